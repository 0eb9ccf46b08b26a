"""The cyclic garbage collector's own time in a cold start, with and without runtime/compile_gc.py.

    python bench/collector_time.py [--models smollm2,gemma3] [--rounds 2] [--name collector_time]

Each run is a fresh process on an empty kernel cache, compiling alone (RINGLLM_COMPILE_HELPER=0), that
builds `LLM(model)` and generates one token of a short prompt: the path of `ringllm generate -n 1`,
in one process so that the collector can be timed in it (gc.callbacks: seconds and passes per
generation). "raised" is the runtime as it is (the youngest generation's threshold raised to
compile_gc.COMPILE_GEN0 while Numba compiles); "off" sets COMPILE_GEN0 to CPython's default 700,
which leaves the thresholds as they are. The two alternate, --rounds times each. Reported per run:
the collector's seconds and passes, the wall time of the LLM's construction and first token, and the
process's peak resident memory (getrusage). Writes bench/results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, write_results  # noqa: E402
from startup import PROMPT, _model_paths  # noqa: E402

CHILD = r"""
import gc, json, resource, sys, time
passes = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
began = [0.0]
def timed(phase, info):
    if phase == "start":
        began[0] = time.perf_counter()
    else:
        passes[info["generation"]][0] += 1
        passes[info["generation"]][1] += time.perf_counter() - began[0]
gc.callbacks.append(timed)
import ringllm.runtime.compile_gc as compile_gc
if sys.argv[2] == "off":
    compile_gc.COMPILE_GEN0 = 700
from ringllm import LLM
t0 = time.perf_counter()
list(LLM(sys.argv[1]).generate(sys.argv[3], max_tokens=1))
wall = time.perf_counter() - t0
print(json.dumps({"wall_s": wall, "gc_s": sum(s for _, s in passes.values()),
                  "passes": {g: n for g, (n, _) in passes.items()},
                  "gc_s_by_generation": {g: s for g, (_, s) in passes.items()},
                  "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def cold_run(path: str, mode: str) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache, RINGLLM_COMPILE_HELPER="0")
        env.pop("RINGLLM_NUMBA_CACHE_BASE", None)
        out = subprocess.run([sys.executable, "-c", CHILD, path, mode, PROMPT], env=env, capture_output=True,
                             text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default="collector_time")
    args = ap.parse_args()
    paths = _model_paths(args.models.split(","))
    runs = {name: {"raised": [], "off": []} for name in paths}
    for _ in range(args.rounds):
        for name, path in paths.items():
            for mode in ("off", "raised"):
                runs[name][mode].append(cold_run(path, mode))
                print(name, mode, runs[name][mode][-1], file=sys.stderr, flush=True)
    command = f"python bench/collector_time.py --models {args.models} --rounds {args.rounds} --name {args.name}"
    payload = {"machine": machine(), "command": command, "runs": runs}
    md = ["# The collector's time in a cold start, with and without compile_gc\n",
          f"`{command}` on {payload['machine']['cpu']}, {payload['machine']['cores']} cores. One process per run, "
          "empty kernel cache, compiling alone: `LLM(model)` and one generated token. raised: the youngest "
          "generation's threshold raised while Numba compiles (runtime/compile_gc.py); off: CPython's thresholds "
          "throughout. Medians over the rounds (runs alternate).\n",
          "| model | mode | collector s | passes gen0 / gen1 / gen2 | wall s | peak RSS MB |", "|---|---|---|---|---|---|"]
    for name, modes in runs.items():
        for mode in ("off", "raised"):
            rs = modes[mode]
            med = {k: float(np.median([r[k] for r in rs])) for k in ("gc_s", "wall_s", "maxrss_mb")}
            passes = " / ".join(str(int(np.median([r["passes"][str(g)] for r in rs]))) for g in range(3))
            md.append(f"| {name} | {mode} | {med['gc_s']:.2f} | {passes} | {med['wall_s']:.1f} | "
                      f"{med['maxrss_mb']:.0f} |")
    text = "\n".join(md) + "\n"
    print(text)
    write_results(args.name, payload, text)


if __name__ == "__main__":
    main()
