"""Numba's extension entry points are not scanned for a call of one of ringllm's kernels.

Before the first call of a dispatcher with new argument types (compiling or loading it from the
cache), Numba runs `_compilation_chain_init_hook`, which initialises the `numba_extensions` entry
points of every installed distribution once per process (numba.core.entrypoints.init_all): it
lists the entry points of every package in the environment, a scan whose cost grows with the
number of packages installed, paid by every process at its first kernel call. ringllm's kernels
take NumPy arrays, scalars and tuples of them and call no extension's functions, so the scan serves
them nothing.

install() makes the hook skip the scan for the dispatchers of ringllm's own modules. Every other
dispatcher (an embedding application's kernels) still runs it before its first compile, and the
scan still happens once: a ringllm kernel's call does not mark it done. A compile scans anyway (the
lowering registries' first load, numba.core.cpu, runs the same initialisation), so what is skipped is
the scan of a process that only loads cached kernels.
"""
from __future__ import annotations

__all__ = ["install"]

_PACKAGE = "ringllm."


def install() -> bool:
    """Install the hook (module docstring); False, and nothing changed, where Numba's hook is not the
    single call of entrypoints.init_all this narrows."""
    from numba.core import dispatcher

    base = dispatcher._DispatcherBase
    numba_hook = base.__dict__.get("_compilation_chain_init_hook")
    if numba_hook is None or getattr(numba_hook, "_ringllm", False) or \
            numba_hook.__code__.co_names != ("entrypoints", "init_all"):
        return False

    def _compilation_chain_init_hook(self):
        if not getattr(self.py_func, "__module__", "").startswith(_PACKAGE):
            numba_hook(self)

    _compilation_chain_init_hook._ringllm = True
    _compilation_chain_init_hook.__doc__ = numba_hook.__doc__
    base._compilation_chain_init_hook = _compilation_chain_init_hook
    return True
