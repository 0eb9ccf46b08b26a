"""OpenMP spin count: decode speed on an idle machine and latency beside a busy process, per GOMP_SPINCOUNT.

    python bench/spin_count.py [--spins auto,1000,4000,30000] [--steps 300] [--busy-steps 600] [-t 2]
                               [--rounds 2] [--name spin_count]

Numba's OpenMP layer (libgomp) keeps a thread that finished its share of a parallel kernel spinning
for GOMP_SPINCOUNT iterations of `pause` before it sleeps on a futex; the next parallel kernel wakes
a sleeping thread through the kernel (and, in a VM, the hypervisor). A decode step is ~150 parallel
kernels with Python between them, so how long the spin lasts against those gaps decides whether the
threads are awake when the next kernel starts. Too long a spin holds a core another process wants.

For each spin count ("auto": the one ringllm chooses, runtime/omp_spin.py), in a fresh process
(libgomp reads the variable once, at load), on the bundled
SmolLM2 with `-t` threads:
- idle: exact decode tok/s (one stream, 128-token prompt, `steps` tokens), q8 decode tok/s, and q8
  batched decode at B = 8 (CPUEngine.step_batch over 8 streams), total tok/s;
- busy: exact decode with one busy-looping process beside it (unpinned, what a build or a second
  app does to an edge box): per-token latency p50 / p99 and tok/s over `busy-steps` tokens.
llama.cpp (llama-cpp-python, same GGUF, same threads, its own thread pool and waiting) runs the
same exact-decode protocol in a fresh process of its own each round, for reference (no q8 or batched
figures: its greedy decode through llama-cpp-python's eval). Also the time of one `pause` on this
CPU (the unit of the spin), timed as the runtime's calibration times it (omp_spin.pause_ns).
Rounds alternate the spin counts (`--rounds`), each figure is the median over them.
Writes bench/results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, write_results  # noqa: E402

from ringllm.runtime.omp_spin import pause_ns  # noqa: E402  (the calibration's own timing)

DATA = os.path.join(os.path.dirname(__file__), "data", "prideprejudice.txt")

CHILD = r"""
import json, os, sys, time, numpy as np
from ringllm.models.bundled import default_model_path
from ringllm.models.loader import load_model
from ringllm.runtime.engine import CPUEngine
from ringllm.runtime.kv_config import KVConfig

data, threads, steps, busy_steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = load_model(default_model_path())
ids = model.tokenizer.encode(open(data, encoding="utf-8").read()[:80000])
kv = KVConfig(capacity=512, policy="streaming", sinks=4)


def decode(eng, n, start=0):
    st = eng.new_store(kv)
    tok = int(np.argmax(eng.prefill(ids[start:start + 128], st)))
    eng.step(tok, st)
    lat = np.empty(n)
    for i in range(n):
        t0 = time.perf_counter()
        tok = int(np.argmax(eng.step(tok, st)))
        lat[i] = time.perf_counter() - t0
    return lat


def batched(eng, B, n):
    stores = [eng.new_store(kv) for _ in range(B)]
    nxt = [int(np.argmax(eng.prefill(ids[2000 * i:2000 * i + 128], st))) for i, st in enumerate(stores)]
    nxt = [int(t) for t in np.argmax(eng.step_batch(nxt, stores), axis=1)]
    t0 = time.perf_counter()
    for _ in range(n):
        nxt = [int(t) for t in np.argmax(eng.step_batch(nxt, stores), axis=1)]
    return B * n / (time.perf_counter() - t0)


exact = CPUEngine(model.spec, model.tensors, n_threads=threads)
q8 = CPUEngine(model.spec, model.tensors, n_threads=threads, precision="q8")
decode(exact, 8), decode(q8, 8), batched(q8, 8, 2)           # kernels loaded before timing
out = {"gomp_spincount": int(os.environ["GOMP_SPINCOUNT"]), "exact_tok_s": steps / decode(exact, steps).sum(),
       "q8_tok_s": steps / decode(q8, steps).sum(), "q8_b8_tok_s": batched(q8, 8, steps // 4)}
print("READY", flush=True)
sys.stdin.readline()                                         # the parent has started the busy process
lat = decode(exact, busy_steps, start=4000)
out.update(busy_p50_ms=1e3 * float(np.median(lat)), busy_p99_ms=1e3 * float(np.percentile(lat, 99)),
           busy_tok_s=busy_steps / lat.sum())
print(json.dumps(out))
"""

LLAMA_CPP = r"""
import json, os, sys, time, numpy as np
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
from common import llama_cpp_last_logits, llama_cpp_model
from ringllm.models.bundled import default_model_path
from ringllm.models.loader import load_model

data, threads, steps, busy_steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ids = load_model(default_model_path()).tokenizer.encode(open(data, encoding="utf-8").read()[:80000])
llm = llama_cpp_model(default_model_path(), 128 + max(steps, busy_steps) + 16, threads)


def decode(n, start=0):
    llm.reset()
    llm.eval(ids[start:start + 128])
    tok = int(np.argmax(llama_cpp_last_logits(llm)))
    lat = np.empty(n)
    for i in range(n):
        t0 = time.perf_counter()
        llm.eval([tok])
        tok = int(np.argmax(llama_cpp_last_logits(llm)))
        lat[i] = time.perf_counter() - t0
    return lat


decode(8)
out = {"exact_tok_s": steps / decode(steps).sum()}
print("READY", flush=True)
sys.stdin.readline()
lat = decode(busy_steps, start=4000)
out.update(busy_p50_ms=1e3 * float(np.median(lat)), busy_p99_ms=1e3 * float(np.percentile(lat, 99)),
           busy_tok_s=busy_steps / lat.sum())
print(json.dumps(out))
"""

def one(spin: str, threads: int, steps: int, busy_steps: int) -> dict:
    """A fresh process with GOMP_SPINCOUNT=spin ("auto": unset): its idle figures, then its latency
    beside a busy process."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "RINGLLM_GOMP_SPINCOUNT")}
    if spin not in ("auto", "llama.cpp"):
        env["GOMP_SPINCOUNT"] = spin
    code = LLAMA_CPP if spin == "llama.cpp" else CHILD
    child = subprocess.Popen([sys.executable, "-c", code, DATA, str(threads), str(steps), str(busy_steps)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    line = child.stdout.readline()
    if line.strip() != "READY":
        child.kill()
        raise RuntimeError(f"child (spin {spin}) failed before its busy run: {line!r}")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        child.stdin.write("\n")
        child.stdin.flush()
        out, _ = child.communicate(timeout=1800)
    finally:
        busy.kill()
        busy.wait()
    if child.returncode != 0:
        raise RuntimeError(f"child (spin {spin}) exited with {child.returncode}")
    return json.loads(out.strip().splitlines()[-1])


FIELDS = (("exact_tok_s", "exact decode tok/s"), ("q8_tok_s", "q8 decode tok/s"), ("q8_b8_tok_s", "q8 B = 8 tok/s"),
          ("busy_p50_ms", "busy: p50 ms"), ("busy_p99_ms", "busy: p99 ms"), ("busy_tok_s", "busy: tok/s"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spins", default="auto,1000,4000,30000")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--busy-steps", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--no-llama-cpp", action="store_true", help="leave out llama.cpp's reference row")
    ap.add_argument("--name", default="spin_count")
    args = ap.parse_args()
    spins = args.spins.split(",")
    if not args.no_llama_cpp:
        spins.append("llama.cpp")
    ns = pause_ns()
    runs = {s: [] for s in spins}
    for r in range(args.rounds):
        for s in spins:
            runs[s].append(one(s, args.threads, args.steps, args.busy_steps))
            print(f"round {r + 1} spin {s}: {runs[s][-1]}", flush=True)
    med = {s: {k: statistics.median(run[k] for run in runs[s]) for k, _ in FIELDS if k in runs[s][0]} for s in spins}
    cmd = "python bench/spin_count.py " + " ".join(sys.argv[1:])
    m = machine()
    md = ["# OpenMP spin count (GOMP_SPINCOUNT): idle decode speed and latency beside a busy process", "",
          f"`{cmd}` on {m['cpu']}, {args.threads} threads, bundled SmolLM2, capacity 512; medians of "
          f"{args.rounds} alternated rounds, each spin count in a fresh process. One `pause` takes {ns:.1f} ns "
          f"here, so a spin of N iterations lasts about N x {ns:.1f} ns.", "",
          "| GOMP_SPINCOUNT | spin lasts | " + " | ".join(label for _, label in FIELDS) + " |",
          "|---|---|" + "---|" * len(FIELDS)]
    for s in spins:
        if s == "llama.cpp":
            label, lasts = s, "(its own)"
        else:
            count = runs[s][0]["gomp_spincount"]
            label, lasts = (f"auto ({count})" if s == "auto" else s), f"{count * ns / 1e3:.0f} us"
        md.append(f"| {label} | {lasts} | " + " | ".join(f"{med[s][k]:.1f}" if k in med[s] else "-" for k, _ in FIELDS)
                  + " |")
    write_results(args.name, {"machine": m, "command": cmd, "pause_ns": ns, "threads": args.threads,
                              "runs": runs, "medians": med},
                  "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
