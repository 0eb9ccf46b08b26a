"""Where CI's time goes: a cold run of the test suite (empty kernel cache, as CI runs it) against a warm
rerun of the same suite on the cache the cold run filled. A test's cold duration minus its warm one is
about what it spent compiling kernels that no earlier test had compiled.

    PYTEST_ADDOPTS=--durations=0 bash .ci/run > cold.log 2>&1          # a clean clone, empty caches
    python -m pytest -q --durations=0 > warm.log 2>&1                   # then again, same clone and caches
    python bench/ci_time.py cold.log warm.log [--name ci_time]

Reads the two logs' duration lines (pytest's --durations=0; the cold log's aarch64 part, after
"=== aarch64 run", is read apart) and writes bench/results/NAME.{json,md}: per file and per test,
cold and warm seconds, largest compile share first.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, write_results  # noqa: E402

_LINE = re.compile(r"^([\d.]+)s (call|setup|teardown)\s+(\S+)", re.M)
_TOTAL = re.compile(r"^(\d+ passed.*?) in ([\d.]+)s", re.M)


def durations(text: str) -> collections.Counter:
    """test node id -> seconds (setup, call and teardown summed)."""
    out: collections.Counter = collections.Counter()
    for seconds, _, node in _LINE.findall(text):
        out[node] += float(seconds)
    return out


def per_file(tests: collections.Counter) -> collections.Counter:
    out: collections.Counter = collections.Counter()
    for node, seconds in tests.items():
        out[node.split("::")[0]] += seconds
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cold_log")
    ap.add_argument("warm_log")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--name", default="ci_time")
    args = ap.parse_args()
    cold_text = open(args.cold_log, encoding="utf-8", errors="replace").read()
    host_text, _, arm_text = cold_text.partition("=== aarch64 run")
    warm_text = open(args.warm_log, encoding="utf-8", errors="replace").read()
    cold, warm, arm = durations(host_text), durations(warm_text), durations(arm_text)
    totals = {"cold": _TOTAL.findall(host_text), "warm": _TOTAL.findall(warm_text), "aarch64": _TOTAL.findall(arm_text)}
    compile_share = collections.Counter({k: cold[k] - warm.get(k, 0.0) for k in cold})
    files_cold, files_warm = per_file(cold), per_file(warm)
    md = ["# Where CI's time goes: the suite cold (as CI runs it) and warm (the same kernels cached)", "",
          f"`python bench/ci_time.py {' '.join(sys.argv[1:])}` over the logs of the commands in "
          "bench/ci_time.py's docstring.", "", f"Machine: {machine()}", ""]
    for key, found in totals.items():
        if found:
            md.append(f"- {key}: {found[-1][0]} in {float(found[-1][1]):.0f} s")
    md += ["", f"Test durations summed: cold {sum(cold.values()):.0f} s, warm {sum(warm.values()):.0f} s; "
           f"compiling (cold minus warm, tests slower cold) {sum(v for v in compile_share.values() if v > 0):.0f} s.",
           "", "Per file (seconds):", "", "| file | cold | warm | cold - warm |", "|---|---|---|---|"]
    for f, s in files_cold.most_common(args.top):
        md.append(f"| {f} | {s:.0f} | {files_warm.get(f, 0.0):.0f} | {s - files_warm.get(f, 0.0):.0f} |")
    md += ["", f"Tests with the most compiling (cold minus warm), largest {args.top}:", "",
           "| test | cold s | warm s |", "|---|---|---|"]
    for node, s in compile_share.most_common(args.top):
        md.append(f"| `{node}` | {cold[node]:.1f} | {warm.get(node, 0.0):.1f} |")
    md += ["", f"Slowest warm (running, not compiling), largest {args.top}:", "", "| test | warm s |", "|---|---|"]
    md += [f"| `{node}` | {s:.1f} |" for node, s in warm.most_common(args.top)]
    if arm:
        md += ["", f"aarch64 under emulation (the cold log's listed durations; {len(arm)} tests):", "",
               "| test | s |", "|---|---|"]
        md += [f"| `{node}` | {s:.1f} |" for node, s in arm.most_common(args.top)]
    payload = {"machine": machine(), "args": vars(args), "totals": totals, "cold": dict(cold), "warm": dict(warm),
               "aarch64": dict(arm)}
    write_results(args.name, payload, "\n".join(md) + "\n")
    print("\n".join(md[:40]))


if __name__ == "__main__":
    main()
