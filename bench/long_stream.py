"""Long streams: per-token latency and memory over N generated tokens at a fixed KV capacity, one run.

    python bench/long_stream.py [-m MODEL] [-n 20000] [--capacity 512] [--sinks 4] [-t THREADS]

Three runs, same model, threads and capacity:
  ringllm in-place   the fixed store, the new token overwrites the victim's slot (EQUIP)
  ringllm shift      the same engine and kernels, survivors copied down on every eviction (HF-style)
  llama.cpp          llama-cpp-python with llama.cpp's context shift (keep `sinks`, discard half, K-shift)
Writes bench/results/long_stream.{json,md,png}: p50/p99 latency, first vs last thousand, RSS.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import (RESULTS, llama_cpp_context_shift, llama_cpp_last_logits, llama_cpp_model, machine,  # noqa: E402
                    write_results)


def rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def run_ringllm(model, n, capacity, sinks, threads, update, prompt):
    from ringllm.runtime.engine import CPUEngine

    eng = CPUEngine(model.spec, model.tensors, n_threads=threads)
    warm = eng.new_store(capacity=16, policy="streaming", sinks=sinks, update=update)
    eng.logits(prompt[:8] * 4, warm)   # compile/load every kernel, eviction path included, before timing
    st = eng.new_store(capacity=capacity, policy="streaming", sinks=sinks, update=update)
    logits = eng.prefill(prompt, st)
    lat, rss = np.zeros(n), []
    for i in range(n):
        t0 = time.perf_counter()
        logits = eng.step(int(np.argmax(logits)), st)
        lat[i] = time.perf_counter() - t0
        if i % 500 == 0:
            rss.append((i, rss_mb()))
    return lat, rss, st.stats()


def run_llama_cpp(path, n, capacity, sinks, threads, prompt):
    llm = llama_cpp_model(path, n_ctx=capacity, n_threads=threads)
    if llm is None:
        return None
    llm.eval(prompt)
    lat, rss, shifts = np.zeros(n), [], 0
    for i in range(n):
        t0 = time.perf_counter()
        tok = int(np.argmax(llama_cpp_last_logits(llm)))
        if llm.n_tokens >= capacity:
            llama_cpp_context_shift(llm, sinks)
            shifts += 1
        llm.eval([tok])
        lat[i] = time.perf_counter() - t0
        if i % 500 == 0:
            rss.append((i, rss_mb()))
    return lat, rss, {"context_shifts": shifts}


def summary(lat):
    ms = lat * 1e3
    return {"p50_ms": float(np.median(ms)), "p99_ms": float(np.percentile(ms, 99)),
            "p99_over_p50": float(np.percentile(ms, 99) / np.median(ms)), "mean_ms": float(ms.mean()),
            "first_1000_mean_ms": float(ms[:1000].mean()), "last_1000_mean_ms": float(ms[-1000:].mean()),
            "tok_s": float(len(ms) / lat.sum())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-n", type=int, default=20000)
    ap.add_argument("--capacity", type=int, default=512)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("--name", default="long_stream", help="results file stem under bench/results")
    args = ap.parse_args()
    from ringllm.models.bundled import default_model_path
    from ringllm.models.loader import load_model

    path = args.model or default_model_path()
    model = load_model(path)
    prompt = model.tokenizer.encode("It is a truth universally acknowledged, that a single man in possession "
                                    "of a good fortune, must be in want of a wife.")
    runs = {}
    for name, update in (("ringllm in-place", "inplace"), ("ringllm shift-and-append", "shift")):
        lat, rss, stats = run_ringllm(model, args.n, args.capacity, args.sinks, args.threads, update, prompt)
        runs[name] = {"latency": summary(lat), "rss_mb": rss, "stats": stats, "_lat": lat}
        print(name, runs[name]["latency"], flush=True)
    got = run_llama_cpp(path, args.n, args.capacity, args.sinks, args.threads, prompt)
    if got:
        lat, rss, stats = got
        runs["llama.cpp context shift"] = {"latency": summary(lat), "rss_mb": rss, "stats": stats, "_lat": lat}
        print("llama.cpp", runs["llama.cpp context shift"]["latency"], flush=True)

    plot(runs, args, os.path.join(RESULTS, args.name + ".png"))
    inplace, shift = runs["ringllm in-place"]["latency"], runs["ringllm shift-and-append"]["latency"]
    payload = {"model": os.path.basename(path), "tokens": args.n, "capacity": args.capacity, "sinks": args.sinks,
               "threads": args.threads, "machine": machine(),
               "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
               "inplace_speedup_over_shift": shift["mean_ms"] / inplace["mean_ms"],
               "runs": {k: {kk: vv for kk, vv in v.items() if kk != "_lat"} for k, v in runs.items()}}
    md = [f"# Long stream: {args.n} generated tokens, capacity {args.capacity}, sinks {args.sinks}\n",
          f"Model {payload['model']}, {args.threads} threads, {payload['machine']['cpu']}, OMP_WAIT_POLICY="
          f"{payload['omp_wait_policy']}. Command: `python bench/long_stream.py -n {args.n} --capacity {args.capacity} "
          f"-t {args.threads} --name {args.name}`.\n",
          "| run | tok/s | p50 ms | p99 ms | p99/p50 | first 1k mean ms | last 1k mean ms | RSS first->last MB |",
          "|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        lt = r["latency"]
        md.append(f"| {name} | {lt['tok_s']:.1f} | {lt['p50_ms']:.2f} | {lt['p99_ms']:.2f} | {lt['p99_over_p50']:.2f} | "
                  f"{lt['first_1000_mean_ms']:.2f} | {lt['last_1000_mean_ms']:.2f} | "
                  f"{r['rss_mb'][min(1, len(r['rss_mb']) - 1)][1]:.0f} -> {r['rss_mb'][-1][1]:.0f} |")
    md.append(f"\nIn-place over shift-and-append (same engine, same kernels): {payload['inplace_speedup_over_shift']:.3f}x\n")
    text = "\n".join(md) + "\n"
    print(text)
    write_results(args.name, payload, text)


def plot(runs, args, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for name, r in runs.items():
        lat = r["_lat"] * 1e3
        w = 50
        smooth = np.convolve(lat, np.ones(w) / w, mode="valid")
        ax.plot(np.arange(len(smooth)) + w, smooth, lw=0.8, label=f"{name} (50-token mean)")
    ax.set_xlabel("generated token")
    ax.set_ylabel("latency per token (ms)")
    ax.set_title(f"Per-token latency, capacity {args.capacity}, {args.n} tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
