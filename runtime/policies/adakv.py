"""`adakv` (Ada-KV, Feng et al. 2024): one layer-wide budget shared by the kv heads, split by the
scores themselves, so heads hold different numbers of tokens.

Scores: SnapKV's (runtime/policies/snapkv.py): per slot the attention mass the last w queries gave
it (summed over the GQA group), max-pooled over `pool` neighbouring tokens, on the log key grid.
The masses of different heads are comparable (every query row of every head sums to one), which is
what lets Ada-KV compare them across heads.

Budget: the layer holds at most C x n_kv tokens over its heads (C = capacity, the per-head
average). When tokens must go, the victims are the lowest keys over all heads' unprotected slots
together (one layer-wide top-k; ties -> the older token, then the lower head), and each head is
left with at least its floor: max(ceil(ada_floor x C), sinks + recent + 1) tokens, Ada-KV's
safeguard (alpha = ada_floor, default 0.2) that keeps a head from being starved. Staged eviction
runs Algorithm 1 on the layer totals (C, R, sigma, delta all times n_kv): every step one token
enters each head, so the layer total moves exactly as n_kv ordinary heads would.

Memory: a victim's slot is really freed (the head's count drops, nothing is masked). Each head's
arrays hold up to the most one head can get, n_kv x P - (n_kv - 1) x floor (P: the per-head
physical capacity of the staging settings), since a dense (n_kv, slots) store cannot lend one
head's free slots to another; the paged pool would allocate only the blocks held. With a single
kv head (Gemma 3 270M) adakv is SnapKV.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from ringllm.runtime.eviction import grid_cell_bound, grid_value, keep_after
from ringllm.runtime.kv_write import AUX, COUNT, RANK, SEQ
from ringllm.runtime.policies.base import step_params
from ringllm.runtime.policies.snapkv import MASS_FIXED, SnapKV, observe_head, pool_ranks
from ringllm.runtime.policy_step import bind_layer_step


@njit(cache=True, nogil=True, fastmath=False)
def select_drops(key, tot_l, seq_l, rank_l, count_l, pool, by_rank, capacity, lazy, slack, max_drop, sinks, recent,
                 floor, mode, low, order, ptr, drop_h):
    """drop_h[h] = how many of the layer's n_total victims head h gives, by one layer-wide selection,
    in one call over the layer's scores, and key[h, :drop_h[h]] = those victims' slots (as float64,
    lowest key first): kv_write_policy takes them as given (eviction.GRID_GIVEN).

    n_total: staged eviction (eviction.keep_after) on the layer totals, the held tokens of all
    heads plus the n_kv entering, with capacity, lazy, slack, max_drop (per head) times n_kv.

    tot_l (n_kv, P) i64 window mass totals in fixed point (snapkv.record_window), seq_l/rank_l (n_kv, P) i64,
    count_l (n_kv,) held before the write, pool as snapkv.pooled_keys (same pooled values). A
    slot is a candidate when sinks <= rank < count - recent; a head keeps at least `floor` tokens
    after the new one enters. Victims are taken lowest grid key (grid `mode`, eviction.grid_value)
    first, ties to the lower seq, then the lower head.

    Works in rank order, where a head's candidates are one contiguous run and the lower rank is the
    older token: per head, the totals are laid out by rank (by_rank[:n]) with each rank's slot
    (key[h, r], as float64), max-pooled (by_rank[P:P + n]), then only the n_total lowest candidates
    can be taken (no head gives more than the layer): they are found among the ranks within a grid
    cell of the n_total-th lowest pooled value (the grid, a log2, is computed for those only) and
    kept sorted by (grid key, rank) by insertion. The slot arrays are read once, in slot order, and
    no per-slot key is written or scanned again (cheaper than gridding every slot's key and
    choosing per head, when the caches are cold as a decode's matrix products leave them). Scratch:
    by_rank (2P,) f64,
    low (P,) f64, order (n_kv, P) i64 (each head's candidates, slots), ptr (n_kv,) i64; key (n_kv, P)
    f64 is scratch until the result. Returns the number chosen (fewer than n_total only when too few
    candidates remain).
    """
    n_kv = count_l.shape[0]
    held = n_kv
    for h in range(n_kv):
        held += count_l[h]
    n_total = held - keep_after(held, capacity * n_kv, lazy * n_kv, slack * n_kv, max_drop * n_kv)
    if n_total <= 0:
        drop_h[:] = 0
        return 0
    half = pool // 2
    P = tot_l.shape[1]
    for h in range(n_kv):
        n = count_l[h]
        for j in range(n):                      # totals and slots by rank
            r = rank_l[h, j]
            by_rank[r] = np.float64(tot_l[h, j]) * (1.0 / MASS_FIXED)
            key[h, r] = j
        pool_ranks(by_rank, n, P, half)        # max-pooled over the ranks within pool // 2
        lo, hi = sinks, n - recent
        m = 0                                   # the m <= n_total lowest pooled values, ascending
        for r in range(lo, hi):
            x = by_rank[P + r]
            if m < n_total:
                m += 1
            elif x >= low[n_total - 1]:
                continue
            i = m - 1
            while i > 0 and low[i - 1] > x:
                low[i] = low[i - 1]
                i -= 1
            low[i] = x
        bound = grid_cell_bound(low[m - 1], mode) if m > 0 else -np.inf
        c = 0                                   # head h's m lowest candidates by (grid key, rank):
        for r in range(lo, hi):                 # grid keys in by_rank[:c], ranks in order[h, :c]
            x = by_rank[P + r]
            if not x <= bound:
                continue
            g = grid_value(x, mode)
            if c == m:
                if g >= by_rank[m - 1]:         # an equal key of a higher rank comes later
                    continue
            else:
                c += 1
            i = c - 1
            while i > 0 and by_rank[i - 1] > g:
                by_rank[i] = by_rank[i - 1]
                order[h, i] = order[h, i - 1]
                i -= 1
            by_rank[i] = g
            order[h, i] = r
        for i in range(c):                      # ranks -> slots, then the grid keys beside them
            order[h, i] = np.int64(key[h, order[h, i]])
        for i in range(c):
            key[h, i] = by_rank[i]
        ptr[h] = c
        drop_h[h] = 0
    got = 0
    while got < n_total:
        best = -1
        for h in range(n_kv):
            d = drop_h[h]
            if d >= ptr[h] or count_l[h] + 1 - d <= floor:
                continue
            if best < 0:
                best = h
                continue
            db = drop_h[best]
            if key[h, d] < key[best, db] or (key[h, d] == key[best, db]
                                              and seq_l[h, order[h, d]] < seq_l[best, order[best, db]]):
                best = h
        if best < 0:
            break
        drop_h[best] += 1
        got += 1
    for h in range(n_kv):
        for i in range(drop_h[h]):
            key[h, i] = order[h, i]
    return got


@njit(cache=True, nogil=True, fastmath=False)
def choose_next(lay, st, prm, by_rank, s, victims, pend, pend_drop):
    """The next write's victims (policy_step's contract): one layer-wide selection (select_drops);
    prm: pool, floor, and the scratch low, order, ptr."""
    key_l, key_grid, drop_h, capacity, lazy, slack, max_drop, sinks, recent, reindexed, victims_rows, shift = st
    pool, width, floor, lam, by_rank_rows, s_rows, low, order, ptr, qhist = prm
    select_drops(pend, lay[AUX], lay[SEQ], lay[RANK], lay[COUNT], pool, by_rank, capacity, lazy, slack, max_drop, sinks,
                 recent, floor, key_grid, low, order, ptr, pend_drop)


class AdaKV(SnapKV):
    name = "adakv"
    ragged = True
    # the selection spans the layer's heads: once for the layer, after every head observed
    layer_step = staticmethod(bind_layer_step("adakv", choose_next, observe_head, per_head_choice=False))

    def __init__(self, kv, spec):
        super().__init__(kv, spec)
        self.n_kv = spec.n_head_kv
        self.order = np.zeros((self.n_kv, 0), np.int64)
        self.ptr = np.zeros(self.n_kv, np.int64)
        self.low = np.zeros(0, np.float64)
        self.floors: dict[int, int] = {}       # head_floor per layer capacity

    def head_floor(self, capacity: int) -> int:
        """Tokens every head keeps at least (Ada-KV's safeguard; never below what protection keeps)."""
        return max(math.ceil(self.kv.ada_floor * capacity), self.kv.sinks + self.kv.resolved_recent + 1)

    def head_slots(self, capacity: int, physical: int) -> int:
        """Slots per head: the most one head can hold while the others sit at their floor."""
        return self.n_kv * physical - (self.n_kv - 1) * min(self.head_floor(capacity), physical)

    def layer_floor(self, store, il: int) -> int:
        """head_floor of layer il's capacity (cached), with the selection's scratch sized for its slots."""
        P = store.seq[il].shape[1]
        if self.order.shape[1] < P:
            self.order = np.zeros((self.n_kv, P), np.int64)
            self.low = np.zeros(P, np.float64)
        cap = store.layer_capacity[il]
        floor = self.floors.get(cap)
        if floor is None:
            floor = self.floors[cap] = self.head_floor(cap)
        return floor

    def step_params(self, store, il):
        floor = self.layer_floor(store, il)
        return step_params(pool=self.kv.pool, width=self.kv.window, floor=floor, by_rank=self.rank_scratch(store, il),
                           low=self.low, order=self.order, ptr=self.ptr)

    def select(self, store, il: int) -> None:
        """Before a write into layer il: store.drop_h (n_kv,) <- how many victims each head gives in the
        layer-wide selection, store.key[h, :drop_h[h]] <- their slots (select_drops; GRID_GIVEN)."""
        kv = self.kv
        floor = self.layer_floor(store, il)
        select_drops(store.key, store.aux[il], store.seq[il], store.rank[il], store.count[il], kv.pool,
                     self.rank_scratch(store, il)[0], store.layer_capacity[il], kv.lazy, kv.slack, kv.max_drop,
                     store.layer_sinks[il], store.recent, floor, self.key_grid, self.low, self.order, self.ptr,
                     store.drop_h)
