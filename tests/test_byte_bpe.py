"""models/byte_bpe.py: ringllm's own byte-level BPE against the `tokenizers` backend built from the
same GGUF vocabulary (Tokenizer.from_gguf(..., lean=False)), which tests/test_tokenizer.py checks
against transformers. Same ids for every text, both ways of treating special tokens, and the same
decoded text for any ids."""
from __future__ import annotations

import random

import pytest

from ringllm.models.tokenizer import Tokenizer
from ringllm.runtime.errors import ModelFileError

from byte_vocabulary import BYTE_PRE_TOKENIZERS, tiny_byte_metadata
from conftest import novel_text
from lean_tokenizer_checks import assert_same, novel_slices, random_texts


@pytest.fixture(scope="module")
def novel() -> str:
    return novel_text()


def _assert_same_decode(lean: Tokenizer, oracle: Tokenizer, count: int, seed: int) -> None:
    """Arbitrary id sequences: split UTF-8 characters, special and shadowed ids, respelled tokens."""
    rng = random.Random(seed)
    for _ in range(count):
        ids = [rng.randrange(lean.n_vocab) for _ in range(rng.randrange(1, 12))]
        for skip in (False, True):
            assert lean.decode(ids, skip_special=skip) == oracle.decode(ids, skip_special=skip), (ids, skip)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("all_bytes", [True, False])
def test_random_vocabularies(seed, all_bytes):
    md = tiny_byte_metadata(seed, all_bytes)
    lean = Tokenizer.from_gguf(md, "tiny.gguf")
    oracle = Tokenizer.from_gguf(md, "tiny.gguf", lean=False)
    assert lean._lean is not None and oracle._lean is None
    alphabet = list("abcd1' \n\t") + ["abc", "é", "日", "日本", "<|im_start|>", "<|im|>", "<tool>", "'s", "  ",
                                      "\u2581ctl", "\u00e6", "\u0157"]
    texts = ["", " ", "a", "abc", "abcabc", "ab c", "a bc", "<|im_start|>user\nhi<|im_end|>", "<|im_start|",
             "1234567", "x's 'll", "\n\n\nabc", "日本語", "\u00e6\u0157"]
    assert_same(lean, oracle, texts + random_texts(alphabet, 300, seed))
    _assert_same_decode(lean, oracle, 300, seed)


def test_every_pre_tokenizer_drawn():
    assert {tiny_byte_metadata(s)["tokenizer.ggml.pre"] for s in range(8)} == set(BYTE_PRE_TOKENIZERS)


def test_backend_is_built_on_first_use():
    md = tiny_byte_metadata(0)
    tok = Tokenizer.from_gguf(md, "tiny.gguf")
    assert callable(tok._backend)
    backend = tok.backend
    assert backend is tok.backend and not callable(tok._backend)
    text = "abc <tool> d<|im_start|>"
    assert backend.encode(text, add_special_tokens=False).ids == tok.encode(text, add_bos=False)


def test_a_merge_of_unknown_parts_never_applies_and_the_backend_refuses_it():
    md = tiny_byte_metadata(1)
    merges = list(md["tokenizer.ggml.merges"]) + ["zz9 qq8"]
    md = dict(md, **{"tokenizer.ggml.merges": merges, "tokenizer.ggml.tokens": md["tokenizer.ggml.tokens"] + ["zz9qq8"],
                     "tokenizer.ggml.token_type": list(md["tokenizer.ggml.token_type"]) + [1]})
    lean = Tokenizer.from_gguf(md, "tiny.gguf")
    assert lean.decode(lean.encode("abc zz9qq8")) == "abc zz9qq8"
    with pytest.raises(ModelFileError, match="inconsistent"):
        lean.backend
    with pytest.raises(ModelFileError, match="inconsistent"):
        Tokenizer.from_gguf(md, "tiny.gguf", lean=False)


def test_a_vocabulary_without_merges_encodes_byte_by_byte():
    md = dict(tiny_byte_metadata(2), **{"tokenizer.ggml.merges": []})
    lean = Tokenizer.from_gguf(md, "tiny.gguf")
    oracle = Tokenizer.from_gguf(md, "tiny.gguf", lean=False)
    assert_same(lean, oracle, ["abc d", "日本 <tool>x", ""])
    assert len(lean.encode("abc", add_bos=False)) == 3


def test_bad_merges_are_refused():
    md = tiny_byte_metadata(1)
    for merges, message in ((["a b", "ab"], r"merges\[1\] is 'ab', not two tokens"),
                            (["ab", "a  b"], r"merges\[0\] is 'ab'"),        # as many spaces as merges
                            (["a b", "a  b"], r"merges\[1\]"), (["a b", "a b\nc d"], r"merges\[1\]"),
                            (["a b", 7], r"merges\[1\] is 7"), (["a q"], "inconsistent: merge 'a q' makes 'aq'")):
        with pytest.raises(ModelFileError, match=message):
            Tokenizer.from_gguf(dict(md, **{"tokenizer.ggml.merges": merges}), "tiny.gguf")


@pytest.fixture(scope="module")
def smollm2_pair():
    from ringllm.models.bundled import default_model_path
    from ringllm.models.gguf_file import GGUFFile

    path = default_model_path()
    md = GGUFFile(path).metadata
    return Tokenizer.from_gguf(md, path), Tokenizer.from_gguf(md, path, lean=False)


def test_smollm2_novel_and_corners(smollm2_pair, novel):
    lean, oracle = smollm2_pair
    slices = novel_slices(novel)
    corners = ["<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "<|im_start", "a  1 end.\n\nNext",
               "tabs\t\tand\n\nnew  lines   ", "   ", "héllo wörld ÿ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🙂", "\x00\x01", "I'm 'll 's",
               "x = f(1234567) + 0.5e-3", "<|endoftext|><|endoftext|>", "\u200b\u00a0\u3000 ", "a\u0301"]
    alphabet = list(" \n\tab'1é😀") + ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>", "Ġ", "ing",
                                        "the"]
    assert_same(lean, oracle, slices + corners + random_texts(alphabet, 400, 1))
    _assert_same_decode(lean, oracle, 400, 2)


def test_smollm2_whole_novel(smollm2_pair, novel):
    lean, oracle = smollm2_pair
    text = novel[:100_000]
    assert lean.encode(text) == oracle.encode(text)
    assert lean.encode(text) == oracle.encode(text)           # from the remembered words
