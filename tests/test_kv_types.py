"""KV store element types (KVConfig k_type / v_type: f16, q8_0, q4_0; runtime/kv_types.py).

The row codecs against gguf's NumPy quantizers (bit for bit; q4_0 on each block's rotation), the
q4_0 rotation itself, the configuration errors, and the CPU
engine against the NumPy reference engine (which rounds K and V with gguf's quantizers where the
engine's store does) for every policy x type, through hundreds of evictions.

Tolerances: the two engines compute K and V in different orders (~1e-7 relative), and a quantizer
is a step function, so now and then an input within an ulp of a rounding boundary rounds one way
in one engine and the other way in the other: one value moves by one quantization step (f16: 2^-11
relative; q8_0: amax/127 of its block; q4_0: amax/8). Until the first such flip the logits agree
within 1e-5; after it, by up to TYPE_TOL (measured maxima over every policy: f16 5e-4, q8_0 4e-3,
q4_0 2e-2). The tokens are the same throughout, and the survivors are compared at every step; the
logits are checked while they are the same (a flip can tip a near-tie of scores).
"""
from __future__ import annotations

import numpy as np
import pytest

from ringllm.models.loader import load_model
from ringllm.runtime import kv_codec, kv_types
from ringllm.runtime.engine import CPUEngine
from ringllm.runtime.errors import ConfigError
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.reference import ReferenceEngine, hadamard_blocks, q4_0_outliers, round_kv_type

from conftest import FULL
from test_policies_engine import POLICIES, same_survivors

TYPES = ["f16", "q8_0", "q4_0"]
TYPE_TOL = {"f16": 2e-3, "q8_0": 2e-2, "q4_0": 6e-2}


def _cases(rng) -> np.ndarray:
    """Rows of 128 values that reach the quantizers' corners: zeros, a zero block, a negative extreme,
    ties of the largest magnitude, exact halves of a step, huge and tiny scales."""
    x = (rng.standard_normal((400, 128)) * rng.uniform(1e-3, 60, (400, 1))).astype(np.float32)
    x[0] = 0
    x[1, :32] = 0
    x[2, 7] = -4 * np.abs(x[2]).max()
    x[3, :32] = np.where(np.arange(32) % 2, 3.0, -3.0)          # +-3 ties: the first is the block's max
    x[4, :32] = np.arange(32, dtype=np.float32) * (127 / 31) / 127 * 2.5 + 0.5 / 127   # values near halves
    x[5] *= 1e4
    x[6] *= 1e-30
    return x


@pytest.mark.parametrize("name", TYPES)
def test_codec_is_gguf_bit_for_bit(name):
    from gguf import GGMLQuantizationType as T, quants

    x = _cases(np.random.default_rng(0))
    enc = kv_codec.encode(x, name)
    assert enc.dtype == kv_types.STORE_DTYPE[name] and enc.shape == (400, kv_types.row_width(name, 128))
    if name == "f16":
        np.testing.assert_array_equal(enc.view(np.float16), x.astype(np.float16))
    elif name == "q8_0":
        np.testing.assert_array_equal(enc.view(np.int8), quants.quantize(x, T.Q8_0).view(np.int8))
    else:                               # q4_0: llama.cpp's quantizer on each block's rotation (the
        signs = np.tile(kv_types.Q4_0_SIGNS, 4)          # reference's butterflies: the encoder's order)
        np.testing.assert_array_equal(enc, quants.quantize(hadamard_blocks(x * signs), T.Q4_0))
        keys = kv_codec.encode(x, name, key=True)        # a key row: of the rest, its outliers apart
        chans, u = q4_0_outliers(x)
        rest = x.copy()
        np.put_along_axis(rest, chans, np.take_along_axis(x, chans, -1) - u, -1)
        nb, n = kv_types.q4_0_blocks_width(128), kv_types.Q4_0_OUTLIERS
        assert keys.shape == (400, kv_types.row_width(name, 128, key=True)) == (400, nb + 3 * n)
        np.testing.assert_array_equal(keys[:, :nb], quants.quantize(hadamard_blocks(rest * signs), T.Q4_0))
        np.testing.assert_array_equal(keys[:, nb:nb + 2 * n].copy().view(np.float16), u.astype(np.float16))
        np.testing.assert_array_equal(keys[:, nb + 2 * n:], chans)
    for key in ((False, True) if name == "q4_0" else (False,)):
        dec, ref = kv_codec.decode(kv_codec.encode(x, name, key), 128), round_kv_type(x, name, key)
        if name == "q4_0":              # a scale past f16's range (x[5]) is inf: its rows are not
            bad = ~np.isfinite(ref).all(axis=1)      # values in either (the rotation spreads the inf)
            assert bad.any() and (~np.isfinite(dec[bad])).any(axis=1).all() and np.isfinite(dec[~bad]).all()
            dec, ref = dec[~bad], ref[~bad]
        np.testing.assert_array_equal(dec, ref)
    assert kv_types.row_bytes(name, 128) * 400 == enc.nbytes


def _q4_0_rotation(x: np.ndarray) -> np.ndarray:
    """y = H (s x) per block of 32 (kv_types), H as an explicit +-1 matrix (Sylvester's recursion),
    in float64: an oracle for the store's butterflies, which round their float32 sums."""
    h = np.ones((1, 1))
    while h.shape[0] < 32:
        h = np.block([[h, h], [h, -h]])
    blocks = x.reshape(-1, 32).astype(np.float64) * kv_types.Q4_0_SIGNS
    return (blocks @ h.T).astype(np.float32).reshape(x.shape)


def test_q4_0_rotation_is_the_hadamard_matrix():
    """The encoder's float32 butterflies against the float64 matrix: every scale within a few ulps
    (a sum's rounding), every nibble the same but where y sits within rounding of a step's edge."""
    from gguf import GGMLQuantizationType as T, quants

    x = _cases(np.random.default_rng(3))[7:]          # rows of ordinary values, no corners
    enc = kv_codec.encode(x, "q4_0").reshape(-1, 18)
    want = quants.quantize(_q4_0_rotation(x), T.Q4_0).reshape(-1, 18)
    d, d_want = enc[:, :2].copy().view(np.float16).astype(np.float32), want[:, :2].copy().view(np.float16).astype(np.float32)
    np.testing.assert_allclose(d, d_want, rtol=2e-3)
    assert (enc[:, 2:] == want[:, 2:]).mean() > 0.999


def test_q4_0_rotation_cuts_the_error_of_offset_channels():
    """Keys whose energy sits in a few channels' offsets (a pre-RoPE key: docs/kv_types.md): the
    rotated q4_0 rows' squared error is a fraction of llama.cpp's q4_0 of the values themselves, and
    on rows without such channels no worse than it by more than noise."""
    from gguf import GGMLQuantizationType as T, quants

    rng = np.random.default_rng(11)
    for offsets, bound in (((3, 10.0), (40, -8.0), (77, 6.0)), 0.45), ((), 1.05):
        x = rng.standard_normal((2000, 128)).astype(np.float32) * 1.5
        for ch, mu in offsets:
            x[:, ch] += mu
        plain = quants.dequantize(quants.quantize(x, T.Q4_0), T.Q4_0)
        rotated = kv_codec.round_trip(x, "q4_0")
        assert ((rotated - x) ** 2).mean() < bound * ((plain - x) ** 2).mean()


def test_q4_0_outliers_apart():
    """Each q4_0 key row holds its Q4_0_OUTLIERS largest values apart in f16 (kv_types): on rows whose
    energy sits in a few channels (a key after RoPE) the error is a fraction of the rotation alone's;
    the channels are the largest, the first of equal ones, NaN last; a value past f16's range is held
    as f16's largest with the rest in the blocks; the basis the attention reads (kv_basis, compiled
    and NumPy) is the decoded row's coefficients."""
    from gguf import GGMLQuantizationType as T, quants
    from numba import njit

    from ringllm.runtime.kv_basis import decode_basis, decode_row_basis, rotate_back

    rng = np.random.default_rng(5)
    x = rng.standard_normal((2000, 64)).astype(np.float32)
    for ch, mu in ((3, 12.0), (35, -9.0), (50, 7.0)):
        x[:, ch] += mu
    signs = np.tile(kv_types.Q4_0_SIGNS, 2)
    rotated_only = rotate_back(quants.dequantize(quants.quantize(hadamard_blocks(x * signs), T.Q4_0), T.Q4_0) / 32)
    np.testing.assert_array_equal(kv_codec.round_trip(x, "q4_0"), rotated_only)       # a value row: none apart
    apart = kv_codec.round_trip(x, "q4_0", key=True)
    assert ((apart - x) ** 2).mean() < 0.5 * ((rotated_only - x) ** 2).mean()

    nb, n = kv_types.q4_0_blocks_width(64), kv_types.Q4_0_OUTLIERS
    rows = np.zeros((4, 64), np.float32)
    rows[0, :] = np.where(np.arange(64) % 2, 3.0, -3.0)            # all equal: the first four
    rows[1, :] = np.nan
    rows[1, 40] = 1.0                                                # NaN last: 40, then the first NaNs
    rows[2, 10], rows[2, 20] = 1e5, -2.0                             # clipped to 65504, the rest in the blocks
    rows[3, 7] = np.float32(1.0009765625 + 2 ** -12)                 # f16 rounds it; the blocks hold the rest
    enc = kv_codec.encode(rows, "q4_0", key=True)
    chans = enc[:, nb + 2 * n:]
    assert chans[0].tolist() == [0, 1, 2, 3] and chans[1].tolist() == [40, 0, 1, 2]
    assert chans[2].tolist()[:2] == [10, 20] and enc[2, nb:nb + 2].copy().view(np.float16)[0] == 65504
    dec = kv_codec.decode(enc, 64)
    assert abs(dec[2, 10] - 1e5) < 1e5 / 8 and dec[2, 20] == -2.0 and np.isfinite(dec[2]).all()
    assert np.abs(dec[3] - rows[3]).max() < 2 ** -12          # f16 alone would miss by 2 ** -12
    np.testing.assert_array_equal(dec[[0, 2, 3]], round_kv_type(rows[[0, 2, 3]], "q4_0", key=True))

    @njit
    def basis_rows(dst, enc):
        for r in range(enc.shape[0]):
            decode_row_basis(dst[r], enc[r])
    enc = kv_codec.encode(x[:300], "q4_0", key=True)
    compiled = np.empty((300, 64), np.float32)
    basis_rows(compiled, enc)
    np.testing.assert_array_equal(compiled, decode_basis(enc, 64))
    np.testing.assert_allclose(rotate_back(compiled), kv_codec.decode(enc, 64), rtol=0, atol=1e-5)


def test_restore_converts_q4_0_rows_of_the_unrotated_form(tmp_path_factory):
    """A state saved when q4_0 rows held llama.cpp's blocks of the values themselves (no "q4_0_rows"
    entry), or of their rotation with no outliers apart ("hadamard"), is converted on restore, keys
    and values: its rows decoded by gguf and encoded in today's form, so the restored store holds the
    saved values, rounded once more; q8_0 rows are never touched; an unknown form is refused."""
    from gguf import GGMLQuantizationType as T, quants
    from ringllm.runtime.kv_store import KVStore

    tiny = _tiny("llama", tmp_path_factory)
    eng = CPUEngine(tiny.spec, tiny.tensors)
    ids = np.random.default_rng(8).permutation(256)[:30].tolist()
    st = eng.new_store(KVConfig(capacity=16, policy="streaming", k_type="q4_0", v_type="q4_0"))
    eng.prefill(ids, st)
    old = st.state()
    hd = tiny.spec.head_dim
    for name in (f"{f}.{il}" for f in "kv" for il in range(tiny.spec.n_layer)):     # the old form
        values = kv_codec.decode(old["arrays"][name], hd)
        shape = old["arrays"][name].shape[:-1] + (kv_types.q4_0_blocks_width(hd),)
        old["arrays"][name] = quants.quantize(values, T.Q4_0).reshape(shape)
    del old["q4_0_rows"]
    rotated = st.state()                                    # the form before key outliers: value rows as today's
    signs = np.tile(kv_types.Q4_0_SIGNS, hd // 32)
    for name in (f"k.{il}" for il in range(tiny.spec.n_layer)):
        values = kv_codec.decode(rotated["arrays"][name], hd)
        shape = rotated["arrays"][name].shape[:-1] + (kv_types.q4_0_blocks_width(hd),)
        rotated["arrays"][name] = quants.quantize(hadamard_blocks(values * signs), T.Q4_0).reshape(shape)
    rotated["q4_0_rows"] = "hadamard"
    for saved in (old, rotated):
        restored = KVStore.restore(tiny.spec, saved)
        for name in "kv":
            for mine, theirs in zip(getattr(st, name), getattr(restored, name)):
                want = kv_codec.decode(mine, hd)
                step = np.abs(want).max(axis=-1, keepdims=True) / 4 + 1e-6     # one q4_0 step of the row at most
                assert (np.abs(kv_codec.decode(theirs, hd) - want) <= step).all()
                if saved is old or name == "k":                  # rounded a second time, not copied
                    assert not np.array_equal(mine, theirs)
                else:                                            # "hadamard" value rows are today's
                    np.testing.assert_array_equal(mine, theirs)
    rotated["q4_0_rows"] = "hadamard+outliers9"
    with pytest.raises(ConfigError, match="q4_0 rows of the form 'hadamard\\+outliers9'"):
        KVStore.restore(tiny.spec, rotated)
    np.testing.assert_array_equal(KVStore.restore(tiny.spec, st.state()).v[0], st.v[0])
    q8 = eng.new_store(KVConfig(capacity=16, policy="streaming", k_type="q8_0", v_type="q8_0"))
    eng.prefill(ids, q8)
    state = q8.state()
    del state["q4_0_rows"]
    np.testing.assert_array_equal(KVStore.restore(tiny.spec, state).k[0], q8.k[0])


def test_restore_refuses_q4_0_key_rows_naming_a_channel_past_head_dim(tmp_path_factory):
    """A saved q4_0 key row whose outlier names a channel past head_dim (a damaged or forged file) is a
    ConfigError on restore, never a write past a decoder's row."""
    from ringllm.runtime.kv_store import KVStore

    tiny = _tiny("llama", tmp_path_factory)
    eng = CPUEngine(tiny.spec, tiny.tensors)
    st = eng.new_store(KVConfig(capacity=16, policy="streaming", k_type="q4_0", v_type="q4_0"))
    eng.prefill(np.random.default_rng(9).permutation(256)[:20].tolist(), st)
    state = st.state()
    KVStore.restore(tiny.spec, state)
    k = state["arrays"]["k.1"].copy()
    k[0, 3, -1] = tiny.spec.head_dim                       # the last outlier's channel byte
    state["arrays"] = {**state["arrays"], "k.1": k}
    with pytest.raises(ConfigError, match="layer 1 has q4_0 key rows naming a channel past head_dim"):
        KVStore.restore(tiny.spec, state)


def test_bytes_per_value():
    assert [kv_types.row_bytes(t, 64) for t in ("f32", "f16", "q8_0", "q4_0")] == [256, 128, 68, 36]
    assert [kv_types.row_bytes(t, 64, key=True) for t in ("f32", "f16", "q8_0", "q4_0")] == [256, 128, 68, 48]


def test_bad_types_are_config_errors(tmp_path_factory):
    with pytest.raises(ConfigError, match="k_type 'q5_1' unknown; valid: f32, f16, q8_0, q4_0"):
        KVConfig(capacity=16, policy="streaming", k_type="q5_1")
    with pytest.raises(ConfigError, match="v_type"):
        KVConfig(capacity=16, policy="streaming", v_type="int8")
    tiny = _tiny("gptneox", tmp_path_factory)          # head_dim 16: no whole block of 32
    eng = CPUEngine(tiny.spec, tiny.tensors)
    with pytest.raises(ConfigError, match="head_dim is 16: use f32 or f16"):
        eng.new_store(KVConfig(capacity=16, policy="streaming", k_type="q8_0"))
    eng.new_store(KVConfig(capacity=16, policy="streaming", k_type="f16", v_type="f16"))
    wide = _tiny("llama", tmp_path_factory)
    with pytest.raises(ConfigError, match="rope 'rk'"):
        CPUEngine(wide.spec, wide.tensors, rope="rk").new_store(KVConfig(capacity=16, policy="streaming",
                                                                        k_type="q8_0"))


_TINY = {}


def _tiny(arch, tmp_path_factory):
    """A tiny random checkpoint; llama wide (head_dim 64), gemma3 (head_dim 32, sliding layers)."""
    pytest.importorskip("transformers")
    from tiny_checkpoints import build_tiny

    if arch not in _TINY:
        d = str(tmp_path_factory.mktemp(arch))
        build_tiny(arch, d, wide=arch == "llama")
        _TINY[arch] = load_model(d, tokenizer=False)
    return _TINY[arch]


def run_tracked(loaded, kv, ids, n_prompt, tol):
    """The prompt ids[:n_prompt] as one chunk (the parallel chunk kernel on ring layers), then the
    rest one token at a time, through the engine and the reference. Returns the first step whose
    survivors differ (None: never); the logits agree within tol at every step before it."""
    eng = CPUEngine(loaded.spec, loaded.tensors, n_batch=16)
    eng.chunk_min_pairs = 0
    ref = ReferenceEngine(loaded.spec, loaded.tensors)
    st, rc = eng.new_store(kv), ref.new_cache(kv)
    np.testing.assert_allclose(eng.logits(ids[:n_prompt], st), ref.forward(ids[:n_prompt], rc), rtol=0, atol=tol)
    split = None if same_survivors(st, rc) else -1
    for i, t in enumerate(ids[n_prompt:]):
        le, lr = eng.step(t, st), ref.forward([t], rc)[0]
        if split is None and not same_survivors(st, rc):
            split = i
        if split is None:
            np.testing.assert_allclose(le, lr, rtol=0, atol=tol, err_msg=f"step {i}")
    assert st.stats()["evicted_total"] > 0
    return split


# CI's short form: the ring, the Python-path policies that read keys (knorm, gvote), and compiled steps
# that read keys (rkv) or only score (h2o), 148 steps at capacity 16, each (kernel, type) pair compiled
# once (q4_0 keys relative to offsets through rkv's compiled step: test_q4_0_policy_layers_hold_keys_...).
# RINGLLM_TEST_FULL=1: every policy x type, 1,000 steps at capacity 64 (each pair compiles the
# policy's kernels for its arrays, ~15 s on two cores).
PAIRS = ([(p, t) for p in POLICIES for t in TYPES] if FULL else
         [("streaming", "q4_0"), ("h2o", "q8_0"), ("knorm", "f16"), ("gvote", "f16"), ("rkv", "q8_0")])


@pytest.mark.slow
@pytest.mark.parametrize("policy,name", PAIRS)
def test_policies_and_types_against_reference(tmp_path_factory, policy, name):
    tiny = _tiny("llama", tmp_path_factory)
    capacity, n = (64, 1012) if FULL else (16, 160)
    ids = np.random.default_rng(1).integers(0, 256, n).tolist()
    kv = KVConfig(capacity=capacity, policy=policy, sinks=2, window=4, pool=3, lsh_bits=12, history=8,
                  recent=None if policy != "h2o" else capacity // 4, k_type=name, v_type=name)
    split = run_tracked(tiny, kv, ids, 12, TYPE_TOL[name])
    print(f"{policy} {name}: survivors first differ at step {split}")
    assert split is None or split > 20, f"survivors parted at step {split}"


@pytest.mark.parametrize("positions", ["reindexed", "original"])
@pytest.mark.parametrize("policy", ["streaming", "h2o", "full"])
def test_sliding_layers_and_positions(tmp_path_factory, policy, positions):
    """Gemma 3's sliding-window rings beside its global layer, both position modes; the rings with k
    and v of different types."""
    tiny = _tiny("gemma3", tmp_path_factory)
    ids = np.random.default_rng(4).permutation(256)[:90].tolist()
    kv = KVConfig(capacity=None if policy == "full" else 16, policy=policy, sinks=2, window=4, positions=positions,
                  k_type="q8_0", v_type="q8_0" if policy == "h2o" else "q4_0")
    if policy == "full":
        eng, ref = CPUEngine(tiny.spec, tiny.tensors, n_batch=16), ReferenceEngine(tiny.spec, tiny.tensors)
        st, rc = eng.new_store(kv), ref.new_cache(kv)
        np.testing.assert_allclose(eng.logits(ids, st), ref.forward(ids, rc), rtol=0, atol=TYPE_TOL["q4_0"])
        return
    run_tracked(tiny, kv, ids, 12, TYPE_TOL["q4_0"])


def test_staged_eviction_with_types(tmp_path_factory):
    """Staged eviction (lazy, slack, max_drop) on a quantized store."""
    tiny = _tiny("llama", tmp_path_factory)
    ids = np.random.default_rng(8).permutation(256)[:90].tolist()
    kv = KVConfig(capacity=16, policy="h2o", sinks=2, recent=3, lazy=4, slack=2, max_drop=3, k_type="q8_0",
                  v_type="q8_0")
    split = run_tracked(tiny, kv, ids, 12, TYPE_TOL["q8_0"])
    assert split is None or split > 20


def test_store_holds_its_type_and_saves(tmp_path_factory):
    """Rows are stored encoded (bytes per slot), survive snapshot/restore and state()/restore()
    bitwise, and a restored store decodes on alike."""
    from ringllm.runtime.kv_store import KVStore

    tiny = _tiny("llama", tmp_path_factory)
    eng = CPUEngine(tiny.spec, tiny.tensors)
    kv = KVConfig(capacity=16, policy="h2o", k_type="q8_0", v_type="q8_0")
    st = eng.new_store(kv)
    eng.prefill(list(range(3, 40)), st)
    assert st.k[0].dtype == np.int8 and st.k[0].shape[2] == 68 and st.v[0].nbytes == st.k[0].nbytes
    restored = eng.adopt_store(KVStore.restore(tiny.spec, st.state()))
    forked = st.fork()
    a = [eng.step(t, st).copy() for t in (50, 51, 52)]
    for other in (restored, forked):
        np.testing.assert_array_equal(np.stack([eng.step(t, other).copy() for t in (50, 51, 52)]), np.stack(a))
    bad = st.state()
    bad["kv"] = {**bad["kv"], "k_type": "q4_0"}
    with pytest.raises(ConfigError, match="k.0"):
        KVStore.restore(tiny.spec, bad)


def test_key_offset_rule():
    """kv_types.key_offset_of: the mean key, rounded to OFFSET_BITS significant bits."""
    rng = np.random.default_rng(3)
    keys = (rng.normal(size=(9, 64)) + rng.normal(scale=20, size=(1, 64))).astype(np.float32)
    got = kv_types.key_offset_of(keys)
    want = keys.astype(np.float64).mean(0)
    assert got.dtype == np.float32 and got.shape == (64,)
    assert np.all(np.abs(got - want) <= np.abs(want) * 2.0 ** -kv_types.OFFSET_BITS)
    mant = np.frexp(got)[0] * 2 ** kv_types.OFFSET_BITS
    np.testing.assert_array_equal(mant, np.round(mant))
    with pytest.raises(ConfigError, match="key offset"):
        kv_types.key_offset_of(keys[:0])


def test_q4_0_policy_layers_hold_keys_relative_to_offsets(tmp_path_factory):
    """A q4_0 store's policy layers choose their key offsets with their first token from OFFSET_FROM on
    (the engine's and the reference's the same), hold k - c from there on (the first tokens: k), and
    read k back (KVStore.key_values against the reference's rounding); the ring layers and every
    other type hold none. The offsets survive fork, state()/restore() and convert_types; a stream fed
    token by token gets them at token OFFSET_FROM; a state saved before offsets existed restores with
    none (its rows hold the keys themselves) and decodes as before."""
    from ringllm.runtime.kv_store import KVStore

    tiny = _tiny("gemma3", tmp_path_factory)          # sliding-window (ring) layers beside policy layers
    eng, ref = CPUEngine(tiny.spec, tiny.tensors), ReferenceEngine(tiny.spec, tiny.tensors)
    ids = np.random.default_rng(9).permutation(256)[:40].tolist()
    kv = KVConfig(capacity=24, policy="rkv", sinks=2, window=4, k_type="q4_0", v_type="q4_0")   # reads keys
    st, rc = eng.new_store(kv), ref.new_cache(kv)
    np.testing.assert_allclose(eng.logits(ids[:30], st), ref.forward(ids[:30], rc), rtol=0, atol=TYPE_TOL["q4_0"])
    policy_layers = [il for il in range(tiny.spec.n_layer) if st.offsets_keys(il)]
    assert policy_layers and len(policy_layers) < tiny.spec.n_layer
    for il in range(tiny.spec.n_layer):
        np.testing.assert_array_equal(st.koff[il], rc.key_offsets[il])
        assert np.abs(st.koff[il]).max() > 0 if il in policy_layers else not st.koff[il].any()
    for il in policy_layers:
        for h in range(tiny.spec.n_head_kv):
            order = np.argsort(st.seq[il][h, :int(st.count[il][h])])
            np.testing.assert_allclose(st.key_values(il, h, order), rc.layers[il].k[h], rtol=0, atol=1e-3)
    koff = [a.copy() for a in st.koff]
    for other in (st.fork(), KVStore.restore(tiny.spec, st.state())):
        for a, b in zip(other.koff, koff):
            np.testing.assert_array_equal(a, b)
    eng.prefill(ids[30:], st)                          # later writes keep the offsets
    for a, b in zip(st.koff, koff):
        np.testing.assert_array_equal(a, b)
    f = st.convert_types("f32", "f32")                  # keys before RoPE until an engine re-lays them
    assert not any(a.any() for a in f.koff)
    for il in policy_layers:                           # the first tokens' rows hold their keys themselves
        off = np.where((st.seq[il] >= kv_types.OFFSET_FROM)[..., None], st.koff[il][:, None], np.float32(0))
        np.testing.assert_array_equal(f.k[il], kv_codec.decode(st.k[il], tiny.spec.head_dim) + off)
    back = eng.adopt_store(eng.adopt_store(f).convert_types("q4_0", "q4_0"))
    assert all(back.koff[il].any() for il in policy_layers)
    np.testing.assert_allclose(eng.step(7, back), eng.step(7, st), rtol=0, atol=TYPE_TOL["q4_0"])
    one, rc1 = eng.new_store(kv), ref.new_cache(kv)   # a stream fed token by token from its first token:
    for i, t in enumerate(ids[:kv_types.OFFSET_FROM + 2]):     # the offsets come with token OFFSET_FROM
        np.testing.assert_allclose(eng.step(t, one), ref.forward([t], rc1)[0], rtol=0, atol=TYPE_TOL["q4_0"])
        for il in range(tiny.spec.n_layer):
            np.testing.assert_array_equal(one.koff[il], rc1.key_offsets[il])
            assert one.koff[il].any() == (i >= kv_types.OFFSET_FROM and il in policy_layers)
    old = st.state()
    old["arrays"] = {n: a for n, a in old["arrays"].items() if not n.startswith("koff.")}
    legacy = KVStore.restore(tiny.spec, old)
    assert not any(a.any() for a in legacy.koff)
    for il in policy_layers:                           # its rows are read as the keys themselves
        np.testing.assert_array_equal(legacy.key_values(il, 0, np.arange(2)),
                                      kv_codec.decode(st.k[il][0, :2], tiny.spec.head_dim))


def test_key_offsets_cut_the_error_of_offset_keys():
    """Keys that share a large offset (as a real model's do before RoPE): rounded relative to the
    offset of their first tokens, q4_0 keys lose a fraction of what they lose rounded as they are. The
    offset spans 17 channels, more than the four a q4_0 row holds apart (kv_types), which take most
    of an offset of a few channels on their own."""
    rng = np.random.default_rng(4)
    offset = rng.normal(scale=8.0, size=(1, 1, 64)) * (rng.random((1, 1, 64)) < 0.3)
    keys = (rng.normal(size=(200, 2, 64)) + offset).astype(np.float32)
    c = np.stack([kv_types.key_offset_of(keys[1:32, h]) for h in range(2)])
    plain = np.abs(kv_codec.round_trip(keys, "q4_0", key=True) - keys).mean()
    relative = np.abs(kv_codec.round_trip(keys - c, "q4_0", key=True) + c - keys).mean()
    assert relative < 0.5 * plain


def test_kshift_requantizes_and_stays_close(tmp_path_factory):
    """rope "kshift" re-rotates every newer key at each eviction: a quantized key is decoded, rotated
    and encoded again each time; it drifts from the key quantized once, measured here (q8_0)."""
    tiny = _tiny("llama", tmp_path_factory)
    ids = np.random.default_rng(5).permutation(256)[:120].tolist()
    out = {}
    for rope in ("stored", "kshift"):
        eng = CPUEngine(tiny.spec, tiny.tensors, rope=rope)
        st = eng.new_store(KVConfig(capacity=16, policy="streaming", k_type="q8_0"))
        out[rope] = np.stack([eng.step(t, st).copy() for t in ids])
    err = np.abs(out["kshift"] - out["stored"]).max(axis=1)
    assert err[:16].max() < 1e-4           # no eviction yet: no re-rotation
    assert 0 < err.max() < 0.5


def test_convert_types(tmp_path_factory):
    """KVStore.convert_types: q -> f32 keeps every value (rows decoded); f32 -> q8_0 re-lays a policy
    layer's keys before RoPE, then quantizes them as a write would; both stores decode on."""
    tiny = _tiny("llama", tmp_path_factory)
    eng = CPUEngine(tiny.spec, tiny.tensors)
    ids = np.random.default_rng(6).permutation(256)[:40].tolist()
    st = eng.new_store(KVConfig(capacity=16, policy="streaming", k_type="q8_0", v_type="q4_0"))
    eng.prefill(ids, st)
    f = eng.adopt_store(st.convert_types("f32", "f32"))
    hd = tiny.spec.head_dim
    for il in range(tiny.spec.n_layer):
        np.testing.assert_array_equal(f.k[il], kv_codec.decode(st.k[il], hd))
        np.testing.assert_array_equal(f.v[il], kv_codec.decode(st.v[il], hd))
    assert f.kv.k_type == "f32" and f.n_seen == st.n_seen
    np.testing.assert_allclose(eng.step(7, f), eng.step(7, st), rtol=0, atol=TYPE_TOL["q4_0"])

    h = eng.new_store(KVConfig(capacity=16, policy="h2o"))
    eng.prefill(ids, h)
    assert "rebased" in h.layer_rope_mode
    q = eng.adopt_store(h.convert_types("q8_0", "q8_0"))
    assert q.layer_rope_mode == ["fused"] * tiny.spec.n_layer and q.k[0].dtype == np.int8
    direct = eng.new_store(KVConfig(capacity=16, policy="h2o", k_type="q8_0", v_type="q8_0"))
    eng.prefill(ids, direct)
    np.testing.assert_allclose(eng.step(7, q), eng.step(7, direct), rtol=0, atol=TYPE_TOL["q8_0"])
    with pytest.raises(ConfigError, match="valid: f32, f16, q8_0, q4_0"):
        h.convert_types("q2", "f32")


def test_batched_decode_with_types(tmp_path_factory):
    """step_batch over stores of one type (the parallel stream kernel) and of mixed types (the
    per-store path): each row equals the store decoded alone, the same survivors."""
    tiny = _tiny("llama", tmp_path_factory)
    eng = CPUEngine(tiny.spec, tiny.tensors, n_batch=16)
    rng = np.random.default_rng(7)
    prompts = [rng.permutation(256)[:n].tolist() for n in (9, 30, 21)]
    for types in (["q8_0"] * 3, ["q8_0", "q4_0", "q8_0"]):
        cfg = [KVConfig(capacity=16, policy="streaming", sinks=2, k_type=t, v_type=t) for t in types]
        alone, batch = [eng.new_store(c) for c in cfg], [eng.new_store(c) for c in cfg]
        nxt = [int(np.argmax(eng.prefill(p, st))) for p, st in zip(prompts, alone)]
        for p, st in zip(prompts, batch):
            eng.prefill(p, st)
        for _ in range(25):
            got = eng.step_batch(nxt, batch)
            want = np.stack([eng.step(t, st).copy() for t, st in zip(nxt, alone)])
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max())
            nxt = [int(t) for t in np.argmax(want, axis=1)]
        for a, b in zip(alone, batch):
            assert same_survivor_sets(a, b) and a.stats()["evicted_total"] > 0


@pytest.mark.parametrize("k_type,v_type", [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "q4_0")])
def test_paged_store_with_types(tmp_path_factory, k_type, v_type):
    """The paged pool holds rows of every KV type, encoded once at write: a paged store (appends leaving
    holes, hole-filling every 6 tokens, a fork half-way) against the reference cache that rounds keys
    before RoPE as the pool holds them (ring_keys="fused"), through evictions: the pool's held tokens
    are the reference's at every step and the logits agree within the types' tolerance."""
    from ringllm.runtime.paged_pool import PagedKVPool
    from ringllm.runtime.paged_store import PagedStore

    tiny = _tiny("llama", tmp_path_factory)
    spec, hd = tiny.spec, tiny.spec.head_dim
    eng, ref = CPUEngine(spec, tiny.tensors, n_batch=8), ReferenceEngine(spec, tiny.tensors)
    kv = KVConfig(capacity=16, policy="streaming", sinks=2, k_type=k_type, v_type=v_type)
    pool = PagedKVPool.for_model(spec, 64, block_size=4, k_type=k_type, v_type=v_type)
    assert pool.k.dtype == kv_types.STORE_DTYPE[k_type] and pool.v.dtype == kv_types.STORE_DTYPE[v_type]
    assert pool.k.shape[-1] == kv_types.row_width(k_type, hd, key=True)
    assert pool.v.shape[-1] == kv_types.row_width(v_type, hd)
    st = PagedStore(pool, spec, kv, update="append", compact_every=6, compaction="fill")
    rc = ref.new_cache(kv, ring_keys="fused")
    tol = max(TYPE_TOL[k_type], TYPE_TOL[v_type])
    ids = np.random.default_rng(11).integers(0, 256, 70).tolist()
    np.testing.assert_allclose(eng.logits(ids[:12], st), ref.forward(ids[:12], rc), rtol=0, atol=tol)
    for i, t in enumerate(ids[12:]):
        if i == 25:
            parent, st = st, st.fork()
            pool.free_sequence(parent.seq_id)
        np.testing.assert_allclose(eng.step(t, st), ref.forward([t], rc)[0], rtol=0, atol=tol, err_msg=f"step {i}")
        for il, lc in enumerate(rc.layers):
            np.testing.assert_array_equal(pool.held(st.seq_id, il), lc.seq[0], err_msg=f"step {i}, layer {il}")
    stats = st.stats()
    assert stats["tokens_evicted"] > 0 and stats["passes"] > 0


def test_paged_pool_type_errors(tmp_path_factory):
    """An unknown type is a ConfigError naming the supported ones; a store whose types are not its
    pool's is refused naming both."""
    from ringllm.runtime.paged_pool import PagedKVPool
    from ringllm.runtime.paged_store import PagedStore

    spec = _tiny("llama", tmp_path_factory).spec
    with pytest.raises(ConfigError, match="k_type 'q5_0' unknown; valid: f32, f16, q8_0, q4_0"):
        PagedKVPool.for_model(spec, 8, k_type="q5_0")
    pool = PagedKVPool.for_model(spec, 8, k_type="q8_0", v_type="q8_0")
    with pytest.raises(ConfigError, match="pool holds k_type 'q8_0' / v_type 'q8_0' rows; the store asks for 'f16'"):
        PagedStore(pool, spec, KVConfig(capacity=16, policy="streaming", k_type="f16", v_type="f16"))


def same_survivor_sets(a, b) -> bool:
    return all(np.array_equal(np.sort(a.seq[il][h, :int(a.count[il][h])]), np.sort(b.seq[il][h, :int(b.count[il][h])]))
               for il in range(len(a.seq)) for h in range(a.seq[il].shape[0]))


@pytest.mark.parametrize("name", ["f32", "q8_0", "q4_0"])
def test_attention_basis_gives_the_scores_and_sums_of_the_values(name):
    """kv_basis (the stored-layout attention's reads): a query taken into the keys' basis dotted with
    rows read in it gives the scores of the decoded rows, and a weighted sum of rows in the basis,
    taken back, the weighted sum of the decoded rows (1e-5 relative: H's sums round)."""
    from ringllm.runtime import kv_basis

    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 40, 64)).astype(np.float32) * 2
    x[..., 9] += 9.0
    rows = kv_codec.encode(x, name)
    values = kv_codec.decode(rows, 64)
    q = rng.standard_normal((3, 64)).astype(np.float32)
    qw = q.copy()
    kv_basis.to_key_basis(qw, 0, 3, rows)
    z = kv_basis.decode_basis(rows[1], 64)
    np.testing.assert_allclose(qw @ z.T, q @ values[1].T, rtol=1e-5, atol=1e-4)
    w = rng.random((3, 40)).astype(np.float32)
    ow = (w @ z).astype(np.float32)
    kv_basis.from_value_basis(ow, 0, 3, rows)
    np.testing.assert_allclose(ow, w @ values[1], rtol=1e-5, atol=1e-4)
    if name == "q4_0":                  # the coefficients are not the values
        assert not np.allclose(z, values[1], atol=0.1)
