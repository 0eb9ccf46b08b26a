"""Structured output and tool calling through `ringllm serve` (the real program) and the official
`openai` client: response_format, the grammar / regex extensions, a tool round trip (tool call ->
tool result -> final answer) streamed and not, and 400s (never 500s) for what does not compile."""
from __future__ import annotations

import json
import os
import re

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from ringllm.server_process import running_server  # noqa: E402

KEY = "sk-structured-test"
TEMPLATES = os.path.join(os.path.dirname(__file__), "data", "chat_templates")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    """SmolLM2 served with Qwen2.5's template (ChatML like SmolLM2's, plus Hermes <tool_call> syntax)."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with running_server(["-m", smollm2_path, "--api-key", KEY, "-t", "1", "--no-progress", "--log-level", "warning",
                         "--chat-template", os.path.join(TEMPLATES, "Qwen-Qwen2.5-7B-Instruct.jinja")], log) as url:
        yield url


@pytest.fixture(scope="module")
def server_key():
    return KEY


def stream_chat(client, **kw) -> tuple[str, list[dict], str]:
    """(content, tool calls, finish_reason) of a streamed chat, assembled from OpenAI's deltas."""
    content, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content.append(choice.delta.content or "")
            for tc in choice.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.id or call["id"]
                if tc.function is not None:
                    call["name"] += tc.function.name or ""
                    call["arguments"] += tc.function.arguments or ""
    return "".join(content), [calls[i] for i in sorted(calls)], finish


def test_response_format_json_schema_streamed_and_not(client, model_id):
    kw = dict(model=model_id, max_tokens=80, temperature=0, messages=[
        {"role": "user", "content": "Give me a person as JSON with name and age."}],
              response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    r = client.chat.completions.create(**kw)
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    content, calls, finish = stream_chat(client, **kw)
    assert content == text and calls == [] and finish == "stop"
    sampled = client.chat.completions.create(**{**kw, "temperature": 1.0, "seed": 7})
    jsonschema.validate(json.loads(sampled.choices[0].message.content), SCHEMA)
    obj = client.chat.completions.create(**{**kw, "response_format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_grammar_and_regex_extensions(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Is water wet?"}],
                                       max_tokens=8, temperature=0, extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model=model_id, prompt="The year the war ended was", max_tokens=8, temperature=0,
                                  extra_body={"regex": " [12][0-9]{3}"})
    assert re.fullmatch(r" [12][0-9]{3}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    lark = 'start: "color: " COLOR\nCOLOR: "red" | "green" | "blue"'
    r = client.completions.create(model=model_id, prompt="My favourite", max_tokens=8, temperature=0.8, seed=3,
                                  extra_body={"grammar": lark})
    assert re.fullmatch(r"color: (red|green|blue)", r.choices[0].text)


def test_tool_round_trip(client, model_id):
    """tool call -> tool result -> final answer, not streamed, then the same streamed."""
    r = client.chat.completions.create(model=model_id, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=80, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, TOOLS[0]["function"]["parameters"])
    # the same call, streamed: delta.tool_calls pieces add up to it
    content, calls, finish = stream_chat(client, model=model_id, messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=80, temperature=0)
    assert finish == "tool_calls" and content == "" and len(calls) == 1
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == call.function.arguments
    # the tool's result goes back as a role "tool" message; the model answers in text
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 21, **args})}]
    final = client.chat.completions.create(model=model_id, messages=history, tools=TOOLS, max_tokens=40,
                                           temperature=0)
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
    assert answer.message.content
    content, calls, finish = stream_chat(client, model=model_id, messages=history, tools=TOOLS, max_tokens=40,
                                         temperature=0)
    assert (content, calls, finish) == (answer.message.content, [], answer.finish_reason)


def test_named_tool_choice_streams_every_call_argument_piece(server, model_id):
    body = {"model": model_id, "messages": ASK, "tools": TOOLS, "max_tokens": 80, "temperature": 0, "stream": True,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    pieces = []
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                for choice in json.loads(line[5:])["choices"]:
                    for tc in choice["delta"].get("tool_calls", []):
                        pieces.append(tc["function"]["arguments"])
    assert len([p for p in pieces if p]) > 1          # streamed in pieces, not as one block
    jsonschema.validate(json.loads("".join(pieces)), TOOLS[0]["function"]["parameters"])


@pytest.mark.parametrize("body, param, reason", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format", "objekt"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "minimum": 5, "maximum": 1}}}}, "response_format", "minimum"),
    ({"response_format": {"type": "xml"}}, "response_format", "not supported"),
    ({"grammar": 'root ::= "yes | "no"'}, "grammar", "GBNF"),
    ({"grammar": "start: foo"}, "grammar", "foo"),
    ({"regex": "a(b"}, "regex", "unclosed group"),
    ({"regex": "[0-9]+", "grammar": 'root ::= "x"'}, "grammar", "one constraint at a time"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, None, "ignore_eos"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tools", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "need tools"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
])
def test_bad_constraints_and_tools_get_400_naming_the_problem(server, model_id, body, param, reason):
    r = httpx.post(server + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": model_id, "messages": ASK, "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert reason in err["message"] and (param is None or err["param"] == param)
    assert httpx.get(server + "/health", timeout=10).json()["status"] == "ok"


def test_template_without_tool_syntax_is_refused(smollm2_path, tmp_path):
    """The bundled SmolLM2 template renders no tools: a request with tools is a 400 that says so."""
    with running_server(["-m", smollm2_path, "-t", "1", "--no-progress", "--log-level", "warning"],
                        tmp_path / "serve.log") as url:
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"messages": ASK, "tools": TOOLS, "max_tokens": 8})
    assert r.status_code == 400 and "no tool syntax" in r.json()["error"]["message"]
