"""The platform's own recomputation of the challenge's revealed rows, whole and exactly (challenge.py's docstring
argues why every entry of a revealed row is checked), on numpy.

A revealed row C[row] = A_p[row] x B needs all of B (k x n entries, one mix64 of the seed each): at the full
real-work sizes (16384 x 16384) that is 2.7 x 10^8 hashes per challenge, shared by every row of every GPU (one B
per challenge). On lanes of one Python int (lanes.py) it took ~30 s of control-plane CPU per 8-GPU node; here B is
generated in blocks of rows as uint64 arrays (mix64's shifts, XORs and multiplications wrap mod 2^64 as the
definition does), reduced mod 5, and multiplied with the wanted rows of A (m x k, in [-3, 4]) by BLAS in float32.
Exact: every partial sum is an integer of at most 8k in magnitude (|a| <= 4, |e| <= 2), below 2^24 for k <= 2^21
(the agent's own bound is 2^20), whatever order the GEMM adds in. The GEMM runs on one BLAS thread: a
(m x block) by (block x n) product is small, and OpenBLAS's other threads spin while they wait, which doubled the
CPU the check cost a worker for no gain in time. bench/challenge_verify_real.py measures it.
`challenge.expected_entry` stays the definition; tests/provisioning/test_lanes.py holds the two equal.
"""
from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import Any

import numpy as np

try:
    from threadpoolctl import ThreadpoolController
except ImportError:  # scripts/gpu-selfcheck's machine (_one_blas_thread)
    ThreadpoolController = None

from provisioning.verification.challenge import a_row, b_key

K_MAX = 1 << 21  # float32 holds every partial sum exactly below this (8k < 2^24)
BLOCK_WORDS = 1 << 21  # B's words generated at once (16 MiB of uint64, and as much again for the temporary)
_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S27, _S30, _S31, _S32 = (np.uint64(s) for s in (27, 30, 31, 32))
_FIVE = np.uint64(5)


@functools.cache
def _blas_controller() -> Any:
    """The process's BLAS libraries, found once (numpy's is loaded by the import above): threadpool_limits found
    them again on every call, reading every loaded library (~0.3 ms of CPU a check; 1,600 times in
    tests/provisioning/test_policy.py)."""
    return ThreadpoolController() if ThreadpoolController is not None else None


def _one_blas_thread() -> Any:
    """BLAS held to one thread while the rows are recomputed. threadpoolctl is the platform's (requirements.txt);
    scripts/gpu-selfcheck runs this code on a GPU machine that may have numpy beside PyTorch but not threadpoolctl,
    where the GEMM then only costs more CPU."""
    controller = _blas_controller()
    return controller.limit(limits=1, user_api="blas") if controller is not None else nullcontext()


def expected_rows(seed: int, k: int, n: int, wanted: list[tuple[int, int, int]]) -> list[list[int]]:
    """Whole rows C[row] of (gpu, product, row) each, exactly, in the order of `wanted`: B generated once for all
    of them."""
    if not wanted:
        return []
    if not 0 < k <= K_MAX or n <= 0:
        raise ValueError(f"k = {k} and n = {n}: k must be in 1..{K_MAX} and n positive")
    a = np.array([a_row(seed, gpu, product, k, row) for gpu, product, row in wanted], dtype=np.float32)
    a -= 3  # a_row gives A_p + 3
    cols = np.arange(n, dtype=np.uint64) ^ np.uint64(b_key(seed))  # key ^ col; row j's words add j << 32
    out = np.zeros((len(wanted), n), dtype=np.float32)
    block = max(1, min(k, BLOCK_WORDS // n))
    z = np.empty((block, n), dtype=np.uint64)
    t = np.empty_like(z)
    with _one_blas_thread():
        _accumulate(a, cols, k, z, t, out)
    return out.astype(np.int64).tolist()


def _accumulate(a: np.ndarray, cols: np.ndarray, k: int, z: np.ndarray, t: np.ndarray, out: np.ndarray) -> None:
    """out += a x B, B generated `len(z)` rows at a time into z (t: the same shape, a temporary)."""
    block = len(z)
    for j0 in range(0, k, block):
        j1 = min(k, j0 + block)
        zz, tt = z[: j1 - j0], t[: j1 - j0]
        np.bitwise_xor(np.arange(j0, j1, dtype=np.uint64)[:, None] << _S32, cols[None, :], out=zz)
        # mix64, in place: z = (z ^ z >> 30) * C1; z = (z ^ z >> 27) * C2; z ^= z >> 31
        np.right_shift(zz, _S30, out=tt)
        zz ^= tt
        zz *= _C1
        np.right_shift(zz, _S27, out=tt)
        zz ^= tt
        zz *= _C2
        np.right_shift(zz, _S31, out=tt)
        zz ^= tt
        np.remainder(zz, _FIVE, out=tt)
        e = tt.astype(np.float32)
        e -= 2  # entry(): mix64 % 5 - 2
        out += a[:, j0:j1] @ e
