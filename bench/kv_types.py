"""KV store element types (KVConfig k_type = v_type = f32 | f16 | q8_0 | q4_0): size, decode speed, quality.

    python bench/kv_types.py [--models smollm2,gemma3] [--capacities 512 4096 32768] [--steps 24] [--speed-policy streaming]
                             [--ppl-types f16 q8_0/q4_0]
                             [--ppl-tokens 20000] [--ppl-capacities 256 512] [--ppl-policies streaming h2o snapkv]
                             [--chunk-ctx 2048] [--skip-ppl] [--skip-speed] [-t THREADS] [--out NAME]

Three parts, each per type:

- bytes: the store's bytes per token (every layer's K and V rows: n_layer x n_kv x (row bytes of K + V)),
  and the resident size of a whole SmolLM2 store at the largest capacity once every slot is written
  (the K/V arrays and the per-slot metadata the ring writes: sequence index and rank).
- speed: decode tokens/s with the store filled to each capacity (random K/V rows written through
  KVStore.replace_many, one call per layer: speed depends on the tokens held, not on their values),
  policy --speed-policy (streaming: the ring, "stored" RoPE; a scored policy such as h2o: the policy
  layers' kernels, each key rotated by RoPE as it is read). The types run interleaved, repeated
  --rounds times, and each capacity's tok/s is the median; the ratio to f32 is taken per round (this
  machine's speed drifts by half within minutes, so only same-round ratios mean anything).
- quality: streaming perplexity over --ppl-tokens tokens of the novel fed one at a time (pyengine
  perplexity.streaming) per capacity x policy; and chunked perplexity at full context (--chunk-ctx
  tokens per window, policy full), SmolLM2; per --ppl-types entry (a type, or K/V types).

Writes bench/results/<out>.{json,md} and <out>.png (decode speed per capacity).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, write_results  # noqa: E402

TYPES = ("f32", "f16", "q8_0", "q4_0")
TEXT = os.path.join(os.path.dirname(__file__), "data", "prideprejudice.txt")


def _load(name: str):
    from ringllm.models.bundled import default_model_path, gemma3_model_path
    from ringllm.models.loader import load_model

    return load_model({"smollm2": default_model_path, "gemma3": gemma3_model_path}[name]())


def bytes_per_token(spec) -> dict:
    from ringllm.runtime.kv_types import row_bytes

    hd = spec.head_dim                  # a key row and a value row (a q4_0 key row also holds its outliers)
    return {t: spec.n_layer * spec.n_head_kv * (row_bytes(t, hd, key=True) + row_bytes(t, hd)) for t in TYPES}


def filled_store(eng, kv_type: str, capacity: int, seed: int = 0, policy: str = "streaming"):
    """A store of `capacity` slots under `policy`, every slot written (random K/V rows of unit scale)."""
    from ringllm.runtime.kv_config import KVConfig

    spec = eng.spec
    st = eng.new_store(KVConfig(capacity=capacity, policy=policy, sinks=4, k_type=kv_type, v_type=kv_type))
    rng = np.random.default_rng(seed)
    n = capacity - 1                     # room for the token decoded next without an eviction in the fill
    for il in range(spec.n_layer):
        n_l = min(n, st.layer_capacity[il] - 1)
        rows = rng.standard_normal((2, n_l, spec.n_head_kv, spec.head_dim)).astype(np.float32)
        slots = np.tile(np.arange(n_l, dtype=np.int64), (spec.n_head_kv, 1))
        st.replace_many(il, slots, rows[0], rows[1], np.arange(n - n_l, n, dtype=np.int64))
    st.n_seen = n
    return st


def resident_bytes(st) -> int:
    """Bytes of the store's K/V arrays plus the metadata a ring writes per slot (seq, rank)."""
    return sum(a.nbytes for name in ("k", "v", "seq", "rank") for a in getattr(st, name))


def decode_speed(eng, capacities, steps: int, rounds: int, policy: str = "streaming") -> dict:
    out = {}
    for cap in capacities:
        stores = {t: filled_store(eng, t, cap, policy=policy) for t in TYPES}
        for st in stores.values():
            eng.step(1, st)                          # compiled, and the store's pages touched
        per = {t: [] for t in TYPES}
        for _ in range(rounds):
            for t in TYPES:
                st = stores[t]
                t0 = time.perf_counter()
                for i in range(steps):
                    eng.step(100 + i, st)
                per[t].append(steps / (time.perf_counter() - t0))
        ratios = {t: [a / b for a, b in zip(per[t], per["f32"])] for t in TYPES}
        out[cap] = {t: {"tok_s": statistics.median(per[t]), "vs_f32": statistics.median(ratios[t]),
                        "rounds": per[t]} for t in TYPES}
        out[cap]["store_bytes"] = {t: resident_bytes(stores[t]) for t in TYPES}
        print(cap, {t: f"{out[cap][t]['tok_s']:.1f} ({out[cap][t]['vs_f32']:.2f}x)" for t in TYPES}, flush=True)
        del stores
    return out


def _pair(name: str) -> tuple[str, str]:
    """"q8_0" -> (q8_0, q8_0); "q8_0/q4_0" -> keys q8_0, values q4_0."""
    k, _, v = name.partition("/")
    return k, v or k


def quality(model, eng, n_tokens: int, capacities, policies, chunk_ctx: int, types=TYPES) -> dict:
    from ringllm import perplexity as ppl
    from ringllm.runtime.kv_config import KVConfig

    ids = model.tokenizer.encode(open(TEXT, encoding="utf-8").read(), add_bos=False, parse_special=False)
    stream_ids = ids[:n_tokens]
    rows = []
    for cap in capacities:
        for policy in policies:
            for t in types:
                kt, vt = _pair(t)
                st = eng.new_store(KVConfig(capacity=cap, policy=policy, sinks=4, k_type=kt, v_type=vt))
                t0 = time.perf_counter()
                res = ppl.streaming(lambda tok: eng.step(tok, st), stream_ids, len(stream_ids))
                rows.append({"kind": "streaming", "capacity": cap, "policy": policy, "type": t, "ppl": res.ppl,
                             "tokens": len(stream_ids), "seconds": time.perf_counter() - t0})
                print("ppl", cap, policy, t, f"{res.ppl:.4f}", flush=True)
    n_chunk = min(len(ids), 4 * chunk_ctx)
    for t in types:
        def logits_fn(window, t=t):
            kt, vt = _pair(t)
            return eng.logits(window, eng.new_store(KVConfig(capacity=chunk_ctx, policy="full", k_type=kt, v_type=vt)))
        tok = model.tokenizer
        res = ppl.chunked(logits_fn, ids[:n_chunk], chunk_ctx, tok.bos_id if tok.add_bos else None)
        rows.append({"kind": "chunked", "capacity": chunk_ctx, "policy": "full", "type": t, "ppl": res.ppl,
                     "tokens": n_chunk})
        print("chunked", t, f"{res.ppl:.4f}", flush=True)
    return rows


def _plot(speed: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(speed), figsize=(5 * len(speed), 3.6), squeeze=False)
    for ax, (model, per_cap) in zip(axes[0], speed.items()):
        caps = sorted(per_cap, key=int)
        for t in TYPES:
            ax.plot([int(c) for c in caps], [per_cap[c][t]["tok_s"] for c in caps], marker="o", label=t)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens held (capacity)")
        ax.set_ylabel("decode tok/s")
        ax.set_title(model)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--capacities", type=int, nargs="+", default=[512, 4096, 32768])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--speed-policy", default="streaming",
                    help="the policy of the decode-speed stores (streaming: the ring layers' stored-key attention; "
                         "a scored policy such as h2o: the policy layers' kernels, keys rotated as they are read)")
    ap.add_argument("--ppl-tokens", type=int, default=20000)
    ap.add_argument("--ppl-capacities", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--ppl-policies", nargs="+", default=["streaming", "h2o", "snapkv"])
    ap.add_argument("--chunk-ctx", type=int, default=2048)
    ap.add_argument("--ppl-types", nargs="+", default=list(TYPES),
                    help="types of the quality runs: a type, or K/V (e.g. q8_0/q4_0); f32 is always run")
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--out", default="kv_types")
    args = ap.parse_args()
    from ringllm.runtime.engine import CPUEngine

    payload = {"machine": machine(), "command": " ".join(sys.argv), "models": {}}
    md = [f"# KV store types: {', '.join(TYPES)}\n", f"`{payload['command']}`\n"]
    speed_all = {}
    for name in args.models.split(","):
        model = _load(name)
        eng = CPUEngine(model.spec, model.tensors, n_threads=args.threads)
        entry = {"bytes_per_token": bytes_per_token(model.spec)}
        md += [f"## {name}\n", "Bytes per token (all layers, K + V):\n", "| type | bytes/token | vs f32 |", "|---|---|---|"]
        bpt = entry["bytes_per_token"]
        md += [f"| {t} | {bpt[t]} | {bpt[t] / bpt['f32']:.3f} |" for t in TYPES]
        if not args.skip_speed:
            speed = decode_speed(eng, args.capacities, args.steps, args.rounds, args.speed_policy)
            entry["speed"] = {str(c): v for c, v in speed.items()}
            speed_all[name] = entry["speed"]
            md += [f"\nDecode tok/s with the store filled to the capacity (policy {args.speed_policy}; median of the rounds; "
                   "ratio to f32 per round, median), and the store's bytes (K/V arrays, seq, rank):\n",
                   "| capacity | " + " | ".join(TYPES) + " | " + " | ".join(f"{t} store MiB" for t in TYPES) + " |",
                   "|---|" + "---|" * (2 * len(TYPES))]
            for cap, v in speed.items():
                md.append(f"| {cap} | " + " | ".join(f"{v[t]['tok_s']:.1f} ({v[t]['vs_f32']:.2f}x)" for t in TYPES)
                          + " | " + " | ".join(f"{v['store_bytes'][t] / 2**20:.1f} "
                                               f"({v['store_bytes'][t] / v['store_bytes']['f32']:.0%})" for t in TYPES)
                          + " |")
        if not args.skip_ppl and name == "smollm2":
            ptypes = ["f32"] + [t for t in args.ppl_types if t != "f32"]
            rows = quality(model, eng, args.ppl_tokens, args.ppl_capacities, args.ppl_policies, args.chunk_ctx, ptypes)
            entry["quality"] = rows
            base = {(r["kind"], r["capacity"], r["policy"]): r["ppl"] for r in rows if r["type"] == "f32"}
            md += ["\nPerplexity (streaming: token by token through the store; chunked: windows of the full context, "
                   "policy full), and its change from f32 (K/V: keys of one type, values of the other):\n",
                   "| kind | capacity | policy | tokens | " + " | ".join(ptypes) + " |",
                   "|---|---|---|---|" + "---|" * len(ptypes)]
            keys = sorted({(r["kind"], r["capacity"], r["policy"], r["tokens"]) for r in rows})
            for kind, cap, policy, n in keys:
                cells = []
                for t in ptypes:
                    p = next(r["ppl"] for r in rows if (r["kind"], r["capacity"], r["policy"], r["type"]) ==
                             (kind, cap, policy, t))
                    b = base[(kind, cap, policy)]
                    cells.append(f"{p:.3f}" + ("" if t == "f32" else f" ({100 * (p / b - 1):+.2f}%)"))
                md.append(f"| {kind} | {cap} | {policy} | {n} | " + " | ".join(cells) + " |")
        payload["models"][name] = entry
        md.append("")
    text = "\n".join(md) + "\n"
    print(text)
    write_results(args.out, payload, text)
    if speed_all:
        _plot(speed_all, os.path.join(os.path.dirname(__file__), "results", args.out + ".png"))


if __name__ == "__main__":
    main()
