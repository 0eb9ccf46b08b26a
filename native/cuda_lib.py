"""The C module of the CUDA backend and the checks every call into it goes through.

    ffi, lib = ffi_lib()                     # ringllm.native._ringllm_cuda, imported on first use
    check_status(lib.rl_store_reset(st), "rl_store_reset")    # non-zero status -> exception

The cffi module (built by native/_cffi_build.py from include/ringllm_cuda.h) is imported by
ffi_lib() on first use, never at import time: the CPU path and machines without CUDA never load
it. check_status turns the C API's int status into an exception carrying the library's message,
CUDA error text included: ConfigError for a bad argument, DeviceError for everything a device
(or a build without CUDA) causes.

Arrays are checked here before anything reaches C (in the style of pynacl): as_f32, as_i32 and
matrix_blocks raise ConfigError on a wrong dtype, shape or range instead of casting silently;
c_ptr hands cffi a pointer into a checked, C-contiguous array. The constants mirror the header's
enums (status codes, policies, norm kinds, activations, the KV store's element types);
tests/test_native.py and tests/test_native_kv_types.py check them against the built module.
"""
from __future__ import annotations

import glob
import os

import numpy as np

from ringllm.runtime.errors import ConfigError, RingLLMError
from ringllm.runtime.qtensor import QTensor
from ringllm.runtime.quant_types import SUPPORTED_TYPES, GGMLType, row_bytes

__all__ = ["ACTIVATIONS", "ATTEND_PATHS", "ATTEND_SPLIT_MIN_P", "DEVICE_KV_TYPES", "DEVICE_POLICIES", "HEADER",
           "HERE", "NORM_KINDS", "RL_ERR_ARG", "RL_ERR_CUDA", "RL_ERR_NO_CUDA", "RL_ERR_NO_DEVICE", "RL_ERR_OOM",
           "RL_ERR_STATE", "RL_OK", "DeviceError", "as_f32", "as_i32", "available", "build_info", "c_ptr",
           "check_sampling", "check_status", "device_count", "ffi_lib", "has_cuda", "library_path", "matrix_blocks",
           "uniform_draw"]

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = os.path.join(HERE, "include", "ringllm_cuda.h")

# Status codes (include/ringllm_cuda.h)
RL_OK, RL_ERR_NO_CUDA, RL_ERR_NO_DEVICE, RL_ERR_CUDA, RL_ERR_ARG, RL_ERR_OOM, RL_ERR_STATE = range(7)

DEVICE_POLICIES = {"full": 0, "streaming": 1, "h2o": 2, "tova": 3, "knorm": 4, "lsh": 5, "scissorhands": 6, "random": 7,
                   "snapkv": 8, "pyramidkv": 8, "rkv": 9, "adakv": 10, "gvote": 11}
# KV store element types the device holds (KVConfig k_type / v_type, runtime/kv_types.py) -> their
# GGML codes, rl_store_params k_type / v_type (RL_TYPE_F32, RL_TYPE_F16, RL_TYPE_Q8_0)
DEVICE_KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}
NORM_KINDS = {"rms": 0, "layer": 1}
ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
# Paths of the attention step (rl_kernel_attend's path: RL_ATTEND_AUTO, _SINGLE, _SPLIT); "auto" is
# split-K for stores of more than ATTEND_SPLIT_MIN_P slots (RL_ATTEND_SPLIT_MIN_P), as the forward pass
ATTEND_PATHS = {"auto": 0, "single": 1, "split": 2}
ATTEND_SPLIT_MIN_P = 256


class DeviceError(RingLLMError):
    """The CUDA backend cannot run: no GPU or driver, built without CUDA, a CUDA runtime failure."""


# ==================================================================================================
# The C module, loaded on first use
# ==================================================================================================

_MOD = None         # (ffi, lib) once loaded


def ffi_lib():
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


def check_status(status: int, what: str) -> None:
    """Turn a non-zero status of the C API into the matching exception."""
    if status == RL_OK:
        return
    ffi, lib = ffi_lib()
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
    ffi, lib = ffi_lib()
    buf = ffi.new("char[]", 256)
    check_status(lib.rl_build_info(buf, 256), "rl_build_info")
    return ffi.string(buf).decode()


def has_cuda() -> bool:
    """Whether the native module was built with nvcc (False: built without CUDA or not importable)."""
    try:
        return bool(ffi_lib()[1].rl_has_cuda())
    except DeviceError:
        return False


def device_count() -> int:
    """CUDA devices usable here; 0 without a GPU, a driver, or a CUDA build (never raises)."""
    try:
        ffi, lib = ffi_lib()
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

def as_f32(a, name: str, shape: tuple | None = None) -> np.ndarray:
    """A C-contiguous float32 array; ConfigError on another dtype or shape (no silent casts)."""
    if not isinstance(a, np.ndarray) or a.dtype != np.float32:
        raise ConfigError(f"{name} must be a float32 numpy array, got {getattr(a, 'dtype', type(a).__name__)}")
    if shape is not None and a.shape != shape:
        raise ConfigError(f"{name} must have shape {shape}, got {a.shape}")
    return np.ascontiguousarray(a)


def as_i32(a, name: str, shape: tuple | None = None) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.dtype.kind not in "iu":
        raise ConfigError(f"{name} must be an integer numpy array, got {getattr(a, 'dtype', type(a).__name__)}")
    if shape is not None and a.shape != shape:
        raise ConfigError(f"{name} must have shape {shape}, got {a.shape}")
    if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
        raise ConfigError(f"{name} has values outside int32")
    return np.ascontiguousarray(a, dtype=np.int32)


# the types native/src/quant.cu decodes (rl_type_layout); the CPU runtime reads more (quant_types.py)
_CUDA_TYPES = SUPPORTED_TYPES - {GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.IQ4_NL, GGMLType.IQ4_XS}


def _qtype(qtype) -> GGMLType:
    try:
        t = GGMLType(int(qtype))
    except (ValueError, TypeError):
        raise ConfigError(f"unknown GGML type {qtype!r}") from None
    if t not in _CUDA_TYPES:
        raise ConfigError(f"GGML type {t.name} is not supported by the CUDA backend; supported: "
                          f"{sorted(x.name for x in _CUDA_TYPES)}")
    return t


def matrix_blocks(t: QTensor, what: str) -> tuple[GGMLType, int, int, int, np.ndarray]:
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


def c_ptr(ffi, ctype: str, a: np.ndarray):
    return ffi.cast(ctype, ffi.from_buffer(a)) if a is not None else ffi.NULL


def uniform_draw(rng, temperature: float) -> float:
    """The uniform draw of a sampled token, from the caller's seeded generator (0 for greedy)."""
    if temperature <= 0:
        return 0.0
    if rng is None:
        raise ConfigError("sampling (temperature > 0) needs rng, a numpy Generator (e.g. np.random.default_rng(seed))")
    return min(float(rng.random()), 0.99999994)   # below 1.0 in float32


def check_sampling(temperature, top_k, top_p) -> None:
    if not np.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"temperature must be >= 0, got {temperature}")
    if not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ConfigError(f"top_k must be an integer >= 0 (0 = all), got {top_k!r}")
    if not 0.0 < top_p <= 1.0:
        raise ConfigError(f"top_p must be in (0, 1], got {top_p}")
