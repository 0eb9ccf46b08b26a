"""The decode loop of one generation: `Decoder`, advanced a token at a time.

A Decoder owns what is particular to one sequence: its KV store, sampler, stop strings, streaming
detokenizer, token history and Record. It never owns the engine nor its lock: whoever calls the
engine serializes engine use, either LLM.generate (which holds the LLM's engine lock and drives
the decoder alone with Decoder.run) or ringllm.batch.BatchDecoder (which steps several decoders
with one batched engine call per token).

The protocol is prefill(), then feed() and advance() strictly alternating until .done:

    feed()            takes the sampled token into the output and says whether the engine must
                      run it (its logits give the next token) or the generation ends with it
    advance(logits)   samples the next token from those logits and returns the token's Chunk

The engine looks one token ahead this way, so the chunk that carries the finish reason is the
last token's own chunk. With a grammar constraint (the sampler's), the answer also ends, "stop",
at the token that completes the grammar, without an engine step for the end token. The store is only ever cut between tokens; Record.in_engine marks the
one window in which it is not.

check_max_tokens is the shared check of the max_tokens argument (generate, decoder, sessions).
"""
from __future__ import annotations

import time
from typing import Iterator

import numpy as np

from ringllm.backends import check_room, engine_peak_memory
from ringllm.generation import Chunk, Record
from ringllm.runtime import compile_clock
from ringllm.runtime.compile_clock import CompileSpan
from ringllm.runtime.errors import ConfigError, RingLLMError
from ringllm.sampling import Sampler, StopMatcher

__all__ = ["Decoder", "check_max_tokens"]


def check_max_tokens(max_tokens) -> None:
    """ConfigError unless max_tokens is None or a non-negative integer."""
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer))
                                   or max_tokens < 0):
        raise ConfigError(f"max_tokens must be a non-negative integer or None, got {max_tokens!r}")


class Decoder:
    """One generation advanced a token at a time by a caller that runs the engine itself: alone
    (LLM.generate), or beside other sequences through CPUEngine.step_batch (ringllm.batch).

        dec = llm.decoder(prompt, max_tokens=32)      # a fresh store; nothing computed yet
        dec.prefill()                                 # engine prefill + first sample (may finish: EOS, max_tokens 0)
        while not dec.done:
            token = dec.feed()                        # the token the engine must run next, or None (it ends here)
            logits = None if token is None else engine.step(token, dec.store)     # (n_vocab,)
            chunk = dec.advance(logits)               # the Chunk of that token (finish_reason on the last)

    feed() and advance() alternate strictly. The decoder never takes the LLM's lock: whoever calls
    the engine (and prefill()) serializes engine use. .record holds tokens, text, timings, as a
    Generation's.

    llm: the LLM (its .engine, .tokenizer and .spec are read); record: the Record to write;
    store: the sequence's KV store (None with `compress`, which builds it); prefill_ids: the tokens prefill() feeds; history: the token
    history the penalties see (extended with every sampled token)."""

    def __init__(self, llm, record: Record, store, prefill_ids: list[int], history: list[int],
                 sampler: Sampler, max_tokens: int | None, stopper: StopMatcher, ignore_eos: bool,
                 compress=None):
        self.llm, self.record, self.store = llm, record, store
        # compress: None, or callable(ids) -> (store, logits) that prefills and compresses the prompt
        # (KVConfig.compress; LLM.compress_prefill): prefill() then takes the store it returns
        self.compress = compress
        self.prefill_ids, self.history, self.sampler = prefill_ids, history, sampler
        self.max_tokens, self.stopper = max_tokens, stopper
        self.eos = frozenset() if ignore_eos else llm.tokenizer.eos_ids
        self._next: int | None = None           # the sampled token whose chunk comes next
        self._fed: int | None = None            # the token feed() handed out, awaiting its logits
        self._pending: tuple[str, bool, str | None] | None = None     # (text, stop hit, finish) of feed()
        self._index = 0
        self._t1: float | None = None         # wall clock and compile seconds when the token clock started
        self._c1 = 0.0
        self._text_dec = None
        self._prompt_done = 0                  # prompt tokens fed so far (prefill may go in parts)

    @property
    def done(self) -> bool:
        return self.record.done

    @property
    def prefilled(self) -> bool:
        """Whether the whole prompt is in the store (and the first token sampled)."""
        return self._prompt_done >= len(self.prefill_ids)

    def prefill(self, chunk: int | None = None) -> bool:
        """Feed the prompt into the store: all of it (one engine call), or its next `chunk` tokens,
        so that a caller can interleave a long prompt with other sequences' decode steps. After the
        last part, sample the first token (which may end the generation: EOS, max_tokens 0).
        Returns self.prefilled."""
        rec, tm, llm = self.record, self.record.timings, self.llm
        ids = self.prefill_ids
        if self.prefilled:
            raise RingLLMError("Decoder.prefill(): the prompt is already in the store")
        part = ids[self._prompt_done:] if chunk is None else ids[self._prompt_done:self._prompt_done + max(1, chunk)]
        rec.prompt_tokens = len(ids)
        t0 = time.perf_counter()
        rec.in_engine = True
        with CompileSpan() as compiling:
            if self.compress is not None:      # the whole prompt at once: the press needs all of it
                part = ids
                self.store, logits = self.compress(ids)
            else:
                logits = llm.engine.prefill(part, self.store)
        rec.in_engine = False
        rec.fed.extend(part)
        self._prompt_done += len(part)
        tm.prompt_tokens, tm.prompt_s = self._prompt_done, tm.prompt_s + time.perf_counter() - t0 - compiling.seconds
        tm.compile_s += compiling.seconds
        tm.peak_memory_bytes = engine_peak_memory(llm.engine)
        if not self.prefilled:
            return False
        self._first_token(logits)
        return True

    def _first_token(self, logits) -> None:
        """After the prompt: sample the first token, or end here (max_tokens 0, EOS first)."""
        rec = self.record
        if self.max_tokens == 0:
            rec.finish_reason, rec.done = "length", True
            return
        self._text_dec = self.llm.tokenizer.stream_decoder()
        self._start_clock()
        self._next = self.sampler.sample(logits, self.history)
        if self._next in self.eos:
            rec.finish_reason, rec.done = "stop", True
            self._stop_clock()

    def _start_clock(self) -> None:
        """Start timing generated tokens (wall time and the process's compile seconds)."""
        self._t1, self._c1 = time.perf_counter(), compile_clock.totals()[0]

    def _stop_clock(self) -> None:
        """Add the time since _start_clock to gen_s, less the kernels compiled meanwhile (compile_s)."""
        tm = self.record.timings
        compiled = compile_clock.totals()[0] - self._c1
        tm.gen_s += time.perf_counter() - self._t1 - compiled
        tm.compile_s += compiled

    def feed(self) -> int | None:
        """Take the sampled token into the output; returns it when the engine must run it (its
        logits give the next token), None when the generation ends with it (stop string,
        max_tokens, or a policy-full store that has no room)."""
        if self.record.done or self._pending is not None or self._text_dec is None:
            raise RingLLMError("Decoder.feed() out of turn: call prefill() first, then feed() and advance() "
                               "alternately until done")
        if self._t1 is None:
            self._start_clock()
        rec, token = self.record, self._next
        self.history.append(token)
        rec.tokens.append(token)
        text, hit = self.stopper.push(self._text_dec.push(token))
        finish = None
        constraint = self.sampler.constraint
        if hit or (constraint is not None and constraint.done):
            finish = "stop"        # a stop string, or the grammar is complete: nothing but EOS could follow
        elif self.max_tokens is not None and len(rec.tokens) >= self.max_tokens:
            finish = "length"
        else:
            try:
                check_room(self.store, self.llm.spec, 1)
            except ConfigError:
                finish = "length"        # policy full and the context is full
        self._pending = (text, hit, finish)
        self._fed = token if finish is None else None
        return self._fed

    def advance(self, logits: np.ndarray | None) -> Chunk:
        """The Chunk of the token feed() returned. logits (n_vocab,): the engine's output for that
        token (required when feed() returned a token, None when it returned None)."""
        if self._pending is None or (logits is None) != (self._fed is None):
            raise RingLLMError("Decoder.advance() needs the logits of the token feed() returned (None when "
                               "feed() returned None)")
        rec, tm = self.record, self.record.timings
        text, hit, finish = self._pending
        token = self.history[-1]
        if logits is not None:
            rec.fed.append(token)
            self._next = self.sampler.sample(logits, self.history)
            if self._next in self.eos:
                finish = "stop"
        if finish is not None and not hit:
            tail, hit2 = self.stopper.push(self._text_dec.flush())
            text += tail if hit2 else tail + self.stopper.flush()
        rec.text += text
        tm.gen_tokens = len(rec.tokens)
        self._stop_clock()
        tm.peak_memory_bytes = engine_peak_memory(self.llm.engine)
        if finish is not None:
            rec.finish_reason, rec.done = finish, True
        chunk = Chunk(text, token, finish, tm, self._index)
        self._index += 1
        self._pending, self._fed, self._t1 = None, None, None
        return chunk

    def run(self) -> Iterator[Chunk]:
        """Drive this decoder alone: prefill, then one engine.step per token, yielding each Chunk
        (the last carries the finish reason). The caller holds the LLM's engine lock throughout
        (LLM.engine_lock())."""
        rec, engine = self.record, self.llm.engine
        self.prefill()
        while not self.done:
            token = self.feed()
            logits = None
            if token is not None:
                rec.in_engine = True
                logits = engine.step(token, self.store)
                rec.in_engine = False
            yield self.advance(logits)
