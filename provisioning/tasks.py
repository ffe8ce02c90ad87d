"""Celery entry points. Each takes a job id, re-reads the job, returns at once if it is no
longer open, and calls a service. Transient node failures are retried with backoff; the
last failure closes the job with an error in words, never leaving GPUs allocated.

A busy node (every SSH slot the platform allows per node taken: NodeBusy) is not a failure: the job waits
NODE_BUSY_RETRY_S and tries again, as often as its deadline allows, without using up the few retries meant
for an unreachable node.

Each failure is recorded with whose it is (Job.fault, provisioning.services.faults): only the node's count
against its reliability. Waiting for the platform's own work past the deadline, a lost worker, the platform's own
exception, and a time limit that ran out while the platform waited on itself are the platform's.

Jobs reach workers through the outbox (provisioning/services/jobs.py: sent on commit, and by `jobs_dispatch`
every JOB_DISPATCH_INTERVAL_S). A job task claims its job (runner.job_begin: one live execution at a time) and
renews its heartbeat while it runs (runner.JobHeartbeat), so that a lost worker's job is sent again within a
minute and taken over; a job whose worker was lost more than JOB_MAX_LOST_RUNS times fails."""
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol

from celery import shared_task
from celery.exceptions import Retry, SoftTimeLimitExceeded
from celery.signals import worker_process_shutdown, worker_shutdown
from django.conf import settings
from django.db import connection
from django.utils import timezone

from core.logging_context import log_context
from provisioning.concurrency import NodeBusy
from provisioning.models import Job, JobFault, JobKind
from provisioning.services import fleet, maintenance, vms
from provisioning.services import volumes as volume_jobs
from provisioning.services.faults import ON_DATABASE, PlatformError, error_fault, time_ran_out_on
from provisioning.services.jobs import JOB_TASKS
from provisioning.services.runner import JobHeartbeat, JobLost, job_begin, job_held, job_release, job_step
from provisioning.services.spot_checks import node_spot_check_failed, node_spot_check_run
from provisioning.services.verification import (
    node_verify_failed,
    node_verify_run,
)
from provisioning.ssh_errors import AgentTimeout, NodeError
from provisioning.ssh_pool import worker_pool_close

log = logging.getLogger(__name__)

JOB_TASK_OPTIONS = {
    "acks_late": True,
    "reject_on_worker_lost": True,  # a killed worker's job is delivered again, and resumes
    "soft_time_limit": 840,
    "time_limit": 900,
    "max_retries": 3,
}

class JobRunner(Protocol):
    """A job kind's service: it runs the job (keyword-only, as every service)."""

    def __call__(self, *, job: Job) -> None: ...


RUNNERS: dict[str, tuple[JobRunner, Callable[..., None] | None]] = {
    JobKind.NODE_VERIFY: (node_verify_run, node_verify_failed),
    JobKind.NODE_SPOT_CHECK: (node_spot_check_run, node_spot_check_failed),
    JobKind.INSTANCE_PROVISION: (vms.vm_provision, None),
    JobKind.INSTANCE_START: (vms.vm_start, None),
    JobKind.INSTANCE_STOP: (vms.vm_stop, None),
    JobKind.INSTANCE_RESTART: (vms.vm_restart, None),
    JobKind.INSTANCE_DESTROY: (vms.vm_destroy, vms.vm_destroy_failed),
    JobKind.VOLUME_CREATE: (volume_jobs.volume_create_run, volume_jobs.volume_job_failed),
    JobKind.VOLUME_DELETE: (volume_jobs.volume_delete_run, volume_jobs.volume_job_failed),
}


def _fail(job: Job, exc: NodeError) -> None:
    if not job_held(job):  # another execution took the job over: it speaks for the job now
        log.warning("job %s: not failed by this execution, which no longer holds it (%s)", job.pk, exc)
        return
    _, on_failure = RUNNERS[job.kind]
    if on_failure is not None:
        on_failure(job=job, error=exc)
    else:
        # The error itself, not only its words: its kind chooses what the instance's renter is told (vms.renter_reason).
        vms.vm_failed(job=job, error=exc, fault=error_fault(exc))


def run_job(task, job_id: int) -> None:
    request = task.request
    job = job_begin(job_id=job_id, task_id=getattr(request, "id", None) or "",
                    worker=getattr(request, "hostname", None) or "")
    if job is None:
        return
    # Log lines of this job carry its ids (core/logging_context.py).
    with log_context(job_id=job.pk, node_id=job.node_id, instance_id=job.instance_id), JobHeartbeat(job):
        if job.lost_runs > settings.JOB_MAX_LOST_RUNS:
            _fail(job, PlatformError(f"The worker running this job was lost {job.lost_runs} times; the platform "
                                     "stopped trying. Operators have been told."))
            return
        try:
            _run(task, job)
        except JobLost as exc:
            log.warning("job %s: %s; this execution stops", job_id, exc)


def _run(task, job: Job) -> None:
    run, _ = RUNNERS[job.kind]
    try:
        run(job=job)
    except JobLost:
        raise
    except NodeBusy as exc:
        countdown = settings.NODE_BUSY_RETRY_S
        if timezone.now() + timedelta(seconds=countdown) < job.deadline:
            log.info("job %s: %s; retrying in %s s", job.pk, exc, countdown)
            job_step(job=job, message=f"waiting for the node: {exc.message} Trying again in {countdown:.0f} s.")
            job_release(job, retry_at=timezone.now() + timedelta(seconds=countdown))
            raise _retry_uncounted(task, countdown=countdown, exc=exc) from None
        # The slots were taken by the platform's own work (or the job waited for another of its jobs): the
        # platform's failure, whatever the node did (NodeBusy's fault, faults.error_fault).
        _fail(job, NodeBusy(f"The platform's own work kept this job waiting until its deadline: {exc.message} "
                            "Try again later."))
    except NodeError as exc:
        if exc.transient and task.request.retries < task.max_retries:
            log.info("job %s: %s; retrying", job.pk, exc)
            countdown = settings.NODE_TASK_RETRY_BACKOFF_S[task.request.retries]
            job_release(job, retry_at=timezone.now() + timedelta(seconds=countdown))
            raise task.retry(countdown=countdown, exc=exc) from None
        _fail(job, exc)
    except SoftTimeLimitExceeded as exc:
        # Every step is bounded well inside the task's limit, but a node answering each just inside its own bound
        # adds them up past it: the node was too slow to check (a dropped check, as a silent node's), not an
        # internal error that left an active node its listing (found by review). But the time may also have
        # gone to the platform: waiting for one of its own SSH slots for the node, a lock of its database, its own
        # work. Who was being waited for when the time ran out decides (faults.time_ran_out_on says why).
        limit = _soft_time_limit(task)
        fault, doing = time_ran_out_on(exc.__traceback__)
        if doing == ON_DATABASE:  # the query it cut short still runs on that connection: a new one records the end
            connection.close()
        if fault == JobFault.NODE:
            _fail(job, AgentTimeout(f"The job ran past its time limit ({limit} s) while the platform {doing}: the "
                                    "node answered too slowly."))
        else:
            _fail(job, PlatformError(f"The job ran past its time limit ({limit} s) while the platform {doing}."))
    except Exception as exc:
        # Our own bug or an unexpected failure: close the job and free what it held, then re-raise.
        log.exception("job %s crashed", job.pk)
        _fail(job, PlatformError(f"Internal error: {type(exc).__name__}. Operators have been told."))
        raise


def _soft_time_limit(task) -> float | None:
    """The soft time limit this delivery ran under (one sent with its own, else the task's)."""
    limits = getattr(task.request, "timelimit", None) or (None, None)
    return limits[1] or task.soft_time_limit


def _retry_uncounted(task, *, countdown: float, exc: Exception) -> Retry:
    """Send the task again in `countdown` s with the same retry number (what task.retry does, minus the +1),
    so that waiting for a busy node leaves the unreachable-node budget (max_retries) whole."""
    signature = task.signature_from_request(task.request, countdown=countdown, retries=task.request.retries)
    signature.apply_async()
    return Retry(exc=exc, when=countdown, sig=signature)


@shared_task(bind=True, name=JOB_TASKS[JobKind.NODE_VERIFY], **JOB_TASK_OPTIONS)
def node_verify(self, job_id: int):
    run_job(self, job_id)


@shared_task(bind=True, name=JOB_TASKS[JobKind.NODE_SPOT_CHECK], **JOB_TASK_OPTIONS)
def node_spot_check(self, job_id: int):
    run_job(self, job_id)


@shared_task(bind=True, name=JOB_TASKS[JobKind.INSTANCE_PROVISION], **JOB_TASK_OPTIONS)
def instance_provision(self, job_id: int):
    run_job(self, job_id)


@shared_task(bind=True, name=JOB_TASKS[JobKind.INSTANCE_START], **JOB_TASK_OPTIONS)
def instance_start(self, job_id: int):
    run_job(self, job_id)


@shared_task(bind=True, name=JOB_TASKS[JobKind.INSTANCE_STOP], **JOB_TASK_OPTIONS)
def instance_stop(self, job_id: int):
    run_job(self, job_id)


@shared_task(bind=True, name=JOB_TASKS[JobKind.INSTANCE_RESTART], **JOB_TASK_OPTIONS)
def instance_restart(self, job_id: int):
    run_job(self, job_id)


@shared_task(bind=True, name=JOB_TASKS[JobKind.INSTANCE_DESTROY], **JOB_TASK_OPTIONS)
def instance_destroy(self, job_id: int):
    run_job(self, job_id)


@shared_task(bind=True, name=JOB_TASKS[JobKind.VOLUME_CREATE], **JOB_TASK_OPTIONS)
def volume_create(self, job_id: int):
    run_job(self, job_id)


@shared_task(bind=True, name=JOB_TASKS[JobKind.VOLUME_DELETE], **JOB_TASK_OPTIONS)
def volume_delete(self, job_id: int):
    run_job(self, job_id)


@shared_task(acks_late=True, soft_time_limit=50, time_limit=60)
def nodes_health_check():
    """Beat (every HEALTH_CHECK_INTERVAL_S): queue this cycle's health batches (fleet_health_batch)."""
    return fleet.nodes_health_dispatch()


@shared_task(acks_late=True, soft_time_limit=50, time_limit=60)
def nodes_reconcile():
    """Beat (every RECONCILE_INTERVAL_S): queue this cycle's reconcile batches (fleet_reconcile_batch)."""
    return fleet.nodes_reconcile_dispatch()


@shared_task(name=fleet.FLEET_HEALTH_BATCH, acks_late=True, soft_time_limit=240, time_limit=300)
def fleet_health_batch(node_ids: list[int], cycle: str | None = None):
    """Health-check a batch of nodes (a few hundred) and record the results; any worker takes it."""
    return fleet.nodes_health_batch(node_ids, cycle=cycle)


@shared_task(name=fleet.FLEET_RECONCILE_BATCH, acks_late=True, soft_time_limit=540, time_limit=600)
def fleet_reconcile_batch(node_ids: list[int], cycle: str | None = None):
    """Reconcile a batch of nodes' VMs with the database; any worker takes it."""
    return fleet.nodes_reconcile_batch(node_ids, cycle=cycle)


@worker_shutdown.connect
@worker_process_shutdown.connect
def _close_ssh_pool(**_kwargs):
    """A worker process ending closes its kept SSH connections to nodes (provisioning.ssh_pool)."""
    worker_pool_close()


@shared_task(acks_late=True, soft_time_limit=50, time_limit=60)
def jobs_reap():
    return maintenance.jobs_reap()


@shared_task(acks_late=True, ignore_result=True, soft_time_limit=50, time_limit=60)
def jobs_dispatch():
    """The outbox's sender: jobs never sent, lost by the broker, or held by a lost worker (beat, every ~10 s)."""
    summary = maintenance.jobs_dispatch()
    if any(summary.get(k) for k in ("sent", "resent", "recovered", "send_failed")):
        log.info("jobs dispatch: %s", summary)
    return summary


@shared_task(acks_late=True, soft_time_limit=50, time_limit=60)
def nodes_verify_pending():
    return maintenance.nodes_verify_pending()


@shared_task(acks_late=True, soft_time_limit=50, time_limit=60)
def nodes_reverify_due():
    return maintenance.nodes_reverify_due()
