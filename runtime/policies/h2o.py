"""`h2o` (Heavy-Hitter Oracle, Zhang et al. 2023): evict the token with the lowest attention mass
accumulated since it was inserted.

Per (layer, kv head): after each attention step, every held token's score grows by the softmax
weight it received, summed over the query heads of the GQA group; the new token's own weight counts
(it attended to itself). Prefill tokens accumulate exactly like decode tokens (token by token).
Accumulation is float64. Ties -> the older token. Default `recent` = capacity / 2: the paper's even
split between heavy hitters and the recent window.
"""
from __future__ import annotations

from numba import njit

from ringllm.runtime.eviction import GRID_LOG
from ringllm.runtime.kv_write import COUNT, SCORE
from ringllm.runtime.policies.base import Policy, accumulate_mass, choose_lowest_score, score_keys
from ringllm.runtime.policy_step import bind_layer_step


@njit(cache=True, nogil=True, fastmath=False)
def observe_head(lay, mass, q, seq_new, hq0, prm):
    """Every held token's score grows by the mass it just received."""
    accumulate_mass(lay[SCORE], mass, lay[COUNT])


class H2O(Policy):
    name = "h2o"
    needs_mass = True
    # the victims: the lowest accumulated mass, the slots' score
    layer_step = staticmethod(bind_layer_step("h2o", choose_lowest_score, observe_head))

    key_grid = GRID_LOG

    @staticmethod
    def default_recent(kv) -> int:
        """capacity / 2: the paper's even split between heavy hitters and the recent window."""
        return max(0, kv.capacity // 2)

    def fill_raw_keys(self, store, il, q, seq):
        score_keys(store, il)

    def observe(self, store, il, mass, seq):
        accumulate_mass(store.score[il], mass, store.count[il])
