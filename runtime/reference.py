"""The NumPy reference engine: float32, readable over fast; the oracle of every optimized path.

Its KV cache is what HF-style StreamingLLM does: per layer an ordered, contiguous list of the
tokens held (oldest first), keys stored before RoPE; on eviction the survivors are shifted
(np.delete) and the new token appended; at every step RoPE is recomputed for every key from its
position. Positions (DESIGN.md):
    reindexed: a key's position is its rank among the tokens the layer holds (0..n-1), the query's n-1;
    original:  a key's position is its index in the whole sequence, the query's its own index.

Eviction: `full` (grow to the model's context, then an error), `streaming` (StreamingLLM: keep
the first `sinks` tokens and the most recent ones; the victim is the oldest non-sink token) and the
score-based policies of runtime/reference_policies.py (NumPy, written apart from the Numba ones),
with staged eviction (lazy/slack/max_drop). KV types (KVConfig k_type / v_type): a token's key and
value are rounded as they enter, through gguf's NumPy quantizers, exactly where the CPU engine's
store rounds them: values as they are; keys of policy layers before RoPE; keys of ring layers
rotated at their sequence index (the engine's "stored" strategy; ReferenceCache's ring_keys),
rounded, and rotated back to this cache's before-RoPE form. Sliding-window layers (Gemma 3) hold min(window,
capacity) tokens and, when the window fits the capacity, behave exactly like the model's own
window: the oldest token leaves, no sinks, no policy.

This file never imports a Numba kernel: weights are dequantized with the `gguf` package's NumPy
implementation, so it stays independent of ringllm.runtime.dequant.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ringllm.runtime.errors import ConfigError
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.kv_types import OFFSET_FROM, key_offset_of
from ringllm.runtime.model_spec import ModelSpec
from ringllm.runtime.qtensor import QTensor
from ringllm.runtime.quant_types import GGMLType
from ringllm.runtime.reference_policies import REF_POLICIES, staged_keep
from ringllm.runtime.reference_q8 import Q8_TYPES, matmul_q8_ref
from ringllm.runtime.reference_rope import layer_freqs, rope


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


def dequantize_reference(t: QTensor) -> np.ndarray:
    """float32 values of any QTensor in its logical shape, through gguf.quants (independent NumPy code)."""
    from gguf import GGMLQuantizationType, quants

    vals = quants.dequantize(np.ascontiguousarray(t.data), GGMLQuantizationType(int(t.qtype)))
    return np.ascontiguousarray(vals, dtype=np.float32).reshape(t.shape)


def hadamard_blocks(x: np.ndarray) -> np.ndarray:
    """x (..., 32 k) float32 -> H applied to each block of 32 (H the Walsh-Hadamard matrix, Sylvester's
    order): butterflies of span 1, 2, 4, 8, 16, each pair (a, b) -> (a + b, a - b) in float32, the
    order of the store's encoder, so the rotation of a q4_0 block is the same bits."""
    y = np.ascontiguousarray(x, np.float32).reshape(-1, 32)
    h = 1
    while h < 32:
        y = y.reshape(y.shape[0], 32 // (2 * h), 2, h)
        y = np.stack([y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]], axis=2).reshape(-1, 32)
        h *= 2
    return y.reshape(x.shape)


def round_kv_type(x: np.ndarray, kv_type: str, key: bool = False) -> np.ndarray:
    """x (..., hd) float32 as a KV store of type kv_type holds it: gguf's NumPy quantize and dequantize
    (f16: NumPy's half conversion), independent of ringllm.runtime.kv_codec. q4_0 quantizes each
    block's rotation y = H (s r) and returns s H y' / 32 + u, where for keys (key=True) u is the row's
    outliers apart in f16 (q4_0_outliers) and r = x - u the rest, for values u = 0 and r = x
    (kv_types.py: the signs s and the keys' outliers are the format's)."""
    from gguf import GGMLQuantizationType, quants

    from ringllm.runtime.kv_types import Q4_0_SIGNS

    x = np.ascontiguousarray(x, dtype=np.float32)
    if kv_type == "f16":
        return x.astype(np.float16).astype(np.float32)
    qt = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}[kv_type]
    if kv_type == "q8_0":
        return np.ascontiguousarray(quants.dequantize(quants.quantize(x, qt), qt), dtype=np.float32).reshape(x.shape)
    none = x.shape[:-1] + (0,)
    chans, u = q4_0_outliers(x) if key else (np.zeros(none, np.int64), np.zeros(none, np.float32))
    rest = x.copy()
    np.put_along_axis(rest, chans, np.take_along_axis(x, chans, -1) - u, -1)
    signs = np.tile(Q4_0_SIGNS, x.shape[-1] // 32)
    y = hadamard_blocks(rest * signs)
    y = np.asarray(quants.dequantize(quants.quantize(y, qt), qt), dtype=np.float32).reshape(x.shape)
    r = hadamard_blocks(y) / np.float32(32) * signs
    for i in range(chans.shape[-1]):           # x = r + u, one outlier at a time (the decoder's order)
        c = chans[..., i:i + 1]
        np.put_along_axis(r, c, np.take_along_axis(r, c, -1) + u[..., i:i + 1], -1)
    return r


def q4_0_outliers(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The outliers a q4_0 row holds apart (kv_types): of x (..., hd) float32, the channels of the
    Q4_0_OUTLIERS largest magnitudes, largest first, the first of equal ones, NaN last (..., N) int64,
    and their values clipped to float16's range and rounded to it (..., N) float32."""
    from ringllm.runtime.kv_types import Q4_0_OUTLIERS

    chans = np.argsort(-np.abs(x), axis=-1, kind="stable")[..., :Q4_0_OUTLIERS]
    top = np.clip(np.take_along_axis(x, chans, -1), -65504.0, 65504.0)      # f16's largest finite value
    return chans, top.astype(np.float16).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Ordered (shift-and-append) KV cache
# ---------------------------------------------------------------------------------------------


@dataclass
class LayerCache:
    """One layer's cache, oldest first. k, v: (n_kv_head, L, head_dim) float32, keys before RoPE;
    seq: (n_kv_head, L) int64 (heads may hold different tokens under per-head policies); state:
    the policy's per-token arrays, (n_kv_head, L, ...) aligned with seq."""

    k: np.ndarray
    v: np.ndarray
    seq: np.ndarray
    capacity: int        # tokens kept after pruning, the current one included; 0 = unbounded (full)
    sinks: int
    recent: int
    policy: bool         # False: plain streaming order (sliding-window layers, full)
    state: dict
    ragged: bool = False  # adakv: k, v, seq and every state entry are lists of per-head arrays


def _append(lc: LayerCache, k: np.ndarray, v: np.ndarray, seq: int) -> None:
    """Token `seq` joins every head of lc, newest: k, v (n_kv, hd) (keys before RoPE), its policy
    state zero (per-head lists on a ragged layer, stacked arrays on the others)."""
    if lc.ragged:
        for h in range(len(lc.seq)):
            lc.k[h] = np.concatenate([lc.k[h], k[h][None]])
            lc.v[h] = np.concatenate([lc.v[h], v[h][None]])
            lc.seq[h] = np.append(lc.seq[h], seq)
            for a in lc.state.values():
                a[h] = np.concatenate([a[h], np.zeros((1,) + a[h].shape[1:], a[h].dtype)])
        return
    nkv = lc.seq.shape[0]
    lc.k = np.concatenate([lc.k, k[:, None, :]], axis=1)
    lc.v = np.concatenate([lc.v, v[:, None, :]], axis=1)
    lc.seq = np.concatenate([lc.seq, np.full((nkv, 1), seq, np.int64)], axis=1)
    lc.state = {name: np.concatenate([a, np.zeros((nkv, 1) + a.shape[2:], a.dtype)], axis=1)
                for name, a in lc.state.items()}


def _ragged(nkv: int, hd: int, state: dict) -> tuple[list, list, list, dict]:
    """Empty per-head lists (k, v, seq, state) of a layer whose heads hold different numbers of tokens."""
    return ([np.zeros((0, hd), np.float32) for _ in range(nkv)], [np.zeros((0, hd), np.float32) for _ in range(nkv)],
            [np.zeros(0, np.int64) for _ in range(nkv)], {name: list(a) for name, a in state.items()})


class ReferenceCache:
    """Ordered KV cache of one sequence for the reference engine.

    Args:
        spec: the model.
        kv: a KVConfig, or its keyword arguments (capacity, policy, sinks, positions, knobs).
        ring_keys: where the engine being checked rounds the quantized keys of ring layers: "stored"
            (rotated at the sequence index, CPUEngine's default) or "fused" (before RoPE).
    """

    def __init__(self, spec: ModelSpec, kv: KVConfig | None = None, ring_keys: str = "stored", **kwargs):
        kv = kv if kv is not None else KVConfig(**kwargs)
        kv.validate()
        if ring_keys not in ("stored", "fused"):
            raise ConfigError(f"ring_keys {ring_keys!r} unknown; valid: 'stored', 'fused'")
        self.ring_keys = ring_keys
        if kv.policy not in REF_POLICIES:
            raise ConfigError(f"reference engine policy {kv.policy!r} unknown; valid: {tuple(REF_POLICIES)}")
        self.spec, self.kv, self.policy, self.positions = spec, kv, kv.policy, kv.positions
        self.impl = REF_POLICIES[kv.policy](kv, spec)
        self.n_seen = 0
        self.query_history: list[dict[int, np.ndarray]] = [{} for _ in range(spec.n_layer)]   # seq -> q (n_head, hd)
        # optional callable(il, h (T, n_embd), q (T, n_head, hd) before RoPE, seq0) per layer and chunk (a
        # compressing prefill's observation window: runtime/reference_press.py)
        self.query_hook = None
        self.released = 0          # tokens a press released (runtime/reference_press.py)
        # key offsets per layer (n_kv, hd) f32 (kv_types: q4_0 keys of policy layers), set by begin_write
        self.key_offsets = [np.zeros((spec.n_head_kv, spec.head_dim), np.float32) for _ in range(spec.n_layer)]
        hd, nkv = spec.head_dim, spec.n_head_kv
        budgets = (self.impl.budgets(kv.capacity, spec.n_layer) if hasattr(self.impl, "budgets")
                   else [kv.capacity or 0] * spec.n_layer)
        self.layers: list[LayerCache] = []
        for il in range(spec.n_layer):
            evicting = kv.policy != "full"
            cap, s = (budgets[il] if evicting else 0), (kv.sinks if evicting else 0)
            recent = kv.resolved_recent if evicting else 0
            uses_policy = evicting
            w = spec.window[il]
            if w and (cap == 0 or w <= cap):
                cap, s, recent, uses_policy = w, 0, 0, False   # the model's own sliding window
            state = self.impl.new_state(nkv) if uses_policy else {}
            if uses_policy and getattr(self.impl, "ragged", False):
                k, v, seq, state = _ragged(nkv, hd, state)
                self.layers.append(LayerCache(k, v, seq, cap, s, recent, True, state, ragged=True))
                continue
            self.layers.append(LayerCache(np.zeros((nkv, 0, hd), np.float32), np.zeros((nkv, 0, hd), np.float32),
                                          np.zeros((nkv, 0), np.int64), cap, s, recent, uses_policy, state))

    def n_drop(self, il: int) -> int:
        """Tokens to evict before token number L = held + 1 enters layer il."""
        lc = self.layers[il]
        if lc.ragged and not lc.policy:       # a compressed prompt's ring layer: each head on its own (insert)
            return 0
        if lc.ragged:
            return self.impl.layer_drops(lc, self.kv)
        held = lc.seq.shape[1] + 1
        if not lc.capacity:
            return 0
        if not lc.policy:
            return max(0, held - lc.capacity)
        kv = self.kv
        return held - staged_keep(held, lc.capacity, kv.lazy, kv.slack, kv.max_drop)

    def insert(self, il: int, k: np.ndarray, v: np.ndarray, seq: int, q: np.ndarray | None = None) -> None:
        """Make room (shift out the victims) and append token `seq`: k, v (n_kv_head, head_dim) before RoPE;
        q (n_head, head_dim) its query before RoPE (policies that choose by the query). k and v are
        rounded to the KV types first (rounded_kv)."""
        k, v = self.rounded_kv(il, k, v, seq)
        lc = self.layers[il]
        n_drop = self.n_drop(il)
        if lc.ragged and not lc.policy:       # ring: a full head drops its oldest non-sink token
            drop = [np.arange(lc.sinks, lc.sinks + 1) if lc.capacity and s.size + 1 > lc.capacity
                    else np.zeros(0, np.int64) for s in lc.seq]
        elif lc.ragged:
            drop = self.impl.layer_victims(lc, il, n_drop) if n_drop > 0 else [np.zeros(0, np.int64)] * len(lc.seq)
        if lc.ragged:
            for h, d in enumerate(drop):       # per head: shift the victims out, then append the new token
                lc.k[h], lc.v[h] = np.delete(lc.k[h], d, axis=0), np.delete(lc.v[h], d, axis=0)
                lc.seq[h] = np.delete(lc.seq[h], d)
                for a in lc.state.values():
                    a[h] = np.delete(a[h], d, axis=0)
            _append(lc, k, v, seq)
            if q is not None:
                self.query_history[il][seq] = q.copy()
                self.query_history[il].pop(seq - self.kv.window, None)
            return
        if n_drop > 0 and lc.policy and getattr(self.impl, "adaptive", False):
            wanted, _ = self.impl.start(self, il, q, seq)
            n_drop = max(n_drop, wanted)
        if n_drop > 0:
            if lc.policy:
                drop = [self.impl.victims(lc, il, h, n_drop, q, seq, lc.sinks, lc.recent) for h in range(lc.seq.shape[0])]
            else:
                drop = [np.arange(lc.sinks, lc.sinks + n_drop)] * lc.seq.shape[0]   # oldest non-sink tokens
            keep = [np.setdiff1d(np.arange(lc.seq.shape[1]), d) for d in drop]
            lc.k = np.stack([lc.k[h, kp] for h, kp in enumerate(keep)])
            lc.v = np.stack([lc.v[h, kp] for h, kp in enumerate(keep)])
            lc.seq = np.stack([lc.seq[h, kp] for h, kp in enumerate(keep)])
            lc.state = {name: np.stack([a[h, kp] for h, kp in enumerate(keep)]) for name, a in lc.state.items()}
        _append(lc, k, v, seq)
        if lc.policy:
            self.impl.after_insert(lc, il, k)
        if q is not None and lc.policy:
            self.query_history[il][seq] = q.copy()
            self.query_history[il].pop(seq - self.kv.window, None)

    def keep_only(self, il: int, keep: list) -> None:
        """Layer il's head h keeps its tokens keep[h] (indices into its ordered tokens) with their
        policy state, the rest leave (a press's choice, or evict's complement); per-head lists stay
        lists, stacked heads stay stacked (then every head keeps equally many)."""
        lc = self.layers[il]
        nkv = len(keep)
        k = [np.asarray(lc.k[h])[keep[h]] for h in range(nkv)]
        v = [np.asarray(lc.v[h])[keep[h]] for h in range(nkv)]
        seq = [np.asarray(lc.seq[h])[keep[h]] for h in range(nkv)]
        state = {name: [np.asarray(a[h])[keep[h]] for h in range(nkv)] for name, a in lc.state.items()}
        if lc.ragged:
            lc.k, lc.v, lc.seq, lc.state = k, v, seq, state
        else:
            lc.k, lc.v, lc.seq = np.stack(k), np.stack(v), np.stack(seq)
            lc.state = {name: np.stack(a) for name, a in state.items()}

    def evict(self, il: int, seqs) -> None:
        """The reference of KVStore.evict: the tokens of sequence indices `seqs` leave every head of
        layer il that holds them."""
        drop = np.asarray(seqs, np.int64)
        lc = self.layers[il]
        self.keep_only(il, [np.flatnonzero(~np.isin(np.asarray(lc.seq[h]), drop)) for h in range(len(lc.seq))])

    def replace(self, il: int, seqs_out, k: np.ndarray, v: np.ndarray, seqs_in) -> None:
        """The reference of KVStore.replace_many: the tokens `seqs_out` leave every head of layer il,
        then tokens `seqs_in` (newer than any held) enter one by one: k, v (m, n_kv, hd) f32, keys
        before RoPE (rounded to the KV types as insert rounds them), their policy state zero, then
        what the policy computes from the key at insert (after_insert: knorm's norm, lsh's code).
        Nothing is attended: no attention state moves."""
        if len(seqs_in):          # before the victims leave: the engine sees the layer as it was
            self.begin_write(il, np.asarray(k, np.float32), int(np.asarray(seqs_in)[0]))
        self.evict(il, seqs_out)
        lc = self.layers[il]
        for i, s in enumerate(np.asarray(seqs_in, np.int64)):
            k_i, v_i = self.rounded_kv(il, np.asarray(k[i], np.float32), np.asarray(v[i], np.float32), int(s))
            _append(lc, k_i, v_i, int(s))
            if lc.policy:
                self.impl.after_insert(lc, il, k_i)

    def _ring(self, il: int) -> bool:
        """Whether the engine's store keeps layer il as a ring (kv_store.py's layer_ring)."""
        return not self.layers[il].policy or self.kv.ring

    def begin_write(self, il: int, k: np.ndarray, seq0: int) -> None:
        """Before keys k (T, n_kv, hd) (before RoPE) of tokens seq0.. enter layer il: on a layer that
        holds q4_0 keys relative to offsets (kv_types: a policy layer), when they bring it its first
        token from OFFSET_FROM on, the offsets are chosen from every key it has seen but token 0's:
        those it holds (as rounded) and these (kv_types.key_offset_of)."""
        if self.kv.k_type != "q4_0" or self._ring(il) or seq0 + k.shape[0] - 1 < OFFSET_FROM:
            return
        lc = self.layers[il]
        if max((int(np.max(s, initial=-1)) for s in lc.seq), default=-1) >= OFFSET_FROM:
            return                         # chosen already: rows relative to the offsets exist
        new = seq0 + np.arange(k.shape[0]) > 0
        for h in range(k.shape[1]):
            held = np.asarray(lc.seq[h]) > 0
            self.key_offsets[il][h] = key_offset_of(np.concatenate([np.asarray(lc.k[h])[held], k[new, h]]))

    def rounded_kv(self, il: int, k: np.ndarray, v: np.ndarray, seq: int) -> tuple[np.ndarray, np.ndarray]:
        """k, v (n_kv, hd) as the store holds them under the KV types (module docstring), keys given
        and returned before RoPE. q4_0 keys of a policy layer are rounded relative to the layer's
        offsets c (begin_write): round(k - c) + c."""
        kv = self.kv
        if kv.v_type != "f32":
            v = round_kv_type(v, kv.v_type)
        if kv.k_type != "f32":
            ring = self._ring(il)
            if not ring and kv.k_type == "q4_0":       # relative to the offsets from OFFSET_FROM on (kv_types)
                c = self.key_offsets[il] if seq >= OFFSET_FROM else np.float32(0)
                k = round_kv_type(k - c, kv.k_type, key=True) + c
            elif not ring or self.ring_keys == "fused":
                k = round_kv_type(k, kv.k_type, key=True)
            else:
                s = self.spec
                base, scale = layer_freqs(s, il), s.rope_scale[il]
                at = rope(k[:, None, :], np.array([seq]), s.rotary_dim, base, scale)[:, 0]
                held = round_kv_type(at, kv.k_type, key=True)
                k = rope(held[:, None, :], np.array([-seq]), s.rotary_dim, base, scale)[:, 0]
        return k, v

    def observe(self, il: int, weights: np.ndarray) -> None:
        """weights (n_head, L): this step's attention rows, in the order of the held tokens."""
        lc = self.layers[il]
        if lc.policy:
            self.impl.observe(lc, il, weights)

    def key_positions(self, il: int, h: int = 0) -> np.ndarray:
        """(L,) positions of head h's held keys under the position mode; the last entry is the query's."""
        seq = self.layers[il].seq[h]
        return np.arange(seq.size, dtype=np.int64) if self.positions == "reindexed" else seq.copy()

    @property
    def length(self) -> int:
        return max(max(s.size for s in lc.seq) if lc.ragged else int(lc.seq.shape[1]) for lc in self.layers)


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
        precision: "f32" (exact products) or "q8": the products with weights of the types in
            reference_q8.Q8_TYPES take their input rounded as llama.cpp quantizes activations
            (reference_q8.matmul_q8_ref), the oracle of CPUEngine(precision="q8").
    """

    def __init__(self, spec: ModelSpec, tensors: dict[str, QTensor], precision: str = "f32"):
        if precision not in ("f32", "q8"):
            raise ConfigError(f"precision {precision!r} unknown; valid: 'f32', 'q8'")
        self.spec, self.precision = spec, precision
        self.w = {name: dequantize_reference(t) for name, t in tensors.items()}
        self.qtypes = {name: GGMLType(int(t.qtype)) for name, t in tensors.items()}
        if spec.tied_output:
            self.w["output.weight"] = self.w["token_embd.weight"]
            self.qtypes["output.weight"] = self.qtypes["token_embd.weight"]

    def new_cache(self, kv: KVConfig | None = None, **kwargs) -> ReferenceCache:
        return ReferenceCache(self.spec, kv, **kwargs)

    def _norm(self, x: np.ndarray, name: str) -> np.ndarray:
        if self.spec.norm == "layer":
            return layer_norm(x, self.w[name + ".weight"], self.w[name + ".bias"], self.spec.norm_eps)
        return rms_norm(x, self.w[name + ".weight"], self.spec.norm_eps)

    def _product(self, x: np.ndarray, name: str) -> np.ndarray:
        """x (T, n_in) @ W.T of weight `name`, with q8 activation rounding where the precision asks."""
        qtype = self.qtypes[name]
        if self.precision == "q8" and qtype in Q8_TYPES:
            return matmul_q8_ref(self.w[name], x, qtype).astype(np.float32)
        return x @ self.w[name].T

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        y = self._product(x, name + ".weight")
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
        logits = self._product(x, "output.weight")
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

    def _capped(self, scores: np.ndarray) -> np.ndarray:
        """Attention logit soft-capping (Gemma 2): cap * tanh(scores / cap), or scores when the model has none."""
        cap = self.spec.attn_softcap
        return scores if not cap else np.float32(cap) * np.tanh(scores / np.float32(cap))

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
        if s.rope_attn_factor[il] != 1.0:      # HF multiplies cos and sin: the same as scaling q, k's rotated dims
            q[..., :s.rotary_dim] *= np.float32(s.rope_attn_factor[il])
            k[..., :s.rotary_dim] *= np.float32(s.rope_attn_factor[il])
        if cache.query_hook is not None:
            cache.query_hook(il, h, q, int(seqs[0]))
        group = nh // nkv
        out = np.zeros((T, nh, hd), np.float32)
        base, scale = layer_freqs(s, il), s.rope_scale[il]
        cache.begin_write(il, k, int(seqs[0]))
        for t in range(T):
            cache.insert(il, k[t], v[t], int(seqs[t]), q[t])
            lc = cache.layers[il]
            if lc.ragged:     # heads hold different numbers of tokens: one head at a time
                rows = []
                for hk in range(nkv):
                    pos = cache.key_positions(il, hk)
                    keys = rope(lc.k[hk], pos, s.rotary_dim, base, scale)                   # (L_h, hd)
                    qt = rope(q[t].reshape(nkv, group, hd)[hk], pos[-1:], s.rotary_dim, base, scale)
                    rows.append(softmax(self._capped(qt @ keys.T * np.float32(s.attn_scale))))   # (group, L_h)
                    out[t].reshape(nkv, group, hd)[hk] = rows[-1] @ lc.v[hk]
                cache.observe(il, rows)
                continue
            pos = np.stack([cache.key_positions(il, hk) for hk in range(nkv)])             # (nkv, L)
            keys = rope(lc.k, pos, s.rotary_dim, base, scale)                            # (nkv, L, hd)
            qt = rope(q[t].reshape(nkv, group, hd), pos[:, -1:], s.rotary_dim, base, scale)  # (nkv, group, hd)
            weights = softmax(self._capped(np.einsum("kgd,kld->kgl", qt, keys) * np.float32(s.attn_scale)))
            out[t] = np.einsum("kgl,kld->kgd", weights, lc.v).reshape(nh, hd)
            cache.observe(il, weights.reshape(nh, -1))
        return out.reshape(T, nh * hd)
