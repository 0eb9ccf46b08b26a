"""The model files the GPU check builds (scripts/gpu_check.sh): bench/truncated_gguf.py's cut and
tiling of a GGUF, and bench/random_hf_checkpoint.py's random checkpoint in a real config.

Checked on a small file here: a cut keeps every non-layer tensor and key, tiling restores the
layer count with layer i's bytes equal to the cut's layer i % N, and both load in ringllm with the
source's spec apart from the layer count.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import random_hf_checkpoint as rhc  # noqa: E402
import synthetic_gguf as sg  # noqa: E402
import truncated_gguf as tg  # noqa: E402


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A 5-layer synthetic Qwen3 GGUF (the tiny shape with more layers)."""
    from dataclasses import replace

    shape = replace(sg.tiny("qwen3-1.7b"), n_layer=5)
    path = str(tmp_path_factory.mktemp("src") / "qwen3-5.gguf")
    return sg.write_synthetic(shape, path)


def test_cut_then_tile(source, tmp_path):
    from ringllm.models.loader import load_model

    cut, tiled = str(tmp_path / "cut.gguf"), str(tmp_path / "tiled.gguf")
    tg.truncate(source, 2, cut)
    tg.truncate(cut, 2, tiled, tile=5)
    src, c, t = (load_model(p, tokenizer=False) for p in (source, cut, tiled))
    assert c.spec.n_layer == 2 and t.spec.n_layer == 5
    assert c.spec.n_embd == src.spec.n_embd and c.spec.head_dim == src.spec.head_dim
    assert {n for n in c.tensors if not n.startswith("blk.")} == {n for n in src.tensors if not n.startswith("blk.")}
    assert set(t.tensors) == set(src.tensors)
    for name, q in t.tensors.items():
        if name.startswith("blk."):
            il, rest = name[4:].split(".", 1)
            want = c.tensors[f"blk.{int(il) % 2}.{rest}"]
        else:
            want = src.tensors[name]
        assert q.qtype == want.qtype and q.shape == want.shape and np.array_equal(q.data, want.data), name
    assert load_model(tiled).tokenizer.encode("ab") == load_model(source).tokenizer.encode("ab")


def test_cut_refuses_a_layer_count_out_of_range(source, tmp_path):
    with pytest.raises(SystemExit, match="1..5"):
        tg.truncate(source, 6, str(tmp_path / "x.gguf"))


def test_random_checkpoint_loads_with_the_real_config(tmp_path):
    pytest.importorskip("transformers")
    from ringllm.models.loader import load_model

    out = rhc.build("gemma3-270m", str(tmp_path / "g3"), n_layer=2)
    m = load_model(out, tokenizer=False)
    cfg = rhc.CONFIGS["gemma3-270m"]
    assert (m.spec.arch, m.spec.n_layer, m.spec.n_embd, m.spec.n_vocab) == ("gemma3", 2, cfg["hidden_size"],
                                                                              cfg["vocab_size"])
    assert m.spec.head_dim == 256 and m.spec.n_head_kv == 1 and m.spec.window[0] == 512


def test_stream_summary_flatness_after_the_store_fills_and_from_10k():
    """A store that keeps growing until 15,000 tokens in (as a pyramidkv layer budget over the
    capacity can) looks 1.5x slower at the end than just after `capacity` tokens, and flat from
    the 20,000th token on; every field the GPU report prints is there."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import gpu_speed

    ms = np.concatenate([np.linspace(1.0, 1.5, 15000), np.full(35000, 1.5)])
    out = gpu_speed.stream_summary(ms / 1e3, 512, 49488)
    assert out["flat"] > 1.35 and out["last_p50_ms"] == pytest.approx(1.5)
    assert len(out["p50_each_10k_ms"]) == 5 and out["p50_each_10k_ms"][1:] == pytest.approx([1.5] * 4, abs=0.02)
    assert out["flat_from_10k"] == pytest.approx(1.5 / out["p50_each_10k_ms"][0])
    short = gpu_speed.stream_summary(np.full(3000, 1e-3), 512, 0)
    assert "flat_from_10k" not in short and short["p50_each_10k_ms"] == [] and short["flat"] == pytest.approx(1.0)
