"""Helpers shared by the architecture files: GGUF metadata access, HF config access, tensor edits.

An architecture file (llama.py, qwen2.py, gemma3.py, gptneox.py) declares:
    ARCH            GGUF `general.architecture`
    HF_MODEL_TYPES  config.json `model_type` values it reads
    spec_from_gguf(f: GGUFFile) -> ModelSpec
    spec_from_hf(config: dict, path: str) -> ModelSpec
    gguf_tensors(spec, tensors) -> dict[str, QTensor]     (file layout -> internal layout)
    hf_tensors(spec, tensors) -> dict[str, QTensor]       (HF names/layout -> internal)
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ringllm.runtime.errors import ModelFileError, UnsupportedModelError
from ringllm.runtime.qtensor import QTensor
from ringllm.runtime.quant_types import GGMLType

# ---------------------------------------------------------------------------------------------
# GGUF metadata
# ---------------------------------------------------------------------------------------------


class GGUFHParams:
    """`{arch}.key` access on a GGUFFile with clear errors: req("block_count"), opt("rope.freq_base", 1e4)."""

    def __init__(self, f):
        self.f = f
        self.arch = f.architecture

    def req(self, key: str) -> Any:
        return self.f.require(f"{self.arch}.{key}")

    def opt(self, key: str, default: Any = None) -> Any:
        return self.f.get(f"{self.arch}.{key}", default)

    def n_vocab(self) -> int:
        n = self.opt("vocab_size")
        if n is None:
            tokens = self.f.get("tokenizer.ggml.tokens")
            if tokens is None:
                emb = self.f.tensors.get("token_embd.weight")
                if emb is None:
                    raise ModelFileError(self.f.path, "cannot tell the vocabulary size: no vocab_size, "
                                         "no tokenizer.ggml.tokens, no token_embd.weight")
                return emb.shape[0]
            return len(tokens)
        return int(n)

    def rope_scale(self) -> float:
        """Linear RoPE scaling factor (1.0 when none); other scaling types are not supported."""
        kind = self.opt("rope.scaling.type")
        factor = self.opt("rope.scaling.factor")
        if kind in (None, "none") or not factor:
            return 1.0
        if kind != "linear":
            raise UnsupportedModelError(self.f.path, f"RoPE scaling type {kind!r} is not supported (only linear)")
        return float(factor)


# ---------------------------------------------------------------------------------------------
# HF config.json
# ---------------------------------------------------------------------------------------------


def hf_get(config: dict, path: str, key: str, default: Any = ...) -> Any:
    """config[key], or `default`, or a ModelFileError naming config.json and the key."""
    if key in config and config[key] is not None:
        return config[key]
    if default is ...:
        raise ModelFileError(path, f"config.json has no '{key}'")
    return default


def hf_rope(config: dict, layer_type: str | None = None) -> dict:
    """The RoPE parameters of a layer type from either transformers 5 (`rope_parameters`, possibly
    keyed by layer type) or 4.x (`rope_theta`, `rope_scaling`, `partial_rotary_factor`)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            return params[layer_type]
        if "rope_theta" in params or "rope_type" in params:
            return params
    out: dict = {}
    if config.get("rope_theta") is not None:
        out["rope_theta"] = config["rope_theta"]
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict):
        out.update(scaling)
    return out


def hf_rope_theta_scale(config: dict, path: str, layer_type: str | None = None,
                        default_theta: float = 10000.0) -> tuple[float, float]:
    """(theta, linear scale) of a layer type; raises for scaling types the runtime does not implement."""
    rp = hf_rope(config, layer_type)
    theta = float(rp.get("rope_theta", default_theta))
    kind = rp.get("rope_type", rp.get("type", "default")) or "default"
    if kind == "default":
        return theta, 1.0
    if kind == "linear":
        return theta, float(rp["factor"])
    raise UnsupportedModelError(path, f"RoPE scaling type {kind!r} is not supported (default, linear)")


def layer_windows(layer_types: list, window: int, n_layer: int, path: str) -> tuple[int, ...]:
    """Per-layer attention window from HF `layer_types` ("sliding_attention" -> window, else 0 = global)."""
    if len(layer_types) != n_layer:
        raise ModelFileError(path, f"config.json layer_types has {len(layer_types)} entries for {n_layer} layers")
    if "sliding_attention" in layer_types and window <= 0:
        raise ModelFileError(path, "config.json marks sliding_attention layers but has no sliding_window")
    return tuple(window if t == "sliding_attention" else 0 for t in layer_types)


# ---------------------------------------------------------------------------------------------
# Tensor edits
# ---------------------------------------------------------------------------------------------


def float_values(t: QTensor) -> np.ndarray:
    """float32 values of an F32/F16/BF16 QTensor in its logical shape (used for small edits at load)."""
    if t.qtype == GGMLType.F32:
        arr = t.data.view(np.float32)
    elif t.qtype == GGMLType.F16:
        arr = t.data.view(np.float16).astype(np.float32)
    elif t.qtype == GGMLType.BF16:
        arr = (t.data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        raise ValueError(f"{t.name}: float_values needs a float tensor, got {t.qtype.name}")
    return arr.reshape(t.shape)


def f32_tensor(name: str, values: np.ndarray) -> QTensor:
    """A new F32 QTensor holding `values` (1-D or 2-D)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    rows = values.reshape(-1, values.shape[-1]) if values.ndim > 1 else values.reshape(1, -1)
    return QTensor(name, GGMLType.F32, tuple(values.shape), rows.view(np.uint8))


def rope_interleaved_to_half_rows(n_head: int, head_dim: int) -> np.ndarray:
    """Row gather index turning GGUF's interleaved q/k rows into HF's rotate-half order.

    llama.cpp's converter stores, within each head, pair i of the rotation at rows (2i, 2i+1); HF
    keeps the halves apart at rows (i, i + head_dim/2). Returns idx with W_hf = W_gguf[idx]:
    idx[h*hd + j*hd/2 + i] = h*hd + 2*i + j.
    """
    half = head_dim // 2
    h = np.arange(n_head)[:, None, None]
    j = np.arange(2)[None, :, None]
    i = np.arange(half)[None, None, :]
    return (h * head_dim + 2 * i + j).reshape(-1)


def unpermute_rope_qk(spec, tensors: dict[str, QTensor]) -> dict[str, QTensor]:
    """Apply rope_interleaved_to_half_rows to every layer's attn_q/attn_k weight (and bias)."""
    q_idx = rope_interleaved_to_half_rows(spec.n_head, spec.head_dim)
    k_idx = rope_interleaved_to_half_rows(spec.n_head_kv, spec.head_dim)
    out = dict(tensors)
    for il in range(spec.n_layer):
        for part, idx in (("attn_q", q_idx), ("attn_k", k_idx)):
            w = f"blk.{il}.{part}.weight"
            if w in out and out[w].shape[0] == len(idx):
                out[w] = out[w].take_rows(idx)
            b = f"blk.{il}.{part}.bias"
            if b in out:
                vals = float_values(out[b])
                out[b] = f32_tensor(b, vals[idx])
    return out


def rename(tensors: dict[str, QTensor], mapping: dict[str, str]) -> dict[str, QTensor]:
    """Keep the tensors named in `mapping` (source -> internal), renamed; others are dropped."""
    out = {}
    for src, dst in mapping.items():
        if src in tensors:
            t = tensors[src]
            out[dst] = QTensor(dst, t.qtype, t.shape, t.data)
    return out


def llama_style_hf_names(n_layer: int, prefix: str = "model.") -> dict[str, str]:
    """HF names of Llama-family checkpoints (llama, mistral, qwen2, gemma3) -> internal names."""
    m = {f"{prefix}embed_tokens.weight": "token_embd.weight", f"{prefix}norm.weight": "output_norm.weight",
         "lm_head.weight": "output.weight"}
    for il in range(n_layer):
        s, d = f"{prefix}layers.{il}.", f"blk.{il}."
        for kind in ("weight", "bias"):
            m[f"{s}self_attn.q_proj.{kind}"] = f"{d}attn_q.{kind}"
            m[f"{s}self_attn.k_proj.{kind}"] = f"{d}attn_k.{kind}"
            m[f"{s}self_attn.v_proj.{kind}"] = f"{d}attn_v.{kind}"
            m[f"{s}self_attn.o_proj.{kind}"] = f"{d}attn_output.{kind}"
            m[f"{s}mlp.gate_proj.{kind}"] = f"{d}ffn_gate.{kind}"
            m[f"{s}mlp.up_proj.{kind}"] = f"{d}ffn_up.{kind}"
            m[f"{s}mlp.down_proj.{kind}"] = f"{d}ffn_down.{kind}"
        m[f"{s}input_layernorm.weight"] = f"{d}attn_norm.weight"
        m[f"{s}post_attention_layernorm.weight"] = f"{d}ffn_norm.weight"
    return m

