#!/usr/bin/env python3
"""The memory proof's real path (the agent's TorchCard) at a real fill's block shape, on this machine's CPU.

Node verification cannot run the memory proof on real nodes until a GPU has timed its fresh root against the
deadline: the claimed card reading its fill at half its datasheet bandwidth (56 ms for an H200's 134 GB), plus
0.1 s. What can be measured without a GPU is measured here, interleaved round by round on 64 MiB blocks
(4096 chunks of 4096 words, REAL_SIZES):

1. the fill: block i derived with an int64 index tensor and a gather per rotated read (before) against one or two
   contiguous slices per read (now); bit-identical blocks, checked;
2. the digest: PyTorch's eager ops a slice at a time (before) against the torch.compile kernel (now, "fused";
   inductor's C++ here, Triton on a GPU); identical digests, checked;
3. the host's share of a fresh root, which no GPU makes faster: the chunk digests' SHA-256 groups and Merkle
   tree (Committed.keep) for one 64 MiB block, scaled to each catalogue model's fill and set beside that model's
   whole fresh-root deadline. The goal stated here: the host's share under a quarter of every model's deadline,
   so that the GPU's own read keeps most of it.

On a CPU the digest is compute-bound, so (2) says how much work the eager path wastes, not what a GPU gains; the
GPU's figures are gpu-selfcheck's to print (each fresh root line carries the agent's device and host seconds).

Run: .venv/bin/python bench/memproof_real_path.py [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from provisioning.agent.gpumarket_agent import memproof as node  # noqa: E402
from provisioning.agent.gpumarket_agent.challenge import _tensor_bytes  # noqa: E402
from provisioning.verification import memproof  # noqa: E402
from provisioning.verification.policy import TOLERANCES, DeclaredModel, load_catalogue  # noqa: E402

SHAPE = {"chunks": 4096, "words": 4096}
MODELS = ["rtx-a4000", "rtx-a6000", "l40s", "a100-80gb-sxm", "h100-sxm", "h200-sxm"]


def derive_before(card, i):
    """TorchCard.derive as it was: an int64 index tensor and a gather for each rotated read."""
    refs, salt = node.links(card.req["seed"], card.i, i, card.size)
    prev = card.blocks[i - 1]
    out = torch.empty(card.size, dtype=torch.int32)
    for a, b in card._slices():
        mixed = prev[a:b] ^ node._signed(salt, 32)
        for p, rot in refs:
            at = (torch.arange(a, b, dtype=torch.int64) + rot) % card.size
            mixed ^= card.blocks[p].index_select(0, at)
        out[a:b] = card.fmix(mixed)
    return out


def timed(fn):
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    req = node.validate({"seed": 20261202, "blocks": 8, "gpu_indices": [0], "nominal_bytes": 8 * 64 << 20,
                         "time_limit_s": 600, "device": "cpu", "digest": "eager", **SHAPE})
    card = node.TorchCard(torch, torch.device("cpu"), req, 0)
    salts = torch.tensor([node._signed(s, 32) for s in node.position_salts(12345, SHAPE["words"])],
                         dtype=torch.int32)
    compile_s, _ = timed(card.use_fused)  # fused from here on; the eager path is called directly below
    fused, eager = card.fused, node.TorchCard.digests
    rows = {"fill before": [], "fill now": [], "digest eager": [], "digest fused": [], "host keep": []}
    for r in range(args.rounds):
        i = 1 + r % (req["blocks"] - 1)
        t_before, before = timed(lambda i=i: derive_before(card, i))
        t_now, now = timed(lambda i=i: card.derive(i))
        assert torch.equal(before, now) and torch.equal(now, card.blocks[i]), "the fills differ"
        card.fused = None
        t_eager, d_eager = timed(lambda i=i: eager(card, card.blocks[i], salts))
        card.fused = fused
        t_fused, d_fused = timed(lambda i=i: eager(card, card.blocks[i], salts))
        assert torch.equal(d_eager, d_fused), "the digests differ"
        packed = [_tensor_bytes(d_fused)] * 64  # 64 blocks' worth of chunk digests (32 KiB a block)
        t_keep, _ = timed(lambda packed=packed: node.Committed().keep(packed, fresh=True))
        for name, t in (("fill before", t_before), ("fill now", t_now), ("digest eager", t_eager),
                        ("digest fused", t_fused), ("host keep", t_keep / 64)):
            rows[name].append(t)
    mib = SHAPE["chunks"] * SHAPE["words"] * 4 / 2 ** 20
    print(f"this CPU, torch {torch.__version__}, {torch.get_num_threads()} threads; {mib:g} MiB blocks; "
          f"{args.rounds} rounds interleaved; fused digest compiled in {compile_s:.1f} s (cached kernels reused)")
    print(f"{'':14} {'median s/block':>14} {'GB/s':>8}")
    for name, times in rows.items():
        med = statistics.median(times)
        rate = f"{mib * 2 ** 20 / med / 1e9:8.2f}" if name != "host keep" else f"{'-':>8}"  # of 32 KiB, not 64 MiB
        print(f"{name:14} {med:14.6f} {rate}")
    fill_x = statistics.median(rows["fill before"]) / statistics.median(rows["fill now"])
    digest_x = statistics.median(rows["digest eager"]) / statistics.median(rows["digest fused"])
    print(f"fill: {fill_x:.2f}x faster now; digest: fused {digest_x:.1f}x faster than eager (same bits)")

    keep_per_block = statistics.median(rows["host keep"])
    allowance = TOLERANCES["memory_proof_latency_allowance_s"]
    catalogue = load_catalogue()
    print(f"\nthe host's share of a fresh root (SHA-256 groups of the chunk digests, {keep_per_block * 1e3:.2f} ms a "
          f"64 MiB block here) against each model's deadline (read at half its datasheet bandwidth + {allowance:g} s)")
    print(f"{'model':16} {'fill GiB':>8} {'blocks':>6} {'read s':>7} {'deadline s':>10} {'host s':>7} "
          f"{'host share':>10}")
    worst = 0.0
    for slug in MODELS:
        declared = DeclaredModel.from_catalogue(catalogue[slug])
        drawn = memproof.draw(declared, [0], real=True)
        host = keep_per_block * drawn.blocks
        deadline = drawn.read_s + allowance
        worst = max(worst, host / deadline)
        print(f"{slug:16} {drawn.nominal_bytes / 2 ** 30:8.1f} {drawn.blocks:6d} {drawn.read_s:7.3f} "
              f"{deadline:10.3f} {host:7.3f} {host / deadline:10.0%}")
    print(f"goal (host share under 25 % of every deadline): {'met' if worst < 0.25 else 'NOT met'} "
          f"(worst {worst:.0%})")


if __name__ == "__main__":
    main()
