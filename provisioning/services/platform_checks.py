"""The platform's own checks over a node's SSH session, as steps of a job: its throughput to the node, the
challenge (verification/challenge.py) and the memory proof (verification/memproof.py) on whole GPUs, and both on
free MIG slices (verification/slice_challenge.py). What the node answers or fails to answer becomes findings
and figures; only a broken connection raises (NodeError). Used by a verification and by a spot check.
"""
from __future__ import annotations

import time
from typing import Any

from django.conf import settings

from provisioning.models import Job
from provisioning.services.runner import job_step
from provisioning.ssh import NodeSession
from provisioning.ssh_errors import NodeError
from provisioning.verification import challenge, challenge_verdict, memproof, memproof_verdict, slice_challenge
from provisioning.verification.model import DeclaredModel, Finding

# Why a real node's memory proof is not run (on its whole GPUs and on its MIG slices alike).
MEMPROOF_NOT_RUN = "the memory proof's deadline on a real GPU is not measured yet (docs/BENCHMARKS.md)"


def _over_exchange(session: NodeSession, command: str, run: Any, drawn: Any) -> Any:
    """run(exchange, drawn, the time limit) over a new exchange with the agent's `command`, closed whatever
    happens."""
    exchange = session.exchange(command)
    try:
        return run(exchange, drawn, settings.BENCHMARK_TIME_LIMIT_S)
    finally:
        exchange.close()


def _judged(judge: Any, *args: Any) -> tuple[list[Finding], dict[str, Any]]:
    """judge(*args), its figures with the control plane's CPU for it (verify_cpu_s: docs/BENCHMARKS.md)."""
    started = time.process_time()
    findings, figures = judge(*args)
    figures["verify_cpu_s"] = round(time.process_time() - started, 6)
    return findings, figures


def node_network_test(job: Job, session: NodeSession) -> float | None:
    """The platform's own measure of its throughput to the node (NodeSession.upload_throughput): NET_TEST_BYTES
    over SSH. None when switched off or when it failed (a failure is not the node's verdict: it is logged)."""
    nbytes = settings.NET_TEST_BYTES
    if nbytes <= 0:
        return None
    job_step(job=job, message=f"measuring the platform's throughput to the node ({nbytes >> 20} MiB over SSH)")
    try:
        return round(session.upload_throughput(nbytes, timeout=60), 1)
    except NodeError as exc:
        job_step(job=job, message=f"the network test failed: {exc.message}")
        return None


def node_challenge(job: Job, session: NodeSession, declared: DeclaredModel,
                   gpus: list[int]) -> tuple[list[Finding], dict[str, Any]]:
    """The platform's own check of the GPUs' work (verification/challenge.py): matrices from a secret seed,
    committed, revealed where the platform picks, recomputed and timed on the platform's side. What the node
    answers or fails to answer becomes findings; only a broken connection raises (NodeError)."""
    # A sim node does small work standing for the nominal; every other runtime does the real work on its GPUs.
    drawn = challenge.draw(declared, gpus, settings.BENCHMARK_QUICK, real_work=job.node.runtime != "sim")
    job_step(job=job, message=f"challenging GPU{'s' if len(gpus) > 1 else ''} {', '.join(map(str, gpus))} "
                              f"(at most {drawn.wait_s + 4 * challenge.PING_TIMEOUT_S:.0f} s)")
    return _judged(challenge_verdict.judge, declared, drawn, _over_exchange(session, "challenge", challenge.run, drawn))


def node_slice_challenge(job: Job, session: NodeSession, declared: DeclaredModel, inventory: dict[str, Any],
                         uuids: list[str]) -> tuple[list[Finding], dict[str, Any], set[str]]:
    """The platform's challenge and memory proof on the free MIG slices (verification/slice_challenge.py), one
    exchange of each per profile and card, each slice held to its profile's share of the card. Returns (findings,
    figures, disproved UUIDs). A real node's slices get the real-work challenge one slice per exchange; the
    memory proof is sim only, as for whole GPUs (node_memory_proof)."""
    real = job.node.runtime != "sim"
    cards = {g.get("index"): g.get("memory_total_mib") for g in inventory.get("gpus") or []}
    findings: list[Finding] = []
    figures: dict[str, Any] = {}
    disproved: set[str] = set()
    devices = inventory.get("mig") or []
    for gpu in sorted({d["gpu"] for d in devices if d.get("uuid") in uuids}):
        on_card = [d for d in devices if d["gpu"] == gpu]
        for drawn in slice_challenge.draw_slices(declared, on_card, uuids, settings.BENCHMARK_QUICK,
                                                 card_memory_mib=cards.get(gpu), real_work=real):
            job_step(job=job, message=f"challenging GPU {gpu}'s MIG {drawn.profile.name} slice"
                                      f"{'s' if len(drawn.devices) > 1 else ''} (at most "
                                      f"{drawn.challenge.wait_s + 4 * challenge.PING_TIMEOUT_S:.0f} s)")
            outcome = _over_exchange(session, "challenge", challenge.run, drawn.challenge)
            found, measured, bad = slice_challenge.judge_slices(drawn, outcome)
            if real or drawn.proof is None:
                findings += found
                disproved |= bad
                figures.setdefault("slices", {}).update(measured["slices"])
                figures["memory_proof"] = {"not_run": MEMPROOF_NOT_RUN}
                continue
            job_step(job=job, message=f"proving the memory of GPU {gpu}'s MIG {drawn.profile.name} slice"
                                      f"{'s' if len(drawn.devices) > 1 else ''} "
                                      f"({drawn.proof.nominal_bytes / 2 ** 30:.1f} GiB each)")
            proved = _over_exchange(session, "memproof", memproof.run, drawn.proof)
            held_found, held, lost = slice_challenge.judge_slice_proofs(drawn, proved)
            findings += found + held_found
            disproved |= bad | lost
            slices = figures.setdefault("slices", {})
            slices.update({uuid: dict(row, memory_proof=held["slices"].get(uuid))
                           for uuid, row in measured["slices"].items()})
    return findings, figures, disproved


def ecc_mode_of(inventory: dict[str, Any], gpus: list[int]) -> str | None:
    """The ECC mode the inventory reports for all of `gpus` alike (the memory proof's size); None when they differ
    or it does not say (the proof then asks for the smaller of the model's sizes)."""
    rows = [g for g in inventory.get("gpus") or [] if isinstance(g, dict) and g.get("index") in gpus]
    modes = {str(g.get("ecc_mode") or "").lower() for g in rows}
    return modes.pop() if len(modes) == 1 and len(rows) == len(gpus) else None


def node_memory_proof(job: Job, session: NodeSession, declared: DeclaredModel, gpus: list[int],
                      inventory: dict[str, Any] | None = None) -> tuple[list[Finding], dict[str, Any]]:
    """The platform's memory proof (verification/memproof.py): each GPU fills 95 % of the claimed memory from a
    secret seed, commits, re-reads it under a fresh salt on the platform's clock, opens chunks the platform
    picks. Judged on sim nodes only: the agent's PyTorch path computes it, but its deadline on a real card is not
    measured yet (no GPU so far), so a real node's run records why it was not run."""
    if job.node.runtime != "sim":
        return [], {"not_run": MEMPROOF_NOT_RUN}
    drawn = memproof.draw(declared, gpus, ecc_mode=ecc_mode_of(inventory or job.node.inventory or {}, gpus))
    job_step(job=job, message=f"memory proof on GPU{'s' if len(gpus) > 1 else ''} {', '.join(map(str, gpus))} "
                              f"({drawn.nominal_bytes / 2 ** 30:.1f} GiB each)")
    return _judged(memproof_verdict.judge, declared, drawn, _over_exchange(session, "memproof", memproof.run, drawn))
