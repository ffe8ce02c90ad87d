"""A delivery connects to the address its check resolved, with the URL's name in the Host header: a name whose DNS
answer changes after the check (DNS rebinding) cannot steer the request elsewhere, and a name that resolves to
loopback is refused when loopback is not allowed.

The DNS answers for the made-up names below are scripted (socket.getaddrinfo, the resolver every lookup here goes
through); every other name resolves as usual, and the receiving server is a real one on 127.0.0.1."""
import socket

import pytest

from notifications.services import webhooks
from notifications.services.urls import webhook_target

pytestmark = pytest.mark.django_db

NAME = "hooks.rebind.test"


class ScriptedDns:
    """Answers for NAME, one list of addresses per lookup (the last answer repeats), and the lookups counted."""

    def __init__(self, real):
        self.real = real
        self.answers: list[list[str]] = []
        self.lookups = 0

    def __call__(self, host, port, *args, **kwargs):
        if host != NAME:
            return self.real(host, port, *args, **kwargs)
        self.lookups += 1
        addresses = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if not addresses:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, int(port or 0))) for a in addresses]


@pytest.fixture
def dns(monkeypatch):
    scripted = ScriptedDns(socket.getaddrinfo)
    monkeypatch.setattr(socket, "getaddrinfo", scripted)
    return scripted


def _url(receiver) -> str:
    return receiver.url.replace("127.0.0.1", NAME)


def test_the_attempt_connects_to_the_checked_address_and_sends_the_name(owner, receiver, dns, settings):
    settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS = 1
    dns.answers = [["127.0.0.1"]]
    endpoint, _ = webhooks.endpoint_create(user=owner, url=_url(receiver))
    # From the attempt's check on, the name answers 127.0.0.1 once and then no longer resolves: a client that
    # looked the name up again (as requests does by itself) could not connect.
    dns.answers, dns.lookups = [["127.0.0.1"], []], 0
    delivery = webhooks.endpoint_test(endpoint=endpoint)
    attempt = webhooks.webhook_attempt(delivery_id=delivery.pk)
    assert attempt is not None and attempt.error == "" and attempt.status_code == 200
    assert dns.lookups == 1
    (request,) = receiver.requests
    port = receiver.server.server_address[1]
    assert request["headers"]["Host"] == f"{NAME}:{port}" and request["path"] == "/hooks/gpumarket"


def test_a_name_that_resolves_to_loopback_is_refused_when_loopback_is_not_allowed(owner, owner_api, receiver, dns,
                                                                                   settings):
    dns.answers = [["127.0.0.1"]]
    endpoint, _ = webhooks.endpoint_create(user=owner, url=_url(receiver).replace("http://", "https://"))
    settings.NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK = False
    settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS = 1
    r = owner_api.post("/api/v1/webhook-endpoints/", {"url": f"https://{NAME}/hooks"}, format="json")
    assert r.status_code == 400 and "Not a public address" in r.json()["url"][0]
    delivery = webhooks.endpoint_test(endpoint=endpoint)
    webhooks.webhook_attempt(delivery_id=delivery.pk)
    delivery.refresh_from_db()
    assert delivery.status == "failed" and "Not sent" in delivery.last_error and receiver.requests == []


def test_one_bad_address_among_the_answers_refuses_the_name(dns, settings):
    settings.NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK = False
    dns.answers = [["93.184.215.14", "10.0.0.7"]]
    with pytest.raises(Exception, match="Not a public address"):
        webhook_target(f"https://{NAME}/hooks")
    dns.answers = [["93.184.215.14", "2.16.0.1"]]
    target = webhook_target(f"https://{NAME}:8443/hooks?x=1")
    assert str(target.address) == "93.184.215.14" and target.hostname == NAME
    assert target.connect_url == "https://93.184.215.14:8443/hooks?x=1" and target.host_header == f"{NAME}:8443"


# ------------------------------------------------------------------------------------------------------ over TLS

def _certificate(tmp_path, name: str):
    """A self-signed certificate for `name` (and its key), written as PEM files."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture
def tls_receiver(receiver, tmp_path):
    """The receiver behind TLS with a certificate for NAME; `sni` records the names clients asked for."""
    import ssl

    cert_path, key_path = _certificate(tmp_path, NAME)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_path, key_path)
    receiver.sni = []
    context.sni_callback = lambda sock, server_name, ctx: receiver.sni.append(server_name)
    receiver.server.socket = context.wrap_socket(receiver.server.socket, server_side=True)
    receiver.cert_path = cert_path
    return receiver


def test_over_tls_the_name_is_the_sni_and_the_certificate_is_checked_against_it(owner, tls_receiver, dns, settings,
                                                                              tmp_path):
    settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS = 1
    dns.answers = [["127.0.0.1"]]
    url = _url(tls_receiver).replace("http://", "https://")
    endpoint, _ = webhooks.endpoint_create(user=owner, url=url)

    settings.NOTIFICATIONS_WEBHOOK_CA_BUNDLE = str(tls_receiver.cert_path)
    attempt = webhooks.webhook_attempt(delivery_id=webhooks.endpoint_test(endpoint=endpoint).pk)
    assert attempt.error == "" and attempt.status_code == 200, attempt
    # The certificate names only NAME, not 127.0.0.1: it was checked against the URL's name, as sent in SNI.
    assert tls_receiver.sni == [NAME] and len(tls_receiver.requests) == 1

    # Verification is on: a certificate that does not chain to the configured CAs fails the attempt.
    settings.NOTIFICATIONS_WEBHOOK_CA_BUNDLE = str(_certificate(tmp_path, "other.test")[0])
    attempt = webhooks.webhook_attempt(delivery_id=webhooks.endpoint_test(endpoint=endpoint).pk)
    assert attempt.status_code is None and "SSLError" in attempt.error and len(tls_receiver.requests) == 1
