"""The platform's challenge per MIG slice (verification/slice_challenge.py): the draw scaled by the slice's profile,
the agent's sim slice doing the work at the share of the card it really has, the judgement naming the slice and
leaving it unproven, and the agent refusing bad slice requests. The exchange over SSH: test_benchmark_verification.py
(every profile's verdict) and tests/e2e/test_mig.py."""
import json
import os
import random
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from provisioning.agent import gpumarket_agent as agent
from provisioning.agent.gpumarket_agent import memproof as agent_memproof
from provisioning.agent.gpumarket_agent.core import AgentError
from provisioning.verification import challenge, challenge_verdict, memproof, memproof_verdict, slice_challenge
from provisioning.verification.mig import check_mig
from provisioning.verification.model import DeclaredModel, load_catalogue
from provisioning.verification.profiles import (
    PROFILES_DIR,
    simulated_memproof_outcome,
    simulated_outcome,
    simulated_slice_challenge,
)
from tests.provisioning.test_challenge import PipeExchange
from tests.provisioning.test_challenge_agent import hear, say, start
from tests.provisioning.test_memproof import flip_word

A100 = DeclaredModel.from_catalogue(load_catalogue()["a100-80gb-sxm"])


def sim(profile):
    path = PROFILES_DIR / f"{profile}.json"
    cfg = SimpleNamespace(runtime="sim", sim_profile=str(path))
    _, gpus = agent.load_profile(str(path))
    return path, cfg, gpus, agent.read_mig(cfg, gpus)


def test_slices_are_drawn_per_profile_at_their_share_of_the_card():
    _, _, gpus, devices = sim("a100-80gb-sxm-x2-mig")
    drawn = slice_challenge.draw_slices(A100, devices, [d["uuid"] for d in devices], quick=True,
                                        card_memory_mib=81920, rng=random.Random(1))
    assert [(d.profile.name, len(d.devices)) for d in drawn] == [("1g.10gb", 2), ("2g.20gb", 1), ("3g.40gb", 1)]
    for d in drawn:
        assert d.challenge.datasheet_tflops == pytest.approx(312 * d.profile.compute_slices / 7)
        assert d.model.memory_mib == 81920 * d.profile.memory_slices // 8
        request = d.challenge.request(30)
        labels = [challenge.MIG_LABEL_BASE + i for i in range(len(d.devices))]
        assert request["gpu_indices"] == labels and request["mig_uuids"] == [d.devices[x]["uuid"] for x in labels]
    # a rented slice (not named) is not challenged
    one = slice_challenge.draw_slices(A100, devices, [devices[0]["uuid"]], quick=True)
    assert [(d.profile.name, list(d.challenge.mig_uuids)) for d in one] == [("3g.40gb", [devices[0]["uuid"]])]


def test_an_honest_split_card_proves_every_slice():
    path, _, gpus, devices = sim("a100-80gb-sxm-x2-mig")
    findings, figures, disproved = simulated_slice_challenge(path, A100, gpus, devices)
    assert (findings, disproved) == ([], set())
    assert sorted(figures) == sorted(d["uuid"] for d in devices)
    # each slice at ~87 % of its own share of the datasheet, as its card works
    assert all(0.8 < row["of_datasheet"] < 0.95 and row["correct"] for row in figures.values()), figures


def test_a_slice_slower_than_its_profile_is_caught_though_its_figures_are_honest():
    path, cfg, gpus, devices = sim("a100-80gb-sxm-x2-mig-slice-slow")
    slow = devices[0]
    reported = agent.bench_slices(cfg, True, [slow["uuid"]])[0]
    assert reported["bf16_tflops"] > 0.8 * 312 * 3 / 7  # what the node says: a healthy 3g slice
    findings, figures, disproved = simulated_slice_challenge(path, A100, gpus, devices)
    assert disproved == {slow["uuid"]}
    assert [(f.code, f.severity, f.gpu_index) for f in findings] == [("mig_slice_challenge_too_slow", "reject", 0)]
    assert slow["uuid"] in findings[0].message and "3g.40gb" in findings[0].message
    assert 0.25 < figures[slow["uuid"]]["of_datasheet"] < 0.33  # one compute slice of the three named
    # the layout judgement then leaves it unproven: not listed, not in the card's score
    layout = {0: [d["profile"] for d in devices]}
    bench = agent.bench_slices(cfg, True, [d["uuid"] for d in devices])
    _, slices = check_mig(A100, layout, gpus, devices, bench, disproved=disproved)
    assert [s["proven"] for s in slices] == [False, True, True, True]
    _, slices = check_mig(A100, layout, gpus, devices, bench)
    assert all(s["proven"] for s in slices)  # on the node's own figures alone it would have passed


def test_a_slice_that_answers_faster_than_its_share_or_wrongly_is_disproved():
    path, _, gpus, devices = sim("a100-80gb-sxm-x2-mig")
    (drawn,) = slice_challenge.draw_slices(A100, devices, [d["uuid"] for d in devices if d["profile"] == "1g.10gb"],
                                           quick=True)
    fast, wrong = drawn.devices
    outcome = simulated_outcome(path, drawn.challenge)
    outcome.arrivals[fast] = 0.2  # a whole card's speed for a 1g slice: not computed on this slice
    outcome.revealed[str(wrong)]["rows"][0]["values"][0] += 1
    findings, _, disproved = slice_challenge.judge_slices(drawn, outcome)
    assert disproved == {drawn.devices[fast]["uuid"], drawn.devices[wrong]["uuid"]}
    by_code = {f.code: f for f in findings}
    assert set(by_code) >= {"mig_slice_challenge_too_fast", "mig_slice_challenge_wrong_result"}
    assert drawn.devices[fast]["uuid"] in by_code["mig_slice_challenge_too_fast"].message
    assert drawn.devices[wrong]["uuid"] in by_code["mig_slice_challenge_wrong_result"].message


def test_a_node_that_does_not_answer_leaves_every_slice_of_the_exchange_unproven():
    _, _, _, devices = sim("a100-80gb-sxm-x2-mig")
    (drawn,) = slice_challenge.draw_slices(A100, devices, [d["uuid"] for d in devices if d["profile"] == "1g.10gb"],
                                           quick=True)
    outcome = challenge.Outcome(round_trip_s=0.01, problem="stopped with an error: no such MIG device")
    findings, _, disproved = slice_challenge.judge_slices(drawn, outcome)
    assert {f.code for f in findings} == {"mig_slice_challenge_no_answer"}
    assert disproved == {d["uuid"] for d in drawn.devices.values()}


def test_the_platform_and_the_sim_agent_complete_a_slice_exchange_on_pipes():
    path, _, gpus, devices = sim("a100-80gb-sxm-x2-mig-slices-smaller")
    (drawn,) = slice_challenge.draw_slices(A100, devices, [devices[0]["uuid"]], quick=True)
    a, b = os.pipe()
    c, d = os.pipe()
    to_node, node_in = os.fdopen(b, "w"), os.fdopen(a)
    node_out, from_node = os.fdopen(d, "w"), os.fdopen(c)
    cfg = SimpleNamespace(runtime="sim", sim_profile=str(path))
    status = []
    thread = threading.Thread(target=lambda: status.append(agent.run_exchange(cfg, node_in, node_out)))
    thread.start()
    try:
        out = challenge.run(PipeExchange(to_node, from_node), drawn.challenge, 300)
        final = json.loads(from_node.readline())
    finally:
        to_node.close()
        thread.join(30)
    assert (final["ok"], status) == (True, [0])
    findings, figures, disproved = slice_challenge.judge_slices(drawn, out)
    # a 2g slice named 3g: two thirds of the work rate the profile claims (~58 %: the degrade band)
    assert [f.code for f in findings] == ["mig_slice_challenge_too_slow"], findings
    assert 0.5 < figures["slices"][devices[0]["uuid"]]["of_datasheet"] < 0.65
    assert figures["slices"][devices[0]["uuid"]]["correct"]


UUID = "MIG-382e973b-d8f5-84b6-645d-145d612dbf11"  # slice 0 of a100-80gb-sxm-x2-mig


def slice_request(**changes):
    drawn = challenge.draw(replace(A100, datasheet={"bf16_tflops": 312 * 3 / 7}), [challenge.MIG_LABEL_BASE], True)
    return dict(replace(drawn, mig_uuids=(UUID,)).request(30), **changes)


@pytest.mark.parametrize(("changes", "field"), [
    ({"mig_uuids": ["MIG-x; rm -rf /"]}, "mig_uuids"),
    ({"mig_uuids": ["GPU-382e973b-d8f5-84b6-645d-145d612dbf11"]}, "mig_uuids"),
    ({"mig_uuids": [UUID, UUID]}, "mig_uuids"),
    ({"mig_uuids": UUID}, "mig_uuids"),
    ({"gpu_indices": [challenge.MIG_LABEL_BASE + 1]}, "gpu_indices"),  # a label with no slice behind it
    ({"mig_uuids": None}, "gpu_indices"),
])
def test_the_agent_refuses_a_bad_slice_request_naming_the_field(changes, field):
    with pytest.raises(AgentError) as caught:
        agent.validate_challenge(slice_request(**changes))
    assert (caught.value.code, caught.value.field) == ("invalid_request", field)


def test_the_sim_agent_refuses_a_slice_it_does_not_have():
    _, cfg, _, _ = sim("a100-80gb-sxm-x2-mig-slices-smaller")  # other UUIDs than UUID's profile
    req = agent.validate_challenge(slice_request())
    with pytest.raises(AgentError) as caught:
        agent.sim_work(cfg, req)
    assert (caught.value.code, caught.value.field) == ("invalid_request", "mig_uuids")


def test_a_real_node_refuses_a_sim_slices_nominal_work():
    import io
    answer = io.StringIO()
    status = agent.run_exchange(SimpleNamespace(runtime="docker"),
                                io.StringIO(json.dumps({"challenge": slice_request()}) + "\n"), answer)
    assert status == 1 and json.loads(answer.getvalue())["error"]["code"] == "challenge_unsupported"


def tiny_slice(uuids=(UUID,)):
    labels = [challenge.MIG_LABEL_BASE + i for i in range(len(uuids))]
    drawn = challenge.draw_real(0.05, 4096, labels, quick=True, device="cpu", sizes=(256, 512, 2))
    return replace(drawn, mig_uuids=tuple(uuids))


def test_a_real_node_challenges_a_slice_in_a_child_that_sees_only_it(tmp_path):
    """The zipapp as on a real node (runtime docker; the work on this CPU, no GPU here): the agent relays the
    exchange to a child agent started with CUDA_VISIBLE_DEVICES=<the slice>, and the platform's own check passes."""
    torch = pytest.importorskip("torch")
    assert torch
    drawn = tiny_slice()
    out = run_on_a_real_slice(tmp_path, "challenge", challenge.run, drawn)
    label = challenge.MIG_LABEL_BASE
    assert challenge_verdict.check_gpu(drawn, label, out.commitments[label], out.picks[label],
                                       out.revealed[str(label)], out.output_dtypes.get(label)) == ""
    # one slice per exchange on a real node: CUDA shows a process one MIG device
    proc = start(tmp_path, runtime="docker")
    say(proc, {"challenge": tiny_slice((UUID, "MIG-25ed6b80-d9fe-5162-3cab-5650f90cb68e")).request(60)})
    answer = hear(proc)
    assert (answer["error"]["code"], answer["error"]["field"]) == ("invalid_request", "mig_uuids")
    assert proc.wait(10) == 2


class ProcExchange:
    """The exchange on the agent's pipes; `children`: the slice variables of the agent's child processes, as
    /proc showed them when the first line after the pongs arrived (a child's, relayed)."""

    def __init__(self, proc):
        self.proc, self.children = proc, None

    def send(self, message):
        say(self.proc, message)
        return time.monotonic()

    def receive(self, timeout):
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError
        if self.children is None and "pong" not in json.loads(line):
            self.children = slice_children(self.proc.pid)
        return line.encode(), time.monotonic()


def run_on_a_real_slice(tmp_path, command, run, drawn):
    """The platform's `run` of `command` against the zipapp as on a real node; checks that it ended well and that
    a child that sees only the slice did the work. Returns the outcome."""
    proc = start(tmp_path, runtime="docker", command=command)
    try:
        exchange = ProcExchange(proc)
        out = run(exchange, drawn, 120)
        final = hear(proc)
    finally:
        proc.stdin.close()
    assert (final["ok"], proc.wait(30), out.problem) == (True, 0, "")
    assert exchange.children == [{"CUDA_VISIBLE_DEVICES": UUID, "GPUMARKET_MIG_SLICE": UUID}]
    return out


def slice_children(pid):
    """[{CUDA_VISIBLE_DEVICES, GPUMARKET_MIG_SLICE}] of each child process of `pid` (Linux /proc)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as listed:
            for child in listed.read().split():
                with open(f"/proc/{child}/environ", "rb") as environ:
                    pairs = dict(item.split(b"=", 1) for item in environ.read().split(b"\0") if b"=" in item)
                found.append({k.decode(): v.decode() for k, v in pairs.items()
                              if k in (b"CUDA_VISIBLE_DEVICES", b"GPUMARKET_MIG_SLICE")})
    return found


def test_a_real_node_proves_a_slices_memory_in_a_child_that_sees_only_it(tmp_path):
    """The memory proof as the challenge: a real node's agent relays the exchange (roots, fresh salt, openings) to
    a child that sees only the slice, and the platform's own check of the openings passes; two slices in one
    proof are refused, as in the challenge."""
    pytest.importorskip("torch")
    (shape,) = [s for s in slice_challenge.draw_slices(A100, [{"gpu": 0, "device": 0, "profile": "1g.10gb",
                                                               "uuid": UUID}], [UUID], quick=True, real_work=True)]
    drawn = replace(memproof.draw(shape.model, [challenge.MIG_LABEL_BASE], rng=random.Random(3), device="cpu",
                                  sizes={"blocks": 9, "chunks": 6, "words": 16}), mig_uuids=(UUID,))
    out = run_on_a_real_slice(tmp_path, "memproof", memproof.run, drawn)
    label = challenge.MIG_LABEL_BASE
    assert out.fresh_rounds == 1 and memproof_verdict.check_gpu(drawn, out, label) == ""
    findings, figures, disproved = slice_challenge.judge_slice_proofs(replace(shape, proof=drawn), out)
    assert (findings, disproved) == ([], set()) and figures["slices"][UUID]["correct"] is True
    proc = start(tmp_path, runtime="docker", command="memproof")
    two = replace(drawn, gpu_indices=(label, label + 1), mig_uuids=(UUID, "MIG-25ed6b80-d9fe-5162-3cab-5650f90cb68e"))
    say(proc, {"memproof": two.request(60)})
    answer = hear(proc)
    assert (answer["error"]["code"], answer["error"]["field"]) == ("invalid_request", "mig_uuids")
    assert proc.wait(10) == 2


def test_a_slice_child_that_dies_is_the_exchanges_error_not_silence(tmp_path, monkeypatch):
    """A child that ends without its last line (killed, out of memory) is the command's error, which run_exchange
    writes as the last line: the platform hears why, not silence."""
    import io

    from provisioning.agent.gpumarket_agent import challenge as agent_challenge
    from provisioning.agent.gpumarket_agent import mig as agent_mig
    monkeypatch.setattr(agent_mig.sys, "argv", [str(tmp_path / "no-such-agent.pyz")])
    req = replace(tiny_slice(), gpu_indices=(challenge.MIG_LABEL_BASE,)).request(30)
    answer = io.StringIO()
    with pytest.raises(AgentError) as caught:
        agent_mig.relay_to_slice(req, agent_challenge.Lines(io.StringIO(""), answer), "challenge", "commitment")
    assert caught.value.code == "challenge_failed" and UUID in caught.value.message


# ------------------------------------------------------------------------------------ the memory proof per slice

def test_each_slice_fills_its_profiles_share_of_the_card_and_an_honest_one_passes():
    path, _, gpus, devices = sim("a100-80gb-sxm-x2-mig")
    drawn = slice_challenge.draw_slices(A100, devices, [d["uuid"] for d in devices], quick=True, card_memory_mib=81920)
    for d in drawn:
        assert d.proof.nominal_bytes == pytest.approx(0.95 * 81920 * d.profile.memory_slices / 8 * 2 ** 20, abs=1)
        assert d.proof.request(30)["mig_uuids"] == list(d.challenge.mig_uuids)
        findings, figures, disproved = slice_challenge.judge_slice_proofs(d, simulated_memproof_outcome(path, d.proof))
        assert (findings, disproved) == ([], set()), findings
        assert all(row["correct"] for row in figures["slices"].values())


def test_a_slice_smaller_than_its_name_is_late_to_re_read_the_fill():
    path, _, gpus, devices = sim("a100-80gb-sxm-x2-mig-slices-smaller")
    (drawn,) = slice_challenge.draw_slices(A100, devices, [devices[0]["uuid"]], quick=True, card_memory_mib=81920)
    findings, _, disproved = slice_challenge.judge_slice_proofs(drawn, simulated_memproof_outcome(path, drawn.proof))
    assert [(f.code, f.severity, f.gpu_index) for f in findings] == [("mig_slice_memory_proof_late", "reject", 0)]
    assert devices[0]["uuid"] in findings[0].message and disproved == {devices[0]["uuid"]}


def test_a_slice_that_opens_made_up_chunks_fails_the_proof():
    path, _, gpus, devices = sim("a100-80gb-sxm-x2-mig")
    (drawn,) = slice_challenge.draw_slices(A100, devices, [devices[1]["uuid"]], quick=True)
    outcome = simulated_memproof_outcome(path, drawn.proof)
    label = str(challenge.MIG_LABEL_BASE)
    flip_word(outcome.opened[label][0])
    findings, _, disproved = slice_challenge.judge_slice_proofs(drawn, outcome)
    assert [f.code for f in findings] == ["mig_slice_memory_proof_failed"] and disproved == {devices[1]["uuid"]}


def test_the_agent_refuses_a_bad_slice_memory_proof_request():
    _, cfg, _, devices = sim("a100-80gb-sxm-x2-mig")
    (drawn,) = slice_challenge.draw_slices(A100, devices, [devices[0]["uuid"]], quick=True)
    for changes, field in (({"mig_uuids": ["MIG-$(reboot)"]}, "mig_uuids"),
                           ({"gpu_indices": [challenge.MIG_LABEL_BASE + 3]}, "gpu_indices")):
        with pytest.raises(AgentError) as caught:
            agent_memproof.validate(dict(drawn.proof.request(30), **changes))
        assert (caught.value.code, caught.value.field) == ("invalid_request", field)
    other = dict(drawn.proof.request(30), mig_uuids=["MIG-70abe48c-c4c3-471c-23d4-53a46b8ef9e5"])  # not this node's
    with pytest.raises(AgentError) as caught:
        agent_memproof.sim_cards(cfg, agent_memproof.validate(other))
    assert caught.value.field == "mig_uuids"
