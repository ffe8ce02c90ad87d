"""GPUMARKET_DOCKER_PULL=missing and a renter's private image (found by review).

With `missing` the agent skipped the pull of any image already on the node, so a renter without credentials started
another renter's private image, left cached by that renter's pull (docs/BENCHMARKS.md gave this very risk as the
reason `always` is the default). Now only a catalogue image is taken from the cache: a renter's own image
(`image_env`), or one sent with registry credentials, is always pulled, so its registry decides.
"""
import json

import pytest

from provisioning.agent import gpumarket_agent as agent
from tests.marketplace.renting_helpers import ed25519_key
from tests.provisioning.test_agent_renter_text import docker_calls, docker_node  # noqa: F401 - the fixture


@pytest.fixture
def env(docker_node):  # noqa: F811 - the fixture
    """A docker node (the stand-in docker CLI and registry) whose provider set GPUMARKET_DOCKER_PULL=missing."""
    return {**docker_node, "GPUMARKET_DOCKER_PULL": "missing"}


PRIVATE = "registry.acme.example/team/secret-model:1"


def create(env, vm_id, gpus, image=PRIVATE, **extra):
    return agent.handle(["vm", "create"], json.dumps({
        "vm_id": vm_id, "gpu_indices": gpus, "ssh_public_keys": [ed25519_key("r@x")],
        "image": {"docker": image}, **extra}), env)[0]


def test_with_pull_missing_a_renter_without_credentials_cannot_start_another_renters_private_image(env):
    # Renter A: their private image, with their registry login.
    a = create(env, "inst-1", [0], image_env=True, registry_auth={"username": "acme", "password": "acme-token"})
    assert a["ok"], a
    # Without a login the registry refuses this image (the stand-in registry's rule, as a private repository's).
    # Renter B, on the same node, names A's private image and sends no login at all: before, the cached copy ran.
    b = create(env, "inst-2", [1], image_env=True)
    assert not b["ok"] and b["error"]["code"] == "pull_failed", b
    assert "pull access denied" in b["error"]["message"]


def test_with_pull_missing_only_a_catalogue_image_comes_from_the_cache(env, tmp_path):
    catalogue = "ghcr.io/gpumarket/ssh-cuda:12.2"

    def pulls():
        return [c[-1] for c in docker_calls(tmp_path) if c[0] == "--config"]

    assert create(env, "inst-1", [0], image=catalogue)["ok"]
    assert create(env, "inst-2", [1], image=catalogue)["ok"]
    assert pulls() == [catalogue]  # present the second time: not pulled again (what the option is for)
    # With credentials, even a request that does not call the image the renter's own: pulled every time.
    auth = {"username": "acme", "password": "acme-token"}
    assert create(env, "inst-3", [2], registry_auth=auth)["ok"]
    assert create(env, "inst-4", [3], registry_auth=auth)["ok"]
    assert pulls() == [catalogue, PRIVATE, PRIVATE]
