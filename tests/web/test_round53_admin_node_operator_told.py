"""An operator's retire, unlist or maintenance of a provider's node leaves a trace the provider sees (review r53
#3): before, no notice, no e-mail and no node event, only the admin's log, which providers never see (and a retire
is for good). Now each records a node event with the operator and the reason, and tells the provider why."""
import pytest
from django.core import mail

from marketplace.models import Node, NodeState
from notifications.models import PREFERENCE_KINDS, Kind, Notification
from provisioning.models import NodeEvent
from tests.factories import UserFactory, make_listed_node
from tests.web.conftest import logged_in
from tests.web.test_admin_permissions import act

pytestmark = pytest.mark.django_db

ACTIONS = [("retire", "retired_by_operator", "retired"), ("unlist", "unlisted_by_operator", "unlisted"),
           ("set_maintenance", "maintenance_by_operator", "put into maintenance")]


@pytest.mark.parametrize(("action", "event_kind", "done"), ACTIONS)
def test_the_provider_is_told_why_and_the_node_keeps_the_event(action, event_kind, done, operator,
                                                               django_capture_on_commit_callbacks):
    provider = UserFactory()
    node = make_listed_node(provider, name="rig-7")
    with django_capture_on_commit_callbacks(execute=True):
        act(logged_in(operator), "marketplace/node", action, node.pk, reason="Fails every renter's CUDA job",
            index=0)
    node.refresh_from_db()
    assert (node.state == NodeState.RETIRED if action == "retire" else node.state == NodeState.MAINTENANCE
            if action == "set_maintenance" else node.listed is False)
    event = NodeEvent.objects.get(node=node, kind=event_kind)
    assert operator.email in event.message and "Fails every renter's CUDA job" in event.message
    told = Notification.objects.get(user=provider, kind=Kind.NODE_CHANGED_BY_OPERATOR)
    assert told.title == f"Node rig-7 was {done} by the operators"
    assert "Fails every renter's CUDA job" in told.body and operator.email not in told.body
    assert told.payload["node"] == node.pk and told.payload["reason"] == "Fails every renter's CUDA job"


def test_a_node_left_as_it_was_is_neither_recorded_nor_told(operator):
    provider = UserFactory()
    node = make_listed_node(provider)
    Node.objects.filter(pk=node.pk).update(listed=False)
    act(logged_in(operator), "marketplace/node", "unlist", node.pk, reason="x", index=0)
    busy = make_listed_node(provider, name="busy")
    Node.objects.filter(pk=busy.pk).update(state=NodeState.VERIFYING)  # node_update refuses maintenance
    act(logged_in(operator), "marketplace/node", "set_maintenance", busy.pk, reason="x", index=0)
    assert Node.objects.get(pk=busy.pk).state == NodeState.VERIFYING
    assert not NodeEvent.objects.filter(node__in=[node, busy]).exists()
    assert not Notification.objects.filter(user=provider).exists() and not mail.outbox


def test_a_reason_with_a_control_character_does_nothing(operator):
    node = make_listed_node(UserFactory())
    act(logged_in(operator), "marketplace/node", "retire", node.pk, reason="bad\x07", index=0)
    assert Node.objects.get(pk=node.pk).state == NodeState.ACTIVE and not NodeEvent.objects.exists()


def test_providers_choose_the_channels_of_the_new_notice():
    assert Kind.NODE_CHANGED_BY_OPERATOR in PREFERENCE_KINDS  # listed on their notification settings page
