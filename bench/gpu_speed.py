"""GPU backend speed: decode (tg) and prefill (pp) tokens/s, CUDA-graph decode, long streams with eviction,
beside transformers on the same GPU (its default cache, and the HF StreamingLLM shift-and-append
pattern at the same capacities: bench/transformers_baseline.py), the CPU engine and (when
llama-cpp-python was built with CUDA) llama.cpp on the same GGUF.

    python bench/gpu_speed.py [-m MODEL] [--tg 256] [--pp 512,4096] [--stream 50000] [--capacities 512,4096]
                              [--hf-stream 2000] [--name gpu_speed]

Needs an NVIDIA GPU (exits with the backend's DeviceError message otherwise). Prints and writes
bench/results/gpu_speed.{json,md}: tokens/s and achieved GB/s of weights (weight bytes read per
decoded token x tokens/s; the roofline is the GPU's memory bandwidth), per decode mode (logits
downloaded every step, token chosen on the device, CUDA graph), and per eviction policy at a fixed
capacity over a long stream (latency p50/p99 of the first and last thousand tokens: flat is the
point of the in-place store).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import llama_cpp_last_logits, machine, write_results  # noqa: E402

POLICIES = ("streaming", "h2o", "tova", "knorm", "lsh", "scissorhands", "random", "snapkv", "pyramidkv", "rkv", "adakv",
            "gvote")   # the device policies


def decode_bytes(m) -> int:
    """Weight bytes read per decoded token: every matrix once (tied head: the whole embedding)."""
    total = sum(t.nbytes for n, t in m.tensors.items() if n != "token_embd.weight")
    if m.spec.tied_output:
        total += m.tensors["token_embd.weight"].nbytes
    return total


def timed(fn, n: int) -> float:
    t0 = time.perf_counter()
    fn()
    return n / (time.perf_counter() - t0)


SAMPLING = dict(temperature=0.8, top_k=40, top_p=0.95)   # llama.cpp's defaults


def device_decode_rate(eng, prompt: list[int], n_tg: int, **sampling) -> float:
    """Decode tok/s of n_tg tokens chosen on the device after `prompt` (a fresh store, policy full):
    greedy, or sampled with `sampling` (CUDAEngine.decode's temperature / top_k / top_p) and a
    seeded generator."""
    st = eng.new_store(capacity=n_tg + 16, policy="full")
    eng.prefill(prompt, st)
    rng = np.random.default_rng(1) if sampling else None
    tok = eng.pick(**sampling, rng=rng)

    def run():
        t = tok
        for _ in range(n_tg):
            t = eng.decode(t, st, **sampling, rng=rng)
    return timed(run, n_tg)


def bench_gpu(m, n_tg: int, pps: list[int], repeats: int) -> dict:
    """Per mode (plain launches, CUDA-graph decode): prefill tok/s of each prompt length in pps (policy
    full, chunks of up to 512 rows) and decode tok/s of n_tg tokens after an 8-token prompt, with the
    logits downloaded every step (host argmax), with the token chosen on the device (greedy), and
    sampled on the device with SAMPLING (the pick kernel's top-k and top-p bisections read the
    whole vocabulary many times)."""
    from ringllm.native import CUDAEngine

    out = {}
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(100, min(5000, m.spec.n_vocab), n).tolist() for n in pps}
    for graph in (False, True):
        eng = CUDAEngine(m.spec, m.tensors, n_batch=min(512, max(pps)), cuda_graph=graph)
        eng.generate(prompts[pps[0]][:16], eng.new_store(capacity=n_tg + 64, policy="full"), 8)   # warm-up (and capture)
        pp = {n: [] for n in pps}
        tg_logits, tg_device, tg_sampled = [], [], []
        for _ in range(repeats):
            for n, prompt in prompts.items():
                st = eng.new_store(capacity=n + 8, policy="full")
                pp[n].append(timed(lambda: eng.prefill(prompt, st), n))

            st = eng.new_store(capacity=n_tg + 16, policy="full")
            logits = eng.prefill(prompts[pps[0]][:8], st)

            def host_argmax():
                lg = logits
                for _ in range(n_tg):
                    lg = eng.step(int(np.argmax(lg)), st)
            tg_logits.append(timed(host_argmax, n_tg))

            tg_device.append(device_decode_rate(eng, prompts[pps[0]][:8], n_tg))
            tg_sampled.append(device_decode_rate(eng, prompts[pps[0]][:8], n_tg, **SAMPLING))
        key = "graph" if graph else "plain"
        out[key] = {"pp": {str(n): float(np.median(v)) for n, v in pp.items()},
                    "tg_host_argmax": float(np.median(tg_logits)), "tg_device_pick": float(np.median(tg_device)),
                    "tg_device_sampled": float(np.median(tg_sampled))}
    return out


def stream_latencies(eng, n_tokens: int, capacity: int, policy: str) -> tuple[np.ndarray, int]:
    """Per-token latency (s) of n_tokens decode steps (graph replay) of one `policy` store of `capacity`
    slots after a 4-token prompt, and the tokens it evicted."""
    st = eng.new_store(capacity=capacity, policy=policy)
    eng.prefill([1, 2, 3, 4], st)
    tok = eng.pick()
    lat = np.empty(n_tokens)
    for i in range(n_tokens):
        t0 = time.perf_counter()
        tok = eng.decode(tok, st)
        lat[i] = time.perf_counter() - t0
        if (i + 1) % 10000 == 0:        # progress: a run cut short still shows how far each stream got
            print(f"stream {policy} {capacity}: {i + 1} tokens, p50 of the last 1k {np.median(lat[i - 999:i + 1]) * 1e3:.3f} ms",
                  flush=True)
    return lat, st.stats()["evicted_total"]


def stream_summary(lat: np.ndarray, capacity: int, evicted: int) -> dict:
    """tok/s, p50/p99 of the first and last thousand tokens and, when the stream is long enough, of the
    thousand after the store filled (capacity - 4 tokens in): last / filled p50 is the flatness.
    Also the p50 of the thousand tokens before each 10,000th, and last / the first of them
    (flat_from_10k): a policy whose layers or heads hold more than `capacity` slots (pyramidkv's
    budgets, adakv's heads) fills later than `capacity` tokens in, so its "filled" thousand can
    still be a store that grows."""
    n = lat.size
    ms = lat * 1e3
    out = {"tok_s": float(n / lat.sum()), "first_p50_ms": float(np.median(ms[:1000])),
           "first_p99_ms": float(np.percentile(ms[:1000], 99)), "last_p50_ms": float(np.median(ms[-1000:])),
           "last_p99_ms": float(np.percentile(ms[-1000:], 99)), "evicted": evicted}
    full = ms[capacity:capacity + 1000]
    if n >= capacity + 2000:
        out.update(filled_p50_ms=float(np.median(full)), filled_p99_ms=float(np.percentile(full, 99)),
                   flat=float(np.median(ms[-1000:]) / np.median(full)))
    marks = range(10000, n + 1, 10000)
    out["p50_each_10k_ms"] = [float(np.median(ms[m - 1000:m])) for m in marks]
    if n >= 20000:
        out["flat_from_10k"] = float(np.median(ms[-1000:]) / out["p50_each_10k_ms"][0])
    return out


def bench_stream(m, n_tokens: int, capacity: int, policies=POLICIES) -> dict:
    """One long stream per policy, one after another, on one engine."""
    from ringllm.native import CUDAEngine

    eng = CUDAEngine(m.spec, m.tensors, cuda_graph=True)
    out = {}
    for policy in policies:
        print(f"stream {policy} capacity {capacity}: {n_tokens} tokens", flush=True)
        lat, evicted = stream_latencies(eng, n_tokens, capacity, policy)
        out[policy] = stream_summary(lat, capacity, evicted)
        report(f"stream {policy} {capacity}", out[policy])     # each as it ends: a run cut short keeps it
    return out


def bench_streams_concurrent(m, n_tokens: int, capacities: list[int], policies) -> dict:
    """Every (capacity, policy) stream at once, each in its own thread with its own engine (its own CUDA
    stream): a decode step is launch-bound and leaves most of the GPU idle, so the streams overlap
    and the whole set takes about as long as one. Latencies are under that steady contention: the
    flatness (last / filled p50) is the figure, not the absolute latency."""
    import threading

    from ringllm.native import CUDAEngine

    jobs = [(c, p) for c in capacities for p in policies]
    engines = [CUDAEngine(m.spec, m.tensors, cuda_graph=True) for _ in jobs]
    out, errors = {str(c): {} for c in capacities}, []
    start = threading.Barrier(len(jobs))

    def run(eng, c, p):
        try:
            start.wait()
            lat, evicted = stream_latencies(eng, n_tokens, c, p)
            out[str(c)][p] = stream_summary(lat, c, evicted)
            report(f"stream {p} {c} (concurrent)", out[str(c)][p])
        except Exception as e:          # recorded: the other streams go on
            errors.append(f"{p} {c}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(eng, c, p)) for eng, (c, p) in zip(engines, jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        out["errors"] = errors
    return out


def bench_batch(m, batches: list[int], capacity: int, n_steps: int) -> dict:
    """Batched decode throughput: for update "inplace" (EQUIP) and "shift" (shift-and-append), per
    batch size B, B sequences of streaming stores filled to `capacity` (so every step evicts), then
    n_steps steps of all B (decode_batch, CUDA graph; B = 1: decode). tok/s = B x steps / time."""
    from ringllm.native import CUDAEngine

    eng = CUDAEngine(m.spec, m.tensors, n_batch=max(64, max(batches)), cuda_graph=True)
    rng = np.random.default_rng(1)
    out = {}
    for update in ("inplace", "shift"):
        out[update] = {}
        for B in batches:
            kv = dict(capacity=capacity, policy="streaming", sinks=4, update=update)
            prompts = [rng.integers(100, min(5000, m.spec.n_vocab), capacity).tolist() for _ in range(B)]
            if B == 1:
                st = eng.new_store(**kv)
                eng.prefill(prompts[0], st)
                tok = eng.pick()
                for _ in range(8):      # warm-up and capture
                    tok = eng.decode(tok, st)
                t0 = time.perf_counter()
                for _ in range(n_steps):
                    tok = eng.decode(tok, st)
                dt = time.perf_counter() - t0
            else:
                st = eng.new_batch_store(B, **kv)
                toks = np.array([int(np.argmax(eng.forward_seq(p, st, b))) for b, p in enumerate(prompts)], np.int32)
                for _ in range(8):
                    toks = eng.decode_batch(toks, st)
                t0 = time.perf_counter()
                for _ in range(n_steps):
                    toks = eng.decode_batch(toks, st)
                dt = time.perf_counter() - t0
            out[update][str(B)] = {"tok_s": B * n_steps / dt, "step_ms": dt / n_steps * 1e3}
            print(f"batch {update} B={B}: {B * n_steps / dt:.0f} tok/s", flush=True)
            del st
    return out


def copy_bandwidth_gb_s(n_bytes: int = 2 << 30, repeats: int = 10) -> float | None:
    """The card's achievable bandwidth: a device-to-device copy of n_bytes through PyTorch, bytes read
    plus bytes written over the median time (None without a CUDA build of torch)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    src = torch.empty(n_bytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n_bytes / float(np.median(times)) / 1e9


def bench_cpu(m, n_tg: int) -> float:
    from ringllm.runtime.engine import CPUEngine

    eng = CPUEngine(m.spec, m.tensors)
    st = eng.new_store(capacity=n_tg + 16, policy="full")
    logits = eng.prefill([1, 2, 3, 4, 5, 6, 7, 8], st)

    def run():
        lg = logits
        for _ in range(n_tg):
            lg = eng.step(int(np.argmax(lg)), st)
    return timed(run, n_tg)


def bench_llama_cpp(path: str, n_tg: int) -> float | None:
    """llama.cpp decode tok/s with every layer on the GPU; None without a CUDA build of llama-cpp-python."""
    try:
        import llama_cpp
        from llama_cpp import Llama
    except ImportError:
        return None
    if not getattr(llama_cpp, "llama_supports_gpu_offload", lambda: False)():
        return None
    llm = Llama(model_path=path, n_ctx=n_tg + 64, n_gpu_layers=-1, verbose=False)
    llm.eval([1, 2, 3, 4, 5, 6, 7, 8])
    t0 = time.perf_counter()
    for _ in range(n_tg):
        llm.eval([int(np.argmax(llama_cpp_last_logits(llm)))])
    return n_tg / (time.perf_counter() - t0)


def bench_transformers(path: str, n_tg: int, n_pp: int, n_stream: int, capacities: list[int],
                       device: str = "cuda") -> dict:
    """transformers on the GPU, same weights (float16): default cache pp/tg, and the shift-and-append
    stream per capacity (bench/transformers_baseline.py)."""
    import transformers_baseline as tb

    model, torch = tb.load(path, device)
    prompt = np.random.default_rng(0).integers(100, 5000, n_pp).tolist()
    out = {"default_cache": tb.default_cache(model, torch, device, prompt, n_tg)}
    for c in capacities:
        try:
            r = tb.shift_append(model, torch, device, prompt, n_stream, c)
        except Exception as e:          # e.g. an architecture whose rotary module the baseline does not know
            out[f"shift_append_{c}"] = {"error": f"{type(e).__name__}: {e}"}
            continue
        r.pop("tokens")
        out[f"shift_append_{c}"] = r
    return out


def report(section: str, result) -> None:
    """Print one section's figures as soon as they exist (a run cut short keeps what it measured)."""
    print(f"[{section}] {json.dumps(result)}", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF file or HF dir (default: bundled SmolLM2)")
    ap.add_argument("--tg", type=int, default=256)
    ap.add_argument("--pp", default="512,4096", help="prompt lengths of the prefill runs, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stream", type=int, default=50000, help="tokens per long-stream run (0 = skip)")
    ap.add_argument("--capacities", default="512,4096", help="store capacities of the long streams")
    ap.add_argument("--policies", default=",".join(POLICIES), help="policies of the long streams, comma-separated")
    ap.add_argument("--stream-concurrent", action="store_true",
                    help="run every long stream at once, one thread and engine each (flatness under steady contention)")
    ap.add_argument("--batch", default="1,2,4,8,16,32,64", help="batch sizes of the batched decode runs ('' = skip)")
    ap.add_argument("--batch-capacity", type=int, default=512, help="store capacity per sequence in the batched runs")
    ap.add_argument("--batch-steps", type=int, default=200, help="timed steps per batched run")
    ap.add_argument("--hf-stream", type=int, default=2000,
                    help="tokens of transformers' shift-and-append stream per capacity (0 = skip transformers)")
    ap.add_argument("--name", default="gpu_speed")
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU engine anchor")
    args = ap.parse_args(argv)

    import ringllm.native as native
    from ringllm.models.bundled import default_model_path
    from ringllm.models.loader import load_model

    if not native.available():
        try:
            why = native.build_info()
        except native.DeviceError as e:
            why = str(e)
        sys.exit(f"bench/gpu_speed.py needs an NVIDIA GPU and driver; none is usable here (native library: {why})")
    path = args.model or default_model_path()
    m = load_model(path, tokenizer=False)
    name = os.path.basename(path)
    ffi_dev = native.ffi_lib()
    dev = ffi_dev[0].new("char[]", 256)
    total = ffi_dev[0].new("int64_t *")
    native.check_status(ffi_dev[1].rl_device_info(0, dev, 256, total), "rl_device_info")
    gpu_name = ffi_dev[0].string(dev).decode()

    pps = [int(n) for n in args.pp.split(",")]
    res = {"model": name, "gpu": gpu_name, "gpu_memory_gb": int(total[0]) / 1e9, "build": native.build_info(),
           "machine": machine(), "command": " ".join(sys.argv), "decode_bytes": decode_bytes(m), "tg": args.tg,
           "pp": pps}
    res["copy_gb_s"] = copy_bandwidth_gb_s()
    report("copy_gb_s", res["copy_gb_s"])
    res["gpu_engine"] = bench_gpu(m, args.tg, pps, args.repeats)
    report("gpu_engine", res["gpu_engine"])
    capacities = [int(c) for c in args.capacities.split(",")]
    if args.batch:
        res["batch"] = bench_batch(m, [int(b) for b in args.batch.split(",")], args.batch_capacity, args.batch_steps)
        report("batch", res["batch"])
    if args.hf_stream:          # before the long streams: the decode ratio is the headline figure
        try:
            res["transformers"] = bench_transformers(path, args.tg, pps[0], args.hf_stream, capacities)
        except Exception as e:        # recorded, and the run goes on to the streams
            res["transformers_error"] = f"{type(e).__name__}: {e}"
        report("transformers", res.get("transformers", res.get("transformers_error")))
    if args.stream and args.stream_concurrent:
        res["stream"] = bench_streams_concurrent(m, args.stream, capacities, args.policies.split(","))
    elif args.stream:
        res["stream"] = {}
        for c in capacities:
            res["stream"][str(c)] = bench_stream(m, args.stream, c, args.policies.split(","))
            report(f"stream {c}", res["stream"][str(c)])
    if not args.no_cpu:
        res["cpu_tg"] = bench_cpu(m, min(args.tg, 64))
    res["llama_cpp_gpu_tg"] = bench_llama_cpp(path, args.tg)

    gb = res["decode_bytes"] / 1e9
    lines = [f"# GPU backend speed: {name} on {gpu_name}", "", f"build: {res['build']}", "",
             f"command: `{res['command']}`", "",
             "| mode | " + " | ".join(f"pp{n} tok/s" for n in pps) +
             " | tg tok/s (logits to host) | tg tok/s (token on device) | tg tok/s (sampled on device) "
             "| GB/s of weights (device tg) |",
             "|---|" + "---|" * len(pps) + "---|---|---|---|"]
    if res["copy_gb_s"]:
        lines[6:6] = [f"bandwidth limit: a device-to-device copy moves {res['copy_gb_s']:.0f} GB/s (read + write); "
                      f"{res['decode_bytes'] / 1e6:.1f} MB of weights per token caps decode at "
                      f"{res['copy_gb_s'] / gb:.0f} tok/s", ""]
    for mode, r in res["gpu_engine"].items():
        lines.append(f"| {mode} | " + " | ".join(f"{r['pp'][str(n)]:.0f}" for n in pps) +
                     f" | {r['tg_host_argmax']:.0f} | {r['tg_device_pick']:.0f} | {r['tg_device_sampled']:.0f} | "
                     f"{r['tg_device_pick'] * gb:.1f} |")
    if "cpu_tg" in res:
        lines += ["", f"CPU engine tg: {res['cpu_tg']:.1f} tok/s"]
    if res["llama_cpp_gpu_tg"]:
        lines += [f"llama.cpp (GPU) tg: {res['llama_cpp_gpu_tg']:.1f} tok/s"]
    if "transformers_error" in res:
        lines += ["", f"transformers (same GPU): failed: {res['transformers_error']}"]
    if "transformers" in res:
        d = res["transformers"]["default_cache"]
        best = max(r["tg_device_pick"] for r in res["gpu_engine"].values())
        lines += ["", f"transformers (same GPU, float16, default DynamicCache): pp {d['pp']:.0f} tok/s, tg "
                  f"{d['tg']:.0f} tok/s; ringllm best tg / transformers tg: {best / d['tg']:.2f}x"]
    if "batch" in res:
        bs = list(res["batch"]["inplace"])
        lines += ["", f"Batched decode (streaming stores full at capacity {args.batch_capacity}, every step evicts; "
                  f"{args.batch_steps} steps, CUDA graph): tokens/s of all sequences", "",
                  "| update | " + " | ".join(f"B={b}" for b in bs) + " |", "|---|" + "---|" * len(bs)]
        for update, rows in res["batch"].items():
            lines.append(f"| {update} | " + " | ".join(f"{rows[b]['tok_s']:.0f}" for b in bs) + " |")
        lines.append("| in place / shift | " + " | ".join(
            f"{res['batch']['inplace'][b]['tok_s'] / res['batch']['shift'][b]['tok_s']:.2f}x" for b in bs) + " |")
    if "stream" in res:
        mode = "all at once, one thread and engine each" if args.stream_concurrent else "one after another"
        lines += ["", f"Long streams ({mode}): {args.stream} tokens per policy (CUDA graph decode); "
                  f"transformers' shift-and-append stream: {args.hf_stream} tokens. 'filled': the thousand tokens "
                  "after the store filled; flat = last / filled p50", "",
                  "| capacity | engine / policy | tok/s | first 1k p50 / p99 ms | filled 1k p50 / p99 ms | "
                  "last 1k p50 / p99 ms | flat | last / 10k p50 | evicted |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for cap, rows in res["stream"].items():
            if cap == "errors":
                lines += [f"| | failed: {e} | | | | | | | |" for e in rows]
                continue
            for pol, r in rows.items():
                filled = f"{r['filled_p50_ms']:.3f} / {r['filled_p99_ms']:.3f}" if "flat" in r else ""
                flat = f"{r['flat']:.3f}" if "flat" in r else ""
                flat10k = f"{r['flat_from_10k']:.3f}" if "flat_from_10k" in r else ""
                lines.append(f"| {cap} | ringllm {pol} | {r['tok_s']:.0f} | {r['first_p50_ms']:.3f} / "
                             f"{r['first_p99_ms']:.3f} | {filled} | {r['last_p50_ms']:.3f} / {r['last_p99_ms']:.3f} | "
                             f"{flat} | {flat10k} | {r['evicted']} |")
            r = res.get("transformers", {}).get(f"shift_append_{cap}")
            if r and "error" in r:
                lines.append(f"| {cap} | transformers shift-and-append | {r['error']} | | | | | | |")
            elif r:
                lines.append(f"| {cap} | transformers shift-and-append | {r['tok_s']:.0f} | {r['first_p50_ms']:.3f} / "
                             f"{r['first_p99_ms']:.3f} | | {r['last_p50_ms']:.3f} / {r['last_p99_ms']:.3f} | | | "
                             f"{r['n_tokens']} |")
    md = "\n".join(lines) + "\n"
    print(md)
    write_results(args.name, res, md)


if __name__ == "__main__":
    main()
