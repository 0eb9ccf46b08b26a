"""LLVM's code pages leave the resident set once the kernels are loaded (runtime/compiler_pages.py):
only the clean mappings of llvmlite's library are dropped, LLVM compiles again after the release (its
pages fault back in), and a generation through ringllm.LLM ends with them released. Linux only."""
from __future__ import annotations

import mmap
import os

import pytest
from numba import njit

import ringllm
from ringllm.runtime import compiler_pages

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps") or not hasattr(mmap, "MADV_DONTNEED"),
                                reason="needs Linux's /proc/self/smaps and madvise")


def _llvm_mappings() -> list[tuple[int, str, int, int]]:
    """(start, perms, Rss kB, Anonymous kB) of each of this process's mappings of llvmlite's library."""
    return [(lo, perms, rss, anon) for lo, _, perms, rss, anon in
            compiler_pages.library_mappings(compiler_pages.llvm_library_path())]


def _clean_rss_kb() -> int:
    return sum(rss for _, perms, rss, anon in _llvm_mappings() if "w" not in perms and anon == 0)


def test_release_drops_the_clean_library_pages_and_leaves_the_others():
    twice_plus_one = njit(cache=False)(lambda x: 2 * x + 1)
    assert twice_plus_one(3) == 7                   # a compile: LLVM's code runs and its pages come in
    before = {start: (perms, rss, anon) for start, perms, rss, anon in _llvm_mappings()}
    assert _clean_rss_kb() > 1024
    assert compiler_pages.release() > 0
    assert _clean_rss_kb() < 256                    # nothing runs LLVM between the release and this read
    for start, perms, rss, anon in _llvm_mappings():
        if "w" in perms or anon:                    # relocated or writable data: its own pages, kept
            assert (perms, rss, anon) == before[start]
    assert compiler_pages.release() == 0            # nothing compiled or loaded since: nothing to do


def test_llvm_compiles_after_the_release_and_compiled_kernels_still_run():
    square = njit(cache=False)(lambda x: x * x)
    assert square(5) == 25
    compiler_pages.release()
    cube = njit(cache=False)(lambda x: x * x * x)   # LLVM runs again from pages faulted back in
    assert cube(3) == 27 and square(6) == 36
    assert compiler_pages.release() > 0


def test_a_generation_ends_with_llvm_pages_released(smollm2_path):
    llm = ringllm.LLM(smollm2_path, n_threads=1, progress=False)
    out = llm.complete("The capital of France is", max_tokens=3, temperature=0.0)
    assert out.text
    assert _clean_rss_kb() < 256


def test_only_the_librarys_read_only_mappings_qualify_at_each_release():
    """release() advises a remembered range only while /proc/self/maps still shows it as a private, not
    writable mapping of the library (read_only_mappings): never another file's mapping, an anonymous
    one (MADV_DONTNEED would zero its data) or the library's writable data."""
    path = compiler_pages.llvm_library_path()
    now = compiler_pages.read_only_mappings(path)
    perms_at = {start: perms for start, perms, *_ in _llvm_mappings()}
    assert now and all(lo in perms_at and "w" not in perms_at[lo] for lo, _ in now)
    m = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.write(b"x" * (1 << 20))
    import ctypes
    buf = ctypes.c_char.from_buffer(m)
    lo = ctypes.addressof(buf)
    assert not any(a <= lo < b for a, b in now)
    del buf
    njit(cache=False)(lambda x: x - 1)(2)
    assert compiler_pages.release() > 0
    m.seek(0)
    assert m.read(1 << 20) == b"x" * (1 << 20)


def test_a_page_copied_on_write_since_keeps_its_range_out_of_the_release():
    """A library page made writable, written and made read-only again is the process's own copy (not the
    file's bytes) although the mapping reads r--p again: the release leaves its range alone, so the copy
    stays (here the page's own byte written back: the library's contents do not change)."""
    import ctypes

    njit(cache=False)(lambda x: x + 3)(1)
    compiler_pages.release()
    clean = {start for start, perms, rss, anon in _llvm_mappings() if perms == "r--p" and anon == 0}
    # the library's first mapping (its ELF header and read-only data): the code after it is r-xp, so
    # after the mprotects below it is still the same single mapping
    lo, hi = min(r for r in compiler_pages.read_only_mappings(compiler_pages.llvm_library_path()) if r[0] in clean)
    addr = lo
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    assert libc.mprotect(lo, hi - lo, mmap.PROT_READ | mmap.PROT_WRITE) == 0     # the whole mapping: it stays
    byte = ctypes.c_ubyte.from_address(addr)                                    # one mapping, r--p again below
    byte.value = byte.value                                     # a write: the page is copied
    assert libc.mprotect(lo, hi - lo, mmap.PROT_READ) == 0
    assert (lo, hi) in compiler_pages.read_only_mappings(compiler_pages.llvm_library_path())
    njit(cache=False)(lambda x: x + 4)(1)
    compiler_pages.release()
    assert _anon_at(addr) >= page // 1024                     # the copied page is still this process's own


def _anon_at(address: int) -> int:
    """smaps' Anonymous kB of the mapping that holds `address`."""
    inside = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split(None, 5)
            if len(head) >= 5 and "-" in head[0] and len(head[1]) == 4:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("Anonymous:"):
                return int(line.split()[1])
    return 0
