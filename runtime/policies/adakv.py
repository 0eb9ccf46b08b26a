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

from ringllm.runtime.kv_config import keep_after
from ringllm.runtime.policies.base import STEP_ADAKV, grid_cell_bound, grid_value, step_params
from ringllm.runtime.policies.snapkv import SnapKV, pooled_keys


@njit(cache=True, nogil=True)
def select_drops(key, tot_l, seq_l, rank_l, count_l, pool, by_rank, capacity, lazy, slack, max_drop, sinks, recent,
                 floor, mode, low, order, ptr, drop_h):
    """drop_h[h] = how many of the layer's n_total victims head h gives, by one layer-wide selection,
    in one call over the layer's scores: SnapKV's pooled keys, each head's candidates, the merge.

    n_total: staged eviction (kv_config.keep_after) on the layer totals, the held tokens of all
    heads plus the n_kv entering, with capacity, lazy, slack, max_drop (per head) times n_kv.

    tot_l (n_kv, P) i64 window mass totals in fixed point (snapkv.record_window), seq_l/rank_l (n_kv, P) i64, count_l (n_kv,) held
    before the write, pool/by_rank as snapkv.pooled_keys. A slot is a candidate when
    sinks <= rank < count - recent; a head keeps at least `floor` tokens after the new one enters.
    Victims are taken lowest grid key (grid `mode`, policies.base.grid_value) first, ties to the
    lower seq, then the lower head. Per head, only the n_total lowest candidates can be taken (no
    head gives more than the layer): they are found among the slots within a grid cell of the
    n_total-th lowest raw key (the grid, a log2, is computed for those only), sorted by
    insertion. key (n_kv, P) f64 is left holding those slots' grid keys and +inf elsewhere, so
    kv_store.choose_victims(drop_h[h]) on it picks exactly the victims chosen here. Scratch: low
    (P,) f64, order (n_kv, P) i64 (each head's candidates in order), ptr (n_kv,) i64. Returns the
    number chosen (fewer than n_total only when too few candidates remain).
    """
    n_kv = count_l.shape[0]
    held = n_kv
    for h in range(n_kv):
        held += count_l[h]
    n_total = held - keep_after(held, capacity * n_kv, lazy * n_kv, slack * n_kv, max_drop * n_kv)
    if n_total <= 0:
        drop_h[:] = 0
        return 0
    pooled_keys(key, tot_l, rank_l, count_l, pool, by_rank)
    for h in range(n_kv):
        n = count_l[h]
        m = 0                                   # the m <= n_total lowest raw keys, ascending
        for j in range(n):
            r = rank_l[h, j]
            if r < sinks or r >= n - recent:
                continue
            x = key[h, j]
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
        c = 0                                   # head h's m lowest candidates by (grid key, seq)
        for j in range(n):
            x = key[h, j]
            if not x <= bound:
                key[h, j] = np.inf
                continue
            g = grid_value(x, mode)
            key[h, j] = g
            r = rank_l[h, j]
            if r < sinks or r >= n - recent:
                continue
            s = seq_l[h, j]
            if c == m:
                p = order[h, m - 1]
                if g > key[h, p] or (g == key[h, p] and s > seq_l[h, p]):
                    continue
            else:
                c += 1
            i = c - 1
            while i > 0:
                p = order[h, i - 1]
                if key[h, p] < g or (key[h, p] == g and seq_l[h, p] < s):
                    break
                order[h, i] = p
                i -= 1
            order[h, i] = j
        ptr[h] = c
        drop_h[h] = 0
    got = 0
    while got < n_total:
        best = -1
        for h in range(n_kv):
            d = drop_h[h]
            if d >= ptr[h] or count_l[h] + 1 - d <= floor:
                continue
            j = order[h, d]
            if best < 0:
                best = h
                continue
            jb = order[best, drop_h[best]]
            if key[h, j] < key[best, jb] or (key[h, j] == key[best, jb] and seq_l[h, j] < seq_l[best, jb]):
                best = h
        if best < 0:
            break
        drop_h[best] += 1
        got += 1
    return got


class AdaKV(SnapKV):
    name = "adakv"
    ragged = True
    step_kind = STEP_ADAKV

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
        """Before a write into layer il: store.drop_h (n_kv,) <- each head's victims of the
        layer-wide selection, store.key <- keys that make choose_victims pick them (select_drops)."""
        kv = self.kv
        floor = self.layer_floor(store, il)
        select_drops(store.key, store.aux[il], store.seq[il], store.rank[il], store.count[il], kv.pool,
                     self.rank_scratch(store, il), store.layer_capacity[il], kv.lazy, kv.slack, kv.max_drop,
                     store.layer_sinks[il], store.recent, floor, self.key_grid, self.low, self.order, self.ptr,
                     store.drop_h)
