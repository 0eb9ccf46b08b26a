"""Presses: which prompt tokens a KV store keeps after the whole prompt was prefilled (NumPy).

A press is defined on the setting of seed 004 and of kvpress (NVIDIA): the prompt is prefilled
whole, the last w prompt queries (the question) score every key once, the cache is cut to a budget,
and decoding runs on what is kept. runtime/compress.py prefills, captures the window's queries and
rebuilds the store; this file only chooses. Everything here runs once per prompt, in NumPy
(float64 where scores are compared), vectorized over heads.

Input, per layer (LayerPrompt): the held keys rotated at their logical positions, their sequence
indices, the window's queries rotated at theirs, and the number of tokens each head held before this
prompt (a chat session's earlier turns, kept as they are: a turn's press chooses among its own
tokens only). The candidates of head h are its last m slots (m = the new prompt's length, the same
in every head). Output: per kv head the slots kept, ascending (= sequence order).

Budget of the fixed-budget presses: n_kept = min(B, m) for compress_budget B, floor(m x r) for
compress_ratio r (kvpress: int(k_len x (1 - compression_ratio)) with compression_ratio = 1 - r),
at least 1. Selection: the n_kept highest scores, ties to the newer token.

The presses (kvpress's definitions, kvpress/presses/*.py; departures said where they are):
  snapkv     window w = min(compress_window, m - 1): the softmax attention of the w window queries
             over every held key (causal), averaged over the window, for the m - w older candidates;
             average-pooled over neighbouring candidates (kernel compress_pool, zero padded, divided
             by the kernel as torch's avg_pool1d); averaged over each GQA group's query heads. The
             window tokens score max + 1 (always kept when the budget allows). Per kv head top-k.
  pyramidkv  snapkv's scores; per-layer budgets of PyramidKV (KVCache-Factory's formula as kvpress
             writes it): with n_kept the mean, min_num = n_kept / beta, max_num = 2 n_kept - min_num
             (capped at m - w), layer il keeps round(max_num - il (max_num - min_num) / (L - 1)); when
             not m >= max_num >= min_num >= w, every layer keeps n_kept (snapkv). So at budgets below
             about beta x w it IS snapkv: kvpress's fallback, kept.
  adakv      snapkv's scores; each head's round-down ada_floor x n_kept best are kept (Ada-KV's
             safeguard, alpha = ada_floor, kvpress's 0.2), then the n_kv x n_kept best over all heads
             of the layer together: heads keep different numbers of tokens. kvpress masks the pruned
             entries; here they are really released.
  gvote      seed 004, Algorithm 1 / Listing 1: per query head the budget b = the smallest nucleus of
             the last query's attention holding gvote_p of its mass; S = gvote_samples hidden states
             drawn from a channel-wise Gaussian fitted to the layer's attention inputs over the prompt
             (mean, unbiased std), projected by W_q (q_norm when the model has one), rotated with
             cos/sin averaged over the n_f = compress_window positions after the prompt; each sample
             keeps its top-b keys by logit; a kv head keeps the union over its group's query heads and
             the samples. Departure: the draws are NumPy's PCG64 seeded by (seed, layer) (not torch's).
  tova       the last query's attention averaged over every query head of the layer (one set for all
             kv heads); the last token scores max + 1.
  knorm      the lowest key L2 norms are kept (score -|k|; RoPE does not change a norm).
  streaming  the first `sinks` and the newest tokens (StreamingLLMPress, n_sink = KVConfig.sinks).
  random     uniform scores; departure: seeded per (seed, layer), where kvpress reseeds every layer alike.
Sliding-window layers (Gemma 3) keep what their window holds: no press applies to them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ringllm.runtime.reference_rope import layer_freqs, rope

PRESS_NAMES = ("snapkv", "pyramidkv", "adakv", "gvote", "tova", "knorm", "streaming", "random")


@dataclass
class LayerPrompt:
    """One layer after the prefill, as a press sees it (n: tokens held per head, the same in every head
    except after a ragged press's earlier turn, where each head is given its own arrays' first n_h).

    keys: per kv head (n_h, hd) f32, rotated at the tokens' logical positions, sequence order.
    seq: per kv head (n_h,) i64 sequence indices, ascending.
    m: the new prompt's tokens (the candidates: each head's last m).
    q: (n_head, w, hd) f32 the window's queries BEFORE RoPE; qpos: (n_kv, w) i64 their positions per kv head;
    qseq: (w,) i64 their sequence indices (the last w candidates).
    hidden: (mean, std) (n_embd,) f64 of the layer's attention input over the prompt (gvote), else None.
    windowed: a sliding-window layer (kept as held).
    """

    keys: list
    seq: list
    m: int
    q: np.ndarray
    qpos: np.ndarray
    qseq: np.ndarray
    hidden: tuple | None = None
    windowed: bool = False
    memo: dict | None = None          # window_attention's results by window, when one LayerPrompt serves many presses


def hidden_draws(seed: int, il: int, n_samples: int, n_embd: int) -> np.ndarray:
    """(S, n_embd) f64 standard normals of gvote's synthetic hidden states of layer il (PCG64 seeded by
    (seed, il)); shared with the reference press so both vote with the same samples."""
    return np.random.Generator(np.random.PCG64([int(seed), int(il)])).standard_normal((n_samples, n_embd))


def random_scores(seed: int, il: int, n_kv: int, m: int) -> np.ndarray:
    """(n_kv, m) f64 uniform scores of the random press for layer il (PCG64 seeded by (seed, il, 1))."""
    return np.random.Generator(np.random.PCG64([int(seed), int(il), 1])).random((n_kv, m))


def n_kept_of(kv, m: int) -> int:
    """Tokens a fixed-budget press keeps of m candidates (module docstring), at least 1."""
    if kv.compress_budget is not None:
        return max(1, min(int(kv.compress_budget), m))
    return max(1, min(m, math.floor(m * float(kv.compress_ratio) + 1e-9)))


def pyramid_budget(n_kept: int, m: int, w: int, beta: float, il: int, n_layer: int) -> int:
    """PyramidKV's budget of layer il (module docstring; kvpress's get_layer_budget with
    max_capacity_prompt = w + n_kept)."""
    min_num = n_kept / beta
    max_num = 2 * n_kept - min_num
    if max_num >= m - w:
        max_num = m - w
        min_num = 2 * n_kept - max_num
    if not (m >= max_num >= min_num >= w) or n_layer < 2:
        return n_kept
    return max(1, min(m, round(max_num - il * (max_num - min_num) / (n_layer - 1))))


def top_newest(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k highest of scores (m,), ties to the higher index (the newer token); ascending."""
    order = np.lexsort((-np.arange(scores.size), -scores))
    return np.sort(order[:k])


# ---------------------------------------------------------------------------------------------
# Scores
# ---------------------------------------------------------------------------------------------


def rotated_queries(spec, il: int, lp: LayerPrompt) -> np.ndarray:
    """(n_kv, group, w, hd) f32: the window's queries rotated at their positions in each kv head."""
    nkv = spec.n_head_kv
    group = spec.n_head // nkv
    q = lp.q.reshape(nkv, group, lp.q.shape[1], spec.head_dim)
    return rope(q, lp.qpos[:, None, :], spec.rotary_dim, layer_freqs(spec, il), spec.rope_scale[il])


def window_attention(spec, il: int, lp: LayerPrompt, last: int) -> list:
    """Per kv head (group, last, n_h) f64: softmax attention of the last `last` window queries over the
    head's held keys, causal by sequence index, scaled and soft-capped as the model attends (kept in
    lp.memo when lp has one: the same prefill pressed many ways computes it once)."""
    if lp.memo is not None and last in lp.memo:
        return lp.memo[last]
    qr = rotated_queries(spec, il, lp)[:, :, -last:]
    qseq = lp.qseq[-last:]
    out = []
    for h, (keys, seq) in enumerate(zip(lp.keys, lp.seq)):
        g, w, hd = qr[h].shape                    # one 2-D product (BLAS), not a stack of small ones
        logits = (qr[h].reshape(g * w, hd) @ keys.T).reshape(g, w, -1).astype(np.float64) * float(spec.attn_scale)
        if spec.attn_softcap:
            logits = spec.attn_softcap * np.tanh(logits / spec.attn_softcap)
        logits[:, seq[None, :] > qseq[:, None]] = -np.inf
        logits -= logits.max(axis=-1, keepdims=True)
        e = np.exp(logits)
        out.append(e / e.sum(axis=-1, keepdims=True))
    if lp.memo is not None:
        lp.memo[last] = out
    return out


def avg_pool(x: np.ndarray, kernel: int) -> np.ndarray:
    """torch avg_pool1d(kernel, stride 1, padding kernel // 2, count_include_pad) over the last axis."""
    if kernel == 1:
        return x
    half = kernel // 2
    c = np.concatenate([np.zeros(x.shape[:-1] + (1,)), np.cumsum(x, axis=-1)], axis=-1)
    n = x.shape[-1]
    lo = np.clip(np.arange(n) - half, 0, n)
    hi = np.clip(np.arange(n) + half + 1, 0, n)
    return (c[..., hi] - c[..., lo]) / kernel


def snapkv_scores(spec, il: int, lp: LayerPrompt, kv) -> np.ndarray:
    """(n_kv, m) f64: SnapKV's scores of the candidates (module docstring), window tokens at max + 1."""
    m = lp.m
    w = min(kv.compress_window, m - 1)
    att = window_attention(spec, il, lp, w)
    rows = []
    for h, a in enumerate(att):
        n_h = a.shape[-1]
        pre = a[:, :, n_h - m:n_h - w].mean(axis=1)                   # (group, m - w): mean over the window
        rows.append(avg_pool(pre, kv.compress_pool).mean(axis=0))       # pooled, then the group's mean
    scores = np.stack(rows)
    top = scores.max() + 1.0 if scores.size else 1.0
    return np.concatenate([scores, np.full((scores.shape[0], w), top)], axis=1)


def tova_scores(spec, il: int, lp: LayerPrompt) -> np.ndarray:
    """(m,) f64: the last query's attention averaged over all query heads; the last token max + 1."""
    m = lp.m
    att = window_attention(spec, il, lp, 1)
    rows = [a[:, 0, a.shape[-1] - m:a.shape[-1] - 1] for a in att]     # (group, m - 1) per kv head
    s = np.concatenate(rows).mean(axis=0)
    return np.append(s, (s.max() + 1.0) if s.size else 1.0)


def gvote_keep(spec, il: int, lp: LayerPrompt, kv, wq: np.ndarray, bq: np.ndarray | None,
               qnorm: np.ndarray | None) -> list:
    """Per kv head the candidate indices (into its last m) gvote keeps (module docstring). wq
    (n_head*hd, n_embd) f32 the query projection, bq its bias or None, qnorm the per-head q_norm
    weight (hd,) or None."""
    nkv, nh, hd = spec.n_head_kv, spec.n_head, spec.head_dim
    group = nh // nkv
    m = lp.m
    cur = window_attention(spec, il, lp, 1)                  # per kv head (group, 1, n_h)
    mean, std = lp.hidden
    S = kv.gvote_samples
    h_tilde = mean[None, :] + std[None, :] * hidden_draws(kv.seed, il, S, spec.n_embd)
    qt = (h_tilde.astype(np.float32) @ wq.T)
    if bq is not None:
        qt = qt + bq
    qt = qt.reshape(S, nh, hd)
    if qnorm is not None:
        qt = qt / np.sqrt(np.mean(qt * qt, axis=-1, keepdims=True) + spec.norm_eps) * qnorm
    if spec.rope_attn_factor[il] != 1.0:
        qt[..., :spec.rotary_dim] *= np.float32(spec.rope_attn_factor[il])
    freqs, half = layer_freqs(spec, il), spec.rotary_dim // 2
    inv = freqs if np.ndim(freqs) else float(freqs) ** (-np.arange(half, dtype=np.float64) * 2.0 / spec.rotary_dim)
    keep = []
    for h in range(nkv):
        keys, n_h = lp.keys[h], lp.keys[h].shape[0]
        fut = (lp.qpos[h, -1] + 1 + np.arange(kv.compress_window)).astype(np.float64) / spec.rope_scale[il]
        ang = fut[:, None] * inv[None, :]
        cos, sin = np.cos(ang).mean(axis=0), np.sin(ang).mean(axis=0)     # averaged over the future positions
        q = qt[:, h * group:(h + 1) * group].astype(np.float64)            # (S, group, hd)
        a, b = q[..., :half].copy(), q[..., half:spec.rotary_dim].copy()
        q[..., :half] = a * cos - b * sin
        q[..., half:spec.rotary_dim] = b * cos + a * sin
        logits = (q.transpose(1, 0, 2).reshape(group * S, hd) @ keys.T.astype(np.float64)).reshape(group, S, n_h)
        probs = np.sort(cur[h][:, 0], axis=-1)[:, ::-1]
        budget = (np.cumsum(probs, axis=-1) < kv.gvote_p).sum(axis=-1) + 1  # (group,)
        voted = np.zeros(n_h, bool)
        for g in range(group):               # each sample's top-b: its logits at or above its b-th largest
            b = int(min(budget[g], n_h))
            thr = np.partition(logits[g], n_h - b, axis=-1)[:, n_h - b]
            voted |= (logits[g] >= thr[:, None]).any(axis=0)
        keep.append(np.flatnonzero(voted[n_h - m:]))
    return keep


# ---------------------------------------------------------------------------------------------
# Choice
# ---------------------------------------------------------------------------------------------


def choose_layer(spec, il: int, lp: LayerPrompt, kv, weights=None) -> list:
    """Per kv head the candidate indices (0..m-1, into the head's last m slots) layer il keeps,
    ascending. weights: (wq, bq, qnorm) of layer il for gvote.

    Under a decode-time policy that scores each token over every kv head (KVConfig.aligned_heads:
    tova, gvote) every head keeps one set: a press that scores per head takes the heads' mean score
    (adakv then keeps its per-head mean budget), gvote the tokens any head's votes keep."""
    nkv, m, press = spec.n_head_kv, lp.m, kv.compress
    everything = [np.arange(m) for _ in range(nkv)]
    if lp.windowed or m <= 1:
        return everything
    if press == "gvote":
        keep = gvote_keep(spec, il, lp, kv, *weights)
        if kv.aligned_heads:
            union = np.unique(np.concatenate(keep))
            return [union.copy() for _ in range(nkv)]
        return keep
    n_kept = n_kept_of(kv, m)
    if press == "pyramidkv":
        n_kept = pyramid_budget(n_kept, m, min(kv.compress_window, m - 1), kv.pyramid_beta, il, spec.n_layer)
    if n_kept >= m:
        return everything
    if press in ("snapkv", "pyramidkv"):
        scores = snapkv_scores(spec, il, lp, kv)
    elif press == "adakv":
        scores = snapkv_scores(spec, il, lp, kv)
        if not kv.aligned_heads:
            return adakv_keep(scores, n_kept, kv.ada_floor)
    elif press == "tova":
        scores = np.tile(tova_scores(spec, il, lp), (nkv, 1))
    elif press == "knorm":
        scores = -np.stack([np.linalg.norm(k[k.shape[0] - m:].astype(np.float64), axis=-1) for k in lp.keys])
    elif press == "streaming":
        scores = np.ones((nkv, m))
        scores[:, kv.sinks:kv.sinks + (m - n_kept)] = 0.0
    elif press == "random":
        scores = random_scores(kv.seed, il, nkv, m)
    else:
        raise ValueError(press)
    if kv.aligned_heads:
        one = top_newest(scores.mean(axis=0), n_kept)
        return [one.copy() for _ in range(nkv)]
    return [top_newest(scores[h], n_kept) for h in range(nkv)]


def equal_counts(chosen: list, m: int) -> list:
    """chosen (per kv head, ascending candidate indices into the last m) with every head topped up to
    the layer's largest count by its newest candidates not chosen: the decode-time policies that evict
    the same number of tokens from every head (KVConfig.equal_head_counts) take a ragged press's
    choice this way. The press's own choice is kept whole; the top-up costs the memory of n_kv x the
    fullest head instead of the sum."""
    most = max(c.size for c in chosen)
    out = []
    for c in chosen:
        rest = np.setdiff1d(np.arange(m), c, assume_unique=True)
        extra = rest[rest.size - (most - c.size):] if most > c.size else rest[:0]
        out.append(np.sort(np.concatenate([c, extra])))
    return out


def adakv_keep(scores: np.ndarray, n_kept: int, alpha: float) -> list:
    """Ada-KV's layer-wide choice over scores (n_kv, m): each head's floor(alpha x n_kept) best are
    safe, then the n_kv x n_kept best of the layer (ties: the newer token, then the lower head)."""
    nkv, m = scores.shape
    s = scores.copy()
    n_safe = int(n_kept * alpha)
    if n_safe:
        for h in range(nkv):
            s[h, top_newest(scores[h], n_safe)] = np.finfo(np.float64).max
    flat = s.reshape(-1)
    head, idx = np.divmod(np.arange(flat.size), m)
    order = np.lexsort((head, -idx, -flat))[:nkv * n_kept]
    return [np.sort(idx[order][head[order] == h]) for h in range(nkv)]
