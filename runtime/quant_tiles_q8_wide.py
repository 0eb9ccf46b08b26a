"""q8 kernels on 16 lanes (AVX512-VNNI): two groups of 8 rows in one zmm register, for 4+ rows of x.

quant_tiles_q8.py's group kernels decode one group (8 rows x 32 columns) into 8-lane byte vectors
and run each row of x past them: per 4 columns of a row one vpbroadcastd of x and one vpdpbusd. On a
CPU with AVX512-VNNI the same instructions take 16 lanes. Here each register holds the same columns
of two groups (rows 8u .. 8u + 15: lanes 0..7 group u, lanes 8..15 group u + 1, loaded from their
two records with one vinserti64x4), so one broadcast of x and one vpdpbusd serve 16 rows: half the
instructions per multiply-add of the 8-lane kernels where a batch or a prompt chunk makes the
products compute-bound (T >= 4 rows; fewer rows stream the weights once per row and stay on
quant_tiles_q8's tile kernels).

Each lane computes what the 8-lane kernel computes for its row, operation for operation (the same
integer sums, the same float32 fold per block), so both give the same bits. Q8_0's signed weights
take the offset form here: the decoder flips each weight byte's sign bit (w + 128, unsigned) and the
fold subtracts 128 x sum(xq), which is exact in float32 (both terms are integers below 2^24), instead
of the 8-lane kernel's vpabsb / vpsignb per row of x.

Types: every type of the q8 mode (Q4_0, Q4_1, Q4_K, Q5_0, Q8_0, Q6_K; record layouts as
quant_tiles_q8.py's). The entry kernels q8mm_<type>_vnni512 (parallel, and _serial) take the same arguments as
quant_tiles_q8's; below 4 rows they run its 8-lane tile path.
"""
import numpy as np
from numba import njit, prange  # noqa: F401 (prange: named by the generated entry kernels)

from ringllm.runtime import quant_tiles_q8
from ringllm.runtime.act_quant import Q8_0, Q8_K, quantize_row  # noqa: F401 (named by the generated kernels)
from ringllm.runtime.packing_q8 import Q8_GROUPS
from ringllm.runtime.quant_tiles import QK  # noqa: F401 (named by the generated kernels)
from ringllm.runtime.quant_tiles_q8 import decode_q4_k, decode_q6_k, merge_q5, merge_q6, put_rows8, split_nibbles
from ringllm.runtime.quant_types import GGMLType
from ringllm.runtime.simd import (compiles_for, dpbusd, iadd, itof, ixor, ld_f16, zbc_i32, zcat, zfma, zfnma, zhi,
                                  zizero, zjoin_i32, zlo, zmul, zsplat, zstore, zsub, zzero)

__all__ = ["HAS_VNNI512", "Q8_KERNELS_VNNI512", "WIDE_TYPES"]


# Numba compiles for a CPU with 512-bit vpdpbusd: the q8 kernels of the types below take 16 lanes.
HAS_VNNI512 = compiles_for("avx512f", "avx512bw", "avx512vnni")


# ==================================================================================================
# Integer sums: 32 columns of 16 rows against one row of xq (as quant_tiles_q8's VNNI ones, 16 lanes)
# ==================================================================================================

@njit(cache=True, nogil=True, inline="always")
def _zdp4(q0, q1, q2, q3, x, c):
    """vpdpbusd over 16 columns, two independent chains."""
    a = dpbusd(dpbusd(zizero(), q0, zbc_i32(x, c)), q2, zbc_i32(x, c + 8))
    b = dpbusd(dpbusd(zizero(), q1, zbc_i32(x, c + 4)), q3, zbc_i32(x, c + 12))
    return iadd(a, b)


@njit(cache=True, nogil=True, inline="always")
def _zisum(q, x, c):
    """int32 lanes: 32 columns of unsigned bytes times xq[c:c + 32], in two chains of four."""
    a = dpbusd(dpbusd(zizero(), q[0], zbc_i32(x, c)), q[2], zbc_i32(x, c + 8))
    b = dpbusd(dpbusd(zizero(), q[1], zbc_i32(x, c + 4)), q[3], zbc_i32(x, c + 12))
    a = dpbusd(dpbusd(a, q[4], zbc_i32(x, c + 16)), q[6], zbc_i32(x, c + 24))
    b = dpbusd(dpbusd(b, q[5], zbc_i32(x, c + 20)), q[7], zbc_i32(x, c + 28))
    return iadd(a, b)


@njit(cache=True, nogil=True, inline="always")
def _zslots4(buf, w0, w1):
    """The 4 dword slots (4 x 32 bytes) of two groups, at bytes w0 and w1, joined on 16 lanes."""
    return (zjoin_i32(buf, w0, w1), zjoin_i32(buf, w0 + 32, w1 + 32), zjoin_i32(buf, w0 + 64, w1 + 64),
            zjoin_i32(buf, w0 + 96, w1 + 96))


@njit(cache=True, nogil=True, inline="always")
def _znibbles4(buf, w0, w1):
    """The nibble dwords of two groups split into 8 byte vectors, 16 lanes."""
    v0, v1, v2, v3 = _zslots4(buf, w0, w1)
    return split_nibbles(v0, v1, v2, v3)


@njit(cache=True, nogil=True, inline="always")
def _zf16(buf, o0, o1):
    """f32x16 of 8 float16 at byte o0 (lanes 0..7) and 8 at o1."""
    return zcat(ld_f16(buf, o0), ld_f16(buf, o1))


# ==================================================================================================
# Per type: zdecode_<type>(buf, r0, g0, r1, g1, j): sub-block j of group g0 of the record at r0 and of
# group g1 of the record at r1; zrow_<type>(w, X, c, acc): row_<type> of quant_tiles_q8 on 16 lanes.
# ==================================================================================================

@njit(cache=True, nogil=True, inline="always")
def zdecode_q4_0(buf, r0, g0, r1, g1, j):
    return _znibbles4(buf, r0 + 128 * g0, r1 + 128 * g1), _zf16(buf, r0 + 384 + 16 * g0, r1 + 384 + 16 * g1)


@njit(cache=True, nogil=True, inline="always")
def zrow_q4_0(w, X, c, acc):
    b = c >> 5
    f = zsub(itof(_zisum(w[0], X[0], c)), zsplat(np.float32(8.0) * X[3][b]))
    return zfma(f, zmul(w[1], zsplat(X[1][b])), acc)


@njit(cache=True, nogil=True, inline="always")
def zdecode_q4_1(buf, r0, g0, r1, g1, j):
    return (_znibbles4(buf, r0 + 128 * g0, r1 + 128 * g1), _zf16(buf, r0 + 384 + 16 * g0, r1 + 384 + 16 * g1),
            _zf16(buf, r0 + 432 + 16 * g0, r1 + 432 + 16 * g1))


@njit(cache=True, nogil=True, inline="always")
def zrow_q4_1(w, X, c, acc):
    b = c >> 5
    dxb = X[1][b]
    acc = zfma(itof(_zisum(w[0], X[0], c)), zmul(w[1], zsplat(dxb)), acc)
    return zfma(w[2], zsplat(dxb * X[3][b]), acc)


@njit(cache=True, nogil=True, inline="always")
def zdecode_q4_k(buf, r0, g0, r1, g1, j):
    _, dsc0, dmn0 = decode_q4_k(buf, r0, g0, j)       # the scales as the 8-lane decoder computes them
    _, dsc1, dmn1 = decode_q4_k(buf, r1, g1, j)
    return (_znibbles4(buf, r0 + 480 + 384 * j + 128 * g0, r1 + 480 + 384 * j + 128 * g1),
            zcat(dsc0, dsc1), zcat(dmn0, dmn1))


@njit(cache=True, nogil=True, inline="always")
def zrow_q4_k(w, X, c, acc):
    b = c >> 5
    dxb = X[1][b]
    acc = zfma(itof(_zisum(w[0], X[0], c)), zmul(w[1], zsplat(dxb)), acc)
    return zfnma(w[2], zsplat(dxb * X[3][b]), acc)


@njit(cache=True, nogil=True, inline="always")
def zdecode_q5_0(buf, r0, g0, r1, g1, j):
    v0, v1, v2, v3 = _zslots4(buf, r0 + 128 * g0, r1 + 128 * g1)
    q = merge_q5(v0, v1, v2, v3, zjoin_i32(buf, r0 + 128 * Q8_GROUPS + 32 * g0, r1 + 128 * Q8_GROUPS + 32 * g1))
    return q, _zf16(buf, r0 + 160 * Q8_GROUPS + 16 * g0, r1 + 160 * Q8_GROUPS + 16 * g1)


@njit(cache=True, nogil=True, inline="always")
def zrow_q5_0(w, X, c, acc):
    b = c >> 5
    f = zsub(itof(_zisum(w[0], X[0], c)), zsplat(np.float32(16.0) * X[3][b]))
    return zfma(f, zmul(w[1], zsplat(X[1][b])), acc)


@njit(cache=True, nogil=True, inline="always")
def zdecode_q8_0(buf, r0, g0, r1, g1, j):
    """The signed weight bytes with their sign bit flipped (w + 128, unsigned: module docstring)."""
    w0, w1 = r0 + 256 * g0, r1 + 256 * g1
    m = np.int32(-2139062144)            # 0x80808080
    q = (ixor(zjoin_i32(buf, w0, w1), m), ixor(zjoin_i32(buf, w0 + 32, w1 + 32), m),
         ixor(zjoin_i32(buf, w0 + 64, w1 + 64), m), ixor(zjoin_i32(buf, w0 + 96, w1 + 96), m),
         ixor(zjoin_i32(buf, w0 + 128, w1 + 128), m), ixor(zjoin_i32(buf, w0 + 160, w1 + 160), m),
         ixor(zjoin_i32(buf, w0 + 192, w1 + 192), m), ixor(zjoin_i32(buf, w0 + 224, w1 + 224), m))
    return q, _zf16(buf, r0 + 256 * Q8_GROUPS + 16 * g0, r1 + 256 * Q8_GROUPS + 16 * g1)


@njit(cache=True, nogil=True, inline="always")
def zrow_q8_0(w, X, c, acc):
    """isum(w + 128) - 128 S = isum(w), exactly (module docstring); then as row_q8_0."""
    b = c >> 5
    f = zsub(itof(_zisum(w[0], X[0], c)), zsplat(np.float32(128.0) * X[3][b]))
    return zfma(f, zmul(w[1], zsplat(X[1][b])), acc)


@njit(cache=True, nogil=True, inline="always")
def zdecode_q6_k(buf, r0, g0, r1, g1, j):
    _, dsc00, dsc01 = decode_q6_k(buf, r0, g0, j)
    _, dsc10, dsc11 = decode_q6_k(buf, r1, g1, j)
    s0 = r0 + 144 * Q8_GROUPS + 192 * Q8_GROUPS * j
    s1 = r1 + 144 * Q8_GROUPS + 192 * Q8_GROUPS * j
    h0, h1 = s0 + 128 * Q8_GROUPS + 64 * g0, s1 + 128 * Q8_GROUPS + 64 * g1
    v0, v1, v2, v3 = _zslots4(buf, s0 + 128 * g0, s1 + 128 * g1)
    q = merge_q6(v0, v1, v2, v3, zjoin_i32(buf, h0, h1), zjoin_i32(buf, h0 + 32, h1 + 32))
    return q, zcat(dsc00, dsc10), zcat(dsc01, dsc11)


@njit(cache=True, nogil=True, inline="always")
def zrow_q6_k(w, X, c, acc):
    q = w[0]
    i0 = _zdp4(q[0], q[1], q[2], q[3], X[0], c)           # columns c .. c + 15 and c + 16 .. c + 31 apart
    i1 = _zdp4(q[4], q[5], q[6], q[7], X[0], c + 16)
    h = c >> 4
    f0 = zsub(itof(i0), zsplat(np.float32(32.0) * X[2][h]))
    f1 = zsub(itof(i1), zsplat(np.float32(32.0) * X[2][h + 1]))
    return zfma(zfma(f0, w[1], zmul(f1, w[2])), zsplat(X[1][c >> 5]), acc)


# ==================================================================================================
# Group-pair and entry kernels, one template for every type
# ==================================================================================================

@njit(cache=True, nogil=True, inline="always")
def _zput(out, t, row0, a):
    """out[t, row0:row0 + 16] = a, or the lanes below n_rows."""
    if row0 + 16 <= out.shape[1]:
        zstore(out[t], row0, a)
    else:
        put_rows8(out, t, row0, zlo(a))
        if row0 + 8 < out.shape[1]:
            put_rows8(out, t, row0 + 8, zhi(a))


_GRP_SOURCE = '''
@njit(cache=True, nogil=True, fastmath=False)
def zgrp{n}_{name}(buf, base0, g0, base1, g1, nb, {xs}):
{zeros}
    for b in range(nb):
        r0 = base0 + b * {rec}
        r1 = base1 + b * {rec}
        for j in range({subs}):
            c = b * {block} + QK * j
            w = zdecode_{name}(buf, r0, g0, r1, g1, j)
{rows}
    return {accs}
'''

_SOURCE = '''
@njit(cache=True, nogil=True, inline="always")
def zgroup_{name}(out, buf, xq, dx, s16, s32, nb, p):
    n_groups = buf.shape[0] // (nb * {rec}) * {groups}
    u0 = 2 * p
    u1 = u0 + 1 if u0 + 1 < n_groups else u0      # past the buffer's last group: its lanes are not stored
    tile0 = u0 // {groups}
    tile1 = u1 // {groups}
    g0, g1 = u0 - tile0 * {groups}, u1 - tile1 * {groups}
    base0, base1 = tile0 * nb * {rec}, tile1 * nb * {rec}
    T = out.shape[0]
    t = 0
    while t + 4 <= T:
        a0, a1, a2, a3 = zgrp4_{name}(buf, base0, g0, base1, g1, nb, (xq[t], dx[t], s16[t], s32[t]),
                                      (xq[t + 1], dx[t + 1], s16[t + 1], s32[t + 1]),
                                      (xq[t + 2], dx[t + 2], s16[t + 2], s32[t + 2]),
                                      (xq[t + 3], dx[t + 3], s16[t + 3], s32[t + 3]))
        _zput(out, t, 8 * u0, a0)
        _zput(out, t + 1, 8 * u0, a1)
        _zput(out, t + 2, 8 * u0, a2)
        _zput(out, t + 3, 8 * u0, a3)
        t += 4
    while t < T:
        _zput(out, t, 8 * u0, zgrp1_{name}(buf, base0, g0, base1, g1, nb, (xq[t], dx[t], s16[t], s32[t])))
        t += 1


@njit(cache=True, nogil=True, parallel=True, fastmath=False)
def q8mm_{name}_vnni512(out, buf, X, xq, dx, s16, s32, nb):
    T = X.shape[0]
    if T < 4:
        for t in range(T):
            quantize_row(X, xq, dx, s16, s32, {fmt}, t)
        for tile in prange((out.shape[1] + {tile_rows} - 1) // {tile_rows}):
            few_{name}_vnni(out, buf, xq, dx, s16, s32, nb, tile)
    else:
        for t in prange(T):
            quantize_row(X, xq, dx, s16, s32, {fmt}, t)
        for p in prange((out.shape[1] + 15) // 16):
            zgroup_{name}(out, buf, xq, dx, s16, s32, nb, p)


@njit(cache=True, nogil=True, fastmath=False)
def q8mm_{name}_vnni512_serial(out, buf, X, xq, dx, s16, s32, nb):
    T = X.shape[0]
    for t in range(T):
        quantize_row(X, xq, dx, s16, s32, {fmt}, t)
    if T < 4:
        for tile in range((out.shape[1] + {tile_rows} - 1) // {tile_rows}):
            few_{name}_vnni(out, buf, xq, dx, s16, s32, nb, tile)
    else:
        for p in range((out.shape[1] + 15) // 16):
            zgroup_{name}(out, buf, xq, dx, s16, s32, nb, p)
'''

WIDE_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.Q6_K)

# GGMLType -> (parallel, serial) entry kernels, as quant_tiles_q8.Q8_KERNELS_VNNI's (HAS_VNNI512 hosts)
Q8_KERNELS_VNNI512 = {}
for _qt in WIDE_TYPES:
    _name, _rec, _groups, _subs, _block, _fmt = quant_tiles_q8.Q8_TYPE_LAYOUTS[_qt]
    globals()[f"few_{_name}_vnni"] = getattr(quant_tiles_q8, f"few_{_name}_vnni")
    for _n in quant_tiles_q8.GRP_ROWS:
        exec(compile(_GRP_SOURCE.format(
            n=_n, name=_name, rec=_rec, subs=_subs, block=_block,
            xs=", ".join(f"X{k}" for k in range(_n)), accs=", ".join(f"a{k}" for k in range(_n)),
            zeros="\n".join(f"    a{k} = zzero()" for k in range(_n)),
            rows="\n".join(f"            a{k} = zrow_{_name}(w, X{k}, c, a{k})" for k in range(_n))),
            __file__, "exec"), globals())
    exec(compile(_SOURCE.format(name=_name, rec=_rec, groups=_groups, fmt=_fmt, tile_rows=8 * _groups),
                 __file__, "exec"), globals())
    Q8_KERNELS_VNNI512[_qt] = (globals()[f"q8mm_{_name}_vnni512"], globals()[f"q8mm_{_name}_vnni512_serial"])
