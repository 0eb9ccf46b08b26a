"""Where an LLM's resident memory is: the process's RSS, and the part of it each component holds.

`report(llm)` after a generation (Linux: it reads /proc/self/status, /proc/self/smaps and mincore):

- `status`: VmRSS, VmHWM (peak), RssAnon, RssFile, RssShmem of the process, MiB;
- `parts`, MiB of resident pages, each page counted once, for the first part that holds it:
  packed weights (the engine's repacked matrices), f32 vectors (norm weights, biases), the KV store
  of the LLM's last generation (its K/V arrays and bookkeeping), engine scratch (run buffers, logits,
  attention and product scratch, RoPE tables), the vocabulary table the tokenizer keeps, and the
  pages of llvmlite's shared library (LLVM) still resident (runtime/compiler_pages.py drops its
  clean ones once the kernels are loaded); `rest` is the RSS no part claims: Python, NumPy, Numba's
  registries and loaded kernels, the tokenizers library's tables, other libraries.

`ringllm bench --memory` prints it; bench/memory.py puts it beside llama.cpp's figures.
"""
from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

from ringllm.runtime.compiler_pages import library_mappings, llvm_library_path
from ringllm.runtime.errors import ConfigError

__all__ = ["report", "status_mib"]

_STATUS_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
_MIB = 2 ** 20


def status_mib() -> dict[str, float]:
    """The process's resident-set figures from /proc/self/status, MiB; a ConfigError where there is no
    /proc (not Linux: the report's other sources, smaps and mincore, are Linux's too)."""
    if not os.path.exists("/proc/self/status"):
        raise ConfigError("the memory report reads /proc/self/status, /proc/self/smaps and mincore: Linux only")
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, val = line.partition(":")
            if key in _STATUS_KEYS:
                out[key] = int(val.split()[0]) / 1024
    return out


def _arrays_of(obj, depth: int = 4, seen: set | None = None):
    """Every ndarray reachable from obj through attributes, dicts, lists and tuples (depth-limited)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        yield obj
        return
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
        names = list(getattr(obj, "__dict__", {}))
        names += [s for c in type(obj).__mro__ for s in getattr(c, "__slots__", ())]
        items = [getattr(obj, n, None) for n in names]
    else:
        return
    for item in items:
        yield from _arrays_of(item, depth - 1, seen)


class _Pages:
    """Resident pages of arrays (mincore), each page counted for the first caller that asks for it."""

    def __init__(self):
        self.libc = ctypes.CDLL(None)
        self.libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self.claimed: set[int] = set()

    def mib(self, arrays) -> float:
        page, total = mmap.PAGESIZE, 0
        for a in arrays:
            if not isinstance(a, np.ndarray) or a.nbytes == 0:
                continue
            lo = a.ctypes.data // page * page
            n = -(-(a.ctypes.data + a.nbytes - lo) // page)
            vec = (ctypes.c_ubyte * n)()
            if self.libc.mincore(lo, n * page, vec) != 0:
                continue
            first = lo // page
            for i in np.flatnonzero(np.frombuffer(vec, np.uint8) & 1).tolist():
                if first + i not in self.claimed:
                    self.claimed.add(first + i)
                    total += page
        return total / _MIB


def report(llm) -> dict:
    """{"status": ..., "parts": ..., "rest": ...} for `llm` (a ringllm.LLM on the cpu backend), MiB."""
    status_mib()                        # Linux only: the check before any other read
    eng = llm.engine
    if eng is None or not hasattr(eng, "mats"):
        raise ConfigError("the memory report measures the cpu engine's buffers; this LLM has none")
    pages = _Pages()
    mats = list(eng.mats.values())
    parts = {"packed weights": pages.mib(pm.buf for pm in mats),
             "f32 vectors": pages.mib(eng.vecs.values()),
             "KV store": pages.mib(_arrays_of(getattr(llm, "_store", None)))}
    scratch = [pm.scratch for pm in mats] + [pm.rows_scratch for pm in mats]
    scratch += [a for pm in mats if pm.q8_acts is not None for a in pm.q8_acts.bufs]
    scratch += [eng.logits_buf] + list(_arrays_of(eng.buf)) + list(_arrays_of(eng.sc))
    scratch += list(_arrays_of(eng.layer_ropes)) + [a for a in vars(eng).values() if isinstance(a, np.ndarray)]
    parts["engine scratch"] = pages.mib(scratch)
    parts["vocabulary table"] = llm.tokenizer.vocabulary_table().nbytes / _MIB
    path = llvm_library_path()
    llvm_kb = sum(rss for _, _, _, rss, _ in library_mappings(path)) if path else 0
    parts["LLVM library (llvmlite)"] = llvm_kb / 1024
    status = status_mib()
    return {"status": status, "parts": parts, "rest": status["VmRSS"] - sum(parts.values())}
