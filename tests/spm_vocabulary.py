"""A small random SentencePiece vocabulary as GGUF metadata, for tests/test_spm_bpe.py and the spm_bpe
fuzz target: models/spm_bpe.py against the `tokenizers` backend built from the same metadata."""
from __future__ import annotations

import random

from ringllm.models.spm_bpe import SPIECE_SPACE as S

__all__ = ["tiny_spm_metadata"]


def tiny_spm_metadata(seed: int, with_meta: bool = True, all_bytes: bool = True, prefix: bool = True) -> dict:
    """GGUF metadata of a small random SentencePiece vocabulary with the corners the encoder must get
    right: tied scores, two tokens with one text, tokens that hold "▁" after another character
    (with_meta; without it "▁" itself has no token), a character without a token ("é": byte
    tokens), bytes without byte tokens (not all_bytes: "日" becomes the unknown token), control and
    user-defined tokens, one inside another; prefix: add_space_prefix."""
    rng = random.Random(seed)
    chars = list("abcd<>/ ") + ([S] if with_meta else [])
    singles = [c for c in chars if c != " "] + ["x"]
    multi = set()
    while len(multi) < 60:
        multi.add("".join(rng.choice(singles) for _ in range(rng.randrange(2, 6))))
    multi = sorted(multi) + ([f"b{S}c", f">{S}</", f"{S}{S}", f"{S}{S}{S}"] if with_meta else [])
    byte_values = range(256) if all_bytes else [b for b in range(256) if b not in (0xE6, 0x97)]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in byte_values] + singles + multi
    tokens += [multi[3], "<tool>", "<<tool>>"]               # a duplicate text; user-defined; control
    types = [2, 3, 3] + [6] * len(byte_values) + [1] * (len(singles) + len(multi)) + [1, 4, 3]
    scores = [0.0] * (3 + len(byte_values)) + [float(rng.randrange(-6, 0)) for _ in singles + multi]
    scores += [-1.0, 0.0, 0.0]
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_space_prefix": prefix,
    }
