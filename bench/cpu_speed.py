"""Decode (tg) and prefill (pp) tokens/s of the ringllm CPU engine beside llama.cpp, one run, same GGUF and threads.

    python bench/cpu_speed.py [-m MODEL] [-t THREADS] [--tg 128] [--pp 512]

Prints and writes bench/results/cpu_speed.{json,md}: tokens/s, the ratio to llama.cpp, and achieved
GB/s of weights (weight bytes read per token x tokens/s) against the machine's read bandwidth.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import llama_cpp_last_logits, llama_cpp_model, machine, write_results  # noqa: E402


def bench_ringllm(path, threads, n_tg, n_pp, repeats):
    from ringllm.models.loader import load_model
    from ringllm.runtime.engine import CPUEngine

    m = load_model(path, tokenizer=False)
    eng = CPUEngine(m.spec, m.tensors, n_threads=threads, n_batch=min(512, n_pp))
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 5000, n_pp).tolist()
    st = eng.new_store(capacity=n_pp + n_tg + 8, policy="full")
    eng.prefill(prompt[:16], st)          # warm-up: JIT from cache, page in weights
    tg, pp = [], []
    for _ in range(repeats):
        st = eng.new_store(capacity=n_pp + n_tg + 8, policy="full")
        t0 = time.perf_counter()
        logits = eng.prefill(prompt, st)
        pp.append(n_pp / (time.perf_counter() - t0))
        st = eng.new_store(capacity=n_pp + n_tg + 8, policy="full")
        logits = eng.prefill(prompt[:8], st)
        t0 = time.perf_counter()
        for _ in range(n_tg):
            logits = eng.step(int(np.argmax(logits)), st)
        tg.append(n_tg / (time.perf_counter() - t0))
    return {"tg": float(np.median(tg)), "pp": float(np.median(pp)), "weight_bytes": m.weight_bytes,
            "decode_bytes": decode_bytes(m)}


def decode_bytes(m) -> int:
    """Weight bytes read per decoded token: every matrix once, the embedding row negligible (tied head: whole)."""
    total = sum(t.nbytes for n, t in m.tensors.items() if n != "token_embd.weight")
    if m.spec.tied_output:
        total += m.tensors["token_embd.weight"].nbytes
    return total


def bench_llama_cpp(path, threads, n_tg, n_pp, repeats):
    llm = llama_cpp_model(path, n_ctx=n_pp + n_tg + 8, n_threads=threads)
    if llm is None:
        return None
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 5000, n_pp).tolist()
    llm.eval(prompt[:16])
    tg, pp = [], []
    for _ in range(repeats):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        pp.append(n_pp / (time.perf_counter() - t0))
        llm.reset()
        llm.eval(prompt[:8])
        t0 = time.perf_counter()
        for _ in range(n_tg):
            tok = int(np.argmax(llama_cpp_last_logits(llm)))
            llm.eval([tok])
        tg.append(n_tg / (time.perf_counter() - t0))
    return {"tg": float(np.median(tg)), "pp": float(np.median(pp))}


def bench_llama_bench(binary, path, threads, n_tg, n_pp, repeats):
    """llama.cpp's own llama-bench binary (pure C, no Python in the loop), when a path is given."""
    import json
    import subprocess
    if not binary:
        return None
    out = subprocess.run([binary, "-m", path, "-t", str(threads), "-p", str(n_pp), "-n", str(n_tg), "-r", str(repeats),
                          "-o", "json"], capture_output=True, text=True, check=True).stdout
    res = {}
    for row in json.loads(out):
        res["pp" if row["n_prompt"] else "tg"] = float(row["avg_ts"])
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="cpu_speed")
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"),
                    help="path of a llama-bench binary built from llama.cpp (optional second anchor)")
    args = ap.parse_args()
    from ringllm.models.bundled import default_model_path
    path = args.model or default_model_path()
    ours = bench_ringllm(path, args.threads, args.tg, args.pp, args.repeats)
    anchor = bench_llama_cpp(path, args.threads, args.tg, args.pp, args.repeats)
    lb = bench_llama_bench(args.llama_bench, path, args.threads, args.tg, args.pp, args.repeats)
    gbs = ours["decode_bytes"] * ours["tg"] / 1e9
    rows = [("ringllm (Numba)", ours["tg"], ours["pp"], gbs)]
    if anchor:
        rows.append(("llama.cpp (llama-cpp-python, Python loop like ours)", anchor["tg"], anchor["pp"],
                     ours["decode_bytes"] * anchor["tg"] / 1e9))
    if lb:
        rows.append(("llama.cpp (llama-bench, C)", lb["tg"], lb["pp"], ours["decode_bytes"] * lb["tg"] / 1e9))
    payload = {"model": os.path.basename(path), "threads": args.threads, "tg_tokens": args.tg, "pp_tokens": args.pp,
               "ringllm": ours, "llama_cpp": anchor, "llama_bench": lb, "machine": machine(),
               "ratio_tg": ours["tg"] / anchor["tg"] if anchor else None,
               "ratio_pp": ours["pp"] / anchor["pp"] if anchor else None}
    md = [f"# CPU speed: {os.path.basename(path)}, {args.threads} threads\n",
          f"Machine: {payload['machine']['cpu']}, {payload['machine']['cores']} cores; medians of {args.repeats} runs.\n",
          f"Weight bytes read per decoded token: {ours['decode_bytes'] / 1e6:.1f} MB.\n",
          f"| engine | tg{args.tg} tok/s | pp{args.pp} tok/s | decode GB/s of weights |", "|---|---|---|---|"]
    md += [f"| {n} | {tg:.1f} | {pp:.1f} | {g:.2f} |" for n, tg, pp, g in rows]
    if anchor:
        md.append(f"\nringllm / llama.cpp (llama-cpp-python): decode {payload['ratio_tg']:.2f}x, prefill {payload['ratio_pp']:.2f}x")
    if lb:
        md.append(f"ringllm / llama-bench: decode {ours['tg'] / lb['tg']:.2f}x, prefill {ours['pp'] / lb['pp']:.2f}x\n")
    text = "\n".join(md) + "\n"
    print(text)
    write_results(args.name, payload, text)


if __name__ == "__main__":
    main()
