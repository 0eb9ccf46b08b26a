"""bench/transformers_baseline.py's shift-and-append stream, the GPU benchmark's transformers
baseline (run on a GPU machine there, on the CPU here): what it keeps must be what a fresh
transformers forward of the kept tokens at their re-indexed positions holds.

A tiny random Gemma 3 checkpoint (local and global RoPE bases, a sliding window shorter than the
capacity). Layer 0's keys depend only on each token and its position, so after the stream they must
equal layer 0's keys of a fresh forward over the sinks and the most recent tokens: this checks the
eviction, the re-rotation by each layer type's own frequencies, and a sliding-window layer's shift
over the positions it holds.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import transformers_baseline as tb  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def tiny_gemma3(first_layer: str):
    torch.manual_seed(0)
    other = "full_attention" if first_layer == "sliding_attention" else "sliding_attention"
    cfg = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0, max_position_embeddings=512, layer_types=[first_layer, other] * 2,
        bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True)
    return transformers.Gemma3ForCausalLM(cfg).to(torch.float32).eval()


@pytest.mark.parametrize("first_layer", ["sliding_attention", "full_attention"])
def test_shift_append_keeps_what_a_fresh_forward_of_the_kept_tokens_holds(first_layer):
    model = tiny_gemma3(first_layer)
    capacity, sinks, n_tokens = 12, 4, 20
    prompt = np.random.default_rng(1).integers(3, 256, capacity).tolist()
    lat, toks, cache = tb.stream_shift_append(model, torch, "cpu", prompt, n_tokens, capacity, sinks)
    assert lat.shape == (n_tokens,) and cache.get_seq_length() == capacity
    fed = prompt + toks
    kept = fed[:sinks] + fed[len(fed) - (capacity - sinks):]
    with torch.inference_mode():
        fresh = model(torch.tensor([kept]), use_cache=True).past_key_values
    got, want = cache.layers[0].keys, fresh.layers[0].keys
    held = 7 if first_layer == "sliding_attention" else capacity     # a sliding layer keeps window - 1
    assert got.shape == want.shape and got.shape[2] == held
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), float((got - want).abs().max())
    assert torch.allclose(cache.layers[0].values, fresh.layers[0].values, atol=1e-6)


def test_each_layer_type_rotates_with_its_own_frequencies():
    """Gemma 3's local and global layers use different RoPE bases; a single set would shift one of
    them by the wrong angle."""
    model = tiny_gemma3("sliding_attention")
    invs = tb.layer_inv_freqs(model)
    assert len(invs) == 4
    assert torch.equal(invs[0], invs[2]) and torch.equal(invs[1], invs[3]) and not torch.equal(invs[0], invs[1])
    # 1 / 10,000^(2i/d) for the local layers, 1 / 1,000,000^(2i/d) for the global ones
    i = torch.arange(0, 16, 2, dtype=torch.float32) / 16
    assert torch.allclose(invs[0].float(), 1.0 / 10_000.0 ** i) and torch.allclose(invs[1].float(), 1.0 / 1e6 ** i)
