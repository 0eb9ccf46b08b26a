"""The Numba CPU engine against the NumPy reference engine (its oracle).

Tiny random checkpoints of all four architectures, and the real SmolLM2 / Gemma 3: same greedy
tokens and per-step logits within 1e-3 max abs, through eviction (streaming, both position modes)
and chunked prefill longer than the capacity.
"""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from ringllm.models.loader import load_model
from ringllm.runtime.engine import CPUEngine
from ringllm.runtime.errors import ConfigError
from ringllm.runtime.reference import ReferenceEngine

TOL = 1e-3


def greedy(step, first_logits, n):
    """n greedy tokens and the logits that chose them."""
    toks, all_logits = [], [first_logits.copy()]
    logits = first_logits
    for _ in range(n):
        tok = int(np.argmax(logits))
        toks.append(tok)
        logits = step(tok)
        all_logits.append(np.array(logits, copy=True))
    return toks, np.stack(all_logits)


def run_pair(loaded, prompt, n_gen, capacity, policy, positions, n_batch=16, rope="stored", update="inplace"):
    eng = CPUEngine(loaded.spec, loaded.tensors, n_batch=n_batch, rope=rope)
    ref = ReferenceEngine(loaded.spec, loaded.tensors)
    st = eng.new_store(capacity=capacity, policy=policy, sinks=4, positions=positions, update=update)
    rc = ref.new_cache(capacity=capacity, policy=policy, sinks=4, positions=positions)
    got_prompt = eng.logits(prompt, st)
    want_prompt = ref.forward(prompt, rc)
    np.testing.assert_allclose(got_prompt, want_prompt, rtol=0, atol=TOL)
    toks_e, logits_e = greedy(lambda t: eng.step(t, st), got_prompt[-1], n_gen)
    toks_r, logits_r = greedy(lambda t: ref.forward([t], rc)[0], want_prompt[-1], n_gen)
    assert toks_e == toks_r
    np.testing.assert_allclose(logits_e, logits_r, rtol=0, atol=TOL)
    return st


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3", "gptneox"])
def tiny(request, tmp_path_factory):
    pytest.importorskip("transformers")
    from tiny_checkpoints import build_tiny

    d = str(tmp_path_factory.mktemp(request.param))
    build_tiny(request.param, d)
    return load_model(d, tokenizer=False)


@pytest.mark.parametrize("rope,update", [("stored", "inplace"), ("fused", "inplace"), ("rk", "inplace"),
                                         ("kshift", "inplace"), ("stored", "shift")])
@pytest.mark.parametrize("positions", ["reindexed", "original"])
def test_tiny_models_streaming(tiny, positions, rope, update):
    prompt = np.random.default_rng(0).integers(0, 256, 50).tolist()   # > capacity: chunked prefill evicts
    st = run_pair(tiny, prompt, 40, capacity=12, policy="streaming", positions=positions, rope=rope, update=update)
    assert st.stats()["evicted_total"] > 0


def test_tiny_models_full_cache(tiny):
    prompt = np.random.default_rng(1).integers(0, 256, 33).tolist()
    run_pair(tiny, prompt, 20, capacity=None, policy="full", positions="reindexed", n_batch=8)


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_compile_ahead_calls_leave_a_run_unchanged(tiny, policy):
    """attend_empty (a compile helper's first kernel) and warm_ahead's jobs (what a cold start's parent
    compiles while it waits for the helper) touch no store, run buffer or logits a run holds: a run they
    interrupt gives the same bits, and a store attend_empty ran on is still empty."""
    prompt = np.random.default_rng(2).integers(0, 256, 33).tolist()
    eng = CPUEngine(tiny.spec, tiny.tensors, n_batch=8)
    new = lambda: eng.new_store(capacity=12, policy=policy, sinks=4)
    ref_store = new()
    want = [eng.logits(prompt, ref_store)] + [eng.step(t, ref_store).copy() for t in (5, 6)]
    st, empty = new(), new()
    eng.attend_empty(empty)
    assert empty.n_seen == 0 and int(np.sum(empty.count)) == 0
    got = [eng.logits(prompt[:16], st)]
    jobs = eng.warm_ahead()
    assert len(jobs) >= 3
    for job in jobs:
        job()
    eng.attend_empty(empty)
    got[0] = np.concatenate([got[0], eng.logits(prompt[16:], st)])
    step = eng.step(5, st)
    kept = step.copy()
    for job in jobs:
        job()
    np.testing.assert_array_equal(step, kept)
    got += [kept, eng.step(6, st).copy()]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    alive = weakref.ref(eng)               # queued jobs hold the engine weakly: dropped, it is freed
    del eng, new
    gc.collect()
    assert alive() is None
    for job in jobs:
        job()                              # and its jobs do nothing


def test_bad_engine_options(tiny):
    with pytest.raises(ConfigError, match="n_threads"):
        CPUEngine(tiny.spec, tiny.tensors, n_threads=0)
    with pytest.raises(ConfigError, match="rope"):
        CPUEngine(tiny.spec, tiny.tensors, rope="cached")
    eng = CPUEngine(tiny.spec, tiny.tensors)
    st = eng.new_store(capacity=None, policy="full")
    with pytest.raises(ConfigError, match="token ids"):
        eng.logits([0, 10_000], st)
    with pytest.raises(ConfigError, match="exceed the model's context"):
        eng.logits([1] * (tiny.spec.n_ctx + 1), st)
    assert st.n_seen == 0   # nothing half-fed


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return load_model(smollm2_path)


@pytest.mark.slow
@pytest.mark.parametrize("positions", ["reindexed", "original"])
def test_smollm2_1000_tokens_capacity_64(smollm2, positions):
    """Issue acceptance: 1,000 greedy tokens at capacity 64, sinks 4 (over 900 evictions per head);
    CI's short form: 300 tokens."""
    from conftest import full_or_short, novel_text
    prompt = smollm2.tokenizer.encode(novel_text()[20000:20400])[:40]
    n_gen = full_or_short(1000, 300)
    st = run_pair(smollm2, prompt, n_gen, capacity=64, policy="streaming", positions=positions)
    assert st.stats()["evicted_total"] >= (n_gen - 100) * smollm2.spec.n_layer * smollm2.spec.n_head_kv


@pytest.mark.slow
@pytest.mark.parametrize("positions", ["reindexed", "original"])
def test_smollm2_2000_token_prompt_capacity_512(smollm2, positions):
    """Issue acceptance: a 2,000-token prompt streams through a 512-slot store in prefill chunks; CI's
    short form: 800 tokens (the store full, then five 64-token chunks that evict)."""
    from conftest import full_or_short, novel_text
    n_prompt = full_or_short(2000, 800)
    prompt = smollm2.tokenizer.encode(novel_text()[30000:45000])[:n_prompt]
    assert len(prompt) == n_prompt
    st = run_pair(smollm2, prompt, 50, capacity=512, policy="streaming", positions=positions, n_batch=64)
    assert st.stats()["evicted_total"] >= (n_prompt - 500) * smollm2.spec.n_layer * smollm2.spec.n_head_kv


@pytest.mark.slow
def test_gemma3_engine_matches_reference(gemma3_path):
    """Gemma 3 270M (Q5_0, Q4_K, Q6_K, Q8_0 kernels; sliding-window layers) through eviction, every RoPE strategy."""
    loaded = load_model(gemma3_path)
    from conftest import novel_text
    prompt = loaded.tokenizer.encode(novel_text()[50000:52000])[:48]
    for rope in CPUEngine.ROPE_MODES:
        run_pair(loaded, prompt, 12, capacity=24, policy="streaming", positions="reindexed", rope=rope)


@pytest.mark.parametrize("rope", CPUEngine.ROPE_MODES)
def test_mass_hook_sees_each_attention_step(tiny, rope):
    """The measurement hook gets every layer's per-slot mass: group-summed softmax weights (sum = group)."""
    eng = CPUEngine(tiny.spec, tiny.tensors, rope=rope)
    st = eng.new_store(capacity=10, policy="streaming", sinks=2)
    seen = []
    st.mass_hook = lambda il, mass, store: seen.append((il, mass[:, :int(store.count[il][0])].sum(axis=1).copy()))
    eng.logits(list(range(3, 17)), st)
    group = tiny.spec.n_head // tiny.spec.n_head_kv
    assert len(seen) == 14 * tiny.spec.n_layer
    for _, sums in seen:
        np.testing.assert_allclose(sums, group, rtol=1e-5)
