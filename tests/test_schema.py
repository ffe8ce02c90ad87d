"""The OpenAPI schema: valid, complete, and true to what the API answers.

The schemathesis run generates requests from the schema (valid ones and broken
ones) for every operation and checks each answer: never a 5xx, only documented
status codes and content types, bodies that match the documented schema, and
schema-violating input rejected with a 4xx.
"""
import itertools
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from hypothesis import HealthCheck, settings
from rest_framework.throttling import ScopedRateThrottle
from schemathesis.specs.openapi.checks import positive_data_acceptance

from config.wsgi import application
from marketplace.models import GpuModel, User
from marketplace.services.accounts import api_key_create
from tests.factories import UserFactory, api_key_for, make_listed_node, make_node

ROOT = Path(__file__).resolve().parent.parent

# Every operation the API offers. Later issues add theirs here.
ENDPOINTS = {
    ("/api/v1/auth/register/", "post"),
    ("/api/v1/auth/login/", "post"),
    ("/api/v1/auth/me/", "get"),
    ("/api/v1/api-keys/", "get"),
    ("/api/v1/api-keys/", "post"),
    ("/api/v1/api-keys/{id}/", "delete"),
    ("/api/v1/gpu-models/", "get"),
    ("/api/v1/gpu-models/{slug}/", "get"),
    ("/api/v1/nodes/", "get"),
    ("/api/v1/nodes/", "post"),
    ("/api/v1/nodes/{id}/", "get"),
    ("/api/v1/nodes/{id}/", "patch"),
    ("/api/v1/nodes/{id}/", "delete"),
    ("/api/v1/nodes/{id}/benchmarks/", "get"),
    ("/api/v1/offers/", "get"),
    ("/api/v1/offers/{id}/", "get"),
}


def test_schema_is_valid_without_warnings_and_lists_every_endpoint(tmp_path):
    out = tmp_path / "openapi.json"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings.test"}
    result = subprocess.run(
        [sys.executable, "manage.py", "spectacular", "--validate", "--fail-on-warn", "--format", "openapi-json",
         "--file", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    schema = json.loads(out.read_text())
    operations = {(path, method) for path, item in schema["paths"].items() for method in item}
    assert ENDPOINTS <= operations, f"missing from the schema: {sorted(ENDPOINTS - operations)}"
    assert schema["components"]["securitySchemes"]["ApiKeyAuth"]["scheme"] == "bearer"
    for path, method in ENDPOINTS:
        operation = schema["paths"][path][method]
        assert operation.get("summary") or operation.get("description"), f"{method} {path} is not described"
        assert any(code.startswith("4") for code in operation["responses"]), f"{method} {path}: no 4xx documented"


def test_the_published_schema_file_is_current(tmp_path):
    """docs/openapi.yaml is what readers of the repo see: it must be the schema the code serves."""
    out = tmp_path / "openapi.yaml"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings.test"}
    subprocess.run([sys.executable, "manage.py", "spectacular", "--file", str(out)], cwd=ROOT, env=env,
                   check=True, capture_output=True, timeout=120)
    assert out.read_text() == (ROOT / "docs" / "openapi.yaml").read_text(), "run `make schema` and commit the file"


# --- schemathesis -----------------------------------------------------------------------------------------------

api_schema = schemathesis.openapi.from_wsgi("/api/schema/", application)


@pytest.fixture
def wsgi_keeps_test_transaction():
    """Schemathesis calls the WSGI app directly, and Django closes the connection after each request.

    That would end the test's transaction; Django's own test client disconnects the same signal handlers.
    """
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def unthrottled(monkeypatch):
    # DRF copies DEFAULT_THROTTLE_RATES into the throttle class at import, so override_settings cannot reach it.
    monkeypatch.setattr(ScopedRateThrottle, "THROTTLE_RATES", {"auth": "100000/min"})


@dataclass
class World:
    """A fresh user per operation, and real objects for the generated requests to aim at."""

    user: User
    targets: dict[str, str | int]  # collection URL -> the lookup value of an object in it
    turn: itertools.count = field(default_factory=itertools.count)

    def aim_at_real_object(self, case) -> None:
        """Every other valid case of a detail route targets an object that exists: random ids only find 404s,
        and the success answers of detail routes must be checked against the schema too."""
        if not case.path_parameters or not case.meta or not case.meta.generation.mode.is_positive:
            return
        collection = case.operation.path.split("{")[0]
        if collection in self.targets and next(self.turn) % 2 == 0:
            name = next(iter(case.path_parameters))
            case.path_parameters[name] = self.targets[collection]


@pytest.fixture
def world(db, request, localstripe_server):
    # Endpoints that reach Stripe reach localstripe, as in the billing tests.
    request.getfixturevalue("settings").STRIPE_API_BASE = localstripe_server.url
    user = UserFactory()
    return World(user=user, targets={
        "/api/v1/nodes/": make_node(user).pk,
        "/api/v1/offers/": make_listed_node().pk,  # someone else's listed node
        "/api/v1/api-keys/": api_key_create(user=user, name="spare")[0].pk,
        "/api/v1/gpu-models/": GpuModel.objects.order_by("slug").first().slug,
    })


@api_schema.parametrize()
@settings(max_examples=20, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_api_answers_as_its_schema_says(case, world, unthrottled, wsgi_keeps_test_transaction):
    world.aim_at_real_object(case)
    # Business rules the schema cannot express (password strength, an address that must be a host,
    # a GPU model from the catalogue, one node per address:port) answer some schema-valid requests
    # with a documented 400, so "valid data is accepted" is not checked.
    key = api_key_for(world.user)  # a key per call: a generated DELETE may revoke the one before
    case.call_and_validate(headers={"Authorization": f"Bearer {key}"}, excluded_checks=[positive_data_acceptance])
