"""`ringllm serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn).

    POST /v1/completions        prompt -> text (stream=true: server-sent events)
    POST /v1/chat/completions   messages -> message (stream=true: server-sent events)
    GET  /v1/models             the loaded model
    GET  /health                liveness, queue length, counters
    GET  /metrics               Prometheus text format: requests, tokens, latency histograms, KV evictions
    GET  /v1/config             model, context, default KV store, policies and limits (the chat page reads it)
    GET  /                      the chat page (server_page.py, files in web/)
    GET  /openapi.json, /docs   the schema

One worker thread owns the LLM. Up to `max_batch` requests are decoded together, one batched
engine step (CPUEngine.step_batch) per token for all of them, each with its own KV store (the
server's KVConfig, or the request's "kv") and sampling settings, so concurrent clients get what
they would get alone; requests beyond that wait in a bounded FIFO queue (503 when it is full). A
request continues from the cached store of an earlier one that shares the start of its prompt
(ringllm.prompt_cache), so a chat through the API prefills only each turn's new tokens. A client that disconnects
(mid-stream, or while queued) has its request cancelled between two tokens; the others go on.

Requests are checked before they are queued: strict JSON types, ranges, a max_tokens cap, a body
size cap (413), unknown fields (400), the model name (404 with strict_model), the API key when
one is set (401). Errors use OpenAI's shape,
{"error": {"message", "type", "param", "code"}}, and say what is wrong.

This module assembles the app; the parts live beside it:

    server_api.py      ServerSettings, request schemas, APIError and the error body
    server_worker.py   Job and Worker: the thread that owns the LLM and batches requests
    server_http.py     the guard middleware (API key, body size), server-sent events, error handlers
    server_routes.py   Routes: one handler method per route
"""
from __future__ import annotations

from fastapi import FastAPI

from ringllm import __version__
from ringllm.server_api import APIError, ServerSettings
from ringllm.server_http import Guard, install_error_handlers
from ringllm.server_page import install_chat_page
from ringllm.server_routes import Routes
from ringllm.server_worker import Job, Worker

# APIError, Job and Worker are re-exported for code that drives the worker directly (tests).
__all__ = ["create_app", "ServerSettings", "serve", "APIError", "Job", "Worker"]


def create_app(llm, settings: ServerSettings | None = None, worker_factory=None) -> FastAPI:
    """The FastAPI app serving `llm` (the worker thread starts with the app and stops with it).
    worker_factory(llm, settings, metrics): what runs the requests instead of a local Worker
    (ringllm.ray_serve: replicas on Ray Serve); the routes, checks and errors stay these."""
    s = settings or ServerSettings()
    routes = Routes(llm, s, worker_factory)
    app = FastAPI(title="ringllm", version=__version__, lifespan=routes.lifespan,
                  description="OpenAI-compatible API of an embeddable LLM runtime with an in-place KV store.")
    install_error_handlers(app)
    app.get("/health", summary="liveness and queue state")(routes.health)
    app.get("/metrics", summary="Prometheus metrics (text format)")(routes.metrics_text)
    app.get("/v1/config", summary="model, context, default KV store, policies and limits")(routes.config)
    app.get("/v1/models", summary="the loaded model")(routes.models)
    app.get("/v1/models/{model_id}", summary="one model")(routes.model)
    app.post("/v1/completions", summary="complete a prompt (OpenAI legacy completions)")(routes.completions)
    app.post("/v1/chat/completions", summary="answer a conversation (OpenAI chat completions)")(
        routes.chat_completions)
    if s.web_ui:
        install_chat_page(app, s)              # GET /: the chat page (server_page.py)
    app.add_middleware(Guard, settings=s)      # outermost: before routing and body parsing
    return app


def serve(llm, host: str = "127.0.0.1", port: int = 8080, settings: ServerSettings | None = None,
          log_level: str = "info") -> None:
    """Run the server until interrupted."""
    import uvicorn      # imported on use: only a running server needs it, not an app built for tests

    uvicorn.run(create_app(llm, settings), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=3)
