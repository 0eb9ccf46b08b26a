"""Tool calling: tools rendered by the model's own chat template, calls constrained and parsed.

    plan = ToolPlan.build(llm, messages, tools, tool_choice="auto", parallel_tool_calls=True)
    plan.template_kwargs        # {"tools": tools}: what the chat template renders into the prompt
    plan.grammar                # the Grammar that constrains the answer (None: free text)
    parser = plan.parser()      # ToolCallParser: text pieces in, content / call deltas out
    content, calls = plan.parse(text)      # OpenAI tool_calls: [{"id", "type", "function": {"name", "arguments"}}]

Tools are OpenAI's: [{"type": "function", "function": {"name", "description", "parameters"}}].
The template gets them as its `tools` variable (as transformers' apply_chat_template gives them),
so the prompt is what the model was trained on. A template that renders nothing for them (Gemma,
SmolLM2, Phi-4-mini's system-message tools) is refused with a ConfigError, as is one that renders
them but whose call syntax ringllm does not know.

Call syntaxes (`tool_syntax_of(template)` finds the one a template teaches):

    hermes        <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>, one or several
                  (Qwen2.5, Qwen3, SmolLM3, Hermes)
    llama3_json   the whole answer is {"name": "f", "parameters": {...}}, one call (Llama 3.1 / 3.2)

tool_choice:

    "none"        the template is not given the tools; the answer is free text, not parsed for calls
    "auto"        free text, or calls; once the model starts a call (writes `<tool_call>`, or `{` as
                  the first character for llama3_json) the call's name is one of the tools and its
                  arguments follow that tool's JSON Schema (llguidance lazy grammar)
    "required"    the answer is one or more calls (one when parallel_tool_calls is False), nothing else
    {"type": "function", "function": {"name": N}}    exactly one call of N

Arguments follow the tool's `parameters` schema as JSON Schema reads it (an object with no
`additionalProperties` may carry more keys than it lists). A call's "arguments" is the JSON text
the model wrote, so streamed pieces add up to it exactly.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ringllm.constraints import JSON_STYLE, Grammar, lark_grammar
from ringllm.runtime.errors import ConfigError

__all__ = ["ToolPlan", "ToolSyntax", "ToolCallParser", "check_tools", "check_tool_choice", "tool_syntax_of",
           "TOOL_SYNTAXES"]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


# ------------------------------------------------------------------------------------------------
# Checking what the caller passes
# ------------------------------------------------------------------------------------------------

def check_tools(tools: Any) -> list[dict]:
    """OpenAI's tools list, checked: each {"type": "function", "function": {"name", ["description"],
    ["parameters"], ["strict"]}} with a unique name of letters, digits, _ and - (<= 64) and
    parameters a JSON Schema object (default: any object). Returns plain copies."""
    if not isinstance(tools, (list, tuple)) or not tools:
        raise ConfigError("tools must be a non-empty list of {'type': 'function', 'function': {...}}")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ConfigError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                              "'parameters': {...}}}} (only function tools are supported)")
        extra = sorted(set(tool) - {"type", "function"})
        if extra:
            raise ConfigError(f"tools[{i}] has unknown keys {extra}")
        fn = tool["function"]
        unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise ConfigError(f"tools[{i}].function has unknown keys {unknown}; valid: name, description, "
                              "parameters, strict")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
        if name in seen:
            raise ConfigError(f"tools[{i}]: the name {name!r} is used twice")
        seen.add(name)
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise ConfigError(f"tools[{i}].function.parameters must be a JSON Schema object, got "
                              f"{type(params).__name__}")
        if "description" in fn and not isinstance(fn["description"], str):
            raise ConfigError(f"tools[{i}].function.description must be a string")
        out.append({"type": "function", "function": json.loads(json.dumps(fn))})
    return out


def check_tool_choice(choice: Any, tools: list[dict]) -> tuple[str, str | None]:
    """(mode, forced name): mode "none" | "auto" | "required" | "named" (name set). None is "auto"."""
    if choice is None or choice == "auto":
        return "auto", None
    if choice in ("none", "required"):
        return choice, None
    if isinstance(choice, dict) and choice.get("type", "function") == "function" \
            and isinstance(choice.get("function"), dict) and set(choice) <= {"type", "function"}:
        name = choice["function"].get("name")
        names = [t["function"]["name"] for t in tools]
        if name not in names:
            raise ConfigError(f"tool_choice names {name!r}, which is not among the tools {names}")
        return "named", name
    raise ConfigError(f"tool_choice must be 'auto', 'none', 'required' or {{'type': 'function', 'function': "
                      f"{{'name': ...}}}}, got {choice!r}")


# ------------------------------------------------------------------------------------------------
# Call syntaxes
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolSyntax:
    """How a model family writes a call. opener: the text that starts a call ("" when the call is
    the whole answer, opened by its "{"); closer: the text after the call's JSON; args_key: the
    key of the arguments in that JSON; several: whether one answer may hold several calls."""

    name: str
    opener: str
    closer: str
    args_key: str
    several: bool

    def grammar_text(self, tools: list[dict], names: list[str], forced: bool, several: bool,
                     special: frozenset[str] = frozenset()) -> str:
        """The Lark grammar (llguidance's dialect) of an answer: calls of `names` only, their
        arguments under each tool's schema; forced: calls only, else free text or calls (lazy:
        constrained once the opener appears). special: which of the opener and the closer's tag
        are one special token of the vocabulary (written <tag> in the grammar, not as text)."""
        schemas = []
        for t in tools:
            fn = t["function"]
            if fn["name"] in names:
                schemas.append({"type": "object", "properties": {
                    "name": {"const": fn["name"]}, self.args_key: fn.get("parameters", {"type": "object"})},
                    "required": ["name", self.args_key], "additionalProperties": False})
        body = json.dumps({"anyOf": schemas, "x-guidance": JSON_STYLE})
        lines = ["%llguidance {}", f"body: %json {body}", r"SEP: /[ \t\r\n]+/", r"TEXT: /(.|\n)*/"]
        if not self.opener:                       # the answer is one JSON call, or text not starting with {
            lines.append("start: body" if forced else "start: FREE | body")
            lines.append(r"FREE: /[^{](.|\n)*/")
            return "\n".join(lines) + "\n"

        def lit(text: str) -> str:
            return f"<{text[1:-1]}>" if text in special else json.dumps(text)

        tag = self.closer.strip()
        close = f"{json.dumps(self.closer[:self.closer.index(tag)])} {lit(tag)}"
        lines.append(f"call: {lit(self.opener)} \"\\n\" body {close}")
        more = " (SEP call)*" if several else ""
        if forced:
            lines.append(f"start: call{more}")
        elif self.opener in special:              # TEXT cannot hold a special token: no ambiguity
            lines.append(f"start: TEXT | TEXT? call{more}")
        else:                                     # the lazy head ends at the first opener
            lines.append(f"start: TEXT | first{more}")
            lines.append(f"first: head \"\\n\" body {close}")
            lines.append(f"head[lazy]: TEXT {json.dumps(self.opener)}")
        return "\n".join(lines) + "\n"


TOOL_SYNTAXES = {
    "hermes": ToolSyntax("hermes", "<tool_call>", "\n</tool_call>", "arguments", True),
    "llama3_json": ToolSyntax("llama3_json", "", "", "parameters", False),
}


def tool_syntax_of(template: str | None) -> ToolSyntax | None:
    """The call syntax a chat template teaches its model (None: none ringllm knows)."""
    if not template:
        return None
    if "<tool_call>" in template:
        return TOOL_SYNTAXES["hermes"]
    if '"parameters": ' in template and ("ipython" in template or "<|python_tag|>" in template):
        return TOOL_SYNTAXES["llama3_json"]
    return None


# ------------------------------------------------------------------------------------------------
# Parsing calls out of the answer (streamed or whole)
# ------------------------------------------------------------------------------------------------

def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser:
    """Splits an answer, fed as text pieces, into content and calls, as OpenAI's stream deltas.

    feed(text) and finish() return events:
        ("content", text)                       text outside calls (leading/trailing whitespace
                                                and whitespace between calls are left out)
        ("call", index, id, name)               a call starts
        ("arguments", index, piece)             a piece of its arguments JSON text
    .calls lists the calls so far as OpenAI tool_calls; .content the content so far (None if none).
    A call cut before its arguments end (max_tokens) is content, not a call."""

    _HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*')

    def __init__(self, syntax: ToolSyntax):
        self.syntax = syntax
        self.calls: list[dict] = []
        self._content: list[str] = []
        self._buf = ""                     # text not yet consumed by the current mode
        self._mode = "text" if syntax.opener else "start"
        self._held_ws = ""                 # whitespace kept back in text mode
        self._raw_call = ""                # the current call's text, for the cut-call case
        self._depth, self._in_str, self._esc = 0, False, False

    @property
    def content(self) -> str | None:
        text = "".join(self._content)
        return text or None

    # -- text outside calls: the content is the text between calls, joined and stripped
    def _emit_text(self, text: str, out: list) -> None:
        if not self._content:
            text = text.lstrip()
        stripped = text.rstrip()
        if stripped:
            body = self._held_ws + stripped
            self._held_ws = text[len(stripped):]
            self._content.append(body)
            out.append(("content", body))
        else:
            self._held_ws += text

    def feed(self, text: str) -> list[tuple]:
        out: list[tuple] = []
        self._buf += text
        progress = True
        while progress and self._buf:
            progress = getattr(self, f"_step_{self._mode}")(out)
        return out

    def _step_start(self, out) -> bool:          # llama3_json: a call iff the answer starts with "{"
        s = self._buf.lstrip()
        if not s:
            return False
        self._mode = "head" if s[0] == "{" else "plain"
        return True

    def _step_plain(self, out) -> bool:
        self._emit_text(self._buf, out)
        self._buf = ""
        return False

    def _step_text(self, out) -> bool:
        opener = self.syntax.opener
        i = self._buf.find(opener)
        if i >= 0:
            self._emit_text(self._buf[:i], out)
            self._raw_call = opener
            self._buf = self._buf[i + len(opener):]
            self._mode = "head"
            return True
        hold = 0                                  # a tail that may still become the opener
        for n in range(min(len(opener) - 1, len(self._buf)), 0, -1):
            if self._buf.endswith(opener[:n]):
                hold = n
                break
        self._emit_text(self._buf[:len(self._buf) - hold], out)
        self._buf = self._buf[len(self._buf) - hold:]
        return False

    def _step_head(self, out) -> bool:
        m = self._HEAD.match(self._buf)
        if m is None or m.end() == len(self._buf):      # wait for the first character of the arguments
            return False
        index = len(self.calls)
        self.calls.append({"id": new_call_id(), "type": "function",
                           "function": {"name": m.group(1), "arguments": ""}})
        out.append(("call", index, self.calls[-1]["id"], m.group(1)))
        self._raw_call += self._buf[:m.end()]
        self._buf = self._buf[m.end():]
        self._depth, self._in_str, self._esc = 0, False, False
        self._mode = "args"
        return True

    def _step_args(self, out) -> bool:
        end = None
        for i, ch in enumerate(self._buf):
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
            elif ch == '"':
                self._in_str = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
            if self._depth == 0 and not self._in_str and ch in "}]":
                end = i + 1
                break
        piece = self._buf if end is None else self._buf[:end]
        if piece:
            call = self.calls[-1]["function"]
            call["arguments"] += piece
            out.append(("arguments", len(self.calls) - 1, piece))
            self._raw_call += piece
        self._buf = "" if end is None else self._buf[end:]
        if end is not None:
            self._mode = "tail"
        return end is not None

    def _step_tail(self, out) -> bool:          # the call's closing "}" and closer
        end_mark = self.syntax.closer.strip() or "}"
        i = self._buf.find(end_mark)
        if i < 0:
            return False
        self._buf = self._buf[i + len(end_mark):]
        self._raw_call = ""
        self._mode = "text" if self.syntax.opener else "plain"
        return True

    def finish(self) -> list[tuple]:
        """Events of whatever is still held; a call cut short becomes content."""
        out: list[tuple] = []
        if self._mode in ("head", "args"):
            if self._mode == "args":              # its arguments never ended: not a call
                self.calls.pop()
            self._emit_text(self._raw_call + self._buf, out)
        elif self._mode in ("text", "plain", "start"):
            self._emit_text(self._buf, out)
        self._buf = ""
        return out


# ------------------------------------------------------------------------------------------------
# A tool request, planned
# ------------------------------------------------------------------------------------------------

class ToolPlan:
    """What one chat request with tools needs: the template variables, the grammar and the parser.
    Build with ToolPlan.build (every check happens there, before anything is generated)."""

    def __init__(self, tools: list[dict], mode: str, name: str | None, syntax: ToolSyntax | None,
                 grammar: Grammar | None, parallel: bool):
        self.tools, self.mode, self.name, self.syntax = tools, mode, name, syntax
        self.grammar, self.parallel = grammar, parallel

    @property
    def template_kwargs(self) -> dict:
        return {} if self.mode == "none" else {"tools": self.tools}

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none"

    @classmethod
    def build(cls, llm, messages: list[dict], tools: Any, tool_choice: Any = None,
              parallel_tool_calls: bool = True, template_kwargs: dict | None = None) -> "ToolPlan":
        """Check tools and tool_choice against llm's chat template; compile the call grammar.
        ConfigError when the template has no tool syntax (it renders nothing for the tools) or one
        ringllm does not know."""
        tools = check_tools(tools)
        mode, name = check_tool_choice(tool_choice, tools)
        if not isinstance(parallel_tool_calls, bool):
            raise ConfigError(f"parallel_tool_calls must be a bool, got {parallel_tool_calls!r}")
        if mode == "none":
            return cls(tools, mode, None, None, None, parallel_tool_calls)
        extra = dict(template_kwargs or {})
        extra.pop("tools", None)
        with_tools = llm.render_chat(messages, add_generation_prompt=True, tools=tools, **extra)
        without = llm.render_chat(messages, add_generation_prompt=True, **extra)
        if with_tools == without:
            raise ConfigError(f"the chat template of {llm.model_name} has no tool syntax (it renders nothing for "
                              "the tools); give the LLM a template that does (LLM(chat_template=...), ringllm "
                              "--chat-template) or call without tools")
        syntax = tool_syntax_of(llm.chat_template)
        if syntax is None:
            raise ConfigError(f"the chat template of {llm.model_name} renders tools, but ringllm does not know how "
                              "its model writes a call (known: Hermes/Qwen <tool_call>, Llama 3 JSON)")
        names = [name] if mode == "named" else [t["function"]["name"] for t in tools]
        several = syntax.several and parallel_tool_calls and mode != "named"
        tok = llm.tokenizer
        special = frozenset(t for t in (syntax.opener, syntax.closer.strip())
                            if t and tok.token_to_id(t) in tok.special_ids)
        text = syntax.grammar_text(tools, names, forced=mode in ("required", "named"), several=several,
                                   special=special)
        grammar = lark_grammar(llm.tokenizer, text, kind="tool_calls")
        return cls(tools, mode, name, syntax, grammar, parallel_tool_calls)

    def parser(self) -> ToolCallParser | None:
        return ToolCallParser(self.syntax) if self.parses_calls else None

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a whole answer."""
        p = self.parser()
        if p is None:
            return text, []
        p.feed(text)
        p.finish()
        return p.content, p.calls
