"""The machine's read bandwidth beside what the decode attention reaches: the ceiling a memory-bound
kernel is measured against.

    python bench/read_bandwidth.py [--mb 256] [--slots 4096] [--repeats 7] [--name read_bandwidth]

1. Plain read: a float32 sum over a --mb buffer (larger than the last-level cache), vectorized by
   Numba, cut into 96 parts spread over 1 and then all threads; the fastest of --repeats passes, GB/s.
2. Decode attention: stored_attention.attend_stored (one thread) and attend_stored_parallel (all
   threads) over 30 layers of SmolLM2's shapes (3 kv heads, 9 query heads, head_dim 64), every
   layer's store --slots slots full, per KV type: ms per token and the store bytes read per second
   (each layer's K and V rows are read once per token; 30 distinct layers keep them out of cache).

Writes bench/results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, write_results  # noqa: E402

LAYERS, N_KV, GROUP, HEAD_DIM = 30, 3, 3, 64       # SmolLM2-135M's attention shapes


def plain_read(mb: int, repeats: int) -> dict:
    import numba
    from numba import njit, prange

    @njit(parallel=True, fastmath=True, cache=False)
    def part_sums(a, parts):
        out = np.zeros(parts, np.float32)
        n = a.shape[0] // parts
        for c in prange(parts):
            v = a[c * n:(c + 1) * n]
            s = np.float32(0.0)
            for i in range(n):          # from 0 over a view: Numba's index checks leave the loop vectorized
                s += v[i]
            out[c] = s
        return out

    a = np.random.default_rng(0).random(mb * (1 << 20) // 4, dtype=np.float32)
    res = {}
    for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
        numba.set_num_threads(threads)
        part_sums(a, 96)
        best = min(_time(lambda: part_sums(a, 96)) for _ in range(repeats))
        res[threads] = a.nbytes / best / 1e9
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    return res


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def attention(slots: int, repeats: int) -> list[dict]:
    from ringllm.runtime.kv_codec import encode
    from ringllm.runtime.kv_types import KV_TYPES
    from ringllm.runtime.stored_attention import attend_stored, attend_stored_parallel, stored_work

    rng = np.random.default_rng(0)
    n_head = N_KV * GROUP
    pos = np.tile(np.arange(slots, dtype=np.int64), (N_KV, 1))
    count = np.full(N_KV, slots, np.int64)
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    q = rng.standard_normal((n_head, HEAD_DIM)).astype(np.float32)
    out = np.zeros((n_head, HEAD_DIM), np.float32)
    scores = np.zeros((n_head, slots), np.float32)
    work = stored_work(N_KV, n_head, HEAD_DIM, slots)
    no_mass = np.zeros((0, 0), np.float32)
    rows = []
    for kv_type in KV_TYPES:
        ks = [encode(rng.standard_normal((N_KV, slots, HEAD_DIM)).astype(np.float32), kv_type) for _ in range(LAYERS)]
        vs = [encode(rng.standard_normal((N_KV, slots, HEAD_DIM)).astype(np.float32), kv_type) for _ in range(LAYERS)]
        nbytes = sum(a.nbytes for a in ks + vs)
        for name, kernel in (("1 thread", attend_stored), ("all threads", attend_stored_parallel)):
            def token():
                for k, v in zip(ks, vs):
                    kernel(out, q, k, v, pos, pos, count, np.int64(slots), inv_freq, 1.0, HEAD_DIM, np.float32(0.125),
                           np.float32(0.0), scores, work, no_mass)
            token()
            best = min(_time(token) for _ in range(repeats))
            rows.append({"type": kv_type, "kernel": name, "ms_per_token": best * 1e3, "store_mb": nbytes / 1e6,
                         "gb_s": nbytes / best / 1e9})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--slots", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--name", default="read_bandwidth")
    args = ap.parse_args()
    read = plain_read(args.mb, args.repeats)
    att = attention(args.slots, args.repeats)
    md = ["# Read bandwidth and the decode attention", "",
          f"`python bench/read_bandwidth.py {' '.join(sys.argv[1:])}`", "", f"Machine: {machine()}", "",
          f"Plain float32 read of {args.mb} MB (fastest of {args.repeats}):", "",
          "| threads | GB/s |", "|---|---|"]
    md += [f"| {t} | {g:.1f} |" for t, g in read.items()]
    md += ["", f"Decode attention over {LAYERS} layers of SmolLM2's shapes, {args.slots} slots each (fastest of "
           f"{args.repeats}; GB/s: store bytes read per second):", "",
           "| KV type | kernel | ms / token | store MB | GB/s |", "|---|---|---|---|---|"]
    md += [f"| {r['type']} | {r['kernel']} | {r['ms_per_token']:.2f} | {r['store_mb']:.0f} | {r['gb_s']:.1f} |"
           for r in att]
    write_results(args.name, {"machine": machine(), "args": vars(args), "plain_read_gb_s": read, "attention": att},
                  "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
