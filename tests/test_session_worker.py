"""The suite's Celery worker takes tasks only during the tests that ask for it (tests/live.py, session_worker_for).
Before, a test without it that committed a booking had the booking's provisioning run by a worker an earlier test
had started, against the test's rows while the test tore down; the teardown's TRUNCATE then deadlocked with the
task's transaction now and then (an ERROR in tests/test_core_sql.py on a CI run)."""
import uuid

import pytest
import redis
from django.conf import settings

from config.celery import FLEET
from core import dispatch
from tests.live import WANT_THE_WORKER, wait_until

TASK = "notifications.tasks.email_send"  # routed to the fleet queue; an unknown notification id is a no-op


def _queued() -> int:
    return redis.Redis.from_url(settings.CELERY_BROKER_URL).llen(FLEET)


def _received(worker, task_id: str) -> bool:
    return f"[{task_id}] received" in worker.log_path.read_text(errors="replace")


@pytest.mark.django_db(transaction=True)
def test_a_stopped_worker_leaves_tasks_queued_and_drops_them_before_it_takes_tasks_again(celery_worker):
    try:
        celery_worker.consume(False)
        stray = str(uuid.uuid4())
        dispatch.send(TASK, 0, task_id=stray)
        wait_until(lambda: _queued() >= 1, 5, what="the task in the fleet queue")
        with pytest.raises(AssertionError):  # it stays there: nothing takes it
            wait_until(lambda: _received(celery_worker, stray) or _queued() == 0, 2, what="the worker to take it")
    finally:
        celery_worker.consume(True)
    assert _queued() == 0 and not _received(celery_worker, stray)  # dropped, never run
    taken = str(uuid.uuid4())
    dispatch.send(TASK, 0, task_id=taken)
    wait_until(lambda: _received(celery_worker, taken), 20, what="the worker to take a task sent after")


def test_only_the_tests_that_ask_for_the_worker_have_it_take_tasks(request):
    assert WANT_THE_WORKER == {"worker", "celery_worker"}
    assert not WANT_THE_WORKER & set(request.fixturenames)  # this one does not: the worker, if any, takes nothing
    from tests import live

    if live._session_worker is not None:
        assert live._session_worker.consuming is False


@pytest.mark.django_db(transaction=True)
def test_a_stopped_worker_drops_the_tasks_it_holds_for_later(celery_worker):
    """A task taken with a countdown (a retry, a follow-up) would run when due, in whichever test runs then: the
    worker fixture's teardown stops the worker taking tasks, and that revokes what it holds."""
    from config.celery import app

    held = str(uuid.uuid4())
    try:
        celery_worker.consume(True)
        app.send_task(TASK, args=[0], task_id=held, countdown=120)
        wait_until(lambda: _received(celery_worker, held), 20, what="the worker to take the task with a countdown")
        celery_worker.consume(False)
        revoked = app.control.inspect(destination=[celery_worker.nodename], timeout=2.0, limit=1).revoked() or {}
        assert held in {task_id for ids in revoked.values() for task_id in ids}
    finally:
        celery_worker.consume(True)
