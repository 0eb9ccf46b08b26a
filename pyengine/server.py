"""`ringllm serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn).

    POST /v1/completions        prompt -> text (stream=true: server-sent events)
    POST /v1/chat/completions   messages -> message (stream=true: server-sent events)
    GET  /v1/models             the loaded model
    GET  /health                liveness, queue length, counters
    GET  /openapi.json, /docs   the schema

One worker thread owns the LLM. Up to `max_batch` requests are decoded together, one batched
engine step (CPUEngine.step_batch) per token for all of them, each from its own fresh KV store
with its own sampling settings, so concurrent clients get what they would get alone; requests
beyond that wait in a bounded FIFO queue (503 when it is full). A client that disconnects
(mid-stream, or while queued) has its request cancelled between two tokens; the others go on.

Requests are checked before they are queued: strict JSON types, ranges, a max_tokens cap, a body
size cap (413), the model name (404), the API key when one is set (401). Errors use OpenAI's shape,
{"error": {"message", "type", "param", "code"}}, and say what is wrong.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import queue
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from ringllm.runtime.errors import ConfigError, RingLLMError

__all__ = ["create_app", "ServerSettings", "serve"]


@dataclass
class ServerSettings:
    """api_key: required bearer token (None: open). max_tokens_cap: largest max_tokens accepted.
    default_max_tokens: chat answers without max_tokens (completions default to 16, as OpenAI's).
    max_body_bytes: request bodies above get 413. queue_size: waiting requests before 503.
    max_batch: requests decoded together (one engine call per token for all); more wait in the queue.
    model_name: the id /v1/models lists; aliases: other names accepted in "model"."""

    api_key: str | None = None
    max_tokens_cap: int = 4096
    default_max_tokens: int = 512
    max_body_bytes: int = 1 << 20
    queue_size: int = 64
    max_batch: int = 8
    model_name: str | None = None
    aliases: tuple[str, ...] = ()


# --------------------------------------------------------------------------------------------
# Request schemas
# --------------------------------------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = Field(None, description="model id from /v1/models (omitted: the loaded model)")
    max_tokens: int | None = Field(None, ge=0, description="tokens to generate at most")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="extension: 0 = off")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="extension")
    repeat_penalty: float | None = Field(None, gt=0.0, le=10.0, description="extension (llama.cpp)")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    stop: str | list[str] | None = Field(None, description="up to 16 stop strings")
    seed: int | None = Field(None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="only 1 is supported")
    ignore_eos: bool = Field(False, description="extension: keep going past end-of-sequence")
    user: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] = Field(..., description="text, token ids, or a list of one text")
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = None


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------

class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def _error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
                code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                    code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(_error_body(message, type_, param, code), status_code=status, headers=headers)


# --------------------------------------------------------------------------------------------
# The worker
# --------------------------------------------------------------------------------------------

@dataclass
class _Job:
    kind: str                    # "completion" | "chat"
    ids: list[int]
    params: dict
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancel: threading.Event = field(default_factory=threading.Event)

    def emit(self, item: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:           # the event loop is gone (shutdown): nobody is listening
            self.cancel.set()


class Worker:
    """The thread that owns the LLM. Up to max_batch requests are decoded together (one engine call
    per token for all of them, ringllm.batch.BatchDecoder), each from its own fresh KV store with its
    own sampling settings; the others wait in the bounded FIFO queue (503 when it is full). A
    request joins the batch between two steps (its prompt prefilled alone first) and leaves it when
    it finishes or its client goes away."""

    def __init__(self, llm, queue_size: int, max_batch: int = 8):
        from ringllm.batch import BatchDecoder

        self.llm = llm
        self.jobs: queue.Queue = queue.Queue(maxsize=queue_size)
        self.batch = BatchDecoder(llm, max_batch)
        self.live: dict[int, tuple[_Job, Any]] = {}      # batch tag -> (job, its Decoder)
        self._tags = itertools.count()
        self.busy = False
        self.peak_batch = 0                               # most requests stepped together so far
        self.counters = {"completed": 0, "cancelled": 0, "failed": 0}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ringllm-worker", daemon=True)
        self._thread.start()

    @property
    def active(self) -> int:
        return len(self.live)

    def submit(self, job: _Job) -> None:
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
                self.busy = bool(self.live)
                try:
                    job = self.jobs.get(block=not self.live)
                except queue.Empty:
                    break
                if job is None or self._stopping:
                    return
                self.busy = True
                self._admit(job)
            if self.live:
                self._step()

    def _admit(self, job: _Job) -> None:
        """Check the request, prefill it and put it in the batch (or answer it at once)."""
        if job.cancel.is_set():
            self.counters["cancelled"] += 1
            return
        try:
            dec = self.llm.decoder(job.ids, **job.params)
        except RingLLMError as exc:
            self._fail(job, 400, str(exc))
            return
        except BaseException as exc:          # the worker outlives whatever one request did
            self._fail(job, 500, f"internal error: {type(exc).__name__}: {exc}")
            return
        job.emit(("start",))
        tag = next(self._tags)
        try:
            joined = self.batch.join(dec, tag)
        except RingLLMError as exc:
            self._fail(job, 400, str(exc))
            return
        except BaseException as exc:
            self._fail(job, 500, f"internal error: {type(exc).__name__}: {exc}")
            return
        if joined:
            self.live[tag] = (job, dec)
        else:                                 # ended at its prefill (EOS first, max_tokens 0)
            self._end(job, dec)

    def _step(self) -> None:
        """Drop cancelled requests, advance the others one token together, stream their chunks."""
        gone = [tag for tag, (job, _) in self.live.items() if job.cancel.is_set()]
        for tag in gone:
            self.batch.leave(tag)
            del self.live[tag]
        self.busy = bool(self.live)
        self.counters["cancelled"] += len(gone)
        if not self.live:
            return
        self.peak_batch = max(self.peak_batch, len(self.live))
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
        for tag, chunk in results:
            job, dec = self.live[tag]
            if job.cancel.is_set() and chunk.finish_reason is None:
                continue                      # dropped before the next step
            job.emit(("chunk", chunk.text, chunk.token, chunk.finish_reason))
            if chunk.finish_reason is not None:
                del self.live[tag]
                self._end(job, dec)

    def _end(self, job: _Job, dec) -> None:
        rec = dec.record
        job.emit(("end", rec.finish_reason or "stop", rec.prompt_tokens, len(rec.tokens), rec.timings.to_dict()))
        self.counters["completed"] += 1

    def _fail(self, job: _Job, status: int, message: str) -> None:
        self.counters["failed"] += 1
        job.emit(("error", status, message))


# --------------------------------------------------------------------------------------------
# Middleware: API key and body size, before any parsing
# --------------------------------------------------------------------------------------------

class _TooLarge(HTTPException):
    """Raised by the guard's receive(); an HTTPException so that FastAPI's body parser passes it on."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body exceeds this server's limit of {limit} bytes")


class _Guard:
    """ASGI middleware: 401 without the API key on /v1/*, 413 for bodies over the cap (by
    Content-Length, or counted as the body arrives)."""

    def __init__(self, app, settings: ServerSettings):
        self.app, self.settings = app, settings

    async def _reply(self, send, status: int, body: dict, headers: list | None = None) -> None:
        raw = json.dumps(body).encode()
        hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": hdrs + (headers or [])})
        await send({"type": "http.response.body", "body": raw})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        s = self.settings
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if s.api_key and scope.get("path", "").startswith("/v1"):
            auth = headers.get("authorization", "")
            given = auth[7:].strip() if auth.lower().startswith("bearer ") else headers.get("x-api-key", "")
            if not given or not secrets.compare_digest(given.encode(), s.api_key.encode()):
                return await self._reply(send, 401, _error_body(
                    "missing or invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"),
                    [(b"www-authenticate", b"Bearer")])
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return await self._reply(send, 400, _error_body(f"invalid Content-Length {length!r}"))
            if int(length) > s.max_body_bytes:
                return await self._reply(send, 413, _error_body(
                    f"request body of {int(length)} bytes exceeds this server's limit of {s.max_body_bytes} bytes",
                    code="request_too_large"))
        seen = 0
        started = False

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > s.max_body_bytes:
                    raise _TooLarge(s.max_body_bytes)
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._reply(send, 413, _error_body(
                    f"request body exceeds this server's limit of {s.max_body_bytes} bytes", code="request_too_large"))


class _SSEResponse(StreamingResponse):
    """A stream whose job is cancelled however the response ends (done, client gone, error)."""

    def __init__(self, content, job: _Job):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._job.cancel.set()


# --------------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------------

def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "json_invalid":
            return f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
        if err.get("type") == "missing" and not loc:
            return "request body is missing (expected a JSON object)"
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)


def create_app(llm, settings: ServerSettings | None = None) -> FastAPI:
    """The FastAPI app serving `llm` (the worker thread starts with the app and stops with it)."""
    s = settings or ServerSettings()
    name = s.model_name or llm.model_name
    names = {name, *s.aliases}
    created = int(time.time())
    state: dict[str, Any] = {}

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        state["worker"] = Worker(llm, s.queue_size, s.max_batch)
        try:
            yield
        finally:
            state["worker"].stop()

    app = FastAPI(title="ringllm", version=_version(), lifespan=lifespan,
                  description="OpenAI-compatible API of an embeddable LLM runtime with an in-place KV store.")

    def worker() -> Worker:
        if "worker" not in state:       # an app used without its lifespan (e.g. some test clients)
            state["worker"] = Worker(llm, s.queue_size, s.max_batch)
        return state["worker"]

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _error_response(400, _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = "request_too_large" if exc.status_code == 413 else None
        return _error_response(exc.status_code, str(exc.detail), code=code)

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        return _error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    # ---------------------------------------------------------------------------------- helpers

    def check_model(model: str | None) -> None:
        if model is not None and model not in names:
            raise APIError(404, f"model {model!r} does not exist; this server has {sorted(names)}", param="model",
                           code="model_not_found")

    def sampling(req: _Sampling, max_tokens: int | None, default: int) -> dict:
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
            if not k.lstrip("-").isdigit() or not 0 <= int(k) < llm.n_vocab:
                raise APIError(400, f"logit_bias key {k!r} is not a token id of this model (0..{llm.n_vocab - 1})",
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

    async def submit(request: Request, kind: str, ids: list[int], params: dict) -> _Job:
        job = _Job(kind, ids, params, asyncio.get_running_loop(), asyncio.Queue())
        worker().submit(job)
        return job

    async def next_event(request: Request, job: _Job) -> tuple:
        """The job's next event; cancels the job when the client goes away while it waits."""
        while True:
            try:
                return await asyncio.wait_for(job.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel.set()
                    raise asyncio.CancelledError()

    async def first_event(request: Request, job: _Job) -> tuple:
        try:
            ev = await next_event(request, job)
        except BaseException:
            job.cancel.set()
            raise
        if ev[0] == "error":
            raise APIError(ev[1], ev[2], "invalid_request_error" if ev[1] < 500 else "server_error")
        return ev

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    async def run(request: Request, job: _Job, make_chunk, make_final, include_usage: bool, stream: bool):
        await first_event(request, job)           # errors before any output become 4xx responses
        if not stream:
            text, n_tokens = [], 0
            try:
                while True:
                    ev = await next_event(request, job)
                    if ev[0] == "chunk":
                        text.append(ev[1])
                    elif ev[0] == "end":
                        return JSONResponse(make_final("".join(text), ev[1], usage(ev[2], ev[3]), ev[4]))
                    elif ev[0] == "error":
                        raise APIError(ev[1], ev[2], "server_error" if ev[1] >= 500 else "invalid_request_error")
            finally:
                job.cancel.set()

        async def events():
            yield _sse(make_chunk(None, None, first=True))
            while True:
                ev = await job.events.get()
                if ev[0] == "chunk":
                    if ev[1]:
                        yield _sse(make_chunk(ev[1], None))
                elif ev[0] == "end":
                    yield _sse(make_chunk(None, ev[1]))
                    if include_usage:
                        yield _sse(make_chunk(None, None, usage=usage(ev[2], ev[3])))
                    break
                elif ev[0] == "error":
                    yield _sse(_error_body(ev[2], "server_error" if ev[1] >= 500 else "invalid_request_error"))
                    break
            yield "data: [DONE]\n\n"

        return _SSEResponse(events(), job)

    # ---------------------------------------------------------------------------------- routes

    @app.get("/health", summary="liveness and queue state")
    async def health():
        w = worker()
        return {"status": "ok", "model": name, "queued": w.jobs.qsize(), "busy": w.busy, "active": w.active,
                "peak_batch": w.peak_batch, **w.counters}

    @app.get("/v1/models", summary="the loaded model")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                              "owned_by": "ringllm"}]}

    @app.get("/v1/models/{model_id}", summary="one model")
    async def model(model_id: str):
        check_model(model_id)
        return {"id": name, "object": "model", "created": created, "owned_by": "ringllm"}

    @app.post("/v1/completions", summary="complete a prompt (OpenAI legacy completions)")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
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
                ids = llm.prompt_ids(prompt)
            else:
                ids = llm.prompt_ids(list(prompt))
        except ConfigError as exc:
            raise APIError(400, str(exc), param="prompt") from None
        params = sampling(req, req.max_tokens, 16)
        job = await submit(request, "completion", ids, params)
        rid, t = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(text, finish, first=False, usage=None):
            if first:
                text = ""
            body = {"id": rid, "object": "text_completion", "created": t, "model": name,
                    "choices": [] if usage else [{"index": 0, "text": text or "", "finish_reason": finish,
                                                  "logprobs": None}]}
            if usage:
                body["usage"] = usage
            return body

        def final(text, finish, use, timings):
            return {"id": rid, "object": "text_completion", "created": t, "model": name,
                    "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
                    "usage": use, "timings": timings}

        include = bool(req.stream_options and req.stream_options.include_usage)
        return await run(request, job, chunk, final, include, req.stream)

    @app.post("/v1/chat/completions", summary="answer a conversation (OpenAI chat completions)")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_model(req.model)
        if req.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        messages = []
        for i, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):
                content = "".join(p.text for p in content)
            if content is None:
                content = ""
            role = "system" if m.role == "developer" else m.role
            messages.append({"role": role, "content": content})
        try:
            ids = llm.chat_ids(llm.render_chat(messages, add_generation_prompt=True))
        except ConfigError as exc:
            raise APIError(400, str(exc), param="messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling(req, max_tokens, s.default_max_tokens)
        job = await submit(request, "chat", ids, params)
        rid, t = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(text, finish, first=False, usage=None):
            body = {"id": rid, "object": "chat.completion.chunk", "created": t, "model": name,
                    "system_fingerprint": None}
            if usage:
                body["choices"], body["usage"] = [], usage
                return body
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            body["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
            return body

        def final(text, finish, use, timings):
            return {"id": rid, "object": "chat.completion", "created": t, "model": name, "system_fingerprint": None,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": finish, "logprobs": None}],
                    "usage": use, "timings": timings}

        include = bool(req.stream_options and req.stream_options.include_usage)
        return await run(request, job, chunk, final, include, req.stream)

    return _wrap(app, s)


def _wrap(app: FastAPI, settings: ServerSettings):
    """Install the guard as the outermost layer (before routing and body parsing)."""
    app.add_middleware(_Guard, settings=settings)
    return app


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _version() -> str:
    from ringllm import __version__
    return __version__


def serve(llm, host: str = "127.0.0.1", port: int = 8080, settings: ServerSettings | None = None,
          log_level: str = "info") -> None:
    """Run the server until interrupted."""
    import uvicorn
    uvicorn.run(create_app(llm, settings), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=3)
