"""Verdict wording (issue 16): each finding said once with the GPUs it concerns, the right articles, and the
catalogue model the measured figures do fit. Pure: the sim profiles judged in process, the catalogue's JSON."""
import re

import pytest

from provisioning.verification.articles import article, mend_articles
from provisioning.verification.model import DeclaredModel, load_catalogue
from provisioning.verification.profiles import judge_profile
from provisioning.verification.wording import closest_model, gpu_list, reasons, reasons_text


@pytest.fixture(scope="module")
def catalogue():
    return [DeclaredModel.from_catalogue(entry) for entry in load_catalogue().values()]


@pytest.mark.parametrize(("name", "expected"), [
    ("A100 80GB SXM", "an"), ("H100 SXM", "an"), ("RTX A6000", "an"), ("L40S", "an"), ("A10", "an"),
    ("L4", "an"), ("GeForce RTX 4090", "a"), ("T4", "a"), ("Tesla V100", "a"), ("Quadro", "a"), ("eGPU", "an"),
])
def test_articles_follow_the_sound(name, expected):
    assert article(name) == expected


def test_stored_sentences_get_their_articles_mended():
    assert mend_articles("GPU 0 has 84 SMs; a A100 80GB SXM has 108. A H100 is faster than a GeForce card, "
                         "a MIG slice or a vGPU.") == \
        "GPU 0 has 84 SMs; an A100 80GB SXM has 108. An H100 is faster than a GeForce card, an MIG slice or a vGPU."


@pytest.mark.parametrize(("indices", "said"), [
    ([3], "GPU 3"), ([0, 1], "GPUs 0 and 1"), ([2, 0], "GPUs 0 and 2"), (list(range(12)), "GPUs 0–11"),
    ([0, 1, 2, 3, 6], "GPUs 0–3 and 6"), ([0, 2, 4], "GPUs 0, 2 and 4"), ([0, 1, 5, 6], "GPUs 0, 1 and 5, 6"),
])
def test_gpu_lists(indices, said):
    assert gpu_list(indices) == said


def test_twelve_gpus_with_the_same_finding_are_one_sentence():
    findings = [{"severity": "reject", "code": "sm_count", "gpu_index": i,
                 "message": f"GPU {i} has 84 streaming multiprocessors; a A100 80GB SXM has 108."} for i in range(12)]
    findings += [{"severity": "degrade", "code": "power_capped", "gpu_index": i,
                  "message": f"GPU {i}'s power limit is {250 + i:g} W, below its default (400 W); reset it with "
                             f"`nvidia-smi -i {i} -pl 400`."} for i in (4, 5)]
    findings.append({"severity": "reject", "code": "gpu_count", "gpu_index": None,
                     "message": "13 GPUs were declared but the server reports 12."})
    said = reasons(findings)
    assert [(r.severity, r.code, r.gpus) for r in said] == [
        ("reject", "sm_count", tuple(range(12))), ("reject", "gpu_count", ()), ("degrade", "power_capped", (4, 5))]
    assert said[0].text == "Each of GPUs 0–11 has 84 streaming multiprocessors; an A100 80GB SXM has 108."
    assert said[2].text == ("On GPUs 4 and 5, the power limit is 254–255 W, below its default (400 W); reset it "
                            "with `nvidia-smi -i 4,5 -pl 400`.")
    assert said[1].text == "13 GPUs were declared but the server reports 12."
    assert reasons_text(findings).count("A100") == 1 and "a A100" not in reasons_text(findings)
    assert reasons_text(findings, severity="degrade") == said[2].text


def test_a_single_gpu_keeps_its_own_sentence():
    one = [{"severity": "degrade", "code": "low_clock", "gpu_index": 1,
            "message": "GPU 1 ran at 812 MHz under load, 58% of its 1410 MHz maximum: check power limit and cooling."}]
    assert reasons(one)[0].text == one[0]["message"] and reasons(one)[0].gpus_text == "GPU 1"


def test_an_a6000_posing_as_an_a100_is_told_once_per_finding_and_named(catalogue):
    judged = judge_profile("a6000-posing-as-a100-x2", fleet=False)
    findings = [f.as_dict() for f in judged.findings]
    raw = " ".join(f["message"] for f in findings)
    assert "an A100 80GB SXM" in raw and " a A100" not in raw  # the policy's own sentences, as stored
    said = reasons(findings)
    codes = [r.code for r in said]
    assert len(codes) == len(set(codes)) < len(findings)  # one sentence per finding, not one per GPU
    assert {f["code"] for f in findings} == set(codes)  # the machine-readable codes are kept
    sm = next(r for r in said if r.code == "sm_count")
    assert sm.gpus == (0, 1) and sm.text.startswith("Each of GPUs 0 and 1 has 84 streaming multiprocessors; an A100")
    bf16 = next(r for r in said if r.code == "bf16_low").text
    # The two GPUs' figures as a range; one figure when the sim's noise drew them equal to the tenth (seen in CI).
    assert re.search(r"GPUs 0 and 1 reach(es)? [\d.]+(–[\d.]+)? TFLOP/s in BF16 matmul", bf16), bf16
    match = closest_model(catalogue, "a100-80gb-sxm", judged.figures, {})
    assert match.model.slug == "rtx-a6000" and not match.declared
    assert match.text.startswith("The measured figures fit an RTX A6000 best, not the model declared: BF16 ")
    assert "84 streaming multiprocessors, as it has." in match.text


@pytest.mark.parametrize(("profile", "slug"), [
    ("a100-80gb-sxm-x4", "a100-80gb-sxm"), ("rtx-a4000-x2", "rtx-a4000"), ("h100-sxm-x1", "h100-sxm"),
    ("l40s-x4-ecc-off", "l40s"), ("a100-80gb-sxm-x4-thermal", "a100-80gb-sxm"), ("rtx-a6000-x8", "rtx-a6000"),
])
def test_honest_cards_fit_their_own_model(catalogue, profile, slug):
    judged = judge_profile(profile, fleet=False)
    match = closest_model(catalogue, slug, judged.figures, {})
    assert match.model.slug == slug and match.declared and "(the model declared)" in match.text


def test_nothing_measured_matches_nothing(catalogue):
    assert closest_model(catalogue, "a10", {}, {}) is None
