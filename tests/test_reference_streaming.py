"""Streaming eviction and position modes of the reference engine.

Oracle: with a single-layer model, a cached key/value depends only on its own token, so the logits
of a step after evictions equal a fresh transformers forward over just the surviving tokens, at
positions 0..n-1 (reindexed) or at their sequence indices given as position_ids (original).
"""
from __future__ import annotations

import numpy as np
import pytest

from ringllm.runtime.errors import ConfigError
from ringllm.runtime.model_spec import ModelSpec
from ringllm.runtime.reference import ReferenceCache, rope

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def _spec(n_layer=2, window=()):
    return ModelSpec(arch="llama", n_vocab=16, n_embd=8, n_layer=n_layer, n_head=2, n_head_kv=1, head_dim=4,
                     n_ff=16, n_ctx=64, window=window)


def test_cache_keeps_sinks_and_drops_oldest_non_sink():
    cache = ReferenceCache(_spec(), capacity=6, policy="streaming", sinks=2)
    kv = np.zeros((1, 4), np.float32)
    for t in range(10):
        cache.insert(0, kv + t, kv - t, t)
    lc = cache.layers[0]
    assert lc.seq[0].tolist() == [0, 1, 6, 7, 8, 9]
    assert lc.k[0, :, 0].tolist() == [0, 1, 6, 7, 8, 9]   # keys moved with their tokens
    assert cache.key_positions(0).tolist() == [0, 1, 2, 3, 4, 5]
    cache.positions = "original"
    assert cache.key_positions(0).tolist() == [0, 1, 6, 7, 8, 9]


def test_window_layers_slide_without_sinks():
    cache = ReferenceCache(_spec(window=(3, 0)), capacity=5, policy="streaming", sinks=1)
    kv = np.zeros((1, 4), np.float32)
    for t in range(7):
        for il in range(2):
            cache.insert(il, kv, kv, t)
    assert cache.layers[0].seq[0].tolist() == [4, 5, 6]          # the model's window: no sinks
    assert cache.layers[1].seq[0].tolist() == [0, 3, 4, 5, 6]    # the policy: sink 0 + recent


def test_bad_configs_raise():
    with pytest.raises(ConfigError, match="at least sinks \\+ 1"):
        ReferenceCache(_spec(), capacity=4, policy="streaming", sinks=4)
    with pytest.raises(ConfigError, match="positions"):
        ReferenceCache(_spec(), capacity=8, policy="streaming", positions="absolute")
    with pytest.raises(ConfigError, match="policy"):
        ReferenceCache(_spec(), capacity=8, policy="lru")


def test_rope_composes():
    """Rotating by p0 then by p1 equals rotating by p0 + p1 (llama.cpp's RoPE test)."""
    x = np.random.default_rng(0).standard_normal((3, 5, 8)).astype(np.float32)
    p0, p1 = np.array([0, 3, 7, 100, 1000]), np.array([5, 0, 2, 9, 24])
    a = rope(rope(x, p0, 6, 10000.0, 1.0), p1, 6, 10000.0, 1.0)
    b = rope(x, p0 + p1, 6, 10000.0, 1.0)
    np.testing.assert_allclose(a, b, atol=2e-5)
    np.testing.assert_array_equal(a[..., 6:], x[..., 6:])    # partial rotary leaves the tail alone


@pytest.mark.parametrize("positions", ["reindexed", "original"])
def test_streaming_matches_fresh_forward_over_survivors(positions, tmp_path):
    import transformers as tf

    from tiny_checkpoints import build_tiny
    from ringllm.models.loader import load_model
    from ringllm.runtime.reference import ReferenceEngine

    torch.manual_seed(0)
    cfg_model = build_tiny("llama", str(tmp_path))
    one_layer = tf.LlamaConfig(**{**cfg_model.config.to_dict(), "num_hidden_layers": 1})
    model = tf.LlamaForCausalLM(one_layer).eval()
    model.load_state_dict(cfg_model.state_dict(), strict=False)
    model.save_pretrained(str(tmp_path))

    loaded = load_model(str(tmp_path), tokenizer=False)
    eng = ReferenceEngine(loaded.spec, loaded.tensors)
    cap, sinks = 10, 3
    cache = eng.new_cache(capacity=cap, policy="streaming", sinks=sinks, positions=positions)
    ids = np.random.default_rng(3).integers(0, 256, 40).tolist()
    got = eng.forward(ids, cache)
    for t in (9, 10, 17, 39):   # before, at and well after the first eviction
        kept = list(range(sinks)) + list(range(max(sinks, t - cap + 1 + sinks), t + 1)) if t >= cap else list(range(t + 1))
        pos = list(range(len(kept))) if positions == "reindexed" else kept
        with torch.no_grad():
            want = model(torch.tensor([[ids[i] for i in kept]]), position_ids=torch.tensor([pos])).logits[0, -1].numpy()
        np.testing.assert_allclose(got[t], want, rtol=0, atol=1e-4, err_msg=f"step {t}")
