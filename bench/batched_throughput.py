"""Batched decode throughput and memory: B concurrent streams of one model in one process.

    python bench/batched_throughput.py [--batches 1,2,4,8] [--steps 2000] [--rounds 1] [--memory-steps 10000]
                                       [--capacity 512] [--kv-type f32] [-t THREADS] [--name batched_throughput]

Each stream has its own fixed store (streaming, 4 sinks, `capacity` tokens, K and V rows of `kv-type`), is prefilled with its
own 128-token slice of the novel, then decodes greedily; all B advance together through
CPUEngine.step_batch (the projections over the B rows at once). Reported per B: total and
per-stream tokens/s over `steps` steps, the ratio to B = 1. With --rounds R > 1 the list of B runs R
times over, each B after the other in every round (so a slow spell of the machine falls on all of
them), and each figure is the median over the rounds, the ratio the median of each round's own
ratio to that round's B = 1. Memory: the B = 8 run goes on for
`memory-steps` steps per stream (every step evicting once the stores are full) with VmRSS sampled
every 500 steps; the claim checked is RSS = weights + B x fixed KV, flat over the run (first vs
last sample, and the peak VmHWM). llama.cpp is not run beside it: llama-cpp-python exposes no
multi-sequence decode at its high level.
Writes bench/results/<name>.{json,md,png}.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import RESULTS, machine, write_results  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data", "prideprejudice.txt")


def proc_status_mb(field: str) -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def weight_bytes(eng) -> int:
    """Analytic bytes of the engine's weights: the repacked matrices, the float32 vectors and the
    (mmapped) token-embedding table."""
    bufs = {id(pm.buf): pm.buf.nbytes for pm in eng.mats.values()}
    return sum(bufs.values()) + sum(v.nbytes for v in eng.vecs.values()) + eng.embd.data.nbytes


def run(eng, ids, B, steps, capacity, kv_type="f32", sample_every=500):
    from ringllm.runtime.kv_config import KVConfig

    kv = KVConfig(capacity=capacity, policy="streaming", sinks=4, k_type=kv_type, v_type=kv_type)
    stores = [eng.new_store(kv) for _ in range(B)]
    starts = [(2000 * i) % (len(ids) - 128) for i in range(B)]
    nxt = [int(np.argmax(eng.prefill(ids[s0:s0 + 128], st))) for s0, st in zip(starts, stores)]
    rss = [(0, proc_status_mb("VmRSS"))]
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        logits = eng.step_batch(nxt, stores) if B > 1 else eng.step(nxt[0], stores[0])[None]
        nxt = [int(t) for t in np.argmax(logits, axis=1)]
        if s % sample_every == 0:
            rss.append((s, proc_status_mb("VmRSS")))
    if steps % sample_every:
        rss.append((steps, proc_status_mb("VmRSS")))
    dt = time.perf_counter() - t0
    return {"B": B, "steps": steps, "seconds": dt, "total_tok_s": B * steps / dt, "per_stream_tok_s": steps / dt,
            "rss_mb": rss, "kv_bytes_per_stream": stores[0].stats()["bytes"],
            "evicted_per_stream": stores[0].stats()["evicted_total"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=1, help="the batch list run this many times over; medians")
    ap.add_argument("--memory-steps", type=int, default=10000, help="steps per stream of the B = 8 memory run (0: skip)")
    ap.add_argument("--capacity", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("--name", default="batched_throughput")
    ap.add_argument("--precision", choices=("f32", "q8"), default="f32", help="CPUEngine(precision=...)")
    ap.add_argument("--kv-type", choices=("f32", "f16", "q8_0", "q4_0"), default="f32",
                    help="KVConfig k_type = v_type of every stream's store")
    args = ap.parse_args()
    from ringllm.models.bundled import default_model_path
    from ringllm.models.loader import load_model
    from ringllm.runtime.engine import CPUEngine

    path = default_model_path()
    model = load_model(path)
    eng = CPUEngine(model.spec, model.tensors, n_threads=args.threads, precision=args.precision)
    ids = model.tokenizer.encode(open(DATA, encoding="utf-8").read()[:80000])
    run(eng, ids, 2, 4, 16, args.kv_type)                     # compile every kernel before timing
    batches = [int(b) for b in args.batches.split(",")]
    rounds = []
    for _ in range(max(1, args.rounds)):
        got = [run(eng, ids, b, args.steps, args.capacity, args.kv_type) for b in batches]
        for r in got:
            r["ratio_to_b1"] = r["total_tok_s"] / got[0]["total_tok_s"]
            print(f"B={r['B']}: {r['total_tok_s']:.1f} tok/s total, {r['per_stream_tok_s']:.1f} per stream", flush=True)
        rounds.append(got)
    rows = [dict(rs[0], **{k: float(np.median([r[k] for r in rs]))
                           for k in ("total_tok_s", "per_stream_tok_s", "ratio_to_b1")},
                 rounds=[{k: r[k] for k in ("total_tok_s", "ratio_to_b1")} for r in rs])
            for rs in zip(*rounds)]
    mem = run(eng, ids, 8, args.memory_steps, args.capacity, args.kv_type) if args.memory_steps else None
    weights_mb = os.path.getsize(path) / 2 ** 20
    engine_mb = weight_bytes(eng) / 2 ** 20
    res = {"machine": machine(), "threads": args.threads, "capacity": args.capacity, "model": os.path.basename(path),
           "precision": args.precision, "kv_type": args.kv_type, "rounds": max(1, args.rounds),
           "weights_file_mb": weights_mb, "engine_weights_mb": engine_mb, "rows": rows, "memory_run": mem, "peak_rss_mb": proc_status_mb("VmHWM")}
    md = [f"# Batched decode: B concurrent streams of {res['model']}, capacity {args.capacity} each, "
          f"precision {args.precision}, KV {args.kv_type}\n",
          f"Machine: {res['machine']['cpu']}, {res['machine']['cores']} cores, {args.threads} threads. Command: "
          f"`python bench/batched_throughput.py --batches {args.batches} --steps {args.steps} --rounds {args.rounds} "
          f"--memory-steps {args.memory_steps} --capacity {args.capacity} --precision {args.precision} --kv-type {args.kv_type} "
          f"--name {args.name}`.\n",
          *([f"Medians over {args.rounds} rounds (the B values in turn in each; vs B=1: the median of each round's "
             "ratio); every round's total tok/s and ratio are in the JSON.\n"] if args.rounds > 1 else []),
          "| B | total tok/s | per stream tok/s | vs B=1 | KV per stream MB |", "|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['B']} | {r['total_tok_s']:.1f} | {r['per_stream_tok_s']:.1f} | {r['ratio_to_b1']:.2f}x | "
                  f"{r['kv_bytes_per_stream'] / 2 ** 20:.1f} |")
    if mem:
        first, last = mem["rss_mb"][1] if len(mem["rss_mb"]) > 1 else mem["rss_mb"][0], mem["rss_mb"][-1]
        md += ["", f"Memory, B = 8 for {mem['steps']} steps per stream ({mem['evicted_per_stream']} evictions per "
               f"stream over all layers and heads): VmRSS {first[1]:.0f} MB at step {first[0]}, {last[1]:.0f} MB at "
               f"step {last[0]} (growth {last[1] - first[1]:+.1f} MB); peak VmHWM of the whole run "
               f"{res['peak_rss_mb']:.0f} MB. Weights: file {weights_mb:.0f} MB, engine (repacked matrices + vectors + "
               f"embedding table) {engine_mb:.0f} MB; fixed KV 8 x {mem['kv_bytes_per_stream'] / 2 ** 20:.1f} MB = "
               f"{8 * mem['kv_bytes_per_stream'] / 2 ** 20:.1f} MB; weights + 8 x KV = "
               f"{engine_mb + 8 * mem['kv_bytes_per_stream'] / 2 ** 20:.0f} MB (the rest of RSS: Python, "
               f"NumPy, Numba and the tokenizer)."]
    write_results(args.name, res, "\n".join(md) + "\n")
    print("\n".join(md))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2 if mem else 1, figsize=(11 if mem else 5.5, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot([r["B"] for r in rows], [r["total_tok_s"] for r in rows], marker="o", label="total")
    ax.plot([r["B"] for r in rows], [r["per_stream_tok_s"] for r in rows], marker="s", label="per stream")
    ax.set_xlabel("concurrent streams B")
    ax.set_ylabel("tokens/s")
    ax.legend()
    if mem:
        ax = axes[0][1]
        ax.plot([s for s, _ in mem["rss_mb"]], [m for _, m in mem["rss_mb"]], marker=".")
        ax.set_xlabel("step (B = 8)")
        ax.set_ylabel("VmRSS MB")
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, args.name + ".png"), dpi=110)


if __name__ == "__main__":
    main()
