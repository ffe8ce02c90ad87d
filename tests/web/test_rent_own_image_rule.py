"""The rent page's "Your own image" follows the API's image rule (services.instances.options.image_of): a bare word
names a catalogue image and a misspelt one is refused, not pulled as a public image of that name; a reference has a
`/`, `:` or `@` (before, the page took `ubuntu` as a public image where the API refused it)."""
import pytest

from marketplace.models import Instance, Node
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import ed25519_key

pytestmark = pytest.mark.django_db


@pytest.fixture
def node(db):
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=4)
    Node.objects.filter(pk=node.pk).update(inventory={"cuda_version": "12.4"})
    return Node.objects.get(pk=node.pk)


def _rent(web, node, **advanced):
    return web.post(f"/offers/{node.pk}/rent/", {"image": "cuda-12-4", "num_gpus": "1",
                                                 "ssh_public_key": ed25519_key(), "request_token": "t", **advanced})


def test_a_bare_word_not_in_the_catalogue_is_refused_on_the_field(web, funded_renter, node):
    r = _rent(web, node, own_image="ubuntu")
    page = r.content.decode()
    assert r.status_code == 400 and 'id="id_own_image_errors"' in page
    assert "No image &#x27;ubuntu&#x27; in the catalogue" in page and "ubuntu:24.04" in page
    assert not Instance.objects.exists()


def test_a_reference_with_a_tag_is_ones_own_image(web, funded_renter, node):
    assert _rent(web, node, own_image="ubuntu:24.04").status_code == 302
    instance = Instance.objects.get(renter=funded_renter)
    assert (instance.image, instance.image_ref) == (None, "ubuntu:24.04")


def test_a_bare_word_naming_a_catalogue_image_is_that_image(web, funded_renter, node):
    assert _rent(web, node, own_image="pytorch-2-5").status_code == 302
    instance = Instance.objects.get(renter=funded_renter)
    assert instance.image.slug == "pytorch-2-5" and not instance.image_ref


def test_a_registry_login_needs_an_image_of_ones_own_not_a_catalogue_one(web, funded_renter, node):
    r = _rent(web, node, own_image="pytorch-2-5", registry_username="robot", registry_password="s3cret-token-1")
    page = r.content.decode()
    assert r.status_code == 400 and 'id="id_registry_username_errors"' in page
    assert "A registry login goes with an image of your own only." in page
    assert not Instance.objects.exists()
