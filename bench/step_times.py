"""Per-step decode times and prefill time of the CPU engine, in a form that survives a noisy machine.

    python bench/step_times.py [-m MODEL] [-t THREADS] [--steps 300] [--json]

For an A/B of two checkouts: run it alternately from each (one process per sample) and compare the
minima over samples. Each figure is already robust within a sample: a decode figure is the 10th
percentile of per-step times (a burst of another process's work lands in the upper tail), prefill
is the fastest of 5 prompts of 512 tokens. Policies at budget 256 after a 300-token prompt, so every
step evicts; `full` decodes without eviction. bench/results/runtime_core_ab.md has an A/B made so.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None, help="GGUF/safetensors path (default: the bundled SmolLM2)")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--policies", default="streaming,h2o,tova,snapkv,adakv,rkv")
    args = ap.parse_args()
    from ringllm.models.bundled import default_model_path
    from ringllm.models.loader import load_model
    from ringllm.runtime.engine import CPUEngine
    from ringllm.runtime.kv_config import KVConfig

    m = load_model(args.model or default_model_path(), tokenizer=False)
    eng = CPUEngine(m.spec, m.tensors, n_threads=args.threads, n_batch=512)
    prompt = np.random.default_rng(0).integers(100, min(5000, m.spec.n_vocab), 512).tolist()

    def step_ms(kv, n, pre):
        st = eng.new_store(kv)
        tok = int(np.argmax(eng.prefill(prompt[:pre], st)))
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            logits = eng.step(tok, st)
            ts.append(time.perf_counter() - t0)
            tok = int(np.argmax(logits))
        return float(np.percentile(ts, 10) * 1e3)

    step_ms(KVConfig(policy="full", capacity=1024), 16, 16)         # warm-up: kernels from the cache
    pre = []
    for _ in range(5):
        st = eng.new_store(KVConfig(policy="full", capacity=1024))
        t0 = time.perf_counter()
        eng.prefill(prompt, st)
        pre.append(time.perf_counter() - t0)
    out = {"pp512_ms_min": min(pre) * 1e3,
           "step_full_ms_p10": step_ms(KVConfig(policy="full", capacity=1024), args.steps, 8)}
    for p in args.policies.split(","):
        out[f"step_{p}_ms_p10"] = step_ms(KVConfig(policy=p, capacity=256, sinks=4), args.steps, 300)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
