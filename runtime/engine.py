"""The CPU engine: batch-1 decode and chunked prefill over the in-place KV store, Numba kernels throughout.

One forward pass, top to bottom, for a chunk of T tokens (T = 1 when decoding):

    x (T, n_embd) = embed(tokens) * embed_scale
    per layer il:
        h = norm(x)                                      attn_norm
        q, k, v = h @ Wq.T, h @ Wk.T, h @ Wv.T (+ bias)  quantized matvec (T = 1) / matmul (T > 1)
        [q, k = rms_norm per head]                       qk_norm (Gemma 3)
        per token t: store.write(il, k[t], v[t]); att[t] = attend(q[t], store)   in place, RoPE by slot position
        a = att @ Wo.T (+ bias)  [post_attention_norm]
        x = x + a (+ ffn(norm(x)) in parallel when parallel_residual) ...
        ffn: down(act(gate h) * up h)  [post_ffw_norm]
    logits = norm(x) @ W_out.T  [softcap]

All buffers are allocated at construction for `n_batch` rows; a decode step reuses T = 1 views
made once, so the decode loop allocates no arrays.
"""
from __future__ import annotations

import os
import weakref
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

from ringllm.runtime import matvec as mv
from ringllm.runtime import compiler_pages, omp_spin
from ringllm.runtime.chunk_attention import MIN_PAIRS, chunk_fits, chunk_pays, write_attend_chunk
from ringllm.runtime.dequant import dequantize, dequantize_rows
from ringllm.runtime.errors import ConfigError
from ringllm.runtime.host_memory import release_array_pages, release_row_pages
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.kv_codec import round_trip
from ringllm.runtime.kv_store import KVStore
from ringllm.runtime.model_spec import ModelSpec
from ringllm.runtime.policies.base import Policy
from ringllm.runtime.policy_step import policy_write_attend
from ringllm.runtime.ops import (ACT_CODES, act_inplace, add_bias, gated_act, gated_act_fused, layer_norm_rows,
                                 rms_norm_rows, softcap)
from ringllm.runtime.qtensor import QTensor
from ringllm.runtime.rope import STRATEGIES, AttendScratch, layer_ropes
from ringllm.runtime.rope_kernels import REBASE_LIMIT


def _streams():
    """runtime.stream_attention, imported by the first batched step of B > 1 sequences: its kernels and
    typed-list helpers are a share of every process's import, and only step_batch uses them."""
    from ringllm.runtime import stream_attention
    return stream_attention


MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


class _Buffers:
    """Run buffers for T rows: x, h, a, h2 (T, n_embd); q, att (T, n_head*hd); k, v (T, n_kv*hd);
    ff_a, ff_b (T, n_ff); stacked outputs qkv (T, q+2kv), ff_gu (T, 2 n_ff)."""

    def __init__(self, spec: ModelSpec, T: int):
        e, q, kv = spec.n_embd, spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
        f32 = np.float32
        self.x, self.h, self.a = np.zeros((T, e), f32), np.zeros((T, e), f32), np.zeros((T, e), f32)
        self.q, self.att = np.zeros((T, q), f32), np.zeros((T, q), f32)
        self.k, self.v = np.zeros((T, kv), f32), np.zeros((T, kv), f32)
        self.ff_a, self.ff_b = np.zeros((T, spec.n_ff), f32), np.zeros((T, spec.n_ff), f32)
        self.h2 = np.zeros((T, e), f32)
        self.qkv = np.zeros((T, q + 2 * kv), f32)            # stacked q|k|v projection
        self.ff_gu = np.zeros((T, 2 * spec.n_ff), f32)       # stacked gate|up projection

    def view(self, T: int) -> "_Buffers":
        """The first T rows of every buffer (views)."""
        return self._rows(slice(0, T))

    def view_row(self, t: int) -> "_Buffers":
        """Row t of every buffer, as (1, width) views."""
        return self._rows(slice(t, t + 1))

    def _rows(self, rows: slice) -> "_Buffers":
        out = object.__new__(_Buffers)
        for name, arr in vars(self).items():
            setattr(out, name, arr[rows])
        return out


class CPUEngine:
    """Numba engine for one model.

    Args:
        spec, tensors: a LoadedModel's fields (internal names, see ModelSpec).
        n_threads: Numba threads for the kernels (None = all cores).
        n_batch: rows per prefill chunk (matrix-matrix kernels); longer prompts go in chunks.
        rope: where RoPE is applied on the layers the store's ring serves (every one exact; the
            strategies are in runtime/rope.py):
            "stored" (default): keys rotated once at write by their sequence index, the query rotated
                by each slot's offset (sequence index - logical position) at read;
            "fused": keys stored plain, each rotated by its slot's logical position as it is read;
            "rk": EQUIP's cached rotate-half: rotate_half(k) stored beside each key (+50% KV memory),
                keys rotated at read by two multiply-adds per dim;
            "kshift": keys stored rotated at their logical position and re-rotated by the position
                change when an eviction re-indexes them (llama.cpp's K-shift).
        Layers where a policy chooses victims use "rebased" (keys rotated at a per-slot base position
        kept within REBASE_LIMIT of the slot's position, the query rotated once per offset: see
        attention.attend_rebased), or "fused" when rope is "fused", the policy reads the stored
        keys as they were before RoPE (rkv, gvote), or the keys are quantized (KVConfig.k_type: a
        re-rotation would quantize a key again). bench/rope_strategies.py measures them.
        precision: "f32" (default): the weight products take float32 activations, exact up to the
            accumulation order; "q8": llama.cpp's numerics, activations quantized to 8 bits per
            block in every product with a Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q6_K weight (integer dot
            products, faster; matvec.py), other weight types exact. Attention, norms and the KV
            store stay float32 in both.
    """

    ROPE_MODES = tuple(STRATEGIES)

    def __init__(self, spec: ModelSpec, tensors: dict[str, QTensor], n_threads: int | None = None, n_batch: int = 64,
                 rope: str = "stored", precision: str = "f32"):
        if rope not in self.ROPE_MODES:
            raise ConfigError(f"rope {rope!r} unknown; valid: {self.ROPE_MODES}")
        if precision not in mv.PRECISIONS:
            raise ConfigError(f"precision {precision!r} unknown; valid: {mv.PRECISIONS} (q8: 8-bit activations "
                              "in the weight products, as llama.cpp computes them)")
        self.rope, self.precision = rope, precision
        if n_threads is not None:
            if not isinstance(n_threads, int) or n_threads < 1:
                raise ConfigError(f"n_threads must be a positive integer, got {n_threads!r}")
            if n_threads > numba.config.NUMBA_NUM_THREADS:
                raise ConfigError(f"n_threads {n_threads} exceeds the {numba.config.NUMBA_NUM_THREADS} threads "
                                  "Numba was started with (NUMBA_NUM_THREADS)")
        if n_batch < 1:
            raise ConfigError(f"n_batch must be >= 1, got {n_batch}")
        self.spec, self.n_threads, self.n_batch = spec, n_threads, n_batch
        omp_spin.calibrate()               # before the packing kernels start libgomp (runtime/omp_spin.py)
        self.tensors = tensors            # the checkpoint's tensors as loaded (a press reads W_q: runtime/compress.py)
        self.mats = self._pack_matrices(tensors)
        self.vecs = {name: dequantize(t.data, t.qtype, t.shape) for name, t in tensors.items() if len(t.shape) == 1}
        release_array_pages(t.data for t in tensors.values() if len(t.shape) == 1)    # as packing does (host_memory)
        self.embd = tensors["token_embd.weight"]
        self.out_w = self.mats["token_embd.weight" if spec.tied_output else "output.weight"]
        self.act = ACT_CODES[spec.act]
        self.buf = _Buffers(spec, n_batch)
        self.buf1 = self.buf.view(1)
        self.chunk_min_pairs = MIN_PAIRS    # chunks attending fewer query-key pairs go token by token (chunk_pays)
        self._few_rows = False              # step_batch, or forward(few_rows=True): the few-row kernels serve (_matmul)
        self._streams = None                # StreamArrays of step_batch's last group of stores, or None
        self._streams_on = False            # inside step_batch with B > 1: _layer attends through _streams
        self._streams_fit = None            # per layer, whether _streams takes it this step (streams_fit)
        self._stream_seqs = None            # their tokens' sequence indices (B,) i64
        self.logits_buf = np.zeros((n_batch, spec.n_vocab), np.float32)
        nh, hd = spec.n_head, spec.head_dim
        self.sc = AttendScratch(nh, spec.n_head_kv, hd, spec.rotary_dim)     # one token's attention buffers
        self.chunk_q = np.zeros((n_batch, nh, hd), np.float32)      # a prefill chunk's rotated queries
        self.adopter_token = object()      # marks the stores adopt_store sized this engine's scratch for
        self.no_mass = np.zeros((0, 0), np.float32)
        self.qvar = np.zeros((REBASE_LIMIT, nh, hd), np.float32)     # attend_rebased: query per offset
        self.qvar_have = np.zeros(REBASE_LIMIT, np.int64)
        # the same per kv head, for the policies' compiled layer steps (heads on separate threads)
        nkv = spec.n_head_kv
        self.head_qvar = np.zeros((nkv, REBASE_LIMIT, nh // nkv, hd), np.float32)
        self.head_have = np.zeros((nkv, REBASE_LIMIT), np.int64)
        self.head_krot = np.zeros((nkv, hd), np.float32)
        # per layer: RoPE tables and constants (shared by layers of the same base and scale)
        self.layer_ropes = layer_ropes(spec, STRATEGIES[rope].table_rows)
        self.offs = np.zeros(0, np.int64)          # attend_rebased: each slot's offset
        self.head_offs = np.zeros((spec.n_head_kv, 0), np.int64)

    def _pack_matrices(self, tensors: dict[str, QTensor]) -> dict:
        """Repack every matrix once. Projections that read the same input and share a GGML type are
        stacked into one matrix (q|k|v -> attn_qkv, gate|up -> ffn_gate_up): one kernel call instead
        of three or two per token. When v alone has another type (Q4_K_M files store attn_v of some
        layers as Q6_K), q|k are stacked (attn_qk) and v stays apart."""
        spec, mats = self.spec, {}
        for name, t in tensors.items():
            if len(t.shape) == 2 and (name != "token_embd.weight" or spec.tied_output):
                mats[name] = t
        for il in range(spec.n_layer):
            p = f"blk.{il}."
            for fused, parts in (("attn_qkv", ("attn_q", "attn_k", "attn_v")), ("attn_qk", ("attn_q", "attn_k")),
                                 ("ffn_gate_up", ("ffn_gate", "ffn_up"))):
                names = [p + part + ".weight" for part in parts]
                if all(n in mats for n in names) and len({int(mats[n].qtype) for n in names}) == 1:
                    mats[p + fused + ".weight"] = [mats.pop(n) for n in names]
        # NumPy releases the GIL in the repacking's array operations: matrices pack side by side
        workers = self.n_threads or os.cpu_count() or 1

        def pack(t):      # (packing drops each packed chunk's file pages: packing.pack_in_chunks)
            packed = mv.pack(t, self.precision)
            compiler_pages.release()     # the first pack of a type loaded its kernel: LLVM's pages go now,
            return packed                # not after the last matrix (the load's peak holds them otherwise)
        if workers == 1:
            packed = {name: pack(t) for name, t in mats.items()}
        else:
            with ThreadPoolExecutor(workers) as pool:
                packed = dict(zip(mats, pool.map(pack, mats.values())))
        # q8: one set of quantized-activation buffers per input width, shared by the matrices (the engine
        # runs one product at a time; per matrix they would hold ~170 MB on a 1B model at 512-row chunks)
        shared = {}
        for pm in packed.values():
            if pm.q8 is not None:
                pm.q8_acts = shared.setdefault(pm.n_cols, pm.q8_acts)
        return packed

    # -----------------------------------------------------------------------------------------
    # Public verbs
    # -----------------------------------------------------------------------------------------

    def new_store(self, kv: KVConfig | None = None, **kwargs) -> KVStore:
        """A fresh KV store for one sequence: from a KVConfig, or keyword arguments of one."""
        return self.adopt_store(KVStore(self.spec, kv, **kwargs))

    def adopt_store(self, store: KVStore) -> KVStore:
        """Size this engine's scratch for `store` (one built elsewhere, e.g. KVStore.restore).

        Layers where an eviction policy chooses victims use "rebased" RoPE (or "fused", see the class
        docstring) whatever self.rope says: their slots are permuted and re-ranked freely, so the
        offsets of the stored strategy would vary from slot to slot. A store whose policy layers
        were laid out for the other of those two is converted in place."""
        cap = max(store.layer_physical)
        if self.sc.grow(cap):
            self.offs = np.zeros(cap, np.int64)
            self.head_offs = np.zeros((self.spec.n_head_kv, cap), np.int64)
        plain = self.rope == "fused" or store.policy_impl.plain_keys or store.kv.quantized_keys
        policy_mode = "fused" if plain else "rebased"
        ring_mode = store.ring_rope or self.rope          # a compressed store may fix its own (kv_store.py)
        modes = [policy_mode if store.uses_policy(il) else ring_mode for il in range(self.spec.n_layer)]
        if "rk" in modes and store.kv.quantized_keys:
            raise ConfigError(f"rope 'rk' caches rotate_half(k) in float32 beside f32 keys; k_type "
                              f"{store.kv.k_type!r} needs rope 'stored', 'fused' or 'kshift'")
        if store.update == "shift" and self.rope in ("rk", "kshift"):
            raise ConfigError(f"rope {self.rope!r} works on the in-place store only (update 'inplace')")
        old = store.layer_rope_mode
        if old is not None and old != modes and store.n_seen > 0:
            if any(a != b and not store.uses_policy(il) for il, (a, b) in enumerate(zip(old, modes))):
                raise ConfigError(f"this store holds keys laid out for RoPE strategy {old[0]!r}; this engine uses "
                                  f"{self.rope!r}: continue it with an engine of the same strategy")
            for il, (a, b) in enumerate(zip(old, modes)):
                store.convert_rope_layout(il, a, b)
        store.layer_rope_mode = modes
        store.adopter = self.adopter_token
        if {"fused", "rk", "rebased"} & set(modes):
            for rope in self.layer_ropes:
                rope.table.ensure(cap + REBASE_LIMIT + 1)
                rope.full.ensure(cap + 1)
        return store

    def _needs_adoption(self, store) -> bool:
        """Whether `store` must go through adopt_store before this engine feeds it: a dense store this
        engine has not adopted (new, forked, restored, or last fed by another engine) may need its
        layout converted and this engine's scratch grown (the kernels index the scratch by slot,
        unchecked). A paged store lays itself out."""
        return not getattr(store, "paged", False) and getattr(store, "adopter", None) is not self.adopter_token

    def _prepare(self, store, n_new: int) -> None:
        """Before feeding n_new tokens into `store`: its room checked, the store adopted when it must be,
        and Numba's thread count set to this engine's."""
        store.check_room(n_new)
        if self._needs_adoption(store):
            self.adopt_store(store)
        if self.n_threads is not None:
            numba.set_num_threads(self.n_threads)

    def step(self, token: int, store: KVStore) -> np.ndarray:
        """Decode one token; returns its logits (n_vocab,) float32 (a view, valid until the next call)."""
        return self.forward([token], store, all_logits=False)[0]

    def prefill(self, ids, store: KVStore) -> np.ndarray:
        """Feed a prompt in chunks of n_batch; returns the last token's logits (n_vocab,) (a view, valid until
        the next call)."""
        return self.forward(ids, store, all_logits=False)[-1]

    def logits(self, ids, store: KVStore, few_rows: bool = False) -> np.ndarray:
        """Logits (len(ids), n_vocab) of every token fed through the store (decode semantics); few_rows:
        see forward."""
        return self.forward(ids, store, all_logits=True, few_rows=few_rows)

    def attend_and_head(self, store: KVStore) -> np.ndarray:
        """The parts of a decode step that come after the matrix products, alone: every layer writes
        and attends one token of zeros into `store`, then the output head runs on a zero row. The
        kernels of a step in the order a compile helper wants them (runtime/warmup.warm_decode: a
        prompt reaches them only after its first matrix product); returns the head's logits (1,
        n_vocab), a view of the run buffer."""
        if getattr(store, "paged", False):
            raise ConfigError("attend_and_head works on dense KVStores")
        self._prepare(store, 1)
        s, b = self.spec, self.buf1
        for arr in (b.x, b.q, b.k, b.v):
            arr[:] = 0.0
        kk, v3 = b.k.reshape(1, s.n_head_kv, s.head_dim), b.v.reshape(1, s.n_head_kv, s.head_dim)
        scale, attn_cap = np.float32(s.attn_scale), np.float32(s.attn_softcap)
        for il in range(s.n_layer):
            self._attend_dense(il, b, store, store.n_seen, 0, 1, kk, v3, self.layer_ropes[il], scale, attn_cap)
        store.n_seen += 1
        return self._head(b, 1)

    def attend_empty(self, store: KVStore) -> None:
        """Layer 0's attention kernel alone, over `store` before anything is written to it (a zero
        query over no slots; the output is discarded; a policy layer 0 does nothing): the kernel a
        compile helper wants first (runtime/warmup.warm_decode), without the RoPE and write kernels a
        token's attention runs before it, which the parent compiles meanwhile."""
        if getattr(store, "paged", False) or store.uses_policy(0):
            return
        self._prepare(store, 0)
        s = self.spec
        q = np.zeros((s.n_head, s.head_dim), np.float32)
        STRATEGIES[store.layer_rope_mode[0]].attend(store, 0, self.layer_ropes[0], q, store.n_seen,
                                                    np.float32(s.attn_scale), np.float32(s.attn_softcap),
                                                    self.no_mass, self.sc)

    def warm_ahead(self) -> list:
        """Callables that each run, on private buffers (nothing a run or a store holds is touched),
        kernels a prompt meets only after its first layer's attention, in about the order it meets
        them: the FFN activation; a prompt chunk's product for each weight family (the tiled kernel,
        TILED_MIN_T rows: layers past the first may hold other types); the output head (its norm, its
        one-row product, the final softcap); then a decode step's products (one callable per product
        kernel). A cold start's parent runs them while it waits for the helper's attention kernel
        (compile_share.when_idle), and the helper after that kernel (compile_share.run_unclaimed), so
        that the two split them (each skips what the other has claimed) rather than the parent
        compiling them one after another after its wait. A prompt of fewer than TILED_MIN_T tokens
        never needs the tiled kernels (its products are matvecs). The callables hold this engine
        weakly (a queued job that never ran must not keep a dropped engine's weights alive); once it
        is gone they do nothing."""
        engine = weakref.ref(self)

        def job(work):
            def run():
                eng = engine()
                if eng is not None:
                    work(eng)
            return run

        def activation(eng):
            eng._activate(_Buffers(eng.spec, 1), eng._ffn_fused(0))

        def head(eng):
            eng._head(_Buffers(eng.spec, 1), 1, out=np.empty((1, eng.spec.n_vocab), np.float32))

        def product(name, rows):
            def work(eng):
                pm = eng.mats[name]
                out, x = np.empty((rows, pm.n_rows), np.float32), np.zeros((rows, pm.n_cols), np.float32)
                if rows == 1:
                    eng._matmul(out, pm, x)
                else:
                    mv.matmul(out, pm, x, few_rows=False)        # as a prompt chunk's product (_matmul)
            return job(work)

        decode_kernels, families = {}, {}
        for name, pm in self.mats.items():
            decode_kernels.setdefault(pm.q8_kernel if pm.q8 is not None else pm.kernel, name)
            if pm.q8 is None:            # (the q8 mode's products are its decode kernels at any row count)
                families.setdefault(pm.family, name)
        return ([job(activation)] + [product(name, mv.TILED_MIN_T) for name in families.values()] + [job(head)]
                + [product(name, 1) for name in decode_kernels.values()])

    def step_batch(self, tokens, stores) -> np.ndarray:
        """Decode one token for each of B sequences at once: tokens (B,) ints, stores (B,) distinct
        KVStores (each with its own capacity, policy and position). The projections, FFN and head run
        over the B rows as matrix-matrix products; each row writes and attends its own store. Returns
        logits (B, n_vocab) float32, a new array. Equal to B calls of step() up to the rounding of the
        matrix-matrix kernels (the same ones chunked prefill uses)."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        stores = list(stores)
        if ids.size == 0 or ids.size != len(stores):
            raise ConfigError(f"step_batch needs one token per store; got {ids.size} tokens for {len(stores)} stores")
        if len({id(st) for st in stores}) != len(stores):
            raise ConfigError("step_batch: a store appears twice; each sequence needs its own store")
        if ids.min() < 0 or ids.max() >= self.spec.n_vocab:
            raise ConfigError(f"token ids must be in [0, {self.spec.n_vocab}); got {ids.min()}..{ids.max()}")
        for st in stores:
            if getattr(st, "paged", False):
                raise ConfigError("step_batch works on dense KVStores; paged stores decode one at a time (step)")
            self._prepare(st, 1)
        out = np.empty((ids.size, self.spec.n_vocab), np.float32)
        self._few_rows = True
        try:
            self._step_groups(ids, stores, out)
        finally:
            self._few_rows = self._streams_on = False
        return out

    def release_batch(self) -> None:
        """Drop the references step_batch keeps to its last batch's stores (the typed lists of their
        arrays, reused while the batch keeps them): call when the batch is over, so finished
        sequences' stores can be freed."""
        self._streams = None

    def _step_groups(self, ids: np.ndarray, stores: list, out: np.ndarray) -> None:
        """step_batch's pass, n_batch sequences at a time: logits into out (B, n_vocab)."""
        for start in range(0, ids.size, self.n_batch):
            part, group = ids[start:start + self.n_batch], stores[start:start + self.n_batch]
            B = part.size
            b = self.buf1 if B == 1 else self.buf.view(B)
            self._embed(b, part)
            segments = [(st, st.n_seen, r, 1) for r, st in enumerate(group)]
            if B > 1:                       # every sequence's write and attention in one parallel call per layer
                sa = _streams()
                if self._streams is None or not self._streams.matches(group):
                    self._streams = sa.StreamArrays(group, self.spec.n_layer)
                self._stream_seqs = np.array([st.n_seen for st in group], np.int64)
                self._streams_fit = sa.streams_fit(self._streams)
            self._streams_on = B > 1
            for il in range(self.spec.n_layer):
                self._layer(il, b, segments)
            self._streams_on = False
            for st in group:
                st.n_seen += 1
            out[start:start + B] = self._head(b, B)

    def forward(self, ids, store: KVStore, all_logits: bool = True, few_rows: bool = False) -> np.ndarray:
        """Feed ids through the store. all_logits: a new (len(ids), n_vocab) array; else the last
        token's logits (1, n_vocab) as a view of the run buffer, valid until the next call.
        few_rows: a chunk of 2 to matvec.MATMUL_MIN_T - 1 rows takes the few-row products (each weight
        decoded once per pair of rows; the same bits as one matvec per row) instead of one matvec per
        row (below matvec.TILED_MIN_T) or the tiled kernel: for a caller that feeds a few rows again and
        again (speculative verification and drafting), at the price of compiling those kernels."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ConfigError("no tokens to feed")
        if ids.min() < 0 or ids.max() >= self.spec.n_vocab:
            raise ConfigError(f"token ids must be in [0, {self.spec.n_vocab}); got {ids.min()}..{ids.max()}")
        self._prepare(store, ids.size)
        out = np.zeros((ids.size, self.spec.n_vocab), np.float32) if all_logits else None
        self._few_rows = bool(few_rows)
        try:
            for start in range(0, ids.size, self.n_batch):
                chunk = ids[start:start + self.n_batch]
                last = start + chunk.size == ids.size
                logits = self._chunk(chunk, store, want_logits="all" if all_logits else "last" if last else None)
                if all_logits:
                    out[start:start + chunk.size] = logits
                elif last:
                    return logits    # (1, n_vocab), a view of the run buffer: decode allocates no logits array
        finally:
            self._few_rows = False
        return out

    # -----------------------------------------------------------------------------------------
    # The pass
    # -----------------------------------------------------------------------------------------

    def _matmul(self, out: np.ndarray, pm, x: np.ndarray) -> None:
        """out (T, n_out) = x (T, n_in) @ W.T. T = 1 calls the kernel directly: the engine's own
        contiguous float32 buffers were shaped for these matrices at construction (so are the q8
        kernels: the engine's x and out are C-contiguous). The few-row
        kernels serve step_batch and forward(few_rows=True) only (self._few_rows); a prefill chunk of few
        rows runs one matvec per row or the tiled kernel, so that one sequence never compiles them
        (matvec.TILED_MIN_T)."""
        if pm.q8 is not None:        # one kernel call: it quantizes x into the matrix's buffers, then multiplies
            pm.q8_kernel(out, pm.buf, x, *pm.q8_acts.for_rows(x.shape[0]), pm.n_blocks)
        elif x.shape[0] == 1:
            pm.kernel(out[0], pm.buf, x[0], pm.scratch)
        else:
            mv.matmul(out, pm, x, few_rows=self._few_rows)

    def _linear(self, out: np.ndarray, name: str, x: np.ndarray) -> None:
        """out (T, n_out) = x (T, n_in) @ W.T (+ bias)."""
        self._matmul(out, self.mats[name + ".weight"], x)
        bias = self.vecs.get(name + ".bias")
        if bias is not None:
            add_bias(out, bias)

    def _qkv(self, b: "_Buffers", p: str) -> None:
        """b.q, b.k, b.v = projections of b.h (one stacked matrix when the file allows it, else q|k
        stacked and v apart, else three)."""
        pm = self.mats.get(p + "attn_qkv.weight")
        if pm is None:
            pm = self.mats.get(p + "attn_qk.weight")
            if pm is None:
                self._linear(b.q, p + "attn_q", b.h)
                self._linear(b.k, p + "attn_k", b.h)
                self._linear(b.v, p + "attn_v", b.h)
                return
            self._matmul(b.v, self.mats[p + "attn_v.weight"], b.h)
        qkv = b.qkv[:, :pm.n_rows]
        self._matmul(qkv, pm, b.h)
        nq, nk = b.q.shape[1], b.k.shape[1]
        b.q[:] = qkv[:, :nq]
        b.k[:] = qkv[:, nq:nq + nk]
        if pm.n_rows > nq + nk:
            b.v[:] = qkv[:, nq + nk:]
        for part, buf in (("attn_q", b.q), ("attn_k", b.k), ("attn_v", b.v)):
            bias = self.vecs.get(p + part + ".bias")
            if bias is not None:
                add_bias(buf, bias)

    def _norm(self, out: np.ndarray, x: np.ndarray, name: str) -> None:
        if self.spec.norm == "layer":
            layer_norm_rows(out, x, self.vecs[name + ".weight"], self.vecs[name + ".bias"], self.spec.norm_eps)
        else:
            rms_norm_rows(out, x, self.vecs[name + ".weight"], self.spec.norm_eps)

    def _chunk(self, ids: np.ndarray, store: KVStore, want_logits: str | None) -> np.ndarray:
        """Feed ids (T,) through every layer. want_logits "all": logits (T, n_vocab); "last": the last
        row's only (1, n_vocab), the output head run on that row alone (a prompt's other rows need
        none); None: nothing (an empty view)."""
        s = self.spec
        T = ids.size
        b = self.buf1 if T == 1 else self.buf.view(T)
        self._embed(b, ids)
        segments = [(store, store.n_seen, 0, T)]
        for il in range(s.n_layer):
            self._layer(il, b, segments)
        store.n_seen += T
        if want_logits is None:
            return self.logits_buf[:0]
        if want_logits == "last" and T > 1:
            return self._head(b.view_row(T - 1), 1)
        return self._head(b, T)

    def _embed(self, b: _Buffers, ids: np.ndarray) -> None:
        """b.x (T, n_embd) = the token embeddings of ids (T,) (times the model's embedding scale). The
        rows' file pages leave the RSS again (host_memory.release_row_pages): the RSS stays flat however
        many distinct tokens a long run meets."""
        b.x[:] = dequantize_rows(self.embd.data, self.embd.qtype, self.spec.n_embd, ids)
        release_row_pages(self.embd.data, ids)
        if self.spec.embed_scale != 1.0:
            b.x *= np.float32(self.spec.embed_scale)

    def _head(self, b: _Buffers, T: int, out: np.ndarray | None = None) -> np.ndarray:
        """Logits (T, n_vocab) of the run's rows: into `out`, else a view of the run buffer."""
        s = self.spec
        self._norm(b.h, b.x, "output_norm")
        logits = self.logits_buf[:T] if out is None else out
        self._matmul(logits, self.out_w, b.h)
        if s.final_logit_softcap:
            softcap(logits, np.float32(s.final_logit_softcap))
        return logits

    def _layer(self, il: int, b: _Buffers, segments: list[tuple[KVStore, int, int, int]]) -> None:
        """One transformer layer over the run's rows; segments [(store, seq0, t0, T)]: rows t0..t0+T-1 are
        tokens seq0.. of that store (one segment for a prompt chunk, one per sequence in a batch)."""
        s, p = self.spec, f"blk.{il}."
        self._norm(b.h, b.x, p + "attn_norm")
        self._qkv(b, p)
        T, nh, nkv, hd = b.x.shape[0], s.n_head, s.n_head_kv, s.head_dim
        q3, k3, v3 = b.q.reshape(T * nh, hd), b.k.reshape(T * nkv, hd), b.v.reshape(T, nkv, hd)
        if s.qk_norm:
            rms_norm_rows(q3, q3, self.vecs[p + "attn_q_norm.weight"], s.norm_eps)
            rms_norm_rows(k3, k3, self.vecs[p + "attn_k_norm.weight"], s.norm_eps)
        if s.rope_attn_factor[il] != 1.0:    # YaRN/LongRoPE scale cos and sin: the same as scaling q, k's rotated dims
            q3[:, :s.rotary_dim] *= np.float32(s.rope_attn_factor[il])
            k3[:, :s.rotary_dim] *= np.float32(s.rope_attn_factor[il])
        rope = self.layer_ropes[il]
        scale, attn_cap = np.float32(s.attn_scale), np.float32(s.attn_softcap)
        kk = b.k.reshape(T, nkv, hd)
        if self._streams_on and self._streams_fit[il]:
            _streams().write_attend_streams(self._streams, il, rope, b.att.reshape(T, nh, hd), b.q.reshape(T, nh, hd),
                                            kk, v3, self._stream_seqs, scale, attn_cap)
            segments = ()
        for store, seq0, t0, n in segments:
            if getattr(store, "paged", False):   # paged KV pool (runtime/paged_store.py): writes and attends itself
                store.forward_layer(il, b.q, kk, v3, seq0, b.att, rope.table, scale, attn_cap)
            else:
                self._attend_dense(il, b, store, seq0, t0, n, kk, v3, rope, scale, attn_cap)
        self._linear(b.a, p + "attn_output", b.att)
        if s.sandwich_norm:
            rms_norm_rows(b.a, b.a, self.vecs[p + "post_attention_norm.weight"], s.norm_eps)
        if s.parallel_residual:
            self._norm(b.h, b.x, p + "ffn_norm")
            self._ffn(il, b)
            b.x += b.a
            b.x += b.h2
            return
        b.x += b.a
        self._norm(b.h, b.x, p + "ffn_norm")
        self._ffn(il, b)
        if s.sandwich_norm:
            rms_norm_rows(b.h2, b.h2, self.vecs[p + "post_ffw_norm.weight"], s.norm_eps)
        b.x += b.h2

    def _attend_dense(self, il: int, b: _Buffers, store: KVStore, seq0: int, t0: int, T: int, kk: np.ndarray,
                      v3: np.ndarray, rope, scale: np.float32, attn_cap: np.float32) -> None:
        """Write rows t0..t0+T-1 of the run's keys/values (kk, v3: (rows, n_kv, hd)), tokens seq0.., into
        the fixed store token by token and attend each query b.q[t] (n_head * hd) over the store; the
        outputs land in b.att[t]. rope: the layer's rope.LayerRope. Ring layers go through the layer's
        RoPE strategy (rope.STRATEGIES), policy layers through _attend_policy."""
        nh, hd = self.spec.n_head, self.spec.head_dim
        if store.query_hook is not None:        # a compressing prefill's observation window (runtime/compress.py)
            store.query_hook(il, b.h[t0:t0 + T], b.q[t0:t0 + T], seq0)
        policy = store.policy_impl if store.uses_policy(il) else None
        hook = store.mass_hook
        mass = store.mass if (policy is not None and policy.needs_mass) or hook is not None else self.no_mass
        if policy is not None:
            self._attend_policy(il, b, store, policy, seq0, t0, T, kk, v3, rope.table, scale, attn_cap, mass, hook)
            return
        if (T > 1 and hook is None and chunk_pays(seq0, T, self.chunk_min_pairs)
                and chunk_fits(store, il, T)):          # the chunk at once, queries in parallel
            rows = slice(t0, t0 + T)
            write_attend_chunk(store, il, rope, b.att[rows].reshape(T, nh, hd), b.q[rows].reshape(T, nh, hd),
                               kk[rows], v3[rows], seq0, scale, attn_cap, self.chunk_q, self.sc.ktmp)
            return
        strategy, sc = STRATEGIES[store.layer_rope_mode[il]], self.sc
        if T > 1 and hook is None and store.journal is not None and strategy.runs(store, il, T):
            # a speculative verification: the layer read once (rope.StoredRope.write_attend_run)
            rows = slice(t0, t0 + T)
            strategy.write_attend_run(store, il, rope, kk[rows], v3[rows], b.q[rows].reshape(T, nh, hd), seq0, scale,
                                      attn_cap, sc, b.att[rows].reshape(T, nh, hd))
            return
        for t in range(t0, t0 + T):
            seq = seq0 + t - t0
            strategy.write(store, il, rope, kk[t], v3[t], seq, sc)
            strategy.attend(store, il, rope, b.q[t].reshape(nh, hd), seq, scale, attn_cap, mass, sc)
            if hook is not None:
                hook(il, mass, store)
            b.att[t] = sc.out.reshape(-1)

    def _attend_policy(self, il: int, b: _Buffers, store: KVStore, policy, seq0: int, t0: int, T: int, kk: np.ndarray,
                       v3: np.ndarray, table, scale: np.float32, attn_cap: np.float32, mass: np.ndarray,
                       hook) -> None:
        """_attend_dense for a layer where the policy chooses victims, per token: for a policy with a
        compiled step (Policy.layer_step) and no rollback journal, that step (victims, write,
        attention and observe in one call); otherwise, or when the step declines (gvote evicting),
        the policy's keys (KVStore.prepare_policy_write; the journal, when one runs, saves the rows
        the step will change), then eviction, write and attention in one kernel call
        (policy_step.policy_write_attend), then the policy's on_insert and observe. Both paths run
        the same kernels in the same order: a rollback's replay and a plain feed agree bitwise."""
        nh, hd = self.spec.n_head, self.spec.head_dim
        sc = self.sc
        if not store.reindexed and seq0 + T + REBASE_LIMIT >= table.cos.shape[0]:
            table.ensure(seq0 + T + REBASE_LIMIT + 1)     # original positions grow with the stream
        lay = store.layers[il]
        kk = store.relative_keys(il, kk[t0:t0 + T], seq0)     # what the rows encode (kv_types: key offsets)
        t_q = t0
        inserts = type(policy).on_insert is not Policy.on_insert
        layer_step = policy.layer_step if store.journal is None else None
        if layer_step is not None:
            st, rw_rows = store.step_args(il, policy.key_grid), store.rotation_args(il, rows=True)
            pend, prm = store.pending(il), policy.step_params(store, il)
        for t in range(T):
            seq = seq0 + t
            q_t = b.q[t_q + t].reshape(nh, hd)
            if layer_step is not None and layer_step(
                    lay, kk[t], v3[t_q + t], seq, st, rw_rows,
                    (sc.out, q_t, table.cos, table.sin, scale, attn_cap, sc.scores, self.head_qvar, self.head_have,
                     self.head_krot, sc.qrot, sc.qpos, mass, self.head_offs), pend, prm):
                if hook is not None:
                    hook(il, mass, store)
                b.att[t_q + t] = sc.out.reshape(-1)
                continue
            grid = store.prepare_policy_write(il, q_t, seq)
            if store.journal is not None:
                store.journal.before_policy(store, il, grid)
            policy_write_attend(lay, kk[t], v3[t_q + t], seq, store.write_args(il, grid), store.victims[0],
                                store.rotation_args(il),
                                (sc.out, q_t, table.cos, table.sin, scale, attn_cap, sc.scores, self.qvar, self.qvar_have,
                                 sc.krot, sc.qrot, sc.qpos, mass, self.offs))
            if inserts:          # the policy's per-token state of the new slot (reads neither attention nor out),
                k_pre = kk[t] if not store.kv.quantized_keys else round_trip(kk[t], store.kv.k_type, key=True)
                policy.on_insert(store, il, k_pre + store.key_offset_rows(il, seq), q_t)    # from the key as held
            policy.observe(store, il, mass, seq)
            if hook is not None:
                hook(il, mass, store)
            b.att[t_q + t] = sc.out.reshape(-1)

    def _ffn_fused(self, il: int) -> bool:
        """Whether layer il's FFN takes its stacked gate|up product and the fused activation."""
        p = f"blk.{il}."
        return (p + "ffn_gate_up.weight" in self.mats and p + "ffn_gate.bias" not in self.vecs
                and p + "ffn_up.bias" not in self.vecs)

    def _ffn(self, il: int, b: _Buffers) -> None:
        """b.h2 = ffn(b.h)."""
        p = f"blk.{il}."
        if self._ffn_fused(il):
            self._matmul(b.ff_gu, self.mats[p + "ffn_gate_up.weight"], b.h)
            self._activate(b, fused=True)
            self._linear(b.h2, p + "ffn_down", b.ff_a)
            return
        self._linear(b.ff_b, p + "ffn_up", b.h)
        if self.spec.gated_ffn:
            self._linear(b.ff_a, p + "ffn_gate", b.h)
        self._activate(b, fused=False)
        self._linear(b.h2, p + "ffn_down", b.ff_a if self.spec.gated_ffn else b.ff_b)

    def _activate(self, b: _Buffers, fused: bool) -> None:
        """The FFN's activation between its products: fused, b.ff_a = act(gate) * up from the stacked
        b.ff_gu; gated, b.ff_a = act(b.ff_a) * b.ff_b; otherwise b.ff_b = act(b.ff_b) in place."""
        if fused:
            gated_act_fused(b.ff_a, b.ff_gu, self.act)
        elif self.spec.gated_ffn:
            gated_act(b.ff_a, b.ff_a, b.ff_b, self.act)
        else:
            act_inplace(b.ff_b, self.act)
