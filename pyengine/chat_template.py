"""Chat prompts: a model's Jinja chat template rendered in a sandbox, as transformers renders it.

A chat template comes from the model file, so it is untrusted input. It runs in Jinja's
ImmutableSandboxedEnvironment; on top of that, a template that names an underscore attribute
(`''.__class__`, `cycler.__init__.__globals__`, `x['__dict__']`) is refused before it runs, and
any unsafe access the sandbox catches while rendering is an error, never a silent empty string.
Every failure is a ConfigError that says what went wrong.

The environment and the variables match transformers' apply_chat_template, so a model's template
renders the same text here and there (tests/test_chat_templates.py holds real templates of the
common families to that): trim_blocks and lstrip_blocks, the loopcontrols extension, the
`{% generation %}` block (it marks assistant text for training masks; here it renders its body),
`raise_exception`, `strftime_now`, `namespace` and `dict` globals, a `tojson` filter that does not
HTML-escape. The template sees what transformers shows it: `tools` and `documents` (None when not
given), message keys whose value is None left out (a tool-call turn with content None has no
'content'), and a message's reasoning under the names templates read (`reasoning_content` and
`thinking`, filled from whichever of those or `reasoning` the caller set).

A model without a template gets a fallback (`fallback_template`): Gemma's turn format when the
vocabulary has <start_of_turn>, ChatML otherwise.
"""
from __future__ import annotations

import json
from typing import Any

from ringllm.runtime.errors import ConfigError

__all__ = ["render_chat", "check_template_kwargs", "fallback_template", "validate_messages",
           "CHATML_TEMPLATE", "GEMMA_TEMPLATE"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Gemma's turns. A leading system message goes in front of the first user turn (Gemma has no
# system role); "assistant" is called "model". No BOS is written: encode() adds it by the
# model's rule, so the rendered text must not carry one too.
GEMMA_TEMPLATE = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system_prefix = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set system_prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (system_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def fallback_template(tokenizer: Any = None) -> str:
    """The template for a model that has none: Gemma's format when the tokenizer's vocabulary has
    <start_of_turn>, ChatML otherwise. `tokenizer` is a ringllm Tokenizer (anything with
    `token_to_id`), or None for ChatML."""
    lookup = getattr(tokenizer, "token_to_id", None)
    if lookup is not None and lookup("<start_of_turn>") is not None:
        return GEMMA_TEMPLATE
    return CHATML_TEMPLATE


def validate_messages(messages: Any) -> list[dict]:
    """Check a conversation: a list of dicts, each with a non-empty string 'role' and a 'content'
    that is a string or a list of content parts (dicts with a 'type', as OpenAI's and transformers'
    multimodal messages; the template decides what a part renders as). None is allowed for an
    assistant message that carries 'tool_calls'. Returns a copy made of plain JSON values."""
    if not isinstance(messages, (list, tuple)):
        raise ConfigError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ConfigError(f"messages[{i}] must be a dict with 'role' and 'content', "
                              f"got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ConfigError(f"messages[{i}] has no 'role' string (got {role!r})")
        if "content" not in message:
            raise ConfigError(f"messages[{i}] (role {role!r}) has no 'content'")
        content = message["content"]
        if isinstance(content, (list, tuple)):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise ConfigError(f"messages[{i}] (role {role!r}): content part [{j}] must be a dict "
                                      "with a 'type' string, e.g. {'type': 'text', 'text': ...}")
        elif not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise ConfigError(f"messages[{i}] (role {role!r}): 'content' must be a string or a list of "
                              f"content parts, got {type(content).__name__}")
        out.append(_plain(message, f"messages[{i}]"))
    return out


def _plain(value: Any, where: str) -> Any:
    """A copy of `value` made of dict/list/str/int/float/bool/None only: the template never
    sees a caller's object with methods of its own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{where}: keys must be strings, got {k!r}")
            out[k] = _plain(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ConfigError(f"{where}: a {type(value).__name__} cannot be passed to a chat template "
                      "(only JSON-like values)")


# Names render_chat fills itself; template kwargs may not set them.
_RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tokenizer")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def check_template_kwargs(kwargs: Any) -> dict:
    """Extra template variables from a caller (LLM.chat's chat_template_kwargs, the server's
    request): a dict with string keys, none of them a name render_chat fills itself (messages,
    add_generation_prompt, bos_token, eos_token). Any other name is allowed: a template reads what
    it reads (enable_thinking for Qwen3 and SmolLM3, date_string for Llama 3, ...) and ignores the
    rest, as with transformers. None is an empty dict. Returns a plain copy."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ConfigError(f"chat_template_kwargs must be a dict, got {type(kwargs).__name__}")
    for key in kwargs:
        if not isinstance(key, str) or not key:
            raise ConfigError(f"chat_template_kwargs keys must be non-empty strings, got {key!r}")
        if key in _RESERVED:
            raise ConfigError(f"chat_template_kwargs cannot set {key!r}: the renderer sets it "
                              f"(reserved: {', '.join(_RESERVED)})")
    return {k: _plain(v, f"chat_template_kwargs[{k!r}]") for k, v in kwargs.items()}


def _template_tool_calls(calls: Any) -> Any:
    """A message's tool_calls with each function's "arguments" as an object: OpenAI's messages carry
    it as JSON text, the templates (Qwen, Llama 3) write it with `| tojson`, as transformers expects."""
    if not isinstance(calls, list):
        return calls
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                args = json.loads(fn["arguments"])
            except ValueError as exc:
                raise ConfigError(f"a tool call's arguments are not valid JSON ({exc}): "
                                  f"{fn['arguments'][:80]!r}") from None
            call = {**call, "function": {**fn, "arguments": args}}
        out.append(call)
    return out


def _template_messages(messages: list[dict]) -> list[dict]:
    """Messages as transformers hands them to a template: keys whose value is None dropped, tool
    calls' arguments as objects (`_template_tool_calls`), and the reasoning of a message under
    'thinking' and 'reasoning_content' too (from the first of reasoning_content / thinking /
    reasoning that is set), in transformers' key order."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        if "tool_calls" in message:
            message["tool_calls"] = _template_tool_calls(message["tool_calls"])
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat(template: str | None, messages: list[dict], add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", *, tokenizer: Any = None,
                **extra: Any) -> str:
    """Render `messages` with a chat template; None takes `fallback_template(tokenizer)` (ChatML
    when no tokenizer is given).

    extra: more variables for the template (tools, documents, enable_thinking, ...), plain
    JSON-like values only; `tools` and `documents` are None unless given, as in transformers.
    Errors are ConfigError: bad or empty messages, invalid or unsafe template, a template that
    raises (raise_exception) or fails while rendering, or one past the bounds (chat_sandbox.py:
    RENDER_SECONDS, the output limit, the MAX_* bounds on values it builds).
    """
    if template is None:
        template = fallback_template(tokenizer)
    if not isinstance(template, str):
        raise ConfigError(f"chat template must be a string, got {type(template).__name__}")
    if not isinstance(bos_token, str) or not isinstance(eos_token, str):
        raise ConfigError("bos_token and eos_token must be strings")
    plain_messages = validate_messages(messages)
    if not plain_messages:
        raise ConfigError("cannot render an empty conversation: give at least one message")
    variables = {"tools": None, "documents": None}
    variables.update({k: _plain(v, k) for k, v in extra.items()})
    from ringllm.chat_sandbox import render_sandboxed      # Jinja is imported on the first render
    return render_sandboxed(template, variables, _template_messages(plain_messages), add_generation_prompt,
                            bos_token, eos_token)
