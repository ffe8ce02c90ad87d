"""The challenge's real path: the products computed with PyTorch (challenge.py has the exchange and the numbers).

On a real node (runtime docker/libvirt or none; `"device": "cpu"` in the request for tests and
`scripts/gpu-selfcheck --device cpu`) the products are computed with PyTorch (torch_work), one thread per GPU,
every GPU at once: the code and B generated on the device with the same hashes in integer arithmetic (int64 and
int32 multiplications wrap like unsigned ones; logical shifts are arithmetic shifts masked), each A_p mixed from
the code in int32, multiplied in BF16 with FP32 accumulation, and each output row reduced to its digest on the
device, so only the n x 8 bytes of row digests per product reach the host (one SHA-256 each): the platform's
clock times the GPU, not the node's CPU. The output is FP32 straight from the GEMM where the device's PyTorch has
`torch.mm(..., out_dtype=torch.float32)` (exact integers), otherwise the BF16 output of torch.matmul upcast (the
exact FP32 accumulator rounded once to nearest even, which the platform recomputes exactly: reduced-precision
split-K reductions are turned off); the commitment says which (`output_dtype`), before the platform picks rows.
The rows the platform picks are recomputed on the device at the reveal (a row costs k x n; its
digest, committed before the pick, needed the whole product). A real node answers only real-work challenges
(`flop_per_gpu` = products x 2 n^2 k, the platform's `draw(real_work=True)`): the nominal work of a sim challenge
cannot be done for real and is refused as `challenge_unsupported`.
"""
import ctypes
import sys
import threading
import time

from .challenge import GEN_CHUNK, M32, Work, b_key, column_salts, matrix_key, product_salt
from .core import AgentError, at_once
from .mig import MIG_LABEL_BASE


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


def _signed32(x):
    return x - (1 << 32) if x >= 1 << 31 else x


F1, F2 = _signed32(0x85EBCA6B), _signed32(0xC2B2AE35)


def torch_fmix32(z):
    """fmix32 on an int32 tensor (its bits as the uint32 word): * wraps mod 2^32; >> masked to be logical."""
    z = z ^ ((z >> 16) & 0xFFFF)
    z = z * F1
    z = z ^ ((z >> 13) & 0x7FFFF)
    z = z * F2
    return z ^ ((z >> 16) & 0xFFFF)


def generate(torch, dev, key, n_rows, n_cols, code=False):
    """The matrix of `key` on the device, GEN_CHUNK entries at a time: entries in BF16 (exact), or with `code`
    the 32-bit code words as int32."""
    out = torch.empty(n_rows, n_cols, dtype=torch.int32 if code else torch.bfloat16, device=dev)
    cols = torch.arange(n_cols, dtype=torch.int64, device=dev).unsqueeze(0)
    step = max(1, GEN_CHUNK // n_cols)
    for r0 in range(0, n_rows, step):
        rows = torch.arange(r0, min(n_rows, r0 + step), dtype=torch.int64, device=dev).unsqueeze(1)
        if code:
            z = torch_mix64(((rows << 32) | cols) ^ _signed(key)) & M32
            out[r0:r0 + rows.shape[0]] = (z - ((z >> 31) << 32)).to(torch.int32)  # the low word, signed
        else:
            out[r0:r0 + rows.shape[0]] = torch_entries(torch, key, rows, cols).to(torch.bfloat16)
    return out


def a_matrix(torch, code, salt, out=None):
    """A_p from the code words (int32, any rows) under the product's salt: (fmix32(word ^ salt) >> 29) - 3, in
    BF16, GEN_CHUNK entries at a time."""
    n_rows, n_cols = code.shape
    out = torch.empty(n_rows, n_cols, dtype=torch.bfloat16, device=code.device) if out is None else out
    step = max(1, GEN_CHUNK // n_cols)
    for r0 in range(0, n_rows, step):
        z = torch_fmix32(code[r0:r0 + step] ^ _signed32(salt))
        out[r0:r0 + step] = (((z >> 29) & 7) - 3).to(torch.bfloat16)
    return out


def reduce_rows(torch, c, salts, out):
    """Each row of the product (FP32, integer values) to its 64-bit digest in `out` (int64), on the device."""
    n_rows, n_cols = c.shape
    step = max(1, GEN_CHUNK // n_cols)
    for r0 in range(0, n_rows, step):
        h = torch_fmix32(c[r0:r0 + step].to(torch.int32) ^ salts)
        out[r0:r0 + step] = (h.to(torch.int64) & M32).sum(dim=1)  # < n x 2^32: no wrap
    return out


def multiply(torch, a, b):
    """BF16 x BF16 with FP32 accumulation: FP32 out of the GEMM where PyTorch has out_dtype, else BF16 upcast."""
    try:
        return torch.mm(a, b, out_dtype=torch.float32), "fp32"
    except (TypeError, RuntimeError):  # no out_dtype on this PyTorch or device (NotImplementedError included)
        return torch.matmul(a, b).float(), "bf16"


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
    if req.get("mig_uuids"):  # the child of mig.relay_to_slice: its one MIG device is device 0
        return {MIG_LABEL_BASE: torch.device("cuda", 0)}
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
    {gpu: Work} for reveal_rows()."""
    from .measurements import import_torch
    if sys.byteorder != "little":
        raise AgentError("challenge_unsupported", "the challenge's digests are of little-endian uint64s")
    torch = import_torch()
    devs = challenge_devices(torch, req)
    cuda = torch.backends.cuda.matmul
    reduced = cuda.allow_bf16_reduced_precision_reduction
    cuda.allow_bf16_reduced_precision_reduction = False  # FP32 accumulation throughout, split-K included
    n, k, seed = req["n"], req["k"], req["seed"]
    lock = threading.Lock()
    started = clock()

    def work(i, dev):
        code = generate(torch, dev, matrix_key(seed, i, 0, "A"), n, k, code=True)
        b = generate(torch, dev, b_key(seed), k, n)  # the challenge's one B, on each device
        salts = torch.tensor([_signed32(s) for s in column_salts(seed, i, n)], dtype=torch.int32, device=dev)
        digests = torch.empty(req["products"], n, dtype=torch.int64, device=dev)
        a = torch.empty(n, k, dtype=torch.bfloat16, device=dev)
        out_dtype = None
        for p in range(req["products"]):
            a_matrix(torch, code, product_salt(seed, i, p), out=a)
            c, out_dtype = multiply(torch, a, b)
            reduce_rows(torch, c, salts, digests[p])
            del c
        host = digests.to("cpu")  # waits for the device
        computed = clock() - started
        raw = tensor_bytes(host)
        size = n * 8
        packed = [raw[p * size:(p + 1) * size] for p in range(req["products"])]

        def rows(p, picked, code=code, b=b):
            a_rows = a_matrix(torch, code[torch.tensor(picked, dtype=torch.int64, device=dev)],
                              product_salt(seed, i, p))
            return multiply(torch, a_rows, b)[0].to("cpu").tolist()
        done = Work(packed, rows, out_dtype)
        with lock:
            lines.write({"gpu": i, "commitment": done.commitment(), "output_dtype": out_dtype,
                         "node_compute_s": round(computed, 4), "node_elapsed_s": round(clock() - started, 4)})
        return done
    try:
        return at_once(devs.items(), work, "challenge_failed")
    finally:
        cuda.allow_bf16_reduced_precision_reduction = reduced


def tensor_bytes(tensor):
    """A contiguous host tensor's bytes without numpy (a node's PyTorch may come without it)."""
    tensor = tensor.contiguous()
    size = tensor.numel() * tensor.element_size()
    return bytes((ctypes.c_char * size).from_address(tensor.data_ptr()))
