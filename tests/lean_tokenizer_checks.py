"""Checks shared by the tests of ringllm's own encoders (tests/test_spm_bpe.py, tests/test_byte_bpe.py):
the lean tokenizer against the `tokenizers` backend built from the same GGUF metadata."""
from __future__ import annotations

import random

__all__ = ["assert_same", "novel_slices", "random_texts"]


def assert_same(lean, oracle, texts) -> None:
    """Same ids for every text, both ways of treating special tokens, and the same decoded text."""
    for text in texts:
        for parse_special in (True, False):
            ids = oracle.encode(text, parse_special=parse_special, add_bos=False)
            assert lean.encode(text, parse_special=parse_special, add_bos=False) == ids, (text, parse_special)
            for skip in (False, True):
                assert lean.decode(ids, skip_special=skip) == oracle.decode(ids, skip_special=skip), (text, skip)


def random_texts(alphabet, count, seed, longest=40) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, longest))) for _ in range(count)]


def novel_slices(novel: str, count: int = 200, seed: int = 0, longest: int = 600) -> list[str]:
    """`count` random slices of the novel, 1 to `longest` characters."""
    rng = random.Random(seed)
    starts = [rng.randrange(len(novel)) for _ in range(count)]
    return [novel[a:a + rng.randrange(1, longest)] for a in starts]
