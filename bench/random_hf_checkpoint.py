"""A random-weight HF checkpoint in a real model's exact configuration, built with transformers.

    python bench/random_hf_checkpoint.py gemma3-270m OUT_DIR [--dtype bfloat16] [--layers N]

For speed measurements where the model's file cannot be had (a GPU machine with no network, reached
through a 64 MiB transfer, cannot receive Gemma 3 270M's 250 MB GGUF): transformers builds the model
from its config.json with random weights and saves it as safetensors; ringllm and transformers both
load the directory. The shapes, and so the bytes read per token, are the model's; the weights are in
`dtype` (bfloat16 by default, what the hub's checkpoint holds), not a GGUF quantization, so the figures
are those of a bf16 checkpoint. The numbers are noise and the logits mean nothing.
"""
from __future__ import annotations

import argparse

# google/gemma-3-270m config.json (text model)
CONFIGS = {
    "gemma3-270m": dict(
        arch="gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=512, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, rms_norm_eps=1e-6,
        max_position_embeddings=32768, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
        bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True),
}


def build(name: str, out_dir: str, dtype: str = "bfloat16", n_layer: int | None = None, seed: int = 0) -> str:
    """Save the random checkpoint of CONFIGS[name] (optionally cut to n_layer layers) to out_dir."""
    import torch
    import transformers as tf

    cfg = dict(CONFIGS[name])
    arch = cfg.pop("arch")
    if n_layer is not None:
        cfg["num_hidden_layers"] = n_layer
        cfg["layer_types"] = cfg["layer_types"][:n_layer]
    torch.manual_seed(seed)
    if arch != "gemma3":
        raise ValueError(arch)
    config = tf.Gemma3TextConfig(**cfg)
    model = tf.Gemma3ForCausalLM(config).to(getattr(torch, dtype)).eval()
    model.save_pretrained(out_dir)
    return out_dir


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("name", choices=sorted(CONFIGS))
    ap.add_argument("out")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--layers", type=int, default=None)
    a = ap.parse_args(argv)
    print(build(a.name, a.out, a.dtype, a.layers))


if __name__ == "__main__":
    main()
