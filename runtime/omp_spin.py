"""How long Numba's OpenMP threads spin before they sleep: GOMP_SPINCOUNT set as a time.

libgomp keeps a thread that has finished its share of a parallel kernel polling for GOMP_SPINCOUNT
iterations, a `pause` instruction each on x86, before it sleeps on a futex. A kernel that finds the
other threads asleep wakes them through the OS (and, in a VM, the hypervisor), which costs more
than most kernels of a decode step take. A step runs a few parallel kernels per layer with Python
between them (argument checks, slicing, the next dispatch): gaps of a few to a few tens of
microseconds. So the spin should outlast those gaps, and little more: while a thread spins it holds
a core, and beside a busy process the thread that has work then waits for it (libgomp's default of
300,000 iterations made a decode step beside one busy process several times slower).

So the spin is a time, SPIN_SECONDS. An iteration lasts as long as the CPU's `pause`, and that
differs several-fold between x86 cores, so one fixed count spins long enough on one CPU and too
briefly on another. The first process on a CPU times `pause` with a compiled loop (calibrate(),
at CPUEngine construction, before any parallel kernel has loaded libgomp) and records it in the
user's cache (record_path(), keyed by the CPU's model name). Every later process reads the record
at import (choose_at_import(), from ringllm.runtime's __init__) and sets GOMP_SPINCOUNT =
SPIN_SECONDS / pause. Without a record (before the first calibration, on a CPU other than x86, where
libgomp's poll has no `pause`, or when the cache cannot be written): DEFAULT_SPIN_COUNT. A
GOMP_SPINCOUNT the user exported wins; ringllm's own choice is marked in RINGLLM_GOMP_SPINCOUNT so
that child processes tell the two apart.
"""
from __future__ import annotations

import json
import math
import os
import platform
import time

import numpy as np
from numba import njit

from ringllm.runtime.atomic_file import write_bytes
from ringllm.runtime.simd import X86, cpu_pause
from ringllm.runtime.user_cache import user_cache_dir

__all__ = ["SPIN_SECONDS", "DEFAULT_SPIN_COUNT", "spin_count_for", "record_path", "cpu_key", "choose_at_import",
           "calibrate", "pause_ns"]

SPIN_SECONDS = 30e-6                # how long a thread polls before it sleeps
DEFAULT_SPIN_COUNT = 1000           # without a measured `pause`
MIN_SPIN_COUNT, MAX_SPIN_COUNT = 100, 100_000
_MARK = "RINGLLM_GOMP_SPINCOUNT"    # the GOMP_SPINCOUNT ringllm chose (not the user)
_calibrated = False                 # this process has looked for (or made) its CPU's record


def spin_count_for(pause_seconds: float) -> int:
    """Iterations of a `pause` lasting pause_seconds that make SPIN_SECONDS, clamped."""
    if not pause_seconds > 0 or not math.isfinite(pause_seconds):
        return DEFAULT_SPIN_COUNT
    return int(min(MAX_SPIN_COUNT, max(MIN_SPIN_COUNT, round(SPIN_SECONDS / pause_seconds))))


def record_path() -> str:
    return user_cache_dir("omp_spin.json")


def cpu_key() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform module knows of it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _records() -> dict:
    """{cpu_key: pause nanoseconds} from record_path(); {} when missing or unreadable."""
    try:
        with open(record_path(), encoding="utf-8") as f:
            records = json.load(f)
    except (OSError, ValueError):
        return {}
    return records if isinstance(records, dict) else {}


def _user_set() -> bool:
    value = os.environ.get("GOMP_SPINCOUNT")
    return value is not None and os.environ.get(_MARK) != value


def _choose(count: int) -> None:
    os.environ["GOMP_SPINCOUNT"] = os.environ[_MARK] = str(count)


def choose_at_import() -> None:
    """GOMP_SPINCOUNT for this process, before libgomp is loaded: from this CPU's record, else the
    default; left alone when the user set it."""
    global _calibrated
    if _user_set():
        return
    ns = _records().get(cpu_key()) if X86 else None
    recorded = isinstance(ns, (int, float))
    _calibrated = recorded              # calibrate() has nothing left to do (nor to read again)
    _choose(spin_count_for(ns * 1e-9) if recorded else DEFAULT_SPIN_COUNT)


@njit(cache=True, nogil=True, fastmath=False)
def _pause_loop(n):
    for _ in range(n):
        cpu_pause()


def pause_ns(iterations: int = 20_000, repeats: int = 5) -> float:
    """One `pause` on this CPU in nanoseconds: the best of `repeats` timed loops (x86 only)."""
    _pause_loop(np.int64(16))
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        _pause_loop(np.int64(iterations))
        best = min(best, time.perf_counter() - t0)
    return best / iterations * 1e9


def _omp_loaded() -> bool:
    """Whether this process has started Numba's threading layer (libgomp read its settings then)."""
    from numba.np.ufunc import parallel
    return bool(getattr(parallel, "_is_initialized", True))


def calibrate() -> None:
    """Once per process: where this CPU has no record, time `pause` (a few milliseconds) and record it
    (atomically; a cache that cannot be written keeps the default, silently: the spin is a speed
    setting, not a result); the next processes read it at import. This process's own
    GOMP_SPINCOUNT follows when libgomp has not been loaded yet. Nothing when the user set
    GOMP_SPINCOUNT, or off x86."""
    global _calibrated
    if _calibrated:
        return
    _calibrated = True
    if _user_set() or not X86:
        return
    records, key = _records(), cpu_key()
    if isinstance(records.get(key), (int, float)):
        return
    ns = round(pause_ns(), 3)       # as recorded: this process's count is the one later processes read
    records[key] = ns
    try:
        os.makedirs(os.path.dirname(record_path()), exist_ok=True)
        write_bytes(record_path(), json.dumps(records, indent=1, sort_keys=True))
    except OSError:
        pass
    if not _omp_loaded():
        _choose(spin_count_for(ns * 1e-9))
