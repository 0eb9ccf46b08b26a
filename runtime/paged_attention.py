"""The attention step over one sequence's block table in the paged KV pool (runtime/paged_pool.py).

Same formula as runtime/attention.attend (fused RoPE: keys stored before RoPE, each rotated by its
slot's logical position as it is read; GQA without repeated K/V; two-pass float32 softmax), with
the slots found through the block table: table entry i is pool block table[i], its B offsets are
read in order and holes (token index -1) are skipped. A slot's logical position comes from its
token index, never from where the slot sits, so compaction passes (which move slots) and
hole-filling (which permutes them) leave every score unchanged:
    original:  position = token index
    reindexed: position = rank of the token index among the layer's held tokens (a binary search
               in the sorted `held` array the pool keeps per sequence and layer)
"""
from __future__ import annotations

from numba import njit

from ringllm.runtime.attention import cap_scores, scale_group, softmax_inplace
from ringllm.runtime.kv_codec import kv_row
from ringllm.runtime.kv_row_math import group_scores
from ringllm.runtime.eviction import count_below
from ringllm.runtime.numba_flags import FASTMATH
from ringllm.runtime.rope_kernels import rotate_into


@njit(cache=True, nogil=True, fastmath=False)
def gather_slots(slots, spos, seq_l, table, n_table, held, n_held, reindexed):
    """List the occupied slots of one layer in table order: slots[j] = block * B + offset,
    spos[j] = logical position. seq_l (n_blocks, B) i64; table (>= n_table,) i64; held (>= n_held,)
    i64 sorted token indices held; slots, spos (>= n_held,) i64. Returns the count (== n_held)."""
    B = seq_l.shape[1]
    j = 0
    for ti in range(n_table):
        blk = table[ti]
        for o in range(B):
            s = seq_l[blk, o]
            if s < 0:
                continue
            if reindexed:
                spos[j] = count_below(held, n_held, s)
            else:
                spos[j] = s
            slots[j] = blk * B + o
            j += 1
    return j


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def paged_attend(out, q, k_l, v_l, slots, spos, n, q_pos, cos, sin, rotary_dim, scale, softcap, scores, krot, qrot,
                 row):
    """Attention of one token over the n slots listed by gather_slots.

    out (n_head, hd) f32: result.          q (n_head, hd) f32: queries before RoPE.
    k_l, v_l (n_blocks, n_kv, B, width): one layer of the pool, rows in its KV types (an f32 row is
        read in place, any other decoded into `row` first: kv_codec.kv_row).
    slots, spos (>= n,) i64: block * B + offset and logical position of each occupied slot.
    q_pos: the query's logical position (n - 1 in reindexed mode, its token index in original mode).
    cos, sin (n_pos, rotary_dim/2) f32: RopeTable rows covering every position used.
    scale: score multiplier; softcap: attention soft-cap (0 = none). Scratch: scores (n_head, >= n) f32,
    krot (hd,) f32, qrot (n_head, hd) f32, row (hd,) f32.
    """
    n_head, hd = q.shape
    n_kv = k_l.shape[1]
    B = k_l.shape[2]
    group = n_head // n_kv
    for h in range(n_kv):
        h0 = h * group
        for g in range(group):
            rotate_into(qrot[h0 + g], q[h0 + g], q_pos, cos, sin, rotary_dim)
        scale_group(qrot, h0, group, scale)
        for j in range(n):
            blk = slots[j] // B
            o = slots[j] - blk * B
            rotate_into(krot, kv_row(k_l[blk], h, o, row), spos[j], cos, sin, rotary_dim)
            group_scores(scores, qrot, krot, h0, group, j)
        for g in range(group):
            hq = h0 + g
            sc = scores[hq]
            cap_scores(sc, n, softcap)
            softmax_inplace(sc, n)
            o_h = out[hq]
            for d in range(hd):
                o_h[d] = 0.0
            for j in range(n):
                w = sc[j]
                blk = slots[j] // B
                vj = kv_row(v_l[blk], h, slots[j] - blk * B, row)
                for d in range(hd):
                    o_h[d] += w * vj[d]
