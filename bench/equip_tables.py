"""EQUIP's tables on ringllm: in-place KV update against the same engine's shift-and-append mode.

    python bench/equip_tables.py [--caches 256,512,1024] [--batches 1,4,8] [-n 32] [--repeats 3]
                                 [--update-caches 256,512,1024] [--evict 64] [-t THREADS] [--name equip_tables]

Table 2's shape (decode): SmolLM2, policies streaming and h2o, batch sizes B and cache sizes C.
Each configuration holds B stores that are full (one store is prefilled with C + 64 tokens of the
novel and cloned B times through state()/restore()), then decodes n forced tokens per sequence
(B > 1: engine.step_batch, the projections over the B rows at once). Modes: update "inplace" (the
victim's slot is overwritten, EQUIP) and "shift" (survivors copied down and the new token appended,
as an HF-style cache does; same kernels otherwise). The modes alternate within each configuration,
`repeats` times, and the median total tokens/s of each is reported with speedup = inplace / shift.

Table 6's shape (KV update only): the store kernels alone, no model: `evict` tokens leave and
`evict` enter per update (one write drops them, the other writes append; a jitted loop drives the
kernels), for every layer of SmolLM2's KV shape; streaming chooses by age, h2o by a random score;
time per update, both modes, and the speedup.
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

DATA = os.path.join(os.path.dirname(__file__), "data", "prideprejudice.txt")
MODES = ("inplace", "shift")


def decode_table(eng, ids, caches, batches, n, repeats, policies=("streaming", "h2o")):
    from ringllm.runtime.kv_config import KVConfig
    from ringllm.runtime.kv_store import KVStore

    rows = []
    for pol in policies:
        for cap in caches:
            base = {}
            for mode in MODES:
                st = eng.new_store(KVConfig(capacity=cap, policy=pol, sinks=4, update=mode))
                eng.prefill(ids[:cap + 64], st)
                base[mode] = st.state()
            forced = ids[cap + 64:cap + 64 + n]
            for B in batches:
                rates = {m: [] for m in MODES}
                for _ in range(repeats):
                    for mode in MODES:
                        stores = [eng.adopt_store(KVStore.restore(eng.spec, base[mode])) for _ in range(B)]
                        t0 = time.perf_counter()
                        for t in forced:
                            if B == 1:
                                eng.step(int(t), stores[0])
                            else:
                                eng.step_batch([int(t)] * B, stores)
                        rates[mode].append(B * len(forced) / (time.perf_counter() - t0))
                med = {m: float(np.median(v)) for m, v in rates.items()}
                rows.append({"policy": pol, "cache": cap, "batch": B, "tok_s": med, "runs": rates,
                             "speedup": med["inplace"] / med["shift"]})
                print(rows[-1]["policy"], cap, B, {m: round(v, 1) for m, v in med.items()},
                      f"x{rows[-1]['speedup']:.3f}", flush=True)
    return rows


def _update_driver():
    """A jitted loop over one layer's `evict` writes (the store kernels themselves, no Python between
    them): the first write drops `evict` tokens per head (drop_h), the others append."""
    from numba import njit

    from ringllm.runtime.kv_write import COUNT, SCORE, SEQ, kv_write_policy

    @njit(cache=False, nogil=True)
    def run(lay, kvs, seq0, key_l, drop_h, sinks, by_score, victims, shift, inv_freq, angles, angle_tag, tmp):
        seq_l, score_l, count_l = lay[SEQ], lay[SCORE], lay[COUNT]
        nkv = seq_l.shape[0]
        for i in range(kvs.shape[0]):
            if i == 0:
                for h in range(nkv):
                    for j in range(count_l[h]):
                        key_l[h, j] = score_l[h, j] if by_score else seq_l[h, j]
            else:
                drop_h[:] = 0
            kv_write_policy(lay, kvs[i, 0], kvs[i, 1], seq0 + i, (key_l, 0, drop_h, sinks, 0, True, shift), victims,
                            (0, inv_freq, 1.0, 2 * inv_freq.shape[0], angles, angle_tag, tmp))
    return run


def update_table(spec, caches, evict, repeats, policies=("streaming", "h2o")):
    """Time per update of `evict` tokens out and `evict` in over every layer: the store kernels alone
    (victim choice by sequence index for streaming, by a random score for h2o; hole filling in place
    vs survivors copied down), driven by a jitted loop."""
    from ringllm.runtime.kv_config import KVConfig
    from ringllm.runtime.kv_store import KVStore

    run = _update_driver()
    rng = np.random.default_rng(0)
    nkv, hd = spec.n_head_kv, spec.head_dim
    kvs = rng.standard_normal((evict, 2, nkv, hd)).astype(np.float32)
    rows = []
    for pol in policies:
        for cap in caches:
            times = {m: [] for m in MODES}
            for rep in range(repeats + 1):                     # round 0 compiles
                for mode in MODES:
                    st = KVStore(spec, KVConfig(capacity=cap, policy="h2o", sinks=4, recent=0, lazy=evict,
                                                update=mode))
                    for il in range(spec.n_layer):             # full: cap + evict - 1 tokens held, in order
                        n = cap + evict - 1
                        st.seq[il][:, :n] = np.arange(n)
                        st.rank[il][:, :n] = np.arange(n)
                        st.count[il][:] = n
                        st.k[il][:] = rng.standard_normal(st.k[il].shape)
                        st.score[il][:] = rng.random(st.score[il].shape)
                    drop = np.zeros(nkv, np.int64)
                    t0 = time.perf_counter()
                    for il in range(spec.n_layer):
                        drop[:] = evict
                        run(st.layers[il], kvs, cap + evict - 1, st.key, drop, 4, pol == "h2o", st.victims[0],
                            mode == "shift", st.layer_inv_freq[il], *st.rotation_cache(il))
                    if rep:
                        times[mode].append(time.perf_counter() - t0)
                    assert int(st.evicted[0].sum()) == evict * nkv and int(st.count[0][0]) == cap + evict - 1
            med = {m: float(np.median(v)) for m, v in times.items()}
            rows.append({"policy": pol, "cache": cap, "evict": evict, "ms_per_update": {m: 1e3 * v for m, v in med.items()},
                         "speedup": med["shift"] / med["inplace"]})
            print("update", pol, cap, {m: round(1e3 * v, 3) for m, v in med.items()}, f"x{rows[-1]['speedup']:.2f}",
                  flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--caches", default="256,512,1024")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("-n", type=int, default=32, help="decode steps per sequence per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--update-caches", default="256,512,1024")
    ap.add_argument("--evict", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("--name", default="equip_tables")
    args = ap.parse_args()
    from ringllm.models.bundled import default_model_path
    from ringllm.models.loader import load_model
    from ringllm.runtime.engine import CPUEngine

    model = load_model(default_model_path())
    eng = CPUEngine(model.spec, model.tensors, n_threads=args.threads)
    ids = model.tokenizer.encode(open(DATA, encoding="utf-8").read()[:60000])
    caches = [int(c) for c in args.caches.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    upd = update_table(model.spec, [int(c) for c in args.update_caches.split(",")], args.evict, args.repeats)
    dec = decode_table(eng, ids, caches, batches, args.n, args.repeats)
    res = {"machine": machine(), "threads": args.threads, "n": args.n, "repeats": args.repeats, "decode": dec,
           "update": upd}
    md = ["# EQUIP's tables on ringllm: in-place KV update vs the engine's shift-and-append mode\n",
          f"Machine: {res['machine']['cpu']}, {res['machine']['cores']} cores, {args.threads} threads; SmolLM2-135M "
          f"Q4_1. Command: `python bench/equip_tables.py --caches {args.caches} --batches {args.batches} -n {args.n} "
          f"--repeats {args.repeats} --evict {args.evict}`.\n",
          "## Decode (Table 2's shape): total tokens/s, full stores, every step evicts\n",
          "| policy | cache | batch | in-place tok/s | shift tok/s | speedup |", "|---|---|---|---|---|---|"]
    for r in dec:
        md.append(f"| {r['policy']} | {r['cache']} | {r['batch']} | {r['tok_s']['inplace']:.1f} | "
                  f"{r['tok_s']['shift']:.1f} | {r['speedup']:.3f}x |")
    md += ["", f"## KV update only (Table 6's shape): {args.evict} tokens out and {args.evict} in, all "
           f"{model.spec.n_layer} layers\n",
           "| policy | cache | in-place ms | shift ms | speedup |", "|---|---|---|---|---|"]
    for r in upd:
        md.append(f"| {r['policy']} | {r['cache']} | {r['ms_per_update']['inplace']:.3f} | "
                  f"{r['ms_per_update']['shift']:.3f} | {r['speedup']:.2f}x |")
    write_results(args.name, res, "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
