"""Prompt compression after prefill on the CPU engine: prefill whole, press, release (KVConfig.compress).

    store, logits = compress_prefill(engine, ids, kv, room)               a fresh prompt
    store, logits = compress_prefill(engine, ids, kv, room, prior=store)  a chat turn after `store`

1. A transient store of policy full sized to hold the prompt (plus what `prior` holds, copied in) is
   prefilled in chunks by the engine as any prompt is; its query_hook (PrefillCapture) keeps the
   last w queries before RoPE, and for gvote the mean and variance of each layer's attention input.
2. The press (runtime/press.py) chooses, per layer and kv head, which of the prompt's tokens stay.
3. The decode store is built at the kept size plus the room (KVConfig.decode_config) and the kept
   tokens are copied into it (transplant) in sequence order, with their sequence indices, new
   ranks, and positions (reindexed: rank among the head's kept tokens; original: sequence index).
   The transient store is dropped: its memory goes back (kv_stats()["bytes"] and RSS show it).

Under a decode-time policy that evicts by a score (h2o, tova, lsh, ..., or staged streaming) the
kept tokens need the policy's per-token state, so steps 1 and 3 differ: the transient store runs
that policy with every pressed layer sized to hold the whole prompt (policy_transient: nothing is
evicted, and the policy builds its state over every token, as it would have with room for them),
the press's losers leave it through KVStore.evict (each survivor's state moves with its slot), and
KVStore.resized cuts each layer to the most a head keeps plus the policy's own budget at
KVConfig.capacity (policy_capacities). A sliding-window layer is never pressed: a ring of its
window, or the layer a chat session's earlier store made it (window_capacity).

Key layouts: the transient store's ring layers hold keys as the engine's RoPE strategy writes them;
transplant brings each key back to before RoPE (reference_rope, exact up to one float32 rotation)
and lays it out for the decode store. A compressed store in reindexed mode reads its keys "fused"
(KVStore.ring_rope): its positions differ from its sequence indices at every gap, and with a ragged
press (adakv, gvote) per head; the "stored" strategy would rotate the query at every slot and
assumes one query position per layer. In original mode the positions are the sequence indices and
the engine's own strategy serves. The Numba kernels are not changed: compression off runs exactly
the code it ran before (the engine tests a None query_hook once per layer and chunk).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ringllm.runtime.errors import ConfigError
from ringllm.runtime.kv_codec import encode
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.kv_store import KVStore
from ringllm.runtime.press import LayerPrompt, choose_layer, equal_counts
from ringllm.runtime.reference_rope import layer_freqs, rope


class PrefillCapture:
    """KVStore.query_hook of a compressing prefill: the queries (before RoPE) of sequence indices
    [first, end) per layer, q[il] (n_head, end - first, hd) f32; with hidden, the running sum and sum of
    squares (f64) of each layer's attention input over every row fed (gvote's Gaussian)."""

    def __init__(self, spec, first: int, end: int, hidden: bool, m: int | None = None):
        self.spec, self.first, self.end, self.hidden = spec, first, end, hidden
        self.m = m if m is not None else end - first       # the prompt's tokens (the press's candidates)
        self.q = [np.zeros((spec.n_head, end - first, spec.head_dim), np.float32) for _ in range(spec.n_layer)]
        self.hsum = [np.zeros(spec.n_embd) for _ in range(spec.n_layer)] if hidden else None
        self.hsq = [np.zeros(spec.n_embd) for _ in range(spec.n_layer)] if hidden else None
        self.rows = [0] * spec.n_layer

    def __call__(self, il: int, h: np.ndarray, q: np.ndarray, seq0: int) -> None:
        T = q.shape[0]
        lo, hi = max(seq0, self.first), min(seq0 + T, self.end)
        if lo < hi:
            rows = q[lo - seq0:hi - seq0].reshape(hi - lo, self.spec.n_head, self.spec.head_dim)
            self.q[il][:, lo - self.first:hi - self.first] = rows.transpose(1, 0, 2)
        if self.hidden:
            h64 = h.astype(np.float64)
            self.hsum[il] += h64.sum(axis=0)
            self.hsq[il] += (h64 * h64).sum(axis=0)
            self.rows[il] += T

    def narrowed(self, window: int) -> "PrefillCapture":
        """The same capture with only its last `window` queries."""
        out = PrefillCapture.__new__(PrefillCapture)
        out.__dict__.update(self.__dict__)
        w = min(window, self.end - self.first)
        out.first = self.end - w
        out.q = [q[:, q.shape[1] - w:] for q in self.q]
        return out

    def gaussian(self, il: int) -> tuple[np.ndarray, np.ndarray]:
        """(mean, unbiased std) (n_embd,) f64 of layer il's attention input over the rows fed."""
        n = self.rows[il]
        mean = self.hsum[il] / n
        var = (self.hsq[il] - n * mean * mean) / max(n - 1, 1)
        return mean, np.sqrt(np.maximum(var, 0.0))


# ---------------------------------------------------------------------------------------------
# Keys in and out of a store's layouts
# ---------------------------------------------------------------------------------------------


def _rotate(spec, il: int, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    return rope(x, pos, spec.rotary_dim, layer_freqs(spec, il), spec.rope_scale[il])


def held_slots(store: KVStore, il: int, h: int) -> np.ndarray:
    """Head h's occupied slots of layer il in sequence order."""
    n = int(store.count[il][h])
    return np.argsort(store.seq[il][h, :n], kind="stable")


def stored_key_values(store: KVStore, il: int, h: int, slots: np.ndarray) -> np.ndarray:
    """(len(slots), hd) f32: those keys as the layer holds them (its layout), decoded from its KV type
    (with the layer's key offsets: KVStore.key_values)."""
    return store.key_values(il, h, slots)


def plain_keys(store: KVStore, il: int, h: int, slots: np.ndarray) -> np.ndarray:
    """(len(slots), hd) f32: those keys before RoPE, whatever the layer's layout."""
    mode = store.rope_mode(il)
    k = stored_key_values(store, il, h, slots)
    if mode in ("fused", "rk"):
        return k
    if mode == "stored":
        return _rotate(store.spec, il, k, -store.seq[il][h, slots])
    if mode == "kshift":
        return _rotate(store.spec, il, k, -store.pos[il][h, slots])
    if mode == "rebased":
        return _rotate(store.spec, il, k, -store.kbase[il][h, slots])
    raise ConfigError(f"layer {il}: no key layout set (the store was never adopted by an engine)")


def rotated_keys(store: KVStore, il: int, h: int, slots: np.ndarray) -> np.ndarray:
    """(len(slots), hd) f32: those keys rotated at their logical positions. A "stored" layer whose
    positions are the sequence indices (a fresh prefill, or original positions) and a "kshift" layer
    hold them so already: no rotation."""
    mode = store.rope_mode(il)
    pos = store.pos[il][h, slots]
    if mode == "kshift" or (mode == "stored" and np.array_equal(pos, store.seq[il][h, slots])):
        return stored_key_values(store, il, h, slots)
    return _rotate(store.spec, il, plain_keys(store, il, h, slots), pos)


def laid_out_keys(store: KVStore, il: int, h: int, slots: np.ndarray, mode: str, pos: np.ndarray) -> np.ndarray:
    """(len(slots), hd) f32: those keys of `store` as a ring layer in layout `mode` holds them at
    positions `pos` (stored: rotated at the sequence index; kshift: at the position; fused: before
    RoPE). Copied as they are, rows in the store's KV type, when the source already holds them that
    way; else float32 values (written through the destination's encoder)."""
    src = store.rope_mode(il)
    if mode == "stored" and src == "stored":
        return store.k[il][h, slots]
    if mode == "fused" and src in ("fused", "rk") and not store.offsets_keys(il):
        return store.k[il][h, slots]
    k = plain_keys(store, il, h, slots)
    if mode == "stored":
        return _rotate(store.spec, il, k, store.seq[il][h, slots])
    if mode == "kshift":
        return _rotate(store.spec, il, k, pos)
    return k


def transplant(store: KVStore, keep: list, kv: KVConfig, engine, layer_capacity: list[int] | None = None) -> KVStore:
    """A new store of config `kv` (ring policy: full or streaming; per-layer slots layer_capacity, else
    kv.capacity in every layer), adopted by `engine`, holding the
    tokens keep[il][h] (slots of `store`, in sequence order) of each layer and head, with their
    sequence indices, ranks, positions and values; n_seen as `store`, released = n_seen - the most any
    layer holds. ConfigError when a layer's kept tokens do not fit the new capacity."""
    spec = store.spec
    dst = KVStore(spec, kv, layer_capacity=layer_capacity)
    if not all(dst.layer_ring):
        raise ConfigError(f"a compressed prompt decodes under a ring policy, not {kv.policy!r}")
    if dst.reindexed or engine.rope == "rk":
        dst.ring_rope = "fused"
    engine.adopt_store(dst)
    held_max = 0
    for il in range(spec.n_layer):
        mode = dst.rope_mode(il)
        for h in range(spec.n_head_kv):
            slots = np.asarray(keep[il][h], np.int64)
            n = slots.size
            if n > dst.seq[il].shape[1]:
                raise ConfigError(f"layer {il} keeps {n} tokens, more than the decode store's {dst.seq[il].shape[1]}")
            seq = store.seq[il][h, slots]
            pos = np.arange(n, dtype=np.int64) if dst.reindexed else seq
            rows = laid_out_keys(store, il, h, slots, mode, pos)
            dst.k[il][h, :n] = rows if rows.dtype == dst.k[il].dtype else encode(rows, dst.kv.k_type, key=True)
            dst.v[il][h, :n] = store.v[il][h, slots]
            dst.seq[il][h, :n] = seq
            dst.rank[il][h, :n] = np.arange(n)
            dst.pos[il][h, :n] = pos
            dst.count[il][h] = n
            held_max = max(held_max, n)
    dst.n_seen = store.n_seen
    dst.released = store.n_seen - held_max
    return dst


# ---------------------------------------------------------------------------------------------
# The compressing prefill
# ---------------------------------------------------------------------------------------------


def decode_capacities(kv: KVConfig, most: list[int], room: int, n_ctx: int) -> list[int]:
    """Per-layer slots of the decode store: the most a head of the layer keeps plus the room (full:
    the tokens still to generate, within the context; streaming: KVConfig.capacity)."""
    if kv.policy == "full":
        return [min(n + max(room, 1), n_ctx) for n in most]
    return [n + kv.capacity for n in most]


def layer_prompt(store: KVStore, il: int, cap: PrefillCapture, m: int) -> LayerPrompt:
    """Layer il of the prefilled transient store as runtime/press.py takes it."""
    spec = store.spec
    keys, seqs, qpos = [], [], []
    first = cap.first
    for h in range(spec.n_head_kv):
        slots = held_slots(store, il, h)
        seq = store.seq[il][h, slots]
        pos = store.pos[il][h, slots]
        keys.append(rotated_keys(store, il, h, slots))
        seqs.append(seq)
        qpos.append(pos[np.searchsorted(seq, np.arange(first, cap.end))])
    windowed = bool(spec.window[il])
    hidden = cap.gaussian(il) if cap.hidden else None
    return LayerPrompt(keys, seqs, m, cap.q[il], np.stack(qpos), np.arange(first, cap.end), hidden, windowed)


def query_weights(engine, il: int) -> tuple:
    """(wq (n_head*hd, n_embd) f32, bias or None, q_norm weight or None) of layer il, for gvote."""
    from ringllm.runtime.dequant import dequantize

    t = engine.tensors[f"blk.{il}.attn_q.weight"]
    wq = dequantize(t.data, t.qtype, t.shape).reshape(t.shape)
    return wq, engine.vecs.get(f"blk.{il}.attn_q.bias"), engine.vecs.get(f"blk.{il}.attn_q_norm.weight")


def compress_prefill(engine, ids, kv: KVConfig, room: int, prior: KVStore | None = None):
    """Prefill ids (after `prior`'s tokens, a chat session's store, or from nothing), press, and
    rebuild (module docstring). room: the slots the decode store keeps beside the kept tokens (full:
    the tokens the call may still generate; streaming: KVConfig.capacity). Returns (decode store,
    the last token's logits (n_vocab,) f32, a new array). ConfigError for a prompt longer than
    KVConfig.max_prompt (default the model's context) or past the context with what `prior` holds."""
    limit = kv.max_prompt or engine.spec.n_ctx
    if len(ids) > limit:
        raise ConfigError(f"the prompt has {len(ids)} tokens, more than max_prompt {limit}: raise KVConfig.max_prompt "
                          "or shorten the prompt")
    transient, cap, logits = prefill_whole(engine, ids, kv.positions, kv.compress_window,
                                           hidden=kv.compress == "gvote", prior=prior, decode_kv=kv)
    return press_store(engine, transient, cap, kv, room, consume=True), logits


def prefill_whole(engine, ids, positions: str, window: int, hidden: bool, prior: KVStore | None = None,
                  decode_kv: KVConfig | None = None):
    """Steps 1 of the module docstring: (transient store holding prior's tokens and ids, its
    PrefillCapture of the last `window` queries (and the Gaussian of the attention inputs when
    hidden), the last token's logits (n_vocab,) f32). The transient store is left untouched by
    press_store unless it is told to consume it, so one prefill can be pressed many ways
    (bench/compression_ruler.py). decode_kv: the compressing KVConfig when its decode-time policy
    evicts by a score (not a ring): the transient store then runs that policy, sized so it evicts
    nothing (policy_transient), and builds the policy's state over the whole prompt."""
    spec = engine.spec
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    m = ids.size
    full = {"policy": "full", "positions": positions}
    held = 0 if prior is None else max(int(c.max()) for c in prior.count)
    if held + m > spec.n_ctx:
        raise ConfigError(f"{held + m} tokens (held and new) exceed the model's context {spec.n_ctx}: a compressing "
                          "prefill holds the whole prompt first")
    if decode_kv is not None and not decode_kv.ring:
        transient = policy_transient(engine, decode_kv, m, prior)
    elif prior is None:
        transient = engine.new_store(KVConfig(capacity=m, **full))
    else:
        keep_all = [[held_slots(prior, il, h) for h in range(spec.n_head_kv)] for il in range(spec.n_layer)]
        transient = transplant(prior, keep_all, KVConfig(capacity=held + m, **full), engine)
    w = min(window, m)
    cap = PrefillCapture(spec, transient.n_seen + m - w, transient.n_seen + m, hidden=hidden, m=m)
    transient.query_hook = cap
    try:
        logits = np.array(engine.prefill(ids, transient), dtype=np.float32)
    finally:
        transient.query_hook = None
    return transient, cap, logits


def layer_prompts(transient: KVStore, cap: PrefillCapture) -> list[LayerPrompt]:
    """Every layer's LayerPrompt of a prefilled transient store, with memos: pass them to press_store
    to press one prefill many ways without recomputing the rotated keys and window attention."""
    out = [layer_prompt(transient, il, cap, cap.m) for il in range(transient.spec.n_layer)]
    for lp in out:
        lp.memo = {}
    return out


def policy_transient(engine, kv: KVConfig, m: int, prior: KVStore | None) -> KVStore:
    """The transient store of a prompt compressed under an evicting decode-time policy: kv's policy,
    each layer sized to hold what `prior` holds there plus the m new tokens, so the prefill evicts
    nothing while the policy keeps its per-token state (h2o's masses, scissorhands' history, lsh's
    codes, rkv's key sums, gvote's queries) for every token; a sliding-window layer (never pressed)
    keeps window_capacity. prior (a store this path built, or streamed, a chat session's) is resized
    up, its state carried."""
    spec = engine.spec
    held = [0] * spec.n_layer if prior is None else [int(c.max()) for c in prior.count]
    floor = kv.sinks + kv.resolved_recent + 1        # a policy layer keeps one slot evictable (KVStore)
    caps = [window_capacity(spec, prior, il) if spec.window[il] else max(held[il] + m, floor)
            for il in range(spec.n_layer)]
    if prior is None:       # the policy's recent window as kv's capacity sets it, not the larger store's
        decode_kv = replace(kv.decode_config(max(max(caps), kv.capacity)), recent=kv.resolved_recent)
        return engine.adopt_store(KVStore(spec, decode_kv, layer_capacity=caps))
    return engine.adopt_store(prior.resized(caps))


def window_capacity(spec, store: KVStore | None, il: int) -> int:
    """The capacity a sliding-window layer il keeps in a compressed store (it is never pressed): a ring
    of its window, unless `store` (a chat session's earlier store) holds it as a policy layer, as a
    streamed turn (compress_overflow "stream") under staged streaming with a capacity below the window
    builds it: then that layer and capacity, since KVStore.resized keeps each layer's kind. (A ring
    decode-time policy rebuilds its store by transplant instead: there a pressed turn's window layers
    are rings of the window again, whatever the turn before held.)"""
    if store is not None and not store.layer_ring[il]:
        return store.layer_capacity[il]
    return spec.window[il]


def policy_capacities(store: KVStore, kv: KVConfig, most: list[int]) -> list[int]:
    """Per-layer capacities of a compressed store under an evicting decode-time policy: the most a
    head of the layer keeps plus the policy's own budget for the layer at kv.capacity (pyramidkv's
    line, the capacity for the others); a sliding-window layer what window_capacity says."""
    spec = store.spec
    budgets = store.policy_impl.layer_budgets(kv.capacity, spec.n_layer)
    return [window_capacity(spec, store, il) if spec.window[il] else most[il] + budgets[il] for il in range(spec.n_layer)]


def evict_unkept(store: KVStore, keep: list) -> None:
    """Drop from each pressed (non-window) layer of `store` the held tokens not in keep[il][h] (slots),
    with KVStore.evict: every survivor's policy state moves with its slot."""
    for il in range(store.spec.n_layer):
        if store.spec.window[il]:
            continue
        drops = []
        for h in range(store.spec.n_head_kv):
            held = np.arange(int(store.count[il][h]), dtype=np.int64)
            drops.append(np.setdiff1d(held, np.asarray(keep[il][h], np.int64), assume_unique=True))
        store.evict(il, drops)


def press_store(engine, transient: KVStore, cap: PrefillCapture, kv: KVConfig, room: int,
                prompts: list[LayerPrompt] | None = None, consume: bool = False) -> KVStore:
    """Steps 2 and 3 of the module docstring: kv's press over the prompt prefilled into `transient`
    (the capture's window cut to kv.compress_window when it is wider), then the decode store, with
    `room` slots beside the kept tokens (compress_prefill). prompts: layer_prompts(transient, cap),
    made with the same window, to reuse across presses. Under an evicting decode-time policy the
    transient store (prefill_whole's policy_transient) loses the unkept tokens (KVStore.evict) and is
    resized to policy_capacities: in place when `consume` (the caller drops it), else on a fork."""
    spec = engine.spec
    m = cap.m
    if not kv.ring and transient.policy != kv.policy:
        raise ConfigError(f"press_store: decode-time policy {kv.policy!r} needs a transient store of that policy "
                          f"(prefill_whole with decode_kv), not {transient.policy!r}")
    if kv.compress_window < cap.end - cap.first:      # a capture wider than this press's window
        cap = cap.narrowed(kv.compress_window)
    keep, kept_total, chosen_total, candidates = [], 0, 0, 0
    for il in range(spec.n_layer):
        lp = prompts[il] if prompts is not None else layer_prompt(transient, il, cap, m)
        chosen = choose_layer(spec, il, lp, kv, query_weights(engine, il) if kv.compress == "gvote" else None)
        if not lp.windowed:
            chosen_total += sum(c.size for c in chosen)
            if kv.equal_head_counts:      # a ragged press under a per-head evicting policy
                chosen = equal_counts(chosen, m)
        row = []
        for h in range(spec.n_head_kv):
            slots = held_slots(transient, il, h)
            n_h = slots.size
            if lp.windowed:                  # a sliding window keeps what it holds
                row.append(slots)
                continue
            row.append(np.concatenate([slots[:n_h - m], slots[n_h - m:][chosen[h]]]))
            kept_total += chosen[h].size
            candidates += m
        keep.append(row)
    most = [max(r.size for r in row) for row in keep]
    if kv.ring:
        caps = decode_capacities(kv, most, room, spec.n_ctx)
        decode = transplant(transient, keep, kv.decode_config(max(caps)), engine, layer_capacity=caps)
    else:
        work = transient if consume else transient.fork()
        evict_unkept(work, keep)
        caps = policy_capacities(work, kv, most)
        decode = engine.adopt_store(work.resized(caps, capacity=max(caps + [kv.capacity])))
        decode.released = decode.n_seen - max(int(c.max()) for c in decode.count)
    # kept_share: the share of the prompt's tokens held per pressed head; chosen_share: the press's own
    # choice (below kept_share where equal_counts topped ragged heads up)
    decode.press_stats = {"press": kv.compress, "prompt_tokens": int(m),
                          "kept_share": kept_total / candidates if candidates else 1.0,
                          "chosen_share": chosen_total / candidates if candidates else 1.0}
    return decode
