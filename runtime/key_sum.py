"""Per-head sum of the held unit keys, kept exactly as keys enter and leave (R-KV's redundancy).

R-KV (runtime/policies/rkv.py) scores each key by its mean cosine similarity with the other keys
its head holds: (k_j/|k_j|) . S with S the sum of the held unit keys. Re-summing S costs a pass over
every key per decision; the store's write kernel (kv_store.kv_write_policy) instead moves it by the
keys that leave and the one that enters. To make that exact whatever the order of adds and removes,
a unit key's components (|x| <= 1) are rounded to multiples of 2^-40 and summed as int64: the sum is
the same integers after any number of steps, for up to 2^22 held tokens per head.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ringllm.runtime.kv_codec import key_row

# ksum's unit: a unit key's components (|x| <= 1) are rounded to multiples of 2^-40 and summed as
# integers, so the sum is exact (order-free, the same after any number of adds and removes) for up
# to 2^22 held tokens per head
KEY_SUM_FIXED = 2.0 ** 40


@njit(cache=True, nogil=True, fastmath=True)
def key_inv_norm(k_l, koff, seq_l, h, j, buf):
    """1/|k_l[h, j]| in float64 (1e30 for a zero key): measured once, when the key is written. buf (hd,)
    f32 scratch (a quantized store's key is read as it decodes, its layer's offset koff (n_kv, hd)
    added: kv_codec.key_row, which reads seq_l)."""
    kj = key_row(k_l, koff, seq_l, h, j, buf)
    nrm = 0.0
    for d in range(kj.shape[0]):
        nrm += np.float64(kj[d]) * kj[d]
    return 1.0 / max(np.sqrt(nrm), 1e-30)


@njit(cache=True, nogil=True, fastmath=False)
def key_sum_move(ksum, k_l, koff, seq_l, h, j, inv, sign, buf):
    """ksum[h] += sign * round(k_l[h, j] * inv * 2^40): slot j's unit key enters (+1) or leaves (-1)
    the head's sum. No fastmath: a key's rounded contribution must be the same bits when it leaves.
    buf (hd,) f32 scratch."""
    kj = key_row(k_l, koff, seq_l, h, j, buf)
    for d in range(kj.shape[0]):
        ksum[h, d] += sign * np.int64(np.floor(np.float64(kj[d]) * inv * KEY_SUM_FIXED + 0.5))


@njit(cache=True, nogil=True, fastmath=False)
def key_sums(ksum, k_l, koff, seq_l, score_l, count_l):
    """Rebuild ksum (n_kv, hd) i64 and each held slot's 1/|k| in score_l from the keys (a restored
    store, a replace_many): what the write kernel keeps incrementally."""
    buf = np.empty(ksum.shape[1], np.float32)
    for h in range(ksum.shape[0]):
        ksum[h, :] = 0
        for j in range(count_l[h]):
            score_l[h, j] = key_inv_norm(k_l, koff, seq_l, h, j, buf)
            key_sum_move(ksum, k_l, koff, seq_l, h, j, score_l[h, j], 1, buf)
