"""The job relay (JOB_RELAY, provisioning/services/relay.py): a booking leaves its job to the relay, which a NOTIFY
wakes at commit and which sends each new job once however many relays run, records the sends in batches, and leaves
what the broker refused to the dispatcher. The `manage.py job_relay` process: woken by the commit (not by its poll),
stopped by SIGTERM."""
import os
import signal
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone

from provisioning.models import Job, JobKind, JobStatus
from provisioning.services import jobs as job_svc
from provisioning.services import maintenance, relay
from tests.factories import make_listed_node, make_node
from tests.live import _database_url, wait_until
from tests.provisioning.test_job_outbox import public_key

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def relay_on(settings):
    settings.JOB_RELAY = True
    settings.JOB_SEND_IN_BACKGROUND = True  # as in production: the relay, not the sender thread, must send
    yield
    assert job_svc.sender.stop()


def test_a_booking_leaves_its_job_to_the_relay_which_sends_it_once(transactional_db, broker, relay_on, other_api):
    listed = make_listed_node(gpu_count=2)
    r = other_api.post("/api/v1/instances/", {"offer": listed.pk, "num_gpus": 1, "image": "cuda-12-4",
                                              "ssh_public_key": public_key()}, format="json")
    assert r.status_code == 201, r.content
    assert job_svc.sender.flush(timeout=5)
    job = Job.objects.get(instance_id=r.json()["id"])
    assert broker.messages == [] and job.sent_at is None and job.send_attempts == 0  # nothing sent by the web

    assert relay.jobs_relay_batch() == 1
    [(name, job_id, task_id)] = broker.messages
    job.refresh_from_db()
    assert (name, job_id) == ("provisioning.tasks.instance_provision", job.pk) and task_id.startswith(f"job-{job.pk}-")
    assert job.sent_at is not None and job.send_attempts == 1 and job.send_error == ""
    assert relay.jobs_relay_batch() == 0 and len(broker.messages) == 1  # sent: not again
    assert maintenance.jobs_dispatch(now=timezone.now() + timedelta(seconds=30))["sent"] == 0


def test_a_refused_batch_is_recorded_and_left_to_the_dispatcher(transactional_db, broker, relay_on):
    broker.down = True
    jobs = [job_svc.job_create(kind=JobKind.NODE_VERIFY, node=make_node()) for _ in range(3)]
    assert relay.jobs_relay_batch() == 3
    for job in jobs:
        job.refresh_from_db()
        assert job.sent_at is None and job.send_attempts == 1 and job.send_error.startswith("OperationalError")
    assert relay.jobs_relay_batch() == 0  # the relay takes only jobs never tried; the dispatcher backs off
    broker.down = False
    assert maintenance.jobs_dispatch(now=timezone.now() + timedelta(seconds=30))["sent"] == 3
    assert sorted(broker.job_ids()) == sorted(job.pk for job in jobs)


def test_a_batch_whose_flush_fails_is_recorded_refused_whole(transactional_db, broker, relay_on, monkeypatch):
    """The relay publishes a batch through one pipeline (core.dispatch.batch): when the flush fails, which messages
    went out is unknown, so every job of the batch is recorded refused and left to the dispatcher (a copy too many
    is harmless: runner.job_begin lets one execution hold a job)."""
    from contextlib import contextmanager

    from kombu.exceptions import OperationalError

    @contextmanager
    def failing_batch(max_size):
        yield None
        raise OperationalError("Error 32 while writing to socket. Broken pipe.")

    monkeypatch.setattr(relay.dispatch, "batch", failing_batch)
    jobs = [job_svc.job_create(kind=JobKind.NODE_VERIFY, node=make_node()) for _ in range(2)]
    assert relay.jobs_relay_batch() == 2
    for job in jobs:
        job.refresh_from_db()
        assert job.sent_at is None and job.send_attempts == 1 and "Broken pipe" in job.send_error
    assert maintenance.jobs_dispatch(now=timezone.now() + timedelta(seconds=30))["sent"] == 2


def test_relays_side_by_side_send_each_job_exactly_once(transactional_db, broker, relay_on):
    """Four relays (threads, each on its own connection) drain 120 jobs in batches of 7: SKIP LOCKED shares them."""
    nodes = [make_node() for _ in range(120)]
    for node in nodes:
        job_svc.job_create(kind=JobKind.NODE_VERIFY, node=node)
    errors = []

    def one_relay():
        try:
            while relay.jobs_relay_batch(limit=7):
                pass
        except Exception as exc:  # noqa: BLE001 (reported by the test)
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=one_relay) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    ids = broker.job_ids()
    assert len(ids) == 120 and len(set(ids)) == 120
    assert not Job.objects.filter(sent_at__isnull=True).exists()


def test_the_relay_loop_is_woken_by_the_commit_and_stops_when_told(transactional_db, broker, relay_on):
    stop = threading.Event()
    loop = threading.Thread(target=relay.jobs_relay_run, kwargs={"stop": stop, "poll_s": 3600})
    loop.start()
    try:
        wait_until(lambda: _listening(), 10, what="the relay to LISTEN")
        first = job_svc.job_create(kind=JobKind.NODE_VERIFY, node=make_node())  # autocommit: the commit NOTIFYs
        wait_until(lambda: first.pk in broker.job_ids(), 10, what="the relay to send the job")
        # Now it is waiting (it sent the first): with a poll of an hour, only the next commit can wake it.
        second = job_svc.job_create(kind=JobKind.NODE_VERIFY, node=make_node())
        wait_until(lambda: second.pk in broker.job_ids(), 10, what="the relay to send the second job")
        assert sorted(broker.job_ids()) == [first.pk, second.pk]
    finally:
        stop.set()
        loop.join(10)
    assert not loop.is_alive()


def _listening() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE query = 'LISTEN job_outbox'")
        return cursor.fetchone()[0] > 0


def test_the_relay_command_sends_over_the_real_broker_and_ends_on_sigterm(transactional_db, settings, tmp_path):
    """`manage.py job_relay` with a poll of an hour: only the commit's NOTIFY can wake it in time. Its broker keys
    have a prefix of their own (CELERY_BROKER_KEY_PREFIX), read here: no worker takes from them."""
    import redis

    prefix = f"relay-test-{os.getpid()}-"
    redis_db = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    log = tmp_path / "relay.log"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings.test", "DATABASE_URL": _database_url(),
           "CELERY_BROKER_URL": settings.CELERY_BROKER_URL, "CELERY_BROKER_KEY_PREFIX": prefix, "JOB_RELAY": "1",
           "JOB_RELAY_POLL_S": "3600", "DATABASE_CONN_MAX_AGE": "0"}
    queue = _Queue(redis_db, prefix + "ssh")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "manage.py", "job_relay"], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: b"listening" in log.read_bytes() and _listening(), 30, what="the relay to LISTEN")
        settings.JOB_RELAY = True
        for n in (1, 2):  # the second commit comes when the relay waits: only its NOTIFY can wake it in time
            job = job_svc.job_create(kind=JobKind.NODE_VERIFY, node=make_node())
            wait_until(lambda: Job.objects.filter(pk=job.pk, sent_at__isnull=False).exists(), 20,  # noqa: B023
                       what=f"the relay to send job {n}")
            message = queue.newest()
            assert f'"id": "job-{job.pk}-'.encode() in message and b"provisioning.tasks.node_verify" in message
            assert Job.objects.get(pk=job.pk).status == JobStatus.QUEUED
        assert queue.length() == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, log.read_text()
        queue.delete()
    assert b"job relay: stopped" in log.read_bytes()


class _Queue:
    def __init__(self, redis_db, key):
        self.redis, self.key = redis_db, key

    def newest(self) -> bytes:
        return self.redis.lindex(self.key, 0)  # kombu LPUSHes: the newest first

    def length(self) -> int:
        return self.redis.llen(self.key)

    def delete(self) -> None:
        self.redis.delete(self.key)
