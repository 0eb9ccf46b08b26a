"""models/spm_bpe.py: ringllm's own SentencePiece-style BPE against the `tokenizers` backend built
from the same GGUF vocabulary (Tokenizer.from_gguf(..., lean=False)), which tests/test_tokenizer.py
checks against transformers. Same ids for every text, both ways of treating special tokens, and the
same decoded text."""
from __future__ import annotations

import pytest

from ringllm.models.piece_table import PieceTable
from ringllm.models.spm_bpe import SPIECE_SPACE
from ringllm.models.tokenizer import Tokenizer

from conftest import novel_text
from lean_tokenizer_checks import assert_same, novel_slices, random_texts
from spm_vocabulary import tiny_spm_metadata

S = SPIECE_SPACE


@pytest.fixture(scope="module")
def novel() -> str:
    return novel_text()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("with_meta, all_bytes, prefix", [(True, True, True), (True, False, False),
                                                          (False, True, True), (False, False, False)])
def test_random_vocabularies(seed, with_meta, all_bytes, prefix):
    md = tiny_spm_metadata(seed, with_meta, all_bytes, prefix)
    lean = Tokenizer.from_gguf(md, "tiny.gguf")
    oracle = Tokenizer.from_gguf(md, "tiny.gguf", lean=False)
    assert lean._lean is not None and oracle._lean is None
    alphabet = list("abcdx<>/ ") + [S, "é", "日", "\n", "<tool>", "<<tool>>", "<s>", f">{S}</", "> </"]
    texts = ["", " ", "a", f"{S}", "日日a日", "é日é", "<<tool>>", "<<tool>", "x> </x> </"]
    assert_same(lean, oracle, texts + random_texts(alphabet, 400, seed))


def test_backend_is_built_on_first_use():
    md = tiny_spm_metadata(0, True, True, True)
    tok = Tokenizer.from_gguf(md, "tiny.gguf")
    assert callable(tok._backend)
    backend = tok.backend
    assert backend is tok.backend and not callable(tok._backend)
    assert backend.encode("abc <tool> d", add_special_tokens=False).ids == tok.encode("abc <tool> d", add_bos=False)


@pytest.fixture(scope="module")
def gemma3_pair():
    from ringllm.models.bundled import gemma3_model_path
    from ringllm.models.gguf_file import GGUFFile

    try:
        path = gemma3_model_path()
    except Exception as exc:  # noqa: BLE001 - any reason the packaged model is missing
        pytest.skip(f"Gemma 3 model not available: {exc}")
    md = GGUFFile(path).metadata
    return Tokenizer.from_gguf(md, path), Tokenizer.from_gguf(md, path, lean=False)


def test_gemma3_novel_and_corners(gemma3_pair, novel):
    lean, oracle = gemma3_pair
    slices = novel_slices(novel)
    corners = ["<b> </b>", "a> </b", "x>  </y", "> </ > </> </", f"{S}literal{S} marks{S}{S}x",
               "tabs\t\tand\n\nnew  lines   ", "   ", "<start_of_turn> user", "héllo wörld ÿ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🙂",
               "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "<start_of_turn", "\x00\x01"]
    alphabet = list(" ><\n\tab/é😀") + [S, "</", "> </", "<start_of_turn>", "<end_of_turn>", "<mask>"]
    assert_same(lean, oracle, slices + corners + random_texts(alphabet, 600, 1))


def test_gemma3_whole_novel(gemma3_pair, novel):
    """A long text is one word: cut into pieces and remembered, the same ids as in one piece."""
    lean, oracle = gemma3_pair
    text = novel[:100_000]
    assert lean.encode(text) == oracle.encode(text)


def test_piece_table_scans():
    table = PieceTable(["a", "  ", " ", "", "b ", " b", "   ", f"{S}a", f"a{S}b", f"{S}{S}", f"{S}{S}x{S}", f"é{S}"])
    assert table.runs_of(" ").tolist() == [1, 2, 6]
    assert table.after_other(S) == [8, 10, 11]
    with pytest.raises(ValueError, match="one-byte"):
        table.runs_of(S)
