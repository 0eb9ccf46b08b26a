"""SentencePiece-style BPE from a GGUF vocabulary, without building a merges table.

A "llama" GGUF vocabulary (SentencePiece BPE: Llama 2, Mistral, Phi-3, Gemma) usually carries no
merges. Hugging Face `tokenizers` needs them, so its backend (models/tokenizer.py) is built from a
merge for every split of every token into two tokens (derive_merges), a table twice the size of the
vocabulary to derive, hand over and hold. This module encodes with the same rule and the same
tie-breaks straight from the vocabulary, so a model starts with a dict of its tokens and nothing
else (docs/startup.md); the `tokenizers` backend stays available (Tokenizer.backend builds it on
first use) and is the oracle of the tests.

The rule (tokenizers' BPE.merge_word and Word.merge_all with derive_merges' ranking):

- a text is first cut at added tokens (`AddedTokens`: leftmost-longest, on the raw text); each
  other segment is normalized (" " -> "▁"; with add_space_prefix a "▁" put in front of the segment
  that starts the text when it does not start with one) and is one word;
- the word starts as its characters; a character outside the vocabulary becomes its UTF-8 bytes'
  <0xNN> tokens when the vocabulary has all of them, else the unknown token (a run of such
  characters one unknown token, which waits for the next character of the vocabulary while byte
  tokens in between go in first, as tokenizers does), else nothing;
- while two adjacent symbols a, b make a token t = a + b of the vocabulary, the pair with the
  smallest (-rank(t), -len(a), -len(b), first index of t) is merged, the leftmost first among
  equals: rank(t) is the token's score (Gemma: minus its index, the order its merges were learned
  in), as derive_merges orders the merges.

A long text is one word, and the merge loop is Python: where it is exact, the word is cut before
every "▁" that follows another character, and each piece is merged on its own and remembered (as
tokenizers caches words). It is exact because a merge only makes a token of the vocabulary whose
text is the span it covers: a symbol can cover such a cut only if a token holding "x▁" (x not "▁")
lies in the text across it, so cuts inside an occurrence of such a token are left out, and pieces
that no symbol crosses merge independently in the same order. (Gemma 3 has one such token, ">▁</".)

Decoding is tokenizers' decoder chain for these files: "▁" -> " ", runs of <0xNN> tokens joined
into UTF-8 (a run that is not valid UTF-8 gives one U+FFFD per byte), and with add_space_prefix
the first space of the text dropped.
"""
from __future__ import annotations

import heapq
import re
from collections.abc import Callable, Iterable, Sequence

from ringllm.models.piece_table import PieceTable


__all__ = ["AddedTokens", "SentencePieceBPE", "SPIECE_SPACE", "join_symbols", "remembered"]

SPIECE_SPACE = "\u2581"  # "▁"
# where a word is cut (module docstring): before each "▁" that follows another character
_CUT = re.compile("(?<=[^\u2581])(?=\u2581)")
_MEMO_LIMIT = 1 << 16          # pieces remembered per tokenizer before the memo starts again
# a byte token as tokenizers' ByteFallback reads one: "<0x" + two characters u8::from_str_radix takes + ">"
_BYTE_PIECE = re.compile(r"<0x(?:[0-9A-Fa-f]{2}|\+[0-9A-Fa-f])>")


class AddedTokens:
    """Whole-string tokens matched in raw text before the BPE (tokenizers' AddedVocabulary for
    tokens added with normalized=False): at each position the longest one wins, the leftmost
    position first. A special token is matched but, when `parse_special` is off, kept as plain text
    (so a shorter token inside it is not matched either, as tokenizers does)."""

    def __init__(self, contents: Iterable[tuple[str, int, bool]]):
        self._by_text: dict[str, tuple[int, bool]] = {}
        for text, token_id, special in contents:
            if text and text not in self._by_text:
                self._by_text[text] = (token_id, special)
        # first character -> the lengths of the tokens starting with it, longest first
        lengths: dict[str, set[int]] = {}
        for text in self._by_text:
            lengths.setdefault(text[0], set()).add(len(text))
        self._lengths = {c: sorted(ls, reverse=True) for c, ls in lengths.items()}
        self._first = (re.compile("[" + "".join(re.escape(c) for c in sorted(lengths)) + "]")
                       if lengths else None)

    def __len__(self) -> int:
        return len(self._by_text)

    def split(self, text: str, parse_special: bool) -> list[tuple[int, str | int]]:
        """[(start offset, segment text or token id), ...] covering `text` in order."""
        out: list[tuple[int, str | int]] = []
        if self._first is None:
            return [(0, text)] if text else []
        plain = 0                     # start of the plain text not yet emitted
        pos = 0
        search = self._first.search
        lengths = self._lengths
        by_text = self._by_text
        while True:
            m = search(text, pos)
            if m is None:
                break
            at = m.start()
            for size in lengths[text[at]]:
                hit = by_text.get(text[at:at + size])
                if hit is not None:
                    token_id, special = hit
                    if special and not parse_special:
                        pos = at + size               # matched, stays text
                    else:
                        if plain < at:
                            out.append((plain, text[plain:at]))
                        out.append((at, token_id))
                        plain = pos = at + size
                    break
            else:
                pos = at + 1
        if plain < len(text):
            out.append((plain, text[plain:]))
        return out


class SentencePieceBPE:
    """Encoder and decoder of one SentencePiece-style BPE vocabulary (module docstring).

    vocab: token text as the BPE sees it (Gemma's runs of spaces as "▁▁...") -> id, the last of equal
        texts winning; texts: those texts by id (read here only where two are equal); pieces: the
        token texts by id as the file spells them (kept, for decoding); ranks: per id, the token's
        merge rank, higher first (a score), or None for minus the index (Gemma); unk: the unknown
        token's text or None; add_prefix: the add_space_prefix rule; added: (text, id, special) of the
        added tokens, in the order they are added."""

    def __init__(self, vocab: dict[str, int], texts: Sequence[str], pieces: PieceTable,
                 ranks: Sequence[float] | None, unk: str | None, add_prefix: bool,
                 added: Sequence[tuple[str, int, bool]]):
        self._vocab = vocab
        self._pieces = pieces
        self._ranks = ranks
        self._first: dict[int, int] = {}    # id -> first index of its text, where an earlier token has it
        self._shadowed: frozenset[int] = frozenset()   # ids whose text a later token has: no text of their own
        if len(vocab) != len(texts):
            shadowed = set()
            for i, t in enumerate(texts):
                last = vocab[t]
                if last != i:
                    shadowed.add(i)
                    self._first.setdefault(last, i)
            self._shadowed = frozenset(shadowed)
        self._unk = unk
        self._add_prefix = add_prefix
        self._added_list = list(added)
        self._added = AddedTokens(self._added_list)
        self._special = frozenset(i for _, i, special in self._added_list if special)
        self._bytes = [f"<0x{b:02X}>" for b in range(256)]
        # cutting words into pieces (module docstring) needs "▁" itself in the vocabulary: an unknown
        # "▁" would put its byte tokens before an unknown token still waiting across the cut
        self._cuttable = SPIECE_SPACE in vocab
        self._crossing = [pieces[i] for i in pieces.after_other(SPIECE_SPACE)] if self._cuttable else []
        self._memo: dict[str, list[int]] = {}

    def added_contents(self) -> dict[int, str]:
        """id -> text of every added token."""
        return {i: t for t, i, _ in self._added_list}

    # -------------------------------------------------------------------------------- encode
    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        """Ids of `text` (no BOS/EOS)."""
        ids: list[int] = []
        vocab = self._vocab
        for start, part in self._added.split(text, parse_special):
            if isinstance(part, int):
                ids.append(part)
                continue
            word = part.replace(" ", SPIECE_SPACE)
            if self._add_prefix and start == 0 and not word.startswith(SPIECE_SPACE):
                word = SPIECE_SPACE + word
            if self._cuttable:
                ids.extend(self._encode_pieces(word))
            else:
                ids.extend(vocab[s] for s in self._merge_word(word))
        return ids

    def _encode_pieces(self, word: str) -> list[int]:
        """Ids of one word, cut into pieces that merge independently (module docstring), each merged
        once per tokenizer."""
        pieces = _CUT.split(word)
        if self._crossing and len(pieces) > 1:
            pieces = _glue(pieces, word, self._crossing)
        out: list[int] = []
        for piece in pieces:
            out.extend(remembered(self._memo, piece, self._piece_ids))
        return out

    def _piece_ids(self, piece: str) -> list[int]:
        vocab = self._vocab
        return [vocab[s] for s in self._merge_word(piece)]

    def _symbols(self, word: str) -> list[str]:
        """The word's starting symbols: characters, byte tokens or unknown tokens. As tokenizers does,
        an unknown token waits until a character of the vocabulary (or the end) comes, taking in the
        unknown characters on the way, while byte tokens in between go in at once."""
        vocab, unk = self._vocab, self._unk
        syms: list[str] = []
        unk_waiting = False
        for ch in word:
            if ch in vocab:
                if unk_waiting:
                    syms.append(unk)
                    unk_waiting = False
                syms.append(ch)
                continue
            byte_tokens = [self._bytes[b] for b in ch.encode("utf-8")]
            if all(b in vocab for b in byte_tokens):
                syms.extend(byte_tokens)
            elif unk is not None:
                unk_waiting = True
        if unk_waiting:
            syms.append(unk)
        return syms

    def _merge_word(self, word: str) -> list[str]:
        """The word's tokens (texts): its symbols merged by rank, leftmost first among equals."""
        syms: list[str | None] = self._symbols(word)
        n = len(syms)
        if n < 2:
            return syms
        vocab, ranks, first = self._vocab, self._ranks, self._first

        def entry(a: str, b: str, pos: int):
            t = vocab.get(a + b)
            if t is None:
                return None
            return (t if ranks is None else -ranks[t], -len(a), -len(b), first.get(t, t), pos, a, b)

        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap = []
        for i in range(n - 1):
            e = entry(syms[i], syms[i + 1], i)
            if e is not None:
                heap.append(e)
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            _, _, _, _, i, a, b = pop(heap)
            if syms[i] != a:                 # merged away, or grown since the entry was made
                continue
            j = nxt[i]
            if j < 0 or syms[j] != b:
                continue
            merged = a + b
            p, k = join_symbols(syms, nxt, prv, i, j, merged)
            if p >= 0:
                e = entry(syms[p], merged, p)
                if e is not None:
                    push(heap, e)
            if k >= 0:
                e = entry(merged, syms[k], i)
                if e is not None:
                    push(heap, e)
        return [s for s in syms if s is not None]

    # -------------------------------------------------------------------------------- decode
    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids` (valid ids; the caller checks them)."""
        pieces, shadowed = self._pieces, self._shadowed
        parts: list[str] = []
        run = bytearray()                    # a run of <0xNN> tokens' bytes
        run_len = 0
        for i in ids:
            if skip_special and i in self._special:
                continue
            if i in shadowed:                # tokenizers has no text for it
                continue
            piece = pieces[i]
            if len(piece) == 6 and _BYTE_PIECE.fullmatch(piece):
                run.append(int(piece[3:5], 16))
                run_len += 1
                continue
            if run_len:
                parts.append(_bytes_text(run, run_len))
                run.clear()
                run_len = 0
            parts.append(piece.replace(SPIECE_SPACE, " "))
        if run_len:
            parts.append(_bytes_text(run, run_len))
        text = "".join(parts)
        if self._add_prefix and text.startswith(" "):
            text = text[1:]
        return text


def join_symbols(syms: list, nxt: list[int], prv: list[int], i: int, j: int, merged: str) -> tuple[int, int]:
    """A merge in a word's symbols, a list linked both ways (nxt, prv; -1 at the ends): symbol j, the
    one after i, joins i, which becomes `merged`. Returns (the symbol now before i, the one after)."""
    syms[i] = merged
    syms[j] = None
    k = nxt[j]
    nxt[i] = k
    if k >= 0:
        prv[k] = i
    return prv[i], k


def remembered(memo: dict[str, list[int]], word: str, ids_of: Callable[[str], list[int]]) -> list[int]:
    """ids_of(word), each word merged once per tokenizer (as tokenizers caches words): memo holds the
    words so far and starts again when it holds _MEMO_LIMIT of them."""
    ids = memo.get(word)
    if ids is None:
        ids = ids_of(word)
        if len(memo) >= _MEMO_LIMIT:
            memo.clear()
        memo[word] = ids
    return ids


def _glue(pieces: list[str], word: str, crossing: Sequence[str]) -> list[str]:
    """pieces (word cut before each "▁" after another character) with the cuts that lie inside an
    occurrence of a crossing token joined again."""
    glued = set()
    for t in crossing:
        at = word.find(t)
        while at >= 0:
            glued.update(range(at + 1, at + len(t)))
            at = word.find(t, at + 1)
    if not glued:
        return pieces
    out = [pieces[0]]
    pos = len(pieces[0])
    for piece in pieces[1:]:
        if pos in glued:
            out[-1] += piece
        else:
            out.append(piece)
        pos += len(piece)
    return out


def _bytes_text(run: bytes, count: int) -> str:
    try:
        return bytes(run).decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * count
