"""Single CUDA kernels called from Python: upload, one launch, download (tests and benchmarks).

    out = kernels.matmul(w, x)                  # x (T, n_cols) float32 @ W.T on the device
    out, weights = kernels.attend(q, k, v, pos, count, q_pos, rotary_dim)   # k, v: rows of a KV type

Each wrapper checks its arrays (cuda_lib's checks) before calling the matching rl_kernel_* entry
point of include/ringllm_cuda.h, so tests can compare every device kernel with its CPU twin
(runtime/) on the same inputs without building a whole engine.
"""
from __future__ import annotations

import numpy as np

from ringllm.native.cuda_lib import (ACTIVATIONS, ATTEND_PATHS, DEVICE_KV_TYPES, NORM_KINDS, as_f32, as_i32, c_ptr,
                                     check_sampling, check_status, ffi_lib, matrix_blocks)
from ringllm.runtime.errors import ConfigError
from ringllm.runtime.kv_types import STORE_DTYPE, check_kv_type, row_width
from ringllm.runtime.qtensor import QTensor

__all__ = ["kernels"]


def _kv_rows(a, name: str, n_kv: int, P: int, hd: int) -> tuple[np.ndarray, str]:
    """(C-contiguous rows, KV type) of a store array (n_kv, P, width) in a type the device holds,
    named by its dtype as runtime/kv_types.py does (float32 f32, uint16 f16, int8 q8_0)."""
    kind = next((t for t in DEVICE_KV_TYPES if a.dtype == STORE_DTYPE[t]), None)
    if kind is None:
        raise ConfigError(f"{name} must hold rows of a KV type of the device ({', '.join(DEVICE_KV_TYPES)}: dtype "
                          f"{', '.join(str(STORE_DTYPE[t]) for t in DEVICE_KV_TYPES)}), got {a.dtype}")
    check_kv_type(kind, name, hd)
    shape = (n_kv, P, row_width(kind, hd))
    if a.shape != shape:
        raise ConfigError(f"{name} ({kind}) must have shape {shape}, got {a.shape}")
    return np.ascontiguousarray(a), kind


class kernels:
    """One-shot wrappers of the rl_kernel_* entry points; each checks its arrays first."""

    @staticmethod
    def dequant(t: QTensor, device: int = 0) -> np.ndarray:
        """(n_rows, n_cols) float32 values of a matrix in its blocks."""
        qt, n_rows, n_cols, rb, data = matrix_blocks(t, "dequant weights")
        out = np.empty((n_rows, n_cols), np.float32)
        ffi, lib = ffi_lib()
        check_status(lib.rl_kernel_dequant(device, int(qt), n_rows, n_cols, c_ptr(ffi, "uint8_t *", data), rb,
                                     c_ptr(ffi, "float *", out)), "rl_kernel_dequant")
        return out

    @staticmethod
    def matmul(t: QTensor, x: np.ndarray, device: int = 0) -> np.ndarray:
        """x (T, n_cols) float32 @ W.T -> (T, n_rows) float32 (T = 1: the decode matvec)."""
        qt, n_rows, n_cols, rb, data = matrix_blocks(t, "matmul weights")
        if not isinstance(x, np.ndarray) or x.ndim != 2 or x.shape[1] != n_cols or x.shape[0] < 1:
            raise ConfigError(f"x must have shape (T, {n_cols}), got {getattr(x, 'shape', None)}")
        x = as_f32(x, "x")
        out = np.empty((x.shape[0], n_rows), np.float32)
        ffi, lib = ffi_lib()
        check_status(lib.rl_kernel_matmul(device, int(qt), n_rows, n_cols, c_ptr(ffi, "uint8_t *", data), rb,
                                    c_ptr(ffi, "float *", x), x.shape[0], c_ptr(ffi, "float *", out)),
               "rl_kernel_matmul")
        return out

    @staticmethod
    def norm(kind: str, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None, eps: float = 1e-5,
             device: int = 0) -> np.ndarray:
        """Row norm of x (rows, n): "rms" or "layer" (needs b)."""
        if kind not in NORM_KINDS:
            raise ConfigError(f"norm kind {kind!r} unknown; valid: {list(NORM_KINDS)}")
        if not isinstance(x, np.ndarray) or x.ndim != 2:
            raise ConfigError("x must be a 2-D float32 array (rows, n)")
        rows, n = x.shape
        x, w = as_f32(x, "x"), as_f32(w, "w", (n,))
        if kind == "layer":
            if b is None:
                raise ConfigError("layer norm needs a bias b")
            b = as_f32(b, "b", (n,))
        out = np.empty_like(x)
        ffi, lib = ffi_lib()
        check_status(lib.rl_kernel_norm(device, NORM_KINDS[kind], c_ptr(ffi, "float *", x), c_ptr(ffi, "float *", w),
                                  c_ptr(ffi, "float *", b if kind == "layer" else None), rows, n, float(eps),
                                  c_ptr(ffi, "float *", out)), "rl_kernel_norm")
        return out

    @staticmethod
    def act(act: str, up: np.ndarray, gate: np.ndarray | None = None, device: int = 0) -> np.ndarray:
        """act(gate) * up when gate is given, else act(up); (T, n) float32."""
        if act not in ACTIVATIONS:
            raise ConfigError(f"activation {act!r} unknown; valid: {list(ACTIVATIONS)}")
        if not isinstance(up, np.ndarray) or up.ndim != 2:
            raise ConfigError("up must be a 2-D float32 array (T, n)")
        up = as_f32(up, "up")
        if gate is not None:
            gate = as_f32(gate, "gate", up.shape)
        out = np.empty_like(up)
        ffi, lib = ffi_lib()
        check_status(lib.rl_kernel_act(device, ACTIVATIONS[act], int(gate is not None), c_ptr(ffi, "float *", gate),
                                 c_ptr(ffi, "float *", up), up.shape[0], up.shape[1], c_ptr(ffi, "float *", out)),
               "rl_kernel_act")
        return out

    @staticmethod
    def embed(t: QTensor, ids, scale: float = 1.0, device: int = 0) -> np.ndarray:
        """Rows ids of the matrix t, times scale: (len(ids), n_cols) float32."""
        qt, n_rows, n_cols, rb, data = matrix_blocks(t, "embedding")
        ids = as_i32(np.asarray(ids).reshape(-1), "ids")
        if ids.size == 0 or ids.min() < 0 or ids.max() >= n_rows:
            raise ConfigError(f"ids must be non-empty and in [0, {n_rows})")
        out = np.empty((ids.size, n_cols), np.float32)
        ffi, lib = ffi_lib()
        check_status(lib.rl_kernel_embed(device, int(qt), n_rows, n_cols, c_ptr(ffi, "uint8_t *", data), rb,
                                   c_ptr(ffi, "int32_t *", ids), ids.size, float(scale), c_ptr(ffi, "float *", out)),
               "rl_kernel_embed")
        return out

    @staticmethod
    def attend(q, k, v, pos, count, q_pos: int, rotary_dim: int, rope_base: float = 10000.0,
               rope_scale: float = 1.0, attn_scale: float | None = None, path: str = "auto", device: int = 0):
        """One query's attention over a layer's slots (runtime/attention.py attend):
        q (n_head, hd) float32; k, v (n_kv, P, width) rows of a KV type of the device, keys before
        RoPE: float32 (width hd), or f16 / q8_0 rows as runtime/kv_codec.encode gives them (uint16,
        width hd / int8, width hd / 32 * 34; the type follows the dtype, k and v may differ);
        pos (n_kv, P), count (n_kv,) ints. path: "auto" (the forward pass's choice: split-K when
        P > ATTEND_SPLIT_MIN_P), "single" (one block per query head) or "split" (split-K over the
        slots, then a merge; any P). Returns out (n_head, hd) and the softmax weights (n_head, P)
        (zero past count)."""
        if not all(isinstance(a, np.ndarray) for a in (q, k, v, pos, count)):
            raise ConfigError("q, k, v, pos, count must be numpy arrays")
        if q.ndim != 2 or k.ndim != 3:
            raise ConfigError("q must be (n_head, hd) and k, v (n_kv, P, width)")
        n_head, hd = q.shape
        n_kv, P, _ = k.shape
        q = as_f32(q, "q")
        k, k_type = _kv_rows(k, "k", n_kv, P, hd)
        v, v_type = _kv_rows(v, "v", n_kv, P, hd)
        pos, count = as_i32(pos, "pos", (n_kv, P)), as_i32(count, "count", (n_kv,))
        if n_head % n_kv:
            raise ConfigError(f"n_head {n_head} must be a multiple of n_kv {n_kv}")
        if count.min() < 1 or count.max() > P:
            raise ConfigError(f"count must be in [1, {P}]")
        if rotary_dim % 2 or not 0 <= rotary_dim <= hd:
            raise ConfigError(f"rotary_dim must be even and <= {hd}")
        if path not in ATTEND_PATHS:
            raise ConfigError(f"path must be one of {', '.join(ATTEND_PATHS)}, got {path!r}")
        scale = hd ** -0.5 if attn_scale is None else attn_scale
        out = np.empty((n_head, hd), np.float32)
        w = np.zeros((n_head, P), np.float32)
        ffi, lib = ffi_lib()
        check_status(lib.rl_kernel_attend(device, c_ptr(ffi, "float *", q), c_ptr(ffi, "void *", k),
                                          c_ptr(ffi, "void *", v), DEVICE_KV_TYPES[k_type], DEVICE_KV_TYPES[v_type],
                                          c_ptr(ffi, "int32_t *", pos), c_ptr(ffi, "int32_t *", count), n_head, n_kv,
                                          P, hd, rotary_dim, float(rope_base), float(rope_scale), float(scale),
                                          int(q_pos), ATTEND_PATHS[path], c_ptr(ffi, "float *", out),
                                          c_ptr(ffi, "float *", w)),
                     "rl_kernel_attend")
        return out, w

    @staticmethod
    def pick(logits: np.ndarray, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, u: float = 0.0,
             device: int = 0) -> int:
        """The token rl_pick chooses from a logits row (n,) float32 with uniform draw u."""
        if not isinstance(logits, np.ndarray) or logits.ndim != 1 or logits.size < 1:
            raise ConfigError("logits must be a non-empty 1-D float32 array")
        logits = as_f32(logits, "logits")
        check_sampling(temperature, top_k, top_p)
        if not 0.0 <= u < 1.0:
            raise ConfigError(f"u must be in [0, 1), got {u}")
        ffi, lib = ffi_lib()
        tok = ffi.new("int32_t *")
        check_status(lib.rl_kernel_pick(device, c_ptr(ffi, "float *", logits), logits.size, float(temperature), int(top_k),
                                  float(top_p), float(u), tok), "rl_kernel_pick")
        return int(tok[0])
