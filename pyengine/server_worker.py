"""The server's worker: the one thread that owns the LLM and decodes requests in batches.

    worker = Worker(llm, queue_size=256, max_batch=8)
    worker.submit(Job("completion", ids, params, loop, asyncio.Queue()))   # APIError 503 when the queue is full
    ... the job's events arrive on its asyncio queue ...
    worker.stop()

Up to max_batch requests are decoded together (one engine call per token for all of them,
ringllm.batch.BatchDecoder), each with its own KV store and sampling settings; the others wait in
the bounded FIFO queue. A request joins the batch between two steps: its prompt goes in alone, in
PREFILL_CHUNK-token parts between the running streams' steps (so a long prompt does not stall them),
whole when nothing else is decoding; it leaves when it finishes or its client goes away (job.cancel).

Prompt cache (ringllm.prompt_cache): a request starts from a copy of the cached store that
shares the most of its prompt (job.cache_prompt, the default) and prefills only the rest; when it
ends (finished or cancelled between two tokens), its store goes into the cache under every token
it was fed. A store an engine failure interrupted is never cached.

A Job talks to its HTTP handler only through events put on its asyncio queue, from the worker
thread via the event loop. The worker posts events as it goes and hands them over once per engine
step (one call_soon_threadsafe per event loop for every request of the step, not one per token per
request), so the HTTP side wakes once per step, and only for what it sends as it comes: a request
that is not streamed (job.stream False) gets its text as one chunk, posted with its end, so its
handler does not wake for every token (on a small machine the event loop's wake-ups take cores
the engine's threads are using):

    ("start", served_by)                                    admitted: the request is valid and prefilled
                                                            (served_by: the replica's name, or None)
    ("chunk", text, token, finish_reason)                   one token (streamed); not streamed: all its
                                                            text, just before "end"
    ("end", finish_reason, info)     info: prompt_tokens, completion_tokens, cached_tokens, timings, kv_stats
    ("error", status, message)                              400 for a RingLLMError, 500 for anything else

The worker outlives whatever one request does: every exception becomes that request's error event.
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ringllm.backends import store_stats
from ringllm.batch import BatchDecoder
from ringllm.prompt_cache import PromptCache
from ringllm.runtime.errors import RingLLMError
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.warmup import warm_few_rows
from ringllm.server_api import APIError
from ringllm.server_metrics import ServerMetrics

__all__ = ["Job", "PREFILL_CHUNK", "Worker"]

PREFILL_CHUNK = 64        # prompt tokens fed between two decode steps of the running streams


@dataclass
class Job:
    """One request on its way through the worker: its prompt ids, its LLM.decoder() keywords, its
    KV store's config, whether it may use the prompt cache, and the event loop and queue its
    events go to. cancel: set when the client is gone. The worker fills in the rest."""

    kind: str                    # "completion" | "chat"
    ids: list[int]
    params: dict
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    kv: KVConfig | None = None   # None: the LLM's
    cache_prompt: bool = True
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    cached: int = 0              # prompt tokens the prompt cache gave
    evicted0: int = 0            # the store's evictions when the request got it
    last_token: float = 0.0      # when its latest chunk was emitted
    served_by: str | None = None # the replica that serves it (ringllm.ray_serve), from its "start" event
    affinity: str | None = None  # the request's conversation key (user / session_id): where Ray routes it
    stream: bool = True          # False: its text is handed over once, with its end (module docstring)
    held: list = field(default_factory=list)    # a non-streamed request's text so far



def _deliver(items: list[tuple[Job, tuple]]) -> None:
    """On the event loop: put each event on its job's queue."""
    for job, item in items:
        job.events.put_nowait(item)


class Worker:
    """The thread that owns the LLM (see the module docstring); it starts when built."""

    def __init__(self, llm, queue_size: int, max_batch: int = 8, cache_bytes: int = 0,
                 metrics: ServerMetrics | None = None, served_by: str | None = None):
        self.llm, self.served_by = llm, served_by
        self.cache = PromptCache(cache_bytes)
        self.metrics = metrics or ServerMetrics()
        self.jobs: queue.Queue = queue.Queue(maxsize=queue_size)
        self.batch = BatchDecoder(llm, max_batch)
        if max_batch > 1 and getattr(llm, "backend", None) == "cpu":
            warm_few_rows(llm.engine)       # batched steps run the few-row kernels: compile them now
        self.live: dict[int, tuple[Job, Any]] = {}       # batch tag -> (job, its Decoder)
        self.prefilling: dict[int, tuple[Job, Any]] = {}  # admitted, prompt still going in (oldest first)
        self._tags = itertools.count()
        self.busy = False
        self.peak_batch = 0                               # most requests stepped together so far
        self.counters = {"completed": 0, "cancelled": 0, "failed": 0}
        self._stopping = False
        self._outbox: list[tuple[Job, tuple]] = []       # events posted since the last hand-off
        self.metrics.bind(self)
        self._thread = threading.Thread(target=self._run, name="ringllm-worker", daemon=True)
        self._thread.start()

    @property
    def active(self) -> int:
        return len(self.live) + len(self.prefilling)

    def cache_stats(self) -> dict:
        return self.cache.stats()

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise APIError(503, f"server busy: {self.jobs.maxsize} requests are already waiting; retry later",
                           "server_error", code="queue_full", headers={"Retry-After": "1"}) from None

    def stop(self) -> None:
        """End after the current step (active and queued jobs are dropped); never blocks."""
        self._stopping = True
        try:
            self.jobs.put_nowait(None)
        except queue.Full:
            pass

    def _run(self) -> None:
        while not self._stopping:
            while not self.batch.full:               # admit: wait when idle, else take only what waits
                self.busy = bool(self.live or self.prefilling)
                try:
                    job = self.jobs.get(block=not (self.live or self.prefilling))
                except queue.Empty:
                    break
                if job is None or self._stopping:
                    return
                self.busy = True
                self._admit(job)
                self._hand_off()
            if self.prefilling:
                self._prefill()
                self._hand_off()
            if self.live:
                self._step()
                self._hand_off()

    def _post(self, job: Job, item: tuple) -> None:
        self._outbox.append((job, item))

    def _hand_off(self) -> None:
        """Deliver the posted events: one call into each event loop for all of them."""
        if not self._outbox:
            return
        by_loop: dict[int, tuple[asyncio.AbstractEventLoop, list]] = {}
        for job, item in self._outbox:
            by_loop.setdefault(id(job.loop), (job.loop, []))[1].append((job, item))
        self._outbox = []
        for loop, items in by_loop.values():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:       # the event loop is gone (shutdown): nobody is listening
                for job, _ in items:
                    job.cancel.set()

    def _admit(self, job: Job) -> None:
        """Check the request and admit it: its prompt goes in by _prefill, then it joins the batch."""
        if job.cancel.is_set():
            self.counters["cancelled"] += 1
            return
        try:
            kv = job.kv or self.llm.kv
            # a compressing KVConfig prefills each prompt whole into a store of its own: nothing to continue
            use_cache = job.cache_prompt and kv.compress is None
            store, job.cached = self.cache.take(job.ids, kv) if use_cache else (None, 0)
            dec = self.llm.decoder(job.ids, kv=kv, store=store, **job.params)
            job.evicted0 = dec.store.stats()["evicted_total"] if store is not None else 0
        except RingLLMError as exc:
            self._fail(job, 400, str(exc))
            return
        except BaseException as exc:          # the worker outlives whatever one request did
            self._fail(job, 500, f"internal error: {type(exc).__name__}: {exc}")
            return
        self._post(job, ("start", self.served_by))
        tag = next(self._tags)
        self.batch.admit(dec, tag)
        self.prefilling[tag] = (job, dec)

    def _prefill(self) -> None:
        """Feed the oldest admitted prompt: whole when nothing is decoding, else PREFILL_CHUNK tokens,
        so that the running streams get a token between two chunks of a long prompt."""
        for tag in [t for t, (job, _) in self.prefilling.items() if job.cancel.is_set()]:
            self.batch.leave(tag)
            job, dec = self.prefilling.pop(tag)
            self.counters["cancelled"] += 1
            self._keep(job, dec)
            self.metrics.finished("cancelled", job, dec)
        if not self.prefilling:
            return
        tag = next(iter(self.prefilling))
        job, dec = self.prefilling[tag]
        try:
            done = self.batch.prefill_step(PREFILL_CHUNK if self.live else None)
        except RingLLMError as exc:
            del self.prefilling[tag]
            self._fail(job, 400, str(exc))
            return
        except BaseException as exc:          # the worker outlives whatever one request did
            del self.prefilling[tag]
            self._fail(job, 500, f"internal error: {type(exc).__name__}: {exc}")
            return
        if done is None:
            return
        del self.prefilling[tag]
        job.last_token = time.perf_counter()
        self.metrics.first_token(job.last_token - job.submitted)
        if done[2]:
            self.live[tag] = (job, dec)
        else:                                 # ended at its prefill (EOS first, max_tokens 0)
            self._end(job, dec)

    def _step(self) -> None:
        """Drop cancelled requests, advance the others one token together, stream their chunks."""
        gone = [tag for tag, (job, _) in self.live.items() if job.cancel.is_set()]
        for tag in gone:
            self.batch.leave(tag)
            job, dec = self.live.pop(tag)
            self._keep(job, dec)
            self.metrics.finished("cancelled", job, dec)
        self.busy = bool(self.live)
        self.counters["cancelled"] += len(gone)
        if not self.live:
            return
        self.peak_batch = max(self.peak_batch, len(self.live))
        self.metrics.batch(len(self.live))
        try:
            results = self.batch.step()
        except BaseException as exc:          # an engine failure ends every request of this step
            status = 400 if isinstance(exc, RingLLMError) else 500
            msg = str(exc) if status == 400 else f"internal error: {type(exc).__name__}: {exc}"
            for tag, (job, _) in list(self.live.items()):
                self.batch.leave(tag)
                self._fail(job, status, msg)
            self.live.clear()
            return
        now = time.perf_counter()
        for tag, chunk in results:
            job, dec = self.live[tag]
            if job.cancel.is_set() and chunk.finish_reason is None:
                continue                      # dropped before the next step
            self.metrics.token(now - job.last_token)
            job.last_token = now
            if job.stream:
                self._post(job, ("chunk", chunk.text, chunk.token, chunk.finish_reason))
            else:
                job.held.append(chunk.text)
            if chunk.finish_reason is not None:
                del self.live[tag]
                if not job.stream:
                    self._post(job, ("chunk", "".join(job.held), chunk.token, chunk.finish_reason))
                self._end(job, dec)

    def _end(self, job: Job, dec) -> None:
        rec = dec.record
        stats = store_stats(dec.store, job.kv or self.llm.kv)
        self._post(job, ("end", rec.finish_reason or "stop", {
            "prompt_tokens": len(job.ids), "completion_tokens": len(rec.tokens), "cached_tokens": job.cached,
            "timings": rec.timings.to_dict(), "kv_stats": stats}))
        self.counters["completed"] += 1
        self.metrics.finished("completed", job, dec, (stats.get("evicted_total") or 0) - job.evicted0)
        self._keep(job, dec)

    def _keep(self, job: Job, dec) -> None:
        """Put the request's store into the prompt cache under every token it was fed (not a store
        an engine step was interrupted in)."""
        if job.cache_prompt and not dec.record.in_engine and dec.store is not None and dec.store.kv.compress is None:
            self.cache.put(job.ids[:job.cached] + dec.record.fed, dec.store)

    def _fail(self, job: Job, status: int, message: str) -> None:
        self.counters["failed"] += 1
        self.metrics.failed()
        self._post(job, ("error", status, message))
