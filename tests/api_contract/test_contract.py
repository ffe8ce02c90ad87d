"""The API's contract, resource by resource, in the manner of NetBox's APIViewTestCases but as one table
(table.py): for every verb of every path in docs/openapi.yaml, what anonymous callers, another owner, an
operator and the owner get, and that a refused request changes nothing in the database."""
import json
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from django.apps import apps
from django.db import connection

from tests.api_contract import world
from tests.api_contract.table import CALLS, OPERATOR, PUBLIC, STRIPE, USER, Call
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

SCHEMA = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"


def load_yaml(text: str | bytes):
    """yaml.safe_load with libyaml's safe loader where PyYAML has it: the same objects, 5 times as fast on
    docs/openapi.yaml (320 kB)."""
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506 (a safe loader)


VERBS = {"get", "put", "post", "patch", "delete"}
APPS = {"marketplace", "billing", "provisioning"}
# Written by any authenticated request (the key's last use) or log-in: not a change the caller asked for.
VOLATILE = {("marketplace.ApiKey", "last_used_at"), ("marketplace.User", "last_login")}


def operator():
    """Staff with the permission the operators' endpoints ask for (the admin's action asks the same: refunds)."""
    from django.contrib.auth.models import Permission

    user = UserFactory(is_staff=True)
    user.user_permissions.add(Permission.objects.get(content_type__app_label="billing", codename="add_refund"))
    return user


def calls(*access: str, owned: bool = False, lists: bool = False) -> list:
    chosen = [c for c in CALLS if c.access in access and (c.owned or not owned) and (c.lists or not lists)]
    return [pytest.param(c, id=c.id) for c in chosen]


@cache
def _state_queries() -> list[tuple[str, str]]:
    """(label, SQL) per model of the apps: the ORM's SELECT of every row's columns but the volatile ones, by pk."""
    queries = []
    for model in apps.get_models():
        if model._meta.app_label in APPS:
            label = model._meta.label
            columns = [f.attname for f in model._meta.concrete_fields if (label, f.name) not in VOLATILE]
            sql, params = model._base_manager.order_by("pk").values_list(*columns).query.sql_with_params()
            assert not params, (label, params)  # sent as they are, in one batch
            queries.append((label, sql))
    return queries


def database_state() -> dict:
    """Every row of the apps' tables, to compare before and after a refused request. The same SELECTs as the ORM's,
    compiled once and sent to PostgreSQL as one batch: one per model (35, twice a test) were a third of the
    module's time. The rows are the database's values, before any field's from_db_value."""
    queries = _state_queries()
    state = {}
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":  # psycopg: statements without parameters, all results (nextset)
            cursor.execute(";\n".join(sql for _, sql in queries))
            for label, _ in queries:
                state[label] = cursor.fetchall()
                cursor.nextset()
        else:
            for label, sql in queries:
                cursor.execute(sql)
                state[label] = cursor.fetchall()
    return state


def send(client, call: Call, url: str, body: dict | None = None, **headers):
    if call.method in ("get", "delete") and body is None:
        return getattr(client, call.method)(url, **headers)
    raw = json.dumps({} if body is None else body).encode()
    return getattr(client, call.method)(url, data=raw, content_type="application/json", **headers)


def rows(response) -> list[dict]:
    data = response.json()
    return data["results"] if isinstance(data, dict) else data


def assert_refused(response, status: int) -> None:
    assert response.status_code == status, response.content
    assert set(response.json()) == {"detail"}, response.json()  # a reason, nothing of the object


# ---------------------------------------------------------------------------------------------- coverage


def test_every_path_and_verb_of_the_schema_is_in_the_table():
    schema = load_yaml(SCHEMA.read_text())
    published = {f"{verb.upper()} {path}" for path, item in schema["paths"].items() for verb in item if verb in VERBS}
    listed = [call.id for call in CALLS]
    assert len(listed) == len(set(listed)), "a call is in the table twice"
    missing, extra = sorted(published - set(listed)), sorted(set(listed) - published)
    assert not missing, f"in docs/openapi.yaml but not in tests/api_contract/table.py: {missing}"
    assert not extra, f"in tests/api_contract/table.py but not in docs/openapi.yaml: {extra}"


# -------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("call", calls(USER, OPERATOR))
def test_anonymous_is_401_and_changes_nothing(call, anon):
    obj = world.make(call.owned, UserFactory()) if call.owned else None  # an object that exists
    before = database_state()
    response = send(anon, call, call.url(obj))
    assert_refused(response, 401)
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert database_state() == before


@pytest.mark.parametrize("call", calls(USER, owned=True))
def test_another_owners_object_is_404_and_changes_nothing(call, other_api):
    obj = world.make(call.owned, UserFactory())
    body = call.body(SimpleNamespace(api=other_api)) if call.body else None
    before = database_state()
    assert_refused(send(other_api, call, call.url(obj), body), 404)
    assert database_state() == before


@pytest.mark.parametrize("call", calls(USER, owned=True))
def test_an_operator_not_owning_the_object(call, operator_api):
    obj = world.make(call.owned, UserFactory())
    body = call.body(SimpleNamespace(api=operator_api)) if call.body else None
    before = database_state()
    response = send(operator_api, call, call.url(obj), body)
    assert response.status_code == call.operator_other, response.content
    if call.operator_other in (403, 404):  # refused: nothing changed
        assert set(response.json()) == {"detail"}
        assert database_state() == before


@pytest.mark.parametrize("call", calls(OPERATOR))
def test_a_user_who_is_not_an_operator_is_403_and_changes_nothing(call, api):
    before = database_state()
    assert_refused(send(api, call, call.url()), 403)
    assert database_state() == before


@pytest.mark.parametrize("call", calls(STRIPE))
def test_an_unsigned_stripe_call_is_400_and_changes_nothing(call, anon):
    before = database_state()
    response = send(anon, call, call.url(), call.body(SimpleNamespace()))
    assert response.status_code == 400, response.content
    assert database_state() == before


@pytest.mark.parametrize("call", calls(USER, lists=True))
def test_a_collection_lists_the_callers_rows_only(call, api, other_api):
    mine = world.make(call.lists, api.user)
    theirs = world.make(call.lists, other_api.user)
    response = api.get(call.url())
    assert response.status_code == 200, response.content
    ids = {row["id"] for row in rows(response)}
    assert mine.pk in ids and theirs.pk not in ids


# -------------------------------------------------------------------------------------------- the owner


@pytest.mark.parametrize("call", calls(PUBLIC, USER, OPERATOR, STRIPE))
def test_the_owner_succeeds(call, request, anon, client_for):
    caller = {PUBLIC: anon, STRIPE: anon, USER: client_for(UserFactory()),
              OPERATOR: client_for(operator())}[call.access]
    ctx = SimpleNamespace(api=caller, anon=anon, client_for=client_for,
                          localstripe=request.getfixturevalue("localstripe") if call.stripe else None)
    owner = getattr(caller, "user", None) or UserFactory()
    obj = world.make(call.owned, owner) if call.owned else None
    body = call.body(ctx) if call.body else None
    headers = call.headers(ctx, json.dumps(body).encode()) if call.headers else {}
    response = send(caller, call, call.url(obj), body, **headers)
    assert response.status_code == call.ok, response.content
    if obj is not None and call.method != "delete" and isinstance(response.json(), dict) and "id" in response.json():
        assert response.json()["id"] == obj.pk
