"""Cards that fall off the bus, over SSH against a simulated server (real sshd, the real agent, sim VMs that are real
sshd processes): nvidia-smi numbers the remaining cards anew, and a VM named by the old index is refused, with the
card named, rather than started on whatever card carries that index now. Only the hardware is simulated: a card
falls off when the server's profile stops listing it and lists the cards after it one index lower, as nvidia-smi
does."""
import json
from pathlib import Path

import pytest

from provisioning import sim
from provisioning.agent import gpumarket_agent as agent
from tests.provisioning.sshkit import new_keypair, pinned_client, run, run_agent, upload_agent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    base = tmp_path_factory.mktemp("gpu-uuid-simnodes")
    try:
        yield base
    finally:
        sim.nodes_down(base)


@pytest.fixture(scope="module")
def node(base):
    return sim.node_up("a100-80gb-sxm-x4", base)


@pytest.fixture(scope="module")
def conn(node, base):
    pkey, public = new_keypair("gpumarket-platform")
    sim.node_authorize(node["ssh_port"], public, base)
    client = pinned_client(node["address"], node["ssh_port"], node["ssh_user"], pkey, node["host_public_key"])
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="module")
def agent_path(conn):
    return upload_agent(conn)


class Server:
    """The sim server's cards, and the agent on it. Every test starts with all four cards and no VM."""

    def __init__(self, node, conn, agent_path):
        self.node, self.conn, self.agent_path = node, conn, agent_path
        self.profile = Path(node["node_dir"]) / "profile.json"
        self.original = self.profile.read_text()
        self.uuids = [g["uuid"] for g in agent.load_profile(str(self.profile))[1]]

    def call(self, command, request=None):
        status, answer = run_agent(self.conn, self.agent_path, command, request)
        assert (status == 0) == answer["ok"], answer
        return answer

    def create(self, vm_id, indices, uuids, key):
        req = {"vm_id": vm_id, "gpu_indices": indices, "ssh_public_keys": [key]}
        return self.call("vm create", req if uuids is None else {**req, "gpu_uuids": uuids})

    def fall_off(self, index):
        """The card at `index` leaves the bus: nvidia-smi lists the others, numbered anew from 0."""
        data = json.loads(self.profile.read_text())
        kept = [line.split(",", 1)[1] for n, line in enumerate(data["nvidia_smi"]) if n != index]
        data["nvidia_smi"] = [f"{n},{rest}" for n, rest in enumerate(kept)]
        self.profile.write_text(json.dumps(data))

    def vm_processes(self, vm_id):
        return agent.pids_matching(str(Path(self.node["node_dir"]) / "vms" / vm_id) + "/")

    def record(self, vm_id):
        return json.loads((Path(self.node["node_dir"]) / "vms" / vm_id / "vm.json").read_text())

    def reset(self):
        self.profile.write_text(self.original)
        for vm in self.call("vm list")["vms"]:
            self.call("vm destroy", {"vm_id": vm["vm_id"]})


@pytest.fixture
def server(node, conn, agent_path):
    server = Server(node, conn, agent_path)
    try:
        yield server
    finally:
        server.reset()


def visible_uuids(vm, pkey):
    """The cards the renter sees in the VM (its nvidia-smi -L)."""
    with pinned_client(vm["ssh_host"], vm["ssh_port"], vm["ssh_user"], pkey, vm["ssh_host_key"]) as ssh:
        _, out, _ = run(ssh, "nvidia-smi -L")
    return [line.rsplit("(UUID: ", 1)[1].rstrip(")") for line in out.splitlines() if "UUID" in line]


def test_a_vm_named_by_its_cards_uuids_is_created_and_started_on_them(server):
    renter, key = new_keypair()
    u = server.uuids
    vm = server.create("inst-1", [3, 1], [u[3], u[1]], key)
    assert (vm["state"], vm["gpu_indices"]) == ("running", [1, 3])
    assert server.record("inst-1")["spec"]["gpu_uuids"] == [u[1], u[3]]  # in the order of gpu_indices
    assert visible_uuids(vm, renter) == [u[1], u[3]]
    assert server.call("vm stop", {"vm_id": "inst-1"})["state"] == "stopped"
    assert server.call("vm start", {"vm_id": "inst-1", "gpu_indices": [1, 3], "gpu_uuids": [u[1], u[3]]})[
        "state"] == "running"
    assert server.call("vm stop", {"vm_id": "inst-1"})["state"] == "stopped"
    assert server.call("vm start", {"vm_id": "inst-1"})["state"] == "running"  # its record's cards, checked


def test_after_a_card_falls_off_a_vm_is_not_started_on_the_card_now_at_its_old_index(server):
    renter, key = new_keypair()
    u = server.uuids
    assert server.create("inst-1", [2], [u[2]], key)["state"] == "running"
    assert server.call("vm stop", {"vm_id": "inst-1"})["state"] == "stopped"
    server.fall_off(0)  # card 2 is index 1 now; index 2 is card 3
    for start in ({"vm_id": "inst-1", "gpu_indices": [2], "gpu_uuids": [u[2]]}, {"vm_id": "inst-1"}):
        status, refused = run_agent(server.conn, server.agent_path, "vm start", start)
        assert (status, refused["error"]["code"]) == (1, "gpu_moved"), refused
        assert refused["error"]["message"] == (
            f"GPU index 2 is now {u[3]}, not {u[2]}: nvidia-smi numbered the cards anew ({u[2]} is index 1 now)")
        assert server.call("vm status", {"vm_id": "inst-1"})["state"] == "stopped"
        assert server.vm_processes("inst-1") == []
    # The platform, told of the new numbering by its inventory, starts it on its own card at its new index.
    vm = server.call("vm start", {"vm_id": "inst-1", "gpu_indices": [1], "gpu_uuids": [u[2]]})
    assert (vm["state"], vm["gpu_indices"]) == ("running", [1])
    assert visible_uuids(vm, renter) == [u[2]]


def test_a_card_that_fell_off_is_named_and_nothing_is_created(server):
    u = server.uuids
    assert server.create("inst-1", [1], [u[1]], new_keypair()[1])["state"] == "running"
    assert server.call("vm stop", {"vm_id": "inst-1"})["state"] == "stopped"
    server.fall_off(1)
    status, refused = run_agent(server.conn, server.agent_path, "vm create", {
        "vm_id": "inst-2", "gpu_indices": [1], "gpu_uuids": [u[1]], "ssh_public_keys": [new_keypair()[1]]})
    assert (status, refused["error"]["code"]) == (1, "gpu_missing"), refused
    assert refused["error"]["message"] == (
        f"GPU {u[1]} (index 1 when it was allocated) is not on this node now (fallen off the bus?)")
    status, refused = run_agent(server.conn, server.agent_path, "vm start", {"vm_id": "inst-1"})
    assert refused["error"]["code"] == "gpu_missing" and u[1] in refused["error"]["message"], refused
    assert [v["vm_id"] for v in server.call("vm list")["vms"]] == ["inst-1"]
    assert server.vm_processes("inst-1") == [] and server.vm_processes("inst-2") == []


def test_a_card_another_vm_runs_on_is_busy_under_its_new_index(server):
    """VM 1 runs on card 1; card 0 falls off and card 1 is index 0 now. Compared by index, index 0 was free."""
    u = server.uuids
    key = new_keypair()[1]
    assert server.create("inst-1", [1], [u[1]], key)["state"] == "running"
    server.fall_off(0)
    for uuids in (None, [u[1]]):  # a request without UUIDs (an older platform) is judged by the card there now
        status, busy = run_agent(server.conn, server.agent_path, "vm create", {
            "vm_id": "inst-2", "gpu_indices": [0], "ssh_public_keys": [key],
            **({"gpu_uuids": uuids} if uuids else {})})
        assert (status, busy["error"]["code"]) == (1, "gpu_busy"), busy
    assert server.create("inst-2", [1], [u[2]], key)["state"] == "running"  # index 1 is card 2 now: free


def test_a_vm_recorded_without_uuids_still_starts_and_takes_them_from_the_platform(server):
    u = server.uuids
    assert server.create("inst-1", [2], None, new_keypair()[1])["state"] == "running"
    assert "gpu_uuids" not in server.record("inst-1")["spec"]
    assert server.call("vm stop", {"vm_id": "inst-1"})["state"] == "stopped"
    assert server.call("vm start", {"vm_id": "inst-1"})["state"] == "running"  # by index, as before
    assert server.call("vm stop", {"vm_id": "inst-1"})["state"] == "stopped"
    assert server.call("vm start", {"vm_id": "inst-1", "gpu_indices": [2], "gpu_uuids": [u[2]]})[
        "state"] == "running"
    assert server.record("inst-1")["spec"]["gpu_uuids"] == [u[2]]


@pytest.mark.parametrize(("start", "field"), [
    ({"gpu_indices": [1], "gpu_uuids": "GPU-x"}, "gpu_uuids"),
    ({"gpu_indices": [1], "gpu_uuids": ["GPU-1;reboot"]}, "gpu_uuids"),
    ({"gpu_indices": [1, 2], "gpu_uuids": ["GPU-7e0d3a94-1c6b-4f28-a5e9-0b8c2d7f6e14"]}, "gpu_uuids"),
    ({"gpu_indices": [1, 2], "gpu_uuids": ["GPU-7e0d3a94-1c6b-4f28-a5e9-0b8c2d7f6e14"] * 2}, "gpu_uuids"),
    ({"gpu_uuids": ["GPU-7e0d3a94-1c6b-4f28-a5e9-0b8c2d7f6e14"]}, "gpu_uuids"),  # without gpu_indices
    ({"gpu_indices": "1", "gpu_uuids": []}, "gpu_indices"),
])
def test_bad_gpu_uuids_in_a_start_are_refused_naming_the_field(server, start, field):
    assert server.create("inst-1", [1], [server.uuids[1]], new_keypair()[1])["ok"]
    assert server.call("vm stop", {"vm_id": "inst-1"})["state"] == "stopped"
    status, refused = run_agent(server.conn, server.agent_path, "vm start", {"vm_id": "inst-1", **start})
    assert (status, refused["error"]["code"], refused["error"]["field"]) == (2, "invalid_request", field), refused
    assert server.record("inst-1")["spec"]["gpu_indices"] == [1]
    assert server.call("vm status", {"vm_id": "inst-1"})["state"] == "stopped"
