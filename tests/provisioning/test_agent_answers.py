"""What a node answers is checked at the boundary (provisioning/verification/answers.py): an inventory or benchmark
answer with the wrong types, NaN, numbers past their columns, a GPU twice or not at all is the node's rejection
with a reason it can act on, never an internal error and never an active node kept listed on its old verdict.
Also: a verification that cannot be completed by the node's doing, a re-check that measured nothing (no price
cut), stored bad data that offers and pages read, and spot checks the node dodges.

The dishonest nodes are the module's sim node over real SSH with its raw answers rewritten on their way back
(what a tampered agent or a shim would send), through the platform's own parsing (NodeSession)."""
import contextlib
import json
import math
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from marketplace.models import Instance, Node, NodeState
from marketplace.models.nodes import OFFERABLE
from provisioning import tasks
from provisioning.models import Job, JobKind, JobStatus, NodeEvent, VerificationRun
from provisioning.services import verification
from provisioning.services.maintenance import nodes_reverify_due
from provisioning.services.runner import job_begin
from provisioning.services.spot_checks import node_spot_check_failed, node_spot_check_request
from provisioning.services.verification import node_verify_failed, node_verify_request
from provisioning.ssh_errors import AgentFailed, NodeError, NodeUnreachable
from provisioning.verification import memproof_verdict
from provisioning.verification.answers import benchmark_problems, inventory_problems, storable
from provisioning.verification.wording import closest_model
from tests.factories import UserFactory, api_key_for, make_listed_node, make_node
from tests.provisioning.test_benchmark_verification import (
    profile_data,
    register,
    rent,
    simbase,
    simnode,
    use_hardware,
    verify,
)
from tests.provisioning.test_memproof import A100, PROFILES_DIR, exchange_with_agent

__all__ = ["simbase", "simnode"]  # the sim node fixtures, shared with that module's


# ------------------------------------------------------------------------------------ the checks alone

def honest_inventory() -> dict:
    return {"runtime": "sim", "hostname": "n1", "gpu_count": 2, "driver_version": "550.54", "cuda_version": "12.4",
            "gpus": [{"index": i, "uuid": f"GPU-{i}", "name": "NVIDIA A100-SXM4-80GB", "memory_total_mib": 81920,
                      "pci_bus_id": f"00000000:0{i}:00.0", "pci_device_id": "0x20B210DE", "pcie_link_gen_max": 4,
                      "pcie_link_width_max": 16, "power_limit_w": 400.0, "power_default_limit_w": 400.0,
                      "mig_mode": "Disabled", "ecc_mode": "Enabled", "driver_version": "550.54"} for i in (0, 1)],
            "topology": {"pairs": [{"a": 0, "b": 1, "link": "NV12"}], "nvlink_islands": [[0, 1]],
                         "gpus": [{"index": i, "links_total": 12, "links_active": 12, "link_gbs": 25.0}
                                  for i in (0, 1)]},
            "mig": [], "cpu": {"model": "EPYC", "cores": 64}, "ram_mib": 515000, "disk_free_gb": 900,
            "disk": {"test_mib": 32, "write_mbs": 900.5, "read_mbs": 2000.1, "free_gb": 900},
            "os": {"name": "Ubuntu", "kernel": "6.8", "arch": "x86_64"}}


def honest_benchmark(indices=(0, 1)) -> dict:
    return {"mode": "simulated", "device": "cuda", "quick": True, "agent_version": "1.0", "duration_s": 3.2,
            "time_limit_s": 300, "p2p": [{"a": 0, "b": 1, "gbs": 250.0}],
            "gpus": [{"index": i, "uuid": f"GPU-{i}", "name": "NVIDIA A100-SXM4-80GB", "memory_mib": 81050,
                      "sm_count": 108, "bf16_tflops": 270.0, "fp16_tflops": 275.0, "tf32_tflops": 140.0,
                      "fp32_tflops": 18.0, "memory_bandwidth_gbs": 1700.0, "h2d_gbs": 24.0, "d2h_gbs": 25.0,
                      "cnn_train_images_s": 9000.0, "cnn_infer_images_s": 25000.0,
                      "matmul_rel_error": {"fp32": 2e-7, "bf16": 3e-3},
                      "matmul_shapes_tflops": {"bf16": [260.0, 270.0]},
                      "telemetry": {"samples": 40, "sm_clock_mhz": 1410, "sm_clock_max_mhz": 1410,
                                    "power_draw_w": 385.0, "temperature_c": 61, "clocks_event_reasons": [],
                                    "clocks_event_reason_samples": {}, "pcie_link_gen": 4, "pcie_link_width": 16,
                                    "error": None}} for i in indices]}


def with_change(answer: dict, change) -> dict:
    answer = json.loads(json.dumps(answer))
    change(answer)
    return answer


def test_an_honest_inventory_and_benchmark_pass():
    assert inventory_problems(honest_inventory()) == []
    assert benchmark_problems(honest_benchmark(), [0, 1]) == []


@pytest.mark.parametrize(("change", "problem"), [
    (lambda a: a.update(gpus="x"), "gpus is not a list"),
    (lambda a: a.update(gpus=None), "gpus is missing"),
    (lambda a: a["gpus"][0].update(index="0"), "gpus[0].index is not an integer"),
    (lambda a: a["gpus"][1].update(index=0), "gpus[1].index repeats GPU index 0 (also at gpus[0].index)"),
    (lambda a: a["gpus"][0].update(uuid=["a"]), "gpus[0].uuid is not a string"),
    (lambda a: a["gpus"][0].update(name=["x"]), "gpus[0].name is not a string"),
    (lambda a: a["gpus"][1].update(memory_total_mib="81920"), "gpus[1].memory_total_mib is not an integer"),
    (lambda a: a["gpus"][1].update(memory_total_mib=math.nan), "gpus[1].memory_total_mib is not an integer"),
    (lambda a: a["gpus"][1].update(memory_total_mib=10**30), "gpus[1].memory_total_mib outside 0..2147483647"),
    (lambda a: a["gpus"][0].update(pci_bus_id="x" * 40), "gpus[0].pci_bus_id is longer than 32 characters"),
    (lambda a: a["gpus"].append(5), "gpus[2] is not an object"),
    (lambda a: a.update(topology="x"), "topology is not an object"),
    (lambda a: a["topology"].update(nvlink_islands=[["a", "b"]]),
     "topology.nvlink_islands[0][0] is not a GPU index (0..63)"),
    (lambda a: a["topology"].update(nvlink_islands=[[1, 2, 3], [0, 1]]),
     "topology.nvlink_islands[1][1] repeats GPU 1 (also at topology.nvlink_islands[0][0])"),
    (lambda a: a["topology"].update(nvlink_islands=[[0, 0]]),
     "topology.nvlink_islands[0][1] repeats GPU 0 (also at topology.nvlink_islands[0][0])"),
    (lambda a: a.update(mig="x"), "mig is not a list"),
    (lambda a: a["disk"].update(read_mbs=math.inf), "disk.read_mbs is not a finite number"),
    (lambda a: a["disk"].update(write_mbs=1e308), "disk.write_mbs is 1e+308, outside 0..1e+15"),
    (lambda a: a["os"].update(name="a\x00b"), "os.name contains a NUL character"),
    (lambda a: a.update(extra={"x": math.nan}), "extra.x is not a finite number"),
])
def test_a_malformed_inventory_is_named_where_it_is_wrong(change, problem):
    assert problem in inventory_problems(with_change(honest_inventory(), change))


@pytest.mark.parametrize(("change", "problem"), [
    (lambda a: a.clear(), "gpus is missing"),
    (lambda a: a.update(gpus="x"), "gpus is not a list"),
    (lambda a: a["gpus"].append(3), "gpus[2] is not an object"),
    (lambda a: a["gpus"].append(dict(a["gpus"][0])), "gpus[2].index repeats GPU 0 (also at gpus[0].index)"),
    (lambda a: a["gpus"][0].update(index="0"), "gpus[0].index is not an integer"),
    (lambda a: a["gpus"][0].update(index=5), "gpus[0].index is GPU 5, which the benchmark was not asked to measure"),
    (lambda a: a["gpus"].pop(), "gpus has no figures for GPU 1, which the benchmark was asked to measure"),
    (lambda a: a["gpus"][0].update(bf16_tflops=math.nan), "gpus[0].bf16_tflops is not a finite number"),
    (lambda a: a["gpus"][0].update(bf16_tflops=math.inf), "gpus[0].bf16_tflops is not a finite number"),
    (lambda a: a["gpus"][0].update(bf16_tflops=1e308), "gpus[0].bf16_tflops is 1e+308, outside 0..1e+09"),
    (lambda a: a["gpus"][0].update(bf16_tflops="275"), "gpus[0].bf16_tflops is not a number"),
    (lambda a: a["gpus"][0].update(bf16_tflops=-1.0), "gpus[0].bf16_tflops is -1, outside 0..1e+09"),
    (lambda a: a["gpus"][0].update(sm_count="abc"), "gpus[0].sm_count is not an integer"),
    (lambda a: a["gpus"][0].update(telemetry="x"), "gpus[0].telemetry is not an object"),
    (lambda a: a["gpus"][0]["telemetry"].update(power_draw_w="385"), "gpus[0].telemetry.power_draw_w is not a number"),
    (lambda a: a["gpus"][0]["telemetry"].update(clocks_event_reasons="HwSlowdown"),
     "gpus[0].telemetry.clocks_event_reasons is not a list"),
    (lambda a: a["gpus"][0].update(matmul_rel_error="x"), "gpus[0].matmul_rel_error is not an object"),
    (lambda a: a.update(p2p="x"), "p2p is not a list"),
    (lambda a: a.update(agent_version={"x": math.nan}), "agent_version is not a string"),
    (lambda a: a.update(mig_slices=[{"uuid": "MIG-x"}]),
     "mig_slices[0].uuid is a MIG slice the benchmark was not asked"),
])
def test_a_malformed_benchmark_is_named_where_it_is_wrong(change, problem):
    assert any(p.startswith(problem) for p in benchmark_problems(with_change(honest_benchmark(), change), [0, 1]))


def test_storable_drops_what_no_json_or_text_column_takes():
    assert storable({"a": [math.nan, 1.5, {"b\x00": "c\x00d", "e": math.inf}], "f": (1, 2)}) == \
        {"a": [None, 1.5, {"b": "cd", "e": None}], "f": (1, 2)}


def test_the_closest_model_reads_stored_figures_as_they_are():
    """A run stored before the answers were checked: an SM count "abc" and a median "x" are left out."""
    figures = {"median": {"bf16_tflops": "x", "memory_bandwidth_gbs": 1700.0},
               "gpus": [{"sm_count": "abc"}, {"sm_count": math.nan}, "x"]}
    match = closest_model([A100], "a100-80gb-sxm", figures, {"gpus": [{"memory_total_mib": "81920"}, 7]})
    assert match is not None and match.sm_count is None and set(match.shares) == {"memory_bandwidth_gbs"}


def test_a_memory_proof_opening_numbered_with_floats_fails_the_proof():
    drawn, out, _, _ = exchange_with_agent(PROFILES_DIR / "a100-80gb-sxm-x4.json", A100, [0])
    assert memproof_verdict.check_gpu(drawn, out, 0) == ""
    for item in out.opened["0"]:
        item["chunk"] = float(item["chunk"])  # 3.0 == 3, but it is not the chunk's number
    assert memproof_verdict.check_gpu(drawn, out, 0).endswith("was not opened")


def test_openings_among_padding_and_repeats_are_found_once_each():
    """The openings are indexed once by (block, chunk): each chunk needed was a scan of the whole list (a node
    padding it with millions of entries cost the platform seconds of CPU per chunk: found by review). The first
    of a repeated opening counts, as before; a later right one does not mend a wrong first one."""
    drawn, out, _, _ = exchange_with_agent(PROFILES_DIR / "a100-80gb-sxm-x4.json", A100, [0])
    honest = out.opened["0"]
    read = []
    padding = [{}] * 50_000

    class Counted(list):
        def __iter__(self):
            read.append(1)
            return super().__iter__()

    out.opened["0"] = Counted([*padding, *honest, *honest])
    assert memproof_verdict.check_gpu(drawn, out, 0) == "" and len(read) == 1
    wrong = json.loads(json.dumps(honest[0]))
    wrong["words"] = ("ff" if wrong["words"][:2] != "ff" else "00") + wrong["words"][2:]
    out.opened["0"] = [*padding, wrong, *honest]
    assert memproof_verdict.check_gpu(drawn, out, 0) != ""


def test_an_agent_error_that_is_not_an_object_is_its_message():
    error = AgentFailed("boom")
    assert (error.code, error.message, error.field) == ("agent_error", "the agent reported an error: boom", None)


# ------------------------------------------------------------------------------------ offers of bad data

def test_one_nodes_stored_bad_islands_do_not_fail_the_offers(db):
    bad = make_listed_node(UserFactory(), gpu_count=2)
    Node.objects.filter(pk=bad.pk).update(benchmark_summary={
        "verdict": "verified", "nvlink": {"connected": True, "islands": [["a", "b"], [0, 1], "x"],
                                          "links_per_gpu": 12, "p2p_gbs": 250.0, "pcie_p2p_gbs": None}})
    other = make_listed_node(UserFactory(), gpu_count=2)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_for(UserFactory())}")
    listed = client.get("/api/v1/offers/")
    assert listed.status_code == 200
    rows = {row["id"]: row for row in listed.json()["results"]}
    assert set(rows) >= {bad.pk, other.pk}
    assert rows[bad.pk]["benchmark"]["nvlink"]["islands"] == [[], [0, 1]]
    detail = client.get(f"/api/v1/offers/{bad.pk}/")
    assert detail.status_code == 200 and detail.json()["benchmark"]["nvlink"]["islands"] == [[], [0, 1]]


# ------------------------------------------------------------------------------------ over SSH

@pytest.fixture
def node_answers(monkeypatch):
    """node_answers(command, rewrite): the node's raw answer to `command` becomes rewrite(its honest answer), sent
    as JSON (NaN and Infinity as Python's json writes them), for the verifications that follow."""
    rewrites = {}
    real = verification.node_session

    @contextlib.contextmanager
    def rewriting(node, *args, **kwargs):
        with real(node, *args, **kwargs) as session:
            honest = session._exec

            def exec_(cmd, stdin, timeout):
                out = honest(cmd, stdin, timeout)
                rewrite = rewrites.get(cmd.split()[-1])
                return json.dumps(rewrite(json.loads(out))).encode() if rewrite else out
            session._exec = exec_
            yield session

    monkeypatch.setattr(verification, "node_session", rewriting)
    return rewrites.__setitem__


def gpus_changed(change):
    def rewrite(answer):
        change(answer["gpus"])
        return answer
    return rewrite


def test_an_active_nodes_malformed_inventory_rejects_it_with_the_reason(db, simnode, simbase, node_answers):
    node, _ = verify(register(simnode, simbase, "rtx-a4000-x2"))
    assert (node.state, node.verdict) == ("active", "verified")
    node_answers("inventory", gpus_changed(lambda gpus: gpus[1].update(memory_total_mib=math.nan)))
    node, job = verify(node)
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert (node.state, node.verdict) == ("rejected", "rejected")
    assert not Node.objects.filter(OFFERABLE, pk=node.pk).exists()
    run = node.verifications.first()
    assert [f["code"] for f in run.findings] == ["inventory_malformed"] and run.inventory == {}
    # NaN is no JSON number: the answer is refused as it is read (core.untrusted_json), a malformed answer all the same
    assert "inventory answer is malformed: JSON holds NaN, which is not a number" in node.last_error
    assert NodeEvent.objects.filter(node=node, kind="verified_rejected").exists()


@pytest.mark.parametrize(("rewrite", "problem"), [
    (lambda answer: {"ok": True}, "gpus is missing"),
    (gpus_changed(lambda gpus: gpus.append(dict(gpus[0]))), "gpus[2].index repeats GPU 0"),
    (gpus_changed(lambda gpus: gpus[0].update(index="0")), "gpus[0].index is not an integer"),
    (gpus_changed(lambda gpus: gpus[0].update(bf16_tflops=math.inf)), "JSON holds Infinity, which is not a number"),
    (gpus_changed(lambda gpus: gpus[0].update(bf16_tflops=10**400)), "JSON integer 1000000000"),
    (gpus_changed(lambda gpus: gpus[0].update(name="RTX\x00A4000")), "JSON text holds the NUL character"),
])
def test_a_benchmark_answer_that_claims_too_little_or_garbage_rejects(db, simnode, simbase, node_answers, rewrite,
                                                                      problem):
    node = register(simnode, simbase, "rtx-a4000-x2")  # pending: its first verification
    node_answers("benchmark", rewrite)
    node, job = verify(node)
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert (node.state, node.verdict) == ("rejected", "rejected")
    run = node.verifications.first()
    assert "benchmark_malformed" in {f["code"] for f in run.findings} and run.score is None
    assert f"benchmark answer is malformed: {problem}" in node.last_error


def test_an_agent_that_fails_with_a_bare_string_rejects_an_active_node_not_a_platform_error(
        db, simnode, simbase, node_answers):
    node, _ = verify(register(simnode, simbase, "rtx-a4000-x2"))
    node_answers("inventory", lambda answer: {"ok": False, "error": "boom"})
    job = node_verify_request(node=node)
    tasks.run_job(SimpleNamespace(request=SimpleNamespace(retries=0), max_retries=3), job.pk)
    node.refresh_from_db()
    job.refresh_from_db()
    assert (job.status, job.error) == (JobStatus.FAILED, "the agent reported an error: boom")
    assert (node.state, node.verdict) == ("rejected", "rejected")
    assert node.verifications.first().findings[0]["code"] == "verification_failed"
    assert "could not be completed: the agent reported an error: boom" in node.last_error


def test_a_platform_side_failure_keeps_an_active_nodes_verdict(db):
    node = make_listed_node(UserFactory())
    job = job_begin(job_id=node_verify_request(node=node).pk)
    tasks._fail(job, NodeError("Internal error: TypeError. Operators have been told."))
    node.refresh_from_db()
    assert (node.state, node.verdict) == ("active", "verified") and not node.verifications.exists()


def test_a_check_run_past_the_tasks_soft_limit_is_the_node_dropping_it_not_an_internal_error(db):
    """A node answering each step just inside its own bound adds them up past the task's soft limit; Celery's
    SoftTimeLimitExceeded was an internal error (not the node's doing), so an active node kept its listing check
    after check (found by review). It is a dropped check now, when the time ran out waiting for the node (here a
    node that takes the connection and says nothing): two in a row reject the node. (Out on the platform's side,
    it is the platform's: tests/provisioning/test_job_fault.py.)"""
    from tests.provisioning.test_job_fault import silent_node, soft_time_limit

    task = SimpleNamespace(request=SimpleNamespace(retries=0), max_retries=3, soft_time_limit=840)
    with silent_node() as port:
        node = make_listed_node(UserFactory(), address="127.0.0.1", ssh_port=port)
        VerificationRun.objects.create(node=node, verdict="verified")
        for expected in ("verified", "rejected"):
            job = node_verify_request(node=node)
            with soft_time_limit(0.5):
                tasks.run_job(task, job.pk)
            job.refresh_from_db()
            node.refresh_from_db()
            assert job.status == JobStatus.FAILED and "ran past its time limit (840 s)" in job.error
            assert "waited for the node's answer" in job.error and job.fault == "node"
            assert "Internal error" not in job.error and node.verdict == expected


def test_an_active_node_that_drops_two_verifications_in_a_row_is_rejected(db):
    node = make_listed_node(UserFactory())
    VerificationRun.objects.create(node=node, verdict="verified")
    for expected in ("verified", "rejected"):
        job = job_begin(job_id=node_verify_request(node=node).pk)
        node_verify_failed(job=job, error=NodeUnreachable("The SSH connection broke during a command: reset"))
        node.refresh_from_db()
        assert node.verdict == expected
    assert NodeEvent.objects.filter(node=node, kind="verification_dropped").count() == 1
    assert "stopped answering 2 verifications in a row" in node.last_error


def test_a_recheck_of_a_fully_rented_node_cuts_no_price(db, simnode, simbase):
    """Every GPU rented: no benchmark, no score. Verified, or degraded by what nvidia-smi shows (a power limit
    lowered), the renters' prices stay: nothing measured the hardware worse."""
    node, _ = verify(register(simnode, simbase, "rtx-a4000-x2"))
    instance = rent(node, num_gpus=2)
    price = instance.price_per_hour_micros
    node, _ = verify(node)
    assert (node.verdict, node.verifications.first().score) == ("verified", None)
    capped = profile_data("rtx-a4000-x2")
    capped["nvidia_smi"][1] = capped["nvidia_smi"][1].replace("140.00, 140.00", "100.00, 140.00")
    use_hardware(simnode, capped)
    node, _ = verify(node)
    assert (node.verdict, node.verifications.first().score) == ("degraded", None)
    instance.refresh_from_db()
    assert instance.price_per_hour_micros == price
    assert not NodeEvent.objects.filter(node=node, kind="renters_price_cut").exists()


def test_a_rented_card_numbered_anew_is_not_benchmarked(db, simnode, simbase):
    """Card 0 leaves the bus; nvidia-smi lists the rented card 1 as GPU 0. Judged by index alone, the re-check took
    it for the free one and ran the benchmark on the renter's card."""
    from marketplace.models import Gpu, GpuStatus

    node, _ = verify(register(simnode, simbase, "rtx-a4000-x2"))
    Gpu.objects.filter(node=node, index=0).update(status=GpuStatus.UNAVAILABLE)  # so the renter gets card 1
    instance = rent(node, num_gpus=1)
    assert list(Gpu.objects.filter(allocations__instance=instance).values_list("index", flat=True)) == [1]
    data = profile_data("rtx-a4000-x2")
    data["nvidia_smi"] = ["0" + data["nvidia_smi"][1][1:]]  # card 1 alone, numbered 0
    use_hardware(simnode, data)
    node, job = verify(node)
    said = " / ".join(line["message"] for line in job.log)
    assert "every GPU is rented" in said and "benchmarking" not in said, said
    assert Instance.objects.get(pk=instance.pk).price_per_hour_micros == instance.price_per_hour_micros


# ------------------------------------------------------------------------------------ spot checks dodged

@pytest.fixture
def bounds(settings):
    settings.SPOT_CHECK_MIN_S, settings.SPOT_CHECK_MAX_S = 6 * 3600, 42 * 3600
    settings.REVERIFY_MIN_S, settings.REVERIFY_MAX_S = 4 * 86400, 10 * 86400


def dodge(node: Node, error: NodeError) -> None:
    Node.objects.filter(pk=node.pk).update(next_check_at=timezone.now() + timedelta(days=5))
    job = job_begin(job_id=node_spot_check_request(node=node).pk)
    node_spot_check_failed(job=job, error=error)


def test_a_spot_check_the_node_drops_brings_its_full_verification_forward(db, bounds):
    node = make_node(state=NodeState.ACTIVE, verdict="verified")
    VerificationRun.objects.create(node=node, verdict="verified")
    VerificationRun.objects.filter(node=node).update(created_at=timezone.now() - timedelta(days=2))
    dodge(node, NodeUnreachable("The SSH connection broke during a command: reset"))
    event = NodeEvent.objects.get(node=node, kind="spot_check_failed_to_run")
    assert event.level == NodeEvent.Level.WARNING and event.message.endswith("A full verification follows.")
    assert nodes_reverify_due()["queued"] == 1
    assert Job.objects.get(node=node, kind=JobKind.NODE_VERIFY).log[0]["message"] == \
        "queued: scheduled re-verification"


def test_a_dropped_spot_check_soon_after_a_verification_waits_its_turn(db, bounds):
    """At most one forced verification per SPOT_CHECK_MIN_S after the last: a flaky node is not checked in a loop."""
    node = make_node(state=NodeState.ACTIVE, verdict="verified")
    run = VerificationRun.objects.create(node=node, verdict="verified")
    dodge(node, AgentFailed({"code": "refused", "message": "no"}))
    node.refresh_from_db()
    assert node.next_check_at == run.created_at + timedelta(hours=6)
    assert nodes_reverify_due()["queued"] == 0


def test_a_spot_check_that_failed_on_the_platforms_side_moves_nothing(db, bounds):
    node = make_node(state=NodeState.ACTIVE, verdict="verified")
    dodge(node, NodeError("Internal error: KeyError. Operators have been told."))
    node.refresh_from_db()
    assert node.next_check_at > timezone.now() + timedelta(days=4)
    assert NodeEvent.objects.get(node=node, kind="spot_check_failed_to_run").level == NodeEvent.Level.INFO
