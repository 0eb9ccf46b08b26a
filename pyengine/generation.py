"""What a generation hands back: the result types of `LLM.generate`, `LLM.complete`, sessions and batches.

    Timings      speed of one generation (prefill and generated tokens, peak memory)
    Chunk        one generated token: text delta, id, index, finish reason on the last one
    Completion   a finished generation: text, tokens, finish reason, usage, timings
    Record       what a running generation has produced so far (written by its Decoder)
    Generation   the streaming iterator of Chunks over a Record

Contracts. A Chunk's .text is never a partial UTF-8 character nor a piece that could still become
a stop string. The chunk that carries a finish reason ("stop" | "length") is the last token's own
chunk (the decoder looks one token ahead, so EOS is known before that chunk is handed out).
A Generation reads everything through its Record; the generator that produces the chunks writes
only into the Record, never into the Generation, so no reference cycle keeps an abandoned
generation (and the engine lock it holds) alive until the garbage collector runs: dropping the
iterator closes it at once.

This module holds data only: no engine, no sampling, no locking.
"""
from __future__ import annotations

import resource
import sys
from dataclasses import asdict, dataclass, field
from typing import Iterator

__all__ = ["Chunk", "Completion", "Generation", "Record", "Timings", "peak_rss_bytes"]


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (bytes)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


@dataclass
class Timings:
    """Speed of one generation. prompt_*: the prefill; gen_*: the generated tokens (time spent
    producing them, not the caller's time between chunks); compile_s: time spent compiling kernels
    met for the first time during this generation, left out of prompt_s and gen_s (0 once the
    kernels are compiled or loaded from the cache); peak_memory_bytes: the process's peak resident
    memory so far (plus the GPU's peak where the backend reports one)."""

    prompt_tokens: int = 0
    prompt_s: float = 0.0
    gen_tokens: int = 0
    gen_s: float = 0.0
    compile_s: float = 0.0
    peak_memory_bytes: int = 0

    @property
    def prompt_tok_s(self) -> float | None:
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 and self.prompt_tokens else None

    @property
    def gen_tok_s(self) -> float | None:
        return self.gen_tokens / self.gen_s if self.gen_s > 0 and self.gen_tokens else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prompt_tok_s"] = None if self.prompt_tok_s is None else round(self.prompt_tok_s, 2)
        d["gen_tok_s"] = None if self.gen_tok_s is None else round(self.gen_tok_s, 2)
        return d


@dataclass
class Chunk:
    """One generated token: its text delta, id, index, and the finish reason on the last one."""

    text: str
    token: int
    finish_reason: str | None
    timings: Timings
    index: int = 0


@dataclass
class Completion:
    """A finished (non-streaming) generation."""

    text: str
    tokens: list[int]
    finish_reason: str | None
    prompt_tokens: int
    timings: Timings = field(default_factory=Timings)
    speculation: dict | None = None     # LLM.speculate(): rounds, drafted, accepted, acceptance, seconds
    tool_calls: list[dict] | None = None    # LLM.chat(tools=...): OpenAI tool_calls parsed from .text
    content: str | None = None          # with tools: .text without its calls (None when only calls)

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.tokens),
                "total_tokens": self.prompt_tokens + len(self.tokens)}

    @property
    def message(self) -> dict:
        """The answer as an OpenAI assistant message (append it to the conversation to go on):
        {"role": "assistant", "content": ..., "tool_calls": [...] when the model called tools}."""
        if self.tool_calls is None:
            return {"role": "assistant", "content": self.text}
        msg = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = [dict(c, function=dict(c["function"])) for c in self.tool_calls]
        return msg


class Record:
    """What a generation has produced so far. The running generator writes here, never into the
    Generation itself (see the module docstring: no reference cycle keeps the lock alive).

    .fed lists the tokens this generation fed into its store (prompt first); .in_engine is True
    while an engine call on its store runs, so a caller that sees an exception can tell a store
    cut between tokens (consistent) from one cut inside an engine step (unusable)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.prompt_tokens = 0
        self.timings = Timings()
        self.fed: list[int] = []          # tokens this generation fed into the store
        self.done = False
        self.in_engine = False            # True while an engine call runs (a store cut there is unusable)
        self.tool_calls: list[dict] | None = None     # chat with tools: the calls parsed at the end
        self.content: str | None = None
        self.constraint = None            # the request's grammar state (ringllm.constraints), if any


class Generation:
    """The iterator `generate(stream=True)` returns. Iterate it for chunks; afterwards (or at any
    time) .tokens, .text, .finish_reason, .timings describe what was produced. close() stops it
    (the store stays consistent: it is only ever cut between tokens).

    record: the Record the chunks' producer writes into; chunks: that producer (a generator of
    Chunk that must not reference this Generation)."""

    def __init__(self, record: Record | None = None, chunks: Iterator[Chunk] | None = None):
        self.record = record or Record()
        self._it: Iterator[Chunk] | None = chunks

    def __getattr__(self, name: str):
        if name in ("record", "_it"):
            raise AttributeError(name)
        return getattr(self.record, name)

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> Chunk:
        return next(self._it)

    def close(self) -> None:
        if self._it is not None:
            self._it.close()

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def result(self) -> Completion:
        """Run to the end and return the Completion."""
        for _ in self:
            pass
        r = self.record
        return Completion(r.text, list(r.tokens), r.finish_reason, r.prompt_tokens, r.timings,
                          tool_calls=r.tool_calls, content=r.content)
