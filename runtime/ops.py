"""Elementwise and normalization kernels of the CPU engine (batch of T rows), destination first.

Each has a NumPy twin in runtime/reference.py written from the same formula (the oracle).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ringllm.runtime.fast_exp import exp_f32

ACT_SILU, ACT_GELU, ACT_GELU_TANH = 0, 1, 2
ACT_CODES = {"silu": ACT_SILU, "gelu": ACT_GELU, "gelu_tanh": ACT_GELU_TANH}


@njit(cache=True, nogil=True, fastmath=False)
def rms_norm_rows(out, x, w, eps):
    """out (R, n) = x (R, n) * w (n,) / sqrt(mean(x^2) + eps), row by row (out may alias x). The float64
    sum of squares runs in four interleaved partial sums: one chain of n dependent adds (strict order,
    no fastmath, so it never vectorizes) costs about n x 4 cycles, which at a batched step's eight rows
    and two norms a layer is more than the row's arithmetic."""
    rows, n = x.shape
    n4 = n - n % 4
    for r in range(rows):
        s0 = s1 = s2 = s3 = 0.0
        for i in range(0, n4, 4):
            s0 += x[r, i] * x[r, i]
            s1 += x[r, i + 1] * x[r, i + 1]
            s2 += x[r, i + 2] * x[r, i + 2]
            s3 += x[r, i + 3] * x[r, i + 3]
        for i in range(n4, n):
            s0 += x[r, i] * x[r, i]
        ss = (s0 + s1) + (s2 + s3)
        inv = np.float32(1.0 / math.sqrt(ss / n + eps))
        for i in range(n):
            out[r, i] = x[r, i] * inv * w[i]


@njit(cache=True, nogil=True, fastmath=False)
def layer_norm_rows(out, x, w, b, eps):
    """out (R, n) = (x - mean) / sqrt(var + eps) * w + b, row by row (out may alias x)."""
    rows, n = x.shape
    for r in range(rows):
        mu = 0.0
        for i in range(n):
            mu += x[r, i]
        mu /= n
        var = 0.0
        for i in range(n):
            d = x[r, i] - mu
            var += d * d
        inv = 1.0 / math.sqrt(var / n + eps)
        for i in range(n):
            out[r, i] = np.float32((x[r, i] - mu) * inv) * w[i] + b[i]


@njit(cache=True, nogil=True, inline="always")
def _act(x, kind):
    """SiLU x sigmoid(x), GELU (erf) or GELU-tanh 0.5 x (1 + tanh(u)) = x sigmoid(2u). The sigmoids use
    exp_f32 (straight-line code: a row's loop vectorizes; libm's expf / tanhf is a call per value)."""
    if kind == ACT_SILU:
        return x / (np.float32(1.0) + exp_f32(-x))
    if kind == ACT_GELU:
        return np.float32(0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0))))
    u = np.float32(0.7978845608028654) * (x + np.float32(0.044715) * x * x * x)
    return x / (np.float32(1.0) + exp_f32(np.float32(-2.0) * u))


@njit(cache=True, nogil=True, inline="always")
def _gated_row(out, gate, up, kind, t, n):
    for i in range(n):
        out[t, i] = _act(gate[t, i], kind) * up[t, i]


@njit(cache=True, nogil=True, parallel=True, fastmath=False)
def gated_act(out, gate, up, kind):
    """out (T, n_ff) = act(gate) * up, rows over threads. One prange loop serves T = 1 as well (a
    serial twin for few rows would put a second copy of the body into the kernel: compile time)."""
    T, n = out.shape
    for t in prange(T):
        _gated_row(out, gate, up, kind, t, n)


@njit(cache=True, nogil=True, inline="always")
def _gated_fused_row(out, gate_up, kind, t, n):
    for i in range(n):
        out[t, i] = _act(gate_up[t, i], kind) * gate_up[t, n + i]


@njit(cache=True, nogil=True, parallel=True, fastmath=False)
def gated_act_fused(out, gate_up, kind):
    """out (T, n_ff) = act(gate) * up, gate_up (T, 2 n_ff) = [gate | up] (the stacked projection's
    output). One signature whatever T: slices of gate_up would be C-contiguous for T = 1 only, and
    compile gated_act twice. Rows over threads, as gated_act."""
    T, n = out.shape
    for t in prange(T):
        _gated_fused_row(out, gate_up, kind, t, n)


@njit(cache=True, nogil=True, fastmath=False)
def act_inplace(x, kind):
    """x (T, n_ff) = act(x)."""
    T, n = x.shape
    for t in range(T):
        for i in range(n):
            x[t, i] = _act(x[t, i], kind)


@njit(cache=True, nogil=True, fastmath=False)
def add_bias(x, b):
    """x (T, n) += b (n,)."""
    T, n = x.shape
    for t in range(T):
        for i in range(n):
            x[t, i] += b[i]


@njit(cache=True, nogil=True, fastmath=False)
def softcap(x, cap):
    """x = cap * tanh(x / cap), elementwise over (T, n)."""
    T, n = x.shape
    for t in range(T):
        for i in range(n):
            x[t, i] = cap * np.tanh(x[t, i] / cap)
