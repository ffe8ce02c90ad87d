"""Review r54 (offers), finding 5: where the platform takes no simulated node (settings.SIM_NODES_ALLOWED off), the
images catalogue still listed `sim` among every image's runtimes, and listed an image with neither a container nor
a VM image (runnable on sim alone) as `runtimes: ["sim"]`, although no offer can run it; a booking took its slug and
failed later with "has a build only for ." Now the catalogue leaves `sim` and such images out there, and a booking
naming one is a 400 on `image` saying it is not in the catalogue (options.image_of)."""
import pytest
from django.test import override_settings
from rest_framework.test import APIClient

from core.errors import ValidationFailed
from marketplace.models import Image
from marketplace.services.instances.options import image_of
from tests.factories import make_listed_node

from .renting_helpers import add_key, sent_jobs_fixture  # noqa: F401

pytestmark = pytest.mark.django_db


@pytest.fixture
def images():
    Image.objects.create(slug="only-docker", name="D", docker_image="nvidia/cuda:12.2.0-base-ubuntu22.04")
    Image.objects.create(slug="nothing", name="N")


@override_settings(SIM_NODES_ALLOWED=False)
def test_images_runtimes_say_no_sim_where_no_sim_node_is_taken(images):
    rows = {i["slug"]: i for i in APIClient().get("/api/v1/images/").json()}
    assert "nothing" not in rows, rows["nothing"]
    assert rows["only-docker"]["runtimes"] == ["docker"]
    assert all("sim" not in row["runtimes"] for row in rows.values())
    assert APIClient().get("/api/v1/images/nothing/").status_code == 404
    assert APIClient().get("/api/v1/images/only-docker/").json()["runtimes"] == ["docker"]


def test_with_sim_nodes_taken_sim_is_listed(images):
    rows = {i["slug"]: i for i in APIClient().get("/api/v1/images/").json()}
    assert rows["nothing"]["runtimes"] == ["sim"]
    assert rows["only-docker"]["runtimes"] == ["docker", "sim"]
    assert image_of("nothing").slug == "nothing"


@override_settings(SIM_NODES_ALLOWED=False)
def test_a_sim_only_slug_is_refused_at_booking_on_image(images, api):
    with pytest.raises(ValidationFailed) as refused:
        image_of("nothing")
    assert "nothing" in str(refused.value) and "catalogue" in str(refused.value)
    assert image_of("only-docker").slug == "only-docker"
    node = make_listed_node(runtime="docker", gpu_count=1)
    key = add_key(api.user)
    r = api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "nothing", "ssh_keys": [key.pk]},
                 format="json")
    assert r.status_code == 400, r.json()
    assert "catalogue" in str(r.json()["image"]), r.json()
