"""The attention step over the in-place KV store: RoPE by each slot's logical position, fused at read time.

One call per layer per token. Keys are stored before RoPE; each key is rotated as it is read by
the cos/sin of its slot's logical position (a table row), once per kv head and shared by the
query heads of its GQA group (no repeated K/V is materialized). Softmax is two-pass over the
scores of the occupied slots, in float32.

RoPE is rotate-half over the first `rotary_dim` dims: halves (a, b) -> (a cos - b sin, b cos + a sin)
with angle pos/scale * base^(-2i/rotary_dim) (Su et al., RoFormer eq. 34, HF layout).
"""
from __future__ import annotations

import numpy as np
from numba import njit


class RopeTable:
    """cos/sin of angle pos/scale * base^(-2i/rotary_dim) for pos in [0, n): cos, sin (n, rotary_dim/2) float32.

    Grows (doubling) when a position past its end is asked for: in `original` mode positions are
    sequence indices and a stream is unbounded.
    """

    def __init__(self, rotary_dim: int, base: float, scale: float, n: int = 4096):
        self.rotary_dim, self.base, self.scale = rotary_dim, base, scale
        self.cos = self.sin = np.zeros((0, rotary_dim // 2), np.float32)
        self.ensure(n)

    def ensure(self, n: int) -> None:
        if n <= self.cos.shape[0]:
            return
        size = max(n, 2 * self.cos.shape[0])
        half = self.rotary_dim // 2
        inv_freq = self.base ** (-np.arange(half, dtype=np.float64) * 2.0 / self.rotary_dim)
        ang = (np.arange(size, dtype=np.float64) / self.scale)[:, None] * inv_freq[None, :]
        self.cos = np.ascontiguousarray(np.cos(ang), dtype=np.float32)
        self.sin = np.ascontiguousarray(np.sin(ang), dtype=np.float32)


# Reassociation lets LLVM vectorize the float32 dot products and sums (a plain loop is a serial
# chain); no approximate functions, so exp stays exact. Differences vs the reference are float32
# rounding, well inside the engine's 1e-3 logit tolerance.
FASTMATH = {"reassoc", "contract", "nsz"}


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def _rotate_into(dst, src, p, cos, sin, rotary_dim):
    """dst (hd,) = RoPE(src (hd,)) at table row p; dims past rotary_dim are copied."""
    half = rotary_dim // 2
    c = cos[p]
    s = sin[p]
    for i in range(half):
        a = src[i]
        b = src[i + half]
        dst[i] = a * c[i] - b * s[i]
        dst[i + half] = b * c[i] + a * s[i]
    for i in range(rotary_dim, src.shape[0]):
        dst[i] = src[i]


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def attend(out, q, k_l, v_l, pos_l, count_l, q_pos, cos, sin, rotary_dim, scale, scores, krot, qrot, mass):
    """Attention of one token over the occupied slots of one layer.

    out (n_head, hd) f32: result.         q (n_head, hd) f32: queries before RoPE.
    k_l, v_l (n_kv, cap, hd) f32; pos_l (n_kv, cap) i64; count_l (n_kv,) i64: the layer's store.
    q_pos: the query's logical position.  cos, sin (n_pos, rotary_dim/2) f32: RopeTable.
    scale: score multiplier (1/sqrt(hd) or the model's).
    scratch: scores (n_head, cap) f32, krot (hd,) f32, qrot (n_head, hd) f32.
    mass (n_kv, cap) f32: per-slot attention mass summed over the group's query heads, written
        when mass.shape[0] > 0 (policies that score by attention), else untouched.
    """
    n_head, hd = q.shape
    n_kv = k_l.shape[0]
    group = n_head // n_kv
    for hq in range(n_head):
        _rotate_into(qrot[hq], q[hq], q_pos, cos, sin, rotary_dim)
        for d in range(hd):
            qrot[hq, d] *= scale
    want_mass = mass.shape[0] > 0
    for h in range(n_kv):
        n = count_l[h]
        h0 = h * group
        for j in range(n):
            _rotate_into(krot, k_l[h, j], pos_l[h, j], cos, sin, rotary_dim)
            for g in range(group):
                qg = qrot[h0 + g]
                acc = np.float32(0.0)
                for d in range(hd):
                    acc += qg[d] * krot[d]
                scores[h0 + g, j] = acc
        for g in range(group):
            hq = h0 + g
            sc = scores[hq]
            m = sc[0]
            for j in range(1, n):
                m = max(m, sc[j])
            total = np.float32(0.0)
            for j in range(n):
                e = np.exp(sc[j] - m)
                sc[j] = e
                total += e
            inv = np.float32(1.0) / total
            o = out[hq]
            for d in range(hd):
                o[d] = 0.0
            for j in range(n):
                w = sc[j] * inv
                sc[j] = w
                vj = v_l[h, j]
                for d in range(hd):
                    o[d] += w * vj[d]
        if want_mass:
            for j in range(n):
                acc = np.float32(0.0)
                for g in range(group):
                    acc += scores[h0 + g, j]
                mass[h, j] = acc
