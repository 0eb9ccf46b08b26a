"""Multi-token in-place KV update (EQUIP D.7): k tokens enter and k leave in one call, against k
single-token writes.

    python bench/kv_multi_update.py [--capacities 512,2048] [-k 64] [--reps 200] [--name kv_multi_update]

One layer of SmolLM2's KV shape (3 kv heads, head_dim 64), full; each update replaces k tokens of
every head (random unprotected victims, 4 sinks) by k new ones. Ways, all leaving identical stores:
  multi        kv_replace_many with k tokens: one pass over the head (ranks: binary search over
               the k leaving tokens), O(n log k + k hd)
  single_jit   k calls of kv_replace_many with 1 token, looped inside Numba (no dispatch cost): O(k n)
  single_py    the same k calls from Python (what a per-token caller pays, dispatch included)
  ring_jit     k calls of kv_write_streaming (the ring's one-token write, oldest victim), in Numba
Median time per update over reps (positions reindexed). Writes bench/results/<name>.{json,md}.
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

from ringllm.runtime.kv_multi import kv_replace_many  # noqa: E402
from ringllm.runtime.kv_write import kv_write_streaming  # noqa: E402


@njit(cache=False)
def _single_loop(k_l, v_l, seq_l, rank_l, pos_l, kbase_l, score_l, aux_l, hist_l, count_l, evicted_l, slots, k_new,
                 v_new, seq_new, reindexed, vseq):
    for i in range(seq_new.shape[0]):
        kv_replace_many(k_l, v_l, seq_l, rank_l, pos_l, kbase_l, score_l, aux_l, hist_l, count_l, evicted_l,
                        slots[:, i:i + 1], k_new[i:i + 1], v_new[i:i + 1], seq_new[i:i + 1], reindexed, False,
                        vseq)


@njit(cache=False)
def _ring_loop(k_l, v_l, seq_l, pos_l, count_l, evicted_l, k_new, v_new, seq0, sinks):
    for i in range(k_new.shape[0]):
        kv_write_streaming(k_l, v_l, seq_l, pos_l, count_l, evicted_l, k_new[i], v_new[i], seq0 + i, sinks, True)


def fresh(cap, nkv, hd):
    rng = np.random.default_rng(0)
    seq = np.tile(np.arange(cap, dtype=np.int64), (nkv, 1))
    return dict(pos=seq.copy(), kbase=seq.copy(), k=rng.standard_normal((nkv, cap, hd)).astype(np.float32),
                v=rng.standard_normal((nkv, cap, hd)).astype(np.float32), seq=seq, rank=seq.copy(),
                score=np.zeros((nkv, cap)), aux=np.zeros((nkv, cap), np.int64), hist=np.zeros((nkv, 0, cap), np.float32),
                count=np.full(nkv, cap, np.int64), evicted=np.zeros(nkv, np.int64))


def run(way, cap, k, reps, nkv=3, hd=64, sinks=4):
    s = fresh(cap, nkv, hd)
    rng = np.random.default_rng(1)
    kn = rng.standard_normal((k, nkv, hd)).astype(np.float32)
    vseq = np.empty(k, np.int64)
    nxt = cap
    times = []
    for r in range(reps + 3):
        slots = np.stack([sinks + rng.permutation(cap - sinks)[:k] for _ in range(nkv)]).astype(np.int64)
        seqs = np.arange(nxt, nxt + k, dtype=np.int64)
        args = (s["k"], s["v"], s["seq"], s["rank"], s["pos"], s["kbase"], s["score"], s["aux"], s["hist"], s["count"],
                s["evicted"])
        t0 = time.perf_counter()
        if way == "multi":
            kv_replace_many(*args, slots, kn, kn, seqs, True, False, vseq)
        elif way == "single_jit":
            _single_loop(*args, slots, kn, kn, seqs, True, vseq)
        elif way == "single_py":
            for i in range(k):
                kv_replace_many(*args, slots[:, i:i + 1], kn[i:i + 1], kn[i:i + 1], seqs[i:i + 1], True, False, vseq)
        else:
            _ring_loop(s["k"], s["v"], s["seq"], s["pos"], s["count"], s["evicted"], kn, kn, nxt, sinks)
        dt = time.perf_counter() - t0
        if r >= 3:                          # the first calls compile
            times.append(dt)
        nxt += k
    # every multi-token way keeps ranks = order by sequence index (the ring write keeps none)
    for h in range(nkv if way != "ring_jit" else 0):
        assert np.array_equal(s["rank"][h], np.argsort(np.argsort(s["seq"][h])))
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacities", default="512,2048")
    ap.add_argument("-k", type=int, default=64, help="tokens replaced per update")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--name", default="kv_multi_update")
    args = ap.parse_args()
    ways = ("multi", "single_jit", "single_py", "ring_jit")
    rows = []
    for cap in [int(c) for c in args.capacities.split(",")]:
        res = {w: run(w, cap, args.k, args.reps) for w in ways}
        rows.append({"capacity": cap, "k": args.k, **{w + "_us": res[w] * 1e6 for w in ways},
                     "speedup_vs_single_jit": res["single_jit"] / res["multi"],
                     "speedup_vs_single_py": res["single_py"] / res["multi"]})
        print(rows[-1], flush=True)
    payload = {"machine": machine(), "args": vars(args), "shape": "SmolLM2 layer: 3 kv heads x head_dim 64",
               "rows": rows}
    md = ["# Multi-token in-place KV update (EQUIP D.7)", "",
          f"One layer, 3 kv heads x 64 dims, full store; {args.k} tokens leave and {args.k} enter per update "
          "(random unprotected victims). Median microseconds per update; `bench/kv_multi_update.py`.", "",
          "| capacity | multi (1 call) | k x 1-token (Numba loop) | k x 1-token (Python calls) | k x ring write | "
          "speedup vs Numba loop | vs Python calls |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['capacity']} | {r['multi_us']:.1f} | {r['single_jit_us']:.1f} | {r['single_py_us']:.1f} | "
                  f"{r['ring_jit_us']:.1f} | {r['speedup_vs_single_jit']:.1f}x | {r['speedup_vs_single_py']:.1f}x |")
    md += ["", f"Machine: {payload['machine']['cpu']}, {payload['machine']['cores']} cores (shared with other jobs "
           "when run here)."]
    write_results(args.name, payload, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
