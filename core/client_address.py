"""The client's address: the one rule every throttle and log-in lock-out uses.

A forwarding header is something anyone can send, so it is read only when the request comes from a proxy the
operator trusts (settings.TRUSTED_PROXIES: IPs or CIDRs, none by default). Then `X-Forwarded-For` is read from
the right: each trusted proxy appends the address it received the request from, so the first address from the
right that is not a trusted proxy is the client; whatever the client put in the header itself is further left
and never read. With no trusted proxy, REMOTE_ADDR is the client.
"""
from __future__ import annotations

import ipaddress
from functools import lru_cache

from django.conf import settings
from django.http import HttpRequest
from rest_framework.request import Request

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPV6_THROTTLE_PREFIX = 64  # one IPv6 host usually has a whole /64 to pick addresses from


@lru_cache(maxsize=8)
def _networks(values: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(value, strict=False) for value in values)


def _parse(text: str) -> IPAddress | None:
    """An address as proxies write it ("1.2.3.4", "1.2.3.4:5678", "::1", "[::1]:443"), or None."""
    text = text.strip().strip('"')
    if text.startswith("["):
        text = text[1:].split("]", 1)[0]
    elif text.count(":") == 1:
        text = text.split(":", 1)[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return address.ipv4_mapped
    return address


def _trusted(address: IPAddress, networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]) -> bool:
    return any(address.version == net.version and address in net for net in networks)


def client_ip(request: HttpRequest | Request) -> str:
    """The address of the client that sent `request` (a Django or DRF request); "" when there is none."""
    remote = _parse(request.META.get("REMOTE_ADDR") or "")
    if remote is None:
        return ""
    networks = _networks(tuple(settings.TRUSTED_PROXIES))
    if not networks or not _trusted(remote, networks):
        return str(remote)
    client = remote
    hops = (request.META.get("HTTP_X_FORWARDED_FOR") or "").split(",")
    for hop in reversed(hops):
        address = _parse(hop)
        if address is None:
            break  # not an address: the last trusted hop is as far as the chain can be believed
        client = address
        if not _trusted(address, networks):
            break
    return str(client)


def throttle_ident(address: str) -> str:
    """What throttles count by: the address, or its /64 for IPv6 (so one host cannot rotate through its
    prefix to get a fresh budget)."""
    parsed = _parse(address)
    if isinstance(parsed, ipaddress.IPv6Address):
        return str(ipaddress.ip_network(f"{parsed}/{IPV6_THROTTLE_PREFIX}", strict=False))
    return address

