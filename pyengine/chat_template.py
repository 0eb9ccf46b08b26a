"""Chat prompts: a model's Jinja chat template rendered in a sandbox, as transformers renders it.

A chat template comes from the model file, so it is untrusted input. It runs in Jinja's
ImmutableSandboxedEnvironment; on top of that, a template that names an underscore attribute
(`''.__class__`, `cycler.__init__.__globals__`, `x['__dict__']`) is refused before it runs, and
any unsafe access the sandbox catches while rendering is an error, never a silent empty string.
Every failure is a ConfigError that says what went wrong.

The environment matches transformers' apply_chat_template: trim_blocks and lstrip_blocks, the
loopcontrols extension, `raise_exception` and `strftime_now` globals, a `tojson` filter that does
not HTML-escape, so a model's template renders the same text here and there.

A model without a template gets a fallback (`fallback_template`): Gemma's turn format when the
vocabulary has <start_of_turn>, ChatML otherwise.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ringllm.runtime.errors import ConfigError

__all__ = ["render_chat", "fallback_template", "validate_messages", "CHATML_TEMPLATE",
           "GEMMA_TEMPLATE"]

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
    """Check a conversation: a list of dicts, each with a non-empty string 'role' and a string
    'content' (None is allowed for an assistant message that carries 'tool_calls'). Returns a
    copy made of plain JSON values, which is what the template sees."""
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
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise ConfigError(f"messages[{i}] (role {role!r}): 'content' must be a string, "
                              f"got {type(content).__name__}")
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


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but an unsafe attribute is an error at once instead of an
    Undefined that renders as ''."""

    def unsafe_undefined(self, obj: Any, attribute: str):
        raise SecurityError(f"access to attribute {attribute!r} of a "
                            f"{type(obj).__name__!r} object is unsafe")


class _Namespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore names, as transformers' does."""

    def __init__(*args: Any, **kwargs: Any):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace attribute may not start with '_' ({name!r})")


class _TemplateRaised(TemplateError):
    """raise_exception() called by the template itself."""


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _environment() -> _StrictSandbox:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


def _unsafe_names(tree: jinja2.nodes.Node) -> list[str]:
    """Underscore attribute names the template spells out (x.__class__, x['_y'], x|attr('_z'))."""
    found = []
    for node in tree.find_all((jinja2.nodes.Getattr, jinja2.nodes.Getitem, jinja2.nodes.Filter)):
        if isinstance(node, jinja2.nodes.Getattr):
            name = node.attr
        elif isinstance(node, jinja2.nodes.Getitem):
            name = node.arg.value if isinstance(node.arg, jinja2.nodes.Const) else None
        else:
            name = None
            if node.name == "attr" and node.args and isinstance(node.args[0], jinja2.nodes.Const):
                name = node.args[0].value
        if isinstance(name, str) and name.startswith("_"):
            found.append(name)
    return found


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = _environment()
    try:
        tree = env.parse(template)
    except TemplateSyntaxError as exc:
        raise ConfigError(f"chat template is not valid Jinja (line {exc.lineno}): {exc.message}") from None
    unsafe = _unsafe_names(tree)
    if unsafe:
        raise ConfigError("chat template is unsafe and was not run: it reaches for the internal "
                          f"attribute(s) {', '.join(sorted(set(unsafe)))}")
    return env.from_string(tree)


def render_chat(template: str | None, messages: list[dict], add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", *, tokenizer: Any = None,
                **extra: Any) -> str:
    """Render `messages` with a chat template; None takes `fallback_template(tokenizer)` (ChatML
    when no tokenizer is given).

    extra: more variables for the template (tools, documents, enable_thinking, ...), plain
    JSON-like values only. Errors are ConfigError: bad messages, invalid or unsafe template,
    a template that raises (raise_exception) or fails while rendering.
    """
    if template is None:
        template = fallback_template(tokenizer)
    if not isinstance(template, str):
        raise ConfigError(f"chat template must be a string, got {type(template).__name__}")
    if not isinstance(bos_token, str) or not isinstance(eos_token, str):
        raise ConfigError("bos_token and eos_token must be strings")
    plain_messages = validate_messages(messages)
    variables = {k: _plain(v, k) for k, v in extra.items()}
    compiled = _compile(template)
    try:
        return compiled.render(messages=plain_messages, add_generation_prompt=bool(add_generation_prompt),
                               bos_token=bos_token, eos_token=eos_token, **variables)
    except SecurityError as exc:
        raise ConfigError(f"chat template is unsafe and was stopped: {exc}") from None
    except _TemplateRaised as exc:
        raise ConfigError(f"chat template rejected the conversation: {exc}") from None
    except TemplateError as exc:
        raise ConfigError(f"chat template failed: {exc}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError,
            OverflowError, RecursionError) as exc:
        raise ConfigError(f"chat template failed: {type(exc).__name__}: {exc}") from None
