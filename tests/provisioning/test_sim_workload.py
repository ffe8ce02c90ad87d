"""The renter's own workload on a sim node, end to end over real SSH: env, onstart, ports, volumes, logs, pulls.

The sim runtime models what the docker runtime does for real (tests/docker/): these are the same checks from
outside, so the demo and the platform's tests show the same behaviour."""
import json
import socket
from pathlib import Path

import pytest

from provisioning import sim
from provisioning.agent import gpumarket_agent as agent
from provisioning.agent.gpumarket_agent.runtimes.simpull import SIM_PRIVATE_AUTH, SIM_PRIVATE_REGISTRY
from tests.provisioning.sshkit import new_keypair, pinned_client, run, upload_agent

pytestmark = pytest.mark.slow

TRICKY = 'a "quoted" value with \\backslash\\, $HOME, `id`, #hash, \'single\' and\ttab'


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    base = tmp_path_factory.mktemp("simwork")
    try:
        node = sim.node_up("a100-80gb-sxm-x4", base)
        pkey, public = new_keypair("gpumarket-platform")
        sim.node_authorize(node["ssh_port"], public, base)
        client = pinned_client(node["address"], node["ssh_port"], node["ssh_user"], pkey, node["host_public_key"])
        try:
            yield {**node, "conn": client, "agent": upload_agent(client)}
        finally:
            client.close()
    finally:
        sim.nodes_down(base)


def call(node, command, request=None, ok=True):
    # As sshkit.run_agent, with room for a loaded machine: a create starts sshd and a Python box process.
    status, out, err = run(node["conn"], f"python3 {node['agent']} {command}", json.dumps(request or {}), timeout=120)
    lines = out.splitlines()
    assert len(lines) == 1, f"agent must print exactly one line, got {out!r} (stderr {err!r})"
    answer = json.loads(lines[0])
    assert (status == 0) == answer["ok"] == ok, answer
    return answer


def banner(port):
    with socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
        return sock.recv(200).decode()


def port_open(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def host_pretty_name():
    return agent.os_release_pretty_name(Path("/etc/os-release").read_text())


def test_env_onstart_ports_volumes_and_logs(node):
    renter, public = new_keypair()
    vol = call(node, "volume create", {"name": "vol-data0001", "size_gb": 20})
    assert vol == {"name": "vol-data0001", "size_gb": 20, "created": True, "ok": True,
                   "agent_version": agent.AGENT_VERSION, "size_limit": "not_enforced"}  # a folder on the sim
    assert call(node, "volume create", {"name": "vol-data0001", "size_gb": 20})["created"] is False
    onstart = 'echo "onstart ran as $(id -u) with API_KEY=$API_KEY"\necho run >> "$HOME/onstart-count"\n'
    request = {"vm_id": "work-1", "gpu_indices": [1], "ssh_public_keys": [public], "disk_gb": 80,
               "image": {"docker": "ghcr.io/acme/trainer:2.1"},
               "env": {"API_KEY": "sk-123", "TRICKY": TRICKY, "EMPTY": ""}, "onstart": onstart,
               "ports": [8888, 6006], "volumes": [{"name": "vol-data0001", "mount": "/workspace/data"}]}
    vm = call(node, "vm create", request)
    assert (vm["state"], vm["disk_gb"], vm["os"]) == ("running", 80, host_pretty_name())
    assert set(vm["ports"]) == {"8888/tcp", "6006/tcp"}
    for name, mapped in vm["ports"].items():
        assert mapped["host"] == "127.0.0.1" and mapped["port"] not in (vm["ssh_port"], int(name[:4]))
        assert banner(mapped["port"]) == f"gpumarket sim VM work-1: container port {name}\n"
    assert call(node, "vm status", {"vm_id": "work-1"})["ports"] == vm["ports"]
    assert call(node, "volume list")["volumes"] == [{"name": "vol-data0001", "size_gb": 20, "used_by": ["work-1"]}]

    with pinned_client("127.0.0.1", vm["ssh_port"], vm["ssh_user"], renter, vm["ssh_host_key"]) as ssh:
        _, out, _ = run(ssh, "env")
        env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        assert (env["API_KEY"], env["TRICKY"], env["EMPTY"]) == ("sk-123", TRICKY, "")
        assert env["CUDA_VISIBLE_DEVICES"] == "1"
        assert run(ssh, "echo kept > ~/workspace/data/file.txt && cat ~/workspace/data/file.txt")[1] == "kept\n"
        for _ in range(50):  # onstart runs beside sshd; it has had time, but do not race it
            if run(ssh, "cat ~/onstart-count")[1] == "run\n":
                break
        assert run(ssh, "cat ~/onstart-count")[1] == "run\n"
    lines = call(node, "vm logs", {"vm_id": "work-1", "tail": 100})["lines"]
    text = "\n".join(lines)
    assert "[gpumarket] pulling ghcr.io/acme/trainer:2.1" in text
    assert f"onstart ran as {Path('/proc/self').stat().st_uid} with API_KEY=sk-123" in text
    assert "[gpumarket] onstart: exited 0" in text
    assert all(line[:4].isdigit() and line[19] == "." for line in lines)  # each line carries its UTC time
    assert call(node, "vm logs", {"vm_id": "work-1", "tail": 2})["lines"] == lines[-2:]

    ports = {name: m["port"] for name, m in vm["ports"].items()}
    call(node, "vm stop", {"vm_id": "work-1"})
    assert not any(port_open(p) for p in ports.values())
    started = call(node, "vm start", {"vm_id": "work-1"})
    assert {n: m["port"] for n, m in started["ports"].items()} == ports  # the same host ports when still free
    assert banner(ports["8888/tcp"]).startswith("gpumarket sim VM work-1")
    with pinned_client("127.0.0.1", started["ssh_port"], vm["ssh_user"], renter, vm["ssh_host_key"]) as ssh:
        assert run(ssh, "cat ~/workspace/data/file.txt")[1] == "kept\n"
        assert run(ssh, "cat ~/onstart-count")[1] == "run\n"  # once: not again on start

    refused = call(node, "volume delete", {"name": "vol-data0001"}, ok=False)
    assert refused["error"]["code"] == "volume_in_use" and "work-1" in refused["error"]["message"]
    call(node, "vm destroy", {"vm_id": "work-1"})
    assert not any(port_open(p) for p in ports.values())
    assert call(node, "volume list")["volumes"] == [{"name": "vol-data0001", "size_gb": 20, "used_by": []}]

    # A new VM with the same volume finds the file; then the volume goes for good.
    again = call(node, "vm create", {"vm_id": "work-2", "gpu_indices": [0], "ssh_public_keys": [public],
                                     "volumes": [{"name": "vol-data0001", "mount": "/data"}]})
    with pinned_client("127.0.0.1", again["ssh_port"], again["ssh_user"], renter, again["ssh_host_key"]) as ssh:
        assert run(ssh, "cat ~/data/file.txt")[1] == "kept\n"
    assert again["ports"] == {} and again["disk_gb"] == 50
    call(node, "vm destroy", {"vm_id": "work-2"})
    assert call(node, "volume delete", {"name": "vol-data0001"})["deleted"] is True
    assert call(node, "volume delete", {"name": "vol-data0001"})["deleted"] is False
    assert call(node, "volume list")["volumes"] == []


def test_a_vm_cannot_mount_a_volume_the_node_lacks(node):
    answer = call(node, "vm create", {"vm_id": "work-3", "gpu_indices": [0], "ssh_public_keys": [new_keypair()[1]],
                                      "volumes": [{"name": "vol-nosuchvol", "mount": "/data"}]}, ok=False)
    assert (answer["error"]["code"], answer["error"]["field"]) == ("not_found", "volumes")
    assert call(node, "vm list")["vms"] == []


@pytest.mark.parametrize(
    ("image", "auth", "reason"),
    [
        (f"{SIM_PRIVATE_REGISTRY}/team/app:1", None, "no basic auth credentials"),
        (f"{SIM_PRIVATE_REGISTRY}/team/app:1", {"username": "renter", "password": "wrong-pass-77"},
         "unauthorized: authentication required"),
        ("registry.example.invalid:5000/app:1", None, "no such host"),
        ("acme/app:missing", None, "manifest unknown"),
    ],
)
def test_failed_pulls_end_in_pull_failed_with_the_registrys_reason(node, image, auth, reason):
    request = {"vm_id": "pull-1", "gpu_indices": [0], "ssh_public_keys": [new_keypair()[1]],
               "image": {"docker": image}}
    if auth:
        request["registry_auth"] = auth
    answer = call(node, "vm create", request, ok=False)
    assert answer["error"]["code"] == "pull_failed" and reason in answer["error"]["message"]
    assert "wrong-pass-77" not in answer["error"]["message"]
    assert call(node, "vm list")["vms"] == []
    assert not (Path(node["node_dir"]) / "vms" / "pull-1").exists()  # nothing half-made is left


def test_a_private_pull_with_credentials_keeps_them_nowhere(node):
    request = {"vm_id": "pull-2", "gpu_indices": [0], "ssh_public_keys": [new_keypair()[1]],
               "image": {"docker": f"{SIM_PRIVATE_REGISTRY}/team/app:1"}, "registry_auth": SIM_PRIVATE_AUTH}
    vm = call(node, "vm create", request)
    try:
        assert vm["state"] == "running"
        assert call(node, "vm create", request)["created"] is False  # a retry with the same credentials
        logs = "\n".join(call(node, "vm logs", {"vm_id": "pull-2"})["lines"])
        assert "with registry credentials" in logs
        secret = SIM_PRIVATE_AUTH["password"]
        for path in (Path(node["node_dir"]) / "vms").rglob("*"):
            if path.is_file() and path.suffix != ".pyz":
                assert secret not in path.read_text(errors="replace"), path
    finally:
        call(node, "vm destroy", {"vm_id": "pull-2"})


@pytest.mark.parametrize(
    ("command", "request_", "field"),
    [
        ("volume create", {"name": "data", "size_gb": 1}, "name"),
        ("volume create", {"name": "vol-UPPERCASE1", "size_gb": 1}, "name"),
        ("volume create", {"name": "vol-abcdefgh", "size_gb": 0}, "size_gb"),
        ("volume create", {"name": "vol-abcdefgh", "size_gb": "5"}, "size_gb"),
        ("volume create", {"name": "vol-abcdefgh", "size_gb": 65537}, "size_gb"),
        ("volume create", {"name": "vol-abcdefgh", "size_gb": 5, "path": "/"}, "path"),
        ("volume delete", {"name": "vol-../../etc"}, "name"),
        ("volume resize", {"name": "vol-abcdefgh"}, "command"),
        ("vm logs", {"vm_id": "work-1", "tail": 0}, "tail"),
        ("vm logs", {"vm_id": "work-1", "tail": 5001}, "tail"),
        ("vm logs", {"vm_id": "work-1", "tail": "10"}, "tail"),
    ],
)
def test_bad_volume_and_log_requests(node, command, request_, field):
    answer = call(node, command, request_, ok=False)
    assert (answer["error"]["code"], answer["error"]["field"]) == ("invalid_request", field)


def test_a_volume_keeps_its_size(node):
    call(node, "volume create", {"name": "vol-sized0001", "size_gb": 5})
    try:
        assert call(node, "volume create", {"name": "vol-sized0001", "size_gb": 6}, ok=False)["error"]["code"] == \
            "conflict"
    finally:
        call(node, "volume delete", {"name": "vol-sized0001"})
    assert call(node, "vm logs", {"vm_id": "no-such-vm"}, ok=False)["error"]["code"] == "not_found"
