"""The challenge, on the platform's side: a check of the GPUs' work that the node's own reports cannot fake.

1. draw(): a secret 64-bit seed and sizes from the claimed card's datasheet, so that the nominal work per GPU
   (`flop_per_gpu`) takes `target_s` on the claimed card at its datasheet BF16 rate.
2. run(): over one interactive exchange with the agent (`agent challenge`, agent/gpumarket_agent/challenge.py):
   the SSH round trip timed with pings; the challenge sent; each GPU's commitment timed on the platform's clock as
   it arrives; only then the rows to reveal drawn with a secret RNG; the revealed rows read.
3. judge(): the revealed rows must hash to the committed digests (row -> product -> commitment), and entries the
   platform picks (never told to the node) must equal what the platform computes itself from the seed, exactly in
   integers (entries are in [-2, 2], so FP32 accumulation is exact; a BF16-rounded output is allowed its rounding).
   Throughput = flop_per_gpu / (arrival - sent - round trip) against the claimed card's datasheet, in the BF16
   band of TOLERANCES; every GPU within `node_median_max_deviation` of the node's median. The node's own timings
   are kept as detail only.

Sizes: for a simulated node the matrices are small (`n` x `k`) and stand for the nominal work; it computes them
for real and answers each GPU no sooner than its real card would finish the nominal work. For a real node
(`draw(real_work=True)`, the agent's PyTorch path) the work is real: `flop_per_gpu` = products x 2 n^2 k, with n
a multiple of 256 sized so that the work takes `target_s` at the claimed card's datasheet BF16, capped by a
quarter of the card's memory and by the bytes the node must hash (REAL_SIZES, real_sizes()). On every card in
the catalogue the digest cap binds (n = 8192, 8.8 TFLOP per GPU, 9-124 ms at datasheet): the node's SHA-256 of
1 GiB of rows, not the GPU, then sets the time to commit, so the real-work mode proves each GPU's results but its
platform-timed rate is far below the card's (docs/BENCHMARKS.md); node verification still draws nominal work.

Pure: no Django, no SSH; the exchange is anything with send(dict) -> float and receive(timeout) ->
(bytes | None, float) on the time.monotonic() clock, raising EOFError once the node closed it.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import secrets
import statistics
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from provisioning.verification.policy import DEGRADE, REJECT, TOLERANCES, DeclaredModel, Finding

M64 = (1 << 64) - 1
MATRICES = {"A": 1, "B": 2}
# The matrices' sizes and the time the nominal work takes on the claimed card at its datasheet BF16 rate: quick
# (tests, sim nodes on the CI box) and full. Also: rows revealed per GPU, entries of each recomputed here.
SIZES = {
    True: {"n": 16, "k": 16, "products": 2, "target_s": 1.5},
    False: {"n": 48, "k": 48, "products": 4, "target_s": 8.0},
}
# The real-work mode: k fixed (the platform recomputes each checked entry in 2k hashes: ~15 ms at 16384 in
# CPython), n from the target, capped so that A, B and C take at most REAL_MEMORY_SHARE of the card and the
# products' float32 rows the node must SHA-256 before committing stay under max_output_bytes per GPU.
REAL_SIZES = {
    True: {"k": 1024, "products": 2, "target_s": 1.0, "max_output_bytes": 1 << 22},
    False: {"k": 16384, "products": 4, "target_s": 8.0, "max_output_bytes": 1 << 30},
}
REAL_N_STEP = 256
REAL_MEMORY_SHARE = 0.25
REAL_GENERATION_BYTES = 512 << 20  # the agent's int64 temporaries while it generates a matrix
DIGEST_FLOOR_BPS = 2.5e8  # SHA-256 of the outputs at no less than this per GPU: added to the wait for a real node
REVEAL_ROWS = 4
CHECKED_ENTRIES = 4
PINGS = 3
PING_TIMEOUT_S = 10.0
GRACE_S = 5.0  # beyond the time the slowest acceptable card would take, before a GPU counts as not answering


# ------------------------------------------------------------------------- the numbers, as the agent has them

def mix64(z: int) -> int:
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & M64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & M64
    return z ^ (z >> 31)


def matrix_key(seed: int, gpu: int, product: int, matrix: str) -> int:
    z = mix64((seed & M64) ^ 0x9E3779B97F4A7C15)
    for part in (gpu, product, MATRICES[matrix]):
        z = mix64((z + part + 1) & M64)
    return z


def entry(key: int, row: int, col: int) -> int:
    return mix64(key ^ ((row << 32) | col)) % 5 - 2


def expected_entry(seed: int, gpu: int, product: int, k: int, row: int, col: int) -> int:
    """C[row][col] of the product, from the seed alone: k multiply-adds."""
    a, b = matrix_key(seed, gpu, product, "A"), matrix_key(seed, gpu, product, "B")
    return sum(entry(a, row, j) * entry(b, j, col) for j in range(k))


def row_digest(values: list) -> str:
    return hashlib.sha256(struct.pack(f"<{len(values)}f", *values)).hexdigest()


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

    def request(self, time_limit_s: int) -> dict:
        req = {"seed": self.seed, "n": self.n, "k": self.k, "products": self.products, "dtype": "bf16",
               "gpu_indices": list(self.gpu_indices), "flop_per_gpu": self.flop_per_gpu,
               "time_limit_s": time_limit_s}
        if self.device:
            req["device"] = self.device
        return req


def _band(declared: DeclaredModel) -> dict:
    band = dict(TOLERANCES["figure_bands"]["bf16_tflops"])
    if "bf16_tflops" in declared.derived:
        band["reject"] *= TOLERANCES["derived_floor_factor"]
        band["degrade"] *= TOLERANCES["derived_floor_factor"]
    return band


def real_sizes(sheet_tflops: float, memory_mib: int, quick: bool) -> tuple[int, int, int, str]:
    """(n, k, products, what bounds n) of a real-work challenge on a card of this BF16 rate and memory."""
    size = REAL_SIZES[bool(quick)]
    k, products = int(size["k"]), int(size["products"])
    step = REAL_N_STEP
    by_target = math.sqrt(size["target_s"] * sheet_tflops * 1e12 / (products * 2 * k))
    by_output = math.sqrt(size["max_output_bytes"] / (4 * products))
    budget = REAL_MEMORY_SHARE * memory_mib * 2 ** 20 - REAL_GENERATION_BYTES
    # A and B in BF16 (4nk bytes), C in FP32 plus its BF16 or FP32 GEMM output (8 n^2): 8n^2 + 4kn <= budget
    by_memory = (-4 * k + math.sqrt(16 * k * k + 32 * max(budget, 0.0))) / 16
    bound, limit = min(("target", by_target), ("output", by_output), ("memory", by_memory), key=lambda b: b[1])
    return max(step, int(limit // step) * step), k, products, bound


def draw(declared: DeclaredModel, gpu_indices: list[int], quick: bool,
         rng: random.Random | None = None, real_work: bool = False) -> Challenge:
    """The challenge for a node of the declared model: nominal work (a sim node) or, with `real_work`, the
    work a real node's GPUs really do (real_sizes())."""
    sheet = float(declared.datasheet["bf16_tflops"])
    if real_work:
        return draw_real(sheet, declared.memory_mib, gpu_indices, quick, rng, reject=_band(declared)["reject"])
    size = SIZES[bool(quick)]
    seed = rng.getrandbits(64) if rng is not None else secrets.randbits(64)
    wait = size["target_s"] / _band(declared)["reject"] + GRACE_S
    return Challenge(seed=seed, n=int(size["n"]), k=int(size["k"]), products=int(size["products"]),
                     gpu_indices=tuple(gpu_indices), flop_per_gpu=size["target_s"] * sheet * 1e12,
                     target_s=size["target_s"], datasheet_tflops=sheet, wait_s=wait)


def draw_real(sheet_tflops: float, memory_mib: int, gpu_indices: list[int], quick: bool,
              rng: random.Random | None = None, reject: float | None = None, device: str = "") -> Challenge:
    """A real-work challenge: the platform waits for the work at the lowest accepted share of the datasheet,
    plus the digest of every output at DIGEST_FLOOR_BPS, plus GRACE_S."""
    n, k, products, _ = real_sizes(sheet_tflops, memory_mib, quick)
    seed = rng.getrandbits(64) if rng is not None else secrets.randbits(64)
    work = products * 2.0 * n * n * k
    target = work / (sheet_tflops * 1e12)
    floor = reject if reject is not None else TOLERANCES["figure_bands"]["bf16_tflops"]["reject"]
    wait = target / floor + products * n * n * 4 / DIGEST_FLOOR_BPS + GRACE_S
    return Challenge(seed=seed, n=n, k=k, products=products, gpu_indices=tuple(gpu_indices), flop_per_gpu=work,
                     target_s=target, datasheet_tflops=sheet_tflops, wait_s=wait, device=device)


# ------------------------------------------------------------------------------------------ the exchange

class Exchange(Protocol):
    def send(self, message: dict) -> float: ...

    def receive(self, timeout: float) -> tuple[bytes | None, float]: ...


@dataclass
class Outcome:
    """What happened in the exchange, as the platform saw it; judge() turns it into findings."""

    round_trip_s: float | None = None
    sent_at: float | None = None
    arrivals: dict = field(default_factory=dict)  # gpu -> platform clock at its commitment
    commitments: dict = field(default_factory=dict)  # gpu -> hex
    node_elapsed_s: dict = field(default_factory=dict)  # gpu -> what the node says (detail only)
    picks: dict = field(default_factory=dict)  # gpu -> [(product, row, [cols])]
    revealed: dict = field(default_factory=dict)  # gpu -> {"product_digests", "rows"}
    problem: str = ""  # why the exchange ended early: garbage, closed, an error from the node
    node_error: dict | None = None


def pick_rows(challenge: Challenge, rng: random.Random) -> dict[int, list]:
    """Per GPU: the (product, row) pairs to reveal, each with the columns the platform recomputes (kept secret)."""
    picks = {}
    every = challenge.products * challenge.n
    for gpu in challenge.gpu_indices:
        rows = rng.sample(range(every), min(REVEAL_ROWS, every))
        picks[gpu] = [(r // challenge.n, r % challenge.n,
                       rng.sample(range(challenge.n), min(CHECKED_ENTRIES, challenge.n))) for r in rows]
    return picks


def reveal_request(picks: dict[int, list]) -> dict:
    return {"reveal": {str(g): [[p, r] for p, r, _ in rows] for g, rows in picks.items()}}


def _parse(line: bytes) -> dict:
    try:
        message = json.loads(line)
    except ValueError:
        raise ValueError(f"not JSON: {line[:120]!r}") from None
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
        out.round_trip_s = min(trips)
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
            elapsed = message.get("node_elapsed_s")
            out.node_elapsed_s[gpu] = elapsed if isinstance(elapsed, (int, float)) else None
        out.picks = pick_rows(challenge, rng)  # only now, after every commitment
        exchange.send(reveal_request(out.picks))
        line, _ = exchange.receive(PING_TIMEOUT_S)
        if line is None:
            out.problem = f"sent no revealed rows within {PING_TIMEOUT_S:.0f} s"
            return out
        message = _parse(line)
        if not isinstance(message.get("revealed"), dict):
            return _ended(out, message, "sent something other than the revealed rows")
        out.revealed = message["revealed"]
    except ValueError as exc:
        out.problem = f"answered with garbage ({exc})"
    except EOFError:
        out.problem = "closed the exchange before it was over"
    return out


def _ended(out: Outcome, message: dict, what: str) -> Outcome:
    if message.get("ok") is False and isinstance(message.get("error"), dict):
        out.node_error = message["error"]
        out.problem = f"stopped with an error: {message['error'].get('message')}"
    else:
        out.problem = f"{what}: {json.dumps(message)[:120]}"
    return out


# --------------------------------------------------------------------------------------------- the verdict

def check_gpu(challenge: Challenge, gpu: int, commitment: str, picks: list, revealed: Any) -> str:
    """'' if the GPU's revealed rows prove its commitment and every checked entry is right; else why not."""
    if not isinstance(revealed, dict) or not isinstance(revealed.get("rows"), list):
        return "no revealed rows"
    products = revealed.get("product_digests")
    if (not isinstance(products, list) or len(products) != challenge.products
            or not all(isinstance(d, str) for d in products) or joined_digest(products) != commitment):
        return "its product digests do not match its commitment"
    rows = {(r.get("product"), r.get("row")): r for r in revealed["rows"]
            if isinstance(r, dict) and type(r.get("product")) is int and type(r.get("row")) is int}
    tolerance = TOLERANCES["challenge_entry_rel_tolerance"]
    for product, row, cols in picks:
        got = rows.get((product, row))
        if got is None:
            return f"row {row} of product {product} was not revealed"
        values, digests = got.get("values"), got.get("row_digests")
        if (not isinstance(values, list) or len(values) != challenge.n
                or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)):
            return f"row {row} of product {product} is not {challenge.n} numbers"
        if (not isinstance(digests, list) or len(digests) != challenge.n or not all(isinstance(d, str) for d in digests)
                or joined_digest(digests) != products[product] or row_digest(values) != digests[row]):
            return f"row {row} of product {product} does not match what the GPU committed to"
        for col in cols:
            want = expected_entry(challenge.seed, gpu, product, challenge.k, row, col)
            if abs(values[col] - want) > tolerance * abs(want):
                return (f"entry ({row}, {col}) of product {product} is {values[col]:g}; the right value is "
                        f"{want}")
    return ""


def judge(declared: DeclaredModel, challenge: Challenge, out: Outcome) -> tuple[list[Finding], dict]:
    """Findings (codes challenge_*) and the figures the platform measured, per GPU."""
    findings: list[Finding] = []
    band = _band(declared)
    trip = out.round_trip_s or 0.0
    figures: dict[str, Any] = {"seed_bits": 64, "n": challenge.n, "k": challenge.k, "products": challenge.products,
                               "flop_per_gpu": challenge.flop_per_gpu, "target_s": challenge.target_s,
                               "round_trip_s": round(trip, 6) if out.round_trip_s is not None else None, "gpus": {}}
    rates: dict[int, float] = {}
    if out.node_error and out.node_error.get("code") == "challenge_unsupported":
        # A real node answers only real-work challenges (draw(real_work=True)), which node verification does not
        # draw yet (see the module's doc): recorded, no verdict either way; the node is judged on its reported
        # figures as before, and its run says the challenge was not run.
        figures["not_run"] = str(out.node_error.get("message") or "the agent cannot run the challenge")
        return [], figures
    for gpu in challenge.gpu_indices:
        row: dict[str, Any] = {"node_elapsed_s": out.node_elapsed_s.get(gpu)}
        figures["gpus"][str(gpu)] = row
        if gpu not in out.arrivals or out.sent_at is None:
            why = out.problem or "it did not answer"
            findings.append(Finding(REJECT, "challenge_no_answer",
                                    f"GPU {gpu} did not answer the platform's challenge: the node {why}. Check that "
                                    "the agent runs and the GPU responds (`nvidia-smi`), then verify again.", gpu))
            continue
        seconds = max(out.arrivals[gpu] - out.sent_at - trip, 1e-6)
        tflops = challenge.flop_per_gpu / seconds / 1e12
        ratio = tflops / challenge.datasheet_tflops
        # Slow-side judgements allow for the platform's own jitter (TOLERANCES); "too fast" uses the raw time.
        lenient = challenge.flop_per_gpu / max(seconds - TOLERANCES["challenge_latency_allowance_s"], 1e-6) / 1e12
        lenient_ratio = lenient / challenge.datasheet_tflops
        rates[gpu] = lenient
        row.update(platform_elapsed_s=round(seconds, 4), bf16_tflops=round(tflops, 3), of_datasheet=round(ratio, 3))
        wrong = check_gpu(challenge, gpu, out.commitments[gpu], out.picks.get(gpu, []),
                          out.revealed.get(str(gpu)) if isinstance(out.revealed, dict) else None)
        row["correct"] = not wrong
        if wrong:
            why = wrong if out.revealed else (out.problem or wrong)
            findings.append(Finding(REJECT, "challenge_wrong_result",
                                    f"GPU {gpu} failed the platform's matrix challenge: {why}. A GPU that computes "
                                    "wrong results must be repaired or replaced before it is listed.", gpu))
        label = (f"GPU {gpu} did the platform's challenge at {tflops:.1f} TFLOP/s BF16 measured by the platform, "
                 f"{ratio:.0%} of {declared.a_label}'s datasheet {challenge.datasheet_tflops:g}")
        if band["max"] and ratio > band["max"]:
            findings.append(Finding(REJECT, "challenge_too_fast",
                                    f"{label}: faster than the card can compute. The answer was not computed on "
                                    "this card.", gpu))
        elif lenient_ratio < band["reject"]:
            findings.append(Finding(REJECT, "challenge_too_slow",
                                    f"{label}: far too slow for the card declared. Declare the model really "
                                    "installed.", gpu))
        elif lenient_ratio < band["degrade"]:
            findings.append(Finding(DEGRADE, "challenge_too_slow",
                                    f"{label} (healthy: at least {band['degrade']:.0%}). Check its power limit, "
                                    "cooling and clocks.", gpu))
    if len(rates) >= 2:
        median = statistics.median(rates.values())
        for gpu, tflops in rates.items():
            off = abs(tflops - median) / median
            if off > TOLERANCES["node_median_max_deviation"]:
                findings.append(Finding(DEGRADE, "challenge_outlier",
                                        f"GPU {gpu} did the platform's challenge at {tflops:.1f} TFLOP/s, {off:.0%} "
                                        f"off the node's median {median:.1f}: check its cooling, power and slot.", gpu))
    if out.node_error and not findings:
        findings.append(Finding(REJECT, "challenge_no_answer", f"The node {out.problem}."))
    return findings, figures
