"""Our GGUF header parser against the `gguf` package's reader (the independent implementation)."""
from __future__ import annotations

import numpy as np
import pytest

from ringllm.models.gguf_file import GGUFFile


def _compare(path: str) -> None:
    import gguf

    ours = GGUFFile(path)
    theirs = gguf.GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert sorted(keys) == sorted(ours.metadata)
    for key in keys:
        want = theirs.fields[key].contents()
        got = ours.metadata[key]
        if isinstance(got, np.ndarray):
            np.testing.assert_array_equal(got, np.asarray(want), err_msg=key)
        else:
            assert got == want, key
    assert [t.name for t in theirs.tensors] == list(ours.tensors)
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert int(mine.qtype) == int(t.tensor_type)
        assert mine.shape == tuple(reversed([int(d) for d in t.shape])) or mine.shape == (int(t.shape[0]),)
        np.testing.assert_array_equal(mine.data, np.asarray(t.data).view(np.uint8).reshape(mine.data.shape))


def test_metadata_and_tensors_match_gguf_reader_smollm2(smollm2_path):
    _compare(smollm2_path)


@pytest.mark.slow
def test_metadata_and_tensors_match_gguf_reader_gemma3(gemma3_path):
    _compare(gemma3_path)
