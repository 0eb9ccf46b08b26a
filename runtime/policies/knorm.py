"""`knorm` (Devoto et al. 2024, "A simple and effective L2 norm-based strategy"): evict the token
whose key has the largest L2 norm (low-norm keys draw the most attention).

The norm is of the key before RoPE (rotation does not change it anyway), after q/k norm where the
model has one, computed once at insert (float64 of float32 products) and compared on a log grid of
1/256 octave (0.27%): score = floor(256 log2(norm) + 0.5). The same token seen twice has the same key
up to float rounding (prefill's matrix kernels round row by row), so without the grid the order of
such twins would be decided by rounding noise; on the grid they tie and the older goes, in every
implementation alike. No attention needed.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ringllm.runtime.policies.base import Policy, copy_keys


@njit(cache=True, nogil=True, fastmath=False)
def _store_norms(score_l, count_l, k_pre):
    for h in range(score_l.shape[0]):
        acc = 0.0
        for d in range(k_pre.shape[1]):
            acc += np.float64(k_pre[h, d]) * np.float64(k_pre[h, d])
        score_l[h, count_l[h] - 1] = np.floor(256.0 * np.log2(np.sqrt(acc) + 1e-30) + 0.5)


class KNorm(Policy):
    name = "knorm"

    def fill_keys(self, store, il, q, seq):
        copy_keys(store.key, store.score[il], store.count[il], -1.0)

    def on_insert(self, store, il, k_pre, q_pre):
        _store_norms(store.score[il], store.count[il], k_pre)

    def on_replace(self, store, il, slots, k_pre):
        for i in range(k_pre.shape[0]):       # _store_norms writes at "count - 1": slot + 1 per head
            _store_norms(store.score[il], slots[:, i] + 1, k_pre[i])
