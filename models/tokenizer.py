"""The tokenizer of ringllm: ringllm's own BPE for a GGUF vocabulary (byte-level or SentencePiece), or a
HF `tokenizers` backend built from a tokenizer.json.

Two vocabulary kinds come from GGUF files (`tokenizer.ggml.model`):

- "gpt2": byte-level BPE. The file gives the vocabulary (already spelled in GPT-2's byte alphabet)
  and the merges; the text is cut into words by a regex chosen by `tokenizer.ggml.pre`, then
  every word's bytes are spelled in the byte alphabet and merged. Such a file is encoded by
  models/byte_bpe.py (the regex split is the `tokenizers` pre-tokenizer itself; the merges a dict
  of the file's own strings), and the `tokenizers` backend is made only when Tokenizer.backend is read.
- "llama": SentencePiece-style BPE. Spaces become "▁", a missing piece falls back to <0xNN> byte
  tokens. Files of this kind usually carry no merges; the merges are implied by the vocabulary,
  ranked by the token scores (or, for Gemma, by the order of the tokens in the file, which is the
  order Gemma's merges were learned in; its scores do not follow it). Such a file is encoded by
  models/spm_bpe.py, which needs no merges table; the `tokenizers` backend (built from derived
  merges, as for a file that carries merges) is made only when Tokenizer.backend is read.

Tokens the file marks CONTROL (token_type 3) become special added tokens and USER_DEFINED ones (4)
plain added tokens, so a string such as "<|im_start|>" in the text is one token, as llama.cpp and
transformers make it. `encode(..., parse_special=False)` treats the special ones as plain text.

The reference is transformers' own GGUF conversion (AutoTokenizer.from_pretrained(dir,
gguf_file=...)): for the bundled models this tokenizer gives the same ids (tests/test_tokenizer.py).
"""
from __future__ import annotations

import codecs
import json
import os
import re
import threading
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ringllm.models.byte_bpe import ByteLevelBPE
from ringllm.models.merges_cache import cached_merges
from ringllm.models.piece_table import PieceTable
from ringllm.models.spm_bpe import SPIECE_SPACE, SentencePieceBPE
from ringllm.runtime.errors import ConfigError, ModelFileError, UnsupportedModelError

__all__ = ["Tokenizer", "StreamDecoder", "TokenizerWarning", "PRE_TOKENIZER_REGEXES", "SUPPORTED_GGUF_MODELS"]


class TokenizerWarning(UserWarning):
    """A tokenizer built with a guess (unknown pre-tokenizer name, inconsistent metadata)."""


# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

SUPPORTED_GGUF_MODELS = ("gpt2", "llama")

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")

# Text of end-of-turn tokens: generation stops on them as on EOS (when the vocabulary has them).
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "<|return|>", "<|call|>", "<end_of_utterance>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
)

# ---------------------------------------------------------------------------------------------
# Pre-tokenizer regexes, by `tokenizer.ggml.pre`. Each entry is a list of regexes applied in
# turn, every match and every gap between matches becoming a piece (llama.cpp's
# unicode_regex_split, tokenizers' Split(behavior="isolated")); None means GPT-2's own
# ByteLevel regex. Where a model's tokenizer.json states the regex, that spelling is used.
# ---------------------------------------------------------------------------------------------
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek LLM's letter class: the cased letters (Lu/Ll/Lt), as code-point ranges. Written as
# numbers because several of its characters (U+1F7D, U+1FBE, U+2126, U+212A, ...) have canonical
# singletons that a text editor or tool normalizing to NFC silently turns into other letters.
_DEEPSEEK_LETTER_RANGES = (
    (0x41, 0x5A), (0x61, 0x7A), (0xB5, 0xB5), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA),
    (0x1BC, 0x1BF), (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376, 0x377),
    (0x37B, 0x37D), (0x37F, 0x37F), (0x386, 0x386), (0x388, 0x38A), (0x38C, 0x38C),
    (0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481), (0x48A, 0x52F), (0x531, 0x556),
    (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA), (0x1CBD, 0x1CBF),
    (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15), (0x1F18, 0x1F1D),
    (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57), (0x1F59, 0x1F59), (0x1F5B, 0x1F5B),
    (0x1F5D, 0x1F5D), (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE),
    (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC), (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC),
    (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), (0x2102, 0x2102), (0x2107, 0x2107), (0x210A, 0x2113),
    (0x2115, 0x2115), (0x2119, 0x211D), (0x2124, 0x2124), (0x2126, 0x2126), (0x2128, 0x2128),
    (0x212A, 0x212D), (0x212F, 0x2134), (0x2139, 0x2139), (0x213C, 0x213F), (0x2145, 0x2149),
    (0x214E, 0x214E), (0x2183, 0x2184), (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB, 0x2CEE),
    (0x2CF2, 0x2CF3), (0xA640, 0xA66D), (0xA680, 0xA69B), (0xA722, 0xA76F), (0xA771, 0xA787),
    (0xA78B, 0xA78E), (0xAB70, 0xABBF), (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A),
    (0xFF41, 0xFF5A), (0x10400, 0x1044F), (0x104B0, 0x104D3), (0x104D8, 0x104FB),
    (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2), (0x118A0, 0x118DF), (0x1E900, 0x1E943),
)
_DEEPSEEK_LETTERS = "".join(chr(a) if a == b else f"{chr(a)}-{chr(b)}" for a, b in _DEEPSEEK_LETTER_RANGES)
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM = [
    r"[\r\n]",
    r"\s?[" + _DEEPSEEK_LETTERS + r"]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    _CJK_HANGUL,
    r"\p{N}+",
]
_DEEPSEEK_CODER = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"]
_DEEPSEEK_V3 = [
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
_FALCON = [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"]
_DIGITS_THEN_GPT2 = [r"\p{N}", _GPT2]
_BLOOM = [r" ?[^(\s|.,!?…。，、।۔،)]+"]

PRE_TOKENIZER_REGEXES: dict[str, list[str] | None] = {
    "default": None, "gpt-2": None, "gpt2": None, "mpt": None, "olmo": None, "jais": None,
    # llama.cpp cuts digits apart for smollm (as SmolLM2's own tokenizer.json does, with a Digits
    # pre-tokenizer), but transformers' GGUF conversion, our reference, has no entry for
    # "smollm" and uses plain GPT-2. We follow the reference. The two differ only where a run of
    # two or more whitespace characters ends right before a digit ("a  1": GPT-2 gives " ", " 1",
    # llama.cpp "  ", "1"), because SmolLM2's merges never join a digit to anything.
    "smollm": None,
    "llama3": [_LLAMA3], "llama-v3": [_LLAMA3], "llama-bpe": [_LLAMA3], "dbrx": [_LLAMA3],
    "smaug-bpe": [_LLAMA3], "falcon3": [_LLAMA3], "falcon-h1": [_LLAMA3], "pixtral": [_LLAMA3],
    "chatglm-bpe": [_LLAMA3], "lfm2": [_LLAMA3],
    "qwen2": [_QWEN2], "stablelm2": [_QWEN2], "deepseek-r1-qwen": [_QWEN2], "megrez": [_QWEN2],
    "gpt-4o": [_GPT4O], "llama4": [_GPT4O],
    "tekken": [_TEKKEN],
    "deepseek-llm": _DEEPSEEK_LLM, "deepseek-coder": _DEEPSEEK_CODER, "deepseek-v3": _DEEPSEEK_V3,
    "falcon": _FALCON,
    "starcoder": _DIGITS_THEN_GPT2, "refact": _DIGITS_THEN_GPT2, "command-r": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2, "exaone": _DIGITS_THEN_GPT2, "minerva-7b": _DIGITS_THEN_GPT2,
    "poro-chat": _BLOOM, "bloom": _BLOOM, "gpt3-finnish": _BLOOM,
    "viking": _BLOOM + [r"\p{N}"],
}

# Architectures whose "llama" vocabulary is Gemma's: merges ranked by file order, and tokens of
# two or more literal spaces that stand for runs of "▁".
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3", "gemma3n", "gemma-embedding")


def byte_alphabet() -> dict[int, str]:
    """GPT-2's spelling of the 256 byte values as printable characters."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    spelling, extra = {}, 0
    for b in range(256):
        if b in printable:
            spelling[b] = chr(b)
        else:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


_BYTE_TO_CHAR = byte_alphabet()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


# a character outside the byte alphabet (one search per token: a vocabulary of 10^5 at load)
_OUTSIDE_BYTE_ALPHABET = re.compile("[^" + "".join(re.escape(c) for c in sorted(_CHAR_TO_BYTE)) + "]")

# str.translate table: each byte-alphabet character -> the character of its byte (U+0000..U+00FF, so
# latin-1 encodes it to that byte); each other character below U+0100 -> one latin-1 cannot encode
_TO_LATIN1 = {**{i: "\U0010FFFF" for i in range(256)}, **{ord(c): chr(b) for c, b in _CHAR_TO_BYTE.items()}}


def _byte_level_bytes(token: str) -> bytes:
    """The bytes a byte-level vocabulary token stands for: its characters' bytes when all are in the
    byte alphabet, else (a token written as plain text) its UTF-8."""
    try:
        return token.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode("utf-8")


def _spm_bytes(token: str) -> bytes:
    """The bytes a SentencePiece token stands for: <0xNN> its byte, else its text with ▁ as space."""
    m = _BYTE_TOKEN.match(token) if token.startswith("<0x") else None
    if m:
        return bytes([int(m.group(1), 16)])
    return token.replace(SPIECE_SPACE, " ").encode("utf-8")


def derive_merges(tokens: Sequence[str], ranks: Sequence[float]) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary: every split of a token into two tokens of the vocabulary.

    A merge is ranked by the `ranks` value of the token it makes (higher first), then longer left
    part, then longer right part, then token order; the splits of one token by the ids of their
    parts. This is how SentencePiece BPE vocabularies are turned into BPE merges (the ordering
    transformers uses, so ties break the same way).
    """
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab[t] = i
    rank_of: dict[str, float] = {}
    for t, r in zip(tokens, ranks):
        rank_of[t] = r
    entries = []
    seq = 0
    for token, rank in rank_of.items():
        n = len(token)
        if n < 2:
            continue
        local = []
        for k in range(1, n):
            left = token[:k]
            li = vocab.get(left)
            if li is None:
                continue
            right = token[k:]
            ri = vocab.get(right)
            if ri is None:
                continue
            local.append((li, ri, left, right))
        if not local:
            continue
        local.sort()
        for _, _, left, right in local:
            entries.append((-rank, -len(left), -len(right), seq, left, right))
            seq += 1
    entries.sort()
    return [(e[4], e[5]) for e in entries]


def _gemma_spelling(tokens: Sequence[str], pieces: PieceTable) -> list[str]:
    """Gemma's token texts as its BPE sees them: a token of literal spaces (how Gemma stores its runs
    of 2+ spaces) is that many "▁". pieces: the same tokens' PieceTable, which finds them."""
    texts = list(tokens)
    for i in pieces.runs_of(" ").tolist():
        texts[i] = SPIECE_SPACE * len(texts[i])
    return texts


def _spm_tokenizers_backend(vocab: dict[str, int], merges: list[tuple[str, str]], unk: str | None,
                            prefix: bool, added: Sequence[tuple[str, bool]]):
    """The `tokenizers` backend of a SentencePiece-style BPE vocabulary (the Tokenizer.backend of a
    "llama" GGUF file, and the oracle models/spm_bpe.py is tested against)."""
    from tokenizers import decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    backend = Backend(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                                 byte_fallback=True, dropout=None))
    steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPIECE_SPACE, prepend_scheme="first", split=False)
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    else:
        backend.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
    backend.decoder = decoders.Sequence(steps)
    Tokenizer._add_to_backend(backend, added)
    return backend


# two spaces in one line of the merges joined by line breaks (with as many spaces as merges: a line
# without one then exists too); one scan, where a per-line pattern costs an attempt at every position
_TWO_SPACES_IN_A_LINE = re.compile(" [^ \n]* ")


def _checked_merges(merges: list, vocab: dict[str, int], path: str) -> list[str]:
    """A byte-level vocabulary's merges ("a b" strings), checked: two tokens separated by one space,
    whose concatenation is in the vocabulary. The checks run over the merges joined into one text (a
    vocabulary has 10^5). `tokenizers` also refuses a merge whose parts are not tokens; such a merge
    never applies (every symbol of a word is a token), so the lean encoder leaves it unchecked and
    the `tokenizers` backend, built from the same merges, refuses it when first asked for."""
    if not merges:
        return merges
    try:
        lines = "\n".join(merges)
    except TypeError:
        lines = None
    if (lines is None or lines.count("\n") != max(len(merges) - 1, 0) or lines.count(" ") != len(merges)
            or _TWO_SPACES_IN_A_LINE.search(lines)):
        for k, m in enumerate(merges):
            if not isinstance(m, str) or m.count(" ") != 1 or "\n" in m:
                raise ModelFileError(path, f"tokenizer.ggml.merges[{k}] is {m!r}, not two tokens "
                                     "separated by one space")
    if not all(map(vocab.__contains__, lines.replace(" ", "").split("\n"))):
        made = next(m for m in merges if m.replace(" ", "") not in vocab)
        raise ModelFileError(path, f"the vocabulary and merges are inconsistent: merge {made!r} makes "
                             f"{made.replace(' ', '')!r}, which is not in the vocabulary")
    return merges


def _byte_level_pre_tokenizer(pre: str, path: str):
    """The `tokenizers` pre-tokenizer of `tokenizer.ggml.pre` (PRE_TOKENIZER_REGEXES): the words a
    byte-level vocabulary merges, spelled in the byte alphabet."""
    from tokenizers import Regex, pre_tokenizers

    if pre not in PRE_TOKENIZER_REGEXES:
        warnings.warn(f"{path}: tokenizer.ggml.pre {pre!r} is unknown to ringllm; splitting "
                      "words with GPT-2's regex, which may tokenize differently from the "
                      "model's own tokenizer", TokenizerWarning, stacklevel=4)
    regexes = PRE_TOKENIZER_REGEXES.get(pre)
    if regexes is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _as_list(value: Any) -> list:
    if value is None:
        return []
    if hasattr(value, "tolist"):
        return value.tolist()
    return list(value)


class StreamDecoder:
    """Turns token ids into text as they come, holding back a partial UTF-8 character.

    `push(id)` returns the text completed by that token (maybe ""), `flush()` what is left.
    """

    def __init__(self, tokenizer: "Tokenizer", skip_special: bool = False):
        self._tok = tokenizer
        self._skip = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._dec.decode(self._tok.decode_bytes([token_id], skip_special=self._skip,
                                                       strip_prefix=False))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class Tokenizer:
    """Text <-> token ids for one model. Build with `from_gguf`, `from_hf_dir` or `load`."""

    def __init__(self, backend, *, n_vocab: int, pieces: Sequence[str], piece_kind: str,
                 bos_id: int | None, eos_id: int | None, eos_ids: Iterable[int],
                 unk_id: int | None = None, pad_id: int | None = None,
                 add_bos: bool = False, add_eos: bool = False, strip_prefix_space: bool = False,
                 chat_template: str | None = None, special_ids: Iterable[int] = (),
                 source: str = "", lean: SentencePieceBPE | None = None):
        # backend: a `tokenizers.Tokenizer`, or (with lean, which then encodes and decodes) a function
        # that builds one the first time Tokenizer.backend is read
        self._backend = backend
        self._lean = lean
        self._n_vocab = int(n_vocab)
        # vocabulary strings by id, as the source spells them
        self._pieces = pieces if isinstance(pieces, PieceTable) else PieceTable(pieces)
        self._piece_kind = piece_kind  # "byte_level" | "spm" | "backend": how a piece maps to bytes
        self._bos_id = bos_id
        self._eos_id = eos_id
        self._eos_ids = frozenset(i for i in eos_ids if i is not None)
        self._unk_id = unk_id
        self._pad_id = pad_id
        self._add_bos = bool(add_bos)
        self._add_eos = bool(add_eos)
        self._strip_prefix_space = strip_prefix_space
        self._chat_template = chat_template
        self._special_ids = frozenset(special_ids)
        self.source = source
        self._lock = threading.Lock()
        self._piece_bytes: list[bytes] | None = None
        self._piece_memo: dict[int, bytes] = {}   # decode_bytes' pieces so far (the whole table costs
                                                  # ~0.3 s at 262k tokens: built only when asked for)
        self._token_ids: dict[str, int] | None = None
        self._added_contents: dict[int, str] = lean.added_contents() if lean is not None else {
            i: t.content for i, t in backend.get_added_tokens_decoder().items()}

    # ------------------------------------------------------------------ construction: GGUF
    @classmethod
    def from_gguf(cls, metadata: dict, path: str | os.PathLike, lean: bool = True) -> "Tokenizer":
        """Build from a GGUF file's metadata (GGUFFile(path).metadata); `path` names it in errors.

        lean: a SentencePiece vocabulary without merges in the file encodes with ringllm's own BPE
        (models/spm_bpe.py: the same ids, without building the merges); False builds the `tokenizers`
        backend at once, as every other vocabulary does."""
        path = os.fspath(path)
        model = metadata.get("tokenizer.ggml.model")
        if model is None:
            raise ModelFileError(path, "metadata key 'tokenizer.ggml.model' is missing: the file "
                                 "carries no tokenizer")
        if model not in SUPPORTED_GGUF_MODELS:
            raise UnsupportedModelError(
                path, f"tokenizer.ggml.model is {model!r}, which ringllm does not support "
                f"(supported: {', '.join(SUPPORTED_GGUF_MODELS)})")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ModelFileError(path, "metadata key 'tokenizer.ggml.tokens' is missing: the file "
                                 "has no vocabulary")
        tokens = _as_list(tokens)
        try:
            pieces = PieceTable(tokens)      # its join also checks that every token is a str
        except TypeError:
            pieces = None
        if not tokens or pieces is None:
            raise ModelFileError(path, "metadata key 'tokenizer.ggml.tokens' is not a non-empty "
                                 "list of strings")
        n = len(tokens)
        types = _as_list(metadata.get("tokenizer.ggml.token_type"))
        if types and len(types) != n:
            raise ModelFileError(path, f"tokenizer.ggml.token_type has {len(types)} entries but "
                                 f"tokenizer.ggml.tokens has {n}")
        if not types:
            types = [TOKEN_NORMAL] * n
        try:
            types_arr = np.asarray(types, np.int64)
        except (TypeError, ValueError, OverflowError):
            raise ModelFileError(path, "metadata key 'tokenizer.ggml.token_type' is not a list of "
                                 "integers") from None

        def token_id(key: str) -> int | None:
            value = metadata.get(key)
            if value is None:
                return None
            value = int(value)
            if value < 0 or value == 0xFFFFFFFF:  # llama.cpp writes -1 / UINT32_MAX for "none"
                return None
            if value >= n:
                raise ModelFileError(path, f"{key} is {value}, past the vocabulary of {n} tokens")
            return value

        bos_id = token_id("tokenizer.ggml.bos_token_id")
        eos_id = token_id("tokenizer.ggml.eos_token_id")
        unk_id = token_id("tokenizer.ggml.unknown_token_id")
        pad_id = token_id("tokenizer.ggml.padding_token_id")
        arch = str(metadata.get("general.architecture", ""))
        named = (bos_id, eos_id, unk_id, pad_id)

        encoder = None
        if model == "gpt2":
            backend, encoder = cls._byte_level_backend(metadata, path, tokens, pieces, types_arr, named, lean)
            strip_prefix = False
            piece_kind = "byte_level"
            add_bos_default = False
        else:
            backend, encoder, strip_prefix = cls._spm_backend(metadata, path, tokens, pieces, types_arr, arch,
                                                              unk_id, named, lean)
            piece_kind = "spm"
            add_bos_default = True  # llama.cpp's and transformers' rule for SentencePiece files

        add_bos = metadata.get("tokenizer.ggml.add_bos_token")
        add_bos = add_bos_default if add_bos is None else bool(add_bos)
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        if add_bos and bos_id is None:
            raise ModelFileError(path, "tokenizer.ggml.add_bos_token is set but the file names no "
                                 "BOS token (tokenizer.ggml.bos_token_id)")

        control = np.flatnonzero((types_arr == TOKEN_CONTROL) | (types_arr == TOKEN_UNKNOWN)).tolist()
        special = set(control) | {i for i in (bos_id, eos_id, unk_id, pad_id) if i is not None}
        eos_ids = {eos_id} if eos_id is not None else set()
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            i = token_id(key)
            if i is not None:
                eos_ids.add(i)
        eot_texts = set(END_OF_TURN_TOKENS)
        eos_ids.update(i for i in control if tokens[i] in eot_texts)

        template = metadata.get("tokenizer.chat_template")
        return cls(backend, n_vocab=n, pieces=pieces, piece_kind=piece_kind, bos_id=bos_id,
                   eos_id=eos_id, eos_ids=eos_ids, unk_id=unk_id, pad_id=pad_id, add_bos=add_bos,
                   add_eos=add_eos, strip_prefix_space=strip_prefix,
                   chat_template=template if isinstance(template, str) else None,
                   special_ids=special, source=path, lean=encoder)

    @staticmethod
    def _added_list(tokens: Sequence[str], types: Sequence[int], in_vocab,
                    named: Iterable[int | None] = ()) -> list[tuple[str, bool]]:
        """(text, special) of the added tokens, in the order they are added: CONTROL and UNKNOWN tokens
        and the BOS/EOS/UNK/PAD the file names as special tokens, then USER_DEFINED ones as plain
        added tokens. Both are matched whole in the text."""
        special_types = (TOKEN_CONTROL, TOKEN_UNKNOWN)
        named = {i for i in named if i is not None}
        # the tokens that are not plain vocabulary entries, without a Python pass over all of them
        types_arr = np.asarray(types, np.int64)
        marked = sorted(set(np.flatnonzero(types_arr != TOKEN_NORMAL).tolist()) | named)
        control = [(tokens[i], True) for i in marked
                   if (types[i] in special_types or i in named) and in_vocab(tokens[i], TOKEN_CONTROL)]
        user = [(tokens[i], False) for i in marked
                if types[i] == TOKEN_USER_DEFINED and in_vocab(tokens[i], TOKEN_USER_DEFINED)]
        return control + user

    @staticmethod
    def _add_to_backend(backend, added: Sequence[tuple[str, bool]]) -> None:
        """Add the _added_list tokens to a `tokenizers` backend (matched on the raw text)."""
        from tokenizers import AddedToken

        control = [AddedToken(t, normalized=False, special=True) for t, special in added if special]
        if control:
            backend.add_special_tokens(control)
        user = [AddedToken(t, normalized=False, special=False) for t, special in added if not special]
        if user:
            backend.add_tokens(user)

    @classmethod
    def _byte_level_backend(cls, metadata, path, tokens, pieces, types, named, lean):
        """(backend, lean encoder or None) of a byte-level ("gpt2") vocabulary. With lean, the encoder
        is models/byte_bpe.py's and the backend a function that builds the `tokenizers` one from the
        same parts when first asked for."""
        merges_raw = metadata.get("tokenizer.ggml.merges")
        if merges_raw is None:
            raise ModelFileError(path, "metadata key 'tokenizer.ggml.merges' is missing: a gpt2 "
                                 "(byte-level BPE) vocabulary needs its merges")
        outside = _OUTSIDE_BYTE_ALPHABET.search
        if outside("".join(tokens)) is None:        # every token in the byte alphabet: one search
            vocab: dict[str, int] = dict(zip(tokens, range(len(tokens))))
            texts = pieces
        else:
            # Tokens written as plain text rather than in the byte alphabet (some added tokens) are
            # respelled, so the BPE model and the byte-level decoder agree on them.
            texts = ["".join(_BYTE_TO_CHAR[b] for b in t.encode("utf-8")) if outside(t) else t for t in tokens]
            vocab = dict(zip(texts, range(len(texts))))
        merges = _checked_merges(_as_list(merges_raw), vocab, path)
        pre_tokenizer = _byte_level_pre_tokenizer(metadata.get("tokenizer.ggml.pre") or "default", path)
        # A CONTROL token spelled outside the byte alphabet cannot be a real byte-level token
        # (a mislabel in the file): it stays out of the added tokens, as transformers does.
        added = cls._added_list(tokens, types,
                                lambda t, ty: not outside(t) if ty == TOKEN_CONTROL else t in vocab, named)

        def build():
            from tokenizers import Tokenizer as Backend
            from tokenizers import decoders, models

            try:
                backend = Backend(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges],
                                             dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                                             fuse_unk=False))
            except Exception as exc:  # tokenizers raises plain Exception for a merge of unknown tokens
                raise ModelFileError(path, f"the vocabulary and merges are inconsistent: {exc}") from exc
            backend.pre_tokenizer = pre_tokenizer
            backend.decoder = decoders.ByteLevel()
            cls._add_to_backend(backend, added)
            return backend

        if lean:
            return build, ByteLevelBPE(vocab, merges, pre_tokenizer, texts,
                                       [(t, vocab[t], special) for t, special in added], _byte_level_bytes)
        return build(), None

    @classmethod
    def _spm_backend(cls, metadata, path, tokens, pieces, types, arch, unk_id, named, lean):
        """(backend, lean encoder or None, add_space_prefix) of a SentencePiece ("llama") vocabulary.
        Without merges in the file and with lean, the encoder is models/spm_bpe.py's and the backend a
        function that builds the `tokenizers` one from the same parts when first asked for."""
        gemma = arch in _GEMMA_ARCHS
        vocab_tokens = _gemma_spelling(tokens, pieces) if gemma else list(tokens)
        merges_raw = metadata.get("tokenizer.ggml.merges")
        merges = ranks = None
        if merges_raw is not None:
            merges = []
            for k, m in enumerate(_as_list(merges_raw)):
                parts = m.split(" ")
                if len(parts) != 2:
                    raise ModelFileError(path, f"tokenizer.ggml.merges[{k}] is {m!r}, not two "
                                         "tokens separated by one space")
                merges.append((parts[0], parts[1]))
        elif not gemma:                 # Gemma's rank is the token's index: ranks stays None
            scores = metadata.get("tokenizer.ggml.scores")
            if scores is None:
                raise ModelFileError(path, "metadata key 'tokenizer.ggml.scores' is missing: a "
                                     "llama (SentencePiece) vocabulary without merges needs scores")
            scores = _as_list(scores)
            if len(scores) != len(tokens):
                raise ModelFileError(path, f"tokenizer.ggml.scores has {len(scores)} entries but "
                                     f"tokenizer.ggml.tokens has {len(tokens)}")
            ranks = [float(s) for s in scores]
        vocab = dict(zip(vocab_tokens, range(len(vocab_tokens))))     # a later duplicate wins, as in a loop
        if unk_id is not None:
            unk = vocab_tokens[unk_id]
        else:
            unk = "<unk>" if "<unk>" in vocab else None
        prefix = metadata.get("tokenizer.ggml.add_space_prefix")
        prefix = True if prefix is None else bool(prefix)  # llama.cpp's default
        added = cls._added_list(tokens, types, lambda t, ty: t in vocab, named)

        def build():
            nonlocal merges
            if merges is None:
                merges = cached_merges(vocab_tokens, [-i for i in range(len(vocab_tokens))] if ranks is None
                                       else ranks, derive_merges)
            try:
                return _spm_tokenizers_backend(vocab, merges, unk, prefix, added)
            except Exception as exc:
                raise ModelFileError(path, f"the vocabulary and merges are inconsistent: {exc}") from exc

        if merges_raw is None and lean:
            encoder = SentencePieceBPE(vocab, vocab_tokens, pieces, ranks, unk, prefix,
                                       [(t, vocab[t], special) for t, special in added])
            return build, encoder, prefix
        return build(), None, prefix

    # ------------------------------------------------------------------ construction: HF dir
    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Build from a Hugging Face model folder: tokenizer.json, plus tokenizer_config.json,
        special_tokens_map.json, chat_template.jinja / chat_template.json and
        generation_config.json when present."""
        from tokenizers import Tokenizer as Backend

        path = os.fspath(path)
        if not os.path.isdir(path):
            raise ModelFileError(path, "no such directory" if not os.path.exists(path)
                                 else "is not a directory (expected a model folder with tokenizer.json)")
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise ModelFileError(path, "tokenizer.json is missing: ringllm reads HF tokenizers only "
                                 "in their tokenizer.json form (save it with a fast tokenizer's "
                                 "save_pretrained)")
        try:
            backend = Backend.from_file(tj)
        except Exception as exc:
            raise ModelFileError(tj, f"not a readable tokenizer.json: {exc}") from exc

        def read_json(name: str) -> dict:
            p = os.path.join(path, name)
            if not os.path.isfile(p):
                return {}
            try:
                with open(p, encoding="utf-8") as fh:
                    data = json.load(fh)
            except (OSError, ValueError) as exc:
                raise ModelFileError(p, f"not readable JSON: {exc}") from exc
            if not isinstance(data, dict):
                raise ModelFileError(p, "expected a JSON object")
            return data

        config = read_json("tokenizer_config.json")
        special_map = read_json("special_tokens_map.json")
        gen_config = read_json("generation_config.json")

        def token_text(name: str) -> str | None:
            for source in (config, special_map):
                value = source.get(name)
                if isinstance(value, dict):
                    value = value.get("content")
                if isinstance(value, str):
                    return value
            return None

        def id_of(name: str) -> int | None:
            text = token_text(name)
            return backend.token_to_id(text) if text is not None else None

        bos_id, eos_id = id_of("bos_token"), id_of("eos_token")
        unk_id, pad_id = id_of("unk_token"), id_of("pad_token")

        # What the tokenizer.json's post-processor adds around a text, unless the config says.
        bare = backend.encode("a", add_special_tokens=False).ids
        full = backend.encode("a", add_special_tokens=True).ids
        pp_bos = len(full) > len(bare) and full[0] != bare[0]
        pp_eos = len(full) > len(bare) and full[-1] != bare[-1]
        if pp_bos and bos_id is None:
            bos_id = full[0]
        add_bos = config.get("add_bos_token", pp_bos)
        add_eos = config.get("add_eos_token", pp_eos)
        add_bos = bool(add_bos) and bos_id is not None

        added = backend.get_added_tokens_decoder()
        special = {i for i, t in added.items() if t.special}
        special |= {i for i in (bos_id, eos_id, unk_id, pad_id) if i is not None}
        eos_ids = {eos_id} if eos_id is not None else set()
        gen_eos = gen_config.get("eos_token_id")
        for i in (gen_eos if isinstance(gen_eos, list) else [gen_eos]):
            if isinstance(i, int):
                eos_ids.add(i)
        eot_texts = set(END_OF_TURN_TOKENS)
        eos_ids.update(i for i, t in added.items() if t.special and t.content in eot_texts)

        template = None
        jinja_path = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as fh:
                template = fh.read()
        else:
            template = config.get("chat_template")
            if template is None:
                template = read_json("chat_template.json").get("chat_template")
            if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
                named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                template = named.get("default", next(iter(named.values()), None))
            if not isinstance(template, str):
                template = None

        n_vocab = backend.get_vocab_size(with_added_tokens=True)
        id_to_token = {i: t for t, i in backend.get_vocab(with_added_tokens=True).items()}
        pieces = [id_to_token.get(i, "") for i in range(n_vocab)]
        piece_kind = _piece_kind_of(backend)
        strip_prefix = piece_kind == "spm" and '"Strip"' in _state(backend.decoder)
        return cls(backend, n_vocab=n_vocab, pieces=pieces, piece_kind=piece_kind, bos_id=bos_id,
                   eos_id=eos_id, eos_ids=eos_ids, unk_id=unk_id, pad_id=pad_id, add_bos=add_bos,
                   add_eos=bool(add_eos), strip_prefix_space=strip_prefix, chat_template=template,
                   special_ids=special, source=path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Tokenizer":
        """From a .gguf file or a HF model folder."""
        path = os.fspath(path)
        if os.path.isdir(path):
            return cls.from_hf_dir(path)
        from ringllm.models.gguf_file import GGUFFile

        return cls.from_gguf(GGUFFile(path).metadata, path)

    # ------------------------------------------------------------------ properties
    @property
    def n_vocab(self) -> int:
        return self._n_vocab

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def bos_token(self) -> str:
        """Text of the BOS token ("" when the model has none), e.g. for a chat template."""
        return self._added_contents.get(self._bos_id, self._pieces[self._bos_id]) \
            if self._bos_id is not None else ""

    @property
    def eos_token(self) -> str:
        """Text of the EOS token ("" when the model has none)."""
        return self._added_contents.get(self._eos_id, self._pieces[self._eos_id]) \
            if self._eos_id is not None else ""

    @property
    def eos_ids(self) -> frozenset[int]:
        """EOS plus the end-of-turn tokens of the vocabulary: generation stops on any of them."""
        return self._eos_ids

    @property
    def unk_id(self) -> int | None:
        return self._unk_id

    @property
    def pad_id(self) -> int | None:
        return self._pad_id

    @property
    def add_bos(self) -> bool:
        """Whether encode() puts BOS in front by default (the model's rule)."""
        return self._add_bos

    @property
    def add_eos(self) -> bool:
        return self._add_eos

    @property
    def chat_template(self) -> str | None:
        """The model's own chat template (Jinja source), or None when it has none."""
        return self._chat_template

    @property
    def special_ids(self) -> frozenset[int]:
        """Control tokens (BOS, EOS, <|im_start|>, ...): decode(skip_special=True) leaves them out."""
        return self._special_ids

    @property
    def backend(self):
        """The `tokenizers.Tokenizer` of this vocabulary (read it, do not modify it). Where ringllm
        encodes itself (a SentencePiece GGUF vocabulary, models/spm_bpe.py) it is built on first use,
        for the caller alone: encode and decode do not go through it."""
        with self._lock:
            if callable(self._backend) and self._lean is not None:
                self._backend = self._backend()
            return self._backend

    def token_to_id(self, text: str) -> int | None:
        """Id of the vocabulary entry spelled `text` (as the model file spells it), or None."""
        if self._token_ids is None:
            ids: dict[str, int] = {}
            for i, t in enumerate(self._pieces):
                ids.setdefault(t, i)
            self._token_ids = ids
        return self._token_ids.get(text)

    def vocabulary_table(self) -> PieceTable:
        """The vocabulary's strings by id, as this tokenizer holds them (what id_to_token reads)."""
        return self._pieces

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of `token_id`, as the model file spells it."""
        self._check_ids([token_id])
        return self._pieces[token_id]

    def __len__(self) -> int:
        return self._n_vocab

    def __repr__(self) -> str:
        return (f"Tokenizer(n_vocab={self._n_vocab}, kind={self._piece_kind}, bos={self._bos_id}, "
                f"eos={self._eos_id}, add_bos={self._add_bos}, source={self.source!r})")

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True,
               add_eos: bool | None = None) -> list[int]:
        """Token ids of `text`.

        add_bos / add_eos: None follows the model's rule (the `add_bos` / `add_eos` properties).
        parse_special: True matches control-token strings such as "<|im_start|>" in the text as
        those tokens; False tokenizes them as plain text (use it for untrusted user text).
        User-defined tokens are matched either way.
        """
        if not isinstance(text, str):
            raise ConfigError(f"encode() takes a str, got {type(text).__name__}")
        _check_unicode(text)
        if self._lean is not None:
            ids = self._lean.encode(text, parse_special)
        else:
            with self._lock:
                self._backend.encode_special_tokens = not parse_special
                try:
                    ids = self._backend.encode(text, add_special_tokens=False).ids
                finally:
                    self._backend.encode_special_tokens = False
        if self._add_bos if add_bos is None else add_bos:
            if self._bos_id is None:
                raise ConfigError("add_bos=True but this model has no BOS token")
            ids.insert(0, self._bos_id)
        if self._add_eos if add_eos is None else add_eos:
            if self._eos_id is None:
                raise ConfigError("add_eos=True but this model has no EOS token")
            ids.append(self._eos_id)
        return ids

    def _check_ids(self, ids) -> list[int]:
        out = []
        n = self._n_vocab
        for i in ids:
            try:
                v = int(i)
            except (TypeError, ValueError):
                raise ConfigError(f"token id {i!r} is not an integer") from None
            if v != i or not 0 <= v < n:
                raise ConfigError(f"token id {i!r} is outside the vocabulary (0..{n - 1})")
            out.append(v)
        return out

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids` (as transformers' decode gives it)."""
        ids = self._check_ids(ids)
        if self._lean is not None:
            return self._lean.decode(ids, skip_special)
        return self._backend.decode(ids, skip_special_tokens=skip_special)

    def _piece(self, i: int) -> bytes:
        """Token i's bytes inside a text (a control token: its text)."""
        content = self._added_contents.get(i)
        if content is not None:
            return content.encode("utf-8")
        if self._piece_kind == "byte_level":
            return _byte_level_bytes(self._pieces[i])
        if self._piece_kind == "spm":
            return _spm_bytes(self._pieces[i])
        return self._backend.decode([i], skip_special_tokens=False).encode("utf-8")

    def _piece_table(self) -> list[bytes]:
        if self._piece_bytes is None:
            n = self._n_vocab if self._piece_kind == "backend" else len(self._pieces)
            self._piece_bytes = [self._piece(i) for i in range(n)]
        return self._piece_bytes

    def token_bytes(self) -> list[bytes]:
        """Every token's bytes, by id, as it appears inside a text (what decode_bytes joins; a
        control token is its text): the vocabulary a constraint engine matches against."""
        return list(self._piece_table())

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False,
                     strip_prefix: bool = True) -> bytes:
        """The bytes of `ids`: what decode() gives, before UTF-8 decoding, so a character split
        over several tokens (byte-level BPE, <0xNN> byte tokens) can be put together by the caller.

        strip_prefix: drop the space a SentencePiece tokenizer with add_space_prefix puts before
        the first word, as decode() does; False for pieces in the middle of a text (streaming).
        """
        ids = self._check_ids(ids)
        memo = self._piece_memo
        special = self._special_ids if skip_special else ()
        parts = []
        for i in ids:
            if i in special:
                continue
            piece = memo.get(i)
            if piece is None:
                piece = memo[i] = self._piece(i)
            parts.append(piece)
        out = b"".join(parts)
        if strip_prefix and self._strip_prefix_space and out.startswith(b" "):
            out = out[1:]
        return out

    def token_to_piece(self, token_id: int) -> str:
        """Text of one token as it appears inside a text (a SentencePiece word start keeps its
        space). A token that is only part of a UTF-8 character gives U+FFFD: stream with
        decode_bytes or StreamDecoder instead."""
        return self.decode_bytes([token_id], strip_prefix=False).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_unicode(text: str) -> None:
    """ConfigError when `text` holds a lone surrogate (a str can, e.g. from JSON "\\ud800" or bytes
    decoded with surrogateescape); such text has no UTF-8 form, so no tokens."""
    bad = _SURROGATE.search(text)
    if bad is not None:
        raise ConfigError(f"text is not valid Unicode: a lone surrogate U+{ord(bad.group()):04X} at character "
                          f"{bad.start()}; decode bytes with errors='replace' or remove it")


def _state(obj) -> str:
    if obj is None:
        return ""
    try:
        state = obj.__getstate__()
    except Exception:
        return ""
    return state.decode("utf-8", "replace") if isinstance(state, bytes) else str(state)


def _piece_kind_of(backend) -> str:
    decoder = _state(backend.decoder)
    if '"ByteLevel"' in decoder:
        return "byte_level"
    if '"ByteFallback"' in decoder or '"Metaspace"' in decoder:
        return "spm"
    return "backend"
