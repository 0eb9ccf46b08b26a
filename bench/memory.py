"""Memory: the whole process's resident set (RSS), ringllm beside llama.cpp, at the same context.

For each model, each runtime runs in a fresh process (`python -c CHILD`) that reports its RSS
(VmRSS, split into RssAnon and RssFile) from /proc/self/status at three points, and its peak (VmHWM):

- import: `import ringllm` / `from llama_cpp import Llama`;
- load: ringllm.LLM(model, kv=KVConfig(capacity=CONTEXT, k_type=KV, v_type=KV), n_threads=T) /
  Llama(model, n_ctx=CONTEXT, n_threads=T, type_k=KV, type_v=KV);
- generation: after TOKENS generated tokens (greedy, end-of-sequence ignored, so both make the same count).

Both hold their KV cache in the same type, --kv-type: f16 by default, llama.cpp's default cache type.

ringllm's resident memory after the generation is then split by part (ringllm.memory_report, what
`ringllm bench --memory` prints: the pages each part's arrays have resident, a page shared by two
parts counted for the first; packed weights, f32 vectors, the KV store, engine scratch, and the pages
of llvmlite's shared library still resident), except the tokenizer, measured here in a separate
process (the RSS it adds, built from the GGUF metadata which is then dropped, as loading does; heap
trimmed before and after); the rest is Python, NumPy, Numba and the other libraries.

A ringllm process is run once unmeasured first, so that the measured one loads its kernels from the
cache instead of compiling them (compiling holds LLVM's memory). Memory figures do not depend on the
machine's load, so this benchmark can run beside timings.

    python bench/memory.py [--models smollm2,gemma3] [--threads 2] [--context 512] [--tokens 64] [--kv-type f16]
                           [--name memory]

Writes bench/results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, write_results  # noqa: E402

PROMPT = "The capital of France is"
TARGET = 1.3        # issue #24: ringllm's RSS at most 1.3x llama.cpp's
GGML_TYPE = {"f32": 0, "f16": 1}        # llama.cpp's type_k / type_v for each --kv-type

# Shared by both children: /proc/self/status fields in MiB.
STATUS = r"""
import json, sys
def status():
    out = {}
    for line in open("/proc/self/status"):
        key, _, val = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(val.split()[0]) / 1024
    return out
"""

RINGLLM_CHILD = STATUS + r"""
path, threads, context, tokens, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
kv_type = sys.argv[6]
stages = {}
import ringllm
stages["import"] = status()
llm = ringllm.LLM(path, kv=ringllm.KVConfig(capacity=context, k_type=kv_type, v_type=kv_type), n_threads=threads)
stages["load"] = status()
done = llm.complete(prompt, max_tokens=tokens, ignore_eos=True)
stages["generation"] = status()

from ringllm.memory_report import report
eng = llm.engine
mats = list(eng.mats.values())
parts = report(llm)["parts"]
parts.pop("vocabulary table")        # counted in the tokenizer, measured apart (TOKENIZER_CHILD)
alloc = {"packed weights": sum(pm.buf.nbytes for pm in mats) / 2**20, "logits_buf": eng.logits_buf.nbytes / 2**20}
print(json.dumps({"stages": stages, "parts": parts, "allocated": alloc, "tokens": len(done.tokens)}))
"""

# the tokenizer, measured as the RSS it adds once built and the file's metadata dropped (heap trimmed around it)
TOKENIZER_CHILD = STATUS + r"""
import ctypes, gc
path = sys.argv[1]
import ringllm
from ringllm.models.gguf_file import GGUFFile
from ringllm.models.tokenizer import Tokenizer
def settled():
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    return status()["VmRSS"]
r0 = settled()
metadata = GGUFFile(path).metadata
r1 = settled()
tok = Tokenizer.from_gguf(metadata, path)
del metadata                   # as loading does: the model keeps its tokenizer, not the file's vocabulary
r2 = settled()
print(json.dumps({"tokenizer": r2 - r0, "metadata_while_loading": r1 - r0}))
"""

LLAMA_CPP_CHILD = STATUS + r"""
path, threads, context, tokens, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
stages = {}
from llama_cpp import Llama
stages["import"] = status()
kv_type = int(sys.argv[6])
llm = Llama(model_path=path, n_ctx=context, n_threads=threads, n_threads_batch=threads, type_k=kv_type,
            type_v=kv_type, verbose=False)
stages["load"] = status()
n = 0
for _ in llm.generate(llm.tokenize(prompt.encode()), temp=0.0):     # generate() does not stop at EOS
    n += 1
    if n == tokens:
        break
stages["generation"] = status()
print(json.dumps({"stages": stages, "tokens": n}))
"""


def _model_paths(names: list[str]) -> dict[str, str]:
    from ringllm.models.bundled import default_model_path, gemma3_model_path
    found = {"smollm2": default_model_path, "gemma3": gemma3_model_path}
    return {name: found[name]() for name in names}


def _child(code: str, *args) -> dict:
    """Run `code` in a fresh interpreter with args; its last stdout line, parsed as JSON."""
    res = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"child failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def run_model(path: str, threads: int, context: int, tokens: int, kv_type: str) -> dict:
    """ringllm (after one unmeasured run that fills the kernel cache), its tokenizer, then llama.cpp."""
    args = (path, threads, context, tokens, PROMPT)
    _child(RINGLLM_CHILD, *args, kv_type)
    out = {"ringllm": _child(RINGLLM_CHILD, *args, kv_type), "tokenizer": _child(TOKENIZER_CHILD, path)}
    try:
        import llama_cpp  # noqa: F401
        out["llama_cpp"] = _child(LLAMA_CPP_CHILD, *args, GGML_TYPE[kv_type])
    except ImportError:
        out["llama_cpp"] = None
    r = out["ringllm"]
    rss = r["stages"]["generation"]["VmRSS"]
    parts = dict(r["parts"])
    parts["tokenizer"] = out["tokenizer"]["tokenizer"]
    parts["rest (Python, NumPy, Numba, other libraries)"] = rss - sum(parts.values())
    out["breakdown"] = parts
    return out


def _table(name: str, res: dict) -> list[str]:
    r, ll = res["ringllm"]["stages"], (res["llama_cpp"] or {}).get("stages")

    def row(label, fn):
        a = fn(r)
        b = fn(ll) if ll else None
        ratio = f"{a / b:.2f}x" if b else "n/a"
        return f"| {name} | {label} | {a:.0f} | {'n/a' if b is None else f'{b:.0f}'} | {ratio} |"
    return [row("RSS after import", lambda s: s["import"]["VmRSS"]),
            row("RSS after load", lambda s: s["load"]["VmRSS"]),
            row("RSS after generation", lambda s: s["generation"]["VmRSS"]),
            row("peak (VmHWM)", lambda s: s["generation"]["VmHWM"]),
            row("RssAnon after generation", lambda s: s["generation"]["RssAnon"]),
            row("RssFile after generation", lambda s: s["generation"]["RssFile"])]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--kv-type", choices=tuple(GGML_TYPE), default="f16",
                    help="both runtimes' KV cache type (f16: llama.cpp's default)")
    ap.add_argument("--name", default="memory", help="results file name under bench/results")
    args = ap.parse_args()
    paths = _model_paths(args.models.split(","))
    results = {}
    for name, path in paths.items():
        results[name] = run_model(path, args.threads, args.context, args.tokens, args.kv_type)
        print(name, json.dumps(results[name]["breakdown"]), file=sys.stderr, flush=True)
    payload = {"machine": machine(), "command": f"python bench/memory.py --models {args.models} --threads "
               f"{args.threads} --context {args.context} --tokens {args.tokens} --kv-type {args.kv_type} "
               f"--name {args.name}",
               "threads": args.threads, "kv_type": args.kv_type,
               "context": args.context, "tokens": args.tokens, "prompt": PROMPT, "models": paths,
               "target_ratio": TARGET, "results": results}
    md = ["# Memory: the whole process's RSS, beside llama.cpp\n",
          f"`{payload['command']}` on {payload['machine']['cpu']}, {payload['machine']['cores']} cores. Each "
          f"runtime in a fresh process: ringllm `LLM(model, kv=KVConfig(capacity={args.context}, k_type="
          f"{args.kv_type!r}, v_type={args.kv_type!r}))`, llama-cpp-python `Llama(model, n_ctx={args.context}, "
          f"type_k={GGML_TYPE[args.kv_type]}, type_v={GGML_TYPE[args.kv_type]})` (KV {args.kv_type} both), "
          f"{args.threads} threads, {args.tokens} generated tokens. MiB, "
          f"from /proc/self/status; the target is ringllm <= {TARGET}x llama.cpp.\n",
          "| model | figure | ringllm (MiB) | llama.cpp (MiB) | ringllm / llama.cpp |", "|---|---|---|---|---|"]
    for name, res in results.items():
        md += _table(name, res)
    md += ["\nringllm's RSS after the generation, by part (MiB; resident pages, the tokenizer as the RSS it adds "
           "when built alone):\n", "| model | part | MiB | share |", "|---|---|---|---|"]
    for name, res in results.items():
        total = res["ringllm"]["stages"]["generation"]["VmRSS"]
        for part, mib in res["breakdown"].items():
            md.append(f"| {name} | {part} | {mib:.1f} | {100 * mib / total:.0f}% |")
        md.append(f"| {name} | **total RSS** | {total:.1f} | 100% |")
    text = "\n".join(md) + "\n"
    print(text)
    write_results(args.name, payload, text)


if __name__ == "__main__":
    main()
