"""The renter's options on `vm create` (issue 12's contract), checked by the agent itself."""
import pytest

from provisioning.agent import gpumarket_agent as agent
from tests.provisioning.sshkit import new_keypair

KEY = new_keypair()[1]


def request(**changes):
    req = {"vm_id": "inst-1", "gpu_indices": [0], "ssh_public_keys": [KEY], "image": {"docker": "ubuntu:22.04"}}
    req.update(changes)
    return req


def refusal(req, runtime="docker"):
    with pytest.raises(agent.AgentError) as exc:
        agent.validate_create(req, runtime, [0, 1])
    assert exc.value.code == "invalid_request"
    return exc.value.field


def test_all_options_go_into_the_spec_but_the_registry_password_does_not():
    vm_id, spec = agent.validate_create(request(
        env={"B": "2", "A_1": "x y"}, onstart="echo hi", ports=[8888, 22 + 1], registry_auth={
            "username": "me", "password": "s3cret"}, volumes=[{"name": "vol-abcdefgh", "mount": "/data"}]),
        "docker", [0])
    assert spec == {"gpu_indices": [0], "ssh_public_keys": [KEY], "image": {"docker": "ubuntu:22.04"}, "disk_gb": 50,
                    "env": {"A_1": "x y", "B": "2"}, "onstart": "echo hi", "ports": [23, 8888],
                    "volumes": [{"name": "vol-abcdefgh", "mount": "/data"}]}
    assert "s3cret" not in repr(spec)


def test_empty_options_leave_the_spec_as_before():
    _, spec = agent.validate_create(request(env={}, onstart="", ports=[], volumes=[]), "docker", [0])
    assert set(spec) == {"gpu_indices", "ssh_public_keys", "image", "disk_gb"}


@pytest.mark.parametrize(
    "ref",
    [
        "ubuntu", "library/ubuntu:22.04", "localhost/app", "localhost:5000/app:v1", "127.0.0.1:5000/a/b/c:1",
        "[::1]:5000/app", "Registry.Example.com/team/app", "ghcr.io/o/r@sha256:" + "0" * 64,
        "ghcr.io/o/r:1.0@sha256:" + "f" * 64, "a__b/c-d--e/f.g_h:TAG_1.2-x", "x" * 255,
    ],
)
def test_oci_references_that_are_valid(ref):
    assert agent.validate_create(request(image={"docker": ref}), "docker", [0])[1]["image"]["docker"] == ref


@pytest.mark.parametrize(
    "ref",
    [
        "", "Ubuntu", "ubuntu:", "ubuntu:-x", "ubuntu:" + "a" * 129, "-ubuntu", "ubuntu-", "a..b", "a___b",
        "ghcr.io/o/r@sha256:" + "0" * 63, "ghcr.io/o/r@sha512:" + "0" * 128, "host:port/app", "ghcr.io//app",
        "app/", "/app", "x" * 256, "ubuntu latest", "ubuntu\n", "$(id)", "a;b", "--privileged", 42, None,
        "ghcr.io/O/r",
    ],
)
def test_oci_references_that_are_refused(ref):
    assert refusal(request(image={"docker": ref})) == "image"


def test_registry_key():
    assert agent.registry_key("ubuntu") == "https://index.docker.io/v1/"
    assert agent.registry_key("team/app:1") == "https://index.docker.io/v1/"
    assert agent.registry_key("127.0.0.1:5000/team/app:1") == "127.0.0.1:5000"
    assert agent.registry_key("localhost/app") == "localhost"


@pytest.mark.parametrize(
    "env",
    [
        {"lower": "x"}, {"1ABC": "x"}, {"A-B": "x"}, {"A" * 129: "x"}, {"A": 1}, {"A": None}, {"A": "x\x00y"},
        {"A": "a\nb"}, {"A": "a\rb"}, {"A": "x" * 4097}, {f"V{i}": "x" for i in range(65)},
        {f"V{i}": "x" * 4000 for i in range(9)}, ["A=1"], "A=1", {"A": "\ud800"},
    ],
)
def test_bad_env(env):
    assert refusal(request(env=env)) == "env"


@pytest.mark.parametrize("name", ["NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "NVIDIA_REQUIRE_CUDA",
                                  "NVIDIA_DISABLE_REQUIRE", "NVIDIA_MIG_CONFIG_DEVICES", "NVIDIA_"])
def test_renter_env_cannot_steer_the_nodes_nvidia_container_runtime(name):
    # The NVIDIA container runtime reads NVIDIA_* from the container's environment: NVIDIA_VISIBLE_DEVICES=all
    # would hand a container every GPU of a node whose dockerd runs nvidia by default without --gpus.
    with pytest.raises(agent.AgentError) as exc:
        agent.validate_env({name: "all"})
    assert exc.value.field == "env" and "reserved" in exc.value.message and name in exc.value.message
    assert refusal(request(env={"A": "1", name: "all"})) == "env"


def test_env_that_only_changes_what_cuda_sees_inside_the_container_is_allowed():
    env = {"CUDA_VISIBLE_DEVICES": "0", "NVIDIAX": "1", "MY_NVIDIA_TOKEN": "x", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert agent.validate_env(env) == dict(sorted(env.items()))


def test_env_at_its_limits_is_accepted():
    env = {f"V{i}": "y" * 500 for i in range(64)}
    assert agent.validate_create(request(env=env), "docker", [0])[1]["env"] == env
    assert agent.validate_env({"A" * 128: "é" * 4096, "_": ""}) == {"A" * 128: "é" * 4096, "_": ""}


@pytest.mark.parametrize("onstart", [42, ["echo"], "x" * 16385, "echo\x00id", None])
def test_bad_onstart(onstart):
    assert refusal(request(onstart=onstart)) == "onstart"


@pytest.mark.parametrize("ports", [[22], [0], [65536], [-1], ["80"], [80, 80], [True], list(range(1000, 1017)),
                                   80, None, [8.0]])
def test_bad_ports(ports):
    assert refusal(request(ports=ports)) == "ports"


@pytest.mark.parametrize(
    "volumes",
    [
        [{"name": "vol-abcdefgh"}], [{"name": "vol-abcdefgh", "mount": "/data", "ro": True}],
        [{"name": "data", "mount": "/data"}], [{"name": "vol-abc", "mount": "/data"}],
        [{"name": "vol-" + "a" * 33, "mount": "/data"}], [{"name": "vol-abcdefgh", "mount": "data"}],
        [{"name": "vol-abcdefgh", "mount": "/"}], [{"name": "vol-abcdefgh", "mount": "/proc"}],
        [{"name": "vol-abcdefgh", "mount": "/sys/fs"}], [{"name": "vol-abcdefgh", "mount": "/dev/shm"}],
        [{"name": "vol-abcdefgh", "mount": "/a/../etc"}], [{"name": "vol-abcdefgh", "mount": "/a/./b"}],
        [{"name": "vol-abcdefgh", "mount": "/a//b"}], [{"name": "vol-abcdefgh", "mount": "/a/"}],
        [{"name": "vol-abcdefgh", "mount": "//a"}], [{"name": "vol-abcdefgh", "mount": "/a\nb"}],
        [{"name": "vol-abcdefgh", "mount": "/.gpumarket"}],
        [{"name": "vol-abcdefgh", "mount": "/a"}, {"name": "vol-abcdefgh", "mount": "/b"}],
        [{"name": "vol-abcdefgh", "mount": "/a"}, {"name": "vol-abcdefgi", "mount": "/a"}],
        [{"name": f"vol-abcdefg{i}", "mount": f"/m{i}"} for i in range(9)], {"name": "vol-abcdefgh"}, None,
    ],
)
def test_bad_volumes(volumes):
    assert refusal(request(volumes=volumes)) == "volumes"


@pytest.mark.parametrize(
    "auth",
    [
        {"username": "me"}, {"username": "me", "password": "x", "email": "a@b"}, {"username": "", "password": "x"},
        {"username": "a:b", "password": "x"}, {"username": "me", "password": ""}, {"username": "u" * 256,
                                                                                "password": "x"},
        {"username": "me", "password": "x" * 4097}, {"username": "me\n", "password": "x"},
        {"username": "me", "password": "a\x00b"}, "me:pass", ["me", "pass"],
    ],
)
def test_bad_registry_auth(auth):
    assert refusal(request(registry_auth=auth)) == "registry_auth"


def test_the_libvirt_runtime_refuses_options_it_cannot_honour():
    rt = agent.LibvirtRuntime(agent.Config({"GPUMARKET_RUNTIME": "libvirt"}))
    for option in ("env", "onstart", "ports", "volumes"):
        with pytest.raises(agent.AgentError) as exc:
            rt.check_spec({option: ["x"]})
        assert exc.value.field == option
