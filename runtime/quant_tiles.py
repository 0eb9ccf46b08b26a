"""Per-type tile kernels of the packed matvec: one tile of rows of W times x, for each GGML type.

A tile kernel computes dst[d0:d0 + R] = (the R rows of one tile of W) @ x, all columns, and is
called by the entry kernels of matvec_kernels.py once per tile (in prange). R = 24 (three groups of
8 rows) for the 2- to 5-bit types (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q2_K, Q3_K, IQ4_NL, IQ4_XS),
whose inner loops leave registers for a third group and so reuse each x broadcast three times; R = 16
(two groups) for the
others (Q8_0, Q6_K, F16, BF16, F32). This file also fixes the packed layout the kernels read and
packing.py writes: the tile size, the record sizes (REC_*) and the byte offsets inside a record.

Layout ("lanes = rows"). Rows go in groups of 8, one group per 256-bit register: lane k of every
vector belongs to row 8g + k; rows past n_rows are zero padding. For each tile, the data of one block
column (32 values; 256 for K-quants; one column for the float types) of all its groups is one
contiguous record, and a tile is its records in column order, so a thread streams one contiguous run
of memory (with software prefetch PF_DIST bytes ahead). Per 8 weights (one value of 8 rows) the inner
loop is

    vandps / vpsrld  (pick the 4/5/6-bit field in place)      1 op
    vcvtdq2ps        (int -> float)                            1 op
    vfmadd213ps      (acc += q * x[col], x broadcast)          1 op; one vbroadcastss per 2-3 groups

Packed quants. Each lane's values sit in 32-bit words as fixed-width fields: 4-bit types 8 fields
per dword (column 8s + i of a block at bits 4i of dword s), 5-bit types 6 per dword (column 6m + i at
bits 5i of dword m; the block's last 2 columns in a sixth dword), Q6_K 5 per dword at bits 6i, each
16-value sub-block in 3 dwords whose top 2 bits carry the sub-block's 16th value in three pieces
(6 dwords per 32 columns: exactly the file's 6 bits per value; the split value costs 6 more ops
per 16 values, less than the 15% more bytes a seventh dword cost when decode reads at memory speed).
`dword & (mask << w i)` is q * 2^(w i) exactly, so x is pre-scaled once per call by 2^(-w i)
(xs, see matvec_kernels.x_scales; the top field uses a shift and an unscaled x). Q8_0 keeps int8
values, the 8 rows of a column adjacent (vpmovsxbd). F16 scales stay 16-bit (vcvtph2ps); K-quant
6-bit sub-block scales become bytes; F16 / BF16 weights stay 16-bit. Packed bytes per weight equal
the file's for Q4_0, Q4_1, Q4_K, Q6_K, Q8_0 and the float types; the field packing costs +18% for
the 5-bit types (26 instead of 22 bytes per Q5_0 block), repaid by an inner loop as short as the
4-bit one (ORing high-bit planes into nibbles instead needs ~9 more ops per 64 weights).

16-lane kernels. On a CPU with 512-bit SIMD (simd.HAS_AVX512) the 4-bit types and Q6_K (PAIR_TYPES)
run variants whose one i32x16 load holds two adjacent 8-lane slots of a group (same rows, other
columns) against an x pair (zpair), so each and / convert / FMA does 16 weights; the halves are
summed at the end of each block (dot_q4_pairs, dot_q6_pairs). Same records; results equal the
8-lane kernels' up to summation order.

Low-bit and non-linear types. Q2_K keeps its 2-bit values as 16 fields per dword (bytes per weight
equal the file's, its scale|min bytes as stored). Q3_K stores q + 4 (0..7) in nibbles, +33% bytes,
for the 4-bit inner loop. IQ4_NL / IQ4_XS keep the file's 4-bit indices; per dword two vpshufb
(lut16, table IQ4_LUT) turn them into bytes u = kvalue + 128, read like 8-bit fields, and the -128
is folded with the block sums of x as Q4_0's -8 is. Every type's inner loop converts one int field
to float per 8 weights (vcvtdq2ps), which bounds the weights per cycle: the 2-bit type streams fewer
bytes per weight than the 4-bit ones but decodes no faster per weight.

Offsets are folded per block with the sums of x over each block (xsum, computed once per call and
shared by all rows): Q4_1: y = d q + m -> d * sum(q x) + m * S_b; Q4_0: d * (sum(q x) - 8 S_b), etc.

Arguments common to every tile kernel: dst float32 (>= d0 + R,); buf the packed uint8 records;
base the byte offset of the tile's first record; nb blocks (super-blocks for K-quants, columns for
the float types) per row; then either xs (n_cols,) pre-scaled x and xsum (n_cols // 32, or // 16 for
Q6_K) block sums, or x (n_cols,) as is (Q8_0 and the float types). Nothing is bounds-checked.
"""
import numpy as np
from numba import njit

from ringllm.runtime.kernel_copies import bind_copy
from ringllm.runtime.quant_types import GGMLType
from ringllm.runtime.simd import (andf, iand, isrl, ld_bf16, ld_f16, ld_f32, ld_i8, ld_i32, ld_u8, ld_u8i, lut16,
                                  prefetch, srlf, vadd, vbcast, vfma, vfnma, vmul, vsplat, vstore, vsub, vzero,
                                  zadd, zfma, zfold, zhi, zld_i32, zlo, zload, zmul, zpair, zzero)

TILE = 16           # rows per tile: two groups of 8 lanes ...
TILE3 = 24          # ... or three for the 4- and 5-bit types (more reuse of each x broadcast)
GROUP = 8           # rows per 256-bit vector
QK = 32             # values per legacy block
QK_K = 256          # values per K-quant super-block
PF_DIST = 2048      # software prefetch distance in bytes

_TILE3_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q5_K,
                GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.IQ4_NL, GGMLType.IQ4_XS)

# kvalues_iq4nl + 128 (ggml-common.h; all in 1..241, so unsigned bytes), twice: the 16-byte table of
# lut16 (vpshufb) in both 128-bit halves. Read-only; Numba freezes it into the kernels as a constant.
IQ4_LUT = (np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113] * 2, np.int16)
           + 128).astype(np.uint8)
IQ4_LUT.setflags(write=False)


def tile_rows(qtype: GGMLType) -> int:
    """Rows per tile of the packed layout of qtype: 24 for the 2- to 5-bit types, else 16."""
    return TILE3 if qtype in _TILE3_TYPES else TILE


# ==================================================================================================
# Block inner products for the groups of a tile. Each returns one accumulator per group: per lane,
# the sum over the block's columns of q * x (q the raw unsigned field, x from the matching xs).
# ==================================================================================================

@njit(cache=True, nogil=True, inline="always")
def prefetch_range(buf, start, nbytes):
    """prefetch every 64-byte line of buf[start:start + nbytes] (nbytes a constant)."""
    for pf in range(0, nbytes, 64):
        prefetch(buf, start + pf)


@njit(cache=True, nogil=True, inline="always")
def nibble(w, i):
    """Nibble i (0..7) of every lane of w (i32x8 or i32x16), as float q * 2^(4i) (i < 7) or q (i == 7)."""
    if i == 7:
        return srlf(w, 28)
    return andf(w, 15 << (4 * i))


@njit(cache=True, nogil=True, inline="always")
def _dot_q4(buf, r, xs, xb):
    """32 columns of 4-bit values for three groups: nibble dwords of group g at byte r + 128 g
    (4 slots x 32 bytes); xs from prep_x, columns xb..xb+31. Returns (acc_g0, acc_g1, acc_g2)."""
    a0 = vzero()
    a1 = vzero()
    c0 = vzero()
    c1 = vzero()
    e0 = vzero()
    e1 = vzero()
    for s in range(4):
        w0 = ld_i32(buf, r + 32 * s)
        w1 = ld_i32(buf, r + 128 + 32 * s)
        w2 = ld_i32(buf, r + 256 + 32 * s)
        for i in range(0, 8, 2):
            x0 = vbcast(xs, xb + 8 * s + i)
            a0 = vfma(nibble(w0, i), x0, a0)
            c0 = vfma(nibble(w1, i), x0, c0)
            e0 = vfma(nibble(w2, i), x0, e0)
            x1 = vbcast(xs, xb + 8 * s + i + 1)
            a1 = vfma(nibble(w0, i + 1), x1, a1)
            c1 = vfma(nibble(w1, i + 1), x1, c1)
            e1 = vfma(nibble(w2, i + 1), x1, e1)
    return vadd(a0, a1), vadd(c0, c1), vadd(e0, e1)


@njit(cache=True, nogil=True, inline="always")
def dot_q4_pairs(buf, r, xs, xb):
    """_dot_q4 in 16-lane vectors, for CPUs with 512-bit SIMD: one i32x16 load holds slots 2p and
    2p + 1 of a group (the same 8 rows; columns 16p + i and 16p + 8 + i at field i), multiplied by
    the x pair (zpair: xs of the first column in lanes 0-7, of the second in lanes 8-15), so each
    and / convert / FMA does 16 weights. The halves are summed at the end (zfold). Same products as
    _dot_q4, summed in another order. (The pairs are built in registers: a table of them in memory,
    8 n_cols floats, measured faster with the weights in cache but slower streaming them from DRAM,
    where it crowds the weights out of L1.)"""
    a0 = zzero()
    a1 = zzero()
    c0 = zzero()
    c1 = zzero()
    e0 = zzero()
    e1 = zzero()
    for p in range(2):
        w0 = zld_i32(buf, r + 64 * p)
        w1 = zld_i32(buf, r + 128 + 64 * p)
        w2 = zld_i32(buf, r + 256 + 64 * p)
        c = xb + 16 * p
        for i in range(0, 8, 2):
            x0 = zpair(xs, c + i, c + 8 + i)
            a0 = zfma(nibble(w0, i), x0, a0)
            c0 = zfma(nibble(w1, i), x0, c0)
            e0 = zfma(nibble(w2, i), x0, e0)
            x1 = zpair(xs, c + i + 1, c + 9 + i)
            a1 = zfma(nibble(w0, i + 1), x1, a1)
            c1 = zfma(nibble(w1, i + 1), x1, c1)
            e1 = zfma(nibble(w2, i + 1), x1, e1)
    return zfold(zadd(a0, a1)), zfold(zadd(c0, c1)), zfold(zadd(e0, e1))


@njit(cache=True, nogil=True, inline="always")
def field5(w, i):
    """5-bit field i (0..5, bits 5i..5i+4) of every lane of w, as float q * 2^(5i) (i < 5) or q."""
    if i == 5:
        return srlf(w, 25)
    return andf(w, 0x1F << (5 * i))


@njit(cache=True, nogil=True, inline="always")
def _dot_q5(buf, r, xs, xb):
    """32 columns of 5-bit values for three groups: field dwords of group g at byte r + 192 g (6 x 32
    bytes; dword m holds columns 6m..6m+5, dword 5 columns 30, 31); xs from prep_x."""
    a0 = vzero()
    a1 = vzero()
    c0 = vzero()
    c1 = vzero()
    e0 = vzero()
    e1 = vzero()
    for m in range(5):
        w0 = ld_i32(buf, r + 32 * m)
        w1 = ld_i32(buf, r + 192 + 32 * m)
        w2 = ld_i32(buf, r + 384 + 32 * m)
        for i in range(0, 6, 2):
            x0 = vbcast(xs, xb + 6 * m + i)
            a0 = vfma(field5(w0, i), x0, a0)
            c0 = vfma(field5(w1, i), x0, c0)
            e0 = vfma(field5(w2, i), x0, e0)
            x1 = vbcast(xs, xb + 6 * m + i + 1)
            a1 = vfma(field5(w0, i + 1), x1, a1)
            c1 = vfma(field5(w1, i + 1), x1, c1)
            e1 = vfma(field5(w2, i + 1), x1, e1)
    w0 = ld_i32(buf, r + 160)
    w1 = ld_i32(buf, r + 352)
    w2 = ld_i32(buf, r + 544)
    x0 = vbcast(xs, xb + 30)
    a0 = vfma(field5(w0, 0), x0, a0)
    c0 = vfma(field5(w1, 0), x0, c0)
    e0 = vfma(field5(w2, 0), x0, e0)
    x1 = vbcast(xs, xb + 31)
    a1 = vfma(field5(w0, 1), x1, a1)
    c1 = vfma(field5(w1, 1), x1, c1)
    e1 = vfma(field5(w2, 1), x1, e1)
    return vadd(a0, a1), vadd(c0, c1), vadd(e0, e1)


@njit(cache=True, nogil=True, inline="always")
def field6(w, i):
    """6-bit field i (0..4, bits 6i..6i+5) of every lane of w (i32x8 or i32x16), as float q * 2^(6i)."""
    return andf(w, 0x3F << (6 * i))


@njit(cache=True, nogil=True, inline="always")
def _dot_q6(buf, r, xs, xb):
    """32 columns (two 16-value sub-blocks A, B) of 6-bit values for two groups: field dwords of group
    g at byte r + 192 g, 6 x 32 bytes: dword m (< 3) of half h (A: h = 0, B: h = 1) at 96 h + 32 m
    holds column 16h + 5m + i at field i and bits 2m, 2m + 1 of column 16h + 15 at bits 30, 31
    (packing._fields6); xs from prep_x. The split column's three 2-bit pieces are multiplied by its x
    times 1, 4 and 16 (exact powers of two). Returns (A_g0, B_g0, A_g1, B_g1)."""
    a0 = vzero()
    b0 = vzero()
    a1 = vzero()
    b1 = vzero()
    for m in range(3):
        wa0 = ld_i32(buf, r + 32 * m)
        wb0 = ld_i32(buf, r + 96 + 32 * m)
        wa1 = ld_i32(buf, r + 192 + 32 * m)
        wb1 = ld_i32(buf, r + 288 + 32 * m)
        for i in range(5):
            xa = vbcast(xs, xb + 5 * m + i)
            a0 = vfma(field6(wa0, i), xa, a0)
            a1 = vfma(field6(wa1, i), xa, a1)
            xv = vbcast(xs, xb + 16 + 5 * m + i)
            b0 = vfma(field6(wb0, i), xv, b0)
            b1 = vfma(field6(wb1, i), xv, b1)
        k = vsplat(np.float32(1 << (2 * m)))
        xa = vmul(vbcast(xs, xb + 15), k)
        a0 = vfma(srlf(wa0, 30), xa, a0)
        a1 = vfma(srlf(wa1, 30), xa, a1)
        xv = vmul(vbcast(xs, xb + 31), k)
        b0 = vfma(srlf(wb0, 30), xv, b0)
        b1 = vfma(srlf(wb1, 30), xv, b1)
    return a0, b0, a1, b1


# The x factors of the split columns' pieces in the 16-lane Q6_K kernel, per pair vector (see
# _dot_q6_pairs): [1 | 4], [16 | 1], [4 | 16], eight lanes each. Read-only; a constant of the kernels.
Q6_PIECE_SCALES = np.repeat(np.array([1, 4, 16, 1, 4, 16], np.float32), 8)
Q6_PIECE_SCALES.setflags(write=False)


@njit(cache=True, nogil=True, inline="always")
def _q6_pairs_group(w0, w1, w2, xs, xb):
    """One group's three i32x16 of a 32-column Q6_K block (dot_q6_pairs) times x: the five fields of
    each against their x pairs, then the split columns' pieces, into [A | A], [A | B] and [B | B]
    accumulators; returns the sub-blocks' sums (A, B) as f32x8."""
    c0 = zzero()
    c1 = zzero()
    c2 = zzero()
    for i in range(5):
        c0 = zfma(field6(w0, i), zpair(xs, xb + i, xb + 5 + i), c0)
        c1 = zfma(field6(w1, i), zpair(xs, xb + 10 + i, xb + 16 + i), c1)
        c2 = zfma(field6(w2, i), zpair(xs, xb + 21 + i, xb + 26 + i), c2)
    c0 = zfma(srlf(w0, 30), zmul(zpair(xs, xb + 15, xb + 15), zload(Q6_PIECE_SCALES, 0)), c0)
    c1 = zfma(srlf(w1, 30), zmul(zpair(xs, xb + 15, xb + 31), zload(Q6_PIECE_SCALES, 16)), c1)
    c2 = zfma(srlf(w2, 30), zmul(zpair(xs, xb + 31, xb + 31), zload(Q6_PIECE_SCALES, 32)), c2)
    return vadd(zfold(c0), zlo(c1)), vadd(zhi(c1), zfold(c2))


@njit(cache=True, nogil=True, inline="always")
def dot_q6_pairs(buf, r, xs, xb):
    """_dot_q6 in 16-lane vectors (CPUs with 512-bit SIMD): a group's six dwords per lane load as
    three i32x16, [A0 | A1], [A2 | B0], [B1 | B2] (halves A: columns 0-15, B: 16-31), so every
    field extraction, conversion and FMA does 16 weights against an x pair (zpair); the middle
    vector's halves belong to different sub-blocks and are added to each separately. Same products
    as _dot_q6, summed in another order. Returns (A_g0, B_g0, A_g1, B_g1)."""
    a0, b0 = _q6_pairs_group(zld_i32(buf, r), zld_i32(buf, r + 64), zld_i32(buf, r + 128), xs, xb)
    a1, b1 = _q6_pairs_group(zld_i32(buf, r + 192), zld_i32(buf, r + 256), zld_i32(buf, r + 320), xs, xb)
    return a0, b0, a1, b1


@njit(cache=True, nogil=True, inline="always")
def _f2(w, i):
    """2-bit field i (0..15, bits 2i..2i+1) of every lane of w, as float q * 2^(2i) (i < 15) or q."""
    if i == 15:
        return srlf(w, 30)
    return andf(w, 3 << (2 * i))


@njit(cache=True, nogil=True, inline="always")
def _dot_q2(buf, r, xs, xb):
    """32 columns (two 16-value sub-blocks A, B) of 2-bit values for three groups: group g's dword of
    sub-block h at byte r + 64 g + 32 h (column 16 h + i at field i); xs from prep_x. Returns
    (A_g0, B_g0, A_g1, B_g1, A_g2, B_g2)."""
    a0 = vzero()
    b0 = vzero()
    a1 = vzero()
    b1 = vzero()
    a2 = vzero()
    b2 = vzero()
    wa0 = ld_i32(buf, r)
    wb0 = ld_i32(buf, r + 32)
    wa1 = ld_i32(buf, r + 64)
    wb1 = ld_i32(buf, r + 96)
    wa2 = ld_i32(buf, r + 128)
    wb2 = ld_i32(buf, r + 160)
    for i in range(16):
        xa = vbcast(xs, xb + i)
        a0 = vfma(_f2(wa0, i), xa, a0)
        a1 = vfma(_f2(wa1, i), xa, a1)
        a2 = vfma(_f2(wa2, i), xa, a2)
        xv = vbcast(xs, xb + 16 + i)
        b0 = vfma(_f2(wb0, i), xv, b0)
        b1 = vfma(_f2(wb1, i), xv, b1)
        b2 = vfma(_f2(wb2, i), xv, b2)
    return a0, b0, a1, b1, a2, b2


@njit(cache=True, nogil=True, inline="always")
def _dot_q4x16(buf, r, xs, xb):
    """As _dot_q4 (nibble dwords of group g at r + 128 g, column 8s + i at field i of dword s), but
    with one accumulator per 16-value sub-block: A = dwords 0, 1, B = dwords 2, 3. Returns
    (A_g0, B_g0, A_g1, B_g1, A_g2, B_g2)."""
    a0 = vzero()
    b0 = vzero()
    a1 = vzero()
    b1 = vzero()
    a2 = vzero()
    b2 = vzero()
    for s in range(2):
        wa0 = ld_i32(buf, r + 32 * s)
        wb0 = ld_i32(buf, r + 64 + 32 * s)
        wa1 = ld_i32(buf, r + 128 + 32 * s)
        wb1 = ld_i32(buf, r + 192 + 32 * s)
        wa2 = ld_i32(buf, r + 256 + 32 * s)
        wb2 = ld_i32(buf, r + 320 + 32 * s)
        for i in range(8):
            xa = vbcast(xs, xb + 8 * s + i)
            a0 = vfma(nibble(wa0, i), xa, a0)
            a1 = vfma(nibble(wa1, i), xa, a1)
            a2 = vfma(nibble(wa2, i), xa, a2)
            xv = vbcast(xs, xb + 16 + 8 * s + i)
            b0 = vfma(nibble(wb0, i), xv, b0)
            b1 = vfma(nibble(wb1, i), xv, b1)
            b2 = vfma(nibble(wb2, i), xv, b2)
    return a0, b0, a1, b1, a2, b2


@njit(cache=True, nogil=True, inline="always")
def _b8(v, k):
    """Byte k (0..3) of every lane of v, as float u * 2^(8k) (k < 3) or u (k == 3)."""
    if k == 3:
        return srlf(v, 24)
    return andf(v, 0xFF << (8 * k))


@njit(cache=True, nogil=True, inline="always")
def _iq4_lookup(buf, off, lut):
    """The nibble dword of 8 lanes at byte off -> (lo, hi): byte k of a lane's lo / hi is
    kvalue + 128 of its low / high nibble of byte k (two vpshufb)."""
    w = ld_i32(buf, off)
    return lut16(lut, iand(w, 0x0F0F0F0F)), lut16(lut, iand(isrl(w, 4), 0x0F0F0F0F))


@njit(cache=True, nogil=True, inline="always")
def _dot_iq4(buf, r, xs, xb, lut):
    """32 columns of IQ4 indices for three groups: nibble dwords of group g at byte r + 128 g; byte k
    of dword s holds column 8s + k (low nibble) and 8s + 4 + k (high nibble). Each dword becomes the
    unsigned levels u = kvalue + 128 by lut16, one byte per column, read like 8-bit fields (xs from
    prep_x). Returns per group the sum of u x."""
    a0 = vzero()
    a1 = vzero()
    a2 = vzero()
    c0 = vzero()
    c1 = vzero()
    c2 = vzero()
    for s in range(4):
        l0, h0 = _iq4_lookup(buf, r + 32 * s, lut)
        l1, h1 = _iq4_lookup(buf, r + 128 + 32 * s, lut)
        l2, h2 = _iq4_lookup(buf, r + 256 + 32 * s, lut)
        for k in range(4):
            x0 = vbcast(xs, xb + 8 * s + k)
            a0 = vfma(_b8(l0, k), x0, a0)
            a1 = vfma(_b8(l1, k), x0, a1)
            a2 = vfma(_b8(l2, k), x0, a2)
            x1 = vbcast(xs, xb + 8 * s + 4 + k)
            c0 = vfma(_b8(h0, k), x1, c0)
            c1 = vfma(_b8(h1, k), x1, c1)
            c2 = vfma(_b8(h2, k), x1, c2)
    return vadd(a0, c0), vadd(a1, c1), vadd(a2, c2)


# ==================================================================================================
# Tile kernels: one tile (24 rows for the 4- and 5-bit types, else 16) of one type, all columns:
# dst[d0:d0 + rows] = the rows of the tile whose records start at byte `base` of buf.
# nb = blocks (super-blocks for K-quants, columns for float types) per row.
# ==================================================================================================

# record sizes in bytes, per (tile, block)
REC_Q4_0 = 3 * 128 + 3 * 16              # nibbles, d (three groups: 24-row tiles)
REC_Q4_1 = 3 * 128 + 3 * 16 + 3 * 16     # nibbles, d, m (three groups)
REC_Q5_0 = 3 * 192 + 3 * 16              # 5-bit field dwords, d (three groups)
REC_Q5_1 = 3 * 192 + 3 * 16 + 3 * 16     # fields, d, m (three groups)
REC_Q8_0 = 2 * 256 + 2 * 16              # int8 [col][lane] per group, d
REC_Q4_K = 3 * 16 * 2 + 3 * 64 * 2 + 8 * 3 * 128           # d, dmin, sc, mn, nibbles (three groups)
REC_Q5_K = 3 * 16 * 2 + 3 * 64 * 2 + 8 * 3 * 192           # d, dmin, sc, mn, fields (three groups)
REC_Q6_K = 2 * 16 + 16 * 2 * 8 + 8 * 2 * 192                # d, sc, fields per 32 cols (two groups)
REC_Q2_K = 3 * 16 * 2 + 16 * 24 + 8 * 3 * 64              # d, dmin, scale|min bytes, 2-bit fields
REC_Q3_K = 3 * 16 + 16 * 24 + 8 * 3 * 128                  # d, int8 scales, nibbles (three groups)
REC_IQ4_NL = 3 * 128 + 3 * 16                              # index nibbles, d (three groups)
REC_IQ4_XS = 3 * 16 + 8 * 24 + 8 * 3 * 128                 # d, int8 scales, index nibbles
REC_F16 = 2 * 16                         # per column (F16 and BF16)
REC_F32 = 2 * 32                         # per column (F32)


@njit(cache=True, nogil=True, fastmath=False)
def tile_q4_0(dst, d0, buf, base, nb, xs, xsum):
    """Q4_0 tile (24 rows): y = d (q - 8) -> d * (sum q x - 8 S_b)."""
    o0 = vzero()
    o1 = vzero()
    o2 = vzero()
    for b in range(nb):
        r = base + b * REC_Q4_0
        prefetch_range(buf, r + PF_DIST, REC_Q4_0)
        a0, a1, a2 = _dot_q4(buf, r, xs, b * QK)
        s8 = vmul(vbcast(xsum, b), vsplat(np.float32(8.0)))
        o0 = vfma(ld_f16(buf, r + 384), vsub(a0, s8), o0)
        o1 = vfma(ld_f16(buf, r + 400), vsub(a1, s8), o1)
        o2 = vfma(ld_f16(buf, r + 416), vsub(a2, s8), o2)
    vstore(dst, d0, o0)
    vstore(dst, d0 + 8, o1)
    vstore(dst, d0 + 16, o2)


@njit(cache=True, nogil=True, fastmath=False)
def tile_q4_1(dst, d0, buf, base, nb, xs, xsum):
    """Q4_1 tile (24 rows): y = d q + m -> d * sum(q x) + m * S_b."""
    o0 = vzero()
    o1 = vzero()
    o2 = vzero()
    for b in range(nb):
        r = base + b * REC_Q4_1
        prefetch_range(buf, r + PF_DIST, REC_Q4_1)
        a0, a1, a2 = _dot_q4(buf, r, xs, b * QK)
        sb = vbcast(xsum, b)
        o0 = vfma(ld_f16(buf, r + 384), a0, o0)
        o1 = vfma(ld_f16(buf, r + 400), a1, o1)
        o2 = vfma(ld_f16(buf, r + 416), a2, o2)
        o0 = vfma(ld_f16(buf, r + 432), sb, o0)
        o1 = vfma(ld_f16(buf, r + 448), sb, o1)
        o2 = vfma(ld_f16(buf, r + 464), sb, o2)
    vstore(dst, d0, o0)
    vstore(dst, d0 + 8, o1)
    vstore(dst, d0 + 16, o2)


@njit(cache=True, nogil=True, fastmath=False)
def tile_q5_0(dst, d0, buf, base, nb, xs, xsum):
    """Q5_0 tile (24 rows): y = d (q - 16) -> d * (sum q x - 16 S_b)."""
    o0 = vzero()
    o1 = vzero()
    o2 = vzero()
    for b in range(nb):
        r = base + b * REC_Q5_0
        prefetch_range(buf, r + PF_DIST, REC_Q5_0)
        a0, a1, a2 = _dot_q5(buf, r, xs, b * QK)
        s16 = vmul(vbcast(xsum, b), vsplat(np.float32(16.0)))
        o0 = vfma(ld_f16(buf, r + 576), vsub(a0, s16), o0)
        o1 = vfma(ld_f16(buf, r + 592), vsub(a1, s16), o1)
        o2 = vfma(ld_f16(buf, r + 608), vsub(a2, s16), o2)
    vstore(dst, d0, o0)
    vstore(dst, d0 + 8, o1)
    vstore(dst, d0 + 16, o2)


@njit(cache=True, nogil=True, fastmath=False)
def tile_q5_1(dst, d0, buf, base, nb, xs, xsum):
    """Q5_1 tile (24 rows): y = d q + m."""
    o0 = vzero()
    o1 = vzero()
    o2 = vzero()
    for b in range(nb):
        r = base + b * REC_Q5_1
        prefetch_range(buf, r + PF_DIST, REC_Q5_1)
        a0, a1, a2 = _dot_q5(buf, r, xs, b * QK)
        sb = vbcast(xsum, b)
        o0 = vfma(ld_f16(buf, r + 576), a0, o0)
        o1 = vfma(ld_f16(buf, r + 592), a1, o1)
        o2 = vfma(ld_f16(buf, r + 608), a2, o2)
        o0 = vfma(ld_f16(buf, r + 624), sb, o0)
        o1 = vfma(ld_f16(buf, r + 640), sb, o1)
        o2 = vfma(ld_f16(buf, r + 656), sb, o2)
    vstore(dst, d0, o0)
    vstore(dst, d0 + 8, o1)
    vstore(dst, d0 + 16, o2)


@njit(cache=True, nogil=True, fastmath=False)
def tile_q8_0(dst, d0, buf, base, nb, x):
    """Q8_0 tile: y = d q, q int8 stored [col][lane] per group (256 bytes)."""
    o0 = vzero()
    o1 = vzero()
    for b in range(nb):
        r = base + b * REC_Q8_0
        prefetch_range(buf, r + PF_DIST, REC_Q8_0)
        a0 = vzero()
        a1 = vzero()
        c0 = vzero()
        c1 = vzero()
        xb = b * QK
        for j in range(0, 32, 2):
            x0 = vbcast(x, xb + j)
            a0 = vfma(ld_i8(buf, r + 8 * j), x0, a0)
            c0 = vfma(ld_i8(buf, r + 256 + 8 * j), x0, c0)
            x1 = vbcast(x, xb + j + 1)
            a1 = vfma(ld_i8(buf, r + 8 * j + 8), x1, a1)
            c1 = vfma(ld_i8(buf, r + 256 + 8 * j + 8), x1, c1)
        o0 = vfma(ld_f16(buf, r + 512), vadd(a0, a1), o0)
        o1 = vfma(ld_f16(buf, r + 528), vadd(c0, c1), o1)
    vstore(dst, d0, o0)
    vstore(dst, d0 + 8, o1)


@njit(cache=True, nogil=True, fastmath=False)
def tile_q4_k(dst, d0, buf, base, nb, xs, xsum):
    """Q4_K tile (24 rows): per 32-value sub-block j, y = (d sc_j) q - (dmin m_j).

    Record per super-block: d [3 groups][8 lanes] f16, dmin [3][8] f16, sc [8 sub][3][8] u8,
    mn [8][3][8] u8, nibbles [8 sub][3 groups][4 slots][8 lanes] u32.
    """
    o0 = vzero()
    o1 = vzero()
    o2 = vzero()
    for b in range(nb):
        r = base + b * REC_Q4_K
        dd0 = ld_f16(buf, r)
        dd1 = ld_f16(buf, r + 16)
        dd2 = ld_f16(buf, r + 32)
        for j in range(8):
            prefetch_range(buf, r + PF_DIST + j * (REC_Q4_K // 8), REC_Q4_K // 8)
            a0, a1, a2 = _dot_q4(buf, r + 480 + 384 * j, xs, b * QK_K + QK * j)
            sb = vbcast(xsum, b * 8 + j)
            o0 = vfma(vmul(dd0, ld_u8(buf, r + 96 + 24 * j)), a0, o0)
            o1 = vfma(vmul(dd1, ld_u8(buf, r + 104 + 24 * j)), a1, o1)
            o2 = vfma(vmul(dd2, ld_u8(buf, r + 112 + 24 * j)), a2, o2)
            o0 = vfnma(vmul(ld_f16(buf, r + 48), ld_u8(buf, r + 288 + 24 * j)), sb, o0)
            o1 = vfnma(vmul(ld_f16(buf, r + 64), ld_u8(buf, r + 296 + 24 * j)), sb, o1)
            o2 = vfnma(vmul(ld_f16(buf, r + 80), ld_u8(buf, r + 304 + 24 * j)), sb, o2)
    vstore(dst, d0, o0)
    vstore(dst, d0 + 8, o1)
    vstore(dst, d0 + 16, o2)


@njit(cache=True, nogil=True, fastmath=False)
def tile_q5_k(dst, d0, buf, base, nb, xs, xsum):
    """Q5_K tile (24 rows): as Q4_K with 5-bit values; record per super-block: d, dmin [3][8] f16,
    sc, mn [8 sub][3][8] u8, fields [8 sub][3 groups][6][8 lanes] u32."""
    o0 = vzero()
    o1 = vzero()
    o2 = vzero()
    for b in range(nb):
        r = base + b * REC_Q5_K
        dd0 = ld_f16(buf, r)
        dd1 = ld_f16(buf, r + 16)
        dd2 = ld_f16(buf, r + 32)
        for j in range(8):
            prefetch_range(buf, r + PF_DIST + j * (REC_Q5_K // 8), REC_Q5_K // 8)
            a0, a1, a2 = _dot_q5(buf, r + 480 + 576 * j, xs, b * QK_K + QK * j)
            sb = vbcast(xsum, b * 8 + j)
            o0 = vfma(vmul(dd0, ld_u8(buf, r + 96 + 24 * j)), a0, o0)
            o1 = vfma(vmul(dd1, ld_u8(buf, r + 104 + 24 * j)), a1, o1)
            o2 = vfma(vmul(dd2, ld_u8(buf, r + 112 + 24 * j)), a2, o2)
            o0 = vfnma(vmul(ld_f16(buf, r + 48), ld_u8(buf, r + 288 + 24 * j)), sb, o0)
            o1 = vfnma(vmul(ld_f16(buf, r + 64), ld_u8(buf, r + 296 + 24 * j)), sb, o1)
            o2 = vfnma(vmul(ld_f16(buf, r + 80), ld_u8(buf, r + 304 + 24 * j)), sb, o2)
    vstore(dst, d0, o0)
    vstore(dst, d0 + 8, o1)
    vstore(dst, d0 + 16, o2)


@njit(cache=True, nogil=True, fastmath=False)
def tile_q6_k(dst, d0, buf, base, nb, xs, xsum):
    """Q6_K tile (16 rows): per 16-value sub-block u, y = (d sc_u) (q - 32), sc int8.

    Record per super-block: d [2][8] f16, sc [16 sub][2][8] i8, then per 32 columns j: fields
    [2 groups][6][8 lanes] u32 (see _dot_q6).
    """
    o0 = vzero()
    o1 = vzero()
    for b in range(nb):
        r = base + b * REC_Q6_K
        dd0 = ld_f16(buf, r)
        dd1 = ld_f16(buf, r + 16)
        for j in range(8):
            prefetch_range(buf, r + PF_DIST + j * (REC_Q6_K // 8), REC_Q6_K // 8)
            a0, b0, a1, b1 = _dot_q6(buf, r + 288 + 384 * j, xs, b * QK_K + QK * j)
            u = 2 * j
            sa = vmul(vbcast(xsum, b * 16 + u), vsplat(np.float32(32.0)))
            sv = vmul(vbcast(xsum, b * 16 + u + 1), vsplat(np.float32(32.0)))
            o0 = vfma(vmul(dd0, ld_i8(buf, r + 32 + 16 * u)), vsub(a0, sa), o0)
            o1 = vfma(vmul(dd1, ld_i8(buf, r + 40 + 16 * u)), vsub(a1, sa), o1)
            o0 = vfma(vmul(dd0, ld_i8(buf, r + 48 + 16 * u)), vsub(b0, sv), o0)
            o1 = vfma(vmul(dd1, ld_i8(buf, r + 56 + 16 * u)), vsub(b1, sv), o1)
    vstore(dst, d0, o0)
    vstore(dst, d0 + 8, o1)


@njit(cache=True, nogil=True, fastmath=False)
def tile_q2_k(dst, d0, buf, base, nb, xs, xsum):
    """Q2_K tile (24 rows): per 16-value sub-block u, y = (d sc_u) q - (dmin m_u), q 2 bits.

    Record per super-block: d [3 groups][8 lanes] f16, dmin [3][8] f16, the file's scale|min bytes
    [16 sub][3][8] u8 (low nibble sc, high nibble m), then per 32 columns j: fields [3 groups]
    [2 sub-blocks][8 lanes] u32 (column 16 h + i at bits 2i of dword h). Bytes per weight equal the
    file's.
    """
    o0 = vzero()
    o1 = vzero()
    o2 = vzero()
    for b in range(nb):
        r = base + b * REC_Q2_K
        dd0 = ld_f16(buf, r)
        dd1 = ld_f16(buf, r + 16)
        dd2 = ld_f16(buf, r + 32)
        dm0 = ld_f16(buf, r + 48)       # loaded once per super-block: vcvtph2ps shares the
        dm1 = ld_f16(buf, r + 64)       # int -> float port that bounds the inner loop
        dm2 = ld_f16(buf, r + 80)
        for j in range(8):
            prefetch_range(buf, r + PF_DIST + j * (REC_Q2_K // 8), REC_Q2_K // 8)
            a0, b0, a1, b1, a2, b2 = _dot_q2(buf, r + 480 + 192 * j, xs, b * QK_K + QK * j)
            u = 2 * j
            sa = vbcast(xsum, b * 16 + u)
            sv = vbcast(xsum, b * 16 + u + 1)
            m0 = ld_u8i(buf, r + 96 + 24 * u)
            m1 = ld_u8i(buf, r + 104 + 24 * u)
            m2 = ld_u8i(buf, r + 112 + 24 * u)
            o0 = vfma(vmul(dd0, andf(m0, 15)), a0, o0)
            o1 = vfma(vmul(dd1, andf(m1, 15)), a1, o1)
            o2 = vfma(vmul(dd2, andf(m2, 15)), a2, o2)
            o0 = vfnma(vmul(dm0, srlf(m0, 4)), sa, o0)
            o1 = vfnma(vmul(dm1, srlf(m1, 4)), sa, o1)
            o2 = vfnma(vmul(dm2, srlf(m2, 4)), sa, o2)
            m0 = ld_u8i(buf, r + 120 + 24 * u)
            m1 = ld_u8i(buf, r + 128 + 24 * u)
            m2 = ld_u8i(buf, r + 136 + 24 * u)
            o0 = vfma(vmul(dd0, andf(m0, 15)), b0, o0)
            o1 = vfma(vmul(dd1, andf(m1, 15)), b1, o1)
            o2 = vfma(vmul(dd2, andf(m2, 15)), b2, o2)
            o0 = vfnma(vmul(dm0, srlf(m0, 4)), sv, o0)
            o1 = vfnma(vmul(dm1, srlf(m1, 4)), sv, o1)
            o2 = vfnma(vmul(dm2, srlf(m2, 4)), sv, o2)
    vstore(dst, d0, o0)
    vstore(dst, d0 + 8, o1)
    vstore(dst, d0 + 16, o2)


@njit(cache=True, nogil=True, fastmath=False)
def tile_q3_k(dst, d0, buf, base, nb, xs, xsum):
    """Q3_K tile (24 rows): per 16-value sub-block u, y = (d sc_u) (u3 - 4), u3 = q + 4 in 0..7.

    Record per super-block: d [3][8] f16, sc - 32 [16 sub][3][8] i8, then per 32 columns j: u3 in
    nibble dwords [3 groups][4][8 lanes] u32 (as Q4_K's; dwords 0, 1 sub-block 2j, dwords 2, 3
    sub-block 2j + 1). A 3-bit value in a 4-bit field: 4 bits per weight where the file has 3.44, for
    the 4-bit inner loop (two fields per value, split over dwords, would need extra shifts and a
    second pre-scaled x).
    """
    o0 = vzero()
    o1 = vzero()
    o2 = vzero()
    for b in range(nb):
        r = base + b * REC_Q3_K
        dd0 = ld_f16(buf, r)
        dd1 = ld_f16(buf, r + 16)
        dd2 = ld_f16(buf, r + 32)
        for j in range(8):
            prefetch_range(buf, r + PF_DIST + j * (REC_Q3_K // 8), REC_Q3_K // 8)
            a0, b0, a1, b1, a2, b2 = _dot_q4x16(buf, r + 432 + 384 * j, xs, b * QK_K + QK * j)
            u = 2 * j
            sa = vmul(vbcast(xsum, b * 16 + u), vsplat(np.float32(4.0)))
            sv = vmul(vbcast(xsum, b * 16 + u + 1), vsplat(np.float32(4.0)))
            o0 = vfma(vmul(dd0, ld_i8(buf, r + 48 + 24 * u)), vsub(a0, sa), o0)
            o1 = vfma(vmul(dd1, ld_i8(buf, r + 56 + 24 * u)), vsub(a1, sa), o1)
            o2 = vfma(vmul(dd2, ld_i8(buf, r + 64 + 24 * u)), vsub(a2, sa), o2)
            o0 = vfma(vmul(dd0, ld_i8(buf, r + 72 + 24 * u)), vsub(b0, sv), o0)
            o1 = vfma(vmul(dd1, ld_i8(buf, r + 80 + 24 * u)), vsub(b1, sv), o1)
            o2 = vfma(vmul(dd2, ld_i8(buf, r + 88 + 24 * u)), vsub(b2, sv), o2)
    vstore(dst, d0, o0)
    vstore(dst, d0 + 8, o1)
    vstore(dst, d0 + 16, o2)


@njit(cache=True, nogil=True, fastmath=False)
def tile_iq4_nl(dst, d0, buf, base, nb, xs, xsum):
    """IQ4_NL tile (24 rows): y = d kvalue[q] = d (u - 128) -> d * (sum u x - 128 S_b).

    Record per block: index nibble dwords [3 groups][4][8 lanes] u32 (see _dot_iq4), d [3][8] f16;
    bytes per weight equal the file's.
    """
    lut = ld_i32(IQ4_LUT, 0)
    o0 = vzero()
    o1 = vzero()
    o2 = vzero()
    for b in range(nb):
        r = base + b * REC_IQ4_NL
        prefetch_range(buf, r + PF_DIST, REC_IQ4_NL)
        a0, a1, a2 = _dot_iq4(buf, r, xs, b * QK, lut)
        s128 = vmul(vbcast(xsum, b), vsplat(np.float32(128.0)))
        o0 = vfma(ld_f16(buf, r + 384), vsub(a0, s128), o0)
        o1 = vfma(ld_f16(buf, r + 400), vsub(a1, s128), o1)
        o2 = vfma(ld_f16(buf, r + 416), vsub(a2, s128), o2)
    vstore(dst, d0, o0)
    vstore(dst, d0 + 8, o1)
    vstore(dst, d0 + 16, o2)


@njit(cache=True, nogil=True, fastmath=False)
def tile_iq4_xs(dst, d0, buf, base, nb, xs, xsum):
    """IQ4_XS tile (24 rows): per 32-value sub-block j, y = (d (ls_j - 32)) kvalue[q].

    Record per super-block: d [3][8] f16, ls - 32 [8 sub][3][8] i8, index nibble dwords [8 sub]
    [3 groups][4][8 lanes] u32 (see _dot_iq4).
    """
    lut = ld_i32(IQ4_LUT, 0)
    o0 = vzero()
    o1 = vzero()
    o2 = vzero()
    for b in range(nb):
        r = base + b * REC_IQ4_XS
        dd0 = ld_f16(buf, r)
        dd1 = ld_f16(buf, r + 16)
        dd2 = ld_f16(buf, r + 32)
        for j in range(8):
            prefetch_range(buf, r + PF_DIST + j * (REC_IQ4_XS // 8), REC_IQ4_XS // 8)
            a0, a1, a2 = _dot_iq4(buf, r + 240 + 384 * j, xs, b * QK_K + QK * j, lut)
            s128 = vmul(vbcast(xsum, b * 8 + j), vsplat(np.float32(128.0)))
            o0 = vfma(vmul(dd0, ld_i8(buf, r + 48 + 24 * j)), vsub(a0, s128), o0)
            o1 = vfma(vmul(dd1, ld_i8(buf, r + 56 + 24 * j)), vsub(a1, s128), o1)
            o2 = vfma(vmul(dd2, ld_i8(buf, r + 64 + 24 * j)), vsub(a2, s128), o2)
    vstore(dst, d0, o0)
    vstore(dst, d0 + 8, o1)
    vstore(dst, d0 + 16, o2)


@njit(cache=True, nogil=True, fastmath=False)
def tile_f16(dst, d0, buf, base, nb, x):
    """F16 tile: nb = n_cols; per column [2 groups][8 lanes] f16."""
    a0 = vzero()
    a1 = vzero()
    c0 = vzero()
    c1 = vzero()
    n2 = nb - nb % 2
    for c in range(0, n2, 2):
        r = base + c * REC_F16
        prefetch(buf, r + PF_DIST)
        x0 = vbcast(x, c)
        a0 = vfma(ld_f16(buf, r), x0, a0)
        c0 = vfma(ld_f16(buf, r + 16), x0, c0)
        x1 = vbcast(x, c + 1)
        a1 = vfma(ld_f16(buf, r + 32), x1, a1)
        c1 = vfma(ld_f16(buf, r + 48), x1, c1)
    if n2 < nb:
        r = base + n2 * REC_F16
        x0 = vbcast(x, n2)
        a0 = vfma(ld_f16(buf, r), x0, a0)
        c0 = vfma(ld_f16(buf, r + 16), x0, c0)
    vstore(dst, d0, vadd(a0, a1))
    vstore(dst, d0 + 8, vadd(c0, c1))


@njit(cache=True, nogil=True, fastmath=False)
def tile_bf16(dst, d0, buf, base, nb, x):
    """BF16 tile: nb = n_cols; per column [2 groups][8 lanes] bf16."""
    a0 = vzero()
    a1 = vzero()
    c0 = vzero()
    c1 = vzero()
    n2 = nb - nb % 2
    for c in range(0, n2, 2):
        r = base + c * REC_F16
        prefetch(buf, r + PF_DIST)
        x0 = vbcast(x, c)
        a0 = vfma(ld_bf16(buf, r), x0, a0)
        c0 = vfma(ld_bf16(buf, r + 16), x0, c0)
        x1 = vbcast(x, c + 1)
        a1 = vfma(ld_bf16(buf, r + 32), x1, a1)
        c1 = vfma(ld_bf16(buf, r + 48), x1, c1)
    if n2 < nb:
        r = base + n2 * REC_F16
        x0 = vbcast(x, n2)
        a0 = vfma(ld_bf16(buf, r), x0, a0)
        c0 = vfma(ld_bf16(buf, r + 16), x0, c0)
    vstore(dst, d0, vadd(a0, a1))
    vstore(dst, d0 + 8, vadd(c0, c1))


@njit(cache=True, nogil=True, fastmath=False)
def tile_f32(dst, d0, buf, base, nb, x):
    """F32 tile: nb = n_cols; per column [2 groups][8 lanes] f32."""
    a0 = vzero()
    a1 = vzero()
    c0 = vzero()
    c1 = vzero()
    n2 = nb - nb % 2
    for c in range(0, n2, 2):
        r = base + c * REC_F32
        prefetch_range(buf, r + PF_DIST, 2 * REC_F32)
        x0 = vbcast(x, c)
        a0 = vfma(ld_f32(buf, r), x0, a0)
        c0 = vfma(ld_f32(buf, r + 32), x0, c0)
        x1 = vbcast(x, c + 1)
        a1 = vfma(ld_f32(buf, r + 64), x1, a1)
        c1 = vfma(ld_f32(buf, r + 96), x1, c1)
    if n2 < nb:
        r = base + n2 * REC_F32
        x0 = vbcast(x, n2)
        a0 = vfma(ld_f32(buf, r), x0, a0)
        c0 = vfma(ld_f32(buf, r + 32), x0, c0)
    vstore(dst, d0, vadd(a0, a1))
    vstore(dst, d0 + 8, vadd(c0, c1))



# ==================================================================================================
# 16-lane variants (CPUs with 512-bit SIMD, simd.HAS_AVX512): the 4-bit and Q6_K tile kernels above
# with _dot_q4 / _dot_q6 bound to dot_q4_pairs / _dot_q6_pairs. Same records and arguments, same
# results up to summation order.
# ==================================================================================================

PAIR_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q6_K)
_PAIR_NS = dict(globals(), _dot_q4=dot_q4_pairs, _dot_q6=dot_q6_pairs)
for _tile in (tile_q4_0, tile_q4_1, tile_q4_k, tile_q6_k):
    globals()[_tile.__name__ + "_pairs"] = njit(cache=True, nogil=True, fastmath=False)(
        bind_copy(_tile.py_func, _tile.__name__ + "_pairs", _PAIR_NS))
