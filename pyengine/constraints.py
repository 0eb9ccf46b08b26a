"""Constrained decoding: JSON Schema, regex and Lark/GBNF grammars, masked token by token by llguidance.

    grammar = compile_grammar(llm.tokenizer, response_format={"type": "json_schema", "json_schema": {"schema": S}})
    constraint = grammar.start()           # one per request: the parser state of one answer
    constraint.mask(logits)                # logits (n_vocab,) float64: tokens the grammar forbids -> -inf
    constraint.accept(token)               # advance the parser by the sampled token
    constraint.done                        # True when nothing but end-of-sequence can follow

What a caller can ask for (`compile_grammar`'s keywords; at most one of them):

    response_format  {"type": "text"} (no constraint), {"type": "json_object"} (any JSON object),
                     {"type": "json_schema", "json_schema": {"name": ..., "schema": S, "strict": ...}}
                     (OpenAI's shape; a json_schema dict without those keys is taken as S itself)
    grammar          Lark text (llguidance's dialect: `start:` rule, `%json {...}` inlined schemas,
                     `<special>` tokens) or GBNF text (llama.cpp's, converted by llguidance), or a
                     Grammar this module already compiled
    regex            a regular expression the whole answer must match (Rust `regex` syntax)

Everything is compiled before a token is generated: a schema, regex or grammar llguidance cannot
compile (unknown type, unsatisfiable bounds, an unsupported keyword, a syntax error) raises
GrammarError, a ConfigError (so a ValueError) whose message names the problem.

JSON is generated compactly in the separators people and models write (`{"a": 1, "b": [2, 3]}`,
no free whitespace): a small model given free whitespace tends to loop on newlines.

End of sequence: the model's end tokens (EOS and end-of-turn, the tokenizer's eos_ids) are allowed
only where the grammar accepts the text so far; `done` turns True once the grammar can take no
further token, so a decoder ends the answer there without spending a step on the end token.

The vocabulary llguidance sees is the model's own: each token's bytes as ringllm's tokenizer
decodes them (Tokenizer.token_bytes) and its encoder (`llg_tokenizer`), built once per tokenizer and cached on it. Token
ids the tokenizer does not cover (a logits row longer than the vocabulary) are always masked.

A Constraint's state is the grammar plus the tokens accepted so far (`state()`), which is how a
chat session saves a constrained answer cut mid-way and `Grammar.restore` replays it.
"""
from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import numpy as np

from ringllm.runtime.errors import ConfigError

__all__ = ["Constraint", "Grammar", "GrammarError", "compile_grammar", "constraint_from_state", "json_schema_of",
           "lark_grammar", "llg_tokenizer", "JSON_STYLE"]

# Compact JSON, with the separators models write (llguidance's JsonCompileOptions)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_LLG_LOCK = threading.Lock()
_LLG_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # Tokenizer -> LLTokenizer


class GrammarError(ConfigError):
    """A response_format, JSON Schema, regex or grammar that cannot be compiled (the message says why)."""


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:      # a dependency of ringllm; only a broken install lacks it
        raise ConfigError(f"constrained decoding needs the llguidance package ({exc}); pip install llguidance") \
            from None
    return llguidance


# ------------------------------------------------------------------------------------------------
# The vocabulary, as llguidance sees it
# ------------------------------------------------------------------------------------------------

class _EncoderAdapter:
    """What llguidance.TokenizerWrapper reads from a tokenizer: token bytes by id, BOS/EOS ids,
    the special ids, and a text -> ids encoder (no BOS, special strings as plain text)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = tokenizer.token_bytes()
        self.special_token_ids = sorted(tokenizer.special_ids)

    def __call__(self, text):
        if not isinstance(text, str):      # TokenizerWrapper probes with bytes; we take str only
            raise TypeError("text must be a str")
        return self._tok.encode(text, add_bos=False, add_eos=False, parse_special=False)


def llg_tokenizer(tokenizer):
    """The llguidance.LLTokenizer of a ringllm Tokenizer (built once per tokenizer and kept while the
    tokenizer lives; a fraction of a second for 49k tokens, about a second for 262k). Its end
    tokens are the tokenizer's eos_ids."""
    cached = _LLG_TOKENIZERS.get(tokenizer)
    if cached is not None:
        return cached
    llg = _llguidance()
    with _LLG_LOCK:
        cached = _LLG_TOKENIZERS.get(tokenizer)
        if cached is None:
            eos = sorted(tokenizer.eos_ids) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else None)
            cached = llg.LLTokenizer(llg.TokenizerWrapper(_EncoderAdapter(tokenizer)), n_vocab=tokenizer.n_vocab,
                                     eos_token=eos)
            _LLG_TOKENIZERS[tokenizer] = cached
    return cached


# ------------------------------------------------------------------------------------------------
# Requests -> llguidance grammars
# ------------------------------------------------------------------------------------------------

def json_schema_of(response_format: Any) -> dict | None:
    """The JSON Schema a response_format asks for (None for {"type": "text"} or None).
    GrammarError for anything else than OpenAI's three shapes."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise GrammarError(f"response_format must be a dict such as {{'type': 'json_object'}}, got "
                           f"{type(response_format).__name__}")
    kind = response_format.get("type")
    allowed = {"text": {"type"}, "json_object": {"type", "schema"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        raise GrammarError(f"response_format type {kind!r} is not supported; use 'text', 'json_object' or "
                           "'json_schema'")
    extra = sorted(set(response_format) - allowed[kind])
    if extra:
        raise GrammarError(f"response_format of type {kind!r} does not take {extra}")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema", {"type": "object"})
    else:
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise GrammarError("response_format json_schema must be a dict: {'name': ..., 'schema': {...}}")
        openai_keys = {"name", "schema", "strict", "description"}
        if spec.keys() & openai_keys:
            extra = sorted(set(spec) - openai_keys)
            if extra:
                raise GrammarError(f"response_format.json_schema has unknown keys {extra}; "
                                   f"valid: {sorted(openai_keys)}")
            if "schema" not in spec:
                raise GrammarError("response_format.json_schema has no 'schema'")
            schema = spec["schema"]
        else:
            schema = spec
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"a JSON Schema must be a dict (or a bool), got {type(schema).__name__}")
    return schema


def _grammar_source(response_format, grammar, regex) -> tuple[str, str] | None:
    """(description, llguidance grammar text) of a request, or None when it asks for nothing (then
    llguidance is not imported: a plain request does not need the grammar engine)."""
    asked = [name for name, v in (("response_format", json_schema_of(response_format)), ("grammar", grammar),
                                  ("regex", regex)) if v is not None]
    if len(asked) > 1:
        raise GrammarError(f"give one constraint at a time, not {' and '.join(asked)}")
    if not asked:
        return None
    llg = _llguidance()
    if asked[0] == "response_format":
        schema = json_schema_of(response_format)
        try:
            return "json_schema", llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"invalid JSON Schema: {exc}") from None
    if asked[0] == "regex":
        if not isinstance(regex, str) or not regex:
            raise GrammarError(f"regex must be a non-empty string, got {regex!r}")
        return "regex", llg.LLMatcher.grammar_from_regex(regex)
    if not isinstance(grammar, str) or not grammar.strip():
        raise GrammarError(f"grammar must be non-empty Lark or GBNF text, got {grammar!r}")
    from llguidance.gbnf_to_lark import any_to_lark, is_lark_syntax
    kind = "lark" if is_lark_syntax(grammar) else "gbnf"
    try:
        lark = any_to_lark(grammar)
    except Exception as exc:           # the converter raises its own error types
        raise GrammarError(f"invalid GBNF grammar: {exc}") from None
    return kind, llg.LLMatcher.grammar_from_lark(lark)


def compile_grammar(tokenizer, response_format: Any = None, grammar: Any = None,
                    regex: str | None = None) -> "Grammar | None":
    """The Grammar a request asks for (None when it asks for none), compiled against `tokenizer`'s
    vocabulary. A Grammar passed as `grammar` is returned as it is. GrammarError names what is wrong."""
    if isinstance(grammar, Grammar):
        if json_schema_of(response_format) is not None or regex is not None:
            raise GrammarError("give one constraint at a time")
        return grammar
    source = _grammar_source(response_format, grammar, regex)
    if source is None:
        return None
    kind, text = source
    return Grammar(tokenizer, text, kind)


def lark_grammar(tokenizer, lark: str, kind: str = "lark") -> "Grammar":
    """A Grammar from Lark text that ringllm wrote itself (e.g. the tool-call grammars)."""
    return Grammar(tokenizer, _llguidance().LLMatcher.grammar_from_lark(lark), kind)


class Grammar:
    """A compiled grammar over one tokenizer's vocabulary: start() makes the per-request Constraint.

    kind: "json_schema" | "regex" | "lark" | "gbnf" | "tool_calls" (what it was made from);
    text: the llguidance grammar (JSON) it was compiled from; compile_s: seconds the compilation
    took (the first-token latency it adds)."""

    def __init__(self, tokenizer, text: str, kind: str):
        llg = _llguidance()
        t0 = time.perf_counter()
        self.tokenizer, self.text, self.kind = tokenizer, text, kind
        self._llg_tok = llg_tokenizer(tokenizer)
        matcher = llg.LLMatcher(self._llg_tok, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {kind.replace('_', ' ')}: {matcher.get_error().strip()}")
        self._template = matcher
        self._copy_lock = threading.Lock()     # one Grammar may serve requests of several threads
        self.compile_s = time.perf_counter() - t0

    def start(self) -> "Constraint":
        """A fresh parser state (a copy of the compiled one: no recompilation)."""
        with self._copy_lock:
            return Constraint(self, self._template.deep_copy())

    def restore(self, tokens: list[int]) -> "Constraint":
        """The state after `tokens` were accepted (replayed); GrammarError if the grammar refuses them."""
        c = self.start()
        for t in tokens:
            c.accept(int(t))
        return c

    def __repr__(self) -> str:
        return f"Grammar(kind={self.kind!r}, {len(self.text)} chars)"


# ------------------------------------------------------------------------------------------------
# The per-request state
# ------------------------------------------------------------------------------------------------

class Constraint:
    """The parser state of one answer under a Grammar. Not thread-safe: one per request.

    mask(logits) applies the grammar to one step's logits; accept(token) moves on.
    .tokens lists the tokens accepted; .mask_s, .n_masks and .time_s say what it cost."""

    def __init__(self, grammar: Grammar, matcher):
        self.grammar, self._m = grammar, matcher
        n = grammar._llg_tok.vocab_size
        self._n_tok = n
        self._bits = np.zeros((n + 31) // 32, dtype=np.int32)
        self.tokens: list[int] = []
        self.mask_s = 0.0          # seconds computing and applying whole masks
        self.n_masks = 0
        self.time_s = 0.0          # seconds in the constraint altogether (masks and accepts)

    @property
    def done(self) -> bool:
        """True when the grammar takes no further token (the answer is complete)."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """True when the text so far is a complete answer (end of sequence is allowed now)."""
        return self._m.is_accepting()

    def _check(self) -> None:
        if self._m.is_error():
            raise GrammarError(f"the {self.grammar.kind} constraint failed: {self._m.get_error().strip()}")

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """Set the logits of every token the grammar forbids next to -inf, in place.
        logits: (n_vocab,) float64. GrammarError when nothing is left (e.g. logit_bias banned every
        token the grammar allows)."""
        t0 = time.perf_counter()
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._check()
        n = min(self._n_tok, logits.shape[0])
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=n).view(bool)
        logits[:n][~allowed] = -np.inf
        logits[n:] = -np.inf
        dt = time.perf_counter() - t0
        self.mask_s += dt
        self.time_s += dt
        self.n_masks += 1
        if not np.isfinite(logits).any():
            raise GrammarError(f"the {self.grammar.kind} constraint and logit_bias together leave no token to "
                               "sample")
        return logits

    def accept(self, token: int) -> None:
        """Advance by `token` (which the grammar must allow). GrammarError otherwise."""
        t0 = time.perf_counter()
        if not self._m.consume_token(int(token)):
            raise GrammarError(f"the {self.grammar.kind} constraint refused token {token}: "
                               f"{self._m.get_error().strip() or 'not allowed here'}")
        self.tokens.append(int(token))
        self.time_s += time.perf_counter() - t0

    def state(self) -> dict:
        """What restores this state: the grammar text and kind, and the tokens accepted (JSON-ready)."""
        return {"kind": self.grammar.kind, "grammar": self.grammar.text, "tokens": list(self.tokens)}


def constraint_from_state(tokenizer, state: dict) -> Constraint:
    """The Constraint that `Constraint.state()` described (the grammar compiled again, its tokens
    replayed). GrammarError when the state does not fit this tokenizer."""
    if not isinstance(state, dict) or not isinstance(state.get("grammar"), str) or \
            not isinstance(state.get("tokens"), list):
        raise GrammarError("a saved constraint must be {'kind', 'grammar', 'tokens'}")
    grammar = Grammar(tokenizer, state["grammar"], str(state.get("kind", "grammar")))
    return grammar.restore([int(t) for t in state["tokens"]])

