"""HTTP plumbing of the server: the guard middleware, server-sent events, and the error handlers.

Guard is ASGI middleware installed as the app's outermost layer, so it answers before routing
and body parsing: 401 without the API key on /v1/*, 400 for a malformed Content-Length, 413 for
a body over the cap (by Content-Length, or counted as the body arrives). SSEResponse streams a
job's events and cancels the job however the response ends (done, client gone, error), so the
worker drops a request nobody reads. install_error_handlers makes FastAPI's own errors
(validation, HTTP exceptions) and APIError answer with OpenAI's error body.
"""
from __future__ import annotations

import json
import secrets

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ringllm.server_api import APIError, ServerSettings, error_body, error_response, validation_message
from ringllm.server_worker import Job

__all__ = ["Guard", "SSEResponse", "install_error_handlers", "sse_event"]


def sse_event(obj: dict) -> str:
    """One server-sent event carrying obj as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def install_error_handlers(app: FastAPI) -> None:
    """Validation errors -> 400, HTTP exceptions -> their status, APIError -> its status; all with
    OpenAI's error body."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(400, validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = "request_too_large" if exc.status_code == 413 else None
        return error_response(exc.status_code, str(exc.detail), code=code)

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)


class _TooLarge(HTTPException):
    """Raised by the guard's receive(); an HTTPException so that FastAPI's body parser passes it on."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body exceeds this server's limit of {limit} bytes")


class Guard:
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
                return await self._reply(send, 401, error_body(
                    "missing or invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"),
                    [(b"www-authenticate", b"Bearer")])
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return await self._reply(send, 400, error_body(f"invalid Content-Length {length!r}"))
            if int(length) > s.max_body_bytes:
                return await self._reply(send, 413, error_body(
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
                await self._reply(send, 413, error_body(
                    f"request body exceeds this server's limit of {s.max_body_bytes} bytes", code="request_too_large"))


class SSEResponse(StreamingResponse):
    """A stream whose job is cancelled however the response ends (done, client gone, error)."""

    def __init__(self, content, job: Job):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._job.cancel.set()
