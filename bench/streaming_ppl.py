"""StreamingLLM's finding on our engine: streaming perplexity with and without attention sinks, one run.

    python bench/streaming_ppl.py [-m MODEL] [-n 20000] [--capacities 256 512] [-t THREADS]

Every configuration feeds the same N tokens of a novel one at a time through the KV store and
scores every next token (pyengine/perplexity.py `streaming`): the streaming policy at each capacity
with 4 sinks and with 0 sinks (a plain sliding window), and the full cache as the ceiling where
over the first --full-tokens tokens (compare it with the streaming runs' running perplexity at
the same token count, reported every 1,000 tokens). Writes bench/results/streaming_ppl.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, write_results  # noqa: E402

DEFAULT_TEXT = os.path.join(os.path.dirname(__file__), "data", "prideprejudice.txt")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-f", "--file", default=DEFAULT_TEXT)
    ap.add_argument("-n", type=int, default=20000)
    ap.add_argument("--capacities", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--sinks", type=int, nargs="+", default=[4, 0])
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("--full-tokens", type=int, default=4096,
                    help="the full-cache ceiling runs over this many tokens (attention grows with them)")
    args = ap.parse_args()
    from ringllm import perplexity as ppl
    from ringllm.models.bundled import default_model_path
    from ringllm.models.loader import load_model
    from ringllm.runtime.engine import CPUEngine

    path = args.model or default_model_path()
    model = load_model(path)
    ids = model.tokenizer.encode(open(args.file, encoding="utf-8").read(), add_bos=False, parse_special=False)[:args.n]
    eng = CPUEngine(model.spec, model.tensors, n_threads=args.threads)
    rows = []
    configs = [("streaming", c, s) for c in args.capacities for s in args.sinks]
    configs.append(("full", min(len(ids), model.spec.n_ctx, args.full_tokens), 0))
    for policy, cap, sinks in configs:
        st = eng.new_store(capacity=cap, policy=policy, sinks=sinks)
        n = min(len(ids), cap) if policy == "full" else len(ids)
        t0 = time.perf_counter()
        res = ppl.streaming(lambda t: eng.step(t, st), ids, n, report_every=1000)
        row = {"policy": policy, "capacity": cap, "sinks": sinks, "tokens": n, "ppl": res.ppl,
               "running_ppl_every_1000": res.chunk_ppl, "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(row["policy"], cap, sinks, f"{res.ppl:.3f}", f"{row['seconds']:.0f}s", flush=True)
    payload = {"model": os.path.basename(path), "file": os.path.basename(args.file), "machine": machine(), "rows": rows}
    md = [f"# Streaming perplexity: {payload['model']}, {len(ids)} tokens of {payload['file']}\n",
          "Token by token through the KV store (StreamingLLM's protocol), reindexed positions.\n",
          "| policy | capacity | sinks | tokens scored | perplexity |", "|---|---|---|---|---|"]
    md += [f"| {r['policy']} | {r['capacity']} | {r['sinks']} | {r['tokens'] - 1} | {r['ppl']:.3f} |" for r in rows]
    k = rows[-1]["tokens"] // 1000
    if k >= 1:
        md += [f"\nSame first {k * 1000} tokens for every run (running perplexity):\n", "| policy | capacity | sinks | perplexity |",
               "|---|---|---|---|"]
        md += [f"| {r['policy']} | {r['capacity']} | {r['sinks']} | {r['running_ppl_every_1000'][k - 1]:.3f} |"
               for r in rows if len(r["running_ppl_every_1000"]) >= k]
    text = "\n".join(md) + "\n"
    print(text)
    write_results("streaming_ppl", payload, text)


if __name__ == "__main__":
    main()
