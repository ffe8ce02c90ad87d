"""The renter's registry login reaches `docker pull` under the key the docker CLI looks it up by (dockerpull.py)."""
import json

import pytest

from provisioning.agent import gpumarket_agent as agent
from provisioning.agent.gpumarket_agent.runtimes.dockerpull import docker_config_json

AUTH = {"username": "u", "password": "p"}


@pytest.mark.parametrize("reference", [
    "docker.io/team/app:1", "index.docker.io/team/app:1", "docker.io/library/ubuntu", "docker.io/ubuntu:22.04",
    "team/app:1", "ubuntu",
])
def test_docker_hub_references_send_the_login_under_docker_hubs_key(reference):
    # The docker CLI reads Docker Hub's credentials under "https://index.docker.io/v1/" for every reference to
    # Docker Hub's own index, whether it names docker.io, index.docker.io or no registry at all.
    assert list(json.loads(docker_config_json(reference, AUTH))["auths"]) == ["https://index.docker.io/v1/"]


@pytest.mark.parametrize(("reference", "key"), [
    ("registry-1.docker.io/team/app:1", "registry-1.docker.io"),  # not a name the CLI takes for Docker Hub
    ("ghcr.io/team/app:1", "ghcr.io"),
    ("127.0.0.1:5000/team/app:1", "127.0.0.1:5000"),
    ("docker.io:5000/team/app", "docker.io:5000"),
])
def test_other_registries_keep_their_own_key(reference, key):
    assert agent.registry_key(reference) == key
