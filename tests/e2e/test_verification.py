"""Verification end to end: API → Celery worker (Redis) → SSH with a pinned host key → the agent on a
simulated server → verdict and listing."""
import os
import signal
import socket
import subprocess

import pytest
from django.utils import timezone

from marketplace.models import Node, NodeState
from provisioning import sim
from provisioning.models import Job, NodeEvent, VerificationRun
from tests.e2e.conftest import wait_until

pytestmark = pytest.mark.slow


def _banner(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            return sock.recv(4) == b"SSH-"
    except OSError:
        return False


def _settled(node_id):
    node = Node.objects.get(pk=node_id)
    return node if node.state != NodeState.VERIFYING else None


def _job_closed(node):
    """The node's job once it has recorded its end: the node settles a moment before (its state is written in a
    transaction of its own), so a job read at once may still be `running` on a loaded machine."""
    return wait_until(lambda: Job.objects.filter(node=node).exclude(status__in=("queued", "running")).first(), 30,
                      what="the node's job to close")


def test_honest_node_is_verified_and_listed(worker, sim_node_factory, api, anon):
    node, info = sim_node_factory(api, profile="rtx-a4000-x2", gpu_model="rtx-a4000", gpu_count=2)
    r = api.post(f"/api/v1/nodes/{node.pk}/verify/")
    assert r.status_code == 202, r.content
    assert r.json()["state"] == "verifying" and r.json()["current_job"]["kind"] == "node_verify"
    node = wait_until(lambda: _settled(node.pk), 60, what="the verification to end")
    assert (node.state, node.verdict) == ("active", "verified"), (node.last_error, worker.tail())
    gpus = list(node.gpus.order_by("index"))
    assert all(g.uuid.startswith("GPU-") and g.pci_bus_id for g in gpus)
    run = VerificationRun.objects.get(node=node)
    assert run.verdict == "verified" and run.inventory["gpus"][0]["name"] == "NVIDIA RTX A4000"
    job = _job_closed(node)
    assert job.status == "succeeded" and [step["message"] for step in job.log][-1] == "done"
    offers = anon.get("/api/v1/offers/?gpu_model=rtx-a4000").json()["results"]
    assert [o["id"] for o in offers] == [node.pk]
    # Renters see the check's summary on the offer: its verdict and the medians measured per GPU.
    summary = offers[0]["benchmark"]
    assert summary["verdict"] == "verified" and summary["findings"] == []
    measured = run.figures["median"]
    assert summary["median_per_gpu"]["bf16_tflops"] == measured["bf16_tflops"] > 0
    assert 0.65 * 76.7 <= summary["median_per_gpu"]["bf16_tflops"] <= 1.15 * 76.7  # the A4000's dense BF16


def test_first_contact_pins_the_host_key(worker, sim_node_factory, api):
    node, info = sim_node_factory(api, pin=False)
    api.post(f"/api/v1/nodes/{node.pk}/verify/")
    node = wait_until(lambda: _settled(node.pk), 60, what="the verification to end")
    assert node.host_key_fingerprint == info["host_key_fingerprint"]
    assert NodeEvent.objects.filter(node=node, kind="host_key_pinned").exists()


def test_changed_host_key_quarantines_and_sends_nothing(worker, sim_node_factory, api, simnodes_dir):
    node, info = sim_node_factory(api)
    # Reached before (its key pinned at that first contact): a key other than the one given at registration on a
    # node never reached is the registration's mistake, not a change (DeclaredHostKeyWrong, no quarantine).
    Node.objects.filter(pk=node.pk).update(control_proven_at=timezone.now())
    # The server is "reinstalled": same address and port, a new host key (sshd re-reads it on SIGHUP).
    node_dir = simnodes_dir / "nodes" / str(info["ssh_port"])
    for path in node_dir.glob("ssh_host_ed25519_key*"):
        path.unlink()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(node_dir / "ssh_host_ed25519_key")],
                   check=True)
    os.kill(info["pid"], signal.SIGHUP)
    wait_until(lambda: _banner(info["ssh_port"]), 10, what="sshd to come back")
    api.post(f"/api/v1/nodes/{node.pk}/verify/")
    node = wait_until(lambda: _settled(node.pk), 60, what="the verification to end")
    assert node.state == "quarantined", (node.state, node.last_error)
    assert "host key changed" in node.last_error
    assert NodeEvent.objects.filter(node=node, kind="host_key_changed", level="critical").exists()
    assert _job_closed(node).status == "failed"
    # Nothing was sent: the agent was never uploaded to the new server.
    home = node_dir / "home"
    assert not (home / ".gpumarket").exists()


def test_missing_key_is_explained_to_the_provider(worker, sim_node_factory, api, simnodes_dir):
    node, info = sim_node_factory(api)
    (simnodes_dir / "nodes" / str(info["ssh_port"]) / "authorized_keys").write_text("")
    body = api.post(f"/api/v1/nodes/{node.pk}/verify/").json()
    assert body["state"] == "verifying"
    node = wait_until(lambda: _settled(node.pk), 60, what="the verification to end")
    assert node.state == "pending"
    # Never contacted: the one first-contact message, not the cause (review r54: no port-scan oracle).
    assert "Could not log in to" in node.last_error and "install command was run as" in node.last_error
    assert _job_closed(node).status == "failed"
    assert api.get(f"/api/v1/nodes/{node.pk}/").json()["current_job"]["status"] == "failed"


def test_unreachable_node_fails_the_job_with_a_reason(worker, sim_node_factory, api, simnodes_dir):
    node, info = sim_node_factory(api)
    sim.node_down(info["ssh_port"], simnodes_dir)
    api.post(f"/api/v1/nodes/{node.pk}/verify/")
    node = wait_until(lambda: _settled(node.pk), 120, what="the verification to give up")
    assert node.state == "pending"
    # Never contacted: the one first-contact message, not the cause, and no retries at once whose count would tell
    # an unreachable address from a refused key (review r54); nodes_verify_pending tries again later.
    assert "Could not log in to" in node.last_error and "Cannot reach" not in node.last_error
    job = _job_closed(node)
    assert job.status == "failed" and job.attempts == 1
