"""The readers of stored benchmark figures 72851b1 left: each answers with the odd value absent (found by review).

A verification run's figures and findings and a node's benchmark_summary are JSON written from what a node's agent
answered; jsonb keeps any shape, and a row from before the answers were checked, by hand or by a migration holds
what no check allows. The admin's run pages and node page (findings_list, platform_checks_table, the runs list's
reasons), GET /api/v1/nodes/{id}/benchmarks/, a booking's NVLink islands read on the ORM path
(allocation.node_nvlink_islands), a spot check's comparison with the last verdict and the fleet reference each
read them raw: a finding's message that is no text, findings that are a string or a list of strings, figures that
are a list, a challenge GPU key that is no index, medians of the wrong kind were a 500 or a failed task. Each now
reads them through marketplace.stored_figures (run_findings, run_figures, nvlink_summary).
"""
import copy

import pytest
from django.urls import reverse

from marketplace.models import Node
from marketplace.services.instances.allocation import node_nvlink_islands
from provisioning.models import VerificationRun
from provisioning.selectors import fleet_reference
from provisioning.services.spot_checks import _not_on_the_verdict
from tests.factories import UserFactory, make_listed_node, make_node

pytestmark = pytest.mark.django_db

FINDING = {"severity": "degrade", "code": "bf16_low", "gpu_index": 1,
           "message": "GPU 1 reaches 271 TFLOP/s in BF16 matmul, 87% of the 312 a A100 80GB SXM is rated for."}
FIGURES = {
    "device": "cuda",
    "median": {"bf16_tflops": 271.0, "fp32_tflops": 18.9},
    "challenge": {
        "gpus": {str(i): {"platform_elapsed_s": 4.12, "bf16_tflops": 262.3, "of_datasheet": 0.841, "correct": True}
                 for i in range(2)},
        "memory_proof": {"nominal_bytes": 81604378624, "read_deadline_s": 0.1763,
                         "gpus": {str(i): {"fresh_s": 0.0972, "correct": True} for i in range(2)}},
    },
}
ODD_KEY = "GPU x"


def _challenge_gpus(**gpus):
    figures = copy.deepcopy(FIGURES)
    figures["challenge"]["gpus"].update(gpus)
    return figures


# name: (figures, findings, the API's findings codes, whether platform_checks shows, the API's figures)
CASES = {
    "figures a list": ([FIGURES], [FINDING], ["bf16_low"], False, {}),
    "figures text": ("fast", [FINDING], ["bf16_low"], False, {}),
    "challenge a list": ({**FIGURES, "challenge": [1]}, [FINDING], ["bf16_low"], False, None),
    "a challenge gpu key no index": (_challenge_gpus(x={"bf16_tflops": 262.3}), [FINDING], ["bf16_low"], True, None),
    "challenge figures of the wrong kind": (
        _challenge_gpus(**{"1": {"bf16_tflops": "9876.5", "correct": "yes"}}), [FINDING], ["bf16_low"], True, None),
    "findings text": (FIGURES, "bf16_low", [], True, None),
    "findings an object": (FIGURES, {"code": "bf16_low"}, [], True, None),
    "findings of non-objects": (FIGURES, ["bf16_low", 5, None, [FINDING]], [], True, None),
    "a message no text": (FIGURES, [{**FINDING, "message": {"text": "m"}}, FINDING], ["bf16_low"], True, None),
    "finding fields of the wrong kind": (
        FIGURES, [{**FINDING, "code": 5}, {**FINDING, "severity": "bogus"}, {**FINDING, "gpu_index": "1"}],
        ["bf16_low"], True, None),
}


def _run(figures, findings):
    node = make_listed_node(UserFactory(), gpu_model="a100-80gb-sxm", gpu_count=2)
    run = VerificationRun.objects.create(node=node, verdict="degraded", findings=findings, figures=figures, score=86.9)
    return node, run


@pytest.mark.parametrize("case", list(CASES))
def test_the_benchmarks_api_answers_with_the_odd_part_absent(case, client_for):
    figures, findings, codes, checks, api_figures = CASES[case]
    node, _ = _run(figures, findings)
    answer = client_for(node.provider).get(f"/api/v1/nodes/{node.pk}/benchmarks/")
    assert answer.status_code == 200, answer.content[-600:]
    (run,) = answer.json()["results"]
    assert [f["code"] for f in run["findings"]] == codes
    for finding in run["findings"]:  # as the schema says them
        assert finding["severity"] in ("reject", "degrade") and isinstance(finding["message"], str)
        assert finding["gpu_index"] is None or isinstance(finding["gpu_index"], int)
    assert (run["platform_checks"] is not None) is checks
    if checks:
        rows = run["platform_checks"]["gpus"]
        assert [r["device"] for r in rows] == ["GPU 0", "GPU 1"]
        assert all(r["challenge_tflops"] in (262.3, None) and r["challenge_correct"] in (True, None) for r in rows)
    assert run["figures"] == (figures if api_figures is None else api_figures)


@pytest.mark.parametrize("case", list(CASES))
def test_the_admin_run_pages_and_node_page_answer_with_the_odd_part_absent(case, admin_client):
    figures, findings, codes, checks, _ = CASES[case]
    node, run = _run(figures, findings)
    pages = {
        "runs": admin_client.get(reverse("admin:provisioning_verificationrun_changelist")),
        "run": admin_client.get(reverse("admin:provisioning_verificationrun_change", args=[run.pk])),
        "node": admin_client.get(reverse("admin:marketplace_node_change", args=[node.pk])),
    }
    for name, page in pages.items():
        assert page.status_code == 200, (name, page.content[-600:])
    text = pages["run"].content.decode()
    assert (ODD_KEY not in text) and ("9876" not in text.split("<table>", 1)[-1].split("</table>", 1)[0])
    assert ("challenge BF16 TFLOP/s" in text) is checks
    reasons = text.lower().split("reasons (findings)", 1)[1]
    assert ("<code>bf16_low</code>" in reasons) is bool(codes)
    assert ("<code>bf16_low</code>" in pages["node"].content.decode()) is bool(codes)


@pytest.mark.parametrize(("summary", "islands"), [
    ([{"nvlink": {"islands": [[0, 1]]}}], []),
    ("nvlink", []),
    ({"nvlink": [[0, 1]]}, []),
    ({"nvlink": "yes"}, []),
    ({"nvlink": {"islands": "0-1"}}, []),
    ({"nvlink": {"islands": [[0, "1", True], "x", [2, 3]]}}, [[0], [2, 3]]),
    ({"nvlink": {"connected": True, "islands": [[0, 1]]}}, [[0, 1]]),
])
def test_a_bookings_nvlink_islands_read_on_the_orm_path(summary, islands):
    node = make_node(gpu_count=4)
    Node.objects.filter(pk=node.pk).update(benchmark_summary=summary)
    assert node_nvlink_islands(Node.objects.get(pk=node.pk)) == islands  # the whole row, as SQLite's path loads it


@pytest.mark.parametrize("findings", ["bf16_low", ["bf16_low", 5], {"code": "bf16_low"}, [{**FINDING, "code": 5}]])
def test_a_spot_check_compares_with_the_last_verdict_as_read(findings):
    node, _ = _run(FIGURES, findings)
    found = [{**FINDING, "code": "wrong_results"}, dict(FINDING)]
    assert _not_on_the_verdict(node, found) == found  # the stored findings name neither
    node, _ = _run(FIGURES, [*(findings if isinstance(findings, list) else [findings]), FINDING])
    assert _not_on_the_verdict(node, found) == found[:1]


@pytest.mark.parametrize("median", [[271.0], "fast", {"bf16_tflops": "9876.5", "fp32_tflops": True}])
def test_the_fleet_reference_reads_no_odd_median(median, settings):
    settings.FLEET_REFERENCE_MIN_NODES, settings.FLEET_REFERENCE_MIN_PROVIDERS = 3, 3
    for value in (100.0, 101.0, 99.0):
        node = make_node(UserFactory(), gpu_model="a10", gpu_count=1, verdict="verified")
        VerificationRun.objects.create(node=node, verdict="verified",
                                       figures={"device": "cuda", "median": {"bf16_tflops": value}})
    odd = make_node(UserFactory(), gpu_model="a10", gpu_count=1, verdict="verified")
    VerificationRun.objects.create(node=odd, verdict="verified", figures={"device": "cuda", "median": median})
    reference = fleet_reference(odd.gpu_model_id)
    assert reference is not None and reference.median == {"bf16_tflops": 100.0}
    assert reference.nodes == 3  # the odd node's medians read as none
