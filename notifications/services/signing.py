"""The signature of outgoing webhooks, Stripe-like: `X-GPUMarket-Signature: t=<unix seconds>,v1=<hex>`, where
v1 = HMAC-SHA256(secret, "<t>." + body). A receiver recomputes it over the raw body with its endpoint's secret,
compares in constant time and refuses a timestamp older than a few minutes (a replayed request)."""
import hashlib
import hmac
import time

SIGNATURE_HEADER = "X-GPUMarket-Signature"
DEFAULT_TOLERANCE_S = 300


def signature(*, secret: str, timestamp: int, body: bytes) -> str:
    return hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def signature_header(*, secret: str, body: bytes, timestamp: int | None = None) -> str:
    t = int(time.time()) if timestamp is None else timestamp
    return f"t={t},v1={signature(secret=secret, timestamp=t, body=body)}"


def signature_verify(*, secret: str, header: str, body: bytes, tolerance_s: int = DEFAULT_TOLERANCE_S,
                     now: float | None = None) -> bool:
    """True when `header` signs `body` with `secret` and its timestamp is within `tolerance_s` of now."""
    parts: dict[str, list[str]] = {}
    for item in header.split(","):
        name, _, value = item.strip().partition("=")
        parts.setdefault(name, []).append(value)
    try:
        timestamp = int(parts["t"][0])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance_s:
        return False
    expected = signature(secret=secret, timestamp=timestamp, body=body)
    return any(hmac.compare_digest(expected, given) for given in parts.get("v1", []))
