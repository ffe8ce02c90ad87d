"""Round 44 review: what a node answers is judged as what the platform asked for.

A benchmark answer saying "device": "cpu" (or null) to the verification's request for the GPUs was judged as a CPU
run, figures only: no CUDA name, SM count, CUDA memory, power or fleet comparison, so a shim renaming the card
changed one word and "rejected" became "verified". The answer must be measured on the device asked for
(answers.benchmark_problems); the policy's CPU mode stays for gpu-selfcheck --device cpu, where the answer says
so because it was asked to."""
import json

import pytest

from provisioning.models import JobStatus
from provisioning.verification import challenge, challenge_verdict, memproof, memproof_verdict
from provisioning.verification.answers import benchmark_problems
from provisioning.verification.challenge_verdict import platform_rates
from provisioning.verification.policy import judge
from provisioning.verification.tolerances import TOLERANCES
from tests.provisioning.test_agent_answers import (
    gpus_changed,
    honest_benchmark,
    node_answers,
    register,
    simbase,
    simnode,
    verify,
)
from tests.provisioning.test_challenge import A4000
from tests.provisioning.test_challenge import PONGS as CHALLENGE_PONGS
from tests.provisioning.test_challenge import FakeExchange as ChallengeExchange
from tests.provisioning.test_memproof import A100
from tests.provisioning.test_memproof import PONGS as MEMPROOF_PONGS
from tests.provisioning.test_memproof import FakeExchange as MemproofExchange
from tests.provisioning.test_policy import bench, bench_gpu, codes, fleet_of, model, smi_gpu

__all__ = ["node_answers", "simbase", "simnode"]


# ------------------------------------------------------------------------------------ the device asked for

@pytest.mark.parametrize(("device", "shown"), [
    ("cpu", "'cpu'"), (None, "null"), ("CUDA", "'CUDA'"), (7, "not a device name"), ("x" * 65, "not a device name"),
])
def test_a_benchmark_answer_measured_on_another_device_than_asked_is_malformed(device, shown):
    answer = {**honest_benchmark(), "device": device}
    assert benchmark_problems(answer, [0, 1]) == [f"device is {shown}; the benchmark was asked to run on cuda"]


def test_the_device_asked_for_or_none_said_is_accepted():
    assert benchmark_problems(honest_benchmark(), [0, 1]) == []
    unsaid = honest_benchmark()
    del unsaid["device"]  # the agent's default, cuda, as the policy reads it
    assert benchmark_problems(unsaid, [0, 1]) == []
    assert benchmark_problems({**honest_benchmark(), "device": "cpu"}, [0, 1], device="cpu") == []


def test_a_cpu_device_in_the_answer_no_longer_skips_the_platforms_own_fleet_check():
    honest = bench_gpu(0)
    fleet = fleet_of({**{k: honest[k] for k in TOLERANCES["fleet_max_gap"] if k in honest},
                      "platform_bf16_tflops": 250.0})
    gpus = [smi_gpu(0), smi_gpu(1)]
    rates = platform_rates({"gpus": {"0": {"bf16_tflops": 248.0, "correct": True},
                                     "1": {"bf16_tflops": 205.0, "correct": True}}})  # 18 % under the fleet
    as_asked = bench(bench_gpu(0), bench_gpu(1))
    assert codes(judge(model(), 2, gpus, as_asked, fleet=fleet, platform_rates=rates).findings) == {
        ("below_fleet_median", 1)}
    # refused where the answer is read: the verification judges no benchmark then (benchmark_malformed)
    assert benchmark_problems(bench(bench_gpu(0), bench_gpu(1), device="cpu"), [0, 1]) == [
        "device is 'cpu'; the benchmark was asked to run on cuda"]
    # and the policy's figures-only mode is for "cpu" alone: a null device is judged as a GPU run
    unnamed = bench(bench_gpu(0), bench_gpu(1), device=None)
    assert codes(judge(model(), 2, gpus, unnamed, fleet=fleet, platform_rates=rates).findings) == {
        ("below_fleet_median", 1)}


def test_a_null_device_in_the_answer_does_not_skip_the_cuda_name_and_sm_count_checks():
    gpus = [smi_gpu(0)]
    renamed = bench_gpu(0, name="NVIDIA A100-SXM4-40GB", sm_count=98)
    assert {"cuda_name", "sm_count"} <= {c for c, _ in codes(judge(model(), 1, gpus, bench(renamed)).findings)}
    found = judge(model(), 1, gpus, bench(renamed, device=None)).findings
    assert {"cuda_name", "sm_count"} <= {c for c, _ in codes(found)}, codes(found)


def _renamed(device):
    def rewrite(answer):
        gpus_changed(lambda gpus: gpus[0].update(name="NVIDIA RTX A2000", sm_count=26))(answer)
        answer["device"] = device
        return answer
    return rewrite


def test_a_benchmark_answer_saying_cpu_does_not_escape_the_cuda_identity_checks(db, simnode, simbase, node_answers):
    node = register(simnode, simbase, "rtx-a4000-x2")
    node_answers("benchmark", _renamed("cuda"))
    node, job = verify(node)
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert node.verdict == "rejected" and "cuda_name" in {f["code"] for f in node.verifications.first().findings}
    node_answers("benchmark", _renamed("cpu"))
    node, job = verify(node)
    assert job.status == JobStatus.SUCCEEDED, job.error
    run = node.verifications.first()
    found = {f["code"] for f in run.findings}
    assert (node.verdict, run.score) == ("rejected", None) and "benchmark_malformed" in found, (node.verdict, found)
    assert "device is 'cpu'; the benchmark was asked to run on cuda" in node.last_error


# ------------------------------------------------------------------------------------ the node's own words, bounded

HUGE = "x" * (8 << 20)  # an answer line may hold megabytes; the problem is kept once per GPU


def _stopped(message: str) -> bytes:
    return json.dumps({"ok": False, "error": {"code": "internal_error", "message": message}}).encode()


def test_a_nodes_error_message_in_the_challenge_is_kept_to_a_bound():
    drawn = challenge.draw(A4000, [0, 1], quick=True)
    out = challenge.run(ChallengeExchange(*CHALLENGE_PONGS, _stopped(HUGE)), drawn, 300)
    findings, _ = challenge_verdict.judge(A4000, drawn, out)
    assert [f.code for f in findings] == ["challenge_no_answer", "challenge_no_answer"]
    for finding in findings:
        assert len(finding.message) < 1000 and f"stopped with an error: {'x' * 500}… ({len(HUGE) - 500} more " \
                                                 "characters)" in finding.message
    out = challenge.run(ChallengeExchange(*CHALLENGE_PONGS, _stopped("boom")), drawn, 300)
    assert out.problem == "stopped with an error: boom"  # a short one as it is


@pytest.mark.parametrize("roots", [[], [b'{"gpu": 0, "root": "ab"}'], [b'{"gpu": 0, "root": "ab"}',
                                                                     b'{"gpu": 0, "root": "cd"}']])
def test_a_nodes_error_message_in_the_memory_proof_is_kept_to_a_bound(roots):
    drawn = memproof.draw(A100, [0])
    out = memproof.run(MemproofExchange(*MEMPROOF_PONGS, *roots, _stopped(HUGE)), drawn, 300)
    findings, _ = memproof_verdict.judge(A100, drawn, out)
    assert findings and all(len(f.message) < 1000 for f in findings), [len(f.message) for f in findings]
    assert "more characters)" in out.problem and len(out.problem) < 600
