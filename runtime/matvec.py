"""Quantized matrix-vector product for batch-1 decode: out = W @ x, W in GGML blocks, x float32.

This is the hot loop of the CPU engine. Weights are repacked once at load (`pack`) into a layout
made for 256-bit SIMD (AVX2 + FMA + F16C), and `matvec` streams that layout once per call.
`matmul` (prefill, X (T, n_cols)) decodes each tile once and multiplies it with all T rows.

Accuracy: x is never quantized. The result is dequantize(W) @ x up to float32 rounding of the
accumulation order (every dequantized weight value is exact in float32, every scale product
d * sc is exact, and the per-block identity sum_j (d q_j + m) x_j = d sum_j q_j x_j + m sum_j x_j
is applied in float32 with fused multiply-adds). x values below ~1e-30 in magnitude may lose bits
to the power-of-two pre-scaling described below; their products are far below the float32
resolution of any real dot product.

Layout ("lanes = rows"). Rows go in groups of 8, one group per 256-bit register: lane k of every
vector belongs to row 8g + k. A tile is three groups (24 rows) for the 4- and 5-bit types (Q4_0,
Q4_1, Q4_K, Q5_0, Q5_1, Q5_K), two (16 rows) for the others, whose inner loops need more registers;
rows past n_rows are zero padding. For each tile, the data of one block column (32 values; 256 for
K-quants) of all its groups is one contiguous record, and a tile is its records in column order, so
a thread streams one contiguous run of memory (with software prefetch PF_DIST bytes ahead). Small
packed matrices are cut one after another from shared huge-page slabs, so matrices packed in the
order of a forward pass also follow each other in memory. Per 8 weights (one value of 8 rows) the
inner loop is

    vandps / vpsrld  (pick the 4/5/6-bit field in place)      1 op
    vcvtdq2ps        (int -> float)                            1 op
    vfmadd213ps      (acc += q * x[col], x broadcast)          1 op; one vbroadcastss per 2-3 groups

Packed quants. Each lane's values sit in 32-bit words as fixed-width fields: 4-bit types 8 fields
per dword (column 8s + i of a block at bits 4i of dword s), 5-bit types 6 per dword (column 6m + i at
bits 5i of dword m; the block's last 2 columns in a sixth dword), Q6_K 5 per dword at bits 6i (7
dwords per 32 columns, each 16-value sub-block in its own 3 dwords plus one field of the seventh).
`dword & (mask << w i)` is q * 2^(w i) exactly, so x is pre-scaled once per call by 2^(-w i)
(xs; the top field uses a shift and an unscaled x). Q8_0 keeps int8 values, the 8 rows of a column
adjacent (vpmovsxbd). F16 scales stay 16-bit (vcvtph2ps); K-quant 6-bit sub-block scales become
bytes; F16 / BF16 weights stay 16-bit. Packed bytes per weight equal the file's for Q4_0, Q4_1,
Q4_K, Q8_0 and the float types; the field packing costs +18% for the 5-bit types and +15% for Q6_K
(26 instead of 22 bytes per Q5_0 block), repaid by an inner loop as short as the 4-bit one (the
alternative, ORing high-bit planes into nibbles, needs ~9 more ops per 64 weights and ran 30-40%
slower, compute bound).

Offsets are folded per block with the sums of x over each block, computed once per call and
shared by all rows: Q4_1: y = d q + m -> d * sum(q x) + m * S_b; Q4_0: d * (sum(q x) - 8 S_b), etc.

Kernels follow the house style: destination first, return None, nogil, cache; only the entry
kernels (`matvec_<type>`, `unpack_tiles`, `matmul_tiles`) are parallel. matvec entries run prange
over tiles, honour numba.set_num_threads, and stay on the calling thread when one thread is set or
the matrix is small (PAR_MIN_WEIGHTS), where fork/join would cost more than it saves. The SIMD
operations are Numba intrinsics (llvmlite IR on <8 x float> / <8 x i32> values) defined at the top
of this file; `kernel.inspect_asm(kernel.signatures[0])` shows the vandps / vcvtdq2ps /
vfmadd213ps / vbroadcastss inner loops.

Kernels trust their arguments (no bounds checks); the Python entry points validate.
"""
from __future__ import annotations

import mmap
import threading

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from ringllm.runtime.errors import ConfigError, UnsupportedModelError
from ringllm.runtime.qtensor import QTensor
from ringllm.runtime.quant_types import BLOCK_LAYOUT, GGMLType

__all__ = ["PackedMatrix", "pack", "matvec", "matmul", "unpack", "unpack_rows", "tile_rows", "KERNELS"]

TILE = 16           # rows per tile: two groups of 8 lanes ...
TILE3 = 24          # ... or three for the 4- and 5-bit types (more reuse of each x broadcast)
GROUP = 8           # rows per 256-bit vector
QK = 32             # values per legacy block
QK_K = 256          # values per K-quant super-block
PF_DIST = 2048      # software prefetch distance in bytes
PAR_MIN_WEIGHTS = 65536  # matrices with fewer weights run on the calling thread only (fork/join costs more)


# ==================================================================================================
# SIMD layer: Numba types for <8 x float> and <8 x i32>, and intrinsics on them.
#
# Loads from a packed uint8 buffer take a byte offset; loads/stores on float32 arrays take an
# element index. Nothing is bounds-checked.
# ==================================================================================================

class F32x8Type(types.Type):
    """Eight float32 lanes (an LLVM <8 x float>, one ymm register)."""

    def __init__(self):
        super().__init__(name="f32x8")


class I32x8Type(types.Type):
    """Eight 32-bit integer lanes (an LLVM <8 x i32>)."""

    def __init__(self):
        super().__init__(name="i32x8")


f32x8 = F32x8Type()
i32x8 = I32x8Type()
_VF = ir.VectorType(ir.FloatType(), 8)
_VI = ir.VectorType(ir.IntType(32), 8)
_I32 = ir.IntType(32)


@register_model(F32x8Type)
class _F32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VF)


@register_model(I32x8Type)
class _I32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VI)


def _elem_ptr(context, builder, arrty, arr, idx, idxty):
    """Pointer to element idx of a 1-D array (in units of its dtype)."""
    ary = context.make_array(arrty)(context, builder, arr)
    i = context.cast(builder, idx, idxty, types.intp)
    return builder.gep(ary.data, [i], inbounds=True)


def _byte_ptr(context, builder, arrty, arr, off, offty, pointee):
    """Pointer to `pointee` at byte offset off of a uint8 array's data."""
    p = _elem_ptr(context, builder, arrty, arr, off, offty)
    return builder.bitcast(p, pointee.as_pointer())


def _splat(builder, scalar, vty):
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(_VI, [0] * 8))


def _splat_i32(context, builder, val, valty):
    return _splat(builder, context.cast(builder, val, valty, types.int32), _VI)


@intrinsic
def vzero(typingctx):
    """f32x8 of zeros."""
    def codegen(context, builder, sig, args):
        return ir.Constant(_VF, [0.0] * 8)
    return f32x8(), codegen


@intrinsic
def vsplat(typingctx, x):
    """f32x8 with the scalar x in every lane."""
    def codegen(context, builder, sig, args):
        return _splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), _VF)
    return f32x8(x), codegen


@intrinsic
def vbcast(typingctx, arr, idx):
    """f32x8 with arr[idx] (float32 1-D array) in every lane (vbroadcastss)."""
    def codegen(context, builder, sig, args):
        s = builder.load(_elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1]), align=4)
        return _splat(builder, s, _VF)
    return f32x8(arr, idx), codegen


@intrinsic
def vload(typingctx, arr, idx):
    """f32x8 from arr[idx:idx + 8] (float32 1-D array)."""
    def codegen(context, builder, sig, args):
        p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        return builder.load(builder.bitcast(p, _VF.as_pointer()), align=4)
    return f32x8(arr, idx), codegen


@intrinsic
def vstore(typingctx, arr, idx, v):
    """arr[idx:idx + 8] = v (float32 1-D array)."""
    def codegen(context, builder, sig, args):
        p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        builder.store(args[2], builder.bitcast(p, _VF.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(arr, idx, v), codegen


@intrinsic
def ld_f32(typingctx, buf, off):
    """f32x8 from 8 little-endian float32 at byte offset off of a uint8 buffer."""
    def codegen(context, builder, sig, args):
        return builder.load(_byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _VF), align=4)
    return f32x8(buf, off), codegen


@intrinsic
def ld_f16(typingctx, buf, off):
    """f32x8 from 8 IEEE binary16 at byte offset off (vcvtph2ps; exact)."""
    def codegen(context, builder, sig, args):
        vh = ir.VectorType(ir.HalfType(), 8)
        h = builder.load(_byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], vh), align=2)
        return builder.fpext(h, _VF)
    return f32x8(buf, off), codegen


@intrinsic
def ld_bf16(typingctx, buf, off):
    """f32x8 from 8 bfloat16 at byte offset off (vpmovzxwd + vpslld 16; exact)."""
    def codegen(context, builder, sig, args):
        vw = ir.VectorType(ir.IntType(16), 8)
        h = builder.load(_byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], vw), align=2)
        bits = builder.shl(builder.zext(h, _VI), ir.Constant(_VI, [16] * 8))
        return builder.bitcast(bits, _VF)
    return f32x8(buf, off), codegen


@intrinsic
def ld_i8(typingctx, buf, off):
    """f32x8 from 8 int8 at byte offset off (vpmovsxbd + vcvtdq2ps)."""
    def codegen(context, builder, sig, args):
        vb = ir.VectorType(ir.IntType(8), 8)
        b = builder.load(_byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], vb), align=1)
        return builder.sitofp(builder.sext(b, _VI), _VF)
    return f32x8(buf, off), codegen


@intrinsic
def ld_u8(typingctx, buf, off):
    """f32x8 from 8 uint8 at byte offset off (vpmovzxbd + vcvtdq2ps)."""
    def codegen(context, builder, sig, args):
        vb = ir.VectorType(ir.IntType(8), 8)
        b = builder.load(_byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], vb), align=1)
        return builder.sitofp(builder.zext(b, _VI), _VF)
    return f32x8(buf, off), codegen


@intrinsic
def ld_i32(typingctx, buf, off):
    """i32x8 from 8 little-endian 32-bit words at byte offset off."""
    def codegen(context, builder, sig, args):
        return builder.load(_byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _VI), align=4)
    return i32x8(buf, off), codegen


@intrinsic
def prefetch(typingctx, buf, off):
    """Hint the cache line at byte offset off of buf (prefetchnta: weights are read once per token,
    so they should not displace other data from L2/L3; measured equal to prefetcht0); never faults."""
    def codegen(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], ir.IntType(8))
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), _I32, _I32, _I32]),
            "llvm.prefetch.p0i8")
        builder.call(fn, [p, ir.Constant(_I32, 0), ir.Constant(_I32, 0), ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return types.none(buf, off), codegen


@intrinsic
def vfma(typingctx, a, b, c):
    """a * b + c, fused (vfmadd)."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF, _VF, _VF]), "llvm.fma.v8f32")
        return builder.call(fn, args)
    return f32x8(a, b, c), codegen


@intrinsic
def vfnma(typingctx, a, b, c):
    """c - a * b, fused (vfnmadd)."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF, _VF, _VF]), "llvm.fma.v8f32")
        return builder.call(fn, [builder.fneg(args[0]), args[1], args[2]])
    return f32x8(a, b, c), codegen


@intrinsic
def vadd(typingctx, a, b):
    """a + b."""
    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1])
    return f32x8(a, b), codegen


@intrinsic
def vsub(typingctx, a, b):
    """a - b."""
    def codegen(context, builder, sig, args):
        return builder.fsub(args[0], args[1])
    return f32x8(a, b), codegen


@intrinsic
def vmul(typingctx, a, b):
    """a * b."""
    def codegen(context, builder, sig, args):
        return builder.fmul(args[0], args[1])
    return f32x8(a, b), codegen


@intrinsic
def isrl(typingctx, v, n):
    """v >> n, logical, every lane (n: scalar 0..31)."""
    def codegen(context, builder, sig, args):
        return builder.lshr(args[0], _splat_i32(context, builder, args[1], sig.args[1]))
    return i32x8(v, n), codegen


@intrinsic
def andf(typingctx, v, mask):
    """float32(int32(v & mask)) per lane (vpand + vcvtdq2ps)."""
    def codegen(context, builder, sig, args):
        return builder.sitofp(builder.and_(args[0], _splat_i32(context, builder, args[1], sig.args[1])), _VF)
    return f32x8(v, mask), codegen


@intrinsic
def srlf(typingctx, v, n):
    """float32(int32(v >> n)) per lane, logical shift (vpsrld + vcvtdq2ps)."""
    def codegen(context, builder, sig, args):
        return builder.sitofp(builder.lshr(args[0], _splat_i32(context, builder, args[1], sig.args[1])), _VF)
    return f32x8(v, n), codegen


@intrinsic
def _num_threads(typingctx):
    """numba.get_num_threads() by symbol name (the overload Numba ships bakes in a ctypes address,
    which makes a function uncacheable)."""
    from numba.np.ufunc.parallel import _launch_threads
    _launch_threads()

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(cgutils.intp_t, []), "get_num_threads")
        return builder.call(fn, [])
    return types.intp(), codegen


@intrinsic
def vhsum(typingctx, v):
    """Sum of the 8 lanes, as float32."""
    def codegen(context, builder, sig, args):
        s = builder.extract_element(args[0], ir.Constant(_I32, 0))
        for k in range(1, 8):
            s = builder.fadd(s, builder.extract_element(args[0], ir.Constant(_I32, k)))
        return s
    return types.float32(v), codegen


# ==================================================================================================
# x preparation: pre-scaled copies of x and per-block sums, once per call, shared by all rows
# ==================================================================================================

@njit(cache=True, nogil=True)
def _prep(xs, xsum, x, tab, sub):
    """xs (n,) float32 = x * tab[c % 32] (the power-of-two pre-scaling of each column's field, see
    _x_scales); xsum (n // sub,) float32 = sums of x over runs of sub = 32 or 16 values. n % 32 == 0."""
    t0 = vload(tab, 0)
    t1 = vload(tab, 8)
    t2 = vload(tab, 16)
    t3 = vload(tab, 24)
    for b in range(x.shape[0] // 32):
        c = 32 * b
        v0 = vload(x, c)
        v1 = vload(x, c + 8)
        v2 = vload(x, c + 16)
        v3 = vload(x, c + 24)
        vstore(xs, c, vmul(v0, t0))
        vstore(xs, c + 8, vmul(v1, t1))
        vstore(xs, c + 16, vmul(v2, t2))
        vstore(xs, c + 24, vmul(v3, t3))
        if sub == 32:
            xsum[b] = vhsum(vadd(vadd(v0, v1), vadd(v2, v3)))
        else:
            xsum[2 * b] = vhsum(vadd(v0, v1))
            xsum[2 * b + 1] = vhsum(vadd(v2, v3))


def _x_scales(qtype: GGMLType) -> np.ndarray:
    """float32 (32,): the factor 2^(-w i) of column c % 32 of a block whose q sits at bits w i of its
    dword (1 for the top field, which the kernels read with a shift instead of a mask).

    4-bit types: column 8s + i at field i (w = 4, i = 7 top). 5-bit: column 6m + i (m < 5), 30 + i
    (w = 5, i = 5 top). Q6_K: columns 5m + i and 16 + 5m + i (m < 3), 15 and 31 at fields 0 and 1
    (w = 6, i = 4 top). Other types: ones.
    """
    c = np.arange(32)
    if qtype in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K):
        i = c % 8
        e = np.where(i == 7, 0, 4 * i)
    elif qtype in (GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q5_K):
        i = np.where(c < 30, c % 6, c - 30)
        e = np.where(i == 5, 0, 5 * i)
    elif qtype == GGMLType.Q6_K:
        i = np.where(c < 15, c % 5, np.where(c == 15, 0, np.where(c < 31, (c - 16) % 5, 1)))
        e = np.where(i == 4, 0, 6 * i)
    else:
        e = np.zeros(32, np.int64)
    return (2.0 ** -e.astype(np.float64)).astype(np.float32)


# ==================================================================================================
# Block inner products for the groups of a tile. Each returns one accumulator per group: per lane,
# the sum over the block's columns of q * x (q the raw unsigned field, x from the matching xs).
# ==================================================================================================

@njit(cache=True, nogil=True, inline="always")
def _prefetch_range(buf, start, nbytes):
    """prefetch every 64-byte line of buf[start:start + nbytes] (nbytes a constant)."""
    for pf in range(0, nbytes, 64):
        prefetch(buf, start + pf)


@njit(cache=True, nogil=True, inline="always")
def _nib(w, i):
    """Nibble i (0..7) of every lane of w, as float q * 2^(4i) (i < 7) or q (i == 7)."""
    if i == 7:
        return srlf(w, 28)
    return andf(w, 15 << (4 * i))


@njit(cache=True, nogil=True, inline="always")
def _dot_q4(buf, r, xs, xb):
    """32 columns of 4-bit values for three groups: nibble dwords of group g at byte r + 128 g
    (4 slots x 32 bytes); xs from _prep, columns xb..xb+31. Returns (acc_g0, acc_g1, acc_g2)."""
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
            a0 = vfma(_nib(w0, i), x0, a0)
            c0 = vfma(_nib(w1, i), x0, c0)
            e0 = vfma(_nib(w2, i), x0, e0)
            x1 = vbcast(xs, xb + 8 * s + i + 1)
            a1 = vfma(_nib(w0, i + 1), x1, a1)
            c1 = vfma(_nib(w1, i + 1), x1, c1)
            e1 = vfma(_nib(w2, i + 1), x1, e1)
    return vadd(a0, a1), vadd(c0, c1), vadd(e0, e1)


@njit(cache=True, nogil=True, inline="always")
def _f5(w, i):
    """5-bit field i (0..5, bits 5i..5i+4) of every lane of w, as float q * 2^(5i) (i < 5) or q."""
    if i == 5:
        return srlf(w, 25)
    return andf(w, 0x1F << (5 * i))


@njit(cache=True, nogil=True, inline="always")
def _dot_q5(buf, r, xs, xb):
    """32 columns of 5-bit values for three groups: field dwords of group g at byte r + 192 g (6 x 32
    bytes; dword m holds columns 6m..6m+5, dword 5 columns 30, 31); xs from _prep."""
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
            a0 = vfma(_f5(w0, i), x0, a0)
            c0 = vfma(_f5(w1, i), x0, c0)
            e0 = vfma(_f5(w2, i), x0, e0)
            x1 = vbcast(xs, xb + 6 * m + i + 1)
            a1 = vfma(_f5(w0, i + 1), x1, a1)
            c1 = vfma(_f5(w1, i + 1), x1, c1)
            e1 = vfma(_f5(w2, i + 1), x1, e1)
    w0 = ld_i32(buf, r + 160)
    w1 = ld_i32(buf, r + 352)
    w2 = ld_i32(buf, r + 544)
    x0 = vbcast(xs, xb + 30)
    a0 = vfma(_f5(w0, 0), x0, a0)
    c0 = vfma(_f5(w1, 0), x0, c0)
    e0 = vfma(_f5(w2, 0), x0, e0)
    x1 = vbcast(xs, xb + 31)
    a1 = vfma(_f5(w0, 1), x1, a1)
    c1 = vfma(_f5(w1, 1), x1, c1)
    e1 = vfma(_f5(w2, 1), x1, e1)
    return vadd(a0, a1), vadd(c0, c1), vadd(e0, e1)


@njit(cache=True, nogil=True, inline="always")
def _f6(w, i):
    """6-bit field i (0..4, bits 6i..6i+5) of every lane of w, as float q * 2^(6i) (i < 4) or q."""
    if i == 4:
        return srlf(w, 24)
    return andf(w, 0x3F << (6 * i))


@njit(cache=True, nogil=True, inline="always")
def _dot_q6(buf, r, xs, xb):
    """32 columns (two 16-value sub-blocks A, B) of 6-bit values for two groups: field dwords of group
    g at byte r + 224 g (7 x 32 bytes: dwords 0-2 hold columns 0-14, dwords 3-5 columns 16-30, dword 6
    columns 15 and 31); xs from _prep. Returns (A_g0, B_g0, A_g1, B_g1)."""
    a0 = vzero()
    b0 = vzero()
    a1 = vzero()
    b1 = vzero()
    for m in range(3):
        wa0 = ld_i32(buf, r + 32 * m)
        wb0 = ld_i32(buf, r + 96 + 32 * m)
        wa1 = ld_i32(buf, r + 224 + 32 * m)
        wb1 = ld_i32(buf, r + 320 + 32 * m)
        for i in range(5):
            xa = vbcast(xs, xb + 5 * m + i)
            a0 = vfma(_f6(wa0, i), xa, a0)
            a1 = vfma(_f6(wa1, i), xa, a1)
            xv = vbcast(xs, xb + 16 + 5 * m + i)
            b0 = vfma(_f6(wb0, i), xv, b0)
            b1 = vfma(_f6(wb1, i), xv, b1)
    w0 = ld_i32(buf, r + 192)
    w1 = ld_i32(buf, r + 416)
    xa = vbcast(xs, xb + 15)
    a0 = vfma(_f6(w0, 0), xa, a0)
    a1 = vfma(_f6(w1, 0), xa, a1)
    xv = vbcast(xs, xb + 31)
    b0 = vfma(_f6(w0, 1), xv, b0)
    b1 = vfma(_f6(w1, 1), xv, b1)
    return a0, b0, a1, b1


# ==================================================================================================
# Tile kernels: one tile (16 rows, or 24 for Q4_0 / Q4_1 / Q4_K) of one type, all columns:
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
REC_Q6_K = 2 * 16 + 16 * 2 * 8 + 8 * 2 * 224                # d, sc, fields per 32 cols (two groups)
REC_F16 = 2 * 16                         # per column (F16 and BF16)
REC_F32 = 2 * 32                         # per column (F32)


@njit(cache=True, nogil=True)
def _tile_q4_0(dst, d0, buf, base, nb, xs, xsum):
    """Q4_0 tile (24 rows): y = d (q - 8) -> d * (sum q x - 8 S_b)."""
    o0 = vzero()
    o1 = vzero()
    o2 = vzero()
    for b in range(nb):
        r = base + b * REC_Q4_0
        _prefetch_range(buf, r + PF_DIST, REC_Q4_0)
        a0, a1, a2 = _dot_q4(buf, r, xs, b * QK)
        s8 = vmul(vbcast(xsum, b), vsplat(np.float32(8.0)))
        o0 = vfma(ld_f16(buf, r + 384), vsub(a0, s8), o0)
        o1 = vfma(ld_f16(buf, r + 400), vsub(a1, s8), o1)
        o2 = vfma(ld_f16(buf, r + 416), vsub(a2, s8), o2)
    vstore(dst, d0, o0)
    vstore(dst, d0 + 8, o1)
    vstore(dst, d0 + 16, o2)


@njit(cache=True, nogil=True)
def _tile_q4_1(dst, d0, buf, base, nb, xs, xsum):
    """Q4_1 tile (24 rows): y = d q + m -> d * sum(q x) + m * S_b."""
    o0 = vzero()
    o1 = vzero()
    o2 = vzero()
    for b in range(nb):
        r = base + b * REC_Q4_1
        _prefetch_range(buf, r + PF_DIST, REC_Q4_1)
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


@njit(cache=True, nogil=True)
def _tile_q5_0(dst, d0, buf, base, nb, xs, xsum):
    """Q5_0 tile (24 rows): y = d (q - 16) -> d * (sum q x - 16 S_b)."""
    o0 = vzero()
    o1 = vzero()
    o2 = vzero()
    for b in range(nb):
        r = base + b * REC_Q5_0
        _prefetch_range(buf, r + PF_DIST, REC_Q5_0)
        a0, a1, a2 = _dot_q5(buf, r, xs, b * QK)
        s16 = vmul(vbcast(xsum, b), vsplat(np.float32(16.0)))
        o0 = vfma(ld_f16(buf, r + 576), vsub(a0, s16), o0)
        o1 = vfma(ld_f16(buf, r + 592), vsub(a1, s16), o1)
        o2 = vfma(ld_f16(buf, r + 608), vsub(a2, s16), o2)
    vstore(dst, d0, o0)
    vstore(dst, d0 + 8, o1)
    vstore(dst, d0 + 16, o2)


@njit(cache=True, nogil=True)
def _tile_q5_1(dst, d0, buf, base, nb, xs, xsum):
    """Q5_1 tile (24 rows): y = d q + m."""
    o0 = vzero()
    o1 = vzero()
    o2 = vzero()
    for b in range(nb):
        r = base + b * REC_Q5_1
        _prefetch_range(buf, r + PF_DIST, REC_Q5_1)
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


@njit(cache=True, nogil=True)
def _tile_q8_0(dst, d0, buf, base, nb, x):
    """Q8_0 tile: y = d q, q int8 stored [col][lane] per group (256 bytes)."""
    o0 = vzero()
    o1 = vzero()
    for b in range(nb):
        r = base + b * REC_Q8_0
        _prefetch_range(buf, r + PF_DIST, REC_Q8_0)
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


@njit(cache=True, nogil=True)
def _tile_q4_k(dst, d0, buf, base, nb, xs, xsum):
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
            _prefetch_range(buf, r + PF_DIST + j * (REC_Q4_K // 8), REC_Q4_K // 8)
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


@njit(cache=True, nogil=True)
def _tile_q5_k(dst, d0, buf, base, nb, xs, xsum):
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
            _prefetch_range(buf, r + PF_DIST + j * (REC_Q5_K // 8), REC_Q5_K // 8)
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


@njit(cache=True, nogil=True)
def _tile_q6_k(dst, d0, buf, base, nb, xs, xsum):
    """Q6_K tile (16 rows): per 16-value sub-block u, y = (d sc_u) (q - 32), sc int8.

    Record per super-block: d [2][8] f16, sc [16 sub][2][8] i8, then per 32 columns j: fields
    [2 groups][7][8 lanes] u32 (see _dot_q6).
    """
    o0 = vzero()
    o1 = vzero()
    for b in range(nb):
        r = base + b * REC_Q6_K
        dd0 = ld_f16(buf, r)
        dd1 = ld_f16(buf, r + 16)
        for j in range(8):
            _prefetch_range(buf, r + PF_DIST + j * (REC_Q6_K // 8), REC_Q6_K // 8)
            a0, b0, a1, b1 = _dot_q6(buf, r + 288 + 448 * j, xs, b * QK_K + QK * j)
            u = 2 * j
            sa = vmul(vbcast(xsum, b * 16 + u), vsplat(np.float32(32.0)))
            sv = vmul(vbcast(xsum, b * 16 + u + 1), vsplat(np.float32(32.0)))
            o0 = vfma(vmul(dd0, ld_i8(buf, r + 32 + 16 * u)), vsub(a0, sa), o0)
            o1 = vfma(vmul(dd1, ld_i8(buf, r + 40 + 16 * u)), vsub(a1, sa), o1)
            o0 = vfma(vmul(dd0, ld_i8(buf, r + 48 + 16 * u)), vsub(b0, sv), o0)
            o1 = vfma(vmul(dd1, ld_i8(buf, r + 56 + 16 * u)), vsub(b1, sv), o1)
    vstore(dst, d0, o0)
    vstore(dst, d0 + 8, o1)


@njit(cache=True, nogil=True)
def _tile_f16(dst, d0, buf, base, nb, x):
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


@njit(cache=True, nogil=True)
def _tile_bf16(dst, d0, buf, base, nb, x):
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


@njit(cache=True, nogil=True)
def _tile_f32(dst, d0, buf, base, nb, x):
    """F32 tile: nb = n_cols; per column [2 groups][8 lanes] f32."""
    a0 = vzero()
    a1 = vzero()
    c0 = vzero()
    c1 = vzero()
    n2 = nb - nb % 2
    for c in range(0, n2, 2):
        r = base + c * REC_F32
        _prefetch_range(buf, r + PF_DIST, 2 * REC_F32)
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
# Entry kernels: matvec_<type>(out, buf, x, scratch): out (n_rows,) float32 = W @ x.
#
#   buf:     uint8 records from pack (PackedMatrix.buf).
#   x:       (n_cols,) float32; read once, into scratch, before any output is written (so out may
#            alias x).
#   scratch: float32 (56 + n_cols // 16 + n_cols,): x scale table (32), last partial tile (24), block
#            sums of x, pre-scaled x (see _split; PackedMatrix.scratch is set up by pack).
# Tiles run in prange when more than one thread is set and there is more than one tile.
# ==================================================================================================

@njit(cache=True, nogil=True, inline="always")
def _split(out, x, scratch):
    """(n_rows, n_cols, xs, xsum, tab) views of the scratch layout
    [tab (32) | tail (24) | xsum (n_cols // 16) | xs (n_cols)]."""
    n_cols = x.shape[0]
    o = 56 + n_cols // 16
    return out.shape[0], n_cols, scratch[o:o + n_cols], scratch[56:o], scratch[:32]


@njit(cache=True, nogil=True)
def _copy_x(xs, x):
    """xs[:] = x (float types and Q8_0 use x as is)."""
    for c in range(x.shape[0]):
        xs[c] = x[c]


@njit(cache=True, nogil=True)
def _finish_tail(out, tail, r0):
    """out[r0:] = tail[:n_rows - r0] (rows of the last, partial tile)."""
    for r in range(r0, out.shape[0]):
        out[r] = tail[r - r0]


@njit(cache=True, nogil=True, parallel=True)
def matvec_q4_0(out, buf, x, scratch):
    """Q4_0: out (n_rows,) float32 = W @ x; buf from pack()."""
    n_rows, n_cols, xs, xsum, tab = _split(out, x, scratch)
    _prep(xs, xsum, x, tab, 32)
    nb = n_cols // QK
    stride = nb * REC_Q4_0
    n_full = n_rows // TILE3
    if _num_threads() == 1 or n_full < 2 or n_rows * n_cols < PAR_MIN_WEIGHTS:
        for t in range(n_full):
            _tile_q4_0(out, t * TILE3, buf, t * stride, nb, xs, xsum)
    else:
        for t in prange(n_full):
            _tile_q4_0(out, t * TILE3, buf, t * stride, nb, xs, xsum)
    if n_full * TILE3 < n_rows:
        tail = scratch[32:56]
        _tile_q4_0(tail, 0, buf, n_full * stride, nb, xs, xsum)
        _finish_tail(out, tail, n_full * TILE3)


@njit(cache=True, nogil=True, parallel=True)
def matvec_q4_1(out, buf, x, scratch):
    """Q4_1: out (n_rows,) float32 = W @ x; buf from pack()."""
    n_rows, n_cols, xs, xsum, tab = _split(out, x, scratch)
    _prep(xs, xsum, x, tab, 32)
    nb = n_cols // QK
    stride = nb * REC_Q4_1
    n_full = n_rows // TILE3
    if _num_threads() == 1 or n_full < 2 or n_rows * n_cols < PAR_MIN_WEIGHTS:
        for t in range(n_full):
            _tile_q4_1(out, t * TILE3, buf, t * stride, nb, xs, xsum)
    else:
        for t in prange(n_full):
            _tile_q4_1(out, t * TILE3, buf, t * stride, nb, xs, xsum)
    if n_full * TILE3 < n_rows:
        tail = scratch[32:56]
        _tile_q4_1(tail, 0, buf, n_full * stride, nb, xs, xsum)
        _finish_tail(out, tail, n_full * TILE3)


@njit(cache=True, nogil=True, parallel=True)
def matvec_q5_0(out, buf, x, scratch):
    """Q5_0: out (n_rows,) float32 = W @ x; buf from pack()."""
    n_rows, n_cols, xs, xsum, tab = _split(out, x, scratch)
    _prep(xs, xsum, x, tab, 32)
    nb = n_cols // QK
    stride = nb * REC_Q5_0
    n_full = n_rows // TILE3
    if _num_threads() == 1 or n_full < 2 or n_rows * n_cols < PAR_MIN_WEIGHTS:
        for t in range(n_full):
            _tile_q5_0(out, t * TILE3, buf, t * stride, nb, xs, xsum)
    else:
        for t in prange(n_full):
            _tile_q5_0(out, t * TILE3, buf, t * stride, nb, xs, xsum)
    if n_full * TILE3 < n_rows:
        tail = scratch[32:56]
        _tile_q5_0(tail, 0, buf, n_full * stride, nb, xs, xsum)
        _finish_tail(out, tail, n_full * TILE3)


@njit(cache=True, nogil=True, parallel=True)
def matvec_q5_1(out, buf, x, scratch):
    """Q5_1: out (n_rows,) float32 = W @ x; buf from pack()."""
    n_rows, n_cols, xs, xsum, tab = _split(out, x, scratch)
    _prep(xs, xsum, x, tab, 32)
    nb = n_cols // QK
    stride = nb * REC_Q5_1
    n_full = n_rows // TILE3
    if _num_threads() == 1 or n_full < 2 or n_rows * n_cols < PAR_MIN_WEIGHTS:
        for t in range(n_full):
            _tile_q5_1(out, t * TILE3, buf, t * stride, nb, xs, xsum)
    else:
        for t in prange(n_full):
            _tile_q5_1(out, t * TILE3, buf, t * stride, nb, xs, xsum)
    if n_full * TILE3 < n_rows:
        tail = scratch[32:56]
        _tile_q5_1(tail, 0, buf, n_full * stride, nb, xs, xsum)
        _finish_tail(out, tail, n_full * TILE3)


@njit(cache=True, nogil=True, parallel=True)
def matvec_q8_0(out, buf, x, scratch):
    """Q8_0: out (n_rows,) float32 = W @ x; buf from pack()."""
    n_rows, n_cols, xs, xsum, tab = _split(out, x, scratch)
    _copy_x(xs, x)
    nb = n_cols // QK
    stride = nb * REC_Q8_0
    n_full = n_rows // TILE
    if _num_threads() == 1 or n_full < 2 or n_rows * n_cols < PAR_MIN_WEIGHTS:
        for t in range(n_full):
            _tile_q8_0(out, t * TILE, buf, t * stride, nb, xs)
    else:
        for t in prange(n_full):
            _tile_q8_0(out, t * TILE, buf, t * stride, nb, xs)
    if n_full * TILE < n_rows:
        tail = scratch[32:56]
        _tile_q8_0(tail, 0, buf, n_full * stride, nb, xs)
        _finish_tail(out, tail, n_full * TILE)


@njit(cache=True, nogil=True, parallel=True)
def matvec_q4_k(out, buf, x, scratch):
    """Q4_K: out (n_rows,) float32 = W @ x; buf from pack()."""
    n_rows, n_cols, xs, xsum, tab = _split(out, x, scratch)
    _prep(xs, xsum, x, tab, 32)
    nb = n_cols // QK_K
    stride = nb * REC_Q4_K
    n_full = n_rows // TILE3
    if _num_threads() == 1 or n_full < 2 or n_rows * n_cols < PAR_MIN_WEIGHTS:
        for t in range(n_full):
            _tile_q4_k(out, t * TILE3, buf, t * stride, nb, xs, xsum)
    else:
        for t in prange(n_full):
            _tile_q4_k(out, t * TILE3, buf, t * stride, nb, xs, xsum)
    if n_full * TILE3 < n_rows:
        tail = scratch[32:56]
        _tile_q4_k(tail, 0, buf, n_full * stride, nb, xs, xsum)
        _finish_tail(out, tail, n_full * TILE3)


@njit(cache=True, nogil=True, parallel=True)
def matvec_q5_k(out, buf, x, scratch):
    """Q5_K: out (n_rows,) float32 = W @ x; buf from pack()."""
    n_rows, n_cols, xs, xsum, tab = _split(out, x, scratch)
    _prep(xs, xsum, x, tab, 32)
    nb = n_cols // QK_K
    stride = nb * REC_Q5_K
    n_full = n_rows // TILE3
    if _num_threads() == 1 or n_full < 2 or n_rows * n_cols < PAR_MIN_WEIGHTS:
        for t in range(n_full):
            _tile_q5_k(out, t * TILE3, buf, t * stride, nb, xs, xsum)
    else:
        for t in prange(n_full):
            _tile_q5_k(out, t * TILE3, buf, t * stride, nb, xs, xsum)
    if n_full * TILE3 < n_rows:
        tail = scratch[32:56]
        _tile_q5_k(tail, 0, buf, n_full * stride, nb, xs, xsum)
        _finish_tail(out, tail, n_full * TILE3)


@njit(cache=True, nogil=True, parallel=True)
def matvec_q6_k(out, buf, x, scratch):
    """Q6_K: out (n_rows,) float32 = W @ x; buf from pack()."""
    n_rows, n_cols, xs, xsum, tab = _split(out, x, scratch)
    _prep(xs, xsum, x, tab, 16)
    nb = n_cols // QK_K
    stride = nb * REC_Q6_K
    n_full = n_rows // TILE
    if _num_threads() == 1 or n_full < 2 or n_rows * n_cols < PAR_MIN_WEIGHTS:
        for t in range(n_full):
            _tile_q6_k(out, t * TILE, buf, t * stride, nb, xs, xsum)
    else:
        for t in prange(n_full):
            _tile_q6_k(out, t * TILE, buf, t * stride, nb, xs, xsum)
    if n_full * TILE < n_rows:
        tail = scratch[32:56]
        _tile_q6_k(tail, 0, buf, n_full * stride, nb, xs, xsum)
        _finish_tail(out, tail, n_full * TILE)


@njit(cache=True, nogil=True, parallel=True)
def matvec_f16(out, buf, x, scratch):
    """F16: out (n_rows,) float32 = W @ x; buf from pack()."""
    n_rows, n_cols, xs, xsum, tab = _split(out, x, scratch)
    _copy_x(xs, x)
    nb = n_cols
    stride = nb * REC_F16
    n_full = n_rows // TILE
    if _num_threads() == 1 or n_full < 2 or n_rows * n_cols < PAR_MIN_WEIGHTS:
        for t in range(n_full):
            _tile_f16(out, t * TILE, buf, t * stride, nb, xs)
    else:
        for t in prange(n_full):
            _tile_f16(out, t * TILE, buf, t * stride, nb, xs)
    if n_full * TILE < n_rows:
        tail = scratch[32:56]
        _tile_f16(tail, 0, buf, n_full * stride, nb, xs)
        _finish_tail(out, tail, n_full * TILE)


@njit(cache=True, nogil=True, parallel=True)
def matvec_bf16(out, buf, x, scratch):
    """BF16: out (n_rows,) float32 = W @ x; buf from pack()."""
    n_rows, n_cols, xs, xsum, tab = _split(out, x, scratch)
    _copy_x(xs, x)
    nb = n_cols
    stride = nb * REC_F16
    n_full = n_rows // TILE
    if _num_threads() == 1 or n_full < 2 or n_rows * n_cols < PAR_MIN_WEIGHTS:
        for t in range(n_full):
            _tile_bf16(out, t * TILE, buf, t * stride, nb, xs)
    else:
        for t in prange(n_full):
            _tile_bf16(out, t * TILE, buf, t * stride, nb, xs)
    if n_full * TILE < n_rows:
        tail = scratch[32:56]
        _tile_bf16(tail, 0, buf, n_full * stride, nb, xs)
        _finish_tail(out, tail, n_full * TILE)


@njit(cache=True, nogil=True, parallel=True)
def matvec_f32(out, buf, x, scratch):
    """F32: out (n_rows,) float32 = W @ x; buf from pack()."""
    n_rows, n_cols, xs, xsum, tab = _split(out, x, scratch)
    _copy_x(xs, x)
    nb = n_cols
    stride = nb * REC_F32
    n_full = n_rows // TILE
    if _num_threads() == 1 or n_full < 2 or n_rows * n_cols < PAR_MIN_WEIGHTS:
        for t in range(n_full):
            _tile_f32(out, t * TILE, buf, t * stride, nb, xs)
    else:
        for t in prange(n_full):
            _tile_f32(out, t * TILE, buf, t * stride, nb, xs)
    if n_full * TILE < n_rows:
        tail = scratch[32:56]
        _tile_f32(tail, 0, buf, n_full * stride, nb, xs)
        _finish_tail(out, tail, n_full * TILE)


# ==================================================================================================
# Unpack (decode) and matmul kernels (prefill).
#
# _unpack_tile writes tile t (R = 16 or 24 rows) of W transposed into wt (n_cols, ld) float32 at
# columns col0..col0+R-1: wt[c, col0 + r] = W[R t + r, c] (rows past n_rows are zero). Family 0:
# Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (kind 0..4); family 1: Q4_K, Q5_K, Q6_K (kind 0..2); family 2: F16
# (kind 0), F32 (kind 1), BF16 (kind 2). The decoded values equal ggml's dequantization (d * q + m
# evaluated with one fma, so within an ulp of gguf's separately rounded d * q + m).
# ==================================================================================================

@njit(cache=True, nogil=True, inline="always")
def _q4v(w, i):
    """Nibble i of every lane of w as float (the true value 0..15)."""
    return andf(isrl(w, 4 * i), 15)


@njit(cache=True, nogil=True)
def _unpack_bits(wt, col0, c0, buf, r, dv, mv, bits):
    """Store 32 columns (c0..c0+31) of one 8-row group as y = dv * q + mv. bits 4: nibble dwords at
    r (4 x 32 bytes, column 8s + i at field i of dword s); bits 5: 5-bit field dwords (6 x 32 bytes,
    column 6m + i at field i of dword m, columns 30, 31 in dword 5)."""
    if bits == 4:
        for s in range(4):
            w = ld_i32(buf, r + 32 * s)
            for i in range(8):
                vstore(wt[c0 + 8 * s + i], col0, vfma(dv, andf(isrl(w, 4 * i), 15), mv))
    else:
        for m in range(6):
            w = ld_i32(buf, r + 32 * m)
            for i in range(6 if m < 5 else 2):
                vstore(wt[c0 + 6 * m + i], col0, vfma(dv, andf(isrl(w, 5 * i), 0x1F), mv))


@njit(cache=True, nogil=True)
def _unpack_tile_legacy(wt, col0, buf, kind, t, nb):
    """Family 0 tile t -> wt[:, col0:col0 + rows] (rows = 16 for Q8_0, else 24)."""
    rec = (REC_Q4_0, REC_Q4_1, REC_Q5_0, REC_Q5_1, REC_Q8_0)[kind]
    ng = 2 if kind == 4 else 3
    for b in range(nb):
        r = (t * nb + b) * rec
        for g in range(ng):
            c = col0 + 8 * g
            if kind == 0:
                d = ld_f16(buf, r + 384 + 16 * g)
                _unpack_bits(wt, c, b * QK, buf, r + 128 * g, d, vmul(d, vsplat(np.float32(-8.0))), 4)
            elif kind == 1:
                _unpack_bits(wt, c, b * QK, buf, r + 128 * g, ld_f16(buf, r + 384 + 16 * g),
                             ld_f16(buf, r + 432 + 16 * g), 4)
            elif kind == 2:
                d = ld_f16(buf, r + 576 + 16 * g)
                _unpack_bits(wt, c, b * QK, buf, r + 192 * g, d, vmul(d, vsplat(np.float32(-16.0))), 5)
            elif kind == 3:
                _unpack_bits(wt, c, b * QK, buf, r + 192 * g, ld_f16(buf, r + 576 + 16 * g),
                             ld_f16(buf, r + 624 + 16 * g), 5)
            else:
                d = ld_f16(buf, r + 512 + 16 * g)
                for j in range(32):
                    vstore(wt[b * QK + j], c, vmul(d, ld_i8(buf, r + 256 * g + 8 * j)))


@njit(cache=True, nogil=True)
def _unpack_tile_kquant(wt, col0, buf, kind, t, nb):
    """Family 1 tile t -> wt[:, col0:col0 + rows] (rows = 16 for Q6_K, else 24)."""
    rec = (REC_Q4_K, REC_Q5_K, REC_Q6_K)[kind]
    ng = 2 if kind == 2 else 3
    for b in range(nb):
        r = (t * nb + b) * rec
        for g in range(ng):
            c = col0 + 8 * g
            dd = ld_f16(buf, r + 16 * g)
            if kind == 2:
                for j in range(8):
                    rf = r + 288 + 448 * j + 224 * g
                    for hf in range(2):
                        u = 2 * j + hf
                        dv = vmul(dd, ld_i8(buf, r + 32 + 16 * u + 8 * g))
                        mv = vmul(dv, vsplat(np.float32(-32.0)))
                        c0 = b * QK_K + QK * j + 16 * hf
                        for m in range(3):
                            w = ld_i32(buf, rf + 96 * hf + 32 * m)
                            for i in range(5):
                                vstore(wt[c0 + 5 * m + i], c, vfma(dv, andf(isrl(w, 6 * i), 0x3F), mv))
                        w = ld_i32(buf, rf + 192)
                        vstore(wt[c0 + 15], c, vfma(dv, andf(isrl(w, 6 * hf), 0x3F), mv))
            else:
                dm = ld_f16(buf, r + 48 + 16 * g)
                for j in range(8):
                    dv = vmul(dd, ld_u8(buf, r + 96 + 24 * j + 8 * g))
                    mv = vsub(vzero(), vmul(dm, ld_u8(buf, r + 288 + 24 * j + 8 * g)))
                    if kind == 0:
                        _unpack_bits(wt, c, b * QK_K + QK * j, buf, r + 480 + 384 * j + 128 * g, dv, mv, 4)
                    else:
                        _unpack_bits(wt, c, b * QK_K + QK * j, buf, r + 480 + 576 * j + 192 * g, dv, mv, 5)


@njit(cache=True, nogil=True)
def _unpack_tile_float(wt, col0, buf, kind, t, nb):
    """Family 2 tile t -> wt[:, col0:col0 + 16] (nb = n_cols; kind 0 F16, 1 F32, 2 BF16)."""
    for c in range(nb):
        for g in range(2):
            if kind == 0:
                vstore(wt[c], col0 + 8 * g, ld_f16(buf, (t * nb + c) * REC_F16 + 16 * g))
            elif kind == 2:
                vstore(wt[c], col0 + 8 * g, ld_bf16(buf, (t * nb + c) * REC_F16 + 16 * g))
            else:
                vstore(wt[c], col0 + 8 * g, ld_f32(buf, (t * nb + c) * REC_F32 + 32 * g))


@njit(cache=True, nogil=True)
def _unpack_tile(wt, col0, buf, family, kind, t, nb):
    """Tile t of any family -> wt[:, col0:col0 + 16]."""
    if family == 0:
        _unpack_tile_legacy(wt, col0, buf, kind, t, nb)
    elif family == 1:
        _unpack_tile_kquant(wt, col0, buf, kind, t, nb)
    else:
        _unpack_tile_float(wt, col0, buf, kind, t, nb)


@njit(cache=True, nogil=True, parallel=True)
def unpack_tiles(wt, buf, family, kind, rows, t0, t1, nb):
    """Tiles t0..t1 of `rows` rows each -> wt (n_cols, >= rows (t1 - t0)) float32:
    wt[:, rows (t - t0) + r] = W[rows t + r, :]."""
    for t in prange(t0, t1):
        _unpack_tile(wt, (t - t0) * rows, buf, family, kind, t, nb)


@njit(cache=True, nogil=True)
def _gemm_2g(X, w, ld, go, t0, nt, tmp):
    """tmp[j, go:go + 16] = X[t0 + j] @ wt[:, go:go + 16] for j < nt (nt = 1, 2 or 4; w = wt flat,
    row stride ld; tmp (4, ld) flat). Register tiles: 4 tokens x 16 rows, or 2 tokens x 16 rows x
    2 column parities, or 1 token x 16 rows x 2 parities (8, 8, 4 independent accumulators)."""
    n_cols = X.shape[1]
    if nt == 4:
        x0 = X[t0]
        x1 = X[t0 + 1]
        x2 = X[t0 + 2]
        x3 = X[t0 + 3]
        a0 = vzero()
        a1 = vzero()
        b0 = vzero()
        b1 = vzero()
        c0 = vzero()
        c1 = vzero()
        e0 = vzero()
        e1 = vzero()
        for c in range(n_cols):
            w0 = vload(w, ld * c + go)
            w1 = vload(w, ld * c + go + 8)
            xv = vbcast(x0, c)
            a0 = vfma(w0, xv, a0)
            a1 = vfma(w1, xv, a1)
            xv = vbcast(x1, c)
            b0 = vfma(w0, xv, b0)
            b1 = vfma(w1, xv, b1)
            xv = vbcast(x2, c)
            c0 = vfma(w0, xv, c0)
            c1 = vfma(w1, xv, c1)
            xv = vbcast(x3, c)
            e0 = vfma(w0, xv, e0)
            e1 = vfma(w1, xv, e1)
        vstore(tmp, go, a0)
        vstore(tmp, go + 8, a1)
        vstore(tmp, ld + go, b0)
        vstore(tmp, ld + go + 8, b1)
        vstore(tmp, 2 * ld + go, c0)
        vstore(tmp, 2 * ld + go + 8, c1)
        vstore(tmp, 3 * ld + go, e0)
        vstore(tmp, 3 * ld + go + 8, e1)
    elif nt == 2:
        x0 = X[t0]
        x1 = X[t0 + 1]
        a0 = vzero()
        a1 = vzero()
        b0 = vzero()
        b1 = vzero()
        c0 = vzero()
        c1 = vzero()
        e0 = vzero()
        e1 = vzero()
        n2 = n_cols - n_cols % 2
        for c in range(0, n2, 2):
            w0 = vload(w, ld * c + go)
            w1 = vload(w, ld * c + go + 8)
            w2 = vload(w, ld * c + ld + go)
            w3 = vload(w, ld * c + ld + go + 8)
            xv = vbcast(x0, c)
            a0 = vfma(w0, xv, a0)
            a1 = vfma(w1, xv, a1)
            xv = vbcast(x1, c)
            b0 = vfma(w0, xv, b0)
            b1 = vfma(w1, xv, b1)
            xv = vbcast(x0, c + 1)
            c0 = vfma(w2, xv, c0)
            c1 = vfma(w3, xv, c1)
            xv = vbcast(x1, c + 1)
            e0 = vfma(w2, xv, e0)
            e1 = vfma(w3, xv, e1)
        if n2 < n_cols:
            w0 = vload(w, ld * n2 + go)
            w1 = vload(w, ld * n2 + go + 8)
            a0 = vfma(w0, vbcast(x0, n2), a0)
            a1 = vfma(w1, vbcast(x0, n2), a1)
            b0 = vfma(w0, vbcast(x1, n2), b0)
            b1 = vfma(w1, vbcast(x1, n2), b1)
        vstore(tmp, go, vadd(a0, c0))
        vstore(tmp, go + 8, vadd(a1, c1))
        vstore(tmp, ld + go, vadd(b0, e0))
        vstore(tmp, ld + go + 8, vadd(b1, e1))
    else:
        x0 = X[t0]
        a0 = vzero()
        a1 = vzero()
        c0 = vzero()
        c1 = vzero()
        n2 = n_cols - n_cols % 2
        for c in range(0, n2, 2):
            xv = vbcast(x0, c)
            a0 = vfma(vload(w, ld * c + go), xv, a0)
            a1 = vfma(vload(w, ld * c + go + 8), xv, a1)
            xv = vbcast(x0, c + 1)
            c0 = vfma(vload(w, ld * c + ld + go), xv, c0)
            c1 = vfma(vload(w, ld * c + ld + go + 8), xv, c1)
        if n2 < n_cols:
            xv = vbcast(x0, n2)
            a0 = vfma(vload(w, ld * n2 + go), xv, a0)
            a1 = vfma(vload(w, ld * n2 + go + 8), xv, a1)
        vstore(tmp, go, vadd(a0, c0))
        vstore(tmp, go + 8, vadd(a1, c1))


@njit(cache=True, nogil=True)
def _gemm_1g(X, w, ld, go, t0, nt, tmp):
    """As _gemm_2g for the 8 rows go..go+7 (the third group of a 24-row tile): 4 tokens x 2 column
    parities (8 accumulators), one token at a time for a remainder."""
    n_cols = X.shape[1]
    n2 = n_cols - n_cols % 2
    if nt == 4:
        x0 = X[t0]
        x1 = X[t0 + 1]
        x2 = X[t0 + 2]
        x3 = X[t0 + 3]
        a0 = vzero()
        a1 = vzero()
        b0 = vzero()
        b1 = vzero()
        c0 = vzero()
        c1 = vzero()
        e0 = vzero()
        e1 = vzero()
        for c in range(0, n2, 2):
            w0 = vload(w, ld * c + go)
            w1 = vload(w, ld * c + ld + go)
            a0 = vfma(w0, vbcast(x0, c), a0)
            b0 = vfma(w0, vbcast(x1, c), b0)
            c0 = vfma(w0, vbcast(x2, c), c0)
            e0 = vfma(w0, vbcast(x3, c), e0)
            a1 = vfma(w1, vbcast(x0, c + 1), a1)
            b1 = vfma(w1, vbcast(x1, c + 1), b1)
            c1 = vfma(w1, vbcast(x2, c + 1), c1)
            e1 = vfma(w1, vbcast(x3, c + 1), e1)
        if n2 < n_cols:
            w0 = vload(w, ld * n2 + go)
            a0 = vfma(w0, vbcast(x0, n2), a0)
            b0 = vfma(w0, vbcast(x1, n2), b0)
            c0 = vfma(w0, vbcast(x2, n2), c0)
            e0 = vfma(w0, vbcast(x3, n2), e0)
        vstore(tmp, go, vadd(a0, a1))
        vstore(tmp, ld + go, vadd(b0, b1))
        vstore(tmp, 2 * ld + go, vadd(c0, c1))
        vstore(tmp, 3 * ld + go, vadd(e0, e1))
    else:
        for j in range(nt):
            xj = X[t0 + j]
            a0 = vzero()
            a1 = vzero()
            for c in range(0, n2, 2):
                a0 = vfma(vload(w, ld * c + go), vbcast(xj, c), a0)
                a1 = vfma(vload(w, ld * c + ld + go), vbcast(xj, c + 1), a1)
            if n2 < n_cols:
                a0 = vfma(vload(w, ld * n2 + go), vbcast(xj, n2), a0)
            vstore(tmp, j * ld + go, vadd(a0, a1))


@njit(cache=True, nogil=True)
def _gemm_3g4(X, w, t0, tmp):
    """tmp[j, 0:24] = X[t0 + j] @ wt[:, 0:24] for j < 4 (w = wt flat, row stride 24): one pass with
    12 accumulators (4 tokens x 3 groups)."""
    n_cols = X.shape[1]
    x0 = X[t0]
    x1 = X[t0 + 1]
    x2 = X[t0 + 2]
    x3 = X[t0 + 3]
    a0 = vzero()
    a1 = vzero()
    a2 = vzero()
    b0 = vzero()
    b1 = vzero()
    b2 = vzero()
    c0 = vzero()
    c1 = vzero()
    c2 = vzero()
    e0 = vzero()
    e1 = vzero()
    e2 = vzero()
    for c in range(n_cols):
        w0 = vload(w, 24 * c)
        w1 = vload(w, 24 * c + 8)
        w2 = vload(w, 24 * c + 16)
        xv = vbcast(x0, c)
        a0 = vfma(w0, xv, a0)
        a1 = vfma(w1, xv, a1)
        a2 = vfma(w2, xv, a2)
        xv = vbcast(x1, c)
        b0 = vfma(w0, xv, b0)
        b1 = vfma(w1, xv, b1)
        b2 = vfma(w2, xv, b2)
        xv = vbcast(x2, c)
        c0 = vfma(w0, xv, c0)
        c1 = vfma(w1, xv, c1)
        c2 = vfma(w2, xv, c2)
        xv = vbcast(x3, c)
        e0 = vfma(w0, xv, e0)
        e1 = vfma(w1, xv, e1)
        e2 = vfma(w2, xv, e2)
    vstore(tmp, 0, a0)
    vstore(tmp, 8, a1)
    vstore(tmp, 16, a2)
    vstore(tmp, 24, b0)
    vstore(tmp, 32, b1)
    vstore(tmp, 40, b2)
    vstore(tmp, 48, c0)
    vstore(tmp, 56, c1)
    vstore(tmp, 64, c2)
    vstore(tmp, 72, e0)
    vstore(tmp, 80, e1)
    vstore(tmp, 88, e2)


@njit(cache=True, nogil=True)
def _gemm_tile(out, X, wt, r0, tmp):
    """out[:, r0:r0 + ld] = X @ wt (X (T, n_cols), wt (n_cols, ld) float32 C-contiguous, ld = 16 or
    24); rows of out past its end are dropped. tmp: float32 (4 * ld,) scratch."""
    T = X.shape[0]
    ld = wt.shape[1]
    n_rows = out.shape[1]
    w = wt.reshape(-1)
    t0 = 0
    while t0 < T:
        nt = min(4, T - t0)
        if nt == 3:
            nt = 2
        if ld == 24 and nt == 4:
            _gemm_3g4(X, w, t0, tmp)
        else:
            _gemm_2g(X, w, ld, 0, t0, nt, tmp)
            if ld == 24:
                _gemm_1g(X, w, ld, 16, t0, nt, tmp)
        for j in range(nt):
            o = out[t0 + j]
            if r0 + ld <= n_rows:
                for g in range(0, ld, 8):
                    vstore(o, r0 + g, vload(tmp, j * ld + g))
            else:
                for r in range(r0, n_rows):
                    o[r] = tmp[j * ld + r - r0]
        t0 += nt


@njit(cache=True, nogil=True, parallel=True)
def matmul_tiles(out, buf, X, family, kind, nb, wts):
    """out (T, n_rows) float32 = X @ W.T, X (T, n_cols) float32 C-contiguous; wts (n_chunks, n_cols,
    rows per tile) float32 scratch: the tiles are split into n_chunks contiguous runs, one per prange
    iteration; each tile is decoded once into its chunk's scratch and multiplied with all T rows of X."""
    n_rows = out.shape[1]
    rows = wts.shape[2]
    n_tiles = (n_rows + rows - 1) // rows
    n_chunks = wts.shape[0]
    for ch in prange(n_chunks):
        wt = wts[ch]
        tmp = np.empty(4 * rows, np.float32)
        for t in range(ch * n_tiles // n_chunks, (ch + 1) * n_tiles // n_chunks):
            _unpack_tile(wt, 0, buf, family, kind, t, nb)
            _gemm_tile(out, X, wt, t * rows, tmp)


# ==================================================================================================
# Packing (NumPy, once at load): file blocks -> per-tile records
# ==================================================================================================

_HUGE = 2 << 20       # transparent huge page size
_SLAB = 32 << 20      # packed matrices below _SLAB // 4 bytes share slabs of this size
_slab_lock = threading.Lock()
_slab = {"buf": None, "used": 0}


def _map(nbytes: int) -> np.ndarray:
    """Zeroed anonymous mapping of nbytes, 2 MiB aligned, backed by transparent huge pages where the
    kernel allows it (fewer TLB misses while streaming)."""
    mm = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    raw = np.frombuffer(mm, np.uint8)
    start = (-raw.ctypes.data) % _HUGE
    return raw[start:start + nbytes]


def _alloc(nbytes: int) -> np.ndarray:
    """Zeroed uint8 buffer of nbytes, 64-byte aligned, in huge-page memory.

    Small buffers are cut one after the other from shared 32 MiB slabs, so matrices packed in the
    order a forward pass uses them also lie in that order in memory (the hardware prefetcher and
    the kernels' software prefetch run on from one into the next). A slab is freed when the last
    matrix in it is.
    """
    if nbytes >= _SLAB // 4:
        return _map(nbytes)
    size = -(-max(nbytes, 1) // 64) * 64
    with _slab_lock:
        buf, used = _slab["buf"], _slab["used"]
        if buf is None or used + size > buf.shape[0]:
            buf, used = _map(_SLAB), 0
            _slab["buf"] = buf
        _slab["used"] = used + size
    return buf[used:used + nbytes]


def _f16_at(blocks: np.ndarray, off: int) -> np.ndarray:
    """uint16 bits of the f16 at byte off of each block: blocks (..., size) -> (...)."""
    return blocks[..., off].astype(np.uint16) | (blocks[..., off + 1].astype(np.uint16) << np.uint16(8))


def _u32_at(blocks: np.ndarray, off: int) -> np.ndarray:
    b = blocks[..., off:off + 4].astype(np.uint32)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _nib_dwords(q: np.ndarray) -> np.ndarray:
    """q (R, nb, 32) values -> (R, nb, 4) uint32: dword s holds columns 8s + i at bits 4i (low 4 bits)."""
    q = (q.reshape(q.shape[:-1] + (4, 8)) & 15).astype(np.uint32)
    return np.bitwise_or.reduce(q << (4 * np.arange(8, dtype=np.uint32)), axis=-1)


def _fields5(q: np.ndarray) -> np.ndarray:
    """q (R, nb, 32) 5-bit values -> (R, nb, 6) uint32: column 6m + i at bits 5i of dword m (m < 5),
    columns 30, 31 at bits 0 and 5 of dword 5."""
    q = q.astype(np.uint32)
    f = np.zeros(q.shape[:-1] + (6,), np.uint32)
    for c in range(32):
        m, i = (c // 6, c % 6) if c < 30 else (5, c - 30)
        f[..., m] |= q[..., c] << np.uint32(5 * i)
    return f


def _fields6(q: np.ndarray) -> np.ndarray:
    """q (R, nb, 32) 6-bit values -> (R, nb, 7) uint32: columns 0-14 at bits 6i of dwords 0-2
    (column 5m + i), columns 16-30 in dwords 3-5 (column 16 + 5m + i), columns 15, 31 at bits 0 and 6
    of dword 6."""
    q = q.astype(np.uint32)
    f = np.zeros(q.shape[:-1] + (7,), np.uint32)
    for c in range(32):
        if c < 15:
            m, i = c // 5, c % 5
        elif c == 15:
            m, i = 6, 0
        elif c < 31:
            m, i = 3 + (c - 16) // 5, (c - 16) % 5
        else:
            m, i = 6, 1
        f[..., m] |= q[..., c] << np.uint32(6 * i)
    return f


def _pad(a: np.ndarray, rows: int) -> np.ndarray:
    """a with its first axis zero-padded to `rows`."""
    if a.shape[0] == rows:
        return a
    out = np.zeros((rows,) + a.shape[1:], a.dtype)
    out[:a.shape[0]] = a
    return out


def _lanes(a: np.ndarray, n_tiles: int, groups: int, inner_first: int = 0) -> np.ndarray:
    """a (rows, nb, *rest) -> (n_tiles, nb, *rest[:inner_first], groups, *rest[inner_first:], 8): rows
    zero-padded to n_tiles * groups * 8, and the groups and 8 lanes of a tile moved inside each block."""
    a = _pad(a, n_tiles * groups * GROUP)
    rest = a.shape[2:]
    a = a.reshape((n_tiles, groups, GROUP) + a.shape[1:])   # t, g, lane, nb, *rest
    nr = len(rest)
    order = ([0, 3] + [4 + k for k in range(inner_first)] + [1]
             + [4 + k for k in range(inner_first, nr)] + [2])
    return np.ascontiguousarray(a.transpose(order))


def _record(n_tiles: int, nb: int, *parts: np.ndarray) -> np.ndarray:
    """Concatenate per-(tile, block) parts, each (n_tiles, nb, ...), as bytes into one aligned buffer."""
    views = [np.ascontiguousarray(p).view(np.uint8).reshape(n_tiles, nb, -1) for p in parts]
    size = sum(v.shape[-1] for v in views)
    buf = _alloc(n_tiles * nb * size)
    dst = buf.reshape(n_tiles, nb, size)
    o = 0
    for v in views:
        dst[:, :, o:o + v.shape[-1]] = v
        o += v.shape[-1]
    return buf


def _scale_min_k4(sc: np.ndarray):
    """Q4_K / Q5_K 12 packed bytes (..., 12) -> 6-bit scales, mins (..., 8) uint8."""
    sc = sc.astype(np.uint8)
    d = np.empty(sc.shape[:-1] + (8,), np.uint8)
    m = np.empty_like(d)
    d[..., :4] = sc[..., 0:4] & 63
    m[..., :4] = sc[..., 4:8] & 63
    d[..., 4:] = (sc[..., 8:12] & 0x0F) | ((sc[..., 0:4] >> 6) << 4)
    m[..., 4:] = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    return d, m


def _q_kquant(blocks: np.ndarray, qoff: int, qhoff: int | None) -> np.ndarray:
    """Q4_K / Q5_K values (R, nsb, 256) in column order from super-blocks (R, nsb, size)."""
    qs = blocks[..., qoff:qoff + 128].reshape(blocks.shape[:-1] + (4, 32))     # chunk c, l
    q = np.empty(blocks.shape[:-1] + (4, 2, 32), np.uint8)
    q[..., 0, :] = qs & 15
    q[..., 1, :] = qs >> 4
    if qhoff is not None:
        qh = blocks[..., qhoff:qhoff + 32]
        for c in range(4):
            q[..., c, 0, :] |= ((qh >> (2 * c)) & 1) << 4
            q[..., c, 1, :] |= ((qh >> (2 * c + 1)) & 1) << 4
    return q.reshape(blocks.shape[:-1] + (256,))


def _q_q6k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K unsigned 6-bit values (R, nsb, 256) in column order (ggml's dequantize_row_q6_K order)."""
    q = np.empty(blocks.shape[:-1] + (2, 4, 32), np.uint8)
    for n in range(2):
        ql = blocks[..., 64 * n:64 * n + 64]
        qh = blocks[..., 128 + 32 * n:128 + 32 * n + 32]
        q[..., n, 0, :] = (ql[..., :32] & 15) | ((qh & 3) << 4)
        q[..., n, 1, :] = (ql[..., 32:] & 15) | (((qh >> 2) & 3) << 4)
        q[..., n, 2, :] = (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4)
        q[..., n, 3, :] = (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)
    return q.reshape(blocks.shape[:-1] + (256,))


_TILE3_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q5_K)


def tile_rows(qtype: GGMLType) -> int:
    """Rows per tile of the packed layout of qtype: 24 for the 4- and 5-bit types, else 16."""
    return TILE3 if qtype in _TILE3_TYPES else TILE


def _pack_buf(qtype: GGMLType, data: np.ndarray, n_rows: int, n_cols: int) -> np.ndarray:
    """Packed uint8 buffer of a (n_rows, row_bytes) block matrix (see the record layouts above)."""
    groups = tile_rows(qtype) // GROUP
    nt = -(-n_rows // (groups * GROUP))

    def lanes(a, inner_first=0):
        return _lanes(a, nt, groups, inner_first)

    if qtype in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        if qtype in (GGMLType.F16, GGMLType.BF16):
            vals = data.view(np.uint16).reshape(n_rows, n_cols)
        else:
            vals = data.view(np.float32).reshape(n_rows, n_cols)
        return _record(nt, n_cols, lanes(vals))
    block, size = BLOCK_LAYOUT[qtype]
    nb = n_cols // block
    blocks = data.reshape(n_rows, nb, size)
    if qtype == GGMLType.Q8_0:
        return _record(nt, nb, lanes(blocks[..., 2:34]), lanes(_f16_at(blocks, 0)))
    if qtype in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1):
        off = {GGMLType.Q4_0: 2, GGMLType.Q4_1: 4, GGMLType.Q5_0: 6, GGMLType.Q5_1: 8}[qtype]
        qs = blocks[..., off:off + 16]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1)
        if qtype in (GGMLType.Q5_0, GGMLType.Q5_1):
            qh = _u32_at(blocks, off - 4)
            hb = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
            parts = [lanes(_fields5(q | (hb << 4)))]
        else:
            parts = [lanes(_nib_dwords(q))]
        parts.append(lanes(_f16_at(blocks, 0)))
        if qtype in (GGMLType.Q4_1, GGMLType.Q5_1):
            parts.append(lanes(_f16_at(blocks, 2)))
        return _record(nt, nb, *parts)
    if qtype in (GGMLType.Q4_K, GGMLType.Q5_K):
        sc, mn = _scale_min_k4(blocks[..., 4:16])
        if qtype == GGMLType.Q4_K:
            q = _q_kquant(blocks, 16, None).reshape(n_rows, nb, 8, 32)
            per_sub = [lanes(_nib_dwords(q), 1)]                       # t, nb, sub, g, s, lane
        else:
            q = _q_kquant(blocks, 48, 16).reshape(n_rows, nb, 8, 32)
            per_sub = [lanes(_fields5(q), 1)]                          # t, nb, sub, g, m, lane
        return _record(nt, nb, lanes(_f16_at(blocks, 0)), lanes(_f16_at(blocks, 2)),
                       lanes(sc, 1), lanes(mn, 1), *per_sub)
    if qtype == GGMLType.Q6_K:
        q = _q_q6k(blocks).reshape(n_rows, nb, 8, 32)
        sc = blocks[..., 192:208].view(np.int8)
        return _record(nt, nb, lanes(_f16_at(blocks, 208)), lanes(sc, 1), lanes(_fields6(q), 1))
    raise UnsupportedModelError(str(qtype), f"no matvec layout for GGML type {qtype!r}")


# ==================================================================================================
# Public API
# ==================================================================================================

# type -> (matvec entry kernel, unpack family, unpack kind)
KERNELS = {
    GGMLType.Q4_0: (matvec_q4_0, 0, 0),
    GGMLType.Q4_1: (matvec_q4_1, 0, 1),
    GGMLType.Q5_0: (matvec_q5_0, 0, 2),
    GGMLType.Q5_1: (matvec_q5_1, 0, 3),
    GGMLType.Q8_0: (matvec_q8_0, 0, 4),
    GGMLType.Q4_K: (matvec_q4_k, 1, 0),
    GGMLType.Q5_K: (matvec_q5_k, 1, 1),
    GGMLType.Q6_K: (matvec_q6_k, 1, 2),
    GGMLType.F16: (matvec_f16, 2, 0),
    GGMLType.F32: (matvec_f32, 2, 1),
    GGMLType.BF16: (matvec_bf16, 2, 2),
}

# below this many tokens, matmul runs one matvec per token (see bench/matvec_bench.py)
MATMUL_MIN_T = 5


class PackedMatrix:
    """A weight matrix repacked for `matvec` / `matmul`, with its per-call scratch.

    qtype:   GGMLType of the source tensor.
    n_rows, n_cols: logical shape (out features, in features).
    buf:     uint8 packed records (see the module docstring), 64-byte aligned, huge-page memory.
    scratch: float32 (56 + n_cols // 16 + n_cols,) used by every call; a PackedMatrix is
             therefore not safe to use from two threads at once.
    kernel:  the entry kernel; kernel(out, buf, x, scratch) is matvec without the argument
             checks (it can also be called from other Numba code).
    name:    the source tensor's name (names joined by '+' for stacked tensors).
    """

    __slots__ = ("qtype", "n_rows", "n_cols", "buf", "scratch", "name", "kernel",
                 "family", "kind", "tile_rows", "n_tiles", "n_blocks")

    def __init__(self, qtype: GGMLType, n_rows: int, n_cols: int, buf: np.ndarray, name: str = ""):
        self.qtype, self.n_rows, self.n_cols, self.buf, self.name = qtype, n_rows, n_cols, buf, name
        self.kernel, self.family, self.kind = KERNELS[qtype]
        self.tile_rows = tile_rows(qtype)
        self.scratch = np.zeros(56 + n_cols // 16 + n_cols, np.float32)
        self.scratch[:32] = _x_scales(qtype)
        self.n_tiles = (n_rows + self.tile_rows - 1) // self.tile_rows
        block = BLOCK_LAYOUT[qtype][0]
        self.n_blocks = n_cols // block

    @property
    def nbytes(self) -> int:
        """Bytes of packed weights (what one matvec streams)."""
        return int(self.buf.nbytes)

    def __repr__(self) -> str:
        return (f"PackedMatrix({self.name!r}, {self.qtype.name}, {self.n_rows}x{self.n_cols}, "
                f"{self.nbytes} bytes)")


def pack(t) -> PackedMatrix:
    """Repack a QTensor matrix (n_rows, n_cols) for matvec / matmul (a new buffer; t is not kept).

    `t` may also be a list / tuple of QTensors of one type and one n_cols: their rows are stacked
    in order (e.g. q, k, v -> one matrix and one matvec call per token).

    Raises:
        UnsupportedModelError: a GGML type without a layout here.
        ConfigError: not a matrix, parts that do not stack, or data of the wrong size.
    """
    parts = list(t) if isinstance(t, (list, tuple)) else [t]
    if not parts:
        raise ConfigError("pack: no tensors given")
    for p in parts:
        if not isinstance(p, QTensor):
            raise ConfigError(f"pack: expected QTensor, got {type(p).__name__}")
        if len(p.shape) != 2:
            raise ConfigError(f"{p.name}: pack needs a matrix, got shape {p.shape}")
    first = parts[0]
    try:
        qtype = GGMLType(int(first.qtype))
    except ValueError:
        raise UnsupportedModelError(first.name, f"unknown GGML type {first.qtype!r}") from None
    if qtype not in KERNELS:
        raise UnsupportedModelError(first.name, f"matvec does not support GGML type {qtype.name}")
    for p in parts[1:]:
        if int(p.qtype) != int(qtype) or p.n_cols != first.n_cols:
            raise ConfigError(f"pack: {p.name} ({GGMLType(int(p.qtype)).name}, {p.n_cols} columns) cannot be "
                              f"stacked with {first.name} ({qtype.name}, {first.n_cols} columns)")
    block, size = BLOCK_LAYOUT[qtype]
    n_cols = int(first.n_cols)
    if n_cols <= 0 or n_cols % block:
        raise ConfigError(f"{first.name}: n_cols {n_cols} is not a positive multiple of the "
                          f"{qtype.name} block size {block}")
    rb = n_cols // block * size
    datas = []
    for p in parts:
        d = np.ascontiguousarray(p.data)
        if d.dtype != np.uint8 or d.size != p.n_rows * rb or p.n_rows < 1:
            raise ConfigError(f"{p.name}: expected {p.n_rows * rb} uint8 bytes for {qtype.name} "
                              f"{p.shape}, got {d.size} {d.dtype}")
        datas.append(d.reshape(p.n_rows, rb))
    data = datas[0] if len(datas) == 1 else np.concatenate(datas, axis=0)
    n_rows = data.shape[0]
    name = "+".join(p.name for p in parts)
    return PackedMatrix(qtype, n_rows, n_cols, _pack_buf(qtype, data, n_rows, n_cols), name)


_F32 = np.dtype(np.float32)


def _bad_vec(a, n: int, what: str, pm: PackedMatrix) -> ConfigError:
    if isinstance(a, np.ndarray):
        got = (f"{a.dtype} {a.shape}{'' if a.flags.c_contiguous else ' (not C-contiguous)'}"
               f"{'' if a.flags.writeable or what != 'out' else ' (read-only)'}")
    else:
        got = type(a).__name__
    return ConfigError(f"matvec {pm.name}: {what} must be a C-contiguous{' writeable' if what == 'out' else ''} "
                       f"float32 array of shape ({n},), got {got}")


def matvec(out: np.ndarray, pm: PackedMatrix, x: np.ndarray) -> None:
    """out (n_rows,) float32 = W @ x for x (n_cols,) float32. Allocates nothing.

    out, x: C-contiguous float32 1-D arrays, out writeable (out may be x itself when the shape
    allows: x is read in full before out is written). Threads: numba.get_num_threads() at the time
    of the call (numba.set_num_threads). Not thread-safe per PackedMatrix (shared scratch).

    Raises:
        ConfigError: wrong type, dtype, shape or layout of out or x.
    """
    if not (type(out) is np.ndarray and out.dtype is _F32 and out.shape == (pm.n_rows,)
            and out.flags.c_contiguous and out.flags.writeable):
        if not (isinstance(out, np.ndarray) and out.dtype == _F32 and out.shape == (pm.n_rows,)
                and out.flags.c_contiguous and out.flags.writeable):
            raise _bad_vec(out, pm.n_rows, "out", pm)
    if not (type(x) is np.ndarray and x.dtype is _F32 and x.shape == (pm.n_cols,)
            and x.flags.c_contiguous):
        if not (isinstance(x, np.ndarray) and x.dtype == _F32 and x.shape == (pm.n_cols,)
                and x.flags.c_contiguous):
            raise _bad_vec(x, pm.n_cols, "x", pm)
    pm.kernel(out, pm.buf, x, pm.scratch)


def unpack_rows(wt: np.ndarray, pm: PackedMatrix, t0: int, t1: int) -> None:
    """wt[:, :R (t1 - t0)] = rows R t0 .. R t1 of W, transposed, R = pm.tile_rows (float32
    (n_cols, >= R (t1 - t0)), C-contiguous); rows past n_rows come out as zeros."""
    R = pm.tile_rows
    if not (0 <= t0 <= t1 <= pm.n_tiles):
        raise ConfigError(f"unpack_rows {pm.name}: tiles {t0}..{t1} outside 0..{pm.n_tiles}")
    if (not isinstance(wt, np.ndarray) or wt.dtype != _F32 or wt.ndim != 2 or wt.shape[0] != pm.n_cols
            or wt.shape[1] < (t1 - t0) * R or not wt.flags.c_contiguous):
        raise ConfigError(f"unpack_rows {pm.name}: wt must be C-contiguous float32 ({pm.n_cols}, >= "
                          f"{(t1 - t0) * R})")
    unpack_tiles(wt, pm.buf, pm.family, pm.kind, R, t0, t1, pm.n_blocks)


def unpack(pm: PackedMatrix) -> np.ndarray:
    """The dequantized matrix (n_rows, n_cols) float32, decoded from the packed layout (a new array)."""
    wt = np.empty((pm.n_cols, pm.n_tiles * pm.tile_rows), np.float32)
    unpack_rows(wt, pm, 0, pm.n_tiles)
    return np.ascontiguousarray(wt[:, :pm.n_rows].T)


def matmul(out: np.ndarray, pm: PackedMatrix, X: np.ndarray) -> None:
    """out (T, n_rows) float32 = X @ W.T for X (T, n_cols) float32 (prefill).

    T < MATMUL_MIN_T: one matvec per row of X. Otherwise each tile of W (16 or 24 rows) is decoded
    once into a small float32 scratch (n_cols x rows per thread, allocated per call) and multiplied
    with all T rows (register tiles of 4 tokens x 16 rows); tiles are split over
    numba.get_num_threads() threads. No BLAS: NumPy's OpenBLAS threads and Numba's OpenMP threads
    spin against each other on a small machine (a 20-30x slowdown measured on 2 cores).

    Raises:
        ConfigError: wrong type, dtype or shape of out or X.
    """
    if not (isinstance(X, np.ndarray) and X.dtype == _F32 and X.ndim == 2 and X.shape[1] == pm.n_cols):
        raise ConfigError(f"matmul {pm.name}: X must be float32 (T, {pm.n_cols}), got "
                          f"{getattr(X, 'dtype', type(X).__name__)} {getattr(X, 'shape', '')}")
    T = X.shape[0]
    if not (isinstance(out, np.ndarray) and out.dtype == _F32 and out.shape == (T, pm.n_rows)
            and out.flags.writeable):
        raise ConfigError(f"matmul {pm.name}: out must be writeable float32 ({T}, {pm.n_rows}), got "
                          f"{getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', '')}")
    if T == 0:
        return
    if T < MATMUL_MIN_T:
        for i in range(T):
            xi = np.ascontiguousarray(X[i])
            if out[i].flags.c_contiguous:
                pm.kernel(out[i], pm.buf, xi, pm.scratch)
            else:
                tmp = np.empty(pm.n_rows, np.float32)
                pm.kernel(tmp, pm.buf, xi, pm.scratch)
                out[i] = tmp
        return
    if not X.flags.c_contiguous or np.may_share_memory(out, X):
        X = np.array(X, dtype=np.float32, order="C")
    dst = out if out.flags.c_contiguous else np.empty((T, pm.n_rows), np.float32)
    n_chunks = min(numba.get_num_threads(), pm.n_tiles)
    wts = np.empty((n_chunks, pm.n_cols, pm.tile_rows), np.float32)
    matmul_tiles(dst, pm.buf, X, pm.family, pm.kind, pm.n_blocks, wts)
    if dst is not out:
        out[...] = dst
