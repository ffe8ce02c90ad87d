"""What the agent passes on from a renter's image, container or registry (found by review).

The platform refuses any agent answer that holds a NUL or an unpaired surrogate (core/untrusted_json.py) and
counts the refusal against the node. Some answer fields hold text the renter controls: the image's
/etc/os-release (`os`), the image's host key file (`ssh_host_key`), the container's log lines and the agent's own
log (`vm logs`), the registry's error as `docker pull` prints it (`error.message` of pull_failed). One NUL there
failed a renter's own booking as the node's fault (free, on any docker node) and made the VM's logs a 503. The
agent now makes that text safe where it reads it (core.safe_text, printable-only OS name, a host key of the form
`ssh-ed25519 <base64>`), and docker output that is not UTF-8 no longer crashes it.
"""
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.utils import timezone

from core import untrusted_json
from marketplace.models import Instance, InstanceStatus
from provisioning import tasks
from provisioning.agent import gpumarket_agent as agent
from provisioning.agent.gpumarket_agent.records import save_record
from provisioning.models import JobFault, JobKind
from provisioning.services import vms
from provisioning.services.fleet_record import health_samples_record
from provisioning.ssh import Endpoint, NodeSession
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book, run
from tests.marketplace.test_instance_options import body, post
from tests.provisioning.sshkit import new_keypair
from tests.provisioning.test_vm_fault_attribution import RETRIES_SPENT, reliability, run_in_worker

REPO = Path(__file__).resolve().parents[2]
SAMPLES = Path(__file__).parent / "fixtures" / "nvidia_smi"
HOST_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHostKeyOfTheContainerXXXXXXXXXXXXXXXXXXX"

# ------------------------------------------------------------------------------------------ the renter's own output

# A docker CLI stand-in: `docker logs` prints what a renter's program wrote (one NUL byte in it: a binary's
# output, `find -print0`, a progress bar), everything else is a running container.
FAKE_DOCKER_LOGS = """#!/bin/sh
case "$1" in
  logs) printf '2026-12-07T05:00:00.000000000Z step 1\\000done\\n2026-12-07T05:00:01.000000000Z step 2 ok\\n';;
  inspect) echo running;;
esac
"""
FAKE_DOCKER_QUIET = """#!/bin/sh
case "$1" in
  inspect) echo running;;
esac
"""


def _agent_stdout(tmp_path, argv, request, docker=FAKE_DOCKER_LOGS, vm_log=b"", **record):
    """The agent's stdout exactly as it prints it over SSH (its own process, the docker stand-in on PATH), for a
    recorded docker VM (`record`: more of its record) whose agent log (vm.log) holds `vm_log`."""
    fakebin = tmp_path / "bin"
    fakebin.mkdir(exist_ok=True)
    (fakebin / "docker").write_text(docker)
    (fakebin / "docker").chmod(0o755)
    state = tmp_path / "state"
    cfg = agent.Config({"GPUMARKET_RUNTIME": "docker", "GPUMARKET_STATE_DIR": str(state)})
    spec = {"gpu_indices": [0], "ssh_public_keys": [new_keypair()[1]], "image": {"docker": "ghcr.io/x/app:1"},
            "disk_gb": 50}
    save_record(cfg, {"vm_id": request["vm_id"], "runtime": "docker", "spec": spec, "ssh_port": 41000, "ports": {},
                      **record})
    if vm_log:
        (state / "vms" / request["vm_id"] / "vm.log").write_bytes(vm_log)
    env = {**os.environ, "PATH": f"{fakebin}:{os.environ['PATH']}", "GPUMARKET_RUNTIME": "docker",
           "GPUMARKET_STATE_DIR": str(state), "PYTHONPATH": str(REPO / "provisioning" / "agent")}
    proc = subprocess.run([sys.executable, "-m", "gpumarket_agent", *argv], input=json.dumps(request).encode(),
                          capture_output=True, env=env, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.django_db
@pytest.mark.parametrize("where", ["container", "agent log"])
def test_a_nul_byte_in_the_renters_own_output_leaves_the_vms_logs_readable(tmp_path, monkeypatch, api, where):
    """The container's lines (`docker logs`), and the agent's own log, where a sim VM's onstart output lands."""
    node = make_listed_node(gpu_count=4)
    instance = run(Instance.objects.get(pk=post(api, body(node)).json()["id"]))
    if where == "container":
        out = _agent_stdout(tmp_path, ["vm", "logs"], {"runtime": "docker", "vm_id": instance.vm_id, "tail": 200})
    else:
        out = _agent_stdout(tmp_path, ["vm", "logs"], {"runtime": "docker", "vm_id": instance.vm_id, "tail": 200},
                            docker=FAKE_DOCKER_QUIET, vm_log=b"2026-12-07T05:00:00.000000000Z onstart: step 1\x00done\n"
                                                 b"2026-12-07T05:00:01.000000000Z onstart: step 2 ok\n")
    assert json.loads(out)["ok"] is True  # the agent read the logs fine

    @contextlib.contextmanager
    def session(*_a, **_k):  # the real NodeSession.agent over a transport that returns the agent's real stdout
        s = NodeSession(Endpoint(address="203.0.113.9", port=22, user="gpu", private_key=b""))
        monkeypatch.setattr(s, "ensure_agent", lambda: "/home/gpu/.gpumarket/agent/gpumarket_agent-x.pyz")
        monkeypatch.setattr(s, "_exec", lambda cmd, stdin, timeout: out)
        yield s

    monkeypatch.setattr(vms, "node_session", session)
    r = api.get(f"/api/v1/instances/{instance.pk}/logs/", {"tail": "200"})
    # Before: the whole log was refused as the node's garbage, and the renter told their node did not answer (503),
    # for as long as that line was within the tail.
    assert r.status_code == 200, (r.status_code, r.content[:400])
    lines = r.json()["lines"]
    assert any("step 2 ok" in line for line in lines)
    assert any("step 1\ufffddone" in line for line in lines), lines  # the NUL shown as U+FFFD, the line kept


def test_a_record_an_older_agent_wrote_with_a_nul_in_its_os_and_host_key_is_answered(tmp_path):
    """A VM recorded before the fix keeps its image's text in vm.json: every `vm status` of it was refused."""
    out = _agent_stdout(tmp_path, ["vm", "status"], {"vm_id": "inst-3"}, os="Acme\x00 Linux",
                        ssh_host_key="ssh-ed25519 AAAA\x00C3Nza")
    answer = untrusted_json.answer_loads(out)
    assert answer["ok"] is True and answer["state"] == "running", answer
    assert answer["os"] == "Acme\ufffd Linux"


# ------------------------------------------------------------------------ a renter's own image through a booking

# A docker CLI stand-in with a registry (a private repository needs a login) and the image's own files, each set by
# the test: FAKE_OS_RELEASE (the image's /etc/os-release), FAKE_HOST_KEY (its sshd host key file), FAKE_PULL_ERROR
# (the registry's error as docker prints it on stderr), each in hex.
FAKE_DOCKER = r'''#!/usr/bin/env python3
import io, json, os, sys, tarfile
args = sys.argv[1:]
with open(os.environ["FAKE_DOCKER_LOG"], "a") as f:
    f.write(json.dumps(args) + "\n")
state_file = os.environ["FAKE_DOCKER_STATE"]
state = json.load(open(state_file)) if os.path.exists(state_file) else {}
images = state.setdefault("images", [])
verb, name = args[0], args[-1]
def given(var, default=""):
    return bytes.fromhex(os.environ[var]) if os.environ.get(var) else default.encode()
if verb == "--config":  # docker --config DIR pull IMAGE: the registry decides with the credentials in DIR
    conf = json.load(open(os.path.join(args[1], "config.json")))
    if os.environ.get("FAKE_PULL_ERROR"):
        sys.stderr.buffer.write(given("FAKE_PULL_ERROR"))
        sys.exit(1)
    if "registry.acme.example" in name and not conf["auths"]:
        sys.stderr.write("Error response from daemon: pull access denied for %s, repository does not exist or may "
                         "require 'docker login'\n" % name)
        sys.exit(1)
    images.append(name)
    print("Status: Downloaded newer image for " + name)
elif verb == "image" and args[1] == "inspect":
    if name not in images:
        sys.stderr.write("Error: No such image: %s\n" % name)
        sys.exit(1)
    print(json.dumps({"Cmd": ["/usr/sbin/sshd", "-D"]}))
elif verb == "network" and args[1] == "inspect":
    print(json.dumps({"com.docker.network.bridge.enable_icc": "false"}))
elif verb == "create":
    state[args[args.index("--name") + 1]] = "created"
elif verb == "exec":
    if args[2:] == ["cat", "/etc/ssh/ssh_host_ed25519_key.pub"]:
        sys.stdout.buffer.write(given("FAKE_HOST_KEY", "%s root@box\n" % os.environ["FAKE_DEFAULT_HOST_KEY"]))
elif verb == "cp":  # docker cp -L <container>:/etc/os-release -: a tar of the image's own file
    if not os.environ.get("FAKE_OS_RELEASE"):
        sys.exit(1)
    data = given("FAKE_OS_RELEASE")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("os-release")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    sys.stdout.buffer.write(buf.getvalue())
elif verb == "inspect":
    if name not in state:
        sys.stderr.write("Error: No such object: %s\n" % name)
        sys.exit(1)
    print(state[name])
elif verb == "start":
    state[name] = "running"
json.dump(state, open(state_file, "w"))
'''


@pytest.fixture
def docker_node(tmp_path, monkeypatch):
    """The docker stand-in and a 4 x A100 nvidia-smi on PATH; the agent's environment."""
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    (fakebin / "docker").write_text(FAKE_DOCKER)
    (fakebin / "nvidia-smi").write_text(
        f"#!/bin/sh\ncase \"$1\" in --query-gpu=*) cat {SAMPLES / 'a100_sxm4_80gb_x4.csv'};; "
        f"*) cat {SAMPLES / 'h100_sxm_x1_table.txt'};; esac\n")
    for script in fakebin.iterdir():
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fakebin}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DOCKER_STATE", str(tmp_path / "docker.json"))
    monkeypatch.setenv("FAKE_DOCKER_LOG", str(tmp_path / "docker.log"))
    monkeypatch.setenv("FAKE_DEFAULT_HOST_KEY", HOST_KEY)
    return {"GPUMARKET_RUNTIME": "docker", "GPUMARKET_STATE_DIR": str(tmp_path / "state"),
            "GPUMARKET_PORT_RANGE": "41000-41999"}


def docker_calls(tmp_path):
    return [json.loads(line) for line in (tmp_path / "docker.log").read_text().splitlines()]


def book_and_provision(monkeypatch, env):
    """A renter's own image booked on a docker node whose reliability is 1.0, provisioned by the real task through
    the real NodeSession answer parsing (only its transport replaced by a pipe to the real agent, in-process)."""

    class AgentOverPipe(NodeSession):
        def ensure_agent(self):
            return "/home/gpu/.gpumarket/agent/gpumarket_agent-0.pyz"

        def _exec(self, cmd, stdin, timeout):
            request = json.loads(stdin)
            request.pop("gpu_uuids", None)  # the stand-in nvidia-smi's cards are not the factory's
            answer, _ = agent.handle(cmd.split()[2:], json.dumps(request), env)
            return (json.dumps(answer, sort_keys=True) + "\n").encode()  # as core.emit prints it

    @contextlib.contextmanager
    def session(*_a, **_k):
        yield AgentOverPipe(Endpoint(address="10.0.0.1", port=22, user="gpu", private_key=b""))

    monkeypatch.setattr(vms, "node_session", session)
    monkeypatch.setattr(vms, "wait_for_ssh", lambda host, port, timeout=0: None)
    node = make_listed_node(UserFactory(), gpu_count=2, runtime="docker")
    for _ in range(10):
        health_samples_record(ok_ids=[node.pk], failed_ids=[], day=timezone.now().date())
    assert reliability(node) == 1.0
    instance = book(UserFactory(), node, image="ghcr.io/mallory/tiny:1")  # any public image they push
    job = instance.jobs.get(kind=JobKind.INSTANCE_PROVISION)
    run_in_worker(tasks.instance_provision, job, retries=RETRIES_SPENT)
    instance.refresh_from_db()
    job.refresh_from_db()
    return node, instance, job


@pytest.mark.django_db
@pytest.mark.parametrize(("var", "text"), [
    ("FAKE_OS_RELEASE", b'NAME="Acme"\nPRETTY_NAME="Acme Linux\x00 2"\n'),
    ("FAKE_HOST_KEY", HOST_KEY.replace("Host", "Ho\x00st").encode() + b" root@box\n"),
], ids=["os-release", "host key"])
def test_a_renters_own_image_whose_files_hold_a_nul_runs(docker_node, monkeypatch, var, text):
    """Before: every answer about the VM was refused, the booking failed as the node's fault (reliability 0.98),
    the renter billed nothing: repeatable on any docker node, for free."""
    monkeypatch.setenv(var, text.hex())
    node, instance, job = book_and_provision(monkeypatch, docker_node)
    assert instance.status == InstanceStatus.RUNNING, (job.status, job.fault, job.error)
    assert reliability(node) == 1.0
    if var == "FAKE_OS_RELEASE":
        assert instance.os == "Acme Linux 2"  # printable characters only
    else:
        assert instance.os == ""  # the stand-in has no os-release


def test_a_host_key_file_the_image_ships_that_is_no_key_is_none(docker_node, monkeypatch):
    """The agent answers the key's type and base64 body, or no key: what a broken file holds is no key to pin."""
    monkeypatch.setenv("FAKE_HOST_KEY", (HOST_KEY.replace("Host", "Ho\x00st") + " root@box\n").encode().hex())
    answer, _ = agent.handle(["vm", "create"], json.dumps({
        "vm_id": "inst-5", "gpu_indices": [0], "ssh_public_keys": [new_keypair()[1]],
        "image": {"docker": "ghcr.io/mallory/tiny:1"}, "image_env": True}), docker_node)
    assert answer["ok"] and answer["state"] == "running", answer
    assert answer["ssh_host_key"] is None
    monkeypatch.setenv("FAKE_HOST_KEY", (HOST_KEY + " root@box\n").encode().hex())
    again, _ = agent.handle(["vm", "create"], json.dumps({
        "vm_id": "inst-6", "gpu_indices": [1], "ssh_public_keys": [new_keypair()[1]],
        "image": {"docker": "ghcr.io/mallory/tiny:1"}, "image_env": True}), docker_node)
    assert again["ssh_host_key"] == HOST_KEY  # a well-formed one, as before


@pytest.mark.django_db
@pytest.mark.parametrize("stderr", [
    b"Error response from daemon: unauthorized: token \x00 denied\n",
    b"Error response from daemon: unauthorized: \xff\xfe denied\n",  # not UTF-8: the agent crashed (internal_error)
], ids=["NUL", "not UTF-8"])
def test_a_renters_registry_whose_error_holds_a_nul_fails_the_booking_as_the_renters(docker_node, monkeypatch,
                                                                                    stderr):
    """The registry's reason is the renter's to act on, their own image's pull failure not the node's
    (vms.vm_provision). Before: the answer was refused (or the agent crashed) and the node was blamed."""
    monkeypatch.setenv("FAKE_PULL_ERROR", stderr.hex())
    node, instance, job = book_and_provision(monkeypatch, docker_node)
    assert instance.status == InstanceStatus.FAILED
    assert job.fault == JobFault.RENTER, (job.fault, job.error)
    assert "could not be pulled" in job.error and "denied" in job.error, job.error
    assert reliability(node) == 1.0
