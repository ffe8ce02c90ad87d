"""The challenge, on the platform's side: a check of the GPUs' work that the node's own reports cannot fake.

1. draw(): a secret 64-bit seed and sizes from the claimed card's datasheet, so that the nominal work per GPU
   (`flop_per_gpu`) takes `target_s` on the claimed card at its datasheet BF16 rate.
2. run(): over one interactive exchange with the agent (`agent challenge`, agent/gpumarket_agent/challenge.py):
   the SSH round trip timed with pings and below the agent (round_trip.py); the challenge sent; each GPU's
   commitment timed on the platform's clock as it arrives; only then the rows to reveal drawn with a secret RNG;
   the revealed rows read.
3. judge(): the revealed rows must hash to the committed digests (row -> product -> commitment), and every
   revealed row must equal, in all of its n entries, what the platform computes itself from the seed, exactly in
   integers (entries are in [-2, 2] and [-3, 4], so FP32 accumulation is exact; a GPU whose commitment said
   `output_dtype` "bf16" must give each entry as that exact integer rounded once to BF16, to nearest even).
   Throughput = flop_per_gpu / (arrival - sent - round trip) against the claimed card's datasheet, in the BF16
   band of TOLERANCES; every GPU within `node_median_max_deviation` of the node's median. The node's own timings
   are kept as detail only.

The matrices (the same on both sides): one B per challenge (k x n, entries in [-2, 2], shared by its GPUs) and
per GPU one code matrix (n x k, 32-bit words from the seed); product p of a GPU multiplies A_p x B, where A_p's
entries are a nonlinear 32-bit mix of the GPU's code under the product's salt (values in [-3, 4]), so A_p costs a
few integer operations per entry on the device and no shortcut relates one product, or one GPU's, to another.
|C| <= 8k, exact in FP32.

The commitment is made on the device: each output row is reduced to a 64-bit row digest, the sum over its
entries of a nonlinear 32-bit mix (murmur3's fmix32) of the entry's integer value XOR a per-column salt from the
seed. A linear digest (a weighted sum) would let a node compute A_p (B w) without the product; this one needs
every entry. A product's digest is SHA-256 of its n row digests (little-endian uint64, one buffer), the
commitment SHA-256 of the product digests joined. The node SHA-256s only n x 8 bytes per product on its CPU, so
the platform's clock times the GPU. At the reveal the node sends, per picked product, its packed row digests, and
the picked rows' values (it recomputes those rows on the device: one row is cheap, but only the whole product
gives the committed digests).

Soundness (what a node must do to pass, and how likely a cheaper node is caught). The row digest is a sum of
per-entry terms, so it binds nothing by itself: a node that committed any digest D for a row it never computed
could, after the pick, compute that one row (a vector times B) and rewrite a few entries so that the sum hits D
(fmix32 is invertible). It was so until 2026-12: only 4 secret entries of each revealed row were recomputed, a
rewritten entry was seen with probability ~4/n, and a node with no GPU passed. So the platform recomputes every
revealed row whole (challenge_rows.expected_rows) and requires it exactly, and the digest it recomputes from those
values must be the one committed (and through SHA-256 the commitment that arrived at the timed moment). A revealed
row is then accepted only if the node knew that row's exact digest when it committed: by computing the row (all n
entries: each term is a nonlinear mix of one entry), or by guessing a 64-bit sum whose spread is ~2^32 sqrt(n/12)
(one chance in ~2^34 or less). The REVEAL_ROWS (product, row) pairs of each GPU are drawn uniformly from its
products x n rows, without replacement, with the platform's secret RNG, only after every commitment arrived. A GPU
whose commitment covers a fraction f of its rows truly (any mix: some products whole, parts of every product,
approximate or wrong values elsewhere) passes with probability at most f^REVEAL_ROWS (f = 0.5: 1/256; f = 0.9:
0.43), and for the timing a fraction f of the work reads as 1/f of the card's rate: a card at 40 % of the claimed
datasheet that does 60 % of the work to look healthy (65 %) passes 1.7 % of checks per GPU, and every spot check
draws again. An entry adjusted after the pick is caught with certainty; so is an entry moved to a neighbouring BF16
value (the rounding is fixed: no tolerance to steer within). Cost: B is generated once per challenge (k x n hashes,
on numpy in challenge_rows.py: nearly all of the control plane's CPU for the check) and multiplied with the m
revealed rows of A (bench/challenge_verify_real.py).

Sizes: for a simulated node the matrices are small (`n` x `k`) and stand for the nominal work; it computes them
for real and answers each GPU no sooner than its real card would finish the nominal work. For a real node
(`draw(real_work=True)`, the agent's PyTorch path; node verification draws it for every runtime but `sim`) the
work is real: `flop_per_gpu` = products x 2 n^2 k, k fixed per mode, n as large as REAL_SIZES and a share of the
card's memory allow, and as many products as make the work take `target_s` at the claimed card's datasheet BF16
(real_sizes()).

Pure: no Django, no SSH; the exchange is anything with send(dict) -> float and receive(timeout) ->
(bytes | None, float) on the time.monotonic() clock, raising EOFError once the node closed it.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import secrets
import struct
import time
from dataclasses import dataclass, field
from typing import Protocol

from core import untrusted_json
from provisioning.verification import lanes, round_trip
from provisioning.verification.model import DeclaredModel
from provisioning.verification.tolerances import TOLERANCES

M64 = (1 << 64) - 1
NODE_TEXT_MAX = 500  # of a node's own error message in an exchange's problem (node_error_text)
M32 = (1 << 32) - 1
MATRICES = {"A": 1, "B": 2, "S": 3, "D": 4}  # code matrix, B, a product's salt, the digest's column salts
# The matrices' sizes and the time the nominal work takes on the claimed card at its datasheet BF16 rate: quick
# (tests, sim nodes on the CI box) and full.
SIZES = {
    True: {"n": 16, "k": 16, "products": 2, "target_s": 1.5},
    False: {"n": 48, "k": 48, "products": 4, "target_s": 8.0},
}
# The real-work mode: k fixed (the platform recomputes each revealed row whole: B's k x n hashes once per
# challenge), n up to n_max within REAL_MEMORY_SHARE of the card, then as many products as the target takes, at
# most REAL_MAX_PRODUCTS and REAL_MAX_DIGESTS row digests per GPU (kept on the device, 8 bytes each).
REAL_SIZES = {
    True: {"k": 4096, "n_max": 8192, "target_s": 1.0},
    False: {"k": 16384, "n_max": 16384, "target_s": 8.0},
}
REAL_MAX_PRODUCTS = 4096
REAL_MAX_DIGESTS = 1 << 25
REAL_N_STEP = 256
REAL_MEMORY_SHARE = 0.25
REAL_GENERATION_BYTES = 512 << 20  # the agent's int64 temporaries while it generates a matrix
DIGEST_FLOOR_BPS = 2.5e8  # SHA-256 of the row digests at no less than this per GPU: added to the wait
# Rows revealed per GPU, each recomputed whole: a GPU that computed a fraction f of its rows passes <= f^8.
REVEAL_ROWS = 8
MIG_LABEL_BASE = 64  # a MIG slice's label in a challenge: above any GPU index (the agent's GPU indices are < 64)
OUTPUT_DTYPES = ("fp32", "bf16")  # what a commitment may say its GEMM output was (none said: fp32, exact)
PINGS = 3
PING_TIMEOUT_S = 10.0
GRACE_S = 5.0  # beyond the time the slowest acceptable card would take, before a GPU counts as not answering
# The node's bulky answers (the revealed rows, the memory proof's openings) reach the platform at no less than
# this (10 Mbit/s): each wait is PING_TIMEOUT_S plus its bytes at this rate (answer_wait_s).
ANSWER_FLOOR_BPS = 1.25e6


# ------------------------------------------------------------------------- the numbers, as the agent has them

def mix64(z: int) -> int:
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & M64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & M64
    return z ^ (z >> 31)


def fmix32(z: int) -> int:
    """murmur3's finaliser: a bijection of 32-bit words, nonlinear (multiplications mod 2^32 between shifts)."""
    z ^= z >> 16
    z = z * 0x85EBCA6B & M32
    z ^= z >> 13
    z = z * 0xC2B2AE35 & M32
    return z ^ (z >> 16)


def matrix_key(seed: int, gpu: int, product: int, matrix: str) -> int:
    z = mix64((seed & M64) ^ 0x9E3779B97F4A7C15)
    for part in (gpu, product, MATRICES[matrix]):
        z = mix64((z + part + 1) & M64)
    return z


def entry(key: int, row: int, col: int) -> int:
    return mix64(key ^ ((row << 32) | col)) % 5 - 2


def code_word(key: int, row: int, col: int) -> int:
    return mix64(key ^ ((row << 32) | col)) & M32


def product_salt(seed: int, gpu: int, product: int) -> int:
    return matrix_key(seed, gpu, product, "S") & M32


def a_entry(salt: int, word: int) -> int:
    """A_p's entry from the code word under the product's salt: the mix's top 3 bits, in [-3, 4]."""
    return (fmix32(word ^ salt) >> 29) - 3


def b_key(seed: int) -> int:
    """B's key: one B per challenge, shared by its GPUs (each GPU's own code matrix and salts make its products
    its own), so that the platform generates B once to recompute every GPU's revealed rows."""
    return matrix_key(seed, 0, 0, "B")


def expected_entry(seed: int, gpu: int, product: int, k: int, row: int, col: int) -> int:
    """C[row][col] of the product, from the seed alone: k multiply-adds (the definition that
    challenge_rows.expected_rows follows)."""
    code, b = matrix_key(seed, gpu, 0, "A"), b_key(seed)
    salt = product_salt(seed, gpu, product)
    return sum(a_entry(salt, code_word(code, row, j)) * entry(b, j, col) for j in range(k))


def a_row(seed: int, gpu: int, product: int, k: int, row: int) -> tuple[int, ...]:
    """Row `row` of the GPU's A_p plus 3 (each in [0, 7]), on lanes: k code words, mixed under the product's salt."""
    code = matrix_key(seed, gpu, 0, "A")
    words = lanes.mix64(lanes.broadcast(code, k, 128) ^ (lanes.iota(0, k, 128) + lanes.broadcast(row << 32, k, 128)),
                        k)  # code_word
    a = lanes.fmix32((words & lanes.mask(k, 128, 32)) ^ lanes.broadcast(product_salt(seed, gpu, product), k, 128),
                     k, 128) >> 29 & lanes.mask(k, 128, 3)
    return lanes.unpack(a, k, 128)


def bf16_round(value: int) -> int:
    """The integer `value` rounded once to BF16 (8 significant bits), to nearest, ties to even: what a BF16 GEMM
    output holds when its FP32 accumulator is exact."""
    size = abs(value)
    drop = size.bit_length() - 8
    if drop <= 0:
        return value
    q, r = divmod(size, 1 << drop)
    half = 1 << (drop - 1)
    if r > half or (r == half and q & 1):
        q += 1
    return (q << drop) if value >= 0 else -(q << drop)


def column_salts(seed: int, gpu: int, n: int) -> list[int]:
    key = matrix_key(seed, gpu, 0, "D")
    return [mix64(key ^ j) & M32 for j in range(n)]


def row_digest(values: list, salts: list[int]) -> int:
    """The row's 64-bit digest: the sum of fmix32(entry XOR its column's salt), entries as 32-bit integers."""
    return sum(fmix32((int(v) & M32) ^ s) for v, s in zip(values, salts, strict=True)) & M64


def column_salt_lanes(seed: int, gpu: int, n: int) -> int:
    """column_salts in 64-bit lanes (lanes.py)."""
    z = lanes.mix64(lanes.broadcast(matrix_key(seed, gpu, 0, "D"), n, 128) ^ lanes.iota(0, n, 128), n)
    return lanes.narrow(z & lanes.mask(n, 128, 32), n)


def row_digest_lanes(values: list, salts: int) -> int:
    """row_digest on lanes, the salts from column_salt_lanes; values integers below 2^31 in magnitude."""
    words = lanes.pack32(struct.pack(f"<{len(values)}i", *(int(v) for v in values)))  # two's complement: v & M32
    return lanes.total32(lanes.fmix32(words ^ salts, len(values)), len(values)) & M64


def packed_digest(packed: bytes) -> str:
    """A product's digest: SHA-256 of its row digests as little-endian uint64."""
    return hashlib.sha256(packed).hexdigest()


def joined_digest(digests: list[str]) -> str:
    return hashlib.sha256("".join(digests).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------- the draw

@dataclass(frozen=True)
class Challenge:
    seed: int
    n: int
    k: int
    products: int
    gpu_indices: tuple
    flop_per_gpu: float
    target_s: float
    datasheet_tflops: float
    wait_s: float  # how long the platform waits for the last commitment
    device: str = ""  # "cpu" to run a real-work challenge on the node's CPU (tests, gpu-selfcheck --device cpu)
    # MIG slices challenged: gpu_indices are then their labels, MIG_LABEL_BASE + position here (slice_challenge.py)
    mig_uuids: tuple = ()

    def request(self, time_limit_s: int) -> dict:
        req = {"seed": self.seed, "n": self.n, "k": self.k, "products": self.products, "dtype": "bf16",
               "gpu_indices": list(self.gpu_indices), "flop_per_gpu": self.flop_per_gpu,
               "time_limit_s": time_limit_s}
        if self.device:
            req["device"] = self.device
        if self.mig_uuids:
            req["mig_uuids"] = list(self.mig_uuids)
        return req


def bf16_band(declared: DeclaredModel) -> dict:
    """The BF16 band of TOLERANCES the challenge's rate is judged in, its floors lowered for a derived datasheet."""
    band = dict(TOLERANCES["figure_bands"]["bf16_tflops"])
    if "bf16_tflops" in declared.derived:
        band["reject"] *= TOLERANCES["derived_floor_factor"]
        band["degrade"] *= TOLERANCES["derived_floor_factor"]
    return band


def real_sizes(sheet_tflops: float, memory_mib: int, quick: bool) -> tuple[int, int, int, str]:
    """(n, k, products, what bounds the work) of a real-work challenge on a card of this BF16 rate and memory:
    n as large as n_max, the memory and (for one product) the target allow, then products to fill the target."""
    size = REAL_SIZES[bool(quick)]
    k, step, target = int(size["k"]), REAL_N_STEP, float(size["target_s"])
    work = target * sheet_tflops * 1e12
    budget = REAL_MEMORY_SHARE * memory_mib * 2 ** 20 - REAL_GENERATION_BYTES - 8 * REAL_MAX_DIGESTS
    # the code (int32), A_p and B (BF16): 8nk bytes; C in FP32 plus its BF16 or FP32 GEMM output: 8n^2
    by_memory = (-8 * k + math.sqrt(64 * k * k + 32 * max(budget, 0.0))) / 16
    by_target = math.sqrt(work / (2 * k))
    bound, limit = min(("n_max", float(size["n_max"])), ("memory", by_memory), ("target", by_target),
                       key=lambda b: b[1])
    n = max(step, int(limit // step) * step)
    products = max(1, round(work / (2.0 * n * n * k)))
    cap = min(REAL_MAX_PRODUCTS, REAL_MAX_DIGESTS // n)
    if products > cap:
        products, bound = cap, "products"
    return n, k, products, bound


def draw(declared: DeclaredModel, gpu_indices: list[int], quick: bool,
         rng: random.Random | None = None, real_work: bool = False) -> Challenge:
    """The challenge for a node of the declared model: nominal work (a sim node) or, with `real_work`, the
    work a real node's GPUs really do (real_sizes())."""
    sheet = float(declared.datasheet["bf16_tflops"])
    if real_work:
        return draw_real(sheet, declared.memory_mib, gpu_indices, quick, rng, reject=bf16_band(declared)["reject"])
    size = SIZES[bool(quick)]
    seed = rng.getrandbits(64) if rng is not None else secrets.randbits(64)
    wait = size["target_s"] / bf16_band(declared)["reject"] + GRACE_S
    return Challenge(seed=seed, n=int(size["n"]), k=int(size["k"]), products=int(size["products"]),
                     gpu_indices=tuple(gpu_indices), flop_per_gpu=size["target_s"] * sheet * 1e12,
                     target_s=size["target_s"], datasheet_tflops=sheet, wait_s=wait)


def draw_real(sheet_tflops: float, memory_mib: int, gpu_indices: list[int], quick: bool,
              rng: random.Random | None = None, reject: float | None = None, device: str = "",
              sizes: tuple[int, int, int] | None = None) -> Challenge:
    """A real-work challenge (`sizes` = (n, k, products) to choose them, else real_sizes()): the platform waits
    for the work at the lowest accepted share of the datasheet, plus the row digests' SHA-256 at
    DIGEST_FLOOR_BPS, plus GRACE_S."""
    n, k, products = sizes or real_sizes(sheet_tflops, memory_mib, quick)[:3]
    seed = rng.getrandbits(64) if rng is not None else secrets.randbits(64)
    work = products * 2.0 * n * n * k
    target = work / (sheet_tflops * 1e12)
    floor = reject if reject is not None else TOLERANCES["figure_bands"]["bf16_tflops"]["reject"]
    wait = target / floor + products * n * 8 / DIGEST_FLOOR_BPS + GRACE_S
    return Challenge(seed=seed, n=n, k=k, products=products, gpu_indices=tuple(gpu_indices), flop_per_gpu=work,
                     target_s=target, datasheet_tflops=sheet_tflops, wait_s=wait, device=device)


# ------------------------------------------------------------------------------------------ the exchange

class Exchange(Protocol):
    def send(self, message: dict) -> float: ...

    def receive(self, timeout: float) -> tuple[bytes | None, float]: ...


@dataclass
class Outcome:
    """What happened in the exchange, as the platform saw it; judge() turns it into findings."""

    round_trip_s: float | None = None  # taken off each commitment's time: the least of `round_trips`, capped
    round_trips: dict = field(default_factory=dict)  # what each measurement said: round_trip.credit()
    sent_at: float | None = None
    arrivals: dict = field(default_factory=dict)  # gpu -> platform clock at its commitment
    commitments: dict = field(default_factory=dict)  # gpu -> hex
    output_dtypes: dict = field(default_factory=dict)  # gpu -> what its commitment said its GEMM output was
    node_elapsed_s: dict = field(default_factory=dict)  # gpu -> what the node says (detail only)
    picks: dict = field(default_factory=dict)  # gpu -> [(product, row)]
    revealed: dict = field(default_factory=dict)  # gpu -> {"product_digests", "rows"}
    problem: str = ""  # why the exchange ended early: garbage, closed, an error from the node
    node_error: dict | None = None


def pick_rows(challenge: Challenge, rng: random.Random) -> dict[int, list]:
    """Per GPU: the (product, row) pairs to reveal, REVEAL_ROWS distinct ones uniformly from all its rows (each
    recomputed whole by the platform)."""
    picks = {}
    every = challenge.products * challenge.n
    for gpu in challenge.gpu_indices:
        rows = rng.sample(range(every), min(REVEAL_ROWS, every))
        picks[gpu] = [(r // challenge.n, r % challenge.n) for r in rows]
    return picks


def answer_wait_s(nbytes: float) -> float:
    """How long the platform waits for answers of at most `nbytes` after asking: PING_TIMEOUT_S plus the bytes at
    ANSWER_FLOOR_BPS. Eight GPUs' openings of a real fill are ~40 MB: within 10 s alone the node's uplink would
    need 32 Mbit/s, and an honest node on a slower one would be rejected as not answering."""
    return PING_TIMEOUT_S + nbytes / ANSWER_FLOOR_BPS


def reveal_bytes(challenge: Challenge) -> int:
    """At most the bytes of the reveal's lines: per GPU the picked products' packed row digests in hex, the
    revealed rows' values in JSON (|C| <= 8k: at most 12 characters an entry with its separator, a float's ".0"
    included) and the product digests."""
    products = min(REVEAL_ROWS, challenge.products)
    per_gpu = products * 16 * challenge.n + REVEAL_ROWS * (12 * challenge.n + 64) + challenge.products * 68 + 256
    return len(challenge.gpu_indices) * per_gpu


def reveal_request(picks: dict[int, list]) -> dict:
    return {"reveal": {str(g): [[p, r] for p, r in rows] for g, rows in picks.items()}}


def _parse(line: bytes) -> dict:
    try:
        message = untrusted_json.answer_loads(line)  # RecursionError, too deep, not Unicode: all ValueError
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc}): {line[:120]!r}") from None
    if not isinstance(message, dict):
        raise ValueError(f"not a JSON object: {line[:120]!r}")
    return message


def run(exchange: Exchange, challenge: Challenge, time_limit_s: int, rng: random.Random | None = None,
        ) -> Outcome:
    """Drive the exchange. Never raises for what the node says or fails to say: that lands in the Outcome.
    (A broken connection raises whatever the exchange raises.)"""
    rng = rng or random.SystemRandom()
    out = Outcome()
    try:
        trips = []
        for i in range(PINGS):
            sent = exchange.send({"ping": i})
            line, at = exchange.receive(PING_TIMEOUT_S)
            if line is None:
                out.problem = f"did not answer a ping within {PING_TIMEOUT_S:.0f} s"
                return out
            message = _parse(line)
            if message.get("pong") != i:
                return _ended(out, message, "answered a ping with something else")
            trips.append(at - sent)
        out.round_trip_s, out.round_trips, _ = round_trip.credit(trips, exchange)
        out.sent_at = exchange.send({"challenge": challenge.request(time_limit_s)})
        deadline = out.sent_at + challenge.wait_s
        waiting = set(challenge.gpu_indices)
        while waiting:
            line, at = exchange.receive(max(0.0, deadline - time.monotonic()))
            if line is None:
                out.problem = (f"sent no commitment within {challenge.wait_s:.0f} s, the time a card at the lowest "
                               "accepted share of the declared card's datasheet takes, plus "
                               f"{GRACE_S:.0f} s: the GPU is far too slow for the card declared, or hung")
                return out
            message = _parse(line)
            gpu = message.get("gpu")
            if type(gpu) is not int or gpu not in waiting or not isinstance(message.get("commitment"), str):
                return _ended(out, message, "sent something other than a commitment of a challenged GPU")
            waiting.discard(gpu)
            out.arrivals[gpu], out.commitments[gpu] = at, message["commitment"]
            out.output_dtypes[gpu] = message.get("output_dtype")  # said before the pick: how its rows round
            elapsed = message.get("node_elapsed_s")
            out.node_elapsed_s[gpu] = elapsed if isinstance(elapsed, (int, float)) else None
        out.picks = pick_rows(challenge, rng)  # only now, after every commitment
        exchange.send(reveal_request(out.picks))
        # a line per GPU: 8 GPUs' rows and row digests at real sizes are 10-12 MB, past the SSH exchange's
        # 8 MiB a line (provisioning/ssh.py MAX_ANSWER_BYTES); one GPU's are ~1.4 MB
        wait = answer_wait_s(reveal_bytes(challenge))
        deadline, waiting = time.monotonic() + wait, set(out.picks)
        while waiting:
            line, _ = exchange.receive(max(0.0, deadline - time.monotonic()))
            if line is None:
                out.problem = f"sent no revealed rows within {wait:.0f} s"
                return out
            message = _parse(line)
            gpu = message.get("gpu")
            if type(gpu) is not int or gpu not in waiting or not isinstance(message.get("revealed"), dict):
                return _ended(out, message, "sent something other than the revealed rows of a challenged GPU")
            waiting.discard(gpu)
            out.revealed[str(gpu)] = message["revealed"]
    except ValueError as exc:
        out.problem = f"answered with garbage ({exc})"
    except EOFError:
        out.problem = "closed the exchange before it was over"
    return out


def node_error_text(error: dict) -> str:
    """What the problem says of the node's own error message: at most NODE_TEXT_MAX characters, the rest counted.
    An answer line may hold megabytes, and the problem is kept once per GPU (findings, last_error, node events)."""
    said = str(error.get("message"))
    if len(said) <= NODE_TEXT_MAX:
        return said
    return f"{said[:NODE_TEXT_MAX]}… ({len(said) - NODE_TEXT_MAX} more characters)"


def _ended(out: Outcome, message: dict, what: str) -> Outcome:
    if message.get("ok") is False and isinstance(message.get("error"), dict):
        out.node_error = message["error"]
        out.problem = f"stopped with an error: {node_error_text(message['error'])}"
    else:
        out.problem = f"{what}: {json.dumps(message)[:120]}"
    return out
