"""The sandbox chat templates run in (chat_template.py): Jinja's ImmutableSandboxedEnvironment made
strict, with bounds on what a template may compute and a time bound on compiling and rendering.

A module of its own so that Jinja is imported on the first render, not by every process that
imports the runtime (ringllm.llm): a `generate` without --chat never needs it.
"""
from __future__ import annotations

import ctypes
import functools
import json
import re
import threading
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ringllm.runtime.errors import ConfigError

__all__ = ["render_sandboxed", "MAX_NUMBER_ARG", "MAX_VALUE_LEN", "MAX_INT_BITS", "RENDER_SECONDS",
           "MAX_OUTPUT_CHARS"]

# ---------------------------------------------------------------------------------------------
# Bounds on what a template may compute (a model file is untrusted input)
# ---------------------------------------------------------------------------------------------

MAX_NUMBER_ARG = 100_000         # largest integer a template may pass to a call, filter or % format
MAX_VALUE_LEN = 16_000_000       # longest string or list a template may build with * + ~ or pass on
MAX_INT_BITS = 4096              # largest integer a template may compute with * and **
RENDER_SECONDS = 2.0             # a render (compile included) that runs longer is stopped
MAX_OUTPUT_CHARS = 1_000_000     # plus twice the conversation's own length: the longest rendering
_WIDE_FORMAT = re.compile(r"\d{6,}")   # a width or precision of 100000 or more in a format string


def _check_value(value: Any, what: str) -> None:
    """SecurityError when `value` is an integer or a sequence past the bounds above."""
    if isinstance(value, bool):
        return
    if isinstance(value, int) and abs(value) > MAX_NUMBER_ARG:
        raise SecurityError(f"{what}: the number {value if value.bit_length() < 64 else 'given'} is larger "
                            f"than a chat template may use ({MAX_NUMBER_ARG})")
    if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_VALUE_LEN:
        raise SecurityError(f"{what}: a value of {len(value)} items is longer than a chat template may "
                            f"build ({MAX_VALUE_LEN})")


def _check_expansion(obj: Any, name: str, args: tuple) -> None:
    """SecurityError when a str method or filter that grows its input (replace, join, expandtabs)
    would build more than MAX_VALUE_LEN characters; the result's length is computed, not guessed."""
    if name == "replace" and isinstance(obj, str) and len(args) >= 2 and \
            isinstance(args[0], str) and isinstance(args[1], str):
        count = obj.count(args[0]) if args[0] else len(obj) + 1
        grown = len(obj) + count * (len(args[1]) - len(args[0]))
    elif name == "join" and isinstance(obj, str) and args and _size(args[0]) is not None:
        grown = len(obj) * len(args[0])
    elif name == "join" and args and isinstance(args[0], str) and hasattr(obj, "__len__"):
        grown = len(args[0]) * len(obj)                    # the filter: seq|join(sep)
    elif name == "expandtabs" and isinstance(obj, str):
        grown = len(obj) + obj.count("\t") * (int(args[0]) if args and isinstance(args[0], int) else 8)
    else:
        return
    if grown > MAX_VALUE_LEN:
        raise SecurityError(f"{name} would build {grown} characters, more than a chat template may "
                            f"build ({MAX_VALUE_LEN})")


def _check_format(fmt: str) -> None:
    if _WIDE_FORMAT.search(fmt):
        raise SecurityError("a format string with a width or precision of 100000 or more")


def _size(value: Any) -> int | None:
    return len(value) if isinstance(value, (str, list, tuple)) else None


class _BoundedConcat(CodeGenerator):
    """Jinja's code generator, with `a ~ b` compiled to environment.bounded_join instead of Jinja's
    str_join, which no sandbox hook sees: a template doubling a string with `~` (through str() of a
    namespace that holds it) reached 1.7 GB before the time bound stopped it."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:      # not the sandbox's settings
            return super().visit_Concat(node, frame)
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but an unsafe attribute is an error at once instead of an
    Undefined that renders as ''; and bounded: no call, filter, operator or format may build a
    value past the MAX_* bounds (so no single step allocates gigabytes), while render_chat bounds
    the time and the output of the whole render."""

    intercepted_binops = frozenset(["*", "**", "+", "%", "//"])
    code_generator_class = _BoundedConcat

    @staticmethod
    def bounded_join(parts: tuple) -> str:
        """`a ~ b ~ ...`: the parts as strings, joined; SecurityError past MAX_VALUE_LEN characters,
        checked after each part's conversion (one part's str() is at most a few times the largest
        value a template may hold, so this bounds what a chain of them allocates)."""
        out, total = [], 0
        for part in parts:
            text = str(part)
            total += len(text)
            if total > MAX_VALUE_LEN:
                raise SecurityError(f"a concatenation (~) longer than a chat template may build ({MAX_VALUE_LEN})")
            out.append(text)
        return "".join(out)

    def unsafe_undefined(self, obj: Any, attribute: str):
        raise SecurityError(f"access to attribute {attribute!r} of a "
                            f"{type(obj).__name__!r} object is unsafe")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            _check_value(value, f"call of {getattr(__obj, '__name__', type(__obj).__name__)}()")
        if isinstance(getattr(__obj, "__self__", None), str):
            _check_expansion(__obj.__self__, __obj.__name__, args)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Any:
        wrapper = super().wrap_str_format(value)
        if wrapper is not None:
            _check_format(value.__self__)
        return wrapper

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "**" and ints and right > 0 and abs(left) > 1 and \
                abs(left).bit_length() * right > MAX_INT_BITS:
            raise SecurityError(f"{left} ** {right} is larger than a chat template may compute")
        if operator == "*":
            if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise SecurityError("a product larger than a chat template may compute")
            for seq, n in ((left, right), (right, left)):
                if _size(seq) is not None and isinstance(n, int) and _size(seq) * n > MAX_VALUE_LEN:
                    raise SecurityError(f"a repetition of {_size(seq)} items {n} times is longer than a "
                                        f"chat template may build ({MAX_VALUE_LEN})")
        if operator == "+" and _size(left) is not None and _size(right) is not None and \
                _size(left) + _size(right) > MAX_VALUE_LEN:
            raise SecurityError(f"a concatenation longer than a chat template may build ({MAX_VALUE_LEN})")
        if operator == "%" and isinstance(left, str):
            _check_format(left)
            for arg in right if isinstance(right, (tuple, list)) else (right,):
                _check_value(arg, "% format")
        return super().call_binop(context, operator, left, right)


def _bounded_filter(name: str, fn: Any) -> Any:
    """`fn` (a Jinja filter) refusing number and sequence arguments past the bounds (`center(10**9)`),
    and for `format`, wide format strings. Compiled templates call filters directly, not through
    the environment, so the bound lives in the filter itself."""

    @functools.wraps(fn)      # keeps jinja_pass_arg: pass_context / pass_eval_context filters still get it
    def bounded(*args: Any, **kwargs: Any) -> Any:
        first = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0   # the context / eval context
        value, rest = (args[first], args[first + 1:]) if len(args) > first else (None, ())
        for arg in (*rest, *kwargs.values()):
            _check_value(arg, f"filter {name}")
        if name in ("replace", "join"):
            _check_expansion(value, name, rest)
        if name == "format" and isinstance(value, str):
            _check_format(value)
        return fn(*args, **kwargs)

    return bounded


class _RenderTimeout(BaseException):
    """Raised inside a render that ran past RENDER_SECONDS (a BaseException: no except Exception
    in Jinja's runtime may swallow it)."""


def _time_bounded(fn: Any, *args: Any) -> Any:
    """fn(*args), stopped with _RenderTimeout when it runs longer than RENDER_SECONDS.

    A timer thread raises the exception asynchronously in this thread
    (PyThreadState_SetAsyncExc), so a runaway loop of template bytecode stops wherever it is; it
    works in any thread (a server worker too), unlike SIGALRM. The lock and the `done` flag make
    sure the exception is never delivered after fn has returned."""
    tid = threading.get_ident()
    lock, state = threading.Lock(), {"done": False, "fired": False}

    def fire() -> None:
        with lock:
            if not state["done"]:
                state["fired"] = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(_RenderTimeout))

    timer = threading.Timer(RENDER_SECONDS, fire)
    timer.daemon = True
    timer.start()
    try:
        return fn(*args)
    finally:
        with lock:
            state["done"] = True
        timer.cancel()
        if state["fired"]:      # clear an exception not yet delivered
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)


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
        _check_value(value, f"namespace attribute {name!r}")
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace attribute may not start with '_' ({name!r})")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers uses it to find the assistant's text
    for a training mask. Rendering a prompt needs only its body, unchanged; without the tag a
    template that uses it (SmolLM3's) would not even parse."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


class _TemplateDict:
    """The `dict` global: dict(a=1) and dict.fromkeys(keys), nothing else of the type (transformers'
    TemplateDict, so `dict.__class__` and friends are not reachable)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


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
                         extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters.update({name: _bounded_filter(name, fn) for name, fn in env.filters.items()})
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _TemplateDict()
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
        tree = _time_bounded(env.parse, template)
    except TemplateSyntaxError as exc:
        raise ConfigError(f"chat template is not valid Jinja (line {exc.lineno}): {exc.message}") from None
    except (RecursionError, MemoryError) as exc:
        raise ConfigError(f"chat template is too deeply nested to compile ({type(exc).__name__})") from None
    except _RenderTimeout:
        raise ConfigError(f"chat template took over {RENDER_SECONDS} s to parse") from None
    unsafe = _unsafe_names(tree)
    if unsafe:
        raise ConfigError("chat template is unsafe and was not run: it reaches for the internal "
                          f"attribute(s) {', '.join(sorted(set(unsafe)))}")
    try:
        return _time_bounded(env.from_string, tree)
    except TemplateError as exc:
        raise ConfigError(f"chat template does not compile: {exc}") from None
    except (RecursionError, MemoryError, SyntaxError, ValueError, TypeError, OverflowError) as exc:
        raise ConfigError(f"chat template does not compile ({type(exc).__name__}: {exc})") from None
    except _RenderTimeout:
        raise ConfigError(f"chat template took over {RENDER_SECONDS} s to compile") from None


def _render_bounded(compiled: jinja2.Template, max_chars: int, variables: dict) -> str:
    """The template's output, streamed and cut off with a SecurityError past max_chars."""
    out, n = [], 0
    for chunk in compiled.generate(**variables):
        n += len(chunk)
        if n > max_chars:
            raise SecurityError(f"the rendering grew past {max_chars} characters")
        out.append(chunk)
    return "".join(out)



def render_sandboxed(template: str, variables: dict, messages: list[dict], add_generation_prompt: bool,
                     bos_token: str, eos_token: str) -> str:
    """`template` compiled (cached) and rendered in the sandbox with `variables` (plain values,
    chat_template._plain) and the conversation's own variables; every failure a ConfigError
    (chat_template.render_chat says which)."""
    compiled = _compile(template)
    variables.update(messages=messages, add_generation_prompt=bool(add_generation_prompt),
                     bos_token=bos_token, eos_token=eos_token)
    max_chars = MAX_OUTPUT_CHARS + 2 * len(json.dumps(variables, default=str))
    try:
        return _time_bounded(_render_bounded, compiled, max_chars, variables)
    except _RenderTimeout:
        raise ConfigError(f"chat template ran longer than {RENDER_SECONDS} s and was stopped") from None
    except MemoryError:
        raise ConfigError("chat template ran out of memory and was stopped") from None
    except SecurityError as exc:
        raise ConfigError(f"chat template is unsafe and was stopped: {exc}") from None
    except _TemplateRaised as exc:
        raise ConfigError(f"chat template rejected the conversation: {exc}") from None
    except TemplateError as exc:
        raise ConfigError(f"chat template failed: {exc}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError,
            OverflowError, RecursionError, NameError) as exc:     # NameError: Jinja writes a float literal
        raise ConfigError(f"chat template failed: {type(exc).__name__}: {exc}") from None   # past 1e308 as `inf`
