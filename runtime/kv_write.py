"""The KV store's write kernels: a new token into a layer's slots, in place (EQUIP), and the removal
of victims another module chose (runtime/eviction.py). KVStore (kv_store.py) calls them for one
layer; the compiled policy step (policy_step.py) calls kv_write_policy per kv head.

A layer's arrays travel as one tuple in LAYER_FIELDS order (KVStore.layers[il]); shapes, with P
the layer's physical slots: k, v (n_kv, P, hd) f32; seq, rank, pos, kbase (n_kv, P) i64; score
(n_kv, P) f64; aux (n_kv, P) i64; hist (n_kv, w, P) f32; count, evicted (n_kv,) i64; ksum (n_kv or
0, hd) i64; koff (n_kv, hd) f32, the key offsets the rows of a q4_0 policy layer are relative to
(kv_types; the kernels that read keys add them, kv_codec.key_row) (kv_store.py's docstring says what
each holds).

    kv_write_streaming   the ring (streaming, full, sliding windows): the slot eviction.ring_slot
                         names, positions of newer tokens moved down one in reindexed mode
    kv_write_shift       the shift-and-append baseline of the ring (benchmarks)
    kv_write_policy      drop each head's victims (chosen by a policy: eviction.pick_victims, or
                         given), fill every hole with the last occupied slot, write the new token
    evict_slots          the removal itself: ranks updated, one slot copy per victim
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ringllm.runtime.eviction import GRID_GIVEN, count_below, pick_victims, ring_slot, sort_i64
from ringllm.runtime.key_sum import key_inv_norm, key_sum_move
from ringllm.runtime.kv_codec import encode_row
from ringllm.runtime.rope_kernels import rotate_key_by

# The arrays of one layer in the order the kernels take them: one tuple per layer (KVStore.layers),
# built once (the arrays are never reallocated) and unpacked at the top of a kernel.
LAYER_FIELDS = ("k", "v", "seq", "rank", "pos", "kbase", "score", "aux", "hist", "count", "evicted", "ksum", "koff")
# their indices, for kernels that read one or two of them (lay[SCORE]; Numba folds the constant)
K, V, SEQ, RANK, POS, KBASE, SCORE, AUX, HIST, COUNT, EVICTED, KSUM, KOFF = range(len(LAYER_FIELDS))

@njit(cache=True, nogil=True, inline="always")
def copy_row(a_l, h, dst, src):
    """Row dst of head h of a store array (n_kv, P, width) = row src, in the store's type as it is."""
    for d in range(a_l.shape[2]):
        a_l[h, dst, d] = a_l[h, src, d]


@njit(cache=True, nogil=True, inline="always")
def _put(k_l, v_l, seq_l, pos_l, h, slot, k_new, v_new, seq_new, pos_new):
    """Slot `slot` of head h takes token seq_new at logical position pos_new: k_new[h], v_new[h] (hd,)
    f32, encoded in the store's KV types (kv_types.py; quantized once, here)."""
    seq_l[h, slot] = seq_new
    pos_l[h, slot] = pos_new
    encode_row(k_l[h, slot], k_new[h])
    encode_row(v_l[h, slot], v_new[h])


@njit(cache=True, nogil=True, fastmath=False)
def kv_write_streaming(k_l, v_l, seq_l, pos_l, count_l, evicted_l, k_new, v_new, seq_new, sinks, reindexed):
    """Write one token into layer storage, evicting the oldest non-sink token when full.

    k_l, v_l (n_kv, cap, hd) f32; seq_l, pos_l (n_kv, cap) i64; count_l, evicted_l (n_kv,) i64;
    k_new, v_new (n_kv, hd) f32; seq_new: sequence index of the token. Returns None; the slot
    written is the one holding `seq_new` afterwards.
    """
    n_kv, cap = seq_l.shape
    for h in range(n_kv):
        slot, pos_new, victim_seq = ring_slot(seq_l, count_l, evicted_l, h, sinks, reindexed, seq_new)
        if reindexed and victim_seq >= 0:       # every newer token moves down one position
            for j in range(cap):
                if seq_l[h, j] > victim_seq:
                    pos_l[h, j] -= 1
        _put(k_l, v_l, seq_l, pos_l, h, slot, k_new, v_new, seq_new, pos_new)


@njit(cache=True, nogil=True, fastmath=False)
def kv_write_shift(k_l, v_l, seq_l, pos_l, count_l, evicted_l, k_new, v_new, seq_new, sinks, reindexed):
    """The shift-and-append baseline (HF-style StreamingLLM): same arguments as kv_write_streaming,
    but the store is kept ordered: on eviction every slot after the victim (slot `sinks`, the oldest
    non-sink) is copied one slot down and the new token is appended at the end. Kept only as the
    honest baseline of the in-place update in benchmarks."""
    n_kv, cap = seq_l.shape
    for h in range(n_kv):
        n = count_l[h]
        if n < cap:
            slot = n
            count_l[h] = n + 1
        else:
            evicted_l[h] += 1
            for j in range(sinks, cap - 1):
                seq_l[h, j] = seq_l[h, j + 1]
                pos_l[h, j] = j if reindexed else pos_l[h, j + 1]
                copy_row(k_l, h, j, j + 1)
                copy_row(v_l, h, j, j + 1)
            slot = cap - 1
        _put(k_l, v_l, seq_l, pos_l, h, slot, k_new, v_new, seq_new, slot if reindexed else seq_new)


@njit(cache=True, nogil=True, inline="always")
def _move_slot(lay, h, dst, src, reindexed):
    """Slot dst of head h takes everything slot src holds (k, v, seq, rank, pos, kbase, score, aux, hist)."""
    k_l, v_l, seq_l, rank_l, pos_l, kbase_l, score_l, aux_l, hist_l, count_l, evicted_l, ksum, koff = lay
    seq_l[h, dst] = seq_l[h, src]
    rank_l[h, dst] = rank_l[h, src]
    kbase_l[h, dst] = kbase_l[h, src]
    if not reindexed:
        pos_l[h, dst] = pos_l[h, src]
    score_l[h, dst] = score_l[h, src]
    aux_l[h, dst] = aux_l[h, src]
    copy_row(k_l, h, dst, src)
    copy_row(v_l, h, dst, src)
    for i in range(hist_l.shape[1]):
        hist_l[h, i, dst] = hist_l[h, i, src]


@njit(cache=True, nogil=True, fastmath=False)
def evict_slots(lay, h, slots, n_slots, reindexed):
    """Remove the tokens in slots[:n_slots] of head h of the layer `lay` (LAYER_FIELDS), keeping
    slots [0, count) occupied.

    Ranks of the survivors drop by the number of victims older than them (in reindexed mode pos_l is
    rank_l, so positions follow). Each hole takes the last occupied slot (k, v, seq, rank, pos,
    kbase, score, aux, hist move together): one slot copy per victim, no shifting.
    """
    k_l, v_l, seq_l, rank_l, pos_l, kbase_l, score_l, aux_l, hist_l, count_l, evicted_l, ksum, koff = lay
    n = count_l[h]
    # rank update first, while the victims are still in place: a survivor drops by the number of
    # victims older than it (binary search over the victims' sorted sequence indices)
    if n_slots == 1:
        s0 = seq_l[h, slots[0]]
        for j in range(n):
            rank_l[h, j] -= seq_l[h, j] > s0
    elif n_slots <= 8:               # a few (adakv's per-head share): compare with each, no allocation
        for j in range(n):
            sj = seq_l[h, j]
            c = 0
            for m in range(n_slots):
                c += sj > seq_l[h, slots[m]]
            rank_l[h, j] -= c
    else:
        vseq = np.empty(2 * n_slots, np.int64)           # the victims' sequence indices, the sort's buffer
        for m in range(n_slots):
            vseq[m] = seq_l[h, slots[m]]
        sort_i64(vseq, n_slots, vseq[n_slots:], np.empty(0, np.float64), np.empty(0, np.int64))
        for j in range(n):
            rank_l[h, j] -= count_below(vseq, n_slots, seq_l[h, j])
    # holes, highest slot first: the last occupied slot is then never a pending victim
    for a in range(n_slots):          # selection sort of the victims' slots, descending
        best = a
        for b in range(a + 1, n_slots):
            if slots[b] > slots[best]:
                best = b
        slots[a], slots[best] = slots[best], slots[a]
    for m in range(n_slots):
        j = slots[m]
        last = n - 1
        if j != last:
            _move_slot(lay, h, j, last, reindexed)
        seq_l[h, last] = -1
        n -= 1
    count_l[h] = n
    evicted_l[h] += n_slots


@njit(cache=True, nogil=True, fastmath=False)
def evict_slots_shift(lay, h, slots, n_slots, reindexed):
    """evict_slots for the shift-and-append baseline (update "shift"): head h's slots stay in sequence
    order (slot = rank); the victims are removed by copying every later survivor down over them
    (k, v, seq, pos, kbase, score, aux, hist), as an ordered cache does. Benchmarks only."""
    k_l, v_l, seq_l, rank_l, pos_l, kbase_l, score_l, aux_l, hist_l, count_l, evicted_l, ksum, koff = lay
    n = count_l[h]
    sort_i64(slots, n_slots, np.empty(n_slots, np.int64), np.empty(0, np.float64), np.empty(0, np.int64))
    out = 0
    m = 0
    for j in range(n):
        if m < n_slots and slots[m] == j:
            m += 1
            continue
        if out != j:
            _move_slot(lay, h, out, j, reindexed)
        rank_l[h, out] = out
        out += 1
    for j in range(out, n):
        seq_l[h, j] = -1
    count_l[h] = out
    evicted_l[h] += n_slots


@njit(cache=True, nogil=True, fastmath=False)
def kv_write_policy(lay, k_new, v_new, seq_new, wr, victims, rw):
    """Evict drop_h[h] tokens of each head h (lowest key_l among unprotected slots) and write the new token.

    lay: the layer's arrays (LAYER_FIELDS). k_new, v_new (n_kv, hd) f32: the new token's key (before
    RoPE; minus the layer's key offsets koff where it has them: the caller subtracts) and value; seq_new
    its sequence index. wr = (key_l, grid, drop_h, sinks, recent,
    reindexed, shift): drop_h (n_kv,) i64 equal for every head but under adakv; key_l (n_kv, P) f64
    filled by the policy for occupied slots when any drop_h > 0, raw keys compared on grid `grid`
    (GRID_NONE: compared as they are; see eviction.grid_value; GRID_GIVEN: key_l[h, :drop_h[h]]
    are the victims' slots, chosen already); shift: the shift-and-append baseline removes victims
    by copying survivors down (evict_slots_shift). victims (>= max drop_h,) i64 scratch. The new
    token goes to slot count with rank count, zero score/aux/hist (the policy initialises them
    afterwards).
    rw = (rebase, inv_freq, inv_scale, rotary_dim, angles, angle_tag, tmp): rebase 0 stores k_new as
    given (keys before RoPE, the "fused" layout); nonzero ("rebased"): k_new is rotated at its
    logical position as it is written (kbase = position); survivors whose offset kbase - pos the
    evictions pushed out of [0, REBASE_LIMIT) are re-rotated by the attention pass that follows
    (attention.attend_rebased), which reads every key anyway. inv_freq (rotary_dim/2,) f64,
    inv_scale = 1/rope scale; angles (2, rotary_dim/2) f32 and angle_tag (1,) i64: the layer's
    cache of the last new key's rotation (cos, sin and the position they are for; in reindexed mode
    a full store writes at the same position every step, so no cos/sin is computed), tmp (hd,) f32
    scratch. ksum (n_kv, hd) i64: when it has rows (keeps_key_sum policies, "fused" layers), the
    victims' unit keys leave it and the new key's enters, and the new slot's score is its 1/|k|
    (key_sum_move). Returns None.
    """
    k_l, v_l, seq_l, rank_l, pos_l, kbase_l, score_l, aux_l, hist_l, count_l, evicted_l, ksum, koff = lay
    key_l, grid, drop_h, sinks, recent, reindexed, shift = wr
    rebase, inv_freq, inv_scale, rotary_dim, angles, angle_tag, tmp = rw
    n_kv = seq_l.shape[0]
    w = hist_l.shape[1]
    for h in range(n_kv):
        if drop_h[h] > 0:
            if grid == GRID_GIVEN:   # chosen already (policy_step.choose_next): the slots are in key_l
                got = drop_h[h]
                for m in range(got):
                    victims[m] = np.int64(key_l[h, m])
            else:
                got = pick_victims(key_l, grid, h, drop_h[h], seq_l, rank_l, count_l, sinks, recent, victims)
            if ksum.shape[0] > 0:
                for m in range(got):
                    key_sum_move(ksum, k_l, koff, seq_l, h, victims[m], score_l[h, victims[m]], -1, tmp)
            if shift:
                evict_slots_shift(lay, h, victims, got, reindexed)
            else:
                evict_slots(lay, h, victims, got, reindexed)
        slot = count_l[h]
        if slot >= seq_l.shape[1]:
            raise ValueError("kv_write_policy: no slot free after eviction (every held token is protected)")
        rank_l[h, slot] = slot
        _put(k_l, v_l, seq_l, pos_l, h, slot, k_new, v_new, seq_new, slot if reindexed else seq_new)
        score_l[h, slot] = 0.0
        aux_l[h, slot] = 0
        for i in range(w):
            hist_l[h, i, slot] = 0.0
        count_l[h] = slot + 1
        if ksum.shape[0] > 0:
            score_l[h, slot] = key_inv_norm(k_l, koff, seq_l, h, slot, tmp)
            key_sum_move(ksum, k_l, koff, seq_l, h, slot, score_l[h, slot], 1, tmp)
        if rebase != 0:
            kbase_l[h, slot] = pos_l[h, slot]
            rotate_key_by(k_l, h, slot, pos_l[h, slot], angle_tag, angles, inv_freq, inv_scale, rotary_dim, tmp)
