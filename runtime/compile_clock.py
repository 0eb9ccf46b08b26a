"""Time spent compiling kernels, told apart from the work they do.

Numba compiles a kernel the first time it meets a new signature (a cache miss: nothing for this CPU
and these argument types in the on-disk cache). That pause lands inside whatever call needed the
kernel; a prompt's speed measured across it reports the compiler, not the engine. This module keeps
one process-wide count of compile seconds, fed by Numba's own "numba:compile" event (it fires for
real compiles only, never for kernels loaded from the cache), so callers can take the compile time
of a span out of its wall time:

    with CompileSpan() as span:
        run()
    span.seconds, span.signatures       # compile time inside run(), and how many signatures

A compile that compiles others (a kernel calling kernels not compiled yet) counts once: only the
outermost compile of each thread is timed.

The first compile of the process also prints one notice on stderr (unless `quiet()` turned it off),
so a first run explains its pause instead of sitting silent; `expect(seconds)` lets the caller
that knows what is about to compile put an estimate in it.
"""
from __future__ import annotations

import sys
import threading
import time

from numba.core import event

_lock = threading.Lock()
_local = threading.local()
_total = {"seconds": 0.0, "signatures": 0}
_notice = {"printed": False, "quiet": False, "estimate": None, "cache_dir": None}


class _Listener(event.Listener):
    """Sums the outermost compile of each thread; prints the first-compile notice once."""

    def on_start(self, ev):
        depth = getattr(_local, "depth", 0)
        _local.depth = depth + 1
        if depth == 0:
            _local.start = time.perf_counter()
            _first_compile_notice()

    def on_end(self, ev):
        _local.depth -= 1
        if _local.depth == 0:
            dt = time.perf_counter() - _local.start
            with _lock:
                _total["seconds"] += dt
                _total["signatures"] += 1


def _first_compile_notice() -> None:
    with _lock:
        if _notice["printed"] or _notice["quiet"]:
            return
        _notice["printed"] = True
    est = _notice["estimate"]
    about = f" (about {est:.0f} s on a 2-core machine)" if est else ""
    where = f" in {_notice['cache_dir']}" if _notice["cache_dir"] else ""
    text = (f"ringllm: compiling kernels for this CPU, once{about}; they are cached{where} for later runs "
            "(`ringllm warmup` compiles them ahead of time)")
    try:                      # a progress bar on stderr steps aside for the line, then redraws below it
        from tqdm import tqdm
        with tqdm.external_write_mode(file=sys.stderr):
            print(text, file=sys.stderr, flush=True)
    except ImportError:
        print(text, file=sys.stderr, flush=True)


def count_wait(seconds: float) -> None:
    """Count seconds this thread spent waiting for another process to compile a kernel it needs
    (runtime/compile_share.py) as compile time, unless the wait happened inside a compile of its
    own (whose time already includes it)."""
    if getattr(_local, "depth", 0) == 0:
        with _lock:
            _total["seconds"] += seconds


def totals() -> tuple[float, int]:
    """(seconds, signatures) compiled by this process so far."""
    with _lock:
        return _total["seconds"], _total["signatures"]


def quiet(flag: bool = True) -> None:
    """Turn the first-compile notice off (or back on)."""
    _notice["quiet"] = bool(flag)


def expect(seconds: float | None) -> None:
    """The estimate the first-compile notice will quote (None: no estimate)."""
    _notice["estimate"] = seconds


def set_cache_dir(path: str | None) -> None:
    """The directory the notice names as the kernel cache."""
    _notice["cache_dir"] = path or None


class CompileSpan:
    """Compile seconds and signatures between __enter__ and __exit__ (any thread's compiles)."""

    def __init__(self):
        self.seconds, self.signatures = 0.0, 0
        self._start = (0.0, 0)

    def __enter__(self) -> "CompileSpan":
        self._start = totals()
        return self

    def __exit__(self, *exc) -> None:
        s, n = totals()
        self.seconds, self.signatures = s - self._start[0], n - self._start[1]


event.register("numba:compile", _Listener())
