"""Qwen2: the Llama layout plus biases on the q, k and v projections; NeoX RoPE in GGUF (no permutation)."""
from __future__ import annotations

from dataclasses import replace

from ringllm.models import llama
from ringllm.models.common import layer_windows, llama_style_hf_names, rename
from ringllm.runtime.model_spec import ModelSpec

ARCH = "qwen2"
HF_MODEL_TYPES = ("qwen2",)


def spec_from_gguf(f) -> ModelSpec:
    return replace(llama.spec_from_gguf(f), arch=ARCH)


def spec_from_hf(config: dict, path: str) -> ModelSpec:
    spec = llama.spec_from_hf(config, path)
    # Qwen2 configs carry a sliding_window that only applies to the layers `layer_types` marks
    # (derived from use_sliding_window/max_window_layers when the config predates layer_types)
    window = int(config.get("sliding_window") or 0)
    types = config.get("layer_types")
    if types is None:
        first = int(config.get("max_window_layers", spec.n_layer))
        types = ["sliding_attention" if config.get("use_sliding_window") and il >= first else "full_attention"
                 for il in range(spec.n_layer)]
    return replace(spec, arch=ARCH, window=layer_windows(types, window, spec.n_layer, path))


def gguf_tensors(spec: ModelSpec, tensors: dict) -> dict:
    return tensors


def hf_tensors(spec: ModelSpec, tensors: dict) -> dict:
    return rename(tensors, llama_style_hf_names(spec.n_layer))
