"""Prompt compression in the NumPy reference engine: the oracle of runtime/press.py and runtime/compress.py.

Written apart from them, from the presses' definitions (press.py's module docstring, kvpress's
presses): per kv head and per query, plain loops over softmax rows (reference.softmax), pooling as
an explicit sum, selections by sorting (score, index) pairs. Keys are kept before RoPE in the
reference cache and rotated here from each token's position (reference_rope). The only code shared
with press.py is the seeded draws (gvote's hidden states, random's scores): data, not method.

    cache, logits = reference_compress_prefill(ref, ids, kv, room, prior=None)

builds the decode cache as the CPU path does: every layer's heads hold their kept tokens in sequence
order (ragged lists), positions as the cache's position mode gives them (reindexed: rank among the
head's kept tokens; original: sequence index), the decode-time policy's ring (full or streaming)
after that. Under an evicting decode-time policy the prompt goes through a cache of that policy with
room for all of it, and the press keeps its tokens with the state the policy gave them
(_reference_policy_compress).
"""
from __future__ import annotations

import copy
import math

import numpy as np

from ringllm.runtime.errors import ConfigError
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.press import hidden_draws, random_scores
from ringllm.runtime.reference import ReferenceCache, rms_norm, softmax
from ringllm.runtime.reference_rope import layer_freqs, rope


class _Window:
    """query_hook of the reference cache: every row's attention input per layer, and the queries of
    sequence indices [first, end)."""

    def __init__(self, n_layer: int, first: int, end: int):
        self.first, self.end = first, end
        self.q = [dict() for _ in range(n_layer)]        # seq -> (n_head, hd)
        self.h = [[] for _ in range(n_layer)]

    def __call__(self, il, h, q, seq0):
        self.h[il].append(np.asarray(h, np.float64))
        for t in range(q.shape[0]):
            if self.first <= seq0 + t < self.end:
                self.q[il][seq0 + t] = q[t].copy()


def _budget(kv, m: int) -> int:
    """Tokens kept of m (fixed-budget presses): the budget, or floor(m x ratio), between 1 and m."""
    want = kv.compress_budget if kv.compress_budget is not None else math.floor(m * kv.compress_ratio + 1e-9)
    return min(m, max(1, int(want)))


def _pyramid(n_kept: int, m: int, w: int, beta: float, il: int, n_layer: int) -> int:
    """PyramidKV's per-layer budget (KVCache-Factory via kvpress): a line from the largest layer budget
    at layer 0 to the smallest at the last, mean n_kept; SnapKV's n_kept when the line does not fit."""
    smallest = n_kept / beta
    largest = 2 * n_kept - smallest
    if largest >= m - w:
        largest = m - w
        smallest = 2 * n_kept - largest
    fits = m >= largest and largest >= smallest and smallest >= w
    if not fits or n_layer == 1:
        return n_kept
    b = round(largest - il * (largest - smallest) / (n_layer - 1))
    return max(1, min(m, b))


def _best(scores, k: int) -> list[int]:
    """The k highest of scores, ties to the higher index; ascending indices."""
    ranked = sorted(range(len(scores)), key=lambda i: (-scores[i], -i))
    return sorted(ranked[:k])


class _Layer:
    """One layer of the prefilled cache, per head: keys rotated at positions, seq; and queries."""

    def __init__(self, ref, cache, il: int, win: _Window):
        s = ref.spec
        self.spec, self.il = s, il
        lc = cache.layers[il]
        self.seq = [np.asarray(lc.seq[h]) for h in range(s.n_head_kv)]
        self.kpre = [np.asarray(lc.k[h]) for h in range(s.n_head_kv)]
        base, scale = layer_freqs(s, il), s.rope_scale[il]
        self.pos = [np.arange(sq.size) if cache.positions == "reindexed" else sq.copy() for sq in self.seq]
        self.keys = [rope(k, p, s.rotary_dim, base, scale) for k, p in zip(self.kpre, self.pos)]
        self.win = win
        self.qseqs = sorted(win.q[il])

    def query(self, h: int, g: int, t_seq: int) -> np.ndarray:
        """Query head g of kv head h's group at token t_seq, rotated at t_seq's position in head h."""
        s = self.spec
        group = s.n_head // s.n_head_kv
        q = self.win.q[self.il][t_seq][h * group + g]
        p = int(np.flatnonzero(self.seq[h] == t_seq)[0])
        return rope(q[None, :], np.array([self.pos[h][p]]), s.rotary_dim, layer_freqs(s, self.il),
                    s.rope_scale[self.il])[0]

    def attention(self, h: int, g: int, t_seq: int) -> np.ndarray:
        """Softmax row (n_h,) of query (h, g, t_seq) over head h's keys (0 for keys after t_seq)."""
        s = self.spec
        row = np.full(self.seq[h].size, -np.inf)
        seen = self.seq[h] <= t_seq
        x = (self.keys[h][seen] @ self.query(h, g, t_seq)).astype(np.float64) * s.attn_scale
        if s.attn_softcap:
            x = s.attn_softcap * np.tanh(x / s.attn_softcap)
        row[seen] = x
        return softmax(row)


def _snapkv(lay: _Layer, kv, m: int) -> list[np.ndarray]:
    """Per kv head the SnapKV scores of the m candidates (window at the layer's max + 1)."""
    s = lay.spec
    group = s.n_head // s.n_head_kv
    w = min(kv.compress_window, m - 1)
    window = lay.qseqs[-w:]
    half = kv.compress_pool // 2
    out = []
    for h in range(s.n_head_kv):
        n_h = lay.seq[h].size
        cols = range(n_h - m, n_h - w)
        per_head = []
        for g in range(group):
            acc = np.zeros(len(cols))
            for t in window:
                acc += lay.attention(h, g, t)[n_h - m:n_h - w]
            acc /= w
            pooled = np.zeros_like(acc)
            for i in range(acc.size):
                tot = 0.0
                for j in range(i - half, i + half + 1):
                    if 0 <= j < acc.size:
                        tot += acc[j]
                pooled[i] = tot / kv.compress_pool
            per_head.append(pooled)
        out.append(np.mean(per_head, axis=0))
    top = max(float(o.max()) for o in out) + 1.0 if m - w > 0 else 1.0
    return [np.concatenate([o, np.full(w, top)]) for o in out]


def _gvote(ref, lay: _Layer, kv, m: int) -> list[np.ndarray]:
    """GVote's kept candidates per kv head (seed 004, Algorithm 1)."""
    s, il = lay.spec, lay.il
    group = s.n_head // s.n_head_kv
    rows = np.concatenate(lay.win.h[il])
    mu, sd = rows.mean(axis=0), rows.std(axis=0, ddof=1)
    H = (mu + sd * hidden_draws(kv.seed, il, kv.gvote_samples, s.n_embd)).astype(np.float32)
    q = ref._linear(H, f"blk.{il}.attn_q").reshape(kv.gvote_samples, s.n_head, s.head_dim)
    if s.qk_norm:
        q = rms_norm(q, ref.w[f"blk.{il}.attn_q_norm.weight"], s.norm_eps)
    if s.rope_attn_factor[il] != 1.0:
        q[..., :s.rotary_dim] *= np.float32(s.rope_attn_factor[il])
    last = lay.qseqs[-1]
    keep = []
    for h in range(s.n_head_kv):
        n_h = lay.seq[h].size
        future = lay.pos[h][int(np.flatnonzero(lay.seq[h] == last)[0])] + 1 + np.arange(kv.compress_window)
        voted = np.zeros(n_h, bool)
        for g in range(group):
            probs = sorted(lay.attention(h, g, last), reverse=True)
            b, tot = 0, 0.0
            for pr in probs:          # the smallest nucleus holding gvote_p of the mass
                b += 1
                tot += pr
                if tot >= kv.gvote_p:
                    break
            qh = q[:, h * group + g].astype(np.float64)                     # (S, hd)
            # cos/sin averaged over the future positions = the rotations averaged (RoPE is linear in them)
            qr = np.mean([rope(qh, np.full(qh.shape[0], p), s.rotary_dim, layer_freqs(s, il), s.rope_scale[il])
                          for p in future], axis=0)
            for smp in range(qh.shape[0]):
                logit = lay.keys[h].astype(np.float64) @ qr[smp]
                for j in sorted(range(n_h), key=lambda j: -logit[j])[:b]:
                    voted[j] = True
        keep.append(np.flatnonzero(voted[n_h - m:]))
    return keep


def reference_choose(ref, cache, il: int, win: _Window, kv, m: int) -> list[np.ndarray]:
    """Per kv head the candidate indices (into the head's last m tokens) layer il keeps."""
    s = ref.spec
    nkv = s.n_head_kv
    if s.window[il] or m <= 1:
        return [np.arange(m) for _ in range(nkv)]
    lay = _Layer(ref, cache, il, win)
    aligned = kv.aligned_heads               # the decode-time policy needs one token set per layer
    if kv.compress == "gvote":
        keep = _gvote(ref, lay, kv, m)
        if aligned:                              # every token some head's votes keep
            union = sorted(set(int(i) for kh in keep for i in kh))
            return [np.array(union, np.int64) for _ in range(nkv)]
        return keep
    k = _budget(kv, m)
    if kv.compress == "pyramidkv":
        k = _pyramid(k, m, min(kv.compress_window, m - 1), kv.pyramid_beta, il, s.n_layer)
    if k >= m:
        return [np.arange(m) for _ in range(nkv)]
    press = kv.compress
    if aligned and press in ("snapkv", "pyramidkv", "adakv", "knorm", "random"):   # the heads' mean score
        if press == "knorm":
            per_head = [[-float(np.sqrt(np.sum(x.astype(np.float64) ** 2))) for x in lay.kpre[h][-m:]]
                        for h in range(nkv)]
        elif press == "random":
            per_head = [list(row) for row in random_scores(kv.seed, il, nkv, m)]
        else:
            per_head = _snapkv(lay, kv, m)
        mean = [sum(per_head[h][i] for h in range(nkv)) / nkv for i in range(m)]
        return [np.array(_best(mean, k)) for _ in range(nkv)]
    if press in ("snapkv", "pyramidkv"):
        return [np.array(_best(sc, k)) for sc in _snapkv(lay, kv, m)]
    if press == "adakv":
        scores = _snapkv(lay, kv, m)
        n_safe = int(k * kv.ada_floor)
        entries = []
        for h, sc in enumerate(scores):
            safe = set(_best(sc, n_safe)) if n_safe else set()
            entries += [(np.inf if i in safe else sc[i], i, h) for i in range(m)]
        entries.sort(key=lambda e: (-e[0], -e[1], e[2]))
        chosen = entries[:nkv * k]
        return [np.array(sorted(i for _, i, hh in chosen if hh == h), np.int64) for h in range(nkv)]
    if press == "tova":
        group = s.n_head // nkv
        last = lay.qseqs[-1]
        rows = [lay.attention(h, g, last)[lay.seq[h].size - m:lay.seq[h].size - 1]
                for h in range(nkv) for g in range(group)]
        sc = list(np.mean(rows, axis=0)) + [0.0]
        sc[-1] = max(sc[:-1], default=0.0) + 1.0
        return [np.array(_best(sc, k)) for _ in range(nkv)]
    if press == "knorm":
        return [np.array(_best([-float(np.sqrt(np.sum(x.astype(np.float64) ** 2))) for x in lay.kpre[h][-m:]], k))
                for h in range(nkv)]
    if press == "streaming":
        if k >= kv.sinks:
            kept = list(range(min(kv.sinks, m))) + list(range(m - (k - kv.sinks), m))
        else:
            kept = list(range(kv.sinks - k, kv.sinks))
        return [np.array(sorted(set(kept))) for _ in range(nkv)]
    if press == "random":
        sc = random_scores(kv.seed, il, nkv, m)
        return [np.array(_best(sc[h], k)) for h in range(nkv)]
    raise ConfigError(f"reference press {press!r} unknown")


def _per_head(lc, nkv: int):
    """A layer's tokens as per-head lists (k, v before RoPE, seq)."""
    return ([np.asarray(lc.k[h]) for h in range(nkv)], [np.asarray(lc.v[h]) for h in range(nkv)],
            [np.asarray(lc.seq[h]) for h in range(nkv)])


def reference_compress_prefill(ref, ids, kv: KVConfig, room: int, prior: ReferenceCache | None = None):
    """The reference of runtime/compress.compress_prefill: (decode cache, last logits (n_vocab,))."""
    s = ref.spec
    ids = np.asarray(ids, np.int64).reshape(-1)
    m = ids.size
    if m > (kv.max_prompt or s.n_ctx):
        raise ConfigError(f"the prompt has {m} tokens, more than max_prompt {kv.max_prompt or s.n_ctx}")
    if not kv.ring:
        return _reference_policy_compress(ref, ids, kv, prior)
    cache = ReferenceCache(s, KVConfig(policy="full", positions=kv.positions, seed=kv.seed))
    if prior is not None:
        for il, (lc, src) in enumerate(zip(cache.layers, prior.layers)):
            lc.k, lc.v, lc.seq = _per_head(src, s.n_head_kv)
            lc.ragged, lc.policy, lc.state = True, False, {}
            lc.capacity = s.window[il] if s.window[il] else 0
        cache.n_seen = prior.n_seen
    w = min(kv.compress_window, m)
    win = _Window(s.n_layer, cache.n_seen + m - w, cache.n_seen + m)
    cache.query_hook = win
    logits = ref.forward(ids, cache)[-1]
    cache.query_hook = None
    kept_layers = []
    for il in range(s.n_layer):
        chosen = reference_choose(ref, cache, il, win, kv, m)
        k, v, seq = _per_head(cache.layers[il], s.n_head_kv)
        rows = []
        for h in range(s.n_head_kv):
            n_h = seq[h].size
            if s.window[il]:                 # a sliding window keeps what it holds
                rows.append((k[h], v[h], seq[h]))
                continue
            idx = np.concatenate([np.arange(n_h - m), n_h - m + np.asarray(chosen[h], np.int64)]).astype(np.int64)
            rows.append((k[h][idx], v[h][idx], seq[h][idx]))
        kept_layers.append(rows)
    most = [max(r[2].size for r in rows) for rows in kept_layers]
    # per-layer capacities: each layer's most kept plus the room (full: within the context, unbounded
    # here as the reference's full is; streaming: KVConfig.capacity), a sliding window its window
    out = ReferenceCache(s, kv.decode_config(max(most) + (kv.capacity if kv.policy != "full" else 1)))
    for il, (lc, rows) in enumerate(zip(out.layers, kept_layers)):
        if kv.policy != "full":
            cap = most[il] + kv.capacity
            w = s.window[il]
            lc.capacity, lc.sinks = (w, 0) if w and w <= cap else (cap, kv.sinks)
        lc.k = [r[0] for r in rows]
        lc.v = [r[1] for r in rows]
        lc.seq = [r[2] for r in rows]
        lc.ragged, lc.policy, lc.state = True, False, {}
    out.n_seen = cache.n_seen
    out.released = out.n_seen - max(most)
    return out, logits


def _reference_policy_compress(ref, ids, kv: KVConfig, prior: ReferenceCache | None):
    """reference_compress_prefill under an evicting decode-time policy: the prompt goes through a cache
    of that policy whose pressed layers have room for all of it (its state, h2o's masses and the
    rest, built over every token), a sliding-window layer a ring of its window (or, after a prior
    cache, as that cache holds it: compress.window_capacity); the press keeps its
    choice of each layer's new tokens with their state; each pressed layer's capacity becomes the
    most a head keeps plus the policy's budget for the layer."""
    s = ref.spec
    m = ids.size
    budgets_at = kv.decode_config(kv.capacity)
    if prior is None:
        cache = ReferenceCache(s, budgets_at)
        for il, lc in enumerate(cache.layers):
            if s.window[il]:
                lc.capacity, lc.sinks, lc.recent, lc.policy, lc.state = s.window[il], 0, 0, False, {}
    else:
        cache = copy.deepcopy(prior)
    for il, lc in enumerate(cache.layers):
        if not s.window[il]:
            held = max(np.asarray(x).size for x in lc.seq) if lc.ragged else int(lc.seq.shape[1])
            lc.capacity = max(held + m, kv.sinks + kv.resolved_recent + 1)
    w = min(kv.compress_window, m)
    win = _Window(s.n_layer, cache.n_seen + m - w, cache.n_seen + m)
    cache.query_hook = win
    logits = ref.forward(ids, cache)[-1]
    cache.query_hook = None
    impl = cache.impl
    budgets = impl.budgets(kv.capacity, s.n_layer) if hasattr(impl, "budgets") else [kv.capacity] * s.n_layer
    most = []
    for il, lc in enumerate(cache.layers):
        if s.window[il]:
            most.append(max(np.asarray(x).size for x in lc.seq))
            continue
        chosen = reference_choose(ref, cache, il, win, kv, m)
        if kv.equal_head_counts:          # every head as full as the fullest: its newest unchosen tokens
            fullest = max(len(c) for c in chosen)
            for h, c in enumerate(chosen):
                have = set(int(i) for i in c)
                extra = [i for i in range(m - 1, -1, -1) if i not in have][:fullest - len(have)]
                chosen[h] = np.array(sorted(have | set(extra)), np.int64)
        keep = []
        for h in range(s.n_head_kv):
            n_h = np.asarray(lc.seq[h]).size
            new = n_h - m + np.asarray(chosen[h], np.int64)
            keep.append(np.concatenate([np.arange(n_h - m), new]).astype(np.int64))
        cache.keep_only(il, keep)
        most.append(max(x.size for x in keep))
        lc.capacity, lc.sinks, lc.recent = most[-1] + budgets[il], kv.sinks, kv.resolved_recent
    cache.kv = kv.decode_config(max(most[il] + budgets[il] for il in range(s.n_layer)))
    cache.released = cache.n_seen - max(most)
    return cache, logits
