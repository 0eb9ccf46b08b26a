"""The CUDA backend: a model on one device (CUDAEngine) and its KV stores (CUDAStore).

CUDAEngine has runtime.engine.CPUEngine's verbs (new_store, prefill, step, logits), so
ringllm.LLM(backend="cuda") drives it as it drives the CPU engine; usage is in the package
docstring (ringllm.native). Beyond those verbs it chooses tokens on the device: pick() from the
last logits, decode(token, store) a decode step and the choice in one device call (optionally
replayed as a captured CUDA graph), generate(ids, store, n) both in a loop. A batch store
(new_batch_store) holds B sequences: each is fed alone (forward_seq) and all are stepped together
(decode_batch: one pass over the B rows, each KV write and attention step one launch for the batch).

Every option and tensor is checked against the spec before the first device call
(CUDAEngine._plan); the device objects (rl_model, rl_store) are opaque handles freed by the
garbage collector (ffi.gc). A store keeps the layer layout of runtime/kv_store.py and holds its
rows in the KVConfig's k_type / v_type (f32, f16 or q8_0); a policy or KV type the device does not
implement is a ConfigError naming the ones it has.
"""
from __future__ import annotations

import numpy as np

from ringllm.native.cuda_lib import (ACTIVATIONS, DEVICE_KV_TYPES, DEVICE_POLICIES, NORM_KINDS, c_ptr, check_sampling,
                                     check_status, ffi_lib, matrix_blocks, uniform_draw)
from ringllm.runtime.errors import ConfigError, UnsupportedModelError
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.kv_store import layer_layout
from ringllm.runtime.kv_types import STORE_DTYPE, check_kv_type, row_width
from ringllm.runtime.model_spec import ModelSpec
from ringllm.runtime.policies import make_policy
from ringllm.runtime.qtensor import QTensor

__all__ = ["CUDAEngine", "CUDAStore"]

# Tensor roles of the C API: GGUF name (without "blk.il.") -> role code
_GLOBAL_ROLES = {"token_embd.weight": 0, "output.weight": 1, "output_norm.weight": 2, "output_norm.bias": 3}
_LAYER_ROLES = {"attn_norm.weight": 4, "attn_norm.bias": 5, "attn_q.weight": 6, "attn_q.bias": 7,
                "attn_k.weight": 8, "attn_k.bias": 9, "attn_v.weight": 10, "attn_v.bias": 11,
                "attn_output.weight": 12, "attn_output.bias": 13, "attn_q_norm.weight": 14,
                "attn_k_norm.weight": 15, "post_attention_norm.weight": 16, "ffn_norm.weight": 17,
                "ffn_norm.bias": 18, "ffn_gate.weight": 19, "ffn_gate.bias": 20, "ffn_up.weight": 21,
                "ffn_up.bias": 22, "ffn_down.weight": 23, "ffn_down.bias": 24, "post_ffw_norm.weight": 25}
_MATRIX_ROLES = {0, 1, 6, 8, 10, 12, 19, 21, 23}
# prefill modes of the C API (rl_model_params.prefill_mode: RL_PREFILL_CHUNK, RL_PREFILL_TOKEN)
PREFILL_MODES = {"chunk": 1, "token": 2}


# ==================================================================================================
# Store
# ==================================================================================================

class CUDAStore:
    """One sequence's KV store on the device (DESIGN.md "KV store contract"); made by CUDAEngine.new_store.

    The layer layout is KVStore's: capacity C per layer (a sliding-window layer whose window fits
    gets C = window, no sinks, the ring), ring layers for full/streaming without staging, policy
    layers with P = KVConfig.physical_capacity slots otherwise.

    K and V rows are held in kv.k_type / kv.v_type, one of DEVICE_KV_TYPES (f32, f16, q8_0; the row
    layouts of runtime/kv_types.py, bit-identical to the CPU codecs for the same input): a row is
    encoded once, when the KV write stores its token, keys before RoPE on every layer (the layout of
    the CPU store's "fused" strategy, which its policy layers use for quantized keys), and decoded in
    registers by attention and the key-scoring policies (knorm, lsh score the key as held).
    """

    def __init__(self, engine: "CUDAEngine", kv: KVConfig, batch: int = 1):
        spec = engine.spec
        kv.validate()
        for what, name in (("k_type", kv.k_type), ("v_type", kv.v_type)):
            if name not in DEVICE_KV_TYPES:
                raise ConfigError(f"{what} {name!r} is not available on the cuda backend's KV store; available: "
                                  f"{', '.join(DEVICE_KV_TYPES)} (use backend='cpu' for {name})")
            check_kv_type(name, what, spec.head_dim)
        if kv.compress is not None:
            raise ConfigError(f"prompt compression (KVConfig.compress={kv.compress!r}) runs on the cpu and reference "
                              "backends; the cuda backend's store takes the decode-time policies only")
        if kv.policy not in DEVICE_POLICIES:
            raise ConfigError(f"policy {kv.policy!r} is not available on the cuda backend; available: "
                              f"{', '.join(DEVICE_POLICIES)} (use backend='cpu' for the others)")
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= min(engine.n_batch, 1024):
            raise ConfigError(f"batch must be an integer in 1..{min(engine.n_batch, 1024)} (at most the engine's "
                              f"n_batch rows), got {batch!r}")
        capacity, sinks = kv.capacity, kv.sinks
        if kv.policy == "full":
            if capacity is not None and not 1 <= capacity <= spec.n_ctx:
                raise ConfigError(f"with policy 'full' the capacity is the context size, 1..{spec.n_ctx}; got {capacity}")
            capacity, sinks = capacity or spec.n_ctx, 0
        self.engine, self.kv, self.spec = engine, kv, spec
        self.policy, self.positions, self.update = kv.policy, kv.positions, kv.update
        self.k_type, self.v_type = kv.k_type, kv.v_type
        self.capacity, self.sinks = int(capacity), int(sinks)
        self.recent = kv.resolved_recent if kv.policy != "full" else 0
        self.reindexed = kv.positions == "reindexed"
        policy = make_policy(kv, spec)   # the CPU store's layer budgets (pyramidkv) and head slots (adakv)
        (self.layer_capacity, self.layer_sinks, self.layer_ring,
         self.layer_physical) = layer_layout(spec, kv, policy, policy.layer_budgets(self.capacity, spec.n_layer),
                                             self.sinks)
        if max(self.layer_physical) >= 2 ** 31 // max(1, spec.n_head_kv * batch):   # int32 slot indices
            raise ConfigError(f"capacity {self.capacity} x batch {batch} is too large for the cuda backend")
        proj = None
        if kv.policy == "lsh":
            # SimHash projections of runtime/policies/lsh.py: N(0, 1) from default_rng(seed + layer)
            proj = np.ascontiguousarray(np.stack([
                np.random.default_rng(kv.seed + il).standard_normal((kv.lsh_bits, spec.head_dim)).astype(np.float32)
                for il in range(spec.n_layer)]))
        ffi, lib = ffi_lib()
        arrays = {name: np.ascontiguousarray(np.asarray(vals, dtype=np.int32)) for name, vals in (
            ("layer_capacity", self.layer_capacity), ("layer_physical", self.layer_physical),
            ("layer_sinks", self.layer_sinks), ("layer_ring", [int(r) for r in self.layer_ring]))}
        p = ffi.new("rl_store_params *")
        p.policy = DEVICE_POLICIES[kv.policy]
        p.reindexed = int(self.reindexed)
        p.recent, p.lazy, p.slack, p.max_drop, p.lsh_bits = self.recent, kv.lazy, kv.slack, kv.max_drop, kv.lsh_bits
        p.history, p.seed = kv.history, kv.seed % 2 ** 64     # np.uint64(seed) on the CPU: two's complement
        p.shift = int(kv.update == "shift")
        p.window, p.pool, p.rkv_lambda = kv.window, kv.pool, kv.rkv_lambda
        p.gvote_samples, p.gvote_p = kv.gvote_samples, kv.gvote_p
        if policy.ragged:      # one floor: adakv's policy layers all keep the base capacity (the CPU's per layer)
            if any(c != self.capacity for c, ring in zip(self.layer_capacity, self.layer_ring) if not ring):
                raise ConfigError("adakv on the cuda backend needs every policy layer at the store's capacity")
            p.head_floor = policy.head_floor(self.capacity)
        p.batch = batch
        for name, a in arrays.items():
            setattr(p, name, c_ptr(ffi, "int *", a))
        p.lsh_proj = c_ptr(ffi, "float *", proj)
        p.k_type, p.v_type = DEVICE_KV_TYPES[kv.k_type], DEVICE_KV_TYPES[kv.v_type]
        out = ffi.new("rl_store **")
        check_status(lib.rl_store_init(out, engine._model, p), "rl_store_init")
        self._store = ffi.gc(out[0], lib.rl_store_free)
        self.batch = batch
        self._held = np.zeros((spec.n_layer, spec.n_head_kv * batch), np.int64)
        self._evicted = np.zeros((spec.n_layer, spec.n_head_kv * batch), np.int64)
        self.n_seen = 0                   # tokens fed (one sequence)
        self.seen = [0] * batch           # tokens fed per sequence of a batch store

    def check_room(self, n_new: int, b: int | None = None) -> None:
        """Raise before any work when policy full would overflow the model's context (b: the
        sequence of a batch store)."""
        seen = self.n_seen if b is None else self.seen[b]
        if self.policy == "full" and seen + n_new > self.capacity:
            raise ConfigError(f"{seen + n_new} tokens exceed the model's context {self.capacity} with "
                              "policy 'full'; choose an eviction policy (e.g. streaming) or a shorter input")

    def counts(self) -> tuple[np.ndarray, np.ndarray]:
        """held, evicted: (n_layer, n_head_kv x batch) int64 (a device read; sequence b's heads are
        columns b * n_head_kv ...)."""
        ffi, lib = ffi_lib()
        seen = ffi.new("int64_t[]", self.batch)
        check_status(lib.rl_store_counts(self._store, c_ptr(ffi, "int64_t *", self._held),
                                   c_ptr(ffi, "int64_t *", self._evicted), seen), "rl_store_counts")
        return self._held.copy(), self._evicted.copy()

    def read_layer(self, il: int) -> dict:
        """Layer il's slots copied to the host: seq, pos (n_kv, P) i32, score f64, and k, v (n_kv, P,
        width) rows as the store holds them, in the dtype and width of k_type / v_type (KVStore.k[il]'s
        layout: f32 gives the float32 values (n_kv, P, hd); runtime/kv_codec.decode(k, hd) decodes
        the others). Keys are before RoPE."""
        if not 0 <= il < self.spec.n_layer:
            raise ConfigError(f"layer {il} out of range 0..{self.spec.n_layer - 1}")
        nkv, P, hd = self.spec.n_head_kv * self.batch, self.layer_physical[il], self.spec.head_dim
        out = {"k": np.empty((nkv, P, row_width(self.k_type, hd)), STORE_DTYPE[self.k_type]),
               "v": np.empty((nkv, P, row_width(self.v_type, hd)), STORE_DTYPE[self.v_type]),
               "seq": np.empty((nkv, P), np.int32), "pos": np.empty((nkv, P), np.int32),
               "score": np.empty((nkv, P), np.float64)}
        ffi, lib = ffi_lib()
        check_status(lib.rl_store_read_layer(self._store, il, c_ptr(ffi, "void *", out["k"]),
                                             c_ptr(ffi, "void *", out["v"]), c_ptr(ffi, "int32_t *", out["seq"]),
                                             c_ptr(ffi, "int32_t *", out["pos"]), c_ptr(ffi, "double *", out["score"])),
                     "rl_store_read_layer")
        return out

    def reset(self) -> None:
        ffi, lib = ffi_lib()
        check_status(lib.rl_store_reset(self._store), "rl_store_reset")
        self.n_seen = 0
        self.seen = [0] * self.batch

    def reset_seq(self, b: int) -> None:
        """Empty sequence b of a batch store (it leaves; a new one starts there)."""
        self.check_seq(b)
        ffi, lib = ffi_lib()
        check_status(lib.rl_store_reset_seq(self._store, b), "rl_store_reset_seq")
        self.seen[b] = 0

    def check_seq(self, b) -> None:
        if self.batch < 2:
            raise ConfigError("this store holds one sequence; make a batch store with CUDAEngine.new_batch_store")
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 0 <= b < self.batch:
            raise ConfigError(f"sequence index must be in 0..{self.batch - 1}, got {b!r}")

    def device_bytes(self) -> int:
        ffi, lib = ffi_lib()
        n = ffi.new("int64_t *")
        check_status(lib.rl_store_bytes(self._store, n), "rl_store_bytes")
        return int(n[0])

    def stats(self) -> dict:
        """Same keys as KVStore.stats()."""
        held, evicted = self.counts()
        return {"capacity": self.capacity, "length": int(held.max()), "evicted_total": int(evicted.sum()),
                "policy": self.policy, "sinks": self.sinks, "recent": self.recent, "positions": self.positions,
                "update": self.update, "tokens_seen": self.n_seen if self.batch == 1 else sum(self.seen), "layer_capacity": list(self.layer_capacity),
                "bytes": self.device_bytes()}


# ==================================================================================================
# Engine
# ==================================================================================================

class CUDAEngine:
    """The model on one CUDA device, with the verbs of runtime.engine.CPUEngine.

    Args:
        spec, tensors: a LoadedModel's fields. Matrices are uploaded once in their GGUF blocks;
            norm weights and biases as float32.
        n_threads: accepted for CPUEngine compatibility (host threads are not used).
        n_batch: rows per prefill chunk (matrix-matrix kernels).
        device: CUDA device index.
        cuda_graph: replay decode steps (decode()) as a captured CUDA graph.
        fused: fewer launches per layer (q/k/v in one matmul, the FFN activation, biases and residual
            adds in the matmuls' epilogues); False runs one launch per operation, for comparison.
            Logits are bit-identical either way.
        prefill_mode: "chunk": a prefill chunk that fills a ring layer (full, streaming without
            staging, a sliding window that fits) without evicting is written and attended in two
            launches per layer (native/src/prefill.cu); "token": token by token everywhere (decode
            semantics), for comparison; None (default): "chunk" unless the environment has
            RINGLLM_CUDA_PREFILL=token (read when the engine is built). The modes differ only in the
            order of float32 sums; decode steps and policy layers are token by token in both.

    Raises DeviceError when there is no usable GPU/driver or the library was built without CUDA,
    ConfigError on bad options or tensors (before anything is uploaded).
    """

    def __init__(self, spec: ModelSpec, tensors: dict[str, QTensor], n_threads: int | None = None, n_batch: int = 64,
                 device: int = 0, cuda_graph: bool = False, fused: bool = True, prefill_mode: str | None = None):
        if n_threads is not None and (not isinstance(n_threads, int) or n_threads < 1):
            raise ConfigError(f"n_threads must be a positive integer, got {n_threads!r}")
        if not isinstance(n_batch, int) or n_batch < 1:
            raise ConfigError(f"n_batch must be >= 1, got {n_batch!r}")
        if not isinstance(device, int) or device < 0:
            raise ConfigError(f"device must be a CUDA device index >= 0, got {device!r}")
        if not isinstance(spec, ModelSpec):
            raise ConfigError(f"spec must be a ModelSpec, got {type(spec).__name__}")
        if prefill_mode is not None and (not isinstance(prefill_mode, str) or prefill_mode not in PREFILL_MODES):
            raise ConfigError(f"prefill_mode must be one of {', '.join(map(repr, PREFILL_MODES))} or None, "
                              f"got {prefill_mode!r}")
        _refuse_features(spec)
        uploads = self._plan(spec, tensors)   # every check before the first device call
        self.spec, self.n_batch, self.device = spec, n_batch, device
        ffi, lib = ffi_lib()
        p = ffi.new("rl_model_params *")
        p.n_vocab, p.n_embd, p.n_layer = spec.n_vocab, spec.n_embd, spec.n_layer
        p.n_head, p.n_head_kv, p.head_dim, p.n_ff = spec.n_head, spec.n_head_kv, spec.head_dim, spec.n_ff
        p.rotary_dim, p.norm_kind, p.act = spec.rotary_dim, NORM_KINDS[spec.norm], ACTIVATIONS[spec.act]
        p.gated_ffn, p.qk_norm, p.sandwich_norm = int(spec.gated_ffn), int(spec.qk_norm), int(spec.sandwich_norm)
        p.parallel_residual, p.tied_output = int(spec.parallel_residual), int(spec.tied_output)
        p.norm_eps, p.embed_scale, p.attn_scale = spec.norm_eps, spec.embed_scale, spec.attn_scale
        p.final_logit_softcap, p.n_batch, p.device = spec.final_logit_softcap, n_batch, device
        if prefill_mode is not None:      # else 0: RL_PREFILL_DEFAULT
            p.prefill_mode = PREFILL_MODES[prefill_mode]
        self.prefill_mode = prefill_mode
        out = ffi.new("rl_model **")
        check_status(lib.rl_model_init(out, p), "rl_model_init")
        self._model = ffi.gc(out[0], lib.rl_model_free)
        for kind, role, il, payload in uploads:
            if kind == "matrix":
                qt, n_rows, n_cols, rb, data = payload
                check_status(lib.rl_model_set_matrix(self._model, role, il, int(qt), n_rows, n_cols,
                                               c_ptr(ffi, "uint8_t *", data), rb), "rl_model_set_matrix")
            else:
                check_status(lib.rl_model_set_vector(self._model, role, il, c_ptr(ffi, "float *", payload), payload.size),
                       "rl_model_set_vector")
        for il in range(spec.n_layer):
            check_status(lib.rl_model_set_rope(self._model, il, float(spec.rope_base[il]), float(spec.rope_scale[il])),
                   "rl_model_set_rope")
        check_status(lib.rl_model_ready(self._model), "rl_model_ready")
        check_status(lib.rl_model_set_graph(self._model, int(bool(cuda_graph))), "rl_model_set_graph")
        self.cuda_graph = bool(cuda_graph)
        check_status(lib.rl_model_set_fused(self._model, int(bool(fused))), "rl_model_set_fused")
        self.fused = bool(fused)
        self._logits1 = np.zeros(spec.n_vocab, np.float32)
        self._tok = ffi.new("int32_t *")

    @staticmethod
    def _plan(spec: ModelSpec, tensors: dict[str, QTensor]) -> list:
        """[(kind, role, layer, payload)] of every tensor to upload, all checked against the spec."""
        # imported on use: it compiles (or loads) Numba kernels, which `import ringllm.native` must not
        from ringllm.runtime.dequant import dequantize

        if not isinstance(tensors, dict):
            raise ConfigError(f"tensors must be a dict name -> QTensor, got {type(tensors).__name__}")
        expected = {**spec.expected_shapes(), **spec.optional_shapes()}
        missing = [n for n in spec.expected_shapes() if n not in tensors]
        if missing:
            raise ConfigError(f"tensor {missing[0]} is missing ({len(missing)} missing in all)")
        plan = []
        for name, t in tensors.items():
            if name in _GLOBAL_ROLES:
                role, il = _GLOBAL_ROLES[name], 0
            else:
                parts = name.split(".", 2)
                if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in _LAYER_ROLES:
                    continue    # not used by the forward pass (as the CPU engine)
                role, il = _LAYER_ROLES[parts[2]], int(parts[1])
                if il >= spec.n_layer:
                    continue
            if name == "output.weight" and spec.tied_output:
                continue
            if name in expected and tuple(t.shape) != tuple(expected[name]):
                raise ConfigError(f"tensor {name} has shape {tuple(t.shape)}, expected {tuple(expected[name])}")
            if role in _MATRIX_ROLES:
                plan.append(("matrix", role, il, matrix_blocks(t, name)))
            else:
                vec = np.ascontiguousarray(dequantize(t.data, t.qtype, t.shape), dtype=np.float32).reshape(-1)
                plan.append(("vector", role, il, vec))
        return plan

    # -----------------------------------------------------------------------------------------
    # Verbs of CPUEngine
    # -----------------------------------------------------------------------------------------

    def new_store(self, kv: KVConfig | None = None, **kwargs) -> CUDAStore:
        """A fresh device KV store for one sequence: from a KVConfig, or keyword arguments of one."""
        if kv is None:
            kv = KVConfig(**kwargs)
        elif kwargs:
            raise ConfigError(f"pass a KVConfig or keyword arguments, not both (got {sorted(kwargs)})")
        return CUDAStore(self, kv)

    def new_batch_store(self, batch: int, kv: KVConfig | None = None, **kwargs) -> CUDAStore:
        """A device KV store for `batch` (2..n_batch) sequences with one configuration: each is fed
        alone (forward_seq) and all are stepped together (decode_batch)."""
        if kv is None:
            kv = KVConfig(**kwargs)
        elif kwargs:
            raise ConfigError(f"pass a KVConfig or keyword arguments, not both (got {sorted(kwargs)})")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 2:
            raise ConfigError(f"a batch store holds 2 or more sequences, got batch={batch!r} (use new_store for one)")
        return CUDAStore(self, kv, batch)

    def _own(self, store) -> None:
        """ConfigError unless store is one of this engine's (new_store, new_batch_store)."""
        if not isinstance(store, CUDAStore) or store.engine is not self:
            raise ConfigError("store must be a CUDAStore made by this engine's new_store() or new_batch_store()")

    def _in_vocab(self, ids: np.ndarray) -> None:
        """ConfigError unless every id (a non-empty integer array) is a token of the model."""
        if ids.min() < 0 or ids.max() >= self.spec.n_vocab:
            raise ConfigError(f"token ids must be in [0, {self.spec.n_vocab}); got {ids.min()}..{ids.max()}")

    def _ids(self, ids, store: CUDAStore, b: int | None = None) -> np.ndarray:
        """ids checked (integers, non-empty, in the vocabulary, room in the store, or in its sequence b)
        as int32."""
        self._own(store)
        if b is None and store.batch > 1:
            raise ConfigError(f"the store holds a batch of {store.batch} sequences: feed one with forward_seq, "
                              "step all with decode_batch")
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise ConfigError(f"token ids must be integers, got dtype {ids.dtype}")
        ids = ids.reshape(-1)
        if ids.size == 0:
            raise ConfigError("no tokens to feed")
        self._in_vocab(ids)
        store.check_room(ids.size, b)
        return np.ascontiguousarray(ids, dtype=np.int32)

    def forward(self, ids, store: CUDAStore, all_logits: bool = True) -> np.ndarray:
        """Feed ids through the store. all_logits: a new (len(ids), n_vocab) array; else the last
        token's logits (n_vocab,) (a view of a host buffer, valid until the next call)."""
        ids = self._ids(ids, store)
        ffi, lib = ffi_lib()
        out = np.empty((ids.size, self.spec.n_vocab), np.float32) if all_logits else self._logits1
        check_status(lib.rl_forward(self._model, store._store, c_ptr(ffi, "int32_t *", ids), ids.size,
                              c_ptr(ffi, "float *", out), int(bool(all_logits))), "rl_forward")
        store.n_seen += ids.size
        return out

    def forward_seq(self, ids, store: CUDAStore, b: int, all_logits: bool = False) -> np.ndarray:
        """forward() into sequence b of a batch store: (len(ids), n_vocab) logits when all_logits,
        else the last token's (n_vocab,) (a view of a host buffer, valid until the next call)."""
        self._own(store)
        store.check_seq(b)
        ids = self._ids(ids, store, b)
        ffi, lib = ffi_lib()
        out = np.empty((ids.size, self.spec.n_vocab), np.float32) if all_logits else self._logits1
        check_status(lib.rl_forward_seq(self._model, store._store, int(b), c_ptr(ffi, "int32_t *", ids), ids.size,
                                        c_ptr(ffi, "float *", out), int(bool(all_logits))), "rl_forward_seq")
        store.seen[b] += ids.size
        return out

    def decode_batch(self, tokens, store: CUDAStore, want_logits: bool = False):
        """One decode step of every sequence of a batch store: tokens (batch,), one per sequence.
        Returns each sequence's greedy next token (batch,) int32, or (tokens, logits (batch, n_vocab))
        when want_logits (a new array; sample from it for temperature > 0)."""
        self._own(store)
        if store.batch < 2:
            raise ConfigError("decode_batch needs a batch store (new_batch_store); step one sequence with decode")
        ids = np.asarray(tokens)
        if ids.dtype.kind not in "iu" or ids.shape != (store.batch,):
            raise ConfigError(f"decode_batch takes one integer token per sequence: shape ({store.batch},), got "
                              f"{ids.dtype} {ids.shape}")
        self._in_vocab(ids)
        for b in range(store.batch):
            store.check_room(1, b)
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        nxt = np.empty(store.batch, np.int32)
        logits = np.empty((store.batch, self.spec.n_vocab), np.float32) if want_logits else None
        ffi, lib = ffi_lib()
        check_status(lib.rl_decode_batch(self._model, store._store, c_ptr(ffi, "int32_t *", ids), ids.size,
                                         c_ptr(ffi, "int32_t *", nxt), c_ptr(ffi, "float *", logits)),
                     "rl_decode_batch")
        store.seen = [n + 1 for n in store.seen]
        return (nxt, logits) if want_logits else nxt

    def prefill(self, ids, store: CUDAStore) -> np.ndarray:
        """Feed a prompt in chunks of n_batch; the last token's logits (n_vocab,) (valid until the next call)."""
        return self.forward(ids, store, all_logits=False)

    def step(self, token: int, store: CUDAStore) -> np.ndarray:
        """Decode one token; its logits (n_vocab,) float32 (valid until the next call)."""
        return self.forward([token], store, all_logits=False)

    def logits(self, ids, store: CUDAStore) -> np.ndarray:
        """Logits (len(ids), n_vocab) of every token fed through the store (decode semantics)."""
        return self.forward(ids, store, all_logits=True)

    # -----------------------------------------------------------------------------------------
    # Token choice on the device
    # -----------------------------------------------------------------------------------------

    def pick(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, rng=None) -> int:
        """The next token from the last logits computed (greedy when temperature == 0)."""
        check_sampling(temperature, top_k, top_p)
        u = uniform_draw(rng, temperature)
        ffi, lib = ffi_lib()
        check_status(lib.rl_pick(self._model, float(temperature), int(top_k), float(top_p), u, self._tok), "rl_pick")
        return int(self._tok[0])

    def decode(self, token: int, store: CUDAStore, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               rng=None, want_logits: bool = False):
        """One decode step and the choice of the next token, in one device call.

        Returns the next token, or (token, logits (n_vocab,)) when want_logits."""
        ids = self._ids([token], store)
        check_sampling(temperature, top_k, top_p)
        u = uniform_draw(rng, temperature)
        ffi, lib = ffi_lib()
        lp = c_ptr(ffi, "float *", self._logits1) if want_logits else ffi.NULL
        check_status(lib.rl_decode(self._model, store._store, int(ids[0]), float(temperature), int(top_k), float(top_p), u,
                             self._tok, lp), "rl_decode")
        store.n_seen += 1
        nxt = int(self._tok[0])
        return (nxt, self._logits1) if want_logits else nxt

    def generate(self, ids, store: CUDAStore, n: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 rng=None) -> list[int]:
        """Prefill ids, then n tokens chosen on the device (the last one is not fed back)."""
        if not isinstance(n, int) or n < 1:
            raise ConfigError(f"n must be a positive integer, got {n!r}")
        self.prefill(ids, store)
        out = [self.pick(temperature, top_k, top_p, rng)]
        while len(out) < n:
            out.append(self.decode(out[-1], store, temperature, top_k, top_p, rng))
        return out

    def weight_bytes(self) -> int:
        ffi, lib = ffi_lib()
        n = ffi.new("int64_t *")
        check_status(lib.rl_model_weight_bytes(self._model, n), "rl_model_weight_bytes")
        return int(n[0])


def _refuse_features(spec: ModelSpec) -> None:
    """The device kernels implement plain RoPE (base and linear scale per layer) and uncapped
    attention; a model that needs more is refused by name instead of running wrong."""
    missing = []
    if any(len(f) for f in spec.rope_freq_factors) or spec.rope_long_factors:
        missing.append("RoPE frequency factors (llama3/YaRN/LongRoPE scaling)")
    if any(f != 1.0 for f in spec.rope_attn_factor):
        missing.append("RoPE attention factor")
    if any(spec.no_rope):
        missing.append("NoPE layers")
    if spec.attn_softcap:
        missing.append("attention logit soft-capping")
    if missing:
        raise UnsupportedModelError("cuda", f"the CUDA backend does not implement {', '.join(missing)} "
                                    f"({spec.arch}); use backend 'cpu'")
