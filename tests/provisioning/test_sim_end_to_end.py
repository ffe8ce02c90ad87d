"""Simulated GPU servers end to end: real sshd processes, real SSH with pinned host keys, the real agent.

Only the GPUs are simulated. Every node and VM started here is stopped by the fixtures, even on failure."""
import json
import os
import re
import socket
from pathlib import Path

import paramiko
import pytest

from provisioning import sim
from provisioning.agent import gpumarket_agent as agent
from tests.provisioning.sshkit import fingerprint, new_keypair, pinned_client, run, run_agent, upload_agent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    base = tmp_path_factory.mktemp("simnodes")
    try:
        yield base
    finally:
        sim.nodes_down(base)


@pytest.fixture(scope="module")
def node(base):
    return sim.node_up("a100-80gb-sxm-x4", base)


@pytest.fixture(scope="module")
def platform_key(node, base):
    pkey, public = new_keypair("gpumarket-platform node-1")
    assert sim.node_authorize(node["ssh_port"], public, base) is True
    assert sim.node_authorize(node["ssh_port"], public, base) is False  # installing twice adds nothing
    return pkey


@pytest.fixture(scope="module")
def conn(node, platform_key):
    client = pinned_client(node["address"], node["ssh_port"], node["ssh_user"], platform_key, node["host_public_key"])
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="module")
def agent_path(conn):
    return upload_agent(conn)


def call(conn, agent_path, command, request=None):
    status, answer = run_agent(conn, agent_path, command, request)
    assert answer["agent_version"] == agent.AGENT_VERSION
    assert (status == 0) == answer["ok"], answer
    return answer


def port_open(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_node_reports_the_host_key_it_really_serves(node):
    assert re.fullmatch(r"SHA256:[A-Za-z0-9+/]{43}", node["host_key_fingerprint"])
    assert fingerprint(node["host_public_key"]) == node["host_key_fingerprint"]
    transport = paramiko.Transport(("127.0.0.1", node["ssh_port"]))
    try:
        transport.start_client(timeout=5)
        served = transport.get_remote_server_key()
    finally:
        transport.close()
    assert f"{served.get_name()} {served.get_base64()}" == node["host_public_key"]
    assert (node["address"], node["ssh_user"], node["profile"]) == ("127.0.0.1", "root", "a100-80gb-sxm-x4")
    assert node["pid"] in agent.proc_table()


def test_a_different_pinned_host_key_is_refused(node, platform_key):
    _, other_host_key = new_keypair()
    with pytest.raises(paramiko.BadHostKeyException):
        pinned_client("127.0.0.1", node["ssh_port"], "root", platform_key, other_host_key).close()


def test_a_key_never_authorized_is_refused(node, platform_key):
    stranger, _ = new_keypair()
    with pytest.raises(paramiko.AuthenticationException):
        pinned_client("127.0.0.1", node["ssh_port"], "root", stranger, node["host_public_key"]).close()


def test_uploads_land_in_the_nodes_own_home(node, agent_path):
    assert agent_path == f"{node['node_dir']}/home/gpumarket_agent.pyz"


def test_inventory_over_ssh(conn, agent_path):
    answer = call(conn, agent_path, "inventory")
    assert answer["runtime"] == "sim"
    assert answer["gpu_count"] == 4
    assert {g["name"] for g in answer["gpus"]} == {"NVIDIA A100-SXM4-80GB"}
    assert [g["pci_bus_id"] for g in answer["gpus"]][:2] == ["00000000:01:00.0", "00000000:41:00.0"]
    assert (answer["cuda_version"], answer["driver_version"]) == ("12.2", "535.161.08")
    assert answer["cpu"] == {"model": "AMD EPYC 7543 32-Core Processor", "cores": 128}
    assert (answer["ram_mib"], answer["disk_free_gb"]) == (515902, 6800)


def test_health_over_ssh(conn, agent_path):
    answer = call(conn, agent_path, "health")
    assert (answer["runtime_ok"], answer["runtime_detail"], answer["gpu_count"]) == (True, "sim: ok", 4)
    assert answer["uptime_s"] > 0 and len(answer["load"]) == 3


def test_bad_requests_over_ssh_are_refused_and_run_nothing(conn, agent_path, tmp_path):
    marker = tmp_path / "pwned"
    status, answer = run_agent(conn, agent_path, "vm create", {
        "vm_id": f"x; touch {marker}", "gpu_indices": [0], "ssh_public_keys": [new_keypair()[1]]})
    assert (status, answer["error"]["code"], answer["error"]["field"]) == (2, "invalid_request", "vm_id")
    status, answer = run_agent(conn, agent_path, "vm create", {
        "vm_id": "inst-x", "gpu_indices": [0], "ssh_public_keys": [f"ssh-ed25519 AAAA; touch {marker}"]})
    assert (status, answer["error"]["field"]) == (2, "ssh_public_keys")
    status, answer = run_agent(conn, agent_path, "vm create", {
        "vm_id": "inst-x", "gpu_indices": [4], "ssh_public_keys": [new_keypair()[1]]})
    assert (status, answer["error"]["field"]) == (2, "gpu_indices")  # the node has GPUs 0-3
    assert not marker.exists()
    assert call(conn, agent_path, "vm list")["vms"] == []


def test_vm_lifecycle(node, conn, agent_path, platform_key):
    renter, renter_public = new_keypair("renter@laptop")
    assert call(conn, agent_path, "vm list")["vms"] == []

    vm = call(conn, agent_path, "vm create", {
        "runtime": "sim", "vm_id": "inst-42", "gpu_indices": [2, 1], "ssh_public_keys": [renter_public]})
    assert (vm["state"], vm["created"], vm["gpu_indices"]) == ("running", True, [1, 2])
    assert (vm["ssh_host"], vm["ssh_user"]) == ("127.0.0.1", "root")
    port = vm["ssh_port"]
    assert port != node["ssh_port"] and port_open(port)
    listed = call(conn, agent_path, "vm list")["vms"]
    assert [(v["vm_id"], v["state"], v["ssh_port"]) for v in listed] == [("inst-42", "running", port)]

    # The renter's key gets in and sees exactly GPUs 1 and 2 of the four.
    with _vm_client(vm, renter) as ssh:
        status, out, _ = run(ssh, "nvidia-smi --query-gpu=index,name --format=csv,noheader")
        assert (status, out) == (0, "1, NVIDIA A100-SXM4-80GB\n2, NVIDIA A100-SXM4-80GB\n")
        assert run(ssh, "echo $CUDA_VISIBLE_DEVICES")[1] == "1,2\n"
        status, out, _ = run(ssh, "nvidia-smi")
        assert status == 0 and "CUDA Version: 12.2" in out
        assert out.count("NVIDIA A100-SXM4-80GB") == 2 and "00000000:01:00.0" not in out
    # Any other key is refused: a stranger's, and the platform's own node key too.
    for key in (new_keypair()[0], platform_key):
        with pytest.raises(paramiko.AuthenticationException):
            _vm_client(vm, key).close()

    assert call(conn, agent_path, "vm status", {"vm_id": "inst-42", "probe_ssh": True})["ssh_answers"] is True
    stopped = call(conn, agent_path, "vm stop", {"vm_id": "inst-42"})
    assert stopped["state"] == "stopped" and not port_open(port)
    assert call(conn, agent_path, "vm status", {"vm_id": "inst-42", "probe_ssh": True})["ssh_answers"] is False
    assert call(conn, agent_path, "vm stop", {"vm_id": "inst-42"})["state"] == "stopped"  # idempotent
    assert call(conn, agent_path, "vm list")["vms"][0]["state"] == "stopped"

    started = call(conn, agent_path, "vm start", {"vm_id": "inst-42"})
    assert (started["state"], started["ssh_port"]) == ("running", port)
    assert call(conn, agent_path, "vm status", {"vm_id": "inst-42"})["state"] == "running"
    with _vm_client(started, renter) as ssh:
        assert run(ssh, "nvidia-smi -L")[1].count("GPU ") == 2

    vm_dir = Path(node["node_dir"]) / "vms" / "inst-42"
    pid = int((vm_dir / "sshd.pid").read_text())
    assert pid in agent.proc_table()
    destroyed = call(conn, agent_path, "vm destroy", {"vm_id": "inst-42"})
    assert (destroyed["state"], destroyed["existed"]) == ("destroyed", True)
    assert pid not in agent.proc_table() and not vm_dir.exists() and not port_open(port)
    assert agent.pids_matching(str(vm_dir)) == []
    assert call(conn, agent_path, "vm destroy", {"vm_id": "inst-42"})["existed"] is False
    assert call(conn, agent_path, "vm list")["vms"] == []


def test_create_is_idempotent_and_gpus_are_not_shared(conn, agent_path):
    key = new_keypair()[1]
    request = {"vm_id": "inst-a", "gpu_indices": [0], "ssh_public_keys": [key]}
    first = call(conn, agent_path, "vm create", request)
    try:
        again = call(conn, agent_path, "vm create", request)
        assert (again["created"], again["ssh_port"], again["state"]) == (False, first["ssh_port"], "running")
        conflict = call(conn, agent_path, "vm create", dict(request, gpu_indices=[3]))
        assert conflict["error"]["code"] == "conflict"
        busy = call(conn, agent_path, "vm create", dict(request, vm_id="inst-b", gpu_indices=[3, 0]))
        assert busy["error"]["code"] == "gpu_busy"
        assert [v["vm_id"] for v in call(conn, agent_path, "vm list")["vms"]] == ["inst-a"]
    finally:
        call(conn, agent_path, "vm destroy", {"vm_id": "inst-a"})
    for command in ("vm status", "vm start", "vm stop"):
        assert call(conn, agent_path, command, {"vm_id": "inst-a"})["error"]["code"] == "not_found"


def test_node_down_stops_its_vms_and_their_sessions(base):
    node = sim.node_up("h100-sxm-x1", base)
    key, public = new_keypair()
    sim.node_authorize(node["ssh_port"], public, base)
    renter, renter_public = new_keypair()
    with pinned_client("127.0.0.1", node["ssh_port"], "root", key, node["host_public_key"]) as ssh:
        path = upload_agent(ssh)
        vm = call(ssh, path, "vm create", {"vm_id": "inst-1", "gpu_indices": [0], "ssh_public_keys": [renter_public]})
        session = _vm_client(vm, renter)
        try:
            # A renter's process that must not outlive the node: it prints its pid, then sleeps.
            _, stdout, _ = session.exec_command("echo $$; exec sleep 60")
            renter_pid = int(stdout.readline())
            assert renter_pid in agent.proc_table() and port_open(vm["ssh_port"])
            assert sim.node_down(node["ssh_port"], base) is True
        finally:
            session.close()
    assert renter_pid not in agent.proc_table()
    assert agent.pids_matching(node["node_dir"] + "/") == []
    assert not Path(node["node_dir"]).exists()
    assert not port_open(vm["ssh_port"]) and not port_open(node["ssh_port"])
    assert sim.node_down(node["ssh_port"], base) is False


def test_several_nodes_at_once(base):
    nodes = [sim.node_up(profile, base) for profile in ("rtx-a4000-x2", "rtx-a6000-x8", "rtx-a4000-x2")]
    try:
        assert len({n["ssh_port"] for n in nodes}) == len({n["host_key_fingerprint"] for n in nodes}) == 3
        listed = {n["ssh_port"]: n for n in sim.nodes_list(base)}
        assert all(listed[n["ssh_port"]]["running"] for n in nodes)
        key, public = new_keypair()
        counts = []
        for n in nodes:
            sim.node_authorize(n["ssh_port"], public, base)
            with pinned_client("127.0.0.1", n["ssh_port"], "root", key, n["host_public_key"]) as ssh:
                counts.append(call(ssh, upload_agent(ssh), "inventory")["gpu_count"])
        assert counts == [2, 8, 2]
    finally:
        for n in nodes:
            sim.node_down(n["ssh_port"], base)
    assert not {n["ssh_port"] for n in nodes} & {n["ssh_port"] for n in sim.nodes_list(base)}


def test_sim_node_sessions_carry_the_agent_configuration(conn, node):
    status, out, _ = run(conn, "env")
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert status == 0
    assert env["GPUMARKET_RUNTIME"] == "sim"
    assert env["GPUMARKET_SIM_ROOT"] == node["node_dir"]
    assert json.loads(Path(env["GPUMARKET_SIM_PROFILE"]).read_text())["name"] == "a100-80gb-sxm-x4"
    assert os.path.dirname(env["HOME"]) == node["node_dir"]


def _vm_client(vm, pkey):
    return pinned_client(vm["ssh_host"], vm["ssh_port"], vm["ssh_user"], pkey, vm["ssh_host_key"])


def test_a_stopped_vm_frees_its_gpus_and_can_start_on_others(conn, agent_path):
    renter, public = new_keypair()
    keys = [public]
    call(conn, agent_path, "vm create", {"vm_id": "inst-30", "gpu_indices": [0], "ssh_public_keys": keys})
    call(conn, agent_path, "vm stop", {"vm_id": "inst-30"})
    # The platform gave GPU 0 to someone else meanwhile: a stopped VM does not block it.
    call(conn, agent_path, "vm create", {"vm_id": "inst-31", "gpu_indices": [0], "ssh_public_keys": keys})
    try:
        status, busy = run_agent(conn, agent_path, "vm start", {"vm_id": "inst-30"})
        assert status == 1 and busy["error"]["code"] == "gpu_busy"
        moved = call(conn, agent_path, "vm start", {"vm_id": "inst-30", "gpu_indices": [3]})
        assert moved["state"] == "running" and moved["gpu_indices"] == [3]
        with _vm_client(moved, renter) as vm:
            _, out, _ = run(vm, "nvidia-smi --query-gpu=index --format=csv,noheader; echo $CUDA_VISIBLE_DEVICES")
        assert out.split() == ["3", "3"]
        status, running = run_agent(conn, agent_path, "vm start", {"vm_id": "inst-30", "gpu_indices": [2]})
        assert running["error"]["code"] == "conflict"  # a running VM is not moved
    finally:
        for vm_id in ("inst-30", "inst-31"):
            call(conn, agent_path, "vm destroy", {"vm_id": vm_id})


def test_a_node_folder_a_missed_process_still_writes_into_is_removed_all_the_same(tmp_path):
    """node_down kills the node's processes, then removes its folder; a process the kill missed (an sshd child
    forked after the process table was read) may still write its log meanwhile. Seen once in CI: rmtree failed
    with "Directory not empty". The removal kills what is left under the folder and tries again."""
    import subprocess
    import sys
    import time

    from provisioning.sim.nodes import _remove_node_dir

    node = tmp_path / "nodes" / "40001"
    logs = node / "vms" / "inst-1"
    logs.mkdir(parents=True)
    writer = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, itertools\n"
        "for n in itertools.count():\n"
        "    try:\n"
        "        open(os.path.join(sys.argv[1], f'log-{n}'), 'w').close()\n"
        "    except OSError:\n"
        "        pass\n"), f"{logs}/"])
    try:
        deadline = time.monotonic() + 10
        while len(list(logs.iterdir())) < 50 and time.monotonic() < deadline:
            time.sleep(0.01)
        _remove_node_dir(node)  # before: OSError, "Directory not empty"
        assert not node.exists()
    finally:
        writer.kill()
        writer.wait()
