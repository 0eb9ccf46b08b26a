"""8-bit activation quantization for the q8 kernels (precision="q8"): rows of X -> int8 blocks.

Two formats, as llama.cpp quantizes the activations of its dot products (ggml-cpu's vec_dot_type):

  Q8_0 (weights Q4_0, Q4_1, Q5_0, Q8_0): per block of 32 values, amax = max |x|,
      q = rint(x * (127 / amax)) (ties to even), d = amax / 127 rounded to float16 (the dot product
      uses the rounded scale, as block_q8_0 stores it);
  Q8_K (weights Q4_K, Q6_K): per block of 256 values, m = the value of largest magnitude (the first
      one), iscale = -127 / m, q = min(127, rint(iscale * x)), d = 1 / iscale (float32).

All products, quotients and roundings are float32 operations in this order, so the NumPy oracle
(reference_q8.py) reproduces the bytes exactly. An all-zero block gets q = 0 and d = 0.

Outputs (one row of X per row t; n = X.shape[1], a multiple of 32, or of 256 for Q8_K):
  xq  int8 (T, n): the quantized values in the kernels' column order: within every 8 columns
      8s .. 8s + 7, the even columns first, then the odd ones (8s, 8s+2, 8s+4, 8s+6, 8s+1, 8s+3,
      8s+5, 8s+7), so the 4 bytes at xq[t, 8s] pair with the low nibbles of a packed 4-bit dword and
      those at xq[t, 8s + 4] with its high nibbles (quant_tiles_q8.py);
  dx  float32 (T, n // 32): the scale of each 32 columns (a Q8_K block's d repeated 8 times);
  s16 float32 (T, n // 16): sum of q over each 16 columns (exact integers), for the weight offsets;
  s32 float32 (T, n // 32): the same over each 32 columns.
"""
import numpy as np
from numba import njit, prange

from ringllm.runtime.simd import f16_round

__all__ = ["Q8_0", "Q8_K", "quantize_row", "quantize_rows", "ActQ8"]

Q8_0 = 0     # activation format codes (quantize_rows' `fmt`)
Q8_K = 1

_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7], np.int64)


@njit(cache=True, nogil=True, inline="always")
def _store_block(X, xq, s16, t, c0, width, scale):
    """Quantize X[t, c0:c0 + width] with q = rint(X * scale) clamped to 127, into xq (permuted within
    each 8 columns), and its 16-column sums into s16."""
    for c16 in range(c0, c0 + width, 16):
        acc = 0
        for c8 in range(c16, c16 + 16, 8):
            for j in range(8):
                v = np.rint(X[t, c8 + _ORDER[j]] * scale)
                q = min(127, int(v))
                xq[t, c8 + j] = q
                acc += q
        s16[t, c16 // 16] = acc


@njit(cache=True, nogil=True, fastmath=False)
def quantize_row(X, xq, dx, s16, s32, fmt, t):
    """Quantize row t of X into row t of xq, dx, s16, s32 in format fmt (Q8_0 or Q8_K)."""
    n = X.shape[1]
    if fmt == Q8_0:
        for b in range(n // 32):
            c0 = 32 * b
            amax = np.float32(0.0)
            for j in range(32):
                amax = max(amax, abs(X[t, c0 + j]))
            inv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
            dx[t, b] = f16_round(amax / np.float32(127.0))
            _store_block(X, xq, s16, t, c0, 32, inv)
    else:
        for b in range(n // 256):
            c0 = 256 * b
            amax = np.float32(0.0)
            m = np.float32(0.0)
            for j in range(256):
                a = abs(X[t, c0 + j])
                if a > amax:
                    amax = a
                    m = X[t, c0 + j]
            if amax == 0:
                iscale = np.float32(0.0)
                d = np.float32(0.0)
            else:
                iscale = np.float32(-127.0) / m
                d = np.float32(1.0) / iscale
            for j in range(8):
                dx[t, 8 * b + j] = d
            _store_block(X, xq, s16, t, c0, 256, iscale)
    for b in range(n // 32):
        s32[t, b] = s16[t, 2 * b] + s16[t, 2 * b + 1]


@njit(cache=True, nogil=True, fastmath=False)
def _quantize_serial(X, xq, dx, s16, s32, fmt):
    for t in range(X.shape[0]):
        quantize_row(X, xq, dx, s16, s32, fmt, t)


@njit(cache=True, nogil=True, parallel=True, fastmath=False)
def _quantize_parallel(X, xq, dx, s16, s32, fmt):
    for t in prange(X.shape[0]):
        quantize_row(X, xq, dx, s16, s32, fmt, t)


def quantize_rows(X: np.ndarray, xq: np.ndarray, dx: np.ndarray, s16: np.ndarray, s32: np.ndarray, fmt: int) -> None:
    """Quantize X (T, n) float32 (C-contiguous) into xq, dx, s16, s32 (shapes in the module
    docstring; views of at least T rows). Rows in parallel from 4 rows on."""
    if X.shape[0] >= 4:
        _quantize_parallel(X, xq, dx, s16, s32, fmt)
    else:
        _quantize_serial(X, xq, dx, s16, s32, fmt)


class ActQ8:
    """Reusable buffers (xq, dx, s16, s32) for the quantized activations of up to `rows` rows of n
    columns; `bufs` is the tuple of the four, as the q8 kernels take them."""

    __slots__ = ("n", "bufs")

    def __init__(self, n: int, rows: int = 1):
        self.n = n
        self.bufs = (np.zeros((rows, n), np.int8), np.zeros((rows, n // 32), np.float32),
                     np.zeros((rows, n // 16), np.float32), np.zeros((rows, n // 32), np.float32))

    def for_rows(self, T: int) -> tuple:
        """The buffers, grown to at least T rows."""
        if self.bufs[0].shape[0] < T:
            self.__init__(self.n, T)
        return self.bufs

    def fill(self, X: np.ndarray, fmt: int) -> tuple:
        """Quantize X (T, n) and return (xq, dx, s16, s32) views of its T rows (valid until the next fill)."""
        T = X.shape[0]
        v = tuple(b[:T] for b in self.for_rows(T))
        quantize_rows(X, *v, fmt)
        return v
