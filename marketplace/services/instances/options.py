"""What a renter may ask of an instance beyond GPUs and keys: their own image, registry login, environment, a start
script, ports to expose, and a minimum CUDA version. One set of rules for the API, the rent page and /compat/vast.

The limits are the node agent's (docs: the issue 12 agent contract), so that nothing the platform accepts is
refused on the node. Each `clean_*` takes what a client sent (already parsed from JSON or a form) and returns the
value the platform stores, or raises ValidationFailed naming the field. None of these values ever reaches a shell:
the agent receives them as JSON and builds argument lists.
"""
from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db.models import QuerySet

from core.addresses import is_public
from core.errors import ValidationFailed
from core.request_guard import has_control_character
from core.validators import CONTROL_CHARACTERS_MESSAGE
from marketplace.models import Image, Runtime

# The distribution/reference grammar (github.com/distribution/reference, regexp.go): an optional registry host
# (domain components, or `localhost`, with an optional port), path components in lower case joined by `.`, `_`,
# `__` or dashes, an optional tag, an optional digest. Here the digest is sha256 only (what registries serve).
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*(?::[0-9]+)?"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"sha256:[a-f0-9]{64}"
REFERENCE_RE = re.compile(
    rf"(?:(?P<domain>{_DOMAIN})/)?(?P<path>{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*)"
    rf"(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?", re.ASCII)
# The same grammar as an ECMA 262 pattern (for the API's schema): a catalogue slug, or a reference.
_ECMA_REFERENCE = (rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
                   rf"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?(?:@{_DIGEST})?")
IMAGE_PATTERN = rf"^(?:[-a-zA-Z0-9_]+|{_ECMA_REFERENCE})$"
NAME_MAX = 255  # the grammar's limit on the name (registry and path), as distribution/reference applies it
REFERENCE_MAX = 512

ENV_NAME_RE = re.compile(r"[A-Z_][A-Z0-9_]{0,127}", re.ASCII)
# Names the node's GPU container runtime reads from a container's environment (NVIDIA_VISIBLE_DEVICES=all would
# give the container every GPU of the node): never the renter's to set. The agent refuses them too.
ENV_RESERVED_PREFIXES = ("NVIDIA_",)
ENV_MAX_NAMES = 64
ENV_MAX_VALUE = 4096
ENV_MAX_TOTAL = 32768  # bytes of NAME=value for every variable together, UTF-8 (the agent's count)
ONSTART_MAX = 16384
PORTS_MAX = 16
USERNAME_MAX = 255
PASSWORD_MAX = 4096
CUDA_VERSION_RE = re.compile(r"(0|[1-9][0-9]?)\.(0|[1-9][0-9]?)", re.ASCII)
LOGS_TAIL_MAX = 5000
LOGS_TAIL_DEFAULT = 200


@dataclass(frozen=True)
class InstanceOptions:
    """A renter's instance options, validated. `registry_auth` is plaintext here and only here (in memory)."""

    env: dict[str, str] = field(default_factory=dict)
    onstart: str = ""
    ports: list[int] = field(default_factory=list)
    min_cuda_version: str = ""
    registry_auth: dict[str, str] | None = field(default=None, repr=False)

    def __repr__(self) -> str:  # never the registry password, even in a traceback's locals
        return (f"InstanceOptions(env={sorted(self.env)}, onstart={len(self.onstart)} chars, ports={self.ports}, "
                f"min_cuda_version={self.min_cuda_version!r}, registry_auth={self.registry_auth is not None})")


def _fail(field_name: str, message: str) -> ValidationFailed:
    return ValidationFailed(message, field=field_name)


def is_image_reference(text: str) -> bool:
    """Whether `text` is meant as an OCI reference rather than a catalogue slug: it has a `/`, `:` or `@`. A bare
    word is a slug, so that a misspelt slug is a 400 and not a pull of some public image of that name."""
    return any(c in text for c in "/:@")


def clean_image_text(value: Any, field_name: str = "image") -> str:
    """What an image is checked for before it is looked up: text of at most REFERENCE_MAX characters, without
    control characters (PostgreSQL refuses NUL in text: a 500)."""
    if not isinstance(value, str) or not value:
        raise _fail(field_name, "Give an image: a catalogue slug (/api/v1/images/) or an image reference such as "
                                "`registry.example.com/team/app:1.0`.")
    if len(value) > REFERENCE_MAX:
        raise _fail(field_name, f"An image reference has at most {REFERENCE_MAX} characters.")
    if has_control_character(value):
        raise _fail(field_name, CONTROL_CHARACTERS_MESSAGE)
    return value


def catalogue_images() -> QuerySet[Image]:
    """The catalogue's images a renter can start: active, and where the platform takes no sim node
    (settings.SIM_NODES_ALLOWED off: offers_search and booking leave them out) one with an image for a real runtime
    (found by review: an image with neither was listed, with `runtimes: ["sim"]`, and taken by a booking)."""
    images = Image.objects.filter(active=True)
    return images if settings.SIM_NODES_ALLOWED else images.exclude(docker_image="", libvirt_image="")


def image_runtimes(image: Image) -> list[str]:
    """The runtimes an image runs on here: Image.runtimes, less `sim` where the platform takes no sim node."""
    return [r for r in image.runtimes if r != Runtime.SIM or settings.SIM_NODES_ALLOWED]


def image_of(value: Any, field_name: str = "image") -> Image | str:
    """A catalogue image (by slug, active, runnable here: catalogue_images) or the renter's own OCI reference;
    ValidationFailed otherwise."""
    value = clean_image_text(value, field_name)
    if not is_image_reference(value):
        image = catalogue_images().filter(slug=value).first()
        if image is None:
            slugs = ", ".join(catalogue_images().order_by("slug").values_list("slug", flat=True))
            raise _fail(field_name, f"No image {value[:60]!r} in the catalogue (its images: {slugs}). An image of "
                                    "your own is a reference with a tag or a path, e.g. `ubuntu:24.04` or "
                                    "`registry.example.com/team/app`.")
        return image
    return clean_own_image_reference(value, field_name)


def _literal_ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address a host names without DNS: a plain IP, or a numeric form the C resolver reads as one (`127.1`,
    `2130706433`, `0x7f.1`: inet_aton, which docker's resolver may use); None for a name."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except (OSError, ValueError):
        return None


def internal_registry_reason(reference: str) -> str | None:
    """Why a reference's registry is inside a node's own network (`localhost`, or an IP literal that is not
    public: loopback, link-local, private, unspecified...), or None. Names are not resolved (no DNS here)."""
    domain = image_registry(reference)  # as docker reads it: `1234/app` is Docker Hub's, not host 1234
    host = domain.partition(":")[0]
    if domain == DOCKER_HUB or domain in settings.RENTER_INTERNAL_REGISTRIES \
            or host in settings.RENTER_INTERNAL_REGISTRIES:
        return None
    if host == "localhost" or host.endswith(".localhost"):
        return f"{host} is the node itself (localhost)"
    address = _literal_ip(host)
    if address is None or is_public(address):
        return None
    kind = next((k for k in ("loopback", "link_local", "unspecified", "private") if getattr(address, f"is_{k}")),
                "non-public")
    return f"{host} is a {kind.replace('_', '-')} address"


def clean_own_image_reference(value: Any, field_name: str = "image") -> str:
    """A renter's own image: a valid reference (clean_image_reference) whose registry is not inside the node's
    network. The node's dockerd would connect there from the provider's network and the renter read the
    registry's error: a probe of the node's loopback and LAN (review r53 #3). Catalogue images (set by staff) are
    not checked; settings.RENTER_INTERNAL_REGISTRIES lists internal registries allowed (tests, demos)."""
    reference = clean_image_reference(value, field_name)
    why = internal_registry_reason(reference)
    if why:
        raise _fail(field_name, f"An image of your own cannot come from a registry inside the node's network: {why}. "
                                "Push it to a public registry (e.g. ghcr.io, docker.io) and name that.")
    return reference


def clean_image_reference(value: Any, field_name: str = "image") -> str:
    """An OCI image reference: `[registry[:port]/]name[:tag][@sha256:<64 hex>]`."""
    if not isinstance(value, str) or not value:
        raise _fail(field_name, "Give an image: a catalogue slug (/api/v1/images/) or an image reference such as "
                                "`registry.example.com/team/app:1.0`.")
    if len(value) > REFERENCE_MAX:
        raise _fail(field_name, f"An image reference has at most {REFERENCE_MAX} characters.")
    match = REFERENCE_RE.fullmatch(value)
    if match is None:
        raise _fail(field_name, f"{value[:100]!r} is not a valid image reference: expected "
                                "[registry[:port]/]name[:tag][@sha256:<64 hex digits>], the name in lower case.")
    name_length = len(match["path"]) + (len(match["domain"]) + 1 if match["domain"] else 0)
    if name_length > NAME_MAX:
        raise _fail(field_name, f"The image's name (registry and path) has at most {NAME_MAX} characters.")
    return value


DOCKER_HUB = "docker.io"
# Docker Hub's other names: in a reference (moby's normalizeIndexName) or as a `docker login` server.
_DOCKER_HUB_NAMES = {"docker.io", "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com"}


def image_registry(reference: str) -> str:
    """The registry host[:port] an image reference is pulled from, in lower case; Docker Hub as "docker.io". As
    distribution/reference reads it, the first component is a registry only when it has a "." or ":" or is
    `localhost` (`library/ubuntu` is Docker Hub's)."""
    match = REFERENCE_RE.fullmatch(reference)
    domain = match["domain"] if match else None
    if domain is None or not ("." in domain or ":" in domain or domain == "localhost" or domain != domain.lower()):
        return DOCKER_HUB
    return registry_name(domain)


def registry_name(server: str) -> str:
    """A registry as `docker login` names it (`https://ghcr.io/v1/`, `GHCR.io`) in image_registry's terms."""
    host = server.strip().lower().removeprefix("https://").removeprefix("http://").split("/", 1)[0]
    return DOCKER_HUB if host in _DOCKER_HUB_NAMES else host


def clean_registry_auth(value: Any, field_name: str = "registry_auth") -> dict[str, str] | None:
    """{"username": ..., "password": ...} for a private registry (a token goes in `password`), or None."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _fail(field_name, "`registry_auth` is an object: {\"username\": ..., \"password\": ...}.")
    unknown = sorted(set(value) - {"username", "password"})
    if unknown:
        raise _fail(field_name, f"`registry_auth` has only `username` and `password`, not {', '.join(unknown)}.")
    out = {}
    for key, limit in (("username", USERNAME_MAX), ("password", PASSWORD_MAX)):
        text = value.get(key)
        if not isinstance(text, str) or not text:
            raise _fail(field_name, f"`registry_auth` needs a non-empty `{key}` (a string).")
        if len(text) > limit:
            raise _fail(field_name, f"`registry_auth.{key}` has at most {limit} characters.")
        if has_control_character(text):
            raise _fail(field_name, f"`registry_auth.{key}` may not hold control characters.")
        if not _is_unicode(text):
            raise _fail(field_name, f"`registry_auth.{key}` is not Unicode text.")
        if key == "username" and ":" in text:  # a registry login goes as user:password: no user name has one
            raise _fail(field_name, "`registry_auth.username` may not hold ':'.")
        out[key] = text
    return out


def _is_unicode(text: str) -> bool:
    """Whether `text` encodes as UTF-8 (an unpaired surrogate does not): the agent refuses anything else."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def clean_env(value: Any, field_name: str = "env") -> dict[str, str]:
    """Environment variables: at most 64 names [A-Z_][A-Z0-9_]{0,127}, none starting with NVIDIA_; values of one
    line (no CR or LF) up to 4096 characters without NUL; 32768 bytes of NAME=value in all."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _fail(field_name, "`env` is an object of NAME: \"value\" pairs.")
    if len(value) > ENV_MAX_NAMES:
        raise _fail(field_name, f"At most {ENV_MAX_NAMES} environment variables; you gave {len(value)}.")
    total = 0
    for name, text in value.items():
        if not isinstance(name, str) or not ENV_NAME_RE.fullmatch(name):
            raise _fail(field_name, f"Not an allowed variable name: {str(name)[:140]!r} (upper-case letters, "
                                    "digits and `_`, not starting with a digit, at most 128 characters).")
        if name.startswith(ENV_RESERVED_PREFIXES):
            raise _fail(field_name, f"{name} is reserved: names starting with {' or '.join(ENV_RESERVED_PREFIXES)} "
                                    "steer the server's GPU container runtime, not your program.")
        if not isinstance(text, str):
            raise _fail(field_name, f"The value of {name} is a string.")
        if len(text) > ENV_MAX_VALUE:
            raise _fail(field_name, f"The value of {name} has at most {ENV_MAX_VALUE} characters.")
        if "\x00" in text:
            raise _fail(field_name, f"The value of {name} may not hold a NUL character.")
        if "\n" in text or "\r" in text:
            raise _fail(field_name, f"The value of {name} is one line (no line breaks): encode a multi-line value, "
                                    "e.g. in base64, and decode it in the instance.")
        if not _is_unicode(text):
            raise _fail(field_name, f"The value of {name} is not Unicode text.")
        total += len(name) + 1 + len(text.encode())  # NAME=value (names are ASCII)
    if total > ENV_MAX_TOTAL:
        raise _fail(field_name, f"The environment has at most {ENV_MAX_TOTAL} bytes in all (NAME=value for each "
                                f"variable, UTF-8); it has {total}.")
    return dict(value)


def clean_onstart(value: Any, field_name: str = "onstart") -> str:
    """A script run once, with /bin/sh, at the instance's first boot (inside it)."""
    if value is None or value == "":
        return ""
    if not isinstance(value, str):
        raise _fail(field_name, "`onstart` is a string: a script run by /bin/sh at the first boot.")
    if len(value) > ONSTART_MAX:
        raise _fail(field_name, f"`onstart` has at most {ONSTART_MAX} characters.")
    if "\x00" in value:
        raise _fail(field_name, "`onstart` may not hold a NUL character.")
    if not _is_unicode(value):
        raise _fail(field_name, "`onstart` is not Unicode text.")
    return value


def clean_ports(value: Any, field_name: str = "ports") -> list[int]:
    """Container TCP ports to expose: at most 16, distinct, 1 to 65535, not 22 (SSH is always mapped)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise _fail(field_name, "`ports` is a list of container TCP port numbers, e.g. [8888].")
    if len(value) > PORTS_MAX:
        raise _fail(field_name, f"At most {PORTS_MAX} ports; you gave {len(value)}.")
    seen: list[int] = []
    for port in value:
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise _fail(field_name, f"{str(port)[:20]!r} is not a port: a whole number from 1 to 65535.")
        if port == 22:
            raise _fail(field_name, "Port 22 is the instance's SSH port, always mapped: leave it out.")
        if port in seen:
            raise _fail(field_name, f"Port {port} is listed twice.")
        seen.append(port)
    return seen


def clean_cuda_version(value: Any, field_name: str = "min_cuda_version") -> str:
    """A CUDA version such as "12.2"."""
    if value is None or value == "":
        return ""
    if not isinstance(value, str) or not CUDA_VERSION_RE.fullmatch(value):
        raise _fail(field_name, f"{str(value)[:20]!r} is not a CUDA version: major.minor, e.g. \"12.2\".")
    return value


def cuda_tuple(text: Any) -> tuple[int, int] | None:
    """(major, minor) of a CUDA version as nvidia-smi prints it ("12.4"), or None when unknown or unreadable."""
    match = re.match(r"\s*(\d{1,3})\.(\d{1,3})", text) if isinstance(text, str) else None
    return (int(match[1]), int(match[2])) if match else None


def clean_logs_tail(value: Any) -> int:
    """`?tail=N`: how many of the last log lines, 1 to 5000 (200 when not given)."""
    if value is None or value == "":
        return LOGS_TAIL_DEFAULT
    if not isinstance(value, str) or not (value.isascii() and value.isdigit()) or len(value) > 5 \
            or not 1 <= int(value) <= LOGS_TAIL_MAX:
        raise _fail("tail", f"`tail` is a whole number from 1 to {LOGS_TAIL_MAX}.")
    return int(value)


def instance_options(*, env: Any = None, onstart: Any = None, ports: Any = None, min_cuda_version: Any = None,
                     registry_auth: Any = None) -> InstanceOptions:
    """Every option checked at once: raises one ValidationFailed naming every field at fault."""
    problems: dict[str, str] = {}
    cleaned: dict[str, Any] = {}
    for name, fn, raw in (("env", clean_env, env), ("onstart", clean_onstart, onstart), ("ports", clean_ports, ports),
                          ("min_cuda_version", clean_cuda_version, min_cuda_version),
                          ("registry_auth", clean_registry_auth, registry_auth)):
        try:
            cleaned[name] = fn(raw)
        except ValidationFailed as exc:
            problems[name] = exc.message
    ValidationFailed.check(problems)
    return InstanceOptions(**cleaned)
