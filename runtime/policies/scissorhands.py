"""`scissorhands` (Liu et al. 2023, "persistence of importance"): evict the token that was
unimportant most often over a history window.

Per (layer, kv head) and slot, aux holds one bit per step for the last `history` steps (<= 64): bit
set when the token's attention weight, averaged over the query heads of the GQA group, was below
1/n (n = tokens attended that step, the uniform share). The victim has the MOST set bits, i.e. the
lowest count of steps in which it was important (DESIGN.md's "lowest count ... below 1/n" read as
the paper's counter of unimportant steps, evicting the highest; written here so that nobody has to
guess). Ties -> the older token. Default `recent` = capacity / 4.
"""
from __future__ import annotations

from numba import njit

from ringllm.runtime.kv_write import AUX, COUNT
from ringllm.runtime.policies.base import Policy, popcount, step_params
from ringllm.runtime.policy_step import bind_layer_step, drops_ahead, pick_ahead


@njit(cache=True, nogil=True, fastmath=False)
def update_history(aux_l, mass, count_l, group, history):
    mask = (1 << history) - 1 if history < 64 else -1
    for h in range(aux_l.shape[0]):
        n = count_l[h]
        thresh = 1.0 / n
        for j in range(n):
            low = 1 if mass[h, j] / group < thresh else 0
            aux_l[h, j] = ((aux_l[h, j] << 1) | low) & mask


@njit(cache=True, nogil=True, fastmath=False)
def unimportant_keys(key, aux_l, count_l):
    for h in range(aux_l.shape[0]):
        for j in range(count_l[h]):
            key[h, j] = -popcount(aux_l[h, j])


@njit(cache=True, nogil=True, fastmath=False)
def choose_next(lay, st, prm, by_rank, s, victims, pend, pend_drop):
    """The next write's victims (policy_step's contract): the most steps unimportant."""
    n_drop = drops_ahead(lay, st, pend_drop)
    if n_drop > 0:
        unimportant_keys(st[0], lay[AUX], lay[COUNT])
        pick_ahead(lay, st, n_drop, victims, pend, pend_drop)


@njit(cache=True, nogil=True, fastmath=False)
def observe_head(lay, mass, q, seq_new, hq0, prm):
    """This step's bit of every held token's history (prm's width: the history length)."""
    count_l = lay[COUNT]
    update_history(lay[AUX], mass, count_l, q.shape[0] // count_l.shape[0], prm[1])


class Scissorhands(Policy):
    name = "scissorhands"
    needs_mass = True
    layer_step = staticmethod(bind_layer_step("scissorhands", choose_next, observe_head))

    @staticmethod
    def default_recent(kv) -> int:
        """capacity / 4."""
        return max(0, kv.capacity // 4)

    def step_params(self, store, il):
        return step_params(width=self.kv.history)

    def fill_keys(self, store, il, q, seq):
        unimportant_keys(store.key, store.aux[il], store.count[il])

    def observe(self, store, il, mass, seq):
        update_history(store.aux[il], mass, store.count[il], self.spec.n_head // self.spec.n_head_kv,
                       self.kv.history)
