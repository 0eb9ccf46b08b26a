"""The CUDA store's KV element types (KVConfig k_type / v_type: f32, f16, q8_0; native/src/kv_rows.cuh).

On every machine (CI included):
  * the device's type table (DEVICE_KV_TYPES) is runtime/kv_types.py's names and the header's
    RL_TYPE_* codes; rl_store_params carries k_type / v_type, f32 in a zeroed struct;
  * CUDAStore refuses q4_0 with a ConfigError naming f32, f16, q8_0 (and q8_0 with a head_dim that is
    not a multiple of 32) before any device call; kernels.attend checks row dtypes and widths; the C
    API refuses another type with RL_ERR_ARG before touching a device;
  * the device's row codec, compiled by nvcc for the host, writes runtime/kv_codec.py's bytes and
    reads its values exactly (zeros, ties at .5, f16 overflow and subnormals), with the row sizes of
    kv_types.row_bytes.

With a GPU (marker `gpu`, skipped otherwise):
  * the attention kernels (single-block and split-K) over f16 / q8_0 rows (K and V types mixed)
    against runtime/attention.attend over the decoded rows (normalized MSE < 1e-10, as the f32
    kernel), at 40 slots and past the split threshold (1,000 and 4,096 slots);
  * layer 0 of a typed device store (its keys and values do not depend on the store) holds exactly
    kv_codec.encode of the f32 device store's rows, through ring writes and policy-layer slot moves;
    knorm scores the key as the store holds it;
  * prefill and decode logits (ring layers; policy layers with slot moves) against
    CPUEngine(rope="fused") with the same KVConfig (keys before RoPE on every layer, the device's
    layout, so both quantize the same values). The two differ where a last-bit difference of the
    inputs (accumulation order) flips a rounding: a few values move by one step. So the device must
    be nearer the CPU's run of its type than that run is to the f32 run: max |device - cpu| <= 1e-3 +
    max |cpu typed - cpu f32|, normalized MSE at most half of the typed run's from f32, argmax
    agreement >= 95%. Tolerances measured by emulating the device on the CPU (weights perturbed by
    1e-6 relative): max ratio 0.17 (q8_0), 0.51 (f16: a flip is one ulp, as large as its largest
    rounding error); MSE ratio 0.012 (q8_0), 0.22 (f16). Against CPUEngine's default layout
    (ring-layer keys quantized after RoPE: other noise of the same size, measured up to 1.6x), max
    |device - cpu| <= 1e-3 + 2.5 x the typed run's change, argmax agreement >= 90%.
    Score-driven policies (h2o, knorm) are checked by their scores, not logits: on the tiny random
    model a flipped rounding can change a victim, and then the logits.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import types

import numpy as np
import pytest

import ringllm.native as native
from ringllm.native import DEVICE_KV_TYPES, CUDAEngine, CUDAStore, kernels
from ringllm.runtime import kv_codec
from ringllm.runtime.errors import ConfigError
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.kv_types import KV_TYPES, STORE_DTYPE, row_bytes, row_width
from ringllm.runtime.model_spec import ModelSpec
from ringllm.runtime.quant_types import GGMLType

from test_native import LARGE_STORES, check_attend_against_cpu, tiny_tensors
from test_native import tiny_spec as native_tiny_spec

NATIVE_DIR = os.path.dirname(native.__file__)
HAS_GPU = native.device_count() > 0
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU and driver")

TYPE_PAIRS = [("f16", "f16"), ("q8_0", "q8_0"), ("q8_0", "f16"), ("f32", "q8_0")]


def tiny_spec(**kw) -> ModelSpec:
    """test_native's llama-shaped model with a head_dim (32) q8_0 can hold."""
    return native_tiny_spec(**{"n_embd": 64, "head_dim": 32, "n_ff": 128, **kw})


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    want = np.asarray(want, np.float64)
    return float(np.sum((np.asarray(got, np.float64) - want) ** 2) / max(np.sum(want ** 2), 1e-30))


def codec_rows() -> np.ndarray:
    """(n, 64) float32 rows that exercise the codecs: magnitudes 1e-6 .. 1e5, zero rows and blocks,
    q8_0 ties (x / d exactly k + 0.5), f16 overflow and subnormals."""
    rng = np.random.default_rng(0)
    n, hd = 2000, 64
    x = (rng.standard_normal((n, hd)) * rng.choice([1e-6, 1e-2, 1.0, 100.0, 1e5], (n, 1))).astype(np.float32)
    x[0] = 0.0
    x[1, :32] = 0.0
    x[2, :32] = np.arange(32, dtype=np.float32) - 15.5        # d = 1: every q a tie
    x[2, 0] = 127.0
    x[3] = 1e5                                                # past f16's largest finite value
    x[4] = 1e-7                                               # f16 subnormal
    return x


# ==================================================================================================
# Every machine: the type table, refusals before any device call
# ==================================================================================================

def test_device_kv_types_match_the_header_and_kv_types():
    from ringllm.native import _ringllm_cuda as mod

    assert list(DEVICE_KV_TYPES) == ["f32", "f16", "q8_0"]
    assert set(DEVICE_KV_TYPES) < set(KV_TYPES)
    lib, ffi = mod.lib, mod.ffi
    assert DEVICE_KV_TYPES == {"f32": lib.RL_TYPE_F32, "f16": lib.RL_TYPE_F16, "q8_0": lib.RL_TYPE_Q8_0}
    fields = dict(ffi.typeof("rl_store_params").fields)
    assert {"k_type", "v_type"} <= set(fields)
    p = ffi.new("rl_store_params *")
    assert p.k_type == p.v_type == lib.RL_TYPE_F32                 # a zeroed struct is the f32 store


@pytest.mark.parametrize("field", ["k_type", "v_type"])
def test_store_refuses_q4_0_naming_the_device_types(field):
    spec = tiny_spec()
    engine = types.SimpleNamespace(spec=spec)          # the checks run before the engine is used
    with pytest.raises(ConfigError) as exc:
        CUDAStore(engine, KVConfig(capacity=16, policy="streaming", **{field: "q4_0"}))
    msg = str(exc.value)
    assert field in msg and "q4_0" in msg and "f32, f16, q8_0" in msg
    with pytest.raises(ConfigError, match="multiple of 32|head_dim"):
        CUDAStore(types.SimpleNamespace(spec=tiny_spec(n_embd=32, head_dim=8)),
                  KVConfig(capacity=16, policy="streaming", **{field: "q8_0"}))


def test_attend_wrapper_checks_row_types_and_widths():
    q = np.zeros((4, 32), np.float32)
    pos, count = np.zeros((2, 5), np.int32), np.array([1, 1])
    f32 = np.zeros((2, 5, 32), np.float32)
    with pytest.raises(ConfigError, match="f32, f16, q8_0"):
        kernels.attend(q, np.zeros((2, 5, 18), np.uint8), f32, pos, count, 0, 32)       # q4_0 rows
    with pytest.raises(ConfigError, match="shape"):
        kernels.attend(q, f32, np.zeros((2, 5, 32), np.int8), pos, count, 0, 32)        # q8_0 is 34 wide
    with pytest.raises(ConfigError, match="shape"):
        kernels.attend(q, np.zeros((2, 5, 34), np.uint16), f32, pos, count, 0, 32)
    with pytest.raises(ConfigError, match="head_dim"):
        kernels.attend(np.zeros((4, 8), np.float32), np.zeros((2, 5, 8), np.int8), np.zeros((2, 5, 8), np.float32),
                       pos, count, 0, 8)


def test_c_api_refuses_other_kv_types_before_any_device():
    if not native.has_cuda():
        pytest.skip("built without CUDA: every call answers RL_ERR_NO_CUDA")
    from ringllm.native import _ringllm_cuda as mod

    lib, ffi = mod.lib, mod.ffi
    n_head, n_kv, P, hd = 2, 1, 3, 40
    q, out, w = ffi.new("float[]", n_head * hd), ffi.new("float[]", n_head * hd), ffi.new("float[]", n_head * P)
    k = ffi.new("uint8_t[]", n_kv * P * 4 * hd)
    pos, count = ffi.new("int32_t[]", n_kv * P), ffi.new("int32_t[]", [1])

    def call(k_type, v_type):
        return lib.rl_kernel_attend(0, q, k, k, k_type, v_type, pos, count, n_head, n_kv, P, hd, hd, 10000.0, 1.0,
                                    0.1, 0, lib.RL_ATTEND_AUTO, out, w)

    assert call(lib.RL_TYPE_Q4_0, lib.RL_TYPE_F32) == lib.RL_ERR_ARG
    msg = ffi.string(lib.rl_last_error()).decode()
    assert "k_type" in msg and "f32" in msg and "f16" in msg and "q8_0" in msg
    assert call(lib.RL_TYPE_F32, lib.RL_TYPE_Q8_0) == lib.RL_ERR_ARG          # head_dim 40: no whole blocks
    msg = ffi.string(lib.rl_last_error()).decode()
    assert "v_type" in msg and "head_dim" in msg


# ==================================================================================================
# Every machine with nvcc: the device's row codec, built for the host, against kv_codec
# ==================================================================================================

_HARNESS = r'''
#include "common.cuh"

#include <string.h>

// The device's row codec (kv_rows.cuh) on the host: q8_0_put per lane with the block's amax, as
// kv_put's warps do, and kv_get for every value.
template <int T> static void enc(uint8_t *row, const float *x, int hd) {
    if constexpr (T == RL_TYPE_F32) {
        memcpy(row, x, 4 * (size_t)hd);
    } else if constexpr (T == RL_TYPE_F16) {
        for (int d = 0; d < hd; d++) reinterpret_cast<uint16_t *>(row)[d] = kv_f16_bits(x[d]);
    } else {
        for (int b = 0; b < hd / KV_QBLOCK; b++) {
            float amax = 0.0f;
            for (int i = 0; i < KV_QBLOCK; i++) amax = fmaxf(amax, fabsf(x[b * KV_QBLOCK + i]));
            for (int i = 0; i < KV_QBLOCK; i++) q8_0_put(row + b * KV_Q8_0_BYTES, i, x[b * KV_QBLOCK + i], amax);
        }
    }
}

template <int T> static void dec(float *x, const uint8_t *row, int hd) {
    for (int d = 0; d < hd; d++) x[d] = kv_get<T>(row, d);
}

extern "C" long long h_row_bytes(int type, int hd) { return kv_row_bytes(type, hd); }

extern "C" void h_encode(int type, uint8_t *rows, const float *x, int n, int hd) {
    const int64_t rb = kv_row_bytes(type, hd);
    for (int r = 0; r < n; r++) {
        if (type == RL_TYPE_F16) enc<RL_TYPE_F16>(rows + r * rb, x + (int64_t)r * hd, hd);
        else if (type == RL_TYPE_Q8_0) enc<RL_TYPE_Q8_0>(rows + r * rb, x + (int64_t)r * hd, hd);
        else enc<RL_TYPE_F32>(rows + r * rb, x + (int64_t)r * hd, hd);
    }
}

extern "C" void h_decode(int type, float *x, const uint8_t *rows, int n, int hd) {
    const int64_t rb = kv_row_bytes(type, hd);
    for (int r = 0; r < n; r++) {
        if (type == RL_TYPE_F16) dec<RL_TYPE_F16>(x + (int64_t)r * hd, rows + r * rb, hd);
        else if (type == RL_TYPE_Q8_0) dec<RL_TYPE_Q8_0>(x + (int64_t)r * hd, rows + r * rb, hd);
        else dec<RL_TYPE_F32>(x + (int64_t)r * hd, rows + r * rb, hd);
    }
}
'''


@pytest.fixture(scope="module")
def host_codec(tmp_path_factory):
    """kv_rows.cuh compiled by nvcc into a host library (ctypes)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ringllm_build_cuda_kv", os.path.join(NATIVE_DIR, "build_cuda.py"))
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    nvcc = build.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    d = tmp_path_factory.mktemp("kv_rows_host")
    src, so = str(d / "harness.cu"), str(d / "harness.so")
    with open(src, "w", encoding="utf-8") as fh:
        fh.write(_HARNESS)
    subprocess.run([nvcc, "-std=c++17", "-O2", "-shared", "-Xcompiler", "-fPIC", "-I", build.INCLUDE, "-I", build.SRC,
                    src, "-o", so], check=True, capture_output=True)
    lib = ctypes.CDLL(so)
    lib.h_row_bytes.restype = ctypes.c_longlong
    return lib


def test_device_row_sizes_are_kv_types_row_bytes(host_codec):
    for name, code in DEVICE_KV_TYPES.items():
        for hd in (32, 64, 96, 128, 256):
            assert host_codec.h_row_bytes(code, hd) == row_bytes(name, hd), (name, hd)
    assert host_codec.h_row_bytes(DEVICE_KV_TYPES["q8_0"], 40) == 0          # not whole blocks: refused
    assert host_codec.h_row_bytes(int(GGMLType.Q4_0), 64) == 0               # not a device KV type
    assert host_codec.h_row_bytes(DEVICE_KV_TYPES["f16"], 40) == row_bytes("f16", 40)


@pytest.mark.parametrize("name", ["f32", "f16", "q8_0"])
def test_device_row_codec_is_kv_codec_bit_for_bit(host_codec, name):
    x = codec_rows()
    n, hd = x.shape
    code = DEVICE_KV_TYPES[name]
    want = kv_codec.encode(x, name)
    got = np.zeros_like(want)
    host_codec.h_encode(code, got.ctypes.data_as(ctypes.c_void_p), x.ctypes.data_as(ctypes.c_void_p), n, hd)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"{name}: {(got != want).sum()} elements differ"
    vals = np.zeros((n, hd), np.float32)
    host_codec.h_decode(code, vals.ctypes.data_as(ctypes.c_void_p), want.ctypes.data_as(ctypes.c_void_p), n, hd)
    ref = kv_codec.decode(want, hd)
    assert np.array_equal(vals.view(np.uint32), ref.view(np.uint32))        # -0.0, inf as well


# ==================================================================================================
# GPU: the attention kernel over typed rows
# ==================================================================================================

@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("path", ["auto", "split"])
@pytest.mark.parametrize("k_type,v_type", TYPE_PAIRS)
@pytest.mark.parametrize("rotary_dim", [64, 16])
def test_attention_over_typed_rows_against_cpu_kernel(k_type, v_type, rotary_dim, path):
    """The kernel decodes the rows kv_codec encodes: the CPU attend over the decoded values is the oracle
    (40 slots: "auto" is the single-block kernel, "split" forces split-K)."""
    check_attend_against_cpu(9, 3, 64, rotary_dim, 40, [40, 17, 1], path, seed=rotary_dim, k_type=k_type,
                             v_type=v_type)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("path", ["single", "split"])
@pytest.mark.parametrize("k_type,v_type", TYPE_PAIRS)
@pytest.mark.parametrize("shape", ["smollm2_1000", "gemma3_4096"])
def test_attention_over_typed_rows_large_stores_against_cpu_kernel(shape, k_type, v_type, path):
    """Both attention kernels over f16 / q8_0 rows past the split threshold (test_native.LARGE_STORES)."""
    n_head, n_kv, hd, rotary_dim, P, count = LARGE_STORES[shape]
    check_attend_against_cpu(n_head, n_kv, hd, rotary_dim, P, count, path, seed=P + n_head, k_type=k_type,
                             v_type=v_type)


# ==================================================================================================
# GPU: the store's rows
# ==================================================================================================

@pytest.fixture(scope="module")
def tiny_model():
    spec = tiny_spec()
    return spec, tiny_tensors(spec)


STORE_CONFIGS = {
    "ring": dict(capacity=12, policy="streaming", sinks=4),                          # ring writes
    "staged": dict(capacity=12, policy="streaming", sinks=4, lazy=4, slack=2, max_drop=3,
                   positions="original"),                                            # policy layer: slot moves
}


def held(store_layer: dict, h: int) -> tuple[np.ndarray, np.ndarray]:
    """(slots, seqs) held by kv head h of a read_layer dict, in slot order."""
    slots = np.flatnonzero(store_layer["seq"][h] >= 0)
    return slots, store_layer["seq"][h][slots]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("config", list(STORE_CONFIGS))
@pytest.mark.parametrize("k_type,v_type", TYPE_PAIRS)
def test_layer0_rows_are_the_codec_of_the_f32_rows(tiny_model, config, k_type, v_type):
    """Layer 0's keys and values do not depend on the store: a typed store must hold exactly
    kv_codec.encode of what the f32 store holds, slot for slot, after writes, evictions and moves."""
    spec, tensors = tiny_model
    eng = CUDAEngine(spec, tensors, n_batch=16)
    ids = np.random.default_rng(1).integers(0, spec.n_vocab, 60)
    plain = eng.new_store(KVConfig(**STORE_CONFIGS[config]))
    typed = eng.new_store(KVConfig(**STORE_CONFIGS[config], k_type=k_type, v_type=v_type))
    eng.logits(ids, plain)
    eng.logits(ids, typed)
    a, b = plain.read_layer(0), typed.read_layer(0)
    assert b["k"].dtype == STORE_DTYPE[k_type] and b["k"].shape[2] == row_width(k_type, spec.head_dim)
    assert b["v"].dtype == STORE_DTYPE[v_type] and b["v"].shape[2] == row_width(v_type, spec.head_dim)
    np.testing.assert_array_equal(a["seq"], b["seq"])
    assert typed.stats()["evicted_total"] == plain.stats()["evicted_total"] > 0
    for h in range(spec.n_head_kv):
        slots, _ = held(a, h)
        np.testing.assert_array_equal(b["k"][h, slots], kv_codec.encode(a["k"][h, slots], k_type))
        np.testing.assert_array_equal(b["v"][h, slots], kv_codec.encode(a["v"][h, slots], v_type))
    hd, P = spec.head_dim, typed.layer_physical
    want_bytes = sum(spec.n_head_kv * p * (row_bytes(k_type, hd) + row_bytes(v_type, hd) + 29) + spec.n_head_kv * 12
                     for p in P)
    assert typed.device_bytes() == want_bytes


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("k_type", ["f16", "q8_0"])
def test_knorm_scores_the_key_as_held(tiny_model, k_type):
    """knorm's score is the 1/256-octave grid of the held (decoded) key's norm, as the CPU store's."""
    spec, tensors = tiny_model
    eng = CUDAEngine(spec, tensors, n_batch=16)
    st = eng.new_store(KVConfig(capacity=12, policy="knorm", sinks=2, k_type=k_type))
    eng.logits(np.random.default_rng(2).integers(0, spec.n_vocab, 40), st)
    agree = total = 0
    for il in range(spec.n_layer):
        lay = st.read_layer(il)
        for h in range(spec.n_head_kv):
            slots, _ = held(lay, h)
            vals = kv_codec.decode(lay["k"][h, slots], spec.head_dim).astype(np.float64)
            want = np.floor(256.0 * np.log2(np.sqrt((vals * vals).sum(1)) + 1e-30) + 0.5)
            agree += int((lay["score"][h, slots] == want).sum())
            total += slots.size
    assert agree >= 0.98 * total          # log2 / summation order may move a value sitting on a grid line


# ==================================================================================================
# GPU: logits against CPUEngine with the same KV types
# ==================================================================================================

def check_close_to_cpu(got, want, want_f32, what, factor=1.0, mse_factor=0.5, argmax=0.95):
    """got (device) nearer want (CPU, same KV types) than want is to want_f32 (CPU, f32 store): max
    |got - want| <= 1e-3 + factor * max |want - want_f32|, normalized MSE <= mse_factor times want's
    from want_f32 (None: unchecked), argmax agreement >= argmax."""
    effect, err = float(np.abs(want - want_f32).max()), float(np.abs(got - want).max())
    assert err <= 1e-3 + factor * effect, (what, err, effect)
    if mse_factor is not None:
        e, eff = nmse(got, want), nmse(want, want_f32)
        assert e <= 1e-9 + mse_factor * eff, (what, e, eff)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= argmax, what


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("config", list(STORE_CONFIGS))
@pytest.mark.parametrize("k_type,v_type", TYPE_PAIRS)
def test_logits_match_cpu_engine_of_the_same_type(tiny_model, config, k_type, v_type):
    from ringllm.runtime.engine import CPUEngine

    spec, tensors = tiny_model
    ids = np.random.default_rng(3).integers(0, spec.n_vocab, 50)
    kv, kv32 = KVConfig(**STORE_CONFIGS[config], k_type=k_type, v_type=v_type), KVConfig(**STORE_CONFIGS[config])
    fused = CPUEngine(spec, tensors, n_batch=16, rope="fused")
    default = CPUEngine(spec, tensors, n_batch=16)
    eng = CUDAEngine(spec, tensors, n_batch=16)
    gs, cs = eng.new_store(kv), fused.new_store(kv)
    cs32 = fused.new_store(kv32)
    got, want, want_f32 = eng.logits(ids, gs), fused.logits(ids, cs), fused.logits(ids, cs32)
    check_close_to_cpu(got, want, want_f32, ("prefill", k_type, v_type))
    check_close_to_cpu(got, default.logits(ids, default.new_store(kv)), want_f32, ("default layout", k_type, v_type),
                       factor=2.5, mse_factor=None, argmax=0.9)
    steps = {"got": [], "want": [], "f32": []}
    tok = 7
    for _ in range(20):                                       # decode steps through eviction
        steps["got"].append(eng.step(tok, gs).copy())
        steps["want"].append(fused.step(tok, cs).copy())
        steps["f32"].append(fused.step(tok, cs32).copy())
        tok = (tok * 31 + 5) % spec.n_vocab
    check_close_to_cpu(*(np.array(steps[k]) for k in ("got", "want", "f32")), ("decode", k_type, v_type))
    assert gs.stats()["evicted_total"] == cs.stats()["evicted_total"] > 0


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    from ringllm.models.loader import load_model

    return load_model(smollm2_path)


@gpu
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("k_type,v_type", [("f16", "f16"), ("q8_0", "q8_0")])
def test_smollm2_logits_match_cpu_engine_of_the_same_type(smollm2, k_type, v_type):
    from conftest import novel_text

    from ringllm.runtime.engine import CPUEngine

    ids = smollm2.tokenizer.encode(novel_text()[:20_000])[:100]
    cfg = dict(capacity=48, policy="streaming", sinks=4)
    cpu = CPUEngine(smollm2.spec, smollm2.tensors, n_batch=32, rope="fused")
    eng = CUDAEngine(smollm2.spec, smollm2.tensors, n_batch=32)
    kv = KVConfig(**cfg, k_type=k_type, v_type=v_type)
    got = eng.logits(ids, eng.new_store(kv))
    want = cpu.logits(ids, cpu.new_store(kv))
    want_f32 = cpu.logits(ids, cpu.new_store(KVConfig(**cfg)))
    check_close_to_cpu(got, want, want_f32, ("smollm2", k_type, v_type))
