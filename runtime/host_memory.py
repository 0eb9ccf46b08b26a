"""Host allocations that are cheap to start using: KV storage without transparent huge pages.

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
nothing until its pages are written; it is unmapped when the array is collected. Under the kernel's
`madvise` huge-page mode (the common default) such a mapping gets ordinary pages.
"""
from __future__ import annotations

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
    shape = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < LAZY_MIN_BYTES:
        return np.zeros(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).reshape(shape)


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
        b = a
        while isinstance(b, np.ndarray) and getattr(b, "_mmap", None) is None:
            b = b.base
        m = getattr(b, "_mmap", None) if isinstance(b, np.ndarray) else None
        if m is None or id(m) in seen:
            continue
        seen.add(id(m))
        try:
            m.madvise(mmap.MADV_DONTNEED)
            total += len(m)
        except (OSError, ValueError):       # a closed mapping, or a kernel that refuses: nothing to release
            pass
    return total
