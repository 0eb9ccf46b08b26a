"""Decode tokens/s at a full, evicting store for each RoPE strategy and KV update mode, one run.

    python bench/rope_strategies.py [-m MODEL] [--capacity 512] [-n 300] [-t THREADS] [--repeats 3]

rope "fused": keys stored plain, rotated by their slot's logical position as attention reads them.
rope "rk": EQUIP's cached rotate-half: rotate_half(k) stored beside k (+50% KV), two FMAs per dim at read.
rope "kshift": keys stored rotated at their logical position, re-rotated by -1 on every re-index (llama.cpp).
rope "stored": keys rotated once at write by sequence index; the query rotated by the slot offset.
update "inplace" (EQUIP) vs "shift" (HF-style shift-and-append: survivors copied on every eviction).
Writes bench/results/rope_strategies.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, write_results  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--capacity", type=int, default=512)
    ap.add_argument("-n", type=int, default=300)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from ringllm.models.bundled import default_model_path
    from ringllm.models.loader import load_model
    from ringllm.runtime.engine import CPUEngine

    path = args.model or default_model_path()
    model = load_model(path, tokenizer=False)
    fill = np.random.default_rng(0).integers(100, 5000, args.capacity + 16).tolist()
    configs = [(r, "inplace", p) for r in CPUEngine.ROPE_MODES for p in ("reindexed", "original")]
    configs += [(r, "shift", p) for r in ("stored", "fused") for p in ("reindexed", "original")]
    engines = {r: CPUEngine(model.spec, model.tensors, n_threads=args.threads, rope=r) for r in CPUEngine.ROPE_MODES}
    results = {c: [] for c in configs}
    for _ in range(args.repeats):           # interleave configs so drift hits all alike
        for rope, update, positions in configs:
            eng = engines[rope]
            st = eng.new_store(capacity=args.capacity, policy="streaming", sinks=4, positions=positions, update=update)
            logits = eng.prefill(fill, st)  # full store: every step below evicts
            t0 = time.perf_counter()
            for _ in range(args.n):
                logits = eng.step(int(np.argmax(logits)), st)
            results[(rope, update, positions)].append(args.n / (time.perf_counter() - t0))
    base = float(np.median(results[("fused", "shift", "reindexed")]))
    rows = [{"rope": r, "update": u, "positions": p, "tok_s": float(np.median(v)), "runs": v,
             "vs_fused_shift": float(np.median(v)) / base} for (r, u, p), v in results.items()]
    payload = {"model": os.path.basename(path), "capacity": args.capacity, "tokens": args.n, "threads": args.threads,
               "machine": machine(), "rows": rows}
    md = [f"# RoPE strategy x KV update: decode at a full, evicting store (capacity {args.capacity})\n",
          f"{payload['model']}, streaming policy (4 sinks), {args.n} tokens x {args.repeats} interleaved repeats (median), "
          f"{args.threads} threads, {payload['machine']['cpu']}.\n",
          "| rope | update | positions | tok/s | vs fused + shift (HF-style baseline) |", "|---|---|---|---|---|"]
    md += [f"| {r['rope']} | {r['update']} | {r['positions']} | {r['tok_s']:.1f} | {r['vs_fused_shift']:.3f}x |" for r in rows]
    text = "\n".join(md) + "\n"
    print(text)
    write_results("rope_strategies", payload, text)


if __name__ == "__main__":
    main()
