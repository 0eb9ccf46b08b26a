"""The NumPy reference engine: float32, readable over fast; the oracle of every optimized path.

Its KV cache is what HF-style StreamingLLM does: per layer an ordered, contiguous list of the
tokens held (oldest first), keys stored before RoPE; on eviction the survivors are shifted
(np.delete) and the new token appended; at every step RoPE is recomputed for every key from its
position. Positions (DESIGN.md):
    reindexed: a key's position is its rank among the tokens the layer holds (0..n-1), the query's n-1;
    original:  a key's position is its index in the whole sequence, the query's its own index.

Eviction: `full` (grow to the model's context, then an error) and `streaming` (StreamingLLM: keep
the first `sinks` tokens and the most recent ones; the victim is the oldest non-sink token). Sliding-
window layers (Gemma 3) hold min(window, capacity) tokens and, when the window fits the capacity,
behave exactly like the model's own window: the oldest token leaves, no sinks.

This file never imports a Numba kernel: weights are dequantized with the `gguf` package's NumPy
implementation, so it stays independent of ringllm.runtime.dequant.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ringllm.runtime.errors import ConfigError
from ringllm.runtime.model_spec import ModelSpec
from ringllm.runtime.qtensor import QTensor

POSITION_MODES = ("reindexed", "original")
REFERENCE_POLICIES = ("full", "streaming")

# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


def dequantize_reference(t: QTensor) -> np.ndarray:
    """float32 values of any QTensor in its logical shape, through gguf.quants (independent NumPy code)."""
    from gguf import GGMLQuantizationType, quants

    vals = quants.dequantize(np.ascontiguousarray(t.data), GGMLQuantizationType(int(t.qtype)))
    return np.ascontiguousarray(vals, dtype=np.float32).reshape(t.shape)


# ---------------------------------------------------------------------------------------------
# Ordered (shift-and-append) KV cache
# ---------------------------------------------------------------------------------------------


@dataclass
class LayerCache:
    """One layer's cache. k, v: (n_kv_head, L, head_dim) float32, keys before RoPE; seq: (L,) int64."""

    k: np.ndarray
    v: np.ndarray
    seq: np.ndarray
    capacity: int        # tokens attended including the query; 0 = unbounded (full)
    sinks: int


class ReferenceCache:
    """Ordered KV cache of one sequence for the reference engine.

    Args:
        spec: the model.
        capacity: tokens each (global) layer holds, the current one included; None = policy full.
        policy: "full" | "streaming".
        sinks: first tokens never evicted (streaming).
        positions: "reindexed" | "original".
    """

    def __init__(self, spec: ModelSpec, capacity: int | None = None, policy: str = "full", sinks: int = 4,
                 positions: str = "reindexed"):
        if policy not in REFERENCE_POLICIES:
            raise ConfigError(f"reference engine policy {policy!r} unknown; valid: {REFERENCE_POLICIES}")
        if positions not in POSITION_MODES:
            raise ConfigError(f"positions {positions!r} unknown; valid: {POSITION_MODES}")
        if policy == "streaming":
            if capacity is None or capacity < sinks + 1:
                raise ConfigError(f"streaming needs capacity >= sinks + 1 (capacity={capacity}, sinks={sinks})")
        self.spec, self.policy, self.positions = spec, policy, positions
        self.n_seen = 0
        hd, nkv = spec.head_dim, spec.n_head_kv
        self.layers: list[LayerCache] = []
        for il in range(spec.n_layer):
            cap, s = (capacity or 0) if policy == "streaming" else 0, sinks if policy == "streaming" else 0
            w = spec.window[il]
            if w and (cap == 0 or w <= cap):
                cap, s = w, 0   # the model's own sliding window
            self.layers.append(LayerCache(np.zeros((nkv, 0, hd), np.float32), np.zeros((nkv, 0, hd), np.float32),
                                          np.zeros(0, np.int64), cap, s))

    def insert(self, il: int, k: np.ndarray, v: np.ndarray, seq: int) -> None:
        """Make room (shift out the victim) and append token `seq`: k, v (n_kv_head, head_dim) before RoPE."""
        lc = self.layers[il]
        if lc.capacity and lc.seq.size >= lc.capacity:
            victim = lc.sinks   # oldest non-sink token
            lc.k = np.delete(lc.k, victim, axis=1)
            lc.v = np.delete(lc.v, victim, axis=1)
            lc.seq = np.delete(lc.seq, victim)
        lc.k = np.concatenate([lc.k, k[:, None, :]], axis=1)
        lc.v = np.concatenate([lc.v, v[:, None, :]], axis=1)
        lc.seq = np.append(lc.seq, seq)

    def key_positions(self, il: int) -> np.ndarray:
        """(L,) positions of the held keys under the position mode; the last entry is the query's."""
        seq = self.layers[il].seq
        return np.arange(seq.size, dtype=np.int64) if self.positions == "reindexed" else seq.copy()

    @property
    def length(self) -> int:
        return max(int(lc.seq.size) for lc in self.layers)


# ---------------------------------------------------------------------------------------------
# Math, written from the formulas
# ---------------------------------------------------------------------------------------------


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x (..., n) * w / sqrt(mean(x^2) + eps)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def activation(x: np.ndarray, kind: str) -> np.ndarray:
    if kind == "silu":
        return x / (1.0 + np.exp(-x))
    if kind == "gelu_tanh":
        return 0.5 * x * (1.0 + np.tanh(np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x ** 3)))
    if kind == "gelu":
        from math import erf, sqrt
        return (0.5 * x * (1.0 + np.vectorize(erf, otypes=[np.float64])(x / sqrt(2.0)))).astype(np.float32)
    raise ValueError(kind)


def rope(x: np.ndarray, pos: np.ndarray, rotary_dim: int, base: float, scale: float) -> np.ndarray:
    """Rotate-half RoPE. x (..., L, head_dim) at positions pos (L,): the first rotary_dim dims are
    split in halves (a, b) and become (a cos - b sin, b cos + a sin) with angle pos/scale * base^(-2i/rd)."""
    half = rotary_dim // 2
    inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / rotary_dim)
    ang = (pos.astype(np.float64) / scale)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    a, b = x[..., :half], x[..., half:rotary_dim]
    out = x.copy()
    out[..., :half] = a * cos - b * sin
    out[..., half:rotary_dim] = b * cos + a * sin
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# ---------------------------------------------------------------------------------------------
# Engine
# ---------------------------------------------------------------------------------------------


class ReferenceEngine:
    """Float32 NumPy forward pass of any ModelSpec over a ReferenceCache.

    Args:
        spec: ModelSpec; tensors: internal name -> QTensor (a LoadedModel's fields).
    """

    def __init__(self, spec: ModelSpec, tensors: dict[str, QTensor]):
        self.spec = spec
        self.w = {name: dequantize_reference(t) for name, t in tensors.items()}
        if spec.tied_output:
            self.w["output.weight"] = self.w["token_embd.weight"]

    def new_cache(self, capacity: int | None = None, policy: str = "full", sinks: int = 4,
                  positions: str = "reindexed") -> ReferenceCache:
        return ReferenceCache(self.spec, capacity, policy, sinks, positions)

    def _norm(self, x: np.ndarray, name: str) -> np.ndarray:
        if self.spec.norm == "layer":
            return layer_norm(x, self.w[name + ".weight"], self.w[name + ".bias"], self.spec.norm_eps)
        return rms_norm(x, self.w[name + ".weight"], self.spec.norm_eps)

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        y = x @ self.w[name + ".weight"].T
        bias = self.w.get(name + ".bias")
        return y + bias if bias is not None else y

    def forward(self, tokens, cache: ReferenceCache) -> np.ndarray:
        """Feed `tokens` (T,) after what `cache` holds; returns logits (T, n_vocab) float32.

        Projections run on the whole chunk; the cache update and attention run token by token, so a
        chunk longer than the capacity streams through eviction exactly as T single steps would.
        """
        s = self.spec
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size == 0:
            return np.zeros((0, s.n_vocab), np.float32)
        if tokens.min() < 0 or tokens.max() >= s.n_vocab:
            raise ConfigError(f"token ids must be in [0, {s.n_vocab}); got {tokens.min()}..{tokens.max()}")
        if cache.policy == "full" and cache.n_seen + tokens.size > s.n_ctx:
            raise ConfigError(f"{cache.n_seen + tokens.size} tokens exceed the model's context {s.n_ctx} "
                              "with policy 'full'; choose an eviction policy or a shorter input")
        seqs = cache.n_seen + np.arange(tokens.size)
        x = self.w["token_embd.weight"][tokens] * np.float32(s.embed_scale)
        for il in range(s.n_layer):
            x = self._layer(il, x, seqs, cache)
        cache.n_seen += tokens.size
        x = self._norm(x, "output_norm")
        logits = x @ self.w["output.weight"].T
        if s.final_logit_softcap:
            cap = np.float32(s.final_logit_softcap)
            logits = cap * np.tanh(logits / cap)
        return logits.astype(np.float32)

    def _layer(self, il: int, x: np.ndarray, seqs: np.ndarray, cache: ReferenceCache) -> np.ndarray:
        s, p = self.spec, f"blk.{il}."
        h = self._norm(x, p + "attn_norm")
        attn = self._linear(self._attention(il, h, seqs, cache), p + "attn_output")
        if s.sandwich_norm:
            attn = rms_norm(attn, self.w[p + "post_attention_norm.weight"], s.norm_eps)
        if s.parallel_residual:
            return x + attn + self._ffn(il, self._norm(x, p + "ffn_norm"))
        x = x + attn
        f = self._ffn(il, self._norm(x, p + "ffn_norm"))
        if s.sandwich_norm:
            f = rms_norm(f, self.w[p + "post_ffw_norm.weight"], s.norm_eps)
        return x + f

    def _ffn(self, il: int, h: np.ndarray) -> np.ndarray:
        p = f"blk.{il}."
        up = self._linear(h, p + "ffn_up")
        if self.spec.gated_ffn:
            up = activation(self._linear(h, p + "ffn_gate"), self.spec.act) * up
        else:
            up = activation(up, self.spec.act)
        return self._linear(up, p + "ffn_down")

    def _attention(self, il: int, h: np.ndarray, seqs: np.ndarray, cache: ReferenceCache) -> np.ndarray:
        """h (T, n_embd) -> attention output (T, n_head*head_dim), one token at a time through the cache."""
        s, p = self.spec, f"blk.{il}."
        T, hd, nh, nkv = h.shape[0], s.head_dim, s.n_head, s.n_head_kv
        q = self._linear(h, p + "attn_q").reshape(T, nh, hd)
        k = self._linear(h, p + "attn_k").reshape(T, nkv, hd)
        v = self._linear(h, p + "attn_v").reshape(T, nkv, hd)
        if s.qk_norm:
            q = rms_norm(q, self.w[p + "attn_q_norm.weight"], s.norm_eps)
            k = rms_norm(k, self.w[p + "attn_k_norm.weight"], s.norm_eps)
        group = nh // nkv
        out = np.zeros((T, nh, hd), np.float32)
        base, scale = s.rope_base[il], s.rope_scale[il]
        for t in range(T):
            cache.insert(il, k[t], v[t], int(seqs[t]))
            lc = cache.layers[il]
            pos = cache.key_positions(il)
            keys = rope(lc.k, pos, s.rotary_dim, base, scale)                   # (nkv, L, hd)
            qt = rope(q[t][:, None, :], pos[-1:], s.rotary_dim, base, scale)[:, 0]  # (nh, hd)
            for hq in range(nh):
                hk = hq // group
                w = softmax((keys[hk] @ qt[hq]) * np.float32(s.attn_scale))
                out[t, hq] = w @ lc.v[hk]
        return out.reshape(T, nh * hd)
