"""Byte-level BPE (GPT-2's family: SmolLM2, Llama 3, Qwen) from a GGUF vocabulary and its merges,
without building a `tokenizers` model.

Building Hugging Face `tokenizers`' BPE model hands every merge over as a pair of Python strings and
has the library hash them all into its tables, most of a byte-level tokenizer's load (docs/startup.md).
This module encodes with the same rule from a dict of the merges' own strings ("a b" -> rank), which
Python builds in one pass; the `tokenizers` backend stays available (Tokenizer.backend builds it on
first use) and is the oracle of the tests.

The rule (tokenizers' AddedVocabulary, then its pre-tokenizer, then BPE.merge_word and
Word.merge_all for a model without unknown token, dropout or subword affixes):

- a text is first cut at added tokens (spm_bpe.AddedTokens: leftmost-longest, on the raw text);
- every other segment goes through the vocabulary's pre-tokenizer, the very `tokenizers` object
  the backend uses (the regex split by `tokenizer.ggml.pre`, then the bytes spelled in GPT-2's byte
  alphabet), which gives its words;
- a word starts as its characters, a character outside the vocabulary left out (no unknown token);
- the pair of adjacent symbols with the smallest merge rank is merged, the leftmost first among
  equals; a queued pair is merged only if the two symbols now at its place still make, through a
  merge of the vocabulary, the token it was queued for (tokenizers checks the token, not the pair).
  A merge listed twice ranks where it is listed last, as in tokenizers' table.

Each word is merged once and remembered (spm_bpe.remembered), as tokenizers caches words.

Decoding is tokenizers' decode for these files: each id's text (an added token's content, else the
vocabulary's spelling; an id whose text a later token has is skipped, and with skip_special every
text that is a special token's content), each text's characters turned back into bytes (a text with
a character outside the byte alphabet: its UTF-8), the bytes of all of them read as UTF-8 with each
invalid sequence replaced.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence

from ringllm.models.spm_bpe import AddedTokens, join_symbols, remembered

__all__ = ["ByteLevelBPE"]


class ByteLevelBPE:
    """Encoder and decoder of one byte-level BPE vocabulary (module docstring).

    vocab: token text (in the byte alphabet) -> id, the last of equal texts winning; merges: the
        file's merges, each "a b" (checked by the caller: one space, the concatenation in vocab; a
        merge whose parts are not tokens never applies); pre_tokenizer: the `tokenizers` pre-tokenizer that cuts a segment
        into words; texts: the vocabulary's texts by id as vocab spells them; added: (text, id,
        special) of the added tokens, in the order they are added; token_bytes: a vocabulary text's
        bytes."""

    def __init__(self, vocab: dict[str, int], merges: Sequence[str], pre_tokenizer,
                 texts: Sequence[str], added: Sequence[tuple[str, int, bool]],
                 token_bytes: Callable[[str], bytes]):
        self._vocab = vocab
        self._ranks: Mapping[str, int] = dict(zip(merges, range(len(merges))))
        self._words = pre_tokenizer.pre_tokenize_str
        self._texts = texts
        self._added_list = list(added)
        self._added = AddedTokens(self._added_list)
        self._added_text = {i: t for t, i, _ in self._added_list}
        self._special_texts = frozenset(t for t, _, special in self._added_list if special)
        self._token_bytes = token_bytes
        self._memo: dict[str, list[int]] = {}

    def added_contents(self) -> dict[int, str]:
        """id -> text of every added token."""
        return dict(self._added_text)

    # -------------------------------------------------------------------------------- encode
    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        """Ids of `text` (no BOS/EOS)."""
        ids: list[int] = []
        for _, part in self._added.split(text, parse_special):
            if isinstance(part, int):
                ids.append(part)
                continue
            for word, _ in self._words(part):
                ids.extend(remembered(self._memo, word, self._merge_word))
        return ids

    def _merge_word(self, word: str) -> list[int]:
        """The word's ids: its characters merged by rank (module docstring)."""
        vocab, ranks = self._vocab, self._ranks
        syms: list[str | None] = [c for c in word if c in vocab]
        n = len(syms)
        if n < 2:
            return [vocab[s] for s in syms]
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap = []
        for i in range(n - 1):
            rank = ranks.get(f"{syms[i]} {syms[i + 1]}")
            if rank is not None:
                heap.append((rank, i, syms[i] + syms[i + 1]))
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            _, i, made = pop(heap)
            left = syms[i]
            if left is None:                  # merged into the symbol before it
                continue
            j = nxt[i]
            if j < 0:
                continue
            right = syms[j]
            if left + right != made or f"{left} {right}" not in ranks:
                continue
            p, k = join_symbols(syms, nxt, prv, i, j, made)
            if p >= 0:
                rank = ranks.get(f"{syms[p]} {made}")
                if rank is not None:
                    push(heap, (rank, p, syms[p] + made))
            if k >= 0:
                rank = ranks.get(f"{made} {syms[k]}")
                if rank is not None:
                    push(heap, (rank, i, made + syms[k]))
        return [vocab[s] for s in syms if s is not None]

    # -------------------------------------------------------------------------------- decode
    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids` (valid ids; the caller checks them)."""
        added, texts, vocab = self._added_text, self._texts, self._vocab
        special = self._special_texts if skip_special else frozenset()
        token_bytes = self._token_bytes
        parts: list[bytes] = []
        for i in ids:
            text = added.get(i)
            if text is None:
                text = texts[i]
                if vocab.get(text) != i:         # a later token has this text: tokenizers has none
                    continue
            if text in special:
                continue
            parts.append(token_bytes(text))
        return b"".join(parts).decode("utf-8", "replace")
