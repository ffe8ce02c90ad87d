"""Whether an IP address is one the platform may send a user's traffic to: public, and not an IPv6 form that
carries a private IPv4 address.

ipaddress's is_global judges an IPv6 address by its own prefix only (Python 3.11): 64:ff9b::a9fe:a9fe, the NAT64
form of 169.254.169.254, and 2002:a00:1::1, the 6to4 form of 10.0.0.1, are "global", yet a NAT64 gateway (an
IPv6-only cloud subnet) or a 6to4 relay delivers them to the IPv4 address inside.
"""
import ipaddress

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

# IPv6 prefixes whose last 32 bits are an IPv4 address: NAT64's well-known prefix (RFC 6052), IPv4-compatible
# (deprecated) and IPv4-translated (SIIT) addresses. IPv4-mapped (::ffff:0:0/96) and 6to4 (2002::/16) are read by
# ipaddress itself (ipv4_mapped, sixtofour).
_LAST_32_BITS = tuple(ipaddress.ip_network(n) for n in ("64:ff9b::/96", "::/96", "::ffff:0:0:0/96"))
# Local-use NAT64 prefixes (RFC 8215) place the IPv4 address where their operator chose: never public here.
_LOCAL_NAT64 = ipaddress.ip_network("64:ff9b:1::/48")


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
    """Globally routable, not multicast, and, for IPv6, neither a local-use NAT64 address nor one carrying an
    IPv4 address that is not public itself."""
    if not address.is_global or address.is_multicast:
        return False
    if address.version == 6 and address in _LOCAL_NAT64:
        return False
    inner = embedded_ipv4(address)
    return inner is None or is_public(inner)
