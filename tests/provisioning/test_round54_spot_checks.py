"""Review r54 ("spot"): spot checks and the re-verification beat. A spot-check finding and the beat leave a node in
its provider's maintenance (#2); a spot check cut short by the node leaving `active` is not spent, and one the node
dropped first is a dodge (#1); free MIG slices are spot-checked (#3); a free card left out of the spot check's
inventory is a dodge, not a clean skip (#5); one node's Conflict or error does not stop the beat for the others
(#7)."""
import copy
from datetime import timedelta

import pytest
from django.db.models import Subquery
from django.utils import timezone

from core.errors import Conflict
from marketplace.models import GpuAllocation, MigSlice, Node, NodeState
from marketplace.services.nodes import node_update
from provisioning.models import Job, JobKind, JobStatus, NodeEvent, VerificationRun
from provisioning.services import maintenance
from provisioning.services.maintenance import _node_recheck, nodes_reverify_due
from provisioning.services.runner import job_begin, job_release, job_step
from provisioning.services.spot_checks import node_spot_check_conclude, node_spot_check_request, node_spot_check_run
from tests.factories import make_listed_node
from tests.provisioning.test_benchmark_verification import (
    profile_data,
    register,
    rent,
    simbase,
    simnode,
    use_hardware,
    verify,
)
from tests.provisioning.test_random_rechecks import bounds, spot_check

__all__ = ["bounds", "simbase", "simnode"]

WRONG = {"severity": "reject", "code": "challenge_wrong_result", "message": "GPU 0 wrong.", "gpu_index": 0}


def _verify_jobs(node, status=JobStatus.QUEUED):
    return Job.objects.filter(node=node, kind=JobKind.NODE_VERIFY, status=status)


def _due_spot_check(node, future=None) -> Job:
    future = future or timezone.now() + timedelta(days=8)
    Node.objects.filter(pk=node.pk).update(next_check_at=future,
                                           next_spot_check_at=timezone.now() - timedelta(seconds=1))
    assert nodes_reverify_due()["spot_checks"] == 1
    return Job.objects.get(node=node, kind=JobKind.NODE_SPOT_CHECK, status=JobStatus.QUEUED)


# ------------------------------------------------------------------------------------ #2: not out of maintenance

def test_a_spot_check_finding_leaves_the_node_in_its_providers_maintenance(db, bounds):
    node = make_listed_node()
    job = job_begin(job_id=node_spot_check_request(node=node).pk)
    node_update(node=node, maintenance=True)  # the provider starts work while the challenge runs
    assert node_spot_check_conclude(job=job, gpus=[0], findings=[WRONG], figures={}) is None
    node.refresh_from_db()
    assert node.state == NodeState.MAINTENANCE and not _verify_jobs(node).exists()
    assert node.next_check_at <= timezone.now()  # due: queued once the maintenance ends
    event = NodeEvent.objects.get(node=node, kind="spot_check_failed")
    assert "follows once the node is active again (it is maintenance now)" in event.message
    assert nodes_reverify_due() == {"queued": 0, "spot_checks": 0, "waiting": 0}  # not while in maintenance

    node_update(node=node, maintenance=False)
    node.refresh_from_db()
    assert node.state == NodeState.ACTIVE
    assert nodes_reverify_due()["queued"] == 1
    assert _verify_jobs(node).get().log[0]["message"] == "queued: scheduled re-verification"


def _as_the_beat_read_it(node):
    last = Job.objects.filter(node=node, kind=JobKind.NODE_VERIFY).order_by("-created_at")
    return Node.objects.annotate(last_verify_at=Subquery(last.values("created_at")[:1])).get(pk=node.pk)


@pytest.mark.parametrize("due", ["full", "spot"])
def test_the_beat_leaves_a_node_that_went_into_maintenance_since_its_query_there(db, bounds, due):
    node = make_listed_node()
    past, future = timezone.now() - timedelta(seconds=1), timezone.now() + timedelta(days=8)
    Node.objects.filter(pk=node.pk).update(next_check_at=past if due == "full" else future, next_spot_check_at=past)
    read = _as_the_beat_read_it(node)  # the beat's query: active, due
    node_update(node=Node.objects.get(pk=node.pk), maintenance=True)  # then, before its row lock
    assert _node_recheck(read, timezone.now()) == "waiting"
    node.refresh_from_db()
    assert node.state == NodeState.MAINTENANCE and not node.jobs.exists()
    # Still due: the beat queues it once the maintenance ends (before, the next spot check was drawn 6-42 h away).
    assert (node.next_check_at, node.next_spot_check_at) == ((past if due == "full" else future), past)


# ------------------------------------------------------------------------------------ #1: a cut-short spot check

def test_a_spot_check_cut_short_by_a_maintenance_toggle_runs_again_once_the_node_is_active(db, bounds):
    """The honest path: the provider's maintenance came after the spot check was queued, nothing was dropped. No
    penalty, but the spot check is not spent either (before, the next was 6-42 h away: a free dodge)."""
    node = make_listed_node()
    future = timezone.now() + timedelta(days=8)
    job = job_begin(job_id=_due_spot_check(node, future).pk)
    node_update(node=Node.objects.get(pk=node.pk), maintenance=True)
    job.node.refresh_from_db()
    node_spot_check_run(job=job)
    job.refresh_from_db()
    assert (job.status, job.fault) == (JobStatus.FAILED, "platform")
    assert "runs again once it is active" in job.error
    assert nodes_reverify_due() == {"queued": 0, "spot_checks": 0, "waiting": 0}  # not in maintenance
    node_update(node=Node.objects.get(pk=node.pk), maintenance=False)
    node.refresh_from_db()
    assert node.state == NodeState.ACTIVE and node.next_check_at == future  # not brought forward: no dodge
    assert not NodeEvent.objects.filter(node=node, kind="spot_check_failed_to_run").exists()
    assert nodes_reverify_due()["spot_checks"] == 1  # queued again at once


@pytest.mark.parametrize("first_try", ["connection_dropped", "platform_busy"])
def test_a_dropped_connection_then_maintenance_is_a_dodge(db, bounds, first_try):
    node = make_listed_node()
    VerificationRun.objects.filter(node=node).delete()  # no recent check: the forward is to now
    future = timezone.now() + timedelta(days=8)
    job = job_begin(job_id=_due_spot_check(node, future).pk)
    if first_try == "platform_busy":  # what the task logs when it waits for the platform's own SSH slots
        job_step(job=job, message="waiting for the node: busy. Trying again in 30 s.")
    job_release(job, retry_at=timezone.now())  # the first try raised, the task retries in 5 s
    node_update(node=Node.objects.get(pk=node.pk), maintenance=True)
    job = job_begin(job_id=job.pk)  # the retry
    assert job.attempts == 2
    node_spot_check_run(job=job)
    node_update(node=Node.objects.get(pk=node.pk), maintenance=False)
    node.refresh_from_db()
    assert node.state == NodeState.ACTIVE
    if first_try == "platform_busy":  # the platform's doing: no penalty, the spot check comes again
        assert node.next_check_at == future
        assert nodes_reverify_due()["spot_checks"] == 1
        return
    assert node.next_check_at <= timezone.now()  # brought forward, as a dodge spent on the task's retries
    assert "dropped it" in NodeEvent.objects.get(node=node, kind="spot_check_failed_to_run").message
    assert nodes_reverify_due()["queued"] == 1


# ------------------------------------------------------------------------------------ #7: one node, not the beat

@pytest.mark.parametrize("error", [Conflict("A retired node cannot be verified."), RuntimeError("boom")],
                         ids=["conflict", "error"])
def test_one_nodes_failure_does_not_stop_the_beat_for_the_others(db, bounds, monkeypatch, error):
    first, second = make_listed_node(), make_listed_node()
    Node.objects.filter(pk__in=[first.pk, second.pk]).update(next_check_at=timezone.now() - timedelta(seconds=1))
    original = maintenance.node_verify_request

    def fails_for_the_first(*, node, reason=""):
        if node.pk == first.pk:
            raise error
        return original(node=node, reason=reason)

    monkeypatch.setattr(maintenance, "node_verify_request", fails_for_the_first)
    summary = nodes_reverify_due()
    assert summary == ({"queued": 1, "spot_checks": 0, "waiting": 1} if isinstance(error, Conflict)
                       else {"queued": 1, "spot_checks": 0, "waiting": 0, "errors": 1})
    assert _verify_jobs(second).exists() and not _verify_jobs(first).exists()


# ------------------------------------------------------------------------------------ over SSH: #3, #5

def _dicts(value):
    if isinstance(value, dict):
        yield value
        value = list(value.values())
    if isinstance(value, list):
        for item in value:
            yield from _dicts(item)


@pytest.mark.slow
def test_free_mig_slices_are_spot_checked(db, simnode, simbase, bounds, settings):
    settings.BILLING_REQUIRE_FUNDS = False
    node, _ = verify(register(simnode, simbase, "a100-80gb-sxm-x2-mig"))
    assert node.verdict == "verified", node.last_error
    rent(node)  # GPU 1 whole; GPU 0 is split, its slices all free and on offer
    assert MigSlice.objects.filter(node=node, status="free").count() >= 2
    assert not GpuAllocation.objects.filter(gpu__node=node, gpu__index=0, released_at__isnull=True).exists()
    job = spot_check(node)
    said = [m["message"] for m in job.log]
    assert job.status == JobStatus.SUCCEEDED, said
    assert not [m for m in said if "skipped" in m], said
    assert [m for m in said if m.startswith("challenging GPU 0's MIG")], said
    event = NodeEvent.objects.get(node=node, kind="spot_check_passed")
    assert "MIG slice" in event.message, event.message

    # Its 3g.40gb slice now has one compute slice of seven, its shim reporting three (the -slice-slow profile's lie)
    data = copy.deepcopy(profile_data("a100-80gb-sxm-x2-mig"))
    slow = next(d for d in _dicts(data) if str(d.get("uuid", "")).startswith("MIG-") and d.get("compute_slices") == 3)
    slow.update(compute_slices=1, reported_compute_slices=3)
    use_hardware(simnode, data)
    job = spot_check(node)
    assert NodeEvent.objects.filter(node=node, kind="spot_check_failed").exists(), [m["message"] for m in job.log]
    assert _verify_jobs(node).exists()


@pytest.mark.slow
def test_a_free_card_missing_from_the_spot_checks_inventory_is_a_dodge(db, simnode, simbase, bounds, settings):
    settings.BILLING_REQUIRE_FUNDS = False
    node, _ = verify(register(simnode, simbase, "rtx-a4000-x2"))
    inst = rent(node)
    rented = GpuAllocation.objects.get(instance=inst, released_at__isnull=True).gpu
    VerificationRun.objects.filter(node=node).update(created_at=timezone.now() - timedelta(days=1))
    data = copy.deepcopy(profile_data("rtx-a4000-x2"))
    data["nvidia_smi"] = [line for line in data["nvidia_smi"] if rented.uuid in line]  # free card not shown
    use_hardware(simnode, data)
    job = spot_check(node)
    node.refresh_from_db()
    assert (job.status, job.fault) == (JobStatus.FAILED, "node"), job.log
    assert "did not answer to nvidia-smi" in job.error
    assert NodeEvent.objects.get(node=node, kind="spot_check_gpu_missing").level == NodeEvent.Level.WARNING
    assert node.next_check_at <= timezone.now()  # brought forward, as for a dropped connection
    assert nodes_reverify_due()["queued"] == 1
