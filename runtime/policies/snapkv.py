"""`snapkv` (Li et al. 2024) and `pyramidkv` (Cai et al. 2024): keep the tokens the last w queries
attended to most, scores max-pooled over neighbouring tokens.

SnapKV compresses once, after prefill, using the last w prompt queries as the observation window.
A bounded store cannot hold a long prompt whole, so here the same rule runs whenever tokens must
go (every step, or every `lazy` steps with staged eviction, which is SnapKV's batch compression):
the observation window is the last w queries seen (prompt or generated), each slot's score is the
attention mass it received from them (summed over the GQA group; kept per slot in the store's hist
ring, column = query index mod w), scores are max-pooled over `pool` neighbouring tokens in
sequence order (SnapKV's clustering, kernel 7 by default, the kernel clipped at the edges), and the lowest pooled score goes; ties -> the older token. The observation
window itself is protected: default recent = w. For a prompt that fits the store and a first
eviction right after it, this is exactly SnapKV.

PyramidKV: the same scores, with per-layer budgets falling linearly with depth from
2C - C/beta (first layer) to C/beta (last layer), C = capacity, so the mean budget is C; each
layer's budget is at least sinks + recent + 1.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ringllm.runtime.policies.base import Policy, grid_log_keys


@njit(cache=True, nogil=True)
def _record(hist_l, mass, count_l, col):
    for h in range(hist_l.shape[0]):
        for j in range(count_l[h]):
            hist_l[h, j, col] = mass[h, j]


@njit(cache=True, nogil=True, fastmath=True)
def _pooled_keys(key, hist_l, rank_l, count_l, pool, by_rank):
    """key[h, j] = max over tokens within pool//2 ranks of j of their window mass (float64).

    by_rank (2P,) f64 scratch: window masses in rank order, then their pooled maxima. fastmath: the
    w-term sums and the max passes vectorize (sums reassociated: float64 rounding, far below the
    key grid)."""
    half = pool // 2
    w = hist_l.shape[2]
    P = hist_l.shape[1]
    for h in range(hist_l.shape[0]):
        n = count_l[h]
        for j in range(n):
            acc = 0.0
            for i in range(w):
                acc += hist_l[h, j, i]
            by_rank[rank_l[h, j]] = acc
        for r in range(n):
            by_rank[P + r] = by_rank[r]
        for o in range(1, half + 1):            # neighbours o ranks away on either side
            for r in range(n - o):
                by_rank[P + r] = max(by_rank[P + r], by_rank[r + o])
            for r in range(o, n):
                by_rank[P + r] = max(by_rank[P + r], by_rank[r - o])
        for j in range(n):
            key[h, j] = by_rank[P + rank_l[h, j]]


class SnapKV(Policy):
    name = "snapkv"
    needs_mass = True

    def __init__(self, kv, spec):
        super().__init__(kv, spec)
        self.history_width = kv.window
        self.by_rank = np.zeros(0, np.float64)

    def fill_keys(self, store, il, q, seq):
        if self.by_rank.shape[0] < 2 * store.hist[il].shape[1]:
            self.by_rank = np.zeros(2 * store.hist[il].shape[1], np.float64)
        _pooled_keys(store.key, store.hist[il], store.rank[il], store.count[il], self.kv.pool, self.by_rank)
        grid_log_keys(store.key, store.count[il])

    def observe(self, store, il, mass, seq):
        _record(store.hist[il], mass, store.count[il], seq % self.kv.window)


class PyramidKV(SnapKV):
    name = "pyramidkv"

    def layer_budgets(self, capacity, n_layer):
        floor = self.kv.sinks + self.kv.resolved_recent + 1
        top = capacity / self.kv.pyramid_beta
        bottom = 2 * capacity - top
        if n_layer == 1:
            return [capacity]
        return [max(floor, int(round(bottom - (bottom - top) * il / (n_layer - 1)))) for il in range(n_layer)]
