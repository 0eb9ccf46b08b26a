"""Machine instructions of the weight-tile kernels' loops, for the CPU Numba compiles for.

    python bench/inner_loop_asm.py [q4_0 q4_1 q4_k q8_0 q6_k ...]

Compiles each `runtime/quant_tiles.py` tile kernel (uncached) for the host target and prints, per
loop of its assembly that holds vector multiply-adds (a label that a later branch jumps back to),
the number of instructions from the label to that branch and the multiply-adds among them, and
their ratio per multiply-added float lane (8 per x86 ymm FMA, 4 per NEON fmla): the instructions
each weight x activation product costs in that loop. Run it on
x86 and under aarch64 emulation (scripts/test_aarch64.sh's interpreter; NUMBA_CPU_NAME=cortex-a76
for a Raspberry Pi 5's core) to compare the two lowerings of the same IR (docs/edge.md, "NEON
shape"). Counts are static: how many times each loop runs per block depends on the type's layout.
"""
from __future__ import annotations

import re
import sys

TYPES = ("q4_0", "q4_1", "q4_k", "q8_0", "q6_k")
FMA = re.compile(r"^\s*(vfmadd\w*|fmla|fmadd)\b")
BRANCH = re.compile(r"^\s*(j\w+|b\.\w+|b|cbnz|cbz|tbnz|tbz)\s+(\.?L\w+|\.LBB\w+)")


def asm_of(kind: str) -> str:
    from numba import njit, types

    from ringllm.runtime import quant_tiles

    f32, u8, i64 = types.float32[::1], types.uint8[::1], types.int64
    sig = (f32, i64, u8, i64, i64, f32) if kind == "q8_0" else (f32, i64, u8, i64, i64, f32, f32)
    fn = njit(nogil=True)(getattr(quant_tiles, f"tile_{kind}").py_func)
    fn.compile(sig)
    return fn.inspect_asm(sig)


def loops(asm: str) -> list[tuple[str, int, int]]:
    """[(label, instructions, multiply-adds)] of every backward branch's loop, shortest first."""
    lines = [ln for ln in asm.splitlines() if ln.strip() and not ln.strip().startswith((".", "#", "//", ";"))
             or re.match(r"^\.?L\w+:", ln.strip())]
    where = {}
    out = []
    for i, ln in enumerate(lines):
        m = re.match(r"^(\.?L\w+):", ln.strip())
        if m:
            where[m.group(1)] = i
            continue
        b = BRANCH.match(ln)
        if b and b.group(2) in where:
            body = [x for x in lines[where[b.group(2)] + 1:i + 1] if not re.match(r"^\.?L\w+:", x.strip())]
            out.append((b.group(2), len(body), sum(bool(FMA.match(x)) for x in body)))
    return sorted(out, key=lambda t: t[1])


def main(argv=None) -> None:
    import platform

    import llvmlite.binding as llvm

    kinds = (argv if argv is not None else sys.argv[1:]) or list(TYPES)
    import numba

    print(f"# {platform.machine()}, LLVM target CPU {numba.config.CPU_NAME or llvm.get_host_cpu_name()}")
    lanes = 4 if platform.machine() in ("aarch64", "arm64") else 8
    for kind in kinds:
        found = [(n, f) for _, n, f in loops(asm_of(kind)) if f]
        text = ", ".join(f"{n} instr / {f} FMA = {n / (f * lanes):.2f} per lane" for n, f in found) or "no FMA loop"
        print(f"tile_{kind}: {text}")


if __name__ == "__main__":
    main()
