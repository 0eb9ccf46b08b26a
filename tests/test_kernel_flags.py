"""Every ringllm kernel states its fastmath flags.

Numba compiles a kernel that leaves `fastmath` unset with the flags of the first kernel that calls it
(and caches that code), so its arithmetic would depend on which caller a process, or the process that
filled the kernel cache, met first: the stored layouts' attention once gave different last bits alone
and over the threads that way, and a key's RoPE rotation used fused multiply-adds or not by whether
the batched step or the single step compiled it first. So every kernel Numba compiles on its own (not
inline="always", which takes its caller's flags by design) says fastmath=FASTMATH (numba_flags) or
fastmath=False: in the source, and for the kernels built at import from templates and copies.
"""
from __future__ import annotations

import ast
import importlib
import pathlib
import pkgutil
import sys

import numpy as np
from numba import njit
from numba.core.registry import CPUDispatcher

import ringllm.runtime
from ringllm.runtime.attention import sum_in_order

RUNTIME = pathlib.Path(ringllm.runtime.__file__).resolve().parent


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
                found.append(f"{path.relative_to(RUNTIME)}:{node.lineno} {node.name}")
    return found


def test_every_kernel_in_the_source_states_its_fastmath_flags():
    missing = [k for path in sorted(RUNTIME.rglob("*.py")) for k in _kernels_without_flags(path)]
    assert not missing, f"kernels that would take their first caller's fastmath flags: {missing}"


def test_every_kernel_built_at_import_states_its_fastmath_flags():
    """The kernels in the runtime's modules once imported, those built from templates included."""
    for info in pkgutil.walk_packages(ringllm.runtime.__path__, "ringllm.runtime."):
        importlib.import_module(info.name)
    kernels, missing = 0, []
    for name, module in list(sys.modules.items()):
        if not name.startswith("ringllm.") or module is None:
            continue
        for obj in list(vars(module).values()):
            if isinstance(obj, CPUDispatcher) and obj.__module__ == name:
                kernels += 1
                options = obj.targetoptions
                if options.get("inline") != "always" and "fastmath" not in options:
                    missing.append(f"{name}.{obj.py_func.__name__}")
    assert kernels > 300 and not missing, missing


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
