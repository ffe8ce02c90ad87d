"""Review r53 #3 on the rent page: "Your own image" naming a registry inside the node's network (here the cloud
metadata address) is refused on the field, as the API refuses it (options.clean_own_image_reference)."""
import pytest

from marketplace.models import Instance, Node
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import ed25519_key

pytestmark = pytest.mark.django_db


def test_the_rent_page_refuses_an_internal_registry_on_the_field(web, funded_renter):
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=4)
    Node.objects.filter(pk=node.pk).update(inventory={"cuda_version": "12.4"})
    r = web.post(f"/offers/{node.pk}/rent/", {"image": "cuda-12-4", "num_gpus": "1", "ssh_public_key": ed25519_key(),
                                              "request_token": "t", "own_image": "169.254.169.254/latest:1"})
    page = r.content.decode()
    assert r.status_code == 400 and 'id="id_own_image_errors"' in page, page[:2000]
    assert "inside the node&#x27;s network" in page and "link-local" in page
    assert not Instance.objects.exists()
