"""Batched generation: several Decoders of one LLM advance together, one token each per step.

    batch = BatchDecoder(llm, max_batch=8)
    batch.join(llm.decoder("Once upon a time", max_tokens=32), tag="a")   # prefilled alone, then in the batch
    batch.join(llm.decoder("The capital of France", max_tokens=8), tag="b")
    while batch.active:
        for tag, chunk in batch.step():        # one engine call for every active sequence
            print(tag, chunk.text)
        # join() new ones or leave(tag) here: sequences enter and exit between steps

A server that must not stall its running streams while a long prompt comes in admits it instead
(`admit(dec, tag)`) and advances it one prompt chunk at a time between steps (`prefill_step()`):
the others get a token between two chunks, and the sequence joins the batch when its prompt is in.

Each sequence keeps its own KV store (capacity, policy, positions), sampler, stop strings and
detokenizer (all in its Decoder); only the engine call is shared. With the CPU engine and two or
more sequences, the step is CPUEngine.step_batch (the projections over the B rows as one
matrix-matrix product; its logits equal one-sequence decoding, tests/test_batched.py); one
sequence, another backend, or a paged store decode one sequence at a time through engine.step.
Engine calls run under the LLM's lock, so other users of the same LLM take turns with the batch.
"""
from __future__ import annotations

from typing import Any, Hashable

from ringllm.decoder import Decoder
from ringllm.generation import Chunk
from ringllm.llm import LLM
from ringllm.runtime.errors import ConfigError

__all__ = ["BatchDecoder"]


class BatchDecoder:
    """The active sequences of one LLM: (tag, Decoder) pairs, stepped together.

    Args:
        llm: the LLM whose engine runs every step (its lock is taken around each engine call).
        max_batch: most sequences active at once (join() refuses more).
    """

    def __init__(self, llm: LLM, max_batch: int = 8):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ConfigError(f"max_batch must be a positive integer, got {max_batch!r}")
        self.llm, self.max_batch = llm, max_batch
        self._entries: dict[Hashable, Decoder] = {}
        self._admitted: dict[Hashable, Decoder] = {}       # prompts being prefilled a chunk at a time, oldest first

    @property
    def active(self) -> int:
        """Number of sequences in the batch."""
        return len(self._entries)

    @property
    def prefilling(self) -> int:
        """Number of admitted sequences whose prompt is still going in."""
        return len(self._admitted)

    @property
    def full(self) -> bool:
        return len(self._entries) + len(self._admitted) >= self.max_batch

    def __contains__(self, tag: Hashable) -> bool:
        return tag in self._entries or tag in self._admitted

    def admit(self, dec: Decoder, tag: Hashable) -> None:
        """Take `dec` in without running anything: prefill_step() feeds its prompt a chunk at a time
        and moves it into the batch once the prompt is in."""
        if tag in self:
            raise ConfigError(f"tag {tag!r} is already in the batch")
        if self.full:
            raise ConfigError(f"the batch is full ({self.max_batch} sequences); wait for one to finish")
        self._admitted[tag] = dec

    def prefill_step(self, chunk: int) -> tuple[Hashable, Decoder, bool] | None:
        """Feed the next `chunk` prompt tokens of the oldest admitted sequence (one engine call).
        Returns (tag, decoder, joined) when its prompt is complete: joined True when it entered the
        batch, False when it ended at its prefill (EOS first, max_tokens 0; not added); None while
        its prompt is still going in, or when nothing is admitted. Engine errors propagate, and the
        sequence is dropped."""
        if not self._admitted:
            return None
        tag, dec = next(iter(self._admitted.items()))
        try:
            with self.llm.engine_lock(dec.store):
                complete = dec.prefill(chunk)
        except BaseException:
            del self._admitted[tag]
            raise
        if not complete:
            return None
        del self._admitted[tag]
        if dec.done:
            return tag, dec, False
        self._entries[tag] = dec
        return tag, dec, True

    def join(self, dec: Decoder, tag: Hashable) -> bool:
        """Prefill `dec` (alone: one engine call) and add it under `tag`. Returns False when the
        generation already ended at its prefill (EOS first, max_tokens 0: dec.done, nothing to
        stream); it is then not added. Engine errors propagate (the sequence is not added)."""
        if tag in self:
            raise ConfigError(f"tag {tag!r} is already in the batch")
        if self.full:
            raise ConfigError(f"the batch is full ({self.max_batch} sequences); wait for one to finish")
        with self.llm.engine_lock(dec.store):
            dec.prefill()
        if dec.done:
            return False
        self._entries[tag] = dec
        return True

    def leave(self, tag: Hashable) -> Decoder | None:
        """Remove a sequence (cancelled, or no longer wanted), in the batch or still prefilling;
        returns its Decoder (None if absent). Its store is only ever cut between engine calls, so it
        stays consistent."""
        dec = self._entries.pop(tag, None)
        return dec if dec is not None else self._admitted.pop(tag, None)

    def step(self) -> list[tuple[Hashable, Chunk]]:
        """Advance every active sequence by one token: [(tag, chunk)] in join order. Sequences
        whose chunk carries a finish_reason have left the batch when this returns."""
        entries = list(self._entries.items())
        fed = [(tag, dec, dec.feed()) for tag, dec in entries]
        run = [(dec, token) for _, dec, token in fed if token is not None]
        logits: dict[int, Any] = {}
        if run:
            with self.llm.engine_lock():
                for dec, _ in run:
                    dec.record.in_engine = True
                try:
                    rows = self._forward([t for _, t in run], [d.store for d, _ in run])
                finally:
                    for dec, _ in run:
                        dec.record.in_engine = False
            logits = {id(dec): rows[i] for i, (dec, _) in enumerate(run)}
        out = []
        for tag, dec, token in fed:
            chunk = dec.advance(logits.get(id(dec)) if token is not None else None)
            if chunk.finish_reason is not None:
                self._entries.pop(tag, None)
            out.append((tag, chunk))
        if not self._entries and getattr(self.llm.engine, "release_batch", None) is not None:
            with self.llm.engine_lock():          # the batch is over: its stores can be freed
                self.llm.engine.release_batch()
        return out

    # ------------------------------------------------------------------------------------------

    def _forward(self, tokens: list[int], stores: list) -> list:
        """Logits rows (n_vocab,) of each (token, store): one step_batch call when the engine has
        one and every store is dense, else engine.step per sequence (a copy: step returns a view)."""
        eng = self.llm.engine
        batched = getattr(eng, "step_batch", None)
        if len(tokens) > 1 and batched is not None and not any(getattr(st, "paged", False) for st in stores):
            return list(batched(tokens, stores))
        release = getattr(eng, "release_batch", None)
        if release is not None:               # no batch now: let the last one's finished stores go
            release()
        return [eng.step(t, st).copy() for t, st in zip(tokens, stores)]
