"""Prefill matmul of packed weights, and the tile decoder it shares with unpack.

MATMUL_TILES[family](out, buf, X, kind, nb, rows, wts): out (T, n_rows) float32 = X @ W.T for X (T,
n_cols) float32, W a packed matrix (buf from pack, layout in quant_tiles.py) of tiles of `rows` (16 or
24) rows. Each tile of W is decoded once into a small float32 scratch, transposed (n_cols, rows), and
multiplied with all T rows of X in register tiles; the tiles are split into contiguous runs, one per
prange iteration. The weights are thus read and decoded once per call instead of once per token;
for a few tokens, one matvec per token or the two-row tile kernels are faster (mv.matmul picks, see
MATMUL_MIN_T and TILED_MIN_T there).

Register tiles. With AVX2 the scratch holds one tile (wts (n_chunks, n_cols, rows)) and the products
run 4 tokens x 24 rows (8 x 16 for 16-row tiles): one weight vector load and one broadcast of x per
one or two multiply-adds. With AVX-512 (decoded_rows) the scratch holds WIDE_ROWS = 48 rows (two
24-row tiles or three 16-row ones side by side) and the products run 8 tokens x 48 rows: 24 zmm
accumulators, three weight loads and eight broadcasts per 24 multiply-adds, every one a full 16
lanes, where the one-tile kernels spend a broadcast per multiply-add and (24-row tiles) a third of
their multiply-adds on 8 lanes.

Every output is the same float32 sum whatever the tile width or instruction set: a token in a group of
4 or 8 sums its products over the columns in order, one fma each; the last T mod 4 tokens sum the even
and the odd columns apart and add the two (_gemm_2g, _gemm_1g).

UNPACK_TILES[family] decodes tiles into a caller's array (mv.unpack, mv.unpack_rows). Decoded values
equal ggml's dequantization (d * q + m evaluated with one fma, so within an ulp of gguf's separately
rounded d * q + m).

Types are named by (family, kind): family 0 the legacy blocks Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (kind
0..4); family 1 the K-quants Q4_K, Q5_K, Q6_K (kind 0..2); family 2 the float types F16 (kind 0), F32
(kind 1), BF16 (kind 2); family 3 the low-bit and non-linear types Q2_K, Q3_K, IQ4_NL, IQ4_XS (kind
0..3). matvec_kernels.KERNELS maps each GGMLType to its pair. Each family has its own compiled entry
kernels (kernel_copies.py), so a model compiles its own families' decoders only; the kind is a run-time
int within the family. Kernels trust their arguments; mv.matmul and mv.unpack_rows check.
"""
import numpy as np
from numba import njit, prange

from ringllm.runtime.kernel_copies import bind_copy
from ringllm.runtime.quant_tiles import (IQ4_LUT, QK, QK_K, REC_F16, REC_F32, REC_IQ4_NL, REC_IQ4_XS, REC_Q2_K,
                                         REC_Q3_K, REC_Q4_0, REC_Q4_1, REC_Q4_K, REC_Q5_0, REC_Q5_1, REC_Q5_K,
                                         REC_Q6_K, REC_Q8_0)
from ringllm.runtime.simd import (HAS_AVX512, andf, iand, isrl, ld_bf16, ld_f16, ld_f32, ld_i8, ld_i32, ld_u8,
                                  ld_u8i, lut16, srlf, vadd, vbcast, vfma, vload, vmul, vsplat, vstore, vsub, vzero,
                                  zbcast, zfma, zload, zstore, zzero)

__all__ = ["UNPACK_TILES", "MATMUL_TILES", "WIDE_ROWS", "decoded_rows", "gemm_tile_narrow", "gemm_tile_wide"]

# Rows of W decoded side by side and multiplied together on a CPU with 512-bit SIMD: two 24-row
# tiles or three 16-row ones, three zmm vectors a column (module docstring).
WIDE_ROWS = 48


def decoded_rows(tile_rows: int) -> int:
    """Width of MATMUL_TILES' scratch for tiles of tile_rows rows: WIDE_ROWS where the CPU has
    AVX-512 (simd.HAS_AVX512), else one tile."""
    return WIDE_ROWS if HAS_AVX512 else tile_rows


# ==================================================================================================
# Tile decoder: _unpack_tile writes tile t (R = 16 or 24 rows) of W transposed into wt (n_cols, ld)
# float32 at columns col0..col0+R-1: wt[c, col0 + r] = W[R t + r, c] (rows past n_rows are zero).
# ==================================================================================================

@njit(cache=True, nogil=True, fastmath=False)
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


@njit(cache=True, nogil=True, fastmath=False)
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


@njit(cache=True, nogil=True, fastmath=False)
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
                    rf = r + 288 + 384 * j + 192 * g
                    for hf in range(2):
                        u = 2 * j + hf
                        dv = vmul(dd, ld_i8(buf, r + 32 + 16 * u + 8 * g))
                        mv = vmul(dv, vsplat(np.float32(-32.0)))
                        c0 = b * QK_K + QK * j + 16 * hf
                        top = vzero()       # column 15 of the half, from its three 2-bit pieces (exact)
                        for m in range(3):
                            w = ld_i32(buf, rf + 96 * hf + 32 * m)
                            for i in range(5):
                                vstore(wt[c0 + 5 * m + i], c, vfma(dv, andf(isrl(w, 6 * i), 0x3F), mv))
                            top = vfma(srlf(w, 30), vsplat(np.float32(1 << (2 * m))), top)
                        vstore(wt[c0 + 15], c, vfma(dv, top, mv))
            else:
                dm = ld_f16(buf, r + 48 + 16 * g)
                for j in range(8):
                    dv = vmul(dd, ld_u8(buf, r + 96 + 24 * j + 8 * g))
                    mv = vsub(vzero(), vmul(dm, ld_u8(buf, r + 288 + 24 * j + 8 * g)))
                    if kind == 0:
                        _unpack_bits(wt, c, b * QK_K + QK * j, buf, r + 480 + 384 * j + 128 * g, dv, mv, 4)
                    else:
                        _unpack_bits(wt, c, b * QK_K + QK * j, buf, r + 480 + 576 * j + 192 * g, dv, mv, 5)


@njit(cache=True, nogil=True, fastmath=False)
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


@njit(cache=True, nogil=True, fastmath=False)
def _unpack_iq4(wt, col0, c0, buf, r, dv, mv, lut):
    """Store 32 IQ4 columns (c0..c0+31) of one 8-row group as y = dv * u + mv, u = kvalue + 128 looked
    up from the index nibble dwords at r (4 x 32 bytes; byte k of dword s: columns 8s + k, 8s + 4 + k)."""
    for s in range(4):
        w = ld_i32(buf, r + 32 * s)
        lo = lut16(lut, iand(w, 0x0F0F0F0F))
        hi = lut16(lut, iand(isrl(w, 4), 0x0F0F0F0F))
        for k in range(4):
            vstore(wt[c0 + 8 * s + k], col0, vfma(dv, andf(isrl(lo, 8 * k), 0xFF), mv))
            vstore(wt[c0 + 8 * s + 4 + k], col0, vfma(dv, andf(isrl(hi, 8 * k), 0xFF), mv))


@njit(cache=True, nogil=True, fastmath=False)
def _unpack_tile_lowbit(wt, col0, buf, kind, t, nb):
    """Family 3 tile t (24 rows) -> wt[:, col0:col0 + 24]: kind 0 Q2_K, 1 Q3_K, 2 IQ4_NL, 3 IQ4_XS."""
    rec = (REC_Q2_K, REC_Q3_K, REC_IQ4_NL, REC_IQ4_XS)[kind]
    lut = ld_i32(IQ4_LUT, 0)
    for b in range(nb):
        r = (t * nb + b) * rec
        for g in range(3):
            c = col0 + 8 * g
            if kind == 2:
                d = ld_f16(buf, r + 384 + 16 * g)
                _unpack_iq4(wt, c, b * QK, buf, r + 128 * g, d, vmul(d, vsplat(np.float32(-128.0))), lut)
                continue
            dd = ld_f16(buf, r + 16 * g)
            if kind == 3:
                for j in range(8):
                    dv = vmul(dd, ld_i8(buf, r + 48 + 24 * j + 8 * g))
                    _unpack_iq4(wt, c, b * QK_K + QK * j, buf, r + 240 + 384 * j + 128 * g, dv,
                                vmul(dv, vsplat(np.float32(-128.0))), lut)
                continue
            for u in range(16):
                c0 = b * QK_K + 16 * u
                if kind == 0:
                    sm = ld_u8i(buf, r + 96 + 24 * u + 8 * g)
                    dv = vmul(dd, andf(sm, 15))
                    mv = vsub(vzero(), vmul(ld_f16(buf, r + 48 + 16 * g), srlf(sm, 4)))
                    w = ld_i32(buf, r + 480 + 192 * (u // 2) + 64 * g + 32 * (u % 2))
                    for i in range(16):
                        vstore(wt[c0 + i], c, vfma(dv, andf(isrl(w, 2 * i), 3), mv))
                else:
                    dv = vmul(dd, ld_i8(buf, r + 48 + 24 * u + 8 * g))
                    mv = vmul(dv, vsplat(np.float32(-4.0)))
                    for s in range(2):
                        w = ld_i32(buf, r + 432 + 384 * (u // 2) + 128 * g + 64 * (u % 2) + 32 * s)
                        for i in range(8):
                            vstore(wt[c0 + 8 * s + i], c, vfma(dv, andf(isrl(w, 4 * i), 15), mv))


def _unpack_tiles(wt, buf, kind, rows, t0, t1, nb):
    """Tiles t0..t1 of `rows` rows each -> wt (n_cols, >= rows (t1 - t0)) float32:
    wt[:, rows (t - t0) + r] = W[rows t + r, :]. Source of UNPACK_TILES' copies (unpack_tile bound)."""
    for t in prange(t0, t1):
        unpack_tile(wt, (t - t0) * rows, buf, kind, t, nb)


# ==================================================================================================
# Matmul: register-tiled products of X with one decoded tile, and the parallel driver
# ==================================================================================================

@njit(cache=True, nogil=True, fastmath=False)
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


@njit(cache=True, nogil=True, fastmath=False)
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


@njit(cache=True, nogil=True, fastmath=False)
def _gemm_2g8(X, w, t0, tmp):
    """tmp[j, 0:16] = X[t0 + j] @ wt[:, 0:16] for j < 8 (w = wt flat, row stride 16): one 16-lane
    accumulator per token, each lane summing what _gemm_2g's four-token path sums for it, in the same
    order (the same bits); on a CPU with AVX-512, one zmm operation where that path runs two ymm ones."""
    n_cols = X.shape[1]
    x0 = X[t0]
    x1 = X[t0 + 1]
    x2 = X[t0 + 2]
    x3 = X[t0 + 3]
    x4 = X[t0 + 4]
    x5 = X[t0 + 5]
    x6 = X[t0 + 6]
    x7 = X[t0 + 7]
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = zzero()
    for c in range(n_cols):
        wv = zload(w, 16 * c)
        a0 = zfma(wv, zbcast(x0, c), a0)
        a1 = zfma(wv, zbcast(x1, c), a1)
        a2 = zfma(wv, zbcast(x2, c), a2)
        a3 = zfma(wv, zbcast(x3, c), a3)
        a4 = zfma(wv, zbcast(x4, c), a4)
        a5 = zfma(wv, zbcast(x5, c), a5)
        a6 = zfma(wv, zbcast(x6, c), a6)
        a7 = zfma(wv, zbcast(x7, c), a7)
    zstore(tmp, 0, a0)
    zstore(tmp, 16, a1)
    zstore(tmp, 32, a2)
    zstore(tmp, 48, a3)
    zstore(tmp, 64, a4)
    zstore(tmp, 80, a5)
    zstore(tmp, 96, a6)
    zstore(tmp, 112, a7)


@njit(cache=True, nogil=True, fastmath=False)
def _gemm_3g4(X, w, t0, tmp):
    """tmp[j, 0:24] = X[t0 + j] @ wt[:, 0:24] for j < 4 (w = wt flat, row stride 24): one pass, per token
    one 16-lane accumulator (rows 0-15) and one 8-lane (rows 16-23). On a CPU with AVX-512 the 16 lanes
    are one zmm operation instead of two ymm ones; every lane sums the same products in the same order
    either way (simd.py)."""
    n_cols = X.shape[1]
    x0 = X[t0]
    x1 = X[t0 + 1]
    x2 = X[t0 + 2]
    x3 = X[t0 + 3]
    a0 = zzero()
    b0 = zzero()
    c0 = zzero()
    e0 = zzero()
    a2 = vzero()
    b2 = vzero()
    c2 = vzero()
    e2 = vzero()
    for c in range(n_cols):
        w0 = zload(w, 24 * c)
        w2 = vload(w, 24 * c + 16)
        a0 = zfma(w0, zbcast(x0, c), a0)
        a2 = vfma(w2, vbcast(x0, c), a2)
        b0 = zfma(w0, zbcast(x1, c), b0)
        b2 = vfma(w2, vbcast(x1, c), b2)
        c0 = zfma(w0, zbcast(x2, c), c0)
        c2 = vfma(w2, vbcast(x2, c), c2)
        e0 = zfma(w0, zbcast(x3, c), e0)
        e2 = vfma(w2, vbcast(x3, c), e2)
    zstore(tmp, 0, a0)
    vstore(tmp, 16, a2)
    zstore(tmp, 24, b0)
    vstore(tmp, 40, b2)
    zstore(tmp, 48, c0)
    vstore(tmp, 64, c2)
    zstore(tmp, 72, e0)
    vstore(tmp, 88, e2)


@njit(cache=True, nogil=True, fastmath=False)
def _gemm_z8x48(X, w, t0, tmp):
    """tmp[j, 0:48] = X[t0 + j] @ wt[:, 0:48] for j < 8 (w = wt flat, row stride 48): three 16-lane
    accumulators per token, each lane summing its products over the columns in order, one fma each."""
    x0 = X[t0]
    x1 = X[t0 + 1]
    x2 = X[t0 + 2]
    x3 = X[t0 + 3]
    x4 = X[t0 + 4]
    x5 = X[t0 + 5]
    x6 = X[t0 + 6]
    x7 = X[t0 + 7]
    n_cols = X.shape[1]
    a0 = a1 = a2 = zzero()
    b0 = b1 = b2 = zzero()
    c0 = c1 = c2 = zzero()
    d0 = d1 = d2 = zzero()
    e0 = e1 = e2 = zzero()
    f0 = f1 = f2 = zzero()
    g0 = g1 = g2 = zzero()
    h0 = h1 = h2 = zzero()
    for c in range(n_cols):
        w0 = zload(w, 48 * c)
        w1 = zload(w, 48 * c + 16)
        w2 = zload(w, 48 * c + 32)
        xv = zbcast(x0, c)
        a0, a1, a2 = zfma(w0, xv, a0), zfma(w1, xv, a1), zfma(w2, xv, a2)
        xv = zbcast(x1, c)
        b0, b1, b2 = zfma(w0, xv, b0), zfma(w1, xv, b1), zfma(w2, xv, b2)
        xv = zbcast(x2, c)
        c0, c1, c2 = zfma(w0, xv, c0), zfma(w1, xv, c1), zfma(w2, xv, c2)
        xv = zbcast(x3, c)
        d0, d1, d2 = zfma(w0, xv, d0), zfma(w1, xv, d1), zfma(w2, xv, d2)
        xv = zbcast(x4, c)
        e0, e1, e2 = zfma(w0, xv, e0), zfma(w1, xv, e1), zfma(w2, xv, e2)
        xv = zbcast(x5, c)
        f0, f1, f2 = zfma(w0, xv, f0), zfma(w1, xv, f1), zfma(w2, xv, f2)
        xv = zbcast(x6, c)
        g0, g1, g2 = zfma(w0, xv, g0), zfma(w1, xv, g1), zfma(w2, xv, g2)
        xv = zbcast(x7, c)
        h0, h1, h2 = zfma(w0, xv, h0), zfma(w1, xv, h1), zfma(w2, xv, h2)
    zstore(tmp, 0, a0)
    zstore(tmp, 16, a1)
    zstore(tmp, 32, a2)
    zstore(tmp, 48, b0)
    zstore(tmp, 64, b1)
    zstore(tmp, 80, b2)
    zstore(tmp, 96, c0)
    zstore(tmp, 112, c1)
    zstore(tmp, 128, c2)
    zstore(tmp, 144, d0)
    zstore(tmp, 160, d1)
    zstore(tmp, 176, d2)
    zstore(tmp, 192, e0)
    zstore(tmp, 208, e1)
    zstore(tmp, 224, e2)
    zstore(tmp, 240, f0)
    zstore(tmp, 256, f1)
    zstore(tmp, 272, f2)
    zstore(tmp, 288, g0)
    zstore(tmp, 304, g1)
    zstore(tmp, 320, g2)
    zstore(tmp, 336, h0)
    zstore(tmp, 352, h1)
    zstore(tmp, 368, h2)


@njit(cache=True, nogil=True, fastmath=False)
def gemm_tile_narrow(out, X, wt, r0, tmp, valid):
    """out[:, r0:r0 + valid] = X @ wt[:, :valid] (X (T, n_cols), wt (n_cols, ld) float32 C-contiguous,
    ld = valid = 16 or 24: one tile); rows of out past its end are dropped. tmp: float32 (8 * ld,)."""
    T = X.shape[0]
    ld = wt.shape[1]
    w = wt.reshape(-1)
    t0 = np.int64(0)          # not the literal 0: callees would compile once for Literal[int](0), once for int64
    while t0 < T:
        nt = min(4, T - t0)
        if nt == 3:
            nt = 2
        if ld == 16 and T - t0 >= 8:
            nt = 8
            _gemm_2g8(X, w, t0, tmp)
        elif ld == 24 and nt == 4:
            _gemm_3g4(X, w, t0, tmp)
        else:
            _gemm_2g(X, w, ld, 0, t0, nt, tmp)
            if ld == 24:
                _gemm_1g(X, w, ld, 16, t0, nt, tmp)
        _store_rows(out, tmp, ld, t0, nt, r0, valid)
        t0 += nt


@njit(cache=True, nogil=True, fastmath=False)
def gemm_tile_wide(out, X, wt, r0, tmp, valid):
    """out[:, r0:r0 + valid] = X @ wt[:, :valid] (wt (n_cols, WIDE_ROWS) float32 C-contiguous: tiles
    side by side, valid of its columns decoded); rows of out past its end are dropped. tmp: float32
    (8 * WIDE_ROWS,). Tokens 8 at a time; the last T mod 8 (at most one group of 4, then pairs and one
    alone) through the one-tile kernels, 16 rows at a time. The columns are not blocked to hold a block
    of wt in L1 while the tokens pass: each token's row of X would then stream in short pieces, which
    costs more than reading wt from L2."""
    T = X.shape[0]
    ld = wt.shape[1]
    w = wt.reshape(-1)
    t0 = np.int64(0)
    while t0 < T:
        left = T - t0
        if left >= 8:
            nt = 8
            _gemm_z8x48(X, w, t0, tmp)
        else:
            nt = 4 if left >= 4 else 2 if left >= 2 else 1
            for go in range(0, valid, 16):
                _gemm_2g(X, w, ld, go, t0, nt, tmp)
        _store_rows(out, tmp, ld, t0, nt, r0, valid)
        t0 += nt


@njit(cache=True, nogil=True, inline="always")
def _store_rows(out, tmp, ld, t0, nt, r0, valid):
    """out[t0 + j, r0:r0 + valid] = tmp[j ld : j ld + valid] for j < nt, cut at out's last row."""
    n_rows = out.shape[1]
    for j in range(nt):
        o = out[t0 + j]
        if r0 + valid <= n_rows:
            for g in range(0, valid, 8):
                vstore(o, r0 + g, vload(tmp, j * ld + g))
        else:
            for r in range(r0, n_rows):
                o[r] = tmp[j * ld + r - r0]


# the product of one scratch of decoded tiles, for the scratch width decoded_rows gives
_gemm_tile = gemm_tile_wide if HAS_AVX512 else gemm_tile_narrow


def _matmul_tiles(out, buf, X, kind, nb, rows, wts):
    """out (T, n_rows) float32 = X @ W.T, X (T, n_cols) float32 C-contiguous, W in tiles of `rows` rows;
    wts (n_chunks, n_cols, decoded_rows(rows)) float32 scratch: the tiles are split into n_chunks
    contiguous runs, one per prange iteration; the tiles of a run are decoded into its scratch as
    many at a time as it holds side by side, each once, and multiplied with all T rows of X. Source
    of MATMUL_TILES' copies (unpack_tile bound to one family's decoder)."""
    n_rows = out.shape[1]
    n_cols = X.shape[1]
    width = wts.shape[2]
    per = width // rows
    n_tiles = (n_rows + rows - 1) // rows
    n_chunks = wts.shape[0]
    for ch in prange(n_chunks):
        wt = wts[ch]
        tmp = np.empty(8 * width, np.float32)
        t, t_end = ch * n_tiles // n_chunks, (ch + 1) * n_tiles // n_chunks
        while t < t_end:
            k = min(per, t_end - t)
            for i in range(k):
                unpack_tile(wt, i * rows, buf, kind, t + i, nb)
            if k < per:                 # columns left from no tile: zeros, not whatever the scratch held
                for c in range(n_cols):
                    for r in range(k * rows, width):
                        wt[c, r] = 0.0
            _gemm_tile(out, X, wt, t * rows, tmp, k * rows)
            t += k


# ==================================================================================================
# Entry kernels, one per family: a model compiles the decoders of its own types only
# ==================================================================================================

def _family_entries(source, name: str) -> tuple:
    """(family 0, 1, 2, 3) compiled copies of `source` with unpack_tile bound to that family's decoder."""
    entries = []
    for family, unpack in enumerate((_unpack_tile_legacy, _unpack_tile_kquant, _unpack_tile_float,
                                     _unpack_tile_lowbit)):
        namespace = dict(globals(), unpack_tile=unpack)
        kernel = bind_copy(source, f"{name}_{family}", namespace)
        entries.append(njit(cache=True, nogil=True, parallel=True, fastmath=False)(kernel))
    return tuple(entries)


# UNPACK_TILES[family](wt, buf, kind, rows, t0, t1, nb); MATMUL_TILES[family](out, buf, X, kind, nb, rows, wts)
UNPACK_TILES = _family_entries(_unpack_tiles, "unpack_tiles")
MATMUL_TILES = _family_entries(_matmul_tiles, "matmul_tiles")
