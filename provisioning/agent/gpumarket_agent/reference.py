"""OCI image references, checked with the grammar of github.com/distribution/reference (the one docker uses).

    reference := name [ ":" tag ] [ "@" digest ]
    name      := [ domain "/" ] remote-name          (at most 255 characters)
    domain    := host [ ":" port ] ; host := domain-name | IPv4 | "[" IPv6 "]"
    remote-name := path-component ( "/" path-component )* ; path-component := [a-z0-9]+ ( separator [a-z0-9]+ )*
    separator := [_.] | "__" | "-"+ ; tag := [A-Za-z0-9_][A-Za-z0-9_.-]{0,127} ; digest := "sha256:" 64 hex
The first component is a domain only when it holds "." or ":" or is "localhost" (or has upper-case letters).
"""
import ipaddress
import re
import socket
import threading

_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN_NAME = _DOMAIN_COMPONENT + r"(?:\." + _DOMAIN_COMPONENT + r")*"
_IPV6 = r"\[(?:[a-fA-F0-9:]+)\]"
_HOST = r"(?:" + _DOMAIN_NAME + "|" + _IPV6 + ")"
_DOMAIN = _HOST + r"(?::[0-9]+)?"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[_.]|__|-+)[a-z0-9]+)*"
_REMOTE_NAME = _PATH_COMPONENT + r"(?:/" + _PATH_COMPONENT + r")*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"sha256:[a-f0-9]{64}"
REFERENCE_RE = re.compile(
    r"(?P<name>(?:(?P<domain>" + _DOMAIN + r")/)?(?P<remote>" + _REMOTE_NAME + r"))"
    r"(?::(?P<tag>" + _TAG + r"))?(?:@(?P<digest>" + _DIGEST + r"))?", re.ASCII)
NAME_MAX = 255
DOCKER_HUB = "https://index.docker.io/v1/"  # the key docker's config.json uses for Docker Hub
# The names of Docker Hub's own index in a reference: the docker CLI looks their credentials up under DOCKER_HUB, as
# for a reference without a domain (moby's registry.normalizeIndexName makes "index.docker.io" "docker.io").
DOCKER_HUB_NAMES = ("docker.io", "index.docker.io")


def parse_reference(value):
    """{'domain', 'remote', 'tag', 'digest'} of a valid reference, or None. The domain is None for Docker Hub."""
    if not isinstance(value, str) or len(value) > NAME_MAX + 1 + 128 + 1 + 71:
        return None
    match = REFERENCE_RE.fullmatch(value)
    if not match or len(match.group("name")) > NAME_MAX:
        return None
    domain, remote = match.group("domain"), match.group("remote")
    if domain is not None and not ("." in domain or ":" in domain or domain == "localhost" or domain != domain.lower()):
        remote = domain + "/" + remote  # "library/ubuntu": the first part is a path component, not a host
        domain = None
    if domain is None and not re.fullmatch(_REMOTE_NAME, remote):
        return None
    return {"domain": domain, "remote": remote, "tag": match.group("tag"), "digest": match.group("digest")}


def registry_key(value):
    """The config.json `auths` key for a reference: its registry host[:port], or Docker Hub's (no domain, or one of
    Docker Hub's own names: keyed "docker.io", the login of `docker.io/team/app` was never sent; found by review)."""
    parsed = parse_reference(value)
    if not parsed or not parsed["domain"] or parsed["domain"] in DOCKER_HUB_NAMES:
        return DOCKER_HUB
    return parsed["domain"]


def _literal_ip(host):
    """The IP address a host names without DNS, or None: a plain IPv4/IPv6 address, or one of the numeric forms
    the C resolver (inet_aton) also reads as an address (`127.1`, `2130706433`, `0x7f.1`)."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except (OSError, ValueError):
        return None


def _ip_kind(address):
    """What an address is if it is not a public one ('loopback', 'link-local', ...), else None."""
    for kind, test in (("loopback", "is_loopback"), ("link-local", "is_link_local"),
                       ("unspecified", "is_unspecified"), ("private", "is_private"), ("multicast", "is_multicast"),
                       ("reserved", "is_reserved")):
        if getattr(address, test):
            return kind
    return None if address.is_global else "non-public"


def internal_registry(domain, allowed=(), resolve=None):
    """Why a reference's registry host is inside the node's own network, or None. Refused: `localhost` (any case,
    with or without a port, and names under .localhost) and IP literals that are loopback, link-local, private,
    unspecified or otherwise not public, IPv4 carried in IPv6 included. The node's dockerd would connect there
    from inside the provider's network, and its error text is answered to the renter: a port scan of the node and
    its LAN (review r53 #3). `allowed`: registries the provider lists (GPUMARKET_INTERNAL_REGISTRIES), `host` (any
    port) or `host:port`. A name is resolved on the node (`resolve`: host -> addresses) and refused when any of its
    addresses is inside: a public-looking name pointing at 10.0.0.5 was the same probe. A name that does not resolve
    (in RESOLVE_TIMEOUT_S) passes: dockerd's own pull then fails on it. dockerd resolves again when it pulls, so a
    name whose answer changes in between (DNS rebinding) is left to an egress policy for dockerd."""
    if not domain:
        return None
    domain = domain.lower()
    if domain.startswith("["):
        host = domain[1:domain.index("]")]
    else:
        host = domain.partition(":")[0]
    if domain in allowed or host in allowed or ("[%s]" % host) in allowed:
        return None
    if host == "localhost" or host.endswith(".localhost"):
        return "%s is this node itself (localhost)" % host
    address = _literal_ip(host)
    if address is not None:
        kind = _inside_kind(address)
        return None if kind is None else "%s is a %s address, inside the node's network" % (host, kind)
    for address in (resolve or resolve_host)(host):
        kind = _inside_kind(address)
        if kind is not None:
            return "%s resolves to %s, a %s address inside the node's network" % (host, address, kind)
    return None


def _inside_kind(address):
    """_ip_kind of an address or of the IPv4 address it carries (::ffff:127.0.0.1, 6to4)."""
    kinds = [_ip_kind(address)]
    inner = getattr(address, "ipv4_mapped", None) or getattr(address, "sixtofour", None)
    if inner is not None:
        kinds.append(_ip_kind(inner))
    return next((k for k in kinds if k), None)


RESOLVE_TIMEOUT_S = 5.0


def resolve_host(host):
    """The addresses the node's resolver gives a host name, or [] when it gives none within RESOLVE_TIMEOUT_S
    (getaddrinfo has no timeout of its own; the lookup is left to finish in a daemon thread)."""
    found = []

    def lookup():
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except (OSError, UnicodeError):
            return
        for info in infos:
            try:
                found.append(ipaddress.ip_address(info[4][0].partition("%")[0]))
            except ValueError:
                pass

    thread = threading.Thread(target=lookup, daemon=True)
    thread.start()
    thread.join(RESOLVE_TIMEOUT_S)
    return [] if thread.is_alive() else list(found)
