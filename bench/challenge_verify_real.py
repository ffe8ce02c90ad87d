#!/usr/bin/env python3
"""What the platform pays to verify a real node's full-size challenge answer (GPU-side digests), for
docs/BENCHMARKS.md: per catalogue model, an 8-GPU answer of the real-work draw's sizes (n x k, products), built
here in the reveal's wire format (the picked rows' values, each picked product's packed row digests, every
product digest) and judged with challenge_verdict.judge on this process's CPU clock (time.process_time), as
node_challenge does; plus the largest line of the reveal (a line per GPU) as JSON.

No GPU computes the rows here (a 16384 x 16384 product per row is out of reach of this box): each revealed row's
values are random integers except at the columns the platform checks, where they are the exact products computed
from the seed beforehand (off the clock), so every check of judge() runs to the end, as on an honest answer.

Before and now, interleaved draw by draw on the same answers: judge() with check_gpu as it was (every checked
entry and revealed row digest one word at a time: `check_gpu_before`, kept here) and as it is (on lanes of one
int, verification/lanes.py). Both must find the honest answers clean and give the same reason for an answer with
one checked entry wrong (its digests restamped, so that only the entry check can see it). The goal stated here
(the issue asks only for the figure): under 1 s of control-plane CPU per 8-GPU node.

Run: .venv/bin/python bench/challenge_verify_real.py [--models h100-sxm,rtx-a4000] [--draws 2]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from provisioning.verification import challenge, challenge_verdict  # noqa: E402
from provisioning.verification.model import DeclaredModel, load_catalogue  # noqa: E402
from provisioning.verification.tolerances import TOLERANCES  # noqa: E402

GPUS = 8


def answer(drawn: challenge.Challenge, rng: random.Random) -> tuple[challenge.Outcome, int]:
    """An honest-looking outcome for the draw: commitments at the claimed card's 85 %, and the reveal."""
    out = challenge.Outcome(round_trip_s=0.01, sent_at=0.0)
    out.picks = challenge.pick_rows(drawn, rng)
    out.revealed = {}
    for gpu in drawn.gpu_indices:
        salts = challenge.column_salts(drawn.seed, gpu, drawn.n)
        products = [f"{rng.getrandbits(256):064x}" for _ in range(drawn.products)]
        packed_of: dict[int, bytearray] = {}
        rows = []
        for product, row, cols in out.picks[gpu]:
            values = [rng.randrange(-4096, 4096) for _ in range(drawn.n)]
            for col in cols:
                values[col] = challenge.expected_entry(drawn.seed, gpu, product, drawn.k, row, col)
            packed = packed_of.setdefault(product, bytearray(rng.randbytes(8 * drawn.n)))
            struct.pack_into("<Q", packed, 8 * row, challenge.row_digest(values, salts))
            rows.append({"product": product, "row": row, "values": values})
        for product, packed in packed_of.items():
            products[product] = challenge.packed_digest(bytes(packed))
        out.revealed[str(gpu)] = {"product_digests": products, "rows": rows,
                                  "row_digests": {str(p): bytes(v).hex() for p, v in packed_of.items()}}
        out.commitments[gpu] = challenge.joined_digest(products)
        out.arrivals[gpu] = 0.01 + drawn.target_s / 0.85
    # the node sends a line per GPU (the SSH exchange reads at most 8 MiB a line): the largest one
    size = max(len(json.dumps({"gpu": int(g), "revealed": rows})) for g, rows in out.revealed.items())
    return out, size


def check_gpu_before(drawn: challenge.Challenge, gpu: int, commitment: str, picks: list, revealed: Any) -> str:
    """challenge_verdict.check_gpu as it was (to 2026-12-02): row digests and checked entries one word at a time."""
    if not isinstance(revealed, dict) or not isinstance(revealed.get("rows"), list):
        return "no revealed rows"
    products = revealed.get("product_digests")
    if (not isinstance(products, list) or len(products) != drawn.products
            or not all(isinstance(d, str) for d in products) or challenge.joined_digest(products) != commitment):
        return "its product digests do not match its commitment"
    packed_of = revealed.get("row_digests")
    if not isinstance(packed_of, dict):
        return "no row digests"
    rows = {(r.get("product"), r.get("row")): r for r in revealed["rows"]
            if isinstance(r, dict) and type(r.get("product")) is int and type(r.get("row")) is int}
    salts = challenge.column_salts(drawn.seed, gpu, drawn.n)
    tolerance = TOLERANCES["challenge_entry_rel_tolerance"]
    for product, row, cols in picks:
        got = rows.get((product, row))
        if got is None:
            return f"row {row} of product {product} was not revealed"
        values: Any = got.get("values")
        if not challenge_verdict._integers(values, drawn.n):
            return f"row {row} of product {product} is not {drawn.n} integers"
        packed_hex = packed_of.get(str(product))
        try:
            packed = bytes.fromhex(packed_hex) if isinstance(packed_hex, str) else b""
        except ValueError:
            packed = b""
        if (len(packed) != 8 * drawn.n or challenge.packed_digest(packed) != products[product]
                or struct.unpack_from("<Q", packed, 8 * row)[0] != challenge.row_digest(values, salts)):
            return f"row {row} of product {product} does not match what the GPU committed to"
        for col in cols:
            want = challenge.expected_entry(drawn.seed, gpu, product, drawn.k, row, col)
            if abs(values[col] - want) > tolerance * abs(want):
                return (f"entry ({row}, {col}) of product {product} is {values[col]:g}; the right value is "
                        f"{want}")
    return ""


def judged(declared: DeclaredModel, drawn: challenge.Challenge, out: challenge.Outcome,
           check: Callable) -> tuple[float, list]:
    """(CPU seconds, findings) of challenge_verdict.judge with `check` as its check_gpu."""
    now, challenge_verdict.check_gpu = challenge_verdict.check_gpu, check  # type: ignore[assignment]  # the old one
    try:
        started = time.process_time()
        findings, _ = challenge_verdict.judge(declared, drawn, out)
        return time.process_time() - started, findings
    finally:
        challenge_verdict.check_gpu = now  # type: ignore[assignment]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="h100-sxm,a100-80gb-sxm,rtx-a4000")
    parser.add_argument("--draws", type=int, default=2)
    args = parser.parse_args()
    catalogue = load_catalogue()
    print(f"{'model':16} {'n':>6} {'k':>6} {'products':>8} {'target s':>8} {'wait s':>7} {'line MB':>8} "
          f"{'verify CPU s before (median, max)':>34} {'now (median, max)':>18} verdict")
    bad, worst = 0, {"before": 0.0, "now": 0.0}
    now_check = challenge_verdict.check_gpu
    for slug in args.models.split(","):
        declared = DeclaredModel.from_catalogue(catalogue[slug])
        cpu: dict[str, list[float]] = {"before": [], "now": []}
        size, codes = 0, set()
        for draw in range(args.draws):
            rng = random.Random(draw)
            drawn = challenge.draw(declared, list(range(GPUS)), quick=False, rng=rng, real_work=True)
            out, size = answer(drawn, rng)
            sides = [("before", check_gpu_before), ("now", now_check)]
            for name, check in sides[::1 if draw % 2 else -1]:
                spent, findings = judged(declared, drawn, out, check)
                cpu[name].append(spent)
                codes |= {f.code for f in findings}
            product, row, cols = out.picks[3][0]
            values = next(r for r in out.revealed["3"]["rows"] if (r["product"], r["row"]) == (product, row))["values"]
            values[cols[0]] += 1000 + abs(values[cols[0]])  # wrong past the BF16 tolerance, committed to (digests
            # restamped): only the entry check sees it
            revealed = out.revealed["3"]
            packed = bytearray.fromhex(revealed["row_digests"][str(product)])
            struct.pack_into("<Q", packed, 8 * row, challenge.row_digest(values, challenge.column_salts(
                drawn.seed, 3, drawn.n)))
            revealed["row_digests"][str(product)] = packed.hex()
            revealed["product_digests"][product] = challenge.packed_digest(bytes(packed))
            out.commitments[3] = challenge.joined_digest(revealed["product_digests"])
            reasons = {check(drawn, 3, out.commitments[3], out.picks[3], revealed) for check in (check_gpu_before,
                                                                                                now_check)}
            assert len(reasons) == 1 and next(iter(reasons)).startswith(f"entry ({row}, {cols[0]})"), reasons
        bad += bool(codes)
        med = {name: statistics.median(times) for name, times in cpu.items()}
        for name in worst:
            worst[name] = max(worst[name], med[name])
        print(f"{slug:16} {drawn.n:>6} {drawn.k:>6} {drawn.products:>8} {drawn.target_s:>8.2f} {drawn.wait_s:>7.1f} "
              f"{size / 1e6:>8.1f} {med['before']:>23.2f}, {max(cpu['before']):>8.2f} {med['now']:>9.3f}, "
              f"{max(cpu['now']):>6.3f} {'clean' if not codes else sorted(codes)}")
    print(f"now {worst['before'] / worst['now']:.1f}x less CPU at the worst model; goal (under 1 s per 8-GPU node): "
          f"before {'met' if worst['before'] < 1 else 'NOT met'} ({worst['before']:.2f} s), "
          f"now {'met' if worst['now'] < 1 else 'NOT met'} ({worst['now']:.3f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
