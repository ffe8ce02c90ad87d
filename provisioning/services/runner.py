"""Bookkeeping of a job's life: claim (only if still open and nobody alive holds it), heartbeats, steps, success,
failure.

One execution at a time holds a job: `job_begin` claims it under the row lock and writes `Job.runner` (the task id
of the message, the worker, a nonce) and `heartbeat_at`; `JobHeartbeat` renews `heartbeat_at` every
JOB_HEARTBEAT_INTERVAL_S from a small thread while the task runs. A delivery finds one of these:

- nobody holds the job (queued, or released for a retry: `job_release`): it claims it;
- the holder's heartbeat is older than JOB_HEARTBEAT_STALE_S: its worker was lost (killed, out of memory, its
  machine gone); the delivery takes the job over, counting a lost run (`lost_runs`);
- the holder is this very message (same task id): the broker delivered it again because the execution died
  (`reject_on_worker_lost`); taken over at once, a lost run too;
- another message's execution holds it and beats: this delivery is a duplicate (the dispatcher sent the job
  again, or the broker redelivered it) and does nothing.

An execution that lost its job (taken over after a stall, or reaped past its deadline) notices at its next step
(`job_step` raises JobLost) and stops; its finish and failure change nothing (`job_finish`, `job_held`). Every
agent command is idempotent, so the execution that takes over finishes what the lost one began.
"""
import logging
import os
import secrets
import socket
import threading
from datetime import datetime, timedelta
from typing import Any, Literal, Self

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from provisioning.models import OPEN_JOB_STATUSES, Job, JobFault, JobStatus
from provisioning.services.faults import NOT_COUNTED

MAX_LOG_LINES = 200

log = logging.getLogger(__name__)


class JobLost(Exception):
    """This execution no longer holds its job: another took it over (this one's heartbeat went stale), or the job
    was closed meanwhile (the reaper, past its deadline)."""


def log_lines(log: object) -> list[dict[str, Any]]:
    """A job's stored log (`Job.log`) as its lines, {"at", "message"} objects. What is written is always such a
    list, but jsonb keeps any shape (a row fixed by hand, a data migration, an older version): a log that is no
    list reads as no lines, and a line that is no object as its text (at: None), so the operator still sees it
    and a reader may call .get on every line."""
    if not isinstance(log, list):
        return []
    return [line if isinstance(line, dict) else {"at": None, "message": str(line)[:500]} for line in log]


def _log_line(job: Job, message: str, at: datetime | None = None) -> list[dict[str, Any]]:
    return [*log_lines(job.log), {"at": (at or timezone.now()).isoformat(), "message": message}][-MAX_LOG_LINES:]


def job_begin(*, job_id: int, task_id: str = "", worker: str = "") -> Job | None:
    """Claim the job for this execution and mark it running (another attempt); None when there is nothing to run:
    the job is finished, or another execution that is alive holds it (this delivery is a duplicate)."""
    now = timezone.now()
    token = f"{task_id or 'direct'} {worker or socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"[:255]
    with transaction.atomic():
        job = Job.objects.select_for_update(of=("self",)).select_related("node", "instance").filter(pk=job_id).first()
        if job is None or job.status not in OPEN_JOB_STATUSES:
            return None
        lost = ""
        if job.runner:
            same_message = bool(task_id) and job.runner.split(" ", 1)[0] == task_id
            stale = job.heartbeat_at is None or job.heartbeat_at < now - timedelta(
                seconds=settings.JOB_HEARTBEAT_STALE_S)
            if not (same_message or stale):
                log.info("job %s: held by %s (alive); delivery %s is a duplicate and does nothing",
                         job_id, job.runner, task_id)
                return None
            lost = ("its execution was lost and this message delivered again" if same_message else
                    f"its worker stopped answering (last heartbeat {job.heartbeat_at:%H:%M:%S} UTC)")
            job.lost_runs += 1
        job.transition_to(JobStatus.RUNNING)
        job.attempts += 1
        job.runner = token
        job.heartbeat_at = now
        job.started_at = job.started_at or now
        if lost:
            job.step = f"resumed: {lost} (attempt {job.attempts})"
        else:
            job.step = "started" if job.attempts == 1 else f"started again (attempt {job.attempts})"
        job.log = _log_line(job, f"{job.step} on {token.split(' ', 1)[-1]}", now)
        job.save(update_fields=["status", "attempts", "runner", "heartbeat_at", "lost_runs", "started_at", "step",
                                "log"])
        return job


def job_release(job: Job, *, retry_at: datetime) -> None:
    """This execution ends and the job waits for its retry at `retry_at`: nobody holds it meanwhile, and the
    heartbeat promises the retry (the dispatcher sends the job again only if it has not come JOB_HEARTBEAT_STALE_S
    after). Call before the retry is sent, so the retry never finds its own job still held."""
    Job.objects.filter(pk=job.pk, runner=job.runner).update(runner="", heartbeat_at=retry_at)
    job.runner = ""


def job_held(job: Job) -> bool:
    """Does this execution still hold its job? (A job object not claimed by job_begin is taken as held.)"""
    return not job.runner or Job.objects.filter(pk=job.pk, runner=job.runner).exists()


class JobHeartbeat:
    """While the block runs, a daemon thread renews the job's heartbeat every JOB_HEARTBEAT_INTERVAL_S, on its own
    database connection; it stops when the block ends, or when the job is no longer this execution's."""

    def __init__(self, job: Job, interval_s: float | None = None):
        self.job = job
        self.interval_s = settings.JOB_HEARTBEAT_INTERVAL_S if interval_s is None else interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"job-{job.pk}-heartbeat", daemon=True)

    def __enter__(self) -> Self:
        if self.job.runner:
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> Literal[False]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        return False

    def _beat(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                try:
                    held = Job.objects.filter(pk=self.job.pk, runner=self.job.runner,
                                              status__in=OPEN_JOB_STATUSES).update(heartbeat_at=timezone.now())
                except DatabaseError as exc:  # the next beat tries again on a new connection
                    log.warning("job %s: heartbeat not written: %s", self.job.pk, exc)
                    connection.close()
                    continue
                if not held:  # finished, or taken over: nothing left to vouch for
                    return
        finally:
            connection.close()


def job_step(*, job: Job, message: str) -> None:
    """Record what the job is doing now: users see `step`, operators the whole log. Raises JobLost when the
    execution no longer holds its open job (taken over, or closed by the reaper): it must stop."""
    job.step = message[:200]
    job.log = _log_line(job, message)
    jobs = Job.objects.filter(pk=job.pk)
    if job.runner:
        jobs = jobs.filter(runner=job.runner, status__in=OPEN_JOB_STATUSES)
    if not jobs.update(step=job.step, log=job.log) and job.runner:
        raise JobLost(f"job {job.pk} was taken over by another execution, or closed")


def job_finish(*, job: Job, error: str = "", note: str = "", fault: str = "") -> None:
    """Close the job: succeeded (`note`: why there was nothing to do, for the log), or failed with `error` (in
    words a provider or renter can act on) and `fault`, whose failure it is (JobFault, decided by the caller,
    usually faults.error_fault): only the node's counts against its reliability; any other says so in the error,
    which its provider and renter read."""
    if error and fault not in JobFault.values:
        raise ValueError(f"job {job.pk} failed without saying whose failure it is ({fault!r}): {error[:200]}")
    if error and fault != JobFault.NODE and NOT_COUNTED[fault] not in error:
        error = f"{error.rstrip()} {NOT_COUNTED[fault]}"
    target = JobStatus.FAILED if error else JobStatus.SUCCEEDED
    job.status = target  # in memory as written below; the row moves only if the table lets it (still open)
    job.error = error
    job.fault = fault if error else ""
    job.finished_at = timezone.now()
    job.step = "failed" if error else "done"
    job.log = _log_line(job, error or (f"done: {note}" if note else "done"), job.finished_at)
    # Only an open job is closed: a reaper or another attempt may have closed it meanwhile; and only by the
    # execution holding it (or by the reaper and services, which hold no claim).
    jobs = Job.objects.filter(pk=job.pk)
    if job.runner:
        jobs = jobs.filter(runner=job.runner)
    Job.transition_rows(jobs, target, error=error, fault=job.fault, finished_at=job.finished_at, step=job.step,
                        log=job.log)
