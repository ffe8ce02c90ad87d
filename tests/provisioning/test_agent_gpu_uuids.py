"""A VM's cards named by UUID as well as by index: nvidia-smi numbers the cards anew when one falls off the bus, so
an index alone may name another card than the one the platform allocated. The agent validates `gpu_uuids` as any
request field, refuses to start a VM on a card it was not given, compares VMs as the cards they hold, and a docker
container names its cards by UUID. (Over SSH with the sim runtime: test_sim_gpu_uuids.py.)"""
import json
import os

import pytest

from provisioning.agent import gpumarket_agent as agent
from provisioning.agent.gpumarket_agent.allocation import cards_now, check_gpus_free
from provisioning.agent.gpumarket_agent.runtimes import docker as docker_runtime
from provisioning.agent.gpumarket_agent.validation import validate_gpu_uuids
from tests.provisioning.sshkit import new_keypair
from tests.provisioning.test_agent_docker import FAKE_DOCKER, SAMPLES

A = "GPU-2b4c1e77-9a1f-5c3d-8e0b-7f6a5d4c3b21"
B = "GPU-7e0d3a94-1c6b-4f28-a5e9-0b8c2d7f6e14"
C = "GPU-c91f6b08-4d2e-7a35-b6c1-e8f0a3d5b792"
D = "GPU-05a8e3c6-b7d9-2f41-9c0e-6a1b4d8f2e53"  # the four cards of SAMPLES/a100_sxm4_80gb_x4.csv, indices 0-3
KEY = new_keypair()[1]


def request(**changes):
    req = {"vm_id": "inst-42", "gpu_indices": [1, 0], "gpu_uuids": [B, A], "ssh_public_keys": [KEY],
           "image": {"docker": "nvidia/cuda:12.2.0-base-ubuntu22.04"}}
    req.update(changes)
    return req


def gpus(*uuids):
    """read_gpus rows: the cards listed now, numbered in that order."""
    return [{"index": n, "uuid": u, "pci_bus_id": "00000000:%02X:00.0" % (n + 1)} for n, u in enumerate(uuids)]


# ------------------------------------------------------------------------------------------------ validation

def test_the_spec_keeps_each_cards_uuid_beside_its_index_in_index_order():
    spec = agent.validate_create(request(), "docker", [0, 1, 2, 3])[1]
    assert (spec["gpu_indices"], spec["gpu_uuids"]) == ([0, 1], [A, B])
    spec = agent.validate_create(request(gpu_uuids=[None, A]), "docker", [0, 1, 2, 3])[1]
    assert spec["gpu_uuids"] == [A, None]  # a row with no UUID (older data): that card is judged by its index
    assert "gpu_uuids" not in agent.validate_create(request(gpu_uuids=None), "docker", [0, 1])[1]


@pytest.mark.parametrize("uuids", [
    A,  # not a list
    {"0": A, "1": B},
    [A],  # one UUID for two indices
    [A, B, C],
    [A, A],  # the same card twice
    [A, "GPU-zz"],
    [A, "gpu-7e0d3a94-1c6b-4f28-a5e9-0b8c2d7f6e14"],
    [A, "MIG-7e0d3a94-1c6b-4f28-a5e9-0b8c2d7f6e14"],
    [A, B + "\n"],
    [A, B + ";reboot"],
    [A, "$(reboot)"],
    [A, 7],
    [A, ["GPU"]],
    [A, ""],
])
def test_bad_gpu_uuids_are_refused_naming_the_field(uuids):
    with pytest.raises(agent.AgentError) as exc:
        agent.validate_create(request(gpu_uuids=uuids), "docker", [0, 1, 2, 3])
    assert (exc.value.code, exc.value.field) == ("invalid_request", "gpu_uuids")


def test_each_refusal_says_what_is_wrong():
    said = {}
    for name, value in (("type", "x"), ("length", [A]), ("pattern", [A, "GPU-1"]), ("twice", [B, B])):
        with pytest.raises(agent.AgentError) as exc:
            validate_gpu_uuids(value, [0, 1])
        said[name] = exc.value.message
    assert "must be a list" in said["type"]
    assert "one entry per entry of gpu_indices (2), not 1" in said["length"]
    assert "entry 1 is not a GPU UUID" in said["pattern"] and "GPU-1" not in said["pattern"]
    assert said["twice"] == f"gpu_uuids names {B} more than once"


def test_with_uuids_an_index_the_node_lacks_is_left_to_the_card_check():
    """Without UUIDs an index the node lacks is the platform's mistake; with them, the card check names the card."""
    with pytest.raises(agent.AgentError) as exc:
        agent.validate_create(request(gpu_indices=[3], gpu_uuids=None), "docker", [0, 1, 2])
    assert exc.value.field == "gpu_indices"
    assert agent.validate_create(request(gpu_indices=[3], gpu_uuids=[D]), "docker", [0, 1, 2])[1]["gpu_indices"] == [3]


# ------------------------------------------------------------------------------------------------ card check

def test_cards_where_the_platform_thinks_pass():
    assert [g["uuid"] for g in cards_now(gpus(A, B, C), [0, 2], [A, C])] == [A, C]
    assert [g["uuid"] for g in cards_now(gpus(A, B, C), [1], None)] == [B]  # an older record: by index


def test_a_card_fallen_off_the_bus_is_named():
    with pytest.raises(agent.AgentError) as exc:
        cards_now(gpus(B, C), [0], [A])  # A fell off; B is index 0 now
    assert exc.value.code == "gpu_missing"
    assert exc.value.message == f"GPU {A} (index 0 when it was allocated) is not on this node now (fallen off the bus?)"


def test_a_card_numbered_anew_is_not_taken_for_another():
    with pytest.raises(agent.AgentError) as exc:
        cards_now(gpus(B, C, D), [2, 3], [C, D])  # A fell off: C was index 2 and is 1 now; index 2 is D
    assert (exc.value.code, exc.value.message) == ("gpu_moved", f"GPU index 2 is now {D}, not {C}: nvidia-smi numbered "
                                                                f"the cards anew ({C} is index 1 now)")
    with pytest.raises(agent.AgentError) as exc:
        cards_now(gpus(B, C, D), [3], [D])
    assert exc.value.message == f"there is no GPU index 3 now: nvidia-smi numbered the cards anew ({D} is index 2 now)"
    with pytest.raises(agent.AgentError) as exc:
        cards_now(gpus(B, C, D), [1, 3], [C, None])  # a card without a UUID whose index is gone
    assert (exc.value.code, exc.value.message) == (
        "gpu_missing", "no GPU with index 3 on this node now (fallen off the bus?)")


class Running:
    """A runtime whose every recorded VM runs."""

    def state(self, rec):
        return "running"


def held(indices, uuids=None):
    return {"vm_id": "held", "spec": {"gpu_indices": indices, **({"gpu_uuids": uuids} if uuids else {})}}


def test_vms_are_compared_as_the_cards_they_hold_not_as_numbers_that_moved():
    now = gpus(B, C, D)  # A fell off: B is index 0 now, C 1, D 2
    with pytest.raises(agent.AgentError) as exc:  # recorded on B when B was index 1; index 0 is B now
        check_gpus_free(Running(), [held([1], [B])], [0], gpus=now)
    assert (exc.value.code, exc.value.message) == ("gpu_busy", "GPU 0 is in use by another running VM")
    with pytest.raises(agent.AgentError):
        check_gpus_free(Running(), [held([1], [B])], [0], uuids=[B], gpus=now)
    check_gpus_free(Running(), [held([1], [B])], [1], uuids=[C], gpus=now)  # index 1 is C now: free
    with pytest.raises(agent.AgentError):  # a record from before gpu_uuids: by index, as then
        check_gpus_free(Running(), [held([1])], [1], uuids=[C], gpus=now)
    with pytest.raises(agent.AgentError):  # without the node's cards: by index, as before
        check_gpus_free(Running(), [held([1], [B])], [1])


# ------------------------------------------------------------------------------------------------ docker

def test_a_container_names_its_cards_by_uuid_when_the_platform_sent_every_one():
    spec = {"gpu_indices": [0, 1], "gpu_uuids": [A, B]}
    devices = docker_runtime.container_devices(spec, "toolkit")
    argv = agent.docker_run_argv("a", devices, "ubuntu", 40000, "/s/vms/a/authorized_keys")
    assert argv[argv.index("--gpus") + 1] == f'"device={A},{B}"'
    assert docker_runtime.gpu_argv("toolkit", [C]) == ["--gpus", f'"device={C}"']
    assert docker_runtime.container_devices({"gpu_indices": [0, 1], "gpu_uuids": [A, None]}, "toolkit") == [0, 1]
    assert docker_runtime.container_devices({"gpu_indices": [0, 1]}, "toolkit") == [0, 1]
    mig = {"gpu_indices": [0], "gpu_uuids": [A], "mig_uuids": ["MIG-0a1b2c3d-0000"]}
    assert docker_runtime.container_devices(mig, "toolkit") == ["MIG-0a1b2c3d-0000"]
    stand_in = docker_runtime.container_devices(spec, "devices:/dev/test-gpu{index}")
    assert docker_runtime.gpu_argv("devices:/dev/test-gpu{index}", stand_in) == [
        "--device", "/dev/test-gpu0:/dev/nvidia0", "--device", "/dev/test-gpu1:/dev/nvidia1"]


@pytest.fixture
def docker_node(tmp_path, monkeypatch):
    """A docker node (stand-in docker CLI) whose nvidia-smi lists what `cards` holds now (SAMPLES' 4 x A100)."""
    fakebin, csv = tmp_path / "bin", tmp_path / "gpus.csv"
    fakebin.mkdir()
    rows = (SAMPLES / "a100_sxm4_80gb_x4.csv").read_text().splitlines()
    csv.write_text("\n".join(rows) + "\n")
    (fakebin / "docker").write_text(FAKE_DOCKER)
    (fakebin / "nvidia-smi").write_text(f"#!/bin/sh\ncase \"$1\" in --query-gpu=*) cat {csv};; "
                                        f"*) cat {SAMPLES / 'h100_sxm_x1_table.txt'};; esac\n")
    for script in fakebin.iterdir():
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fakebin}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DOCKER_STATE", str(tmp_path / "containers.json"))
    monkeypatch.setenv("FAKE_DOCKER_LOG", str(tmp_path / "docker.log"))
    env = {"GPUMARKET_RUNTIME": "docker", "GPUMARKET_STATE_DIR": str(tmp_path / "state"),
           "GPUMARKET_PORT_RANGE": "41000-41999"}

    class Node:
        def call(self, command, req):
            return agent.handle(command.split(), json.dumps(req), env)[0]

        def creates(self):
            lines = (tmp_path / "docker.log").read_text().splitlines()
            return [c for c in map(json.loads, lines) if c[0] == "create"]

        def fall_off(self, index):
            """The card at `index` leaves the bus; nvidia-smi numbers the rest anew from 0."""
            kept = [r.split(",", 1)[1] for n, r in enumerate(rows) if n != index]
            csv.write_text("".join(f"{n},{r}\n" for n, r in enumerate(kept)))

        def record(self, vm_id):
            return json.loads((tmp_path / "state" / "vms" / vm_id / "vm.json").read_text())

    return Node()


def test_a_container_made_by_uuid_starts_on_its_own_cards_numbered_anew(docker_node):
    vm = docker_node.call("vm create", request(vm_id="inst-1", gpu_indices=[2, 3], gpu_uuids=[C, D]))
    assert vm["state"] == "running", vm
    create = docker_node.creates()[0]
    assert create[create.index("--gpus") + 1] == f'"device={C},{D}"'
    assert docker_node.call("vm stop", {"vm_id": "inst-1"})["state"] == "stopped"
    docker_node.fall_off(0)  # C is index 1 now, D index 2; index 3 is gone
    for start in ({"vm_id": "inst-1"}, {"vm_id": "inst-1", "gpu_indices": [2, 3], "gpu_uuids": [C, D]}):
        refused = docker_node.call("vm start", start)
        assert refused["error"]["code"] == "gpu_moved", refused
        assert refused["error"]["message"].startswith(f"GPU index 2 is now {D}, not {C}")
        assert docker_node.call("vm status", {"vm_id": "inst-1"})["state"] == "stopped"
    moved = docker_node.call("vm start", {"vm_id": "inst-1", "gpu_indices": [1, 2], "gpu_uuids": [C, D]})
    assert (moved["state"], moved["gpu_indices"]) == ("running", [1, 2]), moved
    assert len(docker_node.creates()) == 1  # the same container: it names C and D, wherever they are
    assert docker_node.record("inst-1")["spec"]["gpu_uuids"] == [C, D]


def test_a_container_made_by_index_is_not_started_on_cards_numbered_anew(docker_node):
    assert docker_node.call("vm create", request(vm_id="inst-1", gpu_indices=[2], gpu_uuids=None))["ok"]
    assert docker_node.call("vm stop", {"vm_id": "inst-1"})["state"] == "stopped"
    docker_node.fall_off(0)  # its `device=2` is D now
    refused = docker_node.call("vm start", {"vm_id": "inst-1", "gpu_indices": [1], "gpu_uuids": [C]})
    assert refused["error"]["code"] == "rebind_unsupported", refused
    assert docker_node.call("vm status", {"vm_id": "inst-1"})["state"] == "stopped"
    spec = docker_node.record("inst-1")["spec"]  # as it was: the refused start changed nothing
    assert spec["gpu_indices"] == [2] and "gpu_uuids" not in spec


def test_a_create_of_a_card_that_fell_off_records_nothing(docker_node, tmp_path):
    docker_node.fall_off(1)
    refused = docker_node.call("vm create", request(vm_id="inst-1", gpu_indices=[1], gpu_uuids=[B]))
    assert refused["error"]["code"] == "gpu_missing", refused
    assert f"GPU {B} (index 1 when it was allocated) is not on this node now" in refused["error"]["message"]
    assert not (tmp_path / "state" / "vms" / "inst-1").exists() and not (tmp_path / "docker.log").exists()
