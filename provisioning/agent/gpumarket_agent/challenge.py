"""The challenge command: matrices the platform generates from a secret seed, multiplied on every GPU, committed,
then revealed row by row where the platform asks. Interactive, one JSON object a line both ways (one SSH exec):

    platform -> {"ping": i}                      node -> {"pong": i}              (the platform times the round trip)
    platform -> {"challenge": {...}}             node -> {"gpu": i, "commitment": hex, "node_elapsed_s": s}
                                                          one line per GPU, as each finishes (the platform's clock)
    platform -> {"reveal": {"<gpu>": [[product, row], ...]}}
                                                 node -> {"revealed": {"<gpu>": {"product_digests": [...],
                                                          "rows": [{"product", "row", "values", "row_digests"}]}}}
    node -> {"ok": true, "agent_version": ...}   (or {"ok": false, "error": {...}} at any point, then the end)

Entry (seed, gpu, product, matrix, row, col) is an integer in [-2, 2] from a counter-based 64-bit hash, so every
product is exact in FP32 accumulation from BF16 inputs, and the platform recomputes any entry on its own.
Digests: row = SHA-256 of the row as little-endian float32; product = SHA-256 of its row digests (hex, joined);
commitment = SHA-256 of the product digests. provisioning/verification/challenge.py implements the same on the
platform, independently (a test holds them equal).

In sim mode the node really computes the products (pure Python, the small sizes the platform asks for) and then
answers each GPU no sooner than the profile's real card would finish the platform's nominal work
(`flop_per_gpu` / (real datasheet BF16 x its fraction)): a sim can lie in what it reports, not in how fast it
works. A GPU whose profile says `matmul_correct: false` returns every entry off by one.

On a real node (runtime docker/libvirt or none; `"device": "cpu"` in the request for tests and
`scripts/gpu-selfcheck --device cpu`) the products are computed with PyTorch (torch_work): A and B generated on
the device with the same hash in int64 arithmetic (multiplication wraps like uint64; the logical shifts are
arithmetic shifts masked), multiplied in BF16 with FP32 accumulation, one thread per GPU, every GPU at once. The
output is FP32 straight from the GEMM where the device's PyTorch has `torch.mm(..., out_dtype=torch.float32)`
(exact integers), otherwise the BF16 output of torch.matmul upcast (the FP32 accumulator rounded once, within the
platform's `challenge_entry_rel_tolerance`); the commitment says which (`output_dtype`). Rows are copied to the
host and hashed with hashlib (which releases the GIL) in a pool of threads; each GPU commits as it finishes. A
real node answers only real-work challenges (`flop_per_gpu` = products x 2 n^2 k, the platform's
`draw(real_work=True)`): the nominal work of a sim challenge cannot be done for real and is refused as
`challenge_unsupported`.
"""
import ctypes
import hashlib
import json
import os
import random
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .core import AGENT_VERSION, AgentError, invalid
from .smi import load_profile

M64 = (1 << 64) - 1
MATRICES = {"A": 1, "B": 2}
LIMITS = {"n": (1, 256), "k": (1, 256), "products": (1, 16), "flop_per_gpu": (1.0, 1e18), "time_limit_s": (1, 900)}
# A real node's real-work challenge: k <= 2^20 keeps every product an exact integer in FP32 (|C| <= 4k <= 2^22).
REAL_LIMITS = dict(LIMITS, n=(1, 16384), k=(1, 1 << 20), products=(1, 64))
DEVICES = ("cuda", "cpu")
GEN_CHUNK = 1 << 23  # elements of a matrix generated at once (int64 temporaries: a few x 64 MiB)
MAX_REVEAL_ROWS = 64


def mix64(z):
    """splitmix64's finaliser: a bijection of 64-bit integers that scatters every input bit."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & M64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & M64
    return z ^ (z >> 31)


def matrix_key(seed, gpu, product, matrix):
    z = mix64((seed & M64) ^ 0x9E3779B97F4A7C15)
    for part in (gpu, product, MATRICES[matrix]):
        z = mix64((z + part + 1) & M64)
    return z


def entry(key, row, col):
    return mix64(key ^ ((row << 32) | col)) % 5 - 2


def matrix_rows(key, rows, cols):
    return [[entry(key, r, c) for c in range(cols)] for r in range(rows)]


def product_rows(seed, gpu, product, n, k):
    a = matrix_rows(matrix_key(seed, gpu, product, "A"), n, k)
    b = matrix_rows(matrix_key(seed, gpu, product, "B"), k, n)
    cols = list(zip(*b))  # noqa: B905 - python3.8 on nodes: no strict=
    return [[sum(x * y for x, y in zip(row, col)) for col in cols] for row in a]  # noqa: B905


def row_digest(values):
    return hashlib.sha256(struct.pack("<%df" % len(values), *values)).hexdigest()


def joined_digest(digests):
    return hashlib.sha256("".join(digests).encode()).hexdigest()


def real_work(req):
    """Whether the challenge's nominal work is the work its sizes really are (the platform's real-work draw)."""
    work = req["products"] * 2.0 * req["n"] * req["n"] * req["k"]
    return abs(req["flop_per_gpu"] - work) <= 1e-9 * work


def validate_challenge(req, real=False):
    """The challenge checked against the sizes a sim node (LIMITS) or a real node (REAL_LIMITS) accepts."""
    if not isinstance(req, dict):
        raise invalid("challenge", "the challenge must be a JSON object")
    unknown = sorted(set(req) - {"seed", "n", "k", "products", "dtype", "gpu_indices", "flop_per_gpu",
                                 "time_limit_s", "device"})
    if unknown:
        raise invalid(unknown[0], "unknown field %s" % unknown[0])
    if type(req.get("seed")) is not int or not 0 <= req["seed"] <= M64:
        raise invalid("seed", "seed must be a 64-bit unsigned integer")
    for name, (low, high) in (REAL_LIMITS if real else LIMITS).items():
        value = req.get(name)
        kind = (int, float) if name == "flop_per_gpu" else (int,)
        if type(value) not in kind or not low <= value <= high:
            raise invalid(name, "%s must be a number from %s to %s" % (name, low, high))
    if req.get("dtype") != "bf16":
        raise invalid("dtype", "dtype must be bf16")
    indices = req.get("gpu_indices")
    if (not isinstance(indices, list) or not indices or len(set(indices)) != len(indices)
            or not all(type(i) is int and 0 <= i < 64 for i in indices)):
        raise invalid("gpu_indices", "gpu_indices must be a non-empty list of distinct GPU indices")
    if req.get("device", "cuda") not in DEVICES:
        raise invalid("device", "device must be one of %s" % ", ".join(DEVICES))
    return req


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


def sim_cards(cfg, indices):
    """Per GPU index: (its real BF16 rate in FLOP/s, whether its products are right), from the sim profile."""
    profile, claimed = load_profile(cfg.sim_profile)
    perf = profile.get("performance") or {}
    specs = {g["index"]: g for g in perf.get("gpus", [])}
    known = {card["index"] for card in claimed}
    rng = random.Random(os.urandom(16))  # noqa: S311 - run-to-run noise, as the sim benchmark's
    cards = {}
    for i in indices:
        spec = specs.get(i)
        if i not in known or spec is None:
            raise invalid("gpu_indices", "this node has no GPU %d" % i)
        sheet = dict(perf.get("datasheet", {}), **spec.get("datasheet", {}))
        noise = 1 + max(-0.03, min(0.03, rng.gauss(0, 0.012)))
        cards[i] = (sheet["bf16_tflops"] * 1e12 * spec["fraction"]["bf16"] * noise, spec.get("matmul_correct", True))
    return cards, perf.get("challenge_hang_s")


def sim_work(cfg, req):
    """The sim node's work on a validated challenge: per GPU (rows of each product, their row digests, the product
    digests) and the seconds its real card takes for the nominal work; and the profile's `challenge_hang_s`."""
    cards, hang_s = sim_cards(cfg, req["gpu_indices"])
    results, seconds = {}, {}
    for i in req["gpu_indices"]:
        rows_of = []
        for p in range(req["products"]):
            rows = product_rows(req["seed"], i, p, req["n"], req["k"])
            if not cards[i][1]:
                rows = [[v + 1 for v in row] for row in rows]  # silent data corruption
            rows_of.append(rows)
        digests = [[row_digest(r) for r in rows] for rows in rows_of]
        results[i] = (rows_of, digests, [joined_digest(d) for d in digests])
        seconds[i] = req["flop_per_gpu"] / cards[i][0]
    return results, seconds, hang_s


def run_exchange(cfg, infile, outfile, clock=time.monotonic, sleep=time.sleep, watchdog=False):
    """The whole exchange (see the module's doc). Returns the exit status; every answer goes to `outfile`.
    With `watchdog`, the process ends at the challenge's time_limit_s whatever it is doing."""
    lines = Lines(infile, outfile)
    if cfg.runtime != "sim":
        preload()
    try:
        message = lines.read("first")
        while "ping" in message:
            lines.write({"pong": message["ping"]})
            message = lines.read("challenge")
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
            results = torch_work(req, lines, clock)
        else:
            results = sim_exchange(cfg, req, lines, clock, sleep)
        reveal = lines.read("reveal").get("reveal")
        lines.write({"revealed": reveal_rows(reveal, results)})
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
        lines.write({"gpu": i, "commitment": joined_digest(results[i][2]),
                     "node_elapsed_s": round(clock() - started, 4)})
    return results


# ------------------------------------------------------------------------------------ the real (PyTorch) path

def _signed(x):
    return x - (1 << 64) if x >= 1 << 63 else x


MUL1, MUL2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def torch_mix64(z):
    """mix64 on an int64 tensor: * wraps mod 2^64 as on uint64; >> is arithmetic on int64, so masked to be logical."""
    z = z ^ ((z >> 30) & ((1 << 34) - 1))
    z = z * MUL1
    z = z ^ ((z >> 27) & ((1 << 37) - 1))
    z = z * MUL2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def torch_entries(torch, key, rows, cols):
    """entry(key, row, col) for int64 tensors of rows (a column) and cols (a row): (uint64 hash) % 5 - 2."""
    z = torch_mix64(((rows << 32) | cols) ^ _signed(key))
    # as uint64 a negative z is z + 2^64, and 2^64 = 1 (mod 5)
    return (torch.remainder(z, 5) + (z < 0).to(torch.int64)) % 5 - 2


def generate(torch, dev, key, n_rows, n_cols):
    """The matrix of `key` on the device, in BF16 (its entries are exact), GEN_CHUNK entries at a time."""
    out = torch.empty(n_rows, n_cols, dtype=torch.bfloat16, device=dev)
    cols = torch.arange(n_cols, dtype=torch.int64, device=dev).unsqueeze(0)
    step = max(1, GEN_CHUNK // n_cols)
    for r0 in range(0, n_rows, step):
        rows = torch.arange(r0, min(n_rows, r0 + step), dtype=torch.int64, device=dev).unsqueeze(1)
        out[r0:r0 + rows.shape[0]] = torch_entries(torch, key, rows, cols).to(torch.bfloat16)
    return out


def multiply(torch, a, b):
    """BF16 x BF16 with FP32 accumulation: FP32 out of the GEMM where PyTorch has out_dtype, else BF16 upcast."""
    try:
        return torch.mm(a, b, out_dtype=torch.float32), "fp32"
    except (TypeError, RuntimeError):  # no out_dtype on this PyTorch or device (NotImplementedError included)
        return torch.matmul(a, b).float(), "bf16"


class HostRows:
    """A product on the host (float32, C order): its rows as lists, and their bytes for hashing."""

    def __init__(self, tensor):
        self.tensor = tensor.contiguous()
        self.n_rows, self.n_cols = self.tensor.shape
        size = self.n_rows * self.n_cols * 4
        self.bytes = memoryview((ctypes.c_char * size).from_address(self.tensor.data_ptr())).cast("B")

    def __len__(self):
        return self.n_rows

    def __getitem__(self, row):
        return self.tensor[row].tolist()

    def digests(self, start, stop):
        width = self.n_cols * 4
        return [hashlib.sha256(self.bytes[r * width:(r + 1) * width]).hexdigest() for r in range(start, stop)]


def preload():
    """PyTorch imported and CUDA initialised before the first ping is answered, so that neither counts in the
    platform's time. No context is made on any GPU here: the challenge names the free ones (a rented GPU is not
    touched). A failure here is left for torch_work() to report."""
    try:
        from .measurements import import_torch
        torch = import_torch()
        if torch.cuda.is_available():
            torch.cuda.init()
    except Exception:  # noqa: BLE001, S110 - reported by torch_work() with the challenge's error line
        pass


def challenge_devices(torch, req):
    if req.get("device", "cuda") == "cpu":
        return {i: torch.device("cpu") for i in req["gpu_indices"]}
    if not torch.cuda.is_available():
        raise AgentError("no_cuda", "PyTorch %s (built for CUDA %s) sees no GPU on this node" % (
            torch.__version__, torch.version.cuda))
    count = torch.cuda.device_count()
    hidden = [i for i in req["gpu_indices"] if i >= count]
    if hidden:
        raise AgentError("gpu_mismatch", "PyTorch sees %d GPU(s): GPU %d is hidden from CUDA (CUDA_VISIBLE_DEVICES, "
                         "MIG, a driver fault?)" % (count, hidden[0]))
    return {i: torch.device("cuda", i) for i in req["gpu_indices"]}


def torch_work(req, lines, clock=time.monotonic):
    """The products on every GPU at once, a thread each; each GPU's commitment written as it finishes. Returns
    {gpu: (rows of each product, row digests of each product, product digests)} for reveal_rows()."""
    from .measurements import import_torch
    if sys.byteorder != "little":
        raise AgentError("challenge_unsupported", "the challenge's digests are of little-endian float32 rows")
    torch = import_torch()
    devs = challenge_devices(torch, req)
    cuda = torch.backends.cuda.matmul
    reduced = cuda.allow_bf16_reduced_precision_reduction
    cuda.allow_bf16_reduced_precision_reduction = False  # FP32 accumulation throughout, split-K included
    n, k, seed = req["n"], req["k"], req["seed"]
    chunk = max(1, (1 << 20) // (4 * n))  # rows per hashing task: ~1 MiB
    pool = ThreadPoolExecutor(max_workers=max(2, min(64, os.cpu_count() or 2)))
    results, errors, lock = {}, [], threading.Lock()
    started = clock()

    def work(i, dev):
        try:
            hosts, tasks, out_dtype = [], [], None
            for p in range(req["products"]):
                a = generate(torch, dev, matrix_key(seed, i, p, "A"), n, k)
                b = generate(torch, dev, matrix_key(seed, i, p, "B"), k, n)
                c, out_dtype = multiply(torch, a, b)
                del a, b
                host = HostRows(c.to("cpu"))  # waits for the device
                del c
                hosts.append(host)
                tasks.append([pool.submit(host.digests, r, min(n, r + chunk)) for r in range(0, n, chunk)])
            computed = clock() - started
            digests = [[d for task in product for d in task.result()] for product in tasks]
            products = [joined_digest(d) for d in digests]
            results[i] = (hosts, digests, products)
            with lock:
                lines.write({"gpu": i, "commitment": joined_digest(products), "output_dtype": out_dtype,
                             "node_compute_s": round(computed, 4), "node_elapsed_s": round(clock() - started, 4)})
        except Exception as exc:  # noqa: BLE001 - the platform gets it as the challenge's error
            errors.append((i, exc))
    try:
        threads = [threading.Thread(target=work, args=item, daemon=True) for item in devs.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        pool.shutdown(wait=False)
        cuda.allow_bf16_reduced_precision_reduction = reduced
    if errors:
        i, exc = errors[0]
        raise AgentError("challenge_failed", "GPU %d: %s: %s" % (i, type(exc).__name__, str(exc)[:500]))
    return results


def reveal_rows(reveal, results):
    if not isinstance(reveal, dict):
        raise invalid("reveal", "reveal must be an object of GPU index -> [[product, row], ...]")
    answer = {}
    for key, picks in reveal.items():
        i = int(key) if str(key).isdigit() else None
        if i not in results or not isinstance(picks, list) or len(picks) > MAX_REVEAL_ROWS:
            raise invalid("reveal", "reveal names GPU %r, which was not challenged, or too many rows" % key)
        rows_of, digests, products = results[i]
        rows = []
        for pick in picks:
            if (not isinstance(pick, list) or len(pick) != 2 or not all(type(x) is int for x in pick)
                    or not 0 <= pick[0] < len(rows_of) or not 0 <= pick[1] < len(rows_of[pick[0]])):
                raise invalid("reveal", "reveal asks for a product or row that does not exist: %r" % (pick,))
            p, r = pick
            rows.append({"product": p, "row": r, "values": rows_of[p][r], "row_digests": digests[p]})
        answer[str(i)] = {"product_digests": products, "rows": rows}
    return answer


def main_challenge(cfg):
    return run_exchange(cfg, sys.stdin, sys.stdout, watchdog=True)
