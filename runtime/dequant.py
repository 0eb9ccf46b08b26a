"""Dequantize GGML tensor blocks to float32 with Numba.

Every kernel has the same contract, destination first, and returns None:

    dequant_<type>(out, blocks)
        out:    float32 1-D, n_blocks * values_per_block values, written in full.
        blocks: uint8 2-D (n_blocks, type_size), one GGML block per row, bytes exactly as the
                GGUF file stores them (little-endian).

Block layouts follow ggml's ggml-common.h (block_q4_0, ..., block_q6_K, block_iq4_nl, block_iq4_xs) and the value order of
ggml-quants.c's dequantize_row_*. The arithmetic is float32 in the operation order of ggml's
scalar dequantize_row_* and of gguf-py's NumPy reference (gguf.quants), with no fast-math, so
results are bit-identical to gguf.quants (tests/test_dequant.py checks this); a ggml build that
fuses multiply-adds into FMA can differ from both in the last bit of Q4_1 / Q5_1 / K-quant values.

Kernels are serial and nogil; `dequantize` splits large tensors into chunks of whole blocks and
runs them on a small thread pool.

Kernels trust their arguments: nothing here checks bounds (Numba does not), so user input goes
through the Python entry points `dequantize` / `dequantize_rows`, which validate dtype, type and
byte counts first and raise ConfigError / UnsupportedModelError.
"""
from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit

from ringllm.runtime.errors import ConfigError, UnsupportedModelError
from ringllm.runtime.quant_types import BLOCK_LAYOUT, SUPPORTED_TYPES, GGMLType, row_bytes

__all__ = [
    "dequantize", "dequantize_rows", "KERNELS",
    "dequant_f32", "dequant_f16", "dequant_bf16",
    "dequant_q4_0", "dequant_q4_1", "dequant_q5_0", "dequant_q5_1", "dequant_q8_0",
    "dequant_q4_k", "dequant_q5_k", "dequant_q6_k", "dequant_q2_k", "dequant_q3_k",
    "dequant_iq4_nl", "dequant_iq4_xs", "KVALUES_IQ4NL",
]

QK_K = 256          # values per K-quant super-block (ggml-common.h)
K_SCALE_SIZE = 12   # bytes of packed 6-bit scales/mins in Q4_K / Q5_K

# kvalues_iq4nl (ggml-common.h): the 16 int8 levels an IQ4_NL / IQ4_XS 4-bit index selects
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                         dtype=np.int8)
KVALUES_IQ4NL.setflags(write=False)

# Below this many values a tensor is decoded in the calling thread: handing chunks to the thread
# pool costs more than it saves on norm vectors and other small tensors.
# Chunks hold at least _CHUNK_MIN_VALUES (~0.1-0.2 ms of kernel time) so submitting them costs
# little next to the work.
_PARALLEL_MIN_VALUES = 1 << 20
_CHUNK_MIN_VALUES = 1 << 18


# ==================================================================================================
# Scalar helpers: little-endian loads and half / bfloat16 -> float32
# ==================================================================================================

@njit(cache=True, nogil=True, inline="always")
def _u16(b, i, o):
    """Little-endian uint16 from bytes b[i, o], b[i, o + 1], as a uint32."""
    return np.uint32(b[i, o]) | (np.uint32(b[i, o + 1]) << np.uint32(8))


@njit(cache=True, nogil=True, inline="always")
def _u32(b, i, o):
    """Little-endian uint32 from bytes b[i, o .. o + 3]."""
    return (np.uint32(b[i, o]) | (np.uint32(b[i, o + 1]) << np.uint32(8))
            | (np.uint32(b[i, o + 2]) << np.uint32(16)) | (np.uint32(b[i, o + 3]) << np.uint32(24)))


@njit(cache=True, nogil=True, fastmath=False)
def half_bits_to_f32(h):
    """IEEE 754 binary16 bits (uint16 value held in an integer) -> np.float32, exactly.

    Normal numbers rebias the exponent (15 -> 127); subnormals (exponent 0, mantissa != 0) are
    normalised; +-0 stay signed zeros; exponent 31 gives +-inf or NaN with the payload kept
    (shifted like NumPy's float16 -> float32 cast does).
    """
    h = np.uint32(h)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exp = (h >> np.uint32(10)) & np.uint32(0x1F)
    mant = h & np.uint32(0x3FF)
    if exp == 0:
        if mant == 0:
            bits = sign
        else:
            # subnormal half: value = mant * 2^-24; shift the leading 1 into the implicit bit
            e = np.uint32(127 - 15 + 1)
            while (mant & np.uint32(0x400)) == 0:
                mant <<= np.uint32(1)
                e -= np.uint32(1)
            mant &= np.uint32(0x3FF)
            bits = sign | (e << np.uint32(23)) | (mant << np.uint32(13))
    elif exp == 0x1F:
        bits = sign | np.uint32(0x7F800000) | (mant << np.uint32(13))
    else:
        bits = sign | ((exp + np.uint32(127 - 15)) << np.uint32(23)) | (mant << np.uint32(13))
    return np.uint32(bits).view(np.float32)


@njit(cache=True, nogil=True, inline="always")
def _f16(b, i, o):
    """float32 value of the little-endian f16 stored at b[i, o:o + 2] (ggml_fp16_t)."""
    return half_bits_to_f32(_u16(b, i, o))


# ==================================================================================================
# Plain float types: F32, F16, BF16 (a "block" is one value)
# ==================================================================================================

@njit(cache=True, nogil=True, fastmath=False)
def dequant_f32(out, blocks):
    """F32: blocks (n, 4) uint8 little-endian IEEE binary32 -> out (n,) float32 (bit copy)."""
    for i in range(blocks.shape[0]):
        out[i] = np.uint32(_u32(blocks, i, 0)).view(np.float32)


@njit(cache=True, nogil=True, fastmath=False)
def dequant_f16(out, blocks):
    """F16: blocks (n, 2) uint8 little-endian IEEE binary16 -> out (n,) float32 (exact)."""
    for i in range(blocks.shape[0]):
        out[i] = _f16(blocks, i, 0)


@njit(cache=True, nogil=True, fastmath=False)
def dequant_bf16(out, blocks):
    """BF16: blocks (n, 2) uint8; a bfloat16 is the top 16 bits of a float32 (ggml_bf16_t)."""
    for i in range(blocks.shape[0]):
        out[i] = np.uint32(_u16(blocks, i, 0) << np.uint32(16)).view(np.float32)


# ==================================================================================================
# Legacy 32-value blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
#
# ggml-common.h (QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK8_0 = 32):
#   block_q4_0 { ggml_half d;              uint8_t qs[16]; }            18 bytes
#   block_q4_1 { ggml_half d, m;           uint8_t qs[16]; }            20 bytes
#   block_q5_0 { ggml_half d; uint8_t qh[4]; uint8_t qs[16]; }          22 bytes
#   block_q5_1 { ggml_half d, m; uint8_t qh[4]; uint8_t qs[16]; }       24 bytes
#   block_q8_0 { ggml_half d;              int8_t  qs[32]; }            34 bytes
# Nibble order (dequantize_row_q4_0 etc.): value j (j < 16) is the low nibble of qs[j], value
# j + 16 is its high nibble. Q5: qh is a little-endian uint32 whose bit j is bit 4 of value j.
# ==================================================================================================

@njit(cache=True, nogil=True, fastmath=False)
def dequant_q4_0(out, blocks):
    """Q4_0: blocks (n, 18) -> out (n * 32,); y = d * (q - 8), q in 0..15."""
    for i in range(blocks.shape[0]):
        d = _f16(blocks, i, 0)
        base = i * 32
        for j in range(16):
            q = blocks[i, 2 + j]
            out[base + j] = d * np.float32(np.int32(q & 0x0F) - 8)
            out[base + j + 16] = d * np.float32(np.int32(q >> 4) - 8)


@njit(cache=True, nogil=True, fastmath=False)
def dequant_q4_1(out, blocks):
    """Q4_1: blocks (n, 20) -> out (n * 32,); y = d * q + m, q in 0..15."""
    for i in range(blocks.shape[0]):
        d = _f16(blocks, i, 0)
        m = _f16(blocks, i, 2)
        base = i * 32
        for j in range(16):
            q = blocks[i, 4 + j]
            out[base + j] = d * np.float32(q & 0x0F) + m
            out[base + j + 16] = d * np.float32(q >> 4) + m


@njit(cache=True, nogil=True, fastmath=False)
def dequant_q5_0(out, blocks):
    """Q5_0: blocks (n, 22) -> out (n * 32,); y = d * (q - 16), q = nibble | qh bit << 4."""
    for i in range(blocks.shape[0]):
        d = _f16(blocks, i, 0)
        qh = _u32(blocks, i, 2)
        base = i * 32
        for j in range(16):
            q = blocks[i, 6 + j]
            h0 = np.int32((qh >> np.uint32(j)) & np.uint32(1)) << 4
            h1 = np.int32((qh >> np.uint32(j + 16)) & np.uint32(1)) << 4
            out[base + j] = d * np.float32((np.int32(q & 0x0F) | h0) - 16)
            out[base + j + 16] = d * np.float32((np.int32(q >> 4) | h1) - 16)


@njit(cache=True, nogil=True, fastmath=False)
def dequant_q5_1(out, blocks):
    """Q5_1: blocks (n, 24) -> out (n * 32,); y = d * q + m, q = nibble | qh bit << 4."""
    for i in range(blocks.shape[0]):
        d = _f16(blocks, i, 0)
        m = _f16(blocks, i, 2)
        qh = _u32(blocks, i, 4)
        base = i * 32
        for j in range(16):
            q = blocks[i, 8 + j]
            h0 = np.int32((qh >> np.uint32(j)) & np.uint32(1)) << 4
            h1 = np.int32((qh >> np.uint32(j + 16)) & np.uint32(1)) << 4
            out[base + j] = d * np.float32(np.int32(q & 0x0F) | h0) + m
            out[base + j + 16] = d * np.float32(np.int32(q >> 4) | h1) + m


@njit(cache=True, nogil=True, fastmath=False)
def dequant_q8_0(out, blocks):
    """Q8_0: blocks (n, 34) -> out (n * 32,); y = d * q, q int8."""
    for i in range(blocks.shape[0]):
        d = _f16(blocks, i, 0)
        base = i * 32
        for j in range(32):
            # np.int8(uint8) reinterprets the byte as two's complement (an LLVM trunc/bitcast)
            out[base + j] = np.float32(np.int8(blocks[i, 2 + j])) * d


# ==================================================================================================
# K-quants: 256-value super-blocks: Q4_K, Q5_K, Q6_K
#
# ggml-common.h (QK_K = 256, K_SCALE_SIZE = 12):
#   block_q4_K { ggml_half d, dmin; uint8_t scales[12]; uint8_t qs[128]; }              144 bytes
#   block_q5_K { ggml_half d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } 176
#   block_q6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; ggml_half d; }     210 bytes
# Q4_K / Q5_K: 8 sub-blocks of 32 values, each with a 6-bit scale and 6-bit min packed into
# scales[12] (get_scale_min_k4 in ggml-quants.c); y = d * sc * q - dmin * m.
# Q6_K: 16 sub-blocks of 16 values with int8 scales; q is 6 bits, 4 from ql and 2 from qh, minus 32.
# ==================================================================================================

@njit(cache=True, nogil=True, inline="always")
def _scale_min_k4(blocks, i, j, off):
    """get_scale_min_k4: 6-bit (scale, min) of sub-block j from the 12 bytes at blocks[i, off:]."""
    if j < 4:
        sc = np.int32(blocks[i, off + j]) & 63
        mn = np.int32(blocks[i, off + j + 4]) & 63
    else:
        sc = (np.int32(blocks[i, off + j + 4]) & 0x0F) | ((np.int32(blocks[i, off + j - 4]) >> 6) << 4)
        mn = (np.int32(blocks[i, off + j + 4]) >> 4) | ((np.int32(blocks[i, off + j]) >> 6) << 4)
    return sc, mn


@njit(cache=True, nogil=True, fastmath=False)
def dequant_q4_k(out, blocks):
    """Q4_K: blocks (n, 144) -> out (n * 256,).

    For each 64-value chunk c (0..3): sub-blocks 2c and 2c + 1 share qs[32c:32c + 32]; low nibbles
    give values 64c..64c+31, high nibbles 64c+32..64c+63.
    """
    for i in range(blocks.shape[0]):
        d = _f16(blocks, i, 0)
        dmin = _f16(blocks, i, 2)
        base = i * QK_K
        for c in range(4):
            sc1, m1 = _scale_min_k4(blocks, i, 2 * c, 4)
            sc2, m2 = _scale_min_k4(blocks, i, 2 * c + 1, 4)
            d1 = d * np.float32(sc1)
            dm1 = dmin * np.float32(m1)
            d2 = d * np.float32(sc2)
            dm2 = dmin * np.float32(m2)
            qoff = 4 + K_SCALE_SIZE + 32 * c
            o = base + 64 * c
            for l in range(32):
                q = blocks[i, qoff + l]
                out[o + l] = d1 * np.float32(q & 0x0F) - dm1
                out[o + 32 + l] = d2 * np.float32(q >> 4) - dm2


@njit(cache=True, nogil=True, fastmath=False)
def dequant_q5_k(out, blocks):
    """Q5_K: blocks (n, 176) -> out (n * 256,).

    Like Q4_K, plus bit 4 of each value from qh[32]: value 64c + l takes bit 2c of qh[l],
    value 64c + 32 + l takes bit 2c + 1.
    """
    for i in range(blocks.shape[0]):
        d = _f16(blocks, i, 0)
        dmin = _f16(blocks, i, 2)
        base = i * QK_K
        qh_off = 4 + K_SCALE_SIZE
        for c in range(4):
            sc1, m1 = _scale_min_k4(blocks, i, 2 * c, 4)
            sc2, m2 = _scale_min_k4(blocks, i, 2 * c + 1, 4)
            d1 = d * np.float32(sc1)
            dm1 = dmin * np.float32(m1)
            d2 = d * np.float32(sc2)
            dm2 = dmin * np.float32(m2)
            qoff = qh_off + 32 + 32 * c
            o = base + 64 * c
            for l in range(32):
                q = np.int32(blocks[i, qoff + l])
                h = np.int32(blocks[i, qh_off + l])
                q1 = (q & 0x0F) | (((h >> (2 * c)) & 1) << 4)
                q2 = (q >> 4) | (((h >> (2 * c + 1)) & 1) << 4)
                out[o + l] = d1 * np.float32(q1) - dm1
                out[o + 32 + l] = d2 * np.float32(q2) - dm2


@njit(cache=True, nogil=True, fastmath=False)
def dequant_q6_k(out, blocks):
    """Q6_K: blocks (n, 210) -> out (n * 256,).

    Per 128-value half n (0, 1), with ql = ql[64n:], qh = qh[32n:], sc = scales[8n:], l in 0..31:
      y[l]      = d * sc[l/16 + 0] * ((ql[l]      & 15) | ((qh[l] >> 0) & 3) << 4) - 32)
      y[l + 32] = d * sc[l/16 + 2] * ((ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4) - 32)
      y[l + 64] = d * sc[l/16 + 4] * ((ql[l]      >> 4) | ((qh[l] >> 4) & 3) << 4) - 32)
      y[l + 96] = d * sc[l/16 + 6] * ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32)
    """
    qh0 = QK_K // 2             # ql[128] at 0, qh[64] at 128
    sc0 = qh0 + QK_K // 4       # scales[16] at 192
    d_off = sc0 + QK_K // 16    # d at 208
    for i in range(blocks.shape[0]):
        d = _f16(blocks, i, d_off)
        for n in range(2):
            o = i * QK_K + 128 * n
            for g in range(2):  # l // 16: the four scales are constant over 16 values of l
                s = sc0 + 8 * n + g
                d1 = d * _i8(blocks[i, s])
                d2 = d * _i8(blocks[i, s + 2])
                d3 = d * _i8(blocks[i, s + 4])
                d4 = d * _i8(blocks[i, s + 6])
                for l in range(16 * g, 16 * g + 16):
                    a = np.int32(blocks[i, 64 * n + l])
                    b = np.int32(blocks[i, 64 * n + l + 32])
                    h = np.int32(blocks[i, qh0 + 32 * n + l])
                    out[o + l] = d1 * np.float32(((a & 0x0F) | ((h & 3) << 4)) - 32)
                    out[o + l + 32] = d2 * np.float32(((b & 0x0F) | (((h >> 2) & 3) << 4)) - 32)
                    out[o + l + 64] = d3 * np.float32(((a >> 4) | (((h >> 4) & 3) << 4)) - 32)
                    out[o + l + 96] = d4 * np.float32(((b >> 4) | (((h >> 6) & 3) << 4)) - 32)


@njit(cache=True, nogil=True, inline="always")
def _i8(byte):
    """A uint8 byte reinterpreted as int8, as float32."""
    return np.float32(np.int8(byte))


# ==================================================================================================
# Low-bit K-quants: Q2_K, Q3_K (256-value super-blocks of 16 sub-blocks of 16 values)
#
# ggml-common.h:
#   block_q2_K { uint8_t scales[16]; uint8_t qs[64]; ggml_half d, dmin; }              84 bytes
#   block_q3_K { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; ggml_half d; } 110 bytes
# Value order (dequantize_row_q2_K / _q3_K): value v = 128 n + 32 s + l (n < 2, s < 4, l < 32) has
# its 2 low bits at bits 2s of qs[32 n + l]; it belongs to sub-block v // 16.
# Q2_K: scales[u] = scale (low nibble) | min (high nibble); y = (d sc_u) q - (dmin m_u).
# Q3_K: value v's bit 2 is bit v // 32 of hmask[v % 32], and q = low2 - 4 when that bit is clear
# (q in -4..3); the 16 scales are 6 bits: low 4 from nibble u // 8 of scales[u % 8], high 2 from
# bits 2 (u // 4) of scales[8 + u % 4], minus 32; y = (d (sc_u - 32)) q.
# ==================================================================================================

@njit(cache=True, nogil=True, fastmath=False)
def dequant_q2_k(out, blocks):
    """Q2_K: blocks (n, 84) -> out (n * 256,)."""
    for i in range(blocks.shape[0]):
        d = _f16(blocks, i, 80)
        dmin = _f16(blocks, i, 82)
        for u in range(16):
            sc = np.int32(blocks[i, u])
            dl = d * np.float32(sc & 0x0F)
            ml = dmin * np.float32(sc >> 4)
            n = u // 8
            s = (u // 2) % 4
            l0 = 16 * (u % 2)
            o = i * QK_K + 16 * u
            for l in range(16):
                q = (np.int32(blocks[i, 16 + 32 * n + l0 + l]) >> (2 * s)) & 3
                out[o + l] = dl * np.float32(q) - ml


@njit(cache=True, nogil=True, inline="always")
def _q3k_scale(blocks, i, u):
    """Q3_K signed 6-bit scale of sub-block u (0..15) from the 12 bytes at blocks[i, 96:], as int."""
    lo = (np.int32(blocks[i, 96 + u % 8]) >> (4 * (u // 8))) & 0x0F
    hi = (np.int32(blocks[i, 104 + u % 4]) >> (2 * (u // 4))) & 3
    return (lo | (hi << 4)) - 32


@njit(cache=True, nogil=True, fastmath=False)
def dequant_q3_k(out, blocks):
    """Q3_K: blocks (n, 110) -> out (n * 256,)."""
    for i in range(blocks.shape[0]):
        d = _f16(blocks, i, 108)
        for u in range(16):
            dl = d * np.float32(_q3k_scale(blocks, i, u))
            n = u // 8
            s = (u // 2) % 4
            l0 = 16 * (u % 2)
            hb = u // 2                  # hmask bit of values 32 hb .. 32 hb + 31
            o = i * QK_K + 16 * u
            for l in range(16):
                low = (np.int32(blocks[i, 32 + 32 * n + l0 + l]) >> (2 * s)) & 3
                h = (np.int32(blocks[i, l0 + l]) >> hb) & 1
                out[o + l] = dl * np.float32(low - 4 + 4 * h)


# ==================================================================================================
# Non-linear 4-bit types: IQ4_NL (32-value blocks), IQ4_XS (256-value super-blocks)
#
# ggml-common.h:
#   block_iq4_nl { ggml_half d; uint8_t qs[16]; }                                       18 bytes
#   block_iq4_xs { ggml_half d; uint16_t scales_h; uint8_t scales_l[4]; uint8_t qs[128]; } 136
# A 4-bit index q picks KVALUES_IQ4NL[q]. Nibble order as Q4_0 within each 32 values (value j < 16
# the low nibble of qs[j], value j + 16 its high nibble); IQ4_XS sub-block b (0..7) uses
# qs[16 b:16 b + 16] and the 6-bit scale ls_b = nibble b % 2 of scales_l[b // 2] | bits 2b of
# scales_h << 4; y = (d (ls_b - 32)) kvalue.
# ==================================================================================================

@njit(cache=True, nogil=True, fastmath=False)
def dequant_iq4_nl(out, blocks):
    """IQ4_NL: blocks (n, 18) -> out (n * 32,); y = d * kvalue[q]."""
    for i in range(blocks.shape[0]):
        d = _f16(blocks, i, 0)
        base = i * 32
        for j in range(16):
            q = blocks[i, 2 + j]
            out[base + j] = d * np.float32(KVALUES_IQ4NL[q & 0x0F])
            out[base + j + 16] = d * np.float32(KVALUES_IQ4NL[q >> 4])


@njit(cache=True, nogil=True, fastmath=False)
def dequant_iq4_xs(out, blocks):
    """IQ4_XS: blocks (n, 136) -> out (n * 256,); y = (d (ls - 32)) * kvalue[q]."""
    for i in range(blocks.shape[0]):
        d = _f16(blocks, i, 0)
        sh = _u16(blocks, i, 2)
        for b in range(8):
            ls = ((np.int32(blocks[i, 4 + b // 2]) >> (4 * (b % 2))) & 0x0F) \
                | (np.int32((sh >> np.uint32(2 * b)) & np.uint32(3)) << 4)
            dl = d * np.float32(ls - 32)
            o = i * QK_K + 32 * b
            for j in range(16):
                q = blocks[i, 8 + 16 * b + j]
                out[o + j] = dl * np.float32(KVALUES_IQ4NL[q & 0x0F])
                out[o + j + 16] = dl * np.float32(KVALUES_IQ4NL[q >> 4])


# type -> serial kernel
KERNELS = {
    GGMLType.F32: dequant_f32,
    GGMLType.F16: dequant_f16,
    GGMLType.BF16: dequant_bf16,
    GGMLType.Q4_0: dequant_q4_0,
    GGMLType.Q4_1: dequant_q4_1,
    GGMLType.Q5_0: dequant_q5_0,
    GGMLType.Q5_1: dequant_q5_1,
    GGMLType.Q8_0: dequant_q8_0,
    GGMLType.Q4_K: dequant_q4_k,
    GGMLType.Q5_K: dequant_q5_k,
    GGMLType.Q6_K: dequant_q6_k,
    GGMLType.Q2_K: dequant_q2_k,
    GGMLType.Q3_K: dequant_q3_k,
    GGMLType.IQ4_NL: dequant_iq4_nl,
    GGMLType.IQ4_XS: dequant_iq4_xs,
}
assert set(KERNELS) == set(SUPPORTED_TYPES), "every type in quant_types.BLOCK_LAYOUT needs a kernel"


# ==================================================================================================
# Parallelism: contiguous chunks of blocks, one kernel call each, on a thread pool.
#
# The kernels are nogil, so plain Python threads run them in parallel. This replaces a
# parallel=True / prange entry kernel on purpose: that costs ~0.7 s of extra compile per type
# (doubling cold compile time), and Numba's fallback workqueue threading layer (used where neither
# TBB nor OpenMP is installed) aborts when two Python threads launch parallel kernels at once,
# whereas these kernels are safe to call from any number of threads.
# ==================================================================================================

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _n_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_n_workers(), thread_name_prefix="ringllm-dequant")
        return _pool


def _forget_pool_after_fork() -> None:
    # a forked child inherits the executor but not its threads: submitting to it would hang
    global _pool, _pool_lock
    _pool = None
    _pool_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


# ==================================================================================================
# Python entry points: validation, then one kernel call
# ==================================================================================================

def _check_type(qtype, name: str) -> GGMLType:
    """qtype (GGMLType, gguf.GGMLQuantizationType or int) as a supported GGMLType."""
    try:
        t = GGMLType(int(qtype))
    except (ValueError, TypeError):
        raise UnsupportedModelError(name, f"unknown GGML tensor type {qtype!r}") from None
    if t not in KERNELS:
        raise UnsupportedModelError(
            name, f"cannot dequantize GGML type {t.name}: ringllm supports "
            f"{', '.join(x.name for x in KERNELS)}")
    return t


def _check_bytes(data, name: str) -> np.ndarray:
    if not isinstance(data, np.ndarray):
        raise ConfigError(f"{name}: data must be a numpy uint8 array, got {type(data).__name__}")
    if data.dtype != np.uint8:
        raise ConfigError(f"{name}: data must have dtype uint8 (the raw GGUF bytes), got {data.dtype}; "
                          "use arr.view(np.uint8) on a contiguous array")
    return data


def _as_blocks(data: np.ndarray, type_size: int) -> np.ndarray:
    """uint8 bytes of any shape/strides -> C-contiguous (n_blocks, type_size) (a view when possible)."""
    return np.ascontiguousarray(data).reshape(-1, type_size)


def _run(qtype: GGMLType, blocks: np.ndarray, n_values: int) -> np.ndarray:
    """Decode validated C-contiguous (n_blocks, type_size) blocks into a new float32 (n_values,)."""
    out = np.empty(n_values, dtype=np.float32)
    n_blocks = blocks.shape[0]
    if n_blocks == 0:
        return out
    kernel = KERNELS[qtype]
    block = BLOCK_LAYOUT[qtype][0]
    workers = _n_workers()
    if workers == 1 or n_values < _PARALLEL_MIN_VALUES:
        kernel(out, blocks)
        return out
    # a few chunks per worker evens out the load; every chunk is a whole number of blocks
    n_chunks = min(4 * workers, max(1, n_values // _CHUNK_MIN_VALUES))
    bounds = [c * n_blocks // n_chunks for c in range(n_chunks + 1)]
    futures = [_get_pool().submit(kernel, out[b0 * block:b1 * block], blocks[b0:b1])
               for b0, b1 in zip(bounds[:-1], bounds[1:]) if b1 > b0]
    for f in futures:
        f.result()
    return out


def dequantize(data: np.ndarray, qtype, shape: tuple[int, ...], *, name: str = "tensor") -> np.ndarray:
    """Dequantize a whole GGML tensor to float32.

    Args:
        data:  uint8 array holding the tensor's blocks as the GGUF file stores them, usually the
               (n_rows, row_bytes) view GGUFTensor.data; any shape or strides, as long as its
               bytes in C order are the blocks in order and the byte count matches `shape`.
        qtype: GGMLType (or gguf.GGMLQuantizationType / int) of the blocks.
        shape: logical shape, (n_rows, n_cols) or (n,) (any rank >= 1); the last dimension must
               be a whole number of blocks.
        name:  used in error messages only (e.g. the tensor name).

    Returns:
        float32 C-contiguous array of `shape`, newly allocated (never a view of `data`).

    Raises:
        UnsupportedModelError: qtype is not one ringllm can dequantize.
        ConfigError: data is not uint8, shape is invalid, or the byte count does not match.
    """
    t = _check_type(qtype, name)
    data = _check_bytes(data, name)
    try:
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: shape must be a tuple of ints, got {shape!r}") from None
    if not shape or any(s < 0 for s in shape):
        raise ConfigError(f"{name}: invalid shape {shape}: need one or more non-negative dimensions")
    block, type_size = BLOCK_LAYOUT[t]
    if shape[-1] % block:
        raise ConfigError(f"{name}: last dimension {shape[-1]} of shape {shape} is not a multiple of "
                          f"the {t.name} block size {block}")
    n_values = math.prod(shape)
    want = n_values // block * type_size
    if data.size != want:
        raise ConfigError(f"{name}: {t.name} tensor of shape {shape} needs {want} bytes "
                          f"({n_values // block} blocks of {type_size}), got {data.size} bytes")
    blocks = _as_blocks(data, type_size)
    return _run(t, blocks, n_values).reshape(shape)


def dequantize_rows(data: np.ndarray, qtype, n_cols: int, rows, *, name: str = "tensor") -> np.ndarray:
    """Dequantize selected rows of a GGML matrix (an embedding lookup).

    Args:
        data:   uint8 (n_rows, row_bytes) bytes of the matrix (GGUFTensor.data); any uint8 array whose
                byte count is a whole number of rows is accepted and read in C order.
        qtype:  GGMLType of the blocks.
        n_cols: values per row (the logical last dimension); a multiple of the block size.
        rows:   1-D integer array-like of row indices, each in [0, n_rows); repeats allowed.
        name:   used in error messages only.

    Returns:
        float32 (len(rows), n_cols), newly allocated.

    Raises:
        UnsupportedModelError: unsupported qtype.
        ConfigError: bad dtype, n_cols not a block multiple, byte count not a whole number of
            rows, non-integer or out-of-range row indices.
    """
    t = _check_type(qtype, name)
    data = _check_bytes(data, name)
    try:
        n_cols = int(n_cols)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: n_cols must be an int, got {n_cols!r}") from None
    rb = row_bytes(t, n_cols) if n_cols > 0 else None
    if rb is None:
        raise ConfigError(f"{name}: n_cols {n_cols} must be a positive multiple of the {t.name} "
                          f"block size {BLOCK_LAYOUT[t][0]}")
    if data.size % rb:
        raise ConfigError(f"{name}: {data.size} bytes is not a whole number of {t.name} rows of "
                          f"{n_cols} values ({rb} bytes each)")
    n_rows = data.size // rb
    idx = np.asarray(rows)
    if idx.ndim != 1:
        raise ConfigError(f"{name}: rows must be a 1-D array of row indices, got shape {idx.shape}")
    if idx.size and not np.issubdtype(idx.dtype, np.integer):
        raise ConfigError(f"{name}: rows must be integers, got dtype {idx.dtype}")
    if idx.size:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= n_rows:
            bad = lo if lo < 0 else hi
            raise ConfigError(f"{name}: row index {bad} out of range: the tensor has {n_rows} rows "
                              f"(valid 0..{n_rows - 1})")
    idx = idx.astype(np.intp, copy=False)
    matrix = data.reshape(n_rows, rb) if data.ndim != 2 or data.shape[1] != rb else data
    picked = matrix[idx]  # fancy indexing: a small C-contiguous copy of the quantized rows
    type_size = BLOCK_LAYOUT[t][1]
    out = _run(t, picked.reshape(-1, type_size), idx.size * n_cols)
    return out.reshape(idx.size, n_cols)
