"""Stored benchmark figures of the wrong kind: every reader answers 200 with the odd figure absent (found by review).

A node's benchmark summary (Node.benchmark_summary) and a verification run's figures and findings
(VerificationRun.figures / findings) are JSON the platform wrote from what a node's agent answered; jsonb keeps any
shape, and a row written before the answers were checked, by hand or by a migration holds what no check allows.
e6d2af1 made numbers no float holds come out as null; values of the wrong kind still broke the readers: a
`median_per_gpu` or `nvlink` that is no object, `findings` that is no list, a figure that is text, a bool or a list,
a `checked_at` that is no date made the offers API (list and single offer), the offers page and Vast's offer search
answer 500 (or show "True", "['x']" or a figure read out of text), and a run's figures or findings of the wrong kind
did the same to the provider's server page and the GPU comparison. Each now reads them through
marketplace.stored_figures, which returns only well-typed values: the odd one is null (the API) or not shown (the
pages), the rest as before.
"""
import copy
import json
from pathlib import Path

import pytest
from django.test import Client
from rest_framework.test import APIClient

from marketplace.api.offer_rows import benchmark_summary
from marketplace.api.offers import BenchmarkSummarySerializer, OfferSerializer
from marketplace.models import Node
from marketplace.services.instances.booking import RUNTIME_REFUSED_OPTIONS
from marketplace.services.volumes import VOLUMELESS_RUNTIMES
from provisioning.models import VerificationRun
from tests.factories import UserFactory, make_listed_node

pytestmark = pytest.mark.django_db

MEDIANS = {"bf16_tflops": 250.5, "tf32_tflops": 140.0, "fp32_tflops": 19.0, "memory_bandwidth_gbs": 1800.0,
           "h2d_gbs": 24.5, "cnn_train_images_s": 3000.0, "cnn_infer_images_s": 9000.0, "power_draw_w": 390.0,
           "bf16_tflops_per_w": 0.64}
GOOD = {"checked_at": "2026-01-02T03:04:05+00:00", "verdict": "verified", "median_per_gpu": MEDIANS,
        "nvlink": {"connected": True, "islands": [[0, 1]], "links_per_gpu": 12, "p2p_gbs": 400.0,
                   "pcie_p2p_gbs": None},
        "findings": ["bf16_low"]}
NVLINK_ABSENT = {"connected": False, "islands": [], "links_per_gpu": None, "p2p_gbs": None, "pcie_p2p_gbs": None}


def _with(**parts):
    summary = copy.deepcopy(GOOD)
    summary.update(parts)
    return summary


def _expected(**parts):
    """The API's `benchmark` for GOOD with `parts` as they are to read."""
    out = copy.deepcopy(GOOD)
    out.update(parts)
    return out


# name: (stored summary, the API's `benchmark`, the offer's `nvlink`, Vast's pcie_bw)
CASES = {
    "summary a list": ([GOOD], None, False, None),
    "summary text": ("verified", None, False, None),
    "summary a number": (7, None, False, None),
    "summary a bool": (True, None, False, None),
    "medians a list": (_with(median_per_gpu=[250.5]), _expected(median_per_gpu=None), True, None),
    "medians text": (_with(median_per_gpu="fast"), _expected(median_per_gpu=None), True, None),
    "medians a number": (_with(median_per_gpu=7), _expected(median_per_gpu=None), True, None),
    "figures of the wrong kind": (
        _with(median_per_gpu={**MEDIANS, "bf16_tflops": "250.5", "tf32_tflops": True, "fp32_tflops": [19.0],
                              "memory_bandwidth_gbs": {"gbs": 1800}, "h2d_gbs": "24.5"}),
        _expected(median_per_gpu={**MEDIANS, "bf16_tflops": None, "tf32_tflops": None, "fp32_tflops": None,
                                  "memory_bandwidth_gbs": None, "h2d_gbs": None}), True, None),
    "nvlink a list": (_with(nvlink=[[0, 1]]), _expected(nvlink=None), False, 24.5),
    "nvlink text": (_with(nvlink="yes"), _expected(nvlink=None), False, 24.5),
    "nvlink a bool": (_with(nvlink=True), _expected(nvlink=None), False, 24.5),
    "nvlink figures of the wrong kind": (
        _with(nvlink={"connected": "yes", "islands": "0-1", "links_per_gpu": "12", "p2p_gbs": True,
                      "pcie_p2p_gbs": [1.0]}), _expected(nvlink=NVLINK_ABSENT), False, 24.5),
    "nvlink islands of the wrong kind": (
        _with(nvlink={"connected": 1, "islands": [[0, "1", True, 1.5], "x", {"gpu": 1}], "links_per_gpu": 12.5,
                      "p2p_gbs": "400"}),
        _expected(nvlink={**NVLINK_ABSENT, "islands": [[0]]}), False, 24.5),
    "findings text": (_with(findings="bf16_low"), _expected(findings=None), True, 24.5),
    "findings an object": (_with(findings={"code": "bf16_low"}), _expected(findings=None), True, 24.5),
    "findings a number": (_with(findings=5), _expected(findings=None), True, 24.5),
    "findings of non-codes": (_with(findings=["bf16_low", {"code": "x"}, 5, None, ["y"], True]),
                              _expected(findings=["bf16_low"]), True, 24.5),
    "checked_at a number": (_with(checked_at=5), _expected(checked_at=None), True, 24.5),
    "checked_at a list": (_with(checked_at=["2026-01-02"]), _expected(checked_at=None), True, 24.5),
    "checked_at no date": (_with(checked_at="yesterday"), _expected(checked_at=None), True, 24.5),
    "verdict an object": (_with(verdict={"v": "verified"}), _expected(verdict=None), True, 24.5),
    "verdict a list": (_with(verdict=["verified"]), _expected(verdict=None), True, 24.5),
}


def _odd_node(summary):
    node = make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=2)
    Node.objects.filter(pk=node.pk).update(benchmark_summary=summary)
    return node


def _strict(content: bytes):
    def refuse(name):
        raise AssertionError(f"the answer holds {name}, which is not JSON")
    return json.loads(content, parse_constant=refuse)


@pytest.mark.parametrize("case", list(CASES))
def test_every_offers_reader_answers_with_the_odd_figure_absent(case):
    """The API's list (the fast path) and single offer (the serializer), its nvlink filter, the offers page and
    Vast's search: 200, the odd value null or not shown, the rest of the summary as stored."""
    summary, benchmark, nvlink, pcie_bw = CASES[case]
    node = _odd_node(summary)
    listed = APIClient().get("/api/v1/offers/")
    assert listed.status_code == 200, listed.content[:300]
    (offer,) = _strict(listed.content)["results"]
    assert offer["benchmark"] == benchmark
    assert offer["nvlink"] is nvlink
    one = APIClient().get(f"/api/v1/offers/{node.pk}/")
    assert one.status_code == 200, one.content[:300]
    assert _strict(one.content)["benchmark"] == benchmark and _strict(one.content)["nvlink"] is nvlink
    # The filter reads the column as stored (containment of a JSON true): it agrees with the answer's `nvlink`.
    with_nvlink = APIClient().get("/api/v1/offers/", {"nvlink": "true"})
    assert with_nvlink.status_code == 200 and with_nvlink.json()["count"] == (1 if nvlink else 0)
    # The fast path and the serializer, as OfferSerializer's `benchmark` field calls it (DRF writes a stored null
    # itself).
    assert benchmark_summary(summary) == benchmark
    assert BenchmarkSummarySerializer().to_representation(summary) == benchmark

    page = Client().get("/offers/")
    assert page.status_code == 200
    text = page.content.decode()
    assert "A100" in text  # the offer is listed
    assert ("· NVLink" in text) is nvlink
    assert "· NVLink 400 GB/s p2p" in text if nvlink else "GB/s p2p" not in text

    search = APIClient().post("/compat/vast/api/v0/bundles/", {"limit": 5}, format="json")
    assert search.status_code == 200, search.content[:300]
    offers = _strict(search.content)["offers"]
    assert offers and all(o.get("pcie_bw") == pcie_bw for o in offers)
    for query in ({"pcie_bw": {"gte": 1}}, {"order": [["pcie_bw", "desc"]]}):
        answer = APIClient().post("/compat/vast/api/v0/bundles/", query, format="json")
        assert answer.status_code == 200, (query, answer.content[:300])


# ----------------------------------------------------------------------- a verification run's figures

DATASHEET = {"bf16_tflops": 312.0, "fp16_tflops": 312.0, "tf32_tflops": 156.0, "fp32_tflops": 19.5,
             "memory_bandwidth_gbs": 2039.0}
GPU_ROW = {"bf16_tflops": 271.0, "fp16_tflops": 271.0, "tf32_tflops": 140.0, "fp32_tflops": 18.9,
           "memory_bandwidth_gbs": 1790.0, "score": 86.9, "sm_count": 108,
           "of_datasheet": {"bf16_tflops": 0.869, "fp16_tflops": 0.869, "tf32_tflops": 0.897, "fp32_tflops": 0.969,
                            "memory_bandwidth_gbs": 0.878}}
RUN_FIGURES = {
    "datasheet": DATASHEET,
    "median": {"bf16_tflops": 271.0, "tf32_tflops": 140.0, "fp32_tflops": 18.9, "memory_bandwidth_gbs": 1790.0,
               "cnn_train_images_s": 3000.0, "cnn_infer_images_s": 9000.0, "bf16_tflops_per_w": 0.64},
    "gpus": [{"index": i, **GPU_ROW} for i in range(2)],
    "challenge": {
        "gpus": {str(i): {"platform_elapsed_s": 4.12, "bf16_tflops": 262.3, "of_datasheet": 0.841, "correct": True}
                 for i in range(2)},
        "memory_proof": {"nominal_bytes": 81604378624, "read_deadline_s": 0.1763,
                         "gpus": {str(i): {"fresh_s": 0.0972, "correct": True} for i in range(2)}},
    },
}
RUN_FINDINGS = [{"severity": "degrade", "code": "bf16_low", "gpu_index": 1,
                 "message": "GPU 1 reaches 271 TFLOP/s in BF16 matmul, 87% of the 312 a A100 80GB SXM is rated for."}]


def _figures(**parts):
    figures = copy.deepcopy(RUN_FIGURES)
    figures.update(parts)
    return figures


def _challenge(**parts):
    return {**copy.deepcopy(RUN_FIGURES["challenge"]), **parts}


ODD = "9876.5"  # a figure stored as text: shown as a number by `number` before, as if measured
PLATFORM = "What the platform measured itself"
FINDING = "(bf16_low)"  # the finding's code, after its sentence
MEASURED = "271.0"  # a GPU's BF16 in the table
NO_FIGURES = "No performance figures in this check"
# name: (figures, findings, what the server page must not show, what it still shows)
RUN_CASES = {
    "figures a list": ([RUN_FIGURES], RUN_FINDINGS, (PLATFORM, MEASURED), (FINDING, NO_FIGURES)),
    "figures text": ("fast", RUN_FINDINGS, (PLATFORM, MEASURED), (FINDING, NO_FIGURES)),
    "gpus an object": (_figures(gpus={"0": GPU_ROW}), RUN_FINDINGS, (MEASURED,), (FINDING, PLATFORM, NO_FIGURES)),
    "gpus of non-objects": (_figures(gpus=[1, "GPU 0", None, [GPU_ROW]]), RUN_FINDINGS, (MEASURED,),
                            (FINDING, PLATFORM, NO_FIGURES)),
    "gpu figures of the wrong kind": (
        _figures(gpus=[{**GPU_ROW, "index": "0", "bf16_tflops": ODD, "tf32_tflops": True, "score": [1],
                        "of_datasheet": [0.9]},
                       {**GPU_ROW, "index": 1, "fp32_tflops": ODD, "of_datasheet": {"bf16_tflops": "0.9"}}]),
        RUN_FINDINGS, ("9,876.5", "9876.5"), (FINDING, PLATFORM, MEASURED)),
    "medians a list": (_figures(median=[271.0]), RUN_FINDINGS, (), (FINDING, PLATFORM, MEASURED)),
    "medians of the wrong kind": (
        _figures(median={**RUN_FIGURES["median"], "bf16_tflops": ODD, "memory_bandwidth_gbs": [1790.0]}),
        RUN_FINDINGS, (), (FINDING, PLATFORM, MEASURED)),
    "datasheet of the wrong kind": (
        _figures(datasheet={**DATASHEET, "bf16_tflops": True, "tf32_tflops": ODD, "memory_bandwidth_gbs": "x"}),
        RUN_FINDINGS, ("9,876.5", "9876.5"), (FINDING, PLATFORM, MEASURED)),
    "challenge a list": (_figures(challenge=[1]), RUN_FINDINGS, (PLATFORM,), (FINDING, MEASURED)),
    "challenge gpus of the wrong kind": (
        _figures(challenge=_challenge(gpus={"x": {"bf16_tflops": 262.3}, "0": "fast",
                                            "1": {"bf16_tflops": ODD, "correct": "yes", "of_datasheet": [1],
                                                  "platform_elapsed_s": {"s": 1}}})),
        RUN_FINDINGS, ("9,876.5", "9876.5", "GPU x"), (FINDING, PLATFORM, MEASURED)),
    "memory proof of the wrong kind": (
        _figures(challenge=_challenge(memory_proof={"gpus": {"0": 5, "1": {"fresh_s": "0.1", "correct": "yes"}},
                                                    "nominal_bytes": "80G", "read_deadline_s": "soon",
                                                    "not_run": ["x"]})),
        RUN_FINDINGS, ("[&#x27;x&#x27;]", "soon"), (FINDING, PLATFORM, MEASURED)),
    "mig slices of the wrong kind": (
        _figures(challenge=_challenge(mig_slices={"slices": {"MIG-1": 5, "MIG-2": {"profile": ["1g"], "bf16_tflops":
                                                                                    ODD, "memory_proof": "x"}},
                                                  "memory_proof": [1]})),
        RUN_FINDINGS, ("9,876.5", "9876.5", "MIG-1"), (FINDING, PLATFORM, MEASURED, "MIG-2")),
    "findings text": (RUN_FIGURES, "bf16_low", (FINDING,), (PLATFORM, MEASURED)),
    "findings an object": (RUN_FIGURES, {"code": "bf16_low"}, (FINDING,), (PLATFORM, MEASURED)),
    "findings of non-objects": (RUN_FIGURES, ["bf16_low", 5, None, [RUN_FINDINGS[0]]], (FINDING,),
                                (PLATFORM, MEASURED)),
    "finding fields of the wrong kind": (
        RUN_FIGURES, [{"severity": ["reject"], "code": 5, "message": {"text": "m"}, "gpu_index": "1"},
                      {**RUN_FINDINGS[0], "gpu_index": "1", "severity": 3}], ("(5)",), (FINDING, PLATFORM, MEASURED)),
}


def _run_node(figures, findings):
    provider = UserFactory()
    node = make_listed_node(provider, gpu_model="a100-80gb-sxm", gpu_count=2)
    VerificationRun.objects.create(node=node, verdict="verified", findings=findings, figures=figures, score=86.9)
    client = Client()
    client.force_login(provider)
    return node, client


@pytest.mark.parametrize("case", list(RUN_CASES))
def test_the_server_page_and_the_gpu_comparison_show_no_odd_figure(case):
    figures, findings, hidden, shown = RUN_CASES[case]
    node, client = _run_node(figures, findings)
    page = client.get(f"/nodes/{node.pk}/")
    assert page.status_code == 200, page.content[-600:]
    # The latest check and the history (the page's forms below say "True" of their own)
    text = page.content.decode().split('id="verdict-h"', 1)[1].split('id="gpus-h"', 1)[0]
    for odd in (*hidden, "True", "None", "[1]", "{&#x27;"):
        assert odd not in text, odd
    for good in shown:
        assert good in text, good
    assert client.get("/nodes/").status_code == 200
    assert client.get(f"/nodes/{node.pk}/live/").status_code == 200
    compare = Client().get("/gpus/")
    assert compare.status_code == 200, compare.content[-600:]
    assert "9,876" not in compare.content.decode() and "9876" not in compare.content.decode()


@pytest.mark.parametrize(("stored", "read"), [
    (None, None), (12, 12.0), (2.5, 2.5), (True, None), (False, None), ("2.5", None), ([1], None), ({}, None),
    (float("nan"), None), (float("inf"), None), (10**400, None),
])
def test_number(stored, read):
    from marketplace import stored_figures  # the reader, new with these tests

    assert stored_figures.number(stored) == read


@pytest.mark.parametrize(("stored", "read"), [
    (None, None), (12, 12), (12.0, 12), (12.5, None), (True, None), ("12", None), (2**63, None), (-(2**63), -(2**63)),
    (float("nan"), None),
])
def test_whole(stored, read):
    from marketplace import stored_figures

    assert stored_figures.whole(stored) == read


# ------------------------------------------------------------------ what the offer's runtime says of bookings

def test_the_offers_runtime_says_what_a_booking_there_may_not_give():
    """b066232 made a booking on a libvirt offer refuse env, onstart, ports and volumes (and a volume there), and
    neither the offer's field nor the published schema said so: a client learnt it from the 400."""
    help_text = str(OfferSerializer().fields["runtime"].help_text)
    schema = (Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml").read_text()
    offer = schema.split("\n    Offer:\n", 1)[1].split("\n    Paginated", 1)[0]
    runtime = offer.split("\n        runtime:\n", 1)[1].split("\n        platform_fee_percent:", 1)[0]
    for kind, fields in RUNTIME_REFUSED_OPTIONS.items():
        assert kind in VOLUMELESS_RUNTIMES or "volumes" not in fields
        for field in fields:
            assert f"`{field}`" in help_text and f"`{field}`" in runtime, field
        assert f"A `{kind}` offer takes no" in help_text and f"A `{kind}` offer takes no" in runtime
    for kind in VOLUMELESS_RUNTIMES:
        assert f"No volume can be created on a `{kind}` offer" in help_text
        assert f"No volume can be created on a `{kind}` offer" in runtime
