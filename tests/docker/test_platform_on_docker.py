"""The whole platform on a real Docker engine (issue 12, "end to end on both runtimes"): the API, a real Celery worker
(tests/live.py), SSH to a node that is a simulated server's sshd whose agent runs in docker mode against the session's
dockerd (tests/docker/harness.py, shared with bench/docker_booking.py), and the renter's own image in the session's
htpasswd registry. Everything is checked from outside: SSH into the container with the renter's key, the env, the
onstart output through GET .../logs/, the mapped port, a file on a volume across stop/start, `docker ps -a` and
`docker volume inspect` on the engine after destroy and after the volume's confirmed deletion; and a pull with the
wrong password ends `failed` with the registry's reason, billing nothing.

Not here: GPU device injection (GPUMARKET_DOCKER_GPUS=none; test_docker_runtime.py checks it at the agent level)
and the node's verification: off `sim`, the check runs the real GPU benchmark, which needs PyTorch and a GPU this
machine lacks (it rejects the node: benchmark_unavailable), so the node is registered through the API and then
marked active and verified directly. One instance (and one failed pull), on the
session's engine and worker: about 10 s of test time on the project's loaded 2-core machine, plus about 25 s to
start the engine, registry and worker once per session."""
import pytest

from billing.models import UsageInterval
from billing.services.ledger import credit_grant, wallet_balance
from marketplace.models import Instance, Node, NodeState, Verdict, Volume
from provisioning.sim import nodes as sim
from tests.docker.engine import REGISTRY_PASSWORD, REGISTRY_USER
from tests.docker.harness import docker_node
from tests.docker.test_docker_runtime import read_port
from tests.e2e.test_instances import _renter_key, _ssh
from tests.factories import UserFactory
from tests.live import wait_until

pytestmark = pytest.mark.slow

AUTH = {"username": REGISTRY_USER, "password": REGISTRY_PASSWORD}
ONSTART = r"""echo "onstart ran with API_KEY=$API_KEY"
nohup perl -MIO::Socket::INET -e '$s = IO::Socket::INET->new(LocalPort => 8080, Listen => 5, ReuseAddr => 1)
    or die "listen: $!"; while ($c = $s->accept) { print $c "hello from the container\n"; close $c }' \
    >/dev/null 2>&1 &
"""


@pytest.fixture
def docker_offer(docker_engine, worker, simnodes_dir, api, tmp_path):
    """A listed node of `api`'s user whose agent runs containers on the session's engine."""
    info = docker_node(sim, simnodes_dir, docker_engine, tmp_path / "agent", port_range="46500-46599")
    r = api.post("/api/v1/nodes/", {
        "name": "docker-node", "address": info["address"], "ssh_port": info["ssh_port"],
        "ssh_user": info["ssh_user"], "country": "DE", "city": "Frankfurt", "gpu_model": "a100-80gb-sxm",
        "gpu_count": 4, "price_per_gpu_hour": "1.000000", "runtime": "docker",
        "host_key_fingerprint": info["host_key_fingerprint"]}, format="json")
    assert r.status_code == 201, r.content
    sim.node_authorize(info["ssh_port"], r.json()["public_key"], simnodes_dir)
    # Verification would run the real benchmark (PyTorch on a GPU): see the module's docstring.
    Node.objects.filter(pk=r.json()["id"]).update(state=NodeState.ACTIVE, verdict=Verdict.VERIFIED, score=1.0)
    yield Node.objects.get(pk=r.json()["id"])
    sim.node_down(info["ssh_port"], simnodes_dir)


def _status(instance_id, *wanted, timeout=180):
    def reached():
        instance = Instance.objects.get(pk=instance_id)
        return instance if instance.status in wanted else None

    return wait_until(reached, timeout, what=f"instance {instance_id} to be {'/'.join(wanted)}")


def _volume_state(volume_id, *wanted):
    def reached():
        volume = Volume.objects.get(pk=volume_id)
        return volume if volume.state in wanted else None

    return wait_until(reached, 60, what=f"volume {volume_id} to be {'/'.join(wanted)}")


def _containers(engine, vm_id):
    return engine.docker("ps", "-a", "--filter", f"label=gpumarket.vm_id={vm_id}", "--format", "{{.Names}}",
                         check=True).stdout.split()


def test_a_renters_own_image_through_the_platform(docker_engine, docker_offer, other_api, tmp_path):
    engine, node = docker_engine, docker_offer
    key_path, public = _renter_key(tmp_path)
    r = other_api.post("/api/v1/volumes/", {"offer": node.pk, "size_gb": 10}, format="json")
    assert r.status_code == 201, r.content
    volume = _volume_state(r.json()["id"], "available", "failed")
    assert volume.state == "available", volume.status_message
    assert engine.docker("volume", "inspect", volume.name).returncode == 0

    r = other_api.post("/api/v1/instances/", {
        "offer": node.pk, "num_gpus": 1, "image": engine.remote_image, "registry_auth": AUTH,
        "ssh_public_key": public, "env": {"API_KEY": "sk-live-1"}, "onstart": ONSTART, "ports": [8080],
        "volumes": [{"volume": volume.pk, "mount": "/data"}]}, format="json")
    assert r.status_code == 201, r.content
    instance_id = r.json()["id"]
    instance = _status(instance_id, "running", "failed")
    assert instance.status == "running", instance.status_message
    body = other_api.get(f"/api/v1/instances/{instance_id}/").json()
    assert body["os"] == "Debian GNU/Linux 12 (bookworm)" and body["image"] == engine.remote_image
    assert list(body["ports"]) == ["8080/tcp"]
    assert _containers(engine, instance.vm_id) == [f"gpumarket-{instance.vm_id}"]

    # From outside: SSH in with the renter's key (the command the API shows), the env, the port, the volume.
    seen = _ssh(body["ssh_command"], key_path, 'printf %s "$API_KEY"')
    assert (seen.returncode, seen.stdout) == (0, "sk-live-1"), seen.stderr
    where = body["ports"]["8080/tcp"]
    assert where["host"] == "127.0.0.1" and read_port(where["port"]) == "hello from the container\n"
    assert _ssh(body["ssh_command"], key_path, "echo kept > /data/file.txt").returncode == 0
    lines = wait_until(lambda: [line for line in other_api.get(f"/api/v1/instances/{instance_id}/logs/").json()[
        "lines"] if "onstart ran with API_KEY=sk-live-1" in line], 30, what="the onstart output in the logs")
    assert len(lines) == 1
    assert REGISTRY_PASSWORD not in str(other_api.get(f"/api/v1/instances/{instance_id}/logs/").json())

    # Stop and start through the API: the container stops (not removed), the file is still there.
    assert other_api.post(f"/api/v1/instances/{instance_id}/stop/").status_code == 202
    _status(instance_id, "stopped")
    state = engine.docker("inspect", "--format", "{{.State.Status}}", f"gpumarket-{instance.vm_id}", check=True)
    assert state.stdout.strip() == "exited"
    assert other_api.post(f"/api/v1/instances/{instance_id}/start/").status_code == 202
    _status(instance_id, "running")
    body = other_api.get(f"/api/v1/instances/{instance_id}/").json()
    assert _ssh(body["ssh_command"], key_path, "cat /data/file.txt").stdout == "kept\n"

    # Destroy: the container is gone from the engine, the volume is kept until its deletion is confirmed.
    assert other_api.delete(f"/api/v1/instances/{instance_id}/").status_code == 202
    _status(instance_id, "destroyed")
    assert _containers(engine, instance.vm_id) == []
    assert engine.docker("volume", "inspect", volume.name).returncode == 0
    refused = other_api.delete(f"/api/v1/volumes/{volume.pk}/", {"confirm": "vol-wrong"}, format="json")
    assert refused.status_code == 400, refused.content
    assert engine.docker("volume", "inspect", volume.name).returncode == 0
    assert other_api.delete(f"/api/v1/volumes/{volume.pk}/", {"confirm": volume.name},
                            format="json").status_code == 202
    assert _volume_state(volume.pk, "deleted", "failed").state == "deleted"
    assert engine.docker("volume", "inspect", volume.name).returncode != 0


def test_a_failed_pull_through_the_platform_ends_failed_with_the_reason_and_bills_nothing(
        docker_engine, docker_offer, client_for, tmp_path):
    engine = docker_engine
    engine.docker("rmi", engine.remote_image)  # not cached on the node: the registry must answer
    renter = UserFactory()
    credit_grant(user=renter, amount_micros=50 * 1_000_000, reason="test: a balance to see unchanged")
    balance = wallet_balance(user_id=renter.pk)
    other_api = client_for(renter)
    r = other_api.post("/api/v1/instances/", {
        "offer": docker_offer.pk, "num_gpus": 1, "image": engine.remote_image, "ssh_public_key": _renter_key(
            tmp_path)[1], "registry_auth": {"username": REGISTRY_USER, "password": "not-the-password"}},
        format="json")
    assert r.status_code == 201, r.content
    instance = _status(r.json()["id"], "running", "failed")
    assert instance.status == "failed"
    body = other_api.get(f"/api/v1/instances/{instance.pk}/").json()
    assert "unauthorized" in body["status_message"] and "not-the-password" not in str(body), body
    assert float(body["cost_so_far"]) == 0
    assert not UsageInterval.objects.filter(instance_id=instance.pk).exists()
    assert wallet_balance(user_id=renter.pk) == balance
    assert _containers(engine, instance.vm_id) == []
