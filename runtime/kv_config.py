"""KVConfig: how a sequence's KV store is sized, which eviction policy chooses victims, and its knobs.

One object carries every knob of DESIGN.md's "Eviction policies" table; `validate()` (run at
construction) rejects unknown names and inconsistent budgets with errors that list the valid
values. The same object configures the CPU engine, the NumPy reference engine and the CUDA backend.

    KVConfig(capacity=512, policy="streaming", sinks=4)                 StreamingLLM
    KVConfig(capacity=256, policy="h2o", recent=128)                    H2O, half heavy hitters, half recent
    KVConfig(capacity=2048, policy="streaming", lazy=32, slack=16, max_drop=32)   staged eviction

Staged eviction (DESIGN.md, seed "Lazy Pruning, Slack, Max_Drop", Algorithm 1), on top of any
policy: with C = capacity and H = C + slack, nothing is evicted while the held length L (the new
token included) satisfies L <= C or L - C < lazy; otherwise the store keeps
L* = C if max_drop == 0 else min(max(L - max_drop, C), H) tokens. lazy = slack = max_drop = 0
(the default) is plain per-step eviction: L* = C whenever L > C. With staging the store holds up to
max(C + lazy, H + 1) tokens at once, which is what it allocates.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from ringllm.runtime.errors import ConfigError
from ringllm.runtime.eviction import keep_after
from ringllm.runtime.kv_types import check_kv_type
from ringllm.runtime.policies import REGISTRY

POLICIES = ("full", "streaming", "h2o", "scissorhands", "tova", "knorm", "lsh", "random", "snapkv", "pyramidkv",
            "adakv", "gvote", "rkv")
POSITION_MODES = ("reindexed", "original")
UPDATE_MODES = ("inplace", "shift")
# prompt compression after prefill (runtime/press.py)
PRESSES = ("snapkv", "pyramidkv", "adakv", "gvote", "tova", "knorm", "streaming", "random")
# decode-time policies whose choice couples the kv heads of a layer (scores averaged over every head's
# slot j: the heads must hold the same tokens; a press keeps one set for every head: KVConfig.aligned_heads)
HEAD_ALIGNED_POLICIES = ("tova", "gvote")
# what a compressing call does with a prompt longer than it takes (KVConfig.compress_overflow)
COMPRESS_OVERFLOW = ("error", "stream")


@dataclass
class KVConfig:
    """KV store configuration (DESIGN.md "KV store contract" and "Eviction policies").

    capacity: tokens a query attends to, itself included (None with policy "full": the model's context).
    policy: one of POLICIES.
    sinks: first tokens never evicted.
    recent: newest held tokens never evicted by score-based policies (None: the policy's default,
        Policy.default_recent in its file: h2o capacity/2 as in the paper's even heavy/recent split,
        lsh 10 as in the paper, windowed policies their observation window, scissorhands/gvote
        capacity/4, else 0).
    positions: "reindexed" (rank among held tokens, StreamingLLM) | "original" (index in the sequence).
    lazy, slack, max_drop: staged eviction R, sigma, delta (module docstring); 0 disables each.
    lsh_bits: SimHash code length c of `lsh`, 1..64.
    history: steps of the history window of `scissorhands`, 1..64.
    window: observation window w (last queries scored) of `snapkv`, `pyramidkv`, `adakv`, `rkv`.
    pool: max-pooling kernel over neighbouring tokens of the windowed scores (odd, >= 1).
    pyramid_beta: `pyramidkv` top/bottom layer budget ratio (>= 1).
    ada_floor: `adakv` share of each head's even split it is guaranteed, in [0, 1].
    gvote_p: `gvote` nucleus mass p, in (0, 1]; gvote_samples: synthetic queries S, >= 1.
    rkv_lambda: `rkv` weight of importance against redundancy, in [0, 1].
    seed: seed of `random`, `lsh` projections and `gvote` sampling.
    update: "inplace" (EQUIP) | "shift" (shift-and-append baseline for benchmarks: survivors copied down).
    k_type, v_type: how keys and values are held, runtime/kv_types.py: "f32" (default), "f16", "q8_0"
        or "q4_0" (llama.cpp's block layouts along head_dim, one f16 scale per 32 values; head_dim
        must be a multiple of 32). A row is encoded once, when its token is written, and slots move
        as encoded rows. Keys the layer's RoPE strategy stores rotated ("stored": at the sequence
        index) are quantized after rotation; policy layers of a quantized-key store keep keys before
        RoPE (rotated as read), so no eviction ever re-quantizes a key; the "kshift" strategy
        re-rotates (decodes, rotates, encodes) a key each time an eviction re-indexes it.

    Prompt compression after prefill (runtime/press.py, runtime/compress.py; generate, chat and chat
    sessions): the whole prompt is prefilled into a transient store sized to it, the press scores the
    prompt's tokens with the last `compress_window` queries, the chosen ones are kept and the store is
    rebuilt at the kept size plus the decode room; decoding then runs under `policy` (full: room for
    the tokens to generate; any other policy: `capacity` is the room it keeps beside the kept prompt,
    per layer its own budget; an evicting policy carries the state it built over the whole prompt,
    h2o's masses, lsh's codes, ..., for the tokens the press kept). adakv and gvote keep different
    numbers of tokens per kv head; under full, streaming (unstaged) and adakv the heads stay so, under
    the other policies each head is topped up to its layer's fullest (equal_head_counts).
    compress: one of PRESSES, or None (no compression).
    compress_budget: tokens each kv head keeps of the prompt (the per-layer mean for pyramidkv, the
        per-head mean for adakv); a budget above the prompt keeps everything.
    compress_ratio: the share of the prompt kept, in (0, 1]: floor(n x ratio) tokens.
        Exactly one of budget and ratio, except for gvote, which chooses its own budget (neither).
    compress_window: observation window w (the last w prompt queries score the others; kvpress's 64);
        gvote: its n_f future positions.
    compress_pool: average-pooling kernel over neighbouring tokens of snapkv/pyramidkv/adakv scores
        (odd, >= 1; kvpress's 5).
    max_prompt: longest prompt a compressing call prefills (None: the model's context); a longer one
        is a ConfigError at the call, unless compress_overflow says otherwise.
    compress_overflow: what a prompt (or chat turn) too long to compress does: "error" (a ConfigError at
        the call, the default) or "stream" (it goes through the decode-time policy uncompressed, token
        by token as any prompt of a streaming store does: the store stays at its capacity, and what it
        evicts is the policy's choice, not the press's). "stream" needs policy streaming.
    """

    capacity: int | None = None
    policy: str = "full"
    sinks: int = 4
    recent: int | None = None
    positions: str = "reindexed"
    lazy: int = 0
    slack: int = 0
    max_drop: int = 0
    lsh_bits: int = 16
    history: int = 32
    window: int = 32
    pool: int = 7
    pyramid_beta: float = 20.0
    ada_floor: float = 0.2
    gvote_p: float = 0.95
    gvote_samples: int = 8
    rkv_lambda: float = 0.1
    seed: int = 0
    update: str = "inplace"
    compress: str | None = None
    compress_budget: int | None = None
    compress_ratio: float | None = None
    compress_window: int = 64
    compress_pool: int = 5
    max_prompt: int | None = None
    compress_overflow: str = "error"
    k_type: str = "f32"
    v_type: str = "f32"

    def __post_init__(self):
        self.validate()

    # -----------------------------------------------------------------------------------------

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        for f in fields(self):
            val = getattr(self, f.name)
            if f.type in ("int", "int | None") and val is not None:
                need(isinstance(val, int) and not isinstance(val, bool), f"{f.name} must be an integer, got {val!r}")
        need(self.policy in POLICIES, f"policy {self.policy!r} unknown; valid: {', '.join(POLICIES)}")
        need(self.positions in POSITION_MODES, f"positions {self.positions!r} unknown; valid: {', '.join(POSITION_MODES)}")
        need(self.update in UPDATE_MODES, f"update {self.update!r} unknown; valid: {', '.join(UPDATE_MODES)}")
        check_kv_type(self.k_type, "k_type")
        check_kv_type(self.v_type, "v_type")
        need(self.sinks >= 0, f"sinks must be >= 0, got {self.sinks}")
        need(self.recent is None or self.recent >= 0, f"recent must be >= 0, got {self.recent}")
        for name in ("lazy", "slack", "max_drop"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        need(1 <= self.lsh_bits <= 64, f"lsh_bits must be in 1..64, got {self.lsh_bits}")
        need(1 <= self.history <= 64, f"history must be in 1..64, got {self.history}")
        need(self.window >= 1, f"window must be >= 1, got {self.window}")
        need(self.pool >= 1 and self.pool % 2 == 1, f"pool must be an odd integer >= 1, got {self.pool}")
        need(self.pyramid_beta >= 1, f"pyramid_beta must be >= 1, got {self.pyramid_beta}")
        need(0.0 <= self.ada_floor <= 1.0, f"ada_floor must be in [0, 1], got {self.ada_floor}")
        need(0.0 < self.gvote_p <= 1.0, f"gvote_p must be in (0, 1], got {self.gvote_p}")
        need(self.gvote_samples >= 1, f"gvote_samples must be >= 1, got {self.gvote_samples}")
        need(0.0 <= self.rkv_lambda <= 1.0, f"rkv_lambda must be in [0, 1], got {self.rkv_lambda}")
        self._validate_compress(need)
        if self.policy == "full":
            need(self.capacity is None or self.capacity >= 1, f"capacity must be >= 1, got {self.capacity}")
            need(not (self.lazy or self.slack or self.max_drop),
                 "staged eviction (lazy/slack/max_drop) needs an eviction policy, not 'full'")
            need(self.update == "inplace", "update 'shift' (the shift-and-append benchmark baseline) needs an "
                 "eviction policy, not 'full'")
            return
        need(self.capacity is not None, f"policy {self.policy!r} needs a capacity (tokens kept)")
        need(self.capacity >= self.sinks + 1, f"capacity must be at least sinks + 1 = {self.sinks + 1} "
             f"(got {self.capacity}): the new token needs a slot beside the sinks")
        recent = self.resolved_recent
        need(self.sinks + recent < self.capacity, f"sinks + recent = {self.sinks} + {recent} must be below the capacity "
             f"{self.capacity}: at least one slot must be evictable")

    def _validate_compress(self, need) -> None:
        """The prompt-compression fields (class docstring): a press by name, its budget, the decode-time
        policies a compressed store supports."""
        need(self.compress_overflow in COMPRESS_OVERFLOW,
             f"compress_overflow {self.compress_overflow!r} unknown; valid: {', '.join(COMPRESS_OVERFLOW)}")
        if self.compress is None:
            for name in ("compress_budget", "compress_ratio", "max_prompt"):
                need(getattr(self, name) is None, f"{name} needs a press: set compress to one of {', '.join(PRESSES)}")
            need(self.compress_overflow == "error", "compress_overflow needs a press: set compress to one of "
                 f"{', '.join(PRESSES)}")
            return
        need(self.compress in PRESSES, f"compress {self.compress!r} unknown; valid: {', '.join(PRESSES)}")
        need(self.ring or self.capacity is not None, f"a compressed prompt decoding under policy {self.policy!r} "
             "needs a capacity (the slots the policy keeps beside the kept prompt)")
        need(self.update == "inplace", "compress needs update 'inplace'")
        need(self.compress_overflow == "error" or self.policy == "streaming",
             "compress_overflow 'stream' sends a prompt too long to compress through the decode-time policy, "
             f"which must evict: policy 'streaming', not {self.policy!r}")
        budget, ratio = self.compress_budget, self.compress_ratio
        if self.compress == "gvote":
            need(budget is None and ratio is None, "gvote chooses its own budget: give neither compress_budget nor "
                 "compress_ratio (gvote_p and gvote_samples steer it)")
        else:
            need((budget is None) != (ratio is None), f"press {self.compress!r} needs exactly one of compress_budget "
                 "(tokens kept) and compress_ratio (share kept)")
        need(budget is None or budget >= 1, f"compress_budget must be >= 1, got {budget}")
        need(ratio is None or (isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0.0 < ratio <= 1.0),
             f"compress_ratio must be in (0, 1], got {ratio!r}")
        need(self.compress_window >= 1, f"compress_window must be >= 1, got {self.compress_window}")
        need(self.compress_pool >= 1 and self.compress_pool % 2 == 1,
             f"compress_pool must be an odd integer >= 1, got {self.compress_pool}")
        need(self.max_prompt is None or self.max_prompt >= 1, f"max_prompt must be >= 1, got {self.max_prompt}")

    def decode_config(self, capacity: int) -> "KVConfig":
        """The KVConfig of the store a compressed prompt decodes in: this one's decode-time policy at
        `capacity` slots (the kept tokens plus the room), without the compression fields."""
        return replace(self, capacity=capacity, compress=None, compress_budget=None, compress_ratio=None,
                       max_prompt=None, compress_overflow="error")

    # -----------------------------------------------------------------------------------------

    @property
    def resolved_recent(self) -> int:
        """Protected recent tokens after applying the policy default (Policy.default_recent)."""
        if self.recent is not None:
            return self.recent
        return REGISTRY[self.policy].default_recent(self)

    def check_types_fit(self, head_dim: int) -> None:
        """ConfigError unless k_type and v_type can hold rows of head_dim values (q8_0 / q4_0 blocks of
        32 must tile it): checked where a model meets the config (a store, a server request)."""
        check_kv_type(self.k_type, "k_type", head_dim)
        check_kv_type(self.v_type, "v_type", head_dim)

    @property
    def quantized_keys(self) -> bool:
        """Whether keys are held in a type other than f32 (their layout then avoids re-rotations)."""
        return self.k_type != "f32"

    @property
    def staged(self) -> bool:
        return bool(self.lazy or self.slack or self.max_drop)

    @property
    def aligned_heads(self) -> bool:
        """Whether the decode-time policy scores each token over every kv head of a layer (tova, gvote),
        so the heads must hold the same tokens: a press then keeps one set for every head."""
        return self.policy in HEAD_ALIGNED_POLICIES

    @property
    def equal_head_counts(self) -> bool:
        """Whether the decode-time policy evicts the same number of tokens from every kv head of a layer
        (every evicting policy but adakv): a ragged press (adakv, gvote) must then leave the heads of
        a layer equally full."""
        return not self.ring and self.policy != "adakv"

    @property
    def ring(self) -> bool:
        """Whether the store writes as a ring (policies full and streaming without staging): no
        policy kernels, the oldest non-sink token is overwritten."""
        return self.policy in ("full", "streaming") and not self.staged

    def keep_after(self, length: int) -> int:
        """Staged eviction (Algorithm 1): tokens to keep when `length` are held, the new one included."""
        return keep_after(length, self.capacity, self.lazy, self.slack, self.max_drop)

    @property
    def physical_capacity(self) -> int:
        """Slots allocated per (layer, kv head): capacity, or more with staging (module docstring)."""
        if self.capacity is None or not self.staged:
            return self.capacity or 0
        return max(self.capacity + max(self.lazy, 1), self.capacity + self.slack + 1)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "KVConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown KVConfig fields {unknown}; valid: {sorted(known)}")
        return cls(**d)
