"""Judge a sim profile without a node or a database: its nvidia-smi lines as the inventory, one noisy draw of its
`performance` as the benchmark, its `declared` model from the catalogue's JSON. For tests and
bench/verdict_stability.py; the platform judges real answers that came over SSH."""
from __future__ import annotations

import json
import random
import time
from pathlib import Path
from types import SimpleNamespace

from marketplace.mig import layout_by_gpu
from provisioning.agent import gpumarket_agent as agent
from provisioning.agent.gpumarket_agent import memproof as agent_memproof
from provisioning.verification import challenge, challenge_verdict, memproof, memproof_verdict, slice_challenge
from provisioning.verification.mig import judge_mig
from provisioning.verification.model import DeclaredModel, Finding, load_catalogue
from provisioning.verification.performance import FleetReference
from provisioning.verification.policy import Judgement, judge

PROFILES_DIR = Path(agent.__file__).resolve().parents[1] / "profiles"  # beside the agent package


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def profile_expectation(name: str) -> dict:
    """{"verdict": ..., "findings": [codes that must be among the findings]} as the profile states it."""
    return json.loads((PROFILES_DIR / f"{name}.json").read_text())["expect"]


def judge_profile(name: str, catalogue: dict | None = None, quick: bool = True,
                  fleet: FleetReference | None | bool = True) -> Judgement:
    """`fleet`: True = the fleet the profile's `expect.fleet` names (profile_fleet), else none; or the reference
    to judge it against; None/False = the datasheet only."""
    path = PROFILES_DIR / f"{name}.json"
    profile, gpus = agent.load_profile(str(path))
    declared = profile["declared"]
    catalogue = catalogue or load_catalogue()
    entry = catalogue[declared["gpu_model"]]
    if fleet is True:
        fleet = profile_fleet(name, catalogue)
    layout = layout_by_gpu(declared.get("mig_layout"))
    whole = [g["index"] for g in gpus if g["index"] not in layout]  # a card split into slices is measured per slice
    cfg = SimpleNamespace(sim_profile=str(path), runtime="sim")
    bench = agent.sim_benchmark(cfg, quick, whole)
    devices = agent.read_mig(cfg, gpus)
    if layout:
        bench["mig_slices"] = agent.bench_slices(cfg, quick, [d["uuid"] for d in devices if d["gpu"] in layout])
    model = DeclaredModel.from_catalogue(entry)
    found, challenge_figures = simulated_challenge(path, model, whole, quick) if whole else ([], {})
    if whole:
        found += simulated_memory_proof(path, model, whole)[0]
    slice_found, _, disproved = simulated_slice_challenge(path, model, gpus, [d for d in devices if d["gpu"] in layout],
                                                          quick)
    found += slice_found
    bench["p2p"] = agent.p2p_figures(cfg, whole, wait=False)  # the figures, without the copies' wall time
    topology = agent.read_topology(SimpleNamespace(runtime="sim"), gpus, profile)
    mig = judge_mig(model, layout, {"gpus": gpus, "mig": devices}, bench, disproved=disproved)
    return judge(model, declared["gpu_count"], gpus, bench, challenge=found, fleet=fleet or None, topology=topology,
                 nvlink_declared=declared.get("nvlink", False), mig=mig,
                 platform_rates=challenge_verdict.platform_rates(challenge_figures))


def fleet_figures(name: str, nodes: int, catalogue: dict | None = None, quick: bool = True) -> list[dict]:
    """The figures `nodes` nodes with this (honest) profile's hardware would record: one draw each, without fleet."""
    catalogue = catalogue or load_catalogue()
    return [judge_profile(name, catalogue, quick, fleet=False).figures for _ in range(nodes)]


def profile_fleet(name: str, catalogue: dict | None = None) -> FleetReference | None:
    """The fleet reference a profile's `expect.fleet` ({"profile": honest profile, "nodes": n}) describes: n nodes
    of that profile, as the platform's selector would build it from their runs. None when it names none."""
    spec = profile_expectation(name).get("fleet")
    if not spec:
        return None
    return FleetReference.from_node_medians(
        [figures["median"] for figures in fleet_figures(spec["profile"], spec["nodes"], catalogue)])


def simulated_challenge(path: Path, declared: DeclaredModel, gpu_indices: list[int], quick: bool = True,
                        round_trip_s: float = 0.0, drawn: challenge.Challenge | None = None,
                        ) -> tuple[list[Finding], dict]:
    """The platform's challenge against the profile's sim agent, in process: the agent's own sim work (its real
    products, its real card's time for the nominal work) and the platform's own checks, with no SSH in between
    (each commitment arrives exactly when the sim agent would send it, plus `round_trip_s`). `drawn`: a
    challenge drawn elsewhere (the MIG slices'), judged here by its outcome only."""
    drawn = drawn or challenge.draw(declared, gpu_indices, quick)
    outcome = simulated_outcome(path, drawn, round_trip_s)
    started = time.process_time()
    findings, figures = challenge_verdict.judge(declared, drawn, outcome)
    figures["verify_cpu_s"] = time.process_time() - started  # as node_challenge records it
    return findings, figures


def simulated_slice_challenge(path: Path, declared: DeclaredModel, gpus: list[dict], devices: list[dict],
                              quick: bool = True) -> tuple[list[Finding], dict, set[str]]:
    """The platform's challenge and memory proof of the profile's MIG slices (`devices`), in process, as
    node_slice_challenge runs them over SSH: (findings, figures by slice UUID, disproved UUIDs)."""
    cards = {g["index"]: g.get("memory_total_mib") for g in gpus}
    findings: list[Finding] = []
    figures: dict = {}
    disproved: set[str] = set()
    for gpu in sorted({d["gpu"] for d in devices}):
        on_card = [d for d in devices if d["gpu"] == gpu]
        for drawn in slice_challenge.draw_slices(declared, on_card, [d["uuid"] for d in on_card], quick,
                                                 card_memory_mib=cards.get(gpu)):
            found, measured, bad = slice_challenge.judge_slices(drawn, simulated_outcome(path, drawn.challenge))
            assert drawn.proof is not None
            proved, held, lost = slice_challenge.judge_slice_proofs(drawn, simulated_memproof_outcome(path,
                                                                                                     drawn.proof))
            findings += found + proved
            disproved |= bad | lost
            figures.update({u: dict(row, memory_proof=held["slices"].get(u)) for u, row in measured["slices"].items()})
    return findings, figures, disproved


def simulated_outcome(path: Path, drawn: challenge.Challenge, round_trip_s: float = 0.0) -> challenge.Outcome:
    """What challenge.run would see of the profile's sim agent answering `drawn`."""
    req = agent.validate_challenge(drawn.request(agent.BENCH_LIMIT_S[0]))
    results, seconds, _ = agent.sim_work(SimpleNamespace(sim_profile=str(path)), req)
    out = challenge.Outcome(round_trip_s=round_trip_s, sent_at=0.0)
    for gpu, taken in seconds.items():
        if taken + round_trip_s > drawn.wait_s:  # the platform stops waiting, as challenge.run does
            out.problem = f"sent no commitment within {drawn.wait_s:.0f} s"
            return out
        out.arrivals[gpu] = taken + round_trip_s
        out.commitments[gpu] = results[gpu].commitment()
    out.picks = challenge.pick_rows(drawn, random.SystemRandom())
    out.revealed = agent.reveal_rows(challenge.reveal_request(out.picks)["reveal"], results)
    return out


def simulated_memory_proof(path: Path, declared: DeclaredModel, gpu_indices: list[int],
                           round_trip_s: float = 0.0) -> tuple[list[Finding], dict]:
    """The platform's memory proof against the profile's sim agent, in process (as simulated_challenge): the
    agent's own fill and digests, each fresh root arriving when the sim agent would send it."""
    drawn = memproof.draw(declared, gpu_indices)
    return memproof_verdict.judge(declared, drawn, simulated_memproof_outcome(path, drawn, round_trip_s))


def simulated_memproof_outcome(path: Path, drawn: memproof.MemProof, round_trip_s: float = 0.0) -> memproof.Outcome:
    """What memproof.run would see of the profile's sim agent answering `drawn`."""
    gpu_indices = list(drawn.gpu_indices)
    req = agent_memproof.validate(drawn.request(agent.BENCH_LIMIT_S[0]))
    cards = agent_memproof.sim_cards(SimpleNamespace(sim_profile=str(path)), req)
    rng = random.SystemRandom()
    out = memproof.Outcome(round_trip_s=round_trip_s, fresh_sent_at=0.0, fresh_salt=rng.getrandbits(64))
    for gpu, card in cards.items():
        out.roots[gpu] = card.commit(agent_memproof.position_salts(agent_memproof.key(drawn.seed, gpu, "digest"),
                                                                   drawn.words))
        out.fresh_roots[gpu] = card.commit(agent_memproof.position_salts(out.fresh_salt, drawn.words), fresh=True)
        out.fresh_arrivals[gpu] = card.fresh_s() + round_trip_s
    out.picks = {g: [(rng.randrange(1, drawn.blocks), rng.randrange(drawn.chunks)) for _ in range(memproof.OPENINGS)]
                 for g in gpu_indices}
    out.opened = agent_memproof.opened({"open": {str(g): [list(p) for p in picks] for g, picks in out.picks.items()}},
                                       cards, req)
    return out
