"""The attention step's arithmetic eight keys at a time, with explicit 8-lane vectors (simd.py), for
head_dim a multiple of 8: the inner loops of stored_attention's units.

    rows8(arr, h, j, tile) -> (rows, base)
        rows j .. j + 7 of head h of a store array as float32 values: rows[base + r * hd + d] is
        value d of row j + r. f32 stores are read in place (rows is head h's rows, flat); the other
        types are decoded into tile (8 hd,) f32 by kv_codec's row decoders and base is 0.
    dot8(scores_row, j, qg, rows, base, hd)
        scores_row[j + r] = qg[:hd] . row r, r < 8
    axpy8(o, w_row, j, rows, base, hd)
        o[:hd] += w_row[j + r] * row r for r = 0 .. 7, in that order
    prefetch_rows(arr, h, j, n)
        hint the cache lines of rows j .. j + n - 1 of head h (a store array of any type)

Why eight: a key's score is a sum over head_dim. One key at a time, each score ends in a horizontal
reduction of an 8-lane vector (a chain of shuffles and adds) plus the loop and index bookkeeping
of its own, which cost more instructions than the multiply-adds for head_dim 64. Eight keys share
the query's loads, the loop, and one reduction (vsum8x8) that turns eight partial-sum vectors into
the eight scores in nine instructions, stored with one vector store. The weighted value sum reads
and writes each eight-value chunk of its output once per eight keys instead of once per key.

The rows stream from DRAM once per token; the hardware prefetcher alone left a single thread at
about half the read bandwidth it reaches on a plain sequential sum, so the callers hint the rows a
few blocks ahead (prefetch_rows, PREFETCH_AHEAD keys).
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from ringllm.runtime.kv_codec import decode, decode_row
from ringllm.runtime.simd import prefetch, vbcast, vfma, vload, vstore, vsum8x8, vzero

PREFETCH_AHEAD = 32          # keys between the rows hinted and the rows read


def rows8(arr, h, j, tile):
    """(rows, base): rows j .. j + 7 of head h as float32 (module docstring)."""
    hd = tile.shape[0] // 8
    if arr.dtype == np.float32:
        return arr[h].reshape(-1), j * hd
    for r in range(8):
        tile[r * hd:(r + 1) * hd] = decode(arr[h, j + r], hd)
    return tile, 0


@overload(rows8, inline="always")
def _ov_rows8(arr, h, j, tile):
    if arr.dtype == types.float32:
        def impl_f32(arr, h, j, tile):
            return arr[h].reshape(-1), j * arr.shape[2]
        return impl_f32

    def impl(arr, h, j, tile):
        hd = tile.shape[0] // 8
        for r in range(8):
            decode_row(tile[r * hd:(r + 1) * hd], arr[h, j + r])
        return tile, 0
    return impl


@njit(cache=True, nogil=True, inline="always")
def dot8(scores_row, j, qg, rows, base, hd):
    """scores_row[j + r] = qg[:hd] . rows[base + r hd : base + (r + 1) hd] for r < 8 (hd % 8 == 0)."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vzero()
    for d in range(0, hd, 8):
        qd = vload(qg, d)
        a0 = vfma(qd, vload(rows, base + d), a0)
        a1 = vfma(qd, vload(rows, base + hd + d), a1)
        a2 = vfma(qd, vload(rows, base + 2 * hd + d), a2)
        a3 = vfma(qd, vload(rows, base + 3 * hd + d), a3)
        a4 = vfma(qd, vload(rows, base + 4 * hd + d), a4)
        a5 = vfma(qd, vload(rows, base + 5 * hd + d), a5)
        a6 = vfma(qd, vload(rows, base + 6 * hd + d), a6)
        a7 = vfma(qd, vload(rows, base + 7 * hd + d), a7)
    vstore(scores_row, j, vsum8x8(a0, a1, a2, a3, a4, a5, a6, a7))


@njit(cache=True, nogil=True, inline="always")
def axpy8(o, w_row, j, rows, base, hd):
    """o[:hd] += w_row[j + r] * rows[base + r hd : base + (r + 1) hd] for r = 0 .. 7 (hd % 8 == 0)."""
    w0, w1, w2, w3 = vbcast(w_row, j), vbcast(w_row, j + 1), vbcast(w_row, j + 2), vbcast(w_row, j + 3)
    w4, w5, w6, w7 = vbcast(w_row, j + 4), vbcast(w_row, j + 5), vbcast(w_row, j + 6), vbcast(w_row, j + 7)
    for d in range(0, hd, 8):
        acc = vfma(w0, vload(rows, base + d), vload(o, d))
        acc = vfma(w1, vload(rows, base + hd + d), acc)
        acc = vfma(w2, vload(rows, base + 2 * hd + d), acc)
        acc = vfma(w3, vload(rows, base + 3 * hd + d), acc)
        acc = vfma(w4, vload(rows, base + 4 * hd + d), acc)
        acc = vfma(w5, vload(rows, base + 5 * hd + d), acc)
        acc = vfma(w6, vload(rows, base + 6 * hd + d), acc)
        vstore(o, d, vfma(w7, vload(rows, base + 7 * hd + d), acc))


@njit(cache=True, nogil=True, inline="always")
def prefetch_rows(arr, h, j, n):
    """Hint the cache lines of rows j .. j + n - 1 of head h of a store array (n_kv, P, width), any
    dtype; the caller keeps j + n <= P (a hint never faults, but the address must be computed)."""
    flat = arr[h].reshape(-1)
    step = 64 // arr.itemsize
    for c in range(j * arr.shape[2], (j + n) * arr.shape[2], step):
        prefetch(flat, c)
