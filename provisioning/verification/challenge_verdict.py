"""The challenge's verdict (challenge.py draws it and runs the exchange): each GPU's revealed rows against its
commitment and, whole, against the rows the platform recomputes itself (challenge.py's docstring argues why every
entry of a revealed row must be checked), and its rate on the platform's clock against the claimed card's BF16 band
and the node's median."""
from __future__ import annotations

import statistics
import struct
from typing import Any

import numpy as np

from provisioning.verification import round_trip
from provisioning.verification.challenge import (
    OUTPUT_DTYPES,
    Challenge,
    Outcome,
    bf16_band,
    bf16_round,
    column_salt_lanes,
    joined_digest,
    packed_digest,
    row_digest_lanes,
)
from provisioning.verification.challenge_rows import expected_rows
from provisioning.verification.model import DEGRADE, REJECT, DeclaredModel, Finding
from provisioning.verification.tolerances import TOLERANCES


def _integers(values: Any, n: int) -> bool:
    """Whether `values` is a list of n integers (integral floats too) of int32's range. Types by a set of them (no
    bool, no string), values on numpy: a revealed row is n = 16384 of them, 64 rows a node."""
    if not isinstance(values, list) or len(values) != n or not set(map(type, values)) <= {int, float}:
        return False
    try:
        array = np.asarray(values, dtype=np.float64)
    except OverflowError:  # an int past float64's range
        return False
    return bool(np.isfinite(array).all() and (array == np.trunc(array)).all() and (np.abs(array) < 2 ** 31).all())


def check_committed(challenge: Challenge, gpu: int, commitment: str, picks: list, revealed: Any,
                    output_dtype: Any = None) -> tuple[str, list]:
    """('', the revealed rows' values in the order of `picks`) if they prove the GPU's commitment (row digests ->
    product digests -> commitment); else (why not, []). Cheap: no entry is recomputed here."""
    if output_dtype is not None and output_dtype not in OUTPUT_DTYPES:
        return f"its commitment named the output dtype {str(output_dtype)[:20]!r}, not one of fp32 or bf16", []
    if not isinstance(revealed, dict) or not isinstance(revealed.get("rows"), list):
        return "no revealed rows", []
    products = revealed.get("product_digests")
    if (not isinstance(products, list) or len(products) != challenge.products
            or not all(isinstance(d, str) for d in products) or joined_digest(products) != commitment):
        return "its product digests do not match its commitment", []
    packed_of = revealed.get("row_digests")
    if not isinstance(packed_of, dict):
        return "no row digests", []
    rows = {(r.get("product"), r.get("row")): r for r in revealed["rows"]
            if isinstance(r, dict) and type(r.get("product")) is int and type(r.get("row")) is int}
    salts = column_salt_lanes(challenge.seed, gpu, challenge.n)
    found = []
    for product, row in picks:
        got = rows.get((product, row))
        if got is None:
            return f"row {row} of product {product} was not revealed", []
        values: Any = got.get("values")
        if not _integers(values, challenge.n):
            return f"row {row} of product {product} is not {challenge.n} integers", []
        packed_hex = packed_of.get(str(product))
        try:
            packed = bytes.fromhex(packed_hex) if isinstance(packed_hex, str) else b""
        except ValueError:
            packed = b""
        if (len(packed) != 8 * challenge.n or packed_digest(packed) != products[product]
                or struct.unpack_from("<Q", packed, 8 * row)[0] != row_digest_lanes(values, salts)):
            return f"row {row} of product {product} does not match what the GPU committed to", []
        found.append(values)
    return "", found


def check_rows(picks: list, found: list, expected: list, output_dtype: Any = None) -> str:
    """'' if every entry of every revealed row is the platform's own (rounded once to BF16 where the commitment
    said bf16); else the first wrong entry. No tolerance: any freedom per entry would let a node steer the row's
    digest to what it committed without the product."""
    for (product, row), values, want in zip(picks, found, expected, strict=True):
        if output_dtype == "bf16":
            want = [bf16_round(v) for v in want]
        if values != want:  # an integral float equals its int
            col = next(c for c, (v, w) in enumerate(zip(values, want, strict=True)) if v != w)
            return f"entry ({row}, {col}) of product {product} is {values[col]:g}; the right value is {want[col]}"
    return ""


def check_gpus(challenge: Challenge, answers: dict[int, tuple]) -> dict[int, str]:
    """Per GPU of `answers` ({gpu: (commitment, picks, revealed, output_dtype)}): '' if its revealed rows prove
    its commitment and each is, whole, the platform's own; else why not. B is generated once for all of them
    (challenge_rows.expected_rows), only for the rows that proved their commitment."""
    verdicts: dict[int, str] = {}
    committed: dict[int, tuple[list, list, Any]] = {}
    for gpu, (commitment, picks, revealed, dtype) in answers.items():
        why, found = check_committed(challenge, gpu, commitment, picks, revealed, dtype)
        if why:
            verdicts[gpu] = why
        else:
            committed[gpu] = (picks, found, dtype)
    wanted = [(gpu, product, row) for gpu, (picks, _, _) in committed.items() for product, row in picks]
    expected = iter(expected_rows(challenge.seed, challenge.k, challenge.n, wanted))
    for gpu, (picks, found, dtype) in committed.items():
        verdicts[gpu] = check_rows(picks, found, [next(expected) for _ in picks], dtype)
    return verdicts


def check_gpu(challenge: Challenge, gpu: int, commitment: str, picks: list, revealed: Any,
              output_dtype: Any = None) -> str:
    """check_gpus for one GPU."""
    return check_gpus(challenge, {gpu: (commitment, picks, revealed, output_dtype)})[gpu]


def judge(declared: DeclaredModel, challenge: Challenge, out: Outcome) -> tuple[list[Finding], dict]:
    """Findings (codes challenge_*) and the figures the platform measured, per GPU."""
    findings: list[Finding] = []
    band = bf16_band(declared)
    trip = out.round_trip_s or 0.0
    figures: dict[str, Any] = {"seed_bits": 64, "n": challenge.n, "k": challenge.k, "products": challenge.products,
                               "flop_per_gpu": challenge.flop_per_gpu, "target_s": challenge.target_s,
                               "round_trip_s": round(trip, 6) if out.round_trip_s is not None else None,
                               "round_trips": round_trip.figures(out.round_trips), "gpus": {}}
    rates: dict[int, float] = {}
    revealed = out.revealed if isinstance(out.revealed, dict) else {}
    answered = [gpu for gpu in challenge.gpu_indices if gpu in out.arrivals and out.sent_at is not None]
    wrongs = check_gpus(challenge, {gpu: (out.commitments[gpu], out.picks.get(gpu, []), revealed.get(str(gpu)),
                                          out.output_dtypes.get(gpu)) for gpu in answered})
    for gpu in challenge.gpu_indices:
        row: dict[str, Any] = {"node_elapsed_s": out.node_elapsed_s.get(gpu)}
        figures["gpus"][str(gpu)] = row
        if gpu not in out.arrivals or out.sent_at is None:
            why = out.problem or "it did not answer"
            findings.append(Finding(REJECT, "challenge_no_answer",
                                    f"GPU {gpu} did not answer the platform's challenge: the node {why}. Check that "
                                    "the agent runs and the GPU responds (`nvidia-smi`), then verify again.", gpu))
            continue
        seconds = max(out.arrivals[gpu] - out.sent_at - trip, 1e-6)
        tflops = challenge.flop_per_gpu / seconds / 1e12
        ratio = tflops / challenge.datasheet_tflops
        # Slow-side judgements allow for the platform's own jitter (TOLERANCES); "too fast" uses the raw time.
        lenient = challenge.flop_per_gpu / max(seconds - TOLERANCES["challenge_latency_allowance_s"], 1e-6) / 1e12
        lenient_ratio = lenient / challenge.datasheet_tflops
        rates[gpu] = lenient
        row.update(platform_elapsed_s=round(seconds, 4), bf16_tflops=_figure(tflops), of_datasheet=_figure(ratio))
        wrong = wrongs[gpu]
        row["correct"] = not wrong
        if wrong:
            why = wrong if out.revealed else (out.problem or wrong)
            findings.append(Finding(REJECT, "challenge_wrong_result",
                                    f"GPU {gpu} failed the platform's matrix challenge: {why}. A GPU that computes "
                                    "wrong results must be repaired or replaced before it is listed.", gpu))
        label = (f"GPU {gpu} did the platform's challenge at {tflops:.1f} TFLOP/s BF16 measured by the platform, "
                 f"{ratio:.0%} of {declared.a_label}'s datasheet {challenge.datasheet_tflops:g}")
        if band["max"] and ratio > band["max"]:
            findings.append(Finding(REJECT, "challenge_too_fast",
                                    f"{label}: faster than the card can compute. The answer was not computed on "
                                    "this card.", gpu))
        elif lenient_ratio < band["reject"]:
            findings.append(Finding(REJECT, "challenge_too_slow",
                                    f"{label}: far too slow for the card declared. Declare the model really "
                                    "installed.", gpu))
        elif lenient_ratio < band["degrade"]:
            findings.append(Finding(DEGRADE, "challenge_too_slow",
                                    f"{label} (healthy: at least {band['degrade']:.0%}). Check its power limit, "
                                    "cooling and clocks.", gpu))
    if len(rates) >= 2:
        median = statistics.median(rates.values())
        for gpu, tflops in rates.items():
            off = abs(tflops - median) / median
            if off > TOLERANCES["node_median_max_deviation"]:
                findings.append(Finding(DEGRADE, "challenge_outlier",
                                        f"GPU {gpu} did the platform's challenge at {tflops:.1f} TFLOP/s, {off:.0%} "
                                        f"off the node's median {median:.1f}: check its cooling, power and slot.", gpu))
    if out.node_error and not findings:
        findings.append(Finding(REJECT, "challenge_no_answer", f"The node {out.problem}."))
    return findings, figures


def platform_rates(figures: dict[str, Any]) -> dict[int, float]:
    """{GPU index: BF16 TFLOP/s the platform measured} of a challenge's figures (judge's), for the GPUs that
    answered correctly; what the fleet reference compares (policy.judge's `platform_rates`)."""
    rows = figures.get("gpus") if isinstance(figures, dict) else None
    return {int(gpu): row["bf16_tflops"] for gpu, row in (rows or {}).items()
            if isinstance(row, dict) and row.get("correct") and isinstance(row.get("bf16_tflops"), int | float)}


def _figure(value: float) -> float:
    """Three decimals, or three significant digits below 1: a CPU's or a throttled card's TFLOP/s (0.0004 on a
    loaded CPU) must not print as 0.0."""
    return round(value, 3) if abs(value) >= 1 else float(f"{value:.3g}")
