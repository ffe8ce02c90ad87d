"""The job reaper (provisioning.services.maintenance.jobs_reap): it fails jobs past their deadline that nobody is
working on, and leaves alone an execution that still beats, whose VM may be coming up on the GPUs the reaper
would otherwise free for the next renter. A destroy past its deadline ends the instance as destroyed, its GPUs
held until the reconciler has removed the VM."""
from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.models import GpuAllocation, Instance
from marketplace.services import instances as svc
from provisioning.models import Job, JobKind, JobStatus
from provisioning.services.maintenance import jobs_reap
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book, run, sent_jobs_fixture  # noqa: F401

pytestmark = pytest.mark.django_db


@pytest.fixture
def inst():
    return book(UserFactory(), make_listed_node(gpu_count=2), num_gpus=1)


def _held(instance) -> int:
    return GpuAllocation.objects.filter(instance=instance, released_at__isnull=True).count()


def _past_deadline(job, *, heartbeat_s_ago):
    Job.objects.filter(pk=job.pk).update(status=JobStatus.RUNNING, runner="worker-1:task-1",
                                         heartbeat_at=timezone.now() - timedelta(seconds=heartbeat_s_ago),
                                         deadline=timezone.now() - timedelta(seconds=1))


def test_a_job_past_its_deadline_whose_execution_still_beats_is_left_to_it(inst, settings):
    svc.instance_mark_provisioning(instance_id=inst.pk)
    job = Job.objects.get(instance=inst, kind=JobKind.INSTANCE_PROVISION)
    _past_deadline(job, heartbeat_s_ago=5)  # creating the VM right now
    assert jobs_reap() == {"reaped": 0}
    assert Instance.objects.get(pk=inst.pk).status == "provisioning" and _held(inst) == 1
    _past_deadline(job, heartbeat_s_ago=settings.JOB_HEARTBEAT_STALE_S + 5)  # its worker is gone
    assert jobs_reap() == {"reaped": 1}
    assert Instance.objects.get(pk=inst.pk).status == "failed" and _held(inst) == 0
    assert Job.objects.get(pk=job.pk).status == JobStatus.FAILED


def test_a_queued_job_past_its_deadline_is_reaped(inst):
    job = Job.objects.get(instance=inst, kind=JobKind.INSTANCE_PROVISION)
    Job.objects.filter(pk=job.pk).update(deadline=timezone.now() - timedelta(seconds=1))
    assert jobs_reap() == {"reaped": 1}
    assert Instance.objects.get(pk=inst.pk).status == "failed"


def test_a_destroy_past_its_deadline_ends_the_instance_destroyed_and_keeps_its_gpus_for_the_reconciler(inst):
    run(inst)
    svc.instance_destroy(instance=Instance.objects.get(pk=inst.pk))
    job = Job.objects.get(instance=inst, kind=JobKind.INSTANCE_DESTROY)
    Job.objects.filter(pk=job.pk).update(deadline=timezone.now() - timedelta(seconds=1))
    assert jobs_reap() == {"reaped": 1}
    instance = Instance.objects.get(pk=inst.pk)
    assert instance.status == "destroyed" and "removed when it answers again" in instance.status_message
    assert _held(inst) == 1  # until the reconciler has removed the VM (instance_cleanup_done)
    assert svc.instance_cleanup_done(instance_id=inst.pk) and _held(inst) == 0


@pytest.mark.parametrize("kind, reached", [("provision", "running"), ("stop", "stopped")])
def test_a_job_whose_worker_was_lost_after_the_vm_got_there_is_closed_as_done_not_failing_the_instance(
        inst, settings, kind, reached):
    """The worker died between marking the instance (running, stopped) and closing its job (found by review): the
    reaper failed a healthy running instance, its GPUs freed under a live VM, and the job counted as failed."""
    run(inst)
    job = Job.objects.get(instance=inst, kind=JobKind.INSTANCE_PROVISION)
    if kind == "stop":
        Job.objects.filter(pk=job.pk).update(status=JobStatus.SUCCEEDED, finished_at=timezone.now())
        svc.instance_stop(instance=Instance.objects.get(pk=inst.pk))
        svc.instance_mark_stopped(instance_id=inst.pk)
        job = Job.objects.get(instance=inst, kind=JobKind.INSTANCE_STOP)
    _past_deadline(job, heartbeat_s_ago=settings.JOB_HEARTBEAT_STALE_S + 5)
    assert jobs_reap() == {"reaped": 1}
    assert Instance.objects.get(pk=inst.pk).status == reached
    assert Job.objects.get(pk=job.pk).status == JobStatus.SUCCEEDED
    assert _held(inst) == (1 if reached == "running" else 0)
