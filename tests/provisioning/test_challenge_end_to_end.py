"""The platform's challenge end to end: the verification service against a simulated server over real SSH, the
agent computing the seeded products for real and answering no sooner than its real card would. Every profile's
verdict (the challenge included) is test_benchmark_verification.py's; here, what the challenge itself records."""
import html
import re
import time

import pytest
from django.test import Client
from django.urls import reverse

from provisioning.models import JobStatus, VerificationRun
from tests.provisioning.test_benchmark_verification import profile_data, register, simbase, simnode, verify

pytestmark = pytest.mark.slow
__all__ = ["simbase", "simnode"]  # the sim node fixtures, shared with that module's


def challenge_of(node):
    run = VerificationRun.objects.get(node=node)
    return run, {f["code"] for f in run.findings}, run.figures["challenge"]


def test_an_honest_node_passes_the_challenge_timed_on_the_platforms_clock(db, simnode, simbase):
    node, job = verify(register(simnode, simbase, "rtx-a4000-x2"))
    run, codes, figures = challenge_of(node)
    assert (node.verdict, codes) == ("verified", set())
    assert [m["message"] for m in job.log if m["message"].startswith("challenging GPUs 0, 1")]
    assert 0 < figures["round_trip_s"] < 0.5 and 0 <= figures["verify_cpu_s"] < 0.1
    for gpu in ("0", "1"):
        row = figures["gpus"][gpu]
        assert row["correct"] is True
        assert 0.6 < row["of_datasheet"] < 0.78  # the profile's ~71 % of an RTX A4000's BF16, with SSH in between
        assert row["platform_elapsed_s"] == pytest.approx(figures["flop_per_gpu"] / row["bf16_tflops"] / 1e12, 1e-2)


def test_faked_figures_do_not_hide_a_slower_card(db, simnode, simbase):
    node, _ = verify(register(simnode, simbase, "a6000-posing-as-a100-x2-faked-figures"))
    run, codes, figures = challenge_of(node)
    assert node.verdict == "rejected" and "challenge_too_slow" in codes
    assert not codes & {"bf16_low", "sm_count", "cuda_name"}  # the node's own reports pass
    assert run.figures["median"]["bf16_tflops"] > 250  # it reports A100 speed ...
    assert all(figures["gpus"][g]["of_datasheet"] < 0.4 for g in ("0", "1"))  # ... the platform measures an A6000's


def platform_rows(node) -> dict[str, list[str]]:
    """The provider's page, its table of what the platform measured itself: {GPU label: [cell texts]}."""
    client = Client()
    client.force_login(node.provider)
    page = client.get(reverse("node", args=[node.pk])).content.decode()
    assert "What the platform measured itself" in page
    table = page.split('<h3 id="platform-h">', 1)[1].split("</table>", 1)[0]
    cells = lambda row: [html.unescape(re.sub(r"<[^>]+>", "", c)).strip()  # noqa: E731
                         for c in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row, re.S)]
    rows = [cells(r) for r in re.findall(r"<tr>(.*?)</tr>", table.split("<tbody>", 1)[1], re.S)]
    return {row[0]: row[1:] for row in rows}


def test_the_provider_sees_the_platforms_figures_beside_the_faked_ones(db, simnode, simbase):
    node, _ = verify(register(simnode, simbase, "a6000-posing-as-a100-x2-faked-figures"))
    run, _, figures = challenge_of(node)
    rows = platform_rows(node)
    assert set(rows) == {"GPU 0", "GPU 1"}
    for gpu in ("0", "1"):
        tflops, share, seconds, products, memory_s, held = rows[f"GPU {gpu}"]
        measured = figures["gpus"][gpu]
        assert tflops == f"{measured['bf16_tflops']:,.1f}" and float(tflops) < 0.4 * 312  # an A6000's, not an A100's
        assert share == f"{measured['of_datasheet'] * 100:.0f} %" and products == "right"
        assert seconds == f"{measured['platform_elapsed_s']:.2f}"
        assert memory_s == f"{figures['memory_proof']['gpus'][gpu]['fresh_s']:,.3f}"
    assert run.figures["median"]["bf16_tflops"] > 250  # what the node reports, in the table above it


def test_the_provider_sees_that_the_memory_was_not_on_the_card(db, simnode, simbase):
    """Every opening right, the re-read late: the rest of the fill is in host RAM. The page says late, not held."""
    node, _ = verify(register(simnode, simbase, "a100-40gb-sxm-says-80gb-everywhere-x1"))
    _, codes, figures = challenge_of(node)
    assert "memory_proof_late" in codes and figures["memory_proof"]["gpus"]["0"]["correct"] is True
    assert platform_rows(node)["GPU 0"][-1] == "late"


def test_wrong_products_are_caught_though_the_node_reports_them_right(db, simnode, simbase):
    node, _ = verify(register(simnode, simbase, "rtx-a4000-x2-bad-matmul-hidden"))
    run, codes, figures = challenge_of(node)
    assert node.verdict == "rejected" and "wrong_results" not in codes
    assert {(f["code"], f["gpu_index"]) for f in run.findings if f["code"].startswith("challenge")} == {
        ("challenge_wrong_result", 0)}
    assert (figures["gpus"]["0"]["correct"], figures["gpus"]["1"]["correct"]) == (False, True)


def test_a_node_that_never_answers_the_challenge_is_rejected_within_the_wait(db, simnode, simbase):
    hung = profile_data("rtx-a4000-x2")
    hung["performance"]["challenge_hang_s"] = 120
    node = register(simnode, simbase, hung)
    started = time.monotonic()
    node, job = verify(node)
    assert time.monotonic() - started < 1.5 / 0.45 + 5 + 8  # the wait, plus connecting and the benchmark
    run, codes, _ = challenge_of(node)
    assert job.status == JobStatus.SUCCEEDED and node.verdict == "rejected" and codes == {"challenge_no_answer"}
    assert "the node sent no commitment within 9 s" in run.findings[0]["message"]  # 1.5 s / (0.45 x 0.9) + 5 s
