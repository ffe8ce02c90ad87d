"""No API path answers an error as HTML: every URL pattern under /api/ (read from the URLconf, so a new route is
covered the day it is added) is called with every method and bad or odd input, and every 4xx/5xx must be JSON.

An unexpected exception inside a view is a JSON 500 that tells nothing of its cause.
"""
import re

import pytest
from django.test import Client
from django.urls import URLResolver, get_resolver, path, resolve
from rest_framework.views import APIView

from config.urls import urlpatterns as site_urlpatterns
from tests.factories import UserFactory, api_key_for

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD", "TRACE"]
UNKNOWN_ID = "999999999"
# Path values that are no id at all: a word, past bigint, negative, a NUL byte, an encoded slash, very long.
ODD_IDS = ["not-an-id", "9" * 30, "-1", "%00", "..%2F..%2Fetc", "x" * 3000]
OVERSIZED = b'{"name": "' + b"x" * (3 * 1024 * 1024) + b'"}'  # past Django's 2.5 MB upload limit
BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
GROUP = re.compile(r"\(\?P<\w+>(?:[^()\\]|\\.)*\)")


def _walk(patterns, prefix=""):
    for pattern in patterns:
        text = pattern.pattern.regex.pattern.removeprefix("^").removesuffix(r"\Z").removesuffix("$")
        if isinstance(pattern, URLResolver):
            yield from _walk(pattern.url_patterns, prefix + text)
        else:
            yield prefix + text


def api_routes() -> list[str]:
    """Every route under /api/, its parameters as {} (e.g. "/api/v1/nodes/{}/verify/")."""
    routes = []
    for text in _walk(get_resolver().url_patterns):
        if text.startswith("api/"):
            routes.append("/" + re.sub(r"\\(.)", r"\1", GROUP.sub("{}", text)))
    return routes


ROUTES = api_routes()


def _is_json(response) -> bool:
    return response.get("Content-Type", "").split(";")[0].strip() in ("application/json", "application/problem+json")


def _describe(method, url, note, response) -> str:
    return f"{method} {url[:80]} ({note}) -> {response.status_code} {response.get('Content-Type')!r}"


@pytest.fixture
def key(db):
    return api_key_for(UserFactory())


@pytest.fixture(autouse=True)
def _no_real_stripe(settings):
    settings.STRIPE_API_BASE = "http://127.0.0.1:9"  # a closed port: a view that reaches Stripe fails at once
    settings.STRIPE_MAX_NETWORK_RETRIES = 0


def _requests(route: str):
    """(method, url, note, client kwargs) for one route: each method with no auth, malformed or odd bodies,
    an Accept it cannot meet; the parameters an unknown id, and odd values with GET and DELETE."""
    url = route.format(*[UNKNOWN_ID] * route.count("{}"))
    for method in METHODS:
        yield method, url, "no auth, a browser's Accept", {"auth": False, "HTTP_ACCEPT": BROWSER_ACCEPT}
        yield method, url, "malformed JSON", {"data": "{", "content_type": "application/json",
                                              "HTTP_ACCEPT": BROWSER_ACCEPT}
        yield method, url, "a JSON list", {"data": "[]", "content_type": "application/json"}
        yield method, url, "text/plain body", {"data": "name=x", "content_type": "text/plain"}
        yield method, url, "form body", {"data": "name=x", "content_type": "application/x-www-form-urlencoded"}
        yield method, url, "Accept nothing it has", {"data": "{}", "content_type": "application/json",
                                                     "HTTP_ACCEPT": "image/png"}
        if method in ("POST", "PUT", "PATCH"):
            yield method, url, "3 MB body", {"data": OVERSIZED, "content_type": "application/json"}
    if "{}" in route:
        for odd in ODD_IDS:
            odd_url = route.format(*[odd] * route.count("{}"))
            for method in ("GET", "DELETE"):
                yield method, odd_url, f"id {odd[:12]!r}", {"HTTP_ACCEPT": BROWSER_ACCEPT}


def test_the_walk_finds_the_api():
    assert len(ROUTES) >= 30
    for route in ("/api/v1/nodes/{}/verify/", "/api/v1/billing/stripe/webhook/", "/api/schema/", "/api/docs/"):
        assert route in ROUTES
    for route in ROUTES:  # each sample path reaches its own route, not a 404 of the resolver
        resolve(route.format(*[UNKNOWN_ID] * route.count("{}")))


@pytest.mark.django_db
@pytest.mark.parametrize("route", ROUTES)
def test_no_error_answer_is_html(route, key):
    client = Client(raise_request_exception=False)
    wrong, errors = [], 0
    for method, url, note, kwargs in _requests(route):
        kwargs = dict(kwargs)
        if kwargs.pop("auth", True):
            kwargs["HTTP_AUTHORIZATION"] = f"Bearer {key}"
        response = client.generic(method, url, **kwargs)
        if response.status_code >= 400:
            errors += 1
            if not _is_json(response):
                wrong.append(_describe(method, url, note, response))
            elif method != "HEAD":
                response.json()  # the body is JSON too, not only the header
    assert errors, f"no error answer at all from {route}"
    assert not wrong, "HTML (or other non-JSON) error answers:\n" + "\n".join(wrong)


@pytest.mark.django_db
@pytest.mark.parametrize("url", ["/api/", "/api/v2/offers/", "/api/v1/no-such-thing/", "/api/v1/nodes/1/no-such-verb/",
                                 "/api/v1/billing/no-such-thing/", "/api/schema/extra/"])
def test_unknown_api_paths_are_json_404s(url, key):
    client = Client(raise_request_exception=False)
    for method in METHODS:
        for headers in ({"HTTP_ACCEPT": BROWSER_ACCEPT}, {"HTTP_AUTHORIZATION": f"Bearer {key}"}):
            response = client.generic(method, url, **headers)
            assert response.status_code == 404 and _is_json(response), _describe(method, url, "unknown", response)


# ------------------------------------------------------------------------------ unexpected exceptions

SECRET = "password=hunter2 at /srv/app/internal.py line 42"


def _boom(*args, **kwargs):
    raise RuntimeError(SECRET)


def plain_view_boom(request):
    raise RuntimeError(SECRET)


class ApiViewBoom(APIView):
    permission_classes = []

    def get(self, request):
        raise RuntimeError(SECRET)


# A test URLconf: the site's routes plus views that fail (config.urls' error handlers come with the star import).
from config.urls import *  # noqa: E402,F403

urlpatterns = [
    path("api/test-only/plain-boom/", plain_view_boom),
    path("api/test-only/drf-boom/", ApiViewBoom.as_view()),
    path("test-only/boom/", plain_view_boom),
    *site_urlpatterns,
]


def _assert_bare_json_500(response):
    assert response.status_code == 500
    assert _is_json(response), response.get("Content-Type")
    assert response.json() == {"detail": "Internal server error."}
    body = response.content.decode()
    assert "hunter2" not in body and "RuntimeError" not in body and "Traceback" not in body


@pytest.mark.django_db
@pytest.mark.parametrize("accept", ["application/json", BROWSER_ACCEPT])
def test_an_unexpected_exception_in_a_real_view_is_a_bare_json_500(monkeypatch, accept, key):
    monkeypatch.setattr("marketplace.selectors.offers_search", _boom)
    client = Client(raise_request_exception=False)
    _assert_bare_json_500(client.get("/api/v1/offers/", HTTP_ACCEPT=accept))
    _assert_bare_json_500(client.get("/api/v1/offers/", HTTP_ACCEPT=accept, HTTP_AUTHORIZATION=f"Bearer {key}"))


@pytest.mark.urls("tests.test_api_never_html")
@pytest.mark.parametrize("url", ["/api/test-only/plain-boom/", "/api/test-only/drf-boom/"])
def test_an_unexpected_exception_in_any_api_view_is_a_bare_json_500(url):
    client = Client(raise_request_exception=False)
    _assert_bare_json_500(client.get(url, HTTP_ACCEPT=BROWSER_ACCEPT))


@pytest.mark.urls("tests.test_api_never_html")
def test_outside_the_api_a_500_is_still_the_sites_page():
    response = Client(raise_request_exception=False).get("/test-only/boom/")
    assert response.status_code == 500 and response["Content-Type"].startswith("text/html")
    assert "hunter2" not in response.content.decode()


@pytest.mark.django_db
def test_a_disallowed_host_is_a_json_400_under_the_api():
    response = Client().get("/api/v1/offers/", HTTP_HOST="evil.example")
    assert response.status_code == 400 and _is_json(response)
    assert response.json() == {"detail": "Bad request."}
