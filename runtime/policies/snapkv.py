"""`snapkv` (Li et al. 2024) and `pyramidkv` (Cai et al. 2024): keep the tokens the last w queries
attended to most, scores max-pooled over neighbouring tokens.

SnapKV compresses once, after prefill, using the last w prompt queries as the observation window.
A bounded store cannot hold a long prompt whole, so here the same rule runs whenever tokens must
go (every step, or every `lazy` steps with staged eviction, which is SnapKV's batch compression):
the observation window is the last w queries seen (prompt or generated), each slot's score is the
attention mass it received from them (summed over the GQA group; kept per slot in the store's hist
ring, column = query index mod w, its total in the slot's aux, moved as each column is written),
scores are max-pooled over `pool` neighbouring tokens in sequence order (SnapKV's clustering,
kernel 7 by default, the kernel clipped at the edges), and the lowest pooled score goes; ties ->
the older token. The observation window itself is protected: default recent = w. For a prompt
that fits the store and a first eviction right after it, this is exactly SnapKV.

PyramidKV: the same scores, with per-layer budgets falling linearly with depth from
2C - C/beta (first layer) to C/beta (last layer), C = capacity, so the mean budget is C; each
layer's budget is at least sinks + recent + 1.

Window totals are fixed point: each entry counts as round(mass x 2^48) (int64; a total is exact
whatever the order of the sums, so observe moves it by the new entry minus the replaced one and
reads one column, not the whole row). Masses below 2^-49 (1.8e-15) count as 0: tokens whose
window total is that small tie, and the older goes. A total must fit int64: window x GQA group
<= 16384 (checked at construction).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ringllm.runtime.errors import ConfigError
from ringllm.runtime.eviction import GRID_LOG
from ringllm.runtime.kv_write import AUX, COUNT, HIST, RANK
from ringllm.runtime.policies.base import Policy, step_params
from ringllm.runtime.policy_step import bind_layer_step, drops_ahead, pick_ahead


MASS_FIXED = 2.0 ** 48     # window totals are kept in fixed point, units of 2^-48 (module docstring)


def check_window(kv, spec) -> None:
    """A window total must fit int64: w entries of at most `group` (one GQA group's weights) each."""
    group = spec.n_head // spec.n_head_kv
    if kv.window * group > 2 ** 14:
        raise ConfigError(f"window {kv.window} x GQA group {group} exceeds 16384: the fixed-point window "
                          f"totals would overflow; use window <= {2 ** 14 // group}")


@njit(cache=True, nogil=True, inline="always")
def mass_fixed(m):
    """An attention mass (f32 >= 0) in fixed point: round(m x 2^48) as int64."""
    return np.int64(np.floor(np.float64(m) * MASS_FIXED + 0.5))


@njit(cache=True, nogil=True, fastmath=False)
def record_window(hist_l, tot_l, mass, count_l, col):
    """hist[h, col, j] = mass[h, j] and tot[h, j] (int64) = the slot's window total in fixed point,
    for the occupied slots: the total moves by the new entry minus the one it replaces. Integer
    sums are exact, so this equals window_totals' sum of the slot's whole window, in any order, for
    ever. hist (n_kv, w, P) is window-major: the column read and written here is contiguous."""
    for h in range(hist_l.shape[0]):
        for j in range(count_l[h]):
            m = mass[h, j]
            tot_l[h, j] += mass_fixed(m) - mass_fixed(hist_l[h, col, j])
            hist_l[h, col, j] = m


@njit(cache=True, nogil=True, fastmath=False)
def window_totals(tot_l, hist_l, count_l):
    """tot[h, j] = sum over the slot's window hist[h, :, j] of mass_fixed (as record_window keeps it)."""
    for h in range(hist_l.shape[0]):
        for j in range(count_l[h]):
            tot_l[h, j] = 0
        for i in range(hist_l.shape[1]):
            for j in range(count_l[h]):
                tot_l[h, j] += mass_fixed(hist_l[h, i, j])


@njit(cache=True, nogil=True, inline="always")
def pool_ranks(by_rank, n, P, half):
    """by_rank[P + r] = max of by_rank[r - half .. r + half] (clipped to [0, n)) for r < n: the
    window masses of one head in rank order, max-pooled over neighbouring tokens."""
    for r in range(n):
        by_rank[P + r] = by_rank[r]
    for o in range(1, half + 1):            # neighbours o ranks away on either side
        for r in range(n - o):
            by_rank[P + r] = max(by_rank[P + r], by_rank[r + o])
        for r in range(o, n):
            by_rank[P + r] = max(by_rank[P + r], by_rank[r - o])


@njit(cache=True, nogil=True, fastmath=True)
def pooled_keys(key, tot_l, rank_l, count_l, pool, by_rank):
    """key[h, j] = max over tokens within pool//2 ranks of j of their window mass totals, tot_l
    (n_kv, P) int64 in fixed point (record_window), as float64 (tot x 2^-48, exact below 2^53).

    by_rank (2P,) f64 scratch: window masses in rank order, then their pooled maxima."""
    half = pool // 2
    P = tot_l.shape[1]
    for h in range(tot_l.shape[0]):
        n = count_l[h]
        for j in range(n):
            by_rank[rank_l[h, j]] = np.float64(tot_l[h, j]) * (1.0 / MASS_FIXED)
        pool_ranks(by_rank, n, P, half)
        for j in range(n):
            key[h, j] = by_rank[P + rank_l[h, j]]


@njit(cache=True, nogil=True, fastmath=False)
def choose_next(lay, st, prm, by_rank, s, victims, pend, pend_drop):
    """The next write's victims (policy_step's contract): the lowest pooled window mass (prm's pool)."""
    n_drop = drops_ahead(lay, st, pend_drop)
    if n_drop > 0:
        pooled_keys(st[0], lay[AUX], lay[RANK], lay[COUNT], prm[0], by_rank)
        pick_ahead(lay, st, n_drop, victims, pend, pend_drop)


@njit(cache=True, nogil=True, fastmath=False)
def observe_head(lay, mass, q, seq_new, hq0, prm):
    """The step's mass enters the observation window (prm's width: w), column seq_new mod w."""
    record_window(lay[HIST], lay[AUX], mass, lay[COUNT], seq_new % prm[1])


class SnapKV(Policy):
    name = "snapkv"
    needs_mass = True
    layer_step = staticmethod(bind_layer_step("snapkv", choose_next, observe_head))

    @staticmethod
    def default_recent(kv) -> int:
        """The observation window itself is protected: w, at most capacity - sinks - 1."""
        return max(0, min(kv.window, kv.capacity - kv.sinks - 1))

    def __init__(self, kv, spec):
        super().__init__(kv, spec)
        check_window(kv, spec)
        self.history_width = kv.window
        self.by_rank = np.zeros((spec.n_head_kv, 0), np.float64)

    key_grid = GRID_LOG

    def rank_scratch(self, store, il) -> np.ndarray:
        """pooled_keys' by_rank scratch, (n_kv, 2P) f64 for layer il's P slots per head: a row per kv
        head (the compiled step runs heads on separate threads; one-thread callers use row 0)."""
        if self.by_rank.shape[1] < 2 * store.seq[il].shape[1]:
            self.by_rank = np.zeros((self.by_rank.shape[0], 2 * store.seq[il].shape[1]), np.float64)
        return self.by_rank

    def step_params(self, store, il):
        return step_params(pool=self.kv.pool, width=self.kv.window, by_rank=self.rank_scratch(store, il))

    def fill_raw_keys(self, store, il, q, seq):
        pooled_keys(store.key, store.aux[il], store.rank[il], store.count[il], self.kv.pool,
                    self.rank_scratch(store, il)[0])

    def observe(self, store, il, mass, seq):
        record_window(store.hist[il], store.aux[il], mass, store.count[il], seq % self.kv.window)

    def after_restore(self, store):
        for il in range(store.spec.n_layer):     # a state saved before the window totals were kept in aux
            window_totals(store.aux[il], store.hist[il], store.count[il])


class PyramidKV(SnapKV):
    name = "pyramidkv"

    def layer_budgets(self, capacity, n_layer):
        floor = self.kv.sinks + self.kv.resolved_recent + 1
        top = capacity / self.kv.pyramid_beta
        bottom = 2 * capacity - top
        if n_layer == 1:
            return [capacity]
        return [max(floor, int(round(bottom - (bottom - top) * il / (n_layer - 1)))) for il in range(n_layer)]
