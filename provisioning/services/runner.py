"""Bookkeeping of a job's life: begin (only if still open), steps, success, failure."""
from django.db import transaction
from django.utils import timezone

from provisioning.models import OPEN_JOB_STATUSES, Job, JobStatus

MAX_LOG_LINES = 200


def job_begin(*, job_id: int) -> Job | None:
    """Mark the job running (another attempt) and return it; None if it is already finished."""
    with transaction.atomic():
        job = Job.objects.select_for_update(of=("self",)).select_related("node", "instance").filter(pk=job_id).first()
        if job is None or job.status not in OPEN_JOB_STATUSES:
            return None
        job.status = JobStatus.RUNNING
        job.attempts += 1
        job.started_at = job.started_at or timezone.now()
        job.step = "started" if job.attempts == 1 else f"started again (attempt {job.attempts})"
        job.log = [*job.log, {"at": timezone.now().isoformat(), "message": job.step}][-MAX_LOG_LINES:]
        job.save(update_fields=["status", "attempts", "started_at", "step", "log"])
        return job


def job_step(job: Job, message: str) -> None:
    """Record what the job is doing now: users see `step`, operators the whole log."""
    job.step = message[:200]
    job.log = [*job.log, {"at": timezone.now().isoformat(), "message": message}][-MAX_LOG_LINES:]
    Job.objects.filter(pk=job.pk).update(step=job.step, log=job.log)


def job_finish(job: Job, *, error: str = "") -> None:
    """Close the job: succeeded, or failed with `error` (in words a provider or renter can act on)."""
    job.status = JobStatus.FAILED if error else JobStatus.SUCCEEDED
    job.error = error
    job.finished_at = timezone.now()
    job.step = "failed" if error else "done"
    job.log = [*job.log, {"at": job.finished_at.isoformat(), "message": error or "done"}][-MAX_LOG_LINES:]
    # Only an open job is closed: a reaper or another attempt may have closed it meanwhile.
    Job.objects.filter(pk=job.pk, status__in=OPEN_JOB_STATUSES).update(
        status=job.status, error=error, finished_at=job.finished_at, step=job.step, log=job.log
    )
