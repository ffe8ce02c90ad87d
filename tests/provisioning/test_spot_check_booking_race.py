"""Review r54 #4: a spot check runs the platform's challenge and memory proof (>= 95 % of each card's memory) on
the node's cards that were free when it read them, holding none of them: the node stays bookable. A renter who
booked one of them meanwhile had their VM created on the card while the challenge and the memory proof ran there
(its first minute shared, its workload out of memory). Now the booking is accepted at once as before, and the job
that creates (or starts) the VM waits until the spot check ends, telling the renter why; a spot check past its
deadline holds it while its worker still beats (it started late), nothing once its heartbeat is stale (its worker
lost). A re-verification of an active node (the benchmark, the challenge and the memory proof on its free cards,
the node bookable meanwhile) is waited for the same way. A job that waited fails at no charge when the check
rejected the node or a card it holds was lost meanwhile (a start: stopped again), and waits NODE_CHECK_WAIT_MAX_S
at most.

Real parts: a sim server over SSH with the real agent (its VMs real sshd processes), the spot check and the VM jobs
run as a worker's deliveries run them (tests/marketplace/sim_renting.deliver), a retry recorded, not sent."""
from datetime import timedelta

import pytest
from celery.canvas import Signature
from django.conf import settings as django_settings
from django.utils import timezone

from marketplace.models import Gpu, GpuAllocation, Instance, InstanceStatus, MigSlice, Node
from marketplace.services import instances as instance_svc
from provisioning import tasks
from provisioning.models import Job, JobKind, JobStatus
from provisioning.services import spot_checks, verification
from provisioning.services.jobs import JOB_DEADLINES
from provisioning.services.nodes import node_session
from provisioning.services.runner import job_begin, job_finish
from provisioning.services.spot_checks import node_spot_check_request, node_spot_check_run
from provisioning.services.verification import node_verify_request, node_verify_run
from provisioning.services.vms import CHECK_FAILED_TOLD, CHECK_TOO_LONG_TOLD, NODE_CHECK_WAIT_MAX_S
from provisioning.ssh import NodeSession
from provisioning.verification.model import REJECT, Finding
from tests.factories import UserFactory
from tests.marketplace.renting_helpers import book
from tests.marketplace.sim_renting import deliver, deliver_until_closed, job_of
from tests.provisioning.test_benchmark_verification import register, simbase, simnode, verify
from tests.provisioning.test_random_rechecks import bounds

__all__ = ["bounds", "simbase", "simnode"]

pytestmark = pytest.mark.slow

MIG_PROFILE = "a100-80gb-sxm-x2-mig"  # GPU 0 split into slices on the server; GPU 1 whole


@pytest.fixture(autouse=True)
def sent_jobs(monkeypatch, settings):
    """Jobs are run by the test, not sent; a retry is recorded, not sent."""
    settings.BILLING_REQUIRE_FUNDS = False
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: None)
    retries: list[Signature] = []
    monkeypatch.setattr(Signature, "apply_async", lambda self, *a, **kw: retries.append(self))
    return retries


@pytest.fixture
def sent(monkeypatch):
    """(when, what) of each agent command sent to the node: `vm create`, `exchange memproof`, ..."""
    calls: list[tuple[object, str]] = []
    agent, exchange = NodeSession.agent, NodeSession.exchange

    def recorded_agent(session, command, sub=None, request=None, timeout=None):
        calls.append((timezone.now(), f"{command} {sub or ''}".strip()))
        return agent(session, command, sub, request, timeout)

    def recorded_exchange(session, command):
        calls.append((timezone.now(), f"exchange {command}"))
        return exchange(session, command)

    monkeypatch.setattr(NodeSession, "agent", recorded_agent)
    monkeypatch.setattr(NodeSession, "exchange", recorded_exchange)
    return calls


@pytest.fixture
def node(db, simnode, simbase, bounds):
    made, _ = verify(register(simnode, simbase, "rtx-a4000-x2"))
    assert made.verdict == "verified", made.last_error
    yield made
    _remove_vms(made)


def _remove_vms(node: Node) -> None:
    """The next test starts on an empty server."""
    with node_session(Node.objects.get(pk=node.pk)) as session:
        for vm in session.agent("vm", "list", {"runtime": "sim"})["vms"]:
            session.agent("vm", "destroy", {"runtime": "sim", "vm_id": vm["vm_id"]})


def _row(instance: Instance) -> Instance:
    return Instance.objects.select_related("node").get(pk=instance.pk)


def _running_spot_check(node: Node) -> Job:
    job = job_begin(job_id=node_spot_check_request(node=node).pk)
    assert job is not None and job.status == JobStatus.RUNNING
    return job


SPOT_TOLD = "Waiting for the server's spot check (the platform's check of its idle GPUs) to end, about a minute."
VERIFY_TOLD = ("Waiting for the server's re-check of its GPUs (the platform's benchmark and checks of its idle GPUs) "
               "to end, a few minutes.")


def _waits_for(job: Job, spot: Job, sent_jobs: list[Signature], settings, *, since=None,
               what: str = "the server's spot check", told: str = SPOT_TOLD) -> None:
    """The delivery of the VM job just ran: it waited for the check, touching nothing on the node. `since`: when
    the delivery began, for a check past its deadline (the job's time counts from then)."""
    job.refresh_from_db()
    instance = job.instance
    assert job.status == JobStatus.RUNNING and job.runner == ""  # released for its retry
    assert job.step.startswith(f"waiting for the node: {what} (job {spot.pk}) runs"), job.step
    assert "once it ends" in job.step
    assert instance.status_message == told
    assert instance.status in (InstanceStatus.PROVISIONING, InstanceStatus.STARTING)  # not billed: not running
    assert sent_jobs[-1].options.get("countdown") == settings.NODE_BUSY_RETRY_S
    assert sent_jobs[-1].options.get("retries", 0) == 0  # the wait spends none of the node's retries
    after = max(spot.deadline, since) if since else spot.deadline
    assert job.deadline >= after + timedelta(seconds=JOB_DEADLINES[job.kind])  # its whole time left after the wait


def test_a_booking_landing_while_a_spot_check_runs_gets_its_vm_only_after_it_ended(node, sent, sent_jobs, monkeypatch,
                                                                                   settings):
    spot = _running_spot_check(node)
    booked = {}
    challenge = spot_checks.node_challenge

    def booking_lands_meanwhile(job, session, declared, gpus):
        # The spot check read GPUs 0 and 1 free and is about to challenge them: a renter books one now.
        assert gpus == [0, 1]
        _beat(job, 0)  # as its worker's heartbeat thread keeps it (runner.JobHeartbeat)
        instance = book(UserFactory(), node)
        provision = job_of(instance, JobKind.INSTANCE_PROVISION)
        booked.update(instance=instance, job=provision,
                      first=deliver(tasks.instance_provision, provision), at=len(sent))
        return challenge(job, session, declared, gpus)

    monkeypatch.setattr(spot_checks, "node_challenge", booking_lands_meanwhile)
    node_spot_check_run(job=spot)
    spot.refresh_from_db()
    assert spot.status == JobStatus.SUCCEEDED, spot.log
    said = [line["message"] for line in spot.log]
    assert [m for m in said if m.startswith("memory proof on GPUs 0, 1")], said  # its card too: booked after the read

    # The booking was accepted at once (the GPU rented in the database), its VM not created: the job waited.
    assert booked["first"] == "retry"
    instance, provision = booked["instance"], booked["job"]
    assert not [what for _, what in sent if what == "vm create"], sent
    _waits_for(provision, spot, sent_jobs, settings)
    assert instance.started_at is None  # nothing billed: billing starts when the VM runs
    assert sent[booked["at"]:] and all(what.startswith("exchange ") for _, what in sent[booked["at"]:]), sent

    assert deliver(tasks.instance_provision, provision, retries=0) == "done"  # the retry, after the spot check
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.RUNNING, instance.status_message
    creates = [(at, i) for i, (at, what) in enumerate(sent) if what == "vm create"]
    proofs = [i for i, (_, what) in enumerate(sent) if what == "exchange memproof"]
    assert len(creates) == 1 and proofs and creates[0][1] > max(proofs), sent
    assert creates[0][0] > spot.finished_at  # created only after the spot check ended
    assert instance.started_at > spot.finished_at  # and billed from when it runs


def _beat(job: Job, s_ago: float) -> None:
    Job.objects.filter(pk=job.pk).update(heartbeat_at=timezone.now() - timedelta(seconds=s_ago))


def test_a_spot_check_past_its_deadline_holds_a_booking_while_its_worker_beats_not_once_it_was_lost(node, sent_jobs,
                                                                                                     settings):
    """Its deadline counts from its creation: one that started late (a busy queue, a retry) still runs its memory
    proof past it, and the reaper spares it while it beats (jobs.job_alive). Before, the booking's VM was created
    on the card under test as soon as the deadline passed."""
    spot = _running_spot_check(node)
    instance = book(UserFactory(), node)
    provision = job_of(instance, JobKind.INSTANCE_PROVISION)
    assert deliver(tasks.instance_provision, provision) == "retry"
    _waits_for(provision, spot, sent_jobs, settings)

    Job.objects.filter(pk=spot.pk).update(deadline=timezone.now() - timedelta(seconds=1))  # its bound passed
    _beat(spot, 1)  # its worker still at work
    since = timezone.now()
    assert deliver(tasks.instance_provision, provision) == "retry"
    spot.refresh_from_db()
    _waits_for(provision, spot, sent_jobs, settings, since=since)
    assert "past its deadline" in provision.step, provision.step

    _beat(spot, django_settings.JOB_HEARTBEAT_STALE_S + 5)  # its worker lost: the reaper's to close
    assert deliver(tasks.instance_provision, provision) == "done"
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.RUNNING, instance.status_message
    assert Job.objects.get(pk=spot.pk).status == JobStatus.RUNNING  # the reaper's to close, not the booking's


def test_a_queued_or_ended_spot_check_holds_nothing(node, sent_jobs):
    """Queued, it has not read the free cards yet: it will see the booking's GPU rented and leave it alone."""
    spot = node_spot_check_request(node=node)
    instance = book(UserFactory(), node)
    assert deliver(tasks.instance_provision, job_of(instance, JobKind.INSTANCE_PROVISION)) == "done"
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.RUNNING, instance.status_message
    spot = job_begin(job_id=spot.pk)
    node_spot_check_run(job=spot)
    said = [line["message"] for line in Job.objects.get(pk=spot.pk).log]
    assert [m for m in said if m.startswith("memory proof on GPU 1 ")], said  # the rented card left alone


def test_a_start_that_takes_gpus_again_waits_for_a_running_spot_check(node, sent_jobs, settings):
    instance = book(UserFactory(), node)
    deliver_until_closed(tasks.instance_provision, job_of(instance, JobKind.INSTANCE_PROVISION))
    instance_svc.instance_stop(instance=_row(instance))
    deliver_until_closed(tasks.instance_stop, job_of(instance, JobKind.INSTANCE_STOP))
    assert _row(instance).status == InstanceStatus.STOPPED

    spot = _running_spot_check(node)  # reads its GPU free: the instance released it when it stopped
    instance_svc.instance_start(instance=_row(instance))
    start = job_of(instance, JobKind.INSTANCE_START)
    assert deliver(tasks.instance_start, start) == "retry"
    _waits_for(start, spot, sent_jobs, settings)
    assert _row(instance).status == InstanceStatus.STARTING

    job_finish(job=spot)  # the spot check ended
    assert deliver(tasks.instance_start, start) == "done"
    assert _row(instance).status == InstanceStatus.RUNNING


def test_a_mig_slice_booked_while_a_spot_check_challenges_free_slices_waits_too(db, simnode, simbase, bounds, sent,
                                                                                  sent_jobs, monkeypatch, settings):
    node, _ = verify(register(simnode, simbase, MIG_PROFILE))
    assert node.verdict == "verified", node.last_error
    try:
        book(UserFactory(), node)  # GPU 1 whole: only GPU 0's free slices are left to check
        spot = _running_spot_check(node)
        booked = {}
        challenge = spot_checks.node_slice_challenge

        def booking_lands_meanwhile(job, session, declared, inventory, uuids):
            _beat(job, 0)
            instance = book(UserFactory(), node, mig_profile="3g.40gb")
            provision = job_of(instance, JobKind.INSTANCE_PROVISION)
            held = set(MigSlice.objects.filter(node=node, status="rented").values_list("uuid", flat=True))
            booked.update(instance=instance, job=provision, tested=held & set(uuids),
                          first=deliver(tasks.instance_provision, provision))
            return challenge(job, session, declared, inventory, uuids)

        monkeypatch.setattr(spot_checks, "node_slice_challenge", booking_lands_meanwhile)
        node_spot_check_run(job=spot)
        spot.refresh_from_db()
        assert spot.status == JobStatus.SUCCEEDED, spot.log
        assert booked["tested"], "the booked slice is among those the spot check read free"
        assert booked["first"] == "retry"
        assert not [what for _, what in sent if what == "vm create"], sent
        _waits_for(booked["job"], spot, sent_jobs, settings)

        assert deliver(tasks.instance_provision, booked["job"]) == "done"
        instance = _row(booked["instance"])
        assert instance.status == InstanceStatus.RUNNING, instance.status_message
        created = [at for at, what in sent if what == "vm create"]
        assert len(created) == 1 and created[0] > spot.finished_at, sent
    finally:
        _remove_vms(node)


def test_a_booking_landing_while_an_active_node_is_re_verified_gets_its_vm_only_after_it_ended(node, sent, sent_jobs,
                                                                                               monkeypatch, settings):
    """A re-verification leaves an active node bookable and benchmarks, challenges and proves the memory of the
    cards free when it read them, for minutes: a card booked after that read waits for it as for a spot check."""
    check = job_begin(job_id=node_verify_request(node=node, reason="scheduled re-verification").pk)
    assert check is not None and check.status == JobStatus.RUNNING
    booked = {}
    challenge = verification.node_challenge

    def booking_lands_meanwhile(job, session, declared, gpus):
        assert gpus == [0, 1]  # read free, benchmarked: a renter books one now
        _beat(job, 0)
        instance = book(UserFactory(), node)
        provision = job_of(instance, JobKind.INSTANCE_PROVISION)
        booked.update(instance=instance, job=provision, first=deliver(tasks.instance_provision, provision))
        return challenge(job, session, declared, gpus)

    monkeypatch.setattr(verification, "node_challenge", booking_lands_meanwhile)
    node_verify_run(job=check)
    check.refresh_from_db()
    assert check.status == JobStatus.SUCCEEDED, check.log
    assert Node.objects.get(pk=node.pk).verdict == "verified"
    said = [line["message"] for line in check.log]
    assert [m for m in said if m.startswith("memory proof on GPUs 0, 1")], said  # its card too

    assert booked["first"] == "retry"
    assert not [what for _, what in sent if what == "vm create"], sent
    _waits_for(booked["job"], check, sent_jobs, settings, what="the server's re-check of its GPUs", told=VERIFY_TOLD)
    assert deliver(tasks.instance_provision, booked["job"]) == "done"
    instance = _row(booked["instance"])
    assert instance.status == InstanceStatus.RUNNING, instance.status_message
    created = [at for at, what in sent if what == "vm create"]
    assert len(created) == 1 and created[0] > check.finished_at, sent
    assert instance.started_at > check.finished_at  # billed from when it runs


def _held_gpu(instance: Instance) -> Gpu:
    return GpuAllocation.objects.select_related("gpu").get(instance_id=instance.pk, released_at__isnull=True).gpu


def _failed_uncharged(instance: Instance, job: Job, told: str, sent: list) -> None:
    """The VM job ended without a VM: the instance failed with `told`, nothing billed, its GPU let go."""
    instance = _row(instance)
    assert instance.status == InstanceStatus.FAILED, instance.status_message
    assert instance.status_message == told
    assert instance.started_at is None  # never ran: nothing billed
    assert not GpuAllocation.objects.filter(instance_id=instance.pk, released_at__isnull=True).exists()
    assert not [what for _, what in sent if what == "vm create"], sent
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED and job.error, job.log


def test_a_booking_that_waited_for_a_re_verification_rejecting_the_node_fails_uncharged(node, sent, sent_jobs,
                                                                                        monkeypatch):
    """Its card was tested (booked after the check read the free cards) and the check rejected the node: the node
    stays active for its renters, the waiting instance among them, so before, its VM was created there all the same,
    perhaps on the card that failed."""
    check = job_begin(job_id=node_verify_request(node=node, reason="scheduled re-verification").pk)
    booked = {}
    challenge = verification.node_challenge

    def booking_lands_then_its_card_fails(job, session, declared, gpus):
        _beat(job, 0)
        instance = book(UserFactory(), node)
        provision = job_of(instance, JobKind.INSTANCE_PROVISION)
        booked.update(instance=instance, job=provision, first=deliver(tasks.instance_provision, provision))
        found, figures = challenge(job, session, declared, gpus)
        index = _held_gpu(instance).index
        return [*found, Finding(REJECT, "challenge_wrong", f"GPU {index} got the challenge wrong.", index)], figures

    monkeypatch.setattr(verification, "node_challenge", booking_lands_then_its_card_fails)
    node_verify_run(job=check)
    after = Node.objects.get(pk=node.pk)
    assert after.verdict == "rejected" and after.state == "active"  # kept active for its renter
    assert booked["first"] == "retry"
    gpu = _held_gpu(booked["instance"])

    assert deliver(tasks.instance_provision, booked["job"]) == "done"
    _failed_uncharged(booked["instance"], booked["job"], CHECK_FAILED_TOLD[JobKind.INSTANCE_PROVISION].format(
        why="the check rejected it"), sent)
    assert Gpu.objects.get(pk=gpu.pk).status == "free"


def test_a_booking_that_waited_while_its_gpu_was_lost_fails_uncharged(node, sent, sent_jobs):
    spot = _running_spot_check(node)
    instance = book(UserFactory(), node)
    provision = job_of(instance, JobKind.INSTANCE_PROVISION)
    assert deliver(tasks.instance_provision, provision) == "retry"
    gpu = _held_gpu(instance)
    Gpu.objects.filter(pk=gpu.pk).update(lost_at=timezone.now())  # its health check lost it (gpu_presence)
    job_finish(job=spot)

    assert deliver(tasks.instance_provision, provision) == "done"
    _failed_uncharged(instance, provision, CHECK_FAILED_TOLD[JobKind.INSTANCE_PROVISION].format(
        why=f"GPU {gpu.index} booked for it, lost or out of service"), sent)
    assert Gpu.objects.get(pk=gpu.pk).status == "unavailable"  # released, out of the offers while lost


def test_a_vm_job_waits_for_a_check_at_most_node_check_wait_max_s(node, sent, sent_jobs):
    """A check that goes on (retries after retries, each beating) no longer re-pushes the booking's wait for up to
    an hour: NODE_CHECK_WAIT_MAX_S after the VM job's creation, the booking fails at no charge."""
    spot = _running_spot_check(node)
    instance = book(UserFactory(), node)
    provision = job_of(instance, JobKind.INSTANCE_PROVISION)
    assert deliver(tasks.instance_provision, provision) == "retry"
    provision.refresh_from_db()
    cap = timedelta(seconds=NODE_CHECK_WAIT_MAX_S + JOB_DEADLINES[JobKind.INSTANCE_PROVISION])
    assert provision.deadline <= provision.created_at + cap

    Job.objects.filter(pk=provision.pk).update(created_at=timezone.now() - timedelta(seconds=NODE_CHECK_WAIT_MAX_S))
    _beat(spot, 0)  # still at work
    assert deliver(tasks.instance_provision, provision) == "done"
    _failed_uncharged(instance, provision, CHECK_TOO_LONG_TOLD[JobKind.INSTANCE_PROVISION], sent)


def test_a_check_whose_worker_was_lost_before_its_deadline_holds_nothing(node, sent_jobs):
    """The reaper spares it until its deadline (jobs.job_alive), up to 900 s for a verification; the booking's
    wait needs its worker beating (a running or retry-waiting check always has a fresh heartbeat)."""
    spot = _running_spot_check(node)
    _beat(spot, django_settings.JOB_HEARTBEAT_STALE_S + 5)
    assert Job.objects.get(pk=spot.pk).deadline > timezone.now()
    instance = book(UserFactory(), node)
    assert deliver(tasks.instance_provision, job_of(instance, JobKind.INSTANCE_PROVISION)) == "done"
    assert _row(instance).status == InstanceStatus.RUNNING, _row(instance).status_message


def test_a_start_that_waited_while_its_gpu_was_lost_is_stopped_again_uncharged(node, sent_jobs):
    instance = book(UserFactory(), node)
    deliver_until_closed(tasks.instance_provision, job_of(instance, JobKind.INSTANCE_PROVISION))
    instance_svc.instance_stop(instance=_row(instance))
    deliver_until_closed(tasks.instance_stop, job_of(instance, JobKind.INSTANCE_STOP))
    spot = _running_spot_check(node)
    instance_svc.instance_start(instance=_row(instance))
    start = job_of(instance, JobKind.INSTANCE_START)
    assert deliver(tasks.instance_start, start) == "retry"
    gpu = _held_gpu(instance)
    Gpu.objects.filter(pk=gpu.pk).update(lost_at=timezone.now())
    job_finish(job=spot)

    assert deliver(tasks.instance_start, start) == "done"
    after = _row(instance)
    assert after.status == InstanceStatus.STOPPED, after.status_message  # the start failure's own end: disk kept
    assert after.status_message == CHECK_FAILED_TOLD[JobKind.INSTANCE_START].format(
        why=f"GPU {gpu.index} booked for it, lost or out of service")
    assert not GpuAllocation.objects.filter(instance_id=instance.pk, released_at__isnull=True).exists()
    assert Job.objects.get(pk=start.pk).status == JobStatus.FAILED
