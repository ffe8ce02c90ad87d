"""Whether an IP address is one the platform may send a user's traffic to: public, and not an IPv6 form that
carries a private IPv4 address.

ipaddress's is_global judges an IPv6 address by its own prefix only (Python 3.11): 64:ff9b::a9fe:a9fe, the NAT64
form of 169.254.169.254, and 2002:a00:1::1, the 6to4 form of 10.0.0.1, are "global", yet a NAT64 gateway (an
IPv6-only cloud subnet) or a 6to4 relay delivers them to the IPv4 address inside.

Nor is Python 3.11's list of what is not global complete: its is_global is `not is_private`, and the private list
lacks site-local fec0::/10 (deprecated by RFC 3879, yet routed by the kernel like any unicast address, and still
used inside some networks), every block outside global unicast 2000::/3 (4000::1, 5f00::/16 segment routing's
SIDs, IPv4-compatible ::8.8.8.8), the documentation block 3fff::/20, the 6bone's 3ffe::/16 (returned), and in
IPv4 most of 192.0.0.0/24 (IETF protocol assignments: 192.0.0.8, the dummy address) and the deprecated 6to4 relay
anycast 192.88.99.0/24. None of them is reached from the internet; any of them may be the platform's own network.
is_public refuses them all, whatever Python's version says.

Also the one rule for where providers' nodes may be (node_address_allowed, node_address_targets; see below).
"""
import functools
import ipaddress
import socket
import threading
import time
from typing import Any

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

# IPv6 prefixes whose last 32 bits are an IPv4 address: NAT64's well-known prefix (RFC 6052), IPv4-compatible
# (deprecated) and IPv4-translated (SIIT) addresses. IPv4-mapped (::ffff:0:0/96) and 6to4 (2002::/16) are read by
# ipaddress itself (ipv4_mapped, sixtofour).
_LAST_32_BITS = tuple(ipaddress.ip_network(n) for n in ("64:ff9b::/96", "::/96", "::ffff:0:0:0/96"))
# Local-use NAT64 prefixes (RFC 8215) place the IPv4 address where their operator chose: never public here.
_LOCAL_NAT64 = ipaddress.ip_network("64:ff9b:1::/48")
# Global unicast (RFC 4291, IANA's IPv6 address space): no other IPv6 address is routed on the internet. Outside
# it only two forms are public, judged by the IPv4 address they carry: IPv4-mapped (the socket reaches that IPv4
# address) and NAT64's well-known prefix (a NAT64 gateway delivers to it). So are refused: site-local fec0::/10
# (RFC 3879), IPv4-compatible ::/96 (deprecated, RFC 4291) and IPv4-translated ::ffff:0:0:0/96 (RFC 2765's, gone
# from RFC 6145) addresses, 5f00::/16 (SRv6 SIDs, RFC 9602) and every unallocated block (4000::/3 ... fe00::/9).
_GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")
_PUBLIC_OUTSIDE_GLOBAL_UNICAST = (ipaddress.ip_network("::ffff:0:0/96"), ipaddress.ip_network("64:ff9b::/96"))
# Inside global unicast, blocks IANA's special-purpose registry says are not globally reachable. Python 3.11 has
# 2001::/23 (Teredo 2001::/32 included), 2001:db8::/32 and the others of that registry but not 3fff::/20; Teredo
# is named here as well so that no newer Python's exceptions to 2001::/23 (3.12.4 and on) could let it through: a
# Teredo relay delivers to the IPv4 address the address carries.
_NOT_GLOBAL_V6 = tuple(ipaddress.ip_network(n) for n in (
    "2001::/32",    # Teredo (RFC 4380)
    "2001:db8::/32",  # documentation (RFC 3849)
    "3ffe::/16",    # the 6bone's test addresses, returned to IANA in 2006 (RFC 3701)
    "3fff::/20",    # documentation (RFC 9637)
))
# IPv4 blocks Python 3.11 calls global that are not: 192.0.0.0/24 but its two anycast services 192.0.0.9 (PCP)
# and 192.0.0.10 (TURN) (RFC 6890; 3.11 has 192.0.0.0/29 and 192.0.0.170/31 only, so 192.0.0.8, the dummy address
# of RFC 7600, was "global"), and the 6to4 relay anycast 192.88.99.0/24 (deprecated, RFC 7526).
_NOT_GLOBAL_V4 = tuple(ipaddress.ip_network(n) for n in ("192.0.0.0/24", "192.88.99.0/24"))
_GLOBAL_V4_EXCEPTIONS = (ipaddress.ip_address("192.0.0.9"), ipaddress.ip_address("192.0.0.10"))


def embedded_ipv4(address: Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (mapped, 6to4, NAT64, compatible, translated), or None."""
    if address.version != 6:
        return None
    assert isinstance(address, ipaddress.IPv6Address)
    inner = address.ipv4_mapped or address.sixtofour
    if inner is None and any(address in net for net in _LAST_32_BITS):
        inner = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return inner


def is_public(address: Address) -> bool:
    """Globally routable (ipaddress's is_global, with the blocks above it misses), not multicast, and, for IPv6,
    global unicast (or an IPv4-mapped or NAT64 address), neither a local-use NAT64 address nor one carrying an IPv4
    address that is not public itself."""
    if not address.is_global or address.is_multicast:
        return False
    if address.version == 4:
        return address in _GLOBAL_V4_EXCEPTIONS or not any(address in net for net in _NOT_GLOBAL_V4)
    if address not in _GLOBAL_UNICAST and not any(address in net for net in _PUBLIC_OUTSIDE_GLOBAL_UNICAST):
        return False
    if address in _LOCAL_NAT64 or any(address in net for net in _NOT_GLOBAL_V6):
        return False
    inner = embedded_ipv4(address)
    return inner is None or is_public(inner)


# ------------------------------------------------------------------------------------ where nodes may be
#
# The platform's workers open SSH connections (and wait for VMs' SSH servers) at addresses providers type. Left
# unchecked, a provider registering 127.0.0.1, 10.0.0.5 or 169.254.169.254 would make them connect to services
# inside the platform's own network and read what is there from the errors and timings. So a node's address is
# public (is_public) or in a network the operator allows (settings.NODE_ADDRESS_ALLOWED_NETWORKS: tests and
# demos, loopback; a platform whose providers' servers are on its private VPN, that network). One rule, checked at
# registration (marketplace.services.nodes) and again at every connection (provisioning.ssh, the VM's SSH wait),
# which connects to the address it checked, never to the name again: a name that resolved to a public address
# may resolve to a private one later (DNS rebinding).

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class AddressNotAllowed(ValueError):
    """A node's address (or one its name resolves to) is outside the rule; the message says which and why."""

    def __init__(self, message: str, address: Address, *, by_name: bool):
        super().__init__(message)
        self.message = message
        self.address = address
        self.by_name = by_name  # the host was a name that resolved to `address`, not the address itself


def address_kind(address: Address) -> str:
    """public, loopback, private, link-local, site-local, multicast, unspecified, reserved, or non-public (an IPv6
    form carrying a private IPv4 address, say); an IPv4-mapped IPv6 address is judged by its IPv4 address."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if is_public(address):
        return "public"
    for kind in ("loopback", "link-local", "site-local", "multicast", "unspecified", "reserved"):
        if getattr(address, "is_" + kind.replace("-", "_"), False):  # site-local: IPv6 only (fec0::/10)
            return kind
    # 100.64.0.0/10 (carrier-grade NAT) is neither global nor "private" for Python 3.11: a private network here.
    if address.is_private or (address.version == 4 and address in _SHARED):
        return "private"
    return "non-public"


_SHARED = ipaddress.ip_network("100.64.0.0/10")


def allowed_node_networks() -> tuple[Network, ...]:
    """settings.NODE_ADDRESS_ALLOWED_NETWORKS, parsed (config/settings/env.py checked each entry at start)."""
    from django.conf import settings

    return _networks(tuple(getattr(settings, "NODE_ADDRESS_ALLOWED_NETWORKS", ()) or ()))


@functools.lru_cache(maxsize=8)
def _networks(values: tuple[str, ...]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(value, strict=False) for value in values)


def node_address_allowed(address: Address, networks: tuple[Network, ...] | None = None) -> bool:
    """Whether the platform may connect to a node at `address`: a public address, or one in `networks` (default:
    the allowed networks of the settings). Never an unspecified address (0.0.0.0 and :: reach this very
    machine) nor a multicast one, whatever is allowed. An IPv4-mapped address (::ffff:10.0.0.1) is the IPv4
    address it maps: the socket reaches that."""
    networks = allowed_node_networks() if networks is None else networks
    inner = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    candidates = (address,) if inner is None else (address, inner)
    if any(a.is_unspecified or a.is_multicast for a in candidates):
        return False
    if is_public(address):
        return True
    return any(a in net for a in candidates for net in networks if a.version == net.version)


def node_address_refusal(host: str, address: Address) -> str:
    """Why the platform does not connect to `host` (which is, or resolves to, `address`), for the provider."""
    kind = address_kind(address)
    inner = embedded_ipv4(address)
    if inner is not None and kind in ("reserved", "non-public") and not is_public(inner):
        # NAT64, 6to4...: the IPv4 address it carries is what a gateway would deliver it to (an IPv4-compatible
        # address carrying a public one is refused as the reserved, deprecated form it is)
        what = f"IPv6 address carrying the {address_kind(inner)} IPv4 address {inner}"
    else:
        what = f"{kind} address" if kind != "non-public" else "address that is not public"
    article = "an" if what[0] in "aeiouI" else "a"
    named = host if _is_literal(host) else f"{host} resolves to {address}, which"
    return (f"{named} is {article} {what}, and the platform connects only to servers at public addresses (or in "
            "networks its operator allows).")


# ------------------------------------------------------------------------------------ a lookup with a time limit
#
# getaddrinfo has none: a slow name server (a user's webhook host, a provider's node name) would hold a web request,
# or the worker that also runs the fleet's health checks, as long as the resolver waits (glibc: 5 s per try and
# name server). Each lookup runs in its own thread, which cannot be stopped and lives as long as the resolver
# waits; past LOOKUPS_AT_ONCE such threads, a lookup waits for a free one within its own time limit, so slow names
# cannot pile up threads without end.
LOOKUPS_AT_ONCE = 16
_lookups = threading.BoundedSemaphore(LOOKUPS_AT_ONCE)
# A node's name at registration (a web request), where no connection's own timeout applies.
NODE_LOOKUP_TIMEOUT_S = 10.0


class LookupTooSlow(TimeoutError):
    """The name's lookup took longer than its time limit (an OSError, as a failed lookup is)."""


def getaddrinfo_within(host: str, port: int | None, timeout_s: float) -> list[tuple[Any, ...]]:
    """socket.getaddrinfo (SOCK_STREAM), or LookupTooSlow after `timeout_s`: the lookup runs in a daemon thread
    that is left to finish on its own when the time is up. An IP address is no lookup: answered at once, with no
    thread and none of the bounded slots (a node registered by IP waited behind slow names, webhooks' included,
    and its health check failed with "could not resolve 203.0.113.7")."""
    try:
        ipaddress.ip_address(str(host).split("%", 1)[0])
    except ValueError:
        pass  # a name: looked up below
    else:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    until = time.monotonic() + max(timeout_s, 0)
    if not _lookups.acquire(timeout=max(timeout_s, 0)):
        raise LookupTooSlow(f"could not resolve {host} within {timeout_s:g} s")
    outcome: list[Any] = []
    done = threading.Event()

    def lookup() -> None:
        try:
            outcome.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except (UnicodeError, OSError) as exc:  # socket.gaierror is an OSError
            outcome.append(exc)
        finally:
            _lookups.release()
            done.set()

    threading.Thread(target=lookup, name="dns-lookup", daemon=True).start()
    if not done.wait(max(until - time.monotonic(), 0)):
        raise LookupTooSlow(f"could not resolve {host} within {timeout_s:g} s")
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return list(outcome[0])


def node_address_targets(host: str, port: int, timeout_s: float | None = None,
                         ) -> list[tuple[socket.AddressFamily, tuple[Any, ...]]]:
    """Resolve `host` (an IP address: itself) and check every address it has against node_address_allowed:
    the (family, sockaddr) pairs to connect to, in the resolver's order, duplicates dropped. AddressNotAllowed
    naming the first address outside the rule (one is enough: which of them a connection would use is the
    resolver's choice); OSError (socket.gaierror) when the name does not resolve, LookupTooSlow (an OSError too)
    when it does not within `timeout_s` (default NODE_LOOKUP_TIMEOUT_S)."""
    timeout_s = NODE_LOOKUP_TIMEOUT_S if timeout_s is None else timeout_s
    networks = allowed_node_networks()
    targets: list[tuple[socket.AddressFamily, tuple[Any, ...]]] = []
    for family, _, _, _, sockaddr in getaddrinfo_within(host, port, timeout_s):
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if not node_address_allowed(address, networks):
            raise AddressNotAllowed(node_address_refusal(host, address), address, by_name=not _is_literal(host))
        if (family, sockaddr) not in targets:
            targets.append((family, sockaddr))
    if not targets:
        raise socket.gaierror(socket.EAI_NONAME, "no IPv4 or IPv6 address")
    return targets


def _is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
