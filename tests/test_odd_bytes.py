"""Odd bytes in a request never reach the database: control characters in the URL are a 400 (JSON under /api/,
a page elsewhere), over-long URLs a 414, a session cookie with one is ignored, and a related field of a JSON body
that has one is a 400 naming it. core/request_guard.py; the schemathesis run in tests/test_schema.py sends them to
every operation."""
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import settings
from django.urls import URLPattern, URLResolver, get_resolver

from tests.factories import make_listed_node
from tests.live import _database_url
from tests.localstripe import free_port

ROOT = Path(__file__).resolve().parent.parent
CONTROL = "Control characters (such as NUL) are not allowed in a URL."
# NUL, other C0 characters, DEL and a C1 character (U+0085), percent-encoded as a client sends them.
ODD = ["%00", "%01", "%09", "%0A", "%0D", "%1B", "%1F", "%7F", "%C2%85", "%C2%9F"]

pytestmark = pytest.mark.django_db


def assert_api_400(response):
    assert response.status_code == 400, (response.status_code, response.content[:300])
    assert response["Content-Type"] == "application/json"
    assert response.json() == {"detail": CONTROL}


def assert_page_400(response):
    assert response.status_code == 400, (response.status_code, response.content[:300])
    assert response["Content-Type"].startswith("text/html")
    assert CONTROL in response.content.decode()


# --- the cases of the issue ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/api/v1/gpu-models/%00/", "/api/v1/gpu-models/a%00b/", "/api/v1/images/%00/"])
def test_a_nul_in_an_api_lookup_is_a_json_400(api, anon, path):
    assert_api_400(api.get(path))
    assert_api_400(anon.get(path))


def test_a_nul_in_the_gpu_comparison_page_models_is_a_400_page(client):
    assert_page_400(client.get("/gpus/?models=%00"))
    assert_page_400(client.get("/gpus/?models=rtx-a4000&models=a%00b"))
    assert client.get("/gpus/?models=rtx-a4000").status_code == 200


@pytest.mark.parametrize("odd", ODD)
def test_every_control_character_is_refused_in_path_query_names_and_values(api, client, odd):
    assert_api_400(api.get(f"/api/v1/gpu-models/x{odd}/"))
    assert_api_400(api.get(f"/api/v1/offers/?city=Berlin{odd}"))
    assert_api_400(api.get(f"/api/v1/offers/?{odd}=1"))
    assert_api_400(api.get(f"/api/v1/nodes/1/?page={odd}"))
    assert_api_400(api.post(f"/api/v1/nodes/{odd}/verify/"))
    assert_page_400(client.get(f"/offers/?city={odd}"))
    assert_page_400(client.get(f"/instances/{odd}/"))


def test_printable_text_still_passes(api, client):
    """Unicode letters, spaces and punctuation are no control characters."""
    make_listed_node()
    assert api.get("/api/v1/offers/?city=S%C3%A3o%20Paulo").status_code == 200
    assert api.get("/api/v1/gpu-models/caf%C3%A9/").status_code == 404
    assert client.get("/offers/?city=K%C3%B6ln").status_code == 200


# --- a session cookie with a control character --------------------------------------------------------------


@pytest.mark.parametrize("cookie", ["aaaaaaaa\x00bbbb", "aaaaaaaa\x01bbbb", "12345678\x7f"])
def test_a_session_cookie_with_a_control_character_is_ignored_not_looked_up(anon, client, cookie):
    """Django looks a session key up in the database: with a NUL in it that was a 500 on every API route and
    page that reads the user (found on GET /api/v1/billing/cards/)."""
    anon.cookies[settings.SESSION_COOKIE_NAME] = cookie
    response = anon.get("/api/v1/billing/cards/")
    assert response.status_code == 401 and response.json()["detail"]
    client.cookies[settings.SESSION_COOKIE_NAME] = cookie
    response = client.get("/instances/")
    assert response.status_code == 302 and "/accounts/login/" in response["Location"]


# --- JSON bodies: related fields look their value up --------------------------------------------------------


def test_a_nul_in_a_related_field_of_a_body_is_a_400_naming_it(api):
    node = {"name": "n", "address": "10.1.1.1", "ssh_user": "gpu", "country": "DE", "gpu_model": "l4\x00",
            "gpu_count": 1, "price_per_gpu_hour": "1", "runtime": "sim"}
    response = api.post("/api/v1/nodes/", node, format="json")
    assert response.status_code == 400 and response.json() == {"gpu_model": ["Control characters are not allowed."]}
    offer = make_listed_node()
    instance = {"offer": offer.pk, "num_gpus": 1, "image": "cuda\x0012-4", "ssh_keys": [1]}
    response = api.post("/api/v1/instances/", instance, format="json")
    assert response.status_code == 400 and response.json()["image"] == ["Control characters are not allowed."]


# --- over-long URLs ------------------------------------------------------------------------------------------


def test_an_over_long_url_is_a_414_json_under_the_api_and_a_page_elsewhere(api, client):
    limit = settings.REQUEST_URL_MAX_CHARS
    base = "/api/v1/offers/?city="
    response = api.get(base + "x" * 5000)
    assert response.status_code == 414 and response.json() == {
        "detail": f"The URL is longer than {limit} characters."}
    response = api.get("/api/v1/gpu-models/" + "y" * limit + "/")
    assert response.status_code == 414 and response["Content-Type"] == "application/json"
    # At the limit, the API answers as usual (here: the city filter's max_length).
    at_limit = api.get(base + "x" * (limit - len(base)))
    assert at_limit.status_code == 400 and "city" in at_limit.json()
    page = client.get("/offers/?city=" + "x" * 5000)
    assert page.status_code == 414 and page["Content-Type"].startswith("text/html")


def test_a_body_over_the_upload_limit_is_a_413_before_anything_reads_it(api, client, monkeypatch):
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    body = json.dumps({"name": "x" * limit})  # over the limit by its quotes and key
    read = []
    monkeypatch.setattr("rest_framework.parsers.JSONParser.parse", lambda *a, **k: read.append(1))
    response = api.post("/api/v1/ssh-keys/", body, content_type="application/json")
    assert response.status_code == 413 and response.json() == {
        "detail": f"The request body is larger than {limit} bytes."}
    assert read == []  # refused by its Content-Length, never parsed
    assert client.post("/accounts/login/", body, content_type="application/json").status_code == 413
    # Up to the limit, the API parses and answers as usual (here: the SSH key's own validation).
    monkeypatch.undo()
    small = api.post("/api/v1/ssh-keys/", {"name": "laptop", "public_key": "not a key"}, format="json")
    assert small.status_code == 400 and "public_key" in small.json()


def test_too_many_query_parameters_is_a_json_400(api, client):
    """More than Django's DATA_UPLOAD_MAX_NUMBER_FIELDS (1000) fits within the URL limit: a 400 that says so."""
    response = api.get("/api/v1/offers/?" + "&".join(["a"] * 1500))
    assert response.status_code == 400 and response.json() == {"detail": "More than 1000 query parameters."}
    assert client.get("/offers/?" + "&".join(["a"] * 1500)).status_code == 400


# --- every URL pattern --------------------------------------------------------------------------------------

_GROUP = re.compile(r"\(\?P<\w+>(?:[^()]|\([^()]*\))*\)|<(?:\w+:)?\w+>")


def _patterns(resolvers, prefix=""):
    for entry in resolvers:
        route = prefix + str(entry.pattern).replace("^", "").replace("$", "").replace("\\Z", "")
        if isinstance(entry, URLResolver):
            yield from _patterns(entry.url_patterns, route)
        elif isinstance(entry, URLPattern):
            yield "/" + route


ROUTES = sorted(set(_patterns(get_resolver().url_patterns)))
WITH_LOOKUPS = [route for route in ROUTES if _GROUP.search(route)]


def test_the_sweep_covers_the_api_the_pages_and_the_admin():
    assert len(WITH_LOOKUPS) > 100
    for route in ("/api/v1/gpu-models/", "/api/v1/billing/top-ups/", "/instances/", "/admin/marketplace/node/"):
        assert any(r.startswith(route) for r in WITH_LOOKUPS), route


@pytest.mark.parametrize("value", ["%00", "a%00b", "1%00"])
def test_every_url_pattern_refuses_a_nul_lookup_value(operator_api, client, value):
    """Every route with a lookup (API, pages, admin), anonymous and as an operator, GET and POST: a 400, never a
    500 (the test client raises a view's exception)."""
    client.force_login(operator_api.user)
    for route in WITH_LOOKUPS:
        path = _GROUP.sub(value, route)
        for caller in (operator_api, client):
            for method in ("get", "post"):
                response = getattr(caller, method)(path)
                if path.startswith("/api/"):
                    assert_api_400(response)
                elif path.startswith("/compat/"):  # the `vastai` CLI's API (compat/vast): its error body
                    assert response.status_code == 400 and response.json() == {"success": False, "error": "bad_request",
                                                                           "msg": CONTROL}
                else:
                    assert_page_400(response)


def test_every_url_pattern_refuses_a_nul_query_value(api):
    # /healthz is answered before any other middleware (config/middleware.py) and reads no query parameter.
    for route in [route for route in ROUTES if route != "/healthz"]:
        path = _GROUP.sub("1", route)
        response = api.get(path + "?q=%00")
        assert response.status_code == 400, (path, response.status_code)


# --- through gunicorn, as deployed ---------------------------------------------------------------------------


def test_run_web_raises_gunicorn_request_line_limit_to_its_maximum_above_djangos():
    script = (ROOT / "scripts" / "run-web").read_text()
    assert re.search(r"--limit-request-line 8190\b", script), "gunicorn's maximum (8190) in scripts/run-web"
    # The request line is "GET <url> HTTP/1.1": Django's limit leaves room for it within gunicorn's.
    assert settings.REQUEST_URL_MAX_CHARS + len("DELETE  HTTP/1.1") < 8190


@pytest.fixture(scope="module")
def gunicorn(django_db_setup, django_db_blocker, tmp_path_factory):
    """scripts/run-web (gunicorn, one worker) on a free port, on the test database."""
    port = free_port()
    with django_db_blocker.unblock():
        database_url = _database_url()
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings.test", "DATABASE_URL": database_url,
           "CACHE_URL": settings.CACHE_URL, "CELERY_BROKER_URL": settings.CELERY_BROKER_URL,
           "BIND_ADDRESS": "127.0.0.1", "PORT": str(port), "WEB_CONCURRENCY": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    log = tmp_path_factory.mktemp("gunicorn") / "gunicorn.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "run-web")], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 30
    while b"Booting worker" not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"gunicorn did not start: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    yield port
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(20)


def _get(port: int, target: str) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.putrequest("GET", target, skip_accept_encoding=True)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        conn.close()


@pytest.mark.slow
def test_through_gunicorn_odd_urls_get_the_apps_answers(gunicorn):
    status, kind, body = _get(gunicorn, "/api/v1/offers/?city=" + "x" * 5000)
    assert (status, kind) == (414, "application/json"), body[:300]
    assert json.loads(body)["detail"].startswith("The URL is longer than")
    status, kind, body = _get(gunicorn, "/api/v1/gpu-models/%00/")
    assert (status, kind, json.loads(body)) == (400, "application/json", {"detail": CONTROL})
    status, kind, body = _get(gunicorn, "/gpus/?models=%00")
    assert status == 400 and kind.startswith("text/html") and CONTROL.encode() in body
    # Past gunicorn's own limit its page answers: the one error a client can meet that is not the app's.
    status, _, _ = _get(gunicorn, "/api/v1/offers/?city=" + "x" * 8200)
    assert status == 414
