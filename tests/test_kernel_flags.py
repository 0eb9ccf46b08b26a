"""The kernels behind a same-bits contract state their fastmath flags.

Numba compiles a kernel that leaves `fastmath` unset with the flags of the first kernel that calls it
(and caches that code), so its arithmetic would depend on which caller a process, or the process that
filled the kernel cache, met first. The stored layouts' attention promises the same bits alone, over
the threads and in a batched step (whose key rotation and row writes are the single step's kernels),
and the KV codecs promise gguf's bytes: every kernel of theirs that Numba compiles on its own (not
inline="always", which takes its caller's flags by design) says fastmath=FASTMATH or fastmath=False.
"""
from __future__ import annotations

import ast
import pathlib

import numpy as np
from numba import njit

from ringllm.runtime.attention import sum_in_order

RUNTIME = pathlib.Path(__file__).resolve().parents[1] / "runtime"
SAME_BITS_MODULES = ("attention.py", "stored_attention.py", "stream_attention.py", "kv_codec.py", "kv_tile_math.py",
                     "kv_row_math.py", "kv_basis.py", "fast_exp.py", "rope_kernels.py", "kv_write.py")


def _kernels_without_flags(path: pathlib.Path) -> list[str]:
    """Functions of path decorated with njit(...) / jit(...), not inline="always", without fastmath=."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef):
            continue
        for deco in node.decorator_list:
            if not isinstance(deco, ast.Call):
                continue
            name = getattr(deco.func, "id", getattr(deco.func, "attr", ""))
            if name not in ("njit", "jit"):
                continue
            kw = {k.arg: k.value for k in deco.keywords}
            inline = isinstance(kw.get("inline"), ast.Constant) and kw["inline"].value == "always"
            if not inline and "fastmath" not in kw:
                found.append(f"{path.name}:{node.lineno} {node.name}")
    return found


def test_same_bits_kernels_state_their_fastmath_flags():
    missing = [k for m in SAME_BITS_MODULES for k in _kernels_without_flags(RUNTIME / m)]
    assert not missing, f"kernels that would take their first caller's fastmath flags: {missing}"


def test_a_stated_strict_kernel_stays_strict_under_a_fastmath_caller():
    """What the rule protects: a copy of sum_in_order (its own options, uncached, so compiled here)
    reached first from a kernel of full fastmath is still compiled without reassociation (no addition
    carries a fast-math flag) and gives sum_in_order's bits; a copy that leaves fastmath unset is
    compiled with the caller's flags."""
    options = {k: v for k, v in sum_in_order.targetoptions.items() if k not in ("cache", "nopython")}
    assert options["fastmath"] is False

    def compiled_under_fastmath_caller(opts):
        kernel = njit(cache=False, **opts)(sum_in_order.py_func)

        @njit(cache=False, fastmath=True)
        def caller(x, n):
            return kernel(x, n)

        x = np.linspace(-3.0, 2.0, 77).astype(np.float32)
        total = caller(x, 77)
        adds = [line for ir in kernel.inspect_llvm().values() for line in ir.splitlines() if " fadd " in line]
        return total, adds

    total, adds = compiled_under_fastmath_caller(options)
    assert total == sum_in_order(np.linspace(-3.0, 2.0, 77).astype(np.float32), 77)
    assert adds and not any(flag in line for line in adds for flag in ("fast", "reassoc", "contract"))
    _, adds_unset = compiled_under_fastmath_caller({k: v for k, v in options.items() if k != "fastmath"})
    assert any("reassoc" in line or "fast" in line for line in adds_unset)
