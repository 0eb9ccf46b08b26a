"""The basis the stored-layout attention (stored_attention.py) reads a layer's rows in: the values
themselves for f32, f16 and q8_0; for q4_0 the blocks' coefficients before the rotation back.

A q4_0 row holds per block of 32 the quantized rotation of its values (kv_types): x = s * H z with
z = (q - 8) d / 32, H the symmetric Walsh-Hadamard matrix and s the fixed signs, plus, in a key
row, its outliers, each a value u at a channel c, which the basis holds as u s_c H[:, c] / 32 added
to c's block (OUTLIER_BASIS), so z is the whole row's coefficients. A score and a weighted sum of values need no
row rotated back:

    q . x = q . (s * H z) = (H (s * q)) . z          sum_j e_j x_j = s * H (sum_j e_j z_j)

so the attention takes each query into the key basis once (to_key_basis), reads every key and value
row as its coefficients z (decode_row_basis: the decoder without its transform, as cheap as
llama.cpp's q4_0), and takes each weighted value sum back (from_value_basis): a transform per query
head and unit instead of one per row. For the other types all three are the plain decode and
nothing.

    decode_row_basis(dst, row)       dst[:hd] = the row in its basis, float32
    kv_row_basis(arr, h, j, buf)     row j of head h of a store array in its basis (f32: in place)
    to_key_basis(qw, h0, group, k_l)      qw[h0 + g] (hd,) taken into k_l's key basis, in place
    from_value_basis(ow, h0, group, v_l)  ow[h0 + g] (hd,), a sum of v_l's rows in its basis, back
                                          to values, in place
    group_scores_row_basis(scores, qw, k_l, h, j, h0, group, buf)
        kv_row_math.group_scores_row with qw in k_l's key basis

Numba overloads resolved by the store array's (or row's) dtype when the calling kernel compiles; the
Python functions are the same arithmetic in NumPy (decode_basis: whole arrays).
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from ringllm.runtime.kv_codec import (block_scale, decode, decode_row, hadamard32_vectors, q4_0_block_integers,
                                     q4_0_outlier, q4_0_outliers_at)
from ringllm.runtime.kv_row_math import group_scores, group_scores_row
from ringllm.runtime.kv_types import Q4_0_SIGNS, QBLOCK
from ringllm.runtime.numba_flags import FASTMATH
from ringllm.runtime.simd import vload, vmul, vsplat, vstore, zadd, zload, zmul, zsplat, zstore

_Q4_BYTES = QBLOCK // 2 + 2      # block_q4_0: f16 scale, 16 bytes of nibbles
_H32 = np.ones((1, 1), np.float32)   # H of kv_types (Sylvester's recursion; symmetric), for the NumPy functions
while _H32.shape[0] < QBLOCK:
    _H32 = np.block([[_H32, _H32], [_H32, -_H32]])
# row l: the coefficients of a unit value at channel l of a block, s_l H[l, :] / 32 (exact in float32):
# s * H (s_l H[:, l] / 32) = e_l, so an outlier u at channel l adds u times this row to its block's
OUTLIER_BASIS = np.ascontiguousarray(_H32 * Q4_0_SIGNS[:, None] / np.float32(QBLOCK), np.float32).reshape(-1)


def decode_basis(a: np.ndarray, head_dim: int) -> np.ndarray:
    """A store array (..., row_width) -> its rows in their basis (..., head_dim) float32 (NumPy)."""
    a = np.ascontiguousarray(a)
    if a.dtype != np.uint8:
        return decode(a, head_dim)
    flat = a.reshape(-1, a.shape[-1])
    nb = head_dim // QBLOCK
    blocks = flat[:, :nb * _Q4_BYTES].reshape(-1, _Q4_BYTES)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32) * np.float32(1.0 / QBLOCK)
    nib = blocks[:, 2:].astype(np.int32)
    q = np.concatenate([nib & 15, nib >> 4], axis=1).astype(np.float32) - np.float32(8.0)
    z = (q * d).reshape(-1, head_dim)
    n = (flat.shape[1] - nb * _Q4_BYTES) // 3                   # a key row's outliers; a value row has none
    u = flat[:, nb * _Q4_BYTES:nb * _Q4_BYTES + 2 * n].copy().view(np.float16).astype(np.float32)
    chans = flat[:, nb * _Q4_BYTES + 2 * n:].astype(np.int64)
    table, rows = OUTLIER_BASIS.reshape(QBLOCK, QBLOCK), np.arange(z.shape[0])[:, None]
    for i in range(n):                 # one channel a row per pass: no index repeats in a pass
        c = chans[:, i]
        z[rows, (c // QBLOCK * QBLOCK)[:, None] + np.arange(QBLOCK)] += u[:, i, None] * table[c % QBLOCK]
    return z.reshape(a.shape[:-1] + (head_dim,))


def _signed_hadamard_np(v: np.ndarray, signs_first: bool) -> np.ndarray:
    blocks = v.reshape(-1, QBLOCK).astype(np.float32)
    if signs_first:
        blocks = blocks * Q4_0_SIGNS
    blocks = (blocks @ _H32).astype(np.float32)
    if not signs_first:
        blocks = blocks * Q4_0_SIGNS
    return blocks.reshape(v.shape)


def rotate_back(z: np.ndarray) -> np.ndarray:
    """Coefficients z (..., hd) float32 -> the values s * H z they stand for, per block of 32 (NumPy)."""
    return _signed_hadamard_np(np.ascontiguousarray(z, np.float32), False)


def decode_row_basis(dst, row):
    """dst[:hd] float32 = the row in its type's basis (module docstring)."""
    dst[:] = decode_basis(row[None, :], dst.shape[0])[0]


def kv_row_basis(arr, h, j, buf):
    """Row j of head h of a store array in its basis: the row itself for f32, else decoded into buf."""
    if arr.dtype == np.float32:
        return arr[h, j]
    decode_row_basis(buf, arr[h, j])
    return buf


def to_key_basis(qw, h0, group, k_l):
    """qw[h0:h0 + group] (each (hd,) f32) taken into the key basis of store array k_l, in place."""
    if k_l.dtype == np.uint8:
        qw[h0:h0 + group] = _signed_hadamard_np(qw[h0:h0 + group], True)


def from_value_basis(ow, h0, group, v_l):
    """ow[h0:h0 + group] (sums of v_l's rows in their basis) back to values, in place."""
    if v_l.dtype == np.uint8:
        ow[h0:h0 + group] = _signed_hadamard_np(ow[h0:h0 + group], False)


def group_scores_row_basis(scores, qw, k_l, h, j, h0, group, buf):
    """scores[h0 + g, j] = qw[h0 + g] . (key j of head h in its basis) for g < group."""
    scores[h0:h0 + group, j] = qw[h0:h0 + group] @ kv_row_basis(k_l, h, j, buf)


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def _coefficients_q4_0(dst, row):
    # z = (q - 8) d / 32 per block: _dec_q4_0 without the rotation; then each outlier u at channel c
    # adds u OUTLIER_BASIS[c % 32] to its block (a product, then a sum: NumPy's decode_basis's order)
    ou = q4_0_outliers_at(row)
    for b in range(ou // _Q4_BYTES):
        o = b * _Q4_BYTES
        a0, a1, a2, a3 = q4_0_block_integers(row, o)
        d = vsplat(block_scale(row, o) * np.float32(1.0 / QBLOCK))
        x0 = b * QBLOCK
        vstore(dst, x0, vmul(a0, d))
        vstore(dst, x0 + 8, vmul(a1, d))
        vstore(dst, x0 + 16, vmul(a2, d))
        vstore(dst, x0 + 24, vmul(a3, d))
    for i in range((row.shape[0] - ou) // 3):         # a key row's outliers (a value row has none)
        c, v = q4_0_outlier(row, ou, i)
        u = zsplat(v)
        x0, t0 = c // QBLOCK * QBLOCK, c % QBLOCK * QBLOCK
        zstore(dst, x0, zadd(zload(dst, x0), zmul(u, zload(OUTLIER_BASIS, t0))))
        zstore(dst, x0 + 16, zadd(zload(dst, x0 + 16), zmul(u, zload(OUTLIER_BASIS, t0 + 16))))


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def _signed_hadamard(v, signs_first):
    """v (hd,) f32 in place, per block of 32: H (s * v) when signs_first, else s * H v."""
    s0, s1 = vload(Q4_0_SIGNS, 0), vload(Q4_0_SIGNS, 8)
    s2, s3 = vload(Q4_0_SIGNS, 16), vload(Q4_0_SIGNS, 24)
    for x0 in range(0, v.shape[0], QBLOCK):
        a0, a1 = vload(v, x0), vload(v, x0 + 8)
        a2, a3 = vload(v, x0 + 16), vload(v, x0 + 24)
        if signs_first:
            a0, a1, a2, a3 = vmul(a0, s0), vmul(a1, s1), vmul(a2, s2), vmul(a3, s3)
        a0, a1, a2, a3 = hadamard32_vectors(a0, a1, a2, a3)
        if not signs_first:
            a0, a1, a2, a3 = vmul(a0, s0), vmul(a1, s1), vmul(a2, s2), vmul(a3, s3)
        vstore(v, x0, a0)
        vstore(v, x0 + 8, a1)
        vstore(v, x0 + 16, a2)
        vstore(v, x0 + 24, a3)


@overload(decode_row_basis, inline="always")
def _ov_decode_row_basis(dst, row):
    if row.dtype == types.uint8:
        def impl_q4_0(dst, row):
            _coefficients_q4_0(dst, row)
        return impl_q4_0

    def impl(dst, row):
        decode_row(dst, row)
    return impl


@overload(kv_row_basis, inline="always")
def _ov_kv_row_basis(arr, h, j, buf):
    if arr.dtype == types.float32:
        def impl_f32(arr, h, j, buf):
            return arr[h, j]
        return impl_f32

    def impl(arr, h, j, buf):
        decode_row_basis(buf, arr[h, j])
        return buf
    return impl


@overload(to_key_basis, inline="always")
def _ov_to_key_basis(qw, h0, group, k_l):
    if k_l.dtype == types.uint8:
        def impl_q4_0(qw, h0, group, k_l):
            for g in range(group):
                _signed_hadamard(qw[h0 + g], True)
        return impl_q4_0

    def impl(qw, h0, group, k_l):
        pass
    return impl


@overload(from_value_basis, inline="always")
def _ov_from_value_basis(ow, h0, group, v_l):
    if v_l.dtype == types.uint8:
        def impl_q4_0(ow, h0, group, v_l):
            for g in range(group):
                _signed_hadamard(ow[h0 + g], False)
        return impl_q4_0

    def impl(ow, h0, group, v_l):
        pass
    return impl


@overload(group_scores_row_basis, inline="always")
def _ov_group_scores_row_basis(scores, qw, k_l, h, j, h0, group, buf):
    if k_l.dtype == types.uint8:
        def impl_q4_0(scores, qw, k_l, h, j, h0, group, buf):
            group_scores(scores, qw, kv_row_basis(k_l, h, j, buf), h0, group, j)
        return impl_q4_0

    def impl(scores, qw, k_l, h, j, h0, group, buf):
        group_scores_row(scores, qw, k_l, h, j, h0, group, buf)
    return impl
