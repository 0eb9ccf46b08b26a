"""The Numba packers (runtime/packing_kernels.py) write every byte the NumPy packing (packing.py and
packing_q8.py, the oracles) writes, for each type and layout they cover: random blocks (every bit pattern of scales, nibbles and
high bits), row counts below, at and past a tile with a partial last tile, one and several block
columns, a matrix stacked from row blocks (q|k|v), chunks of one tile, read-only file rows, and a
destination that is not zeroed (padding lanes must come out 0 all the same).
"""
import os

import numpy as np
import pytest

from ringllm.runtime import packing
from ringllm.runtime.packing import pack_records
from ringllm.runtime.packing_kernels import (FAST_PACK_TYPES, pack_part_fast, pack_part_q8_fast, pack_records_fast,
                                             pack_records_q8_fast, record_bytes)
from ringllm.runtime.packing_q8 import Q8_OWN_LAYOUT, pack_records_q8
from ringllm.runtime.quant_tiles import tile_rows
from ringllm.runtime.quant_types import BLOCK_LAYOUT, GGMLType

FAST = sorted(FAST_PACK_TYPES, key=int)


def _blocks(qtype, n_rows, nb, seed):
    _, size = BLOCK_LAYOUT[qtype]
    return np.random.default_rng(seed).integers(0, 256, (n_rows, nb * size), dtype=np.uint8)


@pytest.mark.parametrize("qtype", FAST, ids=lambda t: t.name)
@pytest.mark.parametrize("n_rows", [1, 7, 16, 24, 29, 53])
@pytest.mark.parametrize("nb", [1, 3])
def test_fast_packing_is_bitwise_the_numpy_packing(qtype, n_rows, nb):
    block, _ = BLOCK_LAYOUT[qtype]
    data = _blocks(qtype, n_rows, nb, 1000 * int(qtype) + 10 * n_rows + nb)
    want = pack_records(qtype, data, n_rows, nb * block)
    got = pack_records_fast(qtype, data, n_rows, nb * block)
    assert got.nbytes == -(-n_rows // tile_rows(qtype)) * nb * record_bytes(qtype)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("qtype", FAST, ids=lambda t: t.name)
def test_fast_packing_chunked_stacked_and_from_a_file(monkeypatch, tmp_path, qtype):
    block, size = BLOCK_LAYOUT[qtype]
    n_rows, nb = 53, 4
    data = _blocks(qtype, n_rows, nb, int(qtype))
    want = pack_records(qtype, data, n_rows, nb * block).tobytes()
    path = os.path.join(tmp_path, "rows.bin")
    data.tofile(path)
    mapped = np.memmap(path, np.uint8, mode="r").reshape(n_rows, nb * size)       # read-only, as a GGUF's rows
    assert pack_records_fast(qtype, mapped, n_rows, nb * block).tobytes() == want
    monkeypatch.setattr(packing, "PACK_CHUNK_BYTES", 1)                          # one tile per chunk
    assert pack_records_fast(qtype, data, n_rows, nb * block).tobytes() == want
    assert pack_records_fast(qtype, [data[:20], data[20:41], data[41:]], n_rows, nb * block).tobytes() == want


@pytest.mark.parametrize("qtype", FAST, ids=lambda t: t.name)
def test_padding_lanes_are_zero_in_a_dirty_buffer(qtype):
    """pack_in_chunks packs its first chunk into np.empty memory: a partial tile's padding lanes are written 0."""
    block, _ = BLOCK_LAYOUT[qtype]
    n_rows, nb = tile_rows(qtype) + 3, 2
    data = _blocks(qtype, n_rows, nb, 7)
    want = pack_records(qtype, data, n_rows, nb * block)
    dirty = np.full(want.nbytes, 0xA5, np.uint8)
    got = pack_part_fast(qtype, data, n_rows, nb * block, lambda n: dirty[:n])
    np.testing.assert_array_equal(got, want)


def test_other_types_fall_back_to_the_numpy_packing():
    qtype = GGMLType.IQ4_XS
    assert qtype not in FAST_PACK_TYPES
    block, _ = BLOCK_LAYOUT[qtype]
    data = _blocks(qtype, 17, 1, 3)
    np.testing.assert_array_equal(pack_records_fast(qtype, data, 17, block), pack_records(qtype, data, 17, block))


@pytest.mark.parametrize("qtype", sorted(Q8_OWN_LAYOUT, key=int), ids=lambda t: t.name)
@pytest.mark.parametrize("n_rows", [1, 7, 16, 29, 53])
@pytest.mark.parametrize("nb", [1, 3])
def test_fast_q8_packing_is_bitwise_the_numpy_packing(qtype, n_rows, nb):
    block, _ = BLOCK_LAYOUT[qtype]
    data = _blocks(qtype, n_rows, nb, 1000 * int(qtype) + 10 * n_rows + nb + 5)
    np.testing.assert_array_equal(pack_records_q8_fast(qtype, data, n_rows, nb * block),
                                  pack_records_q8(qtype, data, n_rows, nb * block))


@pytest.mark.parametrize("qtype", sorted(Q8_OWN_LAYOUT, key=int), ids=lambda t: t.name)
def test_fast_q8_packing_chunked_stacked_and_dirty(monkeypatch, qtype):
    block, _ = BLOCK_LAYOUT[qtype]
    n_rows, nb = 53, 2
    data = _blocks(qtype, n_rows, nb, 11 + int(qtype))
    want = pack_records_q8(qtype, data, n_rows, nb * block)
    dirty = np.full(want.nbytes, 0x5A, np.uint8)
    np.testing.assert_array_equal(pack_part_q8_fast(qtype, data, n_rows, nb * block, lambda n: dirty[:n]), want)
    monkeypatch.setattr(packing, "PACK_CHUNK_BYTES", 1)
    assert pack_records_q8_fast(qtype, [data[:20], data[20:]], n_rows, nb * block).tobytes() == want.tobytes()
