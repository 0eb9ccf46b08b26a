"""ringllm.native: the CUDA backend, a thin wrapper over libringllm_cuda.so (include/ringllm_cuda.h).

    eng = CUDAEngine(spec, tensors)                     # raises DeviceError without a GPU/driver
    st = eng.new_store(KVConfig(capacity=64, policy="h2o"))
    st8 = eng.new_store(KVConfig(capacity=64, k_type="q8_0", v_type="q8_0"))   # rows in f32, f16 or q8_0
    logits = eng.prefill(ids, st)                        # (n_vocab,) float32
    tok = eng.pick()                                     # greedy on the device
    tok = eng.decode(tok, st)                            # one decode step + greedy, one device call
    eng.step(tok, st), eng.logits(ids, st), st.stats()   # the CPUEngine verbs

In the style of pynacl: every array is checked in Python (dtype, shape, range) before anything
reaches C; a non-zero status becomes an exception carrying the library's message, CUDA error text
included (DeviceError for device problems, ConfigError for bad arguments). Importing this package
never loads the C module: that happens when a GPU object is first built, so the CPU path and
machines without CUDA are untouched (and the CPU path never imports this package at all).

This file only re-exports; the code is in

    cuda_lib.py       the C module (loaded on first use), status -> exception, argument checks,
                      build and device queries (build_info, has_cuda, device_count, library_path)
    cuda_backend.py   CUDAEngine (a model on one device) and CUDAStore (one sequence's KV store)
    cuda_kernels.py   kernels: single device kernels called from Python, for tests and benchmarks

and the compiled cffi module is ringllm.native._ringllm_cuda (native/_cffi_build.py).
"""
from ringllm.native.cuda_backend import CUDAEngine, CUDAStore
from ringllm.native.cuda_kernels import kernels
from ringllm.native.cuda_lib import (DEVICE_KV_TYPES, DEVICE_POLICIES, HEADER, HERE, RL_ERR_ARG, RL_ERR_CUDA,
                                     RL_ERR_NO_CUDA, RL_ERR_NO_DEVICE, RL_ERR_OOM, RL_ERR_STATE, RL_OK, DeviceError,
                                     available, build_info, check_status, device_count, ffi_lib, has_cuda,
                                     library_path)

__all__ = ["DeviceError", "CUDAEngine", "CUDAStore", "available", "device_count", "build_info", "library_path",
           "DEVICE_KV_TYPES", "DEVICE_POLICIES", "kernels", "has_cuda", "ffi_lib", "check_status", "HERE", "HEADER",
           "RL_OK", "RL_ERR_NO_CUDA", "RL_ERR_NO_DEVICE", "RL_ERR_CUDA", "RL_ERR_ARG", "RL_ERR_OOM", "RL_ERR_STATE"]
