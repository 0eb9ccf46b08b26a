"""`tova` (Token Omission Via Attention, Oren et al. 2024): evict the token with the lowest attention
weight from the latest query, averaged over all query heads of the layer.

One decision per layer: every kv head evicts the same token, so the heads' slot maps stay identical
(the store refills holes the same way in every head). The score of a slot is replaced (not
accumulated) after every attention step: sum over kv heads of the group-summed mass, / n_head.
No recent window by default (TOVA protects nothing but the new token).
"""
from __future__ import annotations

from numba import njit

from ringllm.runtime.eviction import GRID_LOG
from ringllm.runtime.policies.base import STEP_TOVA, Policy, score_keys


@njit(cache=True, nogil=True)
def latest_mean(score_l, mass, count_l, n_head):
    n_kv = score_l.shape[0]
    n = count_l[0]
    for j in range(n):
        acc = 0.0
        for h in range(n_kv):
            acc += mass[h, j]
        acc /= n_head
        for h in range(n_kv):
            score_l[h, j] = acc


class TOVA(Policy):
    name = "tova"
    needs_mass = True
    step_kind = STEP_TOVA

    key_grid = GRID_LOG

    def fill_raw_keys(self, store, il, q, seq):
        score_keys(store, il)

    def observe(self, store, il, mass, seq):
        latest_mean(store.score[il], mass, store.count[il], self.spec.n_head)
