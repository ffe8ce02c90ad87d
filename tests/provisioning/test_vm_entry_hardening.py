"""The entry wrapper of a docker VM runs its own steps in the platform's environment (found by review).

Before, the renter's env was the container's environment, so the wrapper's own: with PATH=/nowhere it found neither
ssh-keygen nor ls, made no host key, and sshd could not start. The platform had to judge a catalogue image's silent
SSH server with any env as the renter's doing, and a node's own fault went uncounted. Now the env reaches onstart
(exported from the box's renter.env, each value as it is) and SSH sessions only, and the image's command runs in the
image's own environment. (Volumes: test_vm_entry_hardening_mounts.py.)

Here the wrapper that the agent put in the box runs on this host's /bin/sh, as the container would run it: its
environment is what the `docker create` argv gives it (the image's, then --env-file and -e), /etc is a folder of the
test's, the host key is made by the host's ssh-keygen, and sshd is the host's OpenSSH on a loopback port."""
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from marketplace.models import Instance
from provisioning.agent.gpumarket_agent.runtimes import docker as docker_runtime
from provisioning.agent.gpumarket_agent.validation import validate_create
from provisioning.services.vms import create_request
from tests.factories import make_listed_node
from tests.marketplace.test_instance_options import body, post
from tests.provisioning.test_agent_docker import node  # noqa: F401 - the fixture
from tests.provisioning.test_agent_docker_entry import docker_stop

SSHD, KEYGEN = "/usr/sbin/sshd", "/usr/bin/ssh-keygen"
PLATFORM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
IMAGE_PATH = "/opt/image/bin:" + PLATFORM_PATH  # an image's own ENV PATH (conda, CUDA)
TRICKY = "it's $HOME \"q\" `id` $(id) \\n #x"
RENTER_ENV = {"PATH": "/nowhere", "API_KEY": "sk-1", "TRICKY": TRICKY, "HOME": "/nowhere-home"}
ONSTART = 'echo "onstart PATH=$PATH API_KEY=$API_KEY HOME=$HOME"\nprintf "%s\\n" "TRICKY=$TRICKY"\n'
COMMAND = ["/bin/sh", "-c", 'echo "command PATH=$PATH API_KEY=${API_KEY-unset}"']

needs_openssh = pytest.mark.skipif(not (os.access(SSHD, os.X_OK) and os.access(KEYGEN, os.X_OK)
                                        and os.path.isdir("/run/sshd")),
                                   reason="needs OpenSSH's sshd and ssh-keygen (and /run/sshd) on this host")


def created(node, monkeypatch, command=tuple(COMMAND), **options):  # noqa: F811
    """Create a VM on the stand-in docker node; answer the `docker create` argv and its --env-file's text as the
    engine read it (the agent deletes that file after the create)."""
    env_files = []
    real_run = docker_runtime.run

    def snooping(argv, *args, **kwargs):
        if argv[:2] == ["docker", "create"]:
            if "--env-file" in argv:
                with open(argv[argv.index("--env-file") + 1]) as f:
                    env_files.append(f.read())
            else:
                env_files.append(None)
        return real_run(argv, *args, **kwargs)

    monkeypatch.setattr(docker_runtime, "run", snooping)
    monkeypatch.setattr(docker_runtime, "image_command", lambda image: list(command))
    vm = node.create("inst-1", [0], **options)
    assert vm["ok"], vm
    (argv,) = node.creates()  # as the stand-in docker logged it: without "docker"
    (env_file_text,) = env_files
    return argv, env_file_text


def container_environment(argv, env_file_text, home):
    """The environment docker gives the container's first process: the image's ENV, then --env-file, then -e."""
    env = {"PATH": IMAGE_PATH, "HOME": home, "HOSTNAME": "inst-1"}
    for line in (env_file_text or "").splitlines():
        name, _, value = line.partition("=")
        env[name] = value
    for flag, value in zip(argv, argv[1:]):  # noqa: B905 - python3.8 style as the agent's tests
        if flag == "-e":
            name, _, value = value.partition("=")
            env[name] = value
    return env


def wrapper_as_the_container_runs_it(argv, tmp_path, fake_sshd):
    """The box's entry.sh with /etc and the wrapper's state in tmp_path and `fake_sshd` its only sshd."""
    (box,) = [a[:-len(":/.gpumarket:ro")] for a in argv if a.endswith(":/.gpumarket:ro")]
    with open(os.path.join(box, "entry.sh")) as f:
        script = f.read()
    for old, new in [("G=/.gpumarket\n", f"G={box}\n"), ("S=/.gpumarket-state\n", f"S={tmp_path}/state\n"),
                     ("/etc", f"{tmp_path}/etc"),
                     ("for candidate in /usr/sbin/sshd /usr/local/sbin/sshd; do", f"for candidate in {fake_sshd}; do")]:
        assert old in script, old
        script = script.replace(old, new)
    (tmp_path / "etc" / "ssh").mkdir(parents=True, exist_ok=True)  # an image's /etc/ssh, without host keys
    entry = tmp_path / "entry.sh"
    entry.write_text(script)
    return str(entry)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def banner(port, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
                return sock.recv(64)
        except OSError:
            if time.monotonic() > deadline:
                return b""
            time.sleep(0.1)


def wait_for(path, *texts, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if all(t in text for t in texts):
            return text
        time.sleep(0.1)
    return path.read_text() if path.exists() else ""


@needs_openssh
def test_a_vm_whose_renter_env_sets_path_nowhere_still_gets_its_host_key_and_sshd(node, tmp_path,  # noqa: F811
                                                                                  monkeypatch):
    argv, env_file_text = created(node, monkeypatch, env=RENTER_ENV, onstart=ONSTART)
    port = free_port()
    config = tmp_path / "sshd_config"
    config.write_text(f"Port {port}\nListenAddress 127.0.0.1\nHostKey {tmp_path}/etc/ssh/ssh_host_ed25519_key\n"
                      f"PidFile {tmp_path}/sshd.pid\nUsePAM no\nPasswordAuthentication no\n")
    fake_sshd = tmp_path / "sshd"  # the host's sshd on a port of the test's, telling the environment it got
    fake_sshd.write_text(f'#!/bin/sh\necho "sshd PATH=$PATH API_KEY=${{API_KEY-unset}}" > {tmp_path}/sshd.env\n'
                         f'exec {SSHD} "$@" -f {config}\n')
    fake_sshd.chmod(0o755)
    entry = wrapper_as_the_container_runs_it(argv, tmp_path, fake_sshd)
    (tmp_path / "home").mkdir()
    env = container_environment(argv, env_file_text, str(tmp_path / "home"))
    out = tmp_path / "out.log"
    with open(out, "w") as log:
        proc = subprocess.Popen(["/bin/sh", entry, *COMMAND], env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        text = wait_for(out, "[gpumarket] onstart: exited", "the image's command exited")
        assert "[gpumarket] sshd started\n" in text, text
        assert banner(port).startswith(b"SSH-2.0-OpenSSH"), text  # the VM's SSH answers
        assert (tmp_path / "etc" / "ssh" / "ssh_host_ed25519_key.pub").read_text().startswith("ssh-ed25519 ")
        # sshd ran in the platform's environment, never the renter's
        assert (tmp_path / "sshd.env").read_text() == f"sshd PATH={PLATFORM_PATH} API_KEY=unset\n"
        # onstart got the renter's env, every value as given (none read as shell code)
        assert "onstart PATH=/nowhere API_KEY=sk-1 HOME=/nowhere-home\n" in text, text
        assert f"TRICKY={TRICKY}\n" in text, text
        # the image's command, the image's environment
        assert f"command PATH={IMAGE_PATH} API_KEY=unset\n" in text, text
        # and SSH sessions still get the env (pam_env for every session, /etc/profile.d for login shells)
        assert "API_KEY=sk-1\n" in (tmp_path / "etc" / "environment").read_text()
        login = subprocess.run(["/bin/sh", "-c", f'. {tmp_path}/etc/profile.d/gpumarket-env.sh && '
                                                 'printf "%s|%s" "$API_KEY" "$TRICKY"'],
                               capture_output=True, text=True, env={"PATH": PLATFORM_PATH}, check=True)
        assert login.stdout == f"sk-1|{TRICKY}"
    finally:
        if proc.poll() is None:
            docker_stop(proc)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        pid_file = tmp_path / "sshd.pid"
        if pid_file.exists():  # the sshd this test started (it daemonised: a session of its own)
            os.kill(int(pid_file.read_text()), signal.SIGTERM)


def test_the_renters_env_is_in_the_box_only_never_the_containers_environment(node, monkeypatch):  # noqa: F811
    argv, env_file_text = created(node, monkeypatch, env=RENTER_ENV, onstart=ONSTART)
    assert "--env-file" not in argv and env_file_text is None
    env = container_environment(argv, env_file_text, "/root")
    assert not (set(RENTER_ENV) - {"PATH", "HOME"}) & set(env) and env["PATH"] == IMAGE_PATH
    for call in node.docker_calls():  # no value of theirs on any command line of the node
        assert not any(value in arg for value in ("sk-1", TRICKY, "/nowhere") for arg in call), call
    (box,) = [a[:-len(":/.gpumarket:ro")] for a in argv if a.endswith(":/.gpumarket:ro")]
    with open(os.path.join(box, "renter.env")) as f:
        assert f.read() == "".join(f"{k}={RENTER_ENV[k]}\n" for k in sorted(RENTER_ENV))


# ------------------------------------------------------------- the renter's own image: its command gets the env
#
# A renter's own image (the renter named a docker image) reads its settings from the env (a vLLM, TGI or Jupyter image
# reading MODEL_ID, HF_TOKEN, JUPYTER_TOKEN, as `docker run -e` gives them on other GPU clouds); after 741bc7c no
# image's command got it (found by review). The platform says which image is the renter's ("image_env": true in the
# create request), the agent marks the box, and the wrapper exports renter.env (each line as it is) in the command's
# subshell for that image only; a catalogue image's command (the platform's bash entrypoint) still runs without it.

OWN_COMMAND = ["/bin/sh", "-c", 'echo "command PATH=$PATH API_KEY=${API_KEY-unset}"; printf "%s\\n" "cmd=${TRICKY-}"']


@pytest.mark.parametrize("image_env", [True, False, None])
def test_the_command_of_a_renters_own_image_gets_the_env_and_a_catalogue_images_does_not(node, tmp_path,  # noqa: F811
                                                                                       monkeypatch, image_env):
    options = {} if image_env is None else {"image_env": image_env}
    argv, env_file_text = created(node, monkeypatch, command=OWN_COMMAND, env=RENTER_ENV, **options)
    assert argv[-len(OWN_COMMAND):] == OWN_COMMAND
    fake_sshd = tmp_path / "sshd"  # no SSH here: this test looks at the command's environment only
    fake_sshd.write_text("#!/bin/sh\nexit 0\n")
    fake_sshd.chmod(0o755)
    entry = wrapper_as_the_container_runs_it(argv, tmp_path, fake_sshd)
    (tmp_path / "home").mkdir()
    env = container_environment(argv, env_file_text, str(tmp_path / "home"))
    out = tmp_path / "out.log"
    with open(out, "w") as log:
        proc = subprocess.Popen(["/bin/sh", entry, *OWN_COMMAND], env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        text = wait_for(out, "the image's command exited")
    finally:
        if proc.poll() is None:
            docker_stop(proc)
            proc.wait(timeout=10)
    assert "the image's command exited 0" in text, text
    if image_env:  # every value as given, none read as shell code ($(id), backquotes, quotes stay text)
        assert "command PATH=/nowhere API_KEY=sk-1\n" in text and f"cmd={TRICKY}\n" in text, text
    else:
        assert f"command PATH={IMAGE_PATH} API_KEY=unset\n" in text and "cmd=\n" in text, text
    # SSH sessions get the env either way
    assert "API_KEY=sk-1\n" in (tmp_path / "etc" / "environment").read_text()


def test_image_env_is_a_boolean_recorded_only_when_true(node):  # noqa: F811
    for bad in ("true", 1, 0, None, [], {}):
        answer = node.create("inst-1", [0], env={"A": "1"}, image_env=bad)
        assert not answer["ok"] and answer["error"]["code"] == "invalid_request", answer
        assert answer["error"]["field"] == "image_env", answer
    assert node.creates() == []  # nothing made for a refused request
    box = None
    for n, image_env in enumerate((True, False)):
        assert node.create(f"inst-{n + 1}", [n], image_env=image_env)["ok"]
        argv = node.creates()[-1]
        (box,) = [a[:-len(":/.gpumarket:ro")] for a in argv if a.endswith(":/.gpumarket:ro")]
        assert os.path.exists(os.path.join(box, "image-env")) is image_env
    # a create retried with the same word is the same VM; with the other, a different spec
    assert node.create("inst-1", [0], image_env=True)["ok"]
    retried = node.create("inst-1", [0])
    assert not retried["ok"] and retried["error"]["code"] == "conflict", retried


@pytest.mark.django_db
def test_the_platform_says_image_env_for_the_renters_own_image_only(api):
    listed = make_listed_node(gpu_count=4)
    own = post(api, body(listed, image="ghcr.io/org/vllm:1", env={"MODEL_ID": "m"}))
    catalogue = post(api, body(listed, env={"MODEL_ID": "m"}))
    assert own.status_code == catalogue.status_code == 201, (own.content, catalogue.content)
    own_request = create_request(Instance.objects.get(pk=own.json()["id"]))
    catalogue_request = create_request(Instance.objects.get(pk=catalogue.json()["id"]))
    assert own_request["image_env"] is True and "image_env" not in catalogue_request
    # what the node's agent accepts, recorded as such (a JSON boolean, checked there)
    for request, recorded in ((own_request, True), (catalogue_request, None)):
        request = json.loads(json.dumps(request))
        _, spec = validate_create({k: v for k, v in request.items() if k != "registry_auth"}, "docker", [0, 1, 2, 3])
        assert spec.get("image_env") is recorded


# ------------------------------------------------------------- the catalogue image's command under the wrapper
#
# provisioning/images/entrypoint.sh, the catalogue images' command, runs after the wrapper (as its child). It
# truncated /etc/environment and wrote the image's variables only, wiping the renter's env lines the wrapper had just
# put there for pam_env (every non-login SSH session), and then ran `sshd -D -e` on port 22, which the wrapper's sshd
# held: it exited 1 (found by review). Under the wrapper (/.gpumarket there) it now keeps the wrapper's lines after
# the image's and waits instead; run without it (a plain `docker run` of the image) it does as before.

ENTRYPOINT = os.path.join(os.path.dirname(__file__), "..", "..", "provisioning", "images", "entrypoint.sh")
IMAGE_ENV = {"PATH": IMAGE_PATH, "CUDA_VERSION": "12.4.1", "LANG": "C.UTF-8", "HOME": "/root", "OTHER": "not-kept"}
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="entrypoint.sh installs root-owned files (run as root)")


def entrypoint_in(tmp_path, box="/nonexistent-box"):
    """entrypoint.sh with its root in tmp_path (/etc, /run, the mounted keys), the wrapper's box at `box` and a
    stand-in /usr/sbin/sshd that says it ran and exits 1, as one on a port already taken does."""
    with open(ENTRYPOINT) as f:
        script = f.read()
    (tmp_path / "etc" / "ssh").mkdir(parents=True, exist_ok=True)
    (tmp_path / "etc" / "profile.d").mkdir(exist_ok=True)
    (tmp_path / "keys").write_text("ssh-ed25519 AAAA renter\n")
    fake = tmp_path / "image-sshd"
    fake.write_text(f'#!/bin/sh\necho "image sshd $*" >> {tmp_path}/image-sshd.log\nexit 1\n')
    fake.chmod(0o755)
    for old, new in [("/root/.ssh/authorized_keys", f"{tmp_path}/keys"), ("/etc/", f"{tmp_path}/etc/"),
                     ("ssh-keygen -A", f"ssh-keygen -A -f {tmp_path}"), ("/run/sshd", f"{tmp_path}/run/sshd"),
                     ("/usr/sbin/sshd", str(fake))]:
        assert old in script, old
        script = script.replace(old, new)
    script = script.replace("/.gpumarket", box)
    path = tmp_path / "gpumarket-entrypoint"
    path.write_text(script)
    path.chmod(0o755)
    return str(path)


@needs_root
@needs_openssh
def test_the_catalogue_entrypoint_under_the_wrapper_keeps_the_renters_env_and_starts_no_second_sshd(
        node, tmp_path, monkeypatch):  # noqa: F811
    entrypoint = str(tmp_path / "gpumarket-entrypoint")
    argv, env_file_text = created(node, monkeypatch, command=[entrypoint], env=RENTER_ENV, onstart="true\n")
    (box,) = [a[:-len(":/.gpumarket:ro")] for a in argv if a.endswith(":/.gpumarket:ro")]
    assert entrypoint_in(tmp_path, box) == entrypoint
    (tmp_path / "etc" / "environment").write_text('PATH="/usr/local/sbin:/usr/bin"\n')  # the image's own file
    wrapper_sshd = tmp_path / "wrapper-sshd"  # the wrapper's sshd, started (daemonised) before the command runs
    wrapper_sshd.write_text(f"#!/bin/sh\necho started >> {tmp_path}/wrapper-sshd.log\nexit 0\n")
    wrapper_sshd.chmod(0o755)
    entry = wrapper_as_the_container_runs_it(argv, tmp_path, wrapper_sshd)
    env = {**container_environment(argv, env_file_text, "/root"), **IMAGE_ENV}
    out = tmp_path / "out.log"
    with open(out, "w") as log:
        proc = subprocess.Popen(["/bin/sh", entry, entrypoint], env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        environment = tmp_path / "etc" / "environment"
        wait_for(environment, 'CUDA_VERSION="12.4.1"\n')
        wait_for(out, "the image's command exited", timeout=3.0)  # it must not: it waits
        text = out.read_text()
        assert "[gpumarket] sshd started" in text and "the image's command exited" not in text, text
        assert proc.poll() is None
    finally:
        docker_stop(proc)
        proc.wait(timeout=10)
    assert not (tmp_path / "image-sshd.log").exists()  # no second sshd (port 22 is the wrapper's)
    lines = environment.read_text().splitlines()
    # the image's variables, then the renter's env as the wrapper wrote it (pam_env: a name's last line wins)
    assert lines[:3] == ['CUDA_VERSION="12.4.1"', 'LANG="C.UTF-8"', f'PATH="{IMAGE_PATH}"'], lines
    assert lines[3:] == ["API_KEY=sk-1", "HOME=/nowhere-home", "PATH=/nowhere"], lines  # (TRICKY: not pam-safe)
    assert lines[3:] == (Path(box) / "environment").read_text().splitlines()
    assert "API_KEY=sk-1" in (tmp_path / "etc" / "profile.d" / "gpumarket-env.sh").read_text()
    own = (tmp_path / "etc" / "profile.d" / "00-gpumarket-env.sh").read_text()
    assert "export CUDA_VERSION=12.4.1\n" in own and "API_KEY" not in own and "OTHER" not in own


@needs_root
def test_the_catalogue_entrypoint_without_the_wrapper_starts_its_sshd_as_before(tmp_path):
    entrypoint = entrypoint_in(tmp_path)  # no /.gpumarket: a plain `docker run` of the image
    (tmp_path / "etc" / "environment").write_text("OLD=1\n")
    proc = subprocess.run(["/bin/bash", entrypoint], env=IMAGE_ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc  # the stand-in sshd's exit, the script's own (exec)
    assert (tmp_path / "image-sshd.log").read_text() == "image sshd -D -e\n"
    assert (tmp_path / "etc" / "environment").read_text() == \
        f'CUDA_VERSION="12.4.1"\nLANG="C.UTF-8"\nPATH="{IMAGE_PATH}"\n'
    assert (tmp_path / "etc" / "ssh" / "gpumarket" / "authorized_keys").read_text() == "ssh-ed25519 AAAA renter\n"
