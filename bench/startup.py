"""Start-up: process start to first token, ringllm beside llama.cpp, cold, warm and after `ringllm warmup`.

Each figure is one fresh process, timed from its start to its exit after one generated token
(`ringllm generate -m MODEL -p PROMPT -n 1`; for llama.cpp, llama-cpp-python's Llama on the same GGUF
with the same threads generating one token), so interpreter start, imports, model loading, kernel
compilation or cache loading and the prompt all count:

- cold: ringllm with an empty kernel cache (a fresh install, an upgrade, a new container), compiling
  on two cores (the run and its compile helper, runtime/compile_share.py);
- cold alone: the same with RINGLLM_COMPILE_HELPER=0 (one process compiles everything);
- warm: ringllm again on the cache the cold run filled;
- after warmup: an empty cache filled by `ringllm warmup -m MODEL --policy full` (its own time is
  reported apart), then a fresh `generate`;
- llama.cpp: the same GGUF and thread count (its kernels are compiled ahead of time).

Runs alternate (cold, warm, warmup + after, llama.cpp) within each repeat; medians are reported.

    python bench/startup.py [--repeats 3] [--threads 2] [--models smollm2,gemma3,qwen3-1.7b] [--name startup]

Synthetic shapes (bench/synthetic_gguf.py: random weights, Q4_K_M, the real model's shapes and
vocabulary size) time what a 1-2B model's start costs: parsing, tokenizer, repacking a gigabyte.

Writes bench/results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, write_results  # noqa: E402

PROMPT = "The capital of France is"
LLAMA_CPP = r"""
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=int(sys.argv[2]), n_threads_batch=int(sys.argv[2]),
            verbose=False)
llm(sys.argv[3], max_tokens=1, temperature=0.0)
"""


def _model_paths(names: list[str]) -> dict[str, str]:
    """smollm2, gemma3: the bundled models; a bench/synthetic_gguf.py shape (llama-3.2-1b, qwen3-1.7b): its
    random-weight Q4_K_M file in the real model's shapes, written on first use."""
    from ringllm.models.bundled import default_model_path, gemma3_model_path
    from synthetic_gguf import SHAPES, synthetic_path
    found = {"smollm2": default_model_path, "gemma3": gemma3_model_path}
    unknown = [n for n in names if n not in found and n not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; valid: {sorted(found) + sorted(SHAPES)}")
    return {name: found[name]() if name in found else synthetic_path(name) for name in names}


def _timed(cmd: list[str], cache_dir: str | None = None, **extra_env: str) -> tuple[float, str]:
    """Wall seconds of `cmd` as a fresh process (its stderr for the log); raises when it fails."""
    env = dict(os.environ, **extra_env)
    env.pop("RINGLLM_NUMBA_CACHE_BASE", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)      # Python's default, as a user's runs: modules load from bytecode
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = cache_dir
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
    return wall, res.stderr


def _ringllm(path: str, threads: int) -> list[str]:
    return [sys.executable, "-m", "ringllm", "generate", "-m", path, "-p", PROMPT, "-n", "1", "-t", str(threads),
            "--no-progress", "--ignore-eos"]


def run_model(path: str, threads: int) -> dict:
    """One repeat for one model: cold, warm, warmup + after warmup, llama.cpp (seconds)."""
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        out["cold"], _ = _timed(_ringllm(path, threads), cache)
        out["warm"], _ = _timed(_ringllm(path, threads), cache)
    with tempfile.TemporaryDirectory() as cache:        # the cold start without its compile helper
        out["cold_alone"], _ = _timed(_ringllm(path, threads), cache, RINGLLM_COMPILE_HELPER="0")
    with tempfile.TemporaryDirectory() as cache:
        out["warmup_command"], _ = _timed([sys.executable, "-m", "ringllm", "warmup", "-m", path, "--policy", "full"],
                                          cache)
        out["after_warmup"], _ = _timed(_ringllm(path, threads), cache)
    try:
        import llama_cpp  # noqa: F401
        out["llama_cpp"], _ = _timed([sys.executable, "-c", LLAMA_CPP, path, str(threads), PROMPT])
    except ImportError:
        out["llama_cpp"] = None
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="smollm2,gemma3",
                    help="comma-separated: smollm2, gemma3, or a synthetic shape (llama-3.2-1b, qwen3-1.7b)")
    ap.add_argument("--name", default="startup", help="results file name under bench/results")
    args = ap.parse_args()
    paths = _model_paths(args.models.split(","))
    runs = {name: [] for name in paths}
    for _ in range(args.repeats):
        for name, path in paths.items():
            runs[name].append(run_model(path, args.threads))
            print(name, runs[name][-1], file=sys.stderr, flush=True)
    cols = ["cold", "cold_alone", "warm", "warmup_command", "after_warmup", "llama_cpp"]
    medians = {name: {c: (None if any(r[c] is None for r in rs) else float(np.median([r[c] for r in rs])))
                      for c in cols} for name, rs in runs.items()}
    payload = {"machine": machine(), "command": f"python bench/startup.py --repeats {args.repeats} --threads "
               f"{args.threads} --models {args.models} --name {args.name}", "threads": args.threads, "prompt": PROMPT,
               "models": paths, "median_s": medians, "runs": runs}

    def fmt(v):
        return "n/a" if v is None else f"{v:.2f}"

    md = ["# Start-up: process start to first token, beside llama.cpp\n",
          f"`{payload['command']}` on {payload['machine']['cpu']}, {payload['machine']['cores']} cores, "
          f"{args.threads} threads. Each figure: one fresh process from its start to its exit after one generated "
          f"token (`ringllm generate -n 1`; llama-cpp-python `Llama(...)(prompt, max_tokens=1)`), median of "
          f"{args.repeats}; runs alternate. cold: empty kernel cache (compiling on two cores: the run and its "
          "compile helper, runtime/compile_share.py); cold alone: the same without the helper "
          "(RINGLLM_COMPILE_HELPER=0); warm: the cache the cold run filled; "
          "after warmup: a fresh cache filled by `ringllm warmup -m MODEL --policy full` (its own time in the "
          "warmup column).\n",
          "| model | ringllm cold (s) | cold alone (s) | ringllm warm (s) | `ringllm warmup` (s) | after warmup (s) "
          "| llama.cpp (s) | warm / llama.cpp |", "|---|---|---|---|---|---|---|---|"]
    for name, m in medians.items():
        ratio = "n/a" if m["llama_cpp"] is None else f"{m['warm'] / m['llama_cpp']:.2f}x"
        md.append(f"| {name} | {fmt(m['cold'])} | {fmt(m['cold_alone'])} | {fmt(m['warm'])} | {fmt(m['warmup_command'])} | "
                  f"{fmt(m['after_warmup'])} | {fmt(m['llama_cpp'])} | {ratio} |")
    text = "\n".join(md) + "\n"
    print(text)
    write_results(args.name, payload, text)


if __name__ == "__main__":
    main()
