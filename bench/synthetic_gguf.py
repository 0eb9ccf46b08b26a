"""Synthetic GGUF files in the exact shapes of real models, random weights, llama.cpp's Q4_K_M layout.

    python bench/synthetic_gguf.py llama-3.2-1b qwen3-1.7b     # writes (once) and prints the paths

A speed benchmark needs the bytes and the shapes of a model, not its values. This writes a file that
llama.cpp and ringllm both load as they would load the real Q4_K_M conversion of the model:

- hyperparameters: the model's config.json (see SHAPES), written under the metadata keys
  convert_hf_to_gguf.py writes (`{arch}.block_count`, `.context_length`, `.embedding_length`,
  `.feed_forward_length`, `.attention.head_count[_kv]`, `.attention.key_length/value_length`,
  `.rope.freq_base`, `.attention.layer_norm_rms_epsilon`; llama adds `.vocab_size` and
  `.rope.dimension_count`); tied embeddings, so no `output.weight`.
- tensors: the converter's names; `rope_freqs.weight` (head_dim/2 f32 factors) for Llama 3.x's
  "llama3" rope scaling, computed as the converter's LlamaModel.generate_extra_tensors computes
  them (note it reads original_max_position_embeddings from the top level of config.json, so the
  default 8192 applies, which is also Llama 3.2's value); `attn_q_norm`/`attn_k_norm` (head_dim)
  for qwen3.
- per-tensor types of llama.cpp's Q4_K_M (src/llama-quant.cpp, llama_tensor_get_type_impl): Q4_K by
  default; Q6_K for the tied token embedding (it is the output matrix), for attn_v and ffn_down on
  the layers `use_more_bits` picks (i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2); norms and
  rope_freqs stay F32.
- tokenizer: a gpt2-style BPE vocabulary of the model's size (the 256 byte-level symbols, every other
  token the merge of two earlier ones, with its merge, the model's special tokens at their ids): the
  size of the real model's string arrays and BPE tables, so a start-up figure pays for them; the
  token ids of a speed benchmark are drawn directly.

Weights: gguf-py's quantize() has no Q4_K/Q6_K encoder, and quantizing 1-2 GB in NumPy would be slow,
so blocks are written directly: random bytes for the packed quants and sub-block scales, and an f16
super-block scale chosen so a row's dot product with a unit-RMS input is O(1) (Q4_K: d = 1/(236
sqrt(n_in)), dmin = 7.5 d so the mean cancels; Q6_K: d = 1/(1350 sqrt(n_in))). Every block is a valid
block; the numbers are noise, so logits mean nothing, but every kernel reads exactly the bytes it would
read for the real model.

Files are cached under $RINGLLM_BENCH_CACHE (default ~/.cache/ringllm-bench), named by shape and
FORMAT_VERSION, written once (to a temporary name, then renamed) and reused.
"""
from __future__ import annotations

import argparse
import math
import os
import random
from dataclasses import dataclass, replace

import numpy as np

from ringllm.models.tokenizer import byte_alphabet

FORMAT_VERSION = 2
CACHE_DIR = os.environ.get("RINGLLM_BENCH_CACHE", os.path.expanduser("~/.cache/ringllm-bench"))


@dataclass(frozen=True)
class Shape:
    """A model's hyperparameters as its config.json gives them (names follow the GGUF keys).

    arch: GGUF `general.architecture` ("llama" | "qwen3").
    rope_scaling: config.json's llama3 rope_scaling dict (factor, low_freq_factor, high_freq_factor,
        original_max_position_embeddings), or None.
    special: {token id: token text} of the special tokens placed in the vocabulary.
    """

    name: str
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_ctx: int
    rope_theta: float
    norm_eps: float
    rope_scaling: dict | None
    tokenizer_pre: str
    bos: int
    eos: int
    special: dict


_LLAMA3_SPECIAL = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128006: "<|start_header_id|>",
                   128007: "<|end_header_id|>", 128008: "<|eom_id|>", 128009: "<|eot_id|>"}
_QWEN3_SPECIAL = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}

# meta-llama/Llama-3.2-1B and Qwen/Qwen3-1.7B config.json
SHAPES: dict[str, Shape] = {
    "llama-3.2-1b": Shape(
        name="llama-3.2-1b", arch="llama", n_vocab=128256, n_embd=2048, n_layer=16, n_head=32, n_head_kv=8,
        head_dim=64, n_ff=8192, n_ctx=131072, rope_theta=500000.0, norm_eps=1e-5,
        rope_scaling={"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        tokenizer_pre="llama-bpe", bos=128000, eos=128001, special=_LLAMA3_SPECIAL),
    "qwen3-1.7b": Shape(
        name="qwen3-1.7b", arch="qwen3", n_vocab=151936, n_embd=2048, n_layer=28, n_head=16, n_head_kv=8,
        head_dim=128, n_ff=6144, n_ctx=40960, rope_theta=1000000.0, norm_eps=1e-6, rope_scaling=None,
        tokenizer_pre="qwen2", bos=151643, eos=151645, special=_QWEN3_SPECIAL),
}


def tiny(shape_name: str) -> Shape:
    """The same architecture scaled down for tests: 2 layers, n_embd 256, 4 query / 2 KV heads of the
    model's head_dim, n_ff 512, 1024 tokens (every K-quant row needs a multiple of 256 columns). Special
    tokens move to the top of the small vocabulary."""
    s = SHAPES[shape_name]
    n_vocab = 1024
    special = {n_vocab - len(s.special) + i: text for i, text in enumerate(s.special.values())}
    ids = sorted(special)
    return replace(s, name=s.name + "-tiny", n_vocab=n_vocab, n_embd=256, n_layer=2, n_head=4, n_head_kv=2,
                   n_ff=512, n_ctx=4096, special=special, bos=ids[0], eos=ids[1])


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama-quant.cpp's choice of the attn_v / ffn_down layers that Q4_K_M stores as Q6_K."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def q4_k_m_type(name: str, i_layer: int | None, n_layer: int) -> str:
    """"Q4_K" | "Q6_K" | "F32" for a tensor of a tied-embedding model quantized as Q4_K_M."""
    if name.endswith("_norm.weight") or name == "rope_freqs.weight":
        return "F32"
    if name == "token_embd.weight":
        return "Q6_K"                       # tied: quantized as the output matrix
    if name.endswith(("attn_v.weight", "ffn_down.weight")) and use_more_bits(i_layer, n_layer):
        return "Q6_K"
    return "Q4_K"


def llama3_rope_factors(shape: Shape) -> np.ndarray:
    """(head_dim/2,) f32: convert_hf_to_gguf.py's rope_freqs for rope_type "llama3" (1 = unscaled,
    `factor` = fully scaled, smooth in between); llama.cpp divides each frequency by its factor."""
    rs = shape.rope_scaling
    dim = shape.head_dim
    freqs = 1.0 / (shape.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_ctx = 8192          # the converter reads it from the top level of config.json: absent there
    lo_wavelen, hi_wavelen = old_ctx / lo, old_ctx / hi
    out = []
    for f in freqs.astype(np.float64):
        wavelen = 2 * math.pi / f
        if wavelen < hi_wavelen:
            out.append(1.0)
        elif wavelen > lo_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def tensor_plan(shape: Shape) -> list[tuple[str, tuple[int, ...], str]]:
    """[(name, numpy shape (rows, cols) or (n,), type)] in the order the converter writes them."""
    e, hd = shape.n_embd, shape.head_dim
    plan = [("token_embd.weight", (shape.n_vocab, e), "Q6_K")]
    if shape.rope_scaling is not None:
        plan.append(("rope_freqs.weight", (hd // 2,), "F32"))
    for il in range(shape.n_layer):
        p = f"blk.{il}."
        mats = [("attn_q", (shape.n_head * hd, e)), ("attn_k", (shape.n_head_kv * hd, e)),
                ("attn_v", (shape.n_head_kv * hd, e)), ("attn_output", (e, shape.n_head * hd)),
                ("ffn_gate", (shape.n_ff, e)), ("ffn_up", (shape.n_ff, e)), ("ffn_down", (e, shape.n_ff))]
        plan.append((p + "attn_norm.weight", (e,), "F32"))
        if shape.arch == "qwen3":
            plan += [(p + "attn_q_norm.weight", (hd,), "F32"), (p + "attn_k_norm.weight", (hd,), "F32")]
        for m, shp in mats:
            name = p + m + ".weight"
            plan.append((name, shp, q4_k_m_type(name, il, shape.n_layer)))
        plan.append((p + "ffn_norm.weight", (e,), "F32"))
    plan.append(("output_norm.weight", (e,), "F32"))
    return plan


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, row_bytes) uint8 of valid random Q4_K / Q6_K blocks (see the module docstring for the scales)."""
    nb = cols // 256
    if kind == "Q4_K":
        blk = np.frombuffer(rng.bytes(rows * nb * 144), np.uint8).reshape(rows, nb, 144).copy()
        d = np.float16(1.0 / (236.0 * math.sqrt(cols)))
        blk[:, :, 0:2] = np.frombuffer(d.tobytes(), np.uint8)
        blk[:, :, 2:4] = np.frombuffer(np.float16(7.5 * d).tobytes(), np.uint8)
    elif kind == "Q6_K":
        blk = np.frombuffer(rng.bytes(rows * nb * 210), np.uint8).reshape(rows, nb, 210).copy()
        blk[:, :, 208:210] = np.frombuffer(np.float16(1.0 / (1350.0 * math.sqrt(cols))).tobytes(), np.uint8)
    else:
        raise ValueError(kind)
    return blk.reshape(rows, -1)


def vocabulary(shape: Shape) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): the 256 byte symbols, then every other token made by a merge of two
    earlier ones ("a b", one merge a token, in token order, as a trained BPE's are; mostly a token and
    one byte), the special tokens at their ids. A real vocabulary's size in tokens and merges is what
    its load costs (the GGUF string arrays, the BPE tables); the texts are a seeded draw, at most 12
    characters."""
    draw = random.Random(0).random
    alphabet = byte_alphabet()
    tokens = [alphabet[b] for b in range(256)]
    parts = list(tokens)                    # the tokens a merge may join: bytes and merge products
    types = [1] * 256
    merges = []
    known = set(tokens)
    while len(tokens) < shape.n_vocab:
        i = len(tokens)
        if i in shape.special:
            tokens.append(shape.special[i])
            types.append(3)                 # control
            continue
        made = ""
        while not made or made in known or len(made) > 12:
            a = parts[int(draw() * len(parts))]
            b = parts[int(draw() * (len(parts) if draw() < 0.2 else 256))]    # mostly one byte longer
            made = a + b
        merges.append(f"{a} {b}")
        tokens.append(made)
        parts.append(made)
        types.append(1)
        known.add(made)
    return tokens, types, merges


def write_synthetic(shape_name: str | Shape, path: str, seed: int = 0) -> str:
    """Write the synthetic Q4_K_M file of a shape (a SHAPES key or a Shape) to `path`; returns path."""
    import gguf

    shape = SHAPES[shape_name] if isinstance(shape_name, str) else shape_name
    rng = np.random.default_rng(seed)
    tmp = path + ".part"
    w = gguf.GGUFWriter(tmp, shape.arch)
    a = shape.arch
    w.add_type("model")
    w.add_name(f"synthetic {shape.name}")
    w.add_block_count(shape.n_layer)
    w.add_context_length(shape.n_ctx)
    w.add_embedding_length(shape.n_embd)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.norm_eps)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_K_M))
    if a == "llama":
        w.add_vocab_size(shape.n_vocab)
        w.add_rope_dimension_count(shape.head_dim)
    tokens, types, merges = vocabulary(shape)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(shape.tokenizer_pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(shape.bos)
    w.add_eos_token_id(shape.eos)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    qt = gguf.GGMLQuantizationType
    for name, shp, kind in tensor_plan(shape):
        if kind == "F32":
            if name == "rope_freqs.weight":
                arr = llama3_rope_factors(shape)
            else:
                arr = (1.0 + 0.1 * rng.standard_normal(shp)).astype(np.float32)
            w.add_tensor(name, arr)
        else:
            arr = random_blocks(kind, shp[0], shp[1], rng)
            w.add_tensor(name, arr, raw_dtype=getattr(qt, kind))   # byte shape -> (rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def synthetic_path(shape_name: str, cache_dir: str = CACHE_DIR) -> str:
    """The cached file of a shape, written on first use."""
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, f"synthetic-{shape_name}-q4_k_m-v{FORMAT_VERSION}.gguf")
    if not os.path.exists(path):
        write_synthetic(shape_name, path)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="+", choices=sorted(SHAPES))
    for name in ap.parse_args().shapes:
        print(synthetic_path(name))


if __name__ == "__main__":
    main()
