"""The broker goes down: requests still answer (JSON, the rows committed), the jobs wait in their rows, and the
work starts when the broker is back (the dispatcher sends them). Real parts: a private redis-server of this test
(the suite's Redis is never stopped), a real Celery worker on it, simulated servers over SSH."""
import shutil
import socket
import subprocess
import time
from datetime import timedelta

import pytest
import redis
from celery import current_app
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.utils import timezone

from marketplace.models import Instance, Node
from provisioning.models import Job, JobKind, JobStatus
from provisioning.services.maintenance import jobs_dispatch
from tests.live import Worker, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("redis-server") is None,
                                                   reason="redis-server is not installed")]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrivateRedis:
    """A redis-server of this test alone, on a spare port, without persistence: stopped and started at will."""

    def __init__(self, folder):
        self.folder = folder
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--daemonize", "no", "--dir", str(self.folder)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_until(self.answers, 10, what="the private redis-server")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def answers(self) -> bool:
        try:
            return redis.Redis(port=self.port, socket_connect_timeout=0.5).ping()
        except redis.ConnectionError:
            return False


def _point_celery_at(url: str, monkeypatch) -> None:
    """The Celery app of this process sends to `url` from now on (its connection and producer pools are rebuilt).
    Celery reads CELERY_BROKER_URL from the environment before its configuration."""
    app = current_app
    monkeypatch.setenv("CELERY_BROKER_URL", url)
    app.conf.broker_url = url
    # Looked up again by URL in kombu's pools (kept open: the suite's broker gets its own pool back afterwards).
    app._pool = None
    app.amqp._producer_pool = None


@pytest.fixture
def private_broker(tmp_path, settings, monkeypatch):
    server = PrivateRedis(tmp_path)
    server.start()
    before = current_app.conf.broker_url
    settings.CELERY_BROKER_URL = server.url
    _point_celery_at(server.url, monkeypatch)
    assert current_app.connection_for_write().port == server.port
    yield server
    _point_celery_at(before, monkeypatch)
    server.stop()


def _public_key() -> str:
    key = Ed25519PrivateKey.generate().public_key()
    return key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def test_with_the_broker_down_requests_answer_and_the_work_starts_when_it_is_back(
        transactional_db, private_broker, sim_node_factory, simnodes_dir, api, other_api, tmp_path, capsys):
    worker = Worker(tmp_path / "worker.log", simnodes_dir, suffix="-private", broker_url=private_broker.url)
    worker.start()
    try:
        bookable, _ = sim_node_factory(api)
        assert api.post(f"/api/v1/nodes/{bookable.pk}/verify/").status_code == 202
        wait_until(lambda: Node.objects.get(pk=bookable.pk).state == "active", 60, what="the first node verified")
        pending, _ = sim_node_factory(api)

        private_broker.stop()
        started = time.monotonic()
        r = other_api.post("/api/v1/instances/", {"offer": bookable.pk, "num_gpus": 1, "image": "cuda-12-4",
                                                  "ssh_public_key": _public_key()}, format="json")
        booking_s = time.monotonic() - started
        assert r.status_code == 201 and r["Content-Type"] == "application/json", r.content
        instance_id = r.json()["id"]
        r = api.post(f"/api/v1/nodes/{pending.pk}/verify/")
        assert r.status_code == 202 and r["Content-Type"] == "application/json", r.content

        provision = Job.objects.get(instance_id=instance_id, kind=JobKind.INSTANCE_PROVISION)
        verify = Job.objects.get(node=pending, kind=JobKind.NODE_VERIFY)
        for job in (provision, verify):
            assert job.status == JobStatus.QUEUED and job.sent_at is None and job.send_attempts == 1
            assert "OperationalError" in job.send_error and "refused" in job.send_error.lower()
        assert Instance.objects.get(pk=instance_id).status == "requested"
        assert Node.objects.get(pk=pending.pk).state == "verifying"
        # Verify again: the same job, tried again, still waiting.
        assert api.post(f"/api/v1/nodes/{pending.pk}/verify/").status_code == 202
        assert Job.objects.filter(node=pending, kind=JobKind.NODE_VERIFY).count() == 1
        # The dispatcher (once the on-commit send's grace has passed): one refusal ends its run, nothing raised.
        assert jobs_dispatch(now=timezone.now() + timedelta(seconds=10))["send_failed"] == 1

        private_broker.start()  # empty: whatever it held is gone, the rows are not
        back = time.monotonic()

        def done():
            jobs_dispatch()  # beat's part, every JOB_DISPATCH_INTERVAL_S; here more often
            return (Instance.objects.get(pk=instance_id).status in ("running", "failed")
                    and Node.objects.get(pk=pending.pk).state != "verifying")

        wait_until(done, 120, interval=2, what="the jobs to run once the broker is back")
        instance = Instance.objects.get(pk=instance_id)
        assert instance.status == "running", (instance.status_message, worker.tail())
        assert Node.objects.get(pk=pending.pk).state == "active"
        for job in (provision, verify):
            job.refresh_from_db()
            assert job.status == JobStatus.SUCCEEDED and job.sent_at is not None and job.send_error == ""
            assert job.runner.split(" ")[1].startswith(worker.nodename)
        with capsys.disabled():
            print(f"\n[broker outage] booking answered in {booking_s:.2f} s with the broker down; instance "
                  f"running and node verified {time.monotonic() - back:.1f} s after the broker came back")
    finally:
        worker.stop()
