"""The memory proof's verdict (memproof.py draws it, runs the exchange and keeps its clock): each GPU's openings
against both of its roots, G and the seed at every word opened, and its fresh root's time against the deadline."""
from __future__ import annotations

import hashlib
import struct
from typing import Any

from provisioning.verification import lanes, round_trip
from provisioning.verification.memproof import (
    DIGEST_BYTES,
    GROUP,
    M32,
    MEMORY_SHARE,
    MemProof,
    Outcome,
    allowance_s,
    block_leaf,
    fresh_seconds,
    key,
    links,
    merkle_verify,
)
from provisioning.verification.model import REJECT, DeclaredModel, Finding


def _openings(gpu_opened: list) -> dict[tuple[int, int], dict]:
    """Each opening by its (block, chunk), the first of any repeated; read once, not once per chunk needed (a list
    padded with millions of entries cost seconds of the platform's CPU per chunk: found by review). Its numbers
    must be integers: 3.0 == 3 in Python, and a float would reach the slices and Merkle path below (a TypeError of
    ours, not the node's failed proof)."""
    found: dict[tuple[int, int], dict] = {}
    for item in gpu_opened:
        if isinstance(item, dict) and type(item.get("block")) is int and type(item.get("chunk")) is int:
            found.setdefault((item["block"], item["chunk"]), item)
    return found


def _share_of(proof: MemProof, declared: DeclaredModel) -> str:
    """What the fill stood for: MEMORY_SHARE of the memory the card has in its ECC mode (memproof.draw)."""
    if proof.memory_mib:
        return f"{MEMORY_SHARE:.0%} of the {proof.memory_mib} MiB {declared.a_label} has"
    return f"{MEMORY_SHARE:.0%} of the memory declared"


def _hex(value: Any, length: int) -> bytes | None:
    """`value` decoded from hex when it is exactly `length` bytes; else None."""
    if not isinstance(value, str) or len(value) != 2 * length:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        return None


def _check_chunk(proof: MemProof, item: dict | None, roots: tuple[str, str],
                 salts: tuple[int, int]) -> tuple[str, bytes]:
    """('', the chunk's words as little-endian uint32 bytes) if the opened chunk leads to both roots; else (why
    not, b""). `salts`: each digest's position salts in 64-bit lanes (lanes.py)."""
    if item is None:
        return "was not opened", b""
    raw = _hex(item.get("words"), 4 * proof.words)
    if raw is None:
        return f"is not {proof.words} 32-bit words (little-endian, hex)", b""
    words = lanes.pack32(raw)
    chunk, groups_count = item["chunk"], -(-proof.chunks // GROUP)
    group_size = min(GROUP, proof.chunks - GROUP * (chunk // GROUP))
    for suffix, root, salt in (("", roots[0], salts[0]), ("_fresh", roots[1], salts[1])):
        group, groups, path = (_hex(item.get("group" + suffix), DIGEST_BYTES * group_size),
                               _hex(item.get("groups" + suffix), 32 * groups_count), item.get("path" + suffix))
        if group is None or groups is None or not isinstance(path, list):
            return "has no chunk digests, group digests or Merkle path", b""
        if (hashlib.sha256(group).digest() != groups[32 * (chunk // GROUP):32 * (chunk // GROUP + 1)]
                or not merkle_verify(block_leaf([groups[g:g + 32] for g in range(0, len(groups), 32)]),
                                     item["block"], proof.blocks, path, root)):
            return "does not lead to the committed root", b""
        digest = lanes.total32(lanes.fmix32(words ^ salt, proof.words), proof.words) & M32  # chunk_digest
        if struct.unpack_from("<I", group, DIGEST_BYTES * (chunk % GROUP))[0] != digest:
            return "does not match its committed digest", b""
    return "", raw


def _block_zero_raw(proof: MemProof, gpu: int, chunk: int) -> bytes:
    """Chunk `chunk` of block 0 from the seed (block_zero), as little-endian uint32 bytes."""
    count = proof.words
    z = lanes.broadcast(key(proof.seed, gpu, "seed"), count, 128) ^ lanes.iota(chunk * count, count, 128)
    z = lanes.fmix32(lanes.mix64(z, count) & lanes.mask(count, 128, 32), count, 128)
    return struct.pack(f"<{count}I", *lanes.unpack(z, count, 128))


def _position_lanes(base: int, words: int) -> int:
    """position_salts(base, words) in 64-bit lanes."""
    z = lanes.mix64(lanes.broadcast(base, words, 128) ^ lanes.iota(0, words, 128), words)
    return lanes.narrow(z & lanes.mask(words, 128, 32), words)


def _rotated(proof: MemProof, raws: dict, block: int, at: int) -> bytes:
    """Words at .. at + words - 1 (mod the block's size) of `block`: the tail of one opened chunk and the head of
    the next."""
    size, words = proof.chunks * proof.words, proof.words
    at %= size
    first, skip = divmod(at, words)
    head = raws[block, first][4 * skip:]
    return head if not skip else head + raws[block, (first + 1) % proof.chunks][:4 * skip]


def check_gpu(proof: MemProof, out: Outcome, gpu: int) -> str:
    """'' if every opening of the GPU proves its fill and its fresh root; else why not. Word-wise work runs on
    lanes (lanes.py), the same arithmetic as block_zero, chunk_digest and g_word one word at a time."""
    opened = out.opened.get(str(gpu)) if isinstance(out.opened, dict) else None
    if not isinstance(opened, list):
        return out.problem or "it opened nothing"
    size, count = proof.chunks * proof.words, proof.words
    salts = (_position_lanes(key(proof.seed, gpu, "digest"), count), _position_lanes(out.fresh_salt or 0, count))
    roots = (out.roots.get(gpu, ""), out.fresh_roots.get(gpu, ""))
    openings = _openings(opened)
    checked: dict[tuple[int, int], bytes] = {}  # a chunk several openings reach is checked once
    for block, chunk in out.picks.get(gpu, []):
        refs, salt = links(proof.seed, gpu, block, size)
        start = chunk * count
        needed = {(block, chunk), (block - 1, chunk)}
        needed |= {(p, ((start + t + rot) % size) // count) for p, rot in refs for t in (0, count - 1)}
        for b, c in sorted(needed - set(checked)):
            why, checked[b, c] = _check_chunk(proof, openings.get((b, c)), roots, salts)
            if why:
                return f"chunk {c} of block {b} {why}"
            if b == 0 and checked[b, c] != _block_zero_raw(proof, gpu, c):
                return f"chunk {c} of block 0 is not the seed's"
        mixed = lanes.pack32(checked[block - 1, chunk]) ^ lanes.broadcast(salt, count, 64)
        for p, rot in refs:
            mixed ^= lanes.pack32(_rotated(proof, checked, p, start + rot))
        derived = lanes.fmix32(mixed, count)  # g_word at every word of the chunk
        got = lanes.pack32(checked[block, chunk])
        if derived != got:
            t = next(t for t, (x, y) in enumerate(zip(lanes.unpack(derived, count, 64), lanes.unpack(got, count, 64),
                                                      strict=True)) if x != y)
            return (f"word {start + t} of block {block} is not derived from blocks {block - 1} and "
                    f"{', '.join(str(p) for p, _ in refs)}")
    return ""


def judge(declared: DeclaredModel, proof: MemProof, out: Outcome) -> tuple[list[Finding], dict]:
    """Findings (memory_proof_*) and the platform's figures per GPU."""
    findings: list[Finding] = []
    allowance = allowance_s(out)
    gib = proof.nominal_bytes / 2 ** 30
    figures: dict[str, Any] = {"nominal_bytes": proof.nominal_bytes, "blocks": proof.blocks,
                               "read_deadline_s": round(proof.read_s + allowance, 4),
                               "fill_wait_s": round(proof.fill_wait_s, 3),
                               "fresh_rounds": out.fresh_rounds, "round_trips": round_trip.figures(out.round_trips),
                               "gpus": {}}
    for gpu in proof.gpu_indices:
        row: dict[str, Any] = {}
        figures["gpus"][str(gpu)] = row
        if gpu in out.fill_arrivals and out.fill_sent_at is not None:  # what the fill used of its wait
            row["fill_s"] = round(out.fill_arrivals[gpu] - out.fill_sent_at, 4)
            if out.fill_detail.get(gpu):
                row["node_fill"] = out.fill_detail[gpu]
        if gpu not in out.fresh_arrivals or out.fresh_sent_at is None:
            findings.append(Finding(REJECT, "memory_proof_no_answer",
                                    f"GPU {gpu} did not complete the platform's memory proof ({gib:.1f} GiB, "
                                    f"{_share_of(proof, declared)}): the node "
                                    f"{out.problem or 'did not answer'}. Check that the agent runs and the GPU "
                                    "responds (`nvidia-smi`), then verify again.", gpu))
            continue
        seconds = fresh_seconds(out, gpu)
        row["fresh_s"] = round(seconds, 4)
        if out.node_detail.get(gpu):
            row["node"] = out.node_detail[gpu]
        wrong = check_gpu(proof, out, gpu) if out.opened is not None else (out.problem or "it opened nothing")
        row["correct"] = not wrong
        if wrong:
            findings.append(Finding(REJECT, "memory_proof_failed",
                                    f"GPU {gpu} failed the platform's memory proof: {wrong}. The card does not "
                                    f"hold the {gib:.1f} GiB it was asked to fill; declare the memory really "
                                    "installed.", gpu))
        elif seconds - allowance > proof.read_s:
            findings.append(Finding(REJECT, "memory_proof_late",
                                    f"GPU {gpu} re-read its {gib:.1f} GiB fill in {seconds:.2f} s measured by the "
                                    f"platform; {declared.a_label} reads it in at most {proof.read_s:.3f} s at half "
                                    "its datasheet bandwidth. Part of the memory is not on the card (host RAM, or "
                                    "rebuilt on demand): declare the memory really installed.", gpu))
    return findings, figures
