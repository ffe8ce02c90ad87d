"""Instance options end to end on simulated servers through the real worker (issue 12): the renter's own image with
env, onstart and ports (SSH in and read the env, reach the mapped port, the logs show the onstart output); a
private registry's login that works, and pulls that fail (the instance ends failed with the registry's reason and
nothing is billed, the password is gone and in no answer, log or job)."""
import json
import socket
import time

import pytest

from billing.models import UsageInterval
from marketplace.models import Gpu, Instance
from provisioning.agent.gpumarket_agent.runtimes.simpull import SIM_PRIVATE_AUTH, SIM_PRIVATE_REGISTRY
from provisioning.models import Job
from tests.e2e.test_instances import _renter_key, _ssh, _status, _verified_node

pytestmark = pytest.mark.slow


def _read_banner(host: str, port: int) -> str:
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.settimeout(5)
        return sock.recv(200).decode(errors="replace")


def _logs(client, instance_id, tail=200):
    r = client.get(f"/api/v1/instances/{instance_id}/logs/", {"tail": str(tail)})
    assert r.status_code == 200, r.content
    return r.json()["lines"]


def test_own_image_with_env_onstart_and_ports(worker, sim_node_factory, api, other_api, tmp_path):
    node, _ = _verified_node(api, sim_node_factory)
    key_path, public = _renter_key(tmp_path)
    env = {"GREETING": "hello $(id) `uname` 'quoted' \"double\"", "MODE": "train"}
    onstart = 'echo "onstart says $GREETING"\necho done > "$HOME/onstart.out"\n'
    r = other_api.post("/api/v1/instances/", {
        "offer": node.pk, "num_gpus": 1, "image": "ghcr.io/acme/trainer:1.2", "ssh_public_key": public,
        "env": env, "onstart": onstart, "ports": [8888, 6006]}, format="json")
    assert r.status_code == 201, r.content
    instance_id = r.json()["id"]
    instance = _status(instance_id, "running", "failed")
    assert instance.status == "running", (instance.status_message, worker.tail())
    body = other_api.get(f"/api/v1/instances/{instance_id}/").json()
    assert body["image"] == "ghcr.io/acme/trainer:1.2"
    assert set(body["ports"]) == {"8888/tcp", "6006/tcp"}, body["ports"]
    assert body["os"] and "PyTorch" not in body["os"] and body["disk_gb"] >= 1

    # The env is in the renter's session, as given (nothing of it was run by a shell on the way).
    seen = _ssh(body["ssh_command"], key_path, 'printf "%s|%s" "$GREETING" "$MODE"')
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout == f"{env['GREETING']}|train"
    # Each asked-for port is reachable where the instance says.
    for name, where in body["ports"].items():
        assert name in _read_banner(where["host"], where["port"])
    # onstart ran once, inside the instance, its output in the logs.
    lines = []
    for _ in range(50):
        lines = _logs(other_api, instance_id)
        if any("onstart says hello" in line for line in lines):
            break
        time.sleep(0.2)
    assert any(f"onstart says {env['GREETING']}" in line for line in lines), lines
    assert any("pulling ghcr.io/acme/trainer:1.2" in line for line in lines), lines
    assert _ssh(body["ssh_command"], key_path, 'cat "$HOME/onstart.out"').stdout.strip() == "done"
    assert len(_logs(other_api, instance_id, tail=1)) == 1
    assert api.get(f"/api/v1/instances/{instance_id}/logs/").status_code == 404  # not the node owner's to read

    # A restart keeps the options, and onstart is not run again.
    assert other_api.post(f"/api/v1/instances/{instance_id}/restart/").status_code == 202
    _status(instance_id, "running")
    again = other_api.get(f"/api/v1/instances/{instance_id}/").json()
    for name, where in again["ports"].items():
        assert name in _read_banner(where["host"], where["port"])
    assert sum("onstart says" in line for line in _logs(other_api, instance_id, 5000)) == 1
    assert other_api.delete(f"/api/v1/instances/{instance_id}/").status_code == 202
    _status(instance_id, "destroyed")
    assert other_api.get(f"/api/v1/instances/{instance_id}/logs/").status_code == 409


def test_private_registry_login_pulls_and_the_password_is_kept_nowhere(worker, sim_node_factory, api, other_api,
                                                                        tmp_path):
    node, _ = _verified_node(api, sim_node_factory)
    _, public = _renter_key(tmp_path)
    password = SIM_PRIVATE_AUTH["password"]
    r = other_api.post("/api/v1/instances/", {
        "offer": node.pk, "num_gpus": 1, "image": f"{SIM_PRIVATE_REGISTRY}/team/app:1", "ssh_public_key": public,
        "registry_auth": SIM_PRIVATE_AUTH}, format="json")
    assert r.status_code == 201, r.content
    instance_id = r.json()["id"]
    instance = _status(instance_id, "running", "failed")
    assert instance.status == "running", (instance.status_message, worker.tail())
    answers = [other_api.get(f"/api/v1/instances/{instance_id}/").content.decode(),
               json.dumps(_logs(other_api, instance_id, 5000))]
    assert all(password not in text for text in answers)
    assert answers[0].count('"registry_auth":true') == 1
    assert password not in worker.tail(100000)
    assert all(password not in json.dumps(job.log) + job.error + job.step
               for job in Job.objects.filter(instance_id=instance_id))
    assert other_api.delete(f"/api/v1/instances/{instance_id}/").status_code == 202
    destroyed = _status(instance_id, "destroyed")
    assert destroyed.registry_auth_encrypted is None and destroyed.registry_auth is True


@pytest.mark.parametrize(("image", "auth", "reason"), [
    (f"{SIM_PRIVATE_REGISTRY}/team/app:1", None, "no basic auth credentials"),
    (f"{SIM_PRIVATE_REGISTRY}/team/app:1", {"username": "renter", "password": "wrong-password-1"},
     "unauthorized: authentication required"),
    ("ghcr.io/acme/trainer:missing", None, "manifest unknown"),
    ("registry.example.invalid/app:1", None, "no such host"),
])
def test_a_failed_pull_ends_failed_with_the_registrys_reason_and_bills_nothing(
        worker, sim_node_factory, api, other_api, tmp_path, image, auth, reason):
    node, _ = _verified_node(api, sim_node_factory)
    _, public = _renter_key(tmp_path)
    body = {"offer": node.pk, "num_gpus": 2, "image": image, "ssh_public_key": public}
    if auth:
        body["registry_auth"] = auth
    r = other_api.post("/api/v1/instances/", body, format="json")
    assert r.status_code == 201, r.content
    instance_id = r.json()["id"]
    instance = _status(instance_id, "running", "failed")
    assert instance.status == "failed", worker.tail()
    assert instance.status_message.startswith("The image could not be pulled: ") and reason in instance.status_message
    shown = other_api.get(f"/api/v1/instances/{instance_id}/").json()
    assert shown["status"] == "failed" and reason in shown["status_message"]
    assert float(shown["cost_so_far"]) == 0 and instance.started_at is None and instance.billed_seconds == 0
    assert not UsageInterval.objects.filter(instance_id=instance_id).exists()
    assert Gpu.objects.filter(node=node, status="free").count() == 2
    assert Instance.objects.get(pk=instance_id).registry_auth_encrypted is None
    if auth:
        assert auth["password"] not in worker.tail(100000)
