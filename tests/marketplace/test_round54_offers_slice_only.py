"""Review r54 (offers), finding 1: a node whose cards are all split into MIG slices (no whole GPU free) was ranked
and price-filtered by its whole GPU's price, which nobody can book there: a card priced $0.10 whose slices cost
$0.90 came first by `ordering=price_per_gpu_hour`, and matched `max_price_per_gpu_hour=0.2`. Without mig_profile the
whole-GPU price now applies only where a whole GPU is free: such an offer does not match a GPU-hour price bound and
comes after the whole-GPU offers in the price_per_gpu_hour orders (ascending or descending). The score_per_dollar
orders (the default among them) stay an index's order, for speed: there a slice-only offer ranks by its whole GPU's
figure, and its row says it rents slices only."""
from urllib.parse import urlencode

import pytest
from django.http import QueryDict
from rest_framework.test import APIClient

from marketplace import selectors
from marketplace.api.offer_query import UNCACHED, OfferQuery
from marketplace.api.offer_rows import OFFER_COLUMNS
from marketplace.api.offers import OfferFilter
from tests.factories import make_listed_node

from .mig_helpers import make_mig_node
from .test_offer_query import _django_runs, _fresh_cache, _get, _same_params, _uncached  # noqa: F401

pytestmark = pytest.mark.django_db

URL = "/api/v1/offers/"


def ids(params) -> list[int]:
    response = APIClient().get(URL, params)
    assert response.status_code == 200, response.content
    return [o["id"] for o in response.json()["results"]]


@pytest.fixture
def fleet():
    """`slices_only`: both cards split, $0.10 a (unbookable) GPU-hour, 1g.10gb at $0.90; `whole`: $0.50/GPU-hour;
    `dear`: $3/GPU-hour. Same score."""
    slices_only = make_mig_node({0: ["1g.10gb"] * 7, 1: ["1g.10gb"] * 7}, gpu_count=2, price="0.100000",
                                prices={"1g.10gb": "0.900000"}, score=2.0)
    whole = make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=2, price="0.500000", score=2.0)
    dear = make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=2, price="3.000000", score=2.0)
    return slices_only, whole, dear


def test_the_reviewers_order_and_bound(fleet):
    slices_only, whole, dear = fleet
    first = APIClient().get(URL, {"ordering": "price_per_gpu_hour"}).json()["results"][0]
    assert first["id"] == whole.pk
    assert slices_only.pk not in ids({"max_price_per_gpu_hour": "0.2"})
    assert ids({"max_price_per_gpu_hour": "0.5"}) == [whole.pk]
    # Still listed, with its slices (and bookable by them).
    assert slices_only.pk in ids({})
    assert ids({"mig_profile": "1g.10gb", "max_price_per_gpu_hour": "0.9"}) == [slices_only.pk]


@pytest.mark.parametrize("ordering", ["price_per_gpu_hour", "-price_per_gpu_hour"])
def test_slice_only_offers_come_after_whole_gpu_offers_in_the_price_orders(fleet, ordering):
    slices_only, whole, dear = fleet
    got = ids({"ordering": ordering})
    assert got[-1] == slices_only.pk
    cheap_first = [whole.pk, dear.pk]
    assert got[:-1] == (cheap_first if ordering == "price_per_gpu_hour" else cheap_first[::-1])


@pytest.mark.parametrize("ordering", ["-score_per_dollar", ""])
def test_the_score_per_dollar_orders_stay_the_index_order(fleet, ordering):
    slices_only, whole, dear = fleet
    assert ids({"ordering": ordering} if ordering else {}) == [slices_only.pk, whole.pk, dear.pk]


def test_other_orders_keep_slice_only_offers_in_place(fleet):
    slices_only, whole, dear = fleet
    node = slices_only
    node.reliability = 0.5
    node.save(update_fields=["reliability"])
    assert ids({"ordering": "reliability"})[0] == slices_only.pk


def test_a_node_with_a_whole_gpu_free_beside_its_slices_keeps_its_price(fleet):
    slices_only, whole, dear = fleet
    mixed = make_mig_node({0: ["1g.10gb"] * 7}, gpu_count=2, price="0.200000", score=2.0)
    assert ids({"max_price_per_gpu_hour": "0.2"}) == [mixed.pk]
    assert ids({"ordering": "price_per_gpu_hour"}) == [mixed.pk, whole.pk, dear.pk, slices_only.pk]


COMBINATIONS = [
    {"max_price_per_gpu_hour": "0.6"},
    {"max_price_per_gpu_hour": "5", "ordering": "price_per_gpu_hour"},
    {"ordering": "-price_per_gpu_hour"},
    {"ordering": "score_per_dollar"},
    {},
    {"min_gpus": "1", "max_price_per_gpu_hour": "5", "ordering": "-score_per_dollar"},
    {"ordering": "-reliability"},
]


@pytest.mark.parametrize("params", COMBINATIONS, ids=lambda p: urlencode(p) or "none")
def test_the_cached_sql_of_these_shapes_is_djangos_and_answers_alike(fleet, params, monkeypatch):
    """offer_query's templates (the list's fast path) for the whole-GPU expressions: Django's SQL and parameters,
    the same answer and queries cached and uncached."""
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


def test_a_cached_shape_takes_each_requests_bound(fleet):
    slices_only, whole, dear = fleet
    for price, expected in (("0.4", []), ("0.5", [whole.pk]), ("3", [whole.pk, dear.pk]), ("0.1", [])):
        assert ids({"max_price_per_gpu_hour": price}) == expected
