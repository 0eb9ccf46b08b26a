"""The whole-chunk prefill attention (runtime/chunk_attention.py) against the reference engine.

A prompt that fits the store goes through write_attend_chunk (counted), in several chunks, both
position modes, and the logits match the NumPy reference (1e-3, as every engine test); so do the
decode steps after it, which read the keys the chunk path wrote. A store that has evicted, a chunk
that would evict, and a policy layer keep the per-token path; so does a chunk attending fewer
query-key pairs than CPUEngine.chunk_min_pairs (the tests below set it to 0 to reach the path with
tiny prompts, except the one that checks the rule).
"""
from __future__ import annotations

import numpy as np
import pytest

import ringllm.runtime.engine as engine_module
from ringllm.models.loader import load_model
from ringllm.runtime.chunk_attention import MIN_PAIRS, chunk_fits, chunk_pays
from ringllm.runtime.engine import CPUEngine
from ringllm.runtime.reference import ReferenceEngine

TOL = 1e-3


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request, tmp_path_factory):
    pytest.importorskip("transformers")
    from tiny_checkpoints import build_tiny

    d = str(tmp_path_factory.mktemp(request.param))
    build_tiny(request.param, d)
    return load_model(d, tokenizer=False)


@pytest.fixture
def chunk_calls(monkeypatch):
    calls = []
    real = engine_module.write_attend_chunk

    def counting(store, il, rope, out, q, *rest):
        calls.append((il, q.shape[0]))
        return real(store, il, rope, out, q, *rest)
    monkeypatch.setattr(engine_module, "write_attend_chunk", counting)
    return calls


@pytest.mark.parametrize("positions", ["reindexed", "original"])
def test_chunks_match_reference(tiny, chunk_calls, positions):
    prompt = np.random.default_rng(3).integers(0, 256, 45).tolist()
    eng = CPUEngine(tiny.spec, tiny.tensors, n_batch=16)
    eng.chunk_min_pairs = 0
    ref = ReferenceEngine(tiny.spec, tiny.tensors)
    st = eng.new_store(capacity=64, policy="full", positions=positions)
    rc = ref.new_cache(capacity=64, policy="full", positions=positions)
    np.testing.assert_allclose(eng.logits(prompt, st), ref.forward(prompt, rc), rtol=0, atol=TOL)
    assert sorted({T for _, T in chunk_calls}) == [13, 16]          # chunks of 16, 16, 13 rows
    roomy = sum(st.k[il].shape[1] >= len(prompt) for il in range(tiny.spec.n_layer))   # not Gemma 3's windows
    assert roomy >= 1 and len(chunk_calls) == 3 * roomy
    for tok in (5, 9, 200):
        np.testing.assert_allclose(eng.logits([tok], st), ref.forward([tok], rc), rtol=0, atol=TOL)


def test_eviction_keeps_the_per_token_path(tiny, chunk_calls):
    prompt = np.random.default_rng(4).integers(0, 256, 40).tolist()
    eng = CPUEngine(tiny.spec, tiny.tensors, n_batch=16)
    eng.chunk_min_pairs = 0
    ref = ReferenceEngine(tiny.spec, tiny.tensors)
    st = eng.new_store(capacity=24, policy="streaming", sinks=4)
    rc = ref.new_cache(capacity=24, policy="streaming", sinks=4)
    np.testing.assert_allclose(eng.logits(prompt, st), ref.forward(prompt, rc), rtol=0, atol=TOL)
    # the first chunk (16 rows into 24 empty slots) fits; the second would evict, the third follows an eviction
    assert {T for _, T in chunk_calls} == {16}
    assert len(chunk_calls) == sum(st.k[il].shape[1] >= 16 for il in range(tiny.spec.n_layer))
    assert not chunk_fits(st, 0, 2)
    h2o = eng.new_store(capacity=32, policy="h2o")
    assert not any(chunk_fits(h2o, il, 2) for il in range(tiny.spec.n_layer) if h2o.uses_policy(il))


def test_few_pairs_keep_the_per_token_path(tiny, chunk_calls):
    """Default threshold: a 64-row first chunk (64 x 64 pairs) goes token by token, the second
    (64 x 128 = MIN_PAIRS) at once; the logits match the reference either way."""
    assert MIN_PAIRS == 64 * 128 and not chunk_pays(0, 64) and chunk_pays(64, 64)
    prompt = np.random.default_rng(5).integers(0, 256, 128).tolist()
    eng = CPUEngine(tiny.spec, tiny.tensors, n_batch=64)
    ref = ReferenceEngine(tiny.spec, tiny.tensors)
    st = eng.new_store(capacity=160, policy="full")
    rc = ref.new_cache(capacity=160, policy="full")
    np.testing.assert_allclose(eng.logits(prompt, st), ref.forward(prompt, rc), rtol=0, atol=TOL)
    roomy = sum(st.k[il].shape[1] >= len(prompt) for il in range(tiny.spec.n_layer))
    assert roomy >= 1 and len(chunk_calls) == roomy and {T for _, T in chunk_calls} == {64}
