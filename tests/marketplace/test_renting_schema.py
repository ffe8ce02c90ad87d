"""Every answer of the renting endpoints, success and error, matches the published OpenAPI schema."""
from pathlib import Path

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from werkzeug.test import Client

from config.wsgi import application
from marketplace.models import Instance
from marketplace.services import instances as svc
from tests.factories import api_key_for, make_listed_node

from .renting_helpers import ed25519_key, sent_jobs_fixture  # noqa: F401

pytestmark = pytest.mark.django_db

# The published file, which tests/test_schema.py checks is what /api/schema/ serves: asking the app generated the
# schema at import, in each xdist worker (about a second of CPU each).
api_schema = schemathesis.openapi.from_path(Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml")


@pytest.fixture
def wsgi(user):
    # The WSGI handler closes the connection after each request, which would end the test's transaction.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    client = Client(application)
    headers = {"Authorization": f"Bearer {api_key_for(user)}"}

    def call(method, path, template, expect, json=None, extra=None):
        response = client.open(path, method=method, json=json, headers={**headers, **(extra or {})})
        assert response.status_code == expect, (method, path, response.get_data(as_text=True))
        api_schema[template][method].validate_response(response)
        return response.get_json()

    yield call
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


def test_ssh_key_and_image_answers_match_the_schema(wsgi):
    text = ed25519_key("me@laptop")
    key = wsgi("POST", "/api/v1/ssh-keys/", "/api/v1/ssh-keys/", 201, json={"public_key": text})
    wsgi("POST", "/api/v1/ssh-keys/", "/api/v1/ssh-keys/", 409, json={"public_key": text})
    wsgi("POST", "/api/v1/ssh-keys/", "/api/v1/ssh-keys/", 400, json={"public_key": "ssh-dss AAAA"})
    wsgi("GET", "/api/v1/ssh-keys/", "/api/v1/ssh-keys/", 200)
    wsgi("GET", f"/api/v1/ssh-keys/{key['id']}/", "/api/v1/ssh-keys/{id}/", 200)
    wsgi("DELETE", f"/api/v1/ssh-keys/{key['id']}/", "/api/v1/ssh-keys/{id}/", 204)
    wsgi("DELETE", f"/api/v1/ssh-keys/{key['id']}/", "/api/v1/ssh-keys/{id}/", 404)
    wsgi("GET", "/api/v1/images/", "/api/v1/images/", 200)
    wsgi("GET", "/api/v1/images/cuda-12-4/", "/api/v1/images/{slug}/", 200)


def test_instance_answers_match_the_schema(wsgi):
    node = make_listed_node(gpu_count=2)
    base = "/api/v1/instances/"
    body = {"offer": node.pk, "num_gpus": 1, "image": "cuda-12-4", "ssh_public_key": ed25519_key()}
    idem = {"Idempotency-Key": "k"}
    inst = wsgi("POST", base, base, 201, json=body, extra=idem)
    wsgi("POST", base, base, 200, json=body, extra=idem)
    wsgi("POST", base, base, 422, json={**body, "num_gpus": 2}, extra=idem)
    wsgi("POST", base, base, 409, json={**body, "num_gpus": 2})
    wsgi("POST", base, base, 400, json={**body, "num_gpus": 0})
    wsgi("GET", base, base, 200)
    wsgi("GET", f"{base}?status=running", base, 200)
    one, verb = base + "{id}/", base + "{id}/{verb}/"
    url = f"{base}{inst['id']}/"
    wsgi("POST", url + "stop/", verb.replace("{verb}", "stop"), 409)
    svc.instance_mark_provisioning(instance_id=inst["id"])
    svc.instance_mark_running(instance_id=inst["id"], ssh_host="203.0.113.9", ssh_port=40001, ssh_user="root")
    running = wsgi("GET", url, one, 200)
    assert running["ssh_command"] == "ssh -p 40001 root@203.0.113.9"
    wsgi("POST", url + "restart/", verb.replace("{verb}", "restart"), 202)
    svc.instance_mark_running(instance_id=inst["id"], ssh_host="203.0.113.9", ssh_port=40001, ssh_user="root")
    wsgi("POST", url + "stop/", verb.replace("{verb}", "stop"), 202)
    svc.instance_mark_stopped(instance_id=inst["id"])
    wsgi("POST", url + "start/", verb.replace("{verb}", "start"), 202)
    wsgi("DELETE", url, one, 202)
    svc.instance_mark_destroyed(instance_id=inst["id"])
    wsgi("DELETE", url, one, 409)
    wsgi("GET", f"{base}999999/", one, 404)
    assert Instance.objects.get().status == "destroyed"
