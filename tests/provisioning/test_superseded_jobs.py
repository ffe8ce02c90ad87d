"""An instance job that a later job of the same instance took over does nothing (found by review).

START and RESTART both wait on `starting` (vms.WAITING_ON), and one of each may be open at once: an old job still
open (its worker lost after the instance moved on) and sent again by the dispatcher saw the instance in "its" state,
now because of a later job, and acted on it. Sequence: a restart's worker is killed after the instance was marked
running but before its job closed; the renter stops, then starts it; the old RESTART, sent again, runs against the
new `starting`: it stopped the VM under the START, and when it failed vm_failed marked the instance stopped and
freed its GPU while the START started the VM (whose own mark running then raised InvalidTransition): the instance
stopped ("waiting for SSH on the VM"), its GPU free for the next renter, its VM running on the node. Only the
instance's latest job speaks for it (the reaper's rule, vms.job_superseded): an older one is closed with a note and
touches neither the instance, its GPUs, nor the node's fault record."""
from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.models import Gpu, GpuStatus, Instance, InstanceStatus
from marketplace.services import instances as instance_svc
from provisioning import tasks
from provisioning.models import Job, JobFault, JobKind, JobStatus
from provisioning.services import vms
from provisioning.ssh_errors import AgentFailed
from tests.factories import make_listed_node
from tests.provisioning.test_lifecycle_races import FakeNode, run_in_worker, running_instance

pytestmark = pytest.mark.django_db

SUPERSEDED = "a later job of the instance took over"


@pytest.fixture(autouse=True)
def sent_jobs(monkeypatch):
    sent = []
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: sent.append((job_id, kind)))
    monkeypatch.setattr("provisioning.services.vms.wait_for_ssh", lambda host, port, timeout=0: None)
    return sent


@pytest.fixture
def fake_node(monkeypatch):
    fake = FakeNode()
    monkeypatch.setattr("provisioning.services.vms.node_session", fake.session)
    return fake


class WorkerKilled(BaseException):
    """SIGKILL of the worker process: nothing after it runs."""


def _stale_restart(fake_node, monkeypatch):
    """A running instance whose RESTART job is left open (its worker killed after it marked the instance running),
    stale; then stopped and started again by its renter: (instance, the old RESTART, the new START)."""
    node = make_listed_node(gpu_count=1)
    instance = running_instance(node)
    fake_node.vms[instance.vm_id] = "running"
    instance_svc.instance_restart(instance=instance)
    restart = Job.objects.get(instance=instance, kind=JobKind.INSTANCE_RESTART)
    real_finish = vms.job_finish

    def killed(**kwargs):
        raise WorkerKilled()

    monkeypatch.setattr(vms, "job_finish", killed)
    with pytest.raises(WorkerKilled):
        run_in_worker(tasks.instance_restart, restart)
    monkeypatch.setattr(vms, "job_finish", real_finish)
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.RUNNING
    assert Job.objects.get(pk=restart.pk).status == JobStatus.RUNNING
    Job.objects.filter(pk=restart.pk).update(heartbeat_at=timezone.now() - timedelta(seconds=50))  # stale
    instance_svc.instance_stop(instance=Instance.objects.get(pk=instance.pk))
    run_in_worker(tasks.instance_stop, Job.objects.get(instance=instance, kind=JobKind.INSTANCE_STOP))
    instance_svc.instance_start(instance=Instance.objects.get(pk=instance.pk))
    start = Job.objects.get(instance=instance, kind=JobKind.INSTANCE_START)
    return instance, restart, start


def _assert_start_won(fake_node, instance, restart, start):
    instance.refresh_from_db()
    gpu = Gpu.objects.get(node=instance.node, index=0)
    assert not (fake_node.vms.get(instance.vm_id) == "running" and gpu.status == GpuStatus.FREE), \
        "GPU freed while the instance's VM runs on it"
    assert instance.status == InstanceStatus.RUNNING and instance.status_message == "Running"
    assert fake_node.vms[instance.vm_id] == "running"
    assert gpu.status != GpuStatus.FREE and instance.allocations.filter(released_at__isnull=True).exists()
    assert Job.objects.get(pk=start.pk).status == JobStatus.SUCCEEDED
    old = Job.objects.get(pk=restart.pk)
    assert old.status == JobStatus.SUCCEEDED and old.fault == "" and old.error == ""
    assert SUPERSEDED in old.log[-1]["message"]


def test_a_stale_restart_job_that_fails_leaves_a_later_start_alone(fake_node, monkeypatch):
    instance, restart, start = _stale_restart(fake_node, monkeypatch)

    def stale_restart_runs():  # sent again by the dispatcher, taken over by another worker while the START runs
        def refused():
            raise AgentFailed({"code": "conflict", "message": "VM is being started"})
        fake_node.hooks[("vm", "start")] = refused
        run_in_worker(tasks.instance_restart, Job.objects.get(pk=restart.pk))

    fake_node.hooks[("vm", "start")] = stale_restart_runs
    run_in_worker(tasks.instance_start, start)
    _assert_start_won(fake_node, instance, restart, start)


def test_a_stale_restart_job_that_succeeds_late_does_nothing(fake_node, monkeypatch):
    instance, restart, start = _stale_restart(fake_node, monkeypatch)
    fake_node.calls.clear()
    fake_node.hooks[("vm", "start")] = lambda: run_in_worker(tasks.instance_restart, Job.objects.get(pk=restart.pk))
    run_in_worker(tasks.instance_start, start)
    _assert_start_won(fake_node, instance, restart, start)
    assert [sub for _, sub, _ in fake_node.calls] == ["start"], "the old restart drove the VM"


def test_a_stale_start_job_failing_leaves_a_later_restart_alone(fake_node, monkeypatch):
    """The other way round: a START (its worker killed after the instance was marked running), then a restart.
    The old START's failure (its lost runs spent, a node's error) judged the RESTART's `starting` as its own: it
    stopped the VM, marked the instance stopped and freed its GPU under the RESTART, and counted against the node."""
    node = make_listed_node(gpu_count=1)
    instance = running_instance(node)
    fake_node.vms[instance.vm_id] = "running"
    instance_svc.instance_stop(instance=instance)
    run_in_worker(tasks.instance_stop, Job.objects.get(instance=instance, kind=JobKind.INSTANCE_STOP))
    instance_svc.instance_start(instance=Instance.objects.get(pk=instance.pk))
    old_start = Job.objects.get(instance=instance, kind=JobKind.INSTANCE_START)
    real_finish = vms.job_finish

    def killed(**kwargs):
        raise WorkerKilled()

    monkeypatch.setattr(vms, "job_finish", killed)
    with pytest.raises(WorkerKilled):
        run_in_worker(tasks.instance_start, old_start)
    monkeypatch.setattr(vms, "job_finish", real_finish)
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.RUNNING
    instance_svc.instance_restart(instance=Instance.objects.get(pk=instance.pk))
    restart = Job.objects.get(instance=instance, kind=JobKind.INSTANCE_RESTART)
    fake_node.calls.clear()

    vms.vm_failed(job=Job.objects.get(pk=old_start.pk), error="The node did not answer.", fault="node")

    instance.refresh_from_db()
    assert instance.status == InstanceStatus.STARTING and fake_node.calls == []
    assert fake_node.vms[instance.vm_id] == "running"
    assert Gpu.objects.get(node=node, index=0).status != GpuStatus.FREE
    assert instance.allocations.filter(released_at__isnull=True).exists()
    old = Job.objects.get(pk=old_start.pk)
    # Still a failure (operators read it), the platform's: the two jobs raced, the node is not blamed.
    assert old.status == JobStatus.FAILED and old.fault == JobFault.PLATFORM and SUPERSEDED in old.error
    run_in_worker(tasks.instance_restart, restart)  # the RESTART speaks for the instance
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.RUNNING and instance.status_message == "Running (restarted)"
    assert Job.objects.get(pk=restart.pk).status == JobStatus.SUCCEEDED

def test_a_jobs_progress_is_written_only_while_the_instance_is_where_the_job_acts(fake_node):
    node = make_listed_node(gpu_count=1)
    instance = running_instance(node)
    instance_svc.instance_stop(instance=instance)
    instance_svc.instance_set_status_message(instance_id=instance.pk, message="stopping the VM",
                                             only_in=(InstanceStatus.STOPPING,))
    assert Instance.objects.get(pk=instance.pk).status_message == "stopping the VM"
    instance_svc.instance_mark_stopped(instance_id=instance.pk, message="Stopped; the disk is kept.")
    instance_svc.instance_set_status_message(instance_id=instance.pk, message="waiting for SSH on the VM",
                                             only_in=(InstanceStatus.STARTING,))
    assert Instance.objects.get(pk=instance.pk).status_message == "Stopped; the disk is kept."


def test_a_nodes_own_failure_after_a_destroy_was_asked_stays_a_failure_counted_against_it(fake_node, monkeypatch):
    """Found by the second review round: a provision the node failed after its renter asked for a destroy closed
    as succeeded ("a later job took over"), its fault lost; before the superseded rule it failed, the node's."""
    from tests.provisioning.test_job_fault import RETRIES_SPENT, checked_node, provision, reliability
    from tests.provisioning.test_job_fault import run_in_worker as run_with_retries

    node = checked_node()
    instance, job = provision(node)

    def destroyed_then_the_node_fails():
        instance_svc.instance_destroy(instance=Instance.objects.get(pk=instance.pk))
        raise AgentFailed({"code": "command_failed",
                           "message": "docker: Error response from daemon: nvidia-container-cli: initialization error"})

    fake_node.hooks[("vm", "create")] = destroyed_then_the_node_fails
    run_with_retries(tasks.instance_provision, job, retries=RETRIES_SPENT)
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED and job.fault == JobFault.NODE and SUPERSEDED in job.error
    assert reliability(node) < 1.0
