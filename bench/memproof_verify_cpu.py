#!/usr/bin/env python3
"""The control plane's CPU to check one GPU's memory-proof openings, at a real fill's block shape.

After the fresh root the platform picks OPENINGS (block, chunk) pairs per GPU and checks each from the words the
node sends: both salts' chunk digests of every chunk an opening reaches (up to REFS + 2 = 8 chunk ids, up to 14
chunks with the rotated reads' neighbours), the Merkle paths, block 0 against the seed and G at every word. At
4096 words a chunk that was ~0.8 s of CPU a GPU one word at a time (docs/BENCHMARKS.md), 6 s for an 8-GPU node.

Measured here, interleaved round by round on the same openings (the agent's PyTorch path on this CPU fills
`--blocks` 64 MiB blocks and opens what the platform draws):
- before: check_gpu as it was, one word at a time (kept below as check_gpu_before);
- now: memproof_verdict.check_gpu, the word-wise work on lanes of one int (verification/lanes.py).
Both must give the same answer: "" on the honest openings, and the same reason on openings with one word
flipped.

The goal stated here (the issue names none beyond recording the figure): under 0.1 s of CPU a GPU, so that an
8-GPU node's memory proof costs the control plane under a second, less than its challenge (~3 s).

Run: .venv/bin/python bench/memproof_verify_cpu.py [--rounds 5] [--blocks 8]
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import random
import statistics
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from provisioning.agent.gpumarket_agent import memproof as node  # noqa: E402
from provisioning.agent.gpumarket_agent import memproof_torch as node_torch  # noqa: E402
from provisioning.verification import memproof, memproof_verdict  # noqa: E402
from provisioning.verification.memproof import (  # noqa: E402
    DIGEST_BYTES,
    GROUP,
    block_leaf,
    block_zero,
    chunk_digest,
    g_word,
    key,
    links,
    merkle_verify,
    position_salts,
)
from provisioning.verification.memproof_verdict import _hex  # noqa: E402

SHAPE = {"chunks": 4096, "words": 4096}


def _chunk(proof: memproof.MemProof, gpu_opened: list, block: int, chunk: int) -> dict | None:
    """memproof_verdict's lookup of one opening as it was then (a scan of the list per chunk needed)."""
    for item in gpu_opened:
        if (isinstance(item, dict) and type(item.get("block")) is int and type(item.get("chunk")) is int
                and item["block"] == block and item["chunk"] == chunk):
            return item
    return None


def check_chunk_before(proof, item, roots, salts):
    """memproof_verdict._check_chunk as it was: the chunk digests one word at a time."""
    if item is None:
        return "was not opened", []
    raw = _hex(item.get("words"), 4 * proof.words)
    if raw is None:
        return f"is not {proof.words} 32-bit words (little-endian, hex)", []
    words = list(struct.unpack(f"<{proof.words}I", raw))
    chunk, groups_count = item["chunk"], -(-proof.chunks // GROUP)
    group_size = min(GROUP, proof.chunks - GROUP * (chunk // GROUP))
    for suffix, root, salt in (("", roots[0], salts[0]), ("_fresh", roots[1], salts[1])):
        group, groups, path = (_hex(item.get("group" + suffix), DIGEST_BYTES * group_size),
                               _hex(item.get("groups" + suffix), 32 * groups_count), item.get("path" + suffix))
        if group is None or groups is None or not isinstance(path, list):
            return "has no chunk digests, group digests or Merkle path", []
        if (hashlib.sha256(group).digest() != groups[32 * (chunk // GROUP):32 * (chunk // GROUP + 1)]
                or not merkle_verify(block_leaf([groups[g:g + 32] for g in range(0, len(groups), 32)]),
                                     item["block"], proof.blocks, path, root)):
            return "does not lead to the committed root", []
        if struct.unpack_from("<I", group, DIGEST_BYTES * (chunk % GROUP))[0] != chunk_digest(words, salt):
            return "does not match its committed digest", []
    return "", words


def check_gpu_before(proof, out, gpu):
    """memproof_verdict.check_gpu as it was (to 2026-12-02): G, block 0 and the digests one word at a time."""
    opened = out.opened.get(str(gpu)) if isinstance(out.opened, dict) else None
    if not isinstance(opened, list):
        return out.problem or "it opened nothing"
    size = proof.chunks * proof.words
    salts = (position_salts(key(proof.seed, gpu, "digest"), proof.words),
             position_salts(out.fresh_salt or 0, proof.words))
    roots = (out.roots.get(gpu, ""), out.fresh_roots.get(gpu, ""))
    for block, chunk in out.picks.get(gpu, []):
        refs, salt = links(proof.seed, gpu, block, size)
        start = chunk * proof.words
        needed = {(block, chunk), (block - 1, chunk)}
        needed |= {(p, ((start + t + rot) % size) // proof.words) for p, rot in refs for t in range(proof.words)}
        items = {}
        for b, c in sorted(needed):
            why, items[b, c] = check_chunk_before(proof, _chunk(proof, opened, b, c), roots, salts)
            if why:
                return f"chunk {c} of block {b} {why}"
            if b == 0 and items[b, c] != block_zero(proof.seed, gpu, (c + 1) * proof.words, c * proof.words):
                return f"chunk {c} of block 0 is not the seed's"
        for t in range(proof.words):
            j = start + t
            read = [items[p, (j + rot) % size // proof.words][(j + rot) % size % proof.words] for p, rot in refs]
            if items[block, chunk][t] != g_word(items[block - 1, chunk][t], read, salt):
                return (f"word {j} of block {block} is not derived from blocks {block - 1} and "
                        f"{', '.join(str(p) for p, _ in refs)}")
    return ""


def honest_outcome(blocks: int, rng: random.Random):
    """A real-shaped fill on this CPU (the agent's TorchCard), its two roots and the openings the platform
    draws, as memproof.run would hold them."""
    proof = memproof.MemProof(seed=rng.getrandbits(64), blocks=blocks, gpu_indices=(0,), device="cpu",
                              nominal_bytes=blocks * 64 << 20, read_s=1.0, fill_wait_s=600.0, digest="eager",
                              **SHAPE)
    req = node.validate(proof.request(600))
    card = node_torch.TorchCard(torch, torch.device("cpu"), req, 0)
    out = memproof.Outcome(fresh_salt=rng.getrandbits(64))
    out.roots[0] = card.commit(node.position_salts(node.key(proof.seed, 0, "digest"), proof.words))
    out.fresh_roots[0] = card.commit(node.position_salts(out.fresh_salt, proof.words), fresh=True)
    out.picks = {0: [(rng.randrange(1, blocks), rng.randrange(proof.chunks)) for _ in range(memproof.OPENINGS)]}
    out.opened = node.opened({"open": {"0": [list(p) for p in out.picks[0]]}}, {0: card}, req)
    return proof, out


def cpu(fn):
    started = time.process_time()
    value = fn()
    return time.process_time() - started, value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=8)
    args = parser.parse_args()
    rng = random.Random(20261202)
    proof, honest = honest_outcome(args.blocks, rng)
    tampered = copy.deepcopy(honest)
    item = tampered.opened["0"][len(tampered.opened["0"]) // 2]
    raw = bytearray(bytes.fromhex(item["words"]))
    raw[4 * 1000] ^= 1
    item["words"] = raw.hex()
    reaches = len(honest.opened["0"])
    times: dict[str, list[float]] = {"before": [], "now": []}
    for r in range(args.rounds):
        for name, fn in (("before", check_gpu_before), ("now", memproof_verdict.check_gpu))[::1 if r % 2 else -1]:
            spent, verdict = cpu(lambda fn=fn: fn(proof, honest, 0))
            assert verdict == "", (name, verdict)
            times[name].append(spent)
        assert check_gpu_before(proof, tampered, 0) == memproof_verdict.check_gpu(proof, tampered, 0) != ""
    before, now = statistics.median(times["before"]), statistics.median(times["now"])
    print(f"{proof.blocks} blocks of {SHAPE['chunks']} chunks x {SHAPE['words']} words (64 MiB), "
          f"{memproof.OPENINGS} openings reaching {reaches} chunks; {args.rounds} rounds interleaved (CPU seconds)")
    print(f"{'':8} {'median s/GPU':>12} {'range':>19} {'8-GPU node s':>12}")
    for name, value in (("before", before), ("now", now)):
        print(f"{name:8} {value:12.4f} {min(times[name]):9.4f}-{max(times[name]):<9.4f} {8 * value:12.3f}")
    print(f"same verdicts on honest and tampered openings; now {before / now:.1f}x less CPU")
    print(f"goal (under 0.1 s of CPU a GPU): before {'met' if before < 0.1 else 'NOT met'} ({before:.3f} s), "
          f"now {'met' if now < 0.1 else 'NOT met'} ({now:.3f} s)")


if __name__ == "__main__":
    main()
