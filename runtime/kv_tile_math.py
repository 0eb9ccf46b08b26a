"""The attention step's arithmetic eight keys at a time, with explicit 8-lane vectors (simd.py), for
head_dim a multiple of 8: the inner loops of stored_attention's units.

    head_rows(arr, h, tile) -> rows;  rows8_at(arr, h, j, tile) -> base
        rows j .. j + 7 of head h of a store array, in the array's basis (kv_basis.py: the values, or a
        q4_0 row's coefficients before its rotation back): rows[base + r * hd + d] is element d of
        row j + r. f32 and f16 stores are read in place (rows is head h's rows, flat, taken once per
        span; an f16 row is widened as it is loaded, simd.vload_kv, exactly); the other types are
        decoded into tile (8 hd,) f32 (kv_basis.decode_row_basis; rows is tile, base 0).
    dot8(scores_row, j, qg, rows, base, hd)
        scores_row[j + r] = qg[:hd] . row r, r < 8
    axpy8(o, w_row, j, rows, base, hd)
        o[:hd] += w_row[j + r] * row r for r = 0 .. 7, in that order
    rows_tail_at(arr, h, j, n, tile)
        rows j .. j + n - 1 (n < 8) in their basis (f32: copied) in tile's first n rows, the other rows
        zero: a span's last few rows go through dot8 / axpy8 as eight, so every score and sum of
        a unit is made by the same vector code (below: why the same code)
    dot8x2, axpy8x2
        the same for two query heads of a GQA group at once: each row chunk loaded once for both,
        every sum in the same order (the same bits as two single calls)
    prefetch_rows(flat, width, j, n)
        hint the cache lines of rows j .. j + n - 1 of one head (flat: arr[h].reshape(-1), any type)

Why eight: a key's score is a sum over head_dim. One key at a time, each score ends in a horizontal
reduction of an 8-lane vector (a chain of shuffles and adds) plus the loop and index bookkeeping
of its own, which cost more instructions than the multiply-adds for head_dim 64. Eight keys share
the query's loads, the loop, and one reduction (vsum8x8) that turns eight partial-sum vectors into
the eight scores in nine instructions, stored with one vector store. The weighted value sum reads
and writes each eight-value chunk of its output once per eight keys instead of once per key.

Why the tails go through the eight-row code too: the same bits from every caller. These kernels
spell out every vector operation (the fused multiply-adds, the fixed reduction tree of vsum8x8),
so the order of every sum is the source's. A plain loop compiled with fastmath (reassociation) is
vectorized as LLVM sees fit, and LLVM can see fit differently for the same loop inlined into two
callers: attend_stored and attend_stored_parallel once gave the last few slots of a unit different
last bits in a long process (the q8_0 row loop of kv_row_math), where the eight-row code agreed.

The rows stream from DRAM once per token; the hardware prefetcher alone left a single thread at
about half the read bandwidth it reaches on a plain sequential sum, so the callers hint the rows a
few blocks ahead (prefetch_rows, PREFETCH_AHEAD keys).
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from ringllm.runtime.kv_basis import decode_basis, decode_row_basis
from ringllm.runtime.simd import prefetch, vbcast, vfma, vload, vload_kv, vstore, vsum8x8, vzero

PREFETCH_AHEAD = 32          # keys between the rows hinted and the rows read
# store dtypes the kernels read in place (f32, f16), as NumPy and as Numba types
_IN_PLACE = (np.dtype(np.float32), np.dtype(np.uint16))
_IN_PLACE_NB = (types.float32, types.uint16)


def head_rows(arr, h, tile):
    """The buffer rows8_at's offsets index: head h's rows themselves, flat, for an f32 or f16 store
    array (read in place); else tile, which rows8_at decodes into. Taken once per span of slots, not
    per eight rows: a reshape builds a new array header each time, inside the hottest loop."""
    return arr[h].reshape(-1) if arr.dtype in _IN_PLACE else tile


def rows8_at(arr, h, j, tile):
    """Offset into head_rows(arr, h, tile) of rows j .. j + 7 of head h as float32 in the array's basis:
    j hd for f32 and f16 (nothing done), else 0 after decoding the eight rows into tile (kv_basis)."""
    hd = tile.shape[0] // 8
    if arr.dtype in _IN_PLACE:
        return j * hd
    for r in range(8):
        tile[r * hd:(r + 1) * hd] = decode_basis(arr[h, j + r], hd)
    return 0


@njit(cache=True, nogil=True, inline="always")
def rows_tail_at(arr, h, j, n, tile):
    """tile[r hd:(r + 1) hd] = row j + r of head h as float32 in its basis for r < n (n < 8), zero for the
    rows after: eight rows for dot8 / axpy8 (base 0), whose extra rows score zero and add zero."""
    hd = tile.shape[0] // 8
    for r in range(n):
        decode_row_basis(tile[r * hd:(r + 1) * hd], arr[h, j + r])
    for i in range(n * hd, 8 * hd):
        tile[i] = np.float32(0.0)


@overload(head_rows, inline="always")
def _ov_head_rows(arr, h, tile):
    if arr.dtype in _IN_PLACE_NB:
        def impl_f32(arr, h, tile):
            return arr[h].reshape(-1)
        return impl_f32

    def impl(arr, h, tile):
        return tile
    return impl


@overload(rows8_at, inline="always")
def _ov_rows8_at(arr, h, j, tile):
    if arr.dtype in _IN_PLACE_NB:
        def impl_f32(arr, h, j, tile):
            return j * arr.shape[2]
        return impl_f32

    def impl(arr, h, j, tile):
        hd = tile.shape[0] // 8
        for r in range(8):
            decode_row_basis(tile[r * hd:(r + 1) * hd], arr[h, j + r])
        return 0
    return impl


@njit(cache=True, nogil=True, inline="always")
def dot8(scores_row, j, qg, rows, base, hd):
    """scores_row[j + r] = qg[:hd] . rows[base + r hd : base + (r + 1) hd] for r < 8 (hd % 8 == 0)."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vzero()
    for d in range(0, hd, 8):
        qd = vload(qg, d)
        a0 = vfma(qd, vload_kv(rows, base + d), a0)
        a1 = vfma(qd, vload_kv(rows, base + hd + d), a1)
        a2 = vfma(qd, vload_kv(rows, base + 2 * hd + d), a2)
        a3 = vfma(qd, vload_kv(rows, base + 3 * hd + d), a3)
        a4 = vfma(qd, vload_kv(rows, base + 4 * hd + d), a4)
        a5 = vfma(qd, vload_kv(rows, base + 5 * hd + d), a5)
        a6 = vfma(qd, vload_kv(rows, base + 6 * hd + d), a6)
        a7 = vfma(qd, vload_kv(rows, base + 7 * hd + d), a7)
    vstore(scores_row, j, vsum8x8(a0, a1, a2, a3, a4, a5, a6, a7))


@njit(cache=True, nogil=True, inline="always")
def dot8x2(sa, sb, j, qa, qb, rows, base, hd):
    """dot8 for two query heads at once (sa[j + r] = qa . row r, sb[j + r] = qb . row r): each row
    chunk is loaded once for both; every score is summed exactly as dot8 sums it (the same bits)."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vzero()
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = vzero()
    for d in range(0, hd, 8):
        qd, qe = vload(qa, d), vload(qb, d)
        r = vload_kv(rows, base + d)
        a0, b0 = vfma(qd, r, a0), vfma(qe, r, b0)
        r = vload_kv(rows, base + hd + d)
        a1, b1 = vfma(qd, r, a1), vfma(qe, r, b1)
        r = vload_kv(rows, base + 2 * hd + d)
        a2, b2 = vfma(qd, r, a2), vfma(qe, r, b2)
        r = vload_kv(rows, base + 3 * hd + d)
        a3, b3 = vfma(qd, r, a3), vfma(qe, r, b3)
        r = vload_kv(rows, base + 4 * hd + d)
        a4, b4 = vfma(qd, r, a4), vfma(qe, r, b4)
        r = vload_kv(rows, base + 5 * hd + d)
        a5, b5 = vfma(qd, r, a5), vfma(qe, r, b5)
        r = vload_kv(rows, base + 6 * hd + d)
        a6, b6 = vfma(qd, r, a6), vfma(qe, r, b6)
        r = vload_kv(rows, base + 7 * hd + d)
        a7, b7 = vfma(qd, r, a7), vfma(qe, r, b7)
    vstore(sa, j, vsum8x8(a0, a1, a2, a3, a4, a5, a6, a7))
    vstore(sb, j, vsum8x8(b0, b1, b2, b3, b4, b5, b6, b7))


@njit(cache=True, nogil=True, inline="always")
def axpy8(o, w_row, j, rows, base, hd):
    """o[:hd] += w_row[j + r] * rows[base + r hd : base + (r + 1) hd] for r = 0 .. 7 (hd % 8 == 0)."""
    w0, w1, w2, w3 = vbcast(w_row, j), vbcast(w_row, j + 1), vbcast(w_row, j + 2), vbcast(w_row, j + 3)
    w4, w5, w6, w7 = vbcast(w_row, j + 4), vbcast(w_row, j + 5), vbcast(w_row, j + 6), vbcast(w_row, j + 7)
    for d in range(0, hd, 8):
        acc = vfma(w0, vload_kv(rows, base + d), vload(o, d))
        acc = vfma(w1, vload_kv(rows, base + hd + d), acc)
        acc = vfma(w2, vload_kv(rows, base + 2 * hd + d), acc)
        acc = vfma(w3, vload_kv(rows, base + 3 * hd + d), acc)
        acc = vfma(w4, vload_kv(rows, base + 4 * hd + d), acc)
        acc = vfma(w5, vload_kv(rows, base + 5 * hd + d), acc)
        acc = vfma(w6, vload_kv(rows, base + 6 * hd + d), acc)
        vstore(o, d, vfma(w7, vload_kv(rows, base + 7 * hd + d), acc))


@njit(cache=True, nogil=True, inline="always")
def axpy8x2(oa, ob, wa, wb, j, rows, base, hd):
    """axpy8 for two query heads at once (oa += wa[j + r] row r, ob += wb[j + r] row r): each row chunk
    is loaded once for both; every output is summed exactly as axpy8 sums it (the same bits)."""
    a0, a1, a2, a3 = vbcast(wa, j), vbcast(wa, j + 1), vbcast(wa, j + 2), vbcast(wa, j + 3)
    a4, a5, a6, a7 = vbcast(wa, j + 4), vbcast(wa, j + 5), vbcast(wa, j + 6), vbcast(wa, j + 7)
    b0, b1, b2, b3 = vbcast(wb, j), vbcast(wb, j + 1), vbcast(wb, j + 2), vbcast(wb, j + 3)
    b4, b5, b6, b7 = vbcast(wb, j + 4), vbcast(wb, j + 5), vbcast(wb, j + 6), vbcast(wb, j + 7)
    for d in range(0, hd, 8):
        r = vload_kv(rows, base + d)
        acc, bcc = vfma(a0, r, vload(oa, d)), vfma(b0, r, vload(ob, d))
        r = vload_kv(rows, base + hd + d)
        acc, bcc = vfma(a1, r, acc), vfma(b1, r, bcc)
        r = vload_kv(rows, base + 2 * hd + d)
        acc, bcc = vfma(a2, r, acc), vfma(b2, r, bcc)
        r = vload_kv(rows, base + 3 * hd + d)
        acc, bcc = vfma(a3, r, acc), vfma(b3, r, bcc)
        r = vload_kv(rows, base + 4 * hd + d)
        acc, bcc = vfma(a4, r, acc), vfma(b4, r, bcc)
        r = vload_kv(rows, base + 5 * hd + d)
        acc, bcc = vfma(a5, r, acc), vfma(b5, r, bcc)
        r = vload_kv(rows, base + 6 * hd + d)
        acc, bcc = vfma(a6, r, acc), vfma(b6, r, bcc)
        r = vload_kv(rows, base + 7 * hd + d)
        vstore(oa, d, vfma(a7, r, acc))
        vstore(ob, d, vfma(b7, r, bcc))


@njit(cache=True, nogil=True, inline="always")
def prefetch_rows(flat, width, j, n):
    """Hint the cache lines of rows j .. j + n - 1 of one head of a store array, flat = arr[h].reshape(-1)
    (any dtype, rows of `width` elements); the caller keeps j + n within the head (a hint never
    faults, but the address must be computed)."""
    step = 64 // flat.itemsize
    for c in range(j * width, (j + n) * width, step):
        prefetch(flat, c)

