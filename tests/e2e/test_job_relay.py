"""The production path of a job with PostgreSQL (JOB_RELAY): the web process commits the job row and sends nothing;
`manage.py job_relay`, woken by the commit's NOTIFY, hands it to the broker; the real worker verifies the node and
provisions the instance. No beat runs here, so nothing else could send the jobs."""
import os
import signal
import subprocess
import sys

import pytest
from django.conf import settings

from marketplace.models import Instance, Node
from provisioning.models import Job
from tests.live import ROOT, _database_url, wait_until
from tests.marketplace.renting_helpers import ed25519_key

pytestmark = pytest.mark.slow


@pytest.fixture
def relay_process(worker, tmp_path, settings):
    log = tmp_path / "relay.log"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings.test", "DATABASE_URL": _database_url(),
           "CELERY_BROKER_URL": settings.CELERY_BROKER_URL, "CACHE_URL": settings.CACHE_URL, "JOB_RELAY": "1",
           "JOB_RELAY_POLL_S": "3600", "DATABASE_CONN_MAX_AGE": "0"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "manage.py", "job_relay"], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    wait_until(lambda: b"listening" in log.read_bytes(), 30, what="the relay to start")
    settings.JOB_RELAY = True  # this process (the API) leaves its jobs to the relay
    yield proc
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0, log.read_text()


def test_with_the_relay_a_node_is_verified_and_an_instance_runs(relay_process, worker, sim_node_factory, api,
                                                                  other_api):
    node, _ = sim_node_factory(api, profile="rtx-a4000-x2", gpu_model="rtx-a4000", gpu_count=2)
    assert api.post(f"/api/v1/nodes/{node.pk}/verify/").status_code == 202
    wait_until(lambda: Node.objects.get(pk=node.pk).state == "active", 60, what="the node to be verified")

    r = other_api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "cuda-12-4",
                                              "ssh_public_key": ed25519_key()}, format="json")
    assert r.status_code == 201, r.content
    instance_id = r.json()["id"]
    wait_until(lambda: Instance.objects.get(pk=instance_id).status in ("running", "failed"), 60,
               what="the instance to run")
    assert Instance.objects.get(pk=instance_id).status == "running", worker.tail()
    for job in Job.objects.filter(node=node).order_by("id"):  # each sent once, by the relay
        assert job.sent_at is not None and job.send_attempts == 1 and job.send_error == "", job
    assert relay_process.poll() is None
    assert settings.JOB_RELAY
