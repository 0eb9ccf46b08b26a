"""The q8 mode's integer dot-product variants side by side, on the bundled models' own matrices.

    python bench/q8_dots.py [--rows 1,4,8,64] [--repeats 7] [-t THREADS] [--name q8_dots]

For one matrix of each quant type the bundled models hold (SmolLM2 Q4_1: its FFN and its Q8_0
output head; Gemma 3 270M Q4_K_M: its Q4_K, Q5_0, Q6_K and Q8_0 matrices), packed for
precision="q8", times out (T, n_rows) = W @ q8(X) through each variant the CPU has
(q8_choice.DOTS: avx2, vnni, vnni512), the variants interleaved in one process and the minimum
over repeats kept (noise only adds time), and checks that every variant gives the same bits.
Reports microseconds per call and GMAC/s (n_rows x n_cols x T multiply-adds per call), and each
variant's speed relative to the 8-lane VNNI one (VNNI's time over the variant's: above 1x is
faster). Writes bench/results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numba
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, write_results  # noqa: E402


def matrices():
    """[(label, PackedMatrix)]: the first matrix of each q8 type in each bundled model, in file order
    (SmolLM2's Q8_0 one is its token embedding, which is also its output head)."""
    from ringllm.models.bundled import default_model_path, gemma3_model_path
    from ringllm.models.loader import load_model
    from ringllm.runtime import matvec as mv
    from ringllm.runtime.q8_choice import q8_kernels
    from ringllm.runtime.quant_types import GGMLType
    out, seen = [], set()
    for label, path in (("SmolLM2", default_model_path()), ("Gemma 3", gemma3_model_path())):
        model = load_model(path)
        for name, t in model.tensors.items():
            qtype = getattr(t, "qtype", None)
            if qtype is None or len(t.shape) != 2 or (label, qtype) in seen:
                continue
            if label == "Gemma 3" and name.startswith("token_embd"):
                continue                       # 262,144 rows: minutes of packing for one more Q8_0 matrix
            if qtype not in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q5_0, GGMLType.Q6_K, GGMLType.Q8_0):
                continue
            q8_kernels(qtype)                  # a type without q8 kernels would have raised
            seen.add((label, qtype))
            out.append((f"{label} {name} {qtype.name}", mv.pack(t, "q8")))
    return out


def time_call(fn, min_s: float = 0.05) -> float:
    """Seconds per call: calls repeated for at least min_s."""
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_s:
            return dt / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,8,64")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--name", default="q8_dots")
    args = ap.parse_args()
    from ringllm.runtime.q8_choice import DOTS, q8_kernels
    from ringllm.runtime.quant_tiles_q8 import HAS_VNNI
    from ringllm.runtime.quant_tiles_q8_wide import HAS_VNNI512
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    dots = [d for d in DOTS if d == "avx2" or (d == "vnni" and HAS_VNNI) or (d == "vnni512" and HAS_VNNI512)]
    rng = np.random.default_rng(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for label, pm in matrices():
        for T in rows_list:
            X = rng.standard_normal((T, pm.n_cols)).astype(np.float32)
            outs = {d: np.zeros((T, pm.n_rows), np.float32) for d in dots}
            kernels = {d: q8_kernels(pm.qtype, d)[0] for d in dots}
            acts = pm.q8_acts.for_rows(T)
            best = {d: float("inf") for d in dots}
            for _ in range(args.repeats):
                for d in dots:
                    best[d] = min(best[d], time_call(lambda: kernels[d](outs[d], pm.buf, X, *acts, pm.n_blocks)))
            same = all(np.array_equal(outs[d], outs[dots[0]]) for d in dots)
            macs = pm.n_rows * pm.n_cols * T
            row = {"matrix": label, "shape": [pm.n_rows, pm.n_cols], "T": T, "same_bits": same,
                   "us": {d: best[d] * 1e6 for d in dots}, "gmac_s": {d: macs / best[d] / 1e9 for d in dots}}
            results.append(row)
            print(label, T, {d: round(best[d] * 1e6, 1) for d in dots}, "same bits" if same else "DIFFERENT BITS",
                  flush=True)
    cmd = "python bench/q8_dots.py " + " ".join(sys.argv[1:])
    m = machine()
    lines = ["# q8 integer dot products: AVX2, VNNI on 8 lanes, VNNI on 16 lanes", "",
             f"Command: `{cmd}`  ", f"Machine: {m}, {args.threads} threads", "",
             "One call out (T, n_rows) = W @ q8(X) per variant, interleaved, min of "
             f"{args.repeats} repeats; microseconds per call (GMAC/s). All variants gave the same bits: "
             f"{all(r['same_bits'] for r in results)}.", "",
             "| matrix | rows x cols | T | " + " | ".join(dots) + " | " +
             " | ".join(f"{d} speed vs vnni" for d in dots if d != "vnni" and "vnni" in dots) + " |",
             "|---|---|---|" + "---|" * (len(dots) + sum(1 for d in dots if d != "vnni" and "vnni" in dots))]
    for r in results:
        cells = [f"{r['us'][d]:.1f} ({r['gmac_s'][d]:.0f})" for d in dots]
        ratios = [f"{r['us']['vnni'] / r['us'][d]:.2f}x" for d in dots if d != "vnni" and "vnni" in dots]
        lines.append(f"| {r['matrix']} | {r['shape'][0]} x {r['shape'][1]} | {r['T']} | " + " | ".join(cells) +
                     " | " + " | ".join(ratios) + " |")
    write_results(args.name, {"machine": m, "command": cmd, "threads": args.threads, "dots": dots, "results": results},
                  "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
