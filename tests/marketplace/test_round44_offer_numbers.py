"""A node's stored benchmark summary with numbers no float (or no 64-bit integer) holds: every offers listing still
answers, with each such figure null (found by review: `_float(10**400)` raised OverflowError, a 500 on every page
that held the node; a figure read back as inf was written as such, which JSON cannot carry: an indented answer was a 500
and the offers page printed "inf GB/s p2p").

jsonb keeps any number: 1e400 reads back (Python's json) as a 401-digit int that float() cannot convert, and one
with a fraction (10**400 + 0.5) as float inf. Neither is what a node's answer can store today (core.untrusted_json
refuses both), but a summary written before, by hand or by a migration must not take the offers down."""
import json
import re
from decimal import Decimal

import pytest
from django.db import connection
from django.test import Client
from rest_framework.test import APIClient

from marketplace.api import offer_rows
from marketplace.api.offer_rows import benchmark_summary, nvlink_summary
from marketplace.api.offers import BenchmarkSummarySerializer
from marketplace.models import Node
from tests.factories import make_listed_node

pytestmark = pytest.mark.django_db

HUGE = "1" + "0" * 400  # an integer beyond a float's range
# Stored as jsonb text: 1e400 and 10**400 + 0.5 cannot be written through Python's json.
SUMMARY = (
    '{"verdict": "verified", "checked_at": "2026-01-02T03:04:05+00:00",'
    ' "median_per_gpu": {"bf16_tflops": 1e400, "tf32_tflops": ' + HUGE + ', "fp32_tflops": -1e400,'
    ' "memory_bandwidth_gbs": 2039.5, "h2d_gbs": 1e400, "cnn_train_images_s": "fast",'
    ' "cnn_infer_images_s": ' + HUGE + '.5, "power_draw_w": {"w": 1}, "bf16_tflops_per_w": 0.7},'
    ' "nvlink": {"connected": true, "islands": [[0, 1, ' + HUGE + ']], "links_per_gpu": ' + HUGE + ','
    ' "p2p_gbs": ' + HUGE + '.5, "pcie_p2p_gbs": ' + HUGE + '}}'
)
NULLED = ("bf16_tflops", "tf32_tflops", "fp32_tflops", "h2d_gbs", "cnn_train_images_s", "cnn_infer_images_s",
          "power_draw_w")


def _no_constant(name):
    raise AssertionError(f"the answer holds {name}, which is not JSON")


def _strict(content: bytes):
    return json.loads(content, parse_constant=_no_constant)


@pytest.fixture
def node():
    node = make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=2)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE marketplace_node SET benchmark_summary = %s::jsonb WHERE id = %s", [SUMMARY, node.pk])
    stored = Node.objects.get(pk=node.pk).benchmark_summary
    # jsonb writes 1e400 back with all its digits (an int to Python's json); one with a fraction reads as inf.
    medians = stored["median_per_gpu"]
    assert medians["bf16_tflops"] == 10**400 and medians["cnn_infer_images_s"] == float("inf")
    return node


def _check_benchmark(benchmark):
    medians = benchmark["median_per_gpu"]
    for name in NULLED:
        assert medians[name] is None, (name, medians[name])
    assert medians["memory_bandwidth_gbs"] == 2039.5 and medians["bf16_tflops_per_w"] == 0.7
    nvlink = benchmark["nvlink"]
    assert nvlink == {"connected": True, "islands": [[0, 1]], "links_per_gpu": None, "p2p_gbs": None,
                      "pcie_p2p_gbs": None}


@pytest.mark.parametrize("accept", [None, "application/json; indent=2"])
def test_the_offers_list_and_the_offer_answer_with_the_figures_null(node, accept):
    headers = {"HTTP_ACCEPT": accept} if accept else {}
    listed = APIClient().get("/api/v1/offers/", **headers)
    assert listed.status_code == 200, listed.content[:300]
    (offer,) = _strict(listed.content)["results"]
    _check_benchmark(offer["benchmark"])
    assert offer["nvlink"] is True
    one = APIClient().get(f"/api/v1/offers/{node.pk}/", **headers)
    assert one.status_code == 200, one.content[:300]
    assert _strict(one.content)["benchmark"] == offer["benchmark"]


def test_the_fast_path_and_the_serializer_agree_on_them(node):
    stored = Node.objects.get(pk=node.pk).benchmark_summary
    assert benchmark_summary(stored) == BenchmarkSummarySerializer(stored).data
    _check_benchmark(benchmark_summary(stored))


def test_the_offers_page_prints_no_inf(node):
    page = Client().get("/offers/")
    assert page.status_code == 200
    text = page.content.decode()
    assert "NVLink" in text and not re.search(r"NVLink (inf|nan|\d{20})", text, re.IGNORECASE) and HUGE not in text


def test_the_vast_search_answers_without_the_figure(node):
    search = APIClient().post("/compat/vast/api/v0/bundles/", {"limit": 5}, format="json")
    assert search.status_code == 200, search.content[:300]
    offers = _strict(search.content)["offers"]
    assert offers and all("pcie_bw" not in o or o["pcie_bw"] is None for o in offers)
    for query in ({"pcie_bw": {"gte": 1}}, {"order": [["pcie_bw", "desc"]]}):
        answer = APIClient().post("/compat/vast/api/v0/bundles/", query, format="json")
        assert answer.status_code == 200, (query, answer.content[:300])
    assert _strict(APIClient().post("/compat/vast/api/v0/bundles/", {"pcie_bw": {"gte": 1}},
                                    format="json").content)["offers"] == []


def test_a_text_figure_in_the_vast_search_is_no_500():
    """A figure stored as text compared with a number in Python: a TypeError, the search's 500."""
    node = make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=1)
    Node.objects.filter(pk=node.pk).update(benchmark_summary={"median_per_gpu": {"h2d_gbs": "fast"}})
    other = make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=1)
    Node.objects.filter(pk=other.pk).update(benchmark_summary={"median_per_gpu": {"h2d_gbs": 24.5}})
    for query in ({"pcie_bw": {"gte": 1}}, {"order": [["pcie_bw", "desc"]]}):
        answer = APIClient().post("/compat/vast/api/v0/bundles/", query, format="json")
        assert answer.status_code == 200, (query, answer.content[:300])
    found = APIClient().post("/compat/vast/api/v0/bundles/", {"pcie_bw": {"gte": 1}}, format="json").json()
    assert [o["machine_id"] for o in found["offers"]] == [other.pk]


@pytest.mark.parametrize(("value", "expected"), [
    (None, None), (1, 1.0), (2.5, 2.5), ("2.5", 2.5), (float("inf"), None), (float("-inf"), None),
    (float("nan"), None), (10**400, None), (-(10**400), None), ("1e999", None), ("nan", None), ("x", None),
    ({}, None), ([], None), (Decimal("1e400"), None), (Decimal("NaN"), None), (Decimal("sNaN"), None),
    (Decimal("0.75"), 0.75),
])
def test_finite_float(value, expected):
    assert offer_rows.finite_float(value) == expected


def test_nvlink_integers_beyond_64_bits_are_null():
    summary = nvlink_summary({"connected": True, "islands": [], "links_per_gpu": 2**63, "p2p_gbs": 1,
                              "pcie_p2p_gbs": None})
    assert summary is not None and summary["links_per_gpu"] is None
    assert nvlink_summary({"connected": True, "links_per_gpu": 12.0})["links_per_gpu"] == 12  # type: ignore[index]
    assert nvlink_summary({"connected": True, "links_per_gpu": float("nan")})["links_per_gpu"] is None  # type: ignore[index]
