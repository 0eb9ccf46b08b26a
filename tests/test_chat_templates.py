"""Real chat templates of the model families people download, rendered by ringllm and by
transformers' apply_chat_template: the text must be identical, and a conversation transformers
refuses (Gemma's role alternation, a system turn Gemma 2 has no place for) must be refused here
too, as a ConfigError with the template's own message.

The templates are stored under tests/data/chat_templates (README.md there names each one's
source); the oracle tokenizer is built offline from a three-token vocabulary with the family's
BOS/EOS strings, since the template, not the vocabulary, decides the text. Beyond the parity
grid, a few tests pin what the families are known to write (Llama 3's date block, Qwen3's empty
think block, SmolLM3's /no_think flag), so a renderer and an oracle that drifted together would
still be caught.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ringllm.chat_template import check_template_kwargs, render_chat, validate_messages
from ringllm.runtime.errors import ConfigError

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
jinja2 = pytest.importorskip("jinja2")

DATA = Path(__file__).parent / "data" / "chat_templates"

# file stem -> (bos, eos) as the family's tokenizer_config.json has them (None: the model has none)
FAMILIES = {
    "meta-llama-Llama-3.1-8B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "Qwen-Qwen2.5-7B-Instruct": (None, "<|im_end|>"),
    "Qwen-Qwen3-0.6B": (None, "<|im_end|>"),
    "microsoft-Phi-3-mini-4k-instruct": ("<s>", "<|endoftext|>"),
    "microsoft-Phi-3.5-mini-instruct": ("<s>", "<|endoftext|>"),
    "microsoft-Phi-4-mini-instruct": ("<|endoftext|>", "<|endoftext|>"),
    "google-gemma-2-2b-it": ("<bos>", "<eos>"),
    "google-gemma-3n-E4B-it": ("<bos>", "<eos>"),
    "HuggingFaceTB-SmolLM3-3B": (None, "<|im_end|>"),
}

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. Paris"}},
                   "required": ["city"]}}}]

TOOL_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}

CONVERSATIONS = {
    "system_multi_turn": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "What is 2+2?"}],
    "one_user": [{"role": "user", "content": "Hello!"}],
    "multi_turn_no_system": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? Réponds en français 🙂"}],
    "whitespace": [{"role": "user", "content": "  spaces and\nnewlines\n\n  "}],
    "think_in_history": [
        {"role": "system", "content": "Think first."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nTwo and two make four.\n</think>\n\n4"},
        {"role": "user", "content": "3+3?"}],
    "reasoning_field": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6", "reasoning": "Three and three."}],
    "tool_round_trip": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "name": "get_weather", "content": json.dumps({"temp_c": 21})},
        {"role": "user", "content": "Thanks. And tomorrow?"}],
    "tool_call_content_none": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
        {"role": "tool", "content": "21C"}],
    "system_only_then_assistant": [
        {"role": "system", "content": "Be brief /no_think"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hey"}],
    "bad_alternation": [
        {"role": "user", "content": "one"},
        {"role": "user", "content": "two"}],
}

# extra template variables, as apply_chat_template(**kwargs) takes them
VARIANTS = {
    "plain": {},
    "tools": {"tools": TOOLS},
    "thinking_off": {"enable_thinking": False},
    "thinking_on": {"enable_thinking": True},
}


def load(name: str) -> str:
    return (DATA / f"{name}.jinja").read_text(encoding="utf-8")


def oracle(bos: str | None, eos: str | None):
    vocab = {"<unk>": 0}
    for token in (bos, eos):
        if token is not None:
            vocab.setdefault(token, len(vocab))
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                                unk_token="<unk>")


_ORACLES: dict = {}


def expected_and_ours(name: str, messages: list[dict], add_generation_prompt: bool, **kwargs):
    """(transformers' text or exception, ringllm's text or exception) for one rendering."""
    bos, eos = FAMILIES[name]
    if (bos, eos) not in _ORACLES:
        _ORACLES[bos, eos] = oracle(bos, eos)
    template = load(name)
    try:
        expected = _ORACLES[bos, eos].apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt,
            **kwargs)
    except Exception as exc:  # noqa: BLE001 - any refusal of the oracle is what ringllm must match
        expected = exc
    try:
        ours = render_chat(template, messages, add_generation_prompt, bos_token=bos or "", eos_token=eos or "",
                           **kwargs)
    except ConfigError as exc:
        ours = exc
    return expected, ours


def assert_same(name: str, messages: list[dict], add_generation_prompt: bool, **kwargs) -> str | None:
    expected, ours = expected_and_ours(name, messages, add_generation_prompt, **kwargs)
    if isinstance(expected, Exception):
        assert isinstance(ours, ConfigError), (
            f"transformers refused ({type(expected).__name__}: {expected}) but ringllm rendered:\n{ours}")
        if isinstance(expected, jinja2.TemplateError) and not isinstance(expected, jinja2.UndefinedError):
            assert str(expected) in str(ours)       # the template's own raise_exception message
        return None
    assert not isinstance(ours, Exception), f"ringllm refused what transformers rendered: {ours}"
    assert ours == expected
    return ours


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen", "nogen"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("name", list(FAMILIES))
def test_template_matches_transformers(name, conversation, variant, add_generation_prompt):
    assert_same(name, CONVERSATIONS[conversation], add_generation_prompt, **VARIANTS[variant])


# Family-specific switches beyond the grid.
EXTRA_CASES = [
    ("meta-llama-Llama-3.1-8B-Instruct", "system_multi_turn", {"tools": TOOLS, "tools_in_user_message": False}),
    ("meta-llama-Llama-3.1-8B-Instruct", "one_user", {"date_string": "01 Jan 2025"}),
    ("meta-llama-Llama-3.1-8B-Instruct", "one_user", {"tools": TOOLS, "builtin_tools": ["brave_search", "wolfram_alpha"]}),
    ("meta-llama-Llama-3.2-3B-Instruct", "system_multi_turn", {"tools": TOOLS, "tools_in_user_message": False}),
    ("meta-llama-Llama-3.2-3B-Instruct", "one_user", {"date_string": "01 Jan 2025"}),
    ("Qwen-Qwen3-0.6B", "tool_round_trip", {"tools": TOOLS, "enable_thinking": False}),
    ("HuggingFaceTB-SmolLM3-3B", "one_user", {"xml_tools": TOOLS}),
    ("HuggingFaceTB-SmolLM3-3B", "system_multi_turn", {"python_tools": TOOLS, "enable_thinking": False}),
    ("HuggingFaceTB-SmolLM3-3B", "one_user", {"tools": TOOLS, "enable_thinking": True}),
]


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen", "nogen"])
@pytest.mark.parametrize("name,conversation,kwargs", EXTRA_CASES,
                         ids=[f"{n}-{c}-{'+'.join(k)}" for n, c, k in EXTRA_CASES])
def test_family_switches_match_transformers(name, conversation, kwargs, add_generation_prompt):
    assert_same(name, CONVERSATIONS[conversation], add_generation_prompt, **kwargs)


def test_smollm3_system_flags_match_transformers():
    for system in ("Be brief /think", "Be brief /no_think", "Just this. /system_override", ""):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
        for thinking in (None, True, False):
            kwargs = {} if thinking is None else {"enable_thinking": thinking}
            assert_same("HuggingFaceTB-SmolLM3-3B", messages, True, **kwargs)


# ------------------------------------------------------------------ what the families write

def ours(name: str, conversation: str | list, add_generation_prompt: bool = True, **kwargs) -> str:
    messages = CONVERSATIONS[conversation] if isinstance(conversation, str) else conversation
    text = assert_same(name, messages, add_generation_prompt, **kwargs)
    assert text is not None
    return text


def test_llama3_header_tokens_and_date_block():
    text = ours("meta-llama-Llama-3.1-8B-Instruct", "system_multi_turn")
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                           "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
                           "You are a terse assistant.<|eot_id|>")
    assert text.endswith("<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
                         "<|start_header_id|>assistant<|end_header_id|>\n\n")
    dated = ours("meta-llama-Llama-3.2-3B-Instruct", "one_user", date_string="01 Jan 2025")
    assert "Today Date: 01 Jan 2025\n\n<|eot_id|>" in dated
    with_tools = ours("meta-llama-Llama-3.1-8B-Instruct", "system_multi_turn", tools=TOOLS)
    assert "Environment: ipython\n" in with_tools and '"name": "get_weather"' in with_tools


def test_llama32_today_date_comes_from_strftime_now():
    from datetime import datetime
    text = ours("meta-llama-Llama-3.2-3B-Instruct", "one_user")
    assert f"Today Date: {datetime.now().strftime('%d %b %Y')}\n\n" in text


def test_qwen3_thinking_switch_and_think_history():
    off = ours("Qwen-Qwen3-0.6B", "one_user", enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    on = ours("Qwen-Qwen3-0.6B", "one_user", enable_thinking=True)
    assert on.endswith("<|im_start|>assistant\n") and "<think>" not in on
    assert ours("Qwen-Qwen3-0.6B", "one_user") == on
    history = ours("Qwen-Qwen3-0.6B", "think_in_history")
    # the reasoning of a turn before the last user query is dropped
    assert "<|im_start|>assistant\n4<|im_end|>\n" in history and "Two and two" not in history
    last = ours("Qwen-Qwen3-0.6B", CONVERSATIONS["think_in_history"][:3], add_generation_prompt=False)
    assert last.endswith("<|im_start|>assistant\n<think>\nTwo and two make four.\n</think>\n\n4<|im_end|>\n")
    # 'reasoning' (OpenAI-style field name) reaches the template as reasoning_content
    reasoning = ours("Qwen-Qwen3-0.6B", "reasoning_field", add_generation_prompt=False)
    assert reasoning.endswith("<|im_start|>assistant\n<think>\nThree and three.\n</think>\n\n6<|im_end|>\n")


def test_qwen25_chatml_default_system_and_tools():
    text = ours("Qwen-Qwen2.5-7B-Instruct", "one_user")
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert text.endswith("<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n")
    tools = ours("Qwen-Qwen2.5-7B-Instruct", "tool_round_trip", tools=TOOLS)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in tools
    assert "<tool_response>\n{\"temp_c\": 21}\n</tool_response>" in tools


def test_phi_turns():
    assert ours("microsoft-Phi-3.5-mini-instruct", "system_multi_turn", add_generation_prompt=False) == (
        "<|system|>\nYou are a terse assistant.<|end|>\n<|user|>\nHi!<|end|>\n<|assistant|>\nHello.<|end|>\n"
        "<|user|>\nWhat is 2+2?<|end|>\n<|endoftext|>")
    assert ours("microsoft-Phi-4-mini-instruct", "one_user") == "<|user|>Hello!<|end|><|assistant|>"
    assert ours("microsoft-Phi-3-mini-4k-instruct", "one_user") == "<s><|user|>\nHello!<|end|>\n<|assistant|>\n"


def test_gemma_system_folding_and_role_alternation():
    text = ours("google-gemma-3n-E4B-it", "system_multi_turn")
    assert text.startswith("<bos><start_of_turn>user\nYou are a terse assistant.\n\nHi!<end_of_turn>\n"
                           "<start_of_turn>model\nHello.<end_of_turn>\n")
    for name in ("google-gemma-2-2b-it", "google-gemma-3n-E4B-it"):
        with pytest.raises(ConfigError, match="Conversation roles must alternate"):
            render_chat(load(name), CONVERSATIONS["bad_alternation"], bos_token="<bos>")
    with pytest.raises(ConfigError, match="System role not supported"):
        render_chat(load("google-gemma-2-2b-it"), CONVERSATIONS["system_multi_turn"], bos_token="<bos>")


def test_gemma3_content_parts():
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " Describe it. "}]}]
    text = ours("google-gemma-3n-E4B-it", messages)
    assert text == "<bos><start_of_turn>user\n<image_soft_token>Describe it.<end_of_turn>\n<start_of_turn>model\n"


def test_smollm3_reasoning_flags():
    think = ours("HuggingFaceTB-SmolLM3-3B", "one_user")
    assert "Reasoning Mode: /think\n" in think and think.endswith("<|im_start|>assistant\n")
    no_think = ours("HuggingFaceTB-SmolLM3-3B", "one_user", enable_thinking=False)
    assert "Reasoning Mode: /no_think\n" in no_think
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n")
    flagged = ours("HuggingFaceTB-SmolLM3-3B", "system_only_then_assistant", add_generation_prompt=False)
    assert "Reasoning Mode: /no_think\n" in flagged and "Be brief\n\n" in flagged
    assert flagged.endswith("<|im_start|>assistant\n<think>\n\n</think>\nHey<|im_end|>\n")


# ------------------------------------------------------------------ the environment's edges

def test_generation_block_and_dict_global():
    template = ("{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
                "{% set d = dict(a=1) %}{{ d | tojson }}{{ dict.fromkeys(['x']) | tojson }}")
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(template, messages) == '[hi]{"a": 1}{"x": null}'


def test_tools_and_documents_are_defined_as_none():
    template = ("{{ tools is defined }} {{ tools is none }} {{ documents is defined }} "
                "{{ (messages[0]['content'] is defined) }}")
    messages = [{"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}]
    assert render_chat(template, messages) == "True True True False"
    hf = oracle("<s>", "</s>").apply_chat_template(messages, chat_template=template, tokenize=False)
    assert hf == "True True True False"


def test_reasoning_aliases():
    template = "{% for m in messages %}{{ m | tojson }}{% endfor %}"
    messages = [{"role": "assistant", "content": "x", "reasoning": "r"}]
    text = render_chat(template, messages)
    assert json.loads(text) == {"thinking": "r", "role": "assistant", "content": "x", "reasoning": "r",
                                "reasoning_content": "r"}
    assert text == oracle("<s>", "</s>").apply_chat_template(messages, chat_template=template, tokenize=False)


def test_empty_conversation_and_bad_parts_are_refused():
    with pytest.raises(ConfigError, match="empty conversation"):
        render_chat(load("Qwen-Qwen3-0.6B"), [])
    with pytest.raises(ConfigError, match="content part"):
        validate_messages([{"role": "user", "content": ["just text"]}])


def test_check_template_kwargs():
    assert check_template_kwargs(None) == {}
    assert check_template_kwargs({"enable_thinking": False, "tools": TOOLS}) == {"enable_thinking": False,
                                                                                "tools": TOOLS}
    for bad, match in (([1], "must be a dict"), ({1: True}, "keys must be"), ({"messages": []}, "cannot set"),
                       ({"add_generation_prompt": False}, "cannot set"), ({"x": object()}, "cannot be passed")):
        with pytest.raises(ConfigError, match=match):
            check_template_kwargs(bad)


def test_float_literal_past_float_range_is_a_config_error():
    """Jinja writes a float literal past 1e308 into its generated code as `inf`, a NameError when the
    template runs (found by the atheris chat_template target; the input is in its corpus)."""
    with pytest.raises(ConfigError, match="NameError"):
        render_chat("{{ rang74(7e09999) }}", [{"role": "user", "content": "hi"}], bos_token="<s>", eos_token="</s>")
