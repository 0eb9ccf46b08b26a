"""Real GGUF models through the reference engine vs transformers loading the same GGUF (dequantized to f32).

Both sides use identical dequantized weights and float32 activations, so the only difference is
evaluation order: tolerance max abs logit diff <= 1e-3 and the same argmax at every position of a
64-token prompt taken from Pride and Prejudice.
"""
from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import novel_text  # noqa: E402

from ringllm.models.loader import load_model  # noqa: E402
from ringllm.runtime.reference import ReferenceEngine  # noqa: E402

TOL = 1e-3
N_TOKENS = 64


@contextlib.contextmanager
def _one_gguf_parse():
    """transformers parses the GGUF once for the config, once for the tokenizer and once for the
    weights, each a fresh `gguf.GGUFReader` (slow for Gemma 3's 262k-string vocabulary); while this
    is open, a second reader of the same file, unchanged, is the first one (read-only, so the same
    fields and tensors). Dropped on exit: a parsed vocabulary of that size holds most of a GB."""
    import gguf

    made, real = {}, gguf.GGUFReader

    def reader(path, mode="r"):
        st = os.stat(path)
        key = (os.path.realpath(path), mode, st.st_size, st.st_mtime_ns)
        if key not in made:
            made[key] = real(path, mode)
        return made[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real
        made.clear()


def _hf_gguf(path: str):
    d, f = os.path.dirname(path), os.path.basename(path)
    with _one_gguf_parse():
        tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    return tok, model


@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_gguf_logits_match_transformers(which, request):
    path = request.getfixturevalue(f"{which}_path")
    tok, model = _hf_gguf(path)
    text = novel_text()[5000:9000]
    ids = tok(text)["input_ids"][:N_TOKENS]
    assert len(ids) == N_TOKENS
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    del model

    loaded = load_model(path, tokenizer=False)
    eng = ReferenceEngine(loaded.spec, loaded.tensors)
    got = eng.forward(ids, eng.new_cache())
    diff = np.abs(got - want).max()
    print(f"{which}: max abs logit diff {diff:.2e}, logit range {want.min():.1f}..{want.max():.1f}")
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert diff <= TOL
