"""Start-up: process start to first token, ringllm beside llama.cpp, cold, warm and after `ringllm warmup`.

Each figure is one fresh process, timed from its start to the first generated text on its standard
output (first token) and to its exit (`ringllm generate -m MODEL -p PROMPT -n 1`, which writes each
token as it comes; for llama.cpp, llama-cpp-python's Llama on the same GGUF with the same threads
generating one token and writing it), so interpreter start, imports, model loading, kernel
compilation or cache loading and the prompt all count. The two differ where a process has work left
after its token: a cold start's parent waits at exit for its compile helper to save the kernels it
ran stand-ins for (runtime/compile_share.py).

- cold: ringllm with an empty kernel cache (a fresh install, an upgrade, a new container), compiling
  on two cores (the run and its compile helper, runtime/compile_share.py);
- cold alone: the same with RINGLLM_COMPILE_HELPER=0 (one process compiles everything);
- cold chat: the README's first command (`generate --chat ... -n 48`) on an empty cache, to its first
  text and its exit: its first text waits for the first decode step too (generate writes a token's
  text once the engine has run that token, ringllm.decoder.Decoder.advance);
- warm: ringllm again on the cache the cold run filled;
- after warmup: an empty cache filled by `ringllm warmup -m MODEL --policy full` (its own time is
  reported apart), then a fresh `generate`;
- llama.cpp: the same GGUF and thread count (its kernels are compiled ahead of time).

Each repeat runs the cold starts, then the warmup command, then warm, after warmup and llama.cpp in
turn, --warm-runs times each (a repeat counts each one's median, so that none of them is the run
right after a cold start or a warmup); the table gives the medians over the repeats.

    python bench/startup.py [--repeats 3] [--warm-runs 3] [--threads 2] [--models smollm2,gemma3,qwen3-1.7b]
                            [--warm-only [--base DIR]] [--name startup]

--warm-only times warm starts on the user's own kernel cache and llama.cpp, nothing else (an A/B of
the warm path in minutes). With --base DIR (a directory holding another checkout's package as
DIR/ringllm, e.g. symlinks to an older commit's files) it also times that package's warm start
(PYTHONPATH=DIR), run for run in turn with this checkout's, and reports the median of the paired
differences (this checkout minus the base): an A/B whose two sides share every minute of the machine.

Synthetic shapes (bench/synthetic_gguf.py: random weights, Q4_K_M, the real model's shapes and
vocabulary size) time what a 1-2B model's start costs: parsing, tokenizer, repacking a gigabyte.

Writes bench/results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, write_results  # noqa: E402

PROMPT = "The capital of France is"
CHAT_PROMPT = "Write a haiku about the sea."
LLAMA_CPP = r"""
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=int(sys.argv[2]), n_threads_batch=int(sys.argv[2]),
            verbose=False)
out = llm(sys.argv[3], max_tokens=1, temperature=0.0)
sys.stdout.write(out["choices"][0]["text"] or " ")
sys.stdout.flush()
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


def _env(cache_dir: str | None, **extra_env: str) -> dict:
    """A fresh process's environment: the kernel cache under cache_dir (None: the user's), as a user's."""
    env = dict(os.environ, **extra_env)
    env.pop("RINGLLM_NUMBA_CACHE_BASE", None)     # this process's (ringllm is imported here): not a user's
    env.pop("PYTHONDONTWRITEBYTECODE", None)      # Python's default, as a user's runs: modules load from bytecode
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = cache_dir
    return env


def _timed(cmd: list[str], cache_dir: str | None = None, **extra_env: str) -> tuple[float, float]:
    """Wall seconds of `cmd` as a fresh process until its first byte on standard output (its first
    token) and until its exit; raises when it fails or writes nothing."""
    env = _env(cache_dir, **extra_env)
    with tempfile.TemporaryFile() as err:          # a file: a full stderr pipe cannot stall the process
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err)
        first = proc.stdout.read(1)
        t_first = time.perf_counter() - t0
        proc.stdout.read()
        code = proc.wait()
        wall = time.perf_counter() - t0
        if code != 0 or not first:
            err.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} failed (exit {code}):\n{err.read().decode()[-2000:]}")
    return t_first, wall


def _ringllm(path: str, threads: int) -> list[str]:
    return [sys.executable, "-m", "ringllm", "generate", "-m", path, "-p", PROMPT, "-n", "1", "-t", str(threads),
            "--no-progress", "--ignore-eos"]


def _ringllm_chat(path: str, threads: int) -> list[str]:
    """The README's first command on this model: a chat turn of 48 tokens (a token's text is written once
    the engine has run that token, so its first byte waits for the first decode step too)."""
    return [sys.executable, "-m", "ringllm", "generate", "-m", path, "--chat", "-p", CHAT_PROMPT, "-n", "48",
            "-t", str(threads), "--no-progress", "--ignore-eos"]


def _alternate(path: str, threads: int, warm_runs: int, caches: dict) -> dict:
    """ringllm on each named kernel cache and environment ({name: (cache dir, None for the user's; extra
    environment)}) and llama.cpp, warm_runs times each in turn: {name: median first token, name + "_exit":
    median exit, "samples": every run}."""
    have_llama = importlib.util.find_spec("llama_cpp") is not None
    samples = {name: [] for name in caches} | {"llama_cpp": []}
    for _ in range(warm_runs):
        for name, (cache, extra) in caches.items():
            samples[name].append(_timed(_ringllm(path, threads), cache, **extra))
        if have_llama:
            samples["llama_cpp"].append(_timed([sys.executable, "-c", LLAMA_CPP, path, str(threads), PROMPT]))
    out = {}
    for name, runs in samples.items():
        out[name] = float(np.median([r[0] for r in runs])) if runs else None
        out[name + "_exit"] = float(np.median([r[1] for r in runs])) if runs else None
    out["samples"] = samples
    return out


def run_model(path: str, threads: int, warm_runs: int = 3, warm_only: bool = False, base: str | None = None) -> dict:
    """One repeat for one model: cold, cold chat and cold alone (each on its own empty cache), then warmup
    into a fresh cache; then warm (the cache the cold run filled), after warmup and llama.cpp, warm_runs
    times each in turn, reported as their medians (seconds to the first token, and "<name>_exit" to the
    process's exit; every run under "samples"). Alternating the three keeps them in the same conditions:
    a single run right after the warmup command (53 s on both cores) or right after a cold start would
    carry what ran before it. warm_only: warm on the user's own kernel cache (one untimed run first fills
    what it lacks) and llama.cpp alone, every other column None: the warm path's A/B in minutes. base
    (warm_only): also the package in that directory, warm ("warm_base"), in turn with this checkout's,
    and "warm_delta", the median over the rounds of this checkout's first token minus the base's."""
    if warm_only:
        caches = {"warm": (None, {})} | ({"warm_base": (None, {"PYTHONPATH": base})} if base else {})
        for cache, extra in caches.values():
            _timed(_ringllm(path, threads), cache, **extra)
        out = {c + e: None for c in ("cold", "cold_chat", "cold_alone", "after_warmup") for e in ("", "_exit")}
        out["warmup_command"] = None
        out |= _alternate(path, threads, warm_runs, caches)
        if base:
            pairs = zip(out["samples"]["warm"], out["samples"]["warm_base"])
            out["warm_delta"] = float(np.median([a[0] - b[0] for a, b in pairs]))
        return out
    out = {}
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as warmed:
        out["cold"], out["cold_exit"] = _timed(_ringllm(path, threads), cache)
        with tempfile.TemporaryDirectory() as chat_cache:        # the README's chat command on an empty cache
            out["cold_chat"], out["cold_chat_exit"] = _timed(_ringllm_chat(path, threads), chat_cache)
        with tempfile.TemporaryDirectory() as alone_cache:       # the cold start without its compile helper
            out["cold_alone"], out["cold_alone_exit"] = _timed(_ringllm(path, threads), alone_cache,
                                                               RINGLLM_COMPILE_HELPER="0")
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "ringllm", "warmup", "-m", path, "--policy", "full"], check=True,
                       env=_env(warmed), capture_output=True)
        out["warmup_command"] = time.perf_counter() - t0
        return out | _alternate(path, threads, warm_runs, {"warm": (cache, {}), "after_warmup": (warmed, {})})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="smollm2,gemma3",
                    help="comma-separated: smollm2, gemma3, or a synthetic shape (llama-3.2-1b, qwen3-1.7b)")
    ap.add_argument("--warm-runs", type=int, default=3,
                    help="runs of warm, after warmup and llama.cpp per repeat, alternating (their median counts)")
    ap.add_argument("--warm-only", action="store_true",
                    help="warm starts (on the user's kernel cache) and llama.cpp only: no cold or warmup runs")
    ap.add_argument("--base", default=None, metavar="DIR",
                    help="with --warm-only: also time the package DIR/ringllm warm (PYTHONPATH=DIR), in turn with "
                         "this checkout's, and report the median paired difference")
    ap.add_argument("--name", default="startup", help="results file name under bench/results")
    args = ap.parse_args()
    if args.warm_runs < 1:
        ap.error(f"--warm-runs must be at least 1, got {args.warm_runs}")
    if args.base is not None and (not args.warm_only or not os.path.isdir(os.path.join(args.base, "ringllm"))):
        ap.error("--base takes a directory holding a ringllm package (DIR/ringllm) and needs --warm-only")
    paths = _model_paths(args.models.split(","))
    runs = {name: [] for name in paths}
    for _ in range(args.repeats):
        for name, path in paths.items():
            runs[name].append(run_model(path, args.threads, args.warm_runs, args.warm_only, args.base))
            print(name, runs[name][-1], file=sys.stderr, flush=True)
    cols = ["cold", "cold_exit", "cold_alone", "cold_alone_exit", "cold_chat", "cold_chat_exit", "warm", "warm_exit",
            "warmup_command", "after_warmup", "after_warmup_exit", "llama_cpp", "llama_cpp_exit"]
    if args.base:
        cols += ["warm_base", "warm_base_exit", "warm_delta"]
    medians = {name: {c: (None if any(r[c] is None for r in rs) else float(np.median([r[c] for r in rs])))
                      for c in cols} for name, rs in runs.items()}
    command = (f"python bench/startup.py --repeats {args.repeats} --threads {args.threads} --models {args.models} "
               f"--warm-runs {args.warm_runs}{' --warm-only' if args.warm_only else ''}"
               f"{f' --base {args.base}' if args.base else ''} --name {args.name}")
    payload = {"machine": machine(), "command": command, "threads": args.threads, "prompt": PROMPT,
               "models": paths, "median_s": medians, "runs": runs}

    def fmt(v):
        return "n/a" if v is None else f"{v:.2f}"

    md = ["# Start-up: process start to first token, beside llama.cpp\n",
          f"`{payload['command']}` on {payload['machine']['cpu']}, {payload['machine']['cores']} cores, "
          f"{args.threads} threads. Each figure: one fresh process from its start to its first generated token "
          f"on standard output / to its exit (`ringllm generate -n 1`; llama-cpp-python "
          f"`Llama(...)(prompt, max_tokens=1)` writing its token), median of "
          f"{args.repeats}; runs alternate. cold: empty kernel cache (compiling on two cores: the run and its "
          "compile helper, runtime/compile_share.py); cold alone: the same without the helper "
          "(RINGLLM_COMPILE_HELPER=0); cold chat: the README's command (`generate --chat -p "
          f"\"{CHAT_PROMPT}\" -n 48`) on an empty cache, to its first text / its exit; warm: the cache the cold "
          "run filled; "
          "after warmup: a fresh cache filled by `ringllm warmup -m MODEL --policy full` (its own time in the "
          f"warmup column). Warm, after warmup and llama.cpp: {args.warm_runs} runs each per repeat, in turn, "
          "after the cold ones; a repeat counts their median. warm / llama.cpp: first tokens.\n",
          "| model | ringllm cold (s) | cold alone (s) | cold chat (s) | ringllm warm (s) | `ringllm warmup` (s) "
          "| after warmup (s) | llama.cpp (s) | warm / llama.cpp |", "|---|---|---|---|---|---|---|---|---|"]

    def both(m, c):
        return f"{fmt(m[c])} / {fmt(m[c + '_exit'])}"

    for name, m in medians.items():
        ratio = "n/a" if m["llama_cpp"] is None else f"{m['warm'] / m['llama_cpp']:.2f}x"
        md.append(f"| {name} | {both(m, 'cold')} | {both(m, 'cold_alone')} | {both(m, 'cold_chat')} | {both(m, 'warm')} | "
                  f"{fmt(m['warmup_command'])} | {both(m, 'after_warmup')} | {both(m, 'llama_cpp')} | {ratio} |")
    if args.base:
        md += ["", f"This checkout against the package in {args.base} (PYTHONPATH), warm, run for run in turn "
               f"({args.warm_runs} rounds per repeat); the difference is the median over a repeat's rounds of this "
               "checkout's first token minus the base's, then the median over the repeats.", "",
               "| model | warm, this checkout (s) | warm, base (s) | difference (s) |", "|---|---|---|---|"]
        md += [f"| {name} | {both(m, 'warm')} | {both(m, 'warm_base')} | {m['warm_delta']:+.3f} |"
               for name, m in medians.items()]
    text = "\n".join(md) + "\n"
    print(text)
    write_results(args.name, payload, text)


if __name__ == "__main__":
    main()
