"""The offers list's fast path (offer_row + FastJSONRenderer) writes the very bytes OfferSerializer + JSONRenderer
wrote: over varied offers, filters and orderings, and for every shape of a benchmark summary. Compared as bytes of
the same encoder, so a dropped field, a field moved, 1 for 1.0 or "0.79" for "0.790000" fails."""
import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from urllib.parse import urlencode
from uuid import UUID

import pytest
from django.http import QueryDict
from django.utils.translation import gettext_lazy
from rest_framework.renderers import JSONRenderer

from core.api.fields import UsdField
from core.api.renderers import FastJSONRenderer
from marketplace.api.offer_rows import benchmark_summary, usd_text
from marketplace.api.offers import BenchmarkSummarySerializer, OfferFilter, OfferSerializer
from marketplace.models import Gpu, GpuStatus, Node, NodeState, Verdict
from marketplace.selectors import offers_search
from tests.factories import make_listed_node, make_node

pytestmark = pytest.mark.django_db

URL = "/api/v1/offers/"

SUMMARIES = [
    {},
    {"checked_at": "2026-01-02T03:04:05.678901+00:00", "verdict": "verified",
     "median_per_gpu": {"bf16_tflops": 301.5, "tf32_tflops": 150, "fp32_tflops": None, "memory_bandwidth_gbs": 2039.1,
                        "h2d_gbs": 24.75, "cnn_train_images_s": 1812.0, "cnn_infer_images_s": 9000},
     "findings": ["gpu_clock_low", "pcie_downtrained"]},
    {"checked_at": "2026-01-02T03:04:05+00:00", "verdict": "degraded", "median_per_gpu": {"bf16_tflops": 1.0},
     "findings": []},
    {"verdict": "verified", "median_per_gpu": None, "findings": None, "extra": {"not": "shown"}},
    {"checked_at": None, "verdict": None, "median_per_gpu": {}},
    {"checked_at": "", "findings": [None, 3]},
    # NVLink read and measured, power under load (issue 17); and a node read without NVLink.
    {"checked_at": "2026-02-03T04:05:06+00:00", "verdict": "verified",
     "median_per_gpu": {"bf16_tflops": 280.0, "power_draw_w": 398.5, "bf16_tflops_per_w": 0.7026},
     "nvlink": {"connected": True, "islands": [[0, 1, 2, 3], [4, 5, 6, 7]], "links_per_gpu": 12, "p2p_gbs": 226.5,
                "pcie_p2p_gbs": 22.1}},
    {"verdict": "verified", "nvlink": {"connected": False, "islands": [], "links_per_gpu": None, "p2p_gbs": 21.0,
                                       "pcie_p2p_gbs": 21}},
    {"verdict": "verified", "nvlink": None},
]


def _varied_offers() -> list[Node]:
    nodes = [
        make_listed_node(gpu_model="rtx-a6000", gpu_count=8, price="0.790000", score=1.2, reliability=0.97,
                         country="NL", city="Amsterdam", datacenter="AMS3", runtime="docker"),
        make_listed_node(gpu_model="rtx-4090", gpu_count=1, price="0.000001", score=0.0, reliability=0.0,
                         country="BR", city="São Paulo", datacenter=""),
        make_listed_node(gpu_model="h100-sxm", gpu_count=8, price="12345.678901", score=3.25, reliability=1.0,
                         country="JP", city="東京", datacenter="TYO\u20281"),
        make_node(state=NodeState.ACTIVE, verdict=Verdict.DEGRADED, gpu_model="a100-80gb-pcie", gpu_count=4,
                  price="1.000000", score=0.6, reliability=0.5, country="US", city=""),
        make_listed_node(gpu_model="rtx-3090", gpu_count=2, price="0.200000", score=1.0 / 3, reliability=0.123456789),
        make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=6, price="2.500000", score=2, reliability=0.9),
        make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=8, price="2.600000", score=2.5, reliability=0.95),
        make_listed_node(gpu_model="rtx-a4000", gpu_count=2, price="0.170000", score=0.4, reliability=0.99),
        make_listed_node(gpu_model="rtx-a5000", gpu_count=2, price="0.250000", score=0.5, reliability=0.98),
    ]
    for node, summary in zip(nodes, SUMMARIES, strict=True):
        Node.objects.filter(pk=node.pk).update(benchmark_summary=summary)
    # Host facts: measured on some nodes, null on others; a datetime with and without microseconds.
    Node.objects.filter(pk=nodes[0].pk).update(
        cpu_model="AMD EPYC 7543 32-Core Processor", cpu_cores=64, ram_gb=503, disk_free_gb=1800,
        disk_bandwidth_mbs=1523.5, driver_version="550.90.07", cuda_version=12040, pcie_gen=4, pcie_width=16,
        net_mbps=940.25, host_checked_at=datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC),
        disk_price_per_gb_month_micros=123_456)
    Node.objects.filter(pk=nodes[2].pk).update(
        cpu_cores=1, ram_gb=0, disk_bandwidth_mbs=0.0, cuda_version=11080, pcie_gen=5, pcie_width=8, net_mbps=1.0,
        host_checked_at=datetime(2026, 6, 1, tzinfo=UTC), disk_price_per_gb_month_micros=0)
    # Rented GPUs: num_gpus_free below the total.
    for gpu in Gpu.objects.filter(node=nodes[0]).order_by("index")[:5]:
        gpu.status = GpuStatus.RENTED
        gpu.save(update_fields=["status"])
    return nodes


def _serializer_bytes(body: dict, params: dict) -> bytes:
    """What the list answered before the fast path: the same page through OfferSerializer and JSONRenderer."""
    filtered = OfferFilter(data=QueryDict(urlencode(params, doseq=True)), queryset=offers_search())
    assert filtered.is_valid(), filtered.errors
    page = filtered.qs[: int(params.get("page_size", 50))]
    rows = OfferSerializer(page, many=True).data
    return JSONRenderer().render({"count": body["count"], "next": body["next"], "previous": body["previous"],
                                  "results": rows})


@pytest.mark.parametrize("params", [
    {"page_size": "200"},
    {"ordering": "price_per_gpu_hour"},
    {"ordering": "-pcie_gen", "page_size": "3"},
    {"gpu_model": ["rtx-a6000", "h100-sxm"], "min_gpus": "2"},
    {"country": "BR", "city": "são paulo"},
])
def test_the_list_writes_the_serializers_bytes(anon, params):
    _varied_offers()
    response = anon.get(URL, params)
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["results"], "the comparison needs rows"
    assert response.content == _serializer_bytes(body, params)


def test_every_offer_is_compared(anon):
    nodes = _varied_offers()
    body = anon.get(URL, {"page_size": "200"}).json()
    assert sorted(row["id"] for row in body["results"]) == sorted(node.pk for node in nodes)
    assert len(body["results"][0]) == len(OfferSerializer.Meta.fields)


@pytest.mark.parametrize("summary", [*SUMMARIES, None])
def test_benchmark_summary_is_the_nested_serializers(summary):
    expected = None if summary is None else BenchmarkSummarySerializer(summary).data
    assert json.dumps(benchmark_summary(summary)) == json.dumps(expected)


@pytest.mark.parametrize("micros", [0, 1, 999_999, 1_000_000, 790_000, 12_345_678_901, 999_999_999_999, -1,
                                    -1_500_000])
def test_usd_text_is_usd_fields(micros):
    assert usd_text(micros) == UsdField().to_representation(micros)


@pytest.mark.parametrize("data", [
    {"a": 1, "b": 1.0, "c": 0.1, "d": None, "e": True, "f": [1, "x"], "g": {"h": "ü東\u2028\u2029\"\\"}},
    {"price": Decimal("0.790000"), "lazy": gettext_lazy("Not found."), "when": datetime(2026, 1, 2, tzinfo=UTC),
     "micro": datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC), "day": datetime(2026, 1, 2).date(),
     "uuid": UUID("12345678-1234-5678-1234-567812345678"), "delta": timedelta(seconds=90)},
    [1.5, 2e-4, 123456789.123, 1e15],
])
def test_the_renderer_writes_jsonrenderers_bytes(data):
    assert FastJSONRenderer().render(data) == JSONRenderer().render(data)


def test_the_renderer_falls_back_for_what_orjson_refuses():
    for data in ({1: "int key"}, {"big": 2**70}):
        assert FastJSONRenderer().render(data) == JSONRenderer().render(data)
    indented = "application/json; indent=2"
    assert FastJSONRenderer().render({"a": 1}, indented) == JSONRenderer().render({"a": 1}, indented)


def test_tiny_floats_are_the_same_number():
    data = {"x": 1e-05, "y": 2.5e-07, "z": 1e16}
    assert json.loads(FastJSONRenderer().render(data)) == data
