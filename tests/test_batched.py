"""Batched decode (CPUEngine.step_batch) against one-sequence decode (CPUEngine.step).

B sequences with their own stores (different capacities, policies, positions and lengths) advance
together; sequences join and leave between steps. Every row's logits equal the same sequence
decoded alone within 1e-4 (the batch runs the projections through the matrix-matrix kernels of
chunked prefill, decode through the matvec kernels: float32 rounding only), greedy tokens are the
same, and every store holds the same survivors as its one-sequence twin.
"""
from __future__ import annotations

import numpy as np
import pytest

from ringllm.models.loader import load_model
from ringllm.runtime.engine import CPUEngine
from ringllm.runtime.errors import ConfigError
from ringllm.runtime.kv_config import KVConfig

BATCH_TOL = 1e-4

CONFIGS = [KVConfig(capacity=32, policy="streaming", sinks=4),
           KVConfig(capacity=48, policy="h2o", sinks=2),
           KVConfig(capacity=24, policy="snapkv", sinks=2, window=4, positions="original"),
           KVConfig(capacity=40, policy="adakv", sinks=2, window=4)]


def _same_stores(a, b) -> None:
    for il in range(len(a.seq)):
        np.testing.assert_array_equal(a.count[il], b.count[il])
        for h in range(a.seq[il].shape[0]):
            n = int(a.count[il][h])
            np.testing.assert_array_equal(np.sort(a.seq[il][h, :n]), np.sort(b.seq[il][h, :n]))


def _batch_vs_alone(eng, prompts, n_steps, join_at=None, leave_at=None):
    """Greedy decode of len(prompts) sequences (config i % len(CONFIGS)), batched and alone.
    join_at: {i: step} sequence i enters the batch at that step; leave_at: {i: step} it leaves."""
    join_at, leave_at = join_at or {}, leave_at or {}
    n = len(prompts)
    cfg = [CONFIGS[i % len(CONFIGS)] for i in range(n)]
    alone = [eng.new_store(c) for c in cfg]
    batch = [eng.new_store(c) for c in cfg]
    next_alone = [int(np.argmax(eng.prefill(p, st))) for p, st in zip(prompts, alone)]
    next_batch = [int(np.argmax(eng.prefill(p, st))) for p, st in zip(prompts, batch)]
    assert next_alone == next_batch
    for step in range(n_steps):
        active = [i for i in range(n) if join_at.get(i, 0) <= step < leave_at.get(i, n_steps)]
        logits = eng.step_batch([next_batch[i] for i in active], [batch[i] for i in active])
        for row, i in enumerate(active):
            want = eng.step(next_alone[i], alone[i]).copy()
            np.testing.assert_allclose(logits[row], want, rtol=0, atol=BATCH_TOL * max(1.0, np.abs(want).max()))
            next_alone[i], next_batch[i] = int(np.argmax(want)), int(np.argmax(logits[row]))
            assert next_alone[i] == next_batch[i], f"sequence {i} step {step}"
    for a, b in zip(alone, batch):
        assert a.n_seen == b.n_seen
        _same_stores(a, b)
    return batch


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    pytest.importorskip("transformers")
    from tiny_checkpoints import build_tiny

    d = str(tmp_path_factory.mktemp("llama"))
    build_tiny("llama", d)
    return load_model(d, tokenizer=False)


def test_tiny_batch_equals_alone_with_join_and_leave(tiny_llama):
    eng = CPUEngine(tiny_llama.spec, tiny_llama.tensors, n_batch=16)
    rng = np.random.default_rng(0)
    prompts = [rng.permutation(256)[:L].tolist() for L in (5, 40, 17, 60, 9)]
    stores = _batch_vs_alone(eng, prompts, 50, join_at={3: 10}, leave_at={1: 30})
    assert all(st.stats()["evicted_total"] > 0 for st in stores)


def test_step_batch_bad_input(tiny_llama):
    eng = CPUEngine(tiny_llama.spec, tiny_llama.tensors)
    a, b = eng.new_store(capacity=8, policy="streaming"), eng.new_store(capacity=8, policy="streaming")
    with pytest.raises(ConfigError, match="one token per store"):
        eng.step_batch([1, 2, 3], [a, b])
    with pytest.raises(ConfigError, match="appears twice"):
        eng.step_batch([1, 2], [a, a])
    with pytest.raises(ConfigError, match="token ids"):
        eng.step_batch([1, 10 ** 6], [a, b])
    assert a.n_seen == b.n_seen == 0          # nothing was written by the refused calls


def test_smollm2_batch_of_four(smollm2_path):
    from conftest import novel_text

    loaded = load_model(smollm2_path)
    eng = CPUEngine(loaded.spec, loaded.tensors)
    text = novel_text()
    prompts = [loaded.tokenizer.encode(text[5000 * i:5000 * i + 800])[:L] for i, L in enumerate((60, 20, 90, 45))]
    _batch_vs_alone(eng, prompts, 40, join_at={2: 5}, leave_at={0: 25})
