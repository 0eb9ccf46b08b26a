"""The attention step of one token over one layer of the in-place KV store, per RoPE layout.

One call per layer per token. GQA without repeated K/V: each key is read once per kv head and
shared by the query heads of its group. Softmax is two-pass over the scores of the occupied slots,
in float32; the per-slot attention mass (summed over the group) is written when a policy asks.
Keys are laid out by the layer's RoPE strategy (runtime/rope.py), and each layout has its kernel:

    attend           keys before RoPE ("fused"): each rotated by its slot's logical position as read
    (attend_stored   keys rotated at a reference position, the "stored" and "kshift" layouts: its own
                     module, runtime/stored_attention.py, splits the slots over the threads)
    attend_rebased   keys rotated at a per-slot base position kept near the slot's ("rebased",
                     policy layers): the query is rotated once per offset in use
    attend_rk        keys before RoPE with rotate_half(k) cached beside them ("rk", EQUIP)

Argument order: destination first, then the query, the layer's store arrays, positions, tables,
scale, scratch, and the mass output.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ringllm.runtime.fast_exp import exp_f32
from ringllm.runtime.kv_codec import encode_row, key_row, kv_row
from ringllm.runtime.kv_row_math import accumulate_row, accumulate_rows4, group_scores
from ringllm.runtime.numba_flags import FASTMATH
from ringllm.runtime.rope_kernels import rotate_by_table, rotate_into
from ringllm.runtime.simd import vadd, vhmax, vhsum, vload, vmax, vzero

_F32_TINY = np.float32(1.1754944e-38)      # smallest normal float32


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def exp_shifted(sc, n):
    """sc[:n] (f32) -> exp(sc - m), in place, m = max(sc[:n]); returns (m, sum of the exponentials).
    Never subnormal: exp_f32 clamps its argument at -87.3."""
    m = row_max(sc, n)
    for j in range(n):
        sc[j] = exp_f32(sc[j] - m)
    return m, sum_in_order(sc, n)


@njit(cache=True, nogil=True, inline="always")
def row_max(x, n):
    """max(x[:n]) (f32, contiguous, n >= 1): eight lanes at a time (simd.vmax), the last eight
    elements loaded overlapping the rest, then the lanes. A plain `max` loop stays scalar, one
    maxss waiting on the last (LLVM keeps Python's comparison order), which in the attention step
    cost as much as a tenth of the whole pass over a long layer's scores. The maximum is the same
    value in any order (a NaN score makes the softmax NaN either way)."""
    if n < 8:
        m = x[0]
        for j in range(1, n):
            m = max(m, x[j])
        return m
    a = vload(x, 0)
    j = 8
    while j + 8 <= n:
        a = vmax(a, vload(x, j))
        j += 8
    if j < n:
        a = vmax(a, vload(x, n - 8))
    return vhmax(a)


@njit(cache=True, nogil=True, fastmath=False)
def sum_in_order(x, n):
    """Sum of x[:n] (f32, contiguous) in one order whatever the caller: four eight-lane accumulators take
    x[32 i + 8 a : 32 i + 8 a + 8] in turn, the chunks of eight left after them go to the first, the
    accumulators are added (a0 + a1) + (a2 + a3), the lanes 0 to 7 in turn, then x[n - n % 8:n] one by one.

    Why not a plain loop under fastmath: LLVM vectorizes such a sum as it sees fit for the code around
    it: the same kernel linked into different callers (attend_stored alone and over the threads, a
    batched step) can get different widths, hence different last bits of the softmax's denominator, on
    some CPUs. Compiled with fastmath=False, stated (a kernel that leaves fastmath unset takes its first
    caller's flags), and called, not inlined by Numba, so no reassociation flag reaches these
    additions wherever LLVM inlines them."""
    a0 = a1 = a2 = a3 = vzero()
    j = 0
    while j + 32 <= n:
        a0 = vadd(a0, vload(x, j))
        a1 = vadd(a1, vload(x, j + 8))
        a2 = vadd(a2, vload(x, j + 16))
        a3 = vadd(a3, vload(x, j + 24))
        j += 32
    while j + 8 <= n:
        a0 = vadd(a0, vload(x, j))
        j += 8
    total = vhsum(vadd(vadd(a0, a1), vadd(a2, a3)))
    while j < n:
        total += x[j]
        j += 1
    return total


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def softmax_inplace(sc, n):
    """sc[:n] (f32) -> its softmax, in place (max-subtracted, float32)."""
    _, total = exp_shifted(sc, n)
    inv = np.float32(1.0) / total
    for j in range(n):
        w = sc[j] * inv
        sc[j] = w if w >= _F32_TINY else np.float32(0.0)   # no subnormal weights: they slow every op that reads them


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def cap_scores(sc, n, softcap):
    """sc[:n] -> softcap * tanh(sc / softcap) when softcap > 0 (Gemma 2's attention logit soft-capping,
    applied to the scaled scores before the softmax); untouched when softcap is 0."""
    if softcap > 0:
        inv = np.float32(1.0) / softcap
        for j in range(n):
            sc[j] = softcap * np.tanh(sc[j] * inv)


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def scale_group(qrot, h0, group, scale):
    """qrot[h0:h0+group] *= scale (the group's rotated queries take the score multiplier once)."""
    for g in range(group):
        for d in range(qrot.shape[1]):
            qrot[h0 + g, d] *= scale


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def _softmax_weighted_v(out, scores, v_l, mass, h, n, group, softcap, vb):
    """For the query heads of kv head h: softmax over scores[hq, :n] (in place, becoming the weights),
    out[hq] = weights @ v_l[h, :n]; mass[h, :n] = weights summed over the group when mass is wanted.
    softcap > 0 soft-caps the scores first (cap_scores). v_l in any KV type: the rows are read four
    at a time, once for the whole group, and each query head's sum runs over them in slot order
    (kv_row_math.accumulate_rows4; vb (4, hd) f32 scratch for f16 rows)."""
    hd = out.shape[1]
    h0 = h * group
    for g in range(group):
        sc = scores[h0 + g]
        cap_scores(sc, n, softcap)
        softmax_inplace(sc, n)
        o = out[h0 + g]
        for d in range(hd):
            o[d] = 0.0
    j = 0
    while j + 4 <= n:                  # four rows per pass over o: a quarter of the loads/stores of o
        accumulate_rows4(out, scores, v_l, h, j, h0, group, vb)
        j += 4
    while j < n:
        accumulate_row(out, scores, v_l, h, j, h0, group, vb)
        j += 1
    if mass.shape[0] > 0:
        for j in range(n):
            acc = np.float32(0.0)
            for g in range(group):
                acc += scores[h0 + g, j]
            mass[h, j] = acc


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def attend(out, q, k_l, koff, seq_l, v_l, pos_l, count_l, q_pos, cos, sin, rotary_dim, scale, softcap, scores, krot,
           qrot, mass):
    """Attention of one token over the occupied slots of one layer.

    out (n_head, hd) f32: result.         q (n_head, hd) f32: queries before RoPE.
    k_l, v_l (n_kv, cap, width) in the store's KV types (kv_types.py; f32: width = hd); koff (n_kv, hd)
        f32 the layer's key offsets and seq_l (n_kv, cap) i64 its sequence indices (kv_codec.key_row: the
        offsets are added to q4_0 keys as they are read); pos_l
        (n_kv, cap) i64; count_l (n_kv,) i64: the layer's store.
    q_pos (n_kv,) i64: the query's logical position per kv head (heads may hold different numbers
        of tokens under per-head budgets, and in reindexed mode the query sits at count - 1).
    cos, sin (n_pos, rotary_dim/2) f32: RopeTable.
    scale: score multiplier (1/sqrt(hd) or the model's); softcap: attention soft-cap (0 = none, cap_scores).
    scratch: scores (n_head, cap) f32, krot (hd,) f32, qrot (n_head, hd) f32.
    mass (n_kv, cap) f32: per-slot attention mass summed over the group's query heads, written
        when mass.shape[0] > 0 (policies that score by attention), else untouched.
    """
    n_head, hd = q.shape
    n_kv = k_l.shape[0]
    group = n_head // n_kv
    vb = np.empty((4, hd), np.float32)
    for h in range(n_kv):
        n = count_l[h]
        h0 = h * group
        for g in range(group):
            rotate_into(qrot[h0 + g], q[h0 + g], q_pos[h], cos, sin, rotary_dim)
        scale_group(qrot, h0, group, scale)
        for j in range(n):
            rotate_into(krot, key_row(k_l, koff, seq_l, h, j, krot), pos_l[h, j], cos, sin, rotary_dim)
            group_scores(scores, qrot, krot, h0, group, j)
        _softmax_weighted_v(out, scores, v_l, mass, h, n, group, softcap, vb)


# ---------------------------------------------------------------------------------------------
# Rebased keys (policy layers): keys rotated at a per-slot base position, query rotated per offset
# ---------------------------------------------------------------------------------------------
#
# Under a scoring policy the victims fall anywhere, so in reindexed mode the offsets seq - pos of
# the stored strategy take as many values as there were evictions. Instead each key is stored
# rotated at kbase, its logical position when written or last re-rotated, and the offset kbase - pos
# is kept in [0, R) by re-rotating the few keys that reach R in the attention pass that reads them.
# The score of key j is (R(q_pos) q) . (R(pos_j) k_j) = (R(q_pos + off_j) q) . (R(kbase_j) k_j):
# the query is rotated once per offset in use (at most R per kv head), no key is rotated at read.


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def attend_rebased(out, q, k_l, v_l, pos_l, kbase_l, count_l, q_pos, cos, sin, rotary_dim, scale, softcap, scores, qvar,
                   have, mass, offs):
    """attend() for keys stored rotated at kbase_l (n_kv, cap) i64 (see the section comment).

    cos, sin: RopeTable rows covering q_pos + qvar.shape[0]; qvar (R, n_head, hd) f32 scratch: the
    query rotated at q_pos + off for each offset off in [0, R) met; have (R,) i64 and offs (cap,)
    i64 scratch. Per kv head: one pass reads the offsets, the queries of the offsets in use are
    rotated, then the scores are plain dot products (no branch in the key loop). A key whose offset
    left [0, R) (the evictions of the write before this pass moved it down) is re-rotated to its
    position in the store (kbase = pos) here, where it is read anyway: the write kernel
    (kv_store.kv_write_policy) leaves these re-rotations to this pass. So the store is written:
    a key's values change (the same key at another base), never what attention sees. Other
    arguments as in attend().
    """
    n_head, hd = q.shape
    n_kv = k_l.shape[0]
    group = n_head // n_kv
    n_var = qvar.shape[0]
    vb = np.empty((5, hd), np.float32)
    for h in range(n_kv):
        n = count_l[h]
        h0 = h * group
        qp = q_pos[h]
        for o in range(n_var):
            have[o] = 0
        for j in range(n):
            off = kbase_l[h, j] - pos_l[h, j]
            if off < 0 or off >= n_var:
                kj = kv_row(k_l, h, j, vb[4])
                rotate_by_table(vb[4], kj, -off, cos, sin, rotary_dim)
                encode_row(k_l[h, j], vb[4])
                kbase_l[h, j] = pos_l[h, j]
                off = 0
            offs[j] = off
            have[off] = 1
        for o in range(n_var):
            if have[o]:
                for g in range(group):
                    rotate_into(qvar[o, h0 + g], q[h0 + g], qp + o, cos, sin, rotary_dim)
                scale_group(qvar[o], h0, group, scale)
        for j in range(n):
            o = offs[j]
            kj = kv_row(k_l, h, j, vb[4])
            for g in range(group):
                acc = np.float32(0.0)
                for d in range(hd):
                    acc += qvar[o, h0 + g, d] * kj[d]
                scores[h0 + g, j] = acc
        _softmax_weighted_v(out, scores, v_l, mass, h, n, group, softcap, vb)


# ---------------------------------------------------------------------------------------------
# EQUIP's cached rotate-half (RK cache): RoPE(k) at p = k * C[p] + rk * S[p], rk = rotate_half(k)
# ---------------------------------------------------------------------------------------------
#
# C, S (n_pos, rotary_dim) are the cos/sin tables repeated over both halves and rk = (-b, a) for a
# key's halves (a, b) is stored beside the key at write time (+rotary_dim floats per key, i.e. +50%
# KV memory at full rotary), so rotating a key at read is two multiply-adds per dim with no half-split
# shuffle: the form EQUIP uses to make re-indexed RoPE cheap on the fly.


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def attend_rk(out, q, k_l, rk_l, v_l, pos_l, count_l, q_pos, cosf, sinf, cos, sin, rotary_dim, scale, softcap, scores,
              qrot, mass):
    """attend() reading keys through the RK cache: rk_l (n_kv, cap, rotary_dim) f32 = rotate_half of
    each key; cosf, sinf (n_pos, rotary_dim) full-width tables (FullRopeTable); cos, sin the
    half-width ones (the query is rotated once). Other arguments as in attend(); keys f32 only (the
    RK cache is float32), values in any KV type."""
    n_head, hd = q.shape
    n_kv = k_l.shape[0]
    group = n_head // n_kv
    vb = np.empty((4, hd), np.float32)
    for hq in range(n_head):
        rotate_into(qrot[hq], q[hq], q_pos, cos, sin, rotary_dim)
        for d in range(hd):
            qrot[hq, d] *= scale
    for h in range(n_kv):
        n = count_l[h]
        h0 = h * group
        for j in range(n):
            p = pos_l[h, j]
            c = cosf[p]
            s = sinf[p]
            kj = k_l[h, j]
            rj = rk_l[h, j]
            for g in range(group):
                qg = qrot[h0 + g]
                acc = np.float32(0.0)
                for d in range(rotary_dim):
                    acc += qg[d] * (kj[d] * c[d] + rj[d] * s[d])
                for d in range(rotary_dim, hd):
                    acc += qg[d] * kj[d]
                scores[h0 + g, j] = acc
        _softmax_weighted_v(out, scores, v_l, mass, h, n, group, softcap, vb)
