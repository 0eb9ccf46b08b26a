"""Decode speed through `ringllm serve` against in-process generation, for 1 to 16 concurrent clients.

    python bench/server_speed.py [-m MODEL] [--clients 1,2,4,8,16] [--tokens 128] [--repeats 3] [--precision q8]

Measured in one run, on loopback, as the issue's new user does it: `ringllm serve` with default
options, POST /v1/completions, max_tokens --tokens, ignore_eos, temperature 0; every client sends
the same kind of request (prompts differ per client so that the prompt cache does not make them
equal work). Per client count, streamed and not: total generated tokens/s over the wall time of
the whole round (first request sent to last answer received), the slowest request against the
median, and time to first token (streamed). In-process: the same model, `LLM.generate` with the
same request in this process, one call before each server round (never at the same time as one),
timed the same way (tokens over the call's wall time). Each client count first runs one round that
is not counted: the server's first batch of that size loads kernels from the cache (or compiles
them) and would otherwise land in the first measured round. Mean batch: the server's engine steps in the
round, sequences per step (its /metrics histogram ringllm_batch_size, read before and after).
Writes bench/results/server_speed.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_server, machine, write_results  # noqa: E402

PROMPTS = ["Once upon a time", "The history of the city begins", "In a quiet village by the sea",
           "The recipe calls for", "Dear diary, today", "The committee met on Tuesday to", "Far away in the mountains",
           "Chapter one: the arrival", "The experiment started at dawn", "Our journey across the desert",
           "The old clock in the hall", "Notes from the lecture on", "She opened the letter and",
           "A guide to growing tomatoes:", "The ship left the harbour", "When the music stopped"]


def in_process(llm, tokens: int, i: int) -> float:
    """Tokens/s of LLM.generate on this request, in this process: generated tokens over the wall time
    of the whole call (prefill included), as a client's round is counted."""
    t0 = time.perf_counter()
    r = llm.complete(PROMPTS[i % len(PROMPTS)], max_tokens=tokens, ignore_eos=True, temperature=0.0)
    return len(r.tokens) / (time.perf_counter() - t0)


def request(url: str, prompt: str, tokens: int, stream: bool) -> dict:
    body = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": stream}
    t0 = time.perf_counter()
    first, n = None, 0
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        n = r.json()["usage"]["completion_tokens"]
    else:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                    if first is None:
                        first = time.perf_counter() - t0
                    n += 1
    return {"seconds": time.perf_counter() - t0, "tokens": n, "ttft": first}


def batch_totals(url: str) -> tuple[float, float]:
    """(sum, count) of the server's ringllm_batch_size histogram: sequences stepped, engine steps."""
    total = count = 0.0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("ringllm_batch_size_sum"):
            total = float(line.split()[-1])
        elif line.startswith("ringllm_batch_size_count"):
            count = float(line.split()[-1])
    return total, count


def round_of(url: str, clients: int, tokens: int, stream: bool) -> dict:
    before = batch_totals(url)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        rs = list(pool.map(lambda i: request(url, PROMPTS[i % len(PROMPTS)], tokens, stream), range(clients)))
    wall = time.perf_counter() - t0
    secs = [r["seconds"] for r in rs]
    after = batch_totals(url)
    out = {"clients": clients, "stream": stream, "tok_s": sum(r["tokens"] for r in rs) / wall,
           "slowest_over_median": max(secs) / statistics.median(secs),
           "mean_batch": (after[0] - before[0]) / max(after[1] - before[1], 1)}
    if stream:
        out["ttft_median_s"] = statistics.median(r["ttft"] for r in rs)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--clients", default="1,2,4,8,16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--serve-args", default="", help="extra `ringllm serve` arguments (quoted)")
    ap.add_argument("--out", default="server_speed")
    ap.add_argument("--precision", choices=("f32", "q8"), default="f32",
                    help="LLM(precision=...) in process and `serve --precision` (both the same)")
    args = ap.parse_args()
    import ringllm
    llm = ringllm.LLM(args.model, n_threads=args.threads, warmup=True, precision=args.precision)
    in_process(llm, args.tokens, 0)
    local_runs = []
    serve_args = ["--log-level", "warning", "--no-progress", "--precision", args.precision] + args.serve_args.split()
    rows = []
    with bench_server(serve_args, args.model, args.threads) as url:
        request(url, "warm up", 8, False)
        for n in [int(c) for c in args.clients.split(",")]:
            round_of(url, n, args.tokens, False)    # not counted: the first batch of n (kernel loads, first uses)
            for stream in (False, True):
                rounds = []
                for i in range(args.repeats):      # in-process and server rounds alternate: same machine state
                    local_runs.append(in_process(llm, args.tokens, i))
                    rounds.append(round_of(url, n, args.tokens, stream))
                row = {"clients": n, "stream": stream,
                       "tok_s": round(statistics.median(r["tok_s"] for r in rounds), 1),
                       "slowest_over_median": round(max(r["slowest_over_median"] for r in rounds), 2),
                       "mean_batch": round(statistics.median(r["mean_batch"] for r in rounds), 2)}
                if stream:
                    row["ttft_median_s"] = round(statistics.median(r["ttft_median_s"] for r in rounds), 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
    local = statistics.median(local_runs)
    one = {s: next(r["tok_s"] for r in rows if r["clients"] == 1 and r["stream"] == s) for s in (False, True)} \
        if any(r["clients"] == 1 for r in rows) else None
    cmdline = "python bench/server_speed.py " + " ".join(sys.argv[1:])
    md = ["# `ringllm serve` decode speed against in-process generation\n", f"Command: `{cmdline}`  ",
          f"Machine: {machine()}\n",
          f"POST /v1/completions, max_tokens {args.tokens}, ignore_eos, temperature 0; medians of {args.repeats} "
          f"rounds. In-process `LLM.generate` on the same request, its rounds alternating with the server's: "
          f"**{local:.1f} tok/s** (median of {len(local_runs)}; tokens over the call's wall time, prefill included).\n",
          "| clients | stream | total tok/s | vs in-process | vs one client | slowest / median | TTFT median | mean batch |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs_one = f"{r['tok_s'] / one[r['stream']]:.2f}x" if one else "-"
        md.append(f"| {r['clients']} | {r['stream']} | {r['tok_s']} | {r['tok_s'] / local:.2f}x | {vs_one} | "
                  f"{r['slowest_over_median']} | {r.get('ttft_median_s', '-')} | {r['mean_batch']} |")
    write_results(args.out, {"command": cmdline, "machine": machine(), "in_process_tok_s": round(local, 1),
                             "rows": rows}, "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
