"""What one attempt may cost and when none is made (found by review): an IDN host is sent in punycode; whatever an
attempt raises is recorded as a failed attempt; a delivery whose attempts are used up is finished, not re-queued
forever; an attempt has one deadline in all, not per socket read; a paused endpoint is sent no real event.

The receivers are real sockets on 127.0.0.1; the DNS answers for the made-up names are scripted (socket.getaddrinfo,
the resolver every lookup here goes through)."""
import socket
import ssl
import threading
import time

import pytest

from notifications.models import DeliveryStatus, Kind, WebhookDelivery, WebhookEndpoint
from notifications.services import webhooks
from notifications.services.notify import notify
from notifications.services.urls import webhook_target
from tests.notifications.test_webhook_pinning import _certificate

pytestmark = pytest.mark.django_db

IDN = "хуки.пример"
PUNYCODE = "xn--h1ad0ah.xn--e1afmkfd"
SHARP_S = "faß.example"  # IDNA 2008 / UTS 46: xn--fa-hia.example; IDNA 2003 maps it to fass.example, another domain
TLS_NAME = "hooks.drip.test"


@pytest.fixture
def dns(monkeypatch):
    """The made-up names (an IDN in either form) resolve to 127.0.0.1; the names looked up are recorded."""
    real, asked = socket.getaddrinfo, []

    def scripted(host, port, *args, **kwargs):
        if host in (IDN, PUNYCODE, SHARP_S, "xn--fa-hia.example", "fass.example", TLS_NAME):
            asked.append(host)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", int(port or 0)))]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", scripted)
    return asked


def test_an_idn_host_is_looked_up_and_sent_in_punycode(owner, receiver, dns, settings):
    settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS = 1
    port = receiver.server.server_address[1]
    url = receiver.url.replace("127.0.0.1", IDN)
    endpoint, _ = webhooks.endpoint_create(user=owner, url=url)
    assert endpoint.url == url  # kept as typed, for the user to read
    target = webhook_target(url)
    assert (target.hostname, target.host_header) == (PUNYCODE, f"{PUNYCODE}:{port}")  # TLS SNI and Host

    attempt = webhooks.webhook_attempt(delivery_id=webhooks.endpoint_test(endpoint=endpoint).pk)
    assert attempt is not None and (attempt.status_code, attempt.error) == (200, "")
    (request,) = receiver.requests
    assert request["headers"]["Host"] == f"{PUNYCODE}:{port}" and set(dns) == {PUNYCODE}


def test_an_idn_with_sharp_s_is_sent_to_its_own_domain_not_the_idna2003_mapping(dns):
    """Python's "idna" codec is IDNA 2003, which maps ß to ss: the signed events went to whoever owns
    fass.example (found by review)."""
    target = webhook_target(f"https://{SHARP_S}/hooks")
    assert (target.hostname, target.host_header) == ("xn--fa-hia.example", "xn--fa-hia.example")
    assert set(dns) == {"xn--fa-hia.example"}


def test_a_host_name_idna_cannot_encode_is_a_400_naming_the_field(owner_api):
    r = owner_api.post("/api/v1/webhook-endpoints/", {"url": f"https://{'я' * 70}.example/hooks"}, format="json")
    assert r.status_code == 400 and "Not a valid host name" in r.json()["url"][0]


def test_whatever_an_attempt_raises_is_recorded_and_the_delivery_ends(owner, receiver, settings, monkeypatch):
    """Before, an exception requests does not wrap (http.client's UnicodeEncodeError for an IDN Host) escaped
    the attempt after it was counted: nothing logged, never finished, re-queued by the resender forever."""
    settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS = 2
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    delivery = webhooks.endpoint_test(endpoint=endpoint)

    def broken(*args, **kwargs):
        raise UnicodeEncodeError("latin-1", "хуки", 0, 4, "ordinal not in range(256)")

    monkeypatch.setattr(webhooks, "_send", broken)
    results = [webhooks.webhook_attempt(delivery_id=delivery.pk) for _ in range(3)]
    assert [r.retry_in_s is not None for r in results[:2]] == [True, False] and results[2] is None
    delivery.refresh_from_db()
    errors = list(delivery.attempt_log.values_list("error", flat=True))
    assert (delivery.status, delivery.attempts, len(errors)) == (DeliveryStatus.FAILED, 2, 2)
    assert all(e.startswith("Not sent: UnicodeEncodeError") for e in errors) and delivery.finished_at
    assert receiver.requests == []


def test_a_delivery_whose_attempts_are_used_up_is_finished_not_sent_again(owner, receiver, settings):
    """Its last attempt was counted but never recorded (the worker was lost mid-attempt): the resender queues it
    again, and the attempt finishes it as failed instead of sending past the limit."""
    settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS = 3
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    delivery = webhooks.endpoint_test(endpoint=endpoint)
    WebhookDelivery.objects.filter(pk=delivery.pk).update(attempts=3, status=DeliveryStatus.RETRYING)
    assert webhooks.webhook_attempt(delivery_id=delivery.pk) is None
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, delivery.last_error) == (
        DeliveryStatus.FAILED, 3, "Given up after 3 attempts.")
    assert delivery.finished_at and receiver.requests == []


class Dripper:
    """An endpoint that answers one byte every `interval_s`: each read is well inside the timeout, the whole
    status line (up to 64 KiB for http.client) would take minutes; it gives up after `seconds` (so that the test
    fails in time where the attempt has no deadline). With `tls` (a server context) it drips over TLS."""

    def __init__(self, interval_s: float, seconds: float, tls: ssl.SSLContext | None = None):
        self.tls = tls
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hooks"
        self.interval_s, self.seconds = interval_s, seconds
        self.stop = threading.Event()
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        conn, _ = self.sock.accept()
        with conn:
            conn.settimeout(1)
            try:
                if self.tls is not None:
                    conn = self.tls.wrap_socket(conn, server_side=True)
                conn.recv(65536)
                until = time.monotonic() + self.seconds
                for byte in b"HTTP/1.1 200 " + b"O" * 10000:
                    if self.stop.wait(self.interval_s) or time.monotonic() > until:
                        break
                    conn.sendall(bytes([byte]))
            except OSError:  # ssl.SSLError too
                pass  # the client hung up: what the test wants

    def close(self):
        self.stop.set()
        self.sock.close()


def test_an_attempt_has_one_deadline_not_one_per_read(owner, settings):
    settings.NOTIFICATIONS_WEBHOOK_TIMEOUT_S = 1
    settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS = 1
    drip = Dripper(interval_s=0.2, seconds=5)
    try:
        endpoint, _ = webhooks.endpoint_create(user=owner, url=drip.url)
        delivery = webhooks.endpoint_test(endpoint=endpoint)
        started = time.monotonic()
        attempt = webhooks.webhook_attempt(delivery_id=delivery.pk)
        took = time.monotonic() - started
    finally:
        drip.close()
    assert took < 2, f"one attempt took {took:.1f} s with a 1 s timeout"
    # A cut-off status line may even parse ("HTTP/1.1 200 OOO"): it is a timeout all the same, not a delivery.
    assert attempt is not None and (attempt.status_code, attempt.error) == (None, "No answer within 1 s.")
    delivery.refresh_from_db()
    assert delivery.status == DeliveryStatus.FAILED and delivery.attempt_log.get().error == "No answer within 1 s."


def test_the_attempt_deadline_also_bounds_an_https_endpoint(owner, dns, settings, tmp_path):
    """The deadline shut the socket urllib3 opened, but TLS detaches it into an SSLSocket (same connection, a new
    object): the shutdown failed (EBADF, ignored) and the read over TLS went on as long as the endpoint dripped
    (found by review)."""
    settings.NOTIFICATIONS_WEBHOOK_TIMEOUT_S = 1
    settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS = 1
    cert_path, key_path = _certificate(tmp_path, TLS_NAME)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_path, key_path)
    settings.NOTIFICATIONS_WEBHOOK_CA_BUNDLE = str(cert_path)
    drip = Dripper(interval_s=0.2, seconds=6, tls=context)
    try:
        url = drip.url.replace("http://127.0.0.1", f"https://{TLS_NAME}")
        endpoint, _ = webhooks.endpoint_create(user=owner, url=url)
        delivery = webhooks.endpoint_test(endpoint=endpoint)
        started = time.monotonic()
        attempt = webhooks.webhook_attempt(delivery_id=delivery.pk)
        took = time.monotonic() - started
    finally:
        drip.close()
    assert took < 2.5, f"one HTTPS attempt took {took:.1f} s with a 1 s deadline"
    assert attempt is not None and (attempt.status_code, attempt.error) == (None, "No answer within 1 s.")


def test_an_answer_in_time_is_delivered_even_if_the_deadline_passes_before_the_attempt_ends(owner, receiver,
                                                                                           settings, monkeypatch):
    """The outcome is whether the answer came in time, not whether the timer fired by the time the worker got
    round to cancelling it (a busy worker, a slow close): a 2xx the endpoint sent in time is delivered, not
    retried as "no answer" (found by review)."""
    settings.NOTIFICATIONS_WEBHOOK_TIMEOUT_S = 1
    settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS = 1
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    send = webhooks._send

    def then_stalled(*args, **kwargs):  # the real send, then the worker held up past the deadline
        answer = send(*args, **kwargs)
        time.sleep(1.3)
        return answer

    monkeypatch.setattr(webhooks, "_send", then_stalled)
    attempt = webhooks.webhook_attempt(delivery_id=webhooks.endpoint_test(endpoint=endpoint).pk)
    assert attempt is not None and (attempt.status_code, attempt.error) == (200, "")
    assert len(receiver.requests) == 1


def test_a_paused_endpoint_is_sent_no_real_event_already_queued_but_test_events(owner, receiver):
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    receiver.answers = [503]
    notification = notify(user=owner, kind=Kind.NODE_OFFLINE, payload={"node": 1, "message": "m"},
                          dedupe_key="paused:1")
    delivery = notification.deliveries.get()
    assert webhooks.webhook_attempt(delivery_id=delivery.pk).retry_in_s  # a 503: Celery's retry is scheduled
    webhooks.endpoint_update(endpoint=endpoint, active=False)  # the user pauses it
    assert webhooks.webhook_attempt(delivery_id=delivery.pk) is None  # the scheduled retry
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, delivery.last_error) == (
        DeliveryStatus.FAILED, 1, "Not sent: the endpoint is paused.")
    assert len(receiver.requests) == 1
    test = webhooks.webhook_attempt(delivery_id=webhooks.endpoint_test(endpoint=endpoint).pk)
    assert test is not None and test.status_code == 200 and len(receiver.requests) == 2


SLOW_NAME = "slow.dns.test"


@pytest.fixture
def slow_dns(monkeypatch):
    """SLOW_NAME resolves to 127.0.0.1 after 4 s: the resolver waiting on a user's slow name server (glibc waits
    5 s per try by default)."""
    real = socket.getaddrinfo

    def slow(host, port, *args, **kwargs):
        if host == SLOW_NAME:
            time.sleep(4)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", int(port or 0)))]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow)


def test_a_slow_dns_answer_is_inside_the_attempts_deadline(owner, receiver, slow_dns, settings):
    """The name was resolved before the attempt's deadline started: an endpoint whose name server answers slowly
    held the worker (shared with the fleet's health checks) as long as the resolver waited (found by review)."""
    settings.NOTIFICATIONS_WEBHOOK_TIMEOUT_S = 1
    settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS = 1
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    # The name's DNS became slow after the endpoint was saved.
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(url=receiver.url.replace("127.0.0.1", SLOW_NAME))
    delivery = webhooks.endpoint_test(endpoint=endpoint)
    started = time.monotonic()
    attempt = webhooks.webhook_attempt(delivery_id=delivery.pk)
    took = time.monotonic() - started
    assert took < 2, f"one attempt took {took:.1f} s with a 1 s deadline"
    assert attempt is not None and attempt.status_code is None
    assert attempt.error == f"Not sent: Could not resolve {SLOW_NAME} within 1 s."
    assert receiver.requests == []


def test_a_slow_dns_answer_at_saving_is_a_400_within_the_time_limit(owner_api, receiver, slow_dns, settings):
    """Saving an endpoint resolves its name inside the web request: a slow name server held a web worker."""
    settings.NOTIFICATIONS_WEBHOOK_TIMEOUT_S = 1
    started = time.monotonic()
    r = owner_api.post("/api/v1/webhook-endpoints/", {"url": receiver.url.replace("127.0.0.1", SLOW_NAME)},
                       format="json")
    took = time.monotonic() - started
    assert r.status_code == 400 and r.json()["url"] == [f"Could not resolve {SLOW_NAME} within 1 s."], r.content
    assert took < 2, f"saving took {took:.1f} s with a 1 s limit"
    created = owner_api.post("/api/v1/webhook-endpoints/", {"url": receiver.url}, format="json")
    assert created.status_code == 201
    r = owner_api.patch(f"/api/v1/webhook-endpoints/{created.json()['id']}/",
                        {"url": receiver.url.replace("127.0.0.1", SLOW_NAME)}, format="json")
    assert r.status_code == 400 and "within 1 s" in r.json()["url"][0]
