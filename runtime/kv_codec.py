"""Row codecs of the KV store's element types (runtime/kv_types.py names them): Numba kernels, and
whole-array encode/decode for NumPy callers.

The kernels that read and write store rows use kv_row, kv_rows, encode_row and decode_row: Numba
overloads resolved by the row's dtype when a kernel is compiled for the store's arrays, so they take
no type argument and a float32 store compiles to the code it had before types existed.

Quantization follows llama.cpp's reference quantizers (ggml-quants.c quantize_row_q8_0_ref /
q4_0_ref), which gguf's NumPy quantizers also follow: q8_0 d = amax/127, q = round-half-away(x/d);
q4_0 d = m/-8 with m the value of largest magnitude (the first of ties), q = min(15, trunc(x/d +
8.5)); the multiplier 1/d is float32 and d is stored as f16. No fastmath in the encoders, stated
(fastmath=False) rather than left unset: Numba compiles a kernel that sets no fastmath with the flags
of the first kernel that calls it, so an encoder first reached from a fastmath writer would be
compiled, and cached, with them. A q8_0 row encodes to the same bytes as gguf.quants.quantize gives,
a q4_0 row to the bytes it gives for the block's rotation (kv_types), which tests check.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from ringllm.runtime.kv_types import (OFFSET_FROM, Q4_0_OUTLIERS, Q4_0_SIGNS, QBLOCK, STORE_DTYPE, check_kv_type,
                                     row_width, type_of)
from ringllm.runtime.numba_flags import FASTMATH
from ringllm.runtime.simd import (andf, ld_i8, ld_u8i, srlf, vadd, vbfly1, vbfly2, vbfly4, vload, vmul, vsplat,
                                 vstore, vsub)


# ---------------------------------------------------------------------------------------------
# Half precision (F16C's vcvtph2ps / vcvtps2ph where the CPU has them)
# ---------------------------------------------------------------------------------------------


@intrinsic
def f16_bits_to_f32(typingctx, bits):
    """float32 value of IEEE half bits (uint16)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return sig, codegen


@intrinsic
def f32_to_f16_bits(typingctx, x):
    """IEEE half bits (uint16) of a float32, rounded to nearest even (NumPy's astype(float16))."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return sig, codegen


@njit(cache=True, nogil=True, inline="always")
def block_scale(row, o):
    """The f16 scale of the block starting at element o of a q8_0 / q4_0 row (int8 / uint8), as float32."""
    bits = np.uint16(np.uint8(row[o])) | (np.uint16(np.uint8(row[o + 1])) << np.uint16(8))
    return f16_bits_to_f32(bits)


@njit(cache=True, nogil=True, inline="always")
def _put_scale(row, o, d, signed):
    bits = f32_to_f16_bits(d)
    lo, hi = bits & np.uint16(0xFF), bits >> np.uint16(8)
    if signed:
        row[o], row[o + 1] = np.int8(np.int32(lo) - 256 * (lo > 127)), np.int8(np.int32(hi) - 256 * (hi > 127))
    else:
        row[o], row[o + 1] = np.uint8(lo), np.uint8(hi)


@njit(cache=True, nogil=True, inline="always")
def _round_half_away(x):
    """roundf: to nearest, halves away from zero (exact in float32: gguf's np_roundf)."""
    a = abs(x)
    fl = np.floor(a)
    r = fl + np.floor(np.float32(2.0) * (a - fl))
    return r if x >= 0 else -r


# ---------------------------------------------------------------------------------------------
# Row encoders and decoders, one per type
# ---------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True, fastmath=False)
def _enc_f32(row, src):
    for d in range(row.shape[0]):
        row[d] = src[d]


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def _dec_f32(dst, row):
    for d in range(row.shape[0]):
        dst[d] = row[d]


@njit(cache=True, nogil=True, fastmath=False)
def _enc_f16(row, src):
    for d in range(row.shape[0]):
        row[d] = f32_to_f16_bits(src[d])


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def _dec_f16(dst, row):
    for d in range(row.shape[0]):
        dst[d] = f16_bits_to_f32(row[d])


@njit(cache=True, nogil=True, fastmath=False)
def _enc_q8_0(row, src):
    for b in range(row.shape[0] // (QBLOCK + 2)):
        x0 = b * QBLOCK
        amax = np.float32(0.0)
        for i in range(QBLOCK):
            amax = max(amax, abs(src[x0 + i]))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        o = b * (QBLOCK + 2)
        _put_scale(row, o, d, True)
        for i in range(QBLOCK):
            row[o + 2 + i] = np.int8(_round_half_away(src[x0 + i] * inv))


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def _dec_q8_0(dst, row):
    # eight lanes at a time through the simd.py intrinsics: written as a scalar loop, the stores into
    # dst keep LLVM from vectorizing (it cannot rule out that dst and row alias); the same products
    for b in range(row.shape[0] // (QBLOCK + 2)):
        o = b * (QBLOCK + 2)
        d = vsplat(block_scale(row, o))
        for c in range(QBLOCK // 8):
            vstore(dst, b * QBLOCK + 8 * c, vmul(ld_i8(row, o + 2 + 8 * c), d))


@njit(cache=True, nogil=True, fastmath=False)
def hadamard32(y):
    """y (32,) float32 in place -> H y, H the Walsh-Hadamard matrix of kv_types (Sylvester's order):
    butterflies of span 1, 2, 4, 8, 16 in that order, each pair (a, b) -> (a + b, a - b). The reference
    engine repeats the order, so the encoder's float32 sums are the same bits there."""
    for stage in range(5):
        h = 1 << stage
        for i in range(0, QBLOCK, 2 * h):
            for k in range(i, i + h):
                a, b = y[k], y[k + h]
                y[k], y[k + h] = a + b, a - b


F16_MAX = np.float32(65504.0)          # the largest finite float16


@njit(cache=True, nogil=True, fastmath=False)
def q4_0_outliers_at(row):
    """Offset into a q4_0 row of its outliers (kv_types): Q4_0_OUTLIERS f16 values (two bytes each,
    little endian) at this offset, then their channels, one byte each; a key's row holds them, a
    value's row (whole blocks only: its width a multiple of a block's 18 bytes) none, and the offset
    is its width. The outliers a row holds: (row.shape[0] - offset) // 3."""
    w = row.shape[0]
    return w - 3 * Q4_0_OUTLIERS if w % (QBLOCK // 2 + 2) else w


@njit(cache=True, nogil=True, fastmath=False)
def _put_outliers(row, src, hd, ou):
    # the Q4_0_OUTLIERS channels of the largest |src[:hd]| (largest first, the first of equal ones, NaN
    # last: NumPy's stable argsort of -|x|), each with its value clipped to f16's range, into the row
    # from ou on (q4_0_outliers_at); the channels already written are the ones taken
    for i in range(Q4_0_OUTLIERS):
        best, top = -1, np.float32(-1.0)
        for c in range(hd):
            a = abs(src[c])
            if a != a:                 # NaN ranks below every number, above nothing chosen yet
                a = np.float32(-0.5)
            if a > top:
                taken = False
                for m in range(i):
                    taken = taken or row[ou + 2 * Q4_0_OUTLIERS + m] == c
                if not taken:
                    best, top = c, a
        v = src[best]
        if v > F16_MAX:                # held as f16's largest, the rest in the blocks (NaN kept)
            v = F16_MAX
        elif v < -F16_MAX:
            v = -F16_MAX
        bits = f32_to_f16_bits(v)
        row[ou + 2 * i], row[ou + 2 * i + 1] = np.uint8(bits & np.uint16(0xFF)), np.uint8(bits >> np.uint16(8))
        row[ou + 2 * Q4_0_OUTLIERS + i] = np.uint8(best)


@njit(cache=True, nogil=True, fastmath=False)
def _enc_q4_0(row, src):
    # a key row's outliers u taken out and stored as f16 with their channels, then each block of the
    # rest (the values at those channels less u) rotated (kv_types: y = H (s * r)) and put through
    # llama.cpp's q4_0 quantizer; a value row has no outliers (r = x)
    half = QBLOCK // 2
    y = np.empty(QBLOCK, np.float32)
    ou = q4_0_outliers_at(row)
    n = (row.shape[0] - ou) // 3
    hd = ou // (half + 2) * QBLOCK
    if n:
        _put_outliers(row, src, hd, ou)
    for b in range(hd // QBLOCK):
        x0 = b * QBLOCK
        for i in range(QBLOCK):
            y[i] = src[x0 + i]
        for i in range(n):
            c, u = q4_0_outlier(row, ou, i)
            if c // QBLOCK == b:
                y[c - x0] = src[c] - u
        for i in range(QBLOCK):
            y[i] *= Q4_0_SIGNS[i]
        hadamard32(y)
        amax = np.float32(0.0)
        m = np.float32(0.0)
        for i in range(QBLOCK):
            a = abs(y[i])
            if a > amax:
                amax, m = a, y[i]
        d = m / np.float32(-8.0)
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        o = b * (half + 2)
        _put_scale(row, o, d, False)
        for i in range(half):
            lo = min(np.int32(15), np.int32(y[i] * inv + np.float32(8.5)))
            hi = min(np.int32(15), np.int32(y[half + i] * inv + np.float32(8.5)))
            row[o + 2 + i] = np.uint8(lo | (hi << 4))


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def q4_0_block_integers(row, o):
    """The integers q - 8 of the q4_0 block at element o of a row, as four f32x8: values 0-7 and 8-15
    (low nibbles of bytes 0-7, 8-15), 16-23 and 24-31 (their high nibbles)."""
    eight = vsplat(np.float32(8.0))
    qa, qb = ld_u8i(row, o + 2), ld_u8i(row, o + 10)
    return vsub(andf(qa, 15), eight), vsub(andf(qb, 15), eight), vsub(srlf(qa, 4), eight), vsub(srlf(qb, 4), eight)


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def hadamard32_vectors(a0, a1, a2, a3):
    """H (kv_types) applied to a block held as four f32x8 in value order: the butterflies of span 16
    and 8 pair whole vectors, those of span 4, 2 and 1 pair lanes (simd.vbfly4 / 2 / 1). Exact on
    integers, and each output one rounding per butterfly otherwise."""
    a0, a2 = vadd(a0, a2), vsub(a0, a2)
    a1, a3 = vadd(a1, a3), vsub(a1, a3)
    a0, a1 = vadd(a0, a1), vsub(a0, a1)
    a2, a3 = vadd(a2, a3), vsub(a2, a3)
    return (vbfly1(vbfly2(vbfly4(a0))), vbfly1(vbfly2(vbfly4(a1))), vbfly1(vbfly2(vbfly4(a2))),
            vbfly1(vbfly2(vbfly4(a3))))


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def q4_0_outlier(row, ou, i):
    """(channel, value as float32) of outlier i of a q4_0 row whose outliers start at ou."""
    bits = np.uint16(row[ou + 2 * i]) | (np.uint16(row[ou + 2 * i + 1]) << np.uint16(8))
    return np.int64(row[ou + 2 * Q4_0_OUTLIERS + i]), f16_bits_to_f32(bits)


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def _dec_q4_0(dst, row):
    # r = s * H (q - 8) * (d / 32) (kv_types): every step exact on these integers, so the values are
    # those of any order of H's sums (the reference engine's), to the sign of a zero; then x = r + u
    half = QBLOCK // 2
    s0, s1 = vload(Q4_0_SIGNS, 0), vload(Q4_0_SIGNS, 8)
    s2, s3 = vload(Q4_0_SIGNS, 16), vload(Q4_0_SIGNS, 24)
    ou = q4_0_outliers_at(row)
    for b in range(ou // (half + 2)):
        o = b * (half + 2)
        a0, a1, a2, a3 = q4_0_block_integers(row, o)
        a0, a1, a2, a3 = hadamard32_vectors(a0, a1, a2, a3)
        d = vsplat(block_scale(row, o) * np.float32(1.0 / QBLOCK))
        x0 = b * QBLOCK
        vstore(dst, x0, vmul(a0, vmul(d, s0)))
        vstore(dst, x0 + 8, vmul(a1, vmul(d, s1)))
        vstore(dst, x0 + 16, vmul(a2, vmul(d, s2)))
        vstore(dst, x0 + 24, vmul(a3, vmul(d, s3)))
    for i in range((row.shape[0] - ou) // 3):
        c, u = q4_0_outlier(row, ou, i)
        dst[c] += u


# the encoders are not inlined into their callers' IR: a caller compiled with fastmath would let LLVM
# rewrite amax / 127 as a product and change a scale's last bit
_CODECS = {types.float32: (_enc_f32, _dec_f32), types.uint16: (_enc_f16, _dec_f16),
           types.int8: (_enc_q8_0, _dec_q8_0), types.uint8: (_enc_q4_0, _dec_q4_0)}


def _codec(row_type, which: int):
    dtype = getattr(row_type, "dtype", None)
    if dtype not in _CODECS:
        raise TypeError(f"no KV type stores rows of {dtype}")
    return _CODECS[dtype][which]


# ---------------------------------------------------------------------------------------------
# The kernels' interface (overloads: resolved by the row's dtype when a kernel compiles)
# ---------------------------------------------------------------------------------------------


def encode_row(row, src):
    """row (width,) of a store array = src[:hd] float32 encoded in the row's type. Every codec counts
    the values from the row's width (src and dst may be longer scratch: never read or written past hd)."""
    _encode_rows(row.reshape(1, -1), np.asarray(src, np.float32).reshape(1, -1))


def decode_row(dst, row):
    """dst[:hd] float32 = the values row (width,) holds."""
    _decode_rows(dst.reshape(1, -1), row.reshape(1, -1))


def kv_row(arr, h, j, buf):
    """Row j of head h of a store array (n_kv, P, width) as float32 (hd,) values: the row itself
    for f32 (no copy), else decoded into buf (hd,) f32, which is returned."""
    if arr.dtype == np.float32:
        return arr[h, j]
    decode_row(buf, arr[h, j])
    return buf


def key_row(arr, off, seq_l, h, j, buf):
    """kv_row for a key array whose rows hold k - c (kv_types: key offsets; off (n_kv, hd) f32 holds
    c, seq_l (n_kv, P) i64 the slots' sequence indices): a q4_0 row decoded into buf (hd,) f32, off[h]
    added unless the slot holds one of the first OFFSET_FROM tokens (their rows hold their keys), buf
    returned; any other type is kv_row's (its rows hold the keys themselves; off and seq_l unread)."""
    if arr.dtype == np.uint8:
        decode_row(buf, arr[h, j])
        if seq_l[h, j] >= OFFSET_FROM:
            buf[:off.shape[1]] += off[h]
        return buf
    return kv_row(arr, h, j, buf)


def kv_rows(arr, h, j0, n, buf):
    """Rows j0 .. j0 + n - 1 of head h of a store array as float32 (n, hd): the rows themselves for
    f32, else decoded into buf (>= n, hd) f32 and returned as buf[:n]."""
    if arr.dtype == np.float32:
        return arr[h, j0:j0 + n]
    _decode_rows(buf[:n], arr[h, j0:j0 + n])
    return buf[:n]


@overload(encode_row, inline="always")
def _ov_encode_row(row, src):
    enc = _codec(row, 0)

    def impl(row, src):
        enc(row, src)
    return impl


@overload(decode_row, inline="always")
def _ov_decode_row(dst, row):
    dec = _codec(row, 1)

    def impl(dst, row):
        dec(dst, row)
    return impl


@overload(kv_row, inline="always")
def _ov_kv_row(arr, h, j, buf):
    if arr.dtype == types.float32:
        def impl_f32(arr, h, j, buf):
            return arr[h, j]
        return impl_f32
    dec = _codec(arr, 1)

    def impl(arr, h, j, buf):
        dec(buf, arr[h, j])
        return buf
    return impl


@overload(key_row, inline="always")
def _ov_key_row(arr, off, seq_l, h, j, buf):
    if arr.dtype != types.uint8:
        def impl_plain(arr, off, seq_l, h, j, buf):
            return kv_row(arr, h, j, buf)
        return impl_plain
    dec = _codec(arr, 1)

    def impl(arr, off, seq_l, h, j, buf):
        dec(buf, arr[h, j])
        if seq_l[h, j] >= OFFSET_FROM:
            for d in range(off.shape[1]):
                buf[d] += off[h, d]
        return buf
    return impl


@overload(kv_rows, inline="always")
def _ov_kv_rows(arr, h, j0, n, buf):
    if arr.dtype == types.float32:
        def impl_f32(arr, h, j0, n, buf):
            return arr[h, j0:j0 + n]
        return impl_f32
    dec = _codec(arr, 1)

    def impl(arr, h, j0, n, buf):
        for r in range(n):
            dec(buf[r], arr[h, j0 + r])
        return buf[:n]
    return impl


@njit(cache=True, nogil=True, fastmath=False)
def _encode_rows(rows, src):
    for r in range(src.shape[0]):
        encode_row(rows[r], src[r])


@njit(cache=True, nogil=True, fastmath=False)
def _decode_rows(dst, rows):
    for r in range(dst.shape[0]):
        decode_row(dst[r], rows[r])


# ---------------------------------------------------------------------------------------------
# Whole arrays (NumPy callers: a press's rebuild, type conversion of a saved store, tests)
# ---------------------------------------------------------------------------------------------


def encode(x: np.ndarray, name: str, key: bool = False) -> np.ndarray:
    """x (..., hd) float32 -> (..., row_width) in the store dtype of type `name` (keys' rows when key:
    kv_types.row_width)."""
    check_kv_type(name, "KV type", x.shape[-1])
    x = np.ascontiguousarray(x, dtype=np.float32)
    flat = x.reshape(-1, x.shape[-1])
    out = np.empty((flat.shape[0], row_width(name, x.shape[-1], key)), STORE_DTYPE[name])
    if flat.shape[0]:
        _encode_rows(out, flat)
    return out.reshape(x.shape[:-1] + (out.shape[1],))


def decode(a: np.ndarray, head_dim: int) -> np.ndarray:
    """A store array (..., row_width) -> its values (..., head_dim) float32."""
    a = np.ascontiguousarray(a)
    type_of(a)
    flat = a.reshape(-1, a.shape[-1])
    out = np.empty((flat.shape[0], head_dim), np.float32)
    if flat.shape[0]:
        _decode_rows(out, flat)
    return out.reshape(a.shape[:-1] + (head_dim,))


def round_trip(x: np.ndarray, name: str, key: bool = False) -> np.ndarray:
    """x (..., hd) float32 as a store of type `name` gives it back (encode then decode; keys' rows
    when key)."""
    return decode(encode(x, name, key), x.shape[-1])
