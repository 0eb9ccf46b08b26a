"""Load test of `ringllm serve`: N concurrent streaming chat clients for a fixed time, loopback only.

    python bench/server_load.py [-m MODEL] [--clients 32,128] [--seconds 300] [--disconnect 0.1] [--seed 0]

A real server (started here on a free loopback port, --queue-size above the client count so that
no request is refused) and N asyncio clients (httpx), each sending streamed chat requests one
after another until the time is up: a shared system prompt, a user turn of 8 to 400 tokens cut
from the public-domain novel in bench/data, max_tokens 16 to 128, temperature 0.7; a fraction
(--disconnect) of requests hang up after a random number of chunks (deliberate disconnects,
counted apart). Bounded: every request has a timeout, the run stops at --seconds (requests still
running then are cut and not counted). Measured per client count: requests/s (completed),
generated tokens/s (streamed chunks), time to first token and inter-token gaps (p50 / p99, from the
client), errors (HTTP status other than 200, a stream that breaks, a timeout), and the server's
RSS over time (process_resident_memory_bytes from /metrics, every 5 s; the prompt cache fills to
its --cache-mb budget and stays there). Writes bench/results/server_load.{json,md,png}.

The clients run on the same 2 cores as the server: the figures are those of the server with its
clients' cost beside it, as on a single-machine deployment.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, machine, write_results  # noqa: E402

from ringllm.server_process import running_server  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "prideprejudice.txt")
SYSTEM = "You are a helpful assistant who answers questions about novels briefly and precisely."


class Tally:
    def __init__(self):
        self.completed = self.disconnects = self.tokens = 0
        self.errors: dict[str, int] = {}
        self.ttft: list[float] = []
        self.gaps: list[float] = []

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def one_request(client: httpx.AsyncClient, url: str, body: dict, hang_up_after: int | None,
                      tally: Tally, deadline: float) -> None:
    t0 = time.perf_counter()
    last = None
    n = 0
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                 timeout=max(1.0, deadline - time.perf_counter() + 30)) as r:
            if r.status_code != 200:
                await r.aread()
                tally.error(f"http {r.status_code}")
                return
            async for line in r.aiter_lines():
                if time.perf_counter() > deadline:
                    return                            # cut by the end of the run: not counted
                if not line.startswith("data: {"):
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    tally.error("error event")
                    return
                if not any(ch["delta"].get("content") for ch in ev.get("choices", [])):
                    continue
                now = time.perf_counter()
                if last is None:
                    tally.ttft.append(now - t0)
                else:
                    tally.gaps.append(now - last)
                last = now
                n += 1
                tally.tokens += 1
                if hang_up_after is not None and n >= hang_up_after:
                    tally.disconnects += 1
                    return
        tally.completed += 1
    except (httpx.TimeoutException, httpx.TransportError) as exc:
        if time.perf_counter() <= deadline:
            tally.error(type(exc).__name__)


async def client_loop(cid: int, url: str, text: str, args, tally: Tally, deadline: float) -> None:
    rng = random.Random(args.seed * 1000 + cid)
    async with httpx.AsyncClient() as client:
        while time.perf_counter() < deadline:
            chars = rng.randint(32, 1600)               # ~8 to ~400 tokens
            start = rng.randrange(0, len(text) - chars)
            body = {"model": "load", "stream": True, "max_tokens": rng.randint(16, 128), "temperature": 0.7,
                    "seed": rng.randrange(1 << 30),
                    "messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": text[start:start + chars] + "\n\nWho speaks here?"}]}
            hang = rng.randint(1, 12) if rng.random() < args.disconnect else None
            await one_request(client, url, body, hang, tally, deadline)


async def sample_rss(url: str, deadline: float, t0: float, out: list) -> None:
    async with httpx.AsyncClient() as client:
        while time.perf_counter() < deadline:
            try:
                text = (await client.get(url + "/metrics", timeout=10)).text
                rss = float(re.search(r"^process_resident_memory_bytes (\S+)$", text, re.M).group(1))
                cache = float(re.search(r"^ringllm_prompt_cache_bytes (\S+)$", text, re.M).group(1))
                out.append((round(time.perf_counter() - t0, 1), rss / 2 ** 20, cache / 2 ** 20))
            except (httpx.HTTPError, AttributeError):
                pass
            await asyncio.sleep(5)


async def run(url: str, n_clients: int, seconds: float, text: str, args) -> dict:
    tally, rss = Tally(), []
    t0 = time.perf_counter()
    deadline = t0 + seconds
    await asyncio.gather(sample_rss(url, deadline, t0, rss),
                         *[client_loop(i, url, text, args, tally, deadline) for i in range(n_clients)])
    wall = time.perf_counter() - t0

    def pct(xs, q):
        return round(float(np.percentile(xs, q)), 4) if xs else None

    return {"clients": n_clients, "seconds": round(wall, 1), "completed": tally.completed,
            "requests_s": round(tally.completed / wall, 3), "tokens_s": round(tally.tokens / wall, 1),
            "ttft_p50_s": pct(tally.ttft, 50), "ttft_p99_s": pct(tally.ttft, 99),
            "inter_token_p50_s": pct(tally.gaps, 50), "inter_token_p99_s": pct(tally.gaps, 99),
            "errors": sum(tally.errors.values()), "error_kinds": tally.errors, "disconnects": tally.disconnects,
            "rss_mib": [(t, round(r, 1), round(c, 1)) for t, r, c in rss]}


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for res in results:
        ts = [t for t, _, _ in res["rss_mib"]]
        ax.plot(ts, [r for _, r, _ in res["rss_mib"]], label=f"{res['clients']} clients: RSS")
        ax.plot(ts, [c for _, _, c in res["rss_mib"]], "--", label=f"{res['clients']} clients: prompt cache")
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("MiB")
    ax.set_title("ringllm serve under load: server memory over time")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--clients", default="32,128")
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--disconnect", type=float, default=0.1, help="share of requests that hang up mid-stream")
    ap.add_argument("--cache-mb", type=int, default=512)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="server_load")
    args = ap.parse_args()
    text = open(DATA, encoding="utf-8").read()
    counts = [int(c) for c in args.clients.split(",")]
    cmd = ["--model-name", "load", "--log-level", "warning", "--no-progress", "--queue-size", str(4 * max(counts)),
           "--cache-mb", str(args.cache_mb), "--max-batch", str(args.max_batch)]
    if args.model:
        cmd = ["-m", args.model] + cmd
    results = []
    with tempfile.TemporaryDirectory() as tmp, running_server(cmd, os.path.join(tmp, "serve.log"), 600) as url:
        httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                       "max_tokens": 4}, timeout=600)      # compile first
        for n in counts:
            res = asyncio.run(run(url, n, args.seconds, text, args))
            results.append(res)
            print(json.dumps({k: v for k, v in res.items() if k != "rss_mib"}), flush=True)
    cmdline = "python bench/server_load.py " + " ".join(sys.argv[1:])
    md = ["# `ringllm serve` under load\n", f"Command: `{cmdline}`  ", f"Machine: {machine()}\n",
          f"Streaming chat clients on loopback for {args.seconds:.0f} s per row; prompts 8-400 tokens, max_tokens "
          f"16-128, temperature 0.7, {args.disconnect:.0%} of requests hang up mid-stream (counted as disconnects, "
          f"not errors); server --max-batch {args.max_batch}, --cache-mb {args.cache_mb}. The clients share the "
          "server's 2 cores.\n",
          "| clients | requests/s | tokens/s | TTFT p50 | TTFT p99 | inter-token p50 | inter-token p99 | errors | "
          "disconnects | RSS start -> end (MiB) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rss = r["rss_mib"]
        span = f"{rss[0][1]:.0f} -> {rss[-1][1]:.0f}" if rss else "-"
        md.append(f"| {r['clients']} | {r['requests_s']} | {r['tokens_s']} | {r['ttft_p50_s']} s | {r['ttft_p99_s']} s | "
                  f"{r['inter_token_p50_s']} s | {r['inter_token_p99_s']} s | {r['errors']} | {r['disconnects']} | "
                  f"{span} |")
    md.append(f"\n![RSS over time]({args.out}.png)\n")
    write_results(args.out, {"command": cmdline, "machine": machine(), "results": results}, "\n".join(md))
    plot(results, os.path.join(RESULTS, args.out + ".png"))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
