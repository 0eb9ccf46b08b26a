"""Study: q4_0 keys stored relative to a per-layer, per-kv-head offset, measured through the reference engine.

    python bench/kv_key_offsets.py [--tokens 1000] [--capacity 256] [--policies streaming,h2o]
                                   [--calibration 64] [--name kv_key_offsets]

A key of SmolLM2 carries a large offset that is nearly the same for every token of a text (docs/kv_types.md,
"q4_0 rows hold a rotation"): a q4_0 block's scale follows the block's norm, offset included, so the
part of the key that differs from token to token keeps few levels. Storing k - c instead, c a fixed
vector per layer and kv head, and adding c back when a key is read, removes that offset from what is
rounded. The variants, all with q4_0 values and keys (the values rounded as the store rounds them):

    stored       keys rotated by RoPE at their sequence index, then rounded (the engine's ring layers today)
    fused        keys rounded before RoPE as the reference engine rounds them for the engine's policy
                 layers: since the runtime's offsets (KVStore.koff) landed, relative to those
    fused-c      before RoPE, k - c rounded and c added back; c: the mean key of the text's first
                 --calibration tokens but its first (the attention sink), as a store would take it from
                 its first prompt
    fused-c-other  as fused-c, c taken from another text (the first tokens of Emma)
    fused-c-random as fused-c, c taken from random token ids
    stored-c     rotated keys minus c rotated at the calibration tokens' positions (the offset in the
                 stored frame, where RoPE turns it with the position)
    stored-outM  keys rotated by RoPE at their sequence index (as "stored"), but the M rotary pairs of
                 largest mean energy in the calibration keys (per layer and kv head) held in float16
                 and left out of the q4_0 blocks (zeros there): RoPE turns a pair within itself, so a
                 pair's energy, and which pairs carry the offset, do not depend on the position
    fused-outM   as stored-outM, on keys before RoPE
    stored-rowN  keys rotated by RoPE at their sequence index (as "stored"), each row's N channels of
                 largest magnitude held in float16 and left out of its q4_0 blocks (zeros there): chosen
                 per row, so nothing is calibrated and a row names its own channels
    stored-eqA   keys rotated by RoPE at their sequence index (as "stored"), each rotary pair divided by
                 s = (r / median r)^(A/100) before rounding and multiplied back after (r: the pair's RMS
                 over the calibration keys, per layer and kv head); the same as a store holding k / s
                 and the queries scaled by s: RoPE turns a pair within itself, so s commutes with it
    stored-eqA-down  as stored-eqA with s at least 1 (only the pairs above the median scaled down)

Each runs the reference engine (runtime/reference.py, NumPy, an independent implementation of the
model) over --tokens tokens of Pride and Prejudice in 64-token chunks through a --capacity store under
each policy, and reports perplexity and its change from f32 keys and values. The offsets are the
study's (monkeypatched ReferenceCache.rounded_kv), not the runtime's. Writes
bench/results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, write_results  # noqa: E402

from ringllm.models.bundled import default_model_path  # noqa: E402
from ringllm.models.loader import load_model  # noqa: E402
from ringllm.runtime.kv_config import KVConfig  # noqa: E402
from ringllm.runtime.reference import ReferenceEngine, rope, round_kv_type  # noqa: E402
from ringllm.runtime.reference_rope import layer_freqs  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data")
VARIANTS = ("stored", "fused", "fused-c", "fused-c-other", "fused-c-random", "stored-c", "stored-out2", "stored-out4")


def text(name: str) -> str:
    with open(os.path.join(DATA, name), encoding="utf-8") as fh:
        return fh.read()


def calibration_keys(eng: ReferenceEngine, ids) -> dict[int, np.ndarray]:
    """{layer: (n - 1, n_kv, hd) f32}: the keys before RoPE of ids[1:] (n = len(ids)), fed to a fresh
    full-context cache."""
    cache, keys = eng.new_cache(), {}
    insert = cache.insert

    def record(il, k, v, seq, q=None):
        keys.setdefault(il, []).append(k.copy())
        return insert(il, k, v, seq, q)
    cache.insert = record
    eng.forward(np.asarray(ids), cache)
    return {il: np.stack(ks[1:]) for il, ks in keys.items()}


def key_means(keys: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """{layer: (n_kv, hd) f32}: the mean of calibration_keys' keys."""
    return {il: k.mean(0).astype(np.float32) for il, k in keys.items()}


def pair_energy(k: np.ndarray, half: int) -> np.ndarray:
    """(n_kv, half): the mean energy k_i^2 + k_{i+half}^2 of each rotary pair (i, i + half) over the
    keys k (n, n_kv, head_dim); RoPE turns a pair within its plane, so this does not depend on position."""
    return (k[..., :half] ** 2 + k[..., half:2 * half] ** 2).mean(0)


def outlier_channels(spec, keys: dict[int, np.ndarray], pairs: int) -> dict[int, np.ndarray]:
    """{layer: (n_kv, head_dim) bool}: the channels of the `pairs` rotary pairs (i, i + rotary_dim/2)
    with the largest pair_energy over calibration_keys' keys, per kv head."""
    half, out = spec.rotary_dim // 2, {}
    for il, k in keys.items():
        top = np.argsort(-pair_energy(k, half), 1)[:, :pairs]
        mask = np.zeros(k.shape[1:], bool)
        np.put_along_axis(mask, top, True, 1)
        np.put_along_axis(mask, top + half, True, 1)
        out[il] = mask
    return out


def pair_scales(spec, keys: dict[int, np.ndarray], alpha: float, down_only: bool) -> dict[int, np.ndarray]:
    """{layer: (n_kv, head_dim) f32}: per channel, its rotary pair's (r / median r)^alpha, r the pair's RMS
    over calibration_keys' keys (both channels of a pair get the same scale); at least 1 if down_only."""
    half, out = spec.rotary_dim // 2, {}
    for il, k in keys.items():
        r = np.sqrt(pair_energy(k, half) / 2)                                          # (n_kv, half)
        s = (r / np.median(r, 1, keepdims=True)) ** alpha
        if down_only:
            s = np.maximum(s, 1.0)
        full = np.ones(k.shape[1:], np.float32)
        full[:, :half], full[:, half:2 * half] = s, s
        out[il] = full
    return out


def rotated_means(spec, keys: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """{layer: (n_kv, hd)}: the mean of calibration_keys' keys (tokens 1..) rotated by RoPE at their positions."""
    out = {}
    for il, k in keys.items():
        kk = k.transpose(1, 0, 2)                               # (n_kv, n - 1, hd)
        pos = np.broadcast_to(np.arange(1, kk.shape[1] + 1), kk.shape[:2])
        out[il] = rope(kk, pos, spec.rotary_dim, layer_freqs(spec, il), spec.rope_scale[il]).mean(1).astype(np.float32)
    return out


def perplexity(eng: ReferenceEngine, ids: list[int], kv: KVConfig, ring_keys: str, rounded=None) -> float:
    cache = eng.new_cache(kv, ring_keys=ring_keys)
    if rounded is not None:
        cache.rounded_kv = rounded
    nll, n = 0.0, 0
    for i in range(0, len(ids) - 1, 64):
        logits = eng.forward(ids[i:i + 64], cache).astype(np.float64)
        tgt = np.asarray(ids[i + 1:i + 65])
        logits = logits[:tgt.size]
        top = logits.max(1, keepdims=True)
        lse = np.log(np.exp(logits - top).sum(1)) + top[:, 0]
        nll += float((lse - logits[np.arange(tgt.size), tgt]).sum())
        n += tgt.size
    return float(np.exp(nll / n))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--policies", default="streaming,h2o")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--calibration", type=int, default=64)
    ap.add_argument("--name", default="kv_key_offsets")
    args = ap.parse_args()
    loaded = load_model(default_model_path())
    spec, tok = loaded.spec, loaded.tokenizer
    eng = ReferenceEngine(spec, loaded.tensors)
    ids = tok.encode(text("prideprejudice.txt")[100000:200000])[:args.tokens + 1]
    n_cal = args.calibration
    cal = calibration_keys(eng, ids[:n_cal])
    offsets = {"fused-c": key_means(cal),
               "fused-c-other": key_means(calibration_keys(eng, tok.encode(text("emma.txt")[20000:40000])[:n_cal])),
               "fused-c-random": key_means(calibration_keys(eng, np.random.default_rng(0).integers(0, spec.n_vocab,
                                                                                                   n_cal))),
               "stored-c": rotated_means(spec, cal)}
    outliers = {v: outlier_channels(spec, cal, int(v.split("-out")[1]))
                for v in args.variants.split(",") if v.startswith(("stored-out", "fused-out"))}

    def centered(c):
        def rounded(il, k, v, seq):
            return round_kv_type(k - c[il], "q4_0") + c[il], round_kv_type(v, "q4_0")
        return rounded

    def in_stored_frame(round_key):
        """rounded_kv whose key is rounded by round_key(il, key) in the stored frame (rotated by RoPE
        at its sequence index), then rotated back (the reference cache takes keys before RoPE)."""
        def rounded(il, k, v, seq):
            base, scale = layer_freqs(spec, il), spec.rope_scale[il]
            at = rope(k[:, None, :], np.array([seq]), spec.rotary_dim, base, scale)[:, 0]
            at = round_key(il, at)
            return rope(at[:, None, :], np.array([-seq]), spec.rotary_dim, base, scale)[:, 0], round_kv_type(v, "q4_0")
        return rounded

    def stored_centered(c):
        return in_stored_frame(lambda il, at: round_kv_type(at - c[il], "q4_0") + c[il])

    def split_rounded(mask, at):
        """at with the mask's channels rounded to float16 and the others through q4_0 blocks that
        hold zeros in the mask's channels."""
        return np.where(mask, at.astype(np.float16).astype(np.float32),
                        round_kv_type(np.where(mask, 0.0, at).astype(np.float32), "q4_0"))

    scales = {v: pair_scales(spec, cal, int(v.split("-eq")[1].split("-")[0]) / 100, v.endswith("-down"))
              for v in args.variants.split(",") if v.startswith("stored-eq")}

    def stored_equalized(s):
        return in_stored_frame(lambda il, at: round_kv_type(at / s[il], "q4_0") * s[il])

    def stored_outliers(mask):
        return in_stored_frame(lambda il, at: split_rounded(mask[il], at))

    def row_outliers(n):
        def round_key(il, at):
            top = np.argsort(-np.abs(at), axis=-1, kind="stable")[..., :n]
            mask = np.zeros(at.shape, bool)
            np.put_along_axis(mask, top, True, -1)
            return split_rounded(mask, at)
        return in_stored_frame(round_key)

    def fused_outliers(mask):
        def rounded(il, k, v, seq):
            return split_rounded(mask[il], k), round_kv_type(v, "q4_0")
        return rounded

    rows = []
    for policy in args.policies.split(","):
        f32 = KVConfig(capacity=args.capacity, policy=policy, sinks=4)
        q4 = KVConfig(capacity=args.capacity, policy=policy, sinks=4, k_type="q4_0", v_type="q4_0")
        t0 = time.perf_counter()
        base = perplexity(eng, ids, f32, "stored")
        rows.append({"policy": policy, "variant": "f32", "ppl": base, "change": 0.0,
                     "seconds": time.perf_counter() - t0})
        for variant in args.variants.split(","):
            t0 = time.perf_counter()
            if variant == "stored":
                ppl = perplexity(eng, ids, q4, "stored")
            elif variant == "fused":
                ppl = perplexity(eng, ids, q4, "fused")
            elif variant == "stored-c":
                ppl = perplexity(eng, ids, q4, "stored", stored_centered(offsets[variant]))
            elif variant.startswith("stored-eq"):
                ppl = perplexity(eng, ids, q4, "stored", stored_equalized(scales[variant]))
            elif variant.startswith("stored-out"):
                ppl = perplexity(eng, ids, q4, "stored", stored_outliers(outliers[variant]))
            elif variant.startswith("stored-row"):
                ppl = perplexity(eng, ids, q4, "stored", row_outliers(int(variant.split("-row")[1])))
            elif variant.startswith("fused-out"):
                ppl = perplexity(eng, ids, q4, "fused", fused_outliers(outliers[variant]))
            else:
                ppl = perplexity(eng, ids, q4, "fused", centered(offsets[variant]))
            rows.append({"policy": policy, "variant": variant, "ppl": ppl, "change": ppl / base - 1,
                         "seconds": time.perf_counter() - t0})
            print(f"{policy} {variant}: {ppl:.3f} ({100 * (ppl / base - 1):+.2f}%)", flush=True)
    cmd = "python bench/kv_key_offsets.py " + " ".join(sys.argv[1:])
    md = ["# q4_0 keys relative to a per-layer offset (reference engine, SmolLM2)", "",
          f"Command: `{cmd}`  ", f"Machine: {machine()}", "",
          f"{args.tokens} tokens of Pride and Prejudice, 64-token chunks, capacity {args.capacity}, sinks 4, "
          f"q4_0 keys and values; calibration: {n_cal} tokens (bench/kv_key_offsets.py's docstring names "
          "the variants).", "", "| policy | variant | perplexity | vs f32 |", "|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['policy']} | {r['variant']} | {r['ppl']:.3f} | {100 * r['change']:+.2f}% |")
    write_results(args.name, {"command": cmd, "machine": machine(), "rows": rows, "tokens": args.tokens,
                              "capacity": args.capacity, "calibration": n_cal}, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
