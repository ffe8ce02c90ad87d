"""A container whose image's command exits at once, or whose image runs as a non-root user (found by review): the
entry wrapper keeps it running, the box is readable by the image's user, and a crash-looping container is not
answered "running" (stand-in docker CLI of test_agent_docker.py; tests/docker/test_docker_entry.py: a real engine)."""
import json
import os
import stat

import pytest

from provisioning.agent import gpumarket_agent as agent
from provisioning.agent.gpumarket_agent.runtimes import docker as docker_runtime
from provisioning.agent.gpumarket_agent.runtimes.dockerbox import container_command
from tests.provisioning.test_agent_docker import node  # noqa: F401 - the fixture


@pytest.mark.parametrize("command", [["/bin/bash"], ["bash"], ["sh"], ["/bin/sh"], ["/usr/bin/dash"], []])
def test_a_bare_shell_is_no_command_for_the_wrapper(command):
    assert container_command(command) == []


@pytest.mark.parametrize("command", [["bash", "-c", "serve"], ["/usr/sbin/sshd", "-D"], ["python3"],
                                     ["/opt/conda/bin/jupyter", "lab"], ["bashful"]])
def test_any_other_command_is_the_wrappers_to_exec(command):
    assert container_command(command) == command


def test_an_image_whose_command_is_bash_gets_a_container_kept_running_without_it(node, monkeypatch):  # noqa: F811
    monkeypatch.setattr(docker_runtime, "image_command", lambda image: ["/bin/bash"])
    vm = node.create("inst-1", [0], image="ubuntu:22.04")
    assert vm["ok"] and vm["state"] == "running", vm
    (create,) = node.creates()
    assert create[-2:] == ["ubuntu:22.04", "/.gpumarket/entry.sh"]  # the wrapper's own loop, not bash's EOF


def test_the_box_is_readable_by_the_images_user_and_the_vm_folder_by_nobody_else(node):  # noqa: F811
    assert node.create("inst-2", [0], env={"API_KEY": "secret"}, onstart="echo hi")["ok"]
    (create,) = node.creates()
    (box,) = [a.split(":")[0] for a in create if a.endswith(":/.gpumarket:ro")]  # -v <vm dir>/box:/.gpumarket:ro
    vmdir = os.path.dirname(box)

    def mode(path):
        return stat.S_IMODE(os.stat(path).st_mode)

    assert mode(vmdir) == 0o700  # the env in the box: no other user of the host reaches it
    assert mode(box) == 0o755
    assert {name: mode(os.path.join(box, name)) for name in os.listdir(box)} == {
        "entry.sh": 0o755, "profile.sh": 0o644, "environment": 0o644, "onstart.sh": 0o644}


def set_status(tmp_path, name, status):
    path = tmp_path / "containers.json"
    state = json.loads(path.read_text())
    state[name] = status
    path.write_text(json.dumps(state))


def test_a_restarting_container_is_not_running_holds_its_gpus_and_is_stopped_by_a_stop(node, tmp_path):  # noqa: F811
    assert node.create("inst-3", [1], image="ghcr.io/x/app:1")["ok"]
    set_status(tmp_path, "gpumarket-inst-3", "restarting")  # its command exited; the engine runs it again
    assert node.states() == {"inst-3": "restarting"}
    assert node.call("vm status", {"vm_id": "inst-3"})["state"] == "restarting"
    busy = node.create("inst-4", [1])  # the engine starts it again on GPU 1, again and again
    assert busy["error"]["code"] == "gpu_busy", busy
    assert node.call("vm stop", {"vm_id": "inst-3"})["state"] == "stopped"
    assert ["stop", "--time", "20", "gpumarket-inst-3"] in node.docker_calls()


def test_docker_state_restarting_is_no_running_vm():
    assert agent.docker_state("restarting") not in ("running", "stopped", "missing")
