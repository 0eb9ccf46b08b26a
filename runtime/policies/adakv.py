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
from ringllm.runtime.policies.base import grid_lowest_keys
from ringllm.runtime.policies.snapkv import SnapKV


@njit(cache=True, nogil=True)
def split_drops(key, seq_l, rank_l, count_l, n_total, sinks, recent, floor, order, ptr, drop_h):
    """drop_h[h] = how many of the layer's n_total victims head h gives, by one layer-wide selection.

    key (n_kv, P) f64 keys of the held slots (lowest goes), seq_l/rank_l (n_kv, P) i64, count_l
    (n_kv,) held before the write. A slot is a candidate when sinks <= rank < count - recent; a head
    keeps at least `floor` tokens after the new one enters. order (n_kv, >= n_total) i64 and ptr
    (n_kv,) i64 are scratch: each head's n_total lowest candidates are found first (no head gives
    more), O(n_total x held) per head, then merged. Victims are taken lowest key first, ties to the lower seq, then the lower head.
    Returns the number chosen (fewer than n_total only when too few candidates remain).
    """
    n_kv = count_l.shape[0]
    for h in range(n_kv):
        n = count_l[h]
        m = 0                            # head h's n_total lowest candidates, in (key, seq) order
        for i in range(n_total):
            best = -1
            for j in range(n):
                r = rank_l[h, j]
                if r < sinks or r >= n - recent:
                    continue
                if m > 0:                # strictly after the previous pick (seqs are unique per head)
                    p = order[h, m - 1]
                    if key[h, j] < key[h, p] or (key[h, j] == key[h, p] and seq_l[h, j] <= seq_l[h, p]):
                        continue
                if best < 0 or key[h, j] < key[h, best] or (key[h, j] == key[h, best] and seq_l[h, j] < seq_l[h, best]):
                    best = j
            if best < 0:
                break
            order[h, m] = best
            m += 1
        ptr[h] = m                       # candidates of head h
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

    def __init__(self, kv, spec):
        super().__init__(kv, spec)
        self.n_kv = spec.n_head_kv
        self.order = np.zeros((self.n_kv, 0), np.int64)
        self.ptr = np.zeros(self.n_kv, np.int64)

    def head_floor(self, capacity: int) -> int:
        """Tokens every head keeps at least (Ada-KV's safeguard; never below what protection keeps)."""
        return max(math.ceil(self.kv.ada_floor * capacity), self.kv.sinks + self.kv.resolved_recent + 1)

    def head_slots(self, capacity: int, physical: int) -> int:
        """Slots per head: the most one head can hold while the others sit at their floor."""
        return self.n_kv * physical - (self.n_kv - 1) * min(self.head_floor(capacity), physical)

    def fill_keys(self, store, il, q, seq):
        """SnapKV's keys, gridded only where the layer's selection of layer_drops victims can reach
        (grid_lowest_keys: no head gives more than the layer total)."""
        self.fill_raw_keys(store, il, q, seq)
        grid_lowest_keys(store.key, store.rank[il], store.count[il], self.layer_drops(store, il),
                         store.layer_sinks[il], store.recent, self.key_grid)

    def layer_drops(self, store, il: int) -> int:
        """Tokens the next write takes out of layer il over all heads (Algorithm 1 on the layer totals)."""
        kv, n = self.kv, self.n_kv
        held = int(store.count[il].sum()) + n
        return held - keep_after(held, store.layer_capacity[il] * n, kv.lazy * n, kv.slack * n, kv.max_drop * n)

    def split(self, store, il: int, n_total: int, drop_h: np.ndarray) -> None:
        """drop_h (n_kv,) i64 <- per-head victims of the layer-wide selection over store.key."""
        if self.order.shape[1] < n_total:
            self.order = np.zeros((self.n_kv, n_total), np.int64)
        split_drops(store.key, store.seq[il], store.rank[il], store.count[il], n_total, store.layer_sinks[il],
                    store.recent, self.head_floor(store.layer_capacity[il]), self.order, self.ptr, drop_h)
