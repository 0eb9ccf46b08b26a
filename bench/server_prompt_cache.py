"""Time to first token of a chat's 5th turn through `ringllm serve`, with and without the prompt cache.

    python bench/server_prompt_cache.py [-m MODEL] [--history 1500] [--repeats 3] [--kv full,streaming:1024,h2o:1024]

A real server on loopback. Each repeat is a fresh 5-turn conversation: four user turns that each
bring a passage of the public-domain novel in bench/data (sized so that the conversation before the
5th turn holds about --history tokens), answers of at most 48 greedy tokens, then a short 5th
question; every request carries the whole conversation, as OpenAI clients do.
Turns 1-4 run with the cache; turn 5 runs with the cache (it continues turn 4's store) and then
again with "cache_prompt": false (a fresh store, the whole conversation prefilled), both streamed;
TTFT is the client's time from sending the request to the first content chunk. The answers of the
two must be equal (greedy). Writes bench/results/server_prompt_cache.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_server, machine, stream_chat, write_results  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "prideprejudice.txt")


def user_turns(text: str, start: int, chars: int) -> list[str]:
    """Four turns that each bring a passage of `chars` characters (the history), then a short question."""
    out = []
    for i in range(4):
        piece = text[start + i * chars:start + (i + 1) * chars]
        out.append(f"Here is a passage:\n{piece}\nIn one sentence, what happens in it?")
    return out + ["Which of these passages did you like best, and why?"]


def run_conversation(url: str, turns: list[str], kv: dict | None) -> dict:
    messages = [{"role": "system", "content": "You are a careful reader. Answer briefly."}]
    extra = {"model": "bench", "max_tokens": 48, "temperature": 0, **({"kv": kv} if kv else {})}
    for text in turns[:4]:
        messages.append({"role": "user", "content": text})
        messages.append({"role": "assistant", "content": stream_chat(url, {**extra, "messages": messages})["text"]})
    messages.append({"role": "user", "content": turns[4]})
    cached = stream_chat(url, {**extra, "messages": messages})
    fresh = stream_chat(url, {**extra, "messages": messages, "cache_prompt": False})
    return {"history_tokens": fresh["usage"]["prompt_tokens"],
            "cached_tokens": cached["usage"]["prompt_tokens_details"]["cached_tokens"],
            "ttft_cached_s": cached["ttft"] if cached["ttft"] is not None else cached["seconds"],
            "ttft_fresh_s": fresh["ttft"] if fresh["ttft"] is not None else fresh["seconds"],
            "same_answer": cached["text"] == fresh["text"]}


def parse_kv(spec: str) -> dict | None:
    policy, _, cap = spec.partition(":")
    if policy == "full":
        return None
    return {"policy": policy, "capacity": int(cap), "sinks": 4}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--history", type=int, default=1500, help="tokens of the 5th request, about")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv", default="full,streaming:1024,h2o:1024", help="policy[:capacity] list")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--out", default="server_prompt_cache")
    args = ap.parse_args()
    text = open(DATA, encoding="utf-8").read()
    chars = int((args.history - 4 * 48) * 4.2 / 4)       # ~4.2 chars per token, 4 passages, 48-token answers
    serve_args = ["--model-name", "bench", "--log-level", "warning", "--no-progress", "--cache-mb", "2048"]
    rows = []
    with bench_server(serve_args, args.model, args.threads) as url:
        for spec in args.kv.split(","):
            kv = parse_kv(spec)
            run_conversation(url, user_turns(text, 0, 200), kv)        # compile this policy's kernels first
            for r in range(args.repeats):
                res = run_conversation(url, user_turns(text, 20000 + r * 4 * chars, chars), kv)
                res["kv"] = spec
                rows.append(res)
                print(json.dumps(res), flush=True)
    summary = []
    for spec in args.kv.split(","):
        sel = [r for r in rows if r["kv"] == spec]
        c = statistics.median(r["ttft_cached_s"] for r in sel)
        f = statistics.median(r["ttft_fresh_s"] for r in sel)
        summary.append({"kv": spec, "history_tokens": round(statistics.median(r["history_tokens"] for r in sel)),
                        "cached_tokens": round(statistics.median(r["cached_tokens"] for r in sel)),
                        "ttft_cached_s": round(c, 3), "ttft_fresh_s": round(f, 3), "speedup": round(f / c, 1),
                        "same_answers": all(r["same_answer"] for r in sel)})
    cmdline = "python bench/server_prompt_cache.py " + " ".join(sys.argv[1:])
    md = ["# Prompt cache: time to first token of a chat's 5th turn through `ringllm serve`\n",
          f"Command: `{cmdline}`  ",
          f"Machine: {machine()}\n",
          "Medians over the repeats (each a fresh 5-turn conversation; the 5th request carries the whole "
          "conversation). *cached*: the 5th turn continues the 4th turn's store (only the new tokens are "
          "prefilled); *fresh*: the same request with `cache_prompt: false`. Both streamed; TTFT measured "
          "by the client.\n",
          "| KV | history tokens | cached tokens | TTFT cached | TTFT fresh | speedup | same answers |",
          "|---|---|---|---|---|---|---|"]
    for s in summary:
        md.append(f"| {s['kv']} | {s['history_tokens']} | {s['cached_tokens']} | {s['ttft_cached_s']} s | "
                  f"{s['ttft_fresh_s']} s | {s['speedup']}x | {s['same_answers']} |")
    write_results(args.out, {"command": cmdline, "machine": machine(), "rows": rows, "summary": summary},
                  "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
