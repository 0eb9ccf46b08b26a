"""The stored layouts' split attention (runtime/stored_attention.py) against a float64 NumPy oracle.

The oracle rotates the query at q_pos + (seq_j - pos_j) for every slot (float64 angles), takes the
scores of the dequantized keys (kv_codec.decode), soft-caps, softmaxes in float64 and sums the
dequantized values: no units, no split softmax, no tiles. Checked for every KV type, head sizes
that take the eight-key vector path (64) and the scalar one (40), several units per head with a
tail of fewer than eight slots, offsets that change inside a unit (reindexed streaming), soft-capping
and the per-slot mass. The parallel entry gives the serial entry's bits.
"""
from __future__ import annotations

import numpy as np
import pytest

from ringllm.runtime.kv_codec import decode, encode
from ringllm.runtime.stored_attention import (MAX_UNITS, UNIT_SLOTS, attend_stored, attend_stored_parallel,
                                               stored_work, unit_slots)


def _oracle(q, k, v, pos, seq, count, q_pos, inv_freq, rotary_dim, scale, softcap):
    n_head, hd = q.shape
    n_kv = k.shape[0]
    group = n_head // n_kv
    half = rotary_dim // 2
    out = np.zeros((n_head, hd))
    mass = np.zeros((n_kv, k.shape[1]))
    for h in range(n_kv):
        n = count[h]
        kk = k[h, :n].astype(np.float64)
        vv = v[h, :n].astype(np.float64)
        ang = (q_pos + seq[h, :n] - pos[h, :n])[:, None] * inv_freq[None, :]          # (n, half)
        cs, sn = np.cos(ang), np.sin(ang)
        for g in range(group):
            x = q[h * group + g].astype(np.float64)
            a, b = x[:half], x[half:rotary_dim]
            qr = np.broadcast_to(x, (n, hd)).copy()
            qr[:, :half] = a * cs - b * sn
            qr[:, half:rotary_dim] = b * cs + a * sn
            s = scale * np.einsum("nd,nd->n", qr, kk)
            if softcap > 0:
                s = softcap * np.tanh(s / softcap)
            w = np.exp(s - s.max())
            w /= w.sum()
            out[h * group + g] = w @ vv
            mass[h, :n] += w
    return out, mass


def _case(kv_type, hd, n_kv=2, group=3, cap=3 * UNIT_SLOTS + 37, seed=0, layout="original"):
    rng = np.random.default_rng(seed)
    n_head = n_kv * group
    vals_k = rng.standard_normal((n_kv, cap, hd)).astype(np.float32)
    vals_v = rng.standard_normal((n_kv, cap, hd)).astype(np.float32)
    k, v = encode(vals_k, kv_type), encode(vals_v, kv_type)
    count = np.array([cap, cap - UNIT_SLOTS - 5][:n_kv], np.int64)      # heads of different lengths
    seq = np.tile(np.arange(cap, dtype=np.int64) + 900, (n_kv, 1))
    pos = seq.copy()
    if layout == "reindexed":       # sinks at offset 0, the rest shifted by each head's eviction count
        for h in range(n_kv):
            pos[h, 4:] -= 300 + 17 * h
    elif layout == "alternating":   # offsets 0 and 7 in runs of 100 slots: they change inside units, and
        pos -= 7 * ((np.arange(cap) // 100) % 2)            # a unit starts at an offset an earlier one left
    q = rng.standard_normal((n_head, hd)).astype(np.float32)
    return q, k, v, pos, seq, count


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("hd", [64, 32])
@pytest.mark.parametrize("layout", ["original", "reindexed", "alternating"])
def test_matches_oracle_and_parallel_gives_the_same_bits(kv_type, hd, layout):
    q, k, v, pos, seq, count = _case(kv_type, hd, layout=layout)
    rotary_dim = hd - 16 if hd == 64 else hd          # a partial rotary dim as well as a full one
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    _check_serial_parallel_oracle(q, k, v, pos, seq, count, inv_freq, rotary_dim, np.float32(hd ** -0.5))


def _check_serial_parallel_oracle(q, k, v, pos, seq, count, inv_freq, rotary_dim, scale):
    """attend_stored and attend_stored_parallel (no soft-cap, mass wanted) give the same bits, and match
    the float64 oracle: output to 2e-5 / 1e-4, per-slot mass to 1e-6 / 1e-4."""
    n_head, hd = q.shape
    n_kv, cap = k.shape[:2]
    q_pos = np.int64(pos[0, count[0] - 1])
    outs = []
    for fn in (attend_stored, attend_stored_parallel):
        out = np.zeros((n_head, hd), np.float32)
        mass = np.zeros((n_kv, cap), np.float32)
        fn(out, q, k, v, pos, seq, count, q_pos, inv_freq, 1.0, rotary_dim, scale, np.float32(0.0),
           np.zeros((n_head, cap), np.float32), stored_work(n_kv, n_head, hd, cap), mass)
        outs.append((out, mass))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
    ref_out, ref_mass = _oracle(q, decode(k, hd), decode(v, hd), pos, seq, count, q_pos, inv_freq, rotary_dim,
                                float(scale), 0.0)
    np.testing.assert_allclose(outs[0][0], ref_out, atol=2e-5, rtol=1e-4)
    for h in range(n_kv):
        np.testing.assert_allclose(outs[0][1][h, :count[h]], ref_mass[h, :count[h]], atol=1e-6, rtol=1e-4)


def test_unit_sizes_depend_on_the_slot_count_alone():
    assert unit_slots(1) == unit_slots(MAX_UNITS * UNIT_SLOTS) == UNIT_SLOTS
    assert unit_slots(MAX_UNITS * UNIT_SLOTS + 1) == 2 * UNIT_SLOTS
    for count in (1, 300, 2048, 2049, 4096, 5000, 32768, 100_001):
        size = unit_slots(count)
        assert size % UNIT_SLOTS == 0 and size >= UNIT_SLOTS and -(-count // size) <= MAX_UNITS


@pytest.mark.parametrize("kv_type", ["f32", "q8_0"])
def test_long_heads_take_larger_units(kv_type):
    """A head past MAX_UNITS x UNIT_SLOTS slots is cut into larger units, beside a short head still cut
    into UNIT_SLOTS: the oracle's result and mass, and the parallel entry gives the serial one's bits."""
    hd = 64
    q, k, v, pos, seq, count = _case(kv_type, hd, cap=9 * UNIT_SLOTS + 37, layout="alternating")
    count[1] = 3 * UNIT_SLOTS - 50
    assert unit_slots(count[0]) == 2 * UNIT_SLOTS and unit_slots(count[1]) == UNIT_SLOTS
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd)
    _check_serial_parallel_oracle(q, k, v, pos, seq, count, inv_freq, hd, np.float32(0.125))


def test_head_dim_without_eight_lane_chunks_and_softcap():
    hd = 40                                     # not a multiple of 8: the one-key-at-a-time kernels
    q, k, v, pos, seq, count = _case("f32", hd, n_kv=1, group=2, cap=UNIT_SLOTS + 11, layout="reindexed")
    n_head, cap = q.shape[0], k.shape[1]
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd)
    q_pos = np.int64(pos[0, count[0] - 1])
    out = np.zeros((n_head, hd), np.float32)
    attend_stored(out, q * 8, k, v, pos, seq, count, q_pos, inv_freq, 1.0, hd, np.float32(0.3), np.float32(5.0),
                  np.zeros((n_head, cap), np.float32), stored_work(1, n_head, hd, cap), np.zeros((0, 0), np.float32))
    ref, _ = _oracle(q * 8, k, v, pos, seq, count, q_pos, inv_freq, hd, 0.3, 5.0)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-4)


def test_work_refuses_groups_wider_than_half_a_row():
    with pytest.raises(ValueError, match="per-head sums"):
        stored_work(1, 40, 64, 128)
