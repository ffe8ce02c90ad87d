"""The acceptance policy: from (catalogue entry, declared count, agent answers) to findings a provider can act
on, from findings to a verdict, and from measured figures to a score. The rules live by what they judge
(identity.py, performance.py, interconnect.py; the platform's own checks in challenge.py, memproof.py, mig.py);
every threshold in tolerances.TOLERANCES. Nothing here touches the database or Django: scripts/gpu-selfcheck and
bench/verdict_stability.py use it with the catalogue's JSON file.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from provisioning.verification.identity import check_identity
from provisioning.verification.interconnect import check_topology, nvlink_summary
from provisioning.verification.model import REJECT, DeclaredModel, Finding
from provisioning.verification.performance import FleetReference, check_performance, on_gpu
from provisioning.verification.tolerances import FIGURES, PLATFORM_FIGURES, TOLERANCES


def verdict_for(findings: list[Finding]) -> str:
    if any(f.severity == REJECT for f in findings):
        return "rejected"
    if findings:
        return "degraded"
    return "verified"


def gpu_score(gpu: dict) -> float | None:
    """100 x geometric mean of (BF16, bandwidth) / the reference card's datasheet, for one GPU."""
    ref = TOLERANCES["score_reference"]
    bf16, bandwidth = gpu.get("bf16_tflops"), gpu.get("memory_bandwidth_gbs")
    if not bf16 or not bandwidth:
        return None
    return 100 * math.sqrt(bf16 / ref["bf16_tflops"] * bandwidth / ref["memory_bandwidth_gbs"])


def node_score(gpus: list[dict], verdict: str) -> float | None:
    """The node's score per GPU (offers are priced per GPU-hour): the mean GPU score, lowered for a degraded
    node, 0 for a rejected one. None when no GPU was measured."""
    scores = [s for s in map(gpu_score, gpus) if s is not None]
    if not scores:
        return None
    return round(statistics.fmean(scores) * TOLERANCES["score_factor"][verdict], 2)


def _dedupe(findings: list[Finding]) -> list[Finding]:
    seen, kept = set(), []
    for f in findings:
        if (f.code, f.gpu_index) not in seen:
            seen.add((f.code, f.gpu_index))
            kept.append(f)
    return kept


@dataclass(frozen=True)
class MigJudgement:
    """The MIG part of a check (verification/mig.py): findings, the slices judged, the GPUs declared split, and
    the slices' figures as whole-card equivalents for the score."""

    findings: Sequence[Finding] = ()
    slices: Sequence[dict] = ()
    gpus: frozenset[int] = frozenset()
    card_figures: Sequence[dict] = ()


@dataclass
class Judgement:
    verdict: str
    findings: list[Finding]
    score: float | None
    figures: dict


# Throughput per watt: the BF16 matmul figure over the most the card drew under that load (the telemetry's
# maximum while loaded, so the figure errs low, never high). Only on CUDA runs: a CPU run has no GPU power.
PER_WATT_FIGURES = ("power_draw_w", "bf16_tflops_per_w")


def per_watt(gpu: dict) -> dict:
    """A GPU's power under load and its BF16 TFLOP/s per watt (None where either was not measured)."""
    draw = (gpu.get("telemetry") or {}).get("power_draw_w")
    tflops = gpu.get("bf16_tflops")
    draw = draw if isinstance(draw, int | float) and draw > 0 else None
    return {"power_draw_w": draw,
            "bf16_tflops_per_w": round(tflops / draw, 5) if draw and isinstance(tflops, int | float) else None}


def summarize(declared: DeclaredModel, bench: dict) -> dict:
    """What a verification run keeps of the benchmark: per GPU figures, their share of the datasheet, a score."""
    keep = ("index", "uuid", "name", "sm_count", *FIGURES, "h2d_gbs", "d2h_gbs", "cnn_train_images_s",
            "cnn_infer_images_s", *PLATFORM_FIGURES, "matmul_rel_error", "matmul_shapes_tflops", "telemetry")
    gpus = []
    for gpu in bench.get("gpus") or []:
        row = {k: gpu.get(k) for k in keep}
        row["of_datasheet"] = {k: round(gpu[k] / declared.datasheet[k], 3) for k in FIGURES
                               if gpu.get(k) and declared.datasheet.get(k)}
        score = gpu_score(gpu)
        row["score"] = round(score, 2) if score is not None else None
        if on_gpu(bench):
            row.update(per_watt(gpu))
        gpus.append(row)
    medians = {}
    for key in (*FIGURES, "h2d_gbs", "d2h_gbs", "cnn_train_images_s", "cnn_infer_images_s", *PLATFORM_FIGURES,
                *PER_WATT_FIGURES):
        values = [g[key] for g in gpus if g.get(key) is not None]
        places = 5 if key == "bf16_tflops_per_w" else 3  # ~0.5-2 TFLOP/s per W: 3 places would be 3 digits
        medians[key] = round(statistics.median(values), places) if values else None
    head = {k: bench.get(k) for k in ("mode", "device", "quick", "duration_s", "time_limit_s", "torch_version",
                                      "cuda_runtime", "agent_version")}
    return {**head, "datasheet": dict(declared.datasheet), "score_reference": TOLERANCES["score_reference"]["name"],
            "median": medians, "gpus": gpus}


def judge(declared: DeclaredModel, declared_count: int, inventory_gpus: list[dict], bench: dict | None,
          bench_error: str = "", fleet: FleetReference | None = None,
          challenge: Sequence[Finding] = (), topology: dict | None = None,
          nvlink_declared: bool = False, mig: MigJudgement | None = None,
          malformed: Sequence[Finding] = (), platform_rates: Mapping[int, float] | None = None) -> Judgement:
    """The whole policy: identity, then the benchmark's figures (when there are any) against the datasheet and,
    when the model has one, its fleet reference; with the platform's own challenge findings (challenge_verdict.judge)
    and `malformed`, the findings on answers that failed their check (answers.py; such a benchmark is given as
    None); verdict and score. `platform_rates`: each GPU's BF16 TFLOP/s the challenge measured on the platform's
    clock (challenge_verdict.platform_rates), kept and judged against the fleet beside the agent's figures."""
    mig = mig or MigJudgement()
    if bench is not None and platform_rates:
        bench = {**bench, "gpus": [{**g, "platform_bf16_tflops": platform_rates.get(g["index"])}
                                   for g in bench.get("gpus") or [] if isinstance(g, dict)]}
    findings = check_identity(declared, declared_count, inventory_gpus, mig.gpus)
    if bench is not None:
        findings += check_performance(declared, bench, inventory_gpus, fleet)
    findings += list(malformed)
    findings += list(challenge)
    findings += list(mig.findings)
    p2p = (bench or {}).get("p2p")
    findings += check_topology(nvlink_declared, declared_count, topology, p2p)
    if bench_error:
        findings.append(Finding(REJECT, "benchmark_unavailable", f"The benchmark could not run: {bench_error}"))
    findings = _dedupe(findings)
    verdict = verdict_for(findings)
    figures = summarize(declared, bench) if bench is not None else {}
    if figures and fleet is not None:  # what this node was compared with, kept with its figures
        figures["fleet"] = {"nodes": fleet.nodes, "median": {k: round(v, 3) for k, v in fleet.median.items()},
                            **({"providers": fleet.providers} if fleet.providers is not None else {})}
    if figures and (topology or p2p):
        figures["p2p"] = list(p2p or [])
        figures["nvlink"] = nvlink_summary(topology, p2p)
    if figures and mig.slices:
        figures["mig_slices"] = [dict(s) for s in mig.slices]
    score = node_score([*(bench.get("gpus") or []), *mig.card_figures], verdict) if bench is not None else None
    return Judgement(verdict, findings, score, figures)
