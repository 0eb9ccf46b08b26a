"""Where a 512-token prefill of the ringllm CPU engine spends its time, per model and precision.

    python bench/prefill_profile.py [--pp 512] [-t 2] [--synthetic llama-3.2-1b]

Times the engine's own steps in place (methods and kernels wrapped with a perf_counter pair, one
prefill of `pp` random tokens into an empty policy-full store, after a warm-up prefill): each weight
matrix's product grouped by GGML type and shape, the attention of the chunk (KV write + attend),
the norms, the FFN activation, and "other" (the rest: residual adds, RoPE factors, embedding,
Python); the output head (the last row only) is one of the products. For the products it gives the achieved GFLOP/s
(2 x rows x n_rows x n_cols / s) and the share of the machine's float32 FMA peak, measured in the
same run on the same threads (bench/fma_peak.py: register-only multiply-adds). In q8 the products are
integer dot products: the share then says how far past the float32 peak the int8 path goes.
Models: the bundled SmolLM2-135M (Q4_1), Gemma 3 270M (Q4_K_M mix) and, with --synthetic, a
bench/synthetic_gguf.py shape. Writes bench/results/prefill_profile.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, wait_for_quiet_cpu, write_results  # noqa: E402
from fma_peak import measure as measure_fma_peak  # noqa: E402


def profile(path: str, precision: str, pp: int, threads: int) -> dict:
    import ringllm.runtime.engine as E
    from ringllm.models.loader import load_model
    from ringllm.runtime.kv_config import KVConfig

    m = load_model(path, tokenizer=False)
    eng = E.CPUEngine(m.spec, m.tensors, n_threads=threads, n_batch=min(512, pp), precision=precision)
    ids = np.random.default_rng(0).integers(100, min(5000, m.spec.n_vocab), pp).tolist()
    kv = KVConfig(capacity=pp + 8, policy="full")
    eng.prefill(ids, eng.new_store(kv))                     # compile / load, page in
    acc = defaultdict(lambda: [0.0, 0.0])                   # key -> [seconds, flops]

    def timed(owner, name, key):
        """Replace owner.name (an engine method or a kernel the engine module calls) by a timed
        wrapper adding its seconds to acc[key]; returns the original."""
        orig = getattr(owner, name)

        def run(*a):
            t0 = time.perf_counter()
            r = orig(*a)
            acc[key][0] += time.perf_counter() - t0
            return r
        setattr(owner, name, run)
        return orig

    def timed_matmul(out, pm, x, orig=eng._matmul):
        t0 = time.perf_counter()
        orig(out, pm, x)
        k = acc[("matmul", f"{pm.qtype.name} {pm.n_rows}x{pm.n_cols}")]
        k[0] += time.perf_counter() - t0
        k[1] += 2.0 * x.shape[0] * pm.n_rows * pm.n_cols

    eng._matmul = timed_matmul
    timed(eng, "_attend_dense", ("attention", "write + attend"))
    saved = {n: timed(E, n, key) for n, key in (("gated_act_fused", ("activation", "gated FFN activation")),
                                              ("gated_act", ("activation", "gated FFN activation")),
                                              ("rms_norm_rows", ("norms", "RMS norms")),
                                              ("layer_norm_rows", ("norms", "layer norms")))}
    try:
        wait_for_quiet_cpu(30)
        st = eng.new_store(kv)
        t0 = time.perf_counter()
        eng.prefill(ids, st)
        total = time.perf_counter() - t0
    finally:
        for n, f in saved.items():
            setattr(E, n, f)
    rows = []
    for (group, what), (sec, flops) in sorted(acc.items(), key=lambda kv: -kv[1][0]):
        rows.append({"group": group, "what": what, "ms": round(sec * 1e3, 2), "share": round(sec / total, 4),
                     "gflops": round(flops / sec / 1e9, 1) if flops else None})
    other = total - sum(a[0] for a in acc.values())
    rows.append({"group": "other", "what": "residual adds, RoPE factors, embedding, Python", "ms": round(other * 1e3, 2),
                 "share": round(other / total, 4), "gflops": None})
    return {"model": os.path.basename(path), "precision": precision, "pp": pp, "total_ms": round(total * 1e3, 1),
            "tok_s": round(pp / total, 1), "rows": rows}


def markdown(results: list[dict], args, command: str, peak: float) -> str:
    mc = machine()
    md = ["# Where prefill time goes (ringllm CPU engine)", "",
          f"Machine: {mc['cpu']}, {mc['cores']} cores, {args.threads} threads. Command: `{command}`", "",
          f"One prefill of {args.pp} random tokens into an empty store (policy full), each step timed in place. "
          f"GFLOP/s of a product: 2 x rows x n_rows x n_cols / s; % peak: of the 2-core float32 FMA peak "
          f"({peak:.0f} GFLOP/s, bench/fma_peak.py in this run). The output head runs on the last row only: it is the product with "
          "the vocabulary's rows at a low GFLOP/s (one row, bandwidth-bound).", ""]
    for r in results:
        md += [f"## {r['model']}, precision {r['precision']}: {r['total_ms']:.0f} ms, {r['tok_s']:.0f} tok/s", "",
               "| part | what | ms | share | GFLOP/s | % of f32 peak |", "|---|---|---|---|---|---|"]
        for x in r["rows"]:
            g = f"{x['gflops']:.0f}" if x["gflops"] else ""
            p = f"{100 * x['gflops'] / peak:.0f}%" if x["gflops"] else ""
            md.append(f"| {x['group']} | {x['what']} | {x['ms']:.1f} | {100 * x['share']:.1f}% | {g} | {p} |")
        md.append("")
    return "\n".join(md) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("--synthetic", default=None, help="also a bench/synthetic_gguf.py shape (e.g. llama-3.2-1b)")
    args = ap.parse_args()
    from ringllm.models.bundled import default_model_path, gemma3_model_path
    paths = [default_model_path(), gemma3_model_path()]
    if args.synthetic:
        from synthetic_gguf import synthetic_path
        paths.append(synthetic_path(args.synthetic))
    results = []
    for path in paths:
        for precision in ("f32", "q8"):
            r = profile(path, precision, args.pp, args.threads)
            print(f"{r['model']} {precision}: {r['tok_s']} tok/s", flush=True)
            results.append(r)
    peak = max(measure_fma_peak(args.threads).values())
    command = "python bench/prefill_profile.py " + " ".join(sys.argv[1:])
    write_results("prefill_profile", {"machine": machine(), "command": command, "fma_peak_gflops": peak,
                                      "results": results}, markdown(results, args, command, peak))


if __name__ == "__main__":
    main()
