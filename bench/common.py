"""Shared bits of the benchmarks: machine description, result writing, llama.cpp anchor loading."""
from __future__ import annotations

import gzip
import json
import os
import platform
import subprocess
import tempfile
import time
from contextlib import contextmanager

from ringllm.runtime.atomic_file import write_bytes

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import numba
    import numpy
    out = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "numpy": numpy.__version__,
           "numba": numba.__version__, "load_avg_1m": round(os.getloadavg()[0], 2)}
    try:
        import llama_cpp
        out["llama_cpp_python"] = llama_cpp.__version__
    except ImportError:
        pass
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        pass
    return out


def write_results(name: str, payload: dict, markdown: str, compress: bool = False) -> None:
    """bench/results/NAME.json and NAME.md. compress: the JSON gzipped, without indentation, as
    NAME.json.gz (a benchmark that keeps every instance's record, megabytes as indented text)."""
    os.makedirs(RESULTS, exist_ok=True)
    # crash-safe (temporary file, fsync, rename): a killed benchmark keeps the previous results
    if compress:
        data = gzip.compress(json.dumps(payload, separators=(",", ":")).encode("utf-8"), mtime=0)
        write_bytes(os.path.join(RESULTS, name + ".json.gz"), data)
    else:
        write_bytes(os.path.join(RESULTS, name + ".json"), json.dumps(payload, indent=2))
    write_bytes(os.path.join(RESULTS, name + ".md"), markdown)


def read_results(name: str) -> dict:
    """The payload write_results wrote under NAME: NAME.json.gz when there is one, else NAME.json."""
    path = os.path.join(RESULTS, name)
    if os.path.exists(path + ".json.gz"):
        with gzip.open(path + ".json.gz", "rt", encoding="utf-8") as fh:
            return json.load(fh)
    with open(path + ".json", encoding="utf-8") as fh:
        return json.load(fh)


def stream_chat(url: str, body: dict) -> dict:
    """One streamed chat request to a ringllm (or OpenAI-compatible) server at `url`: {"ttft": seconds to the first
    content chunk (None when none came), "seconds": the whole request, "tokens": content chunks, "text": the answer,
    "usage": the final usage (stream_options.include_usage), "replica": the last system_fingerprint}."""
    import httpx
    t0 = time.perf_counter()
    first, n, fp, usage, parts = None, 0, None, None, []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True,
                      "stream_options": {"include_usage": True}}, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            fp = ev.get("system_fingerprint") or fp
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev["choices"]:
                text = ch["delta"].get("content")
                if text:
                    if first is None:
                        first = time.perf_counter() - t0
                    parts.append(text)
                    n += 1
    return {"ttft": first, "tokens": n, "seconds": time.perf_counter() - t0, "replica": fp, "usage": usage,
            "text": "".join(parts)}


def llama_cpp_model(path: str, n_ctx: int, n_threads: int, logits_all: bool = False):
    """llama-cpp-python's Llama on `path` (the bench extra); None when it is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    return Llama(model_path=path, n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads, n_batch=512,
                 logits_all=logits_all, verbose=False)


def llama_cpp_last_logits(llm):
    """The last evaluated token's logits (n_vocab,) as a view (llama-cpp-python keeps `scores` only with logits_all)."""
    import numpy as np
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def llama_cpp_context_shift(llm, n_keep: int) -> int:
    """llama.cpp's context shift (llama-cli/server): drop half of the tokens after the first n_keep, move the rest
    down (K-shift re-rotates their keys on the next decode). Returns the number of tokens discarded."""
    import llama_cpp
    n_past = llm.n_tokens
    n_discard = (n_past - n_keep) // 2
    mem = llama_cpp.llama_get_memory(llm._ctx.ctx)
    llama_cpp.llama_memory_seq_rm(mem, 0, n_keep, n_keep + n_discard)
    llama_cpp.llama_memory_seq_add(mem, 0, n_keep + n_discard, n_past, -n_discard)
    llm.input_ids[n_keep:n_past - n_discard] = llm.input_ids[n_keep + n_discard:n_past].copy()
    llm.n_tokens = n_past - n_discard
    return n_discard


def cpu_busy(interval: float = 0.5) -> float:
    """Fraction of all CPUs busy (user + system + steal, every process) over `interval` seconds, from /proc/stat."""
    import time

    def sample():
        with open("/proc/stat") as fh:
            vals = [int(v) for v in fh.readline().split()[1:]]
        idle = vals[3] + vals[4]
        return sum(vals) - idle, sum(vals)

    b0, t0 = sample()
    time.sleep(interval)
    b1, t1 = sample()
    return (b1 - b0) / max(1, t1 - t0)


def wait_for_quiet_cpu(max_wait: float, threshold: float = 0.15) -> float:
    """Block until the machine is nearly idle (cpu_busy below threshold) or max_wait seconds have passed,
    so a timing starts while no other job competes for the cores. Returns the seconds waited. Call it while
    every process of the benchmark itself is idle."""
    import time

    t0 = time.perf_counter()
    while cpu_busy() > threshold and time.perf_counter() - t0 < max_wait:
        pass
    return time.perf_counter() - t0


@contextmanager
def bench_server(serve_args: list[str], model: str | None = None, threads: int | None = None,
                 timeout_s: float = 600):
    """A real `ringllm serve SERVE_ARGS` on a free loopback port (ringllm.server_process), on `model`
    (None: the bundled one) with `threads` engine threads (None: the default); yields its base URL."""
    from ringllm.server_process import running_server

    cmd = (["-m", model] if model else []) + list(serve_args) + (["-t", str(threads)] if threads else [])
    with tempfile.TemporaryDirectory() as tmp, running_server(cmd, os.path.join(tmp, "serve.log"), timeout_s) as url:
        yield url
