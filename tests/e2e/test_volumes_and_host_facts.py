"""Volumes and host facts end to end: a real worker verifies a simulated server over SSH (the agent's disk test, the
platform's own network test), the offers show what was measured; a renter creates a volume there, mounts it in an
instance, writes a file over SSH, and finds it after stop/start and in a second instance after the first is
destroyed; deleting it is refused while mounted, then removes it from the node."""
import pytest

from marketplace.models import Node, Volume
from provisioning.services.nodes import node_session
from tests.e2e.conftest import wait_until
from tests.e2e.test_instances import _renter_key, _ssh, _status, _verified_node

pytestmark = pytest.mark.slow


def _volume_state(volume_id, *wanted):
    def reached():
        volume = Volume.objects.get(pk=volume_id)
        return volume if volume.state in wanted else None

    return wait_until(reached, 60, what=f"volume {volume_id} to be {'/'.join(wanted)}")


def _node_volumes(node):
    with node_session(Node.objects.get(pk=node.pk)) as session:
        return session.agent("volume", "list", {})["volumes"]


def test_host_facts_measured_by_the_check_are_on_the_offers(worker, sim_node_factory, api, anon):
    node, _ = _verified_node(api, sim_node_factory, profile="rtx-a4000-x2", gpu_model="rtx-a4000", gpu_count=2)
    offer = anon.get(f"/api/v1/offers/{node.pk}/").json()
    # Read from the sim profile (the modelled hardware) ...
    assert offer["cpu_model"].startswith("AMD Ryzen Threadripper PRO 3955WX") and offer["cpu_cores"] == 32
    assert offer["ram_gb"] == 126 and offer["disk_free_gb"] == 1800
    assert (offer["driver_version"], offer["cuda_version"], offer["pcie_gen"], offer["pcie_width"]) == (
        "535.183.01", "12.2", 4, 16)
    # ... and measured for real: the agent's disk test on the node's disk, the platform's own throughput over SSH.
    assert offer["disk_bandwidth_mbs"] > 1 and offer["platform_to_node_mbps"] > 1
    assert offer["host_checked_at"]
    ids = lambda query: [o["id"] for o in anon.get(f"/api/v1/offers/?{query}").json()["results"]]  # noqa: E731
    assert ids("min_cuda_version=12.2") == [node.pk] and ids("min_cuda_version=12.10") == []
    assert ids("min_pcie_gen=4&min_pcie_width=16&min_ram_gb=100&min_cpu_cores=32") == [node.pk]
    assert ids("min_pcie_gen=5") == [] and ids("min_disk_bandwidth_mbs=1000000") == []
    assert ids(f"min_platform_to_node_mbps={offer['platform_to_node_mbps'] - 1}") == [node.pk]


def test_a_volume_outlives_its_instances_and_is_deleted_when_asked(worker, sim_node_factory, api, other_api,
                                                                    tmp_path):
    node, _ = _verified_node(api, sim_node_factory, profile="a100-80gb-sxm-x4", gpu_model="a100-80gb-sxm",
                             gpu_count=4)
    r = other_api.post("/api/v1/volumes/", {"offer": node.pk, "size_gb": 20}, format="json")
    assert r.status_code == 201, r.content
    volume = _volume_state(r.json()["id"], "available", "failed")
    assert volume.state == "available", volume.status_message
    assert _node_volumes(node) == [{"name": volume.name, "size_gb": 20, "used_by": []}]

    key_path, public = _renter_key(tmp_path)
    mount = [{"volume": volume.pk, "mount": "/data"}]
    r = other_api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "pytorch-2-5",
                                              "ssh_public_key": public, "volumes": mount}, format="json")
    assert r.status_code == 201, r.content
    first = r.json()["id"]
    assert _status(first, "running", "failed").status == "running", worker.tail()
    ssh = other_api.get(f"/api/v1/instances/{first}/").json()["ssh_command"]
    assert _ssh(ssh, key_path, "echo kept > ~/data/file.txt").returncode == 0
    assert _node_volumes(node)[0]["used_by"] == [f"inst-{first}"]

    # Kept across stop/start.
    assert other_api.post(f"/api/v1/instances/{first}/stop/").status_code == 202
    _status(first, "stopped")
    assert other_api.post(f"/api/v1/instances/{first}/start/").status_code == 202
    _status(first, "running")
    ssh = other_api.get(f"/api/v1/instances/{first}/").json()["ssh_command"]
    assert _ssh(ssh, key_path, "cat ~/data/file.txt").stdout == "kept\n"

    # Not deleted while mounted; not mounted twice.
    assert other_api.delete(f"/api/v1/volumes/{volume.pk}/", {"confirm": volume.name},
                            format="json").status_code == 409
    again = other_api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "pytorch-2-5",
                                                  "ssh_public_key": public, "volumes": mount}, format="json")
    assert again.status_code == 409

    # Kept after the instance is destroyed: a second instance finds the file.
    assert other_api.delete(f"/api/v1/instances/{first}/").status_code == 202
    _status(first, "destroyed")
    r = other_api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "pytorch-2-5",
                                              "ssh_public_key": public,
                                              "volumes": [{"volume": volume.pk, "mount": "/workspace/in"}]},
                       format="json")
    assert r.status_code == 201, r.content
    second = r.json()["id"]
    assert _status(second, "running", "failed").status == "running", worker.tail()
    ssh = other_api.get(f"/api/v1/instances/{second}/").json()["ssh_command"]
    assert _ssh(ssh, key_path, "cat ~/workspace/in/file.txt").stdout == "kept\n"
    assert other_api.delete(f"/api/v1/instances/{second}/").status_code == 202
    _status(second, "destroyed")

    assert other_api.delete(f"/api/v1/volumes/{volume.pk}/", {"confirm": volume.name},
                            format="json").status_code == 202
    assert _volume_state(volume.pk, "deleted", "available").state == "deleted"
    assert _node_volumes(node) == []
