"""The server's route handlers: one method per route, over one LLM and its worker.

    routes = Routes(llm, settings)
    app = FastAPI(lifespan=routes.lifespan)
    app.get("/health")(routes.health)           # ringllm.server.create_app registers them all

    health             GET  /health                 liveness, queue length, counters
    metrics_text       GET  /metrics                Prometheus text format (ringllm.server_metrics)
    config             GET  /v1/config              model, context, default KV store, policies, limits
    models, model      GET  /v1/models[/{id}]       the loaded model (and its aliases in "model")
    completions        POST /v1/completions         prompt -> text
    chat_completions   POST /v1/chat/completions    messages -> message

A generating handler checks the request (model name, unsupported options, max_tokens cap, stop
strings, logit_bias keys, response_format / grammar / regex and tools, compiled here), turns it
into prompt ids and LLM.decoder() keywords, and queues a Job; everything a request gets wrong is
answered before it is queued. A chat request with tools is answered with OpenAI's tool_calls
(finish_reason "tool_calls"); streamed, as delta.tool_calls pieces (ringllm.tools.ToolCallParser). It then waits for the
job's first event, so an error found at admission (a prompt over a policy-full context) is still
an HTTP error, and answers with one JSON body or, with stream=true, server-sent events ending in
"data: [DONE]". A client that goes away cancels its job (the worker drops it between tokens).

Handlers are bound methods: FastAPI reads their signatures (self excluded), and their names give
the OpenAPI operation ids.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ringllm.chat_template import check_template_kwargs
from ringllm.prompt_cache import default_cache_bytes
from ringllm.runtime.errors import ConfigError
from ringllm.runtime.kv_config import POLICIES, POSITION_MODES, KVConfig
from ringllm.runtime.kv_types import KV_TYPES
from ringllm.server_api import (APIError, ChatCompletionRequest, CompletionRequest, SamplingRequest, ServerSettings,
                                error_body)
from ringllm.server_http import SSEResponse, sse_event
from ringllm.server_metrics import CONTENT_TYPE_LATEST, ServerMetrics
from ringllm.server_worker import Job, Worker
from ringllm.tools import ToolPlan

__all__ = ["Routes", "tool_delta", "usage"]


def tool_delta(event: tuple) -> dict:
    """The chat.completion.chunk delta of one ToolCallParser event (OpenAI's streaming shape)."""
    if event[0] == "content":
        return {"content": event[1]}
    if event[0] == "call":
        _, index, call_id, name = event
        return {"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                "function": {"name": name, "arguments": ""}}]}
    return {"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]}


def usage(info: dict) -> dict:
    """OpenAI's usage object from a job's end info (prompt_tokens counts the whole prompt, cached
    tokens included; prompt_tokens_details.cached_tokens the ones the prompt cache gave)."""
    p, c = info["prompt_tokens"], info["completion_tokens"]
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": info["cached_tokens"]}}


def end_fields(info: dict) -> dict:
    """The ringllm fields of a response's last chunk or body: timings and kv_stats."""
    return {"timings": info["timings"], "kv_stats": info["kv_stats"]}


class Routes:
    """The handlers of one app: the LLM, the settings, the model's names and the worker.

    The worker starts with the app (lifespan) and stops with it; an app used without its
    lifespan (e.g. some test clients) starts one on the first request that needs it."""

    def __init__(self, llm, settings: ServerSettings, worker_factory=None):
        self.llm, self.settings = llm, settings
        self.worker_factory = worker_factory
        self.name = settings.model_name or llm.model_name
        self.names = {self.name, *settings.aliases}
        self.created = int(time.time())
        self.metrics = ServerMetrics()
        self._worker: Worker | None = None

    def _new_worker(self) -> Worker:
        if self.worker_factory is not None:      # another host of the same routes (ringllm.ray_serve)
            return self.worker_factory(self.llm, self.settings, self.metrics)
        s = self.settings
        cache = default_cache_bytes() if s.cache_bytes is None else s.cache_bytes
        return Worker(self.llm, s.queue_size, s.max_batch, cache_bytes=cache, metrics=self.metrics)

    @asynccontextmanager
    async def lifespan(self, app):
        self._worker = self._new_worker()
        try:
            yield
        finally:
            self._worker.stop()

    def worker(self) -> Worker:
        if self._worker is None:       # an app used without its lifespan (e.g. some test clients)
            self._worker = self._new_worker()
        return self._worker

    # ---------------------------------------------------------------------------------- routes

    async def health(self):
        w = self.worker()
        return {"status": "ok", "model": self.name, "queued": w.jobs.qsize(), "busy": w.busy, "active": w.active,
                "peak_batch": w.peak_batch, **w.counters}

    async def metrics_text(self):
        self.worker()              # the gauges read the worker
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def config(self):
        """What a client needs to offer this server's settings: model, context, the default KV
        store, the policies and position modes a request's "kv" may name, the token limits."""
        s = self.settings
        return {"model": self.name, "aliases": sorted(self.names - {self.name}), "n_ctx": self.llm.n_ctx,
                "kv": self.llm.kv.to_dict(), "policies": list(POLICIES), "positions": list(POSITION_MODES),
                "kv_types": list(KV_TYPES),
                "max_tokens_cap": s.max_tokens_cap, "default_max_tokens": s.default_max_tokens,
                "strict_model": s.strict_model, "prompt_cache": self.worker().cache_stats()}

    async def models(self):
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": self.created,
                                              "owned_by": "ringllm"}]}

    async def model(self, model_id: str):
        self.check_model(model_id)
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "ringllm"}

    async def completions(self, req: CompletionRequest, request: Request):
        self.check_model(req.model)
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if req.logprobs is not None:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, f"one prompt per request, got {len(prompt)}", param="prompt")
            prompt = prompt[0]
        try:
            if isinstance(prompt, str):
                ids = self.llm.prompt_ids(prompt)
            else:
                ids = self.llm.prompt_ids(list(prompt))
        except ConfigError as exc:
            raise APIError(400, str(exc), param="prompt") from None
        params = self.sampling(req, req.max_tokens, 16)
        params["grammar"] = await self.constraint(req)
        job = await self.submit(request, "completion", ids, params, req)
        rid, t, name = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time()), self.name

        def chunk(text, finish, first=False, usage=None, info=None):
            if first:
                text = ""
            choices = [] if usage else [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]
            body = {"id": rid, "object": "text_completion", "created": t, "model": name,
                    "system_fingerprint": job.served_by, "choices": choices}
            if usage:
                body["usage"] = usage
            if info:
                body.update(end_fields(info))
            return body

        def final(text, finish, info):
            return {"id": rid, "object": "text_completion", "created": t, "model": name,
                    "system_fingerprint": job.served_by,
                    "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
                    "usage": usage(info), **end_fields(info)}

        include = bool(req.stream_options and req.stream_options.include_usage)
        return await self.run(request, job, chunk, final, include, req.stream)

    async def chat_completions(self, req: ChatCompletionRequest, request: Request):
        self.check_model(req.model)
        if req.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if req.functions is not None or req.function_call is not None:
            raise APIError(400, "functions / function_call (deprecated by OpenAI) are not supported; use tools and "
                           "tool_choice", param="functions" if req.functions is not None else "function_call")
        if req.tools is None and (req.tool_choice is not None or req.parallel_tool_calls is not None):
            raise APIError(400, "tool_choice and parallel_tool_calls need tools", param="tool_choice")
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):
                content = "".join(p.text for p in content)
            if content is None and not m.tool_calls:
                content = ""
            role = "system" if m.role == "developer" else m.role
            message = {"role": role, "content": content}
            for key in ("name", "tool_calls", "tool_call_id"):
                if getattr(m, key) is not None:
                    message[key] = getattr(m, key)
            messages.append(message)
        try:
            extra = check_template_kwargs(req.chat_template_kwargs)
        except ConfigError as exc:
            raise APIError(400, str(exc), param="chat_template_kwargs") from None
        plan = None
        if req.tools is not None:
            try:
                plan = await asyncio.to_thread(ToolPlan.build, self.llm, messages, req.tools, req.tool_choice,
                                               True if req.parallel_tool_calls is None else req.parallel_tool_calls,
                                               extra)
            except ConfigError as exc:
                raise APIError(400, str(exc), param="tools") from None
            if plan.grammar is not None and (req.grammar is not None or req.regex is not None
                                             or (req.response_format or {}).get("type", "text") != "text"):
                raise APIError(400, "response_format, grammar and regex cannot be combined with tools unless "
                               "tool_choice is 'none'", param="tool_choice")
            extra = {**extra, **plan.template_kwargs}
        try:
            ids = self.llm.chat_ids(self.llm.render_chat(messages, add_generation_prompt=True, **extra))
        except ConfigError as exc:
            raise APIError(400, str(exc), param="messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling(req, max_tokens, self.settings.default_max_tokens)
        if plan is not None and plan.grammar is not None:
            params["grammar"] = plan.grammar
        else:
            params["grammar"] = await self.constraint(req)
        job = await self.submit(request, "chat", ids, params, req)
        rid, t, name = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), self.name
        parser = plan.parser() if plan is not None else None

        def body(choice=None, usage=None):
            out = {"id": rid, "object": "chat.completion.chunk", "created": t, "model": name,
                   "system_fingerprint": job.served_by, "choices": [] if choice is None else [choice]}
            if usage:
                out["usage"] = usage
            return out

        def delta(d, finish=None):
            return body({"index": 0, "delta": d, "finish_reason": finish, "logprobs": None})

        def chunk(text, finish, first=False, usage=None, info=None):
            if usage:
                return body(usage=usage)
            if first:
                return delta({"role": "assistant", "content": ""})
            if parser is None:
                out = [delta({"content": text} if text else {}, finish)]
            else:
                events = parser.feed(text) if text else []
                if finish is not None:
                    events += parser.finish()
                out = [delta(tool_delta(ev)) for ev in events]
                if finish is not None:
                    out.append(delta({}, "tool_calls" if parser.calls else finish))
            if info and out:
                out[-1].update(end_fields(info))
            return out

        def final(text, finish, info):
            message = {"role": "assistant", "content": text}
            if plan is not None and plan.parses_calls:
                content, calls = plan.parse(text)
                message = {"role": "assistant", "content": content}
                if calls:
                    message["tool_calls"], finish = calls, "tool_calls"
            return {"id": rid, "object": "chat.completion", "created": t, "model": name,
                    "system_fingerprint": job.served_by,
                    "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                    "usage": usage(info), **end_fields(info)}

        include = bool(req.stream_options and req.stream_options.include_usage)
        return await self.run(request, job, chunk, final, include, req.stream)

    # ---------------------------------------------------------------------------------- helpers

    def check_model(self, model: str | None) -> None:
        """With strict_model, APIError 404 unless model is None or one of this server's names; else
        any id is this server's one model."""
        if self.settings.strict_model and model is not None and model not in self.names:
            raise APIError(404, f"model {model!r} does not exist; this server has {sorted(self.names)}",
                           param="model", code="model_not_found")

    def sampling(self, req: SamplingRequest, max_tokens: int | None, default: int) -> dict:
        """The LLM.decoder() keywords of a request (max_tokens None: default, within the cap)."""
        s, n_vocab = self.settings, self.llm.n_vocab
        if max_tokens is None:
            max_tokens = min(default, s.max_tokens_cap)
        if max_tokens > s.max_tokens_cap:
            raise APIError(400, f"max_tokens {max_tokens} exceeds this server's limit of {s.max_tokens_cap}",
                           param="max_tokens")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > 16:
            raise APIError(400, f"at most 16 stop strings, got {len(stop)}", param="stop")
        bias: dict[int, float] = {}
        for k, v in (req.logit_bias or {}).items():
            if not k.lstrip("-").isdigit() or not 0 <= int(k) < n_vocab:
                raise APIError(400, f"logit_bias key {k!r} is not a token id of this model (0..{n_vocab - 1})",
                               param="logit_bias")
            if not -100.0 <= v <= 100.0:
                raise APIError(400, f"logit_bias[{k}] = {v} is outside [-100, 100]", param="logit_bias")
            bias[int(k)] = float(v)
        out = {"max_tokens": max_tokens, "temperature": 1.0 if req.temperature is None else req.temperature,
               "top_p": 1.0 if req.top_p is None else req.top_p, "top_k": req.top_k or 0,
               "min_p": req.min_p or 0.0, "repeat_penalty": req.repeat_penalty or 1.0,
               "frequency_penalty": req.frequency_penalty or 0.0, "presence_penalty": req.presence_penalty or 0.0,
               "logit_bias": bias, "stop": stop or None, "seed": req.seed, "ignore_eos": req.ignore_eos}
        return out

    async def constraint(self, req: SamplingRequest):
        """The compiled response_format / grammar / regex of a request (None: free text); a 400
        naming the field and the reason when it does not compile. Compiled off the event loop
        (the first one builds the vocabulary's llguidance tokenizer)."""
        try:
            return await asyncio.to_thread(self.llm.compile_grammar, response_format=req.response_format,
                                           grammar=req.grammar, regex=req.regex)
        except ConfigError as exc:
            param = next((k for k in ("response_format", "grammar", "regex") if getattr(req, k) is not None),
                         "response_format")
            raise APIError(400, str(exc), param=param) from None

    def kv_config(self, req: SamplingRequest) -> KVConfig:
        """The request's KV store: the server's KVConfig with the fields of req.kv over it; a 400
        naming the problem for an unknown field, an invalid value or a store past the context."""
        if req.kv is None:
            return self.llm.kv
        try:
            kv = KVConfig.from_dict({**self.llm.kv.to_dict(), **req.kv})
            kv.validate()
            kv.check_types_fit(self.llm.spec.head_dim)
        except (ConfigError, TypeError, ValueError) as exc:
            raise APIError(400, f"kv: {exc}", param="kv") from None
        if kv.capacity is not None and kv.capacity > self.llm.n_ctx:
            raise APIError(400, f"kv: capacity {kv.capacity} exceeds the model's context {self.llm.n_ctx}",
                           param="kv")
        return kv

    async def submit(self, request: Request, kind: str, ids: list[int], params: dict,
                     req: SamplingRequest) -> Job:
        job = Job(kind, ids, params, asyncio.get_running_loop(), asyncio.Queue(), kv=self.kv_config(req),
                  cache_prompt=req.cache_prompt, affinity=req.session_id or req.user, stream=bool(req.stream))
        self.worker().submit(job)
        return job

    @staticmethod
    async def watch(request: Request, job: Job) -> None:
        """Until cancelled: every 0.5 s, whether the client is still there; when it is gone, cancel
        the job and wake its reader with a ("gone",) event. One task per waiting request, instead of
        a timeout around every event."""
        while not job.cancel.is_set():
            await asyncio.sleep(0.5)
            if await request.is_disconnected():
                job.cancel.set()
                job.events.put_nowait(("gone",))
                return

    @staticmethod
    async def next_event(job: Job) -> tuple:
        """The job's next event; CancelledError when its client has gone (watch())."""
        ev = await job.events.get()
        if ev[0] == "gone":
            raise asyncio.CancelledError()
        return ev

    async def run(self, request: Request, job: Job, make_chunk, make_final, include_usage: bool, stream: bool):
        """The response of a queued job: one JSON body (make_final), or server-sent events
        (make_chunk) when stream. Errors before any output become 4xx/5xx responses."""
        watcher = asyncio.create_task(self.watch(request, job))
        try:
            ev = await self.next_event(job)
            if ev[0] == "error":
                raise APIError(ev[1], ev[2], "invalid_request_error" if ev[1] < 500 else "server_error")
            job.served_by = ev[1]              # ("start", replica name or None)
            if not stream:
                text = []
                while True:
                    ev = await self.next_event(job)
                    if ev[0] == "chunk":
                        text.append(ev[1])
                    elif ev[0] == "end":
                        return JSONResponse(make_final("".join(text), ev[1], ev[2]))
                    elif ev[0] == "error":
                        raise APIError(ev[1], ev[2], "server_error" if ev[1] >= 500 else "invalid_request_error")
        except BaseException:
            job.cancel.set()
            raise
        finally:
            watcher.cancel()       # a stream's disconnects are the SSEResponse's to see
            if not stream:
                job.cancel.set()

        def sse(bodies) -> str:          # make_chunk gives one body, or a list of them (tool call deltas)
            return "".join(sse_event(b) for b in (bodies if isinstance(bodies, list) else [bodies]))

        async def events():
            yield sse(make_chunk(None, None, first=True))
            held = None
            while True:
                ev = held or await job.events.get()
                held = None
                if ev[0] == "chunk":
                    # a client that reads slower than the engine writes gets the tokens that piled up
                    # as one chunk: one event to encode and send instead of one per token
                    text = ev[1]
                    while not job.events.empty():
                        nxt = job.events.get_nowait()
                        if nxt[0] != "chunk":
                            held = nxt
                            break
                        text += nxt[1]
                    if text:
                        out = sse(make_chunk(text, None))
                        if out:
                            yield out
                elif ev[0] == "end":
                    yield sse(make_chunk(None, ev[1], info=ev[2]))
                    if include_usage:
                        yield sse_event(make_chunk(None, None, usage=usage(ev[2])))
                    break
                elif ev[0] == "error":
                    yield sse_event(error_body(ev[2], "server_error" if ev[1] >= 500 else "invalid_request_error"))
                    break
                elif ev[0] == "gone":
                    break
            yield "data: [DONE]\n\n"

        return SSEResponse(events(), job)
