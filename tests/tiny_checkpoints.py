"""Tiny random HF checkpoints of every architecture, built and saved with transformers.

Weights are redrawn with a larger spread than the default init (0.02) so logits are O(1) and a
numeric slip cannot hide under tiny values; norm multipliers are drawn around 1.
"""
from __future__ import annotations

import torch

VOCAB = 256


def tiny_config(arch: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, max_position_embeddings=256)
    if arch == "llama":
        return tf.LlamaConfig(**common, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                              tie_word_embeddings=False)
    if arch == "qwen2":
        return tf.Qwen2Config(**common, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6,
                              tie_word_embeddings=True)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**common, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24,
                                   sliding_window=8, layer_types=["sliding_attention", "sliding_attention",
                                                                  "full_attention"],
                                   rope_theta=1e6, rope_local_base_freq=10000.0, rms_norm_eps=1e-6)
    if arch == "gptneox":
        return tf.GPTNeoXConfig(**common, rotary_pct=0.25, rotary_emb_base=10000, layer_norm_eps=1e-5,
                                use_parallel_residual=True, tie_word_embeddings=False)
    raise ValueError(arch)


ARCHS = ("llama", "qwen2", "gemma3", "gptneox")


def build_tiny(arch: str, out_dir: str, seed: int = 0, dtype=torch.float32):
    """Save a tiny random `arch` checkpoint to out_dir; returns the float32 eager transformers model
    holding exactly the saved values (rounded through `dtype`)."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    cfg._attn_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name and name.endswith("weight"):
                centre = 0.0 if arch == "gemma3" else 1.0   # Gemma applies (1 + w)
                p.copy_(centre + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)
    model.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    if dtype == torch.float32:
        return model
    # reload rather than upcast: .to(bf16) would also round buffers such as RoPE's inv_freq
    return tf.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager").eval()
