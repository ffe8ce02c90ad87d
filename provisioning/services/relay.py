"""The job relay: hands new jobs to the broker from outside the processes that created them (JOB_RELAY).

A job row committed by a booking (or any use case) is the outbox; the trigger of migration 0007 NOTIFYs
`job_outbox` when a transaction that inserted jobs commits. A relay LISTENs, wakes, and sends every job that was
never handed over (queued, `sent_at` null, no attempt yet), oldest first, in batches: each batch locks its rows
`FOR UPDATE SKIP LOCKED`, so that any number of relays share the work and a job goes out once per relay pass;
the send is recorded in one UPDATE per batch, in the same transaction. A relay that dies mid-batch leaves its jobs
unsent (its transaction rolls back); another relay, or the dispatcher, sends them. A broker that refuses a job
ends the batch: the rest are recorded as refused (one attempt), and the dispatcher takes them over with its
backoff (maintenance.jobs_dispatch), as it does for the on-commit send.

Run one or more with `scripts/run-relay` (`manage.py job_relay`).
"""
import logging
import threading
import time
from contextlib import closing

import psycopg
from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection, transaction
from django.utils import timezone

from core import dispatch
from core.sql import prepared_cursor
from provisioning.models import Job, JobStatus
from provisioning.services.jobs import publish_each, record_sends

log = logging.getLogger(__name__)

RELAY_BATCH = 200
CHANNEL = "job_outbox"

_PICK_SQL = (f"SELECT id, kind FROM {Job._meta.db_table} "  # noqa: S608 (the model's table)
             "WHERE status = %s AND sent_at IS NULL AND send_attempts = 0 ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED")


def jobs_relay_batch(*, limit: int = RELAY_BATCH) -> int:
    """Send up to `limit` never-sent jobs, oldest first, and record it; how many it took (sent or refused).
    Raises DatabaseError when the database fails (nothing recorded: the jobs stay for the next pass)."""
    with transaction.atomic():
        with prepared_cursor() as cursor:
            cursor.execute(_PICK_SQL, [JobStatus.QUEUED.value, limit])
            batch = [(job_id, kind) for job_id, kind in cursor.fetchall()]
        if batch:
            try:
                with dispatch.batch(max_size=len(batch)) as producer:  # one Redis pipeline for the batch
                    sent, refused, error = publish_each(batch, producer=producer)
            except Exception as exc:  # noqa: BLE001 (the flush failed: which went out is unknown; may go twice)
                sent, refused = [], [job_id for job_id, _ in batch]
                error = f"{type(exc).__name__}: {exc}"[:500]
                log.warning("job relay: the broker did not take a batch of %d (%s); the dispatcher sends them",
                            len(batch), error)
            if sent:
                record_sends(sent, sent_at=timezone.now())
            if refused:
                record_sends(refused, error=error)
    return len(batch)


def jobs_relay_run(*, stop: threading.Event, poll_s: float | None = None, limit: int = RELAY_BATCH) -> None:
    """Relay until `stop` is set: send what is waiting, then sleep until a NOTIFY (or `poll_s`, JOB_RELAY_POLL_S,
    for a notification missed while the listening connection was re-opened). Database errors are logged and
    retried with a growing pause; they never end the loop."""
    poll_s = settings.JOB_RELAY_POLL_S if poll_s is None else poll_s
    listener: psycopg.Connection | None = None
    pause = 0.5
    while not stop.is_set():
        try:
            if listener is None:
                listener = _listen()
            close_old_connections()  # CONN_MAX_AGE and health checks, as between a worker's tasks
            while jobs_relay_batch(limit=limit) >= limit and not stop.is_set():
                pass  # a full batch: more may be waiting
            _wait(listener, stop, poll_s)
            pause = 0.5
        except (DatabaseError, OSError) as exc:
            log.warning("job relay: the database failed (%s); again in %.1f s", exc, pause)
            _close(listener)
            listener = None
            connection.close()
            stop.wait(pause)
            pause = min(pause * 2, 30.0)
        except Exception as exc:  # noqa: BLE001 (psycopg's own errors on the listening connection)
            log.warning("job relay: %s: %s; again in %.1f s", type(exc).__name__, exc, pause)
            _close(listener)
            listener = None
            stop.wait(pause)
            pause = min(pause * 2, 30.0)
    _close(listener)
    connection.close()


def _listen() -> psycopg.Connection:
    """A connection of its own, in autocommit, that LISTENs: Django's may be closed between batches."""
    listener = psycopg.connect(**connection.get_connection_params(), autocommit=True)
    listener.execute(f"LISTEN {CHANNEL}")
    return listener


def _wait(listener: psycopg.Connection, stop: threading.Event, poll_s: float) -> None:
    """Until a notification, `poll_s`, or `stop` (checked every second, so that a stop is prompt)."""
    deadline = time.monotonic() + poll_s
    while not stop.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        # A generator of psycopg's holds the connection's lock until it is closed: one at a time, closed at once.
        with closing(listener.notifies(timeout=min(left, 1.0), stop_after=1)) as notifies:
            woken = next(notifies, None) is not None
        if woken:
            with closing(listener.notifies(timeout=0.0)) as more:  # what else came meanwhile: one pass sends all
                for _ in more:
                    pass
            return


def _close(listener: psycopg.Connection | None) -> None:
    if listener is not None:
        try:
            listener.close()
        except Exception:  # noqa: BLE001, S110 (closing a broken connection: nothing to do about it)
            pass
