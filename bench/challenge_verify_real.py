#!/usr/bin/env python3
"""What the platform pays to verify a real node's full-size challenge answer (GPU-side digests), for
docs/BENCHMARKS.md: per catalogue model, an 8-GPU answer of the real-work draw's sizes (n x k, products), built
here in the reveal's wire format (the picked rows' values, each picked product's packed row digests, every
product digest) and judged with challenge.judge on this process's CPU clock (time.process_time), as
node_challenge does; plus the largest line of the reveal (a line per GPU) as JSON.

No GPU computes the rows here (a 16384 x 16384 product per row is out of reach of this box): each revealed row's
values are random integers except at the columns the platform checks, where they are the exact products computed
from the seed beforehand (off the clock), so every check of judge() runs to the end, as on an honest answer.

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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from provisioning.verification import challenge  # noqa: E402
from provisioning.verification.policy import DeclaredModel, load_catalogue  # noqa: E402

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="h100-sxm,a100-80gb-sxm,rtx-a4000")
    parser.add_argument("--draws", type=int, default=2)
    args = parser.parse_args()
    catalogue = load_catalogue()
    print(f"{'model':16} {'n':>6} {'k':>6} {'products':>8} {'target s':>8} {'wait s':>7} {'line MB':>9} "
          f"{'verify CPU s (median, max)':>27} verdict")
    bad = 0
    for slug in args.models.split(","):
        declared = DeclaredModel.from_catalogue(catalogue[slug])
        cpu, size, codes = [], 0, set()
        for draw in range(args.draws):
            rng = random.Random(draw)
            drawn = challenge.draw(declared, list(range(GPUS)), quick=False, rng=rng, real_work=True)
            out, size = answer(drawn, rng)
            started = time.process_time()
            findings, _ = challenge.judge(declared, drawn, out)
            cpu.append(time.process_time() - started)
            codes |= {f.code for f in findings}
        bad += bool(codes)
        print(f"{slug:16} {drawn.n:>6} {drawn.k:>6} {drawn.products:>8} {drawn.target_s:>8.2f} {drawn.wait_s:>7.1f} "
              f"{size / 1e6:>9.1f} {statistics.median(cpu):>14.2f}, {max(cpu):>10.2f} "
              f"{'clean' if not codes else sorted(codes)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
