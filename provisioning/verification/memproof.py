"""The memory proof, on the platform's side (issue 11 item 3): each GPU fills at least MEMORY_SHARE of the
claimed memory from a secret seed, commits to it, then proves on the platform's clock that it still holds it.

The fill (the same on both sides; agent/gpumarket_agent/memproof.py): `blocks` blocks of `chunks` x `words`
32-bit words. Block 0 comes from the seed; block i >= 1 is G(block_{i-1}, block_{p_1}, ..., block_{p_REFS}):
word j = fmix32(block_{i-1}[j] ^ block_{p_1}[(j + r_1) mod W] ^ ... ^ salt_i), every p_k < i and r_k drawn from
the seed. So a block's content depends on the whole of earlier blocks (the rotations spread each word's
dependencies over every position), not on a short digest of them: a node that dropped a block rebuilds it only
from the REFS + 1 blocks it reads, and with six of them some of those are dropped too. A card holding 68 % of
the fill pays at least 18 passes of its memory to digest it once, half of it 30 or more (with one ref, as
before: 1.3 and 1.5 passes, inside the deadline; bench/memproof_recompute.py).

1. Fill: per GPU a Merkle root over the blocks' digests (a block's digest: SHA-256 of its chunks' 32-bit
   digests, each the sum of fmix32(word ^ a per-position salt) over the chunk, computed where the memory is).
2. Fresh: only after every root, the platform sends a fresh 64-bit salt; the node digests every block again
   under it (reading all of the memory) and sends a second root, **timed on the platform's clock** against the
   time the claimed card takes to read its memory at the reject floor of its bandwidth band, plus a small
   allowance (allowance_s). Memory the node does not have on the card (in host RAM over PCIe, or rebuilt on the
   card) makes it late. A late first answer gets one more fresh salt (FRESH_TRIES): the second answer is judged
   and opened, so one slow line is not a verdict and a node that is late by its nature is late twice.
3. Open: only then, with a secret RNG, `OPENINGS` (block, chunk) pairs per GPU. For each the node sends the
   chunk of block i, the same chunk of block i-1, and the chunks of each block p_k that G reads, each with, for
   both salts, its group of GROUP chunk digests, its block's group digests (a block's Merkle leaf is SHA-256 of
   those: block_leaf) and the block's Merkle path; a line per GPU (a few MiB each at real sizes, under the SSH
   exchange's 8 MiB a line). The platform checks the paths, the chunk digests from the words, G at every word
   of the opened chunk, and block 0 against the seed.

A node that kept only part of the blocks and answered the fresh root with made-up digests for the rest is caught
by the openings (each of the REFS + 2 blocks an opening reaches lands on a dropped block with the dropped
share's probability); one that reads or rebuilds the rest in time for the fresh root is caught by the clock.
What a real GPU would measure is in docs/BENCHMARKS.md (the sim computes small blocks standing for the nominal
bytes, as the challenge does).

Pure: no Django, no SSH; the exchange is challenge.Exchange.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from provisioning.verification import round_trip
from provisioning.verification.challenge import (
    M32,
    M64,
    PING_TIMEOUT_S,
    PINGS,
    Exchange,
    _parse,
    answer_wait_s,
    fmix32,
    mix64,
    node_error_text,
)
from provisioning.verification.model import DeclaredModel
from provisioning.verification.tolerances import TOLERANCES

MEMORY_SHARE = 0.95  # of the claimed memory, per GPU
# The sim's small fill standing for the nominal bytes: blocks x chunks x words 32-bit words.
SIM_SIZES = {"blocks": 16, "chunks": 4, "words": 8}
# A real fill (the agent's PyTorch path; gpu-selfcheck): 16 KiB chunks, 64 MiB blocks, as many as the bytes take.
REAL_SIZES = {"chunks": 4096, "words": 4096}
OPENINGS = 8  # per GPU; a node holding half of the blocks passes all eight with probability 1/256
REFS = 6  # earlier blocks each block reads besides the one before it (bench/memproof_recompute.py: why six)
FILL_PASSES = REFS + 2  # the fill reads REFS + 1 blocks and writes one per block: its nominal traffic
GRACE_S = 5.0
# A real fill's wait also covers the agent compiling its fused digest (torch.compile, once a device) before the
# fill's roots. The fill's wait only ends a hung node: the proof is the fresh root's clock, not this one.
SETUP_S = 120.0
FRESH_TRIES = 2  # the agent's MAX_FRESH
KEYS = {"seed": 11, "pi": 12, "rot": 13, "salt": 14, "digest": 15}
GROUP = 512  # chunk digests per group: a block's leaf is SHA-256 of its groups' SHA-256s (block_leaf)
DIGEST_BYTES = 4  # a chunk digest, the sum mod 2^32 (the agent's: the node hashes 4 bytes a 16 KiB chunk)


# ------------------------------------------------------------------------------ the numbers, as the agent's

def key(seed: int, gpu: int, what: str) -> int:
    z = mix64((seed & M64) ^ 0xD1B54A32D192ED03)
    for part in (gpu, KEYS[what]):
        z = mix64((z + part + 1) & M64)
    return z


def block_zero(seed: int, gpu: int, size: int, start: int = 0) -> list[int]:
    """Words start .. size - 1 of block 0."""
    k = key(seed, gpu, "seed")
    return [fmix32(mix64(k ^ j) & M32) for j in range(start, size)]


def links(seed: int, gpu: int, i: int, size: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """((p_k, r_k) for the REFS blocks block i >= 1 reads, salt_i)."""
    pi, rot = key(seed, gpu, "pi"), key(seed, gpu, "rot")  # once, not once per reference
    refs = tuple((mix64(pi ^ (i * REFS + k)) % i, mix64(rot ^ (i * REFS + k)) % size) for k in range(REFS))
    return refs, mix64(key(seed, gpu, "salt") ^ i) & M32


def g_word(prev: int, refs: list[int], salt: int) -> int:
    for ref in refs:
        prev ^= ref
    return fmix32(prev ^ salt)


def position_salts(base: int, words: int) -> list[int]:
    return [mix64(base ^ t) & M32 for t in range(words)]


def chunk_digest(words: list[int], salts: list[int]) -> int:
    return sum(fmix32((w & M32) ^ s) for w, s in zip(words, salts, strict=True)) & M32


def group_digests(packed: bytes) -> list[bytes]:
    step = DIGEST_BYTES * GROUP
    return [hashlib.sha256(packed[g:g + step]).digest() for g in range(0, len(packed), step)]


def block_leaf(groups: list[bytes]) -> bytes:
    """A block's Merkle leaf: SHA-256 of the SHA-256s of its packed chunk digests, GROUP at a time. An opening
    carries its chunk's group and the block's group digests (~5 KiB a commitment at real sizes), not every chunk
    digest of the block (16 KiB at 4096 chunks, for each of the up to 14 chunks an opening reaches)."""
    return hashlib.sha256(b"".join(groups)).digest()


def merkle_levels(leaves: list[bytes]) -> list[list[bytes]]:
    """Every level of the tree, leaves first; an odd node out is carried up unchanged."""
    levels = [leaves]
    while len(levels[-1]) > 1:
        level = levels[-1]
        up = [hashlib.sha256(level[i] + level[i + 1]).digest() for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            up.append(level[-1])
        levels.append(up)
    return levels


def merkle_verify(leaf: bytes, index: int, count: int, path: Any, root: str) -> bool:
    """Whether `path` (sibling hashes, hex, leaf level first) leads from the leaf at `index` of `count` to root."""
    if not isinstance(path, list) or not 0 <= index < count:
        return False
    node, at = leaf, 0
    try:
        while count > 1:
            if not (index % 2 == 0 and index == count - 1):  # else carried up: no sibling
                if at >= len(path):
                    return False
                sibling = bytes.fromhex(path[at])
                at += 1
                node = hashlib.sha256(node + sibling if index % 2 == 0 else sibling + node).digest()
            index, count = index // 2, (count + 1) // 2
    except (ValueError, TypeError):
        return False
    return at == len(path) and node.hex() == root


# ---------------------------------------------------------------------------------------------- the draw

@dataclass(frozen=True)
class MemProof:
    seed: int
    blocks: int
    chunks: int
    words: int
    gpu_indices: tuple
    nominal_bytes: int  # per GPU: what the fill stands for
    read_s: float  # the claimed card reads nominal_bytes in this at the reject floor of its bandwidth band
    fill_wait_s: float
    device: str = ""  # "cpu": a real fill on the node's CPU (tests)
    mig_uuids: tuple = ()  # MIG slices proved: gpu_indices are their labels (challenge.MIG_LABEL_BASE + position)
    digest: str = ""  # the agent's digest path ("fused", "eager"; its own choice, "auto", when empty)
    memory_mib: int = 0  # the memory the card has in its ECC mode, which nominal_bytes is MEMORY_SHARE of (0: sizes)

    def request(self, time_limit_s: int) -> dict:
        req = {"seed": self.seed, "blocks": self.blocks, "chunks": self.chunks, "words": self.words,
               "gpu_indices": list(self.gpu_indices), "nominal_bytes": self.nominal_bytes,
               "time_limit_s": time_limit_s}
        if self.device:
            req["device"] = self.device
        if self.mig_uuids:
            req["mig_uuids"] = list(self.mig_uuids)
        if self.digest:
            req["digest"] = self.digest
        return req


def draw(declared: DeclaredModel, gpu_indices: list[int], rng: random.Random | None = None,
         real: bool = False, sizes: dict | None = None, device: str = "", digest: str = "",
         ecc_mode: str | None = None) -> MemProof:
    """The sim's small fill standing for 95 % of the claimed memory; with `real`, a fill of that many bytes
    (REAL_SIZES, or `sizes` = {"blocks", "chunks", "words"} to choose them, the nominal bytes then theirs), its
    wait allowing for the agent's SETUP_S.

    The claimed memory is the model's for the cards' ECC mode (`ecc_mode` as nvidia-smi says it, the smaller size
    when unknown): a GDDR card with ECC on has 1/16 less, and 95 % of the catalogue's ECC-off size was more than
    an honest RTX A4000 with ECC on has at all (found by review)."""
    memory_mib = declared.memory_sizes(ecc_mode)[0]
    nominal = int(math.ceil(MEMORY_SHARE * memory_mib * 2 ** 20))
    shape = dict(SIM_SIZES)
    if sizes:
        shape = dict(sizes)
        nominal = shape["blocks"] * shape["chunks"] * shape["words"] * 4
    elif real:
        shape = dict(REAL_SIZES, blocks=-(-nominal // (REAL_SIZES["chunks"] * REAL_SIZES["words"] * 4)))
    band = TOLERANCES["figure_bands"]["memory_bandwidth_gbs"]
    rate = float(declared.datasheet["memory_bandwidth_gbs"]) * 1e9 * band["reject"]
    seed = rng.getrandbits(64) if rng is not None else secrets.randbits(64)
    setup = SETUP_S if real or sizes else 0.0
    return MemProof(seed=seed, gpu_indices=tuple(gpu_indices), nominal_bytes=nominal, read_s=nominal / rate,
                    fill_wait_s=FILL_PASSES * nominal / rate + GRACE_S + setup, device=device, digest=digest,
                    blocks=shape["blocks"], chunks=shape["chunks"], words=shape["words"],
                    memory_mib=0 if sizes else memory_mib)


# ------------------------------------------------------------------------------------------ the exchange

@dataclass
class Outcome:
    round_trip_s: float | None = None  # taken off each fresh root's time: the least of `round_trips`, capped
    round_trips: dict = field(default_factory=dict)  # what each measurement said: round_trip.credit()
    round_trip_spread_s: float = 0.0  # the steadiest repeated round trip's spread: round_trip.credit()
    fresh_rounds: int = 0  # fresh salts sent: a second one when the first roots came late
    roots: dict = field(default_factory=dict)  # gpu -> root of the fill
    fill_sent_at: float | None = None
    fill_arrivals: dict = field(default_factory=dict)  # gpu -> platform clock: the fill's root
    fill_detail: dict = field(default_factory=dict)  # gpu -> the agent's own account of its fill (detail)
    fresh_sent_at: float | None = None
    fresh_salt: int | None = None
    fresh_roots: dict = field(default_factory=dict)  # gpu -> root under the fresh salt
    fresh_arrivals: dict = field(default_factory=dict)  # gpu -> platform clock
    node_detail: dict = field(default_factory=dict)  # gpu -> the agent's own account of its fresh root (detail)
    picks: dict = field(default_factory=dict)  # gpu -> [(block, chunk)]
    opened: Any = None
    problem: str = ""


def _receive(exchange: Exchange, until: float) -> tuple[dict | None, float]:
    line, at = exchange.receive(max(0.0, until - time.monotonic()))
    return (None, at) if line is None else (_parse(line), at)


def _roots(exchange: Exchange, proof: MemProof, until: float, what: str, into: dict,
           arrivals: dict | None = None, details: dict | None = None) -> str:
    waiting = set(proof.gpu_indices)
    while waiting:
        message, at = _receive(exchange, until)
        if message is None:
            return f"sent no {what} within the wait"
        gpu, root = message.get("gpu"), message.get("root")
        if type(gpu) is not int or gpu not in waiting or not isinstance(root, str):
            if message.get("ok") is False and isinstance(message.get("error"), dict):
                return f"stopped with an error: {node_error_text(message['error'])}"
            return f"sent something other than a {what}: {json.dumps(message)[:120]}"
        waiting.discard(gpu)
        into[gpu] = root
        if arrivals is not None:
            arrivals[gpu] = at
        if details is not None:
            details[gpu] = _node_detail(message)
    return ""


def _node_detail(message: dict) -> dict:
    """What a real agent says of its own root (its digest path and seconds), kept if well-formed: detail shown
    beside the platform's clock, never judged."""
    detail: dict[str, Any] = {}
    if message.get("digest") in ("fused", "eager"):
        detail["digest"] = message["digest"]
    seconds = message.get("node_s")
    if isinstance(seconds, dict):
        detail["node_s"] = {k: v for k, v in seconds.items() if k in ("device", "host", "fill", "compile")
                            and type(v) in (int, float) and 0 <= v < 1e6}
    if isinstance(message.get("fused_error"), str):
        detail["fused_error"] = message["fused_error"][:300]
    return detail


def openings_bytes(proof: MemProof) -> int:
    """At most the bytes of the openings' lines: per GPU, OPENINGS picks reaching up to REFS + 2 chunk ids, with
    the rotated reads' neighbours 2 + 2 REFS chunks, each with its words in hex and, per salt, its group, the
    block's group digests and the block's Merkle path in hex."""
    groups = -(-proof.chunks // GROUP)
    path = 68 * max(1, math.ceil(math.log2(max(proof.blocks, 2))))
    per_chunk = 8 * proof.words + 2 * (2 * DIGEST_BYTES * min(GROUP, proof.chunks) + 64 * groups + path) + 256
    return len(proof.gpu_indices) * OPENINGS * (2 + 2 * REFS) * per_chunk


def _openings(exchange: Exchange, proof: MemProof, until: float, out: Outcome) -> str:
    """Read a line of openings per GPU into out.opened ({"<gpu>": [items]}); '' or why the node stopped."""
    out.opened = {}
    waiting = set(proof.gpu_indices)
    while waiting:
        message, _ = _receive(exchange, until)
        if message is None:
            return f"sent no openings within {answer_wait_s(openings_bytes(proof)):.0f} s"
        gpu = message.get("gpu")
        if type(gpu) is not int or gpu not in waiting or not isinstance(message.get("opened"), list):
            if message.get("ok") is False and isinstance(message.get("error"), dict):
                return f"stopped with an error: {node_error_text(message['error'])}"
            return f"sent something other than its openings: {json.dumps(message)[:120]}"
        waiting.discard(gpu)
        out.opened[str(gpu)] = message["opened"]
    return ""


def run(exchange: Exchange, proof: MemProof, time_limit_s: int, rng: random.Random | None = None) -> Outcome:
    """Drive the exchange; what the node says or fails to say lands in the Outcome (a broken connection raises
    what the exchange raises)."""
    rng = rng or random.SystemRandom()
    out = Outcome()
    try:
        trips = []
        for i in range(PINGS):
            sent = exchange.send({"ping": i})
            message, at = _receive(exchange, time.monotonic() + PING_TIMEOUT_S)
            if message is None or message.get("pong") != i:
                out.problem = "did not answer a ping"
                return out
            trips.append(at - sent)
        out.round_trip_s, out.round_trips, out.round_trip_spread_s = round_trip.credit(trips, exchange)
        out.fill_sent_at = sent = exchange.send({"memproof": proof.request(time_limit_s)})
        out.problem = _roots(exchange, proof, sent + proof.fill_wait_s, "root of its fill", out.roots,
                             out.fill_arrivals, out.fill_detail)
        if out.problem:
            return out
        for _ in range(FRESH_TRIES):  # a second salt when the first came late: one slow line is not a verdict
            out.fresh_salt, out.fresh_roots, out.fresh_arrivals, out.node_detail = rng.getrandbits(64), {}, {}, {}
            out.fresh_sent_at = exchange.send({"fresh": out.fresh_salt})
            out.fresh_rounds += 1
            out.problem = _roots(exchange, proof, out.fresh_sent_at + proof.read_s + GRACE_S, "fresh root",
                                 out.fresh_roots, out.fresh_arrivals, out.node_detail)
            if out.problem or not late_gpus(proof, out):
                break
        if out.problem:
            return out
        out.picks = {g: [(rng.randrange(1, proof.blocks), rng.randrange(proof.chunks)) for _ in range(OPENINGS)]
                     for g in proof.gpu_indices}
        exchange.send({"open": {str(g): [list(p) for p in picks] for g, picks in out.picks.items()}})
        out.problem = _openings(exchange, proof, time.monotonic() + answer_wait_s(openings_bytes(proof)), out)
    except ValueError as exc:
        out.problem = f"answered with garbage ({exc})"
    except EOFError:
        out.problem = "closed the exchange before it was over"
    return out


# ------------------------------------------------------------------------------ the clock (memproof_verdict.py)

def allowance_s(out: Outcome) -> float:
    """What the deadline allows beyond the card's read: the platform's own latency, plus the round trips' spread
    (the steadier of the pings and sshd's keepalive replies) up to a cap: a node that answers its pings unevenly
    does not buy itself more."""
    return TOLERANCES["memory_proof_latency_allowance_s"] + min(out.round_trip_spread_s,
                                                                TOLERANCES["memory_proof_jitter_allowance_max_s"])


def fresh_seconds(out: Outcome, gpu: int) -> float:
    """The GPU's fresh root on the platform's clock, its round trip taken off."""
    assert out.fresh_sent_at is not None
    return max(out.fresh_arrivals[gpu] - out.fresh_sent_at - (out.round_trip_s or 0.0), 0.0)


def late_gpus(proof: MemProof, out: Outcome) -> list[int]:
    return [g for g in out.fresh_arrivals if fresh_seconds(out, g) - allowance_s(out) > proof.read_s]
