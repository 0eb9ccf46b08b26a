"""PieceTable (models/piece_table.py): a vocabulary held as one UTF-8 buffer reads back exactly the
strings it was made from, whatever they hold, and a GGUF tokenizer's table is the file's vocabulary."""
from __future__ import annotations

import sys

import pytest

from ringllm.models.piece_table import PieceTable

CASES = [
    [],
    ["a"],
    ["", "", ""],
    ["a\0b", "\0", "c"],                                  # the separator inside pieces: the slow path
    ["héllo", "", "▁the", "\ud800x", "<0x00>", "日本語", "Ġworld", "\n\n"],
]


@pytest.mark.parametrize("pieces", CASES)
def test_reads_back_every_piece_by_index_slice_and_iteration(pieces):
    table = PieceTable(pieces)
    assert len(table) == len(pieces)
    assert list(table) == pieces
    assert [table[i] for i in range(len(pieces))] == pieces
    assert [table[-1 - i] for i in range(len(pieces))] == pieces[::-1]
    assert table[1:] == pieces[1:] and table[::2] == pieces[::2]
    assert table == pieces and table == PieceTable(pieces)
    for bad in (len(pieces), -len(pieces) - 1):
        with pytest.raises(IndexError):
            table[bad]


def test_a_gguf_tokenizer_holds_the_files_vocabulary_in_a_fraction_of_a_lists_memory(smollm2_path):
    from ringllm.models.gguf_file import GGUFFile
    from ringllm.models.tokenizer import Tokenizer

    metadata = GGUFFile(smollm2_path).metadata
    tokens = metadata["tokenizer.ggml.tokens"]
    tok = Tokenizer.from_gguf(metadata, smollm2_path)
    assert [tok.id_to_token(i) for i in range(len(tokens))] == tokens
    assert tok.token_to_id(tokens[1234]) == 1234
    as_list = sys.getsizeof(tokens) + sum(sys.getsizeof(t) for t in tokens)
    assert tok._pieces.nbytes * 4 < as_list
