"""The offers' price filter, price orders and min_gpus under `mig_profile` (found by review): they read the whole GPU's
price and free whole GPUs, so a server whose slices cost $0.30/slice-hour and whose card $4/h was hidden by
max_price_per_gpu_hour=1 (booking a slice worked, at $0.30), the price orders ranked slices by their card's price,
and min_gpus=2 hid a server whose cards are all split with seven free slices. Under `mig_profile` they now read
what booking a slice charges, the node's price per slice-hour of that profile, and count its free slices."""
import re
from urllib.parse import urlencode

import pytest
from django.http import QueryDict
from django.test import Client
from rest_framework.test import APIClient

from marketplace import selectors
from marketplace.api.offer_query import UNCACHED, OfferQuery
from marketplace.api.offer_rows import OFFER_COLUMNS
from marketplace.api.offers import OfferFilter
from marketplace.models import Node
from tests.factories import UserFactory, make_listed_node

from .mig_helpers import make_mig_node
from .renting_helpers import book, sent_jobs_fixture  # noqa: F401
from .test_offer_query import _django_runs, _fresh_cache, _get, _same_params, _uncached  # noqa: F401

pytestmark = pytest.mark.django_db

URL = "/api/v1/offers/"


def ids(params) -> list[int]:
    response = APIClient().get(URL, params)
    assert response.status_code == 200, response.content
    return [o["id"] for o in response.json()["results"]]


@pytest.fixture
def two_prices():
    """`cheap_slices`: $4/GPU-hour, 1g.10gb at $0.30/slice-hour; `cheap_card`: $1/GPU-hour, 1g.10gb at $0.50.
    Same score: by whole-GPU price the card's server ranks first, by slice price the other."""
    cheap_slices = make_mig_node({0: ["1g.10gb"] * 7}, prices={"1g.10gb": "0.300000"}, gpu_count=2, price="4.000000",
                                 score=2.0)
    cheap_card = make_mig_node({0: ["1g.10gb"] * 7}, prices={"1g.10gb": "0.500000"}, gpu_count=2, price="1.000000",
                               score=2.0)
    return cheap_slices, cheap_card


def test_max_price_filter_with_a_mig_profile_hides_cheap_slices():
    """The reviewer's example."""
    node = make_mig_node({0: ["1g.10gb"] * 7}, prices={"1g.10gb": "0.300000"}, gpu_count=2, price="4.000000")
    anon = APIClient()
    listed = anon.get(URL, {"mig_profile": "1g.10gb"}).json()["results"]
    assert [o["mig_slices"][0]["price_per_slice_hour"] for o in listed if o["id"] == node.pk] == ["0.300000"]
    cheap = anon.get(URL, {"mig_profile": "1g.10gb", "max_price_per_gpu_hour": "1"}).json()
    assert node.pk in [o["id"] for o in cheap["results"]]


def test_the_filter_matches_what_booking_a_slice_charges(two_prices):
    cheap_slices, cheap_card = two_prices
    assert ids({"mig_profile": "1g.10gb", "max_price_per_gpu_hour": "0.4"}) == [cheap_slices.pk]
    assert ids({"mig_profile": "1g.10gb", "max_price_per_gpu_hour": "0.3"}) == [cheap_slices.pk]  # at most: equal
    assert ids({"mig_profile": "1g.10gb", "max_price_per_gpu_hour": "0.299999"}) == []
    # The card's server: $1 a GPU, but a slice there costs $0.50, what its booking charges.
    assert cheap_card.pk not in ids({"mig_profile": "1g.10gb", "max_price_per_gpu_hour": "0.45"})
    instance = book(UserFactory(), cheap_slices, 1, mig_profile="1g.10gb")
    assert instance.price_per_hour_micros == 300_000
    # Without mig_profile, still the whole GPU's price.
    assert ids({"max_price_per_gpu_hour": "1"}) == [cheap_card.pk]
    assert ids({"max_price_per_gpu_hour": "4", "ordering": "price_per_gpu_hour"}) == [cheap_card.pk, cheap_slices.pk]


def test_price_orders_under_a_mig_profile_read_the_slice_price(two_prices):
    cheap_slices, cheap_card = two_prices
    mig = {"mig_profile": "1g.10gb"}
    assert ids({**mig, "ordering": "price_per_gpu_hour"}) == [cheap_slices.pk, cheap_card.pk]
    assert ids({**mig, "ordering": "-price_per_gpu_hour"}) == [cheap_card.pk, cheap_slices.pk]
    assert ids(mig) == [cheap_slices.pk, cheap_card.pk]  # the default, -score_per_dollar: more score per slice-$
    assert ids({**mig, "ordering": "-score_per_dollar"}) == [cheap_slices.pk, cheap_card.pk]
    assert ids({**mig, "ordering": "score_per_dollar"}) == [cheap_card.pk, cheap_slices.pk]
    assert ids({**mig, "ordering": "-score,price_per_gpu_hour"}) == [cheap_slices.pk, cheap_card.pk]
    # Without it, the whole GPU's.
    assert ids({"ordering": "price_per_gpu_hour"}) == [cheap_card.pk, cheap_slices.pk]
    assert ids({}) == [cheap_card.pk, cheap_slices.pk]


def test_min_gpus_under_a_mig_profile_counts_its_free_slices():
    all_split = make_mig_node({0: ["1g.10gb"] * 7}, gpu_count=1)  # no whole GPU free, seven slices
    one_slice = make_mig_node({0: ["7g.80gb"], 1: ["1g.10gb"]}, gpu_count=4)  # two whole GPUs free, one 1g slice
    assert ids({"mig_profile": "1g.10gb", "min_gpus": "2"}) == [all_split.pk]
    assert ids({"mig_profile": "1g.10gb", "min_gpus": "7"}) == [all_split.pk]
    assert ids({"mig_profile": "1g.10gb", "min_gpus": "8"}) == []
    assert sorted(ids({"mig_profile": "1g.10gb", "min_gpus": "1"})) == sorted([all_split.pk, one_slice.pk])
    assert ids({"mig_profile": "7g.80gb", "min_gpus": "1"}) == [one_slice.pk]
    # Without mig_profile, whole free GPUs.
    assert ids({"min_gpus": "2"}) == [one_slice.pk]
    # Two slices booked: five left.
    book(UserFactory(), all_split, 2, mig_profile="1g.10gb")
    assert ids({"mig_profile": "1g.10gb", "min_gpus": "5"}) == [all_split.pk]
    assert ids({"mig_profile": "1g.10gb", "min_gpus": "6"}) == []


def test_the_offers_page_filters_and_sorts_by_the_slice_price(two_prices):
    cheap_slices, cheap_card = two_prices
    page = Client().get("/offers/", {"mig_profile": "1g.10gb", "max_price_per_gpu_hour": "0.4"}).content.decode()
    assert [int(i) for i in re.findall(r'href="/offers/(\d+)/rent/', page)] == [cheap_slices.pk]
    assert "Per slice-hour when a MIG slice is chosen" in page
    page = Client().get("/offers/", {"mig_profile": "1g.10gb", "ordering": "-price_per_gpu_hour"}).content.decode()
    assert [int(i) for i in re.findall(r'href="/offers/(\d+)/rent/', page)] == [cheap_card.pk, cheap_slices.pk]


MIG_COMBINATIONS = [
    {"mig_profile": "1g.10gb", "max_price_per_gpu_hour": "0.4"},
    {"mig_profile": "1g.10gb", "max_price_per_gpu_hour": "1", "ordering": "price_per_gpu_hour"},
    {"mig_profile": "1g.10gb", "ordering": "-price_per_gpu_hour"},
    {"mig_profile": "1g.10gb", "ordering": "score_per_dollar"},
    {"mig_profile": "1g.10gb"},
    {"mig_profile": "1g.10gb", "min_gpus": "2", "max_price_per_gpu_hour": "5"},
    {"mig_profile": "1g.10gb", "min_gpus": "3", "ordering": "-reliability"},
]


@pytest.mark.parametrize("params", MIG_COMBINATIONS, ids=lambda p: urlencode(p))
def test_the_cached_sql_of_these_shapes_is_djangos_and_answers_alike(two_prices, params, monkeypatch):
    """offer_query's templates (the list's fast path) for the new expressions: Django's SQL and parameters, the
    same answer and queries cached and uncached, and a shape filled by one value serving another."""
    base = selectors.offers_search(values_list=OFFER_COLUMNS)
    filterset = OfferFilter(QueryDict(urlencode(params)), queryset=base)
    assert filterset.is_valid(), filterset.errors
    query = OfferQuery(filterset, base)
    [(count_sql, count_params)] = _django_runs(filterset.qs, lambda qs: qs.count())
    count = query.count()
    assert count == filterset.qs.count() >= 1
    [(page_sql, page_params)] = _django_runs(filterset.qs, lambda qs: list(qs[0:count]))
    for kind, limits, sql, django_params in (("count", None, count_sql, count_params),
                                             ("page", (0, count), page_sql, page_params)):
        template = query.template(kind, limits)
        assert template is not UNCACHED, f"{kind} of {params} is not cached"
        assert template.sql == sql
        assert _same_params(template.bind(query.values), django_params)
    anon = APIClient()
    expected, expected_sql = _uncached(anon, params, monkeypatch)
    for _ in range(2):
        got, got_sql = _get(anon, params)
        assert (got.status_code, got.content, got_sql) == (200, expected.content, expected_sql)


def test_a_cached_shape_takes_each_requests_price_and_count(two_prices, monkeypatch):
    cheap_slices, cheap_card = two_prices
    for price, expected in (("0.4", [cheap_slices.pk]), ("0.6", [cheap_slices.pk, cheap_card.pk]), ("0.2", [])):
        assert ids({"mig_profile": "1g.10gb", "max_price_per_gpu_hour": price}) == expected
    for count, expected in (("7", [cheap_slices.pk, cheap_card.pk]), ("8", [])):
        assert ids({"mig_profile": "1g.10gb", "min_gpus": count}) == expected


def test_a_whole_gpu_offer_is_untouched_by_the_slice_rules():
    """A node without MIG prices never matches a mig_profile search, at any price (booking refuses it a slice)."""
    plain = make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=2, price="0.100000")
    assert ids({"mig_profile": "1g.10gb", "max_price_per_gpu_hour": "1000"}) == []
    assert ids({"max_price_per_gpu_hour": "0.1"}) == [plain.pk]
    assert Node.objects.get(pk=plain.pk).mig_prices_micros == {}
