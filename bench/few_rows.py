"""Few-row products: how T rows of x (T = 1..16) through one weight matrix cost, per kernel path.

    python bench/few_rows.py [-t THREADS] [--repeats 40] [--name few_rows]

For each weight type in the shape it has in the models people run (SmolLM2's Q4_1 FFN, Gemma 3's
Q5_0 / Q8_0 / Q6_K, a 1B model's Q4_K / Q6_K, F32 norms-sized), three ways to compute out (T, n_rows)
= X @ W.T, timed interleaved in one process (min over repeats; noise only adds time):

  per_row   one matvec per row (T separate passes over W)
  rows      the few-row kernel (matvec.ROWS_KERNELS: rows in pairs through each tile, hot in L1)
  tiled     the many-row kernel (gemm.MATMUL_TILES: each tile decoded once into a scratch)

and which one mv.matmul picks (MATMUL_MIN_T). Also GFLOP/s of the fastest path (2 n_rows n_cols T
flops per call) and its share of the machine's f32 FMA peak (--peak-gflops; by default measured in
the run, bench/fma_peak.py). Writes bench/results/<name>.{json,md}.
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
from fma_peak import measure as measure_fma_peak  # noqa: E402

from ringllm.runtime import matvec as mv  # noqa: E402
from ringllm.runtime.gemm import MATMUL_TILES, decoded_rows  # noqa: E402
from ringllm.runtime.quant_types import GGMLType  # noqa: E402
from ringllm.runtime.random_weights import random_qtensor  # noqa: E402

SHAPES = [  # (type, n_rows, n_cols, where such a matrix is)
    ("Q4_1", 1536, 576, "SmolLM2-135M ffn_up"),
    ("Q4_1", 576, 1536, "SmolLM2-135M ffn_down"),
    ("Q5_0", 2048, 640, "Gemma 3 270M ffn_up"),
    ("Q8_0", 2048, 640, "Gemma 3 270M ffn_gate"),
    ("Q4_K", 8192, 2048, "Llama-3.2-1B ffn_up"),
    ("Q6_K", 2048, 8192, "Llama-3.2-1B ffn_down"),
    ("F16", 1024, 576, "F16 projection"),
    ("F32", 1024, 576, "F32 projection"),
]
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)


def time_paths(pm, T: int, rng, repeats: int) -> dict:
    """Best seconds per call of each path for T rows."""
    X = rng.standard_normal((T, pm.n_cols)).astype(np.float32)
    out = np.empty((T, pm.n_rows), np.float32)
    scratch = np.repeat(pm.scratch[None, :], T, axis=0)
    wts = np.empty((numba.get_num_threads(), pm.n_cols, decoded_rows(pm.tile_rows)), np.float32)

    def per_row():
        for i in range(T):
            pm.kernel(out[i], pm.buf, X[i], pm.scratch)

    def rows():
        pm.rows_kernel(out, pm.buf, X, scratch)

    def tiled():
        MATMUL_TILES[pm.family](out, pm.buf, X, pm.kind, pm.n_blocks, pm.tile_rows, wts)

    paths = {"per_row": per_row, "tiled": tiled}
    if pm.rows_kernel is not None:
        paths["rows"] = rows
    best = {k: float("inf") for k in paths}
    for f in paths.values():
        f()
    for _ in range(repeats):
        for k, f in paths.items():
            t0 = time.perf_counter()
            f()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--peak-gflops", type=float, default=None, help="default: measured (bench/fma_peak.py)")
    ap.add_argument("--name", default="few_rows")
    a = ap.parse_args()
    numba.set_num_threads(a.threads)
    if a.peak_gflops is None:
        a.peak_gflops = max(measure_fma_peak(a.threads).values())
    rng = np.random.default_rng(0)
    warm = mv.pack(random_qtensor(GGMLType.Q4_1, 1536, 576, rng))
    t_end = time.perf_counter() + 2.0          # wake the worker threads and the clocks before the first shape
    while time.perf_counter() < t_end:
        time_paths(warm, 4, rng, 5)
    results = []
    for qname, n_rows, n_cols, where in SHAPES:
        pm = mv.pack(random_qtensor(GGMLType[qname], n_rows, n_cols, rng))
        for T in ROWS:
            best = time_paths(pm, T, rng, a.repeats)
            picked = "per_row" if T == 1 else ("tiled" if T >= mv.MATMUL_MIN_T else
                                               "rows" if pm.rows_kernel is not None else "per_row")
            fastest = min(best, key=best.get)
            gflops = 2.0 * n_rows * n_cols * T / best[fastest] / 1e9
            results.append(dict(type=qname, n_rows=n_rows, n_cols=n_cols, where=where, T=T,
                                us={k: round(v * 1e6, 1) for k, v in best.items()}, picked=picked, fastest=fastest,
                                gflops=round(gflops, 1), peak_share=round(gflops / a.peak_gflops, 3)))
            r = results[-1]
            print(f"{qname} {n_rows}x{n_cols} T={T}: {r['us']} picked {picked} fastest {fastest} "
                  f"{gflops:.1f} GFLOP/s", flush=True)
    cmd = "python bench/few_rows.py " + " ".join(sys.argv[1:])
    m = machine()
    lines = ["# Few-row products: per-row matvec, two-row tiles, tiled matmul\n",
             f"Command: `{cmd}`  \nMachine: {m['cpu']}, {m['cores']} cores, {a.threads} threads, load {m['load_avg_1m']}, "
             f"commit {m.get('commit')}. Best of {a.repeats} interleaved calls, microseconds per call; "
             f"`matmul` uses the two-row tiles below MATMUL_MIN_T = {mv.MATMUL_MIN_T} rows, the tiled kernel from there. "
             f"GFLOP/s of the fastest path; share of a {a.peak_gflops:.0f} GFLOP/s f32 FMA peak.\n"]
    for qname, n_rows, n_cols, where in SHAPES:
        lines.append(f"\n## {qname} {n_rows} x {n_cols} ({where})\n")
        lines.append("| T | per-row matvec (us) | two-row tiles (us) | tiled matmul (us) | matmul uses | "
                     "per-row / used | GFLOP/s (fastest) | peak share |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in results:
            if (r["type"], r["n_rows"], r["n_cols"]) != (qname, n_rows, n_cols):
                continue
            us = r["us"]
            lines.append(f"| {r['T']} | {us['per_row']} | {us.get('rows', '-')} | {us['tiled']} | {r['picked']} | "
                         f"{us['per_row'] / us[r['picked']]:.2f}x | {r['gflops']} | {100 * r['peak_share']:.0f}% |")
    write_results(a.name, {"command": cmd, "machine": m, "threads": a.threads, "matmul_min_t": mv.MATMUL_MIN_T,
                           "results": results}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
