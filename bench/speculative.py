"""Greedy speculative decoding on the CPU engine: acceptance rate and speed against plain decoding.

    python bench/speculative.py [-m MODEL] [-n 500] [--gammas 3,7] [--draft-layers 8,16] [--draft-capacity 64]
                                [--configs streaming:512,h2o:256] [--prompt-tokens 200] [-t THREADS]
                                [--precision f32|q8] [--name speculative]

Per target KV config (policy:capacity): plain greedy decoding of n tokens (tokens/s after the
prefill), then speculative decoding with each draft and gamma, checked token for token against the
plain output:
  layers:N      the same model's first N layers + final norm + head (early-exit self-draft)
  store:C       the full model over a streaming store of capacity C
Also the verify cost: time of one forward of T rows (T = 1..8) through the target store, journaled
and rolled back (so every T sees the same store), divided by one decode step. Below
matvec.MATMUL_MIN_T rows the verify runs the few-row products (the rows in pairs through each weight
tile, bitwise equal to decoding); from there on the tiled kernels read each weight tile once for all rows.
Writes bench/results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, write_results  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data", "prideprejudice.txt")


def verify_cost(eng, kv, prompt, reps, max_t=8):
    """{T: seconds of one T-row forward} over a store that has seen the prompt (journaled, rolled back)."""
    st = eng.new_store(kv)
    eng.prefill(prompt, st)
    ids = prompt[:max_t]
    out = {}
    for T in range(1, max_t + 1):
        times = []
        for r in range(reps + 1):
            st.begin_journal(T)
            t0 = time.perf_counter()
            eng.logits(ids[:T], st, few_rows=True)          # as speculative_generate verifies
            dt = time.perf_counter() - t0
            st.rollback(0)
            st.commit()
            if r:
                times.append(dt)
        out[T] = float(np.median(times))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-n", type=int, default=500)
    ap.add_argument("--gammas", default="3,7")
    ap.add_argument("--draft-layers", default="8,16")
    ap.add_argument("--draft-capacity", type=int, default=64)
    ap.add_argument("--configs", default="streaming:512,h2o:256")
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--verify-reps", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--name", default="speculative")
    ap.add_argument("--precision", choices=("f32", "q8"), default="f32", help="CPUEngine(precision=...) of target and drafts")
    args = ap.parse_args()

    from ringllm.models.bundled import default_model_path
    from ringllm.models.loader import load_model
    from ringllm.runtime.engine import CPUEngine
    from ringllm.runtime.kv_config import KVConfig
    from ringllm.runtime.speculative import greedy_generate, make_layer_draft, speculative_generate

    m = load_model(args.model or default_model_path())
    text = open(DATA, encoding="utf-8").read()[:max(4000, 8 * args.prompt_tokens)]
    prompt = m.tokenizer.encode(text)[:args.prompt_tokens]
    target = CPUEngine(m.spec, m.tensors, n_threads=args.threads, precision=args.precision)
    gammas = [int(g) for g in args.gammas.split(",")]
    layer_drafts = {n: make_layer_draft(m.spec, m.tensors, n, n_threads=args.threads, precision=args.precision)
                    for n in (int(x) for x in args.draft_layers.split(",") if x)}
    results = {"machine": machine(), "args": vars(args), "model": os.path.basename(m.path),
               "n_layer": m.spec.n_layer, "configs": []}
    md = ["# Speculative decoding on the CPU (greedy)", "",
          f"Model {os.path.basename(m.path)}, {args.n} tokens after a {len(prompt)}-token prompt (the novel), "
          f"threads {args.threads or 'all'}, precision {args.precision}. Command: `python bench/speculative.py "
          f"{' '.join(sys.argv[1:])}`. Drafts: `layers:N` = the first N of "
          f"{m.spec.n_layer} layers + head (early exit); `store:C` = the full model over a streaming store of C.", ""]
    for cfg in args.configs.split(","):
        policy, cap = cfg.split(":")
        kv = KVConfig(capacity=int(cap), policy=policy, sinks=4)
        want, plain_s = greedy_generate(target, target.new_store(kv), prompt, args.n)
        plain_tps = (args.n - 1) / plain_s
        vc = verify_cost(target, kv, prompt, args.verify_reps)
        entry = {"kv": cfg, "plain_tok_s": plain_tps, "verify_s": vc,
                 "verify_ratio": {T: vc[T] / vc[1] for T in vc}, "runs": []}
        print(cfg, "plain", round(plain_tps, 2), "tok/s; verify ratio", {T: round(r, 2) for T, r in
                                                                          entry["verify_ratio"].items()}, flush=True)
        drafts = [(f"layers:{n}", eng, kv) for n, eng in layer_drafts.items()]
        drafts.append((f"store:{args.draft_capacity}", target,
                       KVConfig(capacity=args.draft_capacity, policy="streaming", sinks=4)))
        for name, deng, dkv in drafts:
            for g in gammas:
                got, st = speculative_generate(target, target.new_store(kv), deng, deng.new_store(dkv), prompt,
                                               args.n, g)
                same = got == want
                first_diff = None if same else next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
                run = {"draft": name, "gamma": g, "same_output": same, "first_diff": first_diff,
                       "tok_s": (args.n - 1) / st["total_s"], "speedup": plain_s / st["total_s"], **st}
                entry["runs"].append(run)
                print(cfg, name, g, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in run.items()},
                      flush=True)
        results["configs"].append(entry)
        md += [f"## Target KV {cfg}", "",
               f"Plain greedy: {plain_tps:.2f} tokens/s. Verify cost of T rows / one decode step: " +
               ", ".join(f"T={T}: {r:.2f}" for T, r in entry["verify_ratio"].items()) + ".", "",
               "| draft | gamma | same output | acceptance | tokens/round | tokens/s | speedup | draft s | verify s | "
               "rollback s |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in entry["runs"]:
            md.append(f"| {r['draft']} | {r['gamma']} | {'yes' if r['same_output'] else 'NO at ' + str(r['first_diff'])} "
                      f"| {r['acceptance']:.2f} | {r['tokens_per_round']:.2f} | {r['tok_s']:.2f} | {r['speedup']:.2f}x "
                      f"| {r['draft_s']:.1f} | {r['verify_s']:.1f} | {r['rollback_s']:.2f} |")
        md.append("")
    md += [f"Machine: {results['machine']['cpu']}, {results['machine']['cores']} cores."]
    write_results(args.name, results, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
