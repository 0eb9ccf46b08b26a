"""PieceTable: a vocabulary's strings by token id, held as one UTF-8 buffer and an array of ends.

A tokenizer keeps its vocabulary as the model file spells it (Tokenizer.id_to_token, token_to_id,
the byte table a constraint engine matches against). As a list of Python strings each token costs
an object header and a list slot beside its characters, resident for the life of the process though
the list is read a few times. The same strings as one buffer of their UTF-8 bytes and the offset
where each ends cost the bytes and one integer a token; each read decodes its piece again, and the
tokenizers library keeps its own copy for encoding and decoding in any case (docs/footprint.md has
the sizes).

A PieceTable is a read-only Sequence[str]: len, indexing (negative indices, slices), iteration and
equality with a list of the same strings.
"""
from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np

__all__ = ["PieceTable"]

_SEP = "\0"


class PieceTable(Sequence):
    """The strings of `pieces`, in order, held compactly (module docstring)."""

    __slots__ = ("_blob", "_ends")

    def __init__(self, pieces: Sequence[str]):
        pieces = list(pieces)
        joined = _SEP.join(pieces)
        if not pieces:
            blob, ends = b"", np.zeros(0, np.int64)
        elif joined.count(_SEP) == len(pieces) - 1:              # no piece holds the separator: one pass
            blob = joined.encode("utf-8", "surrogatepass")
            seps = np.flatnonzero(np.frombuffer(blob, np.uint8) == 0)
            # piece i spans [ends[i-1] + 1, ends[i]) of the separated buffer; held without separators
            ends = np.append(seps, len(blob)) - np.arange(len(pieces))
            blob = blob.replace(b"\0", b"")
        else:
            encoded = [p.encode("utf-8", "surrogatepass") for p in pieces]
            blob = b"".join(encoded)
            ends = np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)))
        self._blob = blob
        self._ends = np.asarray(ends, np.int64 if len(blob) >= 2 ** 31 else np.int32)

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = operator.index(index)
        n = len(self._ends)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"piece index {index} out of range for {n} pieces")
        lo = int(self._ends[i - 1]) if i else 0
        return self._blob[lo:int(self._ends[i])].decode("utf-8", "surrogatepass")

    def __iter__(self):
        blob, lo = self._blob, 0
        for hi in self._ends.tolist():
            yield blob[lo:hi].decode("utf-8", "surrogatepass")
            lo = hi

    def __eq__(self, other) -> bool:
        if isinstance(other, PieceTable):
            return self._blob == other._blob and np.array_equal(self._ends, other._ends)
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"PieceTable({len(self)} pieces, {len(self._blob)} bytes)"

    def runs_of(self, char: str) -> np.ndarray:
        """Indices (int64, ascending) of the non-empty pieces made of `char` alone, a character of one
        UTF-8 byte: one pass over the buffer, no piece decoded."""
        code = char.encode("utf-8")
        if len(code) != 1:
            raise ValueError(f"runs_of takes a one-byte character, not {char!r}")
        blob = np.frombuffer(self._blob, np.uint8)
        others = np.zeros(len(blob) + 1, np.int64)      # others[k]: bytes other than char in blob[:k]
        np.cumsum(blob != code[0], out=others[1:])
        ends = self._ends.astype(np.int64)
        starts = np.zeros_like(ends)
        starts[1:] = ends[:-1]
        return np.flatnonzero((others[ends] == others[starts]) & (ends > starts))

    def after_other(self, char: str) -> list[int]:
        """Indices (ascending) of the pieces holding `char` right after a different character: one
        pass over the buffer, no piece decoded."""
        code = np.frombuffer(char.encode("utf-8"), np.uint8)
        k = len(code)
        blob = np.frombuffer(self._blob, np.uint8)
        if len(blob) < 2 * k:
            return []
        at = np.ones(len(blob) - k + 1, bool)         # where char's bytes start
        for j in range(k):
            at &= blob[j:len(blob) - k + 1 + j] == code[j]
        at = np.flatnonzero(at)
        ends = self._ends.astype(np.int64)
        owner = np.searchsorted(ends, at, side="right")            # the piece each occurrence is in
        start = np.where(owner > 0, ends[np.maximum(owner - 1, 0)], 0)
        is_at = np.zeros(len(blob) + 1, bool)
        is_at[at] = True
        after_char = (at - k >= start) & is_at[np.maximum(at - k, 0)]   # the same character right before
        return np.unique(owner[(at > start) & ~after_char]).tolist()

    @property
    def nbytes(self) -> int:
        """Bytes held: the UTF-8 buffer and the ends."""
        return len(self._blob) + self._ends.nbytes
