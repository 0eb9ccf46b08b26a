"""The element types of the KV store (KVConfig k_type / v_type): names, row sizes, checks.

A store row holds one token's key or value of one kv head: head_dim values, encoded as

    type   array dtype   row (per head_dim values)                         bytes per value
    f32    float32       the values                                         4
    f16    uint16        IEEE half bit patterns (round to nearest even)     2
    q8_0   int8          llama.cpp's block_q8_0 per 32 values: f16 scale d  34/32
                         (2 bytes, little endian) then 32 int8 q; x = d q
    q4_0   uint8         llama.cpp's block_q4_0 per 32 values: f16 scale d  18/32, plus
                         then 16 bytes; byte i holds q_i (low nibble) and   12 per key row
                         q_{i+16} (high nibble); of the block's rotation
                         y = H (s * r), so r = s * H (d (q - 8)) / 32; a
                         key row then holds its Q4_0_OUTLIERS largest values
                         u as f16 (2 bytes each) and their channels (1 byte
                         each): x = r + u, r the row with u taken out
                         (a value row: x = r)

q4_0 rotates each block before quantizing it. H is the 32 x 32 Walsh-Hadamard matrix (Sylvester's
order, entries +-1, H H = 32 I) and s the fixed signs Q4_0_SIGNS. A key's few large channels (a
pre-RoPE key carries most of its energy in a per-channel offset of a handful of channels) would set
the block's scale and leave its other 31 values two or three levels; rotated, every value carries a
share of each channel, the block is near-Gaussian and its scale follows its norm instead of its
largest channel (QuaRot, Ashkboos et al. 2024, rotates activations and the KV cache so). The signs
keep H's all-ones row from collecting a block's common offset into one coefficient. Dividing by 32
and the signs are exact, and H's sums of integers times one scale are exact in float32, so a row
decodes to the same values whatever the order of the sums (the same bits but for the sign of a
zero). The blocks' bytes are llama.cpp's.

Outliers apart. Rotated or not, a row whose energy sits in a few channels (a key's offset channels;
after RoPE they turn within their rotary pair, so a fixed choice of channels misses them at some
positions) gives every block a scale that follows those channels, and the rest of the row keeps
few levels. So each q4_0 key row first takes out its Q4_0_OUTLIERS values of largest magnitude (the
first of equal ones; NaN last), chosen per row: it stores them as f16, u_i = f16(x[c_i]), with their
channels c_i, and quantizes the rest r = x - u (zero at those channels but for f16's rounding of
them). A row names its own channels, so nothing is calibrated or kept beside the rows, and every
reader decodes x = r + u. The attention's basis reads (kv_basis) add u to the coefficients as
u_i s_c H[:, c] / 32 for its block. Twelve bytes a key row (head_dim 64: 36 -> 48 bytes), 256
channels at most (one byte names one). Value rows hold none: values carry no such offset, and the
outliers cost the attention a 32-value update each (row_width(..., key=True) is a key row's width;
the codecs tell the two apart by it: a value row is whole blocks).

Key offsets (q4_0 keys of policy layers). A pre-RoPE key of a model like SmolLM2 is mostly an
offset that changes little from token to token; rotated, it still sets every block's scale, and
the part that tells tokens apart keeps few levels. So a q4_0 store's policy layers (keys held before
RoPE, the "fused" layout) hold each key as k - c, c (n_kv, head_dim) one vector per layer and kv
head, and every reader adds c back (kv_codec.key_row). Token 0's row (OFFSET_FROM = 1: the rows
before OFFSET_FROM) holds its key itself: it may be written before c exists, in a stream fed token by
token, and the first token of a text is an attention sink whose key is unlike the others'. c is
chosen by the write that brings the layer its first token from OFFSET_FROM on, from the keys of
every token it has seen but token 0 (key_offset_of): a prompt's, or in a stream fed token by token
token 1's alone (a wider start, the first 16 tokens' rows holding their keys and c their mean, lost
more: the early tokens, sinks and heavy hitters, stay and are attended most; docs/kv_types.md). c is
kept for the layer's life: a parameter of the rows, saved with them, never re-fitted (a row is never
re-encoded). The ring layers
(keys stored rotated at their sequence index, where a fixed pre-RoPE offset turns with the
position) hold no offset (c = 0, which is also what a store saved before offsets existed holds).

The array's dtype names the type (the row codecs, runtime/kv_codec.py, dispatch on it). Slot
moves copy rows whatever their type (k_l.shape[2] is the row's width in elements). No Numba here:
the CLI and KVConfig read these names.
"""
from __future__ import annotations

import numpy as np

from ringllm.runtime.errors import ConfigError

KV_TYPES = ("f32", "f16", "q8_0", "q4_0")
STORE_DTYPE = {"f32": np.dtype(np.float32), "f16": np.dtype(np.uint16), "q8_0": np.dtype(np.int8),
               "q4_0": np.dtype(np.uint8)}
QBLOCK = 32                                   # values per q8_0 / q4_0 block (one f16 scale each)
# s of the q4_0 rotation: -1 where bit i of 0x9E3779B9 (the golden ratio's 32 bits) is set
Q4_0_SIGNS = np.array([-1.0 if (0x9E3779B9 >> i) & 1 else 1.0 for i in range(QBLOCK)], np.float32)
Q4_0_OUTLIERS = 4                             # values a q4_0 key row holds apart in f16 (its largest)
Q4_0_ROWS = "hadamard+key_outliers4"          # KVStore.state()'s name for this q4_0 row form
Q4_0_MAX_HEAD_DIM = 256                       # a q4_0 row names an outlier's channel in one byte
_BLOCK_BYTES = {"q8_0": 2 + QBLOCK, "q4_0": 2 + QBLOCK // 2}
OFFSET_BITS = 5                               # significant bits a key offset keeps (key_offset_of)
OFFSET_FROM = 1                               # the first token whose row holds its key relative to the offset


def key_offset_of(keys: np.ndarray) -> np.ndarray:
    """One kv head's key offset from its keys (N, hd) float32 before RoPE (N >= 1): their mean, rounded
    to OFFSET_BITS significant bits. -> (hd,) float32.

    The rounding makes the offset a coarse parameter: two engines whose keys differ in their last bits
    (the reference engine and the CPU engine sum in different orders) choose the same offset unless a
    mean lies within that difference of a rounding boundary, and a 1/32 relative error of the offset
    costs nothing measurable (the rounded residual's scale follows its norm)."""
    keys = np.asarray(keys, np.float32)
    if keys.ndim != 2 or keys.shape[0] == 0:
        raise ConfigError(f"a key offset needs keys (N >= 1, head_dim); got shape {keys.shape}")
    mant, expo = np.frexp(keys.astype(np.float64).mean(axis=0))
    scale = float(1 << OFFSET_BITS)
    return np.ldexp(np.round(mant * scale) / scale, expo).astype(np.float32)


def check_kv_type(name: str, what: str, head_dim: int | None = None) -> None:
    """ConfigError unless `name` is a KV type (and, for q8_0 / q4_0, head_dim a multiple of 32)."""
    if name not in KV_TYPES:
        raise ConfigError(f"{what} {name!r} unknown; valid: {', '.join(KV_TYPES)}")
    if head_dim is not None and name in _BLOCK_BYTES and head_dim % QBLOCK:
        raise ConfigError(f"{what} {name!r} quantizes blocks of {QBLOCK} values along head_dim; this model's "
                          f"head_dim is {head_dim}: use f32 or f16")
    if head_dim is not None and name == "q4_0" and head_dim > Q4_0_MAX_HEAD_DIM:
        raise ConfigError(f"{what} 'q4_0' names its outliers' channels in one byte, at most {Q4_0_MAX_HEAD_DIM}; "
                          f"this model's head_dim is {head_dim}: use f32, f16 or q8_0")


def row_width(name: str, head_dim: int, key: bool = False) -> int:
    """Elements of a store row of type `name` holding head_dim values; a q4_0 key row (key=True) holds
    its outliers after its blocks, a value row only the blocks."""
    if name == "q4_0" and key:
        return q4_0_blocks_width(head_dim) + 3 * Q4_0_OUTLIERS
    if name in _BLOCK_BYTES:
        return head_dim // QBLOCK * _BLOCK_BYTES[name]
    return head_dim


def q4_0_blocks_width(head_dim: int) -> int:
    """Bytes of a q4_0 row's blocks (its outliers follow them: Q4_0_OUTLIERS f16 values, then as many
    one-byte channels)."""
    return head_dim // QBLOCK * _BLOCK_BYTES["q4_0"]


def row_bytes(name: str, head_dim: int, key: bool = False) -> int:
    """Bytes of one row (one token, one kv head) of type `name`, a key's when key (row_width)."""
    return row_width(name, head_dim, key) * STORE_DTYPE[name].itemsize


def type_of(arr: np.ndarray) -> str:
    """The KV type of a store array, from its dtype."""
    for name, dt in STORE_DTYPE.items():
        if arr.dtype == dt:
            return name
    raise ConfigError(f"no KV type has dtype {arr.dtype}")
