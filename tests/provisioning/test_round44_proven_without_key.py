"""Round 44 review: a node proven (Node.control_proven_at) without a host key pinned is pinned at its next contact.

Migration 0034's backfill marked proven every node the platform had reached, a key or not, and 0008 had cleared
the keys of a server's later duplicates and kept their last_seen_at. Only an unproven node was pinned at contact, so
such a node connected with an empty pin, which takes any key, for good: any server at its address was taken for it.
Now a node with no key is pinned at contact whatever its proof says, and 0035 unproves the nodes proven without one."""
import pytest
from django.apps import apps
from django.utils import timezone

from marketplace.models import Node, NodeState, Verdict
from provisioning import sim
from provisioning.models import NodeEvent
from provisioning.services.nodes import _pin_host_key, node_health_probe
from tests.factories import make_node
from tests.provisioning.test_duplicate_nodes import FINGERPRINT, register

pytestmark = pytest.mark.django_db
backfill = __import__("marketplace.migrations.0034_node_proven_control", fromlist=["mark_proven"])
unprove = __import__("marketplace.migrations.0035_node_proven_needs_host_key", fromlist=["unprove_keyless"])


@pytest.fixture(scope="module")
def simbase(tmp_path_factory):
    base = tmp_path_factory.mktemp("proven-no-key")
    yield base
    sim.nodes_down(base)


@pytest.fixture(scope="module")
def servers(simbase):
    return sim.node_up("rtx-a4000-x2", simbase), sim.node_up("rtx-a4000-x2", simbase)


def test_a_node_proven_by_the_backfill_without_a_host_key_is_pinned_at_its_next_contact(servers, simbase):
    server, impostor = servers
    assert server["host_key_fingerprint"] != impostor["host_key_fingerprint"]
    node = register(server, simbase, pin=False, name="reached-no-key")  # as 0008 left a duplicate
    Node.objects.filter(pk=node.pk).update(state=NodeState.REJECTED, verdict=Verdict.REJECTED,
                                           last_seen_at=timezone.now())
    backfill.mark_proven(apps, None)
    node.refresh_from_db()
    assert node.control_proven_at is not None and node.host_key_fingerprint == ""

    assert node_health_probe(node).ok
    node.refresh_from_db()
    pinned = node.host_key_fingerprint
    sim.node_authorize(impostor["ssh_port"], node.ssh_public_key, simbase)  # another server at its endpoint
    Node.objects.filter(pk=node.pk).update(ssh_port=impostor["ssh_port"])
    node.refresh_from_db()
    result = node_health_probe(node)
    assert (pinned, result.ok) == (server["host_key_fingerprint"], False), (pinned, result.ok, result.error)
    node.refresh_from_db()
    assert node.seen_host_key_fingerprint == impostor["host_key_fingerprint"]  # the changed key, as quarantine records


def test_pinning_a_proven_node_with_no_key_records_the_key_it_shows():
    node = make_node()
    Node.objects.filter(pk=node.pk).update(control_proven_at=timezone.now())
    node.refresh_from_db()
    _pin_host_key(node, FINGERPRINT)
    node.refresh_from_db()
    assert node.host_key_fingerprint == FINGERPRINT and node.control_proven_at is not None
    event = NodeEvent.objects.get(node=node, kind="host_key_pinned")
    assert f"Host key {FINGERPRINT} recorded (the node had none pinned) and pinned" in event.message


def test_the_migration_unproves_the_nodes_proven_without_a_key_and_only_those():
    keyless = make_node(name="keyless")
    keyed = make_node(name="keyed", host_key_fingerprint=FINGERPRINT)
    unproven = make_node(name="unproven")
    Node.objects.filter(pk__in=(keyless.pk, keyed.pk)).update(control_proven_at=timezone.now())
    unprove.unprove_keyless(apps, None)
    proven = dict(Node.objects.filter(pk__in=(keyless.pk, keyed.pk, unproven.pk))
                  .values_list("name", "control_proven_at"))
    assert proven["keyless"] is None and proven["unproven"] is None and proven["keyed"] is not None
