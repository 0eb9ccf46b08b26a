"""Benchmark runtime/matvec.py: batch-1 decode matvec on the bundled models' weights.

    python bench/matvec_bench.py [--threads 1 2] [--tokens 40] [--quick] [--llama]

Measures, for 1 and 2 Numba threads:
  * each SmolLM2-135M tensor shape (q 576x576, k/v 192x576, o 576x576, gate/up 1536x576,
    down 576x1536: Q4_1; head 49152x576: Q8_0), streamed from DRAM: calls cycle over enough distinct
    packed copies (the 30 layers' tensors, repeated) to exceed twice the L3 cache; and hot (one
    matrix called back to back, L2/L3 resident);
  * the whole per-token set in model order: 30 x (q, k, v, o, gate, up, down) + head, 211 calls,
    and the same with q|k|v and gate|up stacked into one matrix each (121 calls); projected tok/s
    = 1 / (weights-only time per token);
  * per GGML type (Gemma 3 270M shapes where that model is installed, random blocks otherwise),
    streamed;
  * matmul (prefill) against T matvecs;
  * the fixed cost of one call (Python checks + Numba dispatch + thread fork/join) on a tiny matrix.
G weights/s counts n_rows * n_cols per call; GB/s counts the packed bytes streamed per call.
Writes bench/results/matvec_cpu.json and bench/results/matvec_cpu.md. Timings are min over
repeats (noise on a shared machine only ever adds time) with the median alongside.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numba
import numpy as np

from ringllm.models.bundled import default_model_path, gemma3_model_path
from ringllm.models.gguf_file import GGUFFile
from ringllm.runtime import matvec as mv
from ringllm.runtime.errors import ModelFileError
from ringllm.runtime.qtensor import QTensor
from ringllm.runtime.quant_types import BLOCK_LAYOUT, GGMLType
from ringllm.runtime.random_weights import random_qtensor

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
LAYER_MATS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
STREAM_BYTES = 96 << 20      # > 2 x the 32 MiB L3 of the machine this was written on


def machine() -> dict:
    info = {"cpu": platform.processor() or "unknown", "flags": ""}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name") and info["cpu"] in ("unknown", "x86_64", ""):
                    info["cpu"] = line.split(":", 1)[1].strip()
                if line.startswith("flags") and not info["flags"]:
                    flags = set(line.split(":", 1)[1].split())
                    info["flags"] = " ".join(f for f in ("avx2", "fma", "f16c", "avx512f") if f in flags)
                if line.startswith("cpu family"):
                    info["cpu_family"] = int(line.split(":", 1)[1])
                if line.startswith("model\t"):
                    info["cpu_model"] = int(line.split(":", 1)[1])
    except OSError:
        pass
    try:
        info["cores"] = len(os.sched_getaffinity(0))
    except AttributeError:
        info["cores"] = os.cpu_count()
    try:
        import subprocess
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        for line in lscpu.splitlines():
            k, _, v = line.partition(":")
            if k.strip() in ("L2 cache", "L3 cache", "Hypervisor vendor"):
                info[k.strip()] = v.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        info["load_avg_at_start"] = os.getloadavg()
    except OSError:
        pass
    info.update(python=platform.python_version(), numpy=np.__version__, numba=numba.__version__,
                numba_threading_layer=None, llvm=".".join(map(str, __import__("llvmlite.binding").binding.llvm_version_info)))
    return info


def timeit(fn, reps: int) -> tuple[float, float]:
    """(min, median) seconds of fn() over reps calls, after one warm-up call."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.min(ts)), float(np.median(ts))


def rate(weights: int, nbytes: int, seconds: float) -> dict:
    return {"seconds": seconds, "gw_per_s": weights / seconds / 1e9, "gb_per_s": nbytes / seconds / 1e9}


def stream_case(tensors: list[QTensor], reps: int) -> dict:
    """Streamed matvec: cycle over packed copies of `tensors` totalling > STREAM_BYTES."""
    packed = [mv.pack(t) for t in tensors]
    per = packed[0].nbytes
    copies = max(len(packed), -(-STREAM_BYTES // per))
    mats = [packed[i % len(packed)] if i < len(packed) else mv.pack(tensors[i % len(tensors)])
            for i in range(copies)]
    pm0 = mats[0]
    rng = np.random.default_rng(0)
    x = rng.standard_normal(pm0.n_cols).astype(np.float32)
    out = np.zeros(pm0.n_rows, np.float32)

    def sweep():
        for pm in mats:
            mv.matvec(out, pm, x)

    tmin, tmed = timeit(sweep, reps)
    n = len(mats)
    w = pm0.n_rows * pm0.n_cols

    def hot():
        for _ in range(50):
            mv.matvec(out, pm0, x)

    hmin, hmed = timeit(hot, reps)
    return {"shape": [pm0.n_rows, pm0.n_cols], "type": pm0.qtype.name, "packed_bytes": per, "copies": n,
            "stream": rate(w, per, tmin / n), "stream_median": rate(w, per, tmed / n),
            "hot": rate(w, per, hmin / 50), "hot_median": rate(w, per, hmed / 50)}


def _stack_groups(tensors: list[QTensor]) -> list[list[QTensor]]:
    """q, k, v and gate, up of one layer stacked where they share a type (one call per group)."""
    q, k, v, o, gate, up, down = tensors
    groups = []
    for part in ([q, k, v], [o], [gate, up], [down]):
        cur = [part[0]]
        for t in part[1:]:
            if t.qtype == cur[0].qtype:
                cur.append(t)
            else:
                groups.append(cur)
                cur = [t]
        groups.append(cur)
    return groups


def token_case(f: GGUFFile, n_layer: int, stacked: bool, reps: int) -> dict:
    """The per-token set of a model in model order: per layer q, k, v, o, gate, up, down, then the
    (tied) output head token_embd."""
    mats = []
    for il in range(n_layer):
        ts = [f.tensors[f"blk.{il}.{n}.weight"] for n in LAYER_MATS]
        if stacked:
            mats += [mv.pack(g) for g in _stack_groups(ts)]
        else:
            mats += [mv.pack(t) for t in ts]
    head = mv.pack(f.tensors.get("output.weight", f.tensors["token_embd.weight"]))
    rng = np.random.default_rng(1)
    xs = {n: rng.standard_normal(n).astype(np.float32) for n in {pm.n_cols for pm in mats + [head]}}
    outs = [np.zeros(pm.n_rows, np.float32) for pm in mats]
    hout = np.zeros(head.n_rows, np.float32)
    lw = sum(pm.n_rows * pm.n_cols for pm in mats)
    lb = sum(pm.nbytes for pm in mats)
    hw, hb = head.n_rows * head.n_cols, head.nbytes
    calls = [(o, pm, xs[pm.n_cols]) for o, pm in zip(outs, mats)]
    hx = xs[head.n_cols]
    times_l, times_h = [], []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for o, pm, x in calls:
            mv.matvec(o, pm, x)
        t1 = time.perf_counter()
        mv.matvec(hout, head, hx)
        t2 = time.perf_counter()
        times_l.append(t1 - t0)
        times_h.append(t2 - t1)
    times_l, times_h = np.array(times_l[1:]), np.array(times_h[1:])
    tot = times_l + times_h
    types = sorted({pm.qtype.name for pm in mats})
    return {"calls": len(mats) + 1, "stacked_qkv_gateup": stacked, "layer_types": types,
            "head_type": head.qtype.name,
            "layers": rate(lw, lb, float(times_l.min())), "head": rate(hw, hb, float(times_h.min())),
            "token": rate(lw + hw, lb + hb, float(tot.min())),
            "token_median": rate(lw + hw, lb + hb, float(np.median(tot))),
            "tok_per_s": 1.0 / float(tot.min()), "tok_per_s_median": 1.0 / float(np.median(tot))}


def type_cases(reps: int) -> list[dict]:
    """One streamed case per GGML type: Gemma 3's tensors where installed, random blocks otherwise."""
    cases = {}
    try:
        g = GGUFFile(gemma3_model_path())
        for name in ("ffn_gate", "attn_output", "ffn_down", "attn_v"):
            ts = [g.tensors[f"blk.{il}.{name}.weight"] for il in range(18)]
            cases.setdefault(ts[0].qtype, (ts, "gemma3 blk.*." + name))
        head = g.tensors["token_embd.weight"]
        cases[GGMLType.Q8_0] = ([head.take_rows(slice(0, 16384))], "gemma3 token_embd[:16384]")
    except ModelFileError:
        pass
    rng = np.random.default_rng(3)
    for q in (GGMLType.Q4_1, GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q3_K,
              GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.F16,
              GGMLType.BF16, GGMLType.F32):
        if q not in cases:
            cases[q] = ([random_qtensor(q, 1536, 1024 if BLOCK_LAYOUT[q][0] == 256 else 576, rng)],
                        "random blocks")
    out = []
    for q, (ts, src) in cases.items():
        r = stream_case(ts, reps)
        r["source"] = src
        out.append(r)
    return out


def matmul_case(f: GGUFFile, reps: int) -> list[dict]:
    """matmul (unpack + BLAS or per-row matvec) vs T matvecs, on blk.0.ffn_gate (1536x576 Q4_1) and
    the head rows 0..8191 (Q8_0)."""
    res = []
    rng = np.random.default_rng(2)
    for t in (f.tensors["blk.0.ffn_gate.weight"], f.tensors["token_embd.weight"].take_rows(slice(0, 8192))):
        pm = mv.pack(t)
        for T in (1, 2, 4, 8, 16, 64):
            X = rng.standard_normal((T, pm.n_cols)).astype(np.float32)
            out = np.zeros((T, pm.n_rows), np.float32)
            tm, _ = timeit(lambda: mv.matmul(out, pm, X), reps)

            def loop():
                for i in range(T):
                    mv.matvec(out[i], pm, X[i])

            tl, _ = timeit(loop, reps)
            w = pm.n_rows * pm.n_cols * T
            res.append({"tensor": t.name, "type": pm.qtype.name, "T": T, "matmul_s": tm, "matvec_loop_s": tl,
                        "matmul_gw_tok_per_s": w / tm / 1e9, "matvec_loop_gw_tok_per_s": w / tl / 1e9})
    return res


def overhead_case(reps: int) -> dict:
    rng = np.random.default_rng(4)
    t = random_qtensor(GGMLType.Q4_1, 32, 64, rng)
    pm = mv.pack(t)
    x = rng.standard_normal(64).astype(np.float32)
    out = np.zeros(32, np.float32)
    n = 2000

    def wrapped():
        for _ in range(n):
            mv.matvec(out, pm, x)

    def raw():
        k, b, s = pm.kernel, pm.buf, pm.scratch
        for _ in range(n):
            k(out, b, x, s)

    return {"matvec_us": timeit(wrapped, reps)[0] / n * 1e6, "raw_kernel_us": timeit(raw, reps)[0] / n * 1e6}


def llama_cpp_case(path: str, threads: int, n_tokens: int = 128) -> dict | None:
    """llama.cpp's own decode speed on the same file (llama-cpp-python), for the anchor."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=path, n_threads=threads, n_ctx=512, verbose=False)
    llm("Once upon a time", max_tokens=8)
    llm.reset()
    t0 = time.perf_counter()
    r = llm("Once upon a time", max_tokens=n_tokens, temperature=0.0)
    dt = time.perf_counter() - t0
    n = r["usage"]["completion_tokens"]
    return {"threads": threads, "tokens": n, "seconds": dt, "tok_per_s_incl_prompt": n / dt}


def fmt_rate(r: dict) -> str:
    return f"{r['gw_per_s']:6.2f} Gw/s {r['gb_per_s']:6.2f} GB/s"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=40, help="timed tokens in the per-token runs")
    ap.add_argument("--reps", type=int, default=15, help="repeats of the per-shape runs")
    ap.add_argument("--quick", action="store_true", help="fewer repeats, no per-type / matmul sections")
    ap.add_argument("--llama", action="store_true", help="also time llama.cpp (llama-cpp-python) decoding")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--merge", action="store_true",
                    help="keep the runs of other thread counts already in bench/results/matvec_cpu.json")
    ap.add_argument("--only", default="", help="comma list of sections to run (shapes,token,overhead,types,"
                    "matmul), merged into the existing results of the same thread count (implies --merge)")
    args = ap.parse_args(argv)
    only = {x for x in args.only.split(",") if x}
    if only:
        args.merge = True

    def want(section: str) -> bool:
        return not only or section in only

    reps = 3 if args.quick else args.reps
    info = machine()
    path = default_model_path()
    f = GGUFFile(path)
    try:
        gemma = GGUFFile(gemma3_model_path())
    except ModelFileError:
        gemma = None
    numba.set_num_threads(1)
    mv.matvec(np.zeros(16, np.float32), mv.pack(f.tensors["blk.0.attn_k.weight"].take_rows(slice(0, 16))),
              np.zeros(576, np.float32))
    info["numba_threading_layer"] = numba.threading_layer()
    print(f"# {info['cpu']} ({info['cores']} cores, {info.get('L3 cache', '?')} L3), numba {numba.__version__}, "
          f"threading layer {info['numba_threading_layer']}, load avg {info.get('load_avg_at_start')}")
    results = {"machine": info, "runs": {}}
    shapes = [("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output"), ("gate", "ffn_gate"),
              ("up", "ffn_up"), ("down", "ffn_down")]
    for nt in args.threads:
        if nt > numba.config.NUMBA_NUM_THREADS:
            print(f"skip {nt} threads (NUMBA_NUM_THREADS={numba.config.NUMBA_NUM_THREADS})")
            continue
        numba.set_num_threads(nt)
        run = {"threads": nt, "shapes": {}, "types": [], "matmul": [],
               "load_avg_at_start": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
        print(f"\n## {nt} thread{'s' if nt > 1 else ''}")
        for label, name in (shapes if want("shapes") else []):
            ts = [f.tensors[f"blk.{il}.{name}.weight"] for il in range(30)]
            r = stream_case(ts, reps)
            run["shapes"][label] = r
            print(f"{label:5s} {r['type']} {r['shape'][0]:5d}x{r['shape'][1]:<5d} stream {fmt_rate(r['stream'])}"
                  f"  {r['stream']['seconds'] * 1e6:7.1f} us | hot {fmt_rate(r['hot'])}")
        r = stream_case([f.tensors["token_embd.weight"]], reps) if want("shapes") else None
        if r is not None:
            run["shapes"]["head"] = r
            print(f"head  {r['type']} {r['shape'][0]:5d}x{r['shape'][1]:<5d} stream {fmt_rate(r['stream'])}"
                  f"  {r['stream']['seconds'] * 1e6:7.1f} us | hot {fmt_rate(r['hot'])}")
        for stacked in ((False, True) if want("token") else ()):
            r = token_case(f, 30, stacked, args.tokens)
            run["token_stacked" if stacked else "token"] = r
            print(f"SmolLM2 token set ({r['calls']} calls{', q|k|v and gate|up stacked' if stacked else ''}): "
                  f"layers {fmt_rate(r['layers'])} | head {fmt_rate(r['head'])} | all {fmt_rate(r['token'])} "
                  f"{r['token']['seconds'] * 1e3:.2f} ms -> {r['tok_per_s']:.1f} tok/s "
                  f"(median {r['tok_per_s_median']:.1f})")
        if gemma is not None and not args.quick and want("token"):
            r = token_case(gemma, 18, True, max(5, args.tokens // 4))
            run["gemma3_token_stacked"] = r
            print(f"Gemma 3 270M token set ({r['calls']} calls, stacked; layers {'/'.join(r['layer_types'])}, "
                  f"head {r['head_type']}): layers {fmt_rate(r['layers'])} | head {fmt_rate(r['head'])} | "
                  f"{r['token']['seconds'] * 1e3:.2f} ms -> {r['tok_per_s']:.1f} tok/s")
        if want("overhead"):
            run["overhead"] = overhead_case(reps)
            print(f"fixed cost per call: matvec {run['overhead']['matvec_us']:.2f} us, "
                  f"raw kernel {run['overhead']['raw_kernel_us']:.2f} us")
        if not args.quick and want("types"):
            print("per type (streamed):")
            for r in type_cases(reps):
                run["types"].append(r)
                print(f"  {r['type']:5s} {r['shape'][0]:6d}x{r['shape'][1]:<5d} {fmt_rate(r['stream'])}"
                      f" | hot {fmt_rate(r['hot'])}  [{r['source']}]")
        if not args.quick and want("matmul"):
            print("matmul vs matvec loop (G weight-tokens/s):")
            for r in matmul_case(f, reps):
                run["matmul"].append(r)
                print(f"  {r['type']} T={r['T']:3d}: matmul {r['matmul_gw_tok_per_s']:6.2f}  "
                      f"matvec loop {r['matvec_loop_gw_tok_per_s']:6.2f}")
        if args.llama and want("llama"):
            run["llama_cpp"] = llama_cpp_case(path, nt)
            if run["llama_cpp"]:
                print(f"llama.cpp decode: {run['llama_cpp']['tok_per_s_incl_prompt']:.1f} tok/s")
        results["runs"][str(nt)] = run
    if not args.no_write:
        os.makedirs(RESULTS, exist_ok=True)
        old_path = os.path.join(RESULTS, "matvec_cpu.json")
        if args.merge and os.path.exists(old_path):
            with open(old_path) as fh:
                old = json.load(fh)
            runs = dict(old.get("runs", {}))
            for k, new_run in results["runs"].items():
                if only and k in runs:
                    merged = dict(runs[k])
                    for key, val in new_run.items():
                        if val not in ({}, [], None) and key not in ("threads", "time", "load_avg_at_start"):
                            merged[key] = val
                    merged.setdefault("sections_rerun", []).append(
                        {"sections": sorted(only), "time": new_run["time"], "load_avg_at_start": new_run["load_avg_at_start"]})
                    runs[k] = merged
                else:
                    runs[k] = new_run
            results["runs"] = {k: runs[k] for k in sorted(runs, key=int)}
            results["machine_earlier_runs"] = old.get("machine")
        with open(os.path.join(RESULTS, "matvec_cpu.json"), "w") as fh:
            json.dump(results, fh, indent=1)
        with open(os.path.join(RESULTS, "matvec_cpu.md"), "w") as fh:
            fh.write(markdown(results))
        print(f"\nwrote {RESULTS}/matvec_cpu.json and matvec_cpu.md")
    return 0


def markdown(res: dict) -> str:
    m = res["machine"]
    lines = ["# matvec (runtime/matvec.py) on CPU", "",
             f"Machine: {m['cpu']} (family {m.get('cpu_family', '?')} model {m.get('cpu_model', '?')}), "
             f"{m['cores']} cores, L2 {m.get('L2 cache', '?')}, L3 {m.get('L3 cache', '?')}, "
             f"{m.get('Hypervisor vendor', 'no')} hypervisor, SIMD: {m['flags']}; Python {m['python']}, "
             f"NumPy {m['numpy']}, Numba {m['numba']} (LLVM {m['llvm']}, threading layer "
             f"{m['numba_threading_layer']}); load average at start {m.get('load_avg_at_start')}.", "",
             "Timings are the minimum over repeats (median in the JSON); the machine may be shared, "
             "which only ever adds time. Gw/s = 1e9 weights per second; GB/s = packed weight bytes "
             "streamed per second. 'stream' cycles over distinct packed copies totalling > 96 MiB "
             "(DRAM bound, the decode situation); 'hot' repeats one matrix (cache resident).", ""]
    for nt, run in res["runs"].items():
        lines += [f"## {nt} thread{'s' if nt != '1' else ''}", "",
                  f"Run at {run.get('time', '?')}, load average {run.get('load_avg_at_start', '?')}"
                  + "".join(f"; sections {', '.join(r['sections'])} re-run at {r['time']}, load average "
                            f"{r['load_avg_at_start']}" for r in run.get("sections_rerun", [])) + ".", "",
                  "| matrix | type | shape | stream Gw/s | stream GB/s | us/call | hot Gw/s |",
                  "|---|---|---|---|---|---|---|"]
        for label, r in run["shapes"].items():
            lines.append(f"| {label} | {r['type']} | {r['shape'][0]}x{r['shape'][1]} | {r['stream']['gw_per_s']:.2f} | "
                         f"{r['stream']['gb_per_s']:.2f} | {r['stream']['seconds'] * 1e6:.1f} | "
                         f"{r['hot']['gw_per_s']:.2f} |")
        lines += ["", "| per-token set | calls | layers Gw/s | layers GB/s | head Gw/s | all Gw/s | ms/token | "
                  "projected tok/s (median) |", "|---|---|---|---|---|---|---|---|"]
        for key in ("token", "token_stacked", "gemma3_token_stacked"):
            r = run.get(key)
            if r:
                label = "SmolLM2, " + ("q/k/v, gate/up stacked" if r["stacked_qkv_gateup"] else "one call per matrix")
                if key.startswith("gemma3"):
                    label = f"Gemma 3 270M, stacked ({'/'.join(r['layer_types'])}, head {r['head_type']})"
                lines.append(f"| {label} | "
                             f"{r['calls']} | {r['layers']['gw_per_s']:.2f} | {r['layers']['gb_per_s']:.2f} | "
                             f"{r['head']['gw_per_s']:.2f} | {r['token']['gw_per_s']:.2f} | "
                             f"{r['token']['seconds'] * 1e3:.2f} | {r['tok_per_s']:.1f} ({r['tok_per_s_median']:.1f}) |")
        o = run.get("overhead")
        if o:
            lines += ["", f"Fixed cost of one call on a 32x64 matrix: matvec() {o['matvec_us']:.2f} us, "
                      f"raw kernel {o['raw_kernel_us']:.2f} us."]
        if run.get("types"):
            lines += ["", "| type | shape | source | stream Gw/s | stream GB/s | hot Gw/s |", "|---|---|---|---|---|---|"]
            for r in run["types"]:
                lines.append(f"| {r['type']} | {r['shape'][0]}x{r['shape'][1]} | {r['source']} | "
                             f"{r['stream']['gw_per_s']:.2f} | {r['stream']['gb_per_s']:.2f} | {r['hot']['gw_per_s']:.2f} |")
        if run.get("matmul"):
            lines += ["", "| matmul tensor | T | matmul G weight-tok/s | T x matvec G weight-tok/s |", "|---|---|---|---|"]
            for r in run["matmul"]:
                lines.append(f"| {r['tensor']} ({r['type']}) | {r['T']} | {r['matmul_gw_tok_per_s']:.2f} | "
                             f"{r['matvec_loop_gw_tok_per_s']:.2f} |")
        if run.get("llama_cpp"):
            r = run["llama_cpp"]
            lines += ["", f"llama.cpp (llama-cpp-python) decode on the same file: {r['tok_per_s_incl_prompt']:.1f} tok/s "
                      f"({r['tokens']} tokens incl. a 5-token prompt, {r['threads']} threads)."]
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
