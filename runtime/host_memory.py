"""Host memory: KV storage without transparent huge pages, and giving back what loading used.

NumPy asks the kernel for transparent huge pages (madvise MADV_HUGEPAGE) on every allocation of
4 MiB or more. For a KV store that is the wrong trade: a store sized for the model's context
(hundreds of MB, each kv head's rows 2 MiB or more apart) is written one slot at a time from its
start, so the first token touches one fresh huge page per head, array and layer, and under the
common `defrag=madvise` setting each of those faults may compact memory to find 2 MiB before zeroing
it: the first token of a new sequence then costs tenths of a second (SmolLM2's 30 layers at an 8192
context), paid again by every new store. With ordinary 4 KiB pages each fault zeroes one page,
and a sequence pays for the memory it fills, as it fills it.

`small_pages()` turns NumPy's advice off while the arrays allocated inside it are created (the
setting is process-wide, so it is restored on exit; arrays allocated by other threads meanwhile
merely miss the advice). Where NumPy lacks the switch, it does nothing.

`lazy_zeros()` goes one step further for the big KV arrays: an anonymous memory mapping of its own.
np.zeros gets its memory from malloc, and glibc raises its mmap threshold to the size of every mapped
block it frees (up to 32 MiB), so once one store has been freed the next store's arrays come from the
heap and calloc clears them byte by byte: tens of milliseconds for a store sized to an 8192-token
context, paid by every request a server starts. A fresh mapping is zero by construction and costs
nothing until its pages are written; it is unmapped when the array is collected (`lazy_zeros_group`:
one mapping for many arrays, unmapped with the last of them). The mapping is private (a forked child
copies on write; Python's default for an anonymous mapping is shared memory) and advised against
huge pages, so it gets ordinary pages under every huge-page mode.

Loading leaves two things resident that the process no longer needs: the model file's pages, once
the engine has repacked the weights into its own buffers (`release_array_pages` drops one tensor's
as soon as it is packed, `release_file_pages` a whole mapping), and the heap memory the repacking's
temporaries were freed into (`trim_heap`). Running adds one: the rows an embedding lookup reads
from the file (`release_row_pages` drops them again after each lookup).
"""
from __future__ import annotations

import math
import mmap
from contextlib import contextmanager

import numpy as np

try:
    from numpy._core.multiarray import _set_madvise_hugepage
except ImportError:         # NumPy < 2 keeps it under numpy.core; without it, huge pages stay as they are
    try:
        from numpy.core.multiarray import _set_madvise_hugepage
    except ImportError:
        _set_madvise_hugepage = None


@contextmanager
def small_pages():
    """Arrays allocated inside this block are not advised to use transparent huge pages."""
    if _set_madvise_hugepage is None:
        yield
        return
    previous = _set_madvise_hugepage(False)
    try:
        yield
    finally:
        _set_madvise_hugepage(previous)


def zeros_small_pages(shape, dtype=np.float32) -> np.ndarray:
    """np.zeros(shape, dtype) allocated under small_pages()."""
    with small_pages():
        return np.zeros(shape, dtype)


LAZY_MIN_BYTES = 1 << 16      # smaller arrays come from malloc as usual (a mapping per array would cost more)


def lazy_zeros(shape, dtype=np.float32) -> np.ndarray:
    """A zero array whose memory is paid for as it is written: an anonymous mapping of its own for
    LAZY_MIN_BYTES or more (module docstring), np.zeros below that."""
    return lazy_zeros_group({"a": [(shape, dtype)]})["a"][0]


def lazy_zeros_group(groups: dict) -> dict:
    """lazy_zeros for many arrays at once: groups {name: [(shape, dtype), ...]} -> {name: [array, ...]}.
    The arrays of LAZY_MIN_BYTES or more share one anonymous mapping (each starting on its own page),
    the rest come from np.zeros. A KV store asks for a few arrays per layer, hundreds in all: one
    mapping costs one system call where a mapping per array cost one each (milliseconds per store,
    paid by every request a server starts). The mapping lives as long as any of its arrays."""
    page = mmap.PAGESIZE
    layout, total = {}, 0
    for name, specs in groups.items():
        for i, (shape, dtype) in enumerate(specs):
            shape = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
            dtype = np.dtype(dtype)
            nbytes = math.prod(shape) * dtype.itemsize
            layout[name, i] = (shape, dtype, nbytes, total if nbytes >= LAZY_MIN_BYTES else None)
            if nbytes >= LAZY_MIN_BYTES:
                total += -(-nbytes // page) * page
    arena = np.frombuffer(_anonymous(total), np.uint8) if total else None
    out = {name: [] for name in groups}
    for (name, _), (shape, dtype, nbytes, off) in layout.items():
        out[name].append(np.zeros(shape, dtype) if off is None else arena[off:off + nbytes].view(dtype).reshape(shape))
    return out


def _anonymous(size: int) -> mmap.mmap:
    """A private anonymous mapping of `size` bytes, advised not to use huge pages where the kernel has
    them. mmap.mmap(-1, size) alone would map MAP_SHARED, i.e. shared memory: a child forked from this
    process would write into the parent's KV store and the parent into the child's, and the pages
    would count as shared memory rather than as the process's own. Private, a fork copies on write
    as it does for any other array. MADV_NOHUGEPAGE keeps ordinary pages under the `always`
    huge-page mode too (module docstring)."""
    if not hasattr(mmap, "MAP_PRIVATE"):            # Windows: an anonymous mapping is the process's own
        return mmap.mmap(-1, size)
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        try:
            m.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:                             # a kernel without transparent huge pages
            pass
    return m


def _file_mapping(a):
    """The mmap behind array `a` when `a` is a view of a read-only np.memmap, else None."""
    b = a
    while isinstance(b, np.ndarray) and getattr(b, "_mmap", None) is None:
        b = b.base
    if not isinstance(b, np.ndarray) or getattr(b, "mode", "r") != "r":
        return None
    return getattr(b, "_mmap", None)


def release_array_pages(arrays) -> int:
    """release_file_pages for just the pages under each array: the file pages of one tensor, dropped
    as soon as it has been repacked, instead of the whole file once every tensor has been (at load
    the file's pages and the packed copy are then never resident together, which is what sets the
    load's peak RSS). Arrays that are not C-contiguous views of a read-only np.memmap are skipped;
    a page shared with a neighbouring tensor is dropped too (it faults back in from the page cache
    if that tensor is read). Returns the bytes advised."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return 0
    total, page = 0, mmap.PAGESIZE
    for a in arrays:
        m = _file_mapping(a) if isinstance(a, np.ndarray) and a.flags.c_contiguous and a.size else None
        if m is None:
            continue
        start = _offset_in(m, a)
        total += _drop(m, start // page * page, -(-(start + a.nbytes) // page) * page)
    return total


def _offset_in(m: mmap.mmap, a: np.ndarray) -> int:
    """Byte offset of array a's first element in mapping m."""
    return a.ctypes.data - np.frombuffer(m, np.uint8).ctypes.data


def _drop(m: mmap.mmap, lo: int, hi: int) -> int:
    """MADV_DONTNEED on bytes [lo, min(hi, len(m))) of m (page-aligned lo); returns the bytes advised,
    0 for an empty range, a closed mapping or a kernel that refuses."""
    hi = min(len(m), hi)
    if not 0 <= lo < hi:
        return 0
    try:
        m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    except (OSError, ValueError):
        return 0
    return hi - lo


def _page_table_span() -> int:
    """Bytes of address space one last-level page table maps (the kernel's PMD_SIZE: 2 MiB with 4 KiB
    pages), from /sys where the kernel has transparent huge pages, else worked out: a page table is one
    page of 8-byte entries."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return mmap.PAGESIZE * (mmap.PAGESIZE // 8)


# The most one read fault of a file mapping maps: the aligned span of address space one page table
# covers, around the faulting address. Fault-around maps the page cache's pages of an aligned
# fault_around_bytes window (64 KiB by default, tunable up to this span); kernels with large folios
# in the page cache (xfs, tmpfs, ext4 since 6.16) map the whole folio a fault lands in (measured on
# Linux 6.18, ext4: 256 KiB and 2 MiB for one fault in a file that had been written or read() into
# the cache); a PMD-mapped huge page is this span. Each of these stops at the page table, so no
# fault maps a page outside this span.
FAULT_SPAN_BYTES = max(mmap.PAGESIZE, _page_table_span())


def release_row_pages(a: np.ndarray, rows) -> int:
    """release_array_pages for some rows of `a` only: the pages an embedding lookup has just read
    from the model file. a: 2-D C-contiguous view of a read-only np.memmap (anything else: nothing is
    done); rows: the row indices read. Without this the lookup's pages stay in the RSS after
    release_file_pages dropped the file: one page per distinct token ever seen, so a long run's RSS
    creeps up with its vocabulary until the whole table is resident. Dropped here, a row costs one
    minor fault from the page cache the next time it is read. A fault maps more than the row's own
    pages (a fault-around window or a whole large folio, depending on the kernel and on how the file
    came into the page cache), but never outside the aligned FAULT_SPAN_BYTES of address space
    around the row, so that span, clipped to the mapping, is what is dropped (a page table's walk in
    the kernel, about as cheap as dropping 64 KiB). Returns the bytes advised."""
    if not hasattr(mmap, "MADV_DONTNEED") or a.ndim != 2 or not a.flags.c_contiguous or not a.size:
        return 0
    m = _file_mapping(a)
    if m is None:
        return 0
    span, rb, start = FAULT_SPAN_BYTES, a.nbytes // a.shape[0], a.ctypes.data
    base = start - _offset_in(m, a)             # the mapping's first byte
    runs = []                                   # [lo, hi): addresses of runs of touching spans, one madvise each
    for r in sorted(set(np.asarray(rows, np.int64).ravel().tolist())):
        lo, hi = (start + r * rb) // span * span, -(-(start + (r + 1) * rb) // span) * span
        if runs and lo <= runs[-1][1]:
            runs[-1][1] = hi
        else:
            runs.append([lo, hi])
    return sum(_drop(m, max(0, lo - base), hi - base) for lo, hi in runs)


def trim_heap() -> bool:
    """Give the C heap's free memory back to the system (glibc's malloc_trim(0)); False where there is
    none to call. Repacking a model frees hundreds of MB of NumPy temporaries, many of them in the
    malloc arenas of the packing threads, which glibc does not shrink on its own: without a trim that
    freed memory stays in the process's RSS."""
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):       # not glibc (musl, macOS): its allocator returns memory itself
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True


def release_file_pages(arrays) -> int:
    """Drop this process's resident pages of the read-only file mappings behind `arrays` (arrays
    that are views of an np.memmap; others are skipped), once per mapping; returns the bytes of
    mapping advised. A model's weights, once repacked into the engine's own buffers, are read from
    the file again only for what is still used from it (embedding rows, a draft model built later):
    those pages fault back in from the page cache, one at a time, as they are read. The pages stay
    in the page cache; only this process's resident set (RSS) drops. MADV_DONTNEED on a shared,
    read-only file mapping never loses data."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return 0
    seen, total = set(), 0
    for a in arrays:
        m = _file_mapping(a)
        if m is None or id(m) in seen:
            continue
        seen.add(id(m))
        try:
            m.madvise(mmap.MADV_DONTNEED)
            total += len(m)
        except (OSError, ValueError):       # a closed mapping, or a kernel that refuses: nothing to release
            pass
    return total
