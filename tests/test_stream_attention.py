"""step_batch's parallel write + attention of all sequences (runtime/stream_attention.py).

Each sequence of a batch gets bitwise the logits it gets decoding alone, through eviction, in both
position modes and both precisions; the parallel path is taken (counted) for ring stores and left
for policy stores (mixed batches go the per-sequence way, same results); a batch whose stores change
rebuilds its arrays.
"""
from __future__ import annotations

import numpy as np
import pytest

import ringllm.runtime.stream_attention as stream_module
from ringllm.models.loader import load_model
from ringllm.runtime.engine import CPUEngine


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return load_model(smollm2_path, tokenizer=False)


@pytest.fixture
def stream_calls(monkeypatch):
    calls = []
    real = stream_module.write_attend_streams

    def counting(arrays, il, *rest):
        calls.append(il)
        return real(arrays, il, *rest)
    monkeypatch.setattr(stream_module, "write_attend_streams", counting)      # the engine looks it up per call
    return calls


def _batch_vs_alone(eng, kvs, steps=12, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(100, 5000, 20 + 9 * i).tolist() for i in range(len(kvs))]
    stores = [eng.new_store(**kv) for kv in kvs]
    solo = [eng.new_store(**kv) for kv in kvs]
    toks = [int(np.argmax(eng.prefill(p, s))) for p, s in zip(prompts, stores)]
    for p, s in zip(prompts, solo):
        eng.prefill(p, s)
    for _ in range(steps):
        batch = eng.step_batch(toks, stores)
        alone = np.stack([eng.step(t, s).copy() for t, s in zip(toks, solo)])
        np.testing.assert_array_equal(batch, alone)
        toks = [int(np.argmax(r)) for r in batch]


@pytest.mark.parametrize("precision", ["f32", "q8"])
@pytest.mark.parametrize("positions", ["reindexed", "original"])
def test_batch_equals_alone_through_eviction(smollm2, stream_calls, precision, positions):
    eng = CPUEngine(smollm2.spec, smollm2.tensors, precision=precision)
    kv = dict(capacity=40, policy="streaming", sinks=4, positions=positions)
    _batch_vs_alone(eng, [kv, kv, dict(kv, capacity=64), kv])          # prompts of 20..47 tokens: most evict
    assert len(stream_calls) == 12 * smollm2.spec.n_layer


def test_policy_stores_keep_the_per_sequence_path(smollm2, stream_calls):
    eng = CPUEngine(smollm2.spec, smollm2.tensors)
    ring = dict(capacity=40, policy="streaming", sinks=4)
    _batch_vs_alone(eng, [ring, dict(capacity=40, policy="h2o"), ring], steps=6)
    assert stream_calls == []


def test_changed_batch_rebuilds_its_arrays(smollm2):
    eng = CPUEngine(smollm2.spec, smollm2.tensors)
    kv = dict(capacity=32, policy="streaming", sinks=4)
    _batch_vs_alone(eng, [kv, kv], steps=3, seed=1)
    first = eng._streams
    _batch_vs_alone(eng, [kv, kv, kv], steps=3, seed=2)
    assert eng._streams is not first and len(eng._streams.stores) == 3
