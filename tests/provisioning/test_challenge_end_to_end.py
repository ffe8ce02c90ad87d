"""The platform's challenge end to end: the verification service against a simulated server over real SSH, the
agent computing the seeded products for real and answering no sooner than its real card would. Every profile's
verdict (the challenge included) is test_benchmark_verification.py's; here, what the challenge itself records."""
import time

import pytest

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
