"""The OpenAPI schema: valid, complete, and true to what the API answers.

The schemathesis run generates requests from the schema (valid ones and broken
ones) for every operation and checks each answer: never a 5xx, only documented
status codes and content types, bodies that match the documented schema,
schema-violating input rejected with a 4xx, and a request the schema allows never
refused for a reason the schema could have said (only for the business rules in
BUSINESS_RULES). A second run, with its own seed, puts control characters in the
URL of every operation: a documented 400, never a 5xx.
"""
import copy
import functools
import itertools
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from urllib.parse import quote

import pytest
import schemathesis
import yaml
from django.core.signals import request_finished, request_started
from django.db import close_old_connections, connections
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rest_framework.throttling import ScopedRateThrottle
from schemathesis.config import SchemathesisConfig
from schemathesis.generation import GenerationMode
from schemathesis.generation import case as schemathesis_case
from schemathesis.specs.openapi.checks import positive_data_acceptance

from config.wsgi import application
from core.api.schema import decimal_pattern
from marketplace.models import ApiKey, GpuModel, User, Volume
from marketplace.services.accounts import api_key_create
from tests.factories import UserFactory, make_listed_node, make_node
from tests.schemathesis_lazy import build_when_run

build_when_run()  # each operation's test built by the xdist worker that runs it, not by all five

ROOT = Path(__file__).resolve().parent.parent


def load_yaml(text: str | bytes):
    """yaml.safe_load with libyaml's safe loader where PyYAML has it: the same objects, 5 times as fast on
    docs/openapi.yaml (320 kB)."""
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506 (a safe loader)


# Every operation the API offers. Later issues add theirs here.
ENDPOINTS = {
    ("/api/v1/auth/register/", "post"),
    ("/api/v1/auth/confirm/", "post"),
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
    ("/api/v1/instances/", "post"),
    ("/api/v1/instances/{id}/logs/", "get"),
}


def _spectacular(out: Path, *options: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings.test"}
    return subprocess.run([sys.executable, "manage.py", "spectacular", *options, "--file", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


# The two tests below read one run of the command (6 s of CPU a run, most of it Django's start and the generation),
# on one xdist worker: `make schema`'s command, strict. The file it writes is the same with or without the strict
# options (they only refuse); where they refuse, the published-file test runs the plain command itself.
SPECTACULAR = pytest.mark.xdist_group("spectacular")


@pytest.fixture(scope="module")
def strict_schema_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("spectacular") / "openapi.yaml"
    return _spectacular(out, "--validate", "--fail-on-warn"), out


@SPECTACULAR
def test_schema_is_valid_without_warnings_and_lists_every_endpoint(strict_schema_run):
    result, out = strict_schema_run
    assert result.returncode == 0, result.stderr
    schema = load_yaml(out.read_text())
    operations = {(path, method) for path, item in schema["paths"].items() for method in item}
    assert ENDPOINTS <= operations, f"missing from the schema: {sorted(ENDPOINTS - operations)}"
    assert schema["components"]["securitySchemes"]["ApiKeyAuth"]["scheme"] == "bearer"
    for path, method in ENDPOINTS:
        operation = schema["paths"][path][method]
        assert operation.get("summary") or operation.get("description"), f"{method} {path} is not described"
        assert any(code.startswith("4") for code in operation["responses"]), f"{method} {path}: no 4xx documented"


@SPECTACULAR
def test_the_published_schema_file_is_current(strict_schema_run, tmp_path):
    """docs/openapi.yaml is what readers of the repo see: it must be the schema the code serves."""
    result, out = strict_schema_run
    if result.returncode != 0:  # refused for a warning or as invalid: what does the plain command write?
        out = tmp_path / "openapi.yaml"
        _spectacular(out).check_returncode()
    assert out.read_text() == (ROOT / "docs" / "openapi.yaml").read_text(), "run `make schema` and commit the file"


# --- schemathesis -----------------------------------------------------------------------------------------------

# A URL over REQUEST_URL_MAX_CHARS is refused with a JSON 414 that every operation documents
# (test_every_operation_documents_the_url_errors): for a request the schema forbids, a rejection as a 400 is.
# Schemathesis' own list of rejections, plus 414; generated negative queries can be that long.
NEGATIVE_DATA_REJECTED = ["400", "401", "403", "404", "405", "406", "409", "414", "415", "422", "428", "429", "5xx"]
# The schema the app serves at /api/schema/, read from docs/openapi.yaml: the tests above and
# test_the_served_schema_is_the_published_file check that file is that schema. Asking the app (schemathesis'
# from_wsgi) generated it at import, in each xdist worker.
api_schema = schemathesis.openapi.from_path(ROOT / "docs" / "openapi.yaml", config=SchemathesisConfig.from_dict(
    {"checks": {"negative_data_rejection": {"expected-statuses": NEGATIVE_DATA_REJECTED}}}))
api_schema.app, api_schema.location = application, "/api/schema/"  # as from_wsgi("/api/schema/", application)


def test_the_served_schema_is_the_published_file(anon, published):
    served = anon.get("/api/schema/")
    assert served.status_code == 200
    assert load_yaml(served.content) == published, "run `make schema` and commit the file"


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
    # Every scope the settings name, so that a new one needs no edit here.
    monkeypatch.setattr(ScopedRateThrottle, "THROTTLE_RATES",
                        {scope: "100000/min" for scope in ScopedRateThrottle.THROTTLE_RATES})


@dataclass
class World:
    """A fresh user per operation, and real objects for the generated requests to aim at."""

    user: User
    targets: dict[str, str | int]  # collection URL -> the lookup value of an object in it
    turn: itertools.count = field(default_factory=itertools.count)
    auth_enforced: set[str] = field(default_factory=set)  # ignored_auth's: the operation refused calls without a key
    _key: tuple[str, str, str, tuple] | None = None  # the calls' key: (raw value, database, is-it-active SQL)

    def key(self) -> str:
        """The raw value of an active key of the user's for the next call. A generated DELETE may revoke the key
        of the call before: then it is made anew. (A new key per call cost 2 queries, an e-mail and 7 ms a call,
        3 s of the 36 s of POST /instances/.) Only one such key is active at a time, so the examples stay under
        API_KEYS_PER_USER_MAX, and the user's other keys, such as the DELETE target, are kept.

        The check is `ApiKey.objects.active().filter(pk=...).exists()`, compiled once per key and run as its SQL:
        the ORM built and compiled the same query again before each call (0.6 ms of CPU a call, 376 calls of
        POST /instances/)."""
        if self._key is not None:
            raw, database, sql, params = self._key
            with connections[database].cursor() as cursor:
                cursor.execute(sql, params)
                if cursor.fetchone() is not None:
                    return raw
        made, raw = api_key_create(user=self.user, name="per-call")
        active = ApiKey.objects.active().filter(pk=made.pk)
        self._key = (raw, active.db, *active.query.exists().get_compiler(using=active.db).as_sql())
        return raw

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
def world(db, request, localstripe_server, monkeypatch):
    # Endpoints that reach Stripe reach localstripe, as in the billing tests.
    request.getfixturevalue("settings").STRIPE_API_BASE = localstripe_server.url
    user = UserFactory()
    world = World(user=user, targets={
        "/api/v1/nodes/": make_node(user).pk,
        "/api/v1/offers/": make_listed_node().pk,  # someone else's listed node
        "/api/v1/api-keys/": api_key_create(user=user, name="spare")[0].pk,
        "/api/v1/gpu-models/": GpuModel.objects.order_by("slug").first().slug,
        "/api/v1/volumes/": Volume.objects.create(owner=user, node=make_listed_node(), size_gb=5, state="available",
                                                  price_per_gb_month_micros=100_000).pk,
    })
    # Schemathesis' ignored_auth check sends a 2xx answer's request again without the key and with a wrong one, and
    # its own runner asks that once per operation (CheckContext.auth_enforced_operations: "enforcement is a
    # property of the operation"). `case.call_and_validate` gives the check no such memory, so it asked again after
    # every 2xx: 1,710 of the run's 8,825 requests. The same check on every case, with the runner's memory.
    monkeypatch.setattr(schemathesis_case, "CheckContext",
                        functools.partial(schemathesis_case.CheckContext, auth_enforced_operations=world.auth_enforced))
    return world


# The 400s a request the schema allows may still get: rules no schema can carry (the data, credentials, password
# strength, a signature, a key that parses). Any other 400 of such a request is a gap between the schema and the
# server, and fails the run. (field or "detail", the start of the message)
BUSINESS_RULES = [
    # webhook endpoints: https to a public address that resolves (the world's DNS, not the schema), 10 at most
    ("url", "Use an https:// URL"),
    ("url", "Not a valid URL"),
    ("url", "Not a webhook URL"),
    ("url", "Not a public address"),
    ("url", "The host name does not resolve"),
    # a node's address: where the platform may connect (public, or a network its operator allows), resolved
    ("address", "Not a public address"),
    ("address", "The host name does not resolve"),
    ("url", "At most 10 endpoints"),
    ("detail", "Invalid email or password."),  # credentials
    ("email", "An account with this email already exists."),
    ("password", "This password is "),  # Django's password validators: length, common, numeric
    ("password", "The password is too similar"),
    ("token", "This sign-up token is invalid"),  # a token from an e-mail
    ("detail", "The signature does not verify."),  # the Stripe webhook: an HMAC with the secret
    ("gpu_model", "Select a valid choice."),  # the offers filter: a model of the catalogue (the database)
    ("gpu_model", "Object with slug="),
    ("image", "Object with slug="),
    ("image", "No image "),  # a catalogue slug (the database)
    ("image", "This node runs virtual machines"),  # an image of one's own on a libvirt node (the offer's runtime)
    ("image", "The image's name (registry and path) has at most"),  # the grammar's 255 on the name alone
    ("env", "Not an allowed variable name"),  # OpenAPI 3.0 cannot state the names of an object's properties
    ("env", "The environment has at most"),  # the total size of names and values
    ("registry_auth", "A catalogue image needs no registry login"),
    ("min_cuda_version", "This node's"),  # the offer's driver (the database)
    ("ssh_keys", "Invalid pk "),  # ids of your SSH keys
    ("card", "No such card of yours"),
    ("payment_method", "No such payment method or SetupIntent at the payment provider."),  # ids at Stripe
    ("setup_intent", "No such payment method or SetupIntent at the payment provider."),
    ("auto_top_up_card", "No such card of yours."),
    ("auto_top_up_card", "Auto top-up needs a saved card."),  # enabling auto top-up: the stored settings too
    ("auto_top_up_threshold", "Give a threshold above zero."),
    ("auto_top_up_amount", "Between $"),
    ("offer", "There is no offer "),  # a volume's offer: a node in the database
    ("confirm", "Deleting a volume cannot be undone"),  # a volume's deletion: its name
    ("volumes", "volumes["),  # an instance's volumes: yours, on its node, a normalised mount path
    ("public_key", ""),  # an OpenSSH key must parse (type, base64, key size)
    ("ssh_public_key", ""),
    ("expires_at", "The expiry must be in the future."),  # an API key's expiry: compared with the clock
    # MIG: the catalogue's profiles of the declared model, its GPU count, the placement rule, a price per profile
    # used (marketplace.mig); a node's slices and their free count (the database)
    ("mig_layout", "The "), ("mig_layout", "mig_layout["), ("mig_prices", "Give a price per slice-hour"),
    ("mig_prices", "mig_prices names"), ("mig_profile", "This offer rents no MIG"), ("num_gpus", "This offer has "),
    # the offers filter: nvlink=true with mig_profile (two parameters' values together: OpenAPI 3.0 cannot say it)
    ("nvlink", "nvlink=true and mig_profile cannot go together"),
    ("mig_profile", "nvlink=true and mig_profile cannot go together"),
]


def _business_rule(name: str, message: str) -> bool:
    return any(name == field and message.startswith(start) for field, start in BUSINESS_RULES)


def schema_allowed_requests_are_not_refused_for_schema_reasons(ctx, response, case):
    """A request generated as valid (positive mode) and answered 400 must owe it to a business rule only."""
    if not (case.meta and case.meta.generation.mode.is_positive and response.status_code == 400):
        return None
    try:
        body = response.json()
    except ValueError:
        body = {"detail": response.text}
    schema_level = [
        f"{name}: {message}" for name, messages in body.items()
        for message in (messages if isinstance(messages, list) else [messages])
        if not _business_rule(name, str(message))
    ]
    assert not schema_level, f"the schema allows this request, the server refuses it: {schema_level}"
    return True


@api_schema.parametrize()
@settings(max_examples=20, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_api_answers_as_its_schema_says(case, world, unthrottled, wsgi_keeps_test_transaction):
    world.aim_at_real_object(case)
    # positive_data_acceptance counts every 400 of a valid request; the check below spares business rules.
    case.call_and_validate(headers={"Authorization": f"Bearer {world.key()}"},
                           excluded_checks=[positive_data_acceptance],
                           additional_checks=[schema_allowed_requests_are_not_refused_for_schema_reasons])


# --- odd bytes: control characters in the URL of every operation --------------------------------------------------

def _without_bodies(raw: dict) -> dict:
    """The schema, less its request bodies: the URL is refused before any body is read, so generating bodies
    would only cost time."""
    raw = copy.deepcopy(raw)
    for item in raw["paths"].values():
        for operation in item.values():
            if isinstance(operation, dict):
                operation.pop("requestBody", None)
    return raw


odd_schema = schemathesis.openapi.from_dict(_without_bodies(api_schema.raw_schema))
odd_schema.app = application
odd_schema.config.seed = 20260604  # its own seed, not the main run's
odd_schema.config.phases.examples.enabled = False
odd_schema.config.phases.coverage.enabled = False  # fuzzing only: every example gets its odd bytes
odd_schema.config.generation.modes = [GenerationMode.POSITIVE]  # the rest of the request is valid
CONTROL_CHARACTERS = ["\x00", "\x01", "\t", "\n", "\r", "\x1b", "\x1f", "\x7f", "\x85", "\x9f"]


@odd_schema.parametrize()
@odd_schema.given(data=st.data())
@settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_control_characters_in_any_url_are_a_documented_400(case, data, db, wsgi_keeps_test_transaction):
    """PostgreSQL refuses NUL in text: a lookup, filter or page parameter with one was a 500 (DataError). Each
    generated request gets a control character in a path parameter, a query value or a query parameter's name."""
    places = [("path", name) for name in case.path_parameters or {}]
    places += [("query", name) for name in case.query or {}] + [("name", "q"), ("query", "q")]
    where, name = data.draw(st.sampled_from(places), label="where")
    odd = data.draw(st.sampled_from(CONTROL_CHARACTERS), label="character")
    if where == "path":  # schemathesis keeps path parameters percent-encoded: cut between whole characters
        value = str(case.path_parameters[name])
        cuts = [i for i in range(len(value) + 1) if "%" not in value[max(i - 2, 0):i]]
        cut = data.draw(st.sampled_from(cuts), label="at")
        case.path_parameters[name] = value[:cut] + quote(odd, safe="") + value[cut:]
    else:
        query = dict(case.query or {})
        if where == "name":
            query[f"{name}{odd}"] = "1"
        else:
            values = query.get(name, "x")
            query[name] = [f"{v}{odd}" for v in values or ["x"]] if isinstance(values, list) else f"{values}{odd}"
        case.query = query
    # No credentials: the URL is refused before anything else reads the request.
    response = case.call_and_validate(excluded_checks=[positive_data_acceptance])
    assert response.status_code == 400, (case.path_parameters, case.query, response.status_code, response.text[:300])
    assert response.json() == {"detail": "Control characters (such as NUL) are not allowed in a URL."}


# --- the schema is as strict as the server ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def published():
    return load_yaml((ROOT / "docs" / "openapi.yaml").read_text())


def test_request_bodies_that_refuse_unknown_fields_say_so(published):
    schemas = published["components"]["schemas"]
    for name in ("NodeCreateRequest", "PatchedNodeUpdateRequest", "InstanceCreateRequest", "CardCreateRequest",
                 "TopUpCreateRequest", "RefundCreateRequest", "PatchedProfileRequest", "SshKeyRequest",
                 "ApiKeyRequest"):
        assert schemas[name]["additionalProperties"] is False, name
    assert "additionalProperties" not in schemas["StripeEventRequest"]  # Stripe adds fields; they are kept


def test_the_webhook_signature_header_is_required(published):
    operation = published["paths"]["/api/v1/billing/stripe/webhook/"]["post"]
    (header,) = [p for p in operation["parameters"] if p["name"] == "Stripe-Signature"]
    assert header["in"] == "header" and header["required"] is True
    assert operation["requestBody"]["required"] is True


def test_no_path_parameter_admits_a_sibling_routes_literal_segment(published):
    """A router's lookup takes any segment: /notifications/{id}/ must not admit "unread-count", which is its own
    route (GET /notifications/unread-count/ answers the count, not a notification). Every path parameter's
    pattern against every literal segment of another path at the same place, with the same prefix."""
    paths = [p.strip("/").split("/") for p in published["paths"]]
    checked = 0
    for path, item in published["paths"].items():
        segments = path.strip("/").split("/")
        params = {p["name"]: p["schema"] for op in item.values() for p in op.get("parameters", [])
                  if p["in"] == "path" and "pattern" in p["schema"]}
        for at, segment in enumerate(segments):
            name = segment[1:-1] if segment.startswith("{") else None
            if name not in params:
                continue
            pattern = re.compile(params[name]["pattern"])  # Python's re reads \uXXXX as JSON Schema does
            for other in paths:
                if len(other) > at and other[:at] == segments[:at] and not other[at].startswith("{"):
                    checked += 1
                    assert not pattern.search(other[at]), f"{path} admits {other[at]!r} ({'/'.join(other)})"
    assert checked >= 3  # read-all and unread-count beside notifications/{id}, setup-intent beside cards/{id}


def test_every_operation_documents_the_url_errors(published):
    for path, item in published["paths"].items():
        for method, operation in item.items():
            assert {"400", "414"} <= set(operation["responses"]), f"{method} {path}"


@pytest.mark.parametrize(("minimum", "maximum", "places", "whole"), [
    ("0.001", "100", 6, 6),  # a price per GPU-hour
    ("5", "10000", 2, 7),  # a top-up
    ("0.01", "10000", 2, 7),  # a refund
    ("0", "10000", 2, 7),  # an auto top-up threshold
    ("0.37", "12.3", 2, 3),
])
def test_decimal_patterns_match_exactly_the_numbers_in_bounds(minimum, maximum, places, whole):
    lo, hi = Decimal(minimum), Decimal(maximum)
    pattern = re.compile(decimal_pattern(places=places, whole_digits=whole, minimum=lo, maximum=hi))

    @given(st.integers(0, 10**whole - 1), st.text("0123456789", max_size=places))
    @settings(max_examples=400, deadline=None, database=None)
    def check(integer, fraction):
        text = f"{integer}.{fraction}" if fraction else str(integer)
        assert bool(pattern.fullmatch(text)) == (lo <= Decimal(text) <= hi), text

    check()
    step = Decimal(1).scaleb(-places)
    for text in (minimum, maximum, str(lo + step), str(hi - step)):
        assert pattern.fullmatch(text), text
    for text in ("", ".", "1.", "-1", "1e2", " 1", "01", str(lo - step), str(hi + step)):
        assert not pattern.fullmatch(text), text
