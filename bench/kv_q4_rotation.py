"""Would q4_0 keys lose less if each key were rotated by a Hadamard matrix before it is quantized?

The q4_0 store (llama.cpp's block_q4_0 along head_dim: one f16 scale per 32 values) costs SmolLM2
about 10% perplexity (bench/results/kv_types_quality.md), nearly all of it from the keys (q8_0 keys
with q4_0 values: about 1%). Keys have a few channels of large magnitude; a block's scale follows
its largest value, so the block's other values keep only a few of their 4 bits. An orthonormal
Hadamard rotation H (head_dim a power of two) spreads every channel over all of them; scores are
unchanged in exact arithmetic because q . k = (H q) . (H k), so a store could hold q4_0(H k) and an
attention kernel rotate the query once per head instead of each key (the values likewise: the output
H^T sum_j p_j H v_j). This measures what that would buy, before any kernel is written: the NumPy
reference engine (runtime/reference.py) feeds a text with the whole context in the store (policy
full), its KV rounding replaced for the run by each variant:

- f32: no rounding (the baseline);
- q4_0: llama.cpp's rounding (gguf's quantize / dequantize: scale m / -8, m the value of largest
  magnitude);
- q4_0 rotated: H^T round(H x) with the same rounding;
- q4_0 rotated, best scale: the block scale chosen among 13 multiples (0.75 .. 1.05) of m / -8 to
  minimise the block's squared error (the same block format; a better encoder, not a new type).

Each for the keys alone (values f32) and for keys and values. Perplexity of the tokens after the first.

    python bench/kv_q4_rotation.py [--tokens 1024] [--model smollm2|gemma3] [--name kv_q4_rotation]

Writes bench/results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, write_results  # noqa: E402

TEXT = os.path.join(os.path.dirname(__file__), "data", "prideprejudice.txt")
SCALES = np.linspace(0.75, 1.05, 13)
VARIANTS = ("f32", "q4_0", "q4_0 rotated", "q4_0 rotated, best scale")


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Sylvester-Hadamard matrix of order n (a power of two), float32."""
    if n < 1 or n & (n - 1):
        raise SystemExit(f"head_dim {n} is not a power of two: no Sylvester-Hadamard matrix of that order")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def q4_0_best_scale(x: np.ndarray) -> np.ndarray:
    """x (..., hd) through q4_0 blocks whose f16 scale minimises each block's squared error among
    SCALES x (m / -8), then back to float32 (q = min(15, trunc(x / d + 8.5)) as llama.cpp's encoder)."""
    b = x.reshape(-1, 32).astype(np.float32)
    m = b[np.arange(len(b)), np.argmax(np.abs(b), axis=1)]
    best_err, best = None, None
    for s in SCALES:
        d = (m / np.float32(-8.0) * np.float32(s)).astype(np.float16).astype(np.float32)[:, None]
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
        y = d * (np.minimum(15.0, np.floor(b * inv + 8.5)) - 8.0)
        err = ((y - b) ** 2).sum(axis=1)
        if best is None:
            best_err, best = err, y
        else:
            better = err < best_err
            best_err, best = np.where(better, err, best_err), np.where(better[:, None], y, best)
    return best.reshape(x.shape).astype(np.float32)


@contextlib.contextmanager
def rounding(variant: str, h: np.ndarray):
    """The reference engine's q4_0 rounding replaced by `variant` for the block (other types unchanged)."""
    import ringllm.runtime.reference as ref

    plain = ref.round_kv_type

    def rounded(x, kv_type):
        if kv_type != "q4_0" or variant == "q4_0":
            return plain(x, kv_type)
        y = np.ascontiguousarray(x, np.float32) @ h.T
        y = q4_0_best_scale(y) if variant.endswith("best scale") else plain(y, "q4_0")
        return (y @ h).astype(np.float32)

    ref.round_kv_type = rounded
    try:
        yield
    finally:
        ref.round_kv_type = plain


def perplexity(engine, ids: list[int], k_type: str, v_type: str) -> float:
    from ringllm.runtime.kv_config import KVConfig

    logits = engine.forward(ids[:-1], engine.new_cache(KVConfig(k_type=k_type, v_type=v_type, policy="full")))
    z = logits - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "gemma3"))
    ap.add_argument("--name", default="kv_q4_rotation")
    args = ap.parse_args()
    from ringllm.models.bundled import default_model_path, gemma3_model_path
    from ringllm.models.loader import load_model
    from ringllm.runtime.reference import ReferenceEngine

    model = load_model({"smollm2": default_model_path, "gemma3": gemma3_model_path}[args.model]())
    with open(TEXT, encoding="utf-8") as f:
        ids = model.tokenizer.encode(f.read())[:args.tokens + 1]
    h = hadamard(model.spec.head_dim)
    engine = ReferenceEngine(model.spec, model.tensors)
    rows = []
    for what, v_rounded in (("keys", False), ("keys and values", True)):
        for variant in VARIANTS:
            if variant == "f32" and v_rounded:
                continue
            k_type = "f32" if variant == "f32" else "q4_0"
            v_type = k_type if v_rounded else "f32"
            t0 = time.perf_counter()
            with rounding(variant, h):
                ppl = perplexity(engine, ids, k_type, v_type)
            rows.append({"rounded": "none" if variant == "f32" else what, "variant": variant, "ppl": ppl,
                         "seconds": time.perf_counter() - t0})
            print(rows[-1], file=sys.stderr, flush=True)
    base = rows[0]["ppl"]
    command = f"python bench/kv_q4_rotation.py --tokens {args.tokens} --model {args.model} --name {args.name}"
    payload = {"machine": machine(), "command": command, "model": model.path, "tokens": len(ids) - 1,
               "head_dim": model.spec.head_dim, "rows": rows}
    md = ["# q4_0 keys and values with and without a Hadamard rotation (reference engine)\n",
          f"`{command}` on {payload['machine']['cpu']}. {os.path.basename(model.path)}, the first "
          f"{len(ids) - 1} tokens of Pride and Prejudice after the first, the whole context in the store (policy "
          "full); the reference engine's KV rounding replaced by each variant (bench/kv_q4_rotation.py says "
          "how). Perplexity and its change from f32.\n",
          "| rounded | variant | perplexity | vs f32 |", "|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['rounded']} | {r['variant']} | {r['ppl']:.3f} | {100 * (r['ppl'] / base - 1):+.2f}% |")
    text = "\n".join(md) + "\n"
    print(text)
    write_results(args.name, payload, text)


if __name__ == "__main__":
    main()
