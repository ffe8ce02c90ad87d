"""The offers list's SQL cached per query shape (marketplace/api/offer_query.py) is Django's SQL: for every filter,
several values each, orderings and pages, the cached SQL and parameters equal those Django compiles and runs for the
same request, the queries a request runs are the same strings, and the answers are the same bytes; a shape filled
by one request serves the next with other values correctly."""
import json
from urllib.parse import urlencode

import pytest
from django.db import connection
from django.http import QueryDict
from django.test.utils import CaptureQueriesContext

from marketplace import selectors
from marketplace.api import offer_query
from marketplace.api.offer_query import UNCACHED, OfferQuery, _json_loads
from marketplace.api.offer_rows import OFFER_COLUMNS
from marketplace.api.offers import OfferFilter
from marketplace.models import Node
from tests import module_rows
from tests.marketplace.mig_helpers import make_mig_node
from tests.marketplace.test_offer_rows import _varied_offers

pytestmark = pytest.mark.django_db

URL = "/api/v1/offers/"

# Every filter, several values each; multi-valued gpu_model; every ordering; pages, last partial pages.
COMBINATIONS = [
    {},
    {"page_size": "3"}, {"page_size": "3", "page": "2"}, {"page_size": "4", "page": "3"}, {"page_size": "200"},
    {"gpu_model": "rtx-a6000"}, {"gpu_model": "a100-80gb-sxm"}, {"gpu_model": "rtx-4090"},
    {"gpu_model": ["rtx-a6000", "h100-sxm"]}, {"gpu_model": ["h100-sxm", "rtx-a6000"]},
    {"gpu_model": ["a100-80gb-sxm", "rtx-3090", "rtx-a4000"]}, {"gpu_model": ["rtx-a5000", "rtx-a5000"]},
    {"gpu_model": ["a100-80gb-sxm", "rtx-a6000"], "min_gpus": "2", "ordering": "price_per_gpu_hour"},
    {"min_gpus": "1"}, {"min_gpus": "3"}, {"min_gpus": "8"},
    {"min_gpu_memory_gb": "0"}, {"min_gpu_memory_gb": "40"}, {"min_gpu_memory_gb": "80"},
    {"max_price_per_gpu_hour": "0.25"}, {"max_price_per_gpu_hour": "2.5", "ordering": "price_per_gpu_hour"},
    {"max_price_per_gpu_hour": "0.000001"}, {"max_price_per_gpu_hour": "1000000"},
    {"country": "NL"}, {"country": "BR"}, {"country": "US", "city": "Ashburn"},
    {"city": "amsterdam"}, {"city": "SÃO PAULO"}, {"city": "東京"}, {"country": "JP", "city": "東京"},
    {"min_reliability": "0"}, {"min_reliability": "0.95"}, {"min_reliability": "1"},
    {"min_score": "0.5", "ordering": "-score"}, {"min_score": "2"},
    {"min_cpu_cores": "1"}, {"min_cpu_cores": "64"}, {"min_ram_gb": "0"}, {"min_ram_gb": "100"},
    {"min_disk_free_gb": "1000"}, {"min_disk_bandwidth_mbs": "0"}, {"min_disk_bandwidth_mbs": "1000.5"},
    {"min_pcie_gen": "4"}, {"min_pcie_gen": "5"}, {"min_pcie_width": "8"}, {"min_pcie_width": "16"},
    {"min_platform_to_node_mbps": "1"}, {"min_platform_to_node_mbps": "900.75"},
    {"min_cuda_version": "11.8"}, {"min_cuda_version": "12.4"}, {"min_cuda_version": "12.1"},
    {"mig_profile": "3g.40gb"}, {"mig_profile": "1g.10gb"}, {"mig_profile": "7g.80gb"},
    {"nvlink": "true"}, {"nvlink": "false"}, {"nvlink": "false", "gpu_model": "a100-80gb-sxm"},
    {"ordering": "score"}, {"ordering": "-score_per_dollar"}, {"ordering": "reliability"},
    {"ordering": "-reliability", "min_gpus": "8"}, {"ordering": "-price_per_gpu_hour", "page_size": "2", "page": "2"},
    {"ordering": "cpu_cores"}, {"ordering": "-cuda_version"}, {"ordering": "pcie_width,-score"},
    {"ordering": "-platform_to_node_mbps"}, {"ordering": "ram_gb"},
    {"min_gpu_memory_gb": "24", "max_price_per_gpu_hour": "3", "min_reliability": "0.9", "ordering": "-score",
     "page_size": "2"},
    {"gpu_model": "a100-80gb-sxm", "min_gpus": "1", "min_gpu_memory_gb": "80", "max_price_per_gpu_hour": "5",
     "min_reliability": "0"},
]


@pytest.fixture(autouse=True)
def _fresh_cache():
    offer_query.clear()
    yield
    offer_query.clear()


def _build_offers() -> list[int]:
    nodes = _varied_offers()
    make_mig_node({0: ["3g.40gb", "2g.20gb", "1g.10gb"], 1: ["7g.80gb"]}, country="US", city="Ashburn",
                  reliability=0.96, score=2.2)
    Node.objects.filter(pk=nodes[5].pk).update(
        benchmark_summary={"nvlink": {"connected": True, "islands": [[0, 1, 2, 3, 4, 5]]}})
    return [node.pk for node in nodes]


@pytest.fixture(scope="module")
def offers_rows(request, django_db_setup, django_db_blocker):
    """The offers' rows, built once for the module (tests/module_rows.py): each test's writes are rolled back."""
    with module_rows.rows_for_module(request, django_db_blocker, _build_offers) as pks:
        yield pks


@pytest.fixture
def offers(offers_rows, db):
    by_pk = Node.objects.in_bulk(offers_rows)
    return [by_pk[pk] for pk in offers_rows]


def _get(client, params):
    with CaptureQueriesContext(connection) as captured:
        response = client.get(URL, params)
    return response, [q["sql"] for q in captured.captured_queries]


def _uncached(client, params, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(offer_query, "_shape", lambda cleaned: None)  # every shape: Django compiles, as before
        return _get(client, params)


def _django_runs(queryset, run):
    """(sql, params) of every query Django itself executes for `run(queryset)`."""
    executed = []

    def record(execute, sql, params, many, context):
        executed.append((sql, tuple(params)))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        run(queryset)
    return executed


def _same_params(a, b):
    return len(a) == len(b) and all(type(x) is type(y) and getattr(x, "obj", x) == getattr(y, "obj", y)
                                    for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("params", COMBINATIONS, ids=lambda p: urlencode(p, doseq=True) or "none")
def test_the_cached_sql_and_parameters_are_djangos(anon, offers, params, monkeypatch):
    filterset = OfferFilter(QueryDict(urlencode(params, doseq=True)),
                            queryset=selectors.offers_search(values_list=OFFER_COLUMNS))
    assert filterset.is_valid(), filterset.errors
    query = OfferQuery(filterset, selectors.offers_search(values_list=OFFER_COLUMNS))
    size = int(params.get("page_size", 50))
    page = int(params.get("page", 1))
    [(count_sql, count_params)] = _django_runs(filterset.qs, lambda qs: qs.count())
    count = query.count()
    assert count == filterset.qs.count()
    start, stop = (page - 1) * size, min(page * size, count)
    assert start < stop, "the combination must have rows on its page"
    [(page_sql, page_params)] = _django_runs(filterset.qs, lambda qs: list(qs[start:stop]))

    for kind, limits, sql, django_params in (("count", None, count_sql, count_params),
                                             ("page", (start, stop), page_sql, page_params)):
        template = query.template(kind, limits)
        assert template is not UNCACHED, f"{kind} of {params} is not cached"
        assert template.sql == sql
        assert _same_params(template.bind(query.values), django_params), (template.bind(query.values),
                                                                          django_params)
    assert query[start:stop] == list(filterset.qs[start:stop])


@pytest.mark.parametrize("params", COMBINATIONS, ids=lambda p: urlencode(p, doseq=True) or "none")
def test_the_answer_and_its_queries_are_the_uncached_ones(anon, offers, params, monkeypatch):
    expected, expected_sql = _uncached(anon, params, monkeypatch)
    first, first_sql = _get(anon, params)  # fills the cache
    second, second_sql = _get(anon, params)  # runs from it
    assert expected.status_code == first.status_code == second.status_code
    assert first.content == second.content == expected.content
    assert first_sql == second_sql == expected_sql
    if expected.status_code == 200:
        assert any(t is not UNCACHED for t in offer_query._cache.values()), "nothing was cached"


def test_a_shape_filled_by_one_request_serves_others_with_their_values(anon, offers, monkeypatch):
    # Filled by the first request of each shape, then asked with other values: each must be its own answer.
    variants = [
        [{"gpu_model": "rtx-a6000"}, {"gpu_model": "h100-sxm"}, {"gpu_model": "a100-80gb-sxm"}],
        [{"gpu_model": ["rtx-a6000", "h100-sxm"]}, {"gpu_model": ["rtx-4090", "a100-80gb-sxm"]},
         {"gpu_model": ["a100-80gb-sxm", "rtx-4090"]}, {"gpu_model": ["rtx-3090", "rtx-3090", "rtx-a4000"]}],
        [{"max_price_per_gpu_hour": "0.25", "ordering": "price_per_gpu_hour"},
         {"max_price_per_gpu_hour": "2.55", "ordering": "price_per_gpu_hour"},
         {"max_price_per_gpu_hour": "100", "ordering": "price_per_gpu_hour"}],
        [{"country": "NL"}, {"country": "BR"}, {"country": "US"}, {"country": "DE"}],
        [{"country": "US", "city": "Ashburn"}, {"country": "NL", "city": "AMSTERDAM"}],
        [{"min_reliability": "0.95", "min_gpus": "2"}, {"min_reliability": "0.5", "min_gpus": "1"},
         {"min_reliability": "0", "min_gpus": "8"}],
        [{"min_cuda_version": "12.4"}, {"min_cuda_version": "11.8"}, {"min_cuda_version": "99.0"}],
        [{"min_gpu_memory_gb": "80", "min_score": "2"}, {"min_gpu_memory_gb": "16", "min_score": "0.3"}],
        [{"min_pcie_gen": "5", "min_pcie_width": "8"}, {"min_pcie_gen": "4", "min_pcie_width": "16"}],
        [{"min_platform_to_node_mbps": "1"}, {"min_platform_to_node_mbps": "941"},
         {"min_disk_bandwidth_mbs": "1000", "min_cpu_cores": "2", "min_ram_gb": "1", "min_disk_free_gb": "1"}],
    ]
    for group in variants:
        for params in group:
            cached, cached_sql = _get(anon, params)
            expected, expected_sql = _uncached(anon, params, monkeypatch)
            assert cached.status_code == expected.status_code == 200, (params, cached.content)
            assert cached.content == expected.content, params
            assert cached_sql == expected_sql, params
    # The shapes were cached, not compiled per request: one template per shape and query.
    templates = [t for t in offer_query._cache.values() if t is not UNCACHED]
    assert len(templates) >= 2 * len(variants) - 2


@pytest.mark.parametrize("params, message", [
    ({"gpu_model": "no-such-gpu"}, "Select a valid choice. no-such-gpu is not one of the available choices."),
    ({"gpu_model": ["rtx-a6000", "no-such-gpu"]}, None),
    ({"min_gpus": "0"}, None), ({"min_gpus": "0.5"}, None), ({"country": "XX"}, None), ({"city": " "}, None),
    ({"min_cuda_version": "12"}, None), ({"nvlink": "maybe"}, None), ({"ordering": "nope"}, None),
    ({"page": "99"}, None), ({"page_size": "201"}, None), ({"colour": "red"}, None),
])
def test_bad_input_is_the_same_4xx(anon, offers, params, message, monkeypatch):
    expected, _ = _uncached(anon, params, monkeypatch)
    for _ in range(2):
        response = anon.get(URL, params)
        assert 400 <= response.status_code < 500
        assert (response.status_code, response.content) == (expected.status_code, expected.content)
    if message:
        assert response.json()["gpu_model"] == [message]


def test_the_cache_is_bounded(anon, offers, monkeypatch):
    monkeypatch.setattr(offer_query, "MAX_ENTRIES", 3)
    for size in range(1, 9):
        assert anon.get(URL, {"page_size": str(size)}).status_code == 200
        assert len(offer_query._cache) <= 3
    assert anon.get(URL, {"page_size": "1"}).json() == _uncached(anon, {"page_size": "1"}, monkeypatch)[0].json()


def test_a_shape_the_probe_cannot_describe_is_compiled_by_django(anon, offers, monkeypatch):
    def refuse(name, value, serial):
        raise ValueError(name)

    params = {"country": "NL", "min_gpus": "2"}
    expected, expected_sql = _uncached(anon, params, monkeypatch)
    monkeypatch.setattr(offer_query, "_probe", refuse)
    for _ in range(2):
        response, sql = _get(anon, params)
        assert (response.status_code, response.content, sql) == (200, expected.content, expected_sql)
    assert offer_query._cache and all(t is UNCACHED for t in offer_query._cache.values())


def test_json_columns_decode_as_django_decodes_them():
    """orjson for the page's JSON columns (offer_query._fast_json), Django's json.loads where orjson refuses."""
    for text in ('{"median_per_gpu": {"bf16_tflops": 312.5}, "findings": ["a"], "n": null}', "[1, 2.5e-3, true]",
                 '{"big": 123456789012345678901234567890}', '"\\u00e9\\ud83d\\ude00"'):
        assert _json_loads(text, None, None) == json.loads(text)
    assert _json_loads(None, None, None) is None
