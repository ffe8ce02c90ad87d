"""A node whose check fails by its own doing (node_verify_failed, node_at_fault) is not left listed on its old
verdict, whatever state it is checked from: active (in place), or verifying from offline, or after an operator
accepted its new host key (found by review: those went offline on their old verdict, and their next good health
check listed them again). A failure that is not the node's keeps its verdict, as before."""
import pytest

from marketplace.models import Node, NodeState, Verdict
from marketplace.models.nodes import OFFERABLE
from provisioning.services.fleet_record import node_record_health
from provisioning.services.runner import job_begin
from provisioning.services.verification import (
    BenchmarkTimeout,
    node_accept_host_key,
    node_verify_failed,
    node_verify_request,
)
from provisioning.ssh_errors import AgentGarbage, AuthFailed, NodeError, NodeUnreachable
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book, run, sent_jobs_fixture  # noqa: F401 (the sent_jobs fixture)

pytestmark = pytest.mark.django_db


def _fails(node: Node, error: NodeError) -> Node:
    job = job_begin(job_id=node.jobs.get(kind="node_verify", status="queued").pk)
    node_verify_failed(job=job, error=error)
    node.refresh_from_db()
    return node


def _offerable(node: Node) -> bool:
    return Node.objects.filter(OFFERABLE, pk=node.pk).exists()


def _offline(node: Node) -> Node:
    Node.objects.filter(pk=node.pk).update(state=NodeState.OFFLINE, health_failures=3)
    node.refresh_from_db()
    return node


def test_a_node_whose_new_host_key_was_accepted_and_whose_check_hangs_is_not_listed_again(sent_jobs):
    node = make_listed_node()
    Node.objects.filter(pk=node.pk).update(state=NodeState.QUARANTINED, seen_host_key_fingerprint="SHA256:" + "A" * 43)
    node.refresh_from_db()
    node_accept_host_key(node=node, operator_email="ops@example.com")
    node.refresh_from_db()
    node = _fails(node, BenchmarkTimeout("The benchmark did not answer"))
    assert (node.state, node.verdict) == (NodeState.REJECTED, Verdict.REJECTED)
    assert node.verifications.get().findings[0]["code"] == "verification_failed"
    node_record_health(node_id=node.pk, ok=True)
    node.refresh_from_db()
    assert node.state == NodeState.REJECTED and not _offerable(node)


@pytest.mark.parametrize("error", [AgentGarbage("garbage"), AuthFailed("The node refused the platform's key")])
def test_an_offline_verified_node_whose_check_fails_by_its_doing_is_rejected(sent_jobs, error):
    node = _offline(make_listed_node())
    node_verify_request(node=node)
    node = _fails(node, error)
    assert (node.state, node.verdict) == (NodeState.REJECTED, Verdict.REJECTED)
    assert "could not be completed" in node.last_error
    node_record_health(node_id=node.pk, ok=True)
    node.refresh_from_db()
    assert not _offerable(node)


def test_a_degraded_node_with_a_renter_stays_up_for_them_judged(sent_jobs):
    node = make_listed_node(gpu_count=2)
    Node.objects.filter(pk=node.pk).update(verdict=Verdict.DEGRADED)
    instance = run(book(UserFactory(), node))
    node = _offline(node)
    node_verify_request(node=node)
    node = _fails(node, BenchmarkTimeout("The benchmark did not answer"))
    # Its renter keeps the instance (active, watched); the verdict keeps it off the offers.
    assert (node.state, node.verdict) == (NodeState.ACTIVE, Verdict.REJECTED)
    assert not _offerable(node)
    instance.refresh_from_db()
    assert instance.status == "running"


@pytest.mark.parametrize("error", [NodeUnreachable("The SSH connection broke during a command: reset"),
                                   NodeError("The job did not finish in time and was stopped by the platform.")])
def test_a_failure_not_the_nodes_keeps_its_verdict(sent_jobs, error):
    node = _offline(make_listed_node())
    node_verify_request(node=node)
    node = _fails(node, error)
    assert (node.state, node.verdict) == (NodeState.OFFLINE, Verdict.VERIFIED)
    assert not node.verifications.exists()
    node_record_health(node_id=node.pk, ok=True)
    node.refresh_from_db()
    assert node.state == NodeState.ACTIVE and _offerable(node)


def test_a_pending_node_keeps_its_retries(sent_jobs):
    node = make_listed_node()
    Node.objects.filter(pk=node.pk).update(state=NodeState.PENDING, verdict=Verdict.UNVERIFIED)
    node.refresh_from_db()
    node_verify_request(node=node)
    node = _fails(node, BenchmarkTimeout("The benchmark did not answer"))
    assert (node.state, node.verdict) == (NodeState.PENDING, Verdict.UNVERIFIED)


def test_a_node_its_provider_put_into_maintenance_during_the_check_is_not_judged_by_it(sent_jobs):
    """An active node checked in place goes into maintenance meanwhile (the provider working on it, stopping the
    benchmark): the failed check is an event, as node_verify_run treats maintenance; its renters keep their price.
    The first fix rejected it and cut its renter to $0 an hour (found by the second review round)."""
    from marketplace.services.nodes import node_update

    node = make_listed_node(gpu_count=2)
    instance = run(book(UserFactory(), node))
    price = instance.price_per_hour_micros
    job = job_begin(job_id=node_verify_request(node=node).pk)
    node_update(node=Node.objects.get(pk=node.pk), maintenance=True)
    node_verify_failed(job=job, error=BenchmarkTimeout("The benchmark did not answer"))
    node.refresh_from_db()
    instance.refresh_from_db()
    assert (node.state, node.verdict) == (NodeState.MAINTENANCE, Verdict.VERIFIED)
    assert instance.price_per_hour_micros == price and not node.verifications.exists()
