"""One token through one policy layer in a single kernel call: keys, evict, write, attend, observe.

A decode step of a layer where an eviction policy chooses victims used to be five calls from
Python (the store's write kernel, the query positions, the attention kernel, and the policy's
key and observe kernels around them), each paying Numba's argument unboxing (about 55 ns per
array) and the interpreter's glue: at 30 layers that glue cost as much as the policy's own work.
policy_write_attend runs the store's write kernel (kv_store.kv_write_policy), sets the query's
logical position per kv head and runs the attention kernel of the layer's RoPE layout
(attention.attend_rebased, or attention.attend for keys stored before RoPE) in one call. The
policy's fill_keys (before) and observe (after) stay policy methods there: they differ per policy.

policy_layer_step goes further for the policies whose per-step work is a fixed kernel (Policy.step_kind:
h2o, tova, scissorhands, the SnapKV family, adakv, rkv, gvote's query history): the drop count
(staged eviction, Algorithm 1), the policy's keys, policy_write_attend and the policy's observe in
one call. Measured per layer at budget 256 (SmolLM2 layer 5, 1 thread): with hot caches the
Python between those calls (KVStore.prepare_policy_write, the policy's methods, their dispatch)
was 1.5 to 5 us of the 50 to 75 a policy layer took; with the caches flushed before the call
(a decode's matrix products evict them between layers) prepare_policy_write alone took 27 to 30
us, and the layer step went from 196 to 173 us for h2o. Beside the matrix products split over
two threads this is serial time. The engine takes the Python path (KVStore.prepare_policy_write, the
policy's methods, policy_write_attend) when a rollback journal runs (it saves the rows a step
changes between choosing and writing) and for gvote's eviction steps (its budget vote keeps
statistics in Python); policy_layer_step then returns False before changing anything.
Same kernels as the separate calls, in the same order: results are bit-identical. Within the step
the kv heads run on separate threads (_head_step in prange) except where the policy couples them.
"""
from __future__ import annotations

from numba import njit, prange

from ringllm.runtime.attention import attend, attend_rebased
from ringllm.runtime.eviction import GRID_GIVEN, keep_after, pick_victims
from ringllm.runtime.kv_store import kv_write_policy
from ringllm.runtime.policies.adakv import select_drops
from ringllm.runtime.policies.base import (STEP_ADAKV, STEP_GVOTE, STEP_H2O, STEP_RKV, STEP_SCISSORHANDS, STEP_SNAPKV,
                                          STEP_TOVA, accumulate_mass, copy_keys)
from ringllm.runtime.policies.rkv import rkv_keys
from ringllm.runtime.policies.scissorhands import unimportant_keys, update_history
from ringllm.runtime.policies.snapkv import pooled_keys, record_window
from ringllm.runtime.policies.tova import latest_mean
from ringllm.runtime.simd import num_threads


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


@njit(cache=True, nogil=True)
def choose_next(kind, k_l, seq_l, rank_l, score_l, aux_l, count_l, key_l, key_grid, capacity, lazy, slack, max_drop,
                sinks, recent, ksum, pool, floor, lam, by_rank, s, low, order, ptr, victims, pend, pend_drop):
    """The victims of the next write into the layer as its state stands, for the policy of step kind
    `kind` (not gvote, whose budget needs the next query): pend_drop (n_kv,) i64 how many each head
    gives, pend[h, :pend_drop[h]] (n_kv, P) f64 their slots, as kv_store.kv_write_policy takes them
    under GRID_GIVEN. The same victims as KVStore.prepare_policy_write's keys and the write kernel's
    pick: staged eviction (capacity, lazy, slack, max_drop) on the held tokens plus the new one, the
    policy's keys into key_l (scratch), eviction.pick_victims per head (adakv: its layer-wide
    select_drops). Other arguments as policy_layer_step; victims (>= P + 1,) i64 scratch."""
    if kind == STEP_ADAKV:           # one layer-wide selection: counts per head, the slots in pend
        select_drops(pend, aux_l, seq_l, rank_l, count_l, pool, by_rank, capacity, lazy, slack, max_drop, sinks,
                     recent, floor, key_grid, low, order, ptr, pend_drop)
        return
    held = count_l[0] + 1
    n_drop = held - keep_after(held, capacity, lazy, slack, max_drop)
    for h in range(pend_drop.shape[0]):
        pend_drop[h] = 0
    if n_drop <= 0:
        return
    if kind == STEP_H2O or kind == STEP_TOVA:
        copy_keys(key_l, score_l, count_l, 1.0)
    elif kind == STEP_SCISSORHANDS:
        unimportant_keys(key_l, aux_l, count_l)
    elif kind == STEP_SNAPKV:
        pooled_keys(key_l, aux_l, rank_l, count_l, pool, by_rank)
    elif kind == STEP_RKV:
        rkv_keys(key_l, k_l, aux_l, score_l, count_l, ksum, lam, s)
    for h in range(pend_drop.shape[0]):
        got = pick_victims(key_l, key_grid, h, n_drop, seq_l, rank_l, count_l, sinks, recent, victims)
        for m in range(got):
            pend[h, m] = victims[m]
        pend_drop[h] = got


@njit(cache=True, nogil=True)
def _head_step(h, args):
    """kv head h's share of policy_layer_step; args: the tuple of policy_layer_step's arguments (as
    there) with grid (the victims' grid of this write) and ahead (whether the head chooses its next
    victims itself) added: its write and its query heads' attention (policy_write_attend; drop_h[h]
    victims, given in pend[h]), its part of observe and, when `ahead`, the choice of its next
    victims. The layer kernels run on one-head views (rows h of the layer, query heads h*group ..
    h*group + group - 1) with head h's scratch rows, so heads run on separate threads with nothing
    shared but read-only tables."""
    (kind, k_l, v_l, seq_l, rank_l, pos_l, kbase_l, score_l, aux_l, hist_l, count_l, evicted_l, k_new, v_new, seq_new,
     key_l, key_grid, grid, drop_h, capacity, lazy, slack, max_drop, sinks, recent, reindexed, victims, shift, rebase,
     inv_freq, inv_scale, rotary_dim, angles, angle_tag, tmp, ksum, out, q, cos, sin, scale, scores, qvar, have, krot,
     qrot, q_pos, mass, offs, pend, pend_drop, pool, width, floor, lam, by_rank, s, low, order, ptr, qhist, ahead) = args
    e = h + 1
    g = q.shape[0] // count_l.shape[0]
    a, b = h * g, h * g + g
    policy_write_attend(k_l[h:e], v_l[h:e], seq_l[h:e], rank_l[h:e], pos_l[h:e], kbase_l[h:e], score_l[h:e],
                        aux_l[h:e], hist_l[h:e], count_l[h:e], evicted_l[h:e], k_new[h:e], v_new[h:e], seq_new,
                        pend[h:e], grid, drop_h[h:e], sinks, recent, reindexed, victims[h], shift, rebase, inv_freq,
                        inv_scale, rotary_dim, angles[h], angle_tag[h:e], tmp[h], ksum[h:e], out[a:b], q[a:b], cos,
                        sin, scale, scores[a:b], qvar[h], have[h], krot[h], qrot[a:b], q_pos[h:e], mass[h:e], offs[h])
    if kind == STEP_H2O:
        accumulate_mass(score_l[h:e], mass[h:e], count_l[h:e])
    elif kind == STEP_SCISSORHANDS:
        update_history(aux_l[h:e], mass[h:e], count_l[h:e], g, width)
    elif kind == STEP_SNAPKV or kind == STEP_ADAKV or kind == STEP_RKV:
        record_window(hist_l[h:e], aux_l[h:e], mass[h:e], count_l[h:e], seq_new % width)
    elif kind == STEP_GVOTE:         # GVote.on_insert: the new token's query joins the history ring
        col = seq_new % width
        for hq in range(a, b):
            for d in range(qhist.shape[2]):
                qhist[hq, col, d] = q[hq, d]
    if ahead:
        choose_next(kind, k_l[h:e], seq_l[h:e], rank_l[h:e], score_l[h:e], aux_l[h:e], count_l[h:e], key_l[h:e],
                    key_grid, capacity, lazy, slack, max_drop, sinks, recent, ksum[h:e], pool, floor, lam,
                    by_rank[h], s[h], low, order, ptr, victims[h], pend[h:e], pend_drop[h:e])


@njit(cache=True, nogil=True, parallel=True)
def policy_layer_step(kind, k_l, v_l, seq_l, rank_l, pos_l, kbase_l, score_l, aux_l, hist_l, count_l, evicted_l,
                      k_new, v_new, seq_new, key_l, key_grid, drop_h, capacity, lazy, slack, max_drop, sinks, recent,
                      reindexed, victims, shift, rebase, inv_freq, inv_scale, rotary_dim, angles, angle_tag, tmp,
                      ksum, out, q, cos, sin, scale, scores, qvar, have, krot, qrot, q_pos, mass, offs,
                      pend, pend_drop, pend_tag, pool, width, floor, lam, by_rank, s, low, order, ptr, qhist):
    """One token through policy layer il in one call: what KVStore.prepare_policy_write, the
    policy's fill_keys, policy_write_attend, on_insert and observe do, for the policy of step kind
    `kind` (policies.base.STEP_*). Returns False, having changed nothing, when the step needs the
    Python path (gvote evicting), else True.

    The victims are chosen at the end of the step before (choose_next, right after observe, while
    the scores it just updated and the ranks the attention just read are in cache) for this token,
    and taken from pend/pend_drop when pend_tag[0] == seq_new; when not (the first step, or the layer
    changed otherwise since: the store's own paths clear the tag) they are chosen here first, from
    the same state. Either way the same victims: a saved or rolled-back store decodes bitwise alike.

    The kv heads are independent from the write to the choice of their next victims except where a
    policy couples them (tova's score is the mean over all heads, adakv's selection spans the layer):
    _head_step runs each head's part, over the heads in prange when Numba has more than one thread
    and the layer more than one kv head (the matrix products around this step already use every
    thread; here the second core would otherwise idle), and the coupled parts run after it on this
    thread. Every head's arithmetic is the one-thread form's, so results are bitwise the same at any
    thread count.

    kind .. key_l and sinks .. offs as policy_write_attend (key_grid: the policy's Policy.key_grid,
    the grid its raw keys are compared on), except the scratch, a row per kv head: victims (n_kv,
    >= P + 1) i64, angles (n_kv, 2, rotary_dim/2) f32 and angle_tag (n_kv,) i64 (KVStore.layer_angles,
    layer_angle_tag), tmp (n_kv, hd) f32, qvar (n_kv, R, group, hd) f32, have (n_kv, R) i64, krot
    (n_kv, hd) f32, offs (n_kv, P) i64. capacity, lazy, slack, max_drop: the layer's capacity and
    the staging (Algorithm 1; 0, 0, 0 for plain eviction); drop_h (n_kv,) i64 is set here. pend
    (n_kv, P) f64, pend_drop (n_kv,) i64, pend_tag (1,) i64: the layer's victims chosen ahead
    (KVStore.pend*). pool .. qhist: Policy.step_params (policies.base.step_params). q (n_head, hd)
    f32 is the query before RoPE (gvote's history row of the new token)."""
    n_kv = count_l.shape[0]
    grid = GRID_GIVEN
    if kind == STEP_GVOTE:           # its budget needs this query: only when no token leaves
        grid = key_grid
        held = count_l[0] + 1
        if held - keep_after(held, capacity, lazy, slack, max_drop) > 0:
            return False
        for h in range(n_kv):
            drop_h[h] = 0
    else:
        if pend_tag[0] != seq_new:
            choose_next(kind, k_l, seq_l, rank_l, score_l, aux_l, count_l, key_l, key_grid, capacity, lazy, slack,
                        max_drop, sinks, recent, ksum, pool, floor, lam, by_rank[0], s[0], low, order, ptr,
                        victims[0], pend, pend_drop)
        for h in range(n_kv):
            drop_h[h] = pend_drop[h]
    for h in range(n_kv):            # checked here, before the heads' threads start
        if count_l[h] - drop_h[h] >= seq_l.shape[1]:
            raise ValueError("policy_layer_step: no slot free after eviction (every held token is protected)")
    pend_tag[0] = -1
    ahead = kind == STEP_H2O or kind == STEP_SCISSORHANDS or kind == STEP_SNAPKV or kind == STEP_RKV
    args = (kind, k_l, v_l, seq_l, rank_l, pos_l, kbase_l, score_l, aux_l, hist_l, count_l, evicted_l, k_new, v_new,
            seq_new, key_l, key_grid, grid, drop_h, capacity, lazy, slack, max_drop, sinks, recent, reindexed, victims,
            shift, rebase, inv_freq, inv_scale, rotary_dim, angles, angle_tag, tmp, ksum, out, q, cos, sin, scale,
            scores, qvar, have, krot, qrot, q_pos, mass, offs, pend, pend_drop, pool, width, floor, lam, by_rank, s,
            low, order, ptr, qhist, ahead)
    if n_kv > 1 and num_threads() > 1:
        for h in prange(n_kv):
            _head_step(h, args)
    else:
        for h in range(n_kv):
            _head_step(h, args)
    if kind == STEP_GVOTE:
        return True
    if kind == STEP_TOVA:            # the mean over every head's attention: after all heads
        latest_mean(score_l, mass, count_l, q.shape[0])
    if not ahead:                    # tova, adakv: the choice reads every head
        choose_next(kind, k_l, seq_l, rank_l, score_l, aux_l, count_l, key_l, key_grid, capacity, lazy, slack,
                    max_drop, sinks, recent, ksum, pool, floor, lam, by_rank[0], s[0], low, order, ptr, victims[0],
                    pend, pend_drop)
    pend_tag[0] = seq_new + 1
    return True
