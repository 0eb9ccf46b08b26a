"""`rkv` (R-KV, Cai et al. 2025): evict by importance combined with redundancy.

Importance I_j: the attention mass token j received from the last w queries (summed over the GQA
group; the store's hist ring, as for SnapKV), divided by the largest I in the head (so I in [0, 1]).
Redundancy R_j: the mean cosine similarity of key j (before RoPE) with the other keys the head
holds, in [-1, 1], computed as (k_j/|k_j|) . S - 1 over n - 1 with S the sum of the normalised held
keys (O(n d) per decision, not O(n^2 d); 1/|k_j| is computed once, at insertion, and kept in the
slot's score). Score Z_j = lambda I_j - (1 - lambda) R_j (lambda =
rkv_lambda, default 0.1 as in the paper): the victim has the lowest Z, i.e. it is unimportant and
repeats what other keys already say. Ties -> the older token. Default recent = w.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ringllm.runtime.policies.base import GRID_ABS, Policy
from ringllm.runtime.policies.snapkv import _record


@njit(cache=True, nogil=True)
def _inverse_norms(inv_l, k_l, count_l):
    """inv_l[h, n-1] = 1 / |k| of the newest key of every head (float64), kept with the slot."""
    hd = k_l.shape[2]
    for h in range(k_l.shape[0]):
        j = count_l[h] - 1
        nrm = 0.0
        for d in range(hd):
            nrm += np.float64(k_l[h, j, d]) * k_l[h, j, d]
        inv_l[h, j] = 1.0 / max(np.sqrt(nrm), 1e-30)


@njit(cache=True, nogil=True, fastmath=True)
def _rkv_keys(key, k_l, inv_l, hist_l, count_l, lam, s):
    """key[h, j] = lam * I_j - (1 - lam) * R_j (module docstring); inv_l (n_kv, P) f64 the keys'
    inverse norms (_inverse_norms at insertion); s (hd,) f64 scratch. fastmath: the sums over the
    window and the dot products vectorize (float64, reassociated; far below the key grid)."""
    hd = k_l.shape[2]
    w = hist_l.shape[2]
    for h in range(k_l.shape[0]):
        n = count_l[h]
        for d in range(hd):
            s[d] = 0.0
        top = 0.0
        for j in range(n):
            inv = inv_l[h, j]
            for d in range(hd):
                s[d] += k_l[h, j, d] * inv
            imp = 0.0
            for i in range(w):
                imp += hist_l[h, j, i]
            key[h, j] = imp                   # importance, normalised below
            top = max(top, imp)
        top = 1.0 / top if top > 0 else 0.0
        for j in range(n):
            dot = 0.0
            for d in range(hd):
                dot += k_l[h, j, d] * s[d]
            red = (dot * inv_l[h, j] - 1.0) / max(n - 1, 1)
            key[h, j] = lam * key[h, j] * top - (1.0 - lam) * red


class RKV(Policy):
    name = "rkv"
    needs_mass = True
    plain_keys = True        # redundancy is measured between keys before RoPE

    def __init__(self, kv, spec):
        super().__init__(kv, spec)
        self.history_width = kv.window
        self.s = np.zeros(spec.head_dim, np.float64)

    key_grid = GRID_ABS

    def fill_raw_keys(self, store, il, q, seq):
        _rkv_keys(store.key, store.k[il], store.score[il], store.hist[il], store.count[il], self.kv.rkv_lambda, self.s)

    def on_insert(self, store, il, k_pre, q_pre):
        _inverse_norms(store.score[il], store.k[il], store.count[il])   # score: 1/|k|, moves with the slot

    def observe(self, store, il, mass, seq):
        _record(store.hist[il], mass, store.count[il], seq % self.kv.window)
