"""A small random byte-level BPE vocabulary as GGUF metadata, for tests/test_byte_bpe.py and the
byte_bpe fuzz target: models/byte_bpe.py against the `tokenizers` backend built from the same metadata."""
from __future__ import annotations

import random

from ringllm.models.tokenizer import byte_alphabet

__all__ = ["tiny_byte_metadata", "BYTE_PRE_TOKENIZERS"]

BYTE_PRE_TOKENIZERS = ("gpt-2", "llama3", "qwen2", "starcoder")
_SPACE, _NEWLINE = byte_alphabet()[0x20], byte_alphabet()[0x0A]     # "Ġ", "Ċ"


def tiny_byte_metadata(seed: int, all_bytes: bool = True) -> dict:
    """GGUF metadata of a small random byte-level vocabulary with the corners the encoder must get
    right: merges in random order with one listed twice, a token made by two different merges (the
    queue checks the token, not the pair), two tokens with one text, a control token spelled
    outside the byte alphabet (left out), a user-defined token written as plain UTF-8 (respelled),
    control tokens one inside another; not all_bytes: two byte values have no token (their
    characters are left out of a word). The pre-tokenizer cycles through BYTE_PRE_TOKENIZERS."""
    rng = random.Random(seed)
    alphabet = byte_alphabet()
    byte_values = range(256) if all_bytes else [b for b in range(256) if b not in (0xE6, 0x97)]
    singles = [alphabet[b] for b in byte_values]
    base = list("abcd1'") + [_SPACE, _NEWLINE]
    tokens = list(singles)
    known = set(tokens)
    merges: list[str] = []
    while len(merges) < 70:
        left = rng.choice(base + tokens[256:] if rng.random() < 0.6 else base)
        right = rng.choice(base + tokens[256:] if rng.random() < 0.3 else base)
        made = left + right
        if len(made) > 6 or f"{left} {right}" in merges:
            continue
        merges.append(f"{left} {right}")
        if made not in known:
            known.add(made)
            tokens.append(made)
    # a token two merges make: "abc" from "ab c" and "a bc", in that order
    for t in ("ab", "bc", "abc"):
        if t not in known:
            known.add(t)
            tokens.append(t)
    merges += ["a b", "b c", "ab c", "a bc"]
    rng.shuffle(merges)
    merges.append(merges[len(merges) // 2])            # one merge listed twice: the later rank counts
    tokens.append(tokens[300])                          # a duplicate text
    n_normal = len(tokens)
    tokens += ["<|im_start|>", "<|im_end|>", "<|im|>", "<tool>", "\u65e5\u672c", "\u2581ctl"]
    types = [1] * n_normal + [3, 3, 3, 4, 4, 3]
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": BYTE_PRE_TOKENIZERS[seed % len(BYTE_PRE_TOKENIZERS)],
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": n_normal, "tokenizer.ggml.eos_token_id": n_normal + 1,
    }
