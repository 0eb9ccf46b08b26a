"""Prompt compression's cost against prefill, and decode speed after it (KVConfig.compress).

    python bench/compression_speed.py --tokens 4096 --decode 64 --name compression_speed

One prompt of the novel (bench/data/emma.txt), SmolLM2-135M (bundled) by default:
  prefill      the plain chunked prefill into a policy-full store (what generate does without compression)
  hooked       the same prefill with the observation window captured (runtime/compress.prefill_whole)
  press        each press's choice + the rebuild of the decode store (press_store), the one-time cost
               compression adds; reported as a share of the plain prefill (the issue's target: <= 10%)
  decode       greedy tokens/s after compression (the kept tokens + the room) against decode with the
               whole prompt held, in both position modes (reindexed reads a compressed store "fused")
Timings are the median of --repeats runs (the press; decode: runs of --decode tokens one after the
other), one run of each prefill (they are long). On a machine shared with other work the decode
rates move with the neighbours' load: compare them within one table, and mind the noise.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, write_results  # noqa: E402

PRESS_KV = {"snapkv": 0.3, "pyramidkv": 0.3, "adakv": 0.3, "gvote": None, "tova": 0.3, "knorm": 0.3, "streaming": 0.3,
            "random": 0.3}


def decode_rate(engine, store, first_logits, n: int, repeats: int) -> float:
    """Greedy tokens/s: the median over `repeats` runs of n steps, one after the other on the store."""
    logits, rates = first_logits, []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            logits = engine.step(int(np.argmax(logits)), store)
        rates.append(n / (time.perf_counter() - t))
    return float(np.median(rates))


def main(argv=None):
    import ringllm
    from ringllm.runtime.compress import prefill_whole, press_store
    from ringllm.runtime.kv_config import KVConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--name", default="compression_speed")
    args = ap.parse_args(argv)
    llm = ringllm.LLM(args.model, n_threads=args.threads, progress=False)
    eng = llm.engine
    text = open(os.path.join(os.path.dirname(__file__), "data", "emma.txt"), encoding="utf-8").read()
    ids = llm.tokenize(text[20000:20000 + 8 * args.tokens])[:args.tokens]
    room = args.repeats * args.decode + 1
    out = {"machine": machine(), "command": " ".join(sys.argv), "tokens": len(ids), "decode_tokens": args.decode}

    eng.prefill(ids[:128], eng.new_store(KVConfig(capacity=256)))       # compile outside the clock
    rows = {}
    for positions in ("reindexed", "original"):
        full = eng.new_store(KVConfig(capacity=len(ids) + room, positions=positions))
        t = time.perf_counter()
        logits = np.array(eng.prefill(ids, full))
        prefill_s = time.perf_counter() - t
        full_rate = decode_rate(eng, full, logits, args.decode, args.repeats)
        del full
        t = time.perf_counter()
        transient, cap, logits = prefill_whole(eng, ids, positions, 64, hidden=True)
        hooked_s = time.perf_counter() - t
        presses = {}
        for press, ratio in PRESS_KV.items():
            kv = KVConfig(compress=press, positions=positions,
                          **({} if ratio is None else {"compress_ratio": ratio}))
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                store = press_store(eng, transient, cap, kv, room)
                times.append(time.perf_counter() - t)
            press_s = float(np.median(times))
            rate = decode_rate(eng, store, logits, args.decode, args.repeats)
            presses[press] = {"press_s": press_s, "share_of_prefill": press_s / prefill_s,
                              "kept_share": store.press_stats["kept_share"], "decode_tok_s": rate,
                              "store_bytes": store.stats()["bytes"]}
            print(positions, press, presses[press], flush=True)
            del store
        rows[positions] = {"prefill_s": prefill_s, "hooked_prefill_s": hooked_s, "full_decode_tok_s": full_rate,
                           "full_store_bytes": int(transient.stats()["bytes"]), "presses": presses}
        del transient
    out["rows"] = rows
    md = [f"# Prompt compression: cost against prefill, decode speed after it ({len(ids)}-token prompt)", "",
          f"Machine: {out['machine'].get('cpu')}, {out['machine'].get('cores')} cores (shared with other work). "
          f"Command: `{out['command']}`. SmolLM2-135M Q4_1 unless --model says otherwise.", ""]
    for positions, r in rows.items():
        md += [f"## positions {positions}", "",
               f"Plain prefill {r['prefill_s']:.2f} s; with the window captured {r['hooked_prefill_s']:.2f} s; "
               f"decode with the whole prompt held {r['full_decode_tok_s']:.1f} tok/s "
               f"(store {r['full_store_bytes'] / 2**20:.1f} MiB).", "",
               "| press (30% kept; gvote its own) | press + rebuild s | share of prefill | kept | decode tok/s | "
               "vs full decode | store MiB |", "|---|---|---|---|---|---|---|"]
        for p, x in r["presses"].items():
            md.append(f"| {p} | {x['press_s']:.3f} | {100 * x['share_of_prefill']:.1f}% | {x['kept_share']:.2f} | "
                      f"{x['decode_tok_s']:.1f} | {x['decode_tok_s'] / r['full_decode_tok_s']:.2f}x | "
                      f"{x['store_bytes'] / 2**20:.1f} |")
        md.append("")
    write_results(args.name, out, "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
