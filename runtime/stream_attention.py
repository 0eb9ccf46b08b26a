"""Attention of a batched decode step: every sequence's write and attention in one parallel call.

CPUEngine.step_batch runs the projections of B sequences as one matrix product, but each sequence
then writes and attends its own store: per layer, B pairs of kernel calls from Python, one after
the other on one core, which at B = 8 cost more than the products. write_attend_streams does the
same work for all B sequences in one call per layer, the sequences spread over the threads
(prange): per sequence the same kernels in the same order as the per-token path (RoPE of the key at
its sequence index, kv_write_streaming, attend_stored), so each sequence's result is bitwise the
one it gets alone.

Each thread takes a run of consecutive sequences and, while it attends one, hints the next one's
rows into L2 (attend_stored_ahead). Eight sequences' stores outgrow the last-level cache where one
does not (SmolLM2 at 180 slots: 8 MB each), and one thread reading a store from memory waits on
it for longer than the arithmetic takes; hinted a sequence ahead, the reads overlap the arithmetic.

Numba takes the B stores' arrays as typed lists (StreamArrays), built once per layer for a set of
stores and reused while the batch keeps them (a server's batch changes only when a request joins or
leaves). The lists are made and filled by cached kernels (_list_of, _push): a numba.typed.List made
and appended to from Python compiles Numba's own list helpers, which are not cached, again in every
process, before its first batched step.

When it applies (streams_fit, per layer): every store's layer is a ring in the "stored" RoPE layout,
updated in place, with no rollback journal and no hooks that watch the attention (mass_hook,
query_hook), and the stores hold their rows in the same KV types.
"""
from __future__ import annotations

import numpy as np
from numba import get_num_threads, njit, prange
from numba.typed import List

from ringllm.runtime.stored_attention import attend_stored_ahead, stored_work
from ringllm.runtime.kv_write import kv_write_streaming
from ringllm.runtime.numba_flags import FASTMATH
from ringllm.runtime.rope_kernels import rope_rows_at

__all__ = ["StreamArrays", "streams_fit", "write_attend_streams"]

_NO_MASS = np.zeros((0, 0), np.float32)       # attend_stored's mass argument when no mass is wanted


def streams_fit(arrays: "StreamArrays") -> list[bool]:
    """Per layer, whether write_attend_streams can take it for arrays' stores: every store's layer is
    a ring in the "stored" RoPE layout, updated in place, with no rollback journal and no hooks that
    watch the attention, and the stores hold its rows in one KV type (arrays has typed lists for it).
    Checked once per batched step (a store's journal and hooks can change between steps, never
    inside one), not once per layer."""
    stores = arrays.stores
    if any(st.update != "inplace" or st.journal is not None or st.mass_hook is not None
           or st.query_hook is not None for st in stores):
        return [False] * len(arrays.layers)
    return [lists is not None and all(st.layer_ring[il] and st.layer_rope_mode[il] == "stored" for st in stores)
            for il, lists in enumerate(arrays.layers)]


@njit(cache=True, nogil=True, fastmath=False)
def _list_of(first):
    """A typed List holding `first` (the list's item type is first's array type)."""
    lst = List()
    lst.append(first)
    return lst


@njit(cache=True, nogil=True, fastmath=False)
def _push(lst, item):
    """lst.append(item) for a typed List made by _list_of."""
    lst.append(item)


class StreamArrays:
    """Typed lists of the B stores' arrays of each layer (k, v, seq, pos, count, evicted), with the
    stores' sinks and largest capacity per layer and position modes, for one set of stores (`key`);
    None for a layer whose stores hold rows of different KV types (streams_fit is False there)."""

    def __init__(self, stores, n_layer: int):
        self.key = self._key(stores)
        self.stores = list(stores)          # keeps the ids in key valid
        self.layers = []
        for il in range(n_layer):
            if len({(st.k[il].dtype, st.v[il].dtype) for st in stores}) > 1:
                self.layers.append(None)      # stores of mixed KV types: one typed list cannot hold them
                continue
            lists = []
            for field in ("k", "v", "seq", "pos", "count", "evicted"):
                lst = _list_of(getattr(stores[0], field)[il])
                for st in stores[1:]:
                    _push(lst, getattr(st, field)[il])
                lists.append(lst)
            sinks = np.array([st.layer_sinks[il] for st in stores], np.int64)
            self.layers.append((*lists, sinks, max(st.k[il].shape[1] for st in stores)))
        self.reindexed = np.array([bool(st.reindexed) for st in stores], np.bool_)
        self.scores = self.ktmp = self.work = None      # per-sequence scratch (scratch())

    def scratch(self, B: int, n_kv: int, n_head: int, hd: int, rotary_dim: int, cap: int) -> None:
        """Make scores (B, n_head, >= cap), ktmp (B, hd + rotary_dim) and work (B, stored_work for >= cap
        slots) f32 hold a step of B sequences (allocated once, grown with the layers' capacity)."""
        if self.scores is None or self.scores.shape[0] < B or self.scores.shape[2] < cap:
            self.scores = np.zeros((B, n_head, cap), np.float32)
            self.ktmp = np.zeros((B, hd + rotary_dim), np.float32)
            self.work = np.zeros((B, *stored_work(n_kv, n_head, hd, cap).shape), np.float32)

    @staticmethod
    def _key(stores) -> tuple:
        """The stores and their first layer's key array (a store whose arrays were replaced is a new one)."""
        return tuple((id(st), id(st.k[0])) for st in stores)

    def matches(self, stores) -> bool:
        return self._key(stores) == self.key


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def _write_attend(out, q, k_new, v_new, seqs, ks, vs, seq_ls, pos_ls, count_ls, evicted_ls, sinks, reindexed,
                  inv_freq, inv_scale, rotary_dim, scale, softcap, scores, ktmp, work, no_mass, n_threads):
    B = np.int64(q.shape[0])
    n_chunks = min(n_threads, B)
    for c in prange(n_chunks):          # one run of consecutive sequences per thread
        hi = (c + 1) * B // n_chunks
        for b in range(c * B // n_chunks, hi):      # int64: typed lists index signed
            rope_rows_at(k_new[b], seqs[b], inv_freq, inv_scale, rotary_dim, ktmp[b])
            count_l = count_ls[b]
            kv_write_streaming(ks[b], vs[b], seq_ls[b], pos_ls[b], count_l, evicted_ls[b], k_new[b], v_new[b],
                               seqs[b], sinks[b], reindexed[b])
            q_pos = count_l[0] - 1 if reindexed[b] else seqs[b]
            # the thread's next sequence is read from memory meanwhile (the last has none to hint)
            last = b + 1 == hi
            nb = b if last else b + 1
            attend_stored_ahead(out[b], q[b], ks[b], vs[b], pos_ls[b], seq_ls[b], count_l, q_pos, inv_freq,
                                inv_scale, rotary_dim, scale, softcap, scores[b], work[b], no_mass, ks[nb], vs[nb],
                                count_ls[nb], not last)


def write_attend_streams(arrays: StreamArrays, il: int, rope, out: np.ndarray, q: np.ndarray, k_new: np.ndarray,
                         v_new: np.ndarray, seqs: np.ndarray, scale: np.float32, softcap: np.float32) -> None:
    """Write token seqs[b] (k_new, v_new (B, n_kv, hd), keys before RoPE: rotated here, in place) into
    layer il of store b and out[b] (n_head, hd) = its attention (q (B, n_head, hd) before RoPE), for
    every b at once. streams_fit(arrays)[il] must hold."""
    k, v, seq, pos, count, evicted, sinks, cap_max = arrays.layers[il]
    B, n_head, hd = q.shape
    arrays.scratch(B, k_new.shape[1], n_head, hd, rope.rotary_dim, cap_max)
    _write_attend(out, q, k_new, v_new, seqs, k, v, seq, pos, count, evicted, sinks, arrays.reindexed,
                  rope.inv_freq, rope.inv_scale, rope.rotary_dim, scale, softcap, arrays.scores, arrays.ktmp,
                  arrays.work, _NO_MASS, np.int64(get_num_threads()))
