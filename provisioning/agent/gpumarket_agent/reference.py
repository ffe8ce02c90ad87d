"""OCI image references, checked with the grammar of github.com/distribution/reference (the one docker uses).

    reference := name [ ":" tag ] [ "@" digest ]
    name      := [ domain "/" ] remote-name          (at most 255 characters)
    domain    := host [ ":" port ] ; host := domain-name | IPv4 | "[" IPv6 "]"
    remote-name := path-component ( "/" path-component )* ; path-component := [a-z0-9]+ ( separator [a-z0-9]+ )*
    separator := [_.] | "__" | "-"+ ; tag := [A-Za-z0-9_][A-Za-z0-9_.-]{0,127} ; digest := "sha256:" 64 hex
The first component is a domain only when it holds "." or ":" or is "localhost" (or has upper-case letters).
"""
import re

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
