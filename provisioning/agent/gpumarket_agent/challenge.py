"""The challenge command: matrices the platform generates from a secret seed, multiplied on every GPU, committed,
then revealed row by row where the platform asks. Interactive, one JSON object a line both ways (one SSH exec):

    platform -> {"ping": i}                      node -> {"pong": i}              (the platform times the round trip)
    platform -> {"challenge": {...}}             node -> {"gpu": i, "commitment": hex, "node_elapsed_s": s}
                                                          one line per GPU, as each finishes (the platform's clock)
    platform -> {"reveal": {"<gpu>": [[product, row], ...]}}
                                                 node -> {"gpu": i, "revealed": {"product_digests": [...],
                                                          "row_digests": {"<product>": hex},
                                                          "rows": [{"product", "row", "values"}]}}
                                                          one line per revealed GPU
    node -> {"ok": true, "agent_version": ...}   (or {"ok": false, "error": {...}} at any point, then the end)

One B (k x n) per challenge, shared by its GPUs (key b_key(seed)), has entries entry(key_B, row, col) in [-2, 2]
from a counter-based 64-bit hash; per GPU a code matrix (n x k) of 32-bit words from the same hash; product p of a
GPU is A_p x B with A_p's entry a_entry(salt_p, word) = (fmix32(word ^ salt_p) >> 29) - 3, in [-3, 4]: every
product is exact in FP32 accumulation from BF16 inputs, and the platform recomputes every revealed row whole, on
its own, and wants it exactly (a BF16 output: each entry the exact integer rounded once to BF16, as the
commitment's `output_dtype` says). Digests: a row's is the 64-bit sum over its entries of fmix32(value ^ the
column's salt) (nonlinear: no shortcut through A (B w)), computed where the product is; a product's is SHA-256
of its row digests packed as little-endian uint64; the commitment is SHA-256 of the product digests (hex,
joined). provisioning/verification/challenge.py implements the same on the platform, independently (a test holds
them equal).

In sim mode the node really computes the products (pure Python, the small sizes the platform asks for) and then
answers each GPU no sooner than the profile's real card would finish the platform's nominal work
(`flop_per_gpu` / (real datasheet BF16 x its fraction)): a sim can lie in what it reports, not in how fast it
works. A GPU whose profile says `matmul_correct: false` returns every entry off by one.

MIG slices: the request's `mig_uuids` (validated MIG-... UUIDs, never in a shell string) names slices, each
labelled in `gpu_indices` by MIG_LABEL_BASE + its position there (the label keys its matrices). A sim slice
works at its card's rate times the compute slices (of 7) it really has, whatever its name says. A real node
challenges one slice per exchange, in a child process that sees only that slice (mig.relay_to_slice).

On a real node the products are computed with PyTorch on every GPU at once (challenge_torch.py); a real node
answers only real-work challenges.
"""
import hashlib
import json
import os
import random
import struct
import sys
import threading
import time

from .core import AGENT_VERSION, AgentError, invalid
from .mig import COMPUTE_SLICES, MIG_LABEL_BASE, in_slice_child, relay_to_slice, sim_slices, validate_mig_uuids
from .smi import load_profile

M64 = (1 << 64) - 1
M32 = (1 << 32) - 1
MATRICES = {"A": 1, "B": 2, "S": 3, "D": 4}  # code matrix, B, a product's salt, the digest's column salts
LIMITS = {"n": (1, 256), "k": (1, 256), "products": (1, 16), "flop_per_gpu": (1.0, 1e18), "time_limit_s": (1, 900)}
# A real node's real-work challenge: k <= 2^20 keeps every product an exact integer in FP32 (|C| <= 8k <= 2^23);
# the row digests of every product stay on the device (8 bytes each, at most MAX_DIGESTS).
REAL_LIMITS = dict(LIMITS, n=(1, 16384), k=(1, 1 << 20), products=(1, 4096))
MAX_DIGESTS = 1 << 25
DEVICES = ("cuda", "cpu")
GEN_CHUNK = 1 << 23  # elements of a matrix generated or reduced at once (int64 temporaries: a few x 64 MiB)
MAX_REVEAL_ROWS = 64


def mix64(z):
    """splitmix64's finaliser: a bijection of 64-bit integers that scatters every input bit."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & M64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & M64
    return z ^ (z >> 31)


def fmix32(z):
    """murmur3's finaliser on 32-bit words: nonlinear (multiplications mod 2^32 between shifts)."""
    z ^= z >> 16
    z = z * 0x85EBCA6B & M32
    z ^= z >> 13
    z = z * 0xC2B2AE35 & M32
    return z ^ (z >> 16)


def matrix_key(seed, gpu, product, matrix):
    z = mix64((seed & M64) ^ 0x9E3779B97F4A7C15)
    for part in (gpu, product, MATRICES[matrix]):
        z = mix64((z + part + 1) & M64)
    return z


def entry(key, row, col):
    return mix64(key ^ ((row << 32) | col)) % 5 - 2


def code_word(key, row, col):
    return mix64(key ^ ((row << 32) | col)) & M32


def b_key(seed):
    """B's key: one B per challenge, shared by its GPUs (their own codes and salts keep their products apart)."""
    return matrix_key(seed, 0, 0, "B")


def product_salt(seed, gpu, product):
    return matrix_key(seed, gpu, product, "S") & M32


def a_entry(salt, word):
    return (fmix32(word ^ salt) >> 29) - 3


def column_salts(seed, gpu, n):
    key = matrix_key(seed, gpu, 0, "D")
    return [mix64(key ^ j) & M32 for j in range(n)]


def product_rows(seed, gpu, product, n, k):
    code, key_b = matrix_key(seed, gpu, 0, "A"), b_key(seed)
    salt = product_salt(seed, gpu, product)
    a = [[a_entry(salt, code_word(code, r, c)) for c in range(k)] for r in range(n)]
    cols = list(zip(*[[entry(key_b, r, c) for c in range(n)] for r in range(k)]))  # noqa: B905 - python3.8
    return [[sum(x * y for x, y in zip(row, col)) for col in cols] for row in a]  # noqa: B905


def row_digest(values, salts):
    return sum(fmix32((int(v) & M32) ^ s) for v, s in zip(values, salts)) & M64  # noqa: B905


def packed_digests(digests):
    return struct.pack("<%dQ" % len(digests), *digests)


def joined_digest(digests):
    return hashlib.sha256("".join(digests).encode()).hexdigest()


class Work:
    """One GPU's answer: its row digests packed per product, their SHA-256s, and its rows on demand."""

    def __init__(self, packed, rows, output_dtype=None):
        self.packed = packed  # per product: n little-endian uint64
        self.products = [hashlib.sha256(p).hexdigest() for p in packed]
        self.rows = rows  # rows(product, [row, ...]) -> [[values], ...]
        self.output_dtype = output_dtype

    def commitment(self):
        return joined_digest(self.products)


def real_work(req):
    """Whether the challenge's nominal work is the work its sizes really are (the platform's real-work draw)."""
    work = req["products"] * 2.0 * req["n"] * req["n"] * req["k"]
    return abs(req["flop_per_gpu"] - work) <= 1e-9 * work


def validate_challenge(req, real=False):
    """The challenge checked against the sizes a sim node (LIMITS) or a real node (REAL_LIMITS) accepts."""
    if not isinstance(req, dict):
        raise invalid("challenge", "the challenge must be a JSON object")
    unknown = sorted(set(req) - {"seed", "n", "k", "products", "dtype", "gpu_indices", "flop_per_gpu",
                                 "time_limit_s", "device", "mig_uuids"})
    if unknown:
        raise invalid(unknown[0], "unknown field %s" % unknown[0])
    if type(req.get("seed")) is not int or not 0 <= req["seed"] <= M64:
        raise invalid("seed", "seed must be a 64-bit unsigned integer")
    for name, (low, high) in (REAL_LIMITS if real else LIMITS).items():
        value = req.get(name)
        kind = (int, float) if name == "flop_per_gpu" else (int,)
        if type(value) not in kind or not low <= value <= high:
            raise invalid(name, "%s must be a number from %s to %s" % (name, low, high))
    if req["products"] * req["n"] > MAX_DIGESTS:
        raise invalid("products", "products x n must be at most %d (the row digests kept)" % MAX_DIGESTS)
    if req.get("dtype") != "bf16":
        raise invalid("dtype", "dtype must be bf16")
    validate_targets(req)
    if req.get("device", "cuda") not in DEVICES:
        raise invalid("device", "device must be one of %s" % ", ".join(DEVICES))
    return req


def validate_targets(req):
    """gpu_indices: GPU indices, or MIG slice labels (MIG_LABEL_BASE + the slice's position in mig_uuids)."""
    slices = validate_mig_uuids(req.get("mig_uuids"))
    top = MIG_LABEL_BASE + len(slices) if slices else MIG_LABEL_BASE
    indices = req.get("gpu_indices")
    if (not isinstance(indices, list) or not indices or len(set(indices)) != len(indices)
            or not all(type(i) is int and 0 <= i < top for i in indices)):
        raise invalid("gpu_indices", "gpu_indices must be a non-empty list of distinct GPU indices (0-%d) or MIG "
                      "slice labels (%d + the slice's position in mig_uuids)" % (MIG_LABEL_BASE - 1, MIG_LABEL_BASE))


def sim_slice(profile, label, mig_uuids):
    """(card index, the slice as the sim profile configures it) of a MIG slice label."""
    uuid = mig_uuids[label - MIG_LABEL_BASE]
    for gpu, rows in sim_slices(profile).items():
        for real in rows:
            if real["uuid"] == uuid:
                return gpu, real
    raise invalid("mig_uuids", "this node has no MIG device %s" % uuid)


class Lines:
    """One JSON object a line on a pair of text streams."""

    def __init__(self, infile, outfile):
        self.infile, self.outfile = infile, outfile

    def read(self, what):
        line = self.infile.readline()
        if not line:
            raise AgentError("challenge_aborted", "the platform closed the exchange before sending %s" % what)
        try:
            message = json.loads(line)
        except ValueError:
            raise invalid(what, "the %s line is not JSON" % what) from None
        if not isinstance(message, dict):
            raise invalid(what, "the %s line must be a JSON object" % what)
        return message

    def write(self, message):
        self.outfile.write(json.dumps(message, sort_keys=True) + "\n")
        self.outfile.flush()


def sim_cards(cfg, indices, mig_uuids=None):
    """Per GPU index or MIG slice label: (its real BF16 rate in FLOP/s, whether its products are right), from
    the sim profile. A slice works at its card's rate times the compute slices (of 7) it really has."""
    profile, claimed = load_profile(cfg.sim_profile)
    perf = profile.get("performance") or {}
    specs = {g["index"]: g for g in perf.get("gpus", [])}
    known = {card["index"] for card in claimed}
    rng = random.Random(os.urandom(16))  # noqa: S311 - run-to-run noise, as the sim benchmark's
    cards = {}
    for i in indices:
        share = 1.0
        if i >= MIG_LABEL_BASE:
            gpu, real = sim_slice(profile, i, mig_uuids)
            share = real["compute_slices"] / float(COMPUTE_SLICES)
        else:
            gpu = i
        spec = specs.get(gpu)
        if gpu not in known or spec is None:
            raise invalid("gpu_indices", "this node has no GPU %d" % gpu)
        sheet = dict(perf.get("datasheet", {}), **spec.get("datasheet", {}))
        noise = 1 + max(-0.03, min(0.03, rng.gauss(0, 0.012)))
        cards[i] = (sheet["bf16_tflops"] * 1e12 * spec["fraction"]["bf16"] * share * noise,
                    spec.get("matmul_correct", True))
    return cards, perf.get("challenge_hang_s")


def sim_work(cfg, req):
    """The sim node's work on a validated challenge: per GPU its Work, and the seconds its real card takes for
    the nominal work; and the profile's `challenge_hang_s`."""
    cards, hang_s = sim_cards(cfg, req["gpu_indices"], req.get("mig_uuids"))
    results, seconds = {}, {}
    for i in req["gpu_indices"]:
        rows_of = []
        for p in range(req["products"]):
            rows = product_rows(req["seed"], i, p, req["n"], req["k"])
            if not cards[i][1]:
                rows = [[v + 1 for v in row] for row in rows]  # silent data corruption
            rows_of.append(rows)
        salts = column_salts(req["seed"], i, req["n"])
        packed = [packed_digests([row_digest(r, salts) for r in rows]) for rows in rows_of]
        results[i] = Work(packed, lambda p, picked, rows_of=rows_of: [rows_of[p][r] for r in picked])
        seconds[i] = req["flop_per_gpu"] / cards[i][0]
    return results, seconds, hang_s


def answer_pings(cfg, lines, message, next_what, command, sleep=time.sleep):
    """Pong each ping until the command's request comes, and return that. A sim profile may hold its pongs back
    (`performance.pong_delay_s.<command>` seconds): a node trying to buy round-trip credit for slow answers."""
    delay = 0.0
    if cfg.runtime == "sim":
        delays = (load_profile(cfg.sim_profile)[0].get("performance") or {}).get("pong_delay_s") or {}
        delay = float(delays.get(command, 0.0))
    while "ping" in message:
        if delay > 0:
            sleep(delay)
        lines.write({"pong": message["ping"]})
        message = lines.read(next_what)
    return message


def run_exchange(cfg, infile, outfile, clock=time.monotonic, sleep=time.sleep, watchdog=False):
    """The whole exchange (see the module's doc). Returns the exit status; every answer goes to `outfile`.
    With `watchdog`, the process ends at the challenge's time_limit_s whatever it is doing."""
    lines = Lines(infile, outfile)
    if cfg.runtime != "sim":
        from .challenge_torch import preload, torch_work  # the real path: PyTorch on the node
        preload()
    try:
        message = answer_pings(cfg, lines, lines.read("first"), "challenge", "challenge", sleep)
        req = validate_challenge(message.get("challenge"), real=cfg.runtime != "sim")
        if watchdog:
            timer = threading.Timer(req["time_limit_s"], os._exit, (1,))
            timer.daemon = True
            timer.start()
        if cfg.runtime != "sim":
            if not real_work(req):
                raise AgentError("challenge_unsupported", "this challenge's nominal work (flop_per_gpu %g) is not "
                                 "the work of its sizes: it is for simulated nodes; a real node answers the "
                                 "platform's real-work challenge" % req["flop_per_gpu"])
            if req.get("mig_uuids") and not in_slice_child(req):
                return relay_to_slice(req, lines, "challenge", "commitment")
            results = torch_work(req, lines, clock)
        else:
            results = sim_exchange(cfg, req, lines, clock, sleep)
        reveal = lines.read("reveal").get("reveal")
        for key, rows in sorted(reveal_rows(reveal, results).items(), key=lambda kv: int(kv[0])):
            lines.write({"gpu": int(key), "revealed": rows})  # a line per GPU: ~1.4 MB each at real sizes
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


def sim_exchange(cfg, req, lines, clock, sleep):
    """A sim node's commitments, each no sooner than its real card would finish the nominal work."""
    started = clock()
    results, seconds, hang_s = sim_work(cfg, req)
    if hang_s:  # a knob for tests: a node that never answers
        sleep(hang_s)
    due = sorted((started + s, i) for i, s in seconds.items())
    for at, i in due:
        wait = at - clock()
        if wait > 0:
            sleep(wait)
        lines.write({"gpu": i, "commitment": results[i].commitment(),
                     "node_elapsed_s": round(clock() - started, 4)})
    return results


def reveal_rows(reveal, results):
    if not isinstance(reveal, dict):
        raise invalid("reveal", "reveal must be an object of GPU index -> [[product, row], ...]")
    answer = {}
    for key, picks in reveal.items():
        i = int(key) if str(key).isdigit() else None
        if i not in results or not isinstance(picks, list) or len(picks) > MAX_REVEAL_ROWS:
            raise invalid("reveal", "reveal names GPU %r, which was not challenged, or too many rows" % key)
        work = results[i]
        n = len(work.packed[0]) // 8
        for pick in picks:
            if (not isinstance(pick, list) or len(pick) != 2 or not all(type(x) is int for x in pick)
                    or not 0 <= pick[0] < len(work.packed) or not 0 <= pick[1] < n):
                raise invalid("reveal", "reveal asks for a product or row that does not exist: %r" % (pick,))
        values = {}  # one batch of rows per product, recomputed on the device for a real node
        for p in sorted({pick[0] for pick in picks}):
            wanted = sorted({pick[1] for pick in picks if pick[0] == p})
            values.update(((p, r), v) for r, v in zip(wanted, work.rows(p, wanted)))  # noqa: B905
        rows = [{"product": p, "row": r, "values": values[p, r]} for p, r in picks]
        answer[str(i)] = {"product_digests": work.products, "rows": rows,
                          "row_digests": {str(p): work.packed[p].hex() for p in sorted({x[0] for x in picks})}}
    return answer


def main_challenge(cfg):
    return run_exchange(cfg, sys.stdin, sys.stdout, watchdog=True)
