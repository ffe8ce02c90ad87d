"""Jobs are rows first: creating them, and handing them to Celery (a transactional outbox).

The `Job` row, committed in the same transaction as the state change that asks for the work (an instance
`requested`, a node `verifying`), is the truth. The broker only carries a copy of it:

- `job_create` records the job and, once the caller's transaction commits, tries to send it (`job_send`). A
  broker that cannot be reached is logged and recorded on the row (`send_attempts`, `send_error`), never raised:
  the request that asked for the work has committed, and it answers as usual. With JOB_SEND_IN_BACKGROUND (on
  with PostgreSQL) the request does not wait for that either: the on-commit hook queues the job for this
  process's sender thread (core.background), which hands everything queued to the broker and records the batch
  in one UPDATE (`_send_batch`); a process killed before it did leaves the rows unsent, for the dispatcher.
- With JOB_RELAY (on with PostgreSQL) nothing is sent from the process that created the job: a trigger NOTIFYs
  the job relays when the transaction commits, and one of them sends every new job in batches
  (provisioning/services/relay.py). The web processes then spend no CPU on the broker.
- The dispatcher (`provisioning.services.maintenance.jobs_dispatch`, every JOB_DISPATCH_INTERVAL_S from beat)
  sends what was never sent, sends again what the broker seems to have lost, and what a lost worker held
  (provisioning/services/runner.py: heartbeats). So a broker outage or a dead worker delays work, never loses it.
- A job may reach workers more than once; `runner.job_begin` lets exactly one execution hold it at a time.

JOB_TASKS is the one registry of job kind → Celery task name. Jobs are sent by name (core.dispatch), so this
module imports no task module (tasks import services: no import circle, no deferred import); provisioning.tasks
declares each job task under its registered name, and tests/provisioning/test_job_outbox.py checks that every
kind has its task.
"""
import functools
import logging
import uuid
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from core import dispatch
from core.background import BackgroundBatcher
from core.errors import Conflict
from core.sql import ModelInsert, constraint_violated, prepared_cursor
from marketplace.models import Instance, Node, Volume
from provisioning.models import OPEN, Job, JobKind, JobStatus
from provisioning.services.runner import job_finish

log = logging.getLogger(__name__)

# How long a job may stay open before the reaper fails it (seconds). Generous: a
# verification runs a benchmark; a provision may pull an image.
JOB_DEADLINES: dict[str, int] = {
    JobKind.NODE_VERIFY: 900,
    JobKind.NODE_SPOT_CHECK: 300,
    JobKind.INSTANCE_PROVISION: 900,
    JobKind.INSTANCE_START: 300,
    JobKind.INSTANCE_STOP: 300,
    JobKind.INSTANCE_RESTART: 600,
    JobKind.INSTANCE_DESTROY: 300,
    JobKind.VOLUME_CREATE: 300,
    JobKind.VOLUME_DELETE: 300,
}

# The Celery task that runs each kind of job (provisioning.tasks declares them under these names).
JOB_TASKS: dict[str, str] = {
    JobKind.NODE_VERIFY: dispatch.task_name("provisioning.tasks.node_verify"),
    JobKind.NODE_SPOT_CHECK: dispatch.task_name("provisioning.tasks.node_spot_check"),
    JobKind.INSTANCE_PROVISION: dispatch.task_name("provisioning.tasks.instance_provision"),
    JobKind.INSTANCE_START: dispatch.task_name("provisioning.tasks.instance_start"),
    JobKind.INSTANCE_STOP: dispatch.task_name("provisioning.tasks.instance_stop"),
    JobKind.INSTANCE_RESTART: dispatch.task_name("provisioning.tasks.instance_restart"),
    JobKind.INSTANCE_DESTROY: dispatch.task_name("provisioning.tasks.instance_destroy"),
    JobKind.VOLUME_CREATE: dispatch.task_name("provisioning.tasks.volume_create"),
    JobKind.VOLUME_DELETE: dispatch.task_name("provisioning.tasks.volume_delete"),
}


def job_alive(now: datetime) -> Q:
    """The jobs still under way at `now`, by the reaper's rule (maintenance.jobs_reap reaps an open job past its
    deadline unless it is one of these): running, and before its deadline or with an execution that still beats
    (its heartbeat younger than JOB_HEARTBEAT_STALE_S; a job waiting for its retry has it dated when the retry is
    due, runner.job_release). A deadline counts from the job's creation, so a job that waited in a busy queue can
    pass it while it runs; one whose worker was lost stops counting JOB_HEARTBEAT_STALE_S after its last beat."""
    fresh = now - timedelta(seconds=settings.JOB_HEARTBEAT_STALE_S)
    return Q(status=JobStatus.RUNNING) & (Q(deadline__gte=now) | Q(heartbeat_at__gte=fresh))


class JobConflict(Conflict):
    """The same work is still under way (the constraints job_one_open_per_instance_and_kind and
    job_one_open_node_job_per_node): nothing was queued; the caller's transaction must not commit its change."""


def job_create(*, kind: str, node: Node, instance: Instance | None = None, volume: Volume | None = None,
               savepoint: bool = True) -> Job:
    """Record a queued job; it is sent to a worker once the caller's transaction commits (or by the dispatcher).
    Raises JobConflict while the same kind of job is still open for the instance (or a node job for the node).

    `savepoint=False` saves a round trip pair where a conflict cannot be caught and survived: the caller's
    transaction must end on JobConflict (a booking's new instance, whose jobs cannot be open yet)."""
    try:
        with transaction.atomic(savepoint=savepoint):
            job = job_new(kind=kind, node=node, instance=instance, volume=volume)
            _insert_job(job)
    except IntegrityError as exc:
        if not constraint_violated(exc).startswith("job_one_open_"):  # by name, never in the text (core.sql)
            raise
        if savepoint and instance is not None and _superseded_job_closed(kind=kind, instance_id=instance.pk):
            return job_create(kind=kind, node=node, instance=instance, volume=volume)  # its kind has none open now
        what = (f"instance {instance.pk}" if instance is not None else
                f"volume {volume.pk}" if volume is not None else f"node {node.pk}")
        raise JobConflict(f"A job to {JobKind(kind).label.lower()} is still under way for {what}; "
                          "try again in a moment.") from None
    job_queued(job)
    return job


SUPERSEDED = "a later job of the instance took over"


def _superseded_job_closed(*, kind: str, instance_id: int) -> bool:
    """Close the instance's open job of `kind` when a later job of the instance exists; True when it did. Such a job
    speaks for nothing (provisioning.services.vms.job_superseded: run again, it closes itself so); it is left open
    only when its worker was lost after recording the node's answer, before closing the job. It blocked the
    renter's next stop (a 409 "still under way") and the zero-balance stop until the dispatcher or the reaper came
    by (found by review). A worker still running it finds it closed and superseded, and does nothing more."""
    stale = Job.objects.select_for_update().filter(OPEN, instance_id=instance_id, kind=kind).first()
    if stale is None or not Job.objects.filter(instance_id=instance_id, id__gt=stale.pk).exists():
        return False
    job_finish(job=stale, note=SUPERSEDED)
    log.info("job %s (%s of instance %s) closed as superseded to queue a new one", stale.pk, kind, instance_id)
    return True


def job_new(*, kind: str, node: Node, instance: Instance | None = None, volume: Volume | None = None) -> Job:
    """A queued job, not saved yet: job_create saves it; a booking writes it in its own statement
    (job_insert_for_new_instance) and then calls job_queued."""
    return Job(kind=kind, node=node, instance=instance, volume=volume, status=JobStatus.QUEUED, step="queued",
               deadline=timezone.now() + timedelta(seconds=JOB_DEADLINES[kind]))


def job_queued(job: Job) -> None:
    """The job's row is written in the caller's transaction: have it sent once that commits."""
    if not settings.JOB_RELAY:  # else the relay sends it (provisioning/services/relay.py), woken by the commit
        kind = job.kind
        transaction.on_commit(lambda: _send(job.pk, kind), robust=True)


def job_insert_for_new_instance(job: Job, *, instance_id_sql: str) -> tuple[str, list[Any]]:
    """The job's INSERT for a CTE of a statement that also inserts its instance (a booking's, one round trip):
    (SQL, parameters), the instance's id taken from `instance_id_sql` (e.g. `(SELECT id FROM inst)`). The caller
    sets `job.pk` from `RETURNING id`, then calls job_queued. A new instance has no open job, so the partial
    unique indexes (JobConflict) cannot refuse it. PostgreSQL only."""
    insert = _job_insert()
    return insert.sql_with(instance_id=instance_id_sql), insert.values(job, skip=frozenset({"instance_id"}))


def _insert_job(job: Job) -> None:
    """The job's INSERT; on PostgreSQL one fixed statement, prepared per connection (many use cases run it)."""
    if connection.vendor != "postgresql":
        job.save(force_insert=True)
        return
    with prepared_cursor() as cursor:
        _job_insert().insert(cursor, job)


@functools.cache
def _job_insert() -> ModelInsert:
    return ModelInsert(Job)


def job_send_again_if_unsent(job: Job) -> None:
    """A job asked for again (e.g. Verify twice) that the broker never took: try to send it now, on commit,
    rather than wait for the dispatcher."""
    if job.status == JobStatus.QUEUED and job.sent_at is None:
        transaction.on_commit(lambda: _send(job.pk, job.kind), robust=True)


def _send(job_id: int, kind: str) -> None:
    """The on-commit hook (tests replace it to record what would be sent). Never raises."""
    if settings.JOB_SEND_IN_BACKGROUND:
        sender.submit((job_id, kind))
        return
    try:
        job_send(job_id=job_id, kind=kind)
    except Exception:  # noqa: BLE001 (the caller's transaction committed: nothing here may undo its answer)
        log.exception("job %s (%s): sending it failed; the dispatcher sends it later", job_id, kind)


def job_send(*, job_id: int, kind: str | None = None) -> bool:
    """Hand the job to the broker and record it on the row. False (logged and recorded) when the broker could
    not take it: the dispatcher tries again. Each message has its own task id, so that the claim in
    runner.job_begin can tell a redelivery of one message from another copy of the job. `kind`: when the
    caller knows it (the on-commit send), no read of the row first."""
    if kind is None:
        kind = Job.objects.filter(pk=job_id).values_list("kind", flat=True).first()
        if kind is None:
            return False
    task_id = f"job-{job_id}-{uuid.uuid4().hex[:12]}"
    try:
        _publish(JOB_TASKS[kind], job_id=job_id, task_id=task_id)
    except Exception as exc:  # noqa: BLE001 (kombu and the transports raise many kinds; the row keeps the job)
        error = f"{type(exc).__name__}: {exc}"[:500]
        log.warning("job %s (%s): the broker did not take it (%s); the dispatcher sends it later", job_id, kind, error)
        _record_send(job_id, error=error)
        return False
    _record_send(job_id, sent_at=timezone.now())
    return True


def _publish(task_name: str, *, job_id: int, task_id: str, producer: Any = None) -> None:
    dispatch.send(task_name, job_id, task_id=task_id, producer=producer)


def _record_send(job_id: int, *, sent_at: datetime | None = None, error: str = "") -> None:
    try:
        record_sends([job_id], sent_at=sent_at, error=error)
    except DatabaseError:  # the message is out (or not); the dispatcher judges by the row, at worst sends twice
        log.exception("job %s: could not record the hand-off to the broker", job_id)


def record_sends(job_ids: list[int], *, sent_at: datetime | None = None, error: str = "") -> None:
    """One more hand-off tried for each job: taken by the broker at `sent_at`, or refused with `error`. On
    PostgreSQL one fixed statement, prepared per connection (every booking's job goes through it)."""
    if connection.vendor != "postgresql":
        fields = {"send_attempts": F("send_attempts") + 1, "send_error": error}
        if sent_at is not None:
            fields["sent_at"] = sent_at
        Job.objects.filter(pk__in=job_ids).update(**fields)
        return
    with prepared_cursor() as cursor:
        if sent_at is None:
            cursor.execute(_RECORD_REFUSED_SQL, [error, job_ids])
        else:
            cursor.execute(_RECORD_SENT_SQL, [error, sent_at, job_ids])


_RECORD_SENT_SQL = (f"UPDATE {Job._meta.db_table} SET send_attempts = send_attempts + 1, send_error = %s, "  # noqa: S608
                    "sent_at = %s WHERE id = ANY(%s)")
_RECORD_REFUSED_SQL = (f"UPDATE {Job._meta.db_table} SET send_attempts = send_attempts + 1, "  # noqa: S608
                       "send_error = %s WHERE id = ANY(%s)")


def publish_each(batch: list[tuple[int, str]], *, producer: Any = None) -> tuple[list[int], list[int], str]:
    """Hand each (job id, kind) to the broker (through `producer`, e.g. a `dispatch.batch()`, when given): (the ids
    it took, the ids refused, the refusal). At the first refusal the broker is down: the rest count as refused too,
    untried (the dispatcher sends them with its backoff)."""
    sent: list[int] = []
    refused: list[int] = []
    error = ""
    for job_id, kind in batch:
        if not error:
            try:
                _publish(JOB_TASKS[kind], job_id=job_id, task_id=f"job-{job_id}-{uuid.uuid4().hex[:12]}",
                         producer=producer)
                sent.append(job_id)
                continue
            except Exception as exc:  # noqa: BLE001 (as in job_send)
                error = f"{type(exc).__name__}: {exc}"[:500]
                log.warning("job %s (%s): the broker did not take it (%s); the dispatcher sends it later",
                            job_id, kind, error)
        refused.append(job_id)
    return sent, refused, error


def _send_batch(batch: list[tuple[int, str]]) -> None:
    """The sender thread's work: hand each job to the broker, then record those it took in one UPDATE (and those
    refused in another)."""
    sent, refused, error = publish_each(batch)
    for ids, fields in ((refused, {"error": error}), (sent, {"sent_at": timezone.now()})):
        if not ids:
            continue
        try:
            record_sends(ids, **fields)
        except DatabaseError:  # as in _record_send: at worst the dispatcher sends them again
            log.exception("jobs %s: could not record the hand-off to the broker", ids)
            connection.close()  # the thread's own connection, perhaps broken: the next batch opens a new one


# This process's sender thread; it closes its database connection when idle (an idle process holds none).
sender = BackgroundBatcher("job-sender", _send_batch, on_idle=lambda: connection.close())
