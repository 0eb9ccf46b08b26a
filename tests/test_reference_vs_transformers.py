"""The reference engine against transformers (torch CPU, float32) on tiny random checkpoints.

Tolerance: max abs logit difference <= 1e-4 (float32 rounding of two evaluation orders) over a
32-token prompt and 16 incremental decode steps through the cache.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_checkpoints import ARCHS, VOCAB, build_tiny  # noqa: E402

from ringllm.models.loader import load_model  # noqa: E402
from ringllm.runtime.reference import ReferenceEngine  # noqa: E402

TOL = 1e-4


def hf_prefill_then_decode(model, prompt: list[int], steps: list[int]) -> np.ndarray:
    """Logits (len(prompt) + len(steps), vocab): prompt in one call, then one token at a time with the cache."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        logits, past = [out.logits[0]], out.past_key_values
        for tok in steps:
            out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            logits.append(out.logits[0])
            past = out.past_key_values
    return torch.cat(logits).numpy()


@pytest.mark.parametrize("arch", ARCHS)
def test_reference_matches_transformers(arch, tmp_path):
    model = build_tiny(arch, str(tmp_path))
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, VOCAB, 32).tolist()
    steps = rng.integers(0, VOCAB, 16).tolist()
    want = hf_prefill_then_decode(model, prompt, steps)

    loaded = load_model(str(tmp_path), tokenizer=False)
    eng = ReferenceEngine(loaded.spec, loaded.tensors)
    cache = eng.new_cache()
    got = [eng.forward(prompt, cache)] + [eng.forward([t], cache) for t in steps]
    got = np.concatenate(got)
    assert got.shape == want.shape
    assert np.abs(want).max() > 0.5, "logits too small for the comparison to mean anything"
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)


def test_bf16_checkpoint_loads_exact_values(tmp_path):
    """A bf16 safetensors file gives the logits of the f32 model whose weights were rounded to bf16."""
    model = build_tiny("llama", str(tmp_path), dtype=torch.bfloat16)
    prompt = list(range(3, 40))
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0].numpy()
    loaded = load_model(str(tmp_path), tokenizer=False)
    eng = ReferenceEngine(loaded.spec, loaded.tensors)
    np.testing.assert_allclose(eng.forward(prompt, eng.new_cache()), want, rtol=0, atol=TOL)


def test_gemma3_window_really_slides(tmp_path):
    """The tiny Gemma 3 has an 8-token window on layers 0-1: beyond 8 tokens its caches stop growing."""
    build_tiny("gemma3", str(tmp_path))
    loaded = load_model(str(tmp_path), tokenizer=False)
    eng = ReferenceEngine(loaded.spec, loaded.tensors)
    cache = eng.new_cache()
    eng.forward(list(range(20)), cache)
    assert [lc.seq.size for lc in cache.layers] == [8, 8, 20]
    assert cache.layers[0].seq[0].tolist() == list(range(12, 20))


def test_sharded_checkpoint_equals_single_file(tmp_path):
    model = build_tiny("qwen2", str(tmp_path / "single"))
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="40KB")
    import os
    assert os.path.isfile(tmp_path / "sharded" / "model.safetensors.index.json")
    a = load_model(str(tmp_path / "single"), tokenizer=False)
    b = load_model(str(tmp_path / "sharded"), tokenizer=False)
    assert a.tensors.keys() == b.tensors.keys()
    ids = list(range(20))
    ea, eb = ReferenceEngine(a.spec, a.tensors), ReferenceEngine(b.spec, b.tensors)
    np.testing.assert_array_equal(ea.forward(ids, ea.new_cache()), eb.forward(ids, eb.new_cache()))
