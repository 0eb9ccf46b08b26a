"""Server soak: many tokens through one `ringllm serve`, with clients that hang up mid-stream.

    python bench/server_soak.py                      # 200,000 tokens, 8 clients (about half an hour)
    python bench/server_soak.py --tokens 20000 --name server_soak_short

A real server (started here on a free loopback port, bench/common.bench_server) and `--clients`
asyncio clients, each sending streamed chat requests one after another: a user turn of 8 to 400
tokens cut from the public-domain novel in bench/data, max_tokens drawn from --max-tokens, greedy,
ignore_eos, with usage in the stream. A share (--disconnect) of the requests hangs up after a random
number of chunks, before the answer is done. The run stops starting requests once --tokens tokens
(prompt + completion, from the usage of the requests that stayed; a request that hung up counts its
streamed tokens only) have gone through; the requests in flight then finish.

Checked and reported:
  - the server stays up: /health answers 200 at the end, and the server process is still running;
  - every client that stays gets a complete answer: its stream ends with finish_reason "length", a
    usage chunk and `data: [DONE]`, and with ignore_eos usage counts exactly max_tokens completion
    tokens, streamed in 1 to max_tokens content chunks (fewer chunks than tokens is allowed: a
    token that ends inside a UTF-8 character is sent with the next, and a lagging stream gets its
    tokens coalesced; such answers are counted); any other ending is counted as incomplete, by kind;
  - memory stays flat: the server's RSS (process_resident_memory_bytes from /metrics, every
    --sample-s seconds) against the tokens through so far; "flat" compares the last sample with the
    first one taken after --settle of the tokens (the prompt cache fills up to its --cache-mb budget
    first, by design).
Writes bench/results/<name>.{json,md,png}. tests/test_server_soak.py runs a short form in CI.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, bench_server, machine, write_results  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "prideprejudice.txt")


class Soak:
    """Shared counters of one run: tokens through, requests by outcome, RSS samples."""

    def __init__(self, goal: int):
        self.goal, self.tokens = goal, 0
        self.completed = self.disconnects = 0
        self.merged = 0       # complete answers with fewer chunks than tokens (held-back UTF-8 bytes, coalescing)
        self.incomplete: dict[str, int] = {}
        self.rss: list[tuple[float, int, float, float]] = []      # (seconds, tokens, RSS MiB, cache MiB)

    def done(self) -> bool:
        return self.tokens >= self.goal

    def fail(self, kind: str) -> None:
        self.incomplete[kind] = self.incomplete.get(kind, 0) + 1


async def one_request(client: httpx.AsyncClient, url: str, body: dict, hang_up_after: int | None, soak: Soak) -> None:
    """One streamed chat request; hangs up after `hang_up_after` content chunks when that is set."""
    chunks, finish, usage, done = 0, None, None, False
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                await r.aread()
                soak.fail(f"http {r.status_code}")
                return
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                    continue
                if not line.startswith("data: {"):
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    soak.fail("error event")
                    return
                usage = ev.get("usage") or usage
                for ch in ev.get("choices", []):
                    chunks += bool(ch["delta"].get("content"))
                    finish = ch.get("finish_reason") or finish
                if hang_up_after is not None and chunks >= hang_up_after:
                    soak.disconnects += 1
                    soak.tokens += chunks
                    return
    except (httpx.TimeoutException, httpx.TransportError) as exc:
        soak.fail(type(exc).__name__)
        return
    if not done or finish is None or usage is None:
        soak.fail("stream ended early" if not done else "no finish_reason or usage")
    elif usage["completion_tokens"] != body["max_tokens"] or finish != "length":
        soak.fail(f"{usage['completion_tokens']} of {body['max_tokens']} tokens, finish_reason {finish}")
    elif not 1 <= chunks <= body["max_tokens"]:
        soak.fail(f"{chunks} content chunks for {body['max_tokens']} tokens")
    else:
        soak.completed += 1
        soak.merged += chunks < body["max_tokens"]
    if usage:
        soak.tokens += usage["prompt_tokens"] + usage["completion_tokens"]


async def client_loop(cid: int, url: str, text: str, args, soak: Soak) -> None:
    rng = random.Random(args.seed * 1000 + cid)
    lo, hi = (int(v) for v in args.max_tokens.split(","))
    async with httpx.AsyncClient() as client:
        while not soak.done():
            chars = rng.randint(32, 1600)               # ~8 to ~400 tokens
            start = rng.randrange(0, len(text) - chars)
            body = {"model": "soak", "stream": True, "stream_options": {"include_usage": True},
                    "max_tokens": rng.randint(lo, hi), "temperature": 0.0, "ignore_eos": True,
                    "messages": [{"role": "user", "content": text[start:start + chars] + "\n\nWho speaks here?"}]}
            hang = rng.randint(1, body["max_tokens"] - 1) if rng.random() < args.disconnect else None
            await one_request(client, url, body, hang, soak)


async def sample_rss(url: str, soak: Soak, t0: float, every: float) -> None:
    async with httpx.AsyncClient() as client:
        while True:
            try:
                text = (await client.get(url + "/metrics", timeout=30)).text
                rss = float(re.search(r"^process_resident_memory_bytes (\S+)$", text, re.M).group(1))
                cache = float(re.search(r"^ringllm_prompt_cache_bytes (\S+)$", text, re.M).group(1))
                soak.rss.append((round(time.perf_counter() - t0, 1), soak.tokens, rss / 2 ** 20, cache / 2 ** 20))
            except (httpx.HTTPError, AttributeError):
                pass
            if soak.done():
                return
            await asyncio.sleep(every)


async def run(url: str, text: str, args) -> Soak:
    soak = Soak(args.tokens)
    t0 = time.perf_counter()
    await asyncio.gather(sample_rss(url, soak, t0, args.sample_s),
                         *[client_loop(i, url, text, args, soak) for i in range(args.clients)])
    return soak


def soak_server(args) -> dict:
    """Start the server, run the soak, check it is still up; the payload of the results."""
    text = open(DATA, encoding="utf-8").read()
    serve_args = ["--model-name", "soak", "--log-level", "warning", "--no-progress", "--queue-size",
                  str(4 * args.clients), "--cache-mb", str(args.cache_mb), "--max-batch", str(args.max_batch)]
    t0 = time.perf_counter()
    with bench_server(serve_args, args.model, None) as url:
        httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                       "max_tokens": 4}, timeout=900)      # compile first
        soak = asyncio.run(run(url, text, args))
        health = httpx.get(url + "/health", timeout=30).status_code
    settled = [s for s in soak.rss if s[1] >= args.settle * args.tokens] or soak.rss[-1:]
    first, last = settled[0], soak.rss[-1]
    halves = settled[:len(settled) // 2] or settled, settled[len(settled) // 2:]
    return {"machine": machine(), "args": vars(args), "wall_s": round(time.perf_counter() - t0, 1),
            "tokens": soak.tokens, "completed": soak.completed, "disconnects": soak.disconnects,
            "incomplete": sum(soak.incomplete.values()), "incomplete_kinds": soak.incomplete,
            "health_at_end": health, "rss_settled_mib": round(first[2], 1), "rss_last_mib": round(last[2], 1),
            "rss_max_mib": round(max(s[2] for s in soak.rss), 1),
            "rss_max_settled_halves_mib": [round(max(s[2] for s in h), 1) for h in halves],
            "complete_with_merged_chunks": soak.merged,
            "rss_growth": round(last[2] / first[2] - 1, 4),
            "rss_samples": [(t, n, round(r, 1), round(c, 1)) for t, n, r, c in soak.rss]}


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = res["rss_samples"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for col, style, label in ((2, "-", "server RSS"), (3, "--", "prompt cache")):
        ax.plot([x[1] for x in s], [x[col] for x in s], style, label=label)
    ax.set(xlabel="tokens through the server", ylabel="MiB",
           title=f"ringllm serve, {res['args']['clients']} clients, {res['args']['disconnect']:.0%} hang up")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--disconnect", type=float, default=0.3, help="share of requests that hang up mid-stream")
    ap.add_argument("--max-tokens", default="16,128", help="range of each request's max_tokens: LO,HI")
    ap.add_argument("--cache-mb", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--settle", type=float, default=0.1, help="share of the tokens before RSS counts as settled")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="server_soak")
    args = ap.parse_args()
    res = soak_server(args)
    cmdline = "python bench/server_soak.py " + " ".join(sys.argv[1:])
    md = [f"# Server soak: {res['tokens']} tokens through `ringllm serve`, {args.clients} clients\n",
          f"Command: `{cmdline}`  ", f"Machine: {res['machine']}; wall time {res['wall_s'] / 60:.1f} min\n",
          f"Streamed greedy chat requests (ignore_eos, max_tokens {args.max_tokens.replace(',', '-')}, prompts of "
          f"8-400 tokens); {args.disconnect:.0%} of them hang up mid-stream. Server --max-batch {args.max_batch}, "
          f"--cache-mb {args.cache_mb}; the clients share the server's cores.\n",
          "| server up at the end | complete answers | incomplete answers | hung up | RSS settled -> last (MiB) | "
          "RSS max, first / second half after settling (MiB) |", "|---|---|---|---|---|---|",
          f"| {res['health_at_end'] == 200} | {res['completed']} | {res['incomplete']} {res['incomplete_kinds'] or ''} | "
          f"{res['disconnects']} | {res['rss_settled_mib']} -> {res['rss_last_mib']} | "
          f"{' / '.join(str(v) for v in res['rss_max_settled_halves_mib'])} |",
          f"\nSettled: the samples after {args.settle:.0%} of the tokens (the prompt cache fills to its budget "
          "first). The last sample is taken when every client is done, the others while 8 streams run. "
          f"{res['complete_with_merged_chunks']} complete answers came in fewer chunks than tokens.\n",
          f"![RSS against tokens]({args.name}.png)\n"]
    write_results(args.name, {"command": cmdline, **res}, "\n".join(md))
    plot(res, os.path.join(RESULTS, args.name + ".png"))
    print("\n".join(md))
    return 0 if res["health_at_end"] == 200 and not res["incomplete"] else 1


if __name__ == "__main__":
    sys.exit(main())
