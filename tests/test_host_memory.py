"""What a long run keeps resident: the embedding rows it read from the model file are dropped again
(host_memory.release_row_pages), and loading a session leaves no second store's worth of freed heap
behind (ChatSession.load trims the heap). RSS is read from /proc (Linux); elsewhere these skip."""
from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

import ringllm
from ringllm.runtime.host_memory import (FAULT_SPAN_BYTES, LAZY_MIN_BYTES, lazy_zeros, lazy_zeros_group,
                                         release_row_pages, trim_heap)
from ringllm.session import ChatSession

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps") or not hasattr(mmap, "MADV_DONTNEED"),
                                reason="needs Linux's /proc/self/smaps and madvise")


def _mapping_rss_kb(address: int) -> int:
    """Resident kB of the mapping of this process that contains `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError("no mapping holds the address")


def _anon_rss_mb() -> float:
    """Resident MB of anonymous memory: the heap's (RssAnon) and the KV stores' own mappings (RssShmem:
    host_memory.lazy_zeros maps them shared)."""
    with open("/proc/self/status") as fh:
        kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in fh if line.startswith(("RssAnon", "RssShmem")))}
    return (kb["RssAnon"] + kb["RssShmem"]) / 1024


def _cache_through_read(path) -> None:
    """Put the file in the page cache the way read() does, whatever an earlier test left there: a kernel
    with large page-cache folios then makes them large (up to 2 MiB on Linux 6.18 with ext4), and one
    read fault of a mapping of the file maps a whole folio, not a 64 KiB fault-around window. That is
    how the file of a fresh install can be cached, and what a CI machine had when a release of 64 KiB
    windows left 704 kB of the embedding table resident."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        while os.read(fd, 1 << 20):
            pass
    finally:
        os.close(fd)


def test_release_row_pages_drops_every_page_the_lookup_mapped_and_the_data_reads_back(tmp_path):
    rows, row_bytes = 4096, 4096 + 96           # rows straddle pages; the table spans several FAULT_SPAN_BYTES
    data = np.random.default_rng(0).integers(0, 256, (rows, row_bytes), dtype=np.uint8)
    path, flat = tmp_path / "table.bin", data.reshape(-1)
    with open(path, "wb", buffering=0) as fh:   # 256 KiB writes: a kernel with large page-cache folios
        for o in range(0, flat.size, 1 << 18):   # caches 256 KiB ones, and a fault maps all of one
            fh.write(flat[o:o + (1 << 18)])
    table = np.memmap(path, np.uint8, mode="r", shape=(rows, row_bytes))
    picked, far = np.array([3, 4, 200, 511, 200]), rows - 1
    assert np.array_equal(table[picked], data[picked])          # faults the rows in, and what the kernel maps with them
    assert np.array_equal(table[far], data[far])
    assert _mapping_rss_kb(table.ctypes.data) >= 8
    released = release_row_pages(table, picked)
    assert picked.size * row_bytes <= released <= table.nbytes
    if table.nbytes >= 4 * FAULT_SPAN_BYTES:                   # the far row's span is not the picked rows'
        assert _mapping_rss_kb(table.ctypes.data) > 0
    release_row_pages(table, [far])
    assert _mapping_rss_kb(table.ctypes.data) == 0
    assert np.array_equal(table[picked], data[picked])          # read back from the page cache


def test_release_row_pages_leaves_arrays_that_are_not_file_mappings_alone():
    a = np.ones((64, 4096), np.uint8)
    assert release_row_pages(a, [1, 2]) == 0
    assert release_row_pages(a[:, ::2], [1]) == 0
    assert a.all()


def test_lazy_zeros_group_shares_one_mapping_paid_for_as_written():
    """The big arrays of a group come from one mapping (one address range, each array on a page of its
    own, none overlapping), hold zeros of their dtypes, and only the pages written become resident;
    the small ones are ordinary arrays; each array outlives the others being dropped."""
    big = (256, 1024)                                     # 1 MiB of float32 each: mapped
    groups = {"k": [(big, np.float32), (big, np.float32)], "seq": [((64, 512), np.int64)],
              "small": [((3,), np.int64), ((8, 8), np.float64)]}
    arrays = lazy_zeros_group(groups)
    assert [len(arrays[n]) for n in groups] == [2, 1, 2]
    for name, specs in groups.items():
        for a, (shape, dtype) in zip(arrays[name], specs):
            assert a.shape == shape and a.dtype == dtype and not a.any() and a.flags.c_contiguous
    mapped = arrays["k"] + arrays["seq"]
    spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in mapped)
    assert all(lo % mmap.PAGESIZE == 0 for lo, _ in spans)
    assert all(hi <= lo2 for (_, hi), (lo2, _) in zip(spans, spans[1:]))
    assert all(a.nbytes < LAZY_MIN_BYTES for a in arrays["small"])
    assert _mapping_rss_kb(spans[0][0]) == _mapping_rss_kb(spans[-1][0])          # one mapping
    before = _mapping_rss_kb(spans[0][0])
    arrays["k"][1][:4] = 1.0                              # 4 rows x 4 KiB: four pages
    assert _mapping_rss_kb(spans[0][0]) - before <= 4 * mmap.PAGESIZE // 1024 + 4
    keep = arrays["k"][1]
    del arrays, mapped
    assert keep[:4].all() and not keep[4:].any()
    one = lazy_zeros((300, 100), np.int64)
    assert one.shape == (300, 100) and one.dtype == np.int64 and not one.any()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_writes_its_own_copy_of_a_store_array():
    """A store's arena is the process's private memory: a child forked from it writes into its own copy
    (copy on write), never into the parent's, and sees the parent's rows as they were at the fork."""
    a = lazy_zeros((256, 1024), np.float32)               # 1 MiB: from the shared arena mapping
    a[0] = 1.0
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                          # the child: write, report what it sees, leave
        os.close(r)
        a[:4] = 7.0
        os.write(w, bytes([int(a[0, 0] == 7.0 and a[3, -1] == 7.0 and not a[4:].any())]))
        os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    seen = os.read(r, 1)
    os.close(r)
    assert status == 0 and seen == b"\x01"
    assert (a[0] == 1.0).all() and not a[1:].any()       # the child's rows never reached the parent


def test_embedding_lookups_keep_no_table_pages_resident(smollm2_path):
    """The table's resident bytes stay under what one fault can map (FAULT_SPAN_BYTES) however many
    distinct rows are read. The rows read lie on 8 spans' worth of distinct pages or more, so without
    the release this fails whatever the kernel's fault-around or folio sizes."""
    _cache_through_read(smollm2_path)
    llm = ringllm.LLM(smollm2_path, n_threads=1, progress=False)
    engine = llm.engine
    embd = engine.embd.data
    ids = np.arange(0, embd.shape[0], -(-mmap.PAGESIZE // embd.strides[0]))     # each row on a page of its own
    if ids.size * mmap.PAGESIZE < 8 * FAULT_SPAN_BYTES:
        pytest.skip(f"the table has fewer distinct pages than 8 page-table spans of {FAULT_SPAN_BYTES} bytes")
    resident = []
    for part in np.array_split(ids, -(-ids.size // engine.n_batch)):
        engine._embed(engine.buf.view(len(part)), part)
        resident.append(_mapping_rss_kb(embd.ctypes.data) * 1024)
    assert max(resident) <= FAULT_SPAN_BYTES, (max(resident), ids.size)
    out = llm.complete("The quick brown fox jumps over the lazy dog", max_tokens=4, temperature=0.0)
    assert out.text and _mapping_rss_kb(embd.ctypes.data) * 1024 <= FAULT_SPAN_BYTES


def test_loading_a_session_holds_one_store_not_the_file_temporaries_as_well(smollm2_path, tmp_path):
    llm = ringllm.LLM(smollm2_path, n_threads=1, progress=False)
    session = llm.chat_session(kv=ringllm.KVConfig(capacity=512, policy="streaming"), seed=0)
    session.send("Tell me about the weather in spring, in a few sentences. " * 60, stream=False, max_tokens=8,
                 temperature=0.0, ignore_eos=True)
    store_mb = session.kv_stats()["bytes"] / 2 ** 20
    path = session.save(tmp_path / "a.session")
    trim_heap()                                   # no free heap left for the load to reuse
    before = _anon_rss_mb()
    loaded = ChatSession.load(llm, path)          # both stores alive now
    grown = _anon_rss_mb() - before
    assert grown <= store_mb * 1.25 + 4, (grown, store_mb)
    assert loaded.n_fed == session.n_fed


def test_each_weight_is_held_once_the_rotate_half_qk_rows_are_gathered_when_read(smollm2_path):
    """A llama GGUF's q/k rows are reordered into the rotate-half order (models/common.unpermute_rope_qk)
    as GatheredRows: the same bytes as the gathered copy, read from the file each time, so every matrix
    the loaded model keeps is a view of the file's mapping and the engine's packed buffers are the only
    copy in memory."""
    from ringllm.models.common import rope_interleaved_to_half_rows
    from ringllm.models.gguf_file import GGUFFile
    from ringllm.models.loader import load_model
    from ringllm.runtime.qtensor import GatheredRows

    def maps_the_file(a) -> bool:
        while a is not None:
            if isinstance(a, mmap.mmap):
                return True
            a = getattr(a, "base", None)
        return False

    model, raw = load_model(smollm2_path), GGUFFile(smollm2_path).tensors
    spec = model.spec
    for part, heads in (("attn_q", spec.n_head), ("attn_k", spec.n_head_kv)):
        t = model.tensors[f"blk.3.{part}.weight"]
        assert isinstance(t, GatheredRows)
        rows = rope_interleaved_to_half_rows(heads, spec.head_dim)
        expected = raw[f"blk.3.{part}.weight"].data[rows]
        np.testing.assert_array_equal(t.data, expected)
        assert t.shape == (rows.size, spec.n_embd) and t.nbytes == expected.nbytes
    for name, t in model.tensors.items():
        if len(t.shape) == 2:
            assert maps_the_file(t.stored), name


def test_gathered_rows_take_index_arrays_and_row_masks_as_numpy_indexing_does():
    from ringllm.runtime.qtensor import QTensor
    from ringllm.runtime.quant_types import GGMLType

    data = np.arange(4 * 34, dtype=np.uint8).reshape(4, 34)          # four Q8_0 rows of 32 values
    t = QTensor("w", GGMLType.Q8_0, (4, 32), data)
    for rows in ([3, 1], np.array([True, False, True, False]), [-1]):
        g = t.take_rows(rows)
        np.testing.assert_array_equal(g.data, data[rows])
        assert g.shape == (len(data[rows]), 32) and g.nbytes == data[rows].nbytes
    with pytest.raises(IndexError):
        t.take_rows([4])
    with pytest.raises(IndexError):
        t.take_rows(np.array([True, False]))
