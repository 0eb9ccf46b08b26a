"""On-disk cache of the BPE merges derived from a SentencePiece vocabulary.

tokenizer.derive_merges turns a vocabulary without merges (Gemma's, Llama 2's) into BPE merges by
trying every split of every token: for Gemma's 262,144 tokens that is two million dictionary
lookups and a sort, seconds of every start. The result depends on the tokens and their ranks only,
so it is kept under ringllm's cache directory ($XDG_CACHE_HOME or ~/.cache, then ringllm/merges) in
a file named by a hash of both: each merge as the vocabulary ids of its two parts, an (n, 2) int32
.npy array (loaded in milliseconds, no pickle). A file that cannot be read, or whose ids do not fit
the vocabulary, is derived again and rewritten; a directory that cannot be written only costs the
derivation each time.
"""
from __future__ import annotations

import hashlib
import os
from typing import Callable, Sequence

import numpy as np

from ringllm.runtime.user_cache import user_cache_dir
from ringllm.runtime.atomic_file import atomic_open

FORMAT = 1


def _key(tokens: Sequence[str], ranks: Sequence[float]) -> str:
    digest = hashlib.sha256()
    digest.update(f"v{FORMAT}\0{len(tokens)}\0".encode())
    digest.update("\0".join(tokens).encode("utf-8", "surrogatepass"))
    digest.update(np.asarray(ranks, np.float64).tobytes())
    return digest.hexdigest()[:32]


def _read(path: str, tokens: Sequence[str]) -> list[tuple[str, str]] | None:
    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if ids.ndim != 2 or ids.shape[1] != 2 or ids.dtype != np.int32 or (ids.size and (
            ids.min() < 0 or ids.max() >= len(tokens))):
        return None
    names = np.empty(len(tokens), object)     # the vocabulary's own str objects, gathered by NumPy
    names[:] = tokens
    return list(zip(names[ids[:, 0]].tolist(), names[ids[:, 1]].tolist()))


def _write(path: str, tokens: Sequence[str], merges: list[tuple[str, str]]) -> None:
    index = {t: i for i, t in enumerate(tokens)}
    ids = np.array([(index[a], index[b]) for a, b in merges], np.int32).reshape(-1, 2)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with atomic_open(path, "wb") as f:     # whole or absent: a reader never sees half a file
            np.save(f, ids, allow_pickle=False)
    except OSError:
        pass                                    # a cache: not writing it only costs time next run


def cached_merges(tokens: Sequence[str], ranks: Sequence[float],
                  derive: Callable[[Sequence[str], Sequence[float]], list]) -> list[tuple[str, str]]:
    """derive(tokens, ranks) (merges whose parts are tokens of the vocabulary), read from the cache
    when an earlier process derived it."""
    path = os.path.join(user_cache_dir("merges"), _key(tokens, ranks) + ".npy")
    merges = _read(path, tokens)
    if merges is None:
        merges = derive(tokens, ranks)
        _write(path, tokens, merges)
    return merges
