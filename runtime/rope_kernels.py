"""RoPE kernels: rotation of rows by computed angles or table rows, key re-rotation, and the
K-shift strategy's write (runtime/rope.py has the tables and the strategies that use them).

RoPE is rotate-half over the first `rotary_dim` dims: halves (a, b) -> (a cos - b sin, b cos + a sin)
with angle pos/scale * base^(-2i/rotary_dim) (Su et al., RoFormer eq. 34, HF layout). Angles are
computed in float64 and rounded to float32, as the tables are.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ringllm.runtime.eviction import ring_slot
from ringllm.runtime.kv_codec import encode_row, kv_row
from ringllm.runtime.numba_flags import FASTMATH

# "rebased" policy layers: the largest offset (kbase - pos) a stored key may have before it is
# re-rotated to its position; the attention kernel rotates the query once per offset in use
REBASE_LIMIT = 16

# ---------------------------------------------------------------------------------------------
# Rotation kernels
# ---------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def angles_at(cs, sn, p, inv_freq, inv_scale):
    """cs, sn (rotary_dim/2,) f32 = cos, sin of p/scale * inv_freq, computed in float64 (any p, no table)."""
    pf = p * inv_scale
    for i in range(cs.shape[0]):
        ang = pf * inv_freq[i]
        cs[i] = np.cos(ang)
        sn[i] = np.sin(ang)


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def rotate_with(dst, src, cs, sn, rotary_dim):
    """dst (hd,) = src (hd,) rotated by the angles cs, sn (rotary_dim/2,); dims past rotary_dim are copied."""
    half = rotary_dim // 2
    for i in range(half):
        a = src[i]
        b = src[i + half]
        dst[i] = a * cs[i] - b * sn[i]
        dst[i + half] = b * cs[i] + a * sn[i]
    for i in range(rotary_dim, src.shape[0]):
        dst[i] = src[i]


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def rotate_into(dst, src, p, cos, sin, rotary_dim):
    """dst (hd,) = RoPE(src (hd,)) at table row p; dims past rotary_dim are copied."""
    rotate_with(dst, src, cos[p], sin[p], rotary_dim)


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def rotate_by_table(dst, src, delta, cos, sin, rotary_dim):
    """dst (hd,) = src rotated by `delta` positions (either sign) with table rows |delta|; dst may
    be src. Dims past rotary_dim: copied."""
    half = rotary_dim // 2
    a = delta if delta >= 0 else -delta
    sg = np.float32(1.0) if delta >= 0 else np.float32(-1.0)
    for i in range(half):
        c, sn = cos[a, i], sg * sin[a, i]
        x, y = src[i], src[i + half]
        dst[i] = x * c - y * sn
        dst[i + half] = y * c + x * sn
    for i in range(rotary_dim, src.shape[0]):
        dst[i] = src[i]


@njit(cache=True, nogil=True, fastmath=False)
def rope_rows_at(x, p, inv_freq, inv_scale, rotary_dim, tmp):
    """x (R, hd) rotated in place at position p (the key of one token, all kv heads).

    tmp (hd + rotary_dim,) f32 scratch: the rotated row, then cos and sin (computed once for all rows)."""
    hd = x.shape[1]
    half = rotary_dim // 2
    cs = tmp[hd:hd + half]
    sn = tmp[hd + half:hd + rotary_dim]
    angles_at(cs, sn, p, inv_freq, inv_scale)
    row = tmp[:hd]
    for r in range(x.shape[0]):
        rotate_with(row, x[r], cs, sn, rotary_dim)
        for d in range(hd):
            x[r, d] = row[d]


@njit(cache=True, nogil=True, inline="always")
def rotate_key_by(k_l, h, j, delta, have, angles, inv_freq, inv_scale, rotary_dim, tmp):
    """Key j of head h rotated in place by `delta` positions; angles (2, rotary_dim/2) caches the
    cos/sin of the delta in have[0] (recomputed only when the delta changes). tmp (hd,) f32 scratch.
    A quantized key is decoded, rotated and encoded again (kv_types.py)."""
    if delta != have[0]:
        angles_at(angles[0], angles[1], delta, inv_freq, inv_scale)
        have[0] = delta
    rotate_with(tmp, kv_row(k_l, h, j, tmp), angles[0], angles[1], rotary_dim)
    encode_row(k_l[h, j], tmp)


@njit(cache=True, nogil=True, fastmath=False)
def rotate_keys_to(k_l, kbase_l, target_l, count_l, inv_freq, inv_scale, rotary_dim, angles, angle_tag, tmp):
    """Every held key, stored rotated at kbase, re-rotated to target_l (n_kv, P) i64; kbase = target.
    Converts a layer between RoPE layouts: keys before RoPE are keys rotated at 0."""
    angle_tag[0] = np.int64(-1) << 62
    for h in range(k_l.shape[0]):
        for j in range(count_l[h]):
            if target_l[h, j] != kbase_l[h, j]:
                rotate_key_by(k_l, h, j, target_l[h, j] - kbase_l[h, j], angle_tag, angles, inv_freq, inv_scale,
                              rotary_dim, tmp)
                kbase_l[h, j] = target_l[h, j]


@njit(cache=True, nogil=True, fastmath=False)
def rk_write(rk_l, k_l, seq_l, count_l, seq_new, rotary_dim):
    """rk_l[h, slot] = rotate_half(k_l[h, slot]) over the rotary dims, for the slot holding seq_new."""
    half = rotary_dim // 2
    for h in range(seq_l.shape[0]):
        for j in range(seq_l.shape[1]):
            if seq_l[h, j] == seq_new:
                for i in range(half):
                    rk_l[h, j, i] = -k_l[h, j, i + half]
                    rk_l[h, j, i + half] = k_l[h, j, i]
                break


# ---------------------------------------------------------------------------------------------
# K-shift write
# ---------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True, fastmath=False)
def kv_write_kshift(k_l, v_l, seq_l, pos_l, count_l, evicted_l, k_new, v_new, seq_new, sinks, reindexed, inv_freq,
                    inv_scale, rotary_dim, back, angles, tmp):
    """kv_store.kv_write_streaming for keys stored rotated at their logical position: in reindexed
    mode an eviction moves every newer token down one position, so its stored key is re-rotated by
    -1 in place (back (2, rotary_dim/2) f32: cos, sin of -inv_freq/scale). The new key k_new
    (pre-RoPE) is rotated at its position as it is written. angles (2, rotary_dim/2) f32 and tmp
    (hd,) f32 are scratch. A quantized key is re-rotated as llama.cpp's K-shift does it on a
    quantized cache: decoded, rotated, encoded again (each re-rotation rounds it once more)."""
    n_kv, cap = seq_l.shape
    have = np.int64(-1)
    for h in range(n_kv):
        slot, pos_new, victim_seq = ring_slot(seq_l, count_l, evicted_l, h, sinks, reindexed, seq_new)
        if reindexed and victim_seq >= 0:       # newer tokens move down one position: re-rotate by -1
            for j in range(cap):
                if seq_l[h, j] > victim_seq:
                    pos_l[h, j] -= 1
                    rotate_with(tmp, kv_row(k_l, h, j, tmp), back[0], back[1], rotary_dim)
                    encode_row(k_l[h, j], tmp)
        if pos_new != have:
            angles_at(angles[0], angles[1], pos_new, inv_freq, inv_scale)
            have = pos_new
        rotate_with(tmp, k_new[h], angles[0], angles[1], rotary_dim)
        seq_l[h, slot] = seq_new
        pos_l[h, slot] = pos_new
        encode_row(k_l[h, slot], tmp)
        encode_row(v_l[h, slot], v_new[h])
