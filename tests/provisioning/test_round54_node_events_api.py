"""`GET /api/v1/nodes/{id}/events/`: a node's provider sees what happened to it, as provisioning/node_event_kinds.py
allows: only the kinds in its registry, each with a title, the stored message only where it is safe to show.

Before, node events were the admin's only: providers never saw their node go offline, its GPU lost, a spot check
fail or a VM vanish. The registry test reads every writer of a NodeEvent in the code base, so a new kind cannot
reach providers (nor stay unclassified) by default."""
import ast
from datetime import timedelta
from pathlib import Path

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from core.api.scopes import RENTER
from marketplace.models import NodeState, Verdict
from marketplace.services.accounts import api_key_create
from marketplace.services.nodes import OPERATOR_NODE_ACTIONS, node_change_by_operator
from provisioning.models import NodeEvent
from provisioning.node_event_kinds import OPERATOR_ONLY_KINDS, PROVIDER_KINDS
from tests.factories import UserFactory, make_node

ROOT = Path(__file__).resolve().parents[2]
NOT_SCANNED = {".venv", "tests", "node_modules", ".git", "migrations"}

# Writers whose kind is no literal, each with every value it can take (by file, function and the expression).
DYNAMIC_KINDS = {
    ("provisioning/services/nodes.py", "node_event", "kind"): set(),  # the helper itself: its callers are read
    ("provisioning/services/verification.py", "node_verify_conclude", "f'verified_{verdict}'"):
        {f"verified_{verdict}" for verdict in Verdict.values},
    ("marketplace/services/nodes.py", "node_change_by_operator", "event_kind"):
        {kind for kind, _, _ in OPERATOR_NODE_ACTIONS.values()},
}


def _is_writer(call: ast.Call) -> bool:
    """node_event(...), NodeEvent(...) (bulk_create's rows), NodeEvent.objects.create / get_or_create /
    update_or_create, and <node>.events.create(...)."""
    func = call.func
    if isinstance(func, ast.Name):
        return func.id in ("node_event", "NodeEvent")
    if isinstance(func, ast.Attribute) and func.attr in ("node_event", "NodeEvent"):
        return True
    if isinstance(func, ast.Attribute) and func.attr in ("create", "get_or_create", "update_or_create"):
        base = ast.unparse(func.value)
        return base.endswith("NodeEvent.objects") or base.endswith(".events")
    return False


def _kinds_of(expr: ast.expr, constants: dict[str, str]) -> set[str] | None:
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return {expr.value}
    if isinstance(expr, ast.Name) and expr.id in constants:
        return {constants[expr.id]}
    if isinstance(expr, ast.IfExp):
        a, b = _kinds_of(expr.body, constants), _kinds_of(expr.orelse, constants)
        return a | b if a is not None and b is not None else None
    return None


class _Writers(ast.NodeVisitor):
    def __init__(self, path: str, constants: dict[str, str]):
        self.path, self.constants, self.function = path, constants, ""
        self.kinds: set[str] = set()
        self.unresolved: list[str] = []
        self.writers = 0

    def visit_FunctionDef(self, node):
        outer, self.function = self.function, node.name
        self.generic_visit(node)
        self.function = outer

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node):
        if _is_writer(node):
            self.writers += 1
            kind = next((k.value for k in node.keywords if k.arg == "kind"), None)
            if kind is None:
                self.unresolved.append(f"{self.path}:{node.lineno} (no kind= keyword)")
            else:
                found = _kinds_of(kind, self.constants)
                key = (self.path, self.function, ast.unparse(kind))
                if found is None and key in DYNAMIC_KINDS:
                    found = DYNAMIC_KINDS[key]
                if found is None:
                    self.unresolved.append(f"{self.path}:{node.lineno} kind={ast.unparse(kind)}")
                else:
                    self.kinds |= found
        self.generic_visit(node)


def _written_kinds() -> tuple[set[str], list[str], int]:
    kinds, unresolved, writers = set(), [], 0
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        if NOT_SCANNED & set(relative.parts):
            continue
        text = path.read_text()
        if "NodeEvent" not in text and "node_event" not in text and ".events." not in text:
            continue
        tree = ast.parse(text)
        constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                     and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                     for t in n.targets if isinstance(t, ast.Name)}
        visitor = _Writers(str(relative), constants)
        visitor.visit(tree)
        kinds |= visitor.kinds
        unresolved += visitor.unresolved
        writers += visitor.writers
    return kinds, unresolved, writers


def test_every_kind_written_anywhere_is_classified_for_providers():
    kinds, unresolved, writers = _written_kinds()
    assert not unresolved, ("a NodeEvent writer whose kind this test cannot read: use a literal or a module "
                            f"constant, or list its values in DYNAMIC_KINDS: {unresolved}")
    # The scan reads the writers it must (a broken scan would find nothing and pass).
    assert writers >= 45 and {"offline", "back_online", "gpu_lost", "disk_limit_not_enforced", "verified_rejected",
                              "retired_by_operator", "host_key_accepted", "vm_vanished"} <= kinds
    unclassified = kinds - set(PROVIDER_KINDS) - set(OPERATOR_ONLY_KINDS)
    assert not unclassified, (f"node event kinds neither shown to providers nor declared operator-only "
                              f"(provisioning/node_event_kinds.py): {sorted(unclassified)}")
    assert not set(PROVIDER_KINDS) & set(OPERATOR_ONLY_KINDS)
    stale = (set(PROVIDER_KINDS) | set(OPERATOR_ONLY_KINDS)) - kinds
    assert not stale, f"kinds in the registry that nothing writes: {sorted(stale)}"


def test_the_operators_e_mail_and_the_agents_words_are_never_shown():
    # Those whose writers put an operator's e-mail or the node agent's error text in the message.
    for kind in ("host_key_accepted", "retired_by_operator", "unlisted_by_operator", "maintenance_by_operator",
                 "vm_stop_failed", "vm_destroy_failed", "vm_state_unknown", "orphan_volume_delete_failed",
                 "volume_delete_failed"):
        assert PROVIDER_KINDS[kind].message_shown is False, kind
        assert PROVIDER_KINDS[kind].title


URL = "/api/v1/nodes/{}/events/"


def _event(node, kind, message, level=NodeEvent.Level.INFO, minutes_ago=0):
    return NodeEvent.objects.create(node=node, kind=kind, message=message, level=level,
                                    created_at=timezone.now() - timedelta(minutes=minutes_ago))


@pytest.fixture
def node(api):
    node = make_node(api.user, state=NodeState.ACTIVE, verdict=Verdict.VERIFIED)
    _event(node, "offline", "3 health checks failed in a row: connection refused", NodeEvent.Level.WARNING, 50)
    _event(node, "back_online", "The node answers health checks again.", minutes_ago=40)
    _event(node, "host_key_accepted", "ops@platform.example accepted host key SHA256:x (was SHA256:y).",
           NodeEvent.Level.WARNING, 30)
    _event(node, "verified_unverified", "operator-only words", minutes_ago=25)  # operator-only
    _event(node, "some_internal_kind", "renter bob@example.com's instance", minutes_ago=20)  # in no registry
    _event(node, "gpu_lost", "GPU 1 (GPU-abc) no longer listed by nvidia-smi", NodeEvent.Level.CRITICAL, 10)
    return node


def test_the_provider_sees_the_kinds_for_providers_newest_first(api, node):
    r = api.get(URL.format(node.pk))
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["count"] == 4
    assert [e["kind"] for e in body["results"]] == ["gpu_lost", "host_key_accepted", "back_online", "offline"]
    newest = body["results"][0]
    assert set(newest) == {"id", "created_at", "level", "kind", "title", "message"}
    assert newest["level"] == "critical" and newest["title"] == PROVIDER_KINDS["gpu_lost"].title
    assert newest["message"] == "GPU 1 (GPU-abc) no longer listed by nvidia-smi"
    accepted = body["results"][1]
    assert accepted["title"] == "New SSH host key accepted by an operator" and accepted["message"] == ""
    text = r.content.decode()
    assert "ops@platform.example" not in text and "bob@example.com" not in text and "operator-only" not in text


def test_an_operators_change_through_the_service_shows_without_the_operators_address(api, node):
    operator = UserFactory(is_staff=True, email="ops-alice@platform.example")
    assert node_change_by_operator(node=node, action="unlist", by=operator, reason="checking a report")
    stored = NodeEvent.objects.get(node=node, kind="unlisted_by_operator")
    assert operator.email in stored.message  # written for operators
    shown = api.get(URL.format(node.pk)).json()["results"][0]
    assert (shown["kind"], shown["title"], shown["message"]) == (
        "unlisted_by_operator", "Taken off the offers by an operator", "")
    assert operator.email not in api.get(URL.format(node.pk)).content.decode()


def test_filtered_by_level(api, node):
    body = api.get(URL.format(node.pk) + "?level=warning").json()
    assert [e["kind"] for e in body["results"]] == ["host_key_accepted", "offline"]
    assert api.get(URL.format(node.pk) + "?level=info").json()["count"] == 1


@pytest.mark.parametrize("query", ["?level=loud", "?level=", "?level=WARNING"])
def test_a_bad_level_is_a_400_naming_it(api, node, query):
    r = api.get(URL.format(node.pk) + query)
    assert r.status_code == 400 and "level" in r.json(), r.content


def test_an_unknown_query_parameter_is_a_400(api, node):
    r = api.get(URL.format(node.pk) + "?kind=offline")
    assert r.status_code == 400 and r.json() == {"kind": ["Unknown query parameter."]}


def test_paginated(api, node):
    body = api.get(URL.format(node.pk) + "?page_size=3").json()
    assert (body["count"], len(body["results"])) == (4, 3) and body["next"]
    assert [e["kind"] for e in api.get(body["next"]).json()["results"]] == ["offline"]


@pytest.mark.parametrize("path", ["{pk}", "999999", "abc", "1.5", "99999999999999999999999", "%C2%B2"])
def test_another_provider_gets_a_404(other_api, node, path):
    r = other_api.get(URL.format(path.format(pk=node.pk)))
    assert r.status_code == 404 and "detail" in r.json()


def test_a_renter_key_is_refused_by_scope(node):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_create(user=node.provider, name='r', scopes=[RENTER])[1]}")
    r = client.get(URL.format(node.pk))
    assert r.status_code == 403 and "`provider`" in (r.json().get("detail") or "")


def test_anonymous_callers_must_authenticate(anon, node):
    assert anon.get(URL.format(node.pk)).status_code == 401


def test_operators_need_the_admins_permission_to_see_node_events(operator_api, node):
    assert operator_api.get(URL.format(node.pk)).status_code == 404  # view_node, not view_nodeevent
    operator_api.user.user_permissions.add(
        Permission.objects.get(content_type__app_label="provisioning", codename="view_nodeevent"))
    body = operator_api.get(URL.format(node.pk)).json()
    assert body["count"] == 4 and body["results"][1]["message"] == ""  # what the provider sees


def test_a_retired_nodes_events_are_its_providers_only(api, other_api, node):
    # Its provider still reads them: the retirement's own events are shown nowhere else (review r55 LOW-4).
    type(node).objects.filter(pk=node.pk).update(state=NodeState.RETIRED)
    assert api.get(URL.format(node.pk)).status_code == 200
    assert other_api.get(URL.format(node.pk)).status_code == 404


def test_queries_do_not_grow_with_the_events(api, node):
    def count() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert api.get(URL.format(node.pk) + "?page_size=50").status_code == 200
        return len(captured)

    count()  # a first request does one-off work (the key's use recorded)
    few = count()
    for n in range(30):
        _event(node, "spot_check_passed", f"Spot check {n} passed.", minutes_ago=1)
    assert count() == few
    assert few <= 12
