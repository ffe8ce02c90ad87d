"""The image catalogue in the operators' panel (found by review): a container image or a libvirt image name the
nodes refuse was saved, and every rental of that image failed on its node. The container image is checked as a
renter's own reference (the booking's rule), the libvirt name by the agent's own pattern, without the .qcow2 the
node adds; the error is shown on the form, nothing saved."""
import pytest

from marketplace.models import Image
from marketplace.validators import LIBVIRT_IMAGE_RE, validate_libvirt_image
from provisioning.agent.gpumarket_agent import validation as agent_validation
from provisioning.agent.gpumarket_agent.core import AgentError
from provisioning.agent.gpumarket_agent.validation import validate_create
from tests.marketplace.renting_helpers import ed25519_key
from tests.web.conftest import logged_in
from tests.web.test_admin_pages import change_form

pytestmark = pytest.mark.django_db

ADD = "/admin/marketplace/image/add/"
BAD_DOCKER = ["pytorch/pytorch latest", "pytorch/PyTorch:2.5", "ubuntu:", "ubuntu@sha256:abc"]
BAD_LIBVIRT = ["ubuntu 22.04.qcow2", "ubuntu-22.04.qcow2", "Ubuntu-22.04", "a..b", "-ubuntu", "../etc/passwd",
               "x" * 129]
GOOD_LIBVIRT = ["ubuntu-22.04-cuda-12.4", "debian_12.img", "a"]


@pytest.fixture
def ops(operator):
    return logged_in(operator)


def _form(ops, url=ADD, **values) -> dict:
    data = change_form(ops, url, "image_form")
    data.update({"name": ["Test image"], "slug": ["test-image"], "min_disk_gb": ["20"], "active": ["on"]})
    data.update({k: [v] for k, v in values.items()})
    return data


@pytest.mark.parametrize("value", BAD_DOCKER)
def test_a_container_image_the_booking_refuses_is_not_saved(ops, value):
    r = ops.post(ADD, _form(ops, docker_image=value))
    assert r.status_code == 200
    assert "not a valid image reference" in r.content.decode() or "has at most" in r.content.decode()
    assert not Image.objects.filter(slug="test-image").exists()


@pytest.mark.parametrize("value", BAD_LIBVIRT)
def test_a_libvirt_image_the_agent_refuses_is_not_saved(ops, value):
    r = ops.post(ADD, _form(ops, libvirt_image=value))
    assert r.status_code == 200
    html = r.content.decode()
    assert "the node adds it" in html or "A libvirt image name is" in html or "at most 200" in html
    assert not Image.objects.filter(slug="test-image").exists()


def test_good_names_are_saved_and_an_edit_is_checked_too(ops):
    r = ops.post(ADD, _form(ops, docker_image="pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime",
                            libvirt_image="ubuntu-22.04-cuda-12.4"))
    assert r.status_code == 302, r.content.decode()[:3000]
    image = Image.objects.get(slug="test-image")
    url = f"/admin/marketplace/image/{image.pk}/change/"
    r = ops.post(url, _form(ops, url, libvirt_image="ubuntu-22.04-cuda-12.4.qcow2"))
    assert r.status_code == 200 and "the node adds it" in r.content.decode()
    assert Image.objects.get(pk=image.pk).libvirt_image == "ubuntu-22.04-cuda-12.4"


def _agent_takes(name: str) -> bool:
    request = {"vm_id": "inst-1", "gpu_indices": [0], "ssh_public_keys": [ed25519_key()],
               "image": {"libvirt": name}}
    try:
        validate_create(request, "libvirt", [0])
    except AgentError:
        return False
    return True


def test_the_platforms_pattern_is_the_agents():
    assert LIBVIRT_IMAGE_RE.pattern == agent_validation._LIBVIRT_IMAGE_RE.pattern
    assert LIBVIRT_IMAGE_RE.flags == agent_validation._LIBVIRT_IMAGE_RE.flags


@pytest.mark.parametrize("name", BAD_LIBVIRT + GOOD_LIBVIRT + ["x" * 128, "ubuntu.qcow2"])
def test_the_platform_takes_only_names_the_agent_takes(name):
    """The platform takes what the agent takes (its pattern and its '..'), less the .qcow2 suffix the agent would
    add a second time."""
    try:
        validate_libvirt_image(name)
        platform = True
    except Exception:  # noqa: BLE001 (Django's ValidationError)
        platform = False
    assert platform == (_agent_takes(name) and not name.endswith(".qcow2"))
    if name in GOOD_LIBVIRT:
        assert platform
