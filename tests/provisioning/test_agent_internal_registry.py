"""Review r53 #3 in the node agent (defence in depth behind the platform's check): a renter's own image (image_env,
or pulled with the renter's registry login) from `localhost` or an IP literal inside the node's network is refused
by `vm create` as invalid_request on `image`, before anything is recorded or pulled. Catalogue images (the
platform's) are not checked; GPUMARKET_INTERNAL_REGISTRIES lists the provider's own registries allowed. Names are
resolved too (test_round54_agent_registry_names.py)."""
import pytest

from provisioning.agent import gpumarket_agent as agent
from tests.provisioning.sshkit import new_keypair
from tests.provisioning.test_agent_docker import node  # noqa: F401 (fixture)

KEY = new_keypair()[1]
INTERNAL = ["127.0.0.1:2375/probe:1", "localhost:8080/probe:1", "LOCALHOST/probe", "a.localhost/probe:1",
            "169.254.169.254:80/latest:1", "10.0.0.5:22/probe:1", "192.168.0.1/x:1", "0.0.0.0:80/x:1",
            "[::1]:5000/probe:1", "[fe80::1]:5000/probe:1", "[fd00::1]:5000/probe:1", "[::ffff:7f00:1]:80/x:1",
            "[::]:80/x:1", "127.1:5000/probe:1", "0x7f.1:5000/probe:1", "2130706433:5000/probe:1"]
PUBLIC = ["ubuntu:22.04", "ghcr.io/o/app:1", "registry.example.com:5000/t/app:1", "8.8.8.8:5000/app:1",
          "[2606:4700::1111]:5000/app:1", "docker.io/library/ubuntu", "1234/app:1", "localhostish.example.com/app:1"]


def request(image, **changes):
    req = {"vm_id": "inst-1", "gpu_indices": [0], "ssh_public_keys": [KEY], "image": {"docker": image},
           "image_env": True}
    req.update(changes)
    return req


@pytest.mark.parametrize("image", INTERNAL)
def test_a_renters_own_image_from_inside_the_nodes_network_is_refused(image):
    for req in (request(image), request(image, image_env=False, registry_auth={"username": "u", "password": "p"})):
        with pytest.raises(agent.AgentError) as exc:
            agent.validate_create(req, "docker", [0])
        assert (exc.value.code, exc.value.field) == ("invalid_request", "image")
        assert "inside the node's network" in exc.value.message


@pytest.mark.parametrize("image", PUBLIC)
def test_public_registries_and_names_are_taken(image):
    assert agent.validate_create(request(image), "docker", [0])[1]["image"]["docker"] == image


def test_catalogue_images_and_the_providers_listed_registries_are_taken():
    req = request("127.0.0.1:5000/platform/ssh:1", image_env=False)
    assert agent.validate_create(req, "docker", [0])[1]["image"]["docker"] == "127.0.0.1:5000/platform/ssh:1"
    allowed = agent.Config({"GPUMARKET_INTERNAL_REGISTRIES": " 127.0.0.1 , Registry.Local:5000"}).internal_registries
    assert allowed == ("127.0.0.1", "registry.local:5000")
    for image in ("127.0.0.1:5000/t/app:1", "127.0.0.1/t/app:1", "registry.local:5000/t/app:1"):
        assert agent.validate_create(request(image), "docker", [0], allowed)[1]["image"]["docker"] == image
    with pytest.raises(agent.AgentError):  # host:port allows that port only
        agent.validate_create(request("10.0.0.5:5000/t/app:1"), "docker", [0], ("10.0.0.5:6000",))


def test_vm_create_refuses_before_any_pull_or_record(node, tmp_path):  # noqa: F811
    answer = node.create("inst-3", [0], image="169.254.169.254:80/latest:1", image_env=True)
    assert not answer["ok"] and answer["error"]["code"] == "invalid_request", answer
    assert answer["error"]["field"] == "image" and "link-local" in answer["error"]["message"]
    assert not any("pull" in c or c[0] == "create" for c in node.docker_calls()), node.docker_calls()
    assert not (tmp_path / "state" / "vms" / "inst-3").exists() and node.states() == {}
