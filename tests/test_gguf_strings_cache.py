"""models/gguf_strings_cache.py: a GGUF file's long string arrays read back from the cache give the
strings the file holds, and only where the file holds exactly the bytes they were read from."""
from __future__ import annotations

import os

import pytest

from ringllm.models import gguf_strings_cache
from ringllm.models.gguf_file import GGUFFile

from test_gguf_file import _compare

N = gguf_strings_cache.MIN_CACHED + 5


@pytest.fixture()
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "ringllm" / "gguf_strings"


def _write(path, strings, tail="end") -> str:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", strings)
    w.add_string("general.name", tail)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _vocabulary(seed: int) -> list[str]:
    return [f"tok{i}-{seed}" if i % 7 else f"Ġé日{i}🙂" for i in range(N)]


def _loads_without_reading(path, monkeypatch) -> dict:
    """GGUFFile(path).metadata, failing if a long array was read from the file (a miss stores it)."""
    def refuse(*args):
        raise AssertionError("a long array was read from the file, not the cache")
    with monkeypatch.context() as m:
        m.setattr(gguf_strings_cache, "store", refuse)
        return GGUFFile(path).metadata


def test_second_load_comes_from_the_cache(tmp_path, cache_home, monkeypatch):
    strings = _vocabulary(0)
    path = _write(tmp_path / "a.gguf", strings)
    assert GGUFFile(path).metadata["tokenizer.ggml.tokens"] == strings
    assert len(os.listdir(cache_home)) == 1
    md = _loads_without_reading(path, monkeypatch)
    assert md["tokenizer.ggml.tokens"] == strings and md["general.name"] == "end"
    _compare(path)                                   # the cached load against gguf's reader
    copy = tmp_path / "copy.gguf"                    # another name, the same bytes: the same entry
    copy.write_bytes(open(path, "rb").read())
    assert _loads_without_reading(str(copy), monkeypatch)["tokenizer.ggml.tokens"] == strings


def test_other_bytes_behind_the_same_entry_are_read_again(tmp_path, cache_home):
    strings = _vocabulary(0)
    path = _write(tmp_path / "a.gguf", strings)
    GGUFFile(path)
    changed = strings[:-1] + ["changed-last"]          # same count and first bytes: same entry name
    path2 = _write(tmp_path / "b.gguf", changed)
    assert GGUFFile(path2).metadata["tokenizer.ggml.tokens"] == changed
    assert GGUFFile(path).metadata["tokenizer.ggml.tokens"] == strings
    assert len(os.listdir(cache_home)) == 1


@pytest.mark.parametrize("damage", ["truncate_head", "truncate_text", "garbage", "empty", "bad_utf8"])
def test_damaged_entry_is_read_again_and_rewritten(tmp_path, cache_home, monkeypatch, damage):
    strings = _vocabulary(1)
    path = _write(tmp_path / "a.gguf", strings)
    GGUFFile(path)
    entry = cache_home / os.listdir(cache_home)[0]
    data = entry.read_bytes()
    entry.write_bytes({"truncate_head": data[:20], "truncate_text": data[:-40], "garbage": os.urandom(len(data)),
                       "empty": b"", "bad_utf8": data[:-3] + b"\xff\xfe\xfd"}[damage])
    assert GGUFFile(path).metadata["tokenizer.ggml.tokens"] == strings
    assert entry.read_bytes() == data
    assert _loads_without_reading(path, monkeypatch)["tokenizer.ggml.tokens"] == strings


def test_strings_holding_nul_are_not_cached(tmp_path, cache_home):
    strings = _vocabulary(2)
    strings[5] = "a\0b"
    path = _write(tmp_path / "a.gguf", strings)
    assert GGUFFile(path).metadata["tokenizer.ggml.tokens"] == strings
    assert not cache_home.exists() or not os.listdir(cache_home)
    assert GGUFFile(path).metadata["tokenizer.ggml.tokens"] == strings


def test_unwritable_cache_costs_only_time(tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the cache directory would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    strings = _vocabulary(3)
    path = _write(tmp_path / "a.gguf", strings)
    for _ in range(2):
        assert GGUFFile(path).metadata["tokenizer.ggml.tokens"] == strings


def test_short_arrays_are_not_cached(tmp_path, cache_home):
    path = _write(tmp_path / "a.gguf", [f"t{i}" for i in range(100)])
    assert GGUFFile(path).metadata["tokenizer.ggml.tokens"] == [f"t{i}" for i in range(100)]
    assert not cache_home.exists()
