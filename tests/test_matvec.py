"""runtime/matvec.py against an independent oracle: gguf.quants.dequantize(W) @ x in float64.

Bound: for every output row i, |out_i - ref_i| <= 1e-5 * sum_j |w_ij| |x_j|. The float32
accumulation stays near 1e-7 of that sum (two orders of magnitude inside the bound); a single wrong
field, lane, block or scale moves a row by about |w_ij x_j|, i.e. ~1 / n_cols of the sum (1e-4 to
3e-2 for the shapes here), far outside it.
"""
from __future__ import annotations

import numba
import numpy as np
import pytest

from ringllm.runtime import matvec as mv
from ringllm.runtime import matvec_kernels as mk
from ringllm.runtime.errors import ConfigError, ModelFileError, UnsupportedModelError
from ringllm.runtime.qtensor import QTensor
from ringllm.runtime.quant_types import BLOCK_LAYOUT, GGMLType

REL_TOL = 1e-5
ALL_TYPES = [GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q5_1,
             GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.F16, GGMLType.F32, GGMLType.BF16,
             GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.IQ4_NL, GGMLType.IQ4_XS]


def oracle(t: QTensor) -> np.ndarray:
    """float64 (n_rows, n_cols) values of t through gguf's NumPy dequantizer."""
    from gguf import GGMLQuantizationType, quants

    vals = quants.dequantize(np.ascontiguousarray(t.data), GGMLQuantizationType(int(t.qtype)))
    return np.asarray(vals, dtype=np.float64).reshape(t.shape)


def random_tensor(qtype: GGMLType, n_rows: int, n_cols: int, rng: np.random.Generator) -> QTensor:
    """Random valid blocks: random payload bytes, finite small f16 scales (signed where ggml allows)."""
    block, size = BLOCK_LAYOUT[qtype]
    nb = n_cols // block
    if qtype == GGMLType.F32:
        data = rng.standard_normal((n_rows, n_cols)).astype(np.float32).view(np.uint8)
    elif qtype == GGMLType.F16:
        data = rng.standard_normal((n_rows, n_cols)).astype(np.float16).view(np.uint8)
    elif qtype == GGMLType.BF16:
        bits = rng.standard_normal((n_rows, n_cols)).astype(np.float32).view(np.uint32) >> 16
        data = bits.astype(np.uint16).view(np.uint8)
    else:
        data = rng.integers(0, 256, (n_rows, nb, size), dtype=np.uint8)

        def set_f16(off, lo, hi, signed):
            v = rng.uniform(lo, hi, (n_rows, nb))
            if signed:
                v *= rng.choice([-1.0, 1.0], (n_rows, nb))
            data[..., off:off + 2] = v.astype(np.float16)[..., None].view(np.uint8)

        if qtype in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0):
            set_f16(0, 0.01, 0.1, True)
            if qtype in (GGMLType.Q4_1, GGMLType.Q5_1):
                set_f16(2, 0.1, 1.0, True)
        elif qtype in (GGMLType.Q4_K, GGMLType.Q5_K):
            set_f16(0, 1e-3, 1e-2, False)
            set_f16(2, 1e-3, 1e-2, False)
        elif qtype == GGMLType.Q6_K:
            set_f16(208, 1e-3, 1e-2, True)
        elif qtype == GGMLType.Q2_K:
            set_f16(80, 1e-3, 1e-2, False)
            set_f16(82, 1e-3, 1e-2, False)
        elif qtype == GGMLType.Q3_K:
            set_f16(108, 1e-3, 1e-2, True)
        elif qtype in (GGMLType.IQ4_NL, GGMLType.IQ4_XS):
            set_f16(0, 1e-3, 1e-2, True)
    data = np.ascontiguousarray(data).reshape(n_rows, -1)
    return QTensor(f"random_{qtype.name}", qtype, (n_rows, n_cols), data)


def check_matvec(pm: mv.PackedMatrix, W: np.ndarray, rng: np.random.Generator, what: str) -> None:
    x = rng.standard_normal(W.shape[1]).astype(np.float32)
    out = np.full(W.shape[0], np.nan, np.float32)
    mv.matvec(out, pm, x)
    ref = W @ x.astype(np.float64)
    bound = REL_TOL * (np.abs(W) @ np.abs(x.astype(np.float64))) + 1e-30
    err = np.abs(out.astype(np.float64) - ref)
    assert np.all(err <= bound), f"{what}: worst row {np.argmax(err / bound)}, err/bound {np.max(err / bound):.3g}"


def check_matmul(pm: mv.PackedMatrix, W: np.ndarray, T: int, rng: np.random.Generator, what: str,
                 few_rows: bool = True) -> None:
    X = rng.standard_normal((T, W.shape[1])).astype(np.float32)
    out = np.full((T, W.shape[0]), np.nan, np.float32)
    mv.matmul(out, pm, X, few_rows=few_rows)
    X64 = X.astype(np.float64)
    ref = X64 @ W.T
    bound = REL_TOL * (np.abs(X64) @ np.abs(W.T)) + 1e-30
    err = np.abs(out.astype(np.float64) - ref)
    assert np.all(err <= bound), f"{what} T={T}: err/bound {np.max(err / bound):.3g}"


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    n = min(request.param, numba.config.NUMBA_NUM_THREADS)
    old = numba.get_num_threads()
    numba.set_num_threads(n)
    yield n
    numba.set_num_threads(old)


# ---------------------------------------------------------------------------------------------
# Random blocks, every type, odd shapes
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_random_blocks_matvec(qtype, threads):
    rng = np.random.default_rng(int(qtype) * 7 + threads)
    block = BLOCK_LAYOUT[qtype][0]
    col_options = [256, 512] if block == 256 else [32, 96, 160]
    if block == 1:
        col_options = [1, 7, 33, 96]
    for n_rows in (1, 3, 16, 17, 40, 67):
        for n_cols in col_options:
            t = random_tensor(qtype, n_rows, n_cols, rng)
            W = oracle(t)
            pm = mv.pack(t)
            check_matvec(pm, W, rng, f"{qtype.name} {n_rows}x{n_cols}")
            np.testing.assert_allclose(mv.unpack(pm), W, rtol=1e-6, atol=0)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_random_blocks_matmul(qtype, threads):
    """Every row count 1..17 (one matvec, the two-row tiles with and without an odd row, the tiled
    matmul; and with few_rows=False, per-row matvecs and the tiled matmul) and 33, on matrices with and without a partial last tile and one large enough for the
    parallel loop."""
    rng = np.random.default_rng(100 + int(qtype) + 7 * threads)
    n_cols = 512 if BLOCK_LAYOUT[qtype][0] == 256 else 96
    for n_rows in (3, 17, 300):
        t = random_tensor(qtype, n_rows, n_cols, rng)
        W = oracle(t)
        pm = mv.pack(t)
        for T in (*range(1, 18), 33):
            check_matmul(pm, W, T, rng, f"{qtype.name} {n_rows}x{n_cols}")
            check_matmul(pm, W, T, rng, f"{qtype.name} {n_rows}x{n_cols} (prefill paths)", few_rows=False)


@pytest.mark.parametrize("rows", [16, 24])
def test_wide_register_tiles_equal_one_tile_bitwise(rows):
    """The tiled matmul's product on a CPU with AVX-512 (tiles decoded side by side into WIDE_ROWS
    = 48 rows, 8 tokens at a time, gemm.gemm_tile_wide) gives every output the bits the one-tile
    product gives (AVX2: 4 tokens x 24 rows or 8 x 16, gemm.gemm_tile_narrow), for T = 1..20 and 33
    (groups of 8 and 4 and the last T mod 4 rows) and an odd column count (the parity sums' tail).
    Both compile on any x86-64 (the 16-lane operations as two 8-lane ones without AVX-512)."""
    from ringllm.runtime.gemm import WIDE_ROWS, gemm_tile_narrow, gemm_tile_wide

    rng = np.random.default_rng(rows)
    n_cols = 37
    wt = rng.standard_normal((n_cols, WIDE_ROWS)).astype(np.float32)
    for T in (*range(1, 21), 33):
        X = rng.standard_normal((T, n_cols)).astype(np.float32)
        for valid in range(rows, WIDE_ROWS + 1, rows):          # one, two (three) tiles decoded
            wide = np.full((T, WIDE_ROWS), np.nan, np.float32)
            gemm_tile_wide(wide, X, wt, np.int64(0), np.empty(8 * WIDE_ROWS, np.float32), valid)
            narrow = np.full((T, WIDE_ROWS), np.nan, np.float32)
            for r0 in range(0, valid, rows):
                gemm_tile_narrow(narrow, X, np.ascontiguousarray(wt[:, r0:r0 + rows]), np.int64(r0),
                                  np.empty(8 * rows, np.float32), rows)
            np.testing.assert_array_equal(wide[:, :valid], narrow[:, :valid], err_msg=f"T={T} valid={valid}")
            assert np.isnan(wide[:, valid:]).all()             # nothing stored past the decoded rows


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_few_rows_equal_matvec_bitwise(qtype, threads):
    """A few-row product (2..MATMUL_MIN_T - 1 rows) equals one matvec per row bit for bit, so a row's
    result does not depend on the rows batched with it (batched decode, speculative verification)."""
    rng = np.random.default_rng(300 + int(qtype) + 7 * threads)
    n_cols = 512 if BLOCK_LAYOUT[qtype][0] == 256 else 160
    for n_rows in (17, 300):
        pm = mv.pack(random_tensor(qtype, n_rows, n_cols, rng))
        for T in range(2, mv.MATMUL_MIN_T):
            X = rng.standard_normal((T, n_cols)).astype(np.float32)
            out = np.full((T, n_rows), np.nan, np.float32)
            mv.matmul(out, pm, X)
            for i in range(T):
                ref = np.empty(n_rows, np.float32)
                mv.matvec(ref, pm, X[i])
                np.testing.assert_array_equal(out[i], ref, err_msg=f"{qtype.name} {n_rows}x{n_cols} T={T} row {i}")


@pytest.mark.parametrize("kind", ["narrow", "pairs"])
@pytest.mark.parametrize("qtype", mk.PAIR_TYPES, ids=lambda q: q.name)
def test_8_and_16_lane_kernels(qtype, kind, threads, monkeypatch):
    """The 4-bit types and Q6_K have 8-lane and 16-lane tile kernels (the host takes one:
    matvec_kernels.KERNELS); both are checked on any CPU: matvec within REL_TOL of the oracle on full
    and partial tiles, on one thread and in the parallel loop (300 x 1024 is above PAR_MIN_WEIGHTS),
    and few-row products (pairs of rows and an odd one) bitwise equal to that kind's matvecs."""
    one, rows = ((mk.NARROW_KERNELS[qtype], mk.NARROW_ROWS_KERNELS[qtype]) if kind == "narrow"
                 else (mk.PAIR_KERNELS[qtype], mk.PAIR_ROWS_KERNELS[qtype]))
    monkeypatch.setitem(mk.KERNELS, qtype, one)
    monkeypatch.setitem(mk.ROWS_KERNELS, qtype, rows)
    rng = np.random.default_rng(500 + int(qtype) + 7 * threads)
    cols = (256, 512) if BLOCK_LAYOUT[qtype][0] == 256 else (32, 96, 160, 1024)
    for n_rows in (1, 23, 24, 25, 67, 300):
        for n_cols in cols:
            t = random_tensor(qtype, n_rows, n_cols, rng)
            pm = mv.pack(t)
            assert pm.kernel is one[0] and pm.rows_kernel is rows
            check_matvec(pm, oracle(t), rng, f"{kind} {qtype.name} {n_rows}x{n_cols}")
            X = rng.standard_normal((5, n_cols)).astype(np.float32)
            out = np.full((5, n_rows), np.nan, np.float32)
            mv.matmul(out, pm, X)
            for i in range(5):
                ref = np.empty(n_rows, np.float32)
                mv.matvec(ref, pm, X[i])
                np.testing.assert_array_equal(out[i], ref, err_msg=f"{kind} {qtype.name} {n_rows}x{n_cols} row {i}")


@pytest.mark.parametrize("env, expect", [
    ({"NUMBA_CPU_NAME": "haswell"}, False),
    ({"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+avx,+avx2,+fma,+f16c"}, False),
    ({"NUMBA_CPU_NAME": "skylake-avx512", "NUMBA_CPU_FEATURES": "+avx,+avx2,+fma,+f16c,+avx512f"}, True),
], ids=["cpu-name", "features-avx2", "features-avx512"])
def test_16_lane_choice_follows_numba_target(env, expect):
    """simd.HAS_AVX512 (the 16-lane kernels' switch) follows Numba's target, not only the host: a cache
    built for a named CPU keeps the 8-lane kernels unless its feature list has AVX-512F."""
    import os
    import subprocess
    import sys

    from ringllm.runtime import simd
    if not simd.X86:
        pytest.skip("x86 CPU names (the 16-lane kernels exist for x86-64 only)")

    code = ("from ringllm.runtime import matvec_kernels as mk, simd; from ringllm.runtime.quant_types import GGMLType; "
            "print(simd.HAS_AVX512, mk.KERNELS[GGMLType.Q4_K][0] is mk.PAIR_KERNELS[GGMLType.Q4_K][0])")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(expect), str(expect)]


def test_extreme_scales_and_values():
    """Q4_1 / Q8_0 / Q6_K / Q5_0 / Q2_K / Q3_K / IQ4_NL / IQ4_XS with f16 scales from tiny subnormals
    to large, and x with a wide range."""
    rng = np.random.default_rng(5)
    for qtype, offs in ((GGMLType.Q4_1, (0, 2)), (GGMLType.Q8_0, (0,)), (GGMLType.Q6_K, (208,)),
                        (GGMLType.Q5_0, (0,)), (GGMLType.Q2_K, (80, 82)), (GGMLType.Q3_K, (108,)),
                        (GGMLType.IQ4_NL, (0,)), (GGMLType.IQ4_XS, (0,))):
        block, size = BLOCK_LAYOUT[qtype]
        n_rows, n_cols = 24, 2 * block
        t = random_tensor(qtype, n_rows, n_cols, rng)
        blocks = t.data.reshape(n_rows, -1, size)
        for off in offs:
            mag = 10.0 ** rng.uniform(-7, 3, blocks.shape[:2])   # includes f16 subnormals
            blocks[..., off:off + 2] = (mag * rng.choice([-1, 1], mag.shape)).astype(np.float16)[..., None].view(np.uint8)
        W = oracle(t)
        pm = mv.pack(t)
        x = (rng.standard_normal(n_cols) * 10.0 ** rng.uniform(-6, 4, n_cols)).astype(np.float32)
        out = np.zeros(n_rows, np.float32)
        mv.matvec(out, pm, x)
        ref = W @ x.astype(np.float64)
        bound = REL_TOL * (np.abs(W) @ np.abs(x.astype(np.float64))) + 1e-30
        assert np.all(np.abs(out - ref) <= bound), qtype.name


def test_zero_rows_and_zero_x():
    rng = np.random.default_rng(6)
    t = random_tensor(GGMLType.Q4_1, 19, 64, rng)
    pm = mv.pack(t)
    out = np.full(19, np.nan, np.float32)
    mv.matvec(out, pm, np.zeros(64, np.float32))
    assert np.all(out == 0.0)


def test_out_may_alias_x():
    """x is read in full before any output is written, so a square matvec may work in place."""
    rng = np.random.default_rng(7)
    for qtype in (GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.F32, GGMLType.Q6_K):
        n = 256
        t = random_tensor(qtype, n, n, rng)
        pm = mv.pack(t)
        x = rng.standard_normal(n).astype(np.float32)
        ref = np.zeros(n, np.float32)
        mv.matvec(ref, pm, x.copy())
        mv.matvec(x, pm, x)
        np.testing.assert_array_equal(x, ref)


def test_matmul_layouts():
    """matmul with non-contiguous X / out, X aliasing out, and T on both sides of MATMUL_MIN_T."""
    rng = np.random.default_rng(11)
    t = random_tensor(GGMLType.Q4_1, 40, 64, rng)
    W = oracle(t)
    pm = mv.pack(t)
    for T in (1, mv.MATMUL_MIN_T - 1, mv.MATMUL_MIN_T, 9):
        X = rng.standard_normal((T, 128)).astype(np.float32)[:, ::2]
        big = np.zeros((T, 80), np.float32)
        out = big[:, ::2]
        mv.matmul(out, pm, X)
        ref = X.astype(np.float64) @ W.T
        assert np.all(np.abs(out - ref) <= REL_TOL * (np.abs(X) @ np.abs(W.T)) + 1e-30)
    sq = random_tensor(GGMLType.Q8_0, 64, 64, rng)
    pm = mv.pack(sq)
    X = rng.standard_normal((8, 64)).astype(np.float32)
    ref = np.zeros((8, 64), np.float32)
    mv.matmul(ref, pm, X.copy())
    mv.matmul(X, pm, X)
    np.testing.assert_array_equal(X, ref)


def test_stacked_pack_equals_parts():
    rng = np.random.default_rng(8)
    parts = [random_tensor(GGMLType.Q4_1, n, 96, rng) for n in (32, 8, 8)]
    pm = mv.pack(parts)
    assert (pm.n_rows, pm.n_cols) == (48, 96)
    x = rng.standard_normal(96).astype(np.float32)
    out = np.zeros(48, np.float32)
    mv.matvec(out, pm, x)
    pieces = []
    for p in parts:
        o = np.zeros(p.n_rows, np.float32)
        mv.matvec(o, mv.pack(p), x)
        pieces.append(o)
    np.testing.assert_array_equal(out, np.concatenate(pieces))


def test_repeatable_across_threads():
    """The same call gives the same bits with 1 and 2 threads (each row is computed by one thread)."""
    rng = np.random.default_rng(9)
    t = random_tensor(GGMLType.Q4_1, 200, 576, rng)
    pm = mv.pack(t)
    x = rng.standard_normal(576).astype(np.float32)
    old = numba.get_num_threads()
    try:
        res = []
        for n in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(n)
            o = np.zeros(200, np.float32)
            mv.matvec(o, pm, x)
            res.append(o)
    finally:
        numba.set_num_threads(old)
    for o in res[1:]:
        np.testing.assert_array_equal(o, res[0])


# ---------------------------------------------------------------------------------------------
# Argument checking
# ---------------------------------------------------------------------------------------------

def test_bad_arguments():
    rng = np.random.default_rng(10)
    t = random_tensor(GGMLType.Q4_1, 16, 64, rng)
    pm = mv.pack(t)
    good_out, good_x = np.zeros(16, np.float32), np.zeros(64, np.float32)
    for out, x in ((np.zeros(16, np.float64), good_x), (np.zeros(15, np.float32), good_x),
                   (good_out, np.zeros(65, np.float32)), (good_out, np.zeros(128, np.float32)[::2]),
                   (good_out, [0.0] * 64), (np.zeros((1, 16), np.float32), good_x),
                   (np.zeros(32, np.float32)[::2], good_x)):
        with pytest.raises(ConfigError):
            mv.matvec(out, pm, x)
    ro = np.zeros(16, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ConfigError):
        mv.matvec(ro, pm, good_x)
    with pytest.raises(ConfigError):
        mv.matmul(np.zeros((2, 16), np.float32), pm, np.zeros((3, 64), np.float32))
    with pytest.raises(ConfigError):
        mv.matmul(np.zeros((2, 16), np.float32), pm, np.zeros((2, 64), np.float64))
    with pytest.raises(ConfigError):
        mv.pack(QTensor("v", GGMLType.F32, (64,), np.zeros((1, 256), np.uint8)))
    with pytest.raises(ConfigError):
        mv.pack(QTensor("short", GGMLType.Q4_1, (16, 64), np.zeros((16, 39), np.uint8)))
    with pytest.raises(ConfigError):
        mv.pack([t, random_tensor(GGMLType.Q8_0, 16, 64, rng)])
    with pytest.raises(UnsupportedModelError, match="Q8_1"):
        mv.pack(QTensor("q8_1", GGMLType.Q8_1, (16, 32), np.zeros((16, 36), np.uint8)))


# ---------------------------------------------------------------------------------------------
# Real tensors of the bundled models
# ---------------------------------------------------------------------------------------------

def _real_checks(tensors: dict, names: list[str], max_rows: int, seed: int) -> set:
    rng = np.random.default_rng(seed)
    seen = set()
    for name in names:
        t = tensors[name]
        if t.n_rows > max_rows:
            # a slice of a large matrix, with an odd row count so the last tile is partial
            t = t.take_rows(slice(t.n_rows - max_rows - 5, t.n_rows))
        W = oracle(t)
        pm = mv.pack(t)
        check_matvec(pm, W, rng, name)
        check_matmul(pm, W, 4, rng, name)
        seen.add(t.qtype)
    return seen


def test_smollm2_tensors(smollm2_path, threads):
    from ringllm.models.gguf_file import GGUFFile

    f = GGUFFile(smollm2_path)
    names = [f"blk.0.{n}.weight" for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                           "ffn_up", "ffn_down")] + ["blk.29.ffn_down.weight", "token_embd.weight"]
    seen = _real_checks(f.tensors, names, 3000, threads)
    assert seen == {GGMLType.Q4_1, GGMLType.Q8_0}


def test_gemma3_tensors(threads):
    from ringllm.models.bundled import gemma3_model_path
    from ringllm.models.gguf_file import GGUFFile

    try:
        path = gemma3_model_path()
    except ModelFileError as exc:
        pytest.skip(str(exc))
    f = GGUFFile(path)
    names = [f"blk.0.{n}.weight" for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                           "ffn_up", "ffn_down")] + ["token_embd.weight"]
    seen = _real_checks(f.tensors, names, 2000, 10 + threads)
    assert seen == {GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K}
