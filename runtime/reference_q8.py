"""NumPy oracle of the q8 mode: llama.cpp's activation rounding, then an exact product.

y = dequantize(W) @ dequantize(quantize(x)) in float64, with quantize() the activation format
llama.cpp pairs with W's type (act_format: Q8_K for the K-quants, else Q8_0) and dequantize(W) from
gguf-py's NumPy dequantizer. The optimized kernels (quant_tiles_q8.py) must match this to float32
rounding of their accumulation order; act_quant.py must match quantize_q8_0 / quantize_q8_k byte
for byte. Written from ggml's definitions (quantize_row_q8_0 with AVX2's round-to-nearest-even,
quantize_row_q8_K_ref), in natural column order, independently of the kernels' code.
"""
from __future__ import annotations

import numpy as np

from ringllm.runtime.quant_types import GGMLType

__all__ = ["Q8_TYPES", "act_format", "quantize_q8_0", "quantize_q8_k", "dequantize_acts", "matmul_q8_ref"]

# weight types with q8 kernels, and the activation format llama.cpp's dot product uses for each
Q8_TYPES = {GGMLType.Q4_0: "q8_0", GGMLType.Q4_1: "q8_0", GGMLType.Q5_0: "q8_0", GGMLType.Q8_0: "q8_0",
            GGMLType.Q4_K: "q8_k", GGMLType.Q6_K: "q8_k"}


def act_format(qtype: GGMLType) -> str:
    """"q8_0" or "q8_k": the activation format of qtype's q8 products."""
    return Q8_TYPES[GGMLType(int(qtype))]


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (..., n) float32 -> (q int8 (..., n), d float32 (..., n // 32)): block_q8_0 of every 32 values."""
    b = np.asarray(x, np.float32).reshape(x.shape[:-1] + (-1, 32))
    amax = np.abs(b).max(axis=-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(b * inv[..., None]).astype(np.int8)
    d = (amax / np.float32(127.0)).astype(np.float16).astype(np.float32)
    return q.reshape(x.shape), d


def quantize_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (..., n) float32 -> (q int8 (..., n), d float32 (..., n // 256)): block_q8_K of every 256 values."""
    b = np.asarray(x, np.float32).reshape(x.shape[:-1] + (-1, 256))
    first = np.argmax(np.abs(b), axis=-1)
    m = np.take_along_axis(b, first[..., None], axis=-1)[..., 0]
    with np.errstate(divide="ignore"):
        iscale = np.where(m != 0, np.float32(-127.0) / m, np.float32(0.0)).astype(np.float32)
        d = np.where(m != 0, np.float32(1.0) / iscale, np.float32(0.0)).astype(np.float32)
    q = np.minimum(np.rint(b * iscale[..., None]), 127).astype(np.int8)
    return q.reshape(x.shape), d


def dequantize_acts(x: np.ndarray, fmt: str) -> np.ndarray:
    """float64 values the q8 kernels multiply W with: q * d of x's blocks in format fmt."""
    if fmt == "q8_0":
        q, d = quantize_q8_0(x)
        bs = 32
    else:
        q, d = quantize_q8_k(x)
        bs = 256
    qb = q.astype(np.float64).reshape(q.shape[:-1] + (-1, bs))
    return (qb * d.astype(np.float64)[..., None]).reshape(x.shape)


def matmul_q8_ref(w: np.ndarray, X: np.ndarray, qtype: GGMLType) -> np.ndarray:
    """(T, n_rows) float64 = dequantize_acts(X) @ w.T for w (n_rows, n_cols) the dequantized weights."""
    xa = dequantize_acts(np.atleast_2d(np.asarray(X, np.float32)), act_format(qtype))
    return xa @ np.asarray(w, np.float64).T
