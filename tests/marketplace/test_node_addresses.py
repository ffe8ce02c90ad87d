"""Where a provider may register a node (core/addresses.py: node_address_allowed, node_address_targets). The
platform's workers SSH to the address a provider types: before, 127.0.0.1, 10.x, 169.254.169.254, ::1, a name
resolving to any of them, or an IPv6 form carrying a private IPv4 address (NAT64, 6to4) was registered, and the
workers then connected inside the platform's own network (its errors and timings telling the provider what is
there). Now an address is public or in NODE_ADDRESS_ALLOWED_NETWORKS (the tests' settings allow loopback and
10.0.0.0/8; these tests set it themselves), a name is resolved and every address it has is checked, and anything
else is a 400 on `address` saying why, with nothing written. The same rule at every connection:
tests/provisioning/test_node_address_connect.py."""
import pytest
from django.test import override_settings

from marketplace.models import Gpu, Node
from tests.factories import make_node
from tests.test_settings import production_env, run_python
from tests.web.conftest import logged_in

from .test_api_nodes import URL, valid_payload

pytestmark = pytest.mark.django_db

NONE_ALLOWED = override_settings(NODE_ADDRESS_ALLOWED_NETWORKS=[])

# Every class of address the platform's own network (or this very machine) may answer at, and the word the 400 says.
INTERNAL = [
    ("127.0.0.1", "loopback"), ("127.8.9.10", "loopback"), ("::1", "loopback"),
    ("10.0.0.5", "private"), ("172.16.3.4", "private"), ("192.168.1.1", "private"), ("100.64.0.1", "private"),
    ("fc00::1", "private"), ("fd12:3456::1", "private"),
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),
    ("0.0.0.0", "unspecified"), ("::", "unspecified"),  # noqa: S104 (an address typed, bound by nothing)
    ("224.0.0.1", "multicast"), ("240.0.0.1", "reserved"), ("192.0.2.1", "private"),
    ("::ffff:10.0.0.1", "private"), ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped: the socket reaches the IPv4
    ("64:ff9b::a9fe:a9fe", "carrying the link-local IPv4 address 169.254.169.254"),  # NAT64
    ("2002:a00:1::1", "carrying the private IPv4 address 10.0.0.1"),  # 6to4
    ("64:ff9b:1::a00:1", "reserved address"),  # local-use NAT64 (RFC 8215): where its IPv4 sits is local
]


def counts():
    return Node.objects.count(), Gpu.objects.count()


@NONE_ALLOWED
@pytest.mark.parametrize(("address", "words"), INTERNAL)
def test_an_internal_address_is_refused_naming_the_field_and_why(api, address, words):
    r = api.post(URL, valid_payload(address=address))
    assert r.status_code == 400, r.content
    said = r.json()["address"][0]
    assert said.startswith("Not a public address: ") and words in said and "public addresses" in said, said
    assert counts() == (0, 0)


@NONE_ALLOWED
@pytest.mark.parametrize("address", ["9.9.9.9", "2606:4700:4700::1111", "64:ff9b::909:909"])
def test_a_public_address_is_taken_with_no_network_allowed(api, address):
    r = api.post(URL, valid_payload(address=address))
    assert r.status_code == 201, r.content
    assert Node.objects.get().address == address


@pytest.mark.parametrize(("networks", "address"), [
    (["10.0.0.0/8"], "10.0.0.5"), (["10.8.0.0/16"], "10.8.3.4"), (["127.0.0.0/8"], "127.0.0.1"),
    (["::1/128"], "::1"), (["fd00::/8"], "fd12:3456::1"), (["10.0.0.0/8"], "::ffff:10.0.0.1"),
    (["127.0.0.0/8", "::1/128"], "localhost"),
])
def test_an_address_in_an_allowed_network_is_taken(api, networks, address):
    """An operator whose providers' servers are on a private VPN lists that network (tests and demos: loopback)."""
    with override_settings(NODE_ADDRESS_ALLOWED_NETWORKS=networks):
        r = api.post(URL, valid_payload(address=address))
    assert r.status_code == 201, r.content


@pytest.mark.parametrize(("networks", "address"), [
    (["10.8.0.0/16"], "10.9.0.1"), (["10.8.0.0/16"], "169.254.169.254"), (["::1/128"], "127.0.0.1"),
    (["0.0.0.0/0"], "0.0.0.0"),  # noqa: S104 (never, whatever is allowed: it reaches this very machine)
    (["224.0.0.0/4"], "224.0.0.1"),
])
def test_only_the_networks_listed_are_allowed(api, networks, address):
    with override_settings(NODE_ADDRESS_ALLOWED_NETWORKS=networks):
        r = api.post(URL, valid_payload(address=address))
    assert r.status_code == 400 and "address" in r.json(), r.content
    assert counts() == (0, 0)


@NONE_ALLOWED
def test_a_name_resolving_to_a_private_address_is_refused_naming_what_it_resolves_to(api):
    r = api.post(URL, valid_payload(address="LocalHost"))
    assert r.status_code == 400, r.content
    said = r.json()["address"][0]
    assert said.startswith("Not a public address: localhost resolves to ") and ", which is a loopback address" in said
    assert counts() == (0, 0)


def test_a_name_that_does_not_resolve_is_refused(api):
    r = api.post(URL, valid_payload(address="nowhere.invalid"))  # RFC 2606: never resolves
    assert r.status_code == 400, r.content
    assert r.json()["address"][0].startswith("The host name does not resolve: nowhere.invalid."), r.content
    assert counts() == (0, 0)


@NONE_ALLOWED
def test_the_register_page_says_it_next_to_the_address(user):
    web = logged_in(user)
    form = {"name": "rack1", "address": "169.254.169.254", "ssh_port": "22", "ssh_user": "gpu",
            "host_key_fingerprint": "", "country": "DE", "gpu_model": "rtx-a6000", "gpu_count": "1",
            "price_per_gpu_hour": "0.79", "runtime": "docker"}
    r = web.post("/nodes/new/", form)
    page = r.content.decode()
    assert r.status_code == 400 and 'id="id_address_errors"' in page
    assert "Not a public address: 169.254.169.254 is a link-local address" in page
    assert counts() == (0, 0)


@NONE_ALLOWED
def test_the_service_refuses_it_too(db):
    """node_register is the one way a node is made (the API, the register page, the demo's seed, the benches)."""
    from core.errors import ValidationFailed

    with pytest.raises(ValidationFailed) as refused:
        make_node(address="10.0.0.1")
    assert refused.value.field == "address" and "private address" in refused.value.message
    assert counts() == (0, 0)


def test_the_admin_cannot_change_an_address():
    """Operators see a node's address in the admin; no form there writes it (it would skip the rule)."""
    from django.contrib import admin

    from marketplace.admin.nodes import NodeAdmin

    node_admin = NodeAdmin(Node, admin.site)
    assert "address" in node_admin.get_readonly_fields(None) and not node_admin.has_add_permission(None)


# ------------------------------------------------------------------------------------------------ the setting

def _production(tmp_path, networks):
    return run_python(["-c", "import config.settings.production"],
                      production_env(NODE_ADDRESS_ALLOWED_NETWORKS=networks), tmp_path)


@pytest.mark.parametrize("networks", ["127.0.0.0/8", "10.0.0.0/8,127.0.0.1", "169.254.169.254/32", "0.0.0.0/0",
                                      "::1", "::/0", "fe80::/64", "::ffff:127.0.0.1"])
def test_production_refuses_to_let_nodes_be_on_this_machine_or_link_local(tmp_path, networks):
    result = _production(tmp_path, networks)
    assert result.returncode != 0 and "NODE_ADDRESS_ALLOWED_NETWORKS lists" in result.stderr, result.stderr


def test_production_takes_a_private_network(tmp_path):
    result = _production(tmp_path, "10.8.0.0/16, fd00:8::/64")
    assert result.returncode == 0, result.stderr


def test_a_malformed_network_is_refused_at_start(tmp_path):
    result = _production(tmp_path, "10.8.0.0/33")
    assert result.returncode != 0 and "NODE_ADDRESS_ALLOWED_NETWORKS: '10.8.0.0/33'" in result.stderr


def test_a_name_whose_name_server_is_slow_is_refused_within_the_lookup_limit(api, monkeypatch):
    """getaddrinfo has no time limit of its own: a provider's slow name server held the registration's web request
    as long as the resolver waited. The lookup is bounded (core.addresses.getaddrinfo_within, as webhooks' is)."""
    import socket
    import threading

    from core import addresses

    released = threading.Event()
    real = socket.getaddrinfo

    def slow(host, *args, **kwargs):
        if host == "slow.example.net":
            released.wait(5)
        return real("127.0.0.1", *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    monkeypatch.setattr(addresses, "NODE_LOOKUP_TIMEOUT_S", 0.5)
    try:
        r = api.post(URL, valid_payload(address="slow.example.net"))
    finally:
        released.set()
    assert r.status_code == 400, r.content
    assert r.json()["address"][0].startswith("The host name did not resolve within 0.5 s: slow.example.net."), r.content
    assert counts() == (0, 0)


def test_an_ip_address_is_answered_while_slow_names_hold_every_lookup(monkeypatch):
    """Every connection to a node went through the bounded lookup, a node registered by IP too: with its slots all
    held by slow names (a provider's name server, a webhook's), the connection failed with "could not resolve
    203.0.113.7" and the node's health check with it. An IP address is no lookup: answered at once."""
    import socket
    import threading

    from core import addresses

    released = threading.Event()
    real = socket.getaddrinfo

    def slow(host, *args, **kwargs):
        if host.endswith(".example.net") and not kwargs.get("flags", 0) & socket.AI_NUMERICHOST:
            released.wait(5)  # a name server that does not answer
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    holders = [threading.Thread(target=lambda: addresses.getaddrinfo_within("slow.example.net", 22, 5), daemon=True)
               for _ in range(addresses.LOOKUPS_AT_ONCE)]
    try:
        for holder in holders:
            holder.start()
        for _ in range(500):  # every slot taken by a slow name
            if not addresses._lookups._value:
                break
            threading.Event().wait(0.01)
        with pytest.raises(addresses.LookupTooSlow):
            addresses.getaddrinfo_within("another.example.net", 22, 0.2)
        found = addresses.getaddrinfo_within("203.0.113.7", 22, 0.2)
        assert {sockaddr[0] for *_, sockaddr in found} == {"203.0.113.7"}
    finally:
        released.set()
        for holder in holders:
            holder.join(5)
