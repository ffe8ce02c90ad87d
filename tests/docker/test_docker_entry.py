"""Images the entry wrapper must keep running on a real engine (found by review): one whose command is a bare shell
(ubuntu's and debian's CMD is bash: without a terminal it exits at once, and the container crash-looped while the
agent answered "running"), and one that runs as a non-root user (USER jovyan: the wrapper could not read its own
box, 0700, and the container crash-looped)."""
import json
import os
import time
from pathlib import Path

import pytest

from tests.docker.test_docker_runtime import AUTH, node, ssh  # noqa: F401 - the fixture
from tests.provisioning.sshkit import new_keypair, run


def derived_image(engine, ref, *changes, folder=None):
    """engine.image with `changes` (Dockerfile lines) and, given `folder` (a local folder), a copy of it in /opt."""
    maker = engine.docker("create", engine.image, check=True).stdout.strip()
    try:
        if folder is not None:
            engine.docker("cp", str(folder), maker + ":/opt/", check=True)
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
    status = node("vm status", {"vm_id": "dk-bash", "probe_ssh": True})
    assert status["state"] == "running" and status["ssh_answers"] is True  # its sshd, on the published port


def test_an_image_with_a_host_key_file_and_an_sshd_that_cannot_start_does_not_answer_ssh(node, tmp_path):  # noqa: F811
    """A renter's image can carry a host key file and no working sshd: the agent reads the key all the same, so the
    key cannot tell whose the silence is (found by review); the node's probe of the published port can."""
    folder = tmp_path / "keyonly"
    folder.mkdir()
    (folder / "sshd").write_text("#!/bin/sh\necho 'sshd: cannot start' >&2\nexit 1\n")
    os.chmod(folder / "sshd", 0o755)  # noqa: S103 - run by the image's user
    (folder / "key.pub").write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeKeyFromTheImage renter@image\n")
    engine = node.engine
    maker = engine.docker("create", engine.image, check=True).stdout.strip()
    try:
        engine.docker("cp", str(folder / "sshd"), maker + ":/usr/sbin/sshd", check=True)
        engine.docker("cp", str(folder / "key.pub"), maker + ":/etc/ssh/ssh_host_ed25519_key.pub", check=True)
        engine.docker("cp", str(folder / "key.pub"), maker + ":/etc/ssh/ssh_host_ed25519_key", check=True)
        image = "gpumarket-test/key-no-sshd:1"
        engine.docker("commit", "--change", 'CMD ["sleep", "infinity"]', maker, image, check=True)
    finally:
        engine.docker("rm", "-f", maker)
    node.env["GPUMARKET_DOCKER_PULL"] = "missing"
    _, public = new_keypair()
    vm = node("vm create", {"vm_id": "dk-keyonly", "gpu_indices": [0], "ssh_public_keys": [public],
                            "image": {"docker": image}})
    assert vm["ssh_host_key"].startswith("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeKey")  # read from the image
    status = node("vm status", {"vm_id": "dk-keyonly", "probe_ssh": True})
    assert status["state"] == "running" and status["ssh_answers"] is False


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


# nvidia/cuda:12.x: ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh"], no CMD, the script ending so.
NVIDIA_ENTRYPOINT = """#!/bin/bash
if [[ $# -eq 0 ]]; then exec "/bin/bash"; else exec "$@"; fi
"""


def nvidia_like(engine, tmp_path):
    folder = tmp_path / "nvidia"
    folder.mkdir()
    (folder / "nvidia_entrypoint.sh").write_text(NVIDIA_ENTRYPOINT)
    os.chmod(folder / "nvidia_entrypoint.sh", 0o755)  # noqa: S103 - the image's entrypoint, run by its user
    return derived_image(engine, "gpumarket-test/nvidia-entry:1", 'ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh"]',
                         "CMD []", folder=folder)


@pytest.mark.parametrize("kind", ["nvidia-entrypoint", "shell-form CMD bash", "bash -l"])
def test_an_image_whose_command_ends_in_a_bare_shell_keeps_running_and_stops_at_once(node, tmp_path, kind):  # noqa: F811
    """Found by the second review: only a command that was exactly one bare shell was kept from crash-looping;
    nvidia/cuda's entrypoint (it execs bash when given no CMD), shell-form `CMD bash` (["/bin/sh", "-c", "bash"])
    and ["bash", "-l"] exited at once and `--restart unless-stopped` ran them again forever."""
    engine = node.engine
    image = {"nvidia-entrypoint": lambda: nvidia_like(engine, tmp_path),
             "shell-form CMD bash": lambda: derived_image(engine, "gpumarket-test/sh-c-bash:1", "CMD bash"),
             "bash -l": lambda: derived_image(engine, "gpumarket-test/bash-l:1", 'CMD ["bash", "-l"]')}[kind]()
    node.env["GPUMARKET_DOCKER_PULL"] = "missing"
    _, public = new_keypair()
    vm = node("vm create", {"vm_id": "dk-shell", "gpu_indices": [0], "ssh_public_keys": [public],
                            "image": {"docker": image}})
    state = settled(engine, "dk-shell")
    assert (state["Status"], state["RestartCount"]) == ("running", 0), state
    assert vm["ssh_host_key"].startswith("ssh-ed25519 ")
    assert node("vm status", {"vm_id": "dk-shell"})["state"] == "running"
    logs = engine.docker("logs", "gpumarket-dk-shell", check=True)
    assert "[gpumarket] the image's command exited 0; the instance stays up for SSH" in logs.stdout + logs.stderr
    started = time.monotonic()
    assert node("vm stop", {"vm_id": "dk-shell"})["state"] == "stopped"
    assert time.monotonic() - started < 10  # the wrapper ends at the TERM, not at docker stop's kill after 20 s


def test_the_command_of_a_renters_own_image_gets_the_env_and_a_catalogue_images_does_not(node):  # noqa: F811
    """A renter's own image reads its settings from the env (vLLM's MODEL_ID, HF_TOKEN, JUPYTER_TOKEN, as `docker run
    -e` gives them): after 741bc7c no image's command got it (found by review). The platform's "image_env" says which
    image is the renter's own; its command gets the env, every value as given, and a catalogue image's does not."""
    tricky = "it's $HOME \"q\" `id` $(id) #x"
    image = derived_image(node.engine, "gpumarket-test/reads-env:1", 'CMD ["/bin/sh", "-c", '
                          '"printf \'%s|%s\\\\n\' \\"${MODEL_ID-unset}\\" \\"${TRICKY-unset}\\" > /tmp/cmd-env; '
                          'exec sleep infinity"]')
    node.env["GPUMARKET_DOCKER_PULL"] = "missing"
    # A renter's own image is pulled even so (its registry decides who may read it): it comes from the registry.
    own = node.engine.registry.push(node.engine, image, "team/reads-env:1")
    _, public = new_keypair()
    env = {"MODEL_ID": "meta-llama/Llama-3.1-8B", "TRICKY": tricky}
    for vm_id, gpu, ref, options, expected in (
            ("dk-own", 0, own, {"image_env": True, "registry_auth": AUTH}, f"meta-llama/Llama-3.1-8B|{tricky}\n"),
            ("dk-catalogue", 1, image, {}, "unset|unset\n")):
        node("vm create", {"vm_id": vm_id, "gpu_indices": [gpu], "ssh_public_keys": [public],
                           "image": {"docker": ref}, "env": env, **options})
        deadline = time.monotonic() + 15
        while True:
            got = node.engine.docker("exec", "gpumarket-" + vm_id, "cat", "/tmp/cmd-env")
            if got.returncode == 0 and got.stdout or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert got.stdout == expected, (vm_id, got)
        state = container(node.engine, vm_id)
        assert (state["Status"], state["RestartCount"]) == ("running", 0), state


IMAGES = Path(__file__).resolve().parents[2] / "provisioning" / "images"


def catalogue_like(engine):
    """engine.image made as provisioning/images/Dockerfile makes a catalogue image (its entrypoint.sh as the
    command, its sshd_config), without the network: no apt-get (the test image has OpenSSH) and no tini."""
    ref = "gpumarket-test/catalogue-like:1"
    maker = engine.docker("create", engine.image, check=True).stdout.strip()
    try:
        engine.docker("cp", str(IMAGES / "sshd_config"), maker + ":/etc/ssh/sshd_config.d/00-gpumarket.conf",
                      check=True)
        engine.docker("cp", str(IMAGES / "entrypoint.sh"), maker + ":/usr/local/sbin/gpumarket-entrypoint", check=True)
        engine.docker("commit", "--change", "ENV CUDA_VERSION=12.4.1", "--change",
                      'ENTRYPOINT ["/usr/local/sbin/gpumarket-entrypoint"]', "--change", "CMD []", maker, ref,
                      check=True)
    finally:
        engine.docker("rm", "-f", maker)
    return ref


def test_a_catalogue_image_under_the_wrapper_keeps_the_renters_env_for_ssh_and_its_command_runs_on(node):  # noqa: F811
    """The catalogue image's entrypoint.sh runs after the wrapper: it truncated /etc/environment, wiping the renter's
    env the wrapper had put there for every SSH session (pam_env), and its `sshd -D -e` found port 22 taken by the
    wrapper's sshd and exited 1 (found by review). Now it keeps the wrapper's lines and waits."""
    engine = node.engine
    image = catalogue_like(engine)
    node.env["GPUMARKET_DOCKER_PULL"] = "missing"
    renter, public = new_keypair()
    vm = node("vm create", {"vm_id": "dk-cat", "gpu_indices": [0], "ssh_public_keys": [public],
                            "image": {"docker": image}, "env": {"API_KEY": "sk-cat-1"}})
    deadline = time.monotonic() + 30
    while True:  # the entrypoint has written its lines (after the wrapper's start)
        environment = engine.docker("exec", "gpumarket-dk-cat", "cat", "/etc/environment").stdout
        if "CUDA_VERSION" in environment or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert 'CUDA_VERSION="12.4.1"' in environment and "API_KEY=sk-cat-1" in environment, environment
    with ssh(vm, renter) as client:
        status, out, _ = run(client, "env")  # not a login shell: pam_env's /etc/environment only
        env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        assert status == 0 and env["API_KEY"] == "sk-cat-1" and env["CUDA_VERSION"] == "12.4.1", out
    state = container(engine, "dk-cat")
    assert (state["Status"], state["RestartCount"]) == ("running", 0), state
    logs = engine.docker("logs", "gpumarket-dk-cat", check=True)
    assert "the image's command exited" not in logs.stdout + logs.stderr, logs
    top = engine.docker("top", "gpumarket-dk-cat", check=True).stdout
    assert "sleep infinity" in top and "sshd -D" not in top, top
