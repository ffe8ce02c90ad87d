"""GET /healthz (is this web process able to serve?) and the error handlers (JSON under /api/, pages elsewhere)."""
import logging

from django.conf import settings
from django.db import connection
from django.http import JsonResponse
from django.views import defaults
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView

from core.api.scopes import PUBLIC

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2  # a health check answers in seconds, whatever the state of Redis


def _check_database() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")


def _ping_redis(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=PROBE_TIMEOUT_S, socket_timeout=PROBE_TIMEOUT_S)
    try:
        client.ping()
    finally:
        client.close()


def _check_cache() -> None:
    from django.core.cache import cache

    location = settings.CACHES["default"].get("LOCATION")
    if "redis" in settings.CACHES["default"]["BACKEND"].lower() and location:
        # The first server of the cache (Django's client has no timeout of its own), pinged with a short one.
        _ping_redis(location[0] if isinstance(location, list | tuple) else location.split(",")[0])
    else:
        cache.get("healthz")


def _check_broker() -> None:
    url = settings.CELERY_BROKER_URL
    if url.startswith(("redis://", "rediss://")):
        _ping_redis(url)
    else:
        from kombu import Connection

        with Connection(url, connect_timeout=PROBE_TIMEOUT_S) as conn:
            conn.ensure_connection(max_retries=1, interval_start=0, timeout=PROBE_TIMEOUT_S)


def _checks() -> dict:
    """What this process needs, by name: the database always; the cache and the broker when configured (the
    first-run defaults, a per-process memory cache and the filesystem broker, need no server)."""
    checks = {"database": _check_database}
    if settings.CACHES["default"]["BACKEND"] != "django.core.cache.backends.locmem.LocMemCache":
        checks["cache"] = _check_cache
    if not settings.CELERY_BROKER_URL.startswith(("filesystem://", "memory://")):
        checks["broker"] = _check_broker
    return checks


def healthz(request):
    """200 {"status": "ok"}, or 503 naming only the components that failed; the reason goes to the log."""
    failed = []
    for name, check in _checks().items():
        try:
            check()
        except Exception as exc:  # any failure means "not ready"
            logger.warning("healthz: %s unavailable: %s: %s", name, type(exc).__name__, exc)
            failed.append(name)
    if failed:
        return JsonResponse({"status": "error", "failed": failed}, status=503)
    return JsonResponse({"status": "ok"})


def _is_api(request) -> bool:
    return request.path_info.startswith(("/api/", "/compat/"))


# The Vast.ai-compatible API (compat/vast, docs/vast-cli.md): its clients (the `vastai` CLI) print `msg`.
COMPAT_VAST_PREFIX = "/compat/vast"


def _api_error(request, status: int, code: str, message: str) -> JsonResponse:
    """The API's error body: `{"detail": ...}` under /api/, the documented `{"success": false, "error": CODE,
    "msg": ...}` under /compat/vast (as compat.vast.errors answers every refusal of its views)."""
    path = request.path_info
    if path == COMPAT_VAST_PREFIX or path.startswith(COMPAT_VAST_PREFIX + "/"):
        return JsonResponse({"success": False, "error": code, "msg": message}, status=status)
    return JsonResponse({"detail": message}, status=status)


def not_found(request, exception=None):
    """404 for URLs no route matches: JSON under /api/ (clients parse it), the site's page elsewhere."""
    if _is_api(request):
        return _api_error(request, 404, "not_found", "Not found.")
    return defaults.page_not_found(request, exception)


def server_error(request):
    """500: under /api/ a JSON body that tells nothing of the cause (it is in the log, with the traceback)."""
    if _is_api(request):
        return _api_error(request, 500, "server_error", "Internal server error.")
    return defaults.server_error(request)


def bad_request(request, exception=None):
    """400 from Django itself (a disallowed Host header, a suspicious request)."""
    if _is_api(request):
        return _api_error(request, 400, "bad_request", "Bad request.")
    return defaults.bad_request(request, exception)


def permission_denied(request, exception=None):
    if _is_api(request):
        return _api_error(request, 403, "permission_denied", "You do not have permission to perform this action.")
    return defaults.permission_denied(request, exception)


class SchemaView(SpectacularAPIView):
    """The OpenAPI schema: public, whatever key comes with the request."""

    api_scope = PUBLIC


class ApiDocsView(SpectacularSwaggerSplitView):
    """The API documentation (Swagger UI). The split view serves its start-up script as a file, so the page keeps no
    inline script (Content-Security-Policy); GET only, since its HTML renderer has nothing to show for OPTIONS."""

    api_scope = PUBLIC
    http_method_names = ["get", "head"]
    template_name = "marketplace/api_docs.html"
