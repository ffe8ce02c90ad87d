"""Production: the same settings, but refuse to start with the development defaults, and HTTPS only."""
import ipaddress
import re
from urllib.parse import urlsplit

from django.core.exceptions import ImproperlyConfigured

from .base import *  # noqa: F403
from .base import (
    ALLOWED_HOSTS,
    CACHES,
    DATABASES,
    DEBUG,
    DEFAULT_FIELD_ENCRYPTION_KEY,
    DEFAULT_SECRET_KEY,
    FIELD_ENCRYPTION_KEYS,
    LOGGING,
    NODE_ADDRESS_ALLOWED_NETWORKS,
    NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK,
    SECRET_KEY,
    SITE_URL,
    log_format,
)
from .env import env_bool, env_int, env_str

# Never where providers' nodes may be: this machine (loopback; 0.0.0.0 and :: reach it too) and link-local
# addresses (169.254.169.254 is a cloud's metadata service), also as IPv4-mapped IPv6 addresses.
_NEVER_NODE_NETWORKS = tuple(ipaddress.ip_network(n) for n in (
    "127.0.0.0/8", "0.0.0.0/8", "169.254.0.0/16", "::1/128", "::/128", "fe80::/10",
    "::ffff:127.0.0.0/104", "::ffff:0.0.0.0/104", "::ffff:169.254.0.0/112"))


def unsafe_node_networks(values: list[str]) -> list[str]:
    """The entries of NODE_ADDRESS_ALLOWED_NETWORKS that overlap _NEVER_NODE_NETWORKS."""
    unsafe = []
    for value in values:
        network = ipaddress.ip_network(value, strict=False)
        if any(network.version == never.version and network.overlaps(never) for never in _NEVER_NODE_NETWORKS):
            unsafe.append(value)
    return unsafe


def site_url(raw: str, hosts: list[str]) -> str:
    """SITE_URL as set, which must be an absolute https:// address ending in / (the one-click unsubscribe links are
    made by joining paths to it); when not set, https://<the first of ALLOWED_HOSTS>/ where that is one name (this
    site is HTTPS only), so that notification e-mails carry the List-Unsubscribe header without another setting.
    Empty only when ALLOWED_HOSTS names no single host."""
    raw = raw.strip()
    if raw:
        parts = urlsplit(raw)
        if (parts.scheme != "https" or not parts.hostname or not parts.path.endswith("/") or parts.query
                or parts.fragment):
            raise ImproperlyConfigured(f"SITE_URL must be this site's https:// address ending in /, such as "
                                       f"https://gpus.example.com/, not {raw!r}")
        return raw
    first = next(iter(hosts), "")
    if not first or first == "*" or first.startswith("."):
        return ""
    return f"https://{first}/"


def check_production_settings() -> None:
    """Raise ImproperlyConfigured naming every unsafe default still in force."""
    problems = []
    if DEBUG:
        problems.append("DEBUG is on; set DEBUG=false")
    if SECRET_KEY == DEFAULT_SECRET_KEY or len(SECRET_KEY) < 32:
        problems.append("SECRET_KEY is the development default or shorter than 32 characters")
    if DEFAULT_FIELD_ENCRYPTION_KEY in FIELD_ENCRYPTION_KEYS:
        problems.append("FIELD_ENCRYPTION_KEYS contains the development default key")
    if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
        problems.append("DATABASE_URL is not set (SQLite is for a first run only)")
    if CACHES["default"]["BACKEND"].endswith("LocMemCache"):
        problems.append("the cache is local memory (throttles and log-in lock-outs would count per process): "
                        "set CACHE_URL, or a Redis CELERY_BROKER_URL")
    if NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK:
        problems.append("NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK is on: users' webhooks could reach this machine")
    unsafe = unsafe_node_networks(NODE_ADDRESS_ALLOWED_NETWORKS)
    if unsafe:
        problems.append(f"NODE_ADDRESS_ALLOWED_NETWORKS lists {', '.join(unsafe)}, which holds loopback, link-local or "
                        "unspecified addresses (this machine, a cloud's metadata service): providers could make the "
                        "platform's workers connect there; list only the private networks providers' servers are on")
    if any(host == "*" or host.startswith(".") and host.count(".") < 2 for host in ALLOWED_HOSTS):
        # The e-mailed sign-up, reset and verification links are built from the request's Host header.
        problems.append("ALLOWED_HOSTS accepts any host (*): e-mailed links could name an attacker's domain; "
                        "list this site's names")
    if problems:
        raise ImproperlyConfigured("Refusing to start in production: " + "; ".join(problems))


check_production_settings()
SITE_URL = site_url(SITE_URL, ALLOWED_HOSTS)

# One JSON object per log line (core/logging_context.py), unless LOG_FORMAT=plain.
LOG_FORMAT = log_format("json")
LOGGING["handlers"]["console"]["formatter"] = LOG_FORMAT

_HEADER_NAME = re.compile(r"[A-Za-z0-9-]+")


def proxy_ssl_header(raw: str) -> tuple[str, str] | None:
    """SECURE_PROXY_SSL_HEADER from `Header` or `Header=value` (value `https` unless given); None when empty.

    Only a proxy that always sets (or strips) this header may be trusted with it: anyone can send it.
    """
    raw = raw.strip()
    if not raw:
        return None
    name, _, value = raw.partition("=")
    name, value = name.strip(), value.strip() or "https"
    if not _HEADER_NAME.fullmatch(name):
        raise ImproperlyConfigured(f"SECURE_PROXY_SSL_HEADER must be a header name such as X-Forwarded-Proto, "
                                   f"optionally =value, not {raw!r}")
    return "HTTP_" + name.upper().replace("-", "_"), value


# HTTPS only: plain-HTTP requests are redirected (except /healthz, which load balancers probe over HTTP), and
# browsers are told to use HTTPS from the first request on (HSTS).
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
SECURE_REDIRECT_EXEMPT = [r"^healthz$"]
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 365 * 24 * 3600)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", True)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", False)  # an operator's choice: the preload list is sticky
# Behind a TLS-terminating proxy (load balancer, nginx), the request reached the proxy over HTTPS when the proxy
# says so in this header: set it only there (SECURE_PROXY_SSL_HEADER=X-Forwarded-Proto), never where clients
# reach gunicorn directly.
SECURE_PROXY_SSL_HEADER = proxy_ssl_header(env_str("SECURE_PROXY_SSL_HEADER", ""))
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"

# Cookies: over HTTPS only, out of reach of scripts, and not sent with other sites' cross-site POSTs. The pages'
# scripts read the CSRF token from the form, never from the cookie, so the CSRF cookie is HttpOnly too.
SESSION_COOKIE_SECURE = True
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
CSRF_COOKIE_SECURE = True
CSRF_COOKIE_HTTPONLY = True
CSRF_COOKIE_SAMESITE = "Lax"
