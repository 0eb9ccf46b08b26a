"""On-disk cache of a GGUF file's long string arrays (the vocabulary, the merges), checked against the file.

A GGUF string array is a run of length-prefixed strings: finding each string needs the length of the
one before, so reading a vocabulary is one Python step per string (10^5 of them, the largest part of
reading a header). The same strings joined by NUL into one UTF-8 text are read back by one decode
and one split. That text is kept under ringllm's cache directory ($XDG_CACHE_HOME or ~/.cache, then
ringllm/gguf_strings), in a file named by a hash of the array's element count and first bytes, with
the array's length in bytes and the SHA-256 of those bytes: a cached array is used only where the
file holds exactly the bytes it was read from (a hash of a few MB, a millisecond or two), whatever
the file's name, copy or age. Anything else (no file, another array behind the same name, a short or
damaged file) reads the array from the GGUF again and rewrites the entry; a cache directory that
cannot be written only costs that reading each time.

File layout: MAGIC, u64 count, u64 byte length of the array in the GGUF, 32-byte SHA-256 of those
bytes, then the UTF-8 of the strings joined by NUL. An array holding a NUL inside a string is not
cached.
"""
from __future__ import annotations

import hashlib
import os
import struct

from ringllm.runtime.user_cache import user_cache_dir

__all__ = ["MIN_CACHED", "read_cached", "store"]

MAGIC = b"RLGSTR01"
MIN_CACHED = 4096                      # arrays with fewer strings are read from the file every time
_HEAD = struct.Struct("<8sQQ32s")
_KEY_BYTES = 1 << 16                   # the array's first bytes that name its cache file


def _path(buf, pos: int, count: int) -> str:
    digest = hashlib.sha256(MAGIC + count.to_bytes(8, "little"))
    digest.update(buf[pos:pos + _KEY_BYTES])
    return user_cache_dir("gguf_strings", digest.hexdigest()[:32])


def read_cached(buf, pos: int, count: int) -> tuple[list[str], int] | None:
    """(the `count` strings of the array at byte `pos` of buf, the byte after it) from the cache, or
    None when the cache holds no entry for exactly these bytes."""
    try:
        with open(_path(buf, pos, count), "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    if len(data) < _HEAD.size:
        return None
    magic, n, size, region_hash = _HEAD.unpack_from(data)
    end = pos + size
    if magic != MAGIC or n != count or end > len(buf) or hashlib.sha256(buf[pos:end]).digest() != region_hash:
        return None
    try:
        strings = str(data[_HEAD.size:], "utf-8").split("\0")
    except UnicodeDecodeError:
        return None
    if len(strings) != count:
        return None
    return strings, end


def store(buf, pos: int, end: int, strings: list[str]) -> None:
    """Keep the strings read from bytes pos..end of buf for later processes (nothing when they hold a
    NUL or the cache cannot be written)."""
    text = "\0".join(strings)
    if text.count("\0") != len(strings) - 1:
        return
    head = _HEAD.pack(MAGIC, len(strings), end - pos, hashlib.sha256(buf[pos:end]).digest())
    path = _path(buf, pos, len(strings))
    from ringllm.runtime.atomic_file import atomic_open

    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with atomic_open(path, "wb") as fh:          # whole or absent: a reader never sees half a file
            fh.write(head)
            fh.write(text.encode("utf-8"))
    except OSError:
        pass                                         # a cache: not writing it only costs time next run
