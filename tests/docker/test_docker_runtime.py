"""The docker runtime against a real Docker engine and registry (started by conftest.py), the agent called directly
(test_platform_on_docker.py goes through the API and a worker on the same engine), checked from outside:
SSH into the container, read its env, reach its mapped port, find files on its volume after stop/start and after
destroy + recreate, onstart run once, pulls with and without the right credentials, orphans found.

Replaced here: only GPU device injection. GPUMARKET_DOCKER_GPUS=devices:<char device per index> puts a test
character device at /dev/nvidia<index> where the NVIDIA container toolkit (--gpus) would put the real ones.
Untested here: the toolkit itself (its --gpus parsing, driver libraries and nvidia-smi mounted into the
container, /dev/nvidiactl and /dev/nvidia-uvm), CUDA inside the container, an enforced disk limit (this engine's
overlay2 is not on xfs with project quotas: the agent answers "disk_limit": "not_enforced", checked here), and
inter-container traffic being dropped (the test engine runs with --iptables=false, which icc=false needs: the
network's option is checked, not the packets)."""
import json
import os
import socket
import stat
import tempfile
import time
from pathlib import Path

import pytest

from provisioning.agent import gpumarket_agent as agent
from provisioning.agent.gpumarket_agent.runtimes import docker as docker_runtime
from tests.docker.engine import REGISTRY_PASSWORD, REGISTRY_USER
from tests.provisioning.sshkit import new_keypair, pinned_client, run

SAMPLES = Path(__file__).resolve().parents[1] / "provisioning" / "fixtures" / "nvidia_smi"
TRICKY = "a \"quoted\" $HOME `id` #hash 'single' \\back value"
ONSTART = r"""echo "onstart ran with API_KEY=$API_KEY"
echo once >> /root/onstart-count
nohup perl -MIO::Socket::INET -e '$s = IO::Socket::INET->new(LocalPort => 8080, Listen => 5, ReuseAddr => 1)
    or die "listen: $!"; while ($c = $s->accept) { print $c "hello from the container\n"; close $c }' \
    >/dev/null 2>&1 &
"""
AUTH = {"username": REGISTRY_USER, "password": REGISTRY_PASSWORD}


@pytest.fixture
def node(docker_engine, tmp_path, monkeypatch):
    """Call the agent as a docker node whose CLI talks to the test engine; 4 GPUs, as test char devices."""
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    smi = fakebin / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat {SAMPLES / 'a100_sxm4_80gb_x4.csv'}\n")
    smi.chmod(0o755)
    for i in range(4):  # the same major/minor as /dev/null: harmless, and a real character device
        os.mknod(tmp_path / f"gpu{i}", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    monkeypatch.setenv("PATH", f"{fakebin}:{os.environ['PATH']}")
    monkeypatch.setenv("DOCKER_HOST", docker_engine.env["DOCKER_HOST"])
    monkeypatch.setenv("DOCKER_CONFIG", docker_engine.env["DOCKER_CONFIG"])
    # The agent's temporary folders (a pull's DOCKER_CONFIG) in one of this test's own: what it leaves there is
    # its own, not another test's that runs at the same time.
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    env = {"GPUMARKET_RUNTIME": "docker", "GPUMARKET_STATE_DIR": str(tmp_path / "state"),
           "GPUMARKET_PORT_RANGE": "46100-46499", "GPUMARKET_PUBLIC_HOST": "127.0.0.1",
           "GPUMARKET_DOCKER_BIND": "127.0.0.1", "GPUMARKET_DOCKER_GPUS": f"devices:{tmp_path}/gpu{{index}}",
           "GPUMARKET_INTERNAL_REGISTRIES": "127.0.0.1"}  # the session's registry: renters' own images come from it

    def call(command, request=None, ok=True):
        answer, status = agent.handle(command.split(), json.dumps(request or {}), env)
        assert (status == 0) == answer["ok"] == ok, answer
        return answer

    call.state_dir = tmp_path / "state"
    call.tmp_dir = tmp_path / "tmp"
    call.engine = docker_engine
    call.env = env
    yield call
    for vm in call("vm list")["vms"]:
        call("vm destroy", {"vm_id": vm["vm_id"]})
    for vol in call("volume list")["volumes"]:
        call("volume delete", {"name": vol["name"]})


def ssh(vm, pkey, timeout=20):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return pinned_client(vm["ssh_host"], vm["ssh_port"], vm["ssh_user"], pkey, vm["ssh_host_key"])
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def read_port(port, timeout=15):
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
                data = sock.recv(100).decode()
                if data:
                    return data
        except OSError:
            pass
        if time.monotonic() > deadline:
            return None
        time.sleep(0.2)


def port_open(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_a_renters_container_end_to_end(node):
    engine = node.engine
    renter, public = new_keypair()
    assert node("volume create", {"name": "vol-dockertest1", "size_gb": 10})["created"] is True
    request = {"vm_id": "dk-1", "gpu_indices": [1], "ssh_public_keys": [public], "disk_gb": 30,
               "image": {"docker": engine.remote_image}, "registry_auth": AUTH,
               "env": {"API_KEY": "sk-live-1", "TRICKY": TRICKY}, "onstart": ONSTART, "ports": [8080],
               "volumes": [{"name": "vol-dockertest1", "mount": "/data"}]}
    vm = node("vm create", request)
    assert (vm["state"], vm["os"], vm["disk_gb"]) == ("running", "Debian GNU/Linux 12 (bookworm)", 30)
    assert vm["ssh_host_key"].startswith("ssh-ed25519 ") and vm["ssh_host"] == "127.0.0.1"
    mapped = vm["ports"]["8080/tcp"]
    assert list(vm["ports"]) == ["8080/tcp"] and mapped["host"] == "127.0.0.1"
    assert 46100 <= vm["ssh_port"] <= 46499 and 46100 <= mapped["port"] <= 46499
    assert read_port(mapped["port"]) == "hello from the container\n"  # onstart's listener, through the mapping

    with ssh(vm, renter) as client:
        status, out, _ = run(client, "env")
        env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        assert status == 0 and env["API_KEY"] == "sk-live-1"
        assert run(client, "sh -lc 'printf %s \"$TRICKY\"'")[1] == TRICKY  # login shells get every value exactly
        status, out, _ = run(client, "stat -c '%F %t:%T' /dev/nvidia1; test -e /dev/nvidia0 || echo no-gpu0")
        assert out == "character special file 1:3\nno-gpu0\n"  # only the GPU it rented
        assert run(client, "echo kept > /data/file.txt && cat /data/file.txt")[1] == "kept\n"
        assert run(client, "cat /root/onstart-count")[1] == "once\n"
    text = "\n".join(node("vm logs", {"vm_id": "dk-1", "tail": 200})["lines"])
    for expected in (f"[gpumarket] pulling {engine.remote_image} with registry credentials",
                     "onstart ran with API_KEY=sk-live-1", "[gpumarket] onstart: exited 0", "[gpumarket] created"):
        assert expected in text
    # The registry password is in no log line, no file the agent keeps, and not in the container's config.
    assert REGISTRY_PASSWORD not in text
    for path in node.state_dir.rglob("*"):
        assert not path.is_file() or REGISTRY_PASSWORD not in path.read_text(errors="replace"), path
    assert REGISTRY_PASSWORD not in engine.docker("inspect", "gpumarket-dk-1").stdout
    assert not list(node.tmp_dir.glob("gpumarket-pull-*"))  # the temporary DOCKER_CONFIG is gone

    assert node("vm stop", {"vm_id": "dk-1"})["state"] == "stopped"
    assert not port_open(vm["ssh_port"])
    started = node("vm start", {"vm_id": "dk-1"})
    assert (started["state"], started["ssh_port"], started["ports"]) == ("running", vm["ssh_port"], vm["ports"])
    with ssh(started, renter) as client:
        assert run(client, "cat /data/file.txt; cat /root/onstart-count")[1] == "kept\nonce\n"  # onstart: once
    assert engine.docker("restart", "--time", "2", "gpumarket-dk-1").returncode == 0  # e.g. the engine restarting it
    with ssh(started, renter) as client:
        assert run(client, "cat /data/file.txt; cat /root/onstart-count")[1] == "kept\nonce\n"

    refused = node("volume delete", {"name": "vol-dockertest1"}, ok=False)
    assert refused["error"]["code"] == "volume_in_use"
    assert node("vm destroy", {"vm_id": "dk-1"})["existed"] is True
    assert engine.docker("inspect", "gpumarket-dk-1").returncode != 0
    assert node("volume list")["volumes"] == [{"name": "vol-dockertest1", "size_gb": 10, "used_by": []}]

    again = node("vm create", {"vm_id": "dk-2", "gpu_indices": [0], "ssh_public_keys": [public],
                               "image": {"docker": engine.remote_image}, "registry_auth": AUTH,
                               "volumes": [{"name": "vol-dockertest1", "mount": "/srv/data"}]})
    with ssh(again, renter) as client:
        assert run(client, "cat /srv/data/file.txt")[1] == "kept\n"
    node("vm destroy", {"vm_id": "dk-2"})
    assert node("volume delete", {"name": "vol-dockertest1"})["deleted"] is True
    assert engine.docker("volume", "inspect", "vol-dockertest1").returncode != 0


@pytest.mark.parametrize(
    ("auth", "tag", "reason"),
    [
        ({"username": REGISTRY_USER, "password": "not-the-password"}, "1", "unauthorized"),
        (None, "1", "no basic auth credentials"),
        (AUTH, "no-such-tag", "manifest unknown"),
    ],
)
def test_failed_pulls_answer_the_registrys_reason_and_leave_nothing(node, auth, tag, reason):
    image = node.engine.remote_image.rsplit(":", 1)[0] + ":" + tag
    node.engine.docker("rmi", image)  # not cached: the registry must answer
    request = {"vm_id": "dk-bad", "gpu_indices": [0], "ssh_public_keys": [new_keypair()[1]],
               "image": {"docker": image}}
    if auth:
        request["registry_auth"] = auth
    answer = node("vm create", request, ok=False)
    assert answer["error"]["code"] == "pull_failed" and reason in answer["error"]["message"], answer
    assert "not-the-password" not in answer["error"]["message"]
    assert node("vm list")["vms"] == []
    assert not (node.state_dir / "vms" / "dk-bad").exists()
    assert node.engine.docker("inspect", "gpumarket-dk-bad").returncode != 0


@pytest.mark.parametrize("pull", ["always", "missing"])
def test_a_cached_private_image_still_needs_the_renters_credentials(node, pull):
    # Pulled for one renter, the image is on the node; another renter without credentials still cannot use it. Also
    # where the provider set GPUMARKET_DOCKER_PULL=missing: a renter's own image is pulled all the same (before, the
    # cached copy started for them, found by review).
    node.env["GPUMARKET_DOCKER_PULL"] = pull
    owner = node("vm create", {"vm_id": "dk-owner", "gpu_indices": [0], "ssh_public_keys": [new_keypair()[1]],
                               "image": {"docker": node.engine.remote_image}, "registry_auth": AUTH})
    assert owner["state"] == "running"
    assert node.engine.docker("image", "inspect", node.engine.remote_image).returncode == 0
    answer = node("vm create", {"vm_id": "dk-nocreds", "gpu_indices": [2], "ssh_public_keys": [new_keypair()[1]],
                                "image": {"docker": node.engine.remote_image}, "image_env": True}, ok=False)
    assert answer["error"]["code"] == "pull_failed" and "no basic auth credentials" in answer["error"]["message"]


def test_containers_without_a_record_are_found(node):
    engine = node.engine
    engine.docker("create", "--name", "gpumarket-ghost", "--label", "gpumarket.vm_id=ghost", engine.image, check=True)
    try:
        listed = node("vm list")["vms"]
        assert {"vm_id": "ghost", "state": "stopped"} in listed
    finally:
        engine.docker("rm", "-f", "gpumarket-ghost")
    assert all(v["vm_id"] != "ghost" for v in node("vm list")["vms"])
    engine.docker("create", "--name", "unrelated", engine.image, check=True)  # not ours: no label
    try:
        assert node("vm list")["vms"] == []
    finally:
        engine.docker("rm", "-f", "unrelated")


def test_a_renters_container_is_bounded_and_kept_apart_and_sshd_still_logs_in(node):
    engine = node.engine
    renter, public = new_keypair()
    vm = node("vm create", {"vm_id": "dk-iso", "gpu_indices": [0], "ssh_public_keys": [public], "disk_gb": 5,
                            "image": {"docker": engine.remote_image}, "registry_auth": AUTH})
    info = json.loads(engine.docker("inspect", "gpumarket-dk-iso", check=True).stdout)[0]
    host = info["HostConfig"]
    # A share of memory (no swap beyond it), CPUs and process ids: 1 of the 4 GPUs.
    cores, ram_mib, pids = docker_runtime.host_resources()
    cpus, memory_mib, pid_limit = docker_runtime.container_share(cores, ram_mib, pids, 1, 4)
    assert (host["Memory"], host["MemorySwap"]) == (memory_mib << 20, memory_mib << 20)
    assert (host["NanoCpus"], host["PidsLimit"]) == (int(cpus * 1e9), pid_limit)
    assert "CAP_NET_RAW" in host["CapDrop"] and "no-new-privileges" in host["SecurityOpt"]
    assert list(info["NetworkSettings"]["Networks"]) == ["gpumarket-vms"]  # not docker's default bridge
    network = json.loads(engine.docker("network", "inspect", "gpumarket-vms", check=True).stdout)[0]
    assert network["Options"]["com.docker.network.bridge.enable_icc"] == "false"
    # This engine cannot limit a container's disk (overlay2 off xfs+pquota): the answer says so.
    driver = engine.docker("info", "--format", "{{.Driver}} {{json .DriverStatus}}", check=True).stdout
    expected = "enforced" if "xfs" in driver else "not_enforced"
    assert vm["disk_limit"] == expected, driver
    assert (host.get("StorageOpt") or {}).get("size") == ("5G" if expected == "enforced" else None)
    assert host["LogConfig"] == {"Type": "json-file", "Config": {"max-file": "3", "max-size": "10m"}}
    with ssh(vm, renter) as client:  # sshd's privilege separation works with those capabilities and flags
        status, out, err = run(client, "perl -MSocket -e 'socket(my $s, 17, 3, 0) or die \"raw: $!\\n\"; "
                                       "print \"raw socket\\n\"'")  # AF_PACKET, SOCK_RAW: ARP spoofing, sniffing
        assert status != 0 and "raw: Operation not permitted" in err, (status, out, err)
        status, out, _ = run(client, "grep -E '^(NoNewPrivs|CapEff)' /proc/self/status; echo ok > /root/x; cat /root/x")
        assert status == 0 and "NoNewPrivs:\t1" in out and out.endswith("ok\n"), out
        # The container's own environment, which an nvidia runtime hook reads: no GPU but the devices given.
        assert run(client, "tr '\\0' '\\n' < /proc/1/environ | grep ^NVIDIA_")[1] == "NVIDIA_VISIBLE_DEVICES=void\n"
    stopped = node("vm stop", {"vm_id": "dk-iso"})
    assert stopped["state"] == "stopped" and node("vm start", {"vm_id": "dk-iso"})["state"] == "running"


def test_destroy_removes_the_containers_anonymous_volumes(node):
    engine = node.engine
    maker = engine.docker("create", engine.image, check=True).stdout.strip()
    try:  # an image that declares a VOLUME, as postgres, jupyter and many ML images do
        engine.docker("commit", "--change", "VOLUME /anon", maker, "gpumarket-test/with-volume:1", check=True)
    finally:
        engine.docker("rm", "-f", maker)
    node.env["GPUMARKET_DOCKER_PULL"] = "missing"
    renter, public = new_keypair()
    vm = node("vm create", {"vm_id": "dk-anon", "gpu_indices": [0], "ssh_public_keys": [public],
                            "image": {"docker": "gpumarket-test/with-volume:1"}})
    with ssh(vm, renter) as client:
        assert run(client, "echo renter-data > /anon/file && cat /anon/file")[1] == "renter-data\n"
    info = json.loads(engine.docker("inspect", "gpumarket-dk-anon", check=True).stdout)[0]
    (anonymous,) = [m["Name"] for m in info["Mounts"] if m["Type"] == "volume" and m["Destination"] == "/anon"]
    assert node("vm destroy", {"vm_id": "dk-anon"})["existed"] is True
    assert engine.docker("volume", "inspect", anonymous).returncode != 0  # the renter's data is gone with it
