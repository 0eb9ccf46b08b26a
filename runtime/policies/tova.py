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
from ringllm.runtime.kv_write import COUNT, SCORE
from ringllm.runtime.policies.base import Policy, choose_lowest_score, score_keys
from ringllm.runtime.policy_step import bind_layer_step


@njit(cache=True, nogil=True, fastmath=False)
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


@njit(cache=True, nogil=True, fastmath=False)
def observe_head(lay, mass, q, seq_new, hq0, prm):
    """Nothing per head: the score is a mean over every head (observe_layer)."""


@njit(cache=True, nogil=True, fastmath=False)
def observe_layer(lay, mass, q, prm):
    """Every slot's score becomes the latest query's weight on it, averaged over the query heads."""
    latest_mean(lay[SCORE], mass, lay[COUNT], q.shape[0])


class TOVA(Policy):
    name = "tova"
    needs_mass = True
    # the victims: the lowest mean weight (the slots' score); the mean couples the heads, so one
    # choice for the layer after every head attended
    layer_step = staticmethod(bind_layer_step("tova", choose_lowest_score, observe_head, observe_layer,
                                              per_head_choice=False))

    key_grid = GRID_LOG

    def fill_raw_keys(self, store, il, q, seq):
        score_keys(store, il)

    def observe(self, store, il, mass, seq):
        latest_mean(store.score[il], mass, store.count[il], self.spec.n_head)
