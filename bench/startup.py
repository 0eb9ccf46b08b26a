"""Start-up time: a cold start (empty Numba cache: every kernel compiled) against a warm one (kernels
loaded from the on-disk cache, `cache=True`), each a fresh process that loads the bundled model and
decodes 4 tokens after a short prompt.

    python bench/startup.py [--repeats 3]

Writes bench/results/startup.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, write_results  # noqa: E402

CHILD = r"""
import time
t0 = time.perf_counter()
from ringllm.models.loader import load_model
from ringllm.runtime.engine import CPUEngine
m = load_model(None)
t1 = time.perf_counter()
eng = CPUEngine(m.spec, m.tensors)
st = eng.new_store(capacity=64, policy="streaming")
lg = eng.prefill(m.tokenizer.encode("Hello there, how are you?"), st)
for _ in range(4):
    lg = eng.step(int(lg.argmax()), st)
t2 = time.perf_counter()
print(t1 - t0, t2 - t1, t2 - t0)
"""


def timed(cache_dir: str) -> list[float]:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return [float(x) for x in out.stdout.split()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cold, warm = [], []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as d:
            cold.append(timed(d))
            warm.append(timed(d))
    cold, warm = np.array(cold), np.array(warm)
    rows = {"cold": np.median(cold, axis=0).tolist(), "warm": np.median(warm, axis=0).tolist()}
    payload = {"machine": machine(), "repeats": args.repeats, "columns": ["import+load s", "engine+5 tokens s", "total s"],
               "median": rows, "cold_runs": cold.tolist(), "warm_runs": warm.tolist()}
    md = ["# Start-up: cold (empty Numba cache) vs warm (cached kernels)\n",
          f"Fresh process each: import, load the bundled SmolLM2, build the engine, prefill a short prompt, decode 4 "
          f"tokens. Median of {args.repeats}, {payload['machine']['cpu']}, {payload['machine']['cores']} cores.\n",
          "| start | import + load (s) | engine + first tokens (s) | total (s) |", "|---|---|---|---|"]
    for name, r in rows.items():
        md.append(f"| {name} | {r[0]:.2f} | {r[1]:.2f} | {r[2]:.2f} |")
    text = "\n".join(md) + "\n"
    print(text)
    write_results("startup", payload, text)


if __name__ == "__main__":
    main()
