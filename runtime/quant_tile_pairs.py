"""Two-row tile kernels: one tile of W times two x vectors, each weight decoded once for both.

tile2_<type>(dst0, dst1, d0, buf, base, nb, <x args of row 0>, <x args of row 1>) computes
dst0[d0:d0 + R] = (the R rows of one tile of W) @ x0 and dst1[d0:d0 + R] = ... @ x1 in one pass
over the tile's records. The packed layout, the pre-scaled x (xs, xsum from prep_x) and the
per-block folding of scales and offsets are those of quant_tiles.py, whose one-row kernels these
mirror line for line; see there for the record layouts.

Why pairs: a one-row tile kernel spends per 8 weights one field extraction (vandps / vpsrld), one
int -> float conversion and one FMA, so B rows through B matvecs decode every weight B times and
read it from memory B times. Here the extracted, converted field feeds two FMAs (one per row): per
8 weights and row, 2 ops instead of 3, and the weights stream once per pair. Two rows, not four:
two groups x two rows x two partial sums are 8 accumulators, which with the field dwords, two
broadcasts and the field in flight fit the 16 ymm registers; four rows would spill. Few-row products (batched
decode, speculative verification, short prefill chunks) call these per pair of rows with the tile
hot in L1 (matvec_kernels' few-row entries); many rows decode a tile once into a scratch instead
(gemm.py).

Each row's sums are formed in the one-row kernels' order (the same partial sums, even and odd
fields apart, folded with the same fused multiply-adds), so a few-row product equals T matvecs
bitwise: a row's result does not depend on which rows share its batch (batched decode gives each
stream what decoding it alone gives; a speculative verify row equals the decode step it replaces).
For the 24-row tiles that takes two passes per block (groups 0-1, then group 2: 8 accumulators
each, where one pass would need 12 and spill), at the cost of broadcasting x twice.
"""
import numpy as np
from numba import njit

from ringllm.runtime.kernel_copies import bind_copy
from ringllm.runtime.quant_tiles import (PF_DIST, QK, QK_K, REC_F16, REC_F32, REC_Q4_0, REC_Q4_1, REC_Q4_K,
                                         REC_Q5_0, REC_Q5_1, REC_Q5_K, REC_Q6_K, REC_Q8_0, dot_q4_pairs, dot_q6_pairs,
                                         field5, field6, nibble, prefetch_range)
from ringllm.runtime.simd import (ld_bf16, ld_f16, ld_f32, ld_i8, ld_i32, ld_u8, prefetch, srlf, vadd, vbcast,
                                  vfma, vfnma, vmul, vsplat, vstore, vsub, vzero)


# ==================================================================================================
# Block inner products for two rows of x: per group and row, the sum over the block of q * x
# ==================================================================================================

@njit(cache=True, nogil=True, inline="always")
def _q4_pass(buf, ra, rb, xs0, xs1, xb, two):
    """Nibble dwords of one group at byte ra (and a second at rb when `two`) times two rows of x, with
    _dot_q4's accumulation order: even and odd fields in separate sums, added at the end. Returns
    (ga x0, ga x1, gb x0, gb x1) (the gb pair is zero when not `two`). `two` is a constant of each
    call site, so the unused half compiles away."""
    a0 = vzero()
    a1 = vzero()
    b0 = vzero()
    b1 = vzero()
    c0 = vzero()
    c1 = vzero()
    e0 = vzero()
    e1 = vzero()
    for s in range(4):
        wa = ld_i32(buf, ra + 32 * s)
        wb = ld_i32(buf, rb + 32 * s) if two else wa
        for i in range(0, 8, 2):
            u = vbcast(xs0, xb + 8 * s + i)
            v = vbcast(xs1, xb + 8 * s + i)
            q = nibble(wa, i)
            a0 = vfma(q, u, a0)
            b0 = vfma(q, v, b0)
            if two:
                q = nibble(wb, i)
                c0 = vfma(q, u, c0)
                e0 = vfma(q, v, e0)
            u = vbcast(xs0, xb + 8 * s + i + 1)
            v = vbcast(xs1, xb + 8 * s + i + 1)
            q = nibble(wa, i + 1)
            a1 = vfma(q, u, a1)
            b1 = vfma(q, v, b1)
            if two:
                q = nibble(wb, i + 1)
                c1 = vfma(q, u, c1)
                e1 = vfma(q, v, e1)
    return vadd(a0, a1), vadd(b0, b1), vadd(c0, c1), vadd(e0, e1)


@njit(cache=True, nogil=True, inline="always")
def _dot2_q4(buf, r, xs0, xs1, xb):
    """_dot_q4 for two rows, each row's sums bitwise equal to _dot_q4's: groups 0 and 1 in one pass
    (8 accumulators), group 2 in a second (a single pass would need 12 and spill). Returns
    (g0 x0, g1 x0, g2 x0, g0 x1, g1 x1, g2 x1)."""
    a0, c0, a1, c1 = _q4_pass(buf, r, r + 128, xs0, xs1, xb, True)
    a2, c2, _, _ = _q4_pass(buf, r + 256, r + 256, xs0, xs1, xb, False)
    return a0, a1, a2, c0, c1, c2


@njit(cache=True, nogil=True, inline="always")
def _dot2_q4_pairs(buf, r, xs0, xs1, xb):
    """_dot2_q4 in 16-lane vectors: quant_tiles.dot_q4_pairs for each row on the same loads (the
    field extractions, the same for both rows, are computed once by the compiler), each row's sums
    bitwise equal to it. Returns (g0 x0, g1 x0, g2 x0, g0 x1, g1 x1, g2 x1)."""
    a0, a1, a2 = dot_q4_pairs(buf, r, xs0, xb)
    c0, c1, c2 = dot_q4_pairs(buf, r, xs1, xb)
    return a0, a1, a2, c0, c1, c2


@njit(cache=True, nogil=True, inline="always")
def _dot2_q6_pairs(buf, r, xs0, xs1, xb):
    """_dot2_q6 in 16-lane vectors: quant_tiles.dot_q6_pairs for each row on the same loads (the
    field extractions, the same for both rows, are computed once by the compiler), each row's sums
    bitwise equal to it. Returns (A_g0, B_g0, A_g1, B_g1) for x0, then the same four for x1."""
    a0, b0, a1, b1 = dot_q6_pairs(buf, r, xs0, xb)
    e0, f0, e1, f1 = dot_q6_pairs(buf, r, xs1, xb)
    return a0, b0, a1, b1, e0, f0, e1, f1


@njit(cache=True, nogil=True, inline="always")
def _q5_step(wa, wb, xs0, xs1, c, i, acc, two):
    """Fields i (into the even sums) and i + 1 (odd sums) of the dwords wa (wb), columns c, c + 1."""
    a0, a1, b0, b1, c0, c1, e0, e1 = acc
    u = vbcast(xs0, c)
    v = vbcast(xs1, c)
    q = field5(wa, i)
    a0 = vfma(q, u, a0)
    b0 = vfma(q, v, b0)
    if two:
        q = field5(wb, i)
        c0 = vfma(q, u, c0)
        e0 = vfma(q, v, e0)
    u = vbcast(xs0, c + 1)
    v = vbcast(xs1, c + 1)
    q = field5(wa, i + 1)
    a1 = vfma(q, u, a1)
    b1 = vfma(q, v, b1)
    if two:
        q = field5(wb, i + 1)
        c1 = vfma(q, u, c1)
        e1 = vfma(q, v, e1)
    return a0, a1, b0, b1, c0, c1, e0, e1


@njit(cache=True, nogil=True, inline="always")
def _q5_pass(buf, ra, rb, xs0, xs1, xb, two):
    """As _q4_pass for 5-bit field dwords (6 x 32 bytes per group; dword m holds columns 6m..6m+5,
    dword 5 columns 30, 31), with _dot_q5's accumulation order."""
    z = vzero()
    acc = (z, z, z, z, z, z, z, z)
    for m in range(5):
        wa = ld_i32(buf, ra + 32 * m)
        wb = ld_i32(buf, rb + 32 * m) if two else wa
        for i in range(0, 6, 2):
            acc = _q5_step(wa, wb, xs0, xs1, xb + 6 * m + i, i, acc, two)
    wa = ld_i32(buf, ra + 160)
    wb = ld_i32(buf, rb + 160) if two else wa
    a0, a1, b0, b1, c0, c1, e0, e1 = _q5_step(wa, wb, xs0, xs1, xb + 30, 0, acc, two)
    return vadd(a0, a1), vadd(b0, b1), vadd(c0, c1), vadd(e0, e1)


@njit(cache=True, nogil=True, inline="always")
def _dot2_q5(buf, r, xs0, xs1, xb):
    """_dot_q5 for two rows (bitwise equal per row, two passes as _dot2_q4). Returns
    (g0 x0, g1 x0, g2 x0, g0 x1, g1 x1, g2 x1)."""
    a0, c0, a1, c1 = _q5_pass(buf, r, r + 192, xs0, xs1, xb, True)
    a2, c2, _, _ = _q5_pass(buf, r + 384, r + 384, xs0, xs1, xb, False)
    return a0, a1, a2, c0, c1, c2


@njit(cache=True, nogil=True, inline="always")
def _dot2_q6(buf, r, xs0, xs1, xb):
    """_dot_q6 for two rows: returns (A_g0, B_g0, A_g1, B_g1) for x0, then the same four for x1."""
    a0 = vzero()
    b0 = vzero()
    a1 = vzero()
    b1 = vzero()
    e0 = vzero()
    f0 = vzero()
    e1 = vzero()
    f1 = vzero()
    for m in range(3):
        wa0 = ld_i32(buf, r + 32 * m)
        wb0 = ld_i32(buf, r + 96 + 32 * m)
        wa1 = ld_i32(buf, r + 192 + 32 * m)
        wb1 = ld_i32(buf, r + 288 + 32 * m)
        for i in range(5):
            u = vbcast(xs0, xb + 5 * m + i)
            v = vbcast(xs1, xb + 5 * m + i)
            q = field6(wa0, i)
            a0 = vfma(q, u, a0)
            e0 = vfma(q, v, e0)
            q = field6(wa1, i)
            a1 = vfma(q, u, a1)
            e1 = vfma(q, v, e1)
            u = vbcast(xs0, xb + 16 + 5 * m + i)
            v = vbcast(xs1, xb + 16 + 5 * m + i)
            q = field6(wb0, i)
            b0 = vfma(q, u, b0)
            f0 = vfma(q, v, f0)
            q = field6(wb1, i)
            b1 = vfma(q, u, b1)
            f1 = vfma(q, v, f1)
        k = vsplat(np.float32(1 << (2 * m)))
        u = vmul(vbcast(xs0, xb + 15), k)
        v = vmul(vbcast(xs1, xb + 15), k)
        q = srlf(wa0, 30)
        a0 = vfma(q, u, a0)
        e0 = vfma(q, v, e0)
        q = srlf(wa1, 30)
        a1 = vfma(q, u, a1)
        e1 = vfma(q, v, e1)
        u = vmul(vbcast(xs0, xb + 31), k)
        v = vmul(vbcast(xs1, xb + 31), k)
        q = srlf(wb0, 30)
        b0 = vfma(q, u, b0)
        f0 = vfma(q, v, f0)
        q = srlf(wb1, 30)
        b1 = vfma(q, u, b1)
        f1 = vfma(q, v, f1)
    return a0, b0, a1, b1, e0, f0, e1, f1


@njit(cache=True, nogil=True, fastmath=False)
def _runtime(v):
    """v as a plain int64: a constant passed through it reaches a callee as a run-time value, not a
    literal, so one compiled body serves every caller."""
    return np.int64(v)


@njit(cache=True, nogil=True, inline="always")
def _store3(dst, d0, o0, o1, o2):
    """dst[d0:d0 + 24] = the three group accumulators."""
    vstore(dst, d0, o0)
    vstore(dst, d0 + 8, o1)
    vstore(dst, d0 + 16, o2)


# ==================================================================================================
# Legacy blocks (Q4_0, Q4_1, Q5_0, Q5_1: 24-row tiles; Q8_0: 16 rows)
# ==================================================================================================

@njit(cache=True, nogil=True, fastmath=False)
def _tile2_legacy(dst0, dst1, d0, buf, base, nb, xs0, xsum0, xs1, xsum1, rec, bits, has_min):
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 tile for two rows: y = d q + m (has_min) or d (q - 2^(bits - 1)),
    folded per block as d * sum(q x) + m * S_b or d * (sum(q x) - 2^(bits - 1) S_b). Record: fields
    (3 x 128 or 3 x 192 bytes), d [3][8] f16, then m [3][8] f16 if has_min. The callers pass rec,
    bits and has_min as run-time int64 (_runtime), so the four types share one compiled body (a
    literal would make Numba compile one per type, ~3 s each) at the cost of a predictable branch
    per block."""
    fo = 384 if bits == 4 else 576
    off = np.float32(8.0 if bits == 4 else 16.0)
    o0 = vzero()
    o1 = vzero()
    o2 = vzero()
    p0 = vzero()
    p1 = vzero()
    p2 = vzero()
    for b in range(nb):
        r = base + b * rec
        prefetch_range(buf, r + PF_DIST, rec)
        if bits == 4:
            a0, a1, a2, c0, c1, c2 = _dot2_q4(buf, r, xs0, xs1, b * QK)
        else:
            a0, a1, a2, c0, c1, c2 = _dot2_q5(buf, r, xs0, xs1, b * QK)
        s0 = vbcast(xsum0, b)
        s1 = vbcast(xsum1, b)
        e0 = ld_f16(buf, r + fo)
        e1 = ld_f16(buf, r + fo + 16)
        e2 = ld_f16(buf, r + fo + 32)
        if has_min:
            o0 = vfma(e0, a0, o0)
            o1 = vfma(e1, a1, o1)
            o2 = vfma(e2, a2, o2)
            p0 = vfma(e0, c0, p0)
            p1 = vfma(e1, c1, p1)
            p2 = vfma(e2, c2, p2)
            e0 = ld_f16(buf, r + fo + 48)
            e1 = ld_f16(buf, r + fo + 64)
            e2 = ld_f16(buf, r + fo + 80)
            o0 = vfma(e0, s0, o0)
            o1 = vfma(e1, s0, o1)
            o2 = vfma(e2, s0, o2)
            p0 = vfma(e0, s1, p0)
            p1 = vfma(e1, s1, p1)
            p2 = vfma(e2, s1, p2)
        else:
            s0 = vmul(s0, vsplat(off))
            s1 = vmul(s1, vsplat(off))
            o0 = vfma(e0, vsub(a0, s0), o0)
            o1 = vfma(e1, vsub(a1, s0), o1)
            o2 = vfma(e2, vsub(a2, s0), o2)
            p0 = vfma(e0, vsub(c0, s1), p0)
            p1 = vfma(e1, vsub(c1, s1), p1)
            p2 = vfma(e2, vsub(c2, s1), p2)
    _store3(dst0, d0, o0, o1, o2)
    _store3(dst1, d0, p0, p1, p2)


@njit(cache=True, nogil=True, fastmath=False)
def tile2_q4_0(dst0, dst1, d0, buf, base, nb, xs0, xsum0, xs1, xsum1):
    """Q4_0 tile (24 rows) for two rows of x."""
    _tile2_legacy(dst0, dst1, d0, buf, base, nb, xs0, xsum0, xs1, xsum1, _runtime(REC_Q4_0), _runtime(4), _runtime(0))


@njit(cache=True, nogil=True, fastmath=False)
def tile2_q4_1(dst0, dst1, d0, buf, base, nb, xs0, xsum0, xs1, xsum1):
    """Q4_1 tile (24 rows) for two rows of x."""
    _tile2_legacy(dst0, dst1, d0, buf, base, nb, xs0, xsum0, xs1, xsum1, _runtime(REC_Q4_1), _runtime(4), _runtime(1))


@njit(cache=True, nogil=True, fastmath=False)
def tile2_q5_0(dst0, dst1, d0, buf, base, nb, xs0, xsum0, xs1, xsum1):
    """Q5_0 tile (24 rows) for two rows of x."""
    _tile2_legacy(dst0, dst1, d0, buf, base, nb, xs0, xsum0, xs1, xsum1, _runtime(REC_Q5_0), _runtime(5), _runtime(0))


@njit(cache=True, nogil=True, fastmath=False)
def tile2_q5_1(dst0, dst1, d0, buf, base, nb, xs0, xsum0, xs1, xsum1):
    """Q5_1 tile (24 rows) for two rows of x."""
    _tile2_legacy(dst0, dst1, d0, buf, base, nb, xs0, xsum0, xs1, xsum1, _runtime(REC_Q5_1), _runtime(5), _runtime(1))


@njit(cache=True, nogil=True, inline="always")
def _q8_pair(buf, ra, rb, xs0, xs1, c, acc):
    """One column c of two groups' int8 values (8 bytes at ra, rb) times two rows: acc (g0 x0, g1 x0,
    g0 x1, g1 x1) += q * x[c]."""
    a, b, e, f = acc
    u = vbcast(xs0, c)
    v = vbcast(xs1, c)
    q = ld_i8(buf, ra)
    a = vfma(q, u, a)
    e = vfma(q, v, e)
    q = ld_i8(buf, rb)
    b = vfma(q, u, b)
    f = vfma(q, v, f)
    return a, b, e, f


@njit(cache=True, nogil=True, fastmath=False)
def tile2_q8_0(dst0, dst1, d0, buf, base, nb, x0, x1):
    """Q8_0 tile (16 rows) for two rows of x: y = d q, q int8 [col][lane] per group; even and odd
    columns summed apart as tile_q8_0 does."""
    o0 = vzero()
    o1 = vzero()
    p0 = vzero()
    p1 = vzero()
    z = vzero()
    for b in range(nb):
        r = base + b * REC_Q8_0
        prefetch_range(buf, r + PF_DIST, REC_Q8_0)
        ev = (z, z, z, z)
        od = (z, z, z, z)
        xb = b * QK
        for j in range(0, 32, 2):
            ev = _q8_pair(buf, r + 8 * j, r + 256 + 8 * j, x0, x1, xb + j, ev)
            od = _q8_pair(buf, r + 8 * j + 8, r + 256 + 8 * j + 8, x0, x1, xb + j + 1, od)
        e0 = ld_f16(buf, r + 512)
        e1 = ld_f16(buf, r + 528)
        o0 = vfma(e0, vadd(ev[0], od[0]), o0)
        o1 = vfma(e1, vadd(ev[1], od[1]), o1)
        p0 = vfma(e0, vadd(ev[2], od[2]), p0)
        p1 = vfma(e1, vadd(ev[3], od[3]), p1)
    vstore(dst0, d0, o0)
    vstore(dst0, d0 + 8, o1)
    vstore(dst1, d0, p0)
    vstore(dst1, d0 + 8, p1)


# ==================================================================================================
# K-quants (Q4_K, Q5_K: 24-row tiles; Q6_K: 16 rows)
# ==================================================================================================

@njit(cache=True, nogil=True, fastmath=False)
def _tile2_kquant45(dst0, dst1, d0, buf, base, nb, xs0, xsum0, xs1, xsum1, rec, bits):
    """Q4_K / Q5_K tile for two rows: per 32-value sub-block j, y = (d sc_j) q - (dmin m_j). Record
    as tile_q4_k / tile_q5_k (d, dmin [3][8] f16, sc, mn [8][3][8] u8, then the fields)."""
    fs = 384 if bits == 4 else 576
    o0 = vzero()
    o1 = vzero()
    o2 = vzero()
    p0 = vzero()
    p1 = vzero()
    p2 = vzero()
    for b in range(nb):
        r = base + b * rec
        dd0 = ld_f16(buf, r)
        dd1 = ld_f16(buf, r + 16)
        dd2 = ld_f16(buf, r + 32)
        for j in range(8):
            prefetch_range(buf, r + PF_DIST + j * (rec // 8), rec // 8)
            if bits == 4:
                a0, a1, a2, c0, c1, c2 = _dot2_q4(buf, r + 480 + fs * j, xs0, xs1, b * QK_K + QK * j)
            else:
                a0, a1, a2, c0, c1, c2 = _dot2_q5(buf, r + 480 + fs * j, xs0, xs1, b * QK_K + QK * j)
            s0 = vbcast(xsum0, b * 8 + j)
            s1 = vbcast(xsum1, b * 8 + j)
            e0 = vmul(dd0, ld_u8(buf, r + 96 + 24 * j))
            e1 = vmul(dd1, ld_u8(buf, r + 104 + 24 * j))
            e2 = vmul(dd2, ld_u8(buf, r + 112 + 24 * j))
            o0 = vfma(e0, a0, o0)
            o1 = vfma(e1, a1, o1)
            o2 = vfma(e2, a2, o2)
            p0 = vfma(e0, c0, p0)
            p1 = vfma(e1, c1, p1)
            p2 = vfma(e2, c2, p2)
            e0 = vmul(ld_f16(buf, r + 48), ld_u8(buf, r + 288 + 24 * j))
            e1 = vmul(ld_f16(buf, r + 64), ld_u8(buf, r + 296 + 24 * j))
            e2 = vmul(ld_f16(buf, r + 80), ld_u8(buf, r + 304 + 24 * j))
            o0 = vfnma(e0, s0, o0)
            o1 = vfnma(e1, s0, o1)
            o2 = vfnma(e2, s0, o2)
            p0 = vfnma(e0, s1, p0)
            p1 = vfnma(e1, s1, p1)
            p2 = vfnma(e2, s1, p2)
    _store3(dst0, d0, o0, o1, o2)
    _store3(dst1, d0, p0, p1, p2)


@njit(cache=True, nogil=True, fastmath=False)
def tile2_q4_k(dst0, dst1, d0, buf, base, nb, xs0, xsum0, xs1, xsum1):
    """Q4_K tile (24 rows) for two rows of x."""
    _tile2_kquant45(dst0, dst1, d0, buf, base, nb, xs0, xsum0, xs1, xsum1, _runtime(REC_Q4_K), _runtime(4))


@njit(cache=True, nogil=True, fastmath=False)
def tile2_q5_k(dst0, dst1, d0, buf, base, nb, xs0, xsum0, xs1, xsum1):
    """Q5_K tile (24 rows) for two rows of x."""
    _tile2_kquant45(dst0, dst1, d0, buf, base, nb, xs0, xsum0, xs1, xsum1, _runtime(REC_Q5_K), _runtime(5))


@njit(cache=True, nogil=True, fastmath=False)
def tile2_q6_k(dst0, dst1, d0, buf, base, nb, xs0, xsum0, xs1, xsum1):
    """Q6_K tile (16 rows) for two rows of x: per 16-value sub-block u, y = (d sc_u) (q - 32)."""
    o0 = vzero()
    o1 = vzero()
    p0 = vzero()
    p1 = vzero()
    k32 = vsplat(np.float32(32.0))
    for b in range(nb):
        r = base + b * REC_Q6_K
        dd0 = ld_f16(buf, r)
        dd1 = ld_f16(buf, r + 16)
        for j in range(8):
            prefetch_range(buf, r + PF_DIST + j * (REC_Q6_K // 8), REC_Q6_K // 8)
            a0, b0, a1, b1, c0, f0, c1, f1 = _dot2_q6(buf, r + 288 + 384 * j, xs0, xs1, b * QK_K + QK * j)
            u = 2 * j
            sa0 = vmul(vbcast(xsum0, b * 16 + u), k32)
            sb0 = vmul(vbcast(xsum0, b * 16 + u + 1), k32)
            sa1 = vmul(vbcast(xsum1, b * 16 + u), k32)
            sb1 = vmul(vbcast(xsum1, b * 16 + u + 1), k32)
            e0 = vmul(dd0, ld_i8(buf, r + 32 + 16 * u))
            e1 = vmul(dd1, ld_i8(buf, r + 40 + 16 * u))
            o0 = vfma(e0, vsub(a0, sa0), o0)
            o1 = vfma(e1, vsub(a1, sa0), o1)
            p0 = vfma(e0, vsub(c0, sa1), p0)
            p1 = vfma(e1, vsub(c1, sa1), p1)
            e0 = vmul(dd0, ld_i8(buf, r + 48 + 16 * u))
            e1 = vmul(dd1, ld_i8(buf, r + 56 + 16 * u))
            o0 = vfma(e0, vsub(b0, sb0), o0)
            o1 = vfma(e1, vsub(b1, sb0), o1)
            p0 = vfma(e0, vsub(f0, sb1), p0)
            p1 = vfma(e1, vsub(f1, sb1), p1)
    vstore(dst0, d0, o0)
    vstore(dst0, d0 + 8, o1)
    vstore(dst1, d0, p0)
    vstore(dst1, d0 + 8, p1)


# ==================================================================================================
# Float types (16-row tiles, one column per record)
# ==================================================================================================

@njit(cache=True, nogil=True, inline="always")
def _float_pair(buf, r, kind, xs0, xs1, c, acc):
    """One column c (record at byte r: [2 groups][8 lanes]) times two rows: acc (g0 x0, g1 x0, g0 x1,
    g1 x1) += w * x[c]."""
    if kind == 1:
        w0 = ld_f32(buf, r)
        w1 = ld_f32(buf, r + 32)
    elif kind == 0:
        w0 = ld_f16(buf, r)
        w1 = ld_f16(buf, r + 16)
    else:
        w0 = ld_bf16(buf, r)
        w1 = ld_bf16(buf, r + 16)
    a, b, e, f = acc
    u = vbcast(xs0, c)
    v = vbcast(xs1, c)
    return vfma(w0, u, a), vfma(w1, u, b), vfma(w0, v, e), vfma(w1, v, f)


@njit(cache=True, nogil=True, fastmath=False)
def _tile2_float(dst0, dst1, d0, buf, base, nb, x0, x1, kind):
    """F16 (kind 0) / F32 (1) / BF16 (2) tile for two rows: nb = n_cols, per column [2 groups][8 lanes];
    even and odd columns summed apart as tile_f16 / tile_f32 / tile_bf16 do."""
    rec = REC_F32 if kind == 1 else REC_F16
    z = vzero()
    ev = (z, z, z, z)
    od = (z, z, z, z)
    n2 = nb - nb % 2
    for c in range(0, n2, 2):
        r = base + c * rec
        if kind == 1:
            prefetch_range(buf, r + PF_DIST, 2 * REC_F32)
        else:
            prefetch(buf, r + PF_DIST)
        ev = _float_pair(buf, r, kind, x0, x1, c, ev)
        od = _float_pair(buf, r + rec, kind, x0, x1, c + 1, od)
    if n2 < nb:
        ev = _float_pair(buf, base + n2 * rec, kind, x0, x1, n2, ev)
    vstore(dst0, d0, vadd(ev[0], od[0]))
    vstore(dst0, d0 + 8, vadd(ev[1], od[1]))
    vstore(dst1, d0, vadd(ev[2], od[2]))
    vstore(dst1, d0 + 8, vadd(ev[3], od[3]))


@njit(cache=True, nogil=True, fastmath=False)
def tile2_f16(dst0, dst1, d0, buf, base, nb, x0, x1):
    """F16 tile (16 rows) for two rows of x."""
    _tile2_float(dst0, dst1, d0, buf, base, nb, x0, x1, _runtime(0))


@njit(cache=True, nogil=True, fastmath=False)
def tile2_f32(dst0, dst1, d0, buf, base, nb, x0, x1):
    """F32 tile (16 rows) for two rows of x."""
    _tile2_float(dst0, dst1, d0, buf, base, nb, x0, x1, _runtime(1))


@njit(cache=True, nogil=True, fastmath=False)
def tile2_bf16(dst0, dst1, d0, buf, base, nb, x0, x1):
    """BF16 tile (16 rows) for two rows of x."""
    _tile2_float(dst0, dst1, d0, buf, base, nb, x0, x1, _runtime(2))


# ==================================================================================================
# 16-lane variants of the 4-bit and Q6_K two-row kernels (CPUs with 512-bit SIMD: the few-row
# products of the types whose matvec is quant_tiles' 16-lane one, which they equal bitwise per row):
# the kernels above with _dot2_q4 / _dot2_q6 bound to _dot2_q4_pairs / _dot2_q6_pairs.
# ==================================================================================================

_tile2_legacy_pairs = njit(cache=True, nogil=True, fastmath=False)(
    bind_copy(_tile2_legacy.py_func, "_tile2_legacy_pairs", dict(globals(), _dot2_q4=_dot2_q4_pairs)))
_tile2_kquant45_pairs = njit(cache=True, nogil=True, fastmath=False)(
    bind_copy(_tile2_kquant45.py_func, "_tile2_kquant45_pairs", dict(globals(), _dot2_q4=_dot2_q4_pairs)))
_PAIR_NS = dict(globals(), _tile2_legacy=_tile2_legacy_pairs, _tile2_kquant45=_tile2_kquant45_pairs,
                _dot2_q6=_dot2_q6_pairs)
for _tile in (tile2_q4_0, tile2_q4_1, tile2_q4_k, tile2_q6_k):
    globals()[_tile.__name__ + "_pairs"] = njit(cache=True, nogil=True, fastmath=False)(
        bind_copy(_tile.py_func, _tile.__name__ + "_pairs", _PAIR_NS))
