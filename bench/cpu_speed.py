"""Decode (tg) and prefill (pp) tokens/s of the ringllm CPU engine beside llama.cpp, one run, same GGUF and threads.

    python bench/cpu_speed.py [-m MODEL] [-t THREADS] [--tg 128] [--pp 512]
    python bench/cpu_speed.py --synthetic llama-3.2-1b|qwen3-1.7b|all [--repeats 5]

ringllm runs in both precisions: "f32" (exact activations, the default) and "q8" (8-bit activations
as llama.cpp; rows ringllm-q8).

Prints and writes bench/results/cpu_speed.{json,md} (`--name`): tokens/s, the ratio to llama.cpp, and
achieved GB/s of weights (weight bytes read per decoded token x tokens/s) against the machine's read
bandwidth.

--synthetic runs the files of bench/synthetic_gguf.py (random weights in the exact shapes and Q4_K_M
layout of real models; written once to a cache directory) and writes cpu_speed_synthetic.{json,md}.
There each engine runs in a process of its own (a worker driven over a pipe), so each one's peak
RSS is its own, and the measurements alternate between the two engines (tg then pp, engine order
flipped every repeat) so that noise from other load on the machine falls on both; before each measurement the
driver waits (up to --quiet-wait seconds) for the machine's other jobs to leave the cores idle; the
tables give the best of the repeats (the least disturbed) and the median.

tg: feed 8 prompt tokens, then time n_tg decode steps, each feeding the argmax of the last logits.
pp: time one n_pp-token prompt into an empty cache (ringllm: chunks of 512 rows; llama.cpp: n_batch 512).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import llama_cpp_last_logits, llama_cpp_model, machine, wait_for_quiet_cpu, write_results  # noqa: E402

ENGINES = ("ringllm", "ringllm-q8", "llama.cpp")     # ringllm-q8: CPUEngine(precision="q8")


class RingllmRunner:
    """One ringllm CPUEngine on a file: pp() and tg() each time one measurement and return tokens/s."""

    def __init__(self, path, threads, n_tg, n_pp, precision="f32"):
        from ringllm.models.loader import load_model
        from ringllm.runtime.engine import CPUEngine

        self.n_tg, self.n_pp = n_tg, n_pp
        self.model = m = load_model(path, tokenizer=False)
        self.eng = CPUEngine(m.spec, m.tensors, n_threads=threads, n_batch=min(512, n_pp), precision=precision)
        self.prompt = np.random.default_rng(0).integers(100, 5000, n_pp).tolist()
        self.eng.prefill(self.prompt[:16], self._store())          # warm-up: JIT from cache, page in weights

    def _store(self):
        return self.eng.new_store(capacity=self.n_pp + self.n_tg + 8, policy="full")

    def pp(self) -> float:
        st = self._store()
        t0 = time.perf_counter()
        self.eng.prefill(self.prompt, st)
        return self.n_pp / (time.perf_counter() - t0)

    def tg(self) -> float:
        st = self._store()
        logits = self.eng.prefill(self.prompt[:8], st)
        t0 = time.perf_counter()
        for _ in range(self.n_tg):
            logits = self.eng.step(int(np.argmax(logits)), st)
        return self.n_tg / (time.perf_counter() - t0)

    def info(self) -> dict:
        m = self.model
        return {"weight_bytes": m.weight_bytes, "decode_bytes": decode_bytes(m),
                "packed_bytes": sum(pm.nbytes for pm in self.eng.mats.values())}


class LlamaCppRunner:
    """llama-cpp-python's Llama on a file (default context parameters, n_batch 512), same protocol."""

    def __init__(self, path, threads, n_tg, n_pp):
        self.n_tg, self.n_pp = n_tg, n_pp
        self.llm = llama_cpp_model(path, n_ctx=n_pp + n_tg + 8, n_threads=threads)
        if self.llm is None:
            raise RuntimeError("llama-cpp-python is not installed (pip install -e '.[bench]')")
        self.prompt = np.random.default_rng(0).integers(100, 5000, n_pp).tolist()
        self.llm.eval(self.prompt[:16])

    def pp(self) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(self.prompt)
        return self.n_pp / (time.perf_counter() - t0)

    def tg(self) -> float:
        self.llm.reset()
        self.llm.eval(self.prompt[:8])
        t0 = time.perf_counter()
        for _ in range(self.n_tg):
            self.llm.eval([int(np.argmax(llama_cpp_last_logits(self.llm)))])
        return self.n_tg / (time.perf_counter() - t0)

    def info(self) -> dict:
        return {}


RUNNERS = {"ringllm": RingllmRunner, "llama.cpp": LlamaCppRunner,
           "ringllm-q8": lambda path, threads, n_tg, n_pp: RingllmRunner(path, threads, n_tg, n_pp, "q8")}


def decode_bytes(m) -> int:
    """Weight bytes read per decoded token: every matrix once, the embedding row negligible (tied head: whole)."""
    total = sum(t.nbytes for n, t in m.tensors.items() if n != "token_embd.weight")
    if m.spec.tied_output:
        total += m.tensors["token_embd.weight"].nbytes
    return total


def rss() -> dict:
    """This process's memory from /proc/self/status, MB: peak (VmHWM), now (VmRSS), anonymous and
    file-backed (mapped weight files) parts of now."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, val = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(val.split()[0]) / 1024
    return out


def worker(engine, path, threads, n_tg, n_pp):
    """Serve one engine over stdin/stdout, one JSON line per command: "pp" / "tg" -> tokens/s,
    "info" -> sizes and RSS, "quit". The first line reports the load (or the error that stopped it)."""
    t0 = time.perf_counter()
    try:
        runner = RUNNERS[engine](path, threads, n_tg, n_pp)
    except Exception as exc:     # reported to the driver, which goes on with the other engine
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return
    print(json.dumps({"load_s": time.perf_counter() - t0}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            return
        if cmd in ("pp", "tg"):
            print(json.dumps({cmd: getattr(runner, cmd)()}), flush=True)
        else:
            print(json.dumps({**runner.info(), "rss_mb": rss()}), flush=True)


class Worker:
    """Driver side of a worker process."""

    def __init__(self, engine, path, args):
        self.engine = engine
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", engine, "-m", path, "-t", str(args.threads),
             "--tg", str(args.tg), "--pp", str(args.pp)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            return {"error": f"{self.engine} worker exited with code {self.proc.wait()}"}
        return json.loads(line)

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        self.proc.wait()


def bench_shape(shape, args) -> dict:
    """Both engines on one synthetic shape, interleaved; returns the shape's result record."""
    from synthetic_gguf import SHAPES, synthetic_path

    path = synthetic_path(shape)
    workers = {}
    for e in ENGINES:         # loaded one after the other: neither load competes with the other
        w = Worker(e, path, args)
        if "error" in w.hello:
            print(f"[{shape}] {e}: {w.hello['error']}", file=sys.stderr)
            w.close()
        else:
            workers[e] = w
    runs = {e: {"tg": [], "pp": []} for e in workers}
    waited = 0.0
    for r in range(args.repeats):
        order = list(workers) if r % 2 == 0 else list(workers)[::-1]
        for kind in ("tg", "pp"):
            for e in order:
                time.sleep(0.3)       # let the other engine's spinning threads go idle
                waited += wait_for_quiet_cpu(args.quiet_wait)
                runs[e][kind].append(workers[e].ask(kind)[kind])
        print(f"[{shape}] repeat {r + 1}/{args.repeats}: " + ", ".join(
            f"{e} tg {runs[e]['tg'][-1]:.1f} pp {runs[e]['pp'][-1]:.1f}" for e in workers), file=sys.stderr)
    out = {"file": os.path.basename(path), "file_bytes": os.path.getsize(path), "shape": vars(SHAPES[shape]),
           "waited_for_quiet_s": waited}
    for e, w in workers.items():
        info = w.ask("info")
        w.close()
        rec = {"load_s": w.hello["load_s"], "rss_mb": info.pop("rss_mb"), **info, "runs": runs[e]}
        for kind in ("tg", "pp"):
            rec[kind] = float(np.max(runs[e][kind]))
            rec[kind + "_median"] = float(np.median(runs[e][kind]))
        out[e] = rec
    for e in ENGINES:
        if e not in out:
            out[e] = None
    rg, lc = out["ringllm"], out["llama.cpp"]
    if rg is not None:
        out["decode_bytes"] = rg["decode_bytes"]
        for e in workers:
            out[e]["decode_gbs"] = rg["decode_bytes"] * out[e]["tg"] / 1e9
    out["ratio_tg"] = rg["tg"] / lc["tg"] if rg and lc else None
    out["ratio_pp"] = rg["pp"] / lc["pp"] if rg and lc else None
    q8 = out["ringllm-q8"]
    out["ratio_tg_q8"] = q8["tg"] / lc["tg"] if q8 and lc else None
    out["ratio_pp_q8"] = q8["pp"] / lc["pp"] if q8 and lc else None
    return out


def synthetic_markdown(res: dict, args, command: str) -> str:
    mc = res["machine"]
    md = [f"# CPU speed on synthetic Q4_K_M files, {args.threads} threads\n",
          f"Machine: {mc['cpu']}, {mc['cores']} cores, llama-cpp-python {mc.get('llama_cpp_python', '-')}, "
          f"commit {mc.get('commit', '-')}.\n",
          f"Command: `{command}`\n",
          "Random weights in the exact shapes and Q4_K_M tensor types of the real models (bench/synthetic_gguf.py); "
          f"each engine in its own process, measurements alternating between them; best of {args.repeats} "
          "(median in brackets). GB/s: weight bytes of the file read per decoded token x tg tokens/s. "
          "RSS: peak (VmHWM) of the engine's process, and its anonymous part at the end (the rest is the "
          "memory-mapped file).\n"]
    for shape, r in res["shapes"].items():
        md.append(f"## {shape} ({r['file_bytes'] / 1e6:.0f} MB file"
                  + (f", {r['decode_bytes'] / 1e6:.0f} MB of weights per decoded token)\n" if r.get("decode_bytes")
                     else ")\n"))
        md += [f"| engine | tg{args.tg} tok/s | pp{args.pp} tok/s | decode GB/s | peak RSS MB | anon RSS MB |",
               "|---|---|---|---|---|---|"]
        for e in ENGINES:
            x = r[e]
            if x is None:
                md.append(f"| {e} | failed to load | | | | |")
                continue
            gbs = f"{x['decode_gbs']:.1f}" if "decode_gbs" in x else "-"
            md.append(f"| {e} | {x['tg']:.1f} ({x['tg_median']:.1f}) | {x['pp']:.1f} ({x['pp_median']:.1f}) | {gbs} | "
                      f"{x['rss_mb']['VmHWM']:.0f} | {x['rss_mb']['RssAnon']:.0f} |")
        if r["ratio_tg"] is not None:
            md.append(f"\nringllm / llama.cpp: decode {r['ratio_tg']:.2f}x, prefill {r['ratio_pp']:.2f}x")
        if r.get("ratio_tg_q8") is not None:
            md.append(f"ringllm-q8 / llama.cpp: decode {r['ratio_tg_q8']:.2f}x, prefill {r['ratio_pp_q8']:.2f}x\n")
    return "\n".join(md) + "\n"


def run_synthetic(args):
    from synthetic_gguf import SHAPES

    shapes = sorted(SHAPES) if args.synthetic == "all" else [args.synthetic]
    command = "python bench/cpu_speed.py " + " ".join(sys.argv[1:])
    res = {"command": command, "threads": args.threads, "tg_tokens": args.tg, "pp_tokens": args.pp,
           "repeats": args.repeats, "machine": machine(), "shapes": {}}
    for shape in shapes:
        res["shapes"][shape] = bench_shape(shape, args)
    text = synthetic_markdown(res, args, command)
    print(text)
    write_results(args.name or "cpu_speed_synthetic", res, text)


def bench_llama_bench(binary, path, threads, n_tg, n_pp, repeats):
    """llama.cpp's own llama-bench binary (pure C, no Python in the loop), when a path is given."""
    if not binary:
        return None
    out = subprocess.run([binary, "-m", path, "-t", str(threads), "-p", str(n_pp), "-n", str(n_tg), "-r", str(repeats),
                          "-o", "json"], capture_output=True, text=True, check=True).stdout
    res = {}
    for row in json.loads(out):
        res["pp" if row["n_prompt"] else "tg"] = float(row["avg_ts"])
    return res


def bench_in_process(runner, repeats) -> dict:
    tg, pp = [], []
    for _ in range(repeats):
        pp.append(runner.pp())
        tg.append(runner.tg())
    return {"tg": float(np.median(tg)), "pp": float(np.median(pp)), **runner.info()}


def run_model(args):
    from ringllm.models.bundled import default_model_path
    path = args.model or default_model_path()
    ours = bench_in_process(RingllmRunner(path, args.threads, args.tg, args.pp), args.repeats)
    q8 = bench_in_process(RingllmRunner(path, args.threads, args.tg, args.pp, "q8"), args.repeats)
    try:
        anchor = bench_in_process(LlamaCppRunner(path, args.threads, args.tg, args.pp), args.repeats)
    except RuntimeError:
        anchor = None
    lb = bench_llama_bench(args.llama_bench, path, args.threads, args.tg, args.pp, args.repeats)
    gbs = ours["decode_bytes"] * ours["tg"] / 1e9
    rows = [("ringllm (Numba), precision f32", ours["tg"], ours["pp"], gbs),
            ("ringllm (Numba), precision q8", q8["tg"], q8["pp"], ours["decode_bytes"] * q8["tg"] / 1e9)]
    if anchor:
        rows.append(("llama.cpp (llama-cpp-python, Python loop like ours)", anchor["tg"], anchor["pp"],
                     ours["decode_bytes"] * anchor["tg"] / 1e9))
    if lb:
        rows.append(("llama.cpp (llama-bench, C)", lb["tg"], lb["pp"], ours["decode_bytes"] * lb["tg"] / 1e9))
    payload = {"model": os.path.basename(path), "threads": args.threads, "tg_tokens": args.tg, "pp_tokens": args.pp,
               "ringllm": ours, "ringllm_q8": q8, "llama_cpp": anchor, "llama_bench": lb, "machine": machine(),
               "ratio_tg": ours["tg"] / anchor["tg"] if anchor else None,
               "ratio_pp": ours["pp"] / anchor["pp"] if anchor else None,
               "ratio_tg_q8": q8["tg"] / anchor["tg"] if anchor else None,
               "ratio_pp_q8": q8["pp"] / anchor["pp"] if anchor else None}
    md = [f"# CPU speed: {os.path.basename(path)}, {args.threads} threads\n",
          f"Command: `python bench/cpu_speed.py{' -m ' + args.model if args.model else ''} -t {args.threads} --tg "
          f"{args.tg} --pp {args.pp} --repeats {args.repeats}{' --name ' + args.name if args.name else ''}`\n",
          f"Machine: {payload['machine']['cpu']}, {payload['machine']['cores']} cores; medians of {args.repeats} runs.\n",
          f"Weight bytes read per decoded token: {ours['decode_bytes'] / 1e6:.1f} MB.\n",
          f"| engine | tg{args.tg} tok/s | pp{args.pp} tok/s | decode GB/s of weights |", "|---|---|---|---|"]
    md += [f"| {n} | {tg:.1f} | {pp:.1f} | {g:.2f} |" for n, tg, pp, g in rows]
    if anchor:
        md.append(f"\nringllm / llama.cpp (llama-cpp-python): f32 decode {payload['ratio_tg']:.2f}x, prefill "
                  f"{payload['ratio_pp']:.2f}x; q8 decode {payload['ratio_tg_q8']:.2f}x, prefill {payload['ratio_pp_q8']:.2f}x")
    if lb:
        md.append(f"ringllm / llama-bench: decode {ours['tg'] / lb['tg']:.2f}x, prefill {ours['pp'] / lb['pp']:.2f}x\n")
    text = "\n".join(md) + "\n"
    print(text)
    write_results(args.name or "cpu_speed", payload, text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default=None, help="results file name (default cpu_speed / cpu_speed_synthetic)")
    ap.add_argument("--synthetic", default=None, help="a bench/synthetic_gguf.py shape, or 'all'")
    ap.add_argument("--quiet-wait", type=float, default=30.0,
                    help="--synthetic: before each measurement, wait up to this many seconds for other jobs to "
                         "leave the cores idle")
    ap.add_argument("--worker", default=None, choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"),
                    help="path of a llama-bench binary built from llama.cpp (optional second anchor)")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.model, args.threads, args.tg, args.pp)
    elif args.synthetic:
        run_synthetic(args)
    else:
        run_model(args)


if __name__ == "__main__":
    main()
