"""LLVM's code pages: out of the resident set once the kernels a run needs are loaded.

Numba compiles and loads kernels through llvmlite, whose shared library holds all of LLVM's code
and read-only data, mapped from the file. Loading kernels from the cache touches a good part of it
(initialising the code generator, linking object code, resolving symbols), and those pages stay in
the process's resident set (RSS) after the last kernel is loaded, although running a kernel never
reads them: a compiled kernel is machine code in memory of its own, called from Numba's dispatcher
(docs/footprint.md has the sizes).

`release()` drops this process's resident pages of those mappings with MADV_DONTNEED. Only mappings
that are private, not writable and hold no page of their own (smaps' Anonymous: 0) qualify: their
pages are the file's bytes, so dropping them loses nothing, and the next time LLVM runs (a new
signature to compile or load) they fault back in from the page cache, which keeps them until the
kernel needs the memory. The relocated read-only data (RELRO) and the writable data are left alone.
Unmapped, the pages are also easier for the kernel to reclaim: Linux shields mapped executable
pages from reclaim, not cached ones.

Numba's compiler lock is taken for every compile and every kernel loaded from the cache
("numba:compiler_lock" events); `release()` does its work only when the lock was taken since its
last call, so callers may call it after every batch of engine calls (LLM.engine_lock does) at the
cost of one comparison. The qualifying mappings are found once (one read of /proc/self/smaps) and
remembered; each release checks them again before it advises them: against /proc/self/maps (still a
private, not writable mapping of the library) and /proc/self/pagemap (no page copied on write since,
as an mprotect to writable and back, or a debugger's breakpoint, would make one), read for those
ranges only. Linux only; elsewhere `release()` does nothing and returns 0.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading

import numpy as np
from numba.core import event

__all__ = ["release", "library_mappings", "llvm_library_path", "read_only_mappings"]

_MADV_DONTNEED = 4
_PRESENT, _FILE_OR_SHARED = np.uint64(1 << 63), np.uint64(1 << 61)     # /proc/self/pagemap entry bits
_state = {"uses": 0, "released_at": 0, "ranges": None}
_lock = threading.Lock()
_count_lock = threading.Lock()


class _Listener(event.Listener):
    """Counts the compiler lock's uses (a compile or a cache load each). Numba signals the end after it
    has let the lock go, so two threads can end at once: the count takes a lock of its own."""

    def on_start(self, ev):
        pass

    def on_end(self, ev):
        with _count_lock:
            _state["uses"] += 1


def llvm_library_path() -> str | None:
    """The path of the llvmlite shared library this process loaded (None if it has none loaded)."""
    try:
        from llvmlite.binding import ffi
        name = ffi.lib._name
    except (ImportError, AttributeError, OSError):
        return None
    return os.path.realpath(name) if name else None


def library_mappings(path: str) -> list[tuple[int, int, str, int, int]]:
    """(start, end, perms, Rss kB, Anonymous kB) of each of this process's mappings of the file at
    `path`, from /proc/self/smaps (which walks every mapping's pages: a few ms)."""
    out, current = [], None
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split(None, 5)
            if len(head) >= 5 and "-" in head[0] and len(head[1]) == 4:     # a mapping's header line
                current = None
                if len(head) == 6 and head[5].strip() == path:
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    current = [lo, hi, head[1], 0, 0]
                    out.append(current)
            elif current is not None and line.startswith("Rss:"):
                current[3] = int(line.split()[1])
            elif current is not None and line.startswith("Anonymous:"):
                current[4] = int(line.split()[1])
    return [tuple(m) for m in out]


def _clean_ranges(path: str) -> list[tuple[int, int]]:
    """[start, end) of this process's mappings of `path` that are private, not writable and hold no
    anonymous (copied-on-write) page."""
    return [(lo, hi) for lo, hi, perms, _, anon in library_mappings(path)
            if "w" not in perms and perms[3] == "p" and anon == 0]


def read_only_mappings(path: str) -> set[tuple[int, int]]:
    """[start, end) of this process's private, not writable mappings of `path` now (/proc/self/maps:
    no page walk, unlike smaps)."""
    out = set()
    with open("/proc/self/maps") as fh:
        for line in fh:
            head = line.split(None, 5)
            if len(head) == 6 and head[5].strip() == path and "w" not in head[1] and head[1][3] == "p":
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                out.add((lo, hi))
    return out


def _holds_own_page(lo: int, hi: int) -> bool:
    """Whether any page of [lo, hi) is resident and private to this process (copied on write: not the
    file's bytes), from /proc/self/pagemap's flags (which need no privilege). A read-only mapping can
    gain one after the first smaps read: an mprotect to writable and back, a debugger's breakpoint."""
    page = mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as fh:
        fh.seek(lo // page * 8)
        entries = np.frombuffer(fh.read((hi - lo) // page * 8), np.uint64)
    return bool(np.any((entries & _PRESENT != 0) & (entries & _FILE_OR_SHARED == 0)))


def _advisable(path: str) -> list[tuple[int, int]]:
    """The remembered ranges (found once, from smaps) that are still private, not writable mappings of
    `path` (/proc/self/maps) and hold no page of their own (pagemap)."""
    if _state["ranges"] is None:
        _state["ranges"] = _clean_ranges(path)
    now = read_only_mappings(path)
    return [(lo, hi) for lo, hi in _state["ranges"] if (lo, hi) in now and not _holds_own_page(lo, hi)]


def release() -> int:
    """Drop LLVM's clean file pages from this process's resident set if Numba's compiler was used since
    the last call; returns the bytes of mappings advised (0 when nothing was to do). Each release checks
    the remembered mappings first (_advisable): a range that no longer maps the library read-only, or
    that holds a page of its own, is left alone."""
    if _state["uses"] == _state["released_at"]:
        return 0
    with _lock:
        _state["released_at"] = _state["uses"]
        path = llvm_library_path()
        if path is None:
            return 0
        try:
            ranges = _advisable(path)
        except OSError:                 # no /proc (not Linux), or a read that failed: nothing this time
            return 0
        if not ranges:
            return 0
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return sum(hi - lo for lo, hi in ranges if libc.madvise(lo, hi - lo, _MADV_DONTNEED) == 0)


event.register("numba:compiler_lock", _Listener())
