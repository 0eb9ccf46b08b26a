"""transformers as the speed anchor of the GPU benchmark (and usable on the CPU): the same GGUF
loaded by transformers (dequantized to float16 on a GPU, float32 on the CPU), timed two ways.

  default_cache   prefill tok/s of the prompt and greedy decode tok/s with transformers' default
                  cache (DynamicCache: grows with every token, nothing evicted).
  shift_append    the HF StreamingLLM pattern, the baseline ringllm's in-place store replaces: a
                  stream of n tokens through a cache bounded at `capacity` with `sinks` attention
                  sinks; whenever it is full, every layer's K and V are rebuilt by concatenation
                  without the oldest non-sink token and the shifted keys are re-rotated by one
                  position, each layer with its own RoPE frequencies (positions re-indexed inside
                  the cache; a sliding-window layer, which transformers trims to its window, is
                  shifted over the positions it holds). Per-token latency recorded.

Used by bench/gpu_speed.py; `python bench/transformers_baseline.py --device cpu -n 64` runs it here.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np


def load(path: str, device: str):
    """(model, torch) for a GGUF file or an HF directory; float16 on CUDA, float32 on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    if os.path.isfile(path):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                     gguf_file=os.path.basename(path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval(), torch


def _sync(torch, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def default_cache(model, torch, device: str, prompt: list[int], n_tg: int, repeats: int = 3) -> dict:
    """Median prefill tok/s over the prompt and greedy decode tok/s for n_tg tokens after it."""
    pp, tg = [], []
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        model(ids[:, :8], use_cache=True)                       # warm-up
        for _ in range(repeats):
            _sync(torch, device)
            t0 = time.perf_counter()
            out = model(ids, use_cache=True)
            _sync(torch, device)
            pp.append(len(prompt) / (time.perf_counter() - t0))
            cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(n_tg):
                out = model(tok, past_key_values=cache, use_cache=True)
                cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            _sync(torch, device)
            tg.append(n_tg / (time.perf_counter() - t0))
    return {"pp": float(np.median(pp)), "tg": float(np.median(tg)), "prompt": len(prompt), "n_tg": n_tg}


def layer_inv_freqs(model) -> list:
    """Per layer, the RoPE inverse frequencies (head_dim / 2,) transformers rotates its keys with.
    One set for most models; Gemma 3 has one per layer type (local and global bases): transformers 5
    keeps them as `{layer_type}_inv_freq` on the rotary module, 4.x as a second module
    (`rotary_emb_local`) for the sliding-window layers."""
    rot, cfg = model.model.rotary_emb, model.config
    local = getattr(model.model, "rotary_emb_local", None)
    out = []
    for t in getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers:
        if hasattr(rot, f"{t}_inv_freq"):
            out.append(getattr(rot, f"{t}_inv_freq"))
        elif local is not None and t == "sliding_attention":
            out.append(local.inv_freq)
        else:
            out.append(rot.inv_freq)
    return out


def rotation_by(inv_freq, torch, device: str, delta: int):
    """cos, sin (head_dim,) of a rotation by `delta` positions in transformers' rotate-half layout."""
    inv = inv_freq.to(device=device, dtype=torch.float32)
    ang = torch.cat([inv, inv]) * float(delta)
    return torch.cos(ang), torch.sin(ang)


def rotate(k, cos, sin):
    """k (..., head_dim) rotated by the angles cos, sin (head_dim,) (rotate-half layout)."""
    import torch
    half = k.shape[-1] // 2
    rot = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
    return (k.float() * cos + rot.float() * sin).to(k.dtype)


def evict_and_shift(layer, n: int, sinks: int, cos, sin) -> None:
    """Drop position `sinks` of n from one cache layer and move the later positions down one (keys
    re-rotated by cos, sin). A sliding-window layer (transformers trims it to its window) holds only
    the last positions: it drops position `sinks` only if it holds it, re-rotates what lies past the
    sinks, and its count of positions seen, which its attention mask is sized by, goes down too."""
    import torch

    k, v = layer.keys, layer.values
    first = n - k.shape[2]                                  # position of the layer's first entry
    if first <= sinks:
        d = sinks - first
        layer.keys = torch.cat([k[:, :, :d], rotate(k[:, :, d + 1:], cos, sin)], dim=2)
        layer.values = torch.cat([v[:, :, :d], v[:, :, d + 1:]], dim=2)
    else:
        layer.keys = rotate(k, cos, sin)
    if hasattr(layer, "cumulative_length"):
        layer.cumulative_length -= 1


def stream_shift_append(model, torch, device: str, prompt: list[int], n_tokens: int, capacity: int,
                        sinks: int = 4):
    """Stream n_tokens greedy tokens through a cache bounded at `capacity` by shift-and-append (module
    docstring), after prefilling prompt[:capacity]. Returns (latency s per token, the tokens fed,
    the cache at the end)."""
    rotations = [rotation_by(inv, torch, device, -1) for inv in layer_inv_freqs(model)]
    lat = np.empty(n_tokens)
    with torch.inference_mode():
        out = model(torch.tensor([prompt[:capacity]], device=device), use_cache=True)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        toks = []
        for i in range(n_tokens):
            toks.append(int(tok))
            t0 = time.perf_counter()
            n = cache.get_seq_length()                          # positions held (re-indexed)
            if n >= capacity:                                   # evict the oldest non-sink token
                for layer, (cos, sin) in zip(cache.layers, rotations):
                    evict_and_shift(layer, n, sinks, cos, sin)
                n -= 1
            pos = torch.tensor([[n]], device=device)
            out = model(tok, past_key_values=cache, use_cache=True, position_ids=pos, cache_position=pos[0])
            cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            _sync(torch, device)
            lat[i] = time.perf_counter() - t0
    return lat, toks, cache


def shift_append(model, torch, device: str, prompt: list[int], n_tokens: int, capacity: int, sinks: int = 4) -> dict:
    """stream_shift_append's tok/s, latency of the first and last thousand tokens, and the tokens fed."""
    lat, toks, cache = stream_shift_append(model, torch, device, prompt, n_tokens, capacity, sinks)
    ms = lat * 1e3
    first, last = ms[:min(1000, n_tokens)], ms[-min(1000, n_tokens):]
    return {"tok_s": float(n_tokens / lat.sum()), "capacity": capacity, "sinks": sinks, "n_tokens": n_tokens,
            "first_p50_ms": float(np.median(first)), "first_p99_ms": float(np.percentile(first, 99)),
            "last_p50_ms": float(np.median(last)), "last_p99_ms": float(np.percentile(last, 99)),
            "cache_len": int(cache.get_seq_length()), "tokens": toks}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF file or HF dir (default: bundled SmolLM2)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("-n", type=int, default=64, help="decode tokens")
    ap.add_argument("--pp", type=int, default=128)
    ap.add_argument("--capacity", type=int, default=64)
    args = ap.parse_args(argv)
    from ringllm.models.bundled import default_model_path

    model, torch = load(args.model or default_model_path(), args.device)
    prompt = np.random.default_rng(0).integers(100, 5000, args.pp).tolist()
    print("default cache:", default_cache(model, torch, args.device, prompt, args.n, repeats=1))
    print("shift-and-append:", shift_append(model, torch, args.device, prompt, args.n, args.capacity))


if __name__ == "__main__":
    main()
