"""One token through one policy layer in a single compiled call: victims, write, attention, observe.

A decode step of a layer where an eviction policy chooses victims would be five calls from Python
(the store's write kernel, the query positions, the attention kernel, and the policy's key and
observe kernels around them), each paying Numba's argument unboxing and the interpreter's glue; at
30 layers that glue costs as much as the policy's own work. Two kernels here remove it:

    policy_write_attend   the store's write kernel (kv_write.kv_write_policy), the query's logical
                          position per kv head, and the attention kernel of the layer's layout
                          (attention.attend_rebased, or attention.attend for keys before RoPE)
    layer_step            (one per policy, made by bind_layer_step) the victims, policy_write_attend
                          and the policy's observe, and the choice of the next write's victims

Each policy that has a compiled step (most do; see runtime/policies/) defines, in its own file,
    choose_next(lay, st, prm, by_rank, s, victims, pend, pend_drop)
        the victims of the layer's next write as its state stands: pend_drop (n_kv,) i64 how many
        each head gives, pend[h, :pend_drop[h]] (n_kv, P) f64 their slots, as kv_write_policy takes
        them under GRID_GIVEN (usually: drops_ahead, the policy's keys, pick_ahead)
    observe_head(lay, mass, q, seq_new, hq0, prm)
        what the policy learns from one step's attention, for the kv heads of `lay` (one head in
        the step; the whole layer works too): mass (n_kv, P) f32 their attention mass, q their
        query rows (query head hq0 first)
    observe_layer(lay, mass, q, prm)    (optional) what couples heads, after all of them
and bind_layer_step compiles the shared step below with those functions in it: one kernel per
policy, with no dispatch on the policy inside.

The victims of a write are chosen at the end of the step before (choose_next, right after observe,
while the scores it just updated and the ranks the attention just read are in cache) and kept in
the store's pend/pend_drop, tagged with the sequence index they are for (pend_tag); when the tag does
not match (the first step, or the layer changed some other way: the store's own paths clear it)
they are chosen first, from the same state. Either way the same victims: a saved or rolled-back
store decodes bitwise alike. Within the step the kv heads run on separate threads (prange over
_head_step) except where the policy couples them (per_head_choice False: tova's mean over heads,
adakv's layer-wide selection, chosen after the heads on this thread).

The engine takes the Python path (KVStore.prepare_policy_write, the policy's methods,
policy_write_attend) when a rollback journal runs (it saves the rows a step changes between
choosing and writing) and when a policy chooses nothing ahead (gvote, whose budget needs the new
token's query) and must evict; layer_step then returns False before changing anything. Same
kernels as the Python path, in the same order: the results are bit-identical.

Argument groups (tuples, unpacked at the top of each kernel):
    lay   the layer's arrays, kv_write.LAYER_FIELDS
    st    (key, key_grid, drop_h, capacity, lazy, slack, max_drop, sinks, recent, reindexed,
          victims, shift): key (n_kv, P) f64 scratch, key_grid the policy's grid
          (eviction.grid_value), drop_h (n_kv,) i64 set here, the layer's capacity and staging
          (Algorithm 1; 0, 0, 0 for plain eviction), victims (n_kv, >= P + 1) i64 scratch
    rw    (rebase, inv_freq, inv_scale, rotary_dim, angles, angle_tag, tmp): kv_write_policy's,
          with a row per kv head: angles (n_kv, 2, rotary_dim/2) f32, angle_tag (n_kv,) i64,
          tmp (n_kv, hd) f32 (KVStore.rotation_args(il, rows=True))
    at    (out, q, cos, sin, scale, softcap, scores, qvar, have, krot, qrot, q_pos, mass, offs): the
          attention's, see policy_write_attend; layer_step takes qvar (n_kv, R, group, hd), have
          (n_kv, R), krot (n_kv, hd) and offs (n_kv, P) with a row per kv head
    pend  (pend, pend_drop, pend_tag): KVStore.pending(il)
    prm   Policy.step_params: (pool, width, floor, lam, by_rank, s, low, order, ptr, qhist)
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ringllm.runtime.attention import attend, attend_rebased
from ringllm.runtime.eviction import GRID_GIVEN, keep_after, pick_victims
from ringllm.runtime.kernel_copies import bind_copy
from ringllm.runtime.kv_write import COUNT, RANK, SEQ, kv_write_policy


@njit(cache=True, nogil=True, fastmath=False)
def policy_write_attend(lay, k_new, v_new, seq_new, wr, victims, rw, at):
    """kv_write_policy(lay, k_new, v_new, seq_new, wr, victims, rw) (wr's drop_h filled by
    KVStore.prepare_policy_write), then the new token's attention over the layer. at = (out, q,
    cos, sin, scale, softcap, scores, qvar, have, krot, qrot, q_pos, mass, offs): out (n_head, hd) f32,
    q (n_head, hd) f32 the query before RoPE, cos/sin (n_pos, rotary_dim/2) the RopeTable, scale the
    score multiplier, softcap the attention soft-cap (0 = none); scratch scores (n_head, P), qvar (R, n_head, hd), have (R,) i64, krot (hd,),
    qrot (n_head, hd) f32, q_pos (n_kv,) i64 (set here: count - 1 per head in reindexed mode, else
    seq_new), offs (P,) i64; mass (n_kv, P) f32 written when it has rows. rw's rebase nonzero: keys
    rotated at kbase (attend_rebased, which also does the re-rotations the write kernel leaves to
    it), 0: keys before RoPE (attend)."""
    k_l, v_l, seq_l, rank_l, pos_l, kbase_l, score_l, aux_l, hist_l, count_l, evicted_l, ksum, koff = lay
    out, q, cos, sin, scale, softcap, scores, qvar, have, krot, qrot, q_pos, mass, offs = at
    reindexed = wr[5]
    rebase, rotary_dim = rw[0], rw[3]
    kv_write_policy(lay, k_new, v_new, seq_new, wr, victims, rw)
    for h in range(count_l.shape[0]):
        q_pos[h] = count_l[h] - 1 if reindexed else seq_new
    if rebase != 0:
        attend_rebased(out, q, k_l, v_l, pos_l, kbase_l, count_l, q_pos, cos, sin, rotary_dim, scale, softcap, scores,
                       qvar, have, mass, offs)
    else:
        attend(out, q, k_l, koff, seq_l, v_l, pos_l, count_l, q_pos, cos, sin, rotary_dim, scale, softcap, scores, krot,
               qrot, mass)


# ---------------------------------------------------------------------------------------------
# The pieces a policy's choose_next is made of
# ---------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def drops_ahead(lay, st, pend_drop):
    """Tokens each head gives at the layer's next write (staged eviction, Algorithm 1, on the held
    tokens plus the new one); pend_drop is cleared."""
    count_l = lay[COUNT]
    capacity, lazy, slack, max_drop = st[3], st[4], st[5], st[6]
    held = count_l[0] + 1
    n_drop = held - keep_after(held, capacity, lazy, slack, max_drop)
    for h in range(pend_drop.shape[0]):
        pend_drop[h] = 0
    return n_drop


@njit(cache=True, nogil=True, inline="always")
def pick_ahead(lay, st, n_drop, victims, pend, pend_drop):
    """The n_drop victims of each head by the keys in st's key (eviction.pick_victims, on the
    policy's grid) into pend/pend_drop; victims (>= P + 1,) i64 scratch."""
    seq_l, rank_l, count_l = lay[SEQ], lay[RANK], lay[COUNT]
    key_l, key_grid, sinks, recent = st[0], st[1], st[7], st[8]
    for h in range(pend_drop.shape[0]):
        got = pick_victims(key_l, key_grid, h, n_drop, seq_l, rank_l, count_l, sinks, recent, victims)
        for m in range(got):
            pend[h, m] = victims[m]
        pend_drop[h] = got


@njit(cache=True, nogil=True, fastmath=False)
def observe_nothing(lay, mass, q, prm):
    """observe_layer of the policies whose heads observe alone."""


# ---------------------------------------------------------------------------------------------
# The shared step, compiled once per policy (bind_layer_step)
# ---------------------------------------------------------------------------------------------
#
# The names choose_next, observe_head, observe_layer, head_step, PER_HEAD_CHOICE and
# CHOOSES_AHEAD below are bound per policy: bind_layer_step gives each policy copies of these two
# functions whose globals hold the policy's functions and flags (Numba compiles them as constants).
# The module-level values here only name them; no compiled step reads them.
choose_next = observe_head = observe_layer = head_step = None
PER_HEAD_CHOICE = CHOOSES_AHEAD = None


def _head_step(h, args):
    """kv head h's share of the layer step: its write and its query heads' attention
    (policy_write_attend on one-head views, drop_h[h] victims given in pend[h]), its observe and,
    when the choice is per head, the choice of its next victims. The views keep Numba's C layout
    and each head has its own scratch rows, so heads run on separate threads. args: _layer_step's
    groups and the write's grid as one flat tuple (a parallel loop takes flat tuples only), in the
    order lay, (k_new, v_new, seq_new), st, (grid,), rw, at, pend, prm."""
    (k_l, v_l, seq_l, rank_l, pos_l, kbase_l, score_l, aux_l, hist_l, count_l, evicted_l, ksum, koff,
     k_new, v_new, seq_new,
     key_l, key_grid, drop_h, capacity, lazy, slack, max_drop, sinks, recent, reindexed, victims, shift,
     grid,
     rebase, inv_freq, inv_scale, rotary_dim, angles, angle_tag, tmp,
     out, q, cos, sin, scale, softcap, scores, qvar, have, krot, qrot, q_pos, mass, offs,
     pend_l, pend_drop, pend_tag,
     pool, width, floor, lam, by_rank, s, low, order, ptr, qhist) = args
    prm = (pool, width, floor, lam, by_rank, s, low, order, ptr, qhist)
    e = h + 1
    g = q.shape[0] // count_l.shape[0]
    a, b = h * g, h * g + g
    lay_h = (k_l[h:e], v_l[h:e], seq_l[h:e], rank_l[h:e], pos_l[h:e], kbase_l[h:e], score_l[h:e], aux_l[h:e],
             hist_l[h:e], count_l[h:e], evicted_l[h:e], ksum[h:e], koff[h:e])
    policy_write_attend(lay_h, k_new[h:e], v_new[h:e], seq_new,
                        (pend_l[h:e], grid, drop_h[h:e], sinks, recent, reindexed, shift), victims[h],
                        (rebase, inv_freq, inv_scale, rotary_dim, angles[h], angle_tag[h:e], tmp[h]),
                        (out[a:b], q[a:b], cos, sin, scale, softcap, scores[a:b], qvar[h], have[h], krot[h], qrot[a:b],
                         q_pos[h:e], mass[h:e], offs[h]))
    observe_head(lay_h, mass[h:e], q[a:b], seq_new, a, prm)
    if PER_HEAD_CHOICE:
        st_h = (key_l[h:e], key_grid, drop_h[h:e], capacity, lazy, slack, max_drop, sinks, recent, reindexed, victims,
                shift)
        choose_next(lay_h, st_h, prm, by_rank[h], s[h], victims[h], pend_l[h:e], pend_drop[h:e])


def _layer_step(lay, k_new, v_new, seq_new, st, rw, at, pend, prm):
    """One token through policy layer `lay` (argument groups: module docstring): its victims (chosen
    ahead, or now), its write, attention and observe, and its next victims. Returns False, having
    changed nothing, when the step must take the Python path (a policy that chooses nothing ahead,
    evicting), else True."""
    count_l, seq_l = lay[COUNT], lay[SEQ]
    drop_h, capacity, lazy, slack, max_drop, victims = st[2], st[3], st[4], st[5], st[6], st[10]
    pend_l, pend_drop, pend_tag = pend
    n_kv = count_l.shape[0]
    grid = GRID_GIVEN
    if not CHOOSES_AHEAD:            # only a step that evicts nothing runs here
        grid = st[1]
        held = count_l[0] + 1
        if held - keep_after(held, capacity, lazy, slack, max_drop) > 0:
            return False
        for h in range(n_kv):
            drop_h[h] = 0
    else:
        if pend_tag[0] != seq_new:
            choose_next(lay, st, prm, prm[4][0], prm[5][0], victims[0], pend_l, pend_drop)
        for h in range(n_kv):
            drop_h[h] = pend_drop[h]
    for h in range(n_kv):            # checked here, before the heads' threads start
        if count_l[h] - drop_h[h] >= seq_l.shape[1]:
            raise ValueError("policy layer step: no slot free after eviction (every held token is protected)")
    pend_tag[0] = -1
    args = lay + (k_new, v_new, seq_new) + st + (grid,) + rw + at + pend + prm
    # One loop, parallel however many heads and threads: a serial twin of it would put a second copy of
    # head_step's code into this kernel, and compiling the step takes a quarter longer. prange's index is
    # unsigned; as int64, head_step compiles once, not twice.
    for h in prange(n_kv):
        head_step(np.int64(h), args)
    if not CHOOSES_AHEAD:
        return True
    observe_layer(lay, at[12], at[1], prm)
    if not PER_HEAD_CHOICE:
        choose_next(lay, st, prm, prm[4][0], prm[5][0], victims[0], pend_l, pend_drop)
    pend_tag[0] = seq_new + 1
    return True


def bind_layer_step(policy: str, choose_next, observe_head, observe_layer=observe_nothing, per_head_choice=True,
                    chooses_ahead=True):
    """The compiled layer step of policy `policy` with its functions (module docstring) in it.

    per_head_choice: choose_next runs per kv head inside the heads' threads (False: once for the layer
    after every head observed, when the choice couples heads). chooses_ahead: False for a policy
    whose victims need the new token's query (gvote): the step then runs only when nothing is evicted
    and never chooses ahead. The result is cached on disk like any kernel of this package."""
    namespace = dict(globals())
    # __name__ stays this module's: Numba rebuilds a cached kernel's environment by importing it
    namespace.update(choose_next=choose_next, observe_head=observe_head, observe_layer=observe_layer,
                     PER_HEAD_CHOICE=per_head_choice, CHOOSES_AHEAD=chooses_ahead)
    namespace["head_step"] = njit(cache=True, nogil=True, fastmath=False)(bind_copy(_head_step, f"{policy}_head_step", namespace))
    return njit(cache=True, nogil=True, parallel=True, fastmath=False)(bind_copy(_layer_step, f"{policy}_layer_step", namespace))
