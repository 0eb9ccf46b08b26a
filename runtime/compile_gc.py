"""Fewer cyclic-collector passes while Numba compiles.

A compile builds Numba's IR, type annotations and LLVM modules: container objects by the hundred
thousand, all alive until the compile ends. CPython's collector starts a pass over the youngest
generation every 700 net allocations and walks the survivors again in its older generations,
whole-heap passes included, each of which walks every long-lived object of the process (Numba's
registries, the loaded model's tables): passes that find almost nothing to free while the compile
runs.

While the outermost compile of the process runs (Numba's "numba:compile" event; compiles hold
Numba's compiler lock, so they do not overlap), the youngest generation's threshold is COMPILE_GEN0
instead of the process's: ten times fewer young passes, and with them fewer older and whole-heap
ones. The collector still runs, so a compile's garbage is freed as before, only later (a cold
start's peak memory grows by what waits). The process's thresholds are put back when the compile
ends; a threshold the process set itself to COMPILE_GEN0 or more, or a collector turned off, is left
alone. `install()` (runtime/__init__.py) registers the listener, once.
"""
from __future__ import annotations

import gc
import threading

from numba.core import event

__all__ = ["COMPILE_GEN0", "install"]

COMPILE_GEN0 = 7000      # the youngest generation's threshold during a compile (CPython's default: 700)

_lock = threading.Lock()
_state = {"depth": 0, "saved": None, "installed": False}


class _Listener(event.Listener):
    """Raises the youngest generation's threshold for the outermost compile, restores it after."""

    def on_start(self, ev):
        with _lock:
            _state["depth"] += 1
            if _state["depth"] == 1:
                saved = gc.get_threshold()
                if gc.isenabled() and 0 < saved[0] < COMPILE_GEN0:
                    _state["saved"] = saved
                    gc.set_threshold(COMPILE_GEN0, *saved[1:])

    def on_end(self, ev):
        with _lock:
            _state["depth"] -= 1
            if _state["depth"] == 0 and _state["saved"] is not None:
                gc.set_threshold(*_state["saved"])
                _state["saved"] = None


def install() -> None:
    """Register the listener on Numba's compile event (once per process)."""
    with _lock:
        if not _state["installed"]:
            _state["installed"] = True
            event.register("numba:compile", _Listener())
