"""Llama family: Llama 2/3, SmolLM2, TinyLlama, Mistral-style (RMSNorm, SwiGLU, RoPE, GQA).

GGUF files of this architecture store q/k rows in llama.cpp's interleaved RoPE order; they are
permuted back to HF's rotate-half order at load (models.common.unpermute_rope_qk).
"""
from __future__ import annotations

from ringllm.models.common import GGUFHParams, hf_get, hf_rope_theta_scale, llama_style_hf_names, rename, unpermute_rope_qk
from ringllm.runtime.errors import UnsupportedModelError
from ringllm.runtime.model_spec import ModelSpec

ARCH = "llama"
HF_MODEL_TYPES = ("llama", "mistral")


def spec_from_gguf(f) -> ModelSpec:
    hp = GGUFHParams(f)
    n_embd, n_head = int(hp.req("embedding_length")), int(hp.req("attention.head_count"))
    n_layer = int(hp.req("block_count"))
    head_dim = int(hp.opt("attention.key_length", n_embd // n_head))
    return ModelSpec(
        arch=ARCH, n_vocab=hp.n_vocab(), n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        n_head_kv=int(hp.opt("attention.head_count_kv", n_head)), head_dim=head_dim,
        n_ff=int(hp.req("feed_forward_length")), n_ctx=int(hp.opt("context_length", 2048)),
        norm="rms", norm_eps=float(hp.opt("attention.layer_norm_rms_epsilon", 1e-5)), act="silu",
        rotary_dim=int(hp.opt("rope.dimension_count", head_dim)),
        rope_base=(float(hp.opt("rope.freq_base", 10000.0)),) * n_layer,
        rope_scale=(hp.rope_scale(),) * n_layer,
        window=(int(hp.opt("attention.sliding_window", 0) or 0),) * n_layer,
        tied_output="output.weight" not in f.tensors,
    )


def spec_from_hf(config: dict, path: str) -> ModelSpec:
    n_embd, n_head = hf_get(config, path, "hidden_size"), hf_get(config, path, "num_attention_heads")
    n_layer = hf_get(config, path, "num_hidden_layers")
    theta, scale = hf_rope_theta_scale(config, path)
    head_dim = hf_get(config, path, "head_dim", n_embd // n_head)
    window = config.get("sliding_window") if config.get("model_type") == "mistral" else None
    return ModelSpec(
        arch=ARCH, n_vocab=hf_get(config, path, "vocab_size"), n_embd=n_embd, n_layer=n_layer,
        n_head=n_head, n_head_kv=hf_get(config, path, "num_key_value_heads", n_head), head_dim=head_dim,
        n_ff=hf_get(config, path, "intermediate_size"), n_ctx=hf_get(config, path, "max_position_embeddings", 2048),
        norm="rms", norm_eps=float(hf_get(config, path, "rms_norm_eps", 1e-6)),
        act=_hf_act(config, path), rotary_dim=int(head_dim * float(config.get("partial_rotary_factor", 1.0))),
        rope_base=(theta,) * n_layer, rope_scale=(scale,) * n_layer, window=(int(window or 0),) * n_layer,
        tied_output=bool(config.get("tie_word_embeddings", False)),
    )


def _hf_act(config: dict, path: str) -> str:
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(path, f"hidden_act {act!r} is not supported for {ARCH} (silu)")
    return "silu"


def gguf_tensors(spec: ModelSpec, tensors: dict) -> dict:
    return unpermute_rope_qk(spec, tensors)


def hf_tensors(spec: ModelSpec, tensors: dict) -> dict:
    return rename(tensors, llama_style_hf_names(spec.n_layer))
