"""ringllm on aarch64: the run scripts/test_aarch64.sh makes under qemu user-mode emulation.

Skipped elsewhere: these tests read the inputs tests/cross_arch_fixtures.py makes on the host
(RINGLLM_CROSS_FIXTURES names their folder), since torch and transformers do not run in the
emulated sysroot. Beside this file, the aarch64 run also takes the architecture-independent
suites named in scripts/test_aarch64.sh (every quant type's matvec and matmul against gguf's
dequantization, every policy's known answers, the KV store, fast exp).

  * every architecture's tiny random checkpoint (safetensors and GGUF, one Q8_0 file): the Numba
    engine against the NumPy reference engine, prompt and decode steps through streaming eviction
    (tests/test_engine.py run_pair, 1e-4);
  * the bundled SmolLM2: the greedy tokens of the host's CPU engine, token for token, with and
    without an evicting policy.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from cross_arch_fixtures import GGUF_ARCHS, HF_ARCHS, Q8_ARCH, host_tokens

FIXTURES = os.environ.get("RINGLLM_CROSS_FIXTURES")
pytestmark = pytest.mark.skipif(not FIXTURES, reason="runs under scripts/test_aarch64.sh, which makes its inputs")


def tiny_path(arch: str) -> str:
    base = arch.removesuffix("-q8_0")
    d = os.path.join(FIXTURES, "tiny", base)
    if arch.endswith("-q8_0"):
        return os.path.join(d, "model-q8_0.gguf")
    return os.path.join(d, "model.gguf") if base in GGUF_ARCHS else d


@pytest.mark.parametrize("arch", HF_ARCHS + GGUF_ARCHS + (f"{Q8_ARCH}-q8_0",))
def test_architecture_matches_reference_engine(arch):
    from test_engine import run_pair

    from ringllm.models.loader import load_model

    loaded = load_model(tiny_path(arch), tokenizer=False)
    prompt = np.random.default_rng(0).integers(0, 256, 20).tolist()
    st = run_pair(loaded, prompt, 6, capacity=12, policy="streaming", positions="reindexed")
    assert st.stats()["evicted_total"] > 0


def test_bundled_model_tokens_match_the_host(smollm2_path):
    with open(os.path.join(FIXTURES, "host_tokens.json"), encoding="utf-8") as fh:
        want = json.load(fh)
    got = host_tokens(smollm2_path)
    for name, toks in want["tokens"].items():
        first = next((i for i, (a, b) in enumerate(zip(got[name], toks)) if a != b), None)
        assert got[name] == toks, f"{name}: first token that differs from the {want['machine']} host's at {first}"
