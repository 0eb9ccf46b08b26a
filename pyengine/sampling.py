"""Sampling: a chain of small functions over one step's logits, and a seeded generator.

Each filter takes logits (a float64 array it may modify in place) and returns them with the
tokens it rules out set to -inf; none of them touches the random generator. The chain, in
llama.cpp's order:

    logit_bias -> grammar mask -> repetition / frequency / presence penalties -> (temperature 0: argmax)
    -> top_k -> top_p -> min_p -> temperature -> draw from the softmax

The grammar mask (a ringllm.constraints.Constraint, when the request has a response_format,
grammar or regex) sets every token the grammar forbids to -inf; the sampled token then advances
the constraint. The whole mask is computed at every token, greedy included: llguidance's check of
a single token accepts some tokens its mask leaves out (a lone " " before a quote the vocabulary
writes as one ' "' token), so checking the argmax alone would not give the masked argmax.

`temperature <= 0` is greedy decoding: the argmax after bias and penalties (ties: the lowest id).
The draw uses one uniform number of a numpy Generator (PCG64) per token, so the same seed and
the same logits give the same tokens, and the generator's state can be saved with a session
(`Sampler.state()` / `Sampler.from_state`).

Penalties look at the last `penalty_last_n` tokens of the history (prompt and generated tokens,
as llama.cpp does; 0 disables the window, -1 means the whole history):
    repeat_penalty r (llama.cpp/CTRL): a seen token's logit l becomes l / r if l > 0 else l * r;
    frequency_penalty f, presence_penalty p (OpenAI): l -= f * count + p * (count > 0).

Stop strings: `StopMatcher` is fed text deltas and returns what may be shown. It holds back any
tail that could still become a stop string, so a partial stop string is never emitted, and cuts
the text where a stop string appears.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Iterable, Sequence

import numpy as np

from ringllm.runtime.errors import ConfigError

__all__ = ["SamplingParams", "Sampler", "StopMatcher", "apply_logit_bias", "apply_penalties", "greedy",
           "top_k", "top_p", "min_p", "temperature", "softmax", "draw"]

NEG_INF = -np.inf


# ------------------------------------------------------------------------------------------------
# The filters
# ------------------------------------------------------------------------------------------------

def apply_logit_bias(logits: np.ndarray, bias: dict[int, float] | None) -> np.ndarray:
    """logits[id] += bias[id]; a bias of -100 or less bans the token (OpenAI's convention), +100 or
    more forces it (every other token is banned)."""
    if not bias:
        return logits
    forced = [i for i, b in bias.items() if b >= 100]
    for i, b in bias.items():
        logits[i] = NEG_INF if b <= -100 else logits[i] + b
    if forced:
        keep = logits[forced].copy()
        logits[:] = NEG_INF
        logits[forced] = keep
    return logits


def penalizes(repeat_penalty: float, frequency_penalty: float, presence_penalty: float, last_n: int) -> bool:
    """Whether apply_penalties with these settings changes a logit (given a history to penalize)."""
    return (repeat_penalty != 1.0 or frequency_penalty != 0.0 or presence_penalty != 0.0) and last_n != 0


def apply_penalties(logits: np.ndarray, history: Sequence[int], repeat_penalty: float = 1.0,
                    frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                    last_n: int = 64) -> np.ndarray:
    """Repetition (llama.cpp: divide a positive logit, multiply a negative one), frequency and
    presence penalties (OpenAI: subtract f * count + p) over the last `last_n` history tokens."""
    if not penalizes(repeat_penalty, frequency_penalty, presence_penalty, last_n) or len(history) == 0:
        return logits
    window = history if last_n < 0 else history[-last_n:]
    ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    vals = logits[ids]
    if repeat_penalty != 1.0:
        vals = np.where(vals > 0, vals / repeat_penalty, vals * repeat_penalty)
    vals = vals - frequency_penalty * counts - presence_penalty * (counts > 0)
    logits[ids] = vals
    return logits


def greedy(logits: np.ndarray) -> int:
    """The argmax (the lowest id among equal maxima)."""
    return int(np.argmax(logits))


def top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep the k largest logits (k <= 0 or k >= vocab: keep all). Ties at the k-th value are kept."""
    n = logits.shape[0]
    if k <= 0 or k >= n:
        return logits
    kth = np.partition(logits, n - k)[n - k]
    logits[logits < kth] = NEG_INF
    return logits


def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities (float64) of logits, -inf entries at 0."""
    m = np.max(logits)
    if not np.isfinite(m):
        raise ConfigError("every token was ruled out (all logits are -inf after bias/filters)")
    p = np.exp(logits - m)
    return p / p.sum()


def top_p(logits: np.ndarray, p: float) -> np.ndarray:
    """Nucleus: keep the smallest set of most probable tokens whose mass reaches p (p >= 1: all).
    The most probable token is always kept."""
    if p >= 1.0:
        return logits
    probs = softmax(logits)
    n = probs.shape[0]
    # the nucleus usually sits in a few hundred tokens: sort those, and sort all only if it does not
    m = min(n, 256)
    cand = np.argpartition(-probs, m - 1)[:m] if m < n else np.arange(n)
    order = cand[np.argsort(-probs[cand], kind="stable")]
    csum = np.cumsum(probs[order])
    if csum[-1] < p - 1e-9 and m < n:
        order = np.argsort(-probs, kind="stable")
        csum = np.cumsum(probs[order])
    # first index where the mass reaches p (within rounding: 0.5 + 0.3 reaches 0.8)
    cut = int(np.searchsorted(csum, p - 1e-9, side="left")) + 1
    keep = order[:min(cut, order.shape[0])]
    mask = np.ones(n, dtype=bool)
    mask[keep] = False
    logits[mask] = NEG_INF
    return logits


def min_p(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep tokens whose probability is at least p times the top token's (p <= 0: all)."""
    if p <= 0.0:
        return logits
    # prob_i / prob_max = exp(l_i - l_max) >= p  <=>  l_i >= l_max + log p
    threshold = np.max(logits) + math.log(p)
    logits[logits < threshold] = NEG_INF
    return logits


def temperature(logits: np.ndarray, t: float) -> np.ndarray:
    """Divide by t (> 0)."""
    if t <= 0:
        raise ConfigError(f"temperature must be > 0 here (0 is greedy), got {t}")
    if t != 1.0:
        logits /= t
    return logits


def draw(logits: np.ndarray, rng: np.random.Generator) -> int:
    """One token from softmax(logits), using exactly one uniform number of rng."""
    probs = softmax(logits)
    csum = np.cumsum(probs)
    u = rng.random() * csum[-1]
    i = int(np.searchsorted(csum, u, side="right"))
    i = min(i, probs.shape[0] - 1)
    while probs[i] == 0.0 and i > 0:      # never land on a ruled-out token through rounding
        i -= 1
    return i


# ------------------------------------------------------------------------------------------------
# Parameters and the sampler
# ------------------------------------------------------------------------------------------------

@dataclass
class SamplingParams:
    """Every knob of the chain (module docstring). Validated at construction (ConfigError)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self):
        self.validate()

    def validate(self, n_vocab: int | None = None) -> None:
        def num(name, lo=None, hi=None, lo_open=False):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"{name} must be a finite number, got {v!r}")
            if lo is not None and (v <= lo if lo_open else v < lo):
                raise ConfigError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {v}")
            if hi is not None and v > hi:
                raise ConfigError(f"{name} must be <= {hi}, got {v}")

        num("temperature", 0.0)
        num("top_p", 0.0, 1.0, lo_open=True)
        num("min_p", 0.0, 1.0)
        num("repeat_penalty", 0.0, lo_open=True)
        num("frequency_penalty")
        num("presence_penalty")
        for name in ("top_k", "penalty_last_n"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{name} must be an integer, got {v!r}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.penalty_last_n < -1:
            raise ConfigError(f"penalty_last_n must be >= -1 (-1 = whole history), got {self.penalty_last_n}")
        if self.logit_bias is None:
            self.logit_bias = {}
        if not isinstance(self.logit_bias, dict):
            raise ConfigError(f"logit_bias must be a dict {{token_id: bias}}, got {type(self.logit_bias).__name__}")
        clean = {}
        for k, v in self.logit_bias.items():
            try:
                ki = int(k)
            except (TypeError, ValueError):
                raise ConfigError(f"logit_bias key {k!r} is not a token id") from None
            if isinstance(k, float) and k != ki:
                raise ConfigError(f"logit_bias key {k!r} is not a token id")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"logit_bias[{k!r}] must be a finite number, got {v!r}")
            if ki < 0 or (n_vocab is not None and ki >= n_vocab):
                raise ConfigError(f"logit_bias key {ki} is outside the vocabulary (0..{(n_vocab or 0) - 1})")
            clean[ki] = float(v)
        self.logit_bias = clean

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown sampling parameters {unknown}; valid: {sorted(known)}")
        return cls(**d)


class Sampler:
    """The chain with its seeded generator. `sample(logits, history)` -> token id.

    The generator advances by exactly one draw per non-greedy token; greedy sampling leaves it
    untouched. constraint: the request's grammar state (ringllm.constraints.Constraint) or None;
    every sampled token is accepted into it."""

    def __init__(self, params: SamplingParams | None = None, seed: int | None = 0, constraint=None):
        self.params = params or SamplingParams()
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise ConfigError(f"seed must be a non-negative integer or None, got {seed!r}")
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.constraint = constraint

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        p, c = self.params, self.constraint
        if p.greedy and c is None and not p.logit_bias and not penalizes(p.repeat_penalty, p.frequency_penalty,
                                                                          p.presence_penalty, p.penalty_last_n):
            return greedy(np.asarray(logits).reshape(-1))      # nothing changes a logit: the argmax as it is
        x = np.array(logits, dtype=np.float64).reshape(-1)   # a copy: the engine's buffer stays as is
        apply_logit_bias(x, p.logit_bias)
        if c is not None:
            c.mask(x)
        apply_penalties(x, history, p.repeat_penalty, p.frequency_penalty, p.presence_penalty, p.penalty_last_n)
        if p.greedy:
            token = greedy(x)
        else:
            top_k(x, p.top_k)
            top_p(x, p.top_p)
            min_p(x, p.min_p)
            temperature(x, p.temperature)
            token = draw(x, self.rng)
        if c is not None:
            c.accept(token)
        return token

    # generator state, for sessions
    def state(self) -> dict:
        return {"rng": self.rng.bit_generator.state}

    def set_state(self, state: dict) -> None:
        try:
            rng = np.random.Generator(np.random.PCG64())
            rng.bit_generator.state = state["rng"]
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
            raise ConfigError(f"sampler state is malformed: {exc!r}") from None
        self.rng = rng


# ------------------------------------------------------------------------------------------------
# Stop strings
# ------------------------------------------------------------------------------------------------

class StopMatcher:
    """Finds stop strings in streamed text without ever showing part of one.

    push(delta) -> (text to emit now, stopped). Once stopped, the text after (and including) the
    stop string is dropped. flush() -> the held-back tail at the end of generation."""

    def __init__(self, stops: str | Iterable[str] | None = None):
        if stops is None:
            stops = []
        elif isinstance(stops, str):
            stops = [stops]
        else:
            stops = list(stops)
        for s in stops:
            if not isinstance(s, str):
                raise ConfigError(f"stop strings must be strings, got {s!r}")
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def push(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        buf = self._held + delta
        first, which = -1, None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (first < 0 or i < first):
                first, which = i, s
        if first >= 0:
            self.stopped, self.matched, self._held = True, which, ""
            return buf[:first], True
        hold = 0
        for s in self.stops:      # longest tail of buf that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:n]):
                    hold = n
                    break
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        out, self._held = ("" if self.stopped else self._held), ""
        return out
