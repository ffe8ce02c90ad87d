"""Review r54 (offers), finding 4: a filter of one value given twice (`?min_gpus=4&min_gpus=1`, two `ordering`) was
silently last-wins; it is a 400 naming the parameter (core.api.filtering.StrictFilterSet), except filters taking
several values (gpu_model, and the other multiple choices: billing events' `kind`). The offers page, which runs the
API's filter set, answers its 400 too; its checkboxes of models still send several."""
import pytest
from django.test import Client
from rest_framework.test import APIClient

from tests.factories import UserFactory, make_listed_node

pytestmark = pytest.mark.django_db

URL = "/api/v1/offers/"



@pytest.mark.parametrize("query", [
    "min_gpus=4&min_gpus=1", "ordering=-price_per_gpu_hour&ordering=score", "country=DE&country=FR",
    "max_price_per_gpu_hour=1&max_price_per_gpu_hour=2", "nvlink=true&nvlink=false",
    "mig_profile=1g.10gb&mig_profile=3g.40gb", "min_cuda_version=12.2&min_cuda_version=11.8",
])
def test_a_repeated_scalar_filter_is_a_400_naming_it(query):
    make_listed_node(gpu_count=2)
    response = APIClient().get(URL + "?" + query)
    assert response.status_code == 400, response.content
    name = query.split("=")[0]
    assert "once" in str(response.json()[name])


def test_the_reviewers_repeated_min_gpus():
    make_listed_node(gpu_count=2)
    assert APIClient().get(URL + "?min_gpus=4&min_gpus=1").status_code == 400


def test_filters_of_several_values_still_take_them():
    a = make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=1)
    h = make_listed_node(gpu_model="h100-sxm", gpu_count=1)
    response = APIClient().get(URL + "?gpu_model=a100-80gb-sxm&gpu_model=h100-sxm")
    assert sorted(o["id"] for o in response.json()["results"]) == sorted([a.pk, h.pk])
    # The same value twice of a multiple choice is fine too.
    response = APIClient().get(URL + "?gpu_model=a100-80gb-sxm&gpu_model=a100-80gb-sxm")
    assert [o["id"] for o in response.json()["results"]] == [a.pk]


def test_other_strict_filtersets_refuse_a_repeat_and_take_their_multiple_choices():
    client = APIClient()
    client.force_authenticate(UserFactory())
    assert client.get("/api/v1/billing/events/?kind=low_balance&kind=refund").status_code == 200
    response = client.get("/api/v1/billing/usage/?instance=1&instance=2")
    assert response.status_code == 400 and "instance" in response.json()


def test_the_offers_page_answers_a_repeated_filter_with_its_400():
    make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=2)
    make_listed_node(gpu_model="h100-sxm", gpu_count=2)
    assert Client().get("/offers/?min_gpus=4&min_gpus=1").status_code == 400
    assert Client().get("/offers/?gpu_model=a100-80gb-sxm&gpu_model=h100-sxm").status_code == 200
