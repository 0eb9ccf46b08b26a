"""How close ringllm's logits come to llama.cpp's, in exact (f32) and q8 precision.

    python bench/q8_logits.py [--tokens 128] [-t 2]

For SmolLM2-135M (Q4_1 + Q8_0) and Gemma 3 270M (Q5_0, Q4_K, Q6_K, Q8_0): one text of `tokens`
tokens (tests/data's novel) through llama.cpp (llama-cpp-python, logits of every position) and through
CPUEngine with precision "f32" and "q8" (policy full, prefill in chunks of 64). llama.cpp quantizes
the activations of its weight products to 8 bits (Q8_0 / Q8_K); the q8 mode rounds them the same way,
so its logits should sit much closer to llama.cpp's than the exact mode's. Reports, per model and
precision, the largest and the mean absolute logit difference over all positions and the share of
positions where the top token agrees; and how far the same engine's logits move when its input
embeddings are scaled by 1 + 1e-6 (the sensitivity of each precision to a rounding-level change: a
q8 rounding that flips moves an activation by a whole step). Writes bench/results/q8_logits.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import llama_cpp_model, machine, write_results  # noqa: E402


def _models() -> list[tuple[str, str]]:
    from ringllm.models.bundled import default_model_path, gemma3_model_path
    return [("SmolLM2-135M Q4_1", default_model_path()), ("Gemma 3 270M Q4_K_M", gemma3_model_path())]


def _text() -> str:
    here = os.path.join(os.path.dirname(__file__), "..", "tests", "data")
    name = sorted(f for f in os.listdir(here) if f.endswith(".txt"))[0]
    with open(os.path.join(here, name), encoding="utf-8") as fh:
        return fh.read()[20000:40000]


def compare(label: str, path: str, n_tokens: int, threads: int) -> dict:
    from ringllm.models.loader import load_model
    from ringllm.runtime.engine import CPUEngine
    from ringllm.runtime.kv_config import KVConfig

    m = load_model(path)
    ids = m.tokenizer.encode(_text())[:n_tokens]
    llm = llama_cpp_model(path, n_ctx=n_tokens + 16, n_threads=threads, logits_all=True)
    llm.reset()
    llm.eval(ids)
    want = np.array(llm.scores[:len(ids)], np.float64)
    row = {"model": label, "file": os.path.basename(path), "tokens": len(ids)}
    for precision in ("f32", "q8"):
        eng = CPUEngine(m.spec, m.tensors, n_threads=threads, precision=precision)
        got = eng.logits(ids, eng.new_store(KVConfig(capacity=len(ids) + 8, policy="full"))).astype(np.float64)
        diff = np.abs(got - want)
        row[precision] = {"max_abs": round(float(diff.max()), 4), "mean_abs": round(float(diff.mean()), 5),
                          "top1_agree": round(float(np.mean(got.argmax(1) == want.argmax(1))), 4)}
        # sensitivity: the same engine with its input embeddings scaled by 1 + 1e-6
        orig = eng._embed

        def nudged(b, ids_, orig=orig):
            orig(b, ids_)
            b.x *= np.float32(1 + 1e-6)
        eng._embed = nudged
        again = eng.logits(ids, eng.new_store(KVConfig(capacity=len(ids) + 8, policy="full"))).astype(np.float64)
        row[precision]["self_max_abs_1e-6"] = round(float(np.abs(again - got).max()), 4)
        print(label, precision, row[precision], flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    rows = [compare(label, path, args.tokens, args.threads) for label, path in _models()]
    md = ["# ringllm logits against llama.cpp's, exact and q8 precision", "",
          f"Machine: {machine()['cpu']}, {args.threads} threads. Command: `python bench/q8_logits.py --tokens "
          f"{args.tokens} -t {args.threads}`", "",
          f"One text of {args.tokens} tokens, logits at every position, llama-cpp-python against CPUEngine "
          "(policy full). llama.cpp rounds the activations of its weight products to 8 bits; precision q8 "
          "does the same.", "",
          "| model | precision | max abs diff | mean abs diff | top-1 agrees | max change, input x (1 + 1e-6) |",
          "|---|---|---|---|---|---|"]
    for r in rows:
        for p in ("f32", "q8"):
            d = r[p]
            md.append(f"| {r['model']} | {p} | {d['max_abs']} | {d['mean_abs']} | {100 * d['top1_agree']:.1f}% | "
                      f"{d['self_max_abs_1e-6']} |")
    write_results("q8_logits", {"machine": machine(), "threads": args.threads, "rows": rows}, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
