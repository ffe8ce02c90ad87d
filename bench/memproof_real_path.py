#!/usr/bin/env python3
"""The memory proof's real path (the agent's TorchCard) at a real fill's block shape, on this machine's CPU.

Node verification cannot run the memory proof on real nodes until a GPU has timed its fresh root against the
deadline: the claimed card reading its fill at half its datasheet bandwidth (56 ms for an H200's 134 GB), plus
0.1 s. What can be measured without a GPU is measured here, interleaved round by round on 64 MiB blocks
(4096 chunks of 4096 words, REAL_SIZES):

1. the fill: block i derived with an int64 index tensor and a gather per rotated read (before) against one or two
   contiguous slices per read (now); bit-identical blocks, checked;
2. the digest: PyTorch's eager ops a slice at a time (before) against the torch.compile kernel over the whole
   fill (now, "fused"; inductor's C++ here, Triton on a GPU); identical digests, checked;
3. the host's share of a fresh root, which no GPU makes faster: the chunk digests' SHA-256 groups and Merkle tree
   per 64 MiB block, before (8-byte digests, 256 a group, copied slices) and now (4-byte digests, 512 a group,
   Committed.keep), scaled to each catalogue model's fill and set beside that model's whole fresh-root deadline.
   The goal stated here: the host's share under a quarter of every model's deadline, so that the GPU's own read
   keeps most of it.

On a CPU the digest is compute-bound, so (2) says how much work the eager path wastes, not what a GPU gains; the
GPU's figures are gpu-selfcheck's to print (each fresh root line carries the agent's device and host seconds).

Run: .venv/bin/python bench/memproof_real_path.py [--rounds 5]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from provisioning.agent.gpumarket_agent import memproof as node  # noqa: E402
from provisioning.agent.gpumarket_agent import memproof_torch as node_torch  # noqa: E402
from provisioning.agent.gpumarket_agent.challenge_torch import tensor_bytes  # noqa: E402
from provisioning.verification import memproof  # noqa: E402
from provisioning.verification.model import DeclaredModel, load_catalogue  # noqa: E402
from provisioning.verification.tolerances import TOLERANCES  # noqa: E402

SHAPE = {"chunks": 4096, "words": 4096}
MODELS = ["rtx-a4000", "rtx-a6000", "l40s", "a100-80gb-sxm", "h100-sxm", "h200-sxm"]


def derive_before(card, i):
    """TorchCard.derive as it was: an int64 index tensor and a gather for each rotated read."""
    refs, salt = node.links(card.req["seed"], card.i, i, card.size)
    prev = card.blocks[i - 1]
    out = torch.empty(card.size, dtype=torch.int32)
    for a, b in card._slices():
        mixed = prev[a:b] ^ node_torch._signed(salt, 32)
        for p, rot in refs:
            at = (torch.arange(a, b, dtype=torch.int64) + rot) % card.size
            mixed ^= card.blocks[p].index_select(0, at)
        out[a:b] = card.fmix(mixed)
    return out


def keep_before(packed_blocks):
    """Committed.keep as it was: 8-byte chunk digests, SHA-256 256 of them (2 KiB) at a time, copied slices."""
    levels = node.merkle_levels([node.block_leaf([hashlib.sha256(p[g:g + 2048]).digest()
                                                  for g in range(0, len(p), 2048)]) for p in packed_blocks])
    return levels[-1][0]


def timed(fn):
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    blocks = 8
    req = node.validate({"seed": 20261202, "blocks": blocks, "gpu_indices": [0], "nominal_bytes": blocks * 64 << 20,
                         "time_limit_s": 600, "device": "cpu", "digest": "eager", **SHAPE})
    card = node_torch.TorchCard(torch, torch.device("cpu"), req, 0)
    salts = torch.tensor([node_torch._signed(s, 32) for s in node.position_salts(12345, SHAPE["words"])],
                         dtype=torch.int32)
    compile_s, _ = timed(card.use_fused)
    fused = card.fused
    rows: dict[str, list[float]] = {name: [] for name in (
        "fill before", "fill now", "digest eager", "digest fused", "host before", "host now")}
    old_packed = [os.urandom(8 * SHAPE["chunks"]) for _ in range(64)]  # 64 blocks of 8-byte digests, as before
    for r in range(args.rounds):
        i = 1 + r % (blocks - 1)
        t_before, before = timed(lambda i=i: derive_before(card, i))
        out = torch.empty(card.size, dtype=torch.int32)
        t_now, _ = timed(lambda i=i, out=out: card.derive(i, out))
        assert torch.equal(before, out) and torch.equal(out, card.blocks[i]), "the fills differ"
        t_eager, d_eager = timed(lambda: card.digests(salts, fused=False))
        t_fused, d_fused = timed(lambda: card.digests(salts, fused=fused))
        assert torch.equal(d_eager, d_fused), "the digests differ"
        raw, per = tensor_bytes(d_fused), node.DIGEST_BYTES * SHAPE["chunks"]
        now_packed = [raw[b * per:(b + 1) * per] for b in range(blocks)] * 8  # 64 blocks' worth
        t_host_before, _ = timed(lambda: keep_before(old_packed))
        t_host_now, _ = timed(lambda now_packed=now_packed: node.Committed().keep(now_packed, fresh=True))
        for name, t in (("fill before", t_before), ("fill now", t_now), ("digest eager", t_eager / blocks),
                        ("digest fused", t_fused / blocks), ("host before", t_host_before / 64),
                        ("host now", t_host_now / 64)):
            rows[name].append(t)
    mib = SHAPE["chunks"] * SHAPE["words"] * 4 / 2 ** 20
    print(f"this CPU, torch {torch.__version__}, {torch.get_num_threads()} threads; {mib:g} MiB blocks, {blocks} "
          f"a fill; {args.rounds} rounds interleaved; fused digest compiled and checked in {compile_s:.1f} s")
    print(f"{'':14} {'median s/block':>14} {'GB/s':>8}")
    for name, times in rows.items():
        med = statistics.median(times)
        rate = f"{mib * 2 ** 20 / med / 1e9:8.2f}" if not name.startswith("host") else f"{'-':>8}"
        print(f"{name:14} {med:14.6f} {rate}")
    median = {name: statistics.median(times) for name, times in rows.items()}
    print(f"fill: {median['fill before'] / median['fill now']:.2f}x faster now; digest: fused "
          f"{median['digest eager'] / median['digest fused']:.1f}x faster than eager (same bits); host: "
          f"{median['host before'] / median['host now']:.2f}x less now")

    allowance = TOLERANCES["memory_proof_latency_allowance_s"]
    catalogue = load_catalogue()
    print(f"\nthe host's share of a fresh root (SHA-256 groups of the chunk digests and the Merkle tree: before "
          f"{median['host before'] * 1e3:.3f} ms, now {median['host now'] * 1e3:.3f} ms a 64 MiB block here) "
          f"against each model's deadline (read at half its datasheet bandwidth + {allowance:g} s)")
    print(f"{'model':16} {'fill GiB':>8} {'blocks':>6} {'read s':>7} {'deadline s':>10} {'host s before':>13} "
          f"{'share':>6} {'host s now':>10} {'share':>6}")
    worst = {"before": 0.0, "now": 0.0}
    for slug in MODELS:
        declared = DeclaredModel.from_catalogue(catalogue[slug])
        drawn = memproof.draw(declared, [0], real=True)
        deadline = drawn.read_s + allowance
        host = {when: median[f"host {when}"] * drawn.blocks for when in worst}
        for when in worst:
            worst[when] = max(worst[when], host[when] / deadline)
        print(f"{slug:16} {drawn.nominal_bytes / 2 ** 30:8.1f} {drawn.blocks:6d} {drawn.read_s:7.3f} "
              f"{deadline:10.3f} {host['before']:13.3f} {host['before'] / deadline:6.0%} {host['now']:10.3f} "
              f"{host['now'] / deadline:6.0%}")
    verdict = {when: "met" if share < 0.25 else "NOT met" for when, share in worst.items()}
    print(f"goal (host share under 25 % of every deadline): before {verdict['before']} (worst {worst['before']:.0%}), "
          f"now {verdict['now']} (worst {worst['now']:.0%})")


if __name__ == "__main__":
    main()
