"""`gvote` (the seed GVote): an adaptive budget, set by the current query, filled by votes of
synthetic future queries.

When the capacity rule (or staging) asks a layer to drop tokens:
1. Budget: for each query head, the current (new) token's query, rotated at its position p, attends
   over the held keys; the nucleus is the smallest set of keys holding gvote_p of the attention
   mass. The budget b is the largest nucleus over the layer's heads.
2. Votes: per query head, a Gaussian (mean and per-dimension standard deviation, pre-RoPE) is fitted
   to the head's last w queries (w = window); S = gvote_samples synthetic queries are drawn from it
   (seeded, Box-Muller over splitmix64: reproducible anywhere), rotated at the averaged future
   position p + w/2, and each votes for the keys of its own top-p nucleus.
3. The layer keeps max(b, sinks + recent) old tokens plus the new one (never more than the capacity
   rule allows): the unprotected tokens with the fewest votes go, ties to the older.
All kv heads of a layer decide together (votes summed over the layer's query heads), so their slot
maps stay aligned, as with TOVA. Positions: p = tokens held (reindexed) or the sequence index
(original). KVStore.stats() reports the budgets chosen (mean and last per layer).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ringllm.runtime.eviction import sort_i64
from ringllm.runtime.kv_codec import key_row
from ringllm.runtime.policies.base import Policy, step_params
from ringllm.runtime.policy_step import bind_layer_step
from ringllm.runtime.policies.random_policy import splitmix64
from ringllm.runtime.rope_kernels import angles_at, rotate_with


@njit(cache=True, nogil=True, fastmath=False)
def gaussian_draws(out, seed, il, hq, seq_new):
    """out (S, hd) f64 standard normals for (seed, layer, query head, new token), Box-Muller pairs."""
    S, hd = out.shape
    base = splitmix64(splitmix64(splitmix64(np.uint64(seed)) ^ np.uint64(il * 4096 + hq)) ^ np.uint64(seq_new))
    for s in range(S):
        for d in range(0, hd, 2):
            a = splitmix64(base ^ np.uint64(s * 65536 + d))
            b = splitmix64(a)
            u1 = (np.float64(a >> np.uint64(11)) + 1.0) * (1.0 / 9007199254740992.0)
            u2 = np.float64(b >> np.uint64(11)) * (1.0 / 9007199254740992.0)
            r = np.sqrt(-2.0 * np.log(u1))
            out[s, d] = r * np.cos(2.0 * np.pi * u2)
            if d + 1 < hd:
                out[s, d + 1] = r * np.sin(2.0 * np.pi * u2)


@njit(cache=True, nogil=True, fastmath=False)
def _nucleus_votes(qv, keys, n, scale, softcap, p, votes):
    """Softmax of qv (hd,) . keys[:n] * scale (soft-capped as the model's attention is when softcap > 0);
    add 1 to votes[j] for the top-p nucleus; returns its size."""
    w = np.empty(n, np.float64)
    m = -1e300
    for j in range(n):
        acc = 0.0
        for d in range(keys.shape[1]):
            acc += qv[d] * keys[j, d]
        w[j] = acc * scale
        if softcap > 0:
            w[j] = softcap * np.tanh(w[j] / softcap)
        m = max(m, w[j])
    tot = 0.0
    for j in range(n):
        w[j] = np.exp(w[j] - m)
        tot += w[j]
    order = np.arange(2 * n)       # the slots by weight, heaviest first, ties to the lower slot (NumPy's stable
    neg = np.empty(n)              # argsort of -w, without compiling it), then the sort's buffer
    for j in range(n):
        neg[j] = -w[j]
    sort_i64(order, n, order[n:], neg, np.arange(n))
    acc = 0.0
    size = 0
    for i in range(n):
        j = order[i]
        votes[j] += 1.0
        acc += w[j] / tot
        size += 1
        if acc >= p:
            break
    return size


@njit(cache=True, nogil=True, fastmath=False)
def _gvote(key, k_l, koff, seq_l, pos_l, count_l, qhist, n_rows, q_now, inv_freq, inv_scale, rotary_dim, scale, softcap,
           p, seed, il, seq_new, p_now, p_future, z, krot, cs, sn):
    n_kv = k_l.shape[0]
    n_head, hd = q_now.shape
    group = n_head // n_kv
    n = count_l[0]
    for h in range(n_kv):                       # keys at their positions (as the store decodes them)
        for j in range(n):
            angles_at(cs, sn, pos_l[h, j], inv_freq, inv_scale)
            rotate_with(krot[h, j], key_row(k_l, koff, seq_l, h, j, krot[h, j]), cs, sn, rotary_dim)
    votes = np.zeros(n, np.float64)
    scratch = np.zeros(n, np.float64)
    qf = np.zeros(hd, np.float32)
    qr = np.zeros(hd, np.float32)
    budget = 0
    for hq in range(n_head):
        h = hq // group
        angles_at(cs, sn, p_now, inv_freq, inv_scale)
        rotate_with(qr, q_now[hq], cs, sn, rotary_dim)
        b = _nucleus_votes(qr, krot[h], n, scale, softcap, p, scratch)
        budget = max(budget, b)
        if n_rows == 0:
            continue
        gaussian_draws(z, seed, il, hq, seq_new)
        angles_at(cs, sn, p_future, inv_freq, inv_scale)
        for s in range(z.shape[0]):
            for d in range(hd):
                mu = 0.0
                for r in range(n_rows):
                    mu += qhist[hq, r, d]
                mu /= n_rows
                var = 0.0
                for r in range(n_rows):
                    var += (qhist[hq, r, d] - mu) ** 2
                qf[d] = mu + np.sqrt(var / n_rows) * z[s, d]
            rotate_with(qr, qf, cs, sn, rotary_dim)
            _nucleus_votes(qr, krot[h], n, scale, softcap, p, votes)
    for h in range(n_kv):
        for j in range(n):
            key[h, j] = votes[j]
    return budget


@njit(cache=True, nogil=True, fastmath=False)
def choose_next(lay, st, prm, by_rank, s, victims, pend, pend_drop):
    """Nothing is chosen ahead: the budget needs the next token's query (fill_keys, Python path)."""


@njit(cache=True, nogil=True, fastmath=False)
def observe_head(lay, mass, q, seq_new, hq0, prm):
    """The new token's query rows join the history ring (prm's qhist (n_head, w, hd), column seq_new
    mod w), as on_insert does on the Python path."""
    width, qhist = prm[1], prm[9]
    col = seq_new % width
    for i in range(q.shape[0]):
        for d in range(qhist.shape[2]):
            qhist[hq0 + i, col, d] = q[i, d]


class GVote(Policy):
    name = "gvote"
    plain_keys = True         # the synthetic queries vote over keys rotated from before RoPE
    # the compiled step runs the steps that evict nothing (it keeps the query history); eviction
    # steps take the Python path (fill_keys)
    layer_step = staticmethod(bind_layer_step("gvote", choose_next, observe_head, chooses_ahead=False))

    @staticmethod
    def default_recent(kv) -> int:
        """capacity / 4."""
        return max(0, kv.capacity // 4)

    def __init__(self, kv, spec):
        super().__init__(kv, spec)
        self.z = np.zeros((kv.gvote_samples, spec.head_dim), np.float64)
        self.inv_freq = [spec.inv_freq(il) for il in range(spec.n_layer)]
        self.cs = np.zeros(spec.rotary_dim // 2, np.float32)
        self.sn = np.zeros(spec.rotary_dim // 2, np.float32)
        self.krot = np.zeros((0, 0, 0), np.float32)
        self.budget_sum = np.zeros(spec.n_layer)
        self.budget_n = np.zeros(spec.n_layer, np.int64)
        self.budget_last = np.zeros(spec.n_layer, np.int64)

    def extra_shape(self):
        return (self.spec.n_head, self.kv.window, self.spec.head_dim)

    def step_params(self, store, il):
        return step_params(width=self.kv.window, qhist=store.extra[il])

    def fill_keys(self, store, il, q, seq):
        s, kv = self.spec, self.kv
        if self.krot.shape[1] < store.k[il].shape[1]:
            self.krot = np.zeros(store.k[il].shape[:2] + (store.spec.head_dim,), np.float32)
        n_old = int(store.count[il][0])
        p_now = n_old if store.reindexed else seq
        budget = _gvote(store.key, store.k[il], store.koff[il], store.seq[il], store.pos[il], store.count[il],
                        store.extra[il], min(seq, kv.window), q,
                        self.inv_freq[il], 1.0 / s.rope_scale[il], s.rotary_dim, float(s.attn_scale), float(s.attn_softcap),
                        kv.gvote_p, kv.seed, il, seq, p_now, p_now + kv.window // 2, self.z, self.krot, self.cs, self.sn)
        self.budget_sum[il] += budget
        self.budget_n[il] += 1
        self.budget_last[il] = budget
        keep_old = max(budget, store.layer_sinks[il] + store.recent)
        return max(0, n_old - keep_old)

    def on_insert(self, store, il, k_pre, q_pre):
        seq = int(store.seq[il][0, store.count[il][0] - 1])       # the new token, just written
        store.extra[il][:, seq % self.kv.window, :] = q_pre

    def stats(self):
        n = np.maximum(self.budget_n, 1)
        return {"gvote_budget_mean": float((self.budget_sum / n).mean()) if self.budget_n.any() else None,
                "gvote_budget_last": self.budget_last.tolist()}
