"""Queues by kind of work (config/celery.py): every task routed, and real workers on separate queues.

The live tests run their own workers (`ssh` and `money`, nothing on `fleet`) under a broker key prefix of their
own (CELERY_BROKER_KEY_PREFIX), so that the suite's all-queue worker (tests/live.py), if one runs, never takes
their tasks; this process sends through a Celery app with the same prefix and the project's routes.
"""
import socket
import threading
import time
import uuid
from datetime import timedelta

import pytest
import redis
from celery import Celery
from django.conf import settings
from django.utils import timezone

from config.celery import FLEET, MONEY, QUEUES, SSH, TASK_ROUTES
from config.celery import app as celery_app
from marketplace.models import Instance, InstanceStatus, Node, NodeState
from provisioning.models import Job, JobKind, JobStatus
from provisioning.services.jobs import JOB_TASKS, job_create
from tests.billing.helpers import balance, running
from tests.factories import UserFactory, make_listed_node, make_node
from tests.live import Worker, wait_until

# The tests of `queue_workers` (two Celery workers, module scope) on one xdist worker (`make test`'s --dist
# loadgroup): spread over two, each started its own pair (3 to 4 s each).
ONE_PAIR_OF_WORKERS = pytest.mark.xdist_group("test_queues_workers")


def _project_tasks() -> set[str]:
    celery_app.loader.import_default_modules()  # what a worker registers: every app's tasks module
    return {name for name in celery_app.tasks if not name.startswith("celery.")}


def test_every_registered_task_has_a_route_to_a_known_queue():
    tasks = _project_tasks()
    assert len(tasks) >= 15, tasks  # the discovery found the apps' tasks
    unrouted = sorted(tasks - set(TASK_ROUTES))
    assert not unrouted, f"tasks without a route in config/celery.py TASK_ROUTES: {unrouted}"
    stale = sorted(set(TASK_ROUTES) - tasks)
    assert not stale, f"routes for tasks that do not exist: {stale}"
    assert {route["queue"] for route in TASK_ROUTES.values()} == set(QUEUES)


def test_routes_by_kind_of_work_through_the_apps_router():
    def queue_of(name):
        return celery_app.amqp.router.route({}, name)["queue"].name

    for name in JOB_TASKS.values():  # every job drives a node over SSH
        assert queue_of(name) == SSH, name
    for name in ("provisioning.tasks.nodes_health_check", "provisioning.tasks.nodes_reconcile",
                 "provisioning.tasks.nodes_reverify_due", "provisioning.tasks.nodes_verify_pending",
                 "provisioning.tasks.jobs_dispatch", "provisioning.tasks.jobs_reap"):
        assert queue_of(name) == FLEET, name
    for name in ("billing.tasks.usage_meter_tick", "billing.tasks.top_up_charge", "billing.tasks.top_ups_reconcile",
                 "billing.tasks.payouts_run"):
        assert queue_of(name) == MONEY, name


def test_beat_schedules_every_periodic_task_to_a_routed_queue():
    for entry, spec in settings.CELERY_BEAT_SCHEDULE.items():
        assert spec["task"] in TASK_ROUTES, f"beat entry {entry} has no route"
        assert "queue" not in spec.get("options", {}), f"beat entry {entry} routes itself; route it in one place"


# ------------------------------------------------------------------------------------- real workers


@pytest.fixture(scope="module")
def prefix():
    value = f"test-queues-{uuid.uuid4().hex[:8]}:"
    yield value
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    for key in client.scan_iter(match=f"{value}*"):
        client.delete(key)


@pytest.fixture(scope="module")
def sender(prefix):
    """A Celery app that publishes as the project's does (same routes and queues), under the prefix."""
    app = Celery("test-queues", broker=settings.CELERY_BROKER_URL, set_as_current=False)
    app.conf.broker_transport_options = {**settings.CELERY_BROKER_TRANSPORT_OPTIONS, "global_keyprefix": prefix}
    app.conf.task_queues = celery_app.conf.task_queues
    app.conf.task_routes = celery_app.conf.task_routes
    app.conf.task_default_queue = celery_app.conf.task_default_queue
    yield app
    app.close()


@pytest.fixture(scope="module")
def queue_workers(django_db_setup, django_db_blocker, prefix, tmp_path_factory):
    """An `ssh` worker with one slot (so one long job makes it busy) and a `money` worker; none on `fleet`."""
    base = tmp_path_factory.mktemp("queue-workers")
    env = {"CELERY_BROKER_KEY_PREFIX": prefix}
    workers = {
        SSH: Worker(base / "ssh.log", base, suffix="-ssh", queues=(SSH,), concurrency=1, env=env),
        MONEY: Worker(base / "money.log", base, suffix="-money", queues=(MONEY,), concurrency=1, env=env),
    }
    with django_db_blocker.unblock():
        for worker in workers.values():
            worker.start()
    yield workers
    for worker in workers.values():
        if worker.proc.poll() is None:
            worker.kill()  # the ssh worker may still be inside a long job: no warm shutdown wait


@pytest.fixture
def send_through(monkeypatch, sender):
    """What services queue on commit (core.dispatch.send: jobs and billing tasks) goes through `sender`."""
    monkeypatch.setattr("core.dispatch.send",
                        lambda name, *args, task_id=None, producer=None: sender.send_task(name, args=list(args),
                                                                                           task_id=task_id))
    return sender


def _ran(worker: Worker, task_id: str) -> bool:
    return f"[{task_id}] succeeded" in worker.log_path.read_text(errors="replace")


def _received(worker: Worker, task_id: str) -> bool:
    return f"[{task_id}] received" in worker.log_path.read_text(errors="replace")


@ONE_PAIR_OF_WORKERS
def test_two_workers_on_different_queues_each_take_only_their_tasks(queue_workers, sender, prefix,
                                                                     transactional_db):
    ssh, money = queue_workers[SSH], queue_workers[MONEY]
    meter = sender.send_task("billing.tasks.usage_meter_tick").id
    # A job task for a job that does not exist: the ssh worker takes it, re-reads the row, and returns.
    verify = sender.send_task(JOB_TASKS[JobKind.NODE_VERIFY], args=[987654321]).id
    reap = sender.send_task("provisioning.tasks.jobs_reap").id

    wait_until(lambda: _ran(money, meter), 60, what="the money worker to run the meter tick")
    wait_until(lambda: _ran(ssh, verify), 60, what="the ssh worker to run the job task")
    assert not _received(ssh, meter) and not _received(money, verify)
    # The fleet task waits in the fleet queue (no fleet worker here), taken by neither.
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    assert client.llen(f"{prefix}{FLEET}") == 1
    assert not _received(ssh, reap) and not _received(money, reap)
    assert client.llen(f"{prefix}{SSH}") == 0 and client.llen(f"{prefix}{MONEY}") == 0


@pytest.fixture
def hung_node_port():
    """A TCP port that accepts connections and never says anything: a node whose SSH hangs (no banner)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held, stop = [], threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(2)
    for conn in held:
        conn.close()
    server.close()


@ONE_PAIR_OF_WORKERS
def test_a_long_ssh_job_does_not_delay_the_meter_tick_or_a_zero_balance_stop(
        queue_workers, send_through, hung_node_port, transactional_db):
    ssh = queue_workers[SSH]
    # The ssh worker's one slot: verifying a node whose SSH never answers (three 10 s connection attempts).
    hung = make_node(UserFactory(), address="127.0.0.1", ssh_port=hung_node_port, state=NodeState.VERIFYING)
    job = job_create(kind=JobKind.NODE_VERIFY, node=hung)
    wait_until(lambda: Job.objects.filter(pk=job.pk, status=JobStatus.RUNNING).exists(), 60,
               what="the ssh worker to start the long job")

    # A renter with nothing in the wallet, running for ten minutes on a healthy node.
    renter = UserFactory()
    node = make_listed_node(UserFactory(), price="1.500000")
    instance = running(renter, node)
    Instance.objects.filter(pk=instance.pk).update(started_at=timezone.now() - timedelta(minutes=10))
    Node.objects.filter(pk=node.pk).update(last_seen_at=timezone.now())

    started = time.monotonic()
    send_through.send_task("billing.tasks.usage_meter_tick")
    wait_until(lambda: Instance.objects.get(pk=instance.pk).status != InstanceStatus.RUNNING, 30,
               what="the money worker to stop the instance at zero balance")
    took = time.monotonic() - started
    print(f"meter tick + zero-balance stop on the money worker: {took:.2f} s, the ssh worker busy")

    instance.refresh_from_db()
    assert instance.status in (InstanceStatus.STOPPING, InstanceStatus.STOPPED), instance.status
    assert instance.billed_seconds >= 600 and balance(renter) < 0
    # ...while the long job still holds the ssh worker's only slot: it was neither done nor waited for.
    job.refresh_from_db()
    assert job.status == JobStatus.RUNNING and job.attempts == 1, (job.status, job.step)
    task_id = job.runner.split(" ", 1)[0]
    assert _received(ssh, task_id) and not _ran(ssh, task_id)
    assert took < 20, f"the tick and the stop took {took:.1f}s"
    # The stop's own SSH job waits for the ssh worker, in the ssh queue.
    assert Job.objects.filter(instance_id=instance.pk, kind=JobKind.INSTANCE_STOP, status=JobStatus.QUEUED).exists()
