"""The q8 mode (8-bit activations, integer dot products) against its NumPy oracle.

- act_quant's quantizer reproduces reference_q8's Q8_0 / Q8_K bytes and scales exactly;
- every q8 kernel (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K; AVX2 and, where the CPU has it, VNNI) equals dequantize(W) @ dequantize(quantize(x))
  within 1e-5 of sum |w| |x| per output, for 1..17 rows (the 4-row chunks and their remainders, the
  one-to-three-row tile path), row counts that end inside a tile, several blocks per row, 1 and 2
  threads;
- pack / matvec / matmul / CPUEngine / LLM take and refuse precisions as documented;
- end to end, CPUEngine(precision="q8") follows ReferenceEngine(precision="q8"). q8 numerics are
  discontinuous (a rounding that flips on a 1e-7 difference moves an activation by a whole step), so
  whole-model logits are compared statistically, not to 1e-4: the products are checked to 1e-5 above.
"""
from __future__ import annotations

import numba
import numpy as np
import pytest
from test_matvec import oracle, random_tensor

from ringllm.runtime import matvec as mv
from ringllm.runtime.act_quant import Q8_0, Q8_K, ActQ8
from ringllm.runtime.errors import ConfigError
from ringllm.runtime.quant_types import GGMLType
from ringllm.runtime.reference_q8 import Q8_TYPES, dequantize_acts, quantize_q8_0, quantize_q8_k

REL_TOL = 1e-5


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    from ringllm.models.loader import load_model
    return load_model(smollm2_path)
TYPES = sorted(Q8_TYPES)
_EVEN_ODD = np.array([0, 2, 4, 6, 1, 3, 5, 7])


def _kernel_order(q: np.ndarray) -> np.ndarray:
    """q (T, n) in natural column order -> the kernels' (even columns, then odd, per 8)."""
    perm = (np.arange(q.shape[1] // 8)[:, None] * 8 + _EVEN_ODD[None, :]).reshape(-1)
    return q[:, perm]


@pytest.mark.parametrize("fmt", [Q8_0, Q8_K], ids=["q8_0", "q8_k"])
def test_quantizer_matches_oracle_bytes(fmt):
    rng = np.random.default_rng(1)
    X = (rng.standard_normal((6, 512)) * rng.uniform(1e-3, 50, (6, 1))).astype(np.float32)
    X[1, :256] = 0.0                                     # all-zero blocks: q = 0, d = 0
    X[2, 7] = 1e4                                        # one outlier
    X[3] = -np.abs(X[3])                                 # Q8_K's signed max
    X[4, ::3] = np.float32(0.5) * np.float32(127) / np.float32(127)   # exact .5 ties after scaling somewhere
    xq, dx, s16, s32 = ActQ8(512).fill(X, fmt)
    q, d = (quantize_q8_0 if fmt == Q8_0 else quantize_q8_k)(X)
    np.testing.assert_array_equal(xq, _kernel_order(q))
    np.testing.assert_array_equal(dx, d if fmt == Q8_0 else np.repeat(d, 8, axis=1))
    np.testing.assert_array_equal(s16, q.reshape(6, -1, 16).sum(axis=-1, dtype=np.int64).astype(np.float32))
    np.testing.assert_array_equal(s32, q.reshape(6, -1, 32).sum(axis=-1, dtype=np.int64).astype(np.float32))


def check_q8(pm: mv.PackedMatrix, W: np.ndarray, X: np.ndarray, what: str) -> None:
    out = np.full((X.shape[0], W.shape[0]), np.nan, np.float32)
    if X.shape[0] == 1:
        mv.matvec(out[0], pm, X[0])
    else:
        mv.matmul(out, pm, X)
    xa = dequantize_acts(X, Q8_TYPES[pm.qtype])
    ref = xa @ W.T
    bound = REL_TOL * (np.abs(xa) @ np.abs(W.T)) + 1e-30
    err = np.abs(out.astype(np.float64) - ref)
    assert np.all(err <= bound), f"{what}: err/bound {np.max(err / bound):.3g}"


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = numba.get_num_threads()
    numba.set_num_threads(min(request.param, numba.config.NUMBA_NUM_THREADS))
    yield request.param
    numba.set_num_threads(before)


def _dots():
    from ringllm.runtime.quant_tiles_q8 import HAS_VNNI
    from ringllm.runtime.quant_tiles_q8_wide import HAS_VNNI512
    return ["avx2"] + ["vnni"] * HAS_VNNI + ["vnni512"] * HAS_VNNI512


def _kernel_variant(pm) -> str:
    name = pm.q8[0].__name__
    return "vnni512" if name.endswith("_vnni512") else "vnni" if name.endswith("_vnni") else "avx2"


@pytest.mark.parametrize("dot", _dots())
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_q8_kernels_match_oracle(qtype, dot, threads, monkeypatch):
    """Every dot-product variant the CPU has (AVX2; VNNI on 8 lanes; VNNI on 16) against the oracle."""
    from ringllm.runtime.quant_tiles_q8_wide import WIDE_TYPES
    monkeypatch.setenv("RINGLLM_Q8_DOT", dot)
    rng = np.random.default_rng(int(qtype))
    # 53 rows: a partial last tile (16 or 24 rows per tile) and a partial last group of 8; 512 columns:
    # two K-quant super-blocks, 16 legacy blocks. 400 x 256: large enough for the parallel kernel.
    for n_rows, n_cols in [(53, 512), (400, 256)]:
        t = random_tensor(qtype, n_rows, n_cols, rng)
        W = oracle(t)
        pm = mv.pack(t, "q8")
        want = "vnni" if dot == "vnni512" and qtype not in WIDE_TYPES else dot     # 8 lanes where 16 are missing
        assert pm.precision == "q8" and _kernel_variant(pm) == want
        for T in range(1, 18):
            X = (rng.standard_normal((T, n_cols)) * rng.uniform(0.1, 10, (T, 1))).astype(np.float32)
            check_q8(pm, W, X, f"{qtype.name} {n_rows}x{n_cols} T={T}")


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_q8_16_lanes_equal_8_lanes_bitwise(qtype, threads):
    """The 16-lane kernels (quant_tiles_q8_wide.py) compute each row as the 8-lane VNNI ones do, to the
    bit: 4..13 rows of x (the 4-row passes and their remainders), a row count that leaves the last
    16-row pair half empty (53: its second group holds 5 rows) and one with an odd group count that
    ends on a tile's last group (40 rows: 5 groups), parallel and serial entry kernels."""
    from ringllm.runtime.q8_choice import q8_kernels
    from ringllm.runtime.quant_tiles_q8_wide import HAS_VNNI512, WIDE_TYPES
    if not HAS_VNNI512:
        pytest.skip("this CPU has no AVX512-VNNI")
    assert set(WIDE_TYPES) == set(TYPES)
    rng = np.random.default_rng(7 + int(qtype))
    for n_rows, n_cols in [(53, 512), (40, 256), (400, 256)]:
        pm = mv.pack(random_tensor(qtype, n_rows, n_cols, rng), "q8")
        for T in (4, 5, 7, 8, 13):
            X = (rng.standard_normal((T, n_cols)) * rng.uniform(0.1, 10, (T, 1))).astype(np.float32)
            outs = []
            for dot in ("vnni", "vnni512"):
                for kernel in q8_kernels(qtype, dot):
                    out = np.full((T, n_rows), np.nan, np.float32)
                    kernel(out, pm.buf, X, *pm.q8_acts.for_rows(T), pm.n_blocks)
                    outs.append(out)
            for other in outs[1:]:
                np.testing.assert_array_equal(other, outs[0], err_msg=f"{qtype.name} {n_rows}x{n_cols} T={T}")


def test_q8_dot_variant_refusals(monkeypatch):
    from ringllm.runtime.q8_choice import q8_kernels
    with pytest.raises(ConfigError, match="unknown"):
        q8_kernels(GGMLType.Q4_0, "avx512")
    monkeypatch.setenv("RINGLLM_Q8_DOT", "sse")
    with pytest.raises(ConfigError, match="'sse' unknown"):
        q8_kernels(GGMLType.Q4_0)


def test_q8_matmul_layouts_and_aliasing():
    rng = np.random.default_rng(5)
    t = random_tensor(GGMLType.Q4_K, 40, 256, rng)
    W = oracle(t)
    pm = mv.pack(t, "q8")
    X = rng.standard_normal((6, 256)).astype(np.float32)
    want = dequantize_acts(X, "q8_k") @ W.T
    out = np.zeros((6, 80), np.float32)[:, ::2]                       # a non-contiguous destination
    mv.matmul(out, pm, np.asfortranarray(X))                          # and a non-contiguous input
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_precision_choice_and_refusals():
    rng = np.random.default_rng(6)
    with pytest.raises(ConfigError, match="precision"):
        mv.pack(random_tensor(GGMLType.Q4_0, 8, 32, rng), "int8")
    other = mv.pack(random_tensor(GGMLType.Q5_1, 8, 32, rng), "q8")  # no q8 kernels: stays exact
    assert other.precision == "f32"
    own = mv.pack(random_tensor(GGMLType.Q6_K, 8, 256, rng), "q8")   # a layout of its own: no tile decoder
    with pytest.raises(ConfigError, match="q8 layout"):
        mv.unpack(own)
    shared = mv.pack(random_tensor(GGMLType.Q4_K, 8, 256, rng), "q8")    # the exact mode's layout: decodes
    assert mv.unpack(shared).shape == (8, 256)


def test_engine_and_llm_precision_arguments(smollm2):
    from ringllm.runtime.engine import CPUEngine
    with pytest.raises(ConfigError, match="precision"):
        CPUEngine(smollm2.spec, smollm2.tensors, precision="fp8")
    from ringllm.llm import LLM
    with pytest.raises(ConfigError, match="precision"):
        LLM(precision="q4")
    with pytest.raises(ConfigError, match="cpu backend only"):
        LLM(backend="reference", precision="q8")


def test_engine_q8_follows_reference_q8(smollm2):
    """Whole-model logits of CPUEngine(precision="q8") against ReferenceEngine(precision="q8") on a
    48-token prompt and 8 greedy steps: same greedy token at >= 90% of positions and logits that
    correlate at >= 0.99 (q8 end to end is discontinuous: module docstring). The exact engine is
    a control: its gap to the q8 reference is larger than the q8 engine's."""
    from conftest import novel_text

    from ringllm.runtime.engine import CPUEngine
    from ringllm.runtime.reference import ReferenceEngine
    prompt = smollm2.tokenizer.encode(novel_text()[50000:52000])[:48]
    eng = CPUEngine(smollm2.spec, smollm2.tensors, n_batch=16, precision="q8")
    ref = ReferenceEngine(smollm2.spec, smollm2.tensors, precision="q8")
    st, rc = eng.new_store(capacity=64, policy="full"), ref.new_cache(capacity=64, policy="full")
    got, want = [eng.logits(prompt, st)], [ref.forward(prompt, rc)]
    for _ in range(8):
        tok = int(np.argmax(want[-1][-1]))
        got.append(eng.logits([tok], st))
        want.append(ref.forward([tok], rc))
    got, want = np.concatenate(got), np.concatenate(want)
    assert np.mean(got.argmax(1) == want.argmax(1)) >= 0.9
    corr = [np.corrcoef(g, w)[0, 1] for g, w in zip(got, want)]
    assert min(corr) >= 0.99, min(corr)
