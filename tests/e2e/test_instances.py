"""Renting end to end: book through the API, a real worker provisions a VM on a simulated server
over SSH, the renter logs in with the ssh command shown, then stop, start, restart, destroy."""
import os
import signal
import socket
import subprocess
import time

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.conf import settings
from django.core.cache import cache

from marketplace.models import Gpu, GpuAllocation, Instance, Node
from provisioning.models import Job, NodeEvent
from provisioning.services.maintenance import jobs_dispatch, nodes_reconcile
from provisioning.services.nodes import node_session
from tests.e2e.conftest import Worker, wait_until

pytestmark = pytest.mark.slow


def _verified_node(api, sim_node_factory, **kwargs):
    node, info = sim_node_factory(api, **kwargs)
    assert api.post(f"/api/v1/nodes/{node.pk}/verify/").status_code == 202
    wait_until(lambda: Node.objects.get(pk=node.pk).state == "active", 60, what="the node to be verified")
    return Node.objects.get(pk=node.pk), info


def _status(instance_id, *wanted, timeout=60):
    def reached():
        instance = Instance.objects.get(pk=instance_id)
        return instance if instance.status in wanted else None

    return wait_until(reached, timeout, what=f"instance {instance_id} to be {'/'.join(wanted)}")


def _renter_key(folder):
    """A renter's key pair as files, the way `ssh -i` reads them."""
    key = Ed25519PrivateKey.generate()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "id_ed25519"
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()))
    os.chmod(path, 0o600)
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return path, public.decode() + " renter@laptop"


def _ssh(command_line: str, key_path, remote: str) -> subprocess.CompletedProcess:
    """Run the ssh command the API shows, as a renter would paste it, with their key."""
    argv = command_line.split() + ["-i", str(key_path), "-o", "StrictHostKeyChecking=no", "-o",
                                   "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR",
                                   remote]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def _port_open(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_rent_log_in_stop_start_restart_destroy(worker, sim_node_factory, client_for, api, other_api, tmp_path):
    node, _ = _verified_node(api, sim_node_factory, profile="a100-80gb-sxm-x4", gpu_model="a100-80gb-sxm",
                             gpu_count=4)
    key_path, public = _renter_key(tmp_path)
    r = other_api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 2, "image": "pytorch-2-5",
                                              "ssh_public_key": public, "label": "e2e"}, format="json")
    assert r.status_code == 201, r.content
    instance_id = r.json()["id"]
    instance = _status(instance_id, "running", "failed")
    assert instance.status == "running", (instance.status_message, worker.tail())
    body = other_api.get(f"/api/v1/instances/{instance_id}/").json()
    gpus = body["gpus"]
    assert len(gpus) == 2 and body["ssh_command"].startswith("ssh -p ")

    seen = _ssh(body["ssh_command"], key_path,
                "nvidia-smi --query-gpu=index,name --format=csv,noheader; echo CVD=$CUDA_VISIBLE_DEVICES")
    assert seen.returncode == 0, seen.stderr
    lines = seen.stdout.strip().splitlines()
    assert [int(line.split(",")[0]) for line in lines[:-1]] == gpus
    assert all("A100-SXM4-80GB" in line for line in lines[:-1])
    assert lines[-1] == "CVD=" + ",".join(map(str, gpus))
    # Another key is refused at the VM.
    stranger_key, _ = _renter_key(tmp_path / "stranger")
    assert _ssh(body["ssh_command"], stranger_key, "true").returncode != 0

    # Stop keeps the disk, releases the GPUs and closes the port.
    assert other_api.post(f"/api/v1/instances/{instance_id}/stop/").status_code == 202
    _status(instance_id, "stopped")
    assert not _port_open(body["ssh_port"])
    assert Gpu.objects.filter(node=node, status="rented").count() == 0
    assert not GpuAllocation.objects.filter(instance_id=instance_id, released_at__isnull=True).exists()

    # Start takes the same GPUs back (they are free).
    assert other_api.post(f"/api/v1/instances/{instance_id}/start/").status_code == 202
    _status(instance_id, "running")
    again = other_api.get(f"/api/v1/instances/{instance_id}/").json()
    assert again["gpus"] == gpus
    assert _ssh(again["ssh_command"], key_path, "echo $CUDA_VISIBLE_DEVICES").stdout.strip() == ",".join(
        map(str, gpus))

    assert other_api.post(f"/api/v1/instances/{instance_id}/restart/").status_code == 202
    _status(instance_id, "running")
    restarted = other_api.get(f"/api/v1/instances/{instance_id}/").json()
    assert _ssh(restarted["ssh_command"], key_path, "true").returncode == 0

    assert other_api.delete(f"/api/v1/instances/{instance_id}/").status_code == 202
    _status(instance_id, "destroyed")
    assert not _port_open(restarted["ssh_port"])
    assert Gpu.objects.filter(node=node, status="free").count() == 4
    jobs = Job.objects.filter(instance_id=instance_id)
    wait_until(lambda: not jobs.filter(status__in=("queued", "running")).exists(), 30, what="the jobs to close")
    kinds = list(jobs.order_by("id").values_list("kind", "status"))
    assert kinds == [("instance_provision", "succeeded"), ("instance_stop", "succeeded"),
                     ("instance_start", "succeeded"), ("instance_restart", "succeeded"),
                     ("instance_destroy", "succeeded")]


def _closed(job: Job) -> Job:
    """The job once closed: the instance is marked running a moment before its job records success."""
    return wait_until(lambda: Job.objects.filter(pk=job.pk).exclude(status__in=("queued", "running")).first(), 30,
                      what=f"job {job.pk} to close")


def test_worker_killed_mid_provisioning_still_ends_running(worker, sim_node_factory, api, other_api, tmp_path):
    node, _ = _verified_node(api, sim_node_factory)
    _, public = _renter_key(tmp_path)
    # Hold every SSH slot of the node, so the job is caught waiting inside a worker process.
    slots = [f"node-ssh-slot:{node.pk}:{n}" for n in range(4)]
    for key in slots:
        cache.set(key, "held-by-test", 300)
    try:
        r = other_api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "cuda-12-4",
                                                  "ssh_public_key": public}, format="json")
        assert r.status_code == 201, r.content
        instance_id = r.json()["id"]
        job = wait_until(lambda: Job.objects.filter(instance_id=instance_id, status="running").first(), 30,
                         what="the provisioning job to start")
        for pid in worker.children():
            os.kill(pid, signal.SIGKILL)
    finally:
        cache.delete_many(slots)
    instance = _status(instance_id, "running", "failed", timeout=90)
    job = _closed(job)
    assert job.attempts >= 2, "the killed attempt must have been delivered again"
    assert job.lost_runs >= 1 and "resumed: its execution was lost" in " ".join(line["message"] for line in job.log)
    assert instance.status == "running", (instance.status_message, worker.tail())
    assert job.status == "succeeded"
    other_api.delete(f"/api/v1/instances/{instance_id}/")
    _status(instance_id, "destroyed")


def test_a_worker_killed_whole_mid_provisioning_is_noticed_and_another_worker_finishes(
        worker, sim_node_factory, api, other_api, tmp_path, simnodes_dir, capsys):
    """SIGKILL of a whole worker (its pool too) while it runs a provisioning job: it acknowledges nothing and its
    message stays with Redis until the visibility timeout. The job's heartbeat stops; the dispatcher (beat's
    part, run here every JOB_DISPATCH_INTERVAL_S) sends it again once the heartbeat is JOB_HEARTBEAT_STALE_S
    old, and the other worker takes it over and finishes it: running within about a minute, not failed by the
    reaper after the job's 900 s deadline."""
    node, _ = _verified_node(api, sim_node_factory)
    _, public = _renter_key(tmp_path)
    second = Worker(tmp_path / "worker-b.log", simnodes_dir, suffix="-b")
    second.start()
    workers = {worker.nodename: worker, second.nodename: second}
    slots = [f"node-ssh-slot:{node.pk}:{n}" for n in range(4)]
    for key in slots:  # the job is caught inside a worker, waiting for an SSH session to its node
        cache.set(key, "held-by-test", 300)
    picked = None
    try:
        r = other_api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "cuda-12-4",
                                                  "ssh_public_key": public}, format="json")
        assert r.status_code == 201, r.content
        instance_id = r.json()["id"]
        job = wait_until(lambda: Job.objects.filter(instance_id=instance_id, status="running").first(), 30,
                         what="the provisioning job to start")
        [picked] = [w for name, w in workers.items() if f" {name}:" in job.runner]
        [survivor] = [w for w in workers.values() if w is not picked]
        picked.kill()
        killed = time.monotonic()
        cache.delete_many(slots)

        next_dispatch = killed
        while time.monotonic() - killed < 180:
            if time.monotonic() >= next_dispatch:
                jobs_dispatch()
                next_dispatch += settings.JOB_DISPATCH_INTERVAL_S
            instance = Instance.objects.get(pk=instance_id)
            if instance.status in ("running", "failed"):
                break
            time.sleep(0.25)
        to_running = time.monotonic() - killed
        with capsys.disabled():
            print(f"\n[worker killed] instance {instance.status} {to_running:.1f} s after SIGKILL of {picked.nodename} "
                  f"(heartbeat stale after {settings.JOB_HEARTBEAT_STALE_S} s, dispatcher every "
                  f"{settings.JOB_DISPATCH_INTERVAL_S} s)")
        assert instance.status == "running", (instance.status_message, survivor.tail())
        assert to_running < 90, "a lost job must be noticed within a minute and resumed"
        job = _closed(job)
        assert job.status == "succeeded" and job.lost_runs == 1 and job.attempts == 2
        assert f" {survivor.nodename}:" in job.runner
        assert any("no sign of life" in line["message"] for line in job.log)
    finally:
        cache.delete_many(slots)
        second.stop()
        if picked is worker:  # the suite's worker: the next tests need it
            worker.start()
    other_api.delete(f"/api/v1/instances/{instance_id}/")
    _status(instance_id, "destroyed")


def test_reconciler_removes_orphans_and_fails_vanished_vms(worker, sim_node_factory, api, other_api, tmp_path):
    node, _ = _verified_node(api, sim_node_factory)
    _, public = _renter_key(tmp_path)
    r = other_api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "cuda-12-4",
                                              "ssh_public_key": public}, format="json")
    instance = _status(r.json()["id"], "running")
    with node_session(node) as session:
        # A VM nobody booked (left by a crash), and the booked VM removed behind the platform's back.
        session.agent("vm", "create", {"runtime": "sim", "vm_id": "inst-999999", "gpu_indices": [1],
                                       "ssh_public_keys": [public]})
        session.agent("vm", "destroy", {"runtime": "sim", "vm_id": instance.vm_id})
    summary = nodes_reconcile()
    assert summary["orphans_destroyed"] == 1 and summary["instances_failed"] == 1
    with node_session(node) as session:
        assert session.agent("vm", "list", {"runtime": "sim"})["vms"] == []
    instance.refresh_from_db()
    assert instance.status == "failed" and "disappeared" in instance.status_message
    assert Gpu.objects.filter(node=node, status="rented").count() == 0
    assert NodeEvent.objects.filter(node=node, kind="orphan_destroyed").exists()


def test_the_vm_of_an_instance_that_failed_before_it_ever_ran_is_destroyed_not_kept(worker, sim_node_factory, api,
                                                                                     other_api, tmp_path):
    """A provisioning reaped or failed while its VM was being made: the instance never ran, so nothing of the
    renter's is on the VM. The reconciler destroys it with its disk (before: stopped, and kept for good)."""
    node, _ = _verified_node(api, sim_node_factory)
    _, public = _renter_key(tmp_path)
    r = other_api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "cuda-12-4",
                                              "ssh_public_key": public}, format="json")
    instance = _status(r.json()["id"], "running")
    Instance.objects.filter(pk=instance.pk).update(status="failed", started_at=None)  # as a reaped provisioning
    summary = nodes_reconcile()
    assert summary["orphans_destroyed"] == 0
    with node_session(node) as session:
        assert session.agent("vm", "list", {"runtime": "sim"})["vms"] == []
