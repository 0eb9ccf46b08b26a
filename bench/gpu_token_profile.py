"""Where one decoded token's GPU time goes: each kernel's duration, read by Nsight Compute.

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \\
        python3 bench/gpu_token_profile.py step MODEL > token.csv      # on the GPU machine
    python bench/gpu_token_profile.py table token.csv [--name NAME]     # anywhere: the summary

`step` loads MODEL on the CUDA backend (plain launches, policy full, capacity 64), prefills 8
tokens, decodes 3 and profiles the fourth between cuProfilerStart and cuProfilerStop, so ncu times
exactly one token's kernels. `table` groups the CSV's rows by kernel and launch shape and writes
bench/results/NAME.md with each group's count, total and mean microseconds and share of the token.
ncu serialises the launches, so the sum is kernel time alone, without launch gaps; by default it also
flushes the caches before each kernel, so a kernel that reads what the one before it wrote reads it
from memory, not from L2.
"""
from __future__ import annotations

import argparse
import collections
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def step(model: str) -> None:
    import ctypes

    from ringllm.models.loader import load_model
    from ringllm.native import CUDAEngine

    m = load_model(model, tokenizer=False)
    eng = CUDAEngine(m.spec, m.tensors, cuda_graph=False)
    st = eng.new_store(capacity=64, policy="full")
    eng.prefill(list(range(100, 108)), st)
    tok = eng.pick()
    for _ in range(3):
        tok = eng.decode(tok, st)
    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuProfilerStart()
    eng.decode(tok, st)
    cu.cuProfilerStop()


UNITS_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def kernel_times(path: str) -> list[tuple[str, str, float]]:
    """(kernel name without its argument list, grid, microseconds) per profiled launch, in order."""
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    head, data = rows[0], rows[1:]
    k, g, v, u = (head.index(c) for c in ("Kernel Name", "Grid Size", "Metric Value", "Metric Unit"))
    return [(r[k].replace("(int)", "").split("(")[0].replace("<unnamed>::", ""), r[g],
             float(r[v].replace(",", "")) * UNITS_US[r[u]]) for r in data if r[v]]


def table(path: str, name: str) -> str:
    launches = kernel_times(path)
    total = sum(t for _, _, t in launches)
    groups = collections.defaultdict(list)
    for kernel, grid, t in launches:
        groups[(kernel, grid)].append(t)
    lines = [f"# One decoded token's kernels: {os.path.basename(path)}", "",
             f"{len(launches)} launches, {total:.1f} us of kernel time (ncu, gpu__time_duration.sum; launches "
             "serialised, so no launch gaps)", "",
             "| kernel | grid | launches | total us | mean us | share |", "|---|---|---|---|---|---|"]
    for (kernel, grid), ts in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| `{kernel}` | {grid} | {len(ts)} | {sum(ts):.1f} | {sum(ts) / len(ts):.2f} | "
                     f"{sum(ts) / total:.1%} |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(os.path.dirname(__file__), "results", f"{name}.md"), "w") as f:
        f.write(md)
    return md


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("step", help="decode one profiled token (run under ncu)")
    s.add_argument("model")
    t = sub.add_parser("table", help="summarise ncu's CSV")
    t.add_argument("csv")
    t.add_argument("--name", default="gpu_token_profile")
    args = ap.parse_args(argv)
    if args.cmd == "step":
        step(args.model)
    else:
        print(table(args.csv, args.name))


if __name__ == "__main__":
    main()
