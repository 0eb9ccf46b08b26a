"""Inputs of the aarch64 run (scripts/test_aarch64.sh), made on the host where torch and transformers exist.

    python tests/cross_arch_fixtures.py OUT_DIR

Writes into OUT_DIR:
  tiny/<arch>/          a tiny random checkpoint of each architecture (tests/tiny_checkpoints.py):
                        safetensors for the four HF-loaded ones, a GGUF (tests/gguf_from_hf.py, F32)
                        for the families read from GGUF, one Q8_0 GGUF among them;
  host_tokens.json      the host's CPU-engine greedy tokens on the bundled SmolLM2 for the prompts and
                        KV configurations of tests/test_aarch64.py (CASES), with the host's machine.

tests/test_aarch64.py, run under emulation, loads these with ringllm only (no torch there).
"""
from __future__ import annotations

import json
import os
import platform
import sys

# (name, prompt, n tokens, KVConfig kwargs): one run without eviction, one through an evicting policy
CASES = [
    ("full", "The capital of France is", 24, {}),
    ("h2o", "Once upon a time, in a small village by the sea, there lived", 40,
     {"capacity": 24, "policy": "h2o", "sinks": 4}),
]
HF_ARCHS = ("llama", "qwen2", "gemma3", "gptneox")
GGUF_ARCHS = ("qwen3", "phi3", "phi3_longrope", "gemma2", "gemma3_6", "smollm3", "llama3_scaled", "llama_yarn")
Q8_ARCH = "qwen3"        # also written with Q8_0 matrices


def host_tokens(model_path: str) -> dict:
    """{case name: greedy token ids} from the host's CPU engine on the bundled model."""
    import numpy as np

    from ringllm.models.loader import load_model
    from ringllm.runtime.engine import CPUEngine
    from ringllm.runtime.kv_config import KVConfig

    m = load_model(model_path)
    eng = CPUEngine(m.spec, m.tensors)
    out = {}
    for name, prompt, n, kv in CASES:
        st = eng.new_store(KVConfig(**kv) if kv else KVConfig(capacity=None, policy="full"))
        toks = [int(np.argmax(eng.prefill(m.tokenizer.encode(prompt), st)))]
        while len(toks) < n:
            toks.append(int(np.argmax(eng.step(toks[-1], st))))
        out[name] = toks
    return out


def build(out_dir: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gguf_from_hf import write_gguf
    from tiny_checkpoints import build_tiny

    from ringllm.models.bundled import default_model_path

    for arch in HF_ARCHS + GGUF_ARCHS:
        d = os.path.join(out_dir, "tiny", arch)
        os.makedirs(d, exist_ok=True)
        build_tiny(arch, d)
        if arch in GGUF_ARCHS:
            write_gguf(d, os.path.join(d, "model.gguf"))
            if arch == Q8_ARCH:
                write_gguf(d, os.path.join(d, "model-q8_0.gguf"), qtype="Q8_0")
    payload = {"machine": platform.machine(), "tokens": host_tokens(default_model_path())}
    with open(os.path.join(out_dir, "host_tokens.json"), "w", encoding="utf-8") as fh:
        json.dump(payload, fh)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.split("\n\n")[1])
    build(sys.argv[1])
