"""Where a webhook may point: https to a public address. Checked when an endpoint is saved and again before
every attempt (a name that resolved to a public address may later resolve to a private one). An attempt connects
to the very address it checked (`webhook_target`): the name is resolved once, so a DNS answer that changes
between the check and the connection (DNS rebinding) cannot send the request to an internal host.

A host name that is not ASCII (an IDN, `хуки.пример`) is kept as typed in the URL and used in its IDNA (punycode)
form everywhere it goes on the wire: the DNS lookup, the Host header, TLS SNI and the certificate check. The form is
IDNA 2008 with UTS 46 (the `idna` package, as browsers and registries), not Python's "idna" codec (IDNA 2003,
which maps `faß.example` to `fass.example`, someone else's domain).

The lookup has a time limit (SAVE_LOOKUP_S, or NOTIFICATIONS_WEBHOOK_TIMEOUT_S if shorter, when an endpoint is
saved; within the attempt's own deadline before each attempt): getaddrinfo has none, and a user's slow name server
would otherwise hold a web request, or the worker that also runs the fleet's health checks, as long as the resolver
waits. Saving is shorter: it holds one of the few web workers (a slow name answered in 5 s held one 5 s a request;
found by review), and a name that does not answer within it is refused, not saved; the writes are throttled too
(the `webhook_endpoints` rate).

NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK (tests and local demos only) also lets plain http reach 127.0.0.1/::1.
"""
import ipaddress
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit, urlunsplit

import idna
from django.conf import settings

from core.addresses import LookupTooSlow, getaddrinfo_within, is_public
from core.errors import ValidationFailed

URL_MAX_LENGTH = 500
SAVE_LOOKUP_S = 2  # the host name's lookup when an endpoint is saved (inside a web request)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _addresses(host: str, port: int, timeout_s: float) -> list[Address]:
    """The host's addresses ([] when it does not resolve); LookupTooSlow when the answer takes over `timeout_s`."""
    try:
        infos = getaddrinfo_within(host, port, timeout_s)
    except LookupTooSlow:
        raise
    except (UnicodeError, OSError):
        return []
    return [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]


@dataclass(frozen=True)
class WebhookTarget:
    """Where one attempt goes: `connect_url` is the URL with its host replaced by the checked `address`; the
    request carries the name in `host_header`, and TLS uses `hostname` for SNI and the certificate check (both
    ASCII: an IDN in its punycode form)."""

    url: str
    hostname: str
    address: Address
    connect_url: str
    host_header: str


def webhook_url_check(url: str, *, field: str = "url") -> str:
    """The URL as it will be used, or ValidationFailed naming `field` (also when its host name takes longer than
    save_lookup_s() to resolve)."""
    limit = save_lookup_s()
    return _checked(url, field, limit, limit)[0]


def save_lookup_s() -> int:
    """The host name's time to resolve when an endpoint is saved: SAVE_LOOKUP_S, or the attempt's whole time limit
    if that is shorter."""
    return min(SAVE_LOOKUP_S, settings.NOTIFICATIONS_WEBHOOK_TIMEOUT_S)


def webhook_target(url: str, *, timeout_s: float | None = None) -> WebhookTarget:
    """Resolve the URL's host once, within `timeout_s` (an attempt: what is left of its time;
    NOTIFICATIONS_WEBHOOK_TIMEOUT_S by default), and check every address it has (ValidationFailed on `url` as
    webhook_url_check); the attempt connects to the first."""
    if timeout_s is None:
        timeout_s = settings.NOTIFICATIONS_WEBHOOK_TIMEOUT_S
    url, parts, addresses = _checked(url, "url", timeout_s, settings.NOTIFICATIONS_WEBHOOK_TIMEOUT_S)
    address = addresses[0]
    hostname = _ascii_host(str(parts.hostname))  # checked by _checked: it encodes
    connect_url = urlunsplit((parts.scheme, _netloc(str(address), parts.port), parts.path or "/", parts.query, ""))
    return WebhookTarget(url=url, hostname=hostname, address=address, connect_url=connect_url,
                         host_header=_netloc(hostname, parts.port))


def _netloc(host: str, port: int | None) -> str:
    host = f"[{host}]" if ":" in host else host  # an IPv6 address
    return f"{host}:{port}" if port else host


def _ascii_host(hostname: str) -> str:
    """The host as it goes on the wire: an IDN in punycode (http.client refuses a non-ASCII Host header).
    idna.IDNAError for a name IDNA cannot encode (an empty or over-long label, a disallowed character)."""
    # UTS 46 non-transitional (idna's default): ß, ς and the joiners are kept, not mapped to another name.
    return hostname if hostname.isascii() else idna.encode(hostname, uts46=True).decode("ascii")


def _checked(url: str, field: str, timeout_s: float, limit_named: float) -> tuple[str, SplitResult, list[Address]]:
    """`timeout_s`: the lookup's time; `limit_named`: the limit a lookup that took too long is told it missed."""
    url = url.strip()
    if not url:
        raise ValidationFailed("Give the URL that should receive the events.", field=field)
    if len(url) > URL_MAX_LENGTH:
        raise ValidationFailed(f"At most {URL_MAX_LENGTH} characters.", field=field)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValidationFailed("Not a valid URL: check its host and port.", field=field) from None
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise ValidationFailed("Use an https:// URL.", field=field)
    if parts.username or parts.password:
        raise ValidationFailed("Not a webhook URL: put no user name or password in it; check the signature "
                               "instead.", field=field)
    if parts.fragment:
        raise ValidationFailed("Not a webhook URL: it has no #fragment.", field=field)
    try:
        hostname = _ascii_host(parts.hostname)
    except idna.IDNAError:
        raise ValidationFailed(f"Not a valid host name: {parts.hostname}.", field=field) from None
    try:
        addresses = _addresses(hostname, port or (443 if parts.scheme == "https" else 80), timeout_s)
    except LookupTooSlow:
        # At an attempt the limit named is the setting: the lookup had what was left of that much time.
        raise ValidationFailed(f"Could not resolve {parts.hostname} within {limit_named:g} s.",
                               field=field) from None
    if not addresses:
        raise ValidationFailed(f"The host name does not resolve: {parts.hostname}.", field=field)
    loopback_ok = settings.NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK
    for address in addresses:
        if address.is_loopback and loopback_ok:
            continue
        if not is_public(address):  # also an IPv6 form carrying a private IPv4 (NAT64, 6to4): core/addresses.py
            raise ValidationFailed(
                f"Not a public address: {parts.hostname} is a private, loopback or reserved address ({address}); "
                "webhooks go only to public addresses.", field=field)
    if parts.scheme == "http" and not (loopback_ok and all(a.is_loopback for a in addresses)):
        raise ValidationFailed("Use an https:// URL: events are sent only over TLS.", field=field)
    return url, parts, addresses
