"""A query parameter that a list (or the detail of one object) does not read is a 400 naming it, on every list:
a misspelt filter (`?stat=active`) was ignored and answered everything. core.api.filtering.FilterBackend."""
import pytest

from marketplace.models import Image
from tests.factories import make_listed_node, make_node

pytestmark = pytest.mark.django_db

LISTS = ["/api/v1/nodes/", "/api/v1/volumes/", "/api/v1/instances/", "/api/v1/offers/", "/api/v1/images/",
         "/api/v1/gpu-models/", "/api/v1/ssh-keys/", "/api/v1/api-keys/"]


def unknown(response, *names):
    assert response.status_code == 400, response.content
    assert response.json() == {name: ["Unknown query parameter."] for name in names}


@pytest.mark.parametrize("path", LISTS)
def test_an_unknown_parameter_of_a_list_is_a_400_naming_it(api, path):
    unknown(api.get(path + "?foo=1&bar="), "bar", "foo")
    assert api.get(path + "?format=json").status_code == 200


def test_a_misspelt_node_filter_is_a_400_and_the_filters_and_pages_are_read(api, user):
    make_node(user)
    unknown(api.get("/api/v1/nodes/?stat=active"), "stat")
    body = api.get("/api/v1/nodes/?state=pending&page=1&page_size=5").json()
    assert body["count"] == 1


def test_a_list_without_pages_refuses_page_parameters(api):
    unknown(api.get("/api/v1/images/?page=2"), "page")
    unknown(api.get("/api/v1/gpu-models/?page_size=5"), "page_size")


def test_the_detail_of_one_object_reads_no_parameter(api, anon, user):
    offer = make_listed_node()
    unknown(anon.get(f"/api/v1/offers/{offer.pk}/?foo=1"), "foo")
    unknown(anon.get(f"/api/v1/offers/{offer.pk}/?min_gpus=1"), "min_gpus")  # a filter of the list only
    assert anon.get(f"/api/v1/offers/{offer.pk}/").status_code == 200
    node = make_node(user)
    unknown(api.get(f"/api/v1/nodes/{node.pk}/?state=active"), "state")
    image = Image.objects.filter(active=True).first()
    assert image is not None
    unknown(api.get(f"/api/v1/images/{image.slug}/?x=1"), "x")
    assert api.get(f"/api/v1/nodes/{node.pk}/?format=json").status_code == 200
