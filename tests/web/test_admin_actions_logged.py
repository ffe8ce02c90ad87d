"""Every operator action that changes another user's account, workload or server leaves a record of which operator
did it, in the admin's log (LogEntry, the object's history page): only deactivate and reactivate wrote one, and
nothing showed which staff account turned off someone's two-factor log-in, destroyed a renter's instance or retired
a provider's node (found by review). One entry per object the action changed; none for one it refused or left as
it was."""
import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.contenttypes.models import ContentType

from marketplace.models import ApiKey, Instance, Node, NodeState
from marketplace.services import two_factor
from marketplace.services.accounts import api_key_create
from tests.factories import UserFactory, make_listed_node, make_node
from tests.marketplace.renting_helpers import book
from tests.web.conftest import fund, logged_in
from tests.web.test_two_factor_pages import enrol

pytestmark = pytest.mark.django_db


def _logged(obj, by=None) -> list[str]:
    """The admin's log entries of `obj`, by `by` when given."""
    entries = LogEntry.objects.filter(content_type=ContentType.objects.get_for_model(type(obj)), object_id=str(obj.pk))
    if by is not None:
        entries = entries.filter(user=by)
    return list(entries.values_list("change_message", flat=True))


def _act(operator, model: str, action: str, *objects):
    response = logged_in(operator).post(f"/admin/marketplace/{model}/",
                                        {"action": action, "_selected_action": [obj.pk for obj in objects]})
    assert response.status_code == 302, response.status_code


def test_turning_off_two_factor_is_recorded_for_each_account_it_was_on_for(operator):
    on, off = UserFactory(), UserFactory()
    enrol(on)
    _act(operator, "user", "turn_off_two_factor", on, off)
    assert not two_factor.two_factor_enabled(user=on)
    assert _logged(on, operator) == ["Turned off two-factor log-in."]
    assert _logged(off) == []  # it was off: nothing changed, nothing recorded


@pytest.mark.parametrize(("action", "status", "message"), [
    ("force_stop", "stopping", "Stopped from the admin (now stopping)."),
    ("force_destroy", "destroying", "Destroyed from the admin (now destroying)."),
])
def test_force_stopping_or_destroying_an_instance_is_recorded_once(operator, renter, action, status, message):
    fund(renter)
    instance = book(renter, make_listed_node(gpu_count=1))
    if action == "force_stop":
        _act(operator, "instance", action, instance)  # not running yet: refused, not recorded
        assert _logged(instance) == []
    Instance.objects.filter(pk=instance.pk).update(status="running")
    _act(operator, "instance", action, instance)
    instance.refresh_from_db()
    assert instance.status == status
    _act(operator, "instance", action, instance)  # asked again: the service changes nothing
    assert _logged(instance, operator) == [message]


def test_the_node_actions_are_recorded_for_each_node_changed(operator):
    node = make_listed_node(gpu_count=1)
    other = make_listed_node(gpu_count=1, listed=False)
    _act(operator, "node", "unlist", node, other)  # `other` is unlisted already: left as it was
    _act(operator, "node", "set_maintenance", node)
    _act(operator, "node", "reverify_nodes", node)
    _act(operator, "node", "retire", node)
    node.refresh_from_db()
    assert node.state == NodeState.RETIRED
    assert _logged(node, operator) == ["Unlisted.", "Put into maintenance.", "Re-verification asked.", "Retired."][::-1]
    assert _logged(other) == []


def test_a_refused_retire_is_not_recorded(operator, renter):
    fund(renter)
    instance = book(renter, make_listed_node(gpu_count=1))  # a renter on it: retiring is refused
    _act(operator, "node", "retire", instance.node)
    instance.node.refresh_from_db()
    assert instance.node.state != NodeState.RETIRED
    assert _logged(instance.node) == []


def test_revoking_an_api_key_is_recorded(operator, renter):
    key, _ = api_key_create(user=renter, name="ci")
    _act(operator, "apikey", "revoke", key)
    assert ApiKey.objects.get(pk=key.pk).revoked_at is not None
    assert _logged(key, operator) == ["Revoked."]


def test_accepting_a_new_host_key_is_recorded_and_told_as_it_went(operator, monkeypatch):
    """The action said "New host keys accepted for quarantined nodes; verification queued." whatever happened, also
    when no selected node was quarantined, and was the one node action missing from the admin's log (found by
    review). Now each node whose key was accepted is recorded with the key, and the message names what was done
    and what was left as it was."""
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: None)
    new_key = "SHA256:" + "N" * 43
    moved = make_node(name="moved", host_key_fingerprint="SHA256:" + "M" * 43, state=NodeState.QUARANTINED)
    Node.objects.filter(pk=moved.pk).update(seen_host_key_fingerprint=new_key)
    active = make_listed_node(name="active", gpu_count=1)  # no new key waits: nothing to accept
    page = logged_in(operator).post("/admin/marketplace/node/", {
        "action": "accept_new_host_key", "_selected_action": [moved.pk, active.pk]}, follow=True).content.decode()
    moved.refresh_from_db(), active.refresh_from_db()
    assert (moved.host_key_fingerprint, moved.state, active.state) == (new_key, NodeState.VERIFYING, NodeState.ACTIVE)
    assert "New host key accepted and verification queued for 1 node(s): moved." in page
    assert "Left as they are, not quarantined with a new host key waiting: active." in page
    assert _logged(moved, operator) == [f"Accepted new host key {new_key}; re-verification asked."]
    assert _logged(active) == []


def test_accepting_on_a_node_that_is_not_quarantined_does_not_say_it_was_done(operator):
    node = make_listed_node(gpu_count=1)  # active: no new key waits
    page = logged_in(operator).post("/admin/marketplace/node/", {
        "action": "accept_new_host_key", "_selected_action": [node.pk]}, follow=True).content.decode()
    node.refresh_from_db()
    assert node.state == NodeState.ACTIVE  # nothing was done ...
    assert "New host keys accepted" not in page and "No new host key accepted." in page  # ... and it is told so
    assert _logged(node) == []
