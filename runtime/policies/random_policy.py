"""`random`: evict a uniformly random unprotected token (a control for the other policies).

Seeded and reproducible without a generator state: at each eviction every candidate draws
key = splitmix64(seed, layer, kv head, new token's index, candidate's index) / 2^64 and the lowest
goes, so each eviction is a fresh uniform draw and any implementation (the NumPy reference, a
restored session) reproduces it exactly.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ringllm.runtime.policies.base import Policy

_MASK = (1 << 64) - 1


@njit(cache=True, nogil=True, fastmath=False)
def splitmix64(x):
    """One splitmix64 output for state x (uint64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@njit(cache=True, nogil=True, fastmath=False)
def _random_keys(key, seq_l, count_l, seed, il, seq_new):
    for h in range(seq_l.shape[0]):
        base = splitmix64(splitmix64(splitmix64(np.uint64(seed)) ^ np.uint64(il * 1024 + h)) ^ np.uint64(seq_new))
        for j in range(count_l[h]):
            key[h, j] = np.float64(splitmix64(base ^ np.uint64(seq_l[h, j])) >> np.uint64(11)) * (1.0 / 9007199254740992.0)


class Random(Policy):
    name = "random"

    def fill_keys(self, store, il, q, seq):
        _random_keys(store.key, store.seq[il], store.count[il], self.kv.seed, il, seq)
