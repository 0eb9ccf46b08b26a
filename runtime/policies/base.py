"""The interface every eviction policy implements, and kernels several policies share.

A policy owns no per-slot state of its own: what it remembers about a token lives in the store's
per-slot arrays score (f64), aux (i64) and hist (f32, w wide), which move with the token when its
slot is refilled. The engine calls, per layer and token:

    store.write(il, k, v, seq, q)      -> policy.fill_keys(store, il, q, seq) when tokens must go
    policy.on_insert(store, il, k_pre, q_pre)   the new token sits in slot count - 1
    attention (emits per-slot mass only when policy.needs_mass)
    policy.observe(store, il, mass, seq)

fill_keys writes store.key[h, :count[h]]: the lowest keys among unprotected slots are evicted,
ties going to the older token (eviction.choose_victims), compared on the grid the policy names
(key_grid; see runtime/eviction.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ringllm.runtime.eviction import GRID_NONE, grid_keys
from ringllm.runtime.kv_write import COUNT, SCORE
from ringllm.runtime.policy_step import drops_ahead, pick_ahead

_NO_F64 = np.zeros(0, np.float64)
_NO_I64 = np.zeros(0, np.int64)
_NO_ROWS = np.zeros((0, 0), np.float64)
_NO_ORDER = np.zeros((0, 0), np.int64)
_NO_QHIST = np.zeros((0, 0, 0), np.float32)


class Policy:
    """Base: streaming order (oldest first), no attention needed, no per-slot state."""

    name = "base"
    needs_mass = False        # the attention kernel must emit per-slot mass for observe()
    history_width = 0         # window entries per slot in the store's hist array
    ragged = False            # heads may hold different numbers of tokens (adakv: select, head_slots)
    key_grid = GRID_NONE      # fill_keys = fill_raw_keys, then the keys mapped onto this grid (see grid_value)
    plain_keys = False        # reads store.k expecting keys before RoPE: the layer keeps the "fused" layout
    keeps_key_sum = False     # the write kernel keeps store.ksum (sum of unit keys per head), score = 1/|k|
    # the policy's compiled layer step (policy_step.bind_layer_step: victims, write, attention and
    # observe in one call per layer and token), or None: the engine then runs the policy's Python
    # methods around policy_step.policy_write_attend
    layer_step = None

    def __init__(self, kv, spec):
        self.kv, self.spec = kv, spec

    @staticmethod
    def default_recent(kv) -> int:
        """Newest held tokens protected when KVConfig.recent is None (KVConfig.resolved_recent); kv is
        the config, validated up to its recent window. 0 (none protected) by default."""
        return 0

    def layer_budgets(self, capacity: int, n_layer: int) -> list[int]:
        """Tokens kept per layer after pruning (PyramidKV overrides)."""
        return [capacity] * n_layer

    def extra_shape(self) -> tuple:
        """Shape of the store's per-layer `extra` array (state that is not per slot)."""
        return (0,)

    def stats(self) -> dict:
        """Policy figures for KVStore.stats() (e.g. the budgets GVote chose)."""
        return {}

    def fill_keys(self, store, il: int, q, seq: int):
        """Fill store.key for the held slots of layer il; may return a number of tokens to drop larger
        than the capacity asks for (adaptive budgets), else None."""
        wanted = self.fill_raw_keys(store, il, q, seq)
        grid_keys(store.key, store.count[il], self.key_grid)
        return wanted

    def fill_raw_keys(self, store, il: int, q, seq: int):
        """fill_keys before the keys are mapped onto the grid: the store's write kernel grids only the
        keys within one cell of the minimum when it picks a single victim (eviction.choose_one)."""
        seq_keys(store.key, store.seq[il], store.count[il])

    def on_insert(self, store, il: int, k_pre: np.ndarray, q_pre: np.ndarray) -> None:
        pass

    def on_replace(self, store, il: int, slots: np.ndarray, k_pre: np.ndarray) -> None:
        """on_insert for the tokens KVStore.replace_many put in slots (n_kv, m) of layer il, keys
        k_pre (m, n_kv, hd) before RoPE: the per-slot state a policy computes from a key at insert."""

    def observe(self, store, il: int, mass: np.ndarray, seq: int) -> None:
        pass

    def after_restore(self, store) -> None:
        """Rebuild derived per-slot state after KVStore.restore (a state saved by an older version)."""

    def step_params(self, store, il: int) -> tuple:
        """The policy's `prm` of its layer_step for layer il (policy_step's argument groups), in order:
        (pool, width, floor, lam, by_rank, s, low, order, ptr, qhist); what a policy does not use is
        0 or an empty array of the same type (one compiled signature for every policy)."""
        return step_params()


def step_params(pool: int = 0, width: int = 0, floor: int = 0, lam: float = 0.0, by_rank=_NO_ROWS, s=_NO_ROWS,
                low=_NO_F64, order=_NO_ORDER, ptr=_NO_I64, qhist=_NO_QHIST) -> tuple:
    """Policy.step_params' tuple: pool (snapkv family's pooling kernel), width (window w, or
    scissorhands' history), floor (adakv's head floor), lam (rkv's lambda), scratch by_rank (n_kv, 2P)
    f64, s (n_kv, hd) f64 (a row per kv head), low (P,) f64, order (n_kv, P) i64, ptr (n_kv,) i64,
    qhist (gvote's query history, store.extra[il], (n_head, w, hd) f32)."""
    return (int(pool), int(width), int(floor), float(lam), by_rank, s, low, order, ptr, qhist)


@njit(cache=True, nogil=True, fastmath=False)
def popcount(x):
    """Set bits of an int64 (Kernighan)."""
    c = 0
    while x:
        x &= x - 1
        c += 1
    return c


@njit(cache=True, nogil=True, fastmath=False)
def seq_keys(key, seq_l, count_l):
    """key[h, j] = sequence index: the oldest unprotected token goes first."""
    for h in range(seq_l.shape[0]):
        for j in range(count_l[h]):
            key[h, j] = seq_l[h, j]


@njit(cache=True, nogil=True, fastmath=False)
def copy_keys(key, score_l, count_l, sign):
    """key[h, j] = sign * score[h, j] for occupied slots."""
    for h in range(score_l.shape[0]):
        for j in range(count_l[h]):
            key[h, j] = sign * score_l[h, j]


def score_keys(store, il: int) -> None:
    """store.key <- the slots' scores (h2o's accumulated mass, tova's latest weight), raw."""
    copy_keys(store.key, store.score[il], store.count[il], 1.0)


@njit(cache=True, nogil=True, fastmath=False)
def accumulate_mass(score_l, mass, count_l):
    """score[h, j] += mass[h, j] (float64 accumulation) for occupied slots."""
    for h in range(score_l.shape[0]):
        for j in range(count_l[h]):
            score_l[h, j] += mass[h, j]


@njit(cache=True, nogil=True, fastmath=False)
def choose_lowest_score(lay, st, prm, by_rank, s, victims, pend, pend_drop):
    """choose_next (policy_step's contract) of the policies whose key is the slot's score itself (h2o's
    accumulated mass, tova's latest weight): the lowest scores go."""
    n_drop = drops_ahead(lay, st, pend_drop)
    if n_drop > 0:
        copy_keys(st[0], lay[SCORE], lay[COUNT], 1.0)
        pick_ahead(lay, st, n_drop, victims, pend, pend_drop)
