"""The server's prompt cache: KV stores of recent requests, reused by later requests that start with
the same tokens.

    cache = PromptCache(max_bytes=512 << 20)
    store, n = cache.take(ids, kv)             # a store holding ids[:n] (restored from a cached one), or (None, 0)
    ... prefill ids[n:] into it, generate ...
    cache.put(tokens_fed, store)                # the store, keyed by every token fed into it, in order

An entry is a store and the exact token history it was fed (prompt and generated tokens, in
order). A request with ids R reuses the entry of the same KVConfig that gives the most tokens:

  * an entry whose history H is a proper prefix of R (len(H) < len(R)) gives len(H) tokens, under
    every policy. A store's state after H depends only on H: each token is written, its victims
    chosen and its attention scored as it comes, and the engine's chunked prefill computes each row
    the same whatever the chunk (tests/test_prompt_cache.py checks logits bitwise against a fresh
    store for every policy). What the store holds of H (all of it, or what the policy kept) is
    then exactly what a fresh store fed R would hold at that point.
  * an entry that has evicted nothing under policy full or streaming (KVStore.truncatable) also
    gives its longest common prefix with R, cut by KVStore.truncate (at most len(R) - 1: the last
    prompt token is always fed, for its logits). An entry that evicted, or whose policy scores
    tokens by the attention later tokens paid them, cannot be cut: it serves only requests that
    extend all of it.

An entry keeps a snapshot of the store (KVStore.snapshot: the slots it wrote, not the arrays
sized for its whole capacity), so the budget counts the bytes the cache really holds; a hit
restores a fresh store from it (KVStore.from_snapshot), so the entry stays as it was for other
requests and two requests never write one store. Only the CPU engine's dense KVStore is cached
(other backends' stores have no snapshot). Entries are evicted least recently used first to stay
within max_bytes; a store larger than the whole budget is not kept. One thread (the server's
worker) uses a cache.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.kv_store import KVStore, StoreSnapshot

__all__ = ["PromptCache", "default_cache_bytes"]


def default_cache_bytes() -> int:
    """A quarter of the machine's physical memory, at most 4 GiB: the prompt cache's default size."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return int(min(total // 4, 4 << 30))


@dataclass
class _Entry:
    tokens: np.ndarray       # (n,) int64: every token fed into the store, in order
    snap: StoreSnapshot      # the store, cut to the slots it wrote


class PromptCache:
    """Stores of recent requests keyed by their token history (module docstring).

    Args:
        max_bytes: budget of the cached stores; 0 disables the cache (take() always misses).
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max(0, int(max_bytes))
        self._entries: OrderedDict[int, _Entry] = OrderedDict()       # oldest use first
        self._ids = 0
        self.bytes = 0                      # of the snapshots and their token keys
        self.spec = None                    # the model of the stores (set by the first put)
        self.hits = self.misses = self.tokens_reused = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, ids, kv: KVConfig) -> tuple[object | None, int]:
        """(store, n): a store restored from the best entry for prompt `ids` under `kv`, holding ids[:n] (n >= 1),
        or (None, 0) when no entry gives a token."""
        if not self._entries:
            self.misses += 1
            return None, 0
        req = np.asarray(ids, dtype=np.int64)
        best, best_n = None, 0
        for key, e in self._entries.items():
            if e.snap.kv != kv:
                continue
            n = _usable(e, req)
            if n > best_n:
                best, best_n = key, n
        if best is None:
            self.misses += 1
            return None, 0
        entry = self._entries[best]
        self._entries.move_to_end(best)
        store = KVStore.from_snapshot(self.spec, entry.snap)
        if store.n_seen > best_n:
            store.truncate(best_n)
        self.hits += 1
        self.tokens_reused += best_n
        return store, best_n

    def put(self, tokens, store) -> None:
        """Keep `store` (fed exactly `tokens`, in order) for later requests; it replaces an entry of
        the same history and KVConfig. The least recently used entries go to make room."""
        if (self.max_bytes == 0 or not isinstance(store, KVStore) or not len(tokens) or store.n_seen != len(tokens)
                or store.journal is not None):
            return      # off, another backend's store (no snapshot), or a store whose history is not `tokens`
        toks = np.asarray(tokens, dtype=np.int64).copy()
        if toks.nbytes > self.max_bytes:
            return
        snap = store.snapshot()
        size = snap.nbytes + toks.nbytes
        if size > self.max_bytes:
            return
        self.spec = store.spec
        for key, e in list(self._entries.items()):
            if e.snap.kv == snap.kv and e.tokens.size == toks.size and np.array_equal(e.tokens, toks):
                self._drop(key)
        while self._entries and self.bytes + size > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self.evictions += 1
        self._ids += 1
        self._entries[self._ids] = _Entry(toks, snap)
        self.bytes += size

    def clear(self) -> None:
        for key in list(self._entries):
            self._drop(key)

    def stats(self) -> dict:
        return {"entries": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes, "hits": self.hits,
                "misses": self.misses, "tokens_reused": self.tokens_reused, "evictions": self.evictions}

    def _drop(self, key: int) -> None:
        e = self._entries.pop(key)
        self.bytes -= e.snap.nbytes + e.tokens.nbytes


def _usable(entry: _Entry, req: np.ndarray) -> int:
    """Tokens of req (n_req,) the entry can give (module docstring): its whole history when that is a
    proper prefix of req, else the common prefix (at most n_req - 1) when the store can be cut."""
    h = entry.tokens
    m = min(h.size, req.size)
    diff = np.flatnonzero(h[:m] != req[:m])
    common = int(diff[0]) if diff.size else m
    if common == h.size and h.size < req.size:
        return common
    if entry.snap.truncatable:
        return min(common, req.size - 1)
    return 0
