"""`lsh` (LSH-E, the seed): evict the token whose key's SimHash code is farthest, in Hamming
distance, from the current query's code.

SimHash: c = lsh_bits signed random projections, R (c, head_dim) ~ N(0, 1) drawn per layer from
numpy's default_rng(seed + layer); bit i of a vector x is 1 when (R x)_i > 0; the c bits are packed
into one int64 (bit i = 1 << i). Codes are of keys and queries before RoPE (positions are re-indexed
over a stream, so a code of a rotated key would go stale); a key's code is computed once, at insert,
and kept in the slot's aux. The distance of a slot is summed over the query heads of its GQA group.
Ties -> the older token. The paper protects the first 4 and the last 10 tokens: defaults sinks 4,
recent 10. No attention mass needed.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ringllm.runtime.policies.base import Policy, popcount


@njit(cache=True, nogil=True, fastmath=False)
def simhash_rows(out, x, proj):
    """out (R,) i64 = packed sign bits of proj (c, d) @ x[r] (d,) for each row r of x (R, d)."""
    c, d = proj.shape
    for r in range(x.shape[0]):
        code = 0
        for i in range(c):
            acc = np.float32(0.0)
            for t in range(d):
                acc += proj[i, t] * x[r, t]
            if acc > 0:
                code |= 1 << i
        out[r] = code


@njit(cache=True, nogil=True, fastmath=False)
def _hamming_keys(key, aux_l, count_l, q_codes, group):
    for h in range(aux_l.shape[0]):
        for j in range(count_l[h]):
            dist = 0
            for g in range(group):
                dist += popcount(q_codes[h * group + g] ^ aux_l[h, j])
            key[h, j] = -dist


@njit(cache=True, nogil=True, fastmath=False)
def _store_codes(aux_l, count_l, codes):
    for h in range(aux_l.shape[0]):
        aux_l[h, count_l[h] - 1] = codes[h]


def projection(seed: int, il: int, bits: int, head_dim: int) -> np.ndarray:
    """The SimHash projection of layer il: (bits, head_dim) float32."""
    return np.random.default_rng(seed + il).standard_normal((bits, head_dim)).astype(np.float32)


class LSH(Policy):
    name = "lsh"

    @staticmethod
    def default_recent(kv) -> int:
        """10, as in the paper."""
        return 10

    def __init__(self, kv, spec):
        super().__init__(kv, spec)
        self.proj = [projection(kv.seed, il, kv.lsh_bits, spec.head_dim) for il in range(spec.n_layer)]
        self.q_codes = np.zeros(spec.n_head, np.int64)
        self.k_codes = np.zeros(spec.n_head_kv, np.int64)

    def fill_keys(self, store, il, q, seq):
        simhash_rows(self.q_codes, q, self.proj[il])
        _hamming_keys(store.key, store.aux[il], store.count[il], self.q_codes, self.spec.n_head // self.spec.n_head_kv)

    def on_insert(self, store, il, k_pre, q_pre):
        simhash_rows(self.k_codes, k_pre, self.proj[il])
        _store_codes(store.aux[il], store.count[il], self.k_codes)

    def on_replace(self, store, il, slots, k_pre):
        for i in range(k_pre.shape[0]):       # _store_codes writes at "count - 1": slot + 1 per head
            simhash_rows(self.k_codes, np.ascontiguousarray(k_pre[i]), self.proj[il])
            _store_codes(store.aux[il], slots[:, i] + 1, self.k_codes)
