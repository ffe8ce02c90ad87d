"""VM jobs that give up (the node unreachable after the retries, a lost worker, a time limit, the reaper): what the
renter keeps, which GPUs stay held for a VM the node has not confirmed stopped or gone, and what counts against
the provider (found by review; each test failed before its fix). The node is a fake session answering as the
agent's `vm` commands do, which can become unreachable."""
import pytest
from celery.exceptions import Retry, SoftTimeLimitExceeded
from django.utils import timezone

from core.errors import Conflict
from marketplace.models import Gpu, Instance, InstanceStatus
from marketplace.selectors import instances_awaiting_cleanup
from marketplace.services import instances as instance_svc
from provisioning import tasks
from provisioning.models import Job, JobKind, JobStatus
from provisioning.services import vms
from provisioning.services.fleet_record import health_samples_record, nodes_reliability
from provisioning.services.maintenance import jobs_reap
from provisioning.ssh_errors import AgentFailed, NodeUnreachable
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book, run

from .test_lifecycle_races import FakeNode

pytestmark = pytest.mark.django_db

RETRIES_SPENT = tasks.JOB_TASK_OPTIONS["max_retries"]


@pytest.fixture(autouse=True)
def sent_jobs(monkeypatch):
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: None)
    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", lambda host, port, timeout=0: None)


class AwayNode(FakeNode):
    """A FakeNode that opens no session while `unreachable` is set, nor the next `away_for` sessions."""

    unreachable = False
    away_for = 0

    def session(self, node, *args, **kwargs):
        if self.unreachable or self.away_for:
            self.away_for = max(self.away_for - 1, 0)
            raise NodeUnreachable("connection timed out")
        return super().session(node, *args, **kwargs)


@pytest.fixture
def fake_node(monkeypatch):
    fake = AwayNode()
    monkeypatch.setattr("provisioning.services.vms.node_session", fake.session)
    return fake


def run_in_worker(task, job: Job, retries: int = 0, task_id: str | None = None):
    """The job's task as a worker delivery runs it; `retries` as the delivery's retry number."""
    task.push_request(id=task_id or f"task-{job.pk}-{timezone.now().timestamp()}", args=[job.pk], kwargs={},
                      retries=retries, called_directly=False, delivery_info={"exchange": "", "routing_key": "celery"})
    try:
        tasks.run_job(task, job.pk)
    finally:
        task.pop_request()


def running_instance(node, fake):
    instance = run(book(UserFactory(), node))
    Job.objects.filter(instance=instance).update(status=JobStatus.SUCCEEDED, finished_at=timezone.now())
    fake.vms[instance.vm_id] = "running"
    return Instance.objects.get(pk=instance.pk)


def stopped_instance(node, fake):
    instance = running_instance(node, fake)
    instance_svc.instance_stop(instance=instance)
    run_in_worker(tasks.instance_stop, Job.objects.get(instance=instance, kind=JobKind.INSTANCE_STOP))
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.STOPPED
    return instance


def gpu0(node) -> str:
    return Gpu.objects.get(node=node, index=0).status


# ------------------------------------------------------------------------------- the renter keeps their disk

def test_a_start_that_cannot_reach_the_node_leaves_the_stopped_instance_stopped(fake_node):
    """A network blip during a start made the instance failed ("it can only be destroyed"): the renter lost a
    disk that was intact on the node. The start never reached the node: stopped again, its GPU free."""
    node = make_listed_node(gpu_count=1)
    instance = stopped_instance(node, fake_node)
    instance_svc.instance_start(instance=instance)
    fake_node.unreachable = True
    run_in_worker(tasks.instance_start, Job.objects.get(instance=instance, kind=JobKind.INSTANCE_START),
                  retries=RETRIES_SPENT)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.STOPPED, instance.status_message
    assert "start it again" in instance.status_message and not instance.vm_cleanup_pending
    assert gpu0(node) == "free"


def test_a_start_lost_after_it_reached_the_node_is_stopped_again_on_the_node(fake_node):
    """The start reached the node, then the node went quiet (its answer lost, and the VM's state could not be
    read either): the job's failure stops the VM (the node answers that) and the instance is stopped, its GPU
    freed. (A node that answers the state read confirms the start: tests/marketplace/test_renting_lost_answers.)"""
    node = make_listed_node(gpu_count=1)
    instance = stopped_instance(node, fake_node)
    instance_svc.instance_start(instance=instance)

    def started_then_lost():
        fake_node.away_for = 1
        raise NodeUnreachable("connection reset while reading the answer")

    fake_node.hooks[("vm", "start")] = started_then_lost
    run_in_worker(tasks.instance_start, Job.objects.get(instance=instance, kind=JobKind.INSTANCE_START),
                  retries=RETRIES_SPENT)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.STOPPED and fake_node.vms[instance.vm_id] == "stopped"
    assert gpu0(node) == "free" and not instance.vm_cleanup_pending


def test_a_start_on_a_node_failing_its_health_checks_is_refused_at_once(fake_node):
    node = make_listed_node(gpu_count=1)
    instance = stopped_instance(node, fake_node)
    node.health_failures = 1
    node.save(update_fields=["health_failures"])
    with pytest.raises(Conflict, match="health check"):
        instance_svc.instance_start(instance=instance)
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.STOPPED


# ------------------------------------------------------------- no GPU is freed under a VM that may still run

def test_a_stop_that_cannot_reach_the_node_does_not_free_gpus_the_vm_still_uses(fake_node):
    """The stop never reached the node: the instance failed and its GPU was freed while the VM ran on, for the
    next booking to put a second VM on it. Now it is running as before (billing resumes), to be stopped again."""
    node = make_listed_node(gpu_count=1)
    instance = running_instance(node, fake_node)
    instance_svc.instance_stop(instance=instance)
    fake_node.unreachable = True
    run_in_worker(tasks.instance_stop, Job.objects.get(instance=instance, kind=JobKind.INSTANCE_STOP),
                  retries=RETRIES_SPENT)
    instance.refresh_from_db()
    assert fake_node.vms[instance.vm_id] == "running"
    assert instance.status == InstanceStatus.RUNNING and "stop it again" in instance.status_message
    assert gpu0(node) == "rented"
    with pytest.raises(Conflict):
        book(UserFactory(), node)


def test_a_stop_lost_after_it_reached_the_node_keeps_the_gpus_until_the_node_confirms(fake_node):
    """The stop reached the node, whose answer never came: the renter's instance is stopped (what they asked;
    no GPU time billed), but its GPU stays held, waiting for its cleanup, until the node confirms the VM
    stopped; a start takes the instance over again."""
    node = make_listed_node(gpu_count=1)
    instance = running_instance(node, fake_node)
    instance_svc.instance_stop(instance=instance)

    def lost():
        fake_node.unreachable = True
        raise NodeUnreachable("connection reset while reading the answer")

    fake_node.hooks[("vm", "stop")] = lost
    run_in_worker(tasks.instance_stop, Job.objects.get(instance=instance, kind=JobKind.INSTANCE_STOP),
                  retries=RETRIES_SPENT)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.STOPPED and instance.vm_cleanup_pending
    assert gpu0(node) == "rented"
    assert instance.pk in instances_awaiting_cleanup(node_id=node.pk)
    assert instance_svc.instance_cleanup_done(instance_id=instance.pk) == [0]
    instance.refresh_from_db()
    assert not instance.vm_cleanup_pending and gpu0(node) == "free"


def test_a_stop_reaped_past_its_deadline_does_not_free_gpus_the_vm_may_still_use(fake_node):
    """The reaper failed the instance of a stop job past its deadline and freed its GPU, nobody having stopped the
    VM. The job never touched the VM: the instance is running as before, its GPU held."""
    node = make_listed_node(gpu_count=1)
    instance = running_instance(node, fake_node)
    instance_svc.instance_stop(instance=instance)
    stop = Job.objects.get(instance=instance, kind=JobKind.INSTANCE_STOP)
    Job.objects.filter(pk=stop.pk).update(deadline=timezone.now() - timezone.timedelta(seconds=1))
    jobs_reap()
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.RUNNING and gpu0(node) == "rented"
    with pytest.raises(Conflict):
        book(UserFactory(), node)


def test_a_stop_reaped_after_it_reached_the_node_keeps_the_gpus(fake_node):
    node = make_listed_node(gpu_count=1)
    instance = running_instance(node, fake_node)
    instance_svc.instance_stop(instance=instance)
    stop = Job.objects.get(instance=instance, kind=JobKind.INSTANCE_STOP)
    vms.job_step(job=stop, message=vms._STOPPING)  # its worker sent the stop, then was lost
    Job.objects.filter(pk=stop.pk).update(deadline=timezone.now() - timezone.timedelta(seconds=1))
    jobs_reap()
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.STOPPED and instance.vm_cleanup_pending and gpu0(node) == "rented"


def test_a_provision_whose_answer_was_lost_frees_no_gpu_its_vm_uses(fake_node):
    """The node made the VM, then the connection dropped and stayed down: the GPU was freed and `vm destroy`
    could not reach the node either, so the next booking got a GPU the VM ran on. Now the failed instance keeps
    it until the node confirms the VM gone."""
    node = make_listed_node(gpu_count=1)
    instance = book(UserFactory(), node)

    def made_then_lost():
        fake_node.vms[instance.vm_id] = "running"
        fake_node.unreachable = True
        raise NodeUnreachable("connection reset while reading the answer")

    fake_node.hooks[("vm", "create")] = made_then_lost
    run_in_worker(tasks.instance_provision, Job.objects.get(instance=instance, kind=JobKind.INSTANCE_PROVISION),
                  retries=RETRIES_SPENT)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.FAILED and instance.vm_cleanup_pending
    assert instance.vm_id in fake_node.vms and gpu0(node) == "rented"
    assert instance.billed_seconds == 0


def test_a_provision_whose_create_failed_on_a_node_that_answers_frees_the_gpu(fake_node):
    node = make_listed_node(gpu_count=1)
    instance = book(UserFactory(), node)

    def refused():
        raise AgentFailed({"code": "pull_failed", "message": "manifest unknown"})

    fake_node.hooks[("vm", "create")] = refused
    run_in_worker(tasks.instance_provision, Job.objects.get(instance=instance, kind=JobKind.INSTANCE_PROVISION))
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.FAILED and "could not be pulled" in instance.status_message
    assert gpu0(node) == "free" and not instance.vm_cleanup_pending


# --------------------------------------------------------------- an error after the work leaves it done

def test_a_job_failing_after_the_instance_is_running_does_not_fail_the_running_instance(fake_node, monkeypatch):
    """The soft time limit landed after instance_mark_running committed, while the job was being closed: the
    running instance was failed, its GPU freed and its VM stopped. Now the job is closed as done."""
    node = make_listed_node(gpu_count=1)
    instance = book(UserFactory(), node)
    provision = Job.objects.get(instance=instance, kind=JobKind.INSTANCE_PROVISION)
    original, calls = vms.job_finish, []

    def finish(**kwargs):
        if not calls:
            calls.append(1)
            raise SoftTimeLimitExceeded()
        return original(**kwargs)

    monkeypatch.setattr(vms, "job_finish", finish)
    run_in_worker(tasks.instance_provision, provision)
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.RUNNING and gpu0(node) == "rented"
    assert ("vm", "stop", instance.vm_id) not in fake_node.calls
    assert Job.objects.get(pk=provision.pk).status == JobStatus.SUCCEEDED


# ------------------------------------------------------------------ what counts against the provider

def test_a_renter_destroying_before_provisioning_does_not_count_a_failed_job_against_the_provider(fake_node):
    """Book, then destroy before a worker takes the provision: the provision ended FAILED ("nothing done") and
    the node's reliability lost 0.02 each time, for nothing the node did."""
    node = make_listed_node(gpu_count=1)
    for _ in range(10):
        health_samples_record(ok_ids=[node.pk], failed_ids=[], day=timezone.now().date())
    for _ in range(3):
        instance = book(UserFactory(), node)
        instance_svc.instance_destroy(instance=instance)
        run_in_worker(tasks.instance_provision, Job.objects.get(instance=instance, kind=JobKind.INSTANCE_PROVISION))
        run_in_worker(tasks.instance_destroy, Job.objects.get(instance=instance, kind=JobKind.INSTANCE_DESTROY))
        assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.DESTROYED
    assert not Job.objects.filter(node=node, status=JobStatus.FAILED).exists()
    assert nodes_reliability(node_ids=[node.pk], now=timezone.now()) == {node.pk: 1.0}


def test_a_stop_job_redelivered_after_its_worker_died_post_commit_ends_succeeded(fake_node, monkeypatch):
    """The worker stopped the VM, committed `stopped`, and died before closing the job; the message delivered
    again found the instance stopped and closed the job FAILED ("nothing done")."""
    node = make_listed_node(gpu_count=1)
    instance = running_instance(node, fake_node)
    instance_svc.instance_stop(instance=instance)
    stop = Job.objects.get(instance=instance, kind=JobKind.INSTANCE_STOP)

    class Killed(BaseException):
        pass

    def die(**kwargs):
        raise Killed()

    with monkeypatch.context() as patch:
        patch.setattr(vms, "job_finish", die)
        with pytest.raises(Killed):
            run_in_worker(tasks.instance_stop, stop, task_id="msg-1")
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.STOPPED
    run_in_worker(tasks.instance_stop, stop, task_id="msg-1")  # reject_on_worker_lost: delivered again
    stop.refresh_from_db()
    assert stop.status == JobStatus.SUCCEEDED, stop.error


def test_a_destroy_during_a_long_provision_waits_for_it_instead_of_failing(fake_node):
    """A provision may run 900 s (an image pull), a destroy job had 300 s: waiting for the provision it ran out
    of time, ended FAILED (against the provider) and told the renter their server could not be reached. Now its
    deadline stretches to the provision's, and it keeps waiting."""
    node = make_listed_node(gpu_count=1)
    instance = book(UserFactory(), node)
    provision = Job.objects.get(instance=instance, kind=JobKind.INSTANCE_PROVISION)
    Job.objects.filter(pk=provision.pk).update(status=JobStatus.RUNNING, runner="other-worker",
                                               heartbeat_at=timezone.now(), started_at=timezone.now())
    instance_svc.instance_destroy(instance=Instance.objects.get(pk=instance.pk))
    destroy = Job.objects.get(instance=instance, kind=JobKind.INSTANCE_DESTROY)
    Job.objects.filter(pk=destroy.pk).update(deadline=timezone.now() + timezone.timedelta(seconds=20))
    with pytest.raises(Retry):
        run_in_worker(tasks.instance_destroy, destroy)  # what was its last try before its deadline
    destroy.refresh_from_db()
    instance.refresh_from_db()
    assert destroy.status != JobStatus.FAILED and destroy.deadline > Job.objects.get(pk=provision.pk).deadline
    assert instance.status == InstanceStatus.DESTROYING and "could not be reached" not in instance.status_message


# -------------------------------------------------------------- a VM the node answers for as `missing`

class PrunedNode(AwayNode):
    """A node whose agent answers for VMs in `pruned` (recorded there, their container removed on the node) as the
    agent did before it answered not_found for them: a start fails (command_failed), a stop and a status answer
    ok with state `missing`."""

    def __init__(self):
        super().__init__()
        self.pruned: set[str] = set()

    def session(self, node, *args, **kwargs):
        inner = super().session(node, *args, **kwargs)
        fake = self

        class Session(type(inner)):
            def agent(self, cmd, sub=None, request=None, timeout=None):
                vm_id = (request or {}).get("vm_id", "")
                if cmd != "vm" or vm_id not in fake.pruned or sub not in ("start", "stop", "status"):
                    return super().agent(cmd, sub, request, timeout)
                fake.calls.append((cmd, sub, vm_id))
                if sub == "start":
                    raise AgentFailed({"code": "command_failed", "message": f"docker start gpumarket-{vm_id} exited "
                                       f"1: Error response from daemon: No such container: gpumarket-{vm_id}"})
                return {"vm_id": vm_id, "state": "missing", "ssh_host": "10.0.0.9", "ssh_port": 40022,
                        "ssh_user": "root"}

        return Session()


@pytest.fixture
def pruned_node(monkeypatch):
    fake = PrunedNode()
    monkeypatch.setattr("provisioning.services.vms.node_session", fake.session)
    return fake


@pytest.mark.parametrize("kind", [JobKind.INSTANCE_START, JobKind.INSTANCE_STOP])
def test_a_vm_the_node_answers_for_as_missing_fails_its_instance(pruned_node, kind):
    """Its start failed and the job's failure sent `vm stop`, answered ok (state `missing`): the instance was
    stopped, "start it again", at every start, its absent disk billed; a renter's stop of it was "Stopped; the
    disk is kept" (found by review). A VM answered `missing` is gone: the instance fails, its GPU freed."""
    node = make_listed_node(gpu_count=1)
    if kind == JobKind.INSTANCE_START:
        instance = stopped_instance(node, pruned_node)
        pruned_node.pruned.add(instance.vm_id)
        instance_svc.instance_start(instance=instance)
        task = tasks.instance_start
    else:
        instance = running_instance(node, pruned_node)
        pruned_node.pruned.add(instance.vm_id)
        instance_svc.instance_stop(instance=instance)
        task = tasks.instance_stop
    run_in_worker(task, Job.objects.get(instance=instance, kind=kind))
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.FAILED, instance.status_message
    assert instance.status_message == vms._VM_GONE and not instance.vm_cleanup_pending
    assert gpu0(node) == "free"
