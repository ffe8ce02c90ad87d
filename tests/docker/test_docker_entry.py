"""Images the entry wrapper must keep running on a real engine (found by review): one whose command is a bare shell
(ubuntu's and debian's CMD is bash: without a terminal it exits at once, and the container crash-looped while the
agent answered "running"), and one that runs as a non-root user (USER jovyan: the wrapper could not read its own
box, 0700, and the container crash-looped)."""
import json
import time

from tests.docker.test_docker_runtime import node  # noqa: F401 - the fixture
from tests.provisioning.sshkit import new_keypair


def derived_image(engine, ref, *changes):
    maker = engine.docker("create", engine.image, check=True).stdout.strip()
    try:
        argv = ["commit"]
        for change in changes:
            argv += ["--change", change]
        engine.docker(*argv, maker, ref, check=True)
    finally:
        engine.docker("rm", "-f", maker)
    return ref


def container(engine, vm_id):
    info = json.loads(engine.docker("inspect", "gpumarket-" + vm_id, check=True).stdout)[0]
    return {**info["State"], "RestartCount": info["RestartCount"]}


def settled(engine, vm_id, seconds=3.0):
    """The container's state after `seconds`: a command that exits at once has restarted by then."""
    time.sleep(seconds)
    return container(engine, vm_id)


def test_an_image_whose_command_is_bash_keeps_running_with_sshd(node):  # noqa: F811
    image = derived_image(node.engine, "gpumarket-test/bash-cmd:1", 'CMD ["/bin/bash"]')
    node.env["GPUMARKET_DOCKER_PULL"] = "missing"
    _, public = new_keypair()
    vm = node("vm create", {"vm_id": "dk-bash", "gpu_indices": [0], "ssh_public_keys": [public],
                            "image": {"docker": image}})
    state = settled(node.engine, "dk-bash")
    assert (state["Status"], state["RestartCount"]) == ("running", 0), state
    assert vm["ssh_host_key"].startswith("ssh-ed25519 ")  # the wrapper's sshd, up and staying up
    assert node("vm status", {"vm_id": "dk-bash"})["state"] == "running"


def test_an_image_with_a_non_root_user_runs_the_wrapper_and_onstart(node):  # noqa: F811
    image = derived_image(node.engine, "gpumarket-test/non-root:1", "USER nobody", "ENV HOME=/tmp",
                          'CMD ["sleep", "infinity"]')
    node.env["GPUMARKET_DOCKER_PULL"] = "missing"
    _, public = new_keypair()
    node("vm create", {"vm_id": "dk-user", "gpu_indices": [0], "ssh_public_keys": [public],
                       "image": {"docker": image}, "env": {"API_KEY": "renter-secret"},
                       "onstart": 'echo "$(id -un) $API_KEY" > /tmp/onstart-ran'})
    state = settled(node.engine, "dk-user")
    assert (state["Status"], state["RestartCount"]) == ("running", 0), state
    ran = node.engine.docker("exec", "gpumarket-dk-user", "cat", "/tmp/onstart-ran")
    assert ran.stdout == "nobody renter-secret\n", ran
    assert node("vm status", {"vm_id": "dk-user"})["state"] == "running"
