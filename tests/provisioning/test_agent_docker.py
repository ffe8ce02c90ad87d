"""The exact docker commands the agent runs for the `docker` runtime."""
import json
import os
from pathlib import Path

from provisioning.agent import gpumarket_agent as agent
from tests.provisioning.sshkit import new_keypair

SAMPLES = Path(__file__).parent / "fixtures" / "nvidia_smi"


def test_create_argv_for_two_gpus():
    argv = agent.docker_run_argv(
        "inst-42", [0, 1], "nvidia/cuda:12.2.0-base-ubuntu22.04", 40007, "/root/.gpumarket/vms/inst-42/authorized_keys"
    )
    assert argv == [
        "docker", "create",
        "--name", "gpumarket-inst-42",
        "--hostname", "inst-42",
        "--label", "gpumarket.vm_id=inst-42",
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
        box="/s/vms/a", env_path="/s/vms/a/env.list", command=["/usr/sbin/sshd", "-D"])
    assert argv[argv.index("--hostname") + 2:] == [
        "--label", "gpumarket.vm_id=a",
        "--device", "/dev/test-gpu2:/dev/nvidia2", "--device", "/dev/test-gpu5:/dev/nvidia5",
        "-p", "127.0.0.1:40000:22", "-p", "127.0.0.1:40002:6006", "-p", "127.0.0.1:40001:8888",
        "-v", "/s/vms/a/authorized_keys:/root/.ssh/authorized_keys:ro",
        "-v", "/s/vms/a/box:/.gpumarket:ro", "-v", "/s/vms/a/state:/.gpumarket-state",
        "--init", "--entrypoint", "/bin/sh",
        "--mount", "type=volume,src=vol-abcdefgh,dst=/data",
        "--mount", 'type=volume,src=vol-ijklmnop,"dst=/a,b ""c"""',  # CSV, as docker's --mount parser reads it
        "--env-file", "/s/vms/a/env.list",
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
    assert agent.docker_verb_argv("rm", "inst-42") == ["docker", "rm", "-f", "gpumarket-inst-42"]
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
        "running", "running", "stopped", "stopped", "stopped", "stopped"
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
    sys.stderr.write("Error response from daemon: No such container: %s\n" % name)
    sys.exit(1)
verb, name = args[0], args[-1]
if verb == "info":
    print("24.0.7")
elif verb == "ps":
    for n, status in sorted(state.items()):
        print("%s\t%s" % (n[len("gpumarket-"):], status))
elif verb == "--config":
    assert os.stat(args[1]).st_mode & 0o777 == 0o700
    print("Status: Downloaded newer image for " + args[-1])
elif verb == "image":
    print(json.dumps({"Cmd": ["/usr/sbin/sshd", "-D"]}))
elif verb == "create":
    state[args[args.index("--name") + 1]] = "created"
elif verb == "exec":
    print("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHostKeyOfTheContainerXXXXXXXXXXXXXXXXXXX")
elif verb == "cp":
    sys.exit(1)
elif name not in state:
    missing(name)
elif verb == "inspect":
    print(state[name])
elif verb == "start":
    state[name] = "running"
elif verb == "stop":
    state[name] = "exited"
elif verb == "rm":
    del state[name]
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
    assert ["rm", "-f", "gpumarket-inst-7"] in docker_calls()
    assert not keys_file.parent.exists()
    assert call("vm destroy", {"vm_id": "inst-7"})["existed"] is False
    health = call("health", {})
    assert (health["runtime_ok"], health["runtime_detail"], health["gpu_count"]) == (True, "24.0.7", 4)
