"""The memproof command: fill the claimed memory from the platform's seed, commit, re-read it under a fresh salt
on the platform's clock, open the chunks the platform picks. Interactive, one JSON object a line both ways:

    platform -> {"ping": i}                       node -> {"pong": i}
    platform -> {"memproof": {...}}               node -> {"gpu": i, "root": hex}      one line per GPU (the fill)
    platform -> {"fresh": salt}                   node -> {"gpu": i, "root": hex}      per GPU, timed by the platform
   (platform -> {"fresh": salt}                   node -> the same, under the new salt: once, when it came late)
    platform -> {"open": {"<gpu>": [[block, chunk], ...]}}
                                                  node -> {"gpu": i, "opened": [{"block", "chunk", "words",
                                                          "group", "groups", "path", "group_fresh",
                                                          "groups_fresh", "path_fresh"}, ...]}  a line per GPU
    node -> {"ok": true, "agent_version": ...}    (or {"ok": false, "error": {...}} at any point, then the end)

The fill, the digests and the Merkle tree are provisioning/verification/memproof.py's (a test holds them equal):
block 0 from the seed, block i = fmix32(block_{i-1}[j] ^ block_{p_1}[(j + r_1) mod W] ^ ... ^ block_{p_REFS}[...]
^ salt_i), each p_k < i and r_k drawn from the seed. REFS earlier blocks per block, not one: a card that dropped
part of its fill and rebuilds it for the fresh root needs the blocks each dropped block reads, and with six of
them those are often dropped too (recompute_passes measures what that costs on the graph a real fill has).

In sim mode the node really computes a small fill (`blocks` x `chunks` x `words` words) standing for
`nominal_bytes` per GPU, and answers no sooner than its real card would: the fill at FILL_PASSES x nominal bytes
over the card's real bandwidth; the fresh root at the bytes it holds on the card over its bandwidth plus the rest
over its host link. A profile's `memory_held_mib` (per GPU or for the node) is what the card really holds; with
`memory_rest: "made_up"` it does not fetch the rest at all and commits made-up digests for the blocks it lacks;
with `"recomputed"` it rebuilds what it lacks on the card for each digest, at recompute.py passes of its
memory (the cheapest way to do that this module knows, on the graph of a real fill of the nominal bytes).
On a real node (or `"device": "cpu"` in the request, for tests and gpu-selfcheck)
memproof_torch.TorchCard does the same on the device with PyTorch. A real node proves one MIG slice per exchange, in
a child agent that sees only that slice (mig.relay_to_slice, as the challenge's). The platform runs it on sim
nodes only until a GPU has measured it (docs/BENCHMARKS.md); a real node asked by node verification would run it
the same way.
"""
import hashlib
import os
import random
import struct
import sys
import threading
import time

from .challenge import (
    M32,
    M64,
    Lines,
    answer_pings,
    fmix32,
    mix64,
    sim_slice,
    validate_targets,
)
from .core import AGENT_VERSION, AgentError, invalid
from .mig import MIG_LABEL_BASE, in_slice_child, relay_to_slice
from .smi import load_profile

KEYS = {"seed": 11, "pi": 12, "rot": 13, "salt": 14, "digest": 15}
REFS = 6  # earlier blocks each block reads besides the one before it
FILL_PASSES = REFS + 2  # the fill reads REFS + 1 blocks and writes one per block: its nominal traffic
REAL_BLOCK_BYTES = 4096 * 4096 * 4  # a real fill's block (verification/memproof.py REAL_SIZES)
LIMITS = {"blocks": (2, 4096), "chunks": (1, 1 << 20), "words": (1, 4096), "nominal_bytes": (1, 1 << 44),
          "time_limit_s": (1, 900)}
SLICE = 1 << 22  # words built or digested at once on the device (int64 temporaries: a few x 32 MiB)
MAX_OPENINGS = 64
GROUP = 512  # chunk digests per group: a block's leaf is SHA-256 of its groups' SHA-256s (block_leaf)
# A chunk digest is the sum mod 2^32: the node's CPU hashes 4 bytes per 16 KiB chunk on the fresh root's clock (8
# took 40 % of an H200's deadline, bench/memproof_real_path.py), and a made-up one still passes with 2^-32.
DIGEST_BYTES = 4
MAX_FRESH = 2  # fresh salts in one proof: the platform asks again once when the first roots came late
# How a real card digests its fill: "fused" is one torch.compile kernel a block (a single read of the memory);
# "eager" is PyTorch's elementwise ops a slice at a time (a dozen kernels and passes a slice: several times too
# slow for the fresh root's deadline on a GPU, docs/BENCHMARKS.md); "auto" fuses on CUDA, stays eager on a CPU.
DIGEST_PATHS = ("auto", "fused", "eager")


def key(seed, gpu, what):
    z = mix64((seed & M64) ^ 0xD1B54A32D192ED03)
    for part in (gpu, KEYS[what]):
        z = mix64((z + part + 1) & M64)
    return z


def block_zero(seed, gpu, size):
    k = key(seed, gpu, "seed")
    return [fmix32(mix64(k ^ j) & M32) for j in range(size)]


def links(seed, gpu, i, size):
    """((p_k, r_k) for the REFS blocks block i >= 1 reads, salt_i)."""
    rots = [mix64(key(seed, gpu, "rot") ^ (i * REFS + k)) % size for k in range(REFS)]
    refs = tuple(zip(read_blocks(seed, gpu, i), rots))  # noqa: B905 - python3.8
    return refs, mix64(key(seed, gpu, "salt") ^ i) & M32


def read_blocks(seed, gpu, i, refs=REFS):
    """The earlier blocks block i reads (`refs` of them: a bench compares fills with fewer)."""
    return [mix64(key(seed, gpu, "pi") ^ (i * refs + k)) % i for k in range(refs)]


def g_word(prev, refs, salt):
    for ref in refs:
        prev ^= ref
    return fmix32(prev ^ salt)


def fill(seed, gpu, blocks, size):
    out = [block_zero(seed, gpu, size)]
    for i in range(1, blocks):
        refs, salt = links(seed, gpu, i, size)
        prev = out[i - 1]
        out.append([g_word(prev[j], [out[p][(j + r) % size] for p, r in refs], salt) for j in range(size)])
    return out


def position_salts(base, words):
    return [mix64(base ^ t) & M32 for t in range(words)]


def chunk_digest(words, salts):
    return sum(fmix32((w & M32) ^ s) for w, s in zip(words, salts)) & M32  # noqa: B905 - python3.8


def packed_block(block, chunks, words, salts):
    return struct.pack("<%dI" % chunks, *[chunk_digest(block[c * words:(c + 1) * words], salts)
                                           for c in range(chunks)])


def group_digests(packed):
    """A block's packed chunk digests (DIGEST_BYTES each) as SHA-256s of GROUP of them at a time (2 KiB: hashlib
    lets go of the GIL from 2 KiB on, so the GPUs' threads hash at once)."""
    step, view = DIGEST_BYTES * GROUP, memoryview(packed)  # slices of a memoryview: no copy (10 % of this on the clock)
    return [hashlib.sha256(view[g:g + step]).digest() for g in range(0, len(packed), step)]


def block_leaf(groups):
    """A block's Merkle leaf: SHA-256 of its group digests. An opening then carries its chunk's group of digests
    and the block's group digests (a few KiB) rather than every chunk digest of the block (16 KiB per salt at
    4096 chunks, and an opening reaches up to 14 chunks: 8 GPUs' openings would be hundreds of MiB)."""
    return hashlib.sha256(b"".join(groups)).digest()


def merkle_levels(leaves):
    levels = [leaves]
    while len(levels[-1]) > 1:
        level = levels[-1]
        up = [hashlib.sha256(level[i] + level[i + 1]).digest() for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            up.append(level[-1])
        levels.append(up)
    return levels


def merkle_path(levels, index):
    path = []
    for level in levels[:-1]:
        sibling = index + 1 if index % 2 == 0 else index - 1
        if sibling < len(level):
            path.append(level[sibling].hex())
        index //= 2
    return path


def validate(req):
    if not isinstance(req, dict):
        raise invalid("memproof", "the memory proof must be a JSON object")
    unknown = sorted(set(req) - {"seed", "blocks", "chunks", "words", "gpu_indices", "nominal_bytes",
                                 "time_limit_s", "device", "mig_uuids", "digest"})
    if unknown:
        raise invalid(unknown[0], "unknown field %s" % unknown[0])
    if type(req.get("seed")) is not int or not 0 <= req["seed"] <= M64:
        raise invalid("seed", "seed must be a 64-bit unsigned integer")
    for name, (low, high) in LIMITS.items():
        if type(req.get(name)) is not int or not low <= req[name] <= high:
            raise invalid(name, "%s must be an integer from %s to %s" % (name, low, high))
    validate_targets(req)  # GPU indices or MIG slice labels, as the challenge's
    if req.get("device", "cuda") not in ("cuda", "cpu"):
        raise invalid("device", "device must be cuda or cpu")
    if req.get("digest", "auto") not in DIGEST_PATHS:
        raise invalid("digest", "digest must be one of %s" % ", ".join(DIGEST_PATHS))
    return req


class Committed:
    """What a card keeps of its two commitments (the fill's salts, the fresh salt) to open chunks later."""

    packed = packed_fresh = groups = groups_fresh = levels = levels_fresh = None

    def keep(self, packed, fresh):
        """The root of these packed chunk digests (one bytes object per block), kept for the openings."""
        groups = [group_digests(p) for p in packed]
        levels = merkle_levels([block_leaf(g) for g in groups])
        if fresh:
            self.packed_fresh, self.groups_fresh, self.levels_fresh = packed, groups, levels
        else:
            self.packed, self.groups, self.levels = packed, groups, levels
        return levels[-1][0].hex()

    def opening(self, block, chunk, words):
        """The wire form of an opened chunk: its words (little-endian uint32, hex), and per commitment its
        group of chunk digests, the block's group digests and the block's Merkle path."""
        g = chunk // GROUP
        item = {"block": block, "chunk": chunk, "words": struct.pack("<%dI" % len(words), *words).hex()}
        for suffix, packed, groups, levels in (("", self.packed, self.groups, self.levels),
                                               ("_fresh", self.packed_fresh, self.groups_fresh, self.levels_fresh)):
            item["group" + suffix] = packed[block][DIGEST_BYTES * GROUP * g:DIGEST_BYTES * GROUP * (g + 1)].hex()
            item["groups" + suffix] = b"".join(groups[block]).hex()
            item["path" + suffix] = merkle_path(levels, block)
        return item


class SimCard(Committed):
    """One sim GPU's fill: the blocks it holds, the rest (in host RAM, or made up), and its real card's rates."""

    def __init__(self, req, i, spec, sheet, perf):
        self.req, self.i = req, i
        frac = spec.get("fraction", {})
        self.bandwidth = sheet["memory_bandwidth_gbs"] * 1e9 * frac.get("memory_bandwidth", 1.0)
        self.host_link = sheet.get("host_link_gbs", 16.0) * 1e9 * frac.get("host_link", 1.0)
        held_mib = spec.get("memory_held_mib", perf.get("memory_held_mib"))
        nominal = req["nominal_bytes"]
        self.held_bytes = nominal if held_mib is None else min(nominal, held_mib * 2 ** 20)
        rest = perf.get("memory_rest")
        self.made_up, self.recomputed = rest == "made_up", rest == "recomputed"
        size = req["chunks"] * req["words"]
        self.blocks = fill(req["seed"], i, req["blocks"], size)
        # the blocks beyond the share held stand for the memory the card does not have
        self.held = max(1, int(req["blocks"] * self.held_bytes / nominal))

    def commit(self, salts, fresh=False):
        r = random.Random(os.urandom(8))  # noqa: S311 - made-up digests
        packed = []
        for b, block in enumerate(self.blocks):
            if fresh and self.made_up and b >= self.held:
                packed.append(bytes(r.getrandbits(8) for _ in range(DIGEST_BYTES * self.req["chunks"])))
            else:
                packed.append(packed_block(block, self.req["chunks"], self.req["words"], salts))
        return self.keep(packed, fresh)

    def fill_s(self):
        return FILL_PASSES * self.req["nominal_bytes"] / self.bandwidth

    def fresh_s(self):
        nominal = self.req["nominal_bytes"]
        if self.recomputed:  # rebuilds on the card what it lacks, on the graph a real fill of these bytes has
            from .recompute import recompute_passes
            blocks = max(2, -(-nominal // REAL_BLOCK_BYTES))
            return recompute_passes(self.req["seed"], self.i, blocks, self.held_bytes / float(nominal)) * (
                nominal / self.bandwidth)
        rest = 0 if self.made_up else (nominal - self.held_bytes) / self.host_link
        return self.held_bytes / self.bandwidth + rest

    def open(self, block, chunk):
        words = self.req["words"]
        return self.opening(block, chunk, self.blocks[block][chunk * words:(chunk + 1) * words])


def sim_cards(cfg, req):
    profile, claimed = load_profile(cfg.sim_profile)
    perf = profile.get("performance") or {}
    specs = {g["index"]: g for g in perf.get("gpus", [])}
    known = {card["index"] for card in claimed}
    cards = {}
    memory = {card["index"]: card.get("memory_total_mib") for card in claimed}
    for i in req["gpu_indices"]:
        gpu, spec = i, specs.get(i)
        if i >= MIG_LABEL_BASE:  # a slice holds the memory it really has, at its share of the card's bandwidth
            gpu, real = sim_slice(profile, i, req["mig_uuids"])
            spec = specs.get(gpu)
            if spec is not None:
                frac = spec.get("fraction", {})
                share = real["memory_mib"] / float(memory.get(gpu) or real["memory_mib"])
                spec = dict(spec, memory_held_mib=min(real["memory_mib"], spec.get(
                    "memory_held_mib", perf.get("memory_held_mib")) or 1 << 40),
                            fraction=dict(frac, memory_bandwidth=frac.get("memory_bandwidth", 1.0) * share))
        if gpu not in known or spec is None:
            raise invalid("gpu_indices", "this node has no GPU %d" % gpu)
        sheet = dict(perf.get("datasheet", {}), **spec.get("datasheet", {}))
        cards[i] = SimCard(req, i, spec, sheet, perf)
    return cards


def commit_all(lines, cards, seconds, salts_of, fresh, clock, sleep):
    started = clock()
    roots = {i: card.commit(salts_of(i), fresh=fresh) for i, card in cards.items()}
    for at, i in sorted((started + seconds(card), i) for i, card in cards.items()):
        wait = at - clock()
        if wait > 0:
            sleep(wait)
        lines.write({"gpu": i, "root": roots[i]})


def needed_chunks(req, gpu, block, chunk):
    """The (block, chunk) pairs that prove chunk `chunk` of `block`: itself, the same chunk of the block before,
    and the chunks of each block it reads that its words read."""
    size, words = req["chunks"] * req["words"], req["words"]
    refs, _ = links(req["seed"], gpu, block, size)
    start = chunk * words
    needed = {(block, chunk), (block - 1, chunk)}
    for p, rot in refs:
        needed |= {(p, (start + rot) % size // words), (p, (start + words - 1 + rot) % size // words)}
    return needed


def opened(message, cards, req):
    picks = message.get("open")
    if not isinstance(picks, dict):
        raise invalid("open", "open must be an object of GPU index -> [[block, chunk], ...]")
    answer = {}
    for k, wanted in picks.items():
        i = int(k) if str(k).isdigit() else None
        if i not in cards or not isinstance(wanted, list) or len(wanted) > MAX_OPENINGS:
            raise invalid("open", "open names GPU %r, which was not asked to fill, or too many chunks" % k)
        items = {}
        for pick in wanted:
            if (not isinstance(pick, list) or len(pick) != 2 or not all(type(x) is int for x in pick)
                    or not 1 <= pick[0] < req["blocks"] or not 0 <= pick[1] < req["chunks"]):
                raise invalid("open", "open asks for a block or chunk that does not exist: %r" % (pick,))
            block, chunk = pick
            needed = needed_chunks(req, i, block, chunk)
            for b, c in needed:
                items[b, c] = cards[i].open(b, c)
        answer[str(i)] = [items[bc] for bc in sorted(items)]
    return answer


def run_exchange(cfg, infile, outfile, clock=time.monotonic, sleep=time.sleep, watchdog=False):
    lines = Lines(infile, outfile)
    if cfg.runtime != "sim":
        from .challenge_torch import preload
        preload()  # PyTorch imported before the first pong: not on the platform's clock
    try:
        message = answer_pings(cfg, lines, lines.read("first"), "memproof", "memproof", sleep)
        req = validate(message.get("memproof"))
        if watchdog:
            timer = threading.Timer(req["time_limit_s"], os._exit, (1,))
            timer.daemon = True
            timer.start()
        sim = cfg.runtime == "sim"
        if not sim and req["chunks"] * req["words"] * 4 * req["blocks"] < req["nominal_bytes"]:
            raise AgentError("memproof_unsupported", "this memory proof's fill (%d bytes) is smaller than the "
                             "memory it stands for: it is for simulated nodes" % (
                                 req["chunks"] * req["words"] * 4 * req["blocks"]))
        if not sim and req.get("mig_uuids") and not in_slice_child(req):  # a CUDA process sees one MIG device
            return relay_to_slice(req, lines, "memproof", "root")
        digest_salts = lambda i: position_salts(key(req["seed"], i, "digest"), req["words"])  # noqa: E731
        if sim:
            cards = sim_cards(cfg, req)
            commit_all(lines, cards, SimCard.fill_s, digest_salts, False, clock, sleep)
        else:
            from .memproof_torch import commit_now, torch_cards  # the real path: PyTorch on the node
            cards = torch_cards(req)
            commit_now(lines, cards, digest_salts, False)
        message = lines.read("fresh")
        for _ in range(MAX_FRESH):  # the platform may send another fresh salt: the last one's roots are opened
            fresh = message.get("fresh")
            if type(fresh) is not int or not 0 <= fresh <= M64:
                raise invalid("fresh", "fresh must be a 64-bit unsigned integer")
            salts = lambda i, fresh=fresh: position_salts(fresh, req["words"])  # noqa: E731
            if sim:
                commit_all(lines, cards, SimCard.fresh_s, salts, True, clock, sleep)
            else:
                commit_now(lines, cards, salts, True)
            message = lines.read("open")
            if "fresh" not in message:
                break
        for i, items in sorted(opened(message, cards, req).items(), key=lambda kv: int(kv[0])):
            lines.write({"gpu": int(i), "opened": items})  # a line per GPU: each a few MiB at real sizes
        lines.write({"ok": True, "agent_version": AGENT_VERSION})
        return 0
    except AgentError as exc:
        error = {"code": exc.code, "message": exc.message}
        if exc.field:
            error["field"] = exc.field
        lines.write({"ok": False, "agent_version": AGENT_VERSION, "error": error})
        return 2 if exc.code == "invalid_request" else 1
    except Exception as exc:  # the platform must always get a line, even for our own bugs
        lines.write({"ok": False, "agent_version": AGENT_VERSION,
                     "error": {"code": "internal_error", "message": "%s: %s" % (type(exc).__name__, exc)}})
        return 1


def main_memproof(cfg):
    return run_exchange(cfg, sys.stdin, sys.stdout, watchdog=True)
