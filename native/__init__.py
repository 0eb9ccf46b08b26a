"""ringllm.native: the CUDA backend, a thin wrapper over libringllm_cuda.so (include/ringllm_cuda.h).

    eng = CUDAEngine(spec, tensors)                     # raises DeviceError without a GPU/driver
    st = eng.new_store(KVConfig(capacity=64, policy="h2o"))
    logits = eng.prefill(ids, st)                        # (n_vocab,) float32
    tok = eng.pick()                                     # greedy on the device
    tok = eng.decode(tok, st)                            # one decode step + greedy, one device call
    eng.step(tok, st), eng.logits(ids, st), st.stats()   # the CPUEngine verbs

In the style of pynacl: every array is checked here (dtype, shape, range) before anything reaches
C; a non-zero status becomes an exception carrying the library's message, CUDA error text included
(DeviceError for device problems, ConfigError for bad arguments). Importing this package never
loads the C module: that happens when a GPU object is first built, so the CPU path and machines
without CUDA are untouched.
"""
from __future__ import annotations

import glob
import os

import numpy as np

from ringllm.runtime.errors import ConfigError, RingLLMError
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.model_spec import ModelSpec
from ringllm.runtime.qtensor import QTensor
from ringllm.runtime.quant_types import SUPPORTED_TYPES, GGMLType, row_bytes

__all__ = ["DeviceError", "CUDAEngine", "CUDAStore", "available", "device_count", "build_info", "library_path",
           "DEVICE_POLICIES", "kernels"]

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = os.path.join(HERE, "include", "ringllm_cuda.h")

# Status codes (include/ringllm_cuda.h)
RL_OK, RL_ERR_NO_CUDA, RL_ERR_NO_DEVICE, RL_ERR_CUDA, RL_ERR_ARG, RL_ERR_OOM, RL_ERR_STATE = range(7)

DEVICE_POLICIES = {"full": 0, "streaming": 1, "h2o": 2, "tova": 3, "knorm": 4, "lsh": 5}
_NORMS = {"rms": 0, "layer": 1}
_ACTS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}

# Tensor roles of the C API: GGUF name (without "blk.il.") -> role code
_GLOBAL_ROLES = {"token_embd.weight": 0, "output.weight": 1, "output_norm.weight": 2, "output_norm.bias": 3}
_LAYER_ROLES = {"attn_norm.weight": 4, "attn_norm.bias": 5, "attn_q.weight": 6, "attn_q.bias": 7,
                "attn_k.weight": 8, "attn_k.bias": 9, "attn_v.weight": 10, "attn_v.bias": 11,
                "attn_output.weight": 12, "attn_output.bias": 13, "attn_q_norm.weight": 14,
                "attn_k_norm.weight": 15, "post_attention_norm.weight": 16, "ffn_norm.weight": 17,
                "ffn_norm.bias": 18, "ffn_gate.weight": 19, "ffn_gate.bias": 20, "ffn_up.weight": 21,
                "ffn_up.bias": 22, "ffn_down.weight": 23, "ffn_down.bias": 24, "post_ffw_norm.weight": 25}
_MATRIX_ROLES = {0, 1, 6, 8, 10, 12, 19, 21, 23}


class DeviceError(RingLLMError):
    """The CUDA backend cannot run: no GPU or driver, built without CUDA, a CUDA runtime failure."""


# ==================================================================================================
# The C module, loaded on first use
# ==================================================================================================

_MOD = None


def _module():
    """(ffi, lib) of ringllm.native._ringllm_cuda; DeviceError when it cannot be imported."""
    global _MOD
    if _MOD is None:
        try:
            from ringllm.native import _ringllm_cuda as mod
        except ImportError as e:
            raise DeviceError(f"the CUDA backend's native module could not be loaded ({e}); reinstall ringllm "
                              "(pip install -e .) on a machine with a C compiler, and nvcc for GPU support") from None
        _MOD = (mod.ffi, mod.lib)
    return _MOD


def _error_text(lib, ffi) -> str:
    return ffi.string(lib.rl_last_error()).decode("utf-8", "replace")


def _check(status: int, what: str) -> None:
    """Turn a non-zero status of the C API into the matching exception."""
    if status == RL_OK:
        return
    ffi, lib = _module()
    msg = _error_text(lib, ffi)
    if status == RL_ERR_ARG:
        raise ConfigError(f"{what}: {msg}")
    if status == RL_ERR_NO_DEVICE:
        raise DeviceError(f"backend 'cuda': {msg}. Use backend='cpu' on this machine, or check the NVIDIA "
                          "driver (nvidia-smi) and CUDA_VISIBLE_DEVICES")
    if status == RL_ERR_NO_CUDA:
        raise DeviceError(f"backend 'cuda': {msg}")
    raise DeviceError(f"{what}: {msg}")


def build_info() -> str:
    """How the library was built, e.g. "CUDA runtime 13.0 (static), sm_80 sm_90 + PTX compute_90"."""
    ffi, lib = _module()
    buf = ffi.new("char[]", 256)
    _check(lib.rl_build_info(buf, 256), "rl_build_info")
    return ffi.string(buf).decode()


def has_cuda() -> bool:
    """Whether the native module was built with nvcc (False: built without CUDA or not importable)."""
    try:
        return bool(_module()[1].rl_has_cuda())
    except DeviceError:
        return False


def device_count() -> int:
    """CUDA devices usable here; 0 without a GPU, a driver, or a CUDA build (never raises)."""
    try:
        ffi, lib = _module()
    except DeviceError:
        return 0
    n = ffi.new("int *")
    return int(n[0]) if lib.rl_device_count(n) == RL_OK else 0


def available() -> bool:
    return device_count() > 0


def library_path() -> str | None:
    """Path of libringllm_cuda.so next to the module, or None (built without CUDA)."""
    hits = glob.glob(os.path.join(HERE, "libringllm_cuda.so"))
    return hits[0] if hits else None


# ==================================================================================================
# Argument checks (before anything reaches C)
# ==================================================================================================

def _f32(a, name: str, shape: tuple | None = None) -> np.ndarray:
    """A C-contiguous float32 array; ConfigError on another dtype or shape (no silent casts)."""
    if not isinstance(a, np.ndarray) or a.dtype != np.float32:
        raise ConfigError(f"{name} must be a float32 numpy array, got {getattr(a, 'dtype', type(a).__name__)}")
    if shape is not None and a.shape != shape:
        raise ConfigError(f"{name} must have shape {shape}, got {a.shape}")
    return np.ascontiguousarray(a)


def _i32(a, name: str, shape: tuple | None = None) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.dtype.kind not in "iu":
        raise ConfigError(f"{name} must be an integer numpy array, got {getattr(a, 'dtype', type(a).__name__)}")
    if shape is not None and a.shape != shape:
        raise ConfigError(f"{name} must have shape {shape}, got {a.shape}")
    if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
        raise ConfigError(f"{name} has values outside int32")
    return np.ascontiguousarray(a, dtype=np.int32)


def _qtype(qtype) -> GGMLType:
    try:
        t = GGMLType(int(qtype))
    except (ValueError, TypeError):
        raise ConfigError(f"unknown GGML type {qtype!r}") from None
    if t not in SUPPORTED_TYPES:
        raise ConfigError(f"GGML type {t.name} is not supported; supported: {sorted(x.name for x in SUPPORTED_TYPES)}")
    return t


def _blocks(t: QTensor, what: str) -> tuple[GGMLType, int, int, int, np.ndarray]:
    """(qtype, n_rows, n_cols, row_bytes, contiguous uint8 rows) of a matrix QTensor, checked."""
    if not isinstance(t, QTensor):
        raise ConfigError(f"{what} must be a QTensor, got {type(t).__name__}")
    qt = _qtype(t.qtype)
    if len(t.shape) != 2:
        raise ConfigError(f"{what} ({t.name}) must be a matrix, got shape {t.shape}")
    n_rows, n_cols = t.shape
    rb = row_bytes(qt, n_cols)
    if rb is None:
        raise ConfigError(f"{what} ({t.name}): {n_cols} columns are not whole {qt.name} blocks")
    data = t.data
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
        raise ConfigError(f"{what} ({t.name}) data must be a uint8 array, got {getattr(data, 'dtype', type(data))}")
    if data.shape != (n_rows, rb):
        raise ConfigError(f"{what} ({t.name}) data must have shape {(n_rows, rb)} for {qt.name} {t.shape}, "
                          f"got {data.shape}")
    return qt, n_rows, n_cols, rb, np.ascontiguousarray(data)


def _ptr(ffi, ctype: str, a: np.ndarray):
    return ffi.cast(ctype, ffi.from_buffer(a)) if a is not None else ffi.NULL


def _uniform(rng, temperature: float) -> float:
    """The uniform draw of a sampled token, from the caller's seeded generator (0 for greedy)."""
    if temperature <= 0:
        return 0.0
    if rng is None:
        raise ConfigError("sampling (temperature > 0) needs rng, a numpy Generator (e.g. np.random.default_rng(seed))")
    return min(float(rng.random()), 0.99999994)   # below 1.0 in float32


def _check_sampling(temperature, top_k, top_p) -> None:
    if not np.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"temperature must be >= 0, got {temperature}")
    if not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ConfigError(f"top_k must be an integer >= 0 (0 = all), got {top_k!r}")
    if not 0.0 < top_p <= 1.0:
        raise ConfigError(f"top_p must be in (0, 1], got {top_p}")


# ==================================================================================================
# Single kernels (tests and benchmarks): upload, one launch, download
# ==================================================================================================

class kernels:
    """One-shot wrappers of the rl_kernel_* entry points; each checks its arrays first."""

    @staticmethod
    def dequant(t: QTensor, device: int = 0) -> np.ndarray:
        """(n_rows, n_cols) float32 values of a matrix in its blocks."""
        qt, n_rows, n_cols, rb, data = _blocks(t, "dequant weights")
        out = np.empty((n_rows, n_cols), np.float32)
        ffi, lib = _module()
        _check(lib.rl_kernel_dequant(device, int(qt), n_rows, n_cols, _ptr(ffi, "uint8_t *", data), rb,
                                     _ptr(ffi, "float *", out)), "rl_kernel_dequant")
        return out

    @staticmethod
    def matmul(t: QTensor, x: np.ndarray, device: int = 0) -> np.ndarray:
        """x (T, n_cols) float32 @ W.T -> (T, n_rows) float32 (T = 1: the decode matvec)."""
        qt, n_rows, n_cols, rb, data = _blocks(t, "matmul weights")
        if not isinstance(x, np.ndarray) or x.ndim != 2 or x.shape[1] != n_cols or x.shape[0] < 1:
            raise ConfigError(f"x must have shape (T, {n_cols}), got {getattr(x, 'shape', None)}")
        x = _f32(x, "x")
        out = np.empty((x.shape[0], n_rows), np.float32)
        ffi, lib = _module()
        _check(lib.rl_kernel_matmul(device, int(qt), n_rows, n_cols, _ptr(ffi, "uint8_t *", data), rb,
                                    _ptr(ffi, "float *", x), x.shape[0], _ptr(ffi, "float *", out)),
               "rl_kernel_matmul")
        return out

    @staticmethod
    def norm(kind: str, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None, eps: float = 1e-5,
             device: int = 0) -> np.ndarray:
        """Row norm of x (rows, n): "rms" or "layer" (needs b)."""
        if kind not in _NORMS:
            raise ConfigError(f"norm kind {kind!r} unknown; valid: {list(_NORMS)}")
        if not isinstance(x, np.ndarray) or x.ndim != 2:
            raise ConfigError("x must be a 2-D float32 array (rows, n)")
        rows, n = x.shape
        x, w = _f32(x, "x"), _f32(w, "w", (n,))
        if kind == "layer":
            if b is None:
                raise ConfigError("layer norm needs a bias b")
            b = _f32(b, "b", (n,))
        out = np.empty_like(x)
        ffi, lib = _module()
        _check(lib.rl_kernel_norm(device, _NORMS[kind], _ptr(ffi, "float *", x), _ptr(ffi, "float *", w),
                                  _ptr(ffi, "float *", b if kind == "layer" else None), rows, n, float(eps),
                                  _ptr(ffi, "float *", out)), "rl_kernel_norm")
        return out

    @staticmethod
    def act(act: str, up: np.ndarray, gate: np.ndarray | None = None, device: int = 0) -> np.ndarray:
        """act(gate) * up when gate is given, else act(up); (T, n) float32."""
        if act not in _ACTS:
            raise ConfigError(f"activation {act!r} unknown; valid: {list(_ACTS)}")
        if not isinstance(up, np.ndarray) or up.ndim != 2:
            raise ConfigError("up must be a 2-D float32 array (T, n)")
        up = _f32(up, "up")
        if gate is not None:
            gate = _f32(gate, "gate", up.shape)
        out = np.empty_like(up)
        ffi, lib = _module()
        _check(lib.rl_kernel_act(device, _ACTS[act], int(gate is not None), _ptr(ffi, "float *", gate),
                                 _ptr(ffi, "float *", up), up.shape[0], up.shape[1], _ptr(ffi, "float *", out)),
               "rl_kernel_act")
        return out

    @staticmethod
    def embed(t: QTensor, ids, scale: float = 1.0, device: int = 0) -> np.ndarray:
        """Rows ids of the matrix t, times scale: (len(ids), n_cols) float32."""
        qt, n_rows, n_cols, rb, data = _blocks(t, "embedding")
        ids = _i32(np.asarray(ids).reshape(-1), "ids")
        if ids.size == 0 or ids.min() < 0 or ids.max() >= n_rows:
            raise ConfigError(f"ids must be non-empty and in [0, {n_rows})")
        out = np.empty((ids.size, n_cols), np.float32)
        ffi, lib = _module()
        _check(lib.rl_kernel_embed(device, int(qt), n_rows, n_cols, _ptr(ffi, "uint8_t *", data), rb,
                                   _ptr(ffi, "int32_t *", ids), ids.size, float(scale), _ptr(ffi, "float *", out)),
               "rl_kernel_embed")
        return out

    @staticmethod
    def attend(q, k, v, pos, count, q_pos: int, rotary_dim: int, rope_base: float = 10000.0,
               rope_scale: float = 1.0, attn_scale: float | None = None, device: int = 0):
        """One query's attention over a layer's slots (runtime/attention.py attend):
        q (n_head, hd), k, v (n_kv, P, hd) float32 keys before RoPE; pos (n_kv, P), count (n_kv,) ints.
        Returns out (n_head, hd) and the softmax weights (n_head, P) (zero past count)."""
        if not all(isinstance(a, np.ndarray) for a in (q, k, v, pos, count)):
            raise ConfigError("q, k, v, pos, count must be numpy arrays")
        if q.ndim != 2 or k.ndim != 3:
            raise ConfigError("q must be (n_head, hd) and k, v (n_kv, P, hd)")
        n_head, hd = q.shape
        n_kv, P, _ = k.shape
        q, k, v = _f32(q, "q"), _f32(k, "k", (n_kv, P, hd)), _f32(v, "v", (n_kv, P, hd))
        pos, count = _i32(pos, "pos", (n_kv, P)), _i32(count, "count", (n_kv,))
        if n_head % n_kv:
            raise ConfigError(f"n_head {n_head} must be a multiple of n_kv {n_kv}")
        if count.min() < 1 or count.max() > P:
            raise ConfigError(f"count must be in [1, {P}]")
        if rotary_dim % 2 or not 0 <= rotary_dim <= hd:
            raise ConfigError(f"rotary_dim must be even and <= {hd}")
        scale = hd ** -0.5 if attn_scale is None else attn_scale
        out = np.empty((n_head, hd), np.float32)
        w = np.zeros((n_head, P), np.float32)
        ffi, lib = _module()
        _check(lib.rl_kernel_attend(device, _ptr(ffi, "float *", q), _ptr(ffi, "float *", k), _ptr(ffi, "float *", v),
                                    _ptr(ffi, "int32_t *", pos), _ptr(ffi, "int32_t *", count), n_head, n_kv, P, hd,
                                    rotary_dim, float(rope_base), float(rope_scale), float(scale), int(q_pos),
                                    _ptr(ffi, "float *", out), _ptr(ffi, "float *", w)), "rl_kernel_attend")
        return out, w

    @staticmethod
    def pick(logits: np.ndarray, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, u: float = 0.0,
             device: int = 0) -> int:
        """The token rl_pick chooses from a logits row (n,) float32 with uniform draw u."""
        if not isinstance(logits, np.ndarray) or logits.ndim != 1 or logits.size < 1:
            raise ConfigError("logits must be a non-empty 1-D float32 array")
        logits = _f32(logits, "logits")
        _check_sampling(temperature, top_k, top_p)
        if not 0.0 <= u < 1.0:
            raise ConfigError(f"u must be in [0, 1), got {u}")
        ffi, lib = _module()
        tok = ffi.new("int32_t *")
        _check(lib.rl_kernel_pick(device, _ptr(ffi, "float *", logits), logits.size, float(temperature), int(top_k),
                                  float(top_p), float(u), tok), "rl_kernel_pick")
        return int(tok[0])


# ==================================================================================================
# Store
# ==================================================================================================

class CUDAStore:
    """One sequence's KV store on the device (DESIGN.md "KV store contract"); made by CUDAEngine.new_store.

    The layer layout is KVStore's: capacity C per layer (a sliding-window layer whose window fits
    gets C = window, no sinks, the ring), ring layers for full/streaming without staging, policy
    layers with P = KVConfig.physical_capacity slots otherwise.
    """

    def __init__(self, engine: "CUDAEngine", kv: KVConfig):
        spec = engine.spec
        kv.validate()
        if kv.policy not in DEVICE_POLICIES:
            raise ConfigError(f"policy {kv.policy!r} is not available on the cuda backend; available: "
                              f"{', '.join(DEVICE_POLICIES)} (use backend='cpu' for the others)")
        if kv.update != "inplace":
            raise ConfigError("update 'shift' (the shift-and-append benchmark baseline) exists on the CPU only")
        capacity, sinks = kv.capacity, kv.sinks
        if kv.policy == "full":
            if capacity is not None and not 1 <= capacity <= spec.n_ctx:
                raise ConfigError(f"with policy 'full' the capacity is the context size, 1..{spec.n_ctx}; got {capacity}")
            capacity, sinks = capacity or spec.n_ctx, 0
        self.engine, self.kv, self.spec = engine, kv, spec
        self.policy, self.positions, self.update = kv.policy, kv.positions, kv.update
        self.capacity, self.sinks = int(capacity), int(sinks)
        self.recent = kv.resolved_recent if kv.policy != "full" else 0
        self.reindexed = kv.positions == "reindexed"
        self.layer_capacity, self.layer_sinks, self.layer_ring, self.layer_physical = [], [], [], []
        for il in range(spec.n_layer):
            cap, s = self.capacity, self.sinks
            ring = kv.policy in ("full", "streaming") and not kv.staged
            w = spec.window[il]
            if w and w <= cap:
                cap, s, ring = w, 0, True
            self.layer_capacity.append(cap)
            self.layer_sinks.append(s)
            self.layer_ring.append(ring)
            self.layer_physical.append(cap if ring else KVConfig(capacity=cap, policy="streaming", sinks=0, lazy=kv.lazy,
                                                                 slack=kv.slack, max_drop=kv.max_drop).physical_capacity)
        if max(self.layer_physical) >= 2 ** 31 // max(1, spec.n_head_kv):
            raise ConfigError(f"capacity {self.capacity} is too large for the cuda backend")
        proj = None
        if kv.policy == "lsh":
            # SimHash projections of runtime/policies/lsh.py: N(0, 1) from default_rng(seed + layer)
            proj = np.ascontiguousarray(np.stack([
                np.random.default_rng(kv.seed + il).standard_normal((kv.lsh_bits, spec.head_dim)).astype(np.float32)
                for il in range(spec.n_layer)]))
        ffi, lib = _module()
        arrays = {name: np.ascontiguousarray(np.asarray(vals, dtype=np.int32)) for name, vals in (
            ("layer_capacity", self.layer_capacity), ("layer_physical", self.layer_physical),
            ("layer_sinks", self.layer_sinks), ("layer_ring", [int(r) for r in self.layer_ring]))}
        p = ffi.new("rl_store_params *")
        p.policy = DEVICE_POLICIES[kv.policy]
        p.reindexed = int(self.reindexed)
        p.recent, p.lazy, p.slack, p.max_drop, p.lsh_bits = self.recent, kv.lazy, kv.slack, kv.max_drop, kv.lsh_bits
        for name, a in arrays.items():
            setattr(p, name, _ptr(ffi, "int *", a))
        p.lsh_proj = _ptr(ffi, "float *", proj)
        out = ffi.new("rl_store **")
        _check(lib.rl_store_init(out, engine._model, p), "rl_store_init")
        self._store = ffi.gc(out[0], lib.rl_store_free)
        self._held = np.zeros((spec.n_layer, spec.n_head_kv), np.int64)
        self._evicted = np.zeros((spec.n_layer, spec.n_head_kv), np.int64)
        self.n_seen = 0

    def check_room(self, n_new: int) -> None:
        """Raise before any work when policy full would overflow the model's context."""
        if self.policy == "full" and self.n_seen + n_new > self.capacity:
            raise ConfigError(f"{self.n_seen + n_new} tokens exceed the model's context {self.capacity} with "
                              "policy 'full'; choose an eviction policy (e.g. streaming) or a shorter input")

    def counts(self) -> tuple[np.ndarray, np.ndarray]:
        """held, evicted: (n_layer, n_head_kv) int64 (a device read)."""
        ffi, lib = _module()
        seen = ffi.new("int64_t *")
        _check(lib.rl_store_counts(self._store, _ptr(ffi, "int64_t *", self._held),
                                   _ptr(ffi, "int64_t *", self._evicted), seen), "rl_store_counts")
        return self._held.copy(), self._evicted.copy()

    def read_layer(self, il: int) -> dict:
        """Layer il's slots copied to the host: k, v (n_kv, P, hd) f32, seq, pos (n_kv, P) i32, score f64."""
        if not 0 <= il < self.spec.n_layer:
            raise ConfigError(f"layer {il} out of range 0..{self.spec.n_layer - 1}")
        nkv, P, hd = self.spec.n_head_kv, self.layer_physical[il], self.spec.head_dim
        out = {"k": np.empty((nkv, P, hd), np.float32), "v": np.empty((nkv, P, hd), np.float32),
               "seq": np.empty((nkv, P), np.int32), "pos": np.empty((nkv, P), np.int32),
               "score": np.empty((nkv, P), np.float64)}
        ffi, lib = _module()
        _check(lib.rl_store_read_layer(self._store, il, _ptr(ffi, "float *", out["k"]), _ptr(ffi, "float *", out["v"]),
                                       _ptr(ffi, "int32_t *", out["seq"]), _ptr(ffi, "int32_t *", out["pos"]),
                                       _ptr(ffi, "double *", out["score"])), "rl_store_read_layer")
        return out

    def reset(self) -> None:
        ffi, lib = _module()
        _check(lib.rl_store_reset(self._store), "rl_store_reset")
        self.n_seen = 0

    def device_bytes(self) -> int:
        ffi, lib = _module()
        n = ffi.new("int64_t *")
        _check(lib.rl_store_bytes(self._store, n), "rl_store_bytes")
        return int(n[0])

    def stats(self) -> dict:
        """Same keys as KVStore.stats()."""
        held, evicted = self.counts()
        return {"capacity": self.capacity, "length": int(held.max()), "evicted_total": int(evicted.sum()),
                "policy": self.policy, "sinks": self.sinks, "recent": self.recent, "positions": self.positions,
                "update": self.update, "tokens_seen": self.n_seen, "layer_capacity": list(self.layer_capacity),
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

    Raises DeviceError when there is no usable GPU/driver or the library was built without CUDA,
    ConfigError on bad options or tensors (before anything is uploaded).
    """

    def __init__(self, spec: ModelSpec, tensors: dict[str, QTensor], n_threads: int | None = None, n_batch: int = 64,
                 device: int = 0, cuda_graph: bool = False):
        if n_threads is not None and (not isinstance(n_threads, int) or n_threads < 1):
            raise ConfigError(f"n_threads must be a positive integer, got {n_threads!r}")
        if not isinstance(n_batch, int) or n_batch < 1:
            raise ConfigError(f"n_batch must be >= 1, got {n_batch!r}")
        if not isinstance(device, int) or device < 0:
            raise ConfigError(f"device must be a CUDA device index >= 0, got {device!r}")
        if not isinstance(spec, ModelSpec):
            raise ConfigError(f"spec must be a ModelSpec, got {type(spec).__name__}")
        uploads = self._plan(spec, tensors)   # every check before the first device call
        self.spec, self.n_batch, self.device = spec, n_batch, device
        ffi, lib = _module()
        p = ffi.new("rl_model_params *")
        p.n_vocab, p.n_embd, p.n_layer = spec.n_vocab, spec.n_embd, spec.n_layer
        p.n_head, p.n_head_kv, p.head_dim, p.n_ff = spec.n_head, spec.n_head_kv, spec.head_dim, spec.n_ff
        p.rotary_dim, p.norm_kind, p.act = spec.rotary_dim, _NORMS[spec.norm], _ACTS[spec.act]
        p.gated_ffn, p.qk_norm, p.sandwich_norm = int(spec.gated_ffn), int(spec.qk_norm), int(spec.sandwich_norm)
        p.parallel_residual, p.tied_output = int(spec.parallel_residual), int(spec.tied_output)
        p.norm_eps, p.embed_scale, p.attn_scale = spec.norm_eps, spec.embed_scale, spec.attn_scale
        p.final_logit_softcap, p.n_batch, p.device = spec.final_logit_softcap, n_batch, device
        out = ffi.new("rl_model **")
        _check(lib.rl_model_init(out, p), "rl_model_init")
        self._model = ffi.gc(out[0], lib.rl_model_free)
        for kind, role, il, payload in uploads:
            if kind == "matrix":
                qt, n_rows, n_cols, rb, data = payload
                _check(lib.rl_model_set_matrix(self._model, role, il, int(qt), n_rows, n_cols,
                                               _ptr(ffi, "uint8_t *", data), rb), "rl_model_set_matrix")
            else:
                _check(lib.rl_model_set_vector(self._model, role, il, _ptr(ffi, "float *", payload), payload.size),
                       "rl_model_set_vector")
        for il in range(spec.n_layer):
            _check(lib.rl_model_set_rope(self._model, il, float(spec.rope_base[il]), float(spec.rope_scale[il])),
                   "rl_model_set_rope")
        _check(lib.rl_model_ready(self._model), "rl_model_ready")
        _check(lib.rl_model_set_graph(self._model, int(bool(cuda_graph))), "rl_model_set_graph")
        self.cuda_graph = bool(cuda_graph)
        self._logits1 = np.zeros(spec.n_vocab, np.float32)
        self._tok = ffi.new("int32_t *")

    @staticmethod
    def _plan(spec: ModelSpec, tensors: dict[str, QTensor]) -> list:
        """[(kind, role, layer, payload)] of every tensor to upload, all checked against the spec."""
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
                plan.append(("matrix", role, il, _blocks(t, name)))
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

    def _ids(self, ids, store: CUDAStore) -> np.ndarray:
        if not isinstance(store, CUDAStore) or store.engine is not self:
            raise ConfigError("store must be a CUDAStore made by this engine's new_store()")
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise ConfigError(f"token ids must be integers, got dtype {ids.dtype}")
        ids = ids.reshape(-1)
        if ids.size == 0:
            raise ConfigError("no tokens to feed")
        if ids.min() < 0 or ids.max() >= self.spec.n_vocab:
            raise ConfigError(f"token ids must be in [0, {self.spec.n_vocab}); got {ids.min()}..{ids.max()}")
        store.check_room(ids.size)
        return np.ascontiguousarray(ids, dtype=np.int32)

    def forward(self, ids, store: CUDAStore, all_logits: bool = True) -> np.ndarray:
        """Feed ids through the store. all_logits: a new (len(ids), n_vocab) array; else the last
        token's logits (n_vocab,) (a view of a host buffer, valid until the next call)."""
        ids = self._ids(ids, store)
        ffi, lib = _module()
        out = np.empty((ids.size, self.spec.n_vocab), np.float32) if all_logits else self._logits1
        _check(lib.rl_forward(self._model, store._store, _ptr(ffi, "int32_t *", ids), ids.size,
                              _ptr(ffi, "float *", out), int(bool(all_logits))), "rl_forward")
        store.n_seen += ids.size
        return out

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
        _check_sampling(temperature, top_k, top_p)
        u = _uniform(rng, temperature)
        ffi, lib = _module()
        _check(lib.rl_pick(self._model, float(temperature), int(top_k), float(top_p), u, self._tok), "rl_pick")
        return int(self._tok[0])

    def decode(self, token: int, store: CUDAStore, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               rng=None, want_logits: bool = False):
        """One decode step and the choice of the next token, in one device call.

        Returns the next token, or (token, logits (n_vocab,)) when want_logits."""
        ids = self._ids([token], store)
        _check_sampling(temperature, top_k, top_p)
        u = _uniform(rng, temperature)
        ffi, lib = _module()
        lp = _ptr(ffi, "float *", self._logits1) if want_logits else ffi.NULL
        _check(lib.rl_decode(self._model, store._store, int(ids[0]), float(temperature), int(top_k), float(top_p), u,
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
        ffi, lib = _module()
        n = ffi.new("int64_t *")
        _check(lib.rl_model_weight_bytes(self._model, n), "rl_model_weight_bytes")
        return int(n[0])
