"""`streaming` (StreamingLLM, Xiao et al. 2023): keep the `sinks` first tokens and the most recent ones.

The victim is the oldest non-sink token. Without staged eviction the store serves this policy with
its ring kernel (no scan, no key); with staging the generic path evicts the oldest unprotected
tokens, keys = sequence index (Policy's defaults).
"""
from __future__ import annotations

from ringllm.runtime.policies.base import Policy


class Streaming(Policy):
    name = "streaming"


class Full(Policy):
    """`full`: nothing is evicted; the store is the model's context and overflowing it is an error."""

    name = "full"
