"""Creating jobs and handing them to Celery; the job row is what operators and users see."""
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from provisioning.models import Job, JobKind, JobStatus

# How long a job may stay open before the reaper fails it (seconds). Generous: a
# verification runs a benchmark; a provision may pull an image.
JOB_DEADLINES = {
    JobKind.NODE_VERIFY: 900,
    JobKind.INSTANCE_PROVISION: 900,
    JobKind.INSTANCE_START: 300,
    JobKind.INSTANCE_STOP: 300,
    JobKind.INSTANCE_RESTART: 600,
    JobKind.INSTANCE_DESTROY: 300,
}


def job_create(*, kind: str, node, instance=None) -> Job:
    """Record a queued job and send it to a worker once the caller's transaction commits."""
    job = Job.objects.create(
        kind=kind, node=node, instance=instance, status=JobStatus.QUEUED, step="queued",
        deadline=timezone.now() + timedelta(seconds=JOB_DEADLINES[kind]),
    )
    transaction.on_commit(lambda: _send(job.pk, kind))
    return job


def _send(job_id: int, kind: str) -> None:
    from provisioning import tasks  # tasks import services; import at call time to keep layers one-way

    getattr(tasks, kind).delay(job_id)
