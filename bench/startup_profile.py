"""Where start-up time goes: each kernel's compile (cold) and each phase of a warm start.

Cold: a fresh process with an empty kernel cache loads the model and runs the code paths of a
generation under the chosen policy (runtime/warmup.py: prefill of few rows and of many, decode,
eviction). Every compile Numba performs is timed through its "numba:compile" event, nested compiles
(a kernel's callees) shown under their caller; for each outermost kernel the compiler's own split is
given (type inference, which includes compiling callees, against lowering to LLVM and machine code).
Warm: a second process on the filled cache, timed phase by phase (imports, GGUF header, tokenizer,
repacking the weights, the first run of each kernel: loading it from the cache).

    python bench/startup_profile.py [--model PATH] [--policies full,h2o] [--name startup_profile]

Writes bench/results/NAME.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, write_results  # noqa: E402

COLD = r"""
import json, sys, time
t_start = time.perf_counter()
import numba.core.event as ev
events, stack = [], []
class Compiles(ev.Listener):
    def on_start(self, e):
        stack.append((time.perf_counter(), len(events)))
        events.append(None)
    def on_end(self, e):
        t0, slot = stack.pop()
        d = e.data["dispatcher"]
        events[slot] = {"kernel": d.py_func.__qualname__, "module": d.py_func.__module__, "depth": len(stack),
                        "seconds": time.perf_counter() - t0, "signature": str(e.data["args"])[:300]}
ev.register("numba:compile", Compiles())
from ringllm.kernel_warmup import _engine_for
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.warmup import warm
from ringllm.runtime import compile_clock
compile_clock.quiet()
model = None if sys.argv[1] == "-" else sys.argv[1]
engine = _engine_for(model)
t_loaded = time.perf_counter()
phases = {}
for policy in sys.argv[2:]:
    t0 = time.perf_counter()
    warm(engine, KVConfig(policy=policy, capacity=None if policy == "full" else 64))
    phases[policy] = time.perf_counter() - t0
# the compiler's own split for each outermost kernel
from numba.core.registry import CPUDispatcher
import gc
split = {}
for o in gc.get_objects():
    if isinstance(o, CPUDispatcher):
        for sig, cres in o.overloads.items():
            times = (cres.metadata or {}).get("pipeline_times") or {}
            agg = {"typing": 0.0, "lowering": 0.0, "other": 0.0}
            for passes in times.values():
                for name, t in passes.items():
                    key = ("typing" if "type_inference" in name else "lowering" if "lowering" in name else "other")
                    agg[key] += t.run
            split.setdefault(o.py_func.__qualname__, []).append(agg)
print(json.dumps({"load_s": t_loaded - t_start, "phases": phases, "events": events, "split": split}))
"""

WARM = r"""
import json, sys, time
t0 = time.perf_counter()
import numba.core.caching as caching
loads = {}
original = caching.Cache.load_overload
def timed_load(self, sig, target_context):
    t = time.perf_counter()
    r = original(self, sig, target_context)
    loads[self._name] = loads.get(self._name, 0.0) + time.perf_counter() - t
    return r
caching.Cache.load_overload = timed_load
import ringllm.llm
t1 = time.perf_counter()
from ringllm.models.gguf_file import GGUFFile
from ringllm.models.loader import load_model
path = None if sys.argv[1] == "-" else sys.argv[1]
from ringllm.models.bundled import default_model_path
GGUFFile(path or default_model_path())
t2 = time.perf_counter()
model = load_model(path)
t3 = time.perf_counter()
from ringllm.runtime.engine import CPUEngine
engine = CPUEngine(model.spec, model.tensors)
t4 = time.perf_counter()
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.warmup import warm
warm(engine, KVConfig())
t5 = time.perf_counter()
print(json.dumps({"phases": {"import ringllm": t1 - t0, "GGUF header": t2 - t1,
                             "load model (header again, tokenizer)": t3 - t2,
                             "engine (repack weights, dequantize vectors)": t4 - t3,
                             "first run of every kernel (cache loads, first calls)": t5 - t4},
                  "cache_loads": loads}))
"""


def _child(script: str, args: list[str], cache: str) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    env.pop("RINGLLM_NUMBA_CACHE_BASE", None)
    res = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def _markdown(payload: dict) -> str:
    cold, warm = payload["cold"], payload["warm"]
    top = [e for e in cold["events"] if e and e["depth"] == 0]
    total = sum(e["seconds"] for e in top)
    lines = ["# Start-up profile: compiling (cold) and loading (warm) the kernels\n",
             f"`{payload['command']}` on {payload['machine']['cpu']}, {payload['machine']['cores']} cores, "
             f"numba {payload['machine']['numba']}. Model: {payload['model']}.\n",
             "## Cold: every compile, in the order they finish\n",
             f"Model load {cold['load_s']:.2f} s; then the code paths of a generation per policy (seconds, compile "
             "included): " + ", ".join(f"{k} {v:.1f}" for k, v in cold["phases"].items()) + ". "
             f"{len(top)} outermost kernel signatures took {total:.1f} s; nested compiles (a caller's callees, "
             "indented) are inside their caller's time. typing/lowering: the compiler's own split of an outermost "
             "kernel (typing includes its callees' compiles; lowering includes LLVM's optimisation and machine code).\n",
             "| kernel | seconds | typing / lowering |", "|---|---|---|"]
    seen = {}
    for e in cold["events"]:
        if not e or e["seconds"] < 0.05:
            continue
        split = ""
        if e["depth"] == 0:
            k = seen.get(e["kernel"], 0)
            seen[e["kernel"]] = k + 1
            parts = cold["split"].get(e["kernel"], [])
            if k < len(parts):
                split = f"{parts[k]['typing']:.2f} / {parts[k]['lowering']:.2f}"
        name = ("&nbsp;&nbsp;" * e["depth"]) + f"`{e['kernel']}`"
        lines.append(f"| {name} | {e['seconds']:.2f} | {split} |")
    lines += ["\n## Warm: the same start on the filled cache\n", "| phase | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in warm["phases"].items()]
    loads = sorted(warm["cache_loads"].items(), key=lambda kv: -kv[1])
    lines += ["\nKernel cache loads (the first one also initialises Numba's compiler context): " +
              ", ".join(f"{k.split(' at ')[0].replace('<function ', '')} {v * 1e3:.0f} ms" for k, v in loads[:12]) +
              f"; {len(loads)} kernels, {sum(v for _, v in loads):.2f} s in all.\n"]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="-", help="GGUF file or HF directory (default: the bundled SmolLM2)")
    ap.add_argument("--policies", default="full,h2o", help="policies whose code paths the cold run compiles")
    ap.add_argument("--name", default="startup_profile", help="results under bench/results/NAME.{json,md}")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        cold = _child(COLD, [args.model, *args.policies.split(",")], cache)
        warm = _child(WARM, [args.model], cache)
    payload = {"machine": machine(), "command": f"python bench/startup_profile.py --model {args.model} "
               f"--policies {args.policies} --name {args.name}",
               "model": "bundled SmolLM2-135M Q4_1" if args.model == "-" else args.model,
               "cold": cold, "warm": warm}
    text = _markdown(payload)
    print(text)
    write_results(args.name, payload, text)


if __name__ == "__main__":
    main()
