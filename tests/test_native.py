"""The CUDA backend (ringllm.native): build, import, errors everywhere; numerics where a GPU exists.

On every machine (CI included):
  * the header is plain C that cffi parses as is; every function it declares is in the cffi module
    and exported by libringllm_cuda.so; the library was built (sm_80, sm_90, PTX) when nvcc exists;
  * the no-CUDA build (src/stub.c) compiles and answers RL_ERR_NO_CUDA with a clear message;
  * importing ringllm and running the CPU path never imports ringllm.native;
  * backend construction without a device raises DeviceError (a RingLLMError) naming the problem;
  * the wrapper rejects bad arrays/options with ConfigError before any device call.

With a GPU (marker `gpu`, skipped otherwise): every kernel against its CPU/NumPy oracle (dequant
bit-exact, the rest by normalized MSE; both attention kernels, single-block and split-K, at 40 slots
and at 1,000 and 4,096), whole-model logits against CPUEngine (max abs 1e-3), chunked prefill
(prefill_mode "chunk", native/src/prefill.cu) against CPUEngine and against token by token, and
1,000 greedy tokens at capacity 64 identical to CPUEngine for each device policy, with the same
survivors in the store.
"""
from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import ringllm.native as native
from ringllm.native import CUDAEngine, DeviceError, kernels
from ringllm.runtime.errors import ConfigError, RingLLMError
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.model_spec import ModelSpec
from ringllm.runtime.qtensor import QTensor
from ringllm.runtime.quant_types import GGMLType

NATIVE_DIR = os.path.dirname(native.__file__)
HAS_GPU = native.device_count() > 0
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU and driver")

ALL_TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1,
             GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]


def header_text() -> str:
    with open(native.HEADER, encoding="utf-8") as fh:
        return fh.read()


def header_functions() -> list[str]:
    """Names of the functions the header declares."""
    text = re.sub(r"/\*.*?\*/", "", header_text(), flags=re.S)
    return sorted(set(re.findall(r"\b(rl_\w+)\s*\(", text)))


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    """Normalized MSE, as llama.cpp's test-backend-ops: sum (a - b)^2 / sum b^2."""
    want = np.asarray(want, np.float64)
    return float(np.sum((np.asarray(got, np.float64) - want) ** 2) / max(np.sum(want ** 2), 1e-30))


def load_build_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ringllm_build_cuda_test", os.path.join(NATIVE_DIR, "build_cuda.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_spec(**kw) -> ModelSpec:
    args = dict(arch="llama", n_vocab=64, n_embd=32, n_layer=2, n_head=4, n_head_kv=2, head_dim=8, n_ff=64, n_ctx=128)
    args.update(kw)
    return ModelSpec(**args)


def tiny_tensors(spec: ModelSpec, seed: int = 0) -> dict[str, QTensor]:
    """Random F32 tensors of every expected shape."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in spec.expected_shapes().items():
        vals = rng.standard_normal(shape).astype(np.float32) * (0.3 if len(shape) == 2 else 1.0)
        if len(shape) == 1:
            vals = 1.0 + 0.1 * vals
        data = vals.view(np.uint8).reshape(shape[0], -1) if len(shape) == 2 else vals.view(np.uint8)
        out[name] = QTensor(name, GGMLType.F32, shape, data)
    return out


# ==================================================================================================
# Every machine: build, import, exports
# ==================================================================================================

def test_header_is_plain_c_for_cffi():
    from cffi import FFI

    text = header_text()
    assert not re.search(r"^\s*#\s*include", text, flags=re.M)
    FFI().cdef(text)      # parses as is
    assert len(header_functions()) >= 25


def test_cffi_module_imports_and_exports_every_function():
    from ringllm.native import _ringllm_cuda as mod

    missing = [f for f in header_functions() if not hasattr(mod.lib, f)]
    assert not missing, f"functions of the header missing from the cffi module: {missing}"
    assert mod.lib.RL_ERR_NO_DEVICE == native.RL_ERR_NO_DEVICE
    for name, code in native.DEVICE_POLICIES.items():
        assert getattr(mod.lib, f"RL_POLICY_{name.upper()}") == code, name


def test_every_cpu_policy_has_a_device_code():
    from ringllm.runtime.policies import REGISTRY

    assert set(native.DEVICE_POLICIES) == set(REGISTRY)


def test_cuda_library_compiled_and_linked_when_nvcc_exists():
    build = load_build_module()
    if build.find_nvcc() is None:
        assert not native.has_cuda()
        assert "without CUDA" in native.build_info()
        pytest.skip("nvcc not found: the module was built without CUDA (checked)")
    assert native.has_cuda(), "nvcc exists but the native module was built without CUDA"
    info = native.build_info()
    assert "sm_80" in info and "sm_90" in info and "PTX compute_90" in info, info
    path = native.library_path()
    assert path is not None and os.path.isfile(path)
    lib = ctypes.CDLL(path)          # loads without a driver: the CUDA runtime is static
    missing = [f for f in header_functions() if not hasattr(lib, f)]
    assert not missing, f"not exported by {path}: {missing}"
    # the cffi module resolves the library next to itself (rpath $ORIGIN)
    mod_file = [f for f in os.listdir(NATIVE_DIR) if f.startswith("_ringllm_cuda") and f.endswith(".so")]
    assert mod_file
    cuobjdump = os.path.join(os.path.dirname(build.find_nvcc()), "cuobjdump")
    if os.path.exists(cuobjdump):
        listing = subprocess.run([cuobjdump, "--list-elf", "--list-ptx", path], capture_output=True, text=True).stdout
        assert "sm_80" in listing and "sm_90" in listing and ".ptx" in listing, listing


def test_stub_build_reports_built_without_cuda(tmp_path):
    """The no-nvcc build: the same header compiled with src/stub.c."""
    from cffi import FFI

    ffi = FFI()
    ffi.cdef(header_text())
    ffi.set_source("_ringllm_stub_probe", '#include <stddef.h>\n#include <stdint.h>\n#include "ringllm_cuda.h"\n',
                   sources=[os.path.join(NATIVE_DIR, "src", "stub.c")], include_dirs=[os.path.join(NATIVE_DIR, "include")])
    so = ffi.compile(tmpdir=str(tmp_path), verbose=False)
    code = ("import sys, importlib.util as u\n"
            f"s = u.spec_from_file_location('_ringllm_stub_probe', {so!r}); m = u.module_from_spec(s); s.loader.exec_module(m)\n"
            "lib, ffi = m.lib, m.ffi\n"
            "out = ffi.new('rl_model **'); p = ffi.new('rl_model_params *')\n"
            "assert lib.rl_has_cuda() == 0\n"
            "assert lib.rl_model_init(out, p) == lib.RL_ERR_NO_CUDA\n"
            "print(ffi.string(lib.rl_last_error()).decode())\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "built without CUDA" in res.stdout and "nvcc" in res.stdout


@pytest.fixture(scope="module")
def dequant_check(tmp_path_factory):
    """tests/native_dequant_check.cpp built with the host's C++ compiler: dequant.cuh's decoding as
    plain C++ (no FMA contraction, as the device code's explicit roundings)."""
    import shutil

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        pytest.skip("no C++ compiler")
    here = os.path.dirname(__file__)
    exe = str(tmp_path_factory.mktemp("dq") / "native_dequant_check")
    subprocess.run([cxx, "-std=c++17", "-O2", "-ffp-contract=off", "-Wall", "-Wno-unknown-pragmas",
                    "-I", os.path.join(here, "..", "native", "include"), "-I", os.path.join(here, "..", "native", "src"),
                    os.path.join(here, "native_dequant_check.cpp"), "-o", exe], check=True)
    return exe


@pytest.mark.parametrize("walk", ["rows", "lanes"])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_device_block_decoding_is_bit_exact_on_the_host(qtype, walk, dequant_check, random_tensor, tmp_path):
    """The decoding the GPU's kernels use (dequant.cuh: word masks, byte permutes, the exponent
    trick for small integers) gives runtime/dequant.py's bits for every type, checked on the CPU,
    both as the dequant kernel reads a row and as a decode matvec's lanes walk it. Rows of
    2-byte-aligned types start at every even offset; special f16 and bf16 values included."""
    from ringllm.runtime.dequant import dequantize

    rng = np.random.default_rng(100 + int(qtype))
    # several 256-value steps per lane, and a partial last step; floats: a tail of 5
    n_cols = (1024 if qtype in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)
              else 709 if qtype in (GGMLType.F32, GGMLType.F16, GGMLType.BF16) else 736)
    t = random_tensor(qtype, 9, n_cols, rng)
    data = np.ascontiguousarray(t.data)
    if qtype in (GGMLType.F16, GGMLType.BF16):   # infinities, NaN, signed zeros, subnormals
        special = np.array([0x7C00, 0xFC00, 0x7E00, 0x8000, 0x0001, 0x83FF, 0x7F80, 0xFF80, 0x7FC0, 0x0080],
                           np.uint16).view(np.uint8)
        data = data.copy()
        data[0, :special.size] = special
    src, out = tmp_path / "in.bin", tmp_path / "out.bin"
    data.tofile(src)
    subprocess.run([dequant_check, str(int(qtype)), "9", str(n_cols), str(data.shape[1]), str(src), str(out), walk],
                   check=True)
    got = np.fromfile(out, np.float32).reshape(9, n_cols)
    want = np.ascontiguousarray(dequantize(data, qtype, (9, n_cols)), np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_cpu_path_never_imports_native():
    code = ("import sys, numpy as np\n"
            "import ringllm\n"
            "from ringllm.runtime.engine import CPUEngine\n"
            "from ringllm.models.loader import load_model\n"
            "bad = sorted(m for m in sys.modules if m.startswith('ringllm.native'))\n"
            "assert not bad, bad\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_c_api_rejects_null_arguments_without_touching_a_device():
    from ringllm.native import _ringllm_cuda as mod

    lib, ffi = mod.lib, mod.ffi
    assert lib.rl_model_init(ffi.NULL, ffi.NULL) == lib.RL_ERR_ARG
    assert "NULL" in ffi.string(lib.rl_last_error()).decode()
    assert lib.rl_model_free(ffi.NULL) == lib.RL_OK
    assert lib.rl_store_free(ffi.NULL) == lib.RL_OK
    assert lib.rl_build_info(ffi.NULL, 0) == lib.RL_ERR_ARG


def test_attend_paths_match_the_header():
    from ringllm.native import _ringllm_cuda as mod
    from ringllm.native.cuda_lib import ATTEND_PATHS, ATTEND_SPLIT_MIN_P

    lib = mod.lib
    assert ATTEND_PATHS == {"auto": lib.RL_ATTEND_AUTO, "single": lib.RL_ATTEND_SINGLE, "split": lib.RL_ATTEND_SPLIT}
    assert ATTEND_SPLIT_MIN_P == lib.RL_ATTEND_SPLIT_MIN_P


def test_c_api_refuses_attend_paths_it_cannot_run_before_any_device():
    if not native.has_cuda():
        pytest.skip("built without CUDA: every call answers RL_ERR_NO_CUDA")
    from ringllm.native import _ringllm_cuda as mod

    lib, ffi = mod.lib, mod.ffi
    n_head, n_kv, P = 2, 1, 3

    def call(hd, path):
        q, out, w = ffi.new("float[]", n_head * hd), ffi.new("float[]", n_head * hd), ffi.new("float[]", n_head * P)
        k = ffi.new("float[]", n_kv * P * hd)
        pos, count = ffi.new("int32_t[]", n_kv * P), ffi.new("int32_t[]", [1])
        return lib.rl_kernel_attend(0, q, k, k, lib.RL_TYPE_F32, lib.RL_TYPE_F32, pos, count, n_head, n_kv, P, hd,
                                    hd, 10000.0, 1.0, 0.1, 0, path, out, w)

    assert call(32, 3) == lib.RL_ERR_ARG
    assert "path" in ffi.string(lib.rl_last_error()).decode()
    assert call(512, lib.RL_ATTEND_SPLIT) == lib.RL_ERR_ARG          # head_dim past a thread per dim
    assert "split-K" in ffi.string(lib.rl_last_error()).decode()


def test_prefill_modes_match_the_header_and_unknown_ones_are_refused_before_any_device():
    from ringllm.native import _ringllm_cuda as mod
    from ringllm.native.cuda_backend import PREFILL_MODES

    lib, ffi = mod.lib, mod.ffi
    assert lib.RL_PREFILL_DEFAULT == 0
    assert PREFILL_MODES == {"chunk": lib.RL_PREFILL_CHUNK, "token": lib.RL_PREFILL_TOKEN}
    if not native.has_cuda():
        pytest.skip("built without CUDA: every call answers RL_ERR_NO_CUDA")
    p = ffi.new("rl_model_params *")
    for name in ("n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "head_dim", "n_ff", "n_batch"):
        setattr(p, name, 1)
    p.prefill_mode = 3
    assert lib.rl_model_init(ffi.new("rl_model **"), p) == lib.RL_ERR_ARG
    assert "prefill_mode" in ffi.string(lib.rl_last_error()).decode()


# ==================================================================================================
# Every machine: errors
# ==================================================================================================

@pytest.mark.skipif(HAS_GPU, reason="a GPU is present")
def test_no_device_gives_a_clear_error():
    spec = tiny_spec()
    with pytest.raises(DeviceError) as exc:
        CUDAEngine(spec, tiny_tensors(spec))
    assert isinstance(exc.value, RingLLMError)
    msg = str(exc.value)
    if native.has_cuda():
        assert "no CUDA device/driver found" in msg
        assert "cuda" in msg.lower() and "failed:" in msg      # the CUDA error text is included
    else:
        assert "built without CUDA" in msg
    assert native.device_count() == 0 and not native.available()


def test_wrapper_checks_arguments_before_any_device_call():
    spec = tiny_spec()
    tensors = tiny_tensors(spec)
    w = tensors["blk.0.attn_q.weight"]
    with pytest.raises(ConfigError, match="float32"):
        kernels.matmul(w, np.zeros((1, 32), np.float64))
    with pytest.raises(ConfigError, match="shape"):
        kernels.matmul(w, np.zeros((1, 31), np.float32))
    with pytest.raises(ConfigError, match="QTensor"):
        kernels.dequant(np.zeros((4, 4), np.uint8))
    bad = QTensor("w", GGMLType.Q4_0, (4, 64), np.zeros((4, 10), np.uint8))
    with pytest.raises(ConfigError, match="shape"):
        kernels.dequant(bad)
    with pytest.raises(ConfigError, match="whole"):
        kernels.dequant(QTensor("w", GGMLType.Q4_0, (4, 40), np.zeros((4, 18), np.uint8)))
    with pytest.raises(ConfigError, match="unknown GGML type"):
        kernels.dequant(QTensor("w", 99, (4, 4), np.zeros((4, 16), np.uint8)))
    with pytest.raises(ConfigError, match="count"):
        kernels.attend(np.zeros((4, 8), np.float32), np.zeros((2, 5, 8), np.float32), np.zeros((2, 5, 8), np.float32),
                       np.zeros((2, 5), np.int32), np.array([6, 1]), 0, 8)
    with pytest.raises(ConfigError, match="path"):
        kernels.attend(np.zeros((4, 8), np.float32), np.zeros((2, 5, 8), np.float32), np.zeros((2, 5, 8), np.float32),
                       np.zeros((2, 5), np.int32), np.array([1, 1]), 0, 8, path="fast")
    with pytest.raises(ConfigError, match="shape"):
        kernels.attend(np.zeros((4, 8), np.float32), np.zeros((2, 5, 8), np.float32), np.zeros((2, 4, 8), np.float32),
                       np.zeros((2, 5), np.int32), np.array([1, 1]), 0, 8)
    with pytest.raises(ConfigError, match="top_p"):
        kernels.pick(np.zeros(8, np.float32), temperature=1.0, top_p=0.0)
    with pytest.raises(ConfigError, match="float32"):
        kernels.norm("rms", np.zeros((2, 4), np.float16), np.ones(4, np.float32))
    with pytest.raises(ConfigError, match="ids"):
        kernels.embed(w, [0, 10_000])
    with pytest.raises(ConfigError, match="n_batch"):
        CUDAEngine(spec, tensors, n_batch=0)
    with pytest.raises(ConfigError, match="n_threads"):
        CUDAEngine(spec, tensors, n_threads=0)
    with pytest.raises(ConfigError, match="prefill_mode"):
        CUDAEngine(spec, tensors, prefill_mode="fast")
    with pytest.raises(ConfigError, match="missing"):
        CUDAEngine(spec, {k: v for k, v in tensors.items() if k != "blk.1.ffn_up.weight"})
    wrong = dict(tensors)
    wrong["blk.0.attn_k.weight"] = tensors["blk.0.attn_q.weight"]
    with pytest.raises(ConfigError, match="attn_k"):
        CUDAEngine(spec, wrong)


# ==================================================================================================
# GPU: kernels against their oracles
# ==================================================================================================

@pytest.fixture(scope="module")
def random_tensor():
    from test_matvec import random_tensor as make

    return make


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_dequant_bit_exact(qtype, random_tensor):
    from ringllm.runtime.dequant import dequantize

    rng = np.random.default_rng(int(qtype))
    n_cols = 512 if qtype in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K) else 96
    t = random_tensor(qtype, 7, n_cols, rng)
    got = kernels.dequant(t)
    want = dequantize(t.data, t.qtype, t.shape)
    assert np.array_equal(got.view(np.uint32), np.ascontiguousarray(want, np.float32).view(np.uint32))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("length", ["short", "long"])
def test_matmul_against_dequantized_oracle(qtype, T, length, random_tensor):
    """Short rows take fewer steps than the decode loop unrolls; long ones (9 or 5 warp steps and a
    partial one) take the unrolled body and its remainder, some types' rows starting 2-byte aligned only."""
    from ringllm.runtime.dequant import dequantize

    rng = np.random.default_rng(10 + int(qtype) + T)
    k_quant = qtype in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)
    n_cols = (2304 if k_quant else 1312) if length == "long" else (768 if k_quant else 160)
    t = random_tensor(qtype, 37, n_cols, rng)
    x = rng.standard_normal((T, n_cols)).astype(np.float32)
    want = x.astype(np.float64) @ dequantize(t.data, t.qtype, t.shape).astype(np.float64).T
    assert nmse(kernels.matmul(t, x), want) < 1e-10


@gpu
@pytest.mark.gpu
def test_matmul_odd_float_columns(random_tensor):
    rng = np.random.default_rng(3)
    t = random_tensor(GGMLType.F32, 5, 13, rng)
    x = rng.standard_normal((3, 13)).astype(np.float32)
    W = t.data.view(np.float32).reshape(5, 13)
    assert nmse(kernels.matmul(t, x), x.astype(np.float64) @ W.T) < 1e-10


@gpu
@pytest.mark.gpu
def test_norms_activations_embedding():
    from ringllm.runtime import ops
    from ringllm.runtime.dequant import dequantize_rows

    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 576)).astype(np.float32) * 3
    w = rng.standard_normal(576).astype(np.float32)
    b = rng.standard_normal(576).astype(np.float32)
    want = np.empty_like(x)
    ops.rms_norm_rows(want, x, w, 1e-5)
    assert nmse(kernels.norm("rms", x, w, eps=1e-5), want) < 1e-12
    # the register kernel's shapes (a 128-value head and 100 values: one warp; 4,128 and 8,192: 5 and
    # 8 values per thread at 1,024 threads) and the looping kernel past 8,192
    for n in (128, 100, 1024 * 4 + 32, 8192, 8200):
        xs = rng.standard_normal((3, n)).astype(np.float32)
        ws = rng.standard_normal(n).astype(np.float32)
        want_n = np.empty_like(xs)
        ops.rms_norm_rows(want_n, xs, ws, 1e-6)
        assert nmse(kernels.norm("rms", xs, ws, eps=1e-6), want_n) < 1e-12, n
    ops.layer_norm_rows(want, x, w, b, 1e-5)
    assert nmse(kernels.norm("layer", x, w, b, eps=1e-5), want) < 1e-12
    g, u = x[:, :100].copy(), x[:, 100:200].copy()
    for act, code in ops.ACT_CODES.items():
        want = np.empty_like(g)
        ops.gated_act(want, g, u, code)
        assert nmse(kernels.act(act, u, gate=g), want) < 1e-12, act
        want = u.copy()
        ops.act_inplace(want, code)
        assert nmse(kernels.act(act, u), want) < 1e-12, act
    from test_matvec import random_tensor as make
    t = make(GGMLType.Q6_K, 50, 256, rng)
    ids = [3, 0, 49, 3]
    want = dequantize_rows(t.data, t.qtype, 256, np.array(ids)) * np.float32(1.5)
    assert nmse(kernels.embed(t, ids, scale=1.5), want) < 1e-14


def check_attend_against_cpu(n_head: int, n_kv: int, hd: int, rotary_dim: int, P: int, count, path: str, seed: int,
                             k_type: str = "f32", v_type: str = "f32") -> None:
    """kernels.attend(path=...) over rows of k_type / v_type against runtime/attention.attend over
    the values they hold: GQA, permuted slots with arbitrary logical positions (1000 + a permutation
    of 0..P-1), the query at 1060 + P. out by normalized MSE < 1e-10; the attention mass (weights
    summed over each group) to 1e-5; the weights past count untouched (zero)."""
    from ringllm.runtime import kv_codec
    from ringllm.runtime.attention import attend
    from ringllm.runtime.rope import RopeTable

    rng = np.random.default_rng(seed)
    count = np.array(count, np.int64)
    q = rng.standard_normal((n_head, hd)).astype(np.float32)
    k_rows = kv_codec.encode(rng.standard_normal((n_kv, P, hd)).astype(np.float32), k_type)
    v_rows = kv_codec.encode(rng.standard_normal((n_kv, P, hd)).astype(np.float32), v_type)
    k, v = kv_codec.decode(k_rows, hd), kv_codec.decode(v_rows, hd)
    pos = np.stack([rng.permutation(P) + 1000 for _ in range(n_kv)]).astype(np.int64)
    q_pos, scale = 1060 + P, np.float32(hd ** -0.5)
    table = RopeTable(rotary_dim, 10000.0, 2.0, n=q_pos + 100)
    out = np.zeros((n_head, hd), np.float32)
    scores = np.zeros((n_head, P), np.float32)
    mass = np.zeros((n_kv, P), np.float32)
    attend(out, q, k, np.zeros((n_kv, hd), np.float32), np.zeros((n_kv, P), np.int64), v, pos, count,
           np.full(n_kv, q_pos, np.int64), table.cos, table.sin, rotary_dim, scale,
           np.float32(0.0), scores, np.zeros(hd, np.float32), np.zeros((n_head, hd), np.float32), mass)
    got, w = kernels.attend(q, k_rows, v_rows, pos, count, q_pos, rotary_dim, rope_base=10000.0, rope_scale=2.0,
                            path=path)
    assert nmse(got, out) < 1e-10
    group = n_head // n_kv
    for h in range(n_kv):
        n = count[h]
        rows = w[h * group:(h + 1) * group]
        np.testing.assert_allclose(rows[:, :n].sum(0), mass[h, :n], rtol=0, atol=1e-5)
        assert not rows[:, n:].any()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("path", ["auto", "split"])
@pytest.mark.parametrize("rotary_dim", [64, 16])
def test_attention_step_against_cpu_kernel(rotary_dim, path):
    """GQA, permuted slots with arbitrary logical positions, partial rotary, unequal head counts.
    At 40 slots "auto" is the single-block kernel (the engine's at small capacities); "split" forces
    the split-K kernel (one split per kv head) and its merge."""
    check_attend_against_cpu(9, 3, 64, rotary_dim, 40, [40, 17, 1], path, seed=rotary_dim)


# (n_head, n_kv, head_dim, rotary_dim, P, count): stores past RL_ATTEND_SPLIT_MIN_P, where the forward
# pass takes the split-K kernel (64 slots per block): the head shapes of SmolLM2 (9/3, 64),
# Gemma 3 270M (4/1, 256: a thread per value dim) and Qwen3-1.7B (16/8, 128); counts that end
# inside, at and just past a split, and one-slot heads
LARGE_STORES = {
    "smollm2_1000": (9, 3, 64, 64, 1000, [1000, 517, 1]),
    "smollm2_1000_partial_rotary": (9, 3, 64, 16, 1000, [999, 64, 65]),
    "smollm2_4096": (9, 3, 64, 64, 4096, [4096, 4095, 2048]),
    "gemma3_4096": (4, 1, 256, 256, 4096, [4096]),
    "qwen3_4096": (16, 8, 128, 128, 4096, [4096, 1, 63, 64, 65, 3000, 4000, 129]),
    "group12_hd80": (12, 1, 80, 32, 1000, [777]),     # more heads than ATT_GCHUNK, hd not a multiple of 32
}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("path", ["single", "split"])
@pytest.mark.parametrize("shape", list(LARGE_STORES))
def test_attention_step_large_stores_against_cpu_kernel(shape, path):
    """Both attention kernels (path forced) against the CPU's at up to 4096 slots."""
    n_head, n_kv, hd, rotary_dim, P, count = LARGE_STORES[shape]
    check_attend_against_cpu(n_head, n_kv, hd, rotary_dim, P, count, path, seed=P + n_head)


@gpu
@pytest.mark.gpu
def test_pick_known_answers():
    logits = np.log(np.array([0.1, 0.5, 0.1, 0.3], np.float32))
    assert kernels.pick(logits) == 1                                    # greedy
    assert kernels.pick(np.array([1.0, 3.0, 3.0, 2.0], np.float32)) == 1   # ties -> first
    assert kernels.pick(logits, temperature=1.0, top_k=1, u=0.9) == 1   # top_k 1 == greedy
    assert kernels.pick(logits, temperature=1.0, u=0.0) == 0             # inverse CDF in index order
    assert kernels.pick(logits, temperature=1.0, u=0.55) == 1            # cdf 0.1, 0.6, 0.7, 1.0
    assert kernels.pick(logits, temperature=1.0, u=0.65) == 2
    assert kernels.pick(logits, temperature=1.0, u=0.75) == 3
    assert kernels.pick(logits, temperature=1.0, u=0.99) == 3
    assert kernels.pick(logits, temperature=1.0, top_p=0.7, u=0.99) == 3  # keeps {0.5, 0.3}: cdf 0.5/.8, 1
    assert kernels.pick(logits, temperature=1.0, top_p=0.7, u=0.5) == 1
    assert kernels.pick(logits, temperature=1.0, top_k=2, u=0.7) == 3
    # greedy over a real vocabulary (16-byte loads) and an odd one (one value per load): of tied
    # maxima in different threads' parts, the first
    rng = np.random.default_rng(1)
    for n in (151_936, 5003):
        row = rng.standard_normal(n).astype(np.float32)
        row[[n - 7, 40_001, 9] if n > 40_001 else [n - 7, 4001, 9]] = 9.0
        assert kernels.pick(row) == 9
        row[9] = 0.0
        assert kernels.pick(row) == (40_001 if n > 40_001 else 4001)
    # frequencies over a grid of u follow the softmax
    rng = np.random.default_rng(0)
    big = rng.standard_normal(5000).astype(np.float32) * 2
    p = np.exp(big.astype(np.float64) / 0.8)
    p /= p.sum()
    us = (np.arange(400) + 0.5) / 400
    toks = [kernels.pick(big, temperature=0.8, u=float(u)) for u in us]
    cdf = np.cumsum(p)
    want = [int(np.searchsorted(cdf, u, side="right")) for u in us]
    assert np.mean(np.array(toks) == np.array(want)) > 0.97


# ==================================================================================================
# GPU: whole model against CPUEngine
# ==================================================================================================

@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    from ringllm.models.loader import load_model

    return load_model(smollm2_path)


def prompt_ids(loaded, n: int) -> list[int]:
    from conftest import novel_text

    return loaded.tokenizer.encode(novel_text()[:20_000])[:n]


@gpu
@pytest.mark.gpu
def test_smollm2_logits_match_cpu(smollm2):
    from ringllm.runtime.engine import CPUEngine

    ids = prompt_ids(smollm2, 100)
    cpu = CPUEngine(smollm2.spec, smollm2.tensors, n_batch=32)
    gpu_eng = CUDAEngine(smollm2.spec, smollm2.tensors, n_batch=32)
    for kv in (KVConfig(capacity=None, policy="full"), KVConfig(capacity=48, policy="streaming", sinks=4),
               KVConfig(capacity=48, policy="streaming", sinks=4, positions="original")):
        want = cpu.logits(ids, cpu.new_store(kv))
        got = gpu_eng.logits(ids, gpu_eng.new_store(kv))
        assert np.abs(got - want).max() <= 1e-3, kv
        assert (got.argmax(1) == want.argmax(1)).mean() > 0.99


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3", "gptneox"])
def tiny(request, tmp_path_factory):
    pytest.importorskip("transformers")
    from tiny_checkpoints import build_tiny

    from ringllm.models.loader import load_model

    d = str(tmp_path_factory.mktemp(request.param))
    build_tiny(request.param, d)
    return load_model(d, tokenizer=False)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("positions", ["reindexed", "original"])
def test_tiny_architectures_match_cpu(tiny, positions):
    """All four architectures (norm kinds, qk norm, sandwich norms, parallel residual, partial
    rotary, sliding windows, softcap-free and tied outputs), chunked prefill through eviction."""
    from ringllm.runtime.engine import CPUEngine

    ids = np.random.default_rng(0).integers(0, 256, 50)
    kv = KVConfig(capacity=12, policy="streaming", sinks=4, positions=positions)
    cpu = CPUEngine(tiny.spec, tiny.tensors, n_batch=16)
    gpu_eng = CUDAEngine(tiny.spec, tiny.tensors, n_batch=16)
    cs, gs = cpu.new_store(kv), gpu_eng.new_store(kv)
    np.testing.assert_allclose(gpu_eng.logits(ids, gs), cpu.logits(ids, cs), rtol=0, atol=1e-3)
    tok = 7
    for _ in range(20):
        np.testing.assert_allclose(gpu_eng.step(tok, gs), cpu.step(tok, cs), rtol=0, atol=1e-3)
        tok = (tok * 31 + 5) % 256
    assert gs.stats()["evicted_total"] == cs.stats()["evicted_total"] > 0


def assert_fused_matches_unfused(spec: ModelSpec, tensors: dict, kv: KVConfig, ids, n_batch: int,
                                 steps: int = 20) -> None:
    """CUDAEngine(fused=True) (grouped q/k/v, the FFN activation, biases and residual adds in the
    matmuls' epilogues) against fused=False (one launch per operation): bit-identical logits of a
    chunked prefill (every row), then of `steps` graph-replayed decode steps fed their greedy token."""
    engines = [CUDAEngine(spec, tensors, n_batch=n_batch, cuda_graph=True, fused=f) for f in (True, False)]
    stores = [e.new_store(kv) for e in engines]
    fused, plain = (e.logits(ids, s) for e, s in zip(engines, stores))
    assert np.array_equal(fused, plain), f"prefill: max |diff| {np.abs(fused - plain).max()}"
    tok = int(np.argmax(fused[-1]))
    for i in range(steps):
        (t_f, l_f), (t_p, l_p) = ((t, l.copy()) for t, l in (e.decode(tok, s, want_logits=True)
                                                             for e, s in zip(engines, stores)))
        assert np.array_equal(l_f, l_p) and t_f == t_p, f"decode step {i}: max |diff| {np.abs(l_f - l_p).max()}"
        tok = t_f


@gpu
@pytest.mark.gpu
def test_fused_launches_bit_identical_tiny(tiny):
    """llama (plain), qwen2 (q/k/v biases), gemma3 (qk and sandwich norms: residual adds stay
    unfused), gptneox (parallel residual, non-gated FFN, biases everywhere); then with q/k/v and
    gate/up in different GGML types (the grouped kernel that switches type per part)."""
    from test_matvec import random_tensor

    ids = np.random.default_rng(0).integers(0, 256, 50)
    kv = KVConfig(capacity=12, policy="streaming", sinks=4)
    assert_fused_matches_unfused(tiny.spec, tiny.tensors, kv, ids, n_batch=16)
    rng = np.random.default_rng(1)
    mixed = dict(tiny.tensors)
    roles = {"attn_q": GGMLType.Q8_0, "attn_k": GGMLType.Q4_1, "attn_v": GGMLType.F16, "ffn_gate": GGMLType.Q5_0,
             "ffn_up": GGMLType.Q8_0}
    for il in range(tiny.spec.n_layer):
        for role, qtype in roles.items():
            name = f"blk.{il}.{role}.weight"
            if name in mixed:
                mixed[name] = random_tensor(qtype, *mixed[name].shape, rng)
    assert_fused_matches_unfused(tiny.spec, mixed, kv, ids, n_batch=16)


@gpu
@pytest.mark.gpu
def test_fused_launches_bit_identical_smollm2(smollm2):
    """SmolLM2 (llama, gated SiLU, Q4_1 / Q8_0): prefill through h2o eviction, then decode steps."""
    kv = KVConfig(capacity=64, policy="h2o", sinks=4)
    assert_fused_matches_unfused(smollm2.spec, smollm2.tensors, kv, prompt_ids(smollm2, 100), n_batch=32)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("positions", ["reindexed", "original"])
def test_smollm2_chunked_prefill_matches_cpu(smollm2, positions):
    """Chunk mode (native/src/prefill.cu) on a 700-token prompt in chunks of 96: every row's logits
    within 1e-3 of the CPU engine, then 20 greedy decode steps (a CUDA graph, token by token) giving
    the CPU's tokens. Policy full takes every chunk in chunk mode; streaming at capacity 512 takes
    the chunks up to token 480 in chunk mode, then the chunk 480..575, which crosses C (eviction
    starts inside it), and the rest token by token."""
    from ringllm.runtime.engine import CPUEngine

    ids = prompt_ids(smollm2, 700)
    assert len(ids) == 700
    cpu = CPUEngine(smollm2.spec, smollm2.tensors, n_batch=96)
    eng = CUDAEngine(smollm2.spec, smollm2.tensors, n_batch=96, cuda_graph=True, prefill_mode="chunk")
    for kv in (KVConfig(capacity=None, policy="full", positions=positions),
               KVConfig(capacity=512, policy="streaming", sinks=4, positions=positions)):
        cs, gs = cpu.new_store(kv), eng.new_store(kv)
        want = cpu.logits(ids, cs)
        got = eng.logits(ids, gs)
        err = float(np.abs(got - want).max())
        assert err <= 1e-3, (kv.policy, positions, err)
        want_tok, got_tok = [int(np.argmax(want[-1]))], [int(np.argmax(got[-1]))]
        for _ in range(20):
            want_tok.append(int(np.argmax(cpu.step(want_tok[-1], cs))))
            got_tok.append(eng.decode(got_tok[-1], gs))
        assert got_tok == want_tok, (kv.policy, positions)
        assert gs.stats()["evicted_total"] == cs.stats()["evicted_total"]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n_batch", [16, 4])
@pytest.mark.parametrize("positions", ["reindexed", "original"])
def test_tiny_architectures_chunked_prefill_match_cpu(tiny, positions, n_batch):
    """Chunk mode on the four tiny architectures against the CPU engine (logits within 1e-3, then
    decode steps): policy full (every chunk in chunk mode on the global layers; gemma3's 8-token
    sliding-window layers only while a chunk ends within the first 8 tokens, i.e. with n_batch 4)
    and streaming at capacity 40 (the chunk that crosses C token by token)."""
    from ringllm.runtime.engine import CPUEngine

    ids = np.random.default_rng(1).integers(0, 256, 60)
    cpu = CPUEngine(tiny.spec, tiny.tensors, n_batch=n_batch)
    eng = CUDAEngine(tiny.spec, tiny.tensors, n_batch=n_batch, prefill_mode="chunk")
    for kv in (KVConfig(capacity=None, policy="full", positions=positions),
               KVConfig(capacity=40, policy="streaming", sinks=4, positions=positions)):
        cs, gs = cpu.new_store(kv), eng.new_store(kv)
        np.testing.assert_allclose(eng.logits(ids, gs), cpu.logits(ids, cs), rtol=0, atol=1e-3, err_msg=kv.policy)
        tok = 7
        for _ in range(10):
            np.testing.assert_allclose(eng.step(tok, gs), cpu.step(tok, cs), rtol=0, atol=1e-3, err_msg=kv.policy)
            tok = (tok * 31 + 5) % 256
        assert gs.stats()["evicted_total"] == cs.stats()["evicted_total"]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [8, 40, 96, 256])
def test_chunked_prefill_head_dims_and_kv_types(head_dim):
    """Chunk mode for each register width of its attention kernel (head_dim up to 32, 64, 128, 256;
    40 leaves lanes idle, 256 needs more than 48 KiB of shared memory), one layer: f32 rows against
    the CPU engine, every row type against token by token on the device (both read the same stored
    rows, so they differ only in summation order), through chunk mode, the chunk that crosses C and
    decode steps. The chunk's writes fill the slots as token by token does: K/V rows bit for bit,
    seq and pos."""
    from ringllm.runtime.engine import CPUEngine

    spec = tiny_spec(head_dim=head_dim, n_layer=1)
    tensors = tiny_tensors(spec, seed=head_dim)
    ids = np.random.default_rng(2).integers(0, spec.n_vocab, 100)
    cpu = CPUEngine(spec, tensors, n_batch=16)
    chunk = CUDAEngine(spec, tensors, n_batch=16, prefill_mode="chunk")
    token = CUDAEngine(spec, tensors, n_batch=16, prefill_mode="token")
    types = [("f32", "f32"), ("f16", "f16")] + ([("q8_0", "q8_0"), ("f16", "q8_0")] if head_dim % 32 == 0 else [])
    for k_type, v_type in types:
        for kv in (KVConfig(capacity=None, policy="full", k_type=k_type, v_type=v_type),
                   KVConfig(capacity=40, policy="streaming", sinks=4, positions="original", k_type=k_type,
                            v_type=v_type)):
            what = (kv.policy, k_type, v_type)
            cs, ts = chunk.new_store(kv), token.new_store(kv)
            got = chunk.logits(ids, cs)
            np.testing.assert_allclose(got, token.logits(ids, ts), rtol=0, atol=1e-4, err_msg=str(what))
            if k_type == v_type == "f32":
                np.testing.assert_allclose(got, cpu.logits(ids, cpu.new_store(kv)), rtol=0, atol=1e-3,
                                           err_msg=str(what))
            a, b = cs.read_layer(0), ts.read_layer(0)
            for name in ("k", "v", "seq", "pos"):
                assert np.array_equal(a[name], b[name]), (what, name)
            for tok in (3, 17, 42):
                np.testing.assert_allclose(chunk.step(tok, cs), token.step(tok, ts), rtol=0, atol=1e-4,
                                           err_msg=str(what))


DEVICE_POLICY_CONFIGS = {
    "streaming": dict(policy="streaming", sinks=4),
    "h2o": dict(policy="h2o", sinks=4),
    "tova": dict(policy="tova", sinks=4),
    "knorm": dict(policy="knorm", sinks=4),
    "lsh": dict(policy="lsh", sinks=4),
    "scissorhands": dict(policy="scissorhands", sinks=4),
    "random": dict(policy="random", sinks=4, seed=3),
    "staged_scissorhands": dict(policy="scissorhands", sinks=4, lazy=4, slack=2, history=16),
    "streaming_shift": dict(policy="streaming", sinks=4, update="shift"),
    "h2o_shift": dict(policy="h2o", sinks=4, update="shift"),
    "staged_knorm_shift": dict(policy="knorm", sinks=4, lazy=4, slack=2, update="shift"),
    "staged": dict(policy="streaming", sinks=4, lazy=8, slack=4, max_drop=6),
    "staged_h2o": dict(policy="h2o", sinks=4, lazy=4, slack=2),
    "snapkv": dict(policy="snapkv", sinks=4),
    "pyramidkv": dict(policy="pyramidkv", sinks=4),
    "rkv": dict(policy="rkv", sinks=4),
    "adakv": dict(policy="adakv", sinks=4),
    "staged_snapkv": dict(policy="snapkv", sinks=4, lazy=4, slack=2, positions="original"),
    "staged_adakv": dict(policy="adakv", sinks=4, lazy=4, slack=2, max_drop=3),
    "staged_rkv_shift": dict(policy="rkv", sinks=4, lazy=4, slack=2, update="shift"),
    "snapkv_shift": dict(policy="snapkv", sinks=4, update="shift"),
    "gvote": dict(policy="gvote", sinks=4),
    "gvote_original": dict(policy="gvote", sinks=4, positions="original", gvote_samples=4),
}


@gpu
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("name", list(DEVICE_POLICY_CONFIGS))
def test_greedy_1000_tokens_match_cpu_per_policy(smollm2, name):
    """The same 1,000 greedy tokens as the CPU engine, the same eviction counts, and the same survivors
    in the first and last layers: exactly for the policies that rank by age (streaming, staged
    streaming) or by integer hash draws (random); for the scored ones up to one swapped pair per head. Their keys (knorm's key norms,
    h2o/tova's attention masses, lsh's codes) come from float32 sums taken in another order on each
    device: knorm (1/256 octave) and h2o/tova (1/4096 octave) compare them on a log grid so that
    rounding-level differences tie, but a value within rounding of a grid boundary lands on either
    side of it, as an lsh code bit whose dot product is within rounding of 0 does; one victim choice
    can then differ without any token changing. The window policies (snapkv, pyramidkv, rkv, adakv)
    keep their window totals as exact integers (fixed point) and compare pooled masses (rkv: its
    scores) on the same grids; pyramidkv's per-layer budgets and adakv's per-head slots are the CPU
    store's (kv_store.layer_layout), and adakv's heads hold different numbers of tokens, compared head
    by head. gvote's votes are integer counts of nuclei whose float64 running masses are summed in the
    CPU's order; a synthetic query's float64 Box-Muller draw (device log/sin/cos against the host's) is
    rounded to float32, so the rare draw that rounds apart moves one vote."""
    from ringllm.runtime.engine import CPUEngine

    kv = KVConfig(capacity=64, **DEVICE_POLICY_CONFIGS[name])
    ids = prompt_ids(smollm2, 40)
    cpu = CPUEngine(smollm2.spec, smollm2.tensors)
    cs = cpu.new_store(kv)
    want = [int(np.argmax(cpu.prefill(ids, cs)))]
    while len(want) < 1000:
        want.append(int(np.argmax(cpu.step(want[-1], cs))))
    gpu_eng = CUDAEngine(smollm2.spec, smollm2.tensors)
    gs = gpu_eng.new_store(kv)
    got = gpu_eng.generate(ids, gs, 1000)
    first_diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert first_diff is None, f"{name}: first differing token at step {first_diff}"
    # 999 tokens fed back on each side; one more, then the same survivors in every head
    gpu_eng.decode(got[-1], gs)
    cpu.step(want[-1], cs)
    exact = kv.policy in ("streaming", "random")     # ranked by age, or by integer draws
    for il in (0, smollm2.spec.n_layer - 1):
        dev = gs.read_layer(il)
        for h in range(smollm2.spec.n_head_kv):
            n = int(cs.count[il][h])
            got_set, want_set = set(dev["seq"][h][dev["seq"][h] >= 0].tolist()), set(cs.seq[il][h, :n].tolist())
            assert len(got_set) == len(want_set) == n, (name, il, h)
            parted = sorted(got_set ^ want_set)
            assert len(parted) <= (0 if exact else 2), (name, il, h, parted)
    assert gs.stats()["evicted_total"] == cs.stats()["evicted_total"]


BATCH_CONFIGS = {
    "streaming": dict(policy="streaming", sinks=4),
    "h2o": dict(policy="h2o", sinks=4),
    "tova": dict(policy="tova", sinks=4, positions="original"),
    "random_staged": dict(policy="random", sinks=4, lazy=4, slack=2, seed=5),
    "streaming_shift": dict(policy="streaming", sinks=4, update="shift"),
    "split_attention": dict(policy="h2o", sinks=4, capacity=300),     # P > 256: the split-K attention path,
                                                                        # evicting (a 320-token prompt)
    "snapkv_staged": dict(policy="snapkv", sinks=4, lazy=4, slack=2, positions="original"),
    "rkv": dict(policy="rkv", sinks=4),
    "adakv": dict(policy="adakv", sinks=4),                             # one layer-wide choice per sequence
    "gvote": dict(policy="gvote", sinks=4),
}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", list(BATCH_CONFIGS))
@pytest.mark.parametrize("graph", [False, True], ids=["plain", "graph"])
def test_batch_decode_matches_each_sequence_alone(smollm2, name, graph):
    """B = 4 sequences at different lengths in one batch store, stepped together by decode_batch,
    give each sequence's logits when it decodes alone in its own store (within 1e-3: the projections
    run as a 4-row product), the same greedy tokens over 60 steps, the same eviction counts per
    sequence; a sequence that leaves and is replaced starts from nothing."""
    kv = KVConfig(**{"capacity": 64, **BATCH_CONFIGS[name]})
    eng = CUDAEngine(smollm2.spec, smollm2.tensors, cuda_graph=graph)
    ids = prompt_ids(smollm2, 400)
    prompts = [ids[:30], ids[40:41], ids[50:370] if kv.capacity > 256 else ids[50:150], ids[380:390]]
    B, nkv = len(prompts), smollm2.spec.n_head_kv
    batch = eng.new_batch_store(B, kv)
    alone = [eng.new_store(kv) for _ in prompts]
    toks = []
    for b, pr in enumerate(prompts):
        want = eng.forward_seq(pr, batch, b).copy()
        np.testing.assert_array_equal(want, eng.prefill(pr, alone[b]))
        toks.append(int(np.argmax(want)))
    for step in range(60):
        got, logits = eng.decode_batch(toks, batch, want_logits=True)
        nxt = []
        for b in range(B):
            tok, want = eng.decode(toks[b], alone[b], want_logits=True)
            assert np.abs(logits[b] - want).max() <= 1e-3, (name, step, b)
            assert got[b] == tok, (name, step, b)
            nxt.append(tok)
        toks = nxt
    held, evicted = batch.counts()
    for b in range(B):
        h1, e1 = alone[b].counts()
        np.testing.assert_array_equal(held[:, b * nkv:(b + 1) * nkv], h1)
        np.testing.assert_array_equal(evicted[:, b * nkv:(b + 1) * nkv], e1)
    # sequence 1 leaves; a new prompt starts in its place and decodes as alone
    batch.reset_seq(1)
    fresh = eng.new_store(kv)
    first = int(np.argmax(eng.forward_seq(ids[:20], batch, 1)))
    assert first == int(np.argmax(eng.prefill(ids[:20], fresh)))
    toks[1] = first
    got = eng.decode_batch(toks, batch)
    assert got[1] == eng.decode(first, fresh)


@gpu
@pytest.mark.gpu
def test_batch_store_refuses_single_sequence_verbs(smollm2):
    eng = CUDAEngine(smollm2.spec, smollm2.tensors, n_batch=8)
    batch = eng.new_batch_store(3, capacity=32, policy="streaming")
    with pytest.raises(ConfigError, match="forward_seq"):
        eng.prefill([1, 2, 3], batch)
    with pytest.raises(ConfigError, match="one integer token per sequence"):
        eng.decode_batch([1, 2], batch)
    with pytest.raises(ConfigError, match="0..2"):
        eng.forward_seq([1], batch, 3)
    with pytest.raises(ConfigError, match="batch store"):
        eng.decode_batch([1], eng.new_store(capacity=32, policy="streaming"))
    with pytest.raises(ConfigError, match="batch must be"):
        eng.new_batch_store(9, capacity=32, policy="streaming")
    with pytest.raises(ConfigError, match="2 or more"):
        eng.new_batch_store(1, capacity=32, policy="streaming")


@gpu
@pytest.mark.gpu
def test_decode_graph_and_sampling(smollm2):
    ids = prompt_ids(smollm2, 30)
    kv = KVConfig(capacity=64, policy="h2o")
    plain = CUDAEngine(smollm2.spec, smollm2.tensors)
    graph = CUDAEngine(smollm2.spec, smollm2.tensors, cuda_graph=True)
    assert plain.generate(ids, plain.new_store(kv), 100) == graph.generate(ids, graph.new_store(kv), 100)
    a = plain.generate(ids, plain.new_store(kv), 50, temperature=0.8, top_p=0.9, rng=np.random.default_rng(1))
    b = graph.generate(ids, graph.new_store(kv), 50, temperature=0.8, top_p=0.9, rng=np.random.default_rng(1))
    assert a == b
    with pytest.raises(ConfigError, match="rng"):
        plain.pick(temperature=0.5)


@gpu
@pytest.mark.gpu
def test_store_options_and_stats(smollm2):
    from ringllm.runtime.engine import CPUEngine

    eng = CUDAEngine(smollm2.spec, smollm2.tensors)
    with pytest.raises(ConfigError, match="prompt compression"):
        eng.new_store(capacity=64, policy="snapkv", compress="snapkv", compress_ratio=0.5)
    st = eng.new_store(capacity=32, policy="streaming")
    eng.prefill(list(range(100)), st)
    cs = CPUEngine(smollm2.spec, smollm2.tensors).new_store(capacity=32, policy="streaming")
    want = cs.stats()
    got = st.stats()
    assert set(got) == set(want)
    assert got["length"] == 32 and got["evicted_total"] == 68 * smollm2.spec.n_layer * smollm2.spec.n_head_kv
    assert got["tokens_seen"] == 100
    with pytest.raises(ConfigError, match="token ids"):
        eng.step(smollm2.spec.n_vocab, st)
    full = eng.new_store(capacity=16, policy="full")
    with pytest.raises(ConfigError, match="exceed"):
        eng.logits(list(range(17)), full)


@gpu
@pytest.mark.gpu
def test_llm_api_on_the_cuda_backend_matches_cpu(smollm2_path):
    """ringllm.LLM(backend="cuda"): completion and chat give the CPU engine's greedy tokens."""
    import ringllm

    kv = KVConfig(capacity=64, policy="h2o", sinks=4)
    cpu = ringllm.LLM(smollm2_path, kv=kv, progress=False)
    dev = ringllm.LLM(smollm2_path, kv=kv, backend="cuda", progress=False)
    prompt = "The sea was calm that morning, and"
    want = cpu.complete(prompt, max_tokens=48, ignore_eos=True)
    got = dev.complete(prompt, max_tokens=48, ignore_eos=True)
    assert got.tokens == want.tokens and got.text == want.text
    msgs = [{"role": "user", "content": "Write a haiku about the sea."}]
    assert dev.chat(msgs, max_tokens=24).text == cpu.chat(msgs, max_tokens=24).text
    assert dev.kv_stats()["evicted_total"] == cpu.kv_stats()["evicted_total"]
