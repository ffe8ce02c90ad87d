"""The site's URL conf plus routes that raise each error, so that tests see the error pages a person would
(tests/web/test_every_page.py). Tests only: settings.ROOT_URLCONF points here for the test that needs it."""
from django.core.exceptions import PermissionDenied, SuspiciousOperation
from django.urls import path

from config.urls import handler400, handler403, handler404, handler500  # noqa: F401 (Django reads them here)
from config.urls import urlpatterns as site_patterns


def _bad_request(request):
    raise SuspiciousOperation("tests: a suspicious request")


def _forbidden(request):
    raise PermissionDenied("tests: not allowed")


def _server_error(request):
    raise RuntimeError("tests: a server error")


urlpatterns = [
    path("test-errors/400/", _bad_request),
    path("test-errors/403/", _forbidden),
    path("test-errors/500/", _server_error),
    *site_patterns,
]
