"""One token through one policy layer in a single kernel call: evict, write, attend.

A decode step of a layer where an eviction policy chooses victims used to be five calls from
Python (the store's write kernel, the query positions, the attention kernel, and the policy's
key and observe kernels around them), each paying Numba's argument unboxing (about 55 ns per
array) and the interpreter's glue: at 30 layers that glue cost as much as the policy's own work.
policy_write_attend runs the store's write kernel (kv_store.kv_write_policy), sets the query's
logical position per kv head and runs the attention kernel of the layer's RoPE layout
(attention.attend_rebased, or attention.attend for keys stored before RoPE) in one call. The
policy's fill_keys (before) and observe (after) stay policy methods: they differ per policy.
Same arithmetic as the separate calls, in the same order: results are bit-identical.
"""
from __future__ import annotations

from numba import njit

from ringllm.runtime.attention import attend, attend_rebased
from ringllm.runtime.kv_store import kv_write_policy


@njit(cache=True, nogil=True)
def policy_write_attend(k_l, v_l, seq_l, rank_l, pos_l, kbase_l, score_l, aux_l, hist_l, count_l, evicted_l, k_new,
                        v_new, seq_new, key_l, grid, drop_h, sinks, recent, reindexed, victims, shift, rebase,
                        inv_freq, inv_scale, rotary_dim, angles, angle_tag, tmp, ksum,
                        out, q, cos, sin, scale, scores, qvar, have, krot, qrot, q_pos, mass, offs):
    """kv_write_policy (arguments k_l .. ksum as there, drop_h filled by KVStore.prepare_policy_write),
    then the new token's attention over the layer: out (n_head, hd) f32, q (n_head, hd) f32 the
    query before RoPE, cos/sin (n_pos, rotary_dim/2) the RopeTable, scale the score multiplier;
    scratch scores (n_head, P), qvar (R, n_head, hd), have (R,) i64, krot (hd,), qrot (n_head, hd)
    f32, q_pos (n_kv,) i64 (set here: count - 1 per head in reindexed mode, else seq_new), offs (P,)
    i64; mass (n_kv, P) f32 written when it has rows. rebase nonzero: keys rotated at kbase
    (attend_rebased, which also does the re-rotations the write kernel leaves to it), 0: keys
    before RoPE (attend)."""
    kv_write_policy(k_l, v_l, seq_l, rank_l, pos_l, kbase_l, score_l, aux_l, hist_l, count_l, evicted_l, k_new,
                    v_new, seq_new, key_l, grid, drop_h, sinks, recent, reindexed, victims, shift, rebase, inv_freq,
                    inv_scale, rotary_dim, angles, angle_tag, tmp, ksum)
    for h in range(count_l.shape[0]):
        q_pos[h] = count_l[h] - 1 if reindexed else seq_new
    if rebase != 0:
        attend_rebased(out, q, k_l, v_l, pos_l, kbase_l, count_l, q_pos, cos, sin, rotary_dim, scale, scores, qvar,
                       have, mass, offs)
    else:
        attend(out, q, k_l, v_l, pos_l, count_l, q_pos, cos, sin, rotary_dim, scale, scores, krot, qrot, mass)
