"""`snapkv` (Li et al. 2024) and `pyramidkv` (Cai et al. 2024): keep the tokens the last w queries
attended to most, scores max-pooled over neighbouring tokens.

SnapKV compresses once, after prefill, using the last w prompt queries as the observation window.
A bounded store cannot hold a long prompt whole, so here the same rule runs whenever tokens must
go (every step, or every `lazy` steps with staged eviction, which is SnapKV's batch compression):
the observation window is the last w queries seen (prompt or generated), each slot's score is the
attention mass it received from them (summed over the GQA group; kept per slot in the store's hist
ring, column = query index mod w, its total in the slot's score, taken as each column is written),
scores are max-pooled over `pool` neighbouring tokens in sequence order (SnapKV's clustering,
kernel 7 by default, the kernel clipped at the edges), and the lowest pooled score goes; ties ->
the older token. The observation window itself is protected: default recent = w. For a prompt
that fits the store and a first eviction right after it, this is exactly SnapKV.

PyramidKV: the same scores, with per-layer budgets falling linearly with depth from
2C - C/beta (first layer) to C/beta (last layer), C = capacity, so the mean budget is C; each
layer's budget is at least sinks + recent + 1.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ringllm.runtime.policies.base import GRID_LOG, Policy


@njit(cache=True, nogil=True, fastmath=True)
def _record_sums(hist_l, sums_l, mass, count_l, col):
    """hist[h, j, col] = mass[h, j] and sums[h, j] = the slot's window total hist[h, j, :] (float64),
    for the occupied slots. The total is taken here, where the row's cache lines are being written
    anyway, instead of re-reading the whole (n_kv, P, w) window when keys are needed. fastmath: the
    w-term sums vectorize (reassociated: float64 rounding, far below the key grid)."""
    w = hist_l.shape[2]
    for h in range(hist_l.shape[0]):
        for j in range(count_l[h]):
            m = mass[h, j]
            acc = 0.0
            for i in range(w):       # the row as it will be, summed before the store (no store-to-load stall)
                acc += m if i == col else hist_l[h, j, i]
            hist_l[h, j, col] = m
            sums_l[h, j] = acc


@njit(cache=True, nogil=True, fastmath=True)
def _pooled_keys(key, sums_l, rank_l, count_l, pool, by_rank):
    """key[h, j] = max over tokens within pool//2 ranks of j of their window mass sums_l (float64).

    by_rank (2P,) f64 scratch: window masses in rank order, then their pooled maxima."""
    half = pool // 2
    P = sums_l.shape[1]
    for h in range(sums_l.shape[0]):
        n = count_l[h]
        for j in range(n):
            by_rank[rank_l[h, j]] = sums_l[h, j]
        for r in range(n):
            by_rank[P + r] = by_rank[r]
        for o in range(1, half + 1):            # neighbours o ranks away on either side
            for r in range(n - o):
                by_rank[P + r] = max(by_rank[P + r], by_rank[r + o])
            for r in range(o, n):
                by_rank[P + r] = max(by_rank[P + r], by_rank[r - o])
        for j in range(n):
            key[h, j] = by_rank[P + rank_l[h, j]]


@njit(cache=True, nogil=True, fastmath=True)
def _window_sums(sums_l, hist_l, count_l):
    """sums[h, j] = hist[h, j, :] summed (float64), as _record_sums leaves it."""
    w = hist_l.shape[2]
    for h in range(hist_l.shape[0]):
        for j in range(count_l[h]):
            acc = 0.0
            for i in range(w):
                acc += hist_l[h, j, i]
            sums_l[h, j] = acc


class SnapKV(Policy):
    name = "snapkv"
    needs_mass = True

    def __init__(self, kv, spec):
        super().__init__(kv, spec)
        self.history_width = kv.window
        self.by_rank = np.zeros(0, np.float64)

    key_grid = GRID_LOG

    def fill_raw_keys(self, store, il, q, seq):
        if self.by_rank.shape[0] < 2 * store.hist[il].shape[1]:
            self.by_rank = np.zeros(2 * store.hist[il].shape[1], np.float64)
        _pooled_keys(store.key, store.score[il], store.rank[il], store.count[il], self.kv.pool, self.by_rank)

    def observe(self, store, il, mass, seq):
        _record_sums(store.hist[il], store.score[il], mass, store.count[il], seq % self.kv.window)

    def after_restore(self, store):
        for il in range(store.spec.n_layer):     # a state saved before the window totals were kept in score
            _window_sums(store.score[il], store.hist[il], store.count[il])


class PyramidKV(SnapKV):
    name = "pyramidkv"

    def layer_budgets(self, capacity, n_layer):
        floor = self.kv.sinks + self.kv.resolved_recent + 1
        top = capacity / self.kv.pyramid_beta
        bottom = 2 * capacity - top
        if n_layer == 1:
            return [capacity]
        return [max(floor, int(round(bottom - (bottom - top) * il / (n_layer - 1)))) for il in range(n_layer)]
