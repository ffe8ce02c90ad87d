"""Faults inside the control plane itself: a node whose SSH slots are all taken (NodeBusy), and pending nodes
whose verification keeps failing. A busy node is a transient condition: jobs wait for it without failing the
renter's instance or using up the retries meant for unreachable nodes, and fleet loops count it and go on.
Pending verifications back off and stop after a few failures in a row, telling the provider why."""
import functools
from datetime import timedelta

import pytest
from celery.canvas import Signature
from celery.exceptions import Retry
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from django.core.cache import cache
from django.utils import timezone

from marketplace.models import GpuAllocation, Image, Instance, InstanceStatus, Node, NodeState, Verdict
from marketplace.services import instances as instance_svc
from provisioning import concurrency, sim, tasks
from provisioning.concurrency import MAX_SESSIONS_PER_NODE, NodeBusy, node_slot
from provisioning.models import Job, JobFault, JobKind, JobStatus, NodeEvent
from provisioning.services import maintenance
from provisioning.services.maintenance import nodes_reconcile, nodes_verify_pending
from provisioning.services.nodes import node_health_probe
from provisioning.services.runner import job_begin
from provisioning.services.verification import BenchmarkTimeout, node_verify_failed, node_verify_request
from provisioning.ssh_errors import NodeError
from tests.factories import UserFactory, make_listed_node, make_node


@pytest.fixture(autouse=True)
def sent_jobs(monkeypatch):
    """Jobs handed to Celery on commit are recorded instead (no worker here)."""
    sent = []
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: sent.append((job_id, kind)))
    return sent


@pytest.fixture
def short_slot_wait(monkeypatch):
    """Sessions wait 0.2 s for a free slot instead of a minute."""
    monkeypatch.setattr("provisioning.services.nodes.node_slot", functools.partial(node_slot, wait_s=0.2))


def take_every_slot(node: Node) -> None:
    """Other workers hold every SSH session the platform allows to the node."""
    for slot in range(MAX_SESSIONS_PER_NODE):
        assert cache.add(f"node-ssh-slot:{node.pk}:{slot}", "another-worker", timeout=60)


@pytest.fixture
def resent(monkeypatch):
    """Tasks sent to the broker again (a retry), recorded instead of sent."""
    sent = []
    monkeypatch.setattr(Signature, "apply_async", lambda self, *a, **kw: sent.append(self))
    return sent


def run_in_worker(task, job: Job, retries: int = 0):
    """Run the job's task as a worker delivery with `retries` retries behind it would."""
    task.push_request(id=f"task-{job.pk}", args=[job.pk], kwargs={}, retries=retries, called_directly=False,
                      delivery_info={"exchange": "", "routing_key": "celery"})
    try:
        tasks.run_job(task, job.pk)
    finally:
        task.pop_request()


def book(node: Node) -> Instance:
    key = ed25519.Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    instance, _ = instance_svc.instance_create(renter=UserFactory(), node_id=node.pk, num_gpus=1,
                                               image=Image.objects.filter(active=True).first(), ssh_public_keys=[key])
    return instance


# ------------------------------------------------------------------------------------------- NodeBusy


def test_node_busy_is_a_transient_node_error(db):
    assert issubclass(NodeBusy, NodeError) and NodeBusy.transient and NodeBusy.code == "node_busy"
    node = make_node()
    take_every_slot(node)
    with pytest.raises(NodeBusy) as busy, node_slot(node.pk, wait_s=0.1):
        pass
    assert f"{MAX_SESSIONS_PER_NODE} SSH sessions open to node {node.pk}" in busy.value.message
    assert concurrency.NodeBusy is NodeBusy


def test_a_busy_node_retries_the_renters_job_without_failing_it_or_using_up_retries(db, short_slot_wait, resent,
                                                                                       settings):
    settings.NODE_BUSY_RETRY_S = 30
    node = make_listed_node()
    instance = book(node)
    job = instance.jobs.get(kind=JobKind.INSTANCE_PROVISION)
    take_every_slot(node)
    with pytest.raises(Retry):
        run_in_worker(tasks.instance_provision, job, retries=2)
    [again] = resent
    assert again.options["countdown"] == 30 and again.options["retries"] == 2  # the retry budget is untouched
    assert again.args == (job.pk,) or list(again.args) == [job.pk]
    instance.refresh_from_db()
    job.refresh_from_db()
    assert instance.status == InstanceStatus.PROVISIONING  # not failed, GPUs kept
    assert GpuAllocation.objects.filter(instance=instance, released_at__isnull=True).count() == 1
    assert job.status == JobStatus.RUNNING and "waiting for the node" in job.step and "30 s" in job.step

    # Retried as often as the deadline allows, even with the unreachable-node retries all used.
    with pytest.raises(Retry):
        run_in_worker(tasks.instance_provision, job, retries=tasks.JOB_TASK_OPTIONS["max_retries"])
    assert resent[-1].options["retries"] == tasks.JOB_TASK_OPTIONS["max_retries"]
    job.refresh_from_db()
    assert job.attempts == 2 and job.status == JobStatus.RUNNING


def test_a_node_busy_past_the_jobs_deadline_fails_it_in_words(db, short_slot_wait, resent, settings):
    settings.NODE_BUSY_RETRY_S = 30
    node = make_listed_node()
    instance = book(node)
    job = instance.jobs.get(kind=JobKind.INSTANCE_PROVISION)
    Job.objects.filter(pk=job.pk).update(deadline=timezone.now() + timedelta(seconds=20))
    take_every_slot(node)
    run_in_worker(tasks.instance_provision, job)
    assert resent == []
    job.refresh_from_db()
    instance.refresh_from_db()
    assert job.status == JobStatus.FAILED and "kept this job waiting until its deadline" in job.error
    assert job.fault == JobFault.PLATFORM and "does not count against the node" in job.error
    assert "Internal error" not in job.error and instance.status == InstanceStatus.FAILED
    assert not GpuAllocation.objects.filter(instance=instance, released_at__isnull=True).exists()


def test_a_busy_node_retries_its_verification_too(db, short_slot_wait, resent):
    node = make_node()
    job = node_verify_request(node=node)
    take_every_slot(node)
    with pytest.raises(Retry):
        run_in_worker(tasks.node_verify, job)
    node.refresh_from_db()
    job.refresh_from_db()
    assert node.state == NodeState.VERIFYING and job.status == JobStatus.RUNNING and len(resent) == 1
    assert not NodeEvent.objects.filter(node=node, kind="verification_failed").exists()


# ---------------------------------------------------------------------------------- fleet loops, busy


@pytest.fixture(scope="module")
def simbase(tmp_path_factory):
    base = tmp_path_factory.mktemp("faults-simnodes")
    yield base
    sim.nodes_down(base)


@pytest.fixture(scope="module")
def simnode(simbase):
    return sim.node_up("rtx-a4000-x2", simbase)


def listed_sim_node(simnode, simbase) -> Node:
    node = make_listed_node(UserFactory(), gpu_model="rtx-a4000", gpu_count=2, address=simnode["address"],
                            ssh_port=simnode["ssh_port"], ssh_user=simnode["ssh_user"],
                            host_key_fingerprint=simnode["host_key_fingerprint"])
    sim.node_authorize(simnode["ssh_port"], node.ssh_public_key, simbase)
    return node


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_busy_node_does_not_abort_the_health_check(simnode, simbase, short_slot_wait):
    busy = make_listed_node()  # first in line
    take_every_slot(busy)
    healthy = listed_sim_node(simnode, simbase)
    probe = node_health_probe(busy)
    assert probe.busy and not probe.ok and "SSH sessions open" in probe.error
    assert not node_health_probe(healthy).busy
    summary = maintenance.nodes_health_check()
    assert summary["checked"] == 2 and summary["busy"] == 1 and summary["failed"] == 0
    healthy.refresh_from_db()
    assert healthy.last_seen_at is not None and healthy.health_failures == 0  # the next node was checked
    busy.refresh_from_db()
    assert busy.health_failures == 0  # busy is alive, not a missed check: its renters are not interrupted


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_busy_node_does_not_abort_the_reconcile_loop(simnode, simbase, short_slot_wait):
    busy = make_listed_node()  # reconciled first (nodes go in id order)
    take_every_slot(busy)
    listed_sim_node(simnode, simbase)
    summary = nodes_reconcile()
    assert summary["nodes"] == 1 and summary["busy"] == 1  # counted, and on to the next node


# ------------------------------------------------------------------------------ pending verifications


def fail_verification(job: Job, message: str = "") -> Job:
    """The worker ran the job and the benchmark hung (the node goes back to pending)."""
    job = job_begin(job_id=job.pk)
    node_verify_failed(job=job, error=BenchmarkTimeout(
        message or "The benchmark did not finish within 300 s and was stopped. Check that the GPUs and their "
                   "driver respond (`nvidia-smi`), then verify again."))
    job.refresh_from_db()
    return job


def verify_jobs(node: Node) -> list[Job]:
    return list(Job.objects.filter(node=node, kind=JobKind.NODE_VERIFY).order_by("created_at", "id"))


def test_pending_verifications_back_off_then_stop_and_the_provider_is_told(db, client_for):
    provider = UserFactory()
    node = make_node(provider)
    t0 = timezone.now()
    fail_verification(node_verify_request(node=node))  # the provider's first Verify: the benchmark hangs
    schedule = [(9, 11), (29, 31), (119, 121)]  # minutes after a failure: still waiting, then retried
    for failures, (early, due) in enumerate(schedule, start=1):
        assert nodes_verify_pending(now=t0 + timedelta(minutes=early))["queued"] == 0
        assert nodes_verify_pending(now=t0 + timedelta(minutes=due))["queued"] == 1
        job = verify_jobs(node)[-1]
        assert job.log[0]["message"] == f"queued: automatic retry (try {failures + 1} of 4)"
        fail_verification(job)
    assert len(verify_jobs(node)) == 4

    # Four failures in a row: no more automatic retries, and the provider is told what to do, once.
    for days in (1, 2, 30):
        summary = nodes_verify_pending(now=t0 + timedelta(days=days))
        # Told at the first beat; from then on not looked at again until asked by hand (review r54).
        assert summary["queued"] == 0 and summary["stopped"] == (1 if days == 1 else 0)
    assert len(verify_jobs(node)) == 4
    node.refresh_from_db()
    assert node.state == NodeState.PENDING
    assert "failed 4 times in a row" in node.last_error and "nvidia-smi" in node.last_error
    assert f"POST /api/v1/nodes/{node.pk}/verify/" in node.last_error
    [told] = NodeEvent.objects.filter(node=node, kind="verification_retries_stopped")
    assert told.message == node.last_error and told.level == NodeEvent.Level.WARNING

    # The provider asks again by hand: a new series begins (that try counts as its first).
    response = client_for(provider).post(f"/api/v1/nodes/{node.pk}/verify/")
    assert response.status_code == 202
    fail_verification(verify_jobs(node)[-1])
    assert nodes_verify_pending(now=t0 + timedelta(minutes=9))["queued"] == 0
    assert nodes_verify_pending(now=t0 + timedelta(minutes=11))["queued"] == 1
    assert verify_jobs(node)[-1].log[0]["message"] == "queued: automatic retry (try 2 of 4)"


def test_a_success_ends_the_series_and_an_open_job_is_waited_for(db):
    node = make_node()
    never_tried = make_node()
    t0 = timezone.now()
    for _ in range(3):
        fail_verification(node_verify_request(node=node))  # asked by hand each time: each one starts a series
    job = node_verify_request(node=node)
    assert nodes_verify_pending(now=t0 + timedelta(days=1)) == {"queued": 1, "waiting": 0, "stopped": 0,
                                                                "errors": 0}  # only the never-tried node
    assert Job.objects.filter(node=never_tried, kind=JobKind.NODE_VERIFY).count() == 1
    Job.objects.filter(pk=job.pk).update(status=JobStatus.SUCCEEDED, finished_at=timezone.now())
    Node.objects.filter(pk=node.pk).update(state=NodeState.PENDING, verdict=Verdict.UNVERIFIED)
    for _ in range(3):  # three automatic failures after a success: not yet four in a row
        Job.objects.create(kind=JobKind.NODE_VERIFY, node=node, status=JobStatus.FAILED, error="unreachable",
                           fault=JobFault.NODE, finished_at=timezone.now(), deadline=timezone.now(),
                           log=[{"at": "", "message": "queued: automatic retry (try 1 of 4)"}])
    assert maintenance._failures_in_a_row(list(Job.objects.filter(node=node).order_by("-created_at", "-id"))) == 3


def test_one_nodes_trouble_does_not_keep_the_others_waiting(db, monkeypatch):
    broken, fine = make_node(), make_node()
    real = node_verify_request

    def request(*, node, reason=""):
        if node.pk == broken.pk:
            raise RuntimeError("boom")
        return real(node=node, reason=reason)

    monkeypatch.setattr("provisioning.services.maintenance.node_verify_request", request)
    summary = nodes_verify_pending()
    assert summary["errors"] == 1 and summary["queued"] == 1
    assert Job.objects.filter(node=fine, kind=JobKind.NODE_VERIFY).exists()


def test_verify_pending_runs_once_at_a_time_and_often_enough_for_its_backoff(db, settings):
    node = make_node()
    with maintenance.singleton("nodes_verify_pending", ttl=600):
        assert nodes_verify_pending()["skipped"]
    assert not Job.objects.filter(node=node).exists()
    assert settings.CELERY_BEAT_SCHEDULE["nodes-verify-pending"]["schedule"] <= 60
    assert maintenance.PENDING_RETRY_BACKOFF[0] == timedelta(minutes=10)
