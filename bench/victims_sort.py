"""Staged eviction's victim choice: eviction.choose_victims (its own merge sort, eviction.sort_i64)
against the NumPy sorts it replaced (two stable argsorts, by seq then by key, and fancy indexing),
both compiled in this process, the same victims checked, timed in turn.

    python bench/victims_sort.py [--repeats 200] [--name victims_sort]

One head of n slots (grid-like keys with many ties, sequence indices shuffled), 4 sinks and 16 recent
slots protected, k victims: microseconds per call, the fastest of --repeats calls, both in turn over
three rounds. Writes bench/results/NAME.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from numba import njit

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, write_results  # noqa: E402

CASES = ((512, 16), (4096, 32), (32768, 64))


@njit(cache=False, nogil=True)
def numpy_sorts(key_h, seq_h, rank_h, n, n_drop, sinks, recent, out):
    """The staged branch as it was: NumPy's stable argsorts (ties of key -> older first)."""
    cand = np.empty(n, np.int64)
    m = 0
    for j in range(n):
        if rank_h[j] >= sinks and rank_h[j] < n - recent:
            cand[m] = j
            m += 1
    cand = cand[:m]
    cand = cand[np.argsort(seq_h[cand], kind="mergesort")]
    cand = cand[np.argsort(key_h[cand], kind="mergesort")]
    got = min(n_drop, m)
    out[:got] = cand[:got]
    return got


def _best_us(fn, args, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def main() -> None:
    from ringllm.runtime.eviction import choose_victims

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--name", default="victims_sort")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for n, k in CASES:
        key = np.floor(rng.random(n) * 4096) / 4096
        seq = rng.permutation(n).astype(np.int64)
        rank = np.argsort(np.argsort(seq)).astype(np.int64)
        outs = {name: np.zeros(k, np.int64) for name in ("numpy", "own")}
        numpy_sorts(key, seq, rank, n, k, 4, 16, outs["numpy"])
        choose_victims(key, seq, rank, n, k, 4, 16, outs["own"])
        assert (outs["numpy"] == outs["own"]).all(), (n, k)
        best = {"numpy": float("inf"), "own": float("inf")}
        for _ in range(3):
            best["numpy"] = min(best["numpy"], _best_us(numpy_sorts, (key, seq, rank, n, k, 4, 16, outs["numpy"]),
                                                        args.repeats))
            best["own"] = min(best["own"], _best_us(choose_victims, (key, seq, rank, n, k, 4, 16, outs["own"]),
                                                    args.repeats))
        rows.append({"slots": n, "victims": k, "numpy_us": best["numpy"], "own_us": best["own"]})
        print(rows[-1], flush=True)
    md = ["# Staged eviction's victim choice: its own merge sort against NumPy's sorts", "",
          f"`python bench/victims_sort.py {' '.join(sys.argv[1:])}`", "", f"Machine: {machine()}", "",
          "Microseconds per choose_victims call (one head, 4 sinks and 16 recent slots protected; fastest of "
          f"{args.repeats} calls, three rounds in turn); the same victims from both:", "",
          "| slots | victims | NumPy argsorts (us) | sort_i64 (us) |", "|---|---|---|---|"]
    md += [f"| {r['slots']} | {r['victims']} | {r['numpy_us']:.1f} | {r['own_us']:.1f} |" for r in rows]
    write_results(args.name, {"machine": machine(), "args": vars(args), "rows": rows}, "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
