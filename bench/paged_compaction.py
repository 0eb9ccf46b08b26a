"""The eviction/compaction seed's scenarios on the real paged KV pool: blocks freed, slot copies and
time per compaction pass.

    python bench/paged_compaction.py [--layers 1] [--kv-heads 3] [--head-dim 64] [--repeats 5]

Scenarios (one sequence; a slot copy moves one token's K and V in every layer and kv head):
    toy            6 blocks of 4 slots hold T0-T23; evict T2, T9, T13, T21
    every-10th     16,000 tokens in 1,000 blocks of 16; every 10th token kept (90% evicted)
    one-per-block  16,000 tokens in 1,000 blocks of 16; one survivor per block (93.75% evicted)
For each: blocks freed by the eviction alone, then by an order-preserving repack and by
hole-filling (each from the same evicted state), slot copies, median seconds per pass over
`repeats` runs (kernels compiled beforehand) and the bytes moved. The default KV shape is one layer
of SmolLM2-135M (3 kv heads x 64 dims): 1.5 KiB per slot; time scales with layers.
Writes bench/results/paged_compaction.{json,md}.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, write_results  # noqa: E402

SCENARIOS = {
    "toy": (6, 4, 24, lambda t: t in (2, 9, 13, 21)),
    "every-10th": (1000, 16, 16000, lambda t: t % 10 != 0),
    "one-per-block": (1000, 16, 16000, lambda t: t % 16 != 0),
}


def build(n_blocks, block_size, n_tokens, evicted, shape):
    from ringllm.runtime.paged_pool import PagedKVPool
    pool = PagedKVPool(n_blocks, block_size, *shape)
    sid = pool.new_sequence()
    for t in range(n_tokens):
        pool.append(sid, float(t), -float(t), t)
    freed = pool.evict(sid, [t for t in range(n_tokens) if evicted(t)])
    return pool, sid, freed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    shape = (args.layers, args.kv_heads, args.head_dim)
    slot_bytes = 2 * 4 * args.layers * args.kv_heads * args.head_dim
    build(6, 4, 24, SCENARIOS["toy"][3], shape)[0].compact_repack(0)     # compile the kernels
    build(6, 4, 24, SCENARIOS["toy"][3], shape)[0].compact_fill(0)
    rows = []
    for name, (n_blocks, bs, n_tokens, evicted) in SCENARIOS.items():
        pool, sid, freed = build(n_blocks, bs, n_tokens, evicted, shape)
        g0 = pool.gauges()
        row = {"scenario": name, "blocks": n_blocks, "block_size": bs, "tokens": n_tokens,
               "evicted": g0["tokens_evicted"], "eviction_share": g0["tokens_evicted"] / n_tokens,
               "free_blocks_after_eviction": g0["free_blocks"], "blocks_freed_by_eviction": freed,
               "occupancy_after_eviction": g0["occupancy"]}
        for kind in ("repack", "fill"):
            times, g = [], None
            for _ in range(args.repeats):
                p = copy.deepcopy(pool)
                g = p.compact_repack(sid) if kind == "repack" else p.compact_fill(sid)
                times.append(g["seconds"])
            row[kind] = {"blocks_freed": g["blocks_freed"], "slot_copies": g["slot_copies"],
                         "blocks_after": g["blocks_after"], "seconds_median": float(np.median(times)),
                         "seconds": times, "bytes_moved": g["slot_copies"] * slot_bytes,
                         "occupancy_after": p.gauges()["occupancy"]}
        rows.append(row)
    payload = {"kv_shape": {"n_layer": args.layers, "n_kv_head": args.kv_heads, "head_dim": args.head_dim,
                            "slot_bytes": slot_bytes}, "repeats": args.repeats, "machine": machine(), "rows": rows}
    md = ["# Paged KV pool: the eviction/compaction seed's scenarios\n",
          f"KV shape {args.layers} layer(s) x {args.kv_heads} kv heads x {args.head_dim} dims ({slot_bytes} B per slot), "
          f"median of {args.repeats} passes, {payload['machine']['cpu']} ({payload['machine']['cores']} cores). "
          "A slot copy moves one token's K and V in every layer and head.\n",
          "| scenario | tokens | evicted | blocks freed by eviction | repack: freed / copies / time | "
          "fill: freed / copies / time |", "|---|---|---|---|---|---|"]
    for r in rows:
        cell = lambda d: f"{d['blocks_freed']} / {d['slot_copies']} / {d['seconds_median'] * 1e3:.3f} ms"  # noqa: E731
        md.append(f"| {r['scenario']} ({r['blocks']} blocks of {r['block_size']}) | {r['tokens']} | {r['evicted']} "
                  f"({100 * r['eviction_share']:.2f}%) | {r['blocks_freed_by_eviction']} | {cell(r['repack'])} | "
                  f"{cell(r['fill'])} |")
    text = "\n".join(md) + "\n"
    print(text)
    write_results("paged_compaction", payload, text)


if __name__ == "__main__":
    main()
