"""The volumes page offers the servers the volume service takes (models.nodes.offerable: a free GPU not needed), so
a renter whose own instance holds a server's only GPU can put a volume there from the page as through the API
(before: "Select a valid choice" on the page, 201 from the API)."""
import pytest

from marketplace.models import Node, Volume
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import book
from tests.web.conftest import fund

pytestmark = pytest.mark.django_db


def test_a_server_whose_only_gpu_is_the_renters_own_is_offered(web, renter):
    node = make_listed_node(gpu_count=1, city="Berlin")
    fund(renter)
    book(renter, node, num_gpus=1)  # no GPU free now: the offers do not show it
    page = web.get("/volumes/").content.decode()
    assert f'<option value="{node.pk}"' in page
    r = web.post("/volumes/", {"offer": node.pk, "size_gb": 10, "label": "beside"})
    assert r.status_code == 302, r.content.decode()[:2000]
    assert Volume.objects.get(owner=renter).node_id == node.pk


def test_servers_the_service_refuses_are_not_offered(web, renter):
    unlisted = make_listed_node(gpu_count=1, listed=False)
    not_answering = make_listed_node(gpu_count=1)
    Node.objects.filter(pk=not_answering.pk).update(health_failures=1)
    ok = make_listed_node(gpu_count=1)
    page = web.get("/volumes/").content.decode()
    assert f'<option value="{ok.pk}"' in page
    assert f'<option value="{unlisted.pk}"' not in page and f'<option value="{not_answering.pk}"' not in page
