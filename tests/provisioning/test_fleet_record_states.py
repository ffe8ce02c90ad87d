"""What a health check recorded after the node's state changed may do to it (fleet_record.nodes_record_health):
a check's probe can begin before its provider verifies the node, ends its maintenance or retires it, and is
recorded after (a batch records once every probe has ended)."""
import pytest
from django.utils import timezone

from marketplace.models import Node, NodeState
from marketplace.services.nodes import node_retire, node_update
from provisioning.models import Job, JobKind, JobStatus, NodeEvent
from provisioning.services import fleet
from provisioning.services.fleet_record import nodes_record_health
from provisioning.services.nodes import OFFLINE_AFTER_FAILED_CHECKS, HealthResult
from provisioning.services.verification import node_verify_request, node_verify_run
from provisioning.ssh_errors import NodeUnreachable
from tests.factories import make_listed_node
from tests.provisioning.test_fleet_batches import closed_port


@pytest.fixture(autouse=True)
def sent_jobs(monkeypatch):
    """Jobs handed to Celery on commit are recorded instead (no worker here)."""
    sent = []
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: sent.append((job_id, kind)))
    return sent


def test_a_probe_from_before_a_verify_request_leaves_the_node_to_its_check(db, monkeypatch):
    """An offline node comes back and its provider asks for a verification while a batch that probed it (failing)
    is still running. Before, the batch sent it from verifying back to offline, told its provider again, and the
    check ended "The node is offline, not verifying; nothing done" as the platform's failure."""
    node = make_listed_node(address="127.0.0.1", ssh_port=closed_port())
    Node.objects.filter(pk=node.pk).update(state=NodeState.OFFLINE, health_failures=OFFLINE_AFTER_FAILED_CHECKS,
                                           last_error="gone")
    real_probe = fleet.nodes_probe

    def probe_then_provider_verifies(nodes, parallelism, pool=None):
        results = real_probe(nodes, parallelism, pool=pool)
        node_verify_request(node=Node.objects.get(pk=node.pk), reason="provider asked")
        return results

    monkeypatch.setattr(fleet, "nodes_probe", probe_then_provider_verifies)
    summary = fleet.nodes_health_batch([node.pk])
    assert (summary["failed"], summary.get("stale")) == (0, 1)  # probed before the change: not recorded
    node.refresh_from_db()
    assert node.state == NodeState.VERIFYING
    assert node.health_failures == OFFLINE_AFTER_FAILED_CHECKS
    assert not NodeEvent.objects.filter(node=node, kind="offline").exists()  # no second "offline" notice
    job = Job.objects.get(node=node, kind=JobKind.NODE_VERIFY)
    with pytest.raises(NodeUnreachable):  # the check tried the node (its task retries), not "nothing done"
        node_verify_run(job=job)
    job.refresh_from_db()
    node.refresh_from_db()
    assert node.state == NodeState.VERIFYING and job.status != JobStatus.FAILED, f"{job.status}: {job.error}"


def test_a_node_verified_with_renters_on_it_is_not_sent_offline_by_its_checks(db):
    """Watched while verified with renters on it (fleet.watched_nodes): its failed checks count (its renters are
    interrupted as usual), but where it goes is its check's to say (node_verify_failed)."""
    node = make_listed_node()
    Node.objects.filter(pk=node.pk).update(state=NodeState.VERIFYING, health_failures=OFFLINE_AFTER_FAILED_CHECKS)
    nodes_record_health([HealthResult(node.pk, False, "No SSH answer", probed_at=timezone.now())],
                        running_vm_ids={})
    node.refresh_from_db()
    assert (node.state, node.health_failures, node.last_error) == (
        NodeState.VERIFYING, OFFLINE_AFTER_FAILED_CHECKS + 1, "No SSH answer")


def test_a_failed_probe_from_before_a_verification_concluded_leaves_the_verified_node_active(db, monkeypatch):
    """A node verified while renters are on it (watched), its last checks failed: the verification reaches it and
    lists it while a batch that probed it (failing) still runs. Recorded, that failure was the third in a row and
    sent the node it had just verified offline, its provider told so."""
    node = make_listed_node(address="127.0.0.1", ssh_port=closed_port())
    Node.objects.filter(pk=node.pk).update(state=NodeState.VERIFYING,
                                           health_failures=OFFLINE_AFTER_FAILED_CHECKS - 1)
    monkeypatch.setattr(fleet, "watched_nodes", lambda: Node.objects.all())  # as with renters on it
    real_probe = fleet.nodes_probe

    def probe_then_verification_concludes(nodes, parallelism, pool=None):
        results = real_probe(nodes, parallelism, pool=pool)
        verified = Node.objects.get(pk=node.pk)
        if verified.state == NodeState.VERIFYING:
            verified.transition_to(NodeState.ACTIVE)
            verified.save()
        return results

    monkeypatch.setattr(fleet, "nodes_probe", probe_then_verification_concludes)
    summary = fleet.nodes_health_batch([node.pk])
    node.refresh_from_db()
    assert (node.state, node.health_failures) == (NodeState.ACTIVE, OFFLINE_AFTER_FAILED_CHECKS - 1)
    assert summary.get("stale") == 1
    assert not NodeEvent.objects.filter(node=node, kind="offline").exists()
    fleet.nodes_health_batch([node.pk])  # the next check judges it
    node.refresh_from_db()
    assert node.state == NodeState.OFFLINE


@pytest.mark.parametrize("change", ["maintenance", "retired", "quarantined"])
def test_a_check_recorded_after_another_state_change_leaves_it(db, change):
    """Maintenance begun, the node retired or quarantined while a probe ran: neither its failure nor its answer
    moves the node out of that state (the transitions allow none of it: a guard, not a fix)."""
    node = make_listed_node()
    Node.objects.filter(pk=node.pk).update(health_failures=OFFLINE_AFTER_FAILED_CHECKS)
    began = timezone.now()
    node.refresh_from_db()
    if change == "maintenance":
        node_update(node=node, maintenance=True)
    elif change == "retired":
        node_retire(node=node)
    else:
        Node.objects.filter(pk=node.pk).update(state=NodeState.QUARANTINED, state_changed_at=timezone.now())
    node.refresh_from_db()
    for ok in (False, True):
        nodes_record_health([HealthResult(node.pk, ok, "" if ok else "No SSH answer", vms={}, probed_at=began)],
                            running_vm_ids={})
        node.refresh_from_db()
        assert node.state == change
