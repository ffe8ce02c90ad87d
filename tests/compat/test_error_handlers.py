"""Django's own error answers (config.views: a 500 from an exception no view caught, and the bare 400/403/404)
under /compat/vast are in the shape docs/vast-cli.md documents and the `vastai` CLI prints,
`{"success": false, "error": CODE, "msg": ...}`; they answered `{"detail": ...}`, as /api/ does (found by review)."""
import json

import pytest
from django.core.exceptions import PermissionDenied
from django.test import RequestFactory
from rest_framework.test import APIClient

from config import views
from marketplace.services import instances as instance_svc
from tests.factories import UserFactory, api_key_for

pytestmark = pytest.mark.django_db


def _client(user=None) -> APIClient:
    client = APIClient(raise_request_exception=False)  # the handler's answer, as a client gets it
    if user is not None:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_for(user)}")
    return client


def test_an_unexpected_exception_under_compat_vast_is_a_500_in_its_shape(monkeypatch):
    def broken(**kwargs):
        raise RuntimeError("tests: a bug")

    monkeypatch.setattr(instance_svc, "instances_for_user", broken)
    r = _client(UserFactory()).get("/compat/vast/api/v1/instances/")
    assert r.status_code == 500 and r["Content-Type"] == "application/json"
    assert r.json() == {"success": False, "error": "server_error", "msg": "Internal server error."}
    assert "tests: a bug" not in r.content.decode()  # the cause is in the log only


def test_a_request_django_refuses_under_compat_vast_is_a_400_in_its_shape():
    r = _client().get("/compat/vast/api/v0/users/current/", HTTP_HOST="not-an-allowed-host.example")
    assert r.status_code == 400 and r["Content-Type"] == "application/json"
    assert r.json() == {"success": False, "error": "bad_request", "msg": "Bad request."}
    r = _client().get("/api/v1/gpu-models/", HTTP_HOST="not-an-allowed-host.example")
    assert r.status_code == 400 and r.json() == {"detail": "Bad request."}  # /api/ keeps its own


@pytest.mark.parametrize(("path", "compat"), [
    ("/compat/vast/api/v0/instances/1/", True), ("/compat/vast", True), ("/compat/vastly/x", False),
    ("/api/v1/instances/", False),
])
def test_every_bare_handler_answers_in_the_shape_of_its_api(path, compat):
    request = RequestFactory().get(path)
    answers = {"not_found": views.not_found(request, Exception()), "server_error": views.server_error(request),
               "bad_request": views.bad_request(request, Exception()),
               "permission_denied": views.permission_denied(request, PermissionDenied())}
    for code, response in answers.items():
        body = json.loads(response.content)
        assert response["Content-Type"] == "application/json", (path, code)
        if compat:
            assert body["success"] is False and body["error"] == code and body["msg"], (path, body)
            assert set(body) == {"success", "error", "msg"}
        else:
            assert set(body) == {"detail"}, (path, body)
    assert [r.status_code for r in answers.values()] == [404, 500, 400, 403]


def test_requests_refused_before_any_view_have_the_compat_shape_too(client, settings):
    """core/request_guard answered {"success": false, "msg": ...} with no `error` code under /compat/."""
    too_long = client.get("/compat/vast/api/v0/instances/?q=" + "a" * settings.REQUEST_URL_MAX_CHARS)
    assert too_long.status_code == 414 and too_long.json()["error"] == "uri_too_long"
    too_big = client.generic("PUT", "/compat/vast/api/v0/instances/1/", "x",
                             CONTENT_LENGTH=str(settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1))
    assert too_big.status_code == 413 and too_big.json()["error"] == "request_too_large"
    nul = client.get("/compat/vast/api/v0/instances/?q=%00")
    assert nul.status_code == 400 and nul.json()["error"] == "bad_request" and nul.json()["success"] is False
