"""Attention of a whole prefill chunk at once: a block of queries against a block of keys, online softmax.

The per-token path (engine._attend_dense: one RoPE write and one attend_stored call per token and
layer) runs the chunk's queries one after the other from Python, on one core. When a chunk cannot
evict anything, every query sees exactly the store as it is after the chunk is written, minus the
keys that come after it (causal): so write_attend_chunk writes the chunk's keys (the same per-token
write kernels, in order), then attends all queries in parallel, each kv head's query block against
the layer's slots in key blocks:

    S = (q R(p_t) scale) K_blk^T      rows: the block's queries x the group's query heads
    m' = max(m, rowmax S); P = exp(S - m'); l = l e^(m - m') + rowsum P; O = O e^(m - m') + P V_blk

with key slots after the query's sequence index masked out. Equal to the per-token path up to float32
rounding (the softmax is one pass instead of two); tests/test_chunk_attention.py checks it against
attend_stored and the engine against the reference engine.

When it applies (chunk_fits): a ring layer in the "stored" RoPE layout that holds every token the
store has seen (nothing evicted: every key sits at logical position = sequence index, slots in
sequence order, and each query at its own index) and has room for the whole chunk. Otherwise the engine keeps the per-token path (eviction inside the
chunk changes what the later queries see).

When it pays (chunk_pays): its gain over the per-token path grows with the query-key pairs the chunk
attends (rows x keys it spans); the first chunk of a short prompt attends a few thousand pairs,
where it saves well under a tenth of the chunk's time, less than compiling its two kernels costs a
process that never meets a longer chunk. From MIN_PAIRS pairs on (a second 64-row chunk) it runs.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ringllm.runtime.fast_exp import exp_f32
from ringllm.runtime.kv_codec import kv_row, kv_rows
from ringllm.runtime.kv_write import kv_write_streaming
from ringllm.runtime.numba_flags import FASTMATH
from ringllm.runtime.rope_kernels import angles_at, rope_rows_at, rotate_with

__all__ = ["Q_BLOCK", "K_BLOCK", "MIN_PAIRS", "chunk_fits", "chunk_pays", "write_attend_chunk"]

Q_BLOCK = 8          # queries per block (times the group's query heads: rows of S)
K_BLOCK = 64         # key slots per block
MIN_PAIRS = 8192     # chunk rows x keys spanned (store's tokens + the chunk) from which the chunk path runs
_NEG = np.float32(-3.0e38)


def chunk_fits(store, il: int, T: int) -> bool:
    """True when layer il of `store` can take a chunk of T tokens through write_attend_chunk."""
    if not store.layer_ring[il] or store.update != "inplace" or store.journal is not None:
        return False
    if store.layer_rope_mode[il] != "stored":
        return False
    count = store.count[il]
    n = int(count.max())
    return (int(store.evicted[il].max()) == 0 and int(count.min()) == n == store.n_seen
            and n + T <= store.k[il].shape[1])


def chunk_pays(n_seen: int, T: int, min_pairs: int = MIN_PAIRS) -> bool:
    """True when a chunk of T rows after n_seen stored tokens attends at least min_pairs query-key
    pairs (T x (n_seen + T)): enough work for the parallel chunk path to gain over the per-token one."""
    return T * (n_seen + T) >= min_pairs


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _block(out, qrot, k_l, v_l, seq_l, h, group, t0, nt, seq0, n_slots, softcap, S, O, m, ls, vb):
    """Queries t0 .. t0 + nt - 1 of kv head h's group over slots [0, n_slots): out[t, h*group + g].
    k_l, v_l in any KV type; vb (K_BLOCK + 1, hd) f32 scratch: a key block's values decoded once
    for all R rows, and a key."""
    hd = qrot.shape[2]
    R = nt * group
    for r in range(R):
        m[r] = _NEG
        ls[r] = 0.0
        for d in range(hd):
            O[r, d] = 0.0
    last = seq0 + t0 + nt - 1                     # the block's newest query: later keys are masked for all
    for j0 in range(0, n_slots, K_BLOCK):
        nj = min(K_BLOCK, n_slots - j0)
        if seq_l[h, j0] > last:                   # slots hold increasing sequence indices: none visible
            break
        for jj in range(nj):
            kj = kv_row(k_l, h, j0 + jj, vb[K_BLOCK])
            sj = seq_l[h, j0 + jj]
            for r in range(R):
                t = t0 + r // group
                if sj > seq0 + t:
                    S[r, jj] = _NEG
                    continue
                qr = qrot[t, h * group + r % group]
                acc = np.float32(0.0)
                for d in range(hd):
                    acc += qr[d] * kj[d]
                if softcap > 0:
                    acc = softcap * np.tanh(acc / softcap)
                S[r, jj] = acc
        vblk = kv_rows(v_l, h, j0, nj, vb)
        for r in range(R):
            mx = m[r]
            for jj in range(nj):
                mx = max(mx, S[r, jj])
            if mx == _NEG:
                continue
            alpha = exp_f32(m[r] - mx) if m[r] != _NEG else np.float32(0.0)
            m[r] = mx
            total = np.float32(0.0)
            for jj in range(nj):
                p = exp_f32(S[r, jj] - mx) if S[r, jj] != _NEG else np.float32(0.0)
                S[r, jj] = p
                total += p
            ls[r] = ls[r] * alpha + total
            o = O[r]
            for d in range(hd):
                o[d] *= alpha
            jj = 0
            while jj + 4 <= nj:
                w0, w1, w2, w3 = S[r, jj], S[r, jj + 1], S[r, jj + 2], S[r, jj + 3]
                v0, v1, v2, v3 = vblk[jj], vblk[jj + 1], vblk[jj + 2], vblk[jj + 3]
                for d in range(hd):
                    o[d] += (w0 * v0[d] + w1 * v1[d]) + (w2 * v2[d] + w3 * v3[d])
                jj += 4
            while jj < nj:
                w = S[r, jj]
                vj = vblk[jj]
                for d in range(hd):
                    o[d] += w * vj[d]
                jj += 1
    for r in range(R):
        t = t0 + r // group
        dst = out[t, h * group + r % group]
        inv = np.float32(1.0) / ls[r]
        for d in range(hd):
            dst[d] = O[r, d] * inv


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def _attend_all(out, qrot, k_l, v_l, seq_l, seq0, n_slots, softcap):
    T, n_head, hd = qrot.shape
    n_kv = k_l.shape[0]
    group = n_head // n_kv
    n_qb = (T + Q_BLOCK - 1) // Q_BLOCK
    n_units = n_kv * n_qb
    for u in prange(n_units):
        h = u % n_kv
        i = u // n_kv                 # light and heavy (early and late) query blocks alternate
        qb = i // 2 if i % 2 == 0 else n_qb - 1 - i // 2
        t0 = qb * Q_BLOCK
        nt = min(Q_BLOCK, T - t0)
        R = Q_BLOCK * group
        _block(out, qrot, k_l, v_l, seq_l, h, group, t0, nt, seq0, n_slots, softcap,
               np.empty((R, K_BLOCK), np.float32), np.empty((R, hd), np.float32),
               np.empty(R, np.float32), np.empty(R, np.float32), np.empty((K_BLOCK + 1, hd), np.float32))


@njit(cache=True, nogil=True, fastmath=False)
def _write_and_rotate(qrot, q, k_new, v_new, k_l, v_l, seq_l, pos_l, count_l, evicted_l, seq0, sinks, reindexed,
                      inv_freq, inv_scale, rotary_dim, scale, tmp):
    T, n_head, hd = q.shape
    half = rotary_dim // 2
    cs = tmp[hd:hd + half]
    sn = tmp[hd + half:hd + rotary_dim]
    for t in range(T):
        rope_rows_at(k_new[t], seq0 + t, inv_freq, inv_scale, rotary_dim, tmp)
        kv_write_streaming(k_l, v_l, seq_l, pos_l, count_l, evicted_l, k_new[t], v_new[t], seq0 + t, sinks, reindexed)
        angles_at(cs, sn, seq0 + t, inv_freq, inv_scale)
        for hq in range(n_head):
            rotate_with(qrot[t, hq], q[t, hq], cs, sn, rotary_dim)
            for d in range(hd):
                qrot[t, hq, d] *= scale


def write_attend_chunk(store, il: int, rope, out: np.ndarray, q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray,
                       seq0: int, scale: np.float32, softcap: np.float32, qrot: np.ndarray, tmp: np.ndarray) -> None:
    """Write tokens seq0 .. seq0 + T - 1 (k_new, v_new (T, n_kv, hd), keys before RoPE: rotated here,
    in place) into ring layer il, then out (T, n_head, hd) = their attention over the layer
    (q (T, n_head, hd) before RoPE). chunk_fits(store, il, T) must hold. qrot (>= T, n_head, hd) and
    tmp (hd + rotary_dim,) float32 scratch."""
    T = q.shape[0]
    qr = qrot[:T]
    _write_and_rotate(qr, q, k_new, v_new, store.k[il], store.v[il], store.seq[il], store.pos[il], store.count[il],
                      store.evicted[il], seq0, store.layer_sinks[il], store.reindexed, rope.inv_freq, rope.inv_scale,
                      rope.rotary_dim, scale, tmp)
    _attend_all(out, qr, store.k[il], store.v[il], store.seq[il], seq0, int(store.count[il].max()), softcap)
