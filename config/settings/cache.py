"""The cache: throttles, log-in lock-outs and per-node SSH caps live there, so every process must share it."""
from urllib.parse import urlsplit, urlunsplit

REDIS_SCHEMES = ("redis", "rediss")
REDIS_DATABASES = 16  # Redis's default `databases`


def cache_url(*, cache_url: str, broker_url: str) -> str:
    """CACHE_URL when set; else, with a Redis broker, the same Redis server's next database (the one before,
    when the broker's is the last, 15), so that the cache never shares the broker's keys; else "" (local memory,
    which only a single-process first run may use)."""
    if cache_url:
        return cache_url
    parts = urlsplit(broker_url)
    if parts.scheme not in REDIS_SCHEMES:
        return ""
    try:
        db = int(parts.path.strip("/") or "0")
    except ValueError:
        return ""
    cache_db = db + 1 if db + 1 < REDIS_DATABASES else db - 1
    return urlunsplit((parts.scheme, parts.netloc, f"/{cache_db}", parts.query, parts.fragment))


def caches(url: str) -> dict:
    if url:
        return {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": url}}
    return {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
