"""Where a served token's time goes: `ringllm serve` sampled by py-spy while one client decodes.

    python bench/server_profile.py [-m MODEL] [--seconds 20] [--tokens 128] [--clients 1] [--serve-args '--precision q8']

A real server on loopback; --clients clients send completions (max_tokens --tokens, ignore_eos,
temperature 0) one after another, streamed and then not, each for --seconds while py-spy samples
the server process (every thread, 250 Hz, idle samples included so that waiting shows too). Each
sample's stack is put into one component by the frames it holds (first match from the leaf up):

    engine forward     CPUEngine.forward / step / step_batch (the model: matvecs, attention, KV writes)
    prefill            Decoder.prefill's engine call (counted apart from decode)
    store alloc/cache  KVStore construction, fork, prompt-cache lookups
    sampling           Sampler.sample (logit bias, grammar mask, penalties, greedy / sampling chain)
    detokenize/stop    the streaming detokenizer and stop-string matcher
    worker other       the rest of the worker thread's Python (batch bookkeeping, hand-off)
    worker idle        the worker waiting for a request
    HTTP/JSON/SSE      the event loop thread's work: uvicorn, FastAPI, JSON and SSE encoding
    event loop idle    the event loop waiting (epoll, or uvloop's C loop)
    other threads      py-spy's view of everything else

The shares are of each thread's samples; per-token microseconds divide the thread's busy time by
the tokens generated in the window. Writes bench/results/server_profile.{json,md}.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, write_results  # noqa: E402

from ringllm.server_process import free_port  # noqa: E402

RULES = [  # (component, substrings of a frame "function (file:line)"), checked from the leaf frame up
    ("prefill", ["Decoder.prefill"]),
    ("store alloc/cache", ["KVStore.__init__", "KVStore.fork", "PromptCache", "new_store"]),
    ("sampling", ["Sampler.sample", "apply_penalties", "greedy ("]),
    ("detokenize/stop", ["stream_decoder", "StreamDecoder", "StopMatcher", "push (ringllm"]),
    ("engine forward", ["CPUEngine.", "StoredRope", "KVStore.write", "policy_write_attend"]),
]


def classify(frames: list[str], thread: str) -> str:
    if "ringllm-worker" in thread:
        if frames and ("Queue.get" in frames[-1] or "wait (threading" in frames[-1]):
            return "worker idle"
        for name, keys in RULES:
            if any(any(k in f for k in keys) for f in frames):
                return name
        return "worker other"
    if "MainThread" in thread:
        # idle: waiting in epoll (asyncio's loop), or inside uvloop's C loop with no Python frame above run()
        if frames and ("select (selectors" in frames[-1] or frames[-1].startswith("Runner.run")):
            return "event loop idle"
        return "HTTP/JSON/SSE"
    return "other threads"


def drive(url: str, stop: threading.Event, tokens: int, stream: bool, counter: list) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": stream}
    while not stop.is_set():
        if stream:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                        counter[0] += 1
        else:
            counter[0] += httpx.post(url + "/v1/completions", json=body, timeout=120).json()["usage"]["completion_tokens"]


def profile(url: str, pid: int, seconds: float, tokens: int, clients: int, stream: bool, tmp: str) -> dict:
    out = os.path.join(tmp, f"spy_{stream}.txt")
    stop, counter = threading.Event(), [0]
    threads = [threading.Thread(target=drive, args=(url, stop, tokens, stream, counter)) for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(2)
    start = counter[0]
    subprocess.run(["py-spy", "record", "--pid", str(pid), "-d", str(int(seconds)), "-r", "250", "--threads", "--idle",
                    "--format", "raw", "-o", out], check=True, capture_output=True)
    n_tokens = counter[0] - start
    stop.set()
    for t in threads:
        t.join()
    per_thread: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in open(out):
        stack, _, n = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        thread = frames[0]
        kind = "worker" if "ringllm-worker" in thread else "loop" if "MainThread" in thread else "other"
        per_thread[kind][classify(frames[1:], thread)] += int(n)
    rows = {}
    for kind, counts in per_thread.items():
        total = sum(counts.values())
        for comp, n in counts.items():
            share = n / total
            rows[comp] = {"thread": kind, "share": round(share, 4),
                          "us_per_token": round(share * seconds * 1e6 / max(n_tokens, 1), 1)}
    return {"stream": stream, "tokens": n_tokens, "tok_s": round(n_tokens / seconds, 1), "components": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--out", default="server_profile")
    ap.add_argument("--serve-args", default="", help="extra `ringllm serve` arguments (quoted), e.g. '--precision q8'")
    args = ap.parse_args()
    if shutil.which("py-spy") is None:
        sys.exit("bench/server_profile.py needs py-spy (pip install py-spy)")
    port = free_port()
    cmd = [sys.executable, "-m", "ringllm", "serve", "--port", str(port), "--log-level", "warning", "--no-progress"]
    if args.model:
        cmd += ["-m", args.model]
    cmd += args.serve_args.split()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 300
            while True:
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.time() > deadline or proc.poll() is not None:
                    sys.exit("the server did not start")
                time.sleep(0.5)
            httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=300)
            for stream in (False, True):
                res = profile(url, proc.pid, args.seconds, args.tokens, args.clients, stream, tmp)
                results.append(res)
                print(json.dumps(res), flush=True)
        finally:
            proc.terminate()
            proc.wait(30)
    cmdline = "python bench/server_profile.py " + " ".join(sys.argv[1:])
    order = ["engine forward", "prefill", "store alloc/cache", "sampling", "detokenize/stop", "worker other",
             "worker idle", "HTTP/JSON/SSE", "event loop idle", "other threads"]
    md = ["# Where a served token's time goes\n", f"Command: `{cmdline}`  ", f"Machine: {machine()}\n",
          f"`ringllm serve {args.serve_args}`".replace(" `", "`") + f" sampled by py-spy at 250 Hz, idle included, {args.seconds:.0f} s per mode, "
          f"{args.clients} client(s) sending completions of {args.tokens} tokens (ignore_eos, greedy) back to back. "
          "Share: of that thread's samples; us/token: the share of the window divided by the tokens generated "
          "in it.\n"]
    for res in results:
        md += [f"## {'streamed' if res['stream'] else 'not streamed'}: {res['tok_s']} tok/s\n",
               "| component | thread | share | us / token |", "|---|---|---|---|"]
        for comp in order:
            if comp in res["components"]:
                c = res["components"][comp]
                md.append(f"| {comp} | {c['thread']} | {c['share']:.1%} | {c['us_per_token']} |")
        md.append("")
    write_results(args.out, {"command": cmdline, "machine": machine(), "results": results}, "\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
