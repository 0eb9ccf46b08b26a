"""bench/kv_quality.py's attention loss on a model with sliding-window layers (tiny random Gemma 3,
window 8): tokens are matched by sequence index, so a layer whose full store is a ring (slot j no
longer token j once the window wrapped) counts no mass as lost that the policy's store still holds."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from ringllm.models.loader import load_model
from ringllm.runtime.engine import CPUEngine
from ringllm.runtime.kv_config import KVConfig

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from kv_quality import attention_loss  # noqa: E402


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    pytest.importorskip("transformers")
    from tiny_checkpoints import build_tiny

    d = str(tmp_path_factory.mktemp("gemma3"))
    build_tiny("gemma3", d)
    model = load_model(d, tokenizer=False)
    assert 0 < max(model.spec.window) < 40
    return model


def test_nothing_evicted_means_no_loss_past_the_window(tiny_gemma3):
    eng = CPUEngine(tiny_gemma3.spec, tiny_gemma3.tensors)
    ids = np.random.default_rng(0).integers(0, 256, 40)
    # capacity above the length: the policy's store holds what the full one holds on every layer
    assert attention_loss(eng, KVConfig(capacity=64, policy="h2o", sinks=4), ids) == 0.0


def test_loss_of_a_small_budget_is_a_share(tiny_gemma3):
    eng = CPUEngine(tiny_gemma3.spec, tiny_gemma3.tensors)
    ids = np.random.default_rng(1).integers(0, 256, 40)
    small = attention_loss(eng, KVConfig(capacity=12, policy="streaming", sinks=2), ids)
    larger = attention_loss(eng, KVConfig(capacity=24, policy="streaming", sinks=2), ids)
    assert 0.0 < larger < small < 1.0
