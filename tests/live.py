"""Fixtures with real processes, shared by tests/e2e and tests/web: a real Celery worker on Redis against the
test database, and simulated GPU servers (real sshd processes) registered through the API.

Registered for the whole suite by tests/conftest.py, so that one session has one worker whichever folders run
(a second worker would take tasks meant for the first). Under pytest-xdist each xdist worker has its own session,
hence its own Celery worker, on its own broker database (config/settings/test.py)."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from django.conf import settings
from django.db import connection

from config.celery import QUEUES
from marketplace.models import Node
from provisioning import sim

ROOT = Path(__file__).resolve().parents[1]


def wait_until(predicate, timeout=30.0, interval=0.2, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    # The suite's worker usually holds the reason (a task never received, or stuck): show its last lines.
    tail = f"\n--- the session worker's log, last lines ---\n{_session_worker.tail(40)}" if _session_worker else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{tail}")


_session_worker: "Worker | None" = None


def _database_url() -> str:
    db = connection.settings_dict
    return f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"


class Worker:
    """A `celery worker` process of this project, started and stopped by the tests.

    `suffix` tells several workers apart (their node name, `nodename`, is what a job's `runner` names);
    `broker_url` points one at another broker than the suite's; `queues` are the queues it takes tasks from
    (config/celery.py; all by default); `env` adds to its environment."""

    def __init__(self, log_path: Path, simnodes_dir: Path, *, suffix: str = "", broker_url: str | None = None,
                 queues: tuple[str, ...] = QUEUES, concurrency: int = 2, env: dict[str, str] | None = None):
        self.log_path = log_path
        self.queues = queues  # all of them by default: one worker does everything the e2e tests ask
        self.concurrency = concurrency
        self.extra_env = env or {}
        self.simnodes_dir = simnodes_dir
        self.broker_url = broker_url
        self.nodename = f"e2e-{os.getpid()}{suffix}@{socket.gethostname()}"
        self.proc = None
        self.consuming = True  # it takes tasks from its queues (consume())

    def start(self):
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "config.settings.test",
            "DATABASE_URL": _database_url(),
            "CELERY_BROKER_URL": self.broker_url or settings.CELERY_BROKER_URL,
            "CACHE_URL": settings.CACHE_URL,
            "SIMNODES_DIR": str(self.simnodes_dir),
            "DATABASE_CONN_MAX_AGE": "0",  # no idle connection may block the tests' TRUNCATE between tests
            **self.extra_env,
        }
        self.consuming = True  # a new process takes from every queue it is given
        self.log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop)
        since = self.log.tell()  # a restarted worker: wait for its own "ready."
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "config", "worker", "--pool", "prefork",
             "--concurrency", str(self.concurrency), "--loglevel", "INFO", "--without-gossip", "--without-mingle",
             "--hostname", self.nodename,
             "--queues", ",".join(self.queues)],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        wait_until(lambda: b"ready." in self.log_path.read_bytes()[since:], 60,
                   what="the celery worker to be ready")

    def consume(self, on: bool, settle_s: float = 10.0) -> None:
        """Start or stop taking tasks from its queues (Celery's remote control: add_consumer / cancel_consumer,
        each answered by the worker before this returns). Before it starts, what waits in the queues is dropped:
        tests that had no worker queued it. Stopping waits, up to `settle_s`, for the tasks it has taken to end,
        so that none outlives the test that queued it."""
        if on == self.consuming or self.proc is None or self.proc.poll() is not None:
            return
        from config.celery import app

        control = app.control
        if on:
            control.purge()
        for queue in self.queues:
            (control.add_consumer if on else control.cancel_consumer)(queue, destination=[self.nodename],
                                                                        reply=True, timeout=5.0)
        self.consuming = on
        if on:
            return
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            inspect = control.inspect(destination=[self.nodename], timeout=1.0, limit=1)
            if not any((inspect.active() or {}).values()) and not any((inspect.reserved() or {}).values()):
                break
            time.sleep(0.1)
        # A task it holds with a countdown (a retry, a follow-up check) would still run when due, in whatever test
        # runs then: revoked, the worker drops it instead.
        scheduled = control.inspect(destination=[self.nodename], timeout=1.0, limit=1).scheduled() or {}
        held = [entry["request"]["id"] for entries in scheduled.values() for entry in entries]
        if held:
            control.revoke(held, destination=[self.nodename])

    def children(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split()]

    def kill(self):
        """SIGKILL the worker and its pool at once (its process group), as a lost machine or the OOM killer would:
        it acknowledges nothing and gives nothing back."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if self.proc:
            self.log.close()

    def tail(self, n=60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


@pytest.fixture(scope="session")
def simnodes_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("e2e-simnodes")
    yield base
    sim.nodes_down(base)


@pytest.fixture(scope="session")
def celery_worker(django_db_setup, django_db_blocker, simnodes_dir, tmp_path_factory):
    # Tasks left in the test broker by earlier runs (or by tests without a worker) must not run here.
    redis.Redis.from_url(settings.CELERY_BROKER_URL).flushdb()
    worker = Worker(tmp_path_factory.mktemp("worker") / "worker.log", simnodes_dir)
    with django_db_blocker.unblock():
        worker.start()
    global _session_worker
    _session_worker = worker
    yield worker
    _session_worker = None
    worker.stop()


WANT_THE_WORKER = {"worker", "celery_worker"}


def session_worker_for(request) -> None:
    """Only a test that asks for the suite's worker (`worker`, `celery_worker`) has its tasks run by it. Another
    test's commits queue tasks too (a booking queues its provisioning), and a worker left running by an earlier
    test would run them against the test's rows while the test tears down: its TRUNCATE then deadlocks with the
    task's transaction, now and then (tests/conftest.py calls this for every test)."""
    if _session_worker is not None:
        _session_worker.consume(bool(WANT_THE_WORKER & set(request.fixturenames)))


@pytest.fixture
def worker(celery_worker, transactional_db):
    """The running worker, for a test whose writes it must see (committed, not in a test transaction).

    Before the teardown empties the tables, the worker stops taking tasks and the ones it runs end: a task still
    writing then (the last check's follow-ups) deadlocked with the flush's table locks now and then (an ERROR in
    tests/web/test_browser.py on a CI run)."""
    yield celery_worker
    if celery_worker.proc.poll() is not None:
        print(celery_worker.tail())
    celery_worker.consume(False, settle_s=30.0)


@pytest.fixture
def sim_node_factory(simnodes_dir):
    """Start a simulated server, register it through the API as `client`'s node, install its key."""
    started = []

    def make(client, profile="rtx-a4000-x2", gpu_model="rtx-a4000", gpu_count=2, pin=True, **fields):
        info = sim.node_up(profile, simnodes_dir)
        started.append(info["ssh_port"])
        body = {
            "name": f"sim-{info['ssh_port']}", "address": info["address"], "ssh_port": info["ssh_port"],
            "ssh_user": info["ssh_user"], "country": "DE", "city": "Berlin", "gpu_model": gpu_model,
            "gpu_count": gpu_count, "price_per_gpu_hour": "0.500000", "runtime": "sim",
            **({"host_key_fingerprint": info["host_key_fingerprint"]} if pin else {}), **fields,
        }
        response = client.post("/api/v1/nodes/", body, format="json")
        assert response.status_code == 201, response.content
        node = response.json()
        sim.node_authorize(info["ssh_port"], node["public_key"], simnodes_dir)
        return Node.objects.get(pk=node["id"]), info

    yield make
    for port in started:
        sim.node_down(port, simnodes_dir)
