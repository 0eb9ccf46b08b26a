"""Scale-out on Ray Serve: 8 concurrent chat clients against 1 and 2 replicas, and the follow-up turn
with and without chat affinity, in one run.

    python bench/scale_out.py [-m MODEL] [--clients 8] [--rounds 3] [--tokens 64]

Each configuration is a real `ringllm serve --ray` on loopback (1 engine thread and 1 CPU per
replica). Throughput: --clients chat clients send --rounds streamed requests each (different
short prompts, max_tokens --tokens, ignore_eos), all at once; total generated tokens/s over the
round's wall time, and time to first token p50/p99 from the clients. Affinity: with 2 replicas,
--clients concurrent conversations of 3 turns (a ~600-token first user message, short follow-ups,
each request carrying the whole conversation and no session key), 2 x --clients conversations;
the share of 3rd turns served by the replica that holds the conversation's store (at least half the
prompt from its prompt cache) and their TTFT under ringllm's AffinityRouter and under Ray Serve's default power-of-two-choices
router (`--no-affinity`), each on its own server.
Writes bench/results/scale_out.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_server, machine, stream_chat, write_results  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "prideprejudice.txt")


def throughput(url: str, clients: int, rounds: int, tokens: int) -> dict:
    def client(i):
        out = []
        for r in range(rounds):
            body = {"messages": [{"role": "user", "content": f"Tell me a story about item {i}-{r}."}],
                    "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
            out.append(stream_chat(url, body))
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        res = [x for xs in pool.map(client, range(clients)) for x in xs]
    wall = time.perf_counter() - t0
    ttft = [r["ttft"] for r in res]
    return {"tok_s": round(sum(r["tokens"] for r in res) / wall, 1), "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3),
            "ttft_p99_s": round(float(np.percentile(ttft, 99)), 3), "replicas_used": len({r["replica"] for r in res})}


def follow_ups(url: str, clients: int, text: str) -> dict:
    """TTFT and cached tokens of the 3rd turn of `clients` concurrent 3-turn conversations."""
    def conversation(i):
        start = 5000 + i * 2600
        messages = [{"role": "system", "content": "You answer briefly."},
                    {"role": "user", "content": text[start:start + 2500] + "\nWho is mentioned here?"}]
        served = []
        for q in ["", "Why?", "Say it in five words."]:
            if q:
                messages.append({"role": "user", "content": q})
            last = stream_chat(url, {"messages": messages, "max_tokens": 24, "temperature": 0})
            served.append(last["replica"])
            messages.append({"role": "assistant", "content": last["text"]})
        return {**last, "served": served}

    with ThreadPoolExecutor(clients) as pool:
        res = list(pool.map(conversation, range(2 * clients)))
    hits = [r["usage"]["prompt_tokens_details"]["cached_tokens"] >= r["usage"]["prompt_tokens"] // 2 for r in res]
    return {"conversations": len(res), "replicas_used": len({x for r in res for x in r["served"]}),
            "turn3_same_replica_as_turn2": round(sum(r["served"][2] == r["served"][1] for r in res) / len(res), 2),
            "turn3_hit_rate": round(sum(hits) / len(res), 2),
            "turn3_ttft_p50_s": round(statistics.median(r["ttft"] for r in res), 3),
            "turn3_ttft_mean_s": round(statistics.fmean(r["ttft"] for r in res), 3),
            "turn3_ttft_hit_s": round(statistics.median(r["ttft"] for r, h in zip(res, hits) if h), 3) if any(hits) else None,
            "turn3_ttft_miss_s": round(statistics.median(r["ttft"] for r, h in zip(res, hits) if not h), 3)
            if not all(hits) else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default="scale_out")
    args = ap.parse_args()
    text = open(DATA, encoding="utf-8").read()
    rows, affinity = [], {}
    for replicas, routing in ((1, "affinity"), (2, "affinity"), (2, "default")):
        extra = ["--no-affinity"] if routing == "default" else []
        with bench_server(["--ray", "--replicas", str(replicas), "--log-level", "warning", "--no-progress", *extra],
                          args.model, 1) as url:
            stream_chat(url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            if routing == "affinity":
                row = {"replicas": replicas, **throughput(url, args.clients, args.rounds, args.tokens)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            if replicas == 2:
                affinity[routing] = follow_ups(url, args.clients, text)
                print(json.dumps(affinity), flush=True)
    cmdline = "python bench/scale_out.py " + " ".join(sys.argv[1:])
    md = ["# Scale-out on Ray Serve (`ringllm serve --ray`)\n", f"Command: `{cmdline}`  ", f"Machine: {machine()}\n",
          f"{args.clients} concurrent streaming chat clients, {args.rounds} requests each, max_tokens {args.tokens}; "
          "1 engine thread and 1 CPU per replica.\n",
          "| replicas | total tok/s | TTFT p50 | TTFT p99 | replicas that served |", "|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['replicas']} | {r['tok_s']} | {r['ttft_p50_s']} s | {r['ttft_p99_s']} s | {r['replicas_used']} |")
    md += ["", "Follow-up turn (3rd turn of a conversation opened with a ~600-token message), 2 replicas:", "",
           "| routing | conversations | replicas that served | 3rd turn on the 2nd turn's replica | 3rd turn reused "
           ">= half its prompt | TTFT mean | TTFT p50 | TTFT when reused (median) | TTFT when not (median) |",
           "|---|---|---|---|---|---|---|---|---|"]
    def seconds(x):
        return "-" if x is None else f"{x} s"

    for k, v in affinity.items():
        name = "ringllm's AffinityRouter" if k == "affinity" else "Ray Serve's default router (--no-affinity)"
        md.append(f"| {name} | {v['conversations']} | {v['replicas_used']} | {v['turn3_same_replica_as_turn2']:.0%} | "
                  f"{v['turn3_hit_rate']:.0%} | {v['turn3_ttft_mean_s']} s | {v['turn3_ttft_p50_s']} s | "
                  f"{seconds(v['turn3_ttft_hit_s'])} | {seconds(v['turn3_ttft_miss_s'])} |")
    write_results(args.out, {"command": cmdline, "machine": machine(), "throughput": rows, "affinity": affinity},
                  "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
