"""Tool calling from Python: the call syntax each real template teaches, the call parser (whole and
fed piece by piece), and LLM.chat(tools=...) on SmolLM2 given Qwen2.5's and Llama 3.2's templates:
forced, named and automatic calls, a tool round trip, streaming, and clear errors."""
from __future__ import annotations

import json
import os

import pytest

import ringllm
from ringllm import ConfigError
from ringllm.tools import TOOL_SYNTAXES, ToolCallParser, tool_syntax_of

jsonschema = pytest.importorskip("jsonschema")

TEMPLATES = os.path.join(os.path.dirname(__file__), "data", "chat_templates")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string", "maxLength": 30}},
                                                          "required": ["city"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def template(name: str) -> str:
    with open(os.path.join(TEMPLATES, name + ".jinja"), encoding="utf-8") as fh:
        return fh.read()


@pytest.fixture(scope="module")
def qwen_llm(smollm2_path):
    """SmolLM2 with Qwen2.5's template: both ChatML, so its tokens are SmolLM2's own."""
    return ringllm.LLM(smollm2_path, n_threads=1, progress=False, chat_template=template("Qwen-Qwen2.5-7B-Instruct"))


def check_calls(calls: list[dict], names=("get_weather", "get_time")) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


# ------------------------------------------------------------------------------------------------
# Syntaxes and the parser
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, syntax", [
    ("Qwen-Qwen2.5-7B-Instruct", "hermes"), ("Qwen-Qwen3-0.6B", "hermes"), ("HuggingFaceTB-SmolLM3-3B", "hermes"),
    ("meta-llama-Llama-3.1-8B-Instruct", "llama3_json"), ("meta-llama-Llama-3.2-3B-Instruct", "llama3_json"),
    ("google-gemma-2-2b-it", None), ("google-gemma-3n-E4B-it", None), ("microsoft-Phi-3.5-mini-instruct", None),
])
def test_each_template_teaches_its_call_syntax(name, syntax):
    found = tool_syntax_of(template(name))
    assert (found.name if found else None) == syntax


HERMES_ANSWER = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"centre\\"", '
                 '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"city": '
                 '"{Paris}"}}\n</tool_call>')


@pytest.mark.parametrize("piece", [len(HERMES_ANSWER), 1, 3, 7])
def test_hermes_answer_parsed_whole_or_in_pieces(piece):
    p = ToolCallParser(TOOL_SYNTAXES["hermes"])
    events = []
    for i in range(0, len(HERMES_ANSWER), piece):
        events += p.feed(HERMES_ANSWER[i:i + piece])
    events += p.finish()
    assert p.content == "Let me check."
    assert [c["function"]["name"] for c in p.calls] == ["get_weather", "get_time"]
    assert json.loads(p.calls[0]["function"]["arguments"]) == {"city": 'Paris "centre"', "unit": "celsius"}
    assert p.calls[1]["function"]["arguments"] == '{"city": "{Paris}"}'
    # the events add up to the same thing (what the server streams)
    assert "".join(e[1] for e in events if e[0] == "content") == p.content
    for i, call in enumerate(p.calls):
        assert "".join(e[2] for e in events if e[0] == "arguments" and e[1] == i) == call["function"]["arguments"]
        assert [e[3] for e in events if e[0] == "call" and e[1] == i] == [call["function"]["name"]]


def test_llama3_answer_and_plain_text_and_a_cut_call():
    p = ToolCallParser(TOOL_SYNTAXES["llama3_json"])
    p.feed('{"name": "get_time", "parameters": {"city": "Oslo"}}')
    p.finish()
    assert p.content is None and p.calls[0]["function"] == {"name": "get_time", "arguments": '{"city": "Oslo"}'}
    p = ToolCallParser(TOOL_SYNTAXES["llama3_json"])
    p.feed("It is sunny.")
    p.finish()
    assert p.content == "It is sunny." and p.calls == []
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    p = ToolCallParser(TOOL_SYNTAXES["hermes"])
    p.feed("Sure. " + cut)
    p.finish()
    assert p.calls == [] and p.content == "Sure. " + cut


# ------------------------------------------------------------------------------------------------
# LLM.chat with tools
# ------------------------------------------------------------------------------------------------

def test_required_named_and_single_calls(qwen_llm):
    r = qwen_llm.chat(ASK, tools=TOOLS, tool_choice="required", max_tokens=120)
    assert r.finish_reason == "tool_calls" and r.tool_calls and r.content is None
    check_calls(r.tool_calls)
    assert r.message == {"role": "assistant", "content": None, "tool_calls": r.tool_calls}
    named = qwen_llm.chat(ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
                          max_tokens=80)
    assert [c["function"]["name"] for c in named.tool_calls] == ["get_time"]
    check_calls(named.tool_calls, ["get_time"])
    for seed in range(3):
        one = qwen_llm.chat(ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=80,
                            temperature=1.0, seed=seed)
        assert len(one.tool_calls) == 1 and one.finish_reason == "tool_calls"
        check_calls(one.tool_calls)


def test_auto_answers_text_or_valid_calls_and_the_round_trip(qwen_llm):
    """tool_choice auto: the model writes text or calls; any call it starts follows the schema.
    Then the tool's result goes back (role tool) and the model answers in text."""
    for seed in range(4):
        r = qwen_llm.chat(ASK, tools=TOOLS, max_tokens=100, temperature=1.0, seed=seed)
        assert r.finish_reason in ("stop", "length", "tool_calls")
        check_calls(r.tool_calls)
        assert (r.finish_reason == "tool_calls") == bool(r.tool_calls)
    first = qwen_llm.chat(ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=80)
    call = first.tool_calls[0]
    history = ASK + [first.message, {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temp": 21})}]
    rendered = qwen_llm.render_chat(history, tools=TOOLS)
    assert "<tool_response>\n{\"temp\": 21}\n</tool_response>" in rendered
    assert '"arguments": ' + call["function"]["arguments"] in rendered      # the call, as the model wrote it
    final = qwen_llm.chat(history, tools=TOOLS, tool_choice="none", max_tokens=40)
    assert final.content and final.tool_calls == [] and final.finish_reason in ("stop", "length")


def test_streamed_tool_call_matches_the_completion(qwen_llm):
    whole = qwen_llm.chat(ASK, tools=TOOLS, tool_choice="required", max_tokens=120)
    gen = qwen_llm.chat(ASK, tools=TOOLS, tool_choice="required", max_tokens=120, stream=True)
    chunks = list(gen)
    assert "".join(c.text for c in chunks) == whole.text and chunks[-1].finish_reason == "tool_calls"
    strip = [{**c, "id": None} for c in gen.tool_calls]
    assert strip == [{**c, "id": None} for c in whole.tool_calls] and gen.finish_reason == "tool_calls"


def test_llama3_json_syntax(smollm2_path):
    llm = ringllm.LLM(smollm2_path, n_threads=1, progress=False,
                      chat_template=template("meta-llama-Llama-3.2-3B-Instruct"))
    r = llm.chat(ASK, tools=TOOLS, tool_choice="required", max_tokens=80)
    assert r.text.startswith('{"name": ') and len(r.tool_calls) == 1
    check_calls(r.tool_calls)


def test_tool_errors_are_clear(qwen_llm, smollm2_path):
    plain = ringllm.LLM(smollm2_path, n_threads=1, progress=False)
    with pytest.raises(ConfigError, match="no tool syntax"):
        plain.chat(ASK, tools=TOOLS)
    bad = [
        ([], "non-empty list"),
        ([{"type": "retrieval"}], "only function tools"),
        ([{"type": "function", "function": {"name": "a b"}}], "letters"),
        ([TOOLS[0], TOOLS[0]], "used twice"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}], "objekt"),
    ]
    for tools, message in bad:
        with pytest.raises(ConfigError, match=message):
            qwen_llm.chat(ASK, tools=tools, tool_choice="required")
    with pytest.raises(ConfigError, match="not among the tools"):
        qwen_llm.chat(ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ConfigError, match="tool_choice must be"):
        qwen_llm.chat(ASK, tools=TOOLS, tool_choice="sometimes")
    with pytest.raises(ConfigError, match="tool_choice needs tools"):
        qwen_llm.chat(ASK, tool_choice="auto")
    with pytest.raises(ConfigError, match="cannot be combined"):
        qwen_llm.chat(ASK, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(ConfigError, match="not valid JSON"):
        qwen_llm.chat(ASK + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{oops"}}]}], tools=TOOLS)
