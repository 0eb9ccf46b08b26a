"""The machine's float32 multiply-add peak, measured: the ceiling the matmul kernels are compared with.

    python bench/fma_peak.py [-t THREADS] [--name fma_peak]

Twelve independent accumulators (more than an FMA's latency times its issue rate, so the loop is
bound by issue, not by the dependency chains) updated with fused multiply-adds of registers only,
no memory traffic, in 8-lane vectors (AVX2 ymm) and 16-lane ones (one AVX-512 zmm where the CPU has
it, else two ymm), on one thread and on every thread. GFLOP/s = 2 x lanes x FMAs / s. The
accumulators start from different values and are all stored at the end: identical chains would be
merged by LLVM into one (latency-bound) chain, and unused ones removed.

`measure()` is what bench/prefill_profile.py states its "% of peak" against. Writes
bench/results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numba
import numpy as np
from numba import njit, prange

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, write_results  # noqa: E402

from ringllm.runtime.simd import HAS_AVX512, vfma, vload, vstore, zfma, zload, zstore  # noqa: E402

FMAS_PER_ITER = 12


def _threaded_peak(load, fma, store):
    """A parallel kernel (x, outs, n): on each thread t, FMAS_PER_ITER accumulators loaded from x, n
    iterations of fma(w, v, a) on each, all stored to outs[t]; load/fma/store: one width's intrinsics."""
    @njit(cache=False)
    def one(x, out, n):
        w, v = load(x, 0), load(x, 1)
        a0, a1, a2, a3, a4, a5 = load(x, 2), load(x, 3), load(x, 4), load(x, 5), load(x, 6), load(x, 7)
        a6, a7, a8, a9, a10, a11 = load(x, 8), load(x, 9), load(x, 10), load(x, 11), load(x, 12), load(x, 13)
        for _ in range(n):
            a0, a1, a2, a3 = fma(w, v, a0), fma(w, v, a1), fma(w, v, a2), fma(w, v, a3)
            a4, a5, a6, a7 = fma(w, v, a4), fma(w, v, a5), fma(w, v, a6), fma(w, v, a7)
            a8, a9, a10, a11 = fma(w, v, a8), fma(w, v, a9), fma(w, v, a10), fma(w, v, a11)
        for i, a in enumerate((a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11)):
            store(out, 16 * i, a)

    @njit(cache=False, parallel=True)
    def on_threads(x, outs, n):
        for t in prange(outs.shape[0]):
            one(x, outs[t], n)
    return on_threads


_KERNELS = {8: _threaded_peak(vload, vfma, vstore), 16: _threaded_peak(zload, zfma, zstore)}


def measure(threads: int | None = None, n: int = 5_000_000, repeats: int = 3) -> dict:
    """GFLOP/s of the register-only FMA loops: {"8": ..., "16": ...} on `threads` threads (default
    all of Numba's), the best of `repeats` runs of n iterations per thread."""
    threads = threads or numba.get_num_threads()
    x = np.arange(64, dtype=np.float32) * np.float32(1e-9)
    outs = np.zeros((threads, 16 * FMAS_PER_ITER), np.float32)
    res = {}
    for lanes, kernel in _KERNELS.items():
        kernel(x, outs, 10)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            kernel(x, outs, n)
            best = min(best, time.perf_counter() - t0)
        res[str(lanes)] = 2 * lanes * FMAS_PER_ITER * n * threads / best / 1e9
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("--name", default="fma_peak")
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    rows = {t: measure(t) for t in sorted({1, args.threads})}
    command = "python bench/fma_peak.py " + " ".join(sys.argv[1:])
    md = ["# Float32 FMA peak", "", f"`{command}`", "", f"Machine: {machine()}; AVX-512: {HAS_AVX512}.", "",
          "Register-only fused multiply-adds, 12 independent accumulators (bench/fma_peak.py), best of 3:", "",
          "| threads | 8 lanes GFLOP/s | 16 lanes GFLOP/s |", "|---|---|---|"]
    md += [f"| {t} | {r['8']:.0f} | {r['16']:.0f} |" for t, r in rows.items()]
    write_results(args.name, {"machine": machine(), "command": command, "avx512": HAS_AVX512,
                              "gflops": {str(t): r for t, r in rows.items()}}, "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
