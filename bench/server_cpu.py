"""CPU time per generated token of each thread of `ringllm serve`, and of its client, one client at a time.

    python bench/server_cpu.py [-m MODEL] [--requests 4] [--tokens 128] [--rounds 2] [--precision q8]
                               [--out server_cpu]

On a machine whose cores the engine's threads fill, every other thread that runs (the server's event
loop, the client) takes a core from one of them for a while, and the whole parallel step waits for
it: the CPU time those threads spend per token is what the server costs beyond the engine. Per
round and mode (not streamed, streamed): --requests completions of --tokens tokens (ignore_eos,
greedy) sent one after another by one client (bench/server_speed.py's request()); reported per
generated token: the CPU time of the server process's main thread (uvicorn's event loop), of its
two busiest other threads (the worker thread that drives the engine, and the engine's other
thread), and of this client process (httpx and JSON parsing), with the round's tokens/s.
Thread CPU from psutil (the kernel's per-thread utime + stime). Writes bench/results/<out>.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_server, machine, write_results  # noqa: E402
from server_speed import request  # noqa: E402


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of process pid, by thread id."""
    return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}


def listening_pid(url: str) -> int:
    port = int(url.rsplit(":", 1)[1])
    return next(c.pid for c in psutil.net_connections("tcp")
                if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--precision", choices=("f32", "q8"), default="q8")
    ap.add_argument("--out", default="server_cpu")
    args = ap.parse_args()
    rows = []
    serve_args = ["--log-level", "warning", "--no-progress", "--precision", args.precision]
    with bench_server(serve_args, args.model) as url:
        pid = listening_pid(url)
        request(url, "warm up", 8, False)
        for rnd in range(args.rounds):
            for stream in (False, True):
                before, c0, t0 = thread_cpu(pid), time.process_time(), time.perf_counter()
                n = sum(request(url, "Once upon a time", args.tokens, stream)["tokens"] for _ in range(args.requests))
                after, c1, t1 = thread_cpu(pid), time.process_time(), time.perf_counter()
                ms = {tid: (after[tid] - before.get(tid, 0.0)) * 1e3 / n for tid in after}
                others = sorted((v for tid, v in ms.items() if tid != pid), reverse=True)
                row = {"round": rnd + 1, "stream": stream, "tok_s": round(n / (t1 - t0), 1),
                       "loop_ms": round(ms[pid], 3), "engine_ms": [round(v, 3) for v in others[:2]],
                       "client_ms": round((c1 - c0) * 1e3 / n, 3)}
                rows.append(row)
                print(row, flush=True)
    cmdline = "python bench/server_cpu.py " + " ".join(sys.argv[1:])
    md = ["# CPU time per generated token, `ringllm serve` and its client\n", f"Command: `{cmdline}`  ",
          f"Machine: {machine()}\n",
          f"One client, {args.requests} completions of {args.tokens} tokens a round (ignore_eos, greedy), "
          f"precision {args.precision}. ms of CPU per generated token: the server's event-loop thread, its two "
          "busiest other threads (the engine's), the client process.\n",
          "| round | stream | tok/s | event loop ms | engine threads ms | client ms |", "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['round']} | {r['stream']} | {r['tok_s']} | {r['loop_ms']} | "
                  f"{' / '.join(str(v) for v in r['engine_ms'])} | {r['client_ms']} |")
    write_results(args.out, {"command": cmdline, "machine": machine(), "rows": rows}, "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
