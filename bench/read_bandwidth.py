"""The machine's read bandwidth beside what the decode attention reaches: the ceiling a memory-bound
kernel is measured against.

    python bench/read_bandwidth.py [--mb 256] [--slots 4096] [--repeats 7] [--batch 8] [--stream-slots 256]
                                   [--l3-mb 16] [--skip-attention] [--name read_bandwidth]

1. Plain read: a float32 sum over a --mb buffer (larger than the last-level cache), vectorized by
   Numba, cut into 96 parts spread over 1 and then all threads; the fastest of --repeats passes, GB/s.
2. Decode attention: stored_attention.attend_stored (one thread) and attend_stored_parallel (all
   threads) over 30 layers of SmolLM2's shapes (3 kv heads, 9 query heads, head_dim 64), every
   layer's store --slots slots full, per KV type: ms per token and the store bytes read per second
   (each layer's K and V rows are read once per token; 30 distinct layers keep them out of cache).
3. A batched step's attention (stream_attention.write_attend_streams: --batch streams of the bundled
   SmolLM2, each a streaming store of --stream-slots slots filled with random rows, all threads):
   microseconds per layer call and store GB/s with the layers taken in turn (the streams' stores
   outgrow the last-level cache: rows come from DRAM, as in a real step), with the first few layers
   only (their rows fit in the last-level cache, --l3-mb), and, as the arithmetic's floor, one
   stream's layer attended again and again on one thread (attend_stored, rows in L2) scaled to the
   batch (x batch / threads). The gap between the first and the last is what the reads cost.

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


def stream_steps(batch: int, slots: int, l3_mb: float, repeats: int) -> dict:
    import numba

    from kv_types import filled_store
    from ringllm.models.bundled import default_model_path
    from ringllm.models.loader import load_model
    from ringllm.runtime.engine import CPUEngine
    from ringllm.runtime.stored_attention import attend_stored, stored_work
    from ringllm.runtime.stream_attention import StreamArrays, write_attend_streams

    model = load_model(default_model_path())
    eng = CPUEngine(model.spec, model.tensors)
    s = model.spec
    stores = [filled_store(eng, "f32", slots, seed=b) for b in range(batch)]
    arrays = StreamArrays(stores, s.n_layer)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((batch, s.n_head, s.head_dim)).astype(np.float32)
    k_new = rng.standard_normal((batch, s.n_head_kv, s.head_dim)).astype(np.float32)
    v_new = rng.standard_normal((batch, s.n_head_kv, s.head_dim)).astype(np.float32)
    out = np.zeros_like(q)
    seqs = np.array([st.n_seen for st in stores], np.int64)
    layer_bytes = sum(st.k[0].nbytes + st.v[0].nbytes for st in stores)
    scale, cap = np.float32(s.attn_scale), np.float32(0.0)

    def layers(ils):
        t0 = time.perf_counter()
        for il in ils:
            write_attend_streams(arrays, il, eng.layer_ropes[il], out, q, k_new, v_new, seqs, scale, cap)
        seqs[:] += 1                  # the next pass writes the streams' next token
        return (time.perf_counter() - t0) / len(ils)

    in_l3 = range(max(1, min(s.n_layer, int(l3_mb * 2**20 // layer_bytes))))
    layers(range(s.n_layer))
    dram = min(layers(range(s.n_layer)) for _ in range(repeats))
    l3 = min(layers(in_l3) for _ in range(3 * repeats))     # passes over a few layers: more of them
    st, rope = stores[0], eng.layer_ropes[0]
    work, scores = stored_work(s.n_head_kv, s.n_head, s.head_dim, slots), np.zeros((s.n_head, slots), np.float32)
    one, no_mass = np.zeros((s.n_head, s.head_dim), np.float32), np.zeros((0, 0), np.float32)

    def stream_l2():
        t0 = time.perf_counter()
        for _ in range(200):
            attend_stored(one, q[0], st.k[0], st.v[0], st.pos[0], st.seq[0], st.count[0], np.int64(st.n_seen),
                          rope.inv_freq, rope.inv_scale, rope.rotary_dim, scale, cap, scores, work, no_mass)
        return (time.perf_counter() - t0) / 200

    stream_l2()
    hot = min(stream_l2() for _ in range(repeats))
    threads = numba.get_num_threads()
    res = {"batch": batch, "slots": slots, "threads": threads, "layer_mb": layer_bytes / 1e6,
           "l3_layers": len(in_l3), "us_per_layer_dram": dram * 1e6, "us_per_layer_l3": l3 * 1e6,
           "us_per_stream_layer_l2_one_thread": hot * 1e6, "us_per_layer_l2_floor": hot * 1e6 * batch / threads,
           "gb_s_dram": layer_bytes / dram / 1e9, "gb_s_l3": layer_bytes / l3 / 1e9}
    print(res, flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--slots", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=8, help="streams of the batched step's attention (3.)")
    ap.add_argument("--stream-slots", type=int, default=256, help="slots of each stream's store (3.)")
    ap.add_argument("--l3-mb", type=float, default=16.0, help="bytes of layers that count as cache-resident (3.)")
    ap.add_argument("--skip-attention", action="store_true", help="leave out 2. (the decode attention per KV type)")
    ap.add_argument("--name", default="read_bandwidth")
    args = ap.parse_args()
    read = plain_read(args.mb, args.repeats)
    att = [] if args.skip_attention else attention(args.slots, args.repeats)
    streams = stream_steps(args.batch, args.stream_slots, args.l3_mb, args.repeats)
    md = ["# Read bandwidth and the decode attention", "",
          f"`python bench/read_bandwidth.py {' '.join(sys.argv[1:])}`", "", f"Machine: {machine()}", "",
          f"Plain float32 read of {args.mb} MB (fastest of {args.repeats}):", "",
          "| threads | GB/s |", "|---|---|"]
    md += [f"| {t} | {g:.1f} |" for t, g in read.items()]
    if att:
        md += ["", f"Decode attention over {LAYERS} layers of SmolLM2's shapes, {args.slots} slots each (fastest of "
               f"{args.repeats}; GB/s: store bytes read per second):", "",
               "| KV type | kernel | ms / token | store MB | GB/s |", "|---|---|---|---|---|"]
        md += [f"| {r['type']} | {r['kernel']} | {r['ms_per_token']:.2f} | {r['store_mb']:.0f} | {r['gb_s']:.1f} |"
               for r in att]
    r = streams
    md += ["", f"A batched step's attention, {r['batch']} streams x {r['slots']} slots (write_attend_streams, "
           f"{r['threads']} threads; {r['layer_mb']:.2f} MB of K/V rows per layer; fastest of {args.repeats}):", "",
           "| rows from | us / layer | store GB/s |", "|---|---|---|",
           f"| DRAM (the {LAYERS} layers in turn) | {r['us_per_layer_dram']:.0f} | {r['gb_s_dram']:.1f} |",
           f"| last-level cache (layers 0-{r['l3_layers'] - 1} in turn) | {r['us_per_layer_l3']:.0f} | "
           f"{r['gb_s_l3']:.1f} |",
           f"| L2, the arithmetic's floor (one stream's layer on one thread, "
           f"{r['us_per_stream_layer_l2_one_thread']:.1f} us, x {r['batch']} / {r['threads']}) | "
           f"{r['us_per_layer_l2_floor']:.0f} | |"]
    write_results(args.name, {"machine": machine(), "args": vars(args), "plain_read_gb_s": read, "attention": att,
                              "stream_steps": streams},
                  "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
