"""The exact docker commands the agent runs for the `docker` runtime."""
import json
import os
import threading
import time
from pathlib import Path

import pytest

from provisioning.agent import gpumarket_agent as agent
from provisioning.agent.gpumarket_agent.runtimes import docker as docker_runtime
from tests.provisioning.sshkit import new_keypair

SAMPLES = Path(__file__).parent / "fixtures" / "nvidia_smi"
ISOLATION = ["--network", "gpumarket-vms", "--cap-drop", "NET_RAW", "--cap-drop", "MKNOD", "--cap-drop", "SETFCAP",
             "--cap-drop", "AUDIT_WRITE", "--security-opt", "no-new-privileges"]
LOGS = ["--log-driver", "json-file", "--log-opt", "max-size=10m", "--log-opt", "max-file=3"]


def test_create_argv_for_two_gpus():
    argv = agent.docker_run_argv(
        "inst-42", [0, 1], "nvidia/cuda:12.2.0-base-ubuntu22.04", 40007, "/root/.gpumarket/vms/inst-42/authorized_keys"
    )
    assert argv == [
        "docker", "create",
        "--name", "gpumarket-inst-42",
        "--hostname", "inst-42",
        "--label", "gpumarket.vm_id=inst-42",
        *ISOLATION, *LOGS,
        # One argv element with literal quotes: docker splits an unquoted "device=0,1" at the comma.
        "--gpus", '"device=0,1"',
        "-p", "40007:22",
        "-v", "/root/.gpumarket/vms/inst-42/authorized_keys:/root/.ssh/authorized_keys:ro",
        "--restart", "unless-stopped",
        "nvidia/cuda:12.2.0-base-ubuntu22.04",
    ]


def test_create_argv_for_one_gpu():
    argv = agent.docker_run_argv("a", [3], "ubuntu", 40000, "/s/vms/a/authorized_keys")
    assert argv[argv.index("--gpus") + 1] == '"device=3"'
    assert argv[-1] == "ubuntu"


def test_create_argv_with_the_renters_options():
    argv = agent.docker_run_argv(
        "a", [2, 5], "127.0.0.1:5000/t/app:1", 40000, "/s/vms/a/authorized_keys",
        gpus="devices:/dev/test-gpu{index}", bind="127.0.0.1", ports={"8888/tcp": 40001, "6006/tcp": 40002},
        volumes=[{"name": "vol-abcdefgh", "mount": "/data"}, {"name": "vol-ijklmnop", "mount": '/a,b "c"'}],
        box="/s/vms/a", command=["/usr/sbin/sshd", "-D"])
    assert argv[argv.index("--hostname") + 2:] == [
        "--label", "gpumarket.vm_id=a", *ISOLATION, *LOGS,
        "--device", "/dev/test-gpu2:/dev/nvidia2", "--device", "/dev/test-gpu5:/dev/nvidia5",
        "-p", "127.0.0.1:40000:22", "-p", "127.0.0.1:40002:6006", "-p", "127.0.0.1:40001:8888",
        "-v", "/s/vms/a/authorized_keys:/root/.ssh/authorized_keys:ro",
        "-v", "/s/vms/a/box:/.gpumarket:ro",  # nothing the renter writes lands in a host folder
        "--init", "--entrypoint", "/bin/sh",
        "-e", "TINI_KILL_PROCESS_GROUP=1",  # docker stop's signal reaches the image's command under the wrapper
        "--mount", "type=volume,src=vol-abcdefgh,dst=/data",
        "--mount", 'type=volume,src=vol-ijklmnop,"dst=/a,b ""c"""',  # CSV, as docker's --mount parser reads it
        # no --env-file: the renter's env is no part of the container's environment (dockerbox.py)
        "-e", "NVIDIA_VISIBLE_DEVICES=void",  # no GPU through an nvidia default runtime but the devices given
        "--restart", "unless-stopped", "127.0.0.1:5000/t/app:1",
        "/.gpumarket/entry.sh", "/usr/sbin/sshd", "-D",
    ]
    assert "--gpus" not in agent.docker_run_argv("a", [0], "x", 1, "/k", gpus="none")
    assert "--device" not in agent.docker_run_argv("a", [0], "x", 1, "/k", gpus="none")


def test_env_reaches_the_container_as_files_never_as_argv():
    from provisioning.agent.gpumarket_agent.runtimes import dockerbox
    env = {"B": "it's $HOME", "A": "plain", "H": "#x"}
    assert dockerbox.env_file(env) == "A=plain\nB=it's $HOME\nH=#x\n"
    assert dockerbox.profile_sh(env) == "export A=plain\nexport B='it'\"'\"'s $HOME'\nexport H='#x'\n"
    assert dockerbox.pam_environment(env) == "A=plain\nB=it's $HOME\n"  # pam_env would cut "#x"


def test_pull_config_holds_only_the_renters_credentials():
    assert json.loads(agent.docker_config_json("ubuntu", None)) == {"auths": {}}
    config = json.loads(agent.docker_config_json("127.0.0.1:5000/t/app:1", {"username": "u", "password": "p:w"}))
    assert config == {"auths": {"127.0.0.1:5000": {"auth": "dTpwOnc="}}}  # base64("u:p:w")
    assert agent.pull_reason("Error response from daemon: Head x: unauthorized: bad p:w\n",
                             {"username": "u", "password": "p:w"}) == "Head x: unauthorized: bad ***"


def test_lifecycle_argvs():
    assert agent.docker_verb_argv("start", "inst-42") == ["docker", "start", "gpumarket-inst-42"]
    assert agent.docker_verb_argv("stop", "inst-42") == ["docker", "stop", "--time", "20", "gpumarket-inst-42"]
    # -v: the anonymous volumes an image declares (VOLUME /var/lib/postgresql/data...) go with the container,
    # never left on the provider's disk holding the renter's data; named gpumarket volumes are kept.
    assert agent.docker_verb_argv("rm", "inst-42") == ["docker", "rm", "-f", "-v", "gpumarket-inst-42"]
    assert agent.docker_verb_argv("inspect", "inst-42") == [
        "docker", "inspect", "--format", "{{.State.Status}}", "gpumarket-inst-42"
    ]


def test_list_argv_filters_on_our_label():
    assert agent.DOCKER_LIST_ARGV == [
        "docker", "ps", "-a", "--filter", "label=gpumarket.vm_id",
        "--format", '{{.Label "gpumarket.vm_id"}}\t{{.State}}',
    ]


def test_container_states_map_to_vm_states():
    assert [agent.docker_state(s) for s in ("running", "restarting", "exited", "created", "paused", "dead")] == [
        "running", "restarting", "stopped", "stopped", "stopped", "stopped"  # restarting: its command exited
    ]


# The orchestration around those commands, against a stand-in `docker` CLI (no Docker daemon in the test
# environment): it keeps container states in a JSON file, answers as docker does, and logs every argv.
FAKE_DOCKER = r'''#!/usr/bin/env python3
import json, os, sys
state_file, log_file = os.environ["FAKE_DOCKER_STATE"], os.environ["FAKE_DOCKER_LOG"]
state = json.load(open(state_file)) if os.path.exists(state_file) else {}
args = sys.argv[1:]
with open(log_file, "a") as f:
    f.write(json.dumps(args) + "\n")
def missing(name):
    if args[:2] == ["rm", "-f"] and os.environ.get("FAKE_DOCKER_RM_SILENT"):
        sys.exit(0)  # current Docker CLI (docker/cli#7110): `rm -f` of no container prints nothing, exits 0
    sys.stderr.write("Error response from daemon: No such container: %s\n" % name)
    # `docker rm -f` of no container exits 0 since Docker 20.10 (docker/cli#2678), its error printed all the same
    sys.exit(0 if args[:2] == ["rm", "-f"] else 1)
if os.environ.get("FAKE_DOCKER_DOWN") and os.path.exists(os.environ["FAKE_DOCKER_DOWN"]):  # the daemon is away
    sys.stderr.write("Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon "
                     "running?\n")
    sys.exit(1)
verb, name = args[0], args[-1]
networks = state.setdefault("networks", {})
if verb == "network" and args[1] == "inspect":
    if name not in networks:
        sys.stderr.write("Error: No such network: %s\n" % name)
        sys.exit(1)
    print(json.dumps(networks[name]))
elif verb == "network" and args[1] == "create":
    networks[name] = dict(a.split("=", 1) for i, a in enumerate(args) if args[i - 1] == "--opt")
elif verb == "volume" and args[1] == "inspect":
    if name not in state.setdefault("volumes", {}):
        sys.stderr.write("Error: No such volume: %s\n" % name)
        sys.exit(1)
    print(json.dumps(state["volumes"][name]))
elif verb == "volume" and args[1] == "create":
    if "--opt" in args and os.environ.get("FAKE_DOCKER_NO_QUOTA"):
        sys.stderr.write("Error response from daemon: create %s: quota size requested but no quota support\n" % name)
        sys.exit(1)
    state.setdefault("volumes", {})[name] = dict(a.split("=", 1) for i, a in enumerate(args) if args[i - 1] == "--opt")
elif verb == "volume":
    state.setdefault("volumes", {}).pop(name, None)
elif verb == "info":
    print("24.0.7")
elif verb == "ps":
    for n, status in sorted(state.items()):
        if n not in ("networks", "volumes"):
            print("%s\t%s" % (n[len("gpumarket-"):], status))
elif verb == "--config":
    assert os.stat(args[1]).st_mode & 0o777 == 0o700
    if os.environ.get("FAKE_DOCKER_PULL_WAIT") and "slow" in args[-1]:  # a slow pull: until that file exists
        import time
        while not os.path.exists(os.environ["FAKE_DOCKER_PULL_WAIT"]):
            time.sleep(0.02)
    print("Status: Downloaded newer image for " + args[-1])
elif verb == "image":
    print(json.dumps({"Cmd": ["/usr/sbin/sshd", "-D"]}))
elif verb == "create":
    if any(a.startswith("size=") for a in args) and os.environ.get("FAKE_DOCKER_NO_QUOTA"):
        sys.stderr.write("Error response from daemon: --storage-opt is supported only for overlay over xfs "
                         "with 'pquota' mount option\n")
        sys.exit(1)
    state[args[args.index("--name") + 1]] = "created"
elif verb == "exec":
    print("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHostKeyOfTheContainerXXXXXXXXXXXXXXXXXXX")
elif verb == "cp":
    sys.exit(1)
elif name not in state:
    missing(name)
elif verb in ("start", "rm") and os.environ.get("FAKE_DOCKER_FAIL_" + verb.upper()):  # the engine refuses it
    sys.stderr.write("Error response from daemon: %s: device or resource busy\n" % name)
    sys.exit(1)
elif verb == "inspect":
    print(state[name])
elif verb == "start":
    state[name] = "running"
elif verb == "stop":
    state[name] = "exited"
elif verb == "rm":
    del state[name]
    print(name)  # docker rm prints the name of each container it removed
json.dump(state, open(state_file, "w"))
'''


def test_docker_runtime_lifecycle(tmp_path, monkeypatch):
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    (fakebin / "docker").write_text(FAKE_DOCKER)
    (fakebin / "nvidia-smi").write_text(
        f"#!/bin/sh\ncase \"$1\" in --query-gpu=*) cat {SAMPLES / 'a100_sxm4_80gb_x4.csv'};; "
        f"*) cat {SAMPLES / 'h100_sxm_x1_table.txt'};; esac\n"
    )
    for script in fakebin.iterdir():
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fakebin}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DOCKER_STATE", str(tmp_path / "containers.json"))
    monkeypatch.setenv("FAKE_DOCKER_LOG", str(tmp_path / "docker.log"))
    env = {"GPUMARKET_RUNTIME": "docker", "GPUMARKET_STATE_DIR": str(tmp_path / "state"),
           "GPUMARKET_PORT_RANGE": "41000-41999"}
    key = new_keypair()[1]
    create = {"vm_id": "inst-7", "gpu_indices": [2, 3], "ssh_public_keys": [key],
              "image": {"docker": "ghcr.io/gpumarket/ssh-cuda:12.2"}}

    def call(command, request):
        answer, status = agent.handle(command.split(), json.dumps(request), env)
        assert (status == 0) == answer["ok"], answer
        return answer

    def docker_calls():
        return [json.loads(line) for line in (tmp_path / "docker.log").read_text().splitlines()]

    vm = call("vm create", create)
    assert (vm["state"], vm["ssh_user"], vm["ssh_host"], vm["created"]) == ("running", "root", None, True)
    keys_file = tmp_path / "state" / "vms" / "inst-7" / "authorized_keys"
    assert keys_file.read_text() == key + "\n"
    creates = [c for c in docker_calls() if c[0] == "create"]
    assert len(creates) == 1 and creates[0][creates[0].index("--gpus") + 1] == '"device=2,3"'
    assert creates[0][-3:] == ["/.gpumarket/entry.sh", "/usr/sbin/sshd", "-D"]
    assert [c for c in docker_calls() if "pull" in c][0][-2:] == ["pull", "ghcr.io/gpumarket/ssh-cuda:12.2"]
    assert vm["ssh_host_key"].startswith("ssh-ed25519 AAAA") and vm["os"] is None
    assert 41000 <= vm["ssh_port"] <= 41999

    again = call("vm create", create)
    assert (again["created"], again["ssh_port"]) == (False, vm["ssh_port"])
    assert len([c for c in docker_calls() if c[0] == "create"]) == 1  # no second container

    assert call("vm stop", {"vm_id": "inst-7"})["state"] == "stopped"
    assert call("vm start", {"vm_id": "inst-7"})["state"] == "running"

    # A container of ours the agent has no record of (a crash mid-create) shows up in the list.
    state = json.loads((tmp_path / "containers.json").read_text())
    state["gpumarket-ghost"] = "exited"
    (tmp_path / "containers.json").write_text(json.dumps(state))
    listed = call("vm list", {})["vms"]
    assert [(v["vm_id"], v["state"]) for v in listed] == [("inst-7", "running"), ("ghost", "stopped")]

    assert call("vm destroy", {"vm_id": "inst-7"})["existed"] is True
    assert ["rm", "-f", "-v", "gpumarket-inst-7"] in docker_calls()
    assert not keys_file.parent.exists()
    assert call("vm destroy", {"vm_id": "inst-7"})["existed"] is False
    health = call("health", {})
    assert (health["runtime_ok"], health["runtime_detail"], health["gpu_count"]) == (True, "24.0.7", 4)


# ------------------------------------------------------------------------------------------------------------------
# One renter's container against the host and the other renters (found by review): limits, network, capabilities,
# volumes left behind, GPUs checked before every start, and reads of what the container controls.

@pytest.fixture
def node(tmp_path, monkeypatch):
    """A docker node (stand-in docker CLI, 4 x A100) called in-process; docker_calls() lists every docker argv."""
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    (fakebin / "docker").write_text(FAKE_DOCKER)
    (fakebin / "nvidia-smi").write_text(
        f"#!/bin/sh\ncase \"$1\" in --query-gpu=*) cat {SAMPLES / 'a100_sxm4_80gb_x4.csv'};; "
        f"*) cat {SAMPLES / 'h100_sxm_x1_table.txt'};; esac\n")
    for script in fakebin.iterdir():
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fakebin}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DOCKER_STATE", str(tmp_path / "containers.json"))
    monkeypatch.setenv("FAKE_DOCKER_LOG", str(tmp_path / "docker.log"))
    env = {"GPUMARKET_RUNTIME": "docker", "GPUMARKET_STATE_DIR": str(tmp_path / "state"),
           "GPUMARKET_PORT_RANGE": "41000-41999"}
    key = new_keypair()[1]

    class Node:
        def call(self, command, request):
            return agent.handle(command.split(), json.dumps(request), env)[0]

        def docker_calls(self):
            path = tmp_path / "docker.log"
            return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

        def creates(self):
            return [c for c in self.docker_calls() if c[0] == "create"]

        def create(self, vm_id, gpus, image="ghcr.io/x/app:1", **extra):
            return self.call("vm create", {"vm_id": vm_id, "gpu_indices": gpus, "ssh_public_keys": [key],
                                           "image": {"docker": image}, **extra})

        def states(self):
            return {v["vm_id"]: v["state"] for v in self.call("vm list", {})["vms"]}

    return Node()


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_each_container_gets_a_share_of_memory_cpus_and_processes_in_proportion_to_its_gpus():
    share = docker_runtime.container_share
    # 1 of 4 GPUs on 64 cores, 512 GiB, pid_max 4194304: a quarter of the CPUs, of 90 % of RAM, of half the pids.
    assert share(64, 524288, 4194304, 1, 4) == (16.0, 117964, 524288)
    assert share(64, 524288, 4194304, 4, 4) == (64.0, 471859, 2097152)
    assert share(8, 16000, 32768, 1, 8) == (1.0, 2048, 2048)  # floors: one CPU, 2 GiB
    assert share(2, 8000, 32768, 1 / 7, 1) == (1.0, 2048, 2340)  # a MIG slice: 1/7 of its GPU, the floors
    assert share(128, 1 << 20, 32768, 1, 1000) == (1.0, 2048, 1024)  # never below the floors
    argv = agent.docker_run_argv("a", [0], "x", 1, "/k", limits={"cpus": 16.0, "memory_mib": 117964,
                                                                 "pids": 4096, "disk_gb": 30, "disk_limit": "enforced"})
    # Memory and memory+swap equal: no swap beyond the share.
    assert (flag(argv, "--memory"), flag(argv, "--memory-swap"), flag(argv, "--cpus"), flag(argv, "--pids-limit"),
            flag(argv, "--storage-opt")) == ("117964m", "117964m", "16", "4096", "size=30G")


def test_a_renters_container_cannot_take_the_hosts_memory_cpus_or_process_ids(node):
    assert node.create("inst-1", [0])["ok"]
    (argv,) = node.creates()
    cores, ram_mib, pids = docker_runtime.host_resources()
    cpus, memory, pid_limit = docker_runtime.container_share(cores, ram_mib, pids, 1, 4)  # 1 of the 4 A100s
    assert flag(argv, "--memory") == flag(argv, "--memory-swap") == f"{memory}m"
    assert (float(flag(argv, "--cpus")), int(flag(argv, "--pids-limit"))) == (cpus, pid_limit)
    assert memory < ram_mib * 0.9 or memory == 2048


def test_container_disk_is_limited_to_the_booked_disk_gb_and_the_answer_says_so(node):
    vm = node.create("inst-1", [0], disk_gb=7)
    assert (vm["disk_gb"], vm["disk_limit"]) == (7, "enforced")
    (argv,) = node.creates()
    assert flag(argv, "--storage-opt") == "size=7G"


def test_where_the_engine_cannot_limit_a_containers_disk_the_answer_says_not_enforced(node, monkeypatch):
    monkeypatch.setenv("FAKE_DOCKER_NO_QUOTA", "1")  # overlay2 off xfs with pquota: docker refuses --storage-opt
    vm = node.create("inst-1", [0], disk_gb=7)
    assert (vm["state"], vm["disk_gb"], vm["disk_limit"]) == ("running", 7, "not_enforced")
    first, second = node.creates()
    assert "--storage-opt" in first and "--storage-opt" not in second
    assert node.call("vm status", {"vm_id": "inst-1"})["disk_limit"] == "not_enforced"
    lines = node.call("vm logs", {"vm_id": "inst-1"})["lines"]
    assert any("disk limit is not enforced" in line for line in lines), lines


def test_renters_containers_share_no_bridge_with_inter_container_traffic_or_raw_sockets(node):
    assert node.create("inst-1", [0])["ok"] and node.create("inst-2", [1])["ok"]
    made = [c for c in node.docker_calls() if c[:2] == ["network", "create"]]
    assert made == [["network", "create", "--driver", "bridge", "--label", "gpumarket.network=1", "--opt",
                     "com.docker.network.bridge.enable_icc=false", "gpumarket-vms"]]  # once, for every VM
    for argv in node.creates():
        assert flag(argv, "--network") == "gpumarket-vms"
        assert "NET_RAW" in [a for i, a in enumerate(argv) if argv[i - 1] == "--cap-drop"]
        assert flag(argv, "--security-opt") == "no-new-privileges"


def test_a_network_of_that_name_that_lets_containers_talk_is_refused_not_used(node, tmp_path):
    state = {"networks": {"gpumarket-vms": {}}}  # made by someone else, without enable_icc=false
    (tmp_path / "containers.json").write_text(json.dumps(state))
    answer = node.create("inst-1", [0])
    assert not answer["ok"] and answer["error"]["code"] == "bad_node_config", answer
    assert "enable_icc" in answer["error"]["message"] and node.creates() == []


def test_a_retried_create_does_not_start_a_vm_on_a_gpu_another_running_vm_holds(node):
    assert node.create("inst-1", [2])["ok"]
    assert node.call("vm stop", {"vm_id": "inst-1"})["state"] == "stopped"  # the platform frees GPU 2
    assert node.create("inst-2", [2])["state"] == "running"  # another renter gets GPU 2
    again = node.create("inst-1", [2])  # the first VM's create, retried (or redelivered)
    assert not again["ok"] and again["error"]["code"] == "gpu_busy", again
    assert node.states() == {"inst-1": "stopped", "inst-2": "running"}
    assert node.call("vm destroy", {"vm_id": "inst-2"})["ok"]
    assert node.create("inst-1", [2])["state"] == "running"  # free again: the retry completes


def test_a_vm_being_created_holds_its_gpus_through_its_pull(node, tmp_path, monkeypatch):
    release = tmp_path / "pull-done"
    monkeypatch.setenv("FAKE_DOCKER_PULL_WAIT", str(release))
    first = {}
    thread = threading.Thread(target=lambda: first.update(node.create("inst-1", [2], image="ghcr.io/x/slow:1")))
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not any("pull" in c for c in node.docker_calls()) and time.monotonic() < deadline:
            time.sleep(0.02)
        second = node.create("inst-2", [2])  # while inst-1 pulls: recorded, no container yet
        assert not second["ok"] and second["error"]["code"] == "gpu_busy", second
        assert node.create("inst-3", [3])["state"] == "running"  # another GPU is free
    finally:
        release.touch()
        thread.join(30)
    assert first["state"] == "running" and node.states()["inst-1"] == "running"
    assert "provisioning" not in json.loads((tmp_path / "state" / "vms" / "inst-1" / "vm.json").read_text())
    monkeypatch.delenv("FAKE_DOCKER_PULL_WAIT")
    assert node.call("vm stop", {"vm_id": "inst-1"})["state"] == "stopped"
    assert node.create("inst-2", [2])["state"] == "running"  # created and stopped: it holds nothing


def test_volume_size_is_limited_where_the_engine_can_and_the_answer_says_when_not(node, monkeypatch):
    made = node.call("volume create", {"name": "vol-abcdefgh", "size_gb": 10})
    assert (made["created"], made["size_limit"]) == (True, "enforced")
    assert ["volume", "create", "--label", "gpumarket.volume=vol-abcdefgh", "--opt", "size=10G",
            "vol-abcdefgh"] in node.docker_calls()
    assert node.call("volume create", {"name": "vol-abcdefgh", "size_gb": 10})["size_limit"] == "enforced"
    monkeypatch.setenv("FAKE_DOCKER_NO_QUOTA", "1")  # the local driver without xfs project quotas
    made = node.call("volume create", {"name": "vol-ijklmnop", "size_gb": 10})
    assert (made["created"], made["size_limit"]) == (True, "not_enforced")
    assert ["volume", "create", "--label", "gpumarket.volume=vol-ijklmnop", "vol-ijklmnop"] in node.docker_calls()
    assert node.call("volume create", {"name": "vol-ijklmnop", "size_gb": 10})["size_limit"] == "not_enforced"


def test_reads_of_what_the_container_controls_are_bounded(tmp_path):
    script = tmp_path / "talk"
    script.write_text("#!/bin/sh\nprintf 'first\\n'; head -c 50000000 /dev/zero | tr '\\0' x; "
                      "printf '\\nshort\\nlast\\n'\n")
    script.chmod(0o755)
    lines = docker_runtime.container_log_tail([str(script)], 3, max_line=100)
    assert lines == ["x" * 100, "short", "last"]  # the 50 MB line cut at 100 bytes
    lines = docker_runtime.container_log_tail([str(script)], 3, max_line=100, max_bytes=1 << 20)
    assert lines == ["first", "x" * 100]  # stopped reading after about 1 MiB
    forever = tmp_path / "forever"
    forever.write_text("#!/bin/sh\nexec cat /dev/zero\n")
    forever.chmod(0o755)
    code, out, too_long = docker_runtime.bounded_output([str(forever)], 4096)
    assert too_long and len(out) == 4096
    assert docker_runtime.bounded_output(["printf", "abc"], 4096) == (0, b"abc", False)


def _record(tmp_path, vm_id, gpus, **extra):
    """A VM record as the agent writes it, without its container (made by hand)."""
    from provisioning.agent.gpumarket_agent.records import save_record
    cfg = agent.Config({"GPUMARKET_RUNTIME": "docker", "GPUMARKET_STATE_DIR": str(tmp_path / "state")})
    spec = {"gpu_indices": gpus, "ssh_public_keys": [new_keypair()[1]], "image": {"docker": "ghcr.io/x/app:1"},
            "disk_gb": 50}
    save_record(cfg, {"vm_id": vm_id, "runtime": "docker", "spec": spec, "ssh_port": 41000, "ports": {}, **extra})


def _prune(tmp_path, name):
    """The provider removes a container behind the agent's back (`docker rm`, `docker container prune`)."""
    state = json.loads((tmp_path / "containers.json").read_text())
    del state[name]
    (tmp_path / "containers.json").write_text(json.dumps(state))


def test_a_vm_whose_create_has_not_finished_holds_its_gpus(node, tmp_path):
    # Recorded by a create that did not end (the agent killed mid-pull): until a create finishes it or a destroy
    # removes it, its GPUs are not given to another VM.
    _record(tmp_path, "inst-1", [2], provisioning=True)
    answer = node.create("inst-2", [2])
    assert not answer["ok"] and answer["error"]["code"] == "gpu_busy", answer
    assert node.call("vm destroy", {"vm_id": "inst-1"})["existed"] is True
    assert node.create("inst-2", [2])["state"] == "running"


@pytest.mark.parametrize("stopped", [False, True])
def test_a_vm_whose_container_was_removed_holds_no_gpus_and_cannot_start(node, tmp_path, stopped):
    """A finished VM whose container the provider removed (running, or stopped and pruned): before, its record
    held its GPUs for good (every later create on them: gpu_busy), `vm start` failed with command_failed ("No
    such container") and `vm stop` answered ok, so the platform marked it stopped, "start it again", at every
    try. Now start and stop answer not_found (the platform fails the instance), and its GPUs go to the next VM."""
    assert node.create("inst-1", [2])["state"] == "running"
    if stopped:
        assert node.call("vm stop", {"vm_id": "inst-1"})["state"] == "stopped"
    _prune(tmp_path, "gpumarket-inst-1")
    assert node.states() == {"inst-1": "missing"}
    for verb in ("vm start", "vm stop"):
        answer = node.call(verb, {"vm_id": "inst-1"})
        assert not answer["ok"] and answer["error"]["code"] == "not_found", answer
        assert "container is gone" in answer["error"]["message"] and "destroy it" in answer["error"]["message"]
    assert not any(c[0] == "start" for c in node.docker_calls()[-6:])  # no docker start tried
    assert node.create("inst-2", [2])["state"] == "running"  # its GPU is free for the next renter
    assert node.call("vm destroy", {"vm_id": "inst-1"})["existed"] is True  # the record goes
    assert node.states() == {"inst-2": "running"}


def test_a_create_retried_for_a_record_without_its_container_holds_its_gpus_again(node, tmp_path, monkeypatch):
    """A finished record without its container holds nothing; a create retried for it (the same request) holds
    its GPUs through its pull again, as a first create does, and makes the container anew."""
    release = tmp_path / "pull-done"
    release.touch()
    monkeypatch.setenv("FAKE_DOCKER_PULL_WAIT", str(release))
    assert node.create("inst-1", [2], image="ghcr.io/x/slow:1")["state"] == "running"
    _prune(tmp_path, "gpumarket-inst-1")
    release.unlink()
    retry = {}
    thread = threading.Thread(target=lambda: retry.update(node.create("inst-1", [2], image="ghcr.io/x/slow:1")))
    pulls = sum("pull" in c for c in node.docker_calls())
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while sum("pull" in c for c in node.docker_calls()) == pulls and time.monotonic() < deadline:
            time.sleep(0.02)
        second = node.create("inst-2", [2])  # while the retry pulls
        assert not second["ok"] and second["error"]["code"] == "gpu_busy", second
    finally:
        release.touch()
        thread.join(30)
    assert (retry["state"], retry["created"]) == ("running", False), retry
    assert len(node.creates()) == 2  # its container made anew
    assert "provisioning" not in json.loads((tmp_path / "state" / "vms" / "inst-1" / "vm.json").read_text())


@pytest.mark.parametrize("silent", [False, True])
def test_destroy_removes_a_container_of_ours_that_has_no_record(node, tmp_path, monkeypatch, silent):
    """unrecorded() lists such a container so that the reconciler destroys it; `vm destroy` answered existed:
    false without touching it, so it stayed for good (an orphan_destroyed event at every pass). Removed is what
    `docker rm` names on stdout: of no container it prints "No such container" (Docker 20.10 on) or, silent, nothing
    (current CLI, docker/cli#7110), exiting 0 both ways (found by review: silent was taken as removed)."""
    if silent:
        monkeypatch.setenv("FAKE_DOCKER_RM_SILENT", "1")
    (tmp_path / "containers.json").write_text(json.dumps({"gpumarket-inst-41": "running"}))
    assert node.states() == {"inst-41": "running"}
    answer = node.call("vm destroy", {"vm_id": "inst-41"})
    assert (answer["ok"], answer["existed"]) == (True, True), answer
    assert ["rm", "-f", "-v", "gpumarket-inst-41"] in node.docker_calls()
    assert node.states() == {}
    # Nothing left, nothing removed: `docker rm -f` of no container exits 0 since Docker 20.10, printing "No such
    # container", which was taken as removed (existed: true; the reconciler's orphan_destroyed for nothing)
    gone = node.call("vm destroy", {"vm_id": "inst-41"})
    assert (gone["ok"], gone["existed"]) == (True, False), gone
    answer = node.call("vm destroy", {"vm_id": "gpumarket-ghost; rm -rf /"})
    assert answer["error"]["code"] == "invalid_request" and answer["error"]["field"] == "vm_id", answer


@pytest.mark.parametrize("name", ["ghost", "inst-0", "inst-01", "inst-1-old", "inst-" + "9" * 20])
def test_destroy_leaves_an_unrecorded_container_under_a_name_the_platform_never_gives(node, tmp_path, name):
    """Only inst-<instance id> is the platform's: any other gpumarket-* container (one a person made on the node)
    is listed, but `vm destroy` of it removes nothing (found by review: it was removed, volumes and all)."""
    (tmp_path / "containers.json").write_text(json.dumps({"gpumarket-" + name: "running"}))
    assert node.states() == {name: "running"}
    answer = node.call("vm destroy", {"vm_id": name})
    assert (answer["ok"], answer["existed"]) == (True, False), answer
    assert not [c for c in node.docker_calls() if c[0] == "rm"]
    assert node.states() == {name: "running"}


def test_a_failed_create_whose_container_cannot_be_removed_keeps_its_record_for_a_destroy(node, monkeypatch):
    """A create that failed after making its container, whose cleanup `docker rm` failed too: the record was
    deleted all the same, leaving an unrecorded container that `vm destroy` did not remove. The record stays
    (no longer holding GPUs unless the container runs), and the platform's destroy removes both."""
    monkeypatch.setenv("FAKE_DOCKER_FAIL_START", "1")
    monkeypatch.setenv("FAKE_DOCKER_FAIL_RM", "1")
    answer = node.create("inst-1", [2])
    assert not answer["ok"] and answer["error"]["code"] == "command_failed", answer
    assert "device or resource busy" in answer["error"]["message"]  # the create's own error, not the cleanup's
    assert node.states() == {"inst-1": "stopped"}  # recorded, its container made and never started
    status = node.call("vm status", {"vm_id": "inst-1"})
    assert status["state"] == "stopped" and "provisioning" not in status
    assert any("could not remove its VM" in line for line in node.call("vm logs", {"vm_id": "inst-1"})["lines"])
    monkeypatch.delenv("FAKE_DOCKER_FAIL_START")
    assert node.create("inst-2", [2])["state"] == "running"  # a stopped container holds no GPU
    monkeypatch.delenv("FAKE_DOCKER_FAIL_RM")
    assert node.call("vm destroy", {"vm_id": "inst-1"})["existed"] is True
    assert node.states() == {"inst-2": "running"}


def test_a_daemon_that_does_not_answer_is_no_missing_container(node, tmp_path, monkeypatch):
    """Only the engine's own "No such object/container" makes a VM missing; a daemon that cannot be reached (it
    restarts, its socket is gone) is command_failed: the VM's state is unknown, so it is neither gone (not_found to
    the platform, which fails the instance) nor free of its GPUs."""
    assert node.create("inst-1", [2])["state"] == "running"
    monkeypatch.setenv("FAKE_DOCKER_DOWN", str(tmp_path / "docker-down"))
    (tmp_path / "docker-down").touch()
    assert node.call("vm list", {})["error"]["code"] == "command_failed"
    assert node.call("health", {})["vms"] is None
    for verb in ("vm stop", "vm start", "vm status"):
        answer = node.call(verb, {"vm_id": "inst-1"})
        assert answer["error"]["code"] == "command_failed", (verb, answer)
        assert "Cannot connect to the Docker daemon" in answer["error"]["message"]
    from provisioning.agent.gpumarket_agent.allocation import holds_gpus
    from provisioning.agent.gpumarket_agent.records import load_record
    rt = agent.DockerRuntime(agent.Config({"GPUMARKET_RUNTIME": "docker",
                                           "GPUMARKET_STATE_DIR": str(tmp_path / "state")}))
    with pytest.raises(agent.AgentError) as raised:
        holds_gpus(rt, load_record(rt.cfg, "inst-1"))
    assert raised.value.code == "command_failed"
    (tmp_path / "docker-down").unlink()
    assert node.states() == {"inst-1": "running"}


def test_destroy_only_if_missing_removes_the_record_of_a_removed_container_and_nothing_else(node, tmp_path):
    """The platform's `vm destroy` with only_if_missing, for an instance it failed because its VM was gone: the
    record of a container removed on the node counted as mounting its volumes, so the renter's volume delete was
    refused (volume_in_use) until the instance was destroyed (found by review). The record goes; a VM whose
    container is there is left as it is (conflict), and an unrecorded container of that name too."""
    assert node.call("volume create", {"name": "vol-abcdefgh", "size_gb": 5})["created"] is True
    volumes = [{"name": "vol-abcdefgh", "mount": "/data"}]
    assert node.create("inst-1", [2], volumes=volumes)["state"] == "running"
    assert node.create("inst-2", [3])["state"] == "running"
    refused = node.call("vm destroy", {"vm_id": "inst-1", "only_if_missing": True})
    assert refused["error"]["code"] == "conflict" and "running" in refused["error"]["message"], refused
    assert node.states() == {"inst-1": "running", "inst-2": "running"}  # nothing removed
    _prune(tmp_path, "gpumarket-inst-1")
    in_use = node.call("volume delete", {"name": "vol-abcdefgh"})
    assert in_use["error"]["code"] == "volume_in_use", in_use  # the reviewer's case
    rms = len([c for c in node.docker_calls() if c[0] == "rm"])
    answer = node.call("vm destroy", {"vm_id": "inst-1", "only_if_missing": True})
    assert (answer["ok"], answer["existed"]) == (True, True), answer
    assert len([c for c in node.docker_calls() if c[0] == "rm"]) == rms  # no engine command
    assert not (tmp_path / "state" / "vms" / "inst-1").exists()
    assert node.call("volume delete", {"name": "vol-abcdefgh"})["deleted"] is True
    again = node.call("vm destroy", {"vm_id": "inst-1", "only_if_missing": True})
    assert (again["ok"], again["existed"]) == (True, False), again
    (tmp_path / "containers.json").write_text(json.dumps({**json.loads((tmp_path / "containers.json").read_text()),
                                                          "gpumarket-inst-1": "running"}))  # unrecorded
    assert node.call("vm destroy", {"vm_id": "inst-1", "only_if_missing": True})["existed"] is False
    assert node.states() == {"inst-1": "running", "inst-2": "running"}
    for bad in ("yes", 1, None):
        answer = node.call("vm destroy", {"vm_id": "inst-2", "only_if_missing": bad})
        assert answer["error"]["field"] == "only_if_missing", answer
    assert node.call("vm stop", {"vm_id": "inst-2", "only_if_missing": True})["error"]["field"] == "only_if_missing"
