"""Packing chunk by chunk (packing.pack_in_chunks) writes the same bytes as packing a matrix at once.

A tile's records depend on its own rows only, so cutting a matrix into chunks of whole tiles, or
stacking it from row blocks (q|k|v), must not change a byte: each type is packed with chunks of a
single tile and compared bitwise with the one-shot packing, including a last, partial tile.
"""
import numpy as np
import pytest

from ringllm.runtime import packing
from ringllm.runtime.packing import pack_records
from ringllm.runtime.packing_q8 import pack_records_q8
from ringllm.runtime.quant_types import BLOCK_LAYOUT, GGMLType

TYPES = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K,
         GGMLType.Q3_K, GGMLType.IQ4_XS]


@pytest.mark.parametrize("pack", [pack_records, pack_records_q8])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_chunked_packing_is_bitwise_the_one_shot(monkeypatch, pack, qtype):
    block, size = BLOCK_LAYOUT[qtype]
    n_rows, n_cols = 53, 512                       # 53: the last tile is partial for every tile height
    data = np.random.default_rng(int(qtype)).integers(0, 256, (n_rows, n_cols // block * size), dtype=np.uint8)
    whole = pack(qtype, data, n_rows, n_cols).tobytes()
    monkeypatch.setattr(packing, "PACK_CHUNK_BYTES", 1)     # one tile per chunk
    assert pack(qtype, data, n_rows, n_cols).tobytes() == whole
    assert pack(qtype, [data[:20], data[20:]], n_rows, n_cols).tobytes() == whole
