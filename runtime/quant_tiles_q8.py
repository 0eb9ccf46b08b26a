"""Kernels of the q8 mode: W (packed) @ 8-bit activations, with integer dot products (AVX2).

out (T, n_rows) float32 = W @ x for T rows of x quantized by act_quant.py (xq int8 in its column
order, per-32 scales dx, per-16 / per-32 sums s16 / s32). Record layouts: Q4_0, Q4_1 and Q4_K the
exact mode's (quant_tiles.py, 24-row tiles); Q5_0, Q6_K and Q8_0 packing_q8.py's (16-row tiles).

Per 8 rows (one group, 8 lanes) and 4 columns the inner step is

    vpbroadcastd   4 bytes of xq to every lane
    vpmaddubsw     32 unsigned weight bytes x 32 signed xq bytes -> 16 int16 (pairs summed)
    vpaddw         int16 partial sums, as many as the weights' range allows without overflow:
                   4-bit u <= 15: 8 per 32 columns (8 x 2 x 15 x 127 = 30480); 5-bit u <= 31: 4;
                   6-bit u <= 63: 2; Q8_0 (signed weights, vpsignb moves the sign onto xq): 1
    vpmaddwd       with ones: int16 pairs -> 8 int32 (exact)

so 32 multiply-adds cost about 2 vector instructions where the float path spends 4 FMAs plus the
field extraction and conversion of 32 weights. The integer sum of a block is exact; it is folded in
float32 per block: acc += (isum - offset * sum(xq)) * (d_w * d_x) (+ m_w d_x sum(xq) for the types
with a minimum). The weights are decoded into bytes once per block and group and reused for 4 rows
of x (grp4_*; the remainder rows one at a time, grp1_*).

Memory: no software prefetch. Measured on Zen 4 (2 threads, matrices streamed from DRAM), the
hardware prefetcher alone streams these kernels' records at 36-40 GB/s, and prefetchnta of every
line a record ahead (as the float kernels do, whose per-byte work is ~3x longer) cut that to 21 GB/s.

Parallelism: the entry kernels q8mm_<type> split the row groups (8 rows each) over threads (prange)
and run every row of x through a group before moving on, so a group's weights (8 rows x n_cols,
a few KB) stay in L1/L2 while T rows stream past them. q8mm_<type>_serial is the same on the
calling thread, for matrices too small to be worth a fork/join.

The per-type code is one decode_<type> (the weight bytes and scales of a block for one group) and
one row_<type> (one row of x against them); the group and entry kernels are generated from one
template (_SOURCE) for every type, as matvec_kernels.py does and for the same reason (Numba's cache).
"""
import numpy as np
from numba import njit, prange  # noqa: F401 (prange: named by the generated entry kernels)

from ringllm.runtime.act_quant import Q8_0, Q8_K, quantize_row  # noqa: F401 (named by the generated kernels)
from ringllm.runtime.kernel_copies import bind_copy
from ringllm.runtime.packing_q8 import Q8_GROUPS
from ringllm.runtime.quant_tiles import QK, REC_Q4_0, REC_Q4_1, REC_Q4_K  # noqa: F401 (QK: named by the generated kernels)
from ringllm.runtime.quant_types import GGMLType
from ringllm.runtime.simd import (abs8, add16, bc_i32, compiles_for, dpbusd, hadd16, iadd, iand, ior, ishl, isrl,  # noqa: F401
                                  itof, izero, ld_f16, ld_i8, ld_i32, ld_u8, maddubs, sign8, vfma, vfnma, vlane,
                                  vmul, vsplat, vstore, vsub, vzero)

__all__ = ["Q8_KERNELS", "Q8_KERNELS_VNNI", "HAS_VNNI", "Q8_TYPE_LAYOUTS", "GRP_ROWS", "REC_Q8_Q5_0", "REC_Q8_Q6_K",
           "REC_Q8_Q8_0", "put_rows8", "split_nibbles", "merge_q5", "merge_q6"]

REC_Q8_Q5_0 = Q8_GROUPS * (128 + 32 + 16)                     # nibbles, high bits, d
REC_Q8_Q8_0 = Q8_GROUPS * (256 + 16)                          # value quads, d
REC_Q8_Q6_K = Q8_GROUPS * (16 + 128) + 8 * Q8_GROUPS * 192    # d, scales, per 32 columns: nibbles, high bits

LO4 = 0x0F0F0F0F
BIT4 = 0x10101010
BITS45 = 0x30303030


# ==================================================================================================
# Shared pieces: nibble split and the 16-column int16 partial sum
# ==================================================================================================

@njit(cache=True, nogil=True, inline="always")
def _p16(l0, h0, l1, h1, x, c):
    """int16 lanes: the 16 columns c .. c + 15 of two slots (low / high byte vectors l, h) against
    xq row x, pairs not yet widened (|sum| <= 4 x 2 x 31 x 127 for weights <= 31)."""
    p = add16(maddubs(l0, bc_i32(x, c)), maddubs(h0, bc_i32(x, c + 4)))
    return add16(p, add16(maddubs(l1, bc_i32(x, c + 8)), maddubs(h1, bc_i32(x, c + 12))))


@njit(cache=True, nogil=True, inline="always")
def split_nibbles(v0, v1, v2, v3):
    """Four nibble dword vectors (i32x8 or i32x16: 4 slots x 32 bytes per group) split into 8 byte
    vectors l0, h0, .., l3, h3 (low nibbles, high nibbles)."""
    return (iand(v0, LO4), iand(isrl(v0, 4), LO4), iand(v1, LO4), iand(isrl(v1, 4), LO4),
            iand(v2, LO4), iand(isrl(v2, 4), LO4), iand(v3, LO4), iand(isrl(v3, 4), LO4))


@njit(cache=True, nogil=True, inline="always")
def merge_q5(v0, v1, v2, v3, H):
    """Q5_0's 8 byte vectors (either width): the nibbles of v0..v3 with bit 4 from the high-bit plane H."""
    return (ior(iand(v0, LO4), iand(H, BIT4)),
            ior(iand(isrl(v0, 4), LO4), iand(ishl(H, 4), BIT4)),
            ior(iand(v1, LO4), iand(isrl(H, 1), BIT4)),
            ior(iand(isrl(v1, 4), LO4), iand(ishl(H, 3), BIT4)),
            ior(iand(v2, LO4), iand(isrl(H, 2), BIT4)),
            ior(iand(isrl(v2, 4), LO4), iand(ishl(H, 2), BIT4)),
            ior(iand(v3, LO4), iand(isrl(H, 3), BIT4)),
            ior(iand(isrl(v3, 4), LO4), iand(ishl(H, 1), BIT4)))


@njit(cache=True, nogil=True, inline="always")
def merge_q6(v0, v1, v2, v3, H0, H1):
    """Q6_K's 8 byte vectors (either width): the nibbles of v0..v3 with bits 4..5 from H0, H1."""
    return (ior(iand(v0, LO4), iand(H0, BITS45)),
            ior(iand(isrl(v0, 4), LO4), iand(isrl(H0, 2), BITS45)),
            ior(iand(v1, LO4), iand(ishl(H0, 4), BITS45)),
            ior(iand(isrl(v1, 4), LO4), iand(ishl(H0, 2), BITS45)),
            ior(iand(v2, LO4), iand(H1, BITS45)),
            ior(iand(isrl(v2, 4), LO4), iand(isrl(H1, 2), BITS45)),
            ior(iand(v3, LO4), iand(ishl(H1, 4), BITS45)),
            ior(iand(isrl(v3, 4), LO4), iand(ishl(H1, 2), BITS45)))


@njit(cache=True, nogil=True, inline="always")
def _nibbles4(buf, w):
    """The 4 nibble dwords at byte w (4 slots x 32 bytes) split into 8 byte vectors l0, h0, .., l3, h3."""
    return split_nibbles(ld_i32(buf, w), ld_i32(buf, w + 32), ld_i32(buf, w + 64), ld_i32(buf, w + 96))


# Integer sums of the weight bytes of one block against one row of xq, in two variants: AVX2
# (vpmaddubsw, int16 partial sums as far as the weights' range allows, vpmaddwd) and VNNI (vpdpbusd:
# 4 products summed into int32 per instruction). The row functions below call them by the names
# isum_4bit / isum_5bit / isum_6bit / isum_s8, which each variant's copies bind (_DOTS).

@njit(cache=True, nogil=True, inline="always")
def _isum_4bit_avx2(q, x, c):
    """int32 lanes: 32 columns of bytes <= 15 (8 vectors) times xq[c:c + 32]; one widening."""
    return hadd16(add16(_p16(q[0], q[1], q[2], q[3], x, c), _p16(q[4], q[5], q[6], q[7], x, c + 16)))


@njit(cache=True, nogil=True, inline="always")
def _isum_5bit_avx2(q, x, c):
    """As _isum_4bit_avx2 for bytes <= 31: one widening per 16 columns."""
    return iadd(hadd16(_p16(q[0], q[1], q[2], q[3], x, c)), hadd16(_p16(q[4], q[5], q[6], q[7], x, c + 16)))


@njit(cache=True, nogil=True, inline="always")
def _pair6(a, b, x, c):
    return hadd16(add16(maddubs(a, bc_i32(x, c)), maddubs(b, bc_i32(x, c + 4))))


@njit(cache=True, nogil=True, inline="always")
def _isum_6bit_avx2(q, x, c):
    """Bytes <= 63: the sums of columns c .. c + 15 and c + 16 .. c + 31 apart (Q6_K's 16-value
    scales); one widening per two products."""
    return (iadd(_pair6(q[0], q[1], x, c), _pair6(q[2], q[3], x, c + 8)),
            iadd(_pair6(q[4], q[5], x, c + 16), _pair6(q[6], q[7], x, c + 24)))


@njit(cache=True, nogil=True, inline="always")
def _quad_s8(w, x, c):
    """int32 lanes: 4 signed weight bytes w times xq[c:c + 4] (the sign of w moved onto xq)."""
    return hadd16(maddubs(abs8(w), sign8(bc_i32(x, c), w)))


@njit(cache=True, nogil=True, inline="always")
def _isum_s8_avx2(q, x, c):
    """Signed weight bytes (Q8_0): a widening per product (|w x| pairs reach 32512)."""
    s = iadd(iadd(_quad_s8(q[0], x, c), _quad_s8(q[1], x, c + 4)),
             iadd(_quad_s8(q[2], x, c + 8), _quad_s8(q[3], x, c + 12)))
    return iadd(s, iadd(iadd(_quad_s8(q[4], x, c + 16), _quad_s8(q[5], x, c + 20)),
                        iadd(_quad_s8(q[6], x, c + 24), _quad_s8(q[7], x, c + 28))))


@njit(cache=True, nogil=True, inline="always")
def _dp4(q0, q1, q2, q3, x, c):
    """vpdpbusd over 16 columns, two independent chains (the instruction's latency)."""
    a = dpbusd(dpbusd(izero(), q0, bc_i32(x, c)), q2, bc_i32(x, c + 8))
    b = dpbusd(dpbusd(izero(), q1, bc_i32(x, c + 4)), q3, bc_i32(x, c + 12))
    return iadd(a, b)


@njit(cache=True, nogil=True, inline="always")
def _isum_bytes_vnni(q, x, c):
    """int32 lanes: 32 columns of unsigned bytes (any value) times xq[c:c + 32]."""
    return iadd(_dp4(q[0], q[1], q[2], q[3], x, c), _dp4(q[4], q[5], q[6], q[7], x, c + 16))


@njit(cache=True, nogil=True, inline="always")
def _isum_6bit_vnni(q, x, c):
    return _dp4(q[0], q[1], q[2], q[3], x, c), _dp4(q[4], q[5], q[6], q[7], x, c + 16)


@njit(cache=True, nogil=True, inline="always")
def _isum_s8_vnni(q, x, c):
    """Signed weight bytes: |w| against xq with w's sign."""
    a = dpbusd(izero(), abs8(q[0]), sign8(bc_i32(x, c), q[0]))
    b = dpbusd(izero(), abs8(q[1]), sign8(bc_i32(x, c + 4), q[1]))
    for k in range(2, 8, 2):
        a = dpbusd(a, abs8(q[k]), sign8(bc_i32(x, c + 4 * k), q[k]))
        b = dpbusd(b, abs8(q[k + 1]), sign8(bc_i32(x, c + 4 * k + 4), q[k + 1]))
    return iadd(a, b)


_DOTS = {
    "": {"isum_4bit": _isum_4bit_avx2, "isum_5bit": _isum_5bit_avx2, "isum_6bit": _isum_6bit_avx2,
         "isum_s8": _isum_s8_avx2},
    "_vnni": {"isum_4bit": _isum_bytes_vnni, "isum_5bit": _isum_bytes_vnni, "isum_6bit": _isum_6bit_vnni,
              "isum_s8": _isum_s8_vnni},
}
isum_4bit, isum_5bit, isum_6bit, isum_s8 = (_DOTS[""][k] for k in ("isum_4bit", "isum_5bit", "isum_6bit", "isum_s8"))


# ==================================================================================================
# Per type: decode_<type>(buf, r, g, j) -> the weights of sub-block j of the record at r for group g;
# row_<type>(w, X, c, acc) -> acc + one row's products over its 32 columns from column c.
# X = (xq, dx, s16, s32) of one row.
# ==================================================================================================

@njit(cache=True, nogil=True, inline="always")
def decode_q4_0(buf, r, g, j):
    return _nibbles4(buf, r + 128 * g), ld_f16(buf, r + 384 + 16 * g)


@njit(cache=True, nogil=True, inline="always")
def row_q4_0(w, X, c, acc):
    """y = d (q - 8): (isum - 8 S) d dx."""
    b = c >> 5
    f = vsub(itof(isum_4bit(w[0], X[0], c)), vsplat(np.float32(8.0) * X[3][b]))
    return vfma(f, vmul(w[1], vsplat(X[1][b])), acc)


@njit(cache=True, nogil=True, inline="always")
def decode_q4_1(buf, r, g, j):
    return _nibbles4(buf, r + 128 * g), ld_f16(buf, r + 384 + 16 * g), ld_f16(buf, r + 432 + 16 * g)


@njit(cache=True, nogil=True, inline="always")
def row_q4_1(w, X, c, acc):
    """y = d q + m: isum d dx + m dx S."""
    b = c >> 5
    dxb = X[1][b]
    acc = vfma(itof(isum_4bit(w[0], X[0], c)), vmul(w[1], vsplat(dxb)), acc)
    return vfma(w[2], vsplat(dxb * X[3][b]), acc)


@njit(cache=True, nogil=True, inline="always")
def decode_q4_k(buf, r, g, j):
    dsc = vmul(ld_f16(buf, r + 16 * g), ld_u8(buf, r + 96 + 24 * j + 8 * g))
    dmn = vmul(ld_f16(buf, r + 48 + 16 * g), ld_u8(buf, r + 288 + 24 * j + 8 * g))
    return _nibbles4(buf, r + 480 + 384 * j + 128 * g), dsc, dmn


@njit(cache=True, nogil=True, inline="always")
def row_q4_k(w, X, c, acc):
    """y = (d sc) q - (dmin m): isum (d sc) dx - (dmin m) dx S."""
    b = c >> 5
    dxb = X[1][b]
    acc = vfma(itof(isum_4bit(w[0], X[0], c)), vmul(w[1], vsplat(dxb)), acc)
    return vfnma(w[2], vsplat(dxb * X[3][b]), acc)


@njit(cache=True, nogil=True, inline="always")
def decode_q5_0(buf, r, g, j):
    w = r + 128 * g
    q = merge_q5(ld_i32(buf, w), ld_i32(buf, w + 32), ld_i32(buf, w + 64), ld_i32(buf, w + 96),
                 ld_i32(buf, r + 128 * Q8_GROUPS + 32 * g))
    return q, ld_f16(buf, r + 160 * Q8_GROUPS + 16 * g)


@njit(cache=True, nogil=True, inline="always")
def row_q5_0(w, X, c, acc):
    """y = d (q - 16): (isum - 16 S) d dx; two widenings (5-bit bytes)."""
    b = c >> 5
    f = vsub(itof(isum_5bit(w[0], X[0], c)), vsplat(np.float32(16.0) * X[3][b]))
    return vfma(f, vmul(w[1], vsplat(X[1][b])), acc)


@njit(cache=True, nogil=True, inline="always")
def decode_q8_0(buf, r, g, j):
    w = r + 256 * g
    q = (ld_i32(buf, w), ld_i32(buf, w + 32), ld_i32(buf, w + 64), ld_i32(buf, w + 96),
         ld_i32(buf, w + 128), ld_i32(buf, w + 160), ld_i32(buf, w + 192), ld_i32(buf, w + 224))
    return q, ld_f16(buf, r + 256 * Q8_GROUPS + 16 * g)


@njit(cache=True, nogil=True, inline="always")
def row_q8_0(w, X, c, acc):
    """y = d q: isum d dx."""
    return vfma(itof(isum_s8(w[0], X[0], c)), vmul(w[1], vsplat(X[1][c >> 5])), acc)


@njit(cache=True, nogil=True, inline="always")
def decode_q6_k(buf, r, g, j):
    dd = ld_f16(buf, r + 16 * g)
    sc = r + 16 * Q8_GROUPS + 16 * Q8_GROUPS * j + 8 * g           # scales [16][G][8]: sub-blocks 2j, 2j + 1
    dsc0 = vmul(dd, ld_i8(buf, sc))
    dsc1 = vmul(dd, ld_i8(buf, sc + 8 * Q8_GROUPS))
    s = r + 144 * Q8_GROUPS + 192 * Q8_GROUPS * j
    w = s + 128 * g
    h = s + 128 * Q8_GROUPS + 64 * g
    q = merge_q6(ld_i32(buf, w), ld_i32(buf, w + 32), ld_i32(buf, w + 64), ld_i32(buf, w + 96), ld_i32(buf, h),
                 ld_i32(buf, h + 32))
    return q, dsc0, dsc1


@njit(cache=True, nogil=True, inline="always")
def row_q6_k(w, X, c, acc):
    """y = (d sc) (q - 32) per 16 columns: ((i0 - 32 S0) dsc0 + (i1 - 32 S1) dsc1) dx; 6-bit bytes
    widen every two products."""
    i0, i1 = isum_6bit(w[0], X[0], c)
    h = c >> 4
    f0 = vsub(itof(i0), vsplat(np.float32(32.0) * X[2][h]))
    f1 = vsub(itof(i1), vsplat(np.float32(32.0) * X[2][h + 1]))
    return vfma(vfma(f0, w[1], vmul(f1, w[2])), vsplat(X[1][c >> 5]), acc)


# ==================================================================================================
# Group and entry kernels, one template for every type
# ==================================================================================================

@njit(cache=True, nogil=True, inline="always")
def put_rows8(out, t, row0, a):
    """out[t, row0:row0 + 8] = a, or the lanes below n_rows of a partial last group."""
    n_rows = out.shape[1]
    if row0 + 8 <= n_rows:
        vstore(out[t], row0, a)
    else:
        for k in range(n_rows - row0):
            out[t, row0 + k] = vlane(a, k)


_GRP_SOURCE = '''
@njit(cache=True, nogil=True, fastmath=False)
def grp{n}_{name}{v}(buf, base, g, nb, {xs}):
{zeros}
    for b in range(nb):
        r = base + b * {rec}
        for j in range({subs}):
            c = b * {block} + QK * j
            w = decode_{name}(buf, r, g, j)
{rows}
    return {accs}
'''

_SOURCE = '''
@njit(cache=True, nogil=True, inline="always")
def group_{name}{v}(out, buf, xq, dx, s16, s32, nb, u):
    tile = u // {groups}
    g = u - tile * {groups}
    base = tile * nb * {rec}
    T = out.shape[0]
    t = 0
    while t + 4 <= T:
        a0, a1, a2, a3 = grp4_{name}{v}(buf, base, g, nb, (xq[t], dx[t], s16[t], s32[t]),
                                     (xq[t + 1], dx[t + 1], s16[t + 1], s32[t + 1]),
                                     (xq[t + 2], dx[t + 2], s16[t + 2], s32[t + 2]),
                                     (xq[t + 3], dx[t + 3], s16[t + 3], s32[t + 3]))
        put_rows8(out, t, 8 * u, a0)
        put_rows8(out, t + 1, 8 * u, a1)
        put_rows8(out, t + 2, 8 * u, a2)
        put_rows8(out, t + 3, 8 * u, a3)
        t += 4
    while t < T:
        put_rows8(out, t, 8 * u, grp1_{name}{v}(buf, base, g, nb, (xq[t], dx[t], s16[t], s32[t])))
        t += 1


@njit(cache=True, nogil=True, fastmath=False)
def tile1_{name}{v}(out, buf, tile, nb, X0, t):
{zeros}
    base = tile * nb * {rec}
    for b in range(nb):
        r = base + b * {rec}
        for j in range({subs}):
            c = b * {block} + QK * j
{rows}
{puts}


@njit(cache=True, nogil=True, inline="always")
def few_{name}{v}(out, buf, xq, dx, s16, s32, nb, tile):
    for t in range(out.shape[0]):
        tile1_{name}{v}(out, buf, tile, nb, (xq[t], dx[t], s16[t], s32[t]), t)


@njit(cache=True, nogil=True, parallel=True, fastmath=False)
def q8mm_{name}{v}(out, buf, X, xq, dx, s16, s32, nb):
    T = X.shape[0]
    if T < 4:
        for t in range(T):
            quantize_row(X, xq, dx, s16, s32, {fmt}, t)
        for tile in prange((out.shape[1] + {tile_rows} - 1) // {tile_rows}):
            few_{name}{v}(out, buf, xq, dx, s16, s32, nb, tile)
    else:
        for t in prange(T):
            quantize_row(X, xq, dx, s16, s32, {fmt}, t)
        for u in prange((out.shape[1] + 7) // 8):
            group_{name}{v}(out, buf, xq, dx, s16, s32, nb, u)


@njit(cache=True, nogil=True, fastmath=False)
def q8mm_{name}{v}_serial(out, buf, X, xq, dx, s16, s32, nb):
    T = X.shape[0]
    for t in range(T):
        quantize_row(X, xq, dx, s16, s32, {fmt}, t)
    if T < 4:
        for tile in range((out.shape[1] + {tile_rows} - 1) // {tile_rows}):
            few_{name}{v}(out, buf, xq, dx, s16, s32, nb, tile)
    else:
        for u in range((out.shape[1] + 7) // 8):
            group_{name}{v}(out, buf, xq, dx, s16, s32, nb, u)
'''

# type: (name, record bytes, groups per tile, 32-column sub-blocks per record, columns per record,
# activation format)
Q8_TYPE_LAYOUTS = {
    GGMLType.Q4_0: ("q4_0", REC_Q4_0, 3, 1, 32, "Q8_0"),
    GGMLType.Q4_1: ("q4_1", REC_Q4_1, 3, 1, 32, "Q8_0"),
    GGMLType.Q4_K: ("q4_k", REC_Q4_K, 3, 8, 256, "Q8_K"),
    GGMLType.Q5_0: ("q5_0", REC_Q8_Q5_0, Q8_GROUPS, 1, 32, "Q8_0"),
    GGMLType.Q8_0: ("q8_0", REC_Q8_Q8_0, Q8_GROUPS, 1, 32, "Q8_0"),
    GGMLType.Q6_K: ("q6_k", REC_Q8_Q6_K, Q8_GROUPS, 8, 256, "Q8_K"),
}

_ROWS = (row_q4_0, row_q4_1, row_q4_k, row_q5_0, row_q8_0, row_q6_k)
GRP_ROWS = (1, 4)           # rows of x per decoded group: grp4_* for many rows, grp1_* the rest (8 rows
                            # at once, decoding each block once for a batch of 8, measured slower than
                            # twice 4 on Zen 4)

# GGMLType -> (parallel entry kernel, serial entry kernel), each
# kernel(out (T, n_rows), buf, X (T, n_cols) float32, xq, dx, s16, s32 (act_quant buffers of >= T rows), nb):
# quantizes X into the buffers, then out = W @ q8(X). Q8_KERNELS: AVX2 dot products (every x86-64 the
# engine runs on); Q8_KERNELS_VNNI: vpdpbusd, for CPUs with AVX512-VNNI + VL or AVX-VNNI (HAS_VNNI).
Q8_KERNELS = {}
Q8_KERNELS_VNNI = {}
for _v, _dots in _DOTS.items():
    if _v:                            # the row functions again, bound to this variant's integer sums
        _ns = dict(globals(), **_dots)
        for _row in _ROWS:
            globals()[_row.__name__ + _v] = njit(cache=True, nogil=True, inline="always")(
                bind_copy(_row.py_func, _row.__name__ + _v, _ns))
    for _qt, (_name, _rec, _groups, _subs, _block, _fmt) in Q8_TYPE_LAYOUTS.items():
        for _n in GRP_ROWS:            # grp<n>: one group's decoded weights against n rows of x
            exec(compile(_GRP_SOURCE.format(
                n=_n, name=_name, v=_v, rec=_rec, subs=_subs, block=_block,
                xs=", ".join(f"X{k}" for k in range(_n)), accs=", ".join(f"a{k}" for k in range(_n)),
                zeros="\n".join(f"    a{k} = vzero()" for k in range(_n)),
                rows="\n".join(f"            a{k} = row_{_name}{_v}(w, X{k}, c, a{k})" for k in range(_n))),
                __file__, "exec"), globals())
        _gs = range(_groups)
        _code = compile(_SOURCE.format(
            name=_name, v=_v, rec=_rec, groups=_groups, subs=_subs, block=_block, fmt=_fmt, tile_rows=8 * _groups,
            zeros="\n".join(f"    a{g} = vzero()" for g in _gs),
            rows="\n".join(f"            a{g} = row_{_name}{_v}(decode_{_name}(buf, r, {g}, j), X0, c, a{g})"
                            for g in _gs),
            puts="\n".join(f"    put_rows8(out, t, tile * {8 * _groups} + {8 * g}, a{g})" for g in _gs)), __file__, "exec")
        exec(_code, globals())
        (Q8_KERNELS_VNNI if _v else Q8_KERNELS)[_qt] = (globals()[f"q8mm_{_name}{_v}"],
                                                       globals()[f"q8mm_{_name}{_v}_serial"])


# Numba compiles for a CPU with 256-bit vpdpbusd (AVX-VNNI, or AVX512-VNNI with VL)
HAS_VNNI = compiles_for("avxvnni") or compiles_for("avx512vnni", "avx512vl")
