"""`rkv` (R-KV, Cai et al. 2025): evict by importance combined with redundancy.

Importance I_j: the attention mass token j received from the last w queries (summed over the GQA
group; the store's hist ring, as for SnapKV), divided by the largest I in the head (so I in [0, 1]).
Redundancy R_j: the mean cosine similarity of key j (before RoPE) with the other keys the head
holds, in [-1, 1], computed as (k_j/|k_j|) . S - 1 over n - 1 with S the sum of the normalised held
keys (O(n d) per decision, not O(n^2 d)). S is kept by the store's write kernel as keys enter and
leave (store.ksum, exact integers in units of 2^-40 per component: S differs from the float sum by
at most n 2^-41 per component, R by < 1e-10, far below the key grid), and the slot's score keeps
1/|k_j|, measured when the key is written: one pass over the keys per decision. The slot's aux
keeps its window total, in fixed point as for SnapKV (runtime/policies/snapkv.py), so I_j = T_j / max T. Score Z_j = lambda I_j - (1 - lambda) R_j
(lambda = rkv_lambda, default 0.1 as in the paper): the victim has the lowest Z, i.e. it is unimportant and
repeats what other keys already say. Ties -> the older token. Default recent = w.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ringllm.runtime.eviction import GRID_ABS
from ringllm.runtime.key_sum import KEY_SUM_FIXED, key_sums
from ringllm.runtime.kv_codec import key_row
from ringllm.runtime.kv_write import AUX, COUNT, K, KOFF, KSUM, SCORE, SEQ
from ringllm.runtime.policies.base import Policy, step_params
from ringllm.runtime.policies.snapkv import check_window, observe_head, record_window, window_totals
from ringllm.runtime.policy_step import bind_layer_step, drops_ahead, pick_ahead


@njit(cache=True, nogil=True, fastmath=True)
def rkv_keys(key, k_l, koff, seq_l, tot_l, inv_l, count_l, ksum, lam, s):
    """key[h, j] = lam * I_j - (1 - lam) * R_j (module docstring); tot_l (n_kv, P) i64 the slots'
    window totals in fixed point (snapkv.record_window, kept by observe); inv_l (n_kv, P) f64 the
    slots' 1/|k_j| and ksum (n_kv, hd) i64 the sum of the held unit keys in units of 2^-40 (both kept
    by the store's write kernel, runtime/key_sum.py); s (hd,) f64 scratch. One pass over the keys
    (as the store decodes them). fastmath: the dot products vectorize (float64, reassociated; far
    below the key grid). koff (n_kv, hd) f32 and seq_l: the layer's key offsets and
    sequence indices (kv_codec.key_row)."""
    hd = ksum.shape[1]
    buf = np.empty(hd, np.float32)
    for h in range(k_l.shape[0]):
        n = count_l[h]
        for d in range(hd):
            s[d] = ksum[h, d] / KEY_SUM_FIXED
        top = 0.0
        for j in range(n):
            top = max(top, np.float64(tot_l[h, j]))
        top = 1.0 / top if top > 0 else 0.0
        for j in range(n):
            kj = key_row(k_l, koff, seq_l, h, j, buf)
            dot = 0.0
            for d in range(hd):
                dot += kj[d] * s[d]
            red = (dot * inv_l[h, j] - 1.0) / max(n - 1, 1)
            key[h, j] = lam * np.float64(tot_l[h, j]) * top - (1.0 - lam) * red


@njit(cache=True, nogil=True, fastmath=False)
def choose_next(lay, st, prm, by_rank, s, victims, pend, pend_drop):
    """The next write's victims (policy_step's contract): importance against redundancy (prm's lam)."""
    n_drop = drops_ahead(lay, st, pend_drop)
    if n_drop > 0:
        rkv_keys(st[0], lay[K], lay[KOFF], lay[SEQ], lay[AUX], lay[SCORE], lay[COUNT], lay[KSUM], prm[3], s)
        pick_ahead(lay, st, n_drop, victims, pend, pend_drop)


class RKV(Policy):
    name = "rkv"
    needs_mass = True
    # observe: the observation window of snapkv (its observe_head)
    layer_step = staticmethod(bind_layer_step("rkv", choose_next, observe_head))
    plain_keys = True        # redundancy is measured between keys before RoPE
    keeps_key_sum = True     # the write kernel keeps the sum of unit keys (store.ksum) and 1/|k| (score)

    @staticmethod
    def default_recent(kv) -> int:
        """The observation window is protected, as in snapkv: w, at most capacity - sinks - 1."""
        return max(0, min(kv.window, kv.capacity - kv.sinks - 1))

    def __init__(self, kv, spec):
        super().__init__(kv, spec)
        check_window(kv, spec)
        self.history_width = kv.window
        self.s = np.zeros((spec.n_head_kv, spec.head_dim), np.float64)    # rkv_keys' scratch, a row per kv head

    key_grid = GRID_ABS

    def step_params(self, store, il):
        return step_params(width=self.kv.window, lam=self.kv.rkv_lambda, s=self.s)

    def fill_raw_keys(self, store, il, q, seq):
        rkv_keys(store.key, store.k[il], store.koff[il], store.seq[il], store.aux[il], store.score[il],
                 store.count[il], store.ksum[il], self.kv.rkv_lambda, self.s[0])

    def observe(self, store, il, mass, seq):
        record_window(store.hist[il], store.aux[il], mass, store.count[il], seq % self.kv.window)

    def after_restore(self, store):
        for il in range(store.spec.n_layer):     # states saved before the window totals were kept in aux,
            window_totals(store.aux[il], store.hist[il], store.count[il])      # or before ksum: both rebuilt
            key_sums(store.ksum[il], store.k[il], store.koff[il], store.seq[il], store.score[il],   # (as was kept)
                     store.count[il])
