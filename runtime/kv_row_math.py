"""The attention step's arithmetic on encoded store rows: a GQA group's scores against one key row,
and value rows added into the group's outputs, for every KV type (runtime/kv_types.py).

    group_scores(scores, qrot, key, h0, group, j)
        scores[h0 + g, j] = qrot[h0 + g] . key, a float32 row (hd,), g < group
    group_scores_row(scores, qrot, k_l, h, j, h0, group, buf)
        the same for key j of head h of a store array in any type
    accumulate_rows4(out, scores, v_l, h, j, h0, group, vb)
        out[h0 + g] += sum over r < 4 of scores[h0 + g, j + r] * value j + r of head h
    accumulate_row(out, scores, v_l, h, j, h0, group, vb)
        out[h0 + g] += scores[h0 + g, j] * value j of head h

f32 rows are read in place and f16 and q4_0 rows decoded into buf / vb (F16C converts eight at a
time; a q4_0 block is rotated back, kv_types); the sums run as they always have (slot order, four
rows per pass: the f32 results are the same bits as before types existed). q8_0 rows are never
decoded into memory: a block's 32 integers are converted once in registers and multiplied into up
to four query heads' sums at a time (the block's scale applied once to each head's block sum), and
a value block's scale is folded into each head's weight.

Numba overloads: the implementation is chosen by the row dtype when the calling kernel compiles.
The Python functions below are the same arithmetic in NumPy (for callers outside Numba and tests).
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from ringllm.runtime.kv_codec import block_scale, decode, kv_row
from ringllm.runtime.kv_types import QBLOCK
from ringllm.runtime.numba_flags import FASTMATH

_Q8_BYTES = QBLOCK + 2           # block_q8_0: f16 scale, 32 int8


def group_scores_row(scores, qrot, k_l, h, j, h0, group, buf):
    """scores[h0 + g, j] = qrot[h0 + g] . (key j of head h, decoded) for g < group."""
    key = k_l[h, j] if k_l.dtype == np.float32 else decode(k_l[h, j], qrot.shape[1])
    scores[h0:h0 + group, j] = qrot[h0:h0 + group] @ key


def accumulate_rows4(out, scores, v_l, h, j, h0, group, vb):
    """out[h0 + g] += scores[h0 + g, j:j + 4] @ (values j .. j + 3 of head h, decoded)."""
    rows = v_l[h, j:j + 4] if v_l.dtype == np.float32 else decode(v_l[h, j:j + 4], out.shape[1])
    out[h0:h0 + group] += scores[h0:h0 + group, j:j + 4] @ rows


def accumulate_row(out, scores, v_l, h, j, h0, group, vb):
    """out[h0 + g] += scores[h0 + g, j] * (value j of head h, decoded)."""
    row = v_l[h, j] if v_l.dtype == np.float32 else decode(v_l[h, j], out.shape[1])
    out[h0:h0 + group] += scores[h0:h0 + group, j:j + 1] * row[None, :]


# ---------------------------------------------------------------------------------------------
# f32 and f16: rows read (or decoded) whole, the plain loops
# ---------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def group_scores(scores, qrot, key, h0, group, j):
    """scores[h0 + g, j] = qrot[h0 + g] . key (hd,) for the group's query heads."""
    for g in range(group):
        qg = qrot[h0 + g]
        acc = np.float32(0.0)
        for d in range(key.shape[0]):
            acc += qg[d] * key[d]
        scores[h0 + g, j] = acc


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def _scores_plain(scores, qrot, k_l, h, j, h0, group, buf):
    group_scores(scores, qrot, kv_row(k_l, h, j, buf), h0, group, j)


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def _acc4_plain(out, scores, v_l, h, j, h0, group, vb):
    v0, v1 = kv_row(v_l, h, j, vb[0]), kv_row(v_l, h, j + 1, vb[1])
    v2, v3 = kv_row(v_l, h, j + 2, vb[2]), kv_row(v_l, h, j + 3, vb[3])
    hd = out.shape[1]
    for g in range(group):
        sc = scores[h0 + g]
        w0, w1, w2, w3 = sc[j], sc[j + 1], sc[j + 2], sc[j + 3]
        o = out[h0 + g]
        for d in range(hd):
            o[d] += (w0 * v0[d] + w1 * v1[d]) + (w2 * v2[d] + w3 * v3[d])


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def _acc1_plain(out, scores, v_l, h, j, h0, group, vb):
    vj = kv_row(v_l, h, j, vb[0])
    hd = out.shape[1]
    for g in range(group):
        w = scores[h0 + g, j]
        o = out[h0 + g]
        for d in range(hd):
            o[d] += w * vj[d]


# ---------------------------------------------------------------------------------------------
# q8_0: blocks converted in registers
# ---------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def _scores_q8_0(scores, qrot, k_l, h, j, h0, group, buf):
    row = k_l[h, j]
    nb = row.shape[0] // _Q8_BYTES
    last = group - 1
    for g0 in range(0, group, 4):           # four query heads per pass (a short last pass repeats one)
        q0, q1 = qrot[h0 + g0], qrot[h0 + min(g0 + 1, last)]
        q2, q3 = qrot[h0 + min(g0 + 2, last)], qrot[h0 + min(g0 + 3, last)]
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for b in range(nb):
            o, x0 = b * _Q8_BYTES + 2, b * QBLOCK
            s0 = s1 = s2 = s3 = np.float32(0.0)
            for i in range(QBLOCK):
                x = np.float32(np.int32(row[o + i]))
                s0 += q0[x0 + i] * x
                s1 += q1[x0 + i] * x
                s2 += q2[x0 + i] * x
                s3 += q3[x0 + i] * x
            d = block_scale(row, o - 2)
            a0 += d * s0
            a1 += d * s1
            a2 += d * s2
            a3 += d * s3
        _put4(scores, h0, g0, group, j, a0, a1, a2, a3)


@njit(cache=True, nogil=True, inline="always")
def _put4(scores, h0, g0, group, j, a0, a1, a2, a3):
    scores[h0 + g0, j] = a0
    if g0 + 1 < group:
        scores[h0 + g0 + 1, j] = a1
    if g0 + 2 < group:
        scores[h0 + g0 + 2, j] = a2
    if g0 + 3 < group:
        scores[h0 + g0 + 3, j] = a3


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def _acc4_q8_0(out, scores, v_l, h, j, h0, group, vb):
    r0, r1, r2, r3 = v_l[h, j], v_l[h, j + 1], v_l[h, j + 2], v_l[h, j + 3]
    for b in range(r0.shape[0] // _Q8_BYTES):
        o, x0 = b * _Q8_BYTES + 2, b * QBLOCK
        d0, d1, d2, d3 = block_scale(r0, o - 2), block_scale(r1, o - 2), block_scale(r2, o - 2), block_scale(r3, o - 2)
        for g in range(group):
            sc = scores[h0 + g]
            c0, c1, c2, c3 = sc[j] * d0, sc[j + 1] * d1, sc[j + 2] * d2, sc[j + 3] * d3
            og = out[h0 + g]
            for i in range(QBLOCK):
                og[x0 + i] += ((c0 * np.float32(np.int32(r0[o + i])) + c1 * np.float32(np.int32(r1[o + i])))
                               + (c2 * np.float32(np.int32(r2[o + i])) + c3 * np.float32(np.int32(r3[o + i]))))


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def _acc1_q8_0(out, scores, v_l, h, j, h0, group, vb):
    r = v_l[h, j]
    for b in range(r.shape[0] // _Q8_BYTES):
        o, x0 = b * _Q8_BYTES + 2, b * QBLOCK
        d = block_scale(r, o - 2)
        for g in range(group):
            c = scores[h0 + g, j] * d
            og = out[h0 + g]
            for i in range(QBLOCK):
                og[x0 + i] += c * np.float32(np.int32(r[o + i]))


# the implementations per row dtype: (scores, accumulate four rows, accumulate one row)
_IMPLS = {types.float32: (_scores_plain, _acc4_plain, _acc1_plain),
          types.uint16: (_scores_plain, _acc4_plain, _acc1_plain),
          types.int8: (_scores_q8_0, _acc4_q8_0, _acc1_q8_0),
          types.uint8: (_scores_plain, _acc4_plain, _acc1_plain)}


def _impl(arr, which: int):
    if arr.dtype not in _IMPLS:
        raise TypeError(f"no KV type stores rows of {arr.dtype}")
    return _IMPLS[arr.dtype][which]


@overload(group_scores_row, inline="always")
def _ov_group_scores_row(scores, qrot, k_l, h, j, h0, group, buf):
    fn = _impl(k_l, 0)

    def impl(scores, qrot, k_l, h, j, h0, group, buf):
        fn(scores, qrot, k_l, h, j, h0, group, buf)
    return impl


@overload(accumulate_rows4, inline="always")
def _ov_accumulate_rows4(out, scores, v_l, h, j, h0, group, vb):
    fn = _impl(v_l, 1)

    def impl(out, scores, v_l, h, j, h0, group, vb):
        fn(out, scores, v_l, h, j, h0, group, vb)
    return impl


@overload(accumulate_row, inline="always")
def _ov_accumulate_row(out, scores, v_l, h, j, h0, group, vb):
    fn = _impl(v_l, 2)

    def impl(out, scores, v_l, h, j, h0, group, vb):
        fn(out, scores, v_l, h, j, h0, group, vb)
    return impl
