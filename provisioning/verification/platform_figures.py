"""What the platform measured itself in a verification run, read back from the run's stored figures (as
challenge_verdict.judge, memproof_verdict.judge and slice_challenge write them): per GPU and MIG slice, the
challenge on the platform's clock and the memory proof. The provider's server page, the admin's run page and the
API's benchmark history show it. Pure: a dict in, dataclasses out.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PlatformCheck:
    """One GPU's (or MIG slice's) row of the platform's own checks: the challenge's BF16 TFLOP/s on the
    platform's clock, its share of the datasheet and whether the answers were right; the memory proof's re-read
    seconds on the platform's clock and whether the card held its fill: "yes" (re-read in time, every opening
    right), "late" (the memory is not all on the card), "wrong" (an opening did not prove it). None: not measured."""

    device: str  # "GPU <index>", or "MIG <profile> <UUID>"
    challenge_tflops: float | None = None
    challenge_share: float | None = None
    challenge_s: float | None = None
    challenge_correct: bool | None = None
    memory_s: float | None = None
    memory_held: str | None = None


@dataclass
class PlatformChecks:
    gpus: list[PlatformCheck]  # each GPU, then each MIG slice
    memory_gib: float | None = None  # the fill per GPU
    memory_deadline_s: float | None = None
    memory_not_run: str = ""


def _check_row(device: str, challenge: dict, proof: dict, deadline_s: float | None) -> PlatformCheck:
    held, seconds = proof.get("correct"), proof.get("fresh_s")
    if held is not None:  # memproof_verdict.judge: late when the re-read, its round trip off, passed the deadline
        held = "wrong" if not held else "late" if seconds is not None and deadline_s and seconds > deadline_s else "yes"
    return PlatformCheck(device, challenge.get("bf16_tflops"), challenge.get("of_datasheet"),
                         challenge.get("platform_elapsed_s"), challenge.get("correct"), seconds, held)


def platform_checks(figures: dict) -> PlatformChecks | None:
    """What the platform measured on its own side in a run (its stored `figures`), not what the node reported:
    the figures a driver shim cannot fake. None for a run without the challenge (every GPU rented, a run from
    before it, the server unreachable)."""
    checks = figures.get("challenge") or {}
    gpus = checks.get("gpus") or {}
    proof = checks.get("memory_proof") or {}
    proved = proof.get("gpus") or {}
    slices = (checks.get("mig_slices") or {}).get("slices") or {}
    slice_proof = (checks.get("mig_slices") or {}).get("memory_proof") or {}
    rows = [_check_row(f"GPU {gpu}", gpus.get(gpu) or {}, proved.get(gpu) or {}, proof.get("read_deadline_s"))
            for gpu in sorted(set(gpus) | set(proved), key=int)]
    rows += [_check_row(f"MIG {row.get('profile', '')} {uuid}", row, row.get("memory_proof") or {},
                        slice_proof.get("read_deadline_s")) for uuid, row in sorted(slices.items())]
    if not rows:
        return None
    nominal = proof.get("nominal_bytes")
    not_run = proof.get("not_run") or slice_proof.get("not_run", "")
    return PlatformChecks(rows, memory_gib=nominal / 2 ** 30 if nominal else None,
                          memory_deadline_s=proof.get("read_deadline_s"), memory_not_run=not_run)
