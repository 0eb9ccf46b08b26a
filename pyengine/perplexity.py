"""Perplexity of a token stream, in the two protocols people compare against.

chunked (llama.cpp's llama-perplexity): the tokens are cut into n_chunks = len // n_ctx chunks of
    n_ctx tokens; each chunk is evaluated from an empty cache with its first token replaced by BOS
    (when the model adds one); only the second half is scored: the token at position j+1 is
    predicted from the logits at j for j in [n_ctx/2, n_ctx - 1). PPL = exp(mean NLL).
streaming (StreamingLLM, Xiao et al. 2023, sec. 4.1): the tokens are fed one at a time through a
    bounded KV store (a policy and a capacity); the NLL of every next token is scored. This is the
    decode-time quality of an eviction policy.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import numpy as np

from ringllm.runtime.errors import ConfigError


def log_softmax_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """NLL (T,) float64 of targets (T,) under logits (T, n_vocab), computed in float64."""
    x = logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = np.log(np.exp(x - m).sum(axis=1)) + m[:, 0]
    return lse - x[np.arange(len(targets)), targets]


@dataclass
class PerplexityResult:
    protocol: str
    ppl: float
    nll_mean: float
    n_scored: int
    n_tokens: int
    chunk_ppl: list[float]
    settings: dict

    def to_dict(self) -> dict:
        return asdict(self)


def chunked(logits_fn: Callable[[list[int]], np.ndarray], ids: list[int], n_ctx: int, bos_id: int | None,
            n_chunks: int | None = None, progress: Callable[[Iterable], Iterable] = lambda x: x) -> PerplexityResult:
    """llama-perplexity's protocol. logits_fn(chunk_ids) -> (n_ctx, n_vocab) from a fresh cache."""
    if n_ctx < 4 or n_ctx % 2:
        raise ConfigError(f"n_ctx must be an even number >= 4, got {n_ctx}")
    available = len(ids) // n_ctx
    if available < 1:
        raise ConfigError(f"need at least n_ctx = {n_ctx} tokens, the text has {len(ids)}")
    n = available if n_chunks is None else min(n_chunks, available)
    total, count, per_chunk = 0.0, 0, []
    first = n_ctx // 2
    for c in progress(range(n)):
        chunk = list(ids[c * n_ctx:(c + 1) * n_ctx])
        if bos_id is not None:
            chunk[0] = bos_id
        logits = logits_fn(chunk)
        nll = log_softmax_nll(logits[first:n_ctx - 1], np.asarray(ids[c * n_ctx + first + 1:(c + 1) * n_ctx]))
        total += float(nll.sum())
        count += nll.size
        per_chunk.append(float(np.exp(total / count)))
    return PerplexityResult("chunked", float(np.exp(total / count)), total / count, count, n * n_ctx, per_chunk,
                            {"n_ctx": n_ctx, "n_chunks": n, "bos": bos_id})


def streaming(step_fn: Callable[[int], np.ndarray], ids: list[int], n_tokens: int | None = None,
              progress: Callable[[Iterable], Iterable] = lambda x: x, settings: dict | None = None,
              report_every: int = 1000) -> PerplexityResult:
    """StreamingLLM's protocol. step_fn(token) -> logits (n_vocab,) after feeding it through the store."""
    n = len(ids) if n_tokens is None else min(n_tokens, len(ids))
    if n < 2:
        raise ConfigError(f"need at least 2 tokens, got {n}")
    total, count, running = 0.0, 0, []
    for i in progress(range(n - 1)):
        logits = step_fn(ids[i])
        total += float(log_softmax_nll(logits[None, :], np.asarray([ids[i + 1]]))[0])
        count += 1
        if count % report_every == 0:
            running.append(float(np.exp(total / count)))
    return PerplexityResult("streaming", float(np.exp(total / count)), total / count, count, n, running,
                            dict(settings or {}))
