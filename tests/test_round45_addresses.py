"""core.addresses.is_public is the one rule for where webhooks go and where nodes may be (node_address_allowed).
It started from Python 3.11's ipaddress is_global, which is `not is_private` with an incomplete private list: the
IPv6 site-local block fec0::/10 (RFC 3879), every block outside global unicast 2000::/3 (unallocated ones, SRv6's
5f00::/16, the deprecated IPv4-compatible and IPv4-translated forms), the documentation block 3fff::/20, the 6bone's
3ffe::/16, and in IPv4 192.0.0.0/24 (but for 192.0.0.9 and .10) and the deprecated 6to4 relay anycast
192.88.99.0/24 were "public": a webhook could be POSTed there (and the delivery log tell its user what answered)
and a node registered there (the platform's workers SSH to it). Found by review (round 45, finding 2)."""
import ipaddress

import pytest
from django.test import override_settings

from core.addresses import address_kind, is_public, node_address_allowed, node_address_refusal
from marketplace.models import Node
from notifications.models import WebhookEndpoint
from tests.marketplace.test_api_nodes import URL as NODES_URL
from tests.marketplace.test_api_nodes import valid_payload

# Each block the module did not refuse before, with one address of it: all fail on the old code.
NEWLY_REFUSED = [
    ("fec0::1", "site-local (RFC 3879)"),
    ("fec0:1:2::3", "site-local"),
    ("feff:ffff::1", "site-local, its last address block"),
    ("3fff::1", "documentation (RFC 9637)"),
    ("3fff:fff:ffff::1", "documentation, its end"),
    ("3ffe:b00::1", "6bone (RFC 3701, returned)"),
    ("5f00::1", "SRv6 SIDs (RFC 9602)"),
    ("4000::1", "unallocated (outside 2000::/3)"),
    ("e000::1", "unallocated"),
    ("::1:0:0:1", "reserved by the IETF (::/8), no embedded-IPv4 form"),
    ("::8.8.8.8", "IPv4-compatible (deprecated, RFC 4291), even carrying a public IPv4 address"),
    ("::ffff:0:808:808", "IPv4-translated (RFC 2765's SIIT form, gone from RFC 6145)"),
    ("192.0.0.8", "IPv4 dummy address (RFC 7600), in 192.0.0.0/24"),
    ("192.0.0.200", "IETF protocol assignments 192.0.0.0/24"),
    ("192.88.99.1", "6to4 relay anycast (deprecated, RFC 7526)"),
    ("2002:c058:6301::1", "6to4 form of 192.88.99.1"),
    ("64:ff9b::c000:8", "NAT64 form of 192.0.0.8"),
]

# Blocks that were refused already (checked here so that the rule stays whole, whatever Python's version says).
ALREADY_REFUSED = [
    ("2001::1", "Teredo (RFC 4380)"),
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "Teredo, a client's address"),
    ("2001:db8::1", "documentation (RFC 3849)"),
    ("::ffff:10.0.0.1", "IPv4-mapped private"),
    ("::ffff:169.254.169.254", "IPv4-mapped link-local"),
    ("::10.0.0.1", "IPv4-compatible private"),
    ("64:ff9b::a9fe:a9fe", "NAT64 of link-local"),
    ("64:ff9b:1::808:808", "local-use NAT64 (RFC 8215)"),
    ("2002:a00:1::1", "6to4 of private"),
    ("2002:7f00:1::1", "6to4 of loopback"),
    ("fc00::1", "unique local"), ("fe80::1", "link-local"), ("::1", "loopback"), ("::", "unspecified"),
    ("100::1", "discard-only"), ("ff0e::1", "multicast"),
    ("192.0.0.1", "IETF protocol assignments, in Python's list"), ("100.64.0.1", "carrier-grade NAT"),
    ("240.0.0.1", "reserved"),
]

STILL_PUBLIC = [
    "8.8.8.8", "1.1.1.1", "192.0.0.9", "192.0.0.10",  # PCP and TURN anycast: globally reachable (RFC 7723, 8155)
    "2606:4700:4700::1111", "2a00:1450:4001::1", "2003::1", "3fff:1000::1",  # 3fff:1000:: is past 3fff::/20
    "::ffff:8.8.8.8",  # IPv4-mapped: the socket reaches 8.8.8.8
    "64:ff9b::808:808",  # NAT64's well-known prefix: the gateway delivers to 8.8.8.8
    "2002:808:808::1",  # 6to4 of 8.8.8.8
]


@pytest.mark.parametrize(("address", "what"), NEWLY_REFUSED + ALREADY_REFUSED)
def test_an_address_no_one_reaches_from_the_internet_is_not_public(address, what):
    ip = ipaddress.ip_address(address)
    assert not is_public(ip), what
    assert not node_address_allowed(ip, ()), what
    assert address_kind(ip) != "public", what


@pytest.mark.parametrize("address", STILL_PUBLIC)
def test_public_addresses_stay_public(address):
    ip = ipaddress.ip_address(address)
    assert is_public(ip) and node_address_allowed(ip, ()) and address_kind(ip) == "public"


def test_a_site_local_address_is_named_so_to_the_provider():
    ip = ipaddress.ip_address("fec0::1")
    assert address_kind(ip) == "site-local"
    assert node_address_refusal("fec0::1", ip).startswith("fec0::1 is a site-local address, and the platform")


def test_an_ipv4_compatible_address_carrying_a_public_ipv4_is_not_said_to_carry_a_refused_one():
    said = node_address_refusal("::8.8.8.8", ipaddress.ip_address("::8.8.8.8"))
    assert said.startswith("::8.8.8.8 is a reserved address"), said
    said = node_address_refusal("::10.0.0.1", ipaddress.ip_address("::10.0.0.1"))
    assert "carrying the private IPv4 address 10.0.0.1" in said, said


def test_an_allowed_network_still_allows_a_site_local_node_the_operator_chose():
    """NODE_ADDRESS_ALLOWED_NETWORKS (an operator whose providers are on its own network) is unchanged."""
    ip = ipaddress.ip_address("fec0::5")
    assert node_address_allowed(ip, (ipaddress.ip_network("fec0::/10"),))
    assert not node_address_allowed(ip, (ipaddress.ip_network("fd00::/8"),))


@pytest.mark.django_db
@override_settings(NODE_ADDRESS_ALLOWED_NETWORKS=[], NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK=False)
def test_a_webhook_and_a_node_at_a_site_local_address_are_refused_naming_the_field(api):
    r = api.post("/api/v1/webhook-endpoints/", {"url": "https://[fec0::1]:8443/internal/admin"}, format="json")
    assert r.status_code == 400, r.content
    assert r.json()["url"][0].startswith("Not a public address: fec0::1 is a private, loopback or reserved"), r.content
    assert not WebhookEndpoint.objects.exists()

    r = api.post(NODES_URL, valid_payload(address="fec0::1"), format="json")
    assert r.status_code == 400, r.content
    said = r.json()["address"][0]
    assert said.startswith("Not a public address: fec0::1 is a site-local address"), said
    assert not Node.objects.exists()


@pytest.mark.django_db
@override_settings(NODE_ADDRESS_ALLOWED_NETWORKS=["127.0.0.0/8", "::1/128"], NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK=True)
def test_the_tests_loopback_allowances_still_hold(api):
    """The settings that let tests and demos use this machine are untouched by the stricter rule."""
    r = api.post("/api/v1/webhook-endpoints/", {"url": "http://127.0.0.1:9/hook"}, format="json")
    assert r.status_code == 201, r.content
    r = api.post(NODES_URL, valid_payload(address="127.0.0.1"), format="json")
    assert r.status_code == 201, r.content
