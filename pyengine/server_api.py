"""The server's API surface: its settings, the request schemas, and errors in OpenAI's shape.

Request schemas are strict pydantic models (no silent coercion: "1" is not an int, 1 is not a
bool) that refuse unknown fields with a 400 naming them, as OpenAI's API does ("Unrecognized
request argument"): a field this server does not implement is never silently dropped. The ranges
they declare are checked before a request is queued. OpenAI fields the server knows but does not
implement are declared all the same so that a handler can refuse them with a 400 that says so
(logprobs, echo, suffix, the deprecated functions / function_call). Every error a client can see has OpenAI's body,
{"error": {"message", "type", "param", "code"}}, and a message that names the problem: APIError
carries one from a handler or the worker to the response; error_response builds one; and
validation_message turns pydantic's validation errors into one line.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["APIError", "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "SamplingRequest",
           "ServerSettings", "StreamOptions", "StrictModel", "TextPart", "error_body", "error_response",
           "validation_message"]


@dataclass
class ServerSettings:
    """api_key: required bearer token (None: open). max_tokens_cap: largest max_tokens accepted.
    default_max_tokens: chat answers without max_tokens (completions default to 16, as OpenAI's).
    max_body_bytes: request bodies above get 413. queue_size: waiting requests before 503.
    max_batch: requests decoded together (one engine call per token for all); more wait in the queue.
    model_name: the id /v1/models lists; aliases: other names accepted in "model".
    strict_model: only model_name and the aliases are accepted in "model" (404 for any other);
    False: any model id is served by the one loaded model, as clients that hard-code one expect.
    web_ui: serve the chat page at / (ringllm.server_page).
    cache_bytes: budget of the prompt cache (ringllm.prompt_cache; 0: off; None: a quarter of the
    machine's memory, at most 4 GiB)."""

    api_key: str | None = None
    max_tokens_cap: int = 4096
    default_max_tokens: int = 512
    max_body_bytes: int = 1 << 20
    queue_size: int = 256
    max_batch: int = 8
    model_name: str | None = None
    aliases: tuple[str, ...] = ()
    strict_model: bool = False
    web_ui: bool = True
    cache_bytes: int | None = None


# --------------------------------------------------------------------------------------------
# Request schemas
# --------------------------------------------------------------------------------------------

class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingRequest(StrictModel):
    """The fields completions and chat completions share (model, limits, sampling, streaming)."""

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
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema"}}')
    grammar: str | None = Field(None, description="extension: a Lark (llguidance) or GBNF grammar the answer follows")
    regex: str | None = Field(None, description="extension: a regular expression the whole answer matches")
    kv: dict[str, Any] | None = Field(
        None, description='extension: this request\'s KV store, any KVConfig field, e.g. {"policy": "h2o", '
                          '"capacity": 256} (omitted: the server\'s)')
    session_id: str | None = Field(None, max_length=256, description="extension: a conversation key; with "
                                   "`serve --ray`, requests that share it go to the replica holding its KV store")
    cache_prompt: bool = Field(True, description="extension (llama-server): continue from the cached store of an "
                                                 "earlier request that shares the prompt's first tokens")


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] = Field(..., description="text, token ids, or a list of one text")
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, description="an assistant's calls, as this server returns them")
    tool_call_id: str | None = Field(None, description="on a tool message: the call it answers")


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='extension (vLLM, llama-server): extra chat template variables, e.g. {"enable_thinking": false}')
    tools: list[dict[str, Any]] | None = Field(None, description="function tools, rendered by the chat template")
    tool_choice: str | dict[str, Any] | None = Field(
        None, description='"auto" (default with tools), "none", "required" or {"type": "function", "function": {"name"}}')
    parallel_tool_calls: bool | None = Field(None, description="several calls in one answer (default true)")
    functions: list[Any] | None = Field(None, description="deprecated by OpenAI; refused (use tools)")
    function_call: str | dict[str, Any] | None = Field(None, description="deprecated by OpenAI; refused (use tool_choice)")


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------

class APIError(Exception):
    """An error answered with `status` and OpenAI's error body (headers: extra response headers)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def validation_message(exc: RequestValidationError) -> str:
    """One line that says what is wrong with a request pydantic rejected (its first 5 errors)."""
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "json_invalid":
            return f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
        if err.get("type") == "missing" and not loc:
            return "request body is missing (expected a JSON object)"
        if err.get("type") == "extra_forbidden":
            parts.append(f"unrecognized request argument {loc!r}: this server does not implement it")
            continue
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)
