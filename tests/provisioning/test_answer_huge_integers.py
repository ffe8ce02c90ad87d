"""A JSON integer is unbounded: 10**400 parses. The answers' check took every number to math.isfinite, which
raises OverflowError on an int past the double's range: inventory_problems and benchmark_problems crashed, the
verification ended as the platform's internal error, and an active node kept its verdict and its listing, at
every re-verification a dishonest provider made end so. Now such an int is a problem named (out of the field's
range), the node's rejection; and the closest-model wording reads a stored one as no figure (found by review).

The parse (core.untrusted_json) refuses such an integer too; the flow tests here put it in the answer after the
parse, so that the answers' own check is what they test, and once as raw JSON, rejected whichever refuses it."""
import contextlib
from types import SimpleNamespace

import pytest

from provisioning import tasks
from provisioning.models import JobFault, JobStatus
from provisioning.services import verification
from provisioning.services.verification import node_verify_request
from provisioning.verification.answers import benchmark_problems, inventory_problems
from provisioning.verification.wording import closest_model
from tests.provisioning.test_agent_answers import (
    gpus_changed,
    honest_benchmark,
    honest_inventory,
    node_answers,
    with_change,
)
from tests.provisioning.test_benchmark_verification import register, simbase, simnode, verify
from tests.provisioning.test_memproof import A100

__all__ = ["node_answers", "simbase", "simnode"]  # fixtures, shared with those modules

HUGE = 10**400
TASK = SimpleNamespace(request=SimpleNamespace(retries=0), max_retries=3)


@pytest.mark.parametrize("value", [HUGE, -HUGE, 2**1024], ids=["1e400", "-1e400", "2**1024"])
@pytest.mark.parametrize("change, where, high", [
    (lambda a, v: a["gpus"][0].update(power_limit_w=v), "gpus[0].power_limit_w", "1e+06"),
    (lambda a, v: a["topology"]["gpus"][1].update(link_gbs=v), "topology.gpus[1].link_gbs", "1e+06"),
    (lambda a, v: a["disk"].update(read_mbs=v), "disk.read_mbs", "1e+15"),
])
def test_a_huge_integer_in_an_inventory_number_is_a_problem_named(change, where, high, value):
    problems = inventory_problems(with_change(honest_inventory(), lambda a: change(a, value)))
    assert problems == [f"{where} outside 0..{high}"]  # a number of 400 digits is not quoted


@pytest.mark.parametrize("change, where", [
    (lambda a: a["gpus"][0].update(bf16_tflops=HUGE), "gpus[0].bf16_tflops"),
    (lambda a: a["gpus"][1].update(memory_mib=HUGE), "gpus[1].memory_mib"),
    (lambda a: a["gpus"][0]["matmul_rel_error"].update(fp32=-HUGE), "gpus[0].matmul_rel_error.fp32"),
    (lambda a: a["gpus"][0]["telemetry"].update(temperature_c=HUGE), "gpus[0].telemetry.temperature_c"),
    (lambda a: a["gpus"][0]["matmul_shapes_tflops"]["bf16"].append(HUGE), "gpus[0].matmul_shapes_tflops.bf16[2]"),
    (lambda a: a["p2p"][0].update(gbs=HUGE), "p2p[0].gbs"),
    (lambda a: a.update(duration_s=HUGE), "duration_s"),
])
def test_a_huge_integer_in_a_benchmark_figure_is_a_problem_named(change, where):
    problems = benchmark_problems(with_change(honest_benchmark(), change), [0, 1])
    assert any(p.startswith(f"{where} ") for p in problems), problems


def test_a_huge_integer_in_a_mig_slices_figure_is_a_problem_named():
    row = {k: v for k, v in honest_benchmark([0])["gpus"][0].items() if k not in ("index", "uuid", "name")}
    bench = {"gpus": [], "mig_slices": [{**row, "uuid": "MIG-a", "gpu": 0, "device": 0, "profile": "7g.80gb",
                                         "memory_mib": HUGE}]}
    assert any(p.startswith("mig_slices[0].memory_mib ") for p in benchmark_problems(bench, [], ["MIG-a"]))


def test_an_in_range_integer_is_still_a_number():
    answer = with_change(honest_inventory(), lambda a: a["gpus"][0].update(power_limit_w=400))
    assert inventory_problems(answer) == []
    said = inventory_problems(with_change(honest_inventory(), lambda a: a["gpus"][0].update(power_limit_w=2_000_000)))
    assert said == ["gpus[0].power_limit_w is 2e+06, outside 0..1e+06"]


def test_the_closest_model_reads_a_stored_huge_integer_as_no_figure():
    """A run stored before the answers were checked may hold one: the page must not fail on it."""
    figures = {"median": {"bf16_tflops": HUGE, "memory_bandwidth_gbs": 1700.0}, "gpus": [{"sm_count": HUGE}]}
    match = closest_model([A100], "a100-80gb-sxm", figures, {"gpus": [{"memory_total_mib": HUGE}]})
    assert match is not None and match.sm_count is None and set(match.shares) == {"memory_bandwidth_gbs"}


# ------------------------------------------------------------------------------------ over SSH

@pytest.fixture
def parsed_answers(monkeypatch):
    """parsed_answers(command, rewrite): the node's answer to `command`, as parsed, becomes rewrite(it): what a
    parse that let a huge integer through hands the check."""
    rewrites = {}
    real = verification.node_session

    @contextlib.contextmanager
    def rewriting(node, *args, **kwargs):
        with real(node, *args, **kwargs) as session:
            honest = session.agent

            def agent(command, *a, **kw):
                answer = honest(command, *a, **kw)
                rewrite = rewrites.get(command)
                return rewrite(answer) if rewrite else answer
            session.agent = agent
            yield session

    monkeypatch.setattr(verification, "node_session", rewriting)
    return rewrites.__setitem__


CHANGES = [
    ("inventory", lambda gpus: gpus[0].update(power_limit_w=HUGE), "gpus[0].power_limit_w"),
    ("benchmark", lambda gpus: gpus[0].update(bf16_tflops=HUGE), "gpus[0].bf16_tflops"),
]


@pytest.mark.parametrize("command, change, where", CHANGES)
def test_an_active_node_answering_a_huge_integer_is_rejected_not_kept_listed(db, simnode, simbase, parsed_answers,
                                                                             command, change, where):
    node, _ = verify(register(simnode, simbase, "rtx-a4000-x2"))
    assert (node.state, node.verdict) == ("active", "verified")
    parsed_answers(command, gpus_changed(change))
    job = node_verify_request(node=node)
    with contextlib.suppress(OverflowError):  # the old code's crash, to see its outcome
        tasks.run_job(TASK, job.pk)
    node.refresh_from_db()
    job.refresh_from_db()
    assert (node.state, node.verdict, job.status, job.error) == ("rejected", "rejected", JobStatus.SUCCEEDED, "")
    assert node.verifications.first().findings[0]["code"] == f"{command}_malformed"
    assert f"{command} answer is malformed: {where} outside" in node.last_error


@pytest.mark.parametrize("command, change, where", CHANGES)
def test_a_huge_integer_sent_as_json_rejects_the_node_whichever_check_refuses_it(db, simnode, simbase, node_answers,
                                                                                 command, change, where):
    node, _ = verify(register(simnode, simbase, "rtx-a4000-x2"))
    node_answers(command, gpus_changed(change))
    job = node_verify_request(node=node)
    with contextlib.suppress(OverflowError):
        tasks.run_job(TASK, job.pk)
    node.refresh_from_db()
    job.refresh_from_db()
    assert (node.state, node.verdict) == ("rejected", "rejected"), (job.status, job.error)
    # the answers' check (the verification succeeds: a rejection) or the parse's (a failed check, the node's)
    assert job.status == JobStatus.SUCCEEDED or job.fault == JobFault.NODE, (job.status, job.fault, job.error)
    assert "platform" not in job.error
