"""The image catalogue: seeded by a migration, public, and every name passes the node agent's checks."""
from pathlib import Path

import pytest

from marketplace.models import Image
from provisioning.agent import gpumarket_agent as agent

from .renting_helpers import ed25519_key

pytestmark = pytest.mark.django_db

SEEDED = {"cuda-12-4", "pytorch-2-5", "tensorflow-2-17"}
IMAGES_DIR = Path(__file__).resolve().parents[2] / "provisioning" / "images"


def test_public_list_has_the_seeded_images(anon):
    r = anon.get("/api/v1/images/")
    assert r.status_code == 200
    by_slug = {i["slug"]: i for i in r.json()}
    assert SEEDED <= set(by_slug)
    for slug in SEEDED:
        image = by_slug[slug]
        assert image["runtimes"] == ["docker", "libvirt", "sim"]
        assert image["docker_image"].startswith("gpumarket/") and image["libvirt_image"]
        assert image["min_disk_gb"] >= 20 and image["name"] and image["description"]


def test_retrieve_by_slug_and_unknown_is_404(anon):
    assert anon.get("/api/v1/images/pytorch-2-5/").json()["name"].startswith("PyTorch 2.5.1")
    assert anon.get("/api/v1/images/nope/").status_code == 404


def test_inactive_images_are_hidden(anon):
    Image.objects.filter(slug="tensorflow-2-17").update(active=False)
    assert "tensorflow-2-17" not in {i["slug"] for i in anon.get("/api/v1/images/").json()}


def test_runtimes_follow_what_the_image_has():
    image = Image(slug="x", name="x", docker_image="gpumarket/x:1")
    assert image.runtimes == ["docker", "sim"]
    assert not image.supports("libvirt")


@pytest.mark.parametrize("slug", sorted(SEEDED))
@pytest.mark.parametrize("runtime", ["docker", "libvirt"])
def test_seeded_names_pass_the_agents_create_validation(slug, runtime):
    image = Image.objects.get(slug=slug)
    request = {
        "vm_id": "inst-1", "gpu_indices": [0], "ssh_public_keys": [ed25519_key()],
        "image": {"docker": image.docker_image, "libvirt": image.libvirt_image}, "disk_gb": image.min_disk_gb,
    }
    vm_id, spec = agent.validate_create(request, runtime, [0])
    assert spec["image"][runtime] == getattr(image, f"{runtime}_image")


def test_the_derived_images_are_buildable_from_the_repo():
    dockerfile = (IMAGES_DIR / "Dockerfile").read_text()
    assert "ARG BASE" in dockerfile and "openssh-server" in dockerfile
    entrypoint = (IMAGES_DIR / "entrypoint.sh").read_text()
    assert "/root/.ssh/authorized_keys" in entrypoint and "sshd -D" in entrypoint
    readme = (IMAGES_DIR / "README.md").read_text()
    for image in Image.objects.filter(slug__in=SEEDED):
        assert image.docker_image in readme and image.libvirt_image in readme
