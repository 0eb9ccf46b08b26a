"""The schema set of the structured-output checks, shared by tests/test_structured.py (a few
generations per schema) and bench/structured.py (200 per schema): every output must parse with
json.loads and validate with jsonschema.

Each schema bounds its strings (maxLength) and its numbers' digits (integers in a range, or a
multipleOf that binary floats hold exactly) so that an answer ends within MAX_TOKENS whatever the
sampler draws: a plain JSON "number" lets a model sampled at temperature 1 write digits until
max_tokens (Gemma 3 did: 21.4545776666... for a temperature), an unfinished answer and not a
constraint failure. Everything else (nesting, enums, array bounds, number ranges, optional keys,
anyOf) is what the constraint has to get right.
"""
from __future__ import annotations

import json
import time

SCHEMAS: dict[str, dict] = {
    "nested_object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "address": {"type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 24},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"], "additionalProperties": False},
        },
        "required": ["name", "address"], "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
                       "in_stock": {"type": "boolean"}},
        "required": ["color", "size", "in_stock"], "additionalProperties": False,
    },
    "bounded_array": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                "minItems": 2, "maxItems": 4},
                       "scores": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 5},
                                  "minItems": 1, "maxItems": 3}},
        "required": ["tags", "scores"], "additionalProperties": False,
    },
    "number_ranges": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
                       "temperature_c": {"type": "number", "minimum": -50, "maximum": 60, "multipleOf": 0.5}},
        "required": ["age", "score", "temperature_c"], "additionalProperties": False,
    },
    "optional_keys": {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 40},
                       "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                       "rating": {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.5},
                       "genre": {"type": "string", "maxLength": 20}},
        "required": ["title", "year"], "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {"result": {"anyOf": [
            {"type": "object", "properties": {"ok": {"const": True},
                                              "value": {"type": "integer", "minimum": -1000, "maximum": 1000}},
             "required": ["ok", "value"], "additionalProperties": False},
            {"type": "object", "properties": {"ok": {"const": False}, "error": {"type": "string", "maxLength": 40}},
             "required": ["ok", "error"], "additionalProperties": False},
        ]}},
        "required": ["result"], "additionalProperties": False,
    },
}

SUBJECTS = ["a cat", "a city", "a book", "a movie", "a car", "a shirt", "a song", "a planet", "a river", "a chair",
            "a teacher", "a pizza", "a computer", "a garden", "a storm", "a museum", "a train", "a dragon",
            "a mountain", "a bakery", "a hospital", "a violin", "a spaceship", "a forest", "a coffee cup",
            "a football match", "a lighthouse", "a library", "a robot", "a festival", "an island", "an exam",
            "an apple", "an engine", "an owl", "an island hotel", "an old map", "an email", "an orchestra", "an app"]
ASKS = ["Describe {s} as JSON.", "Give me JSON about {s}.", "Write a JSON record for {s}.",
        "Return data about {s} in JSON.", "Produce a JSON object that describes {s}."]
MAX_TOKENS = 160


def messages(schema_name: str, i: int) -> list[dict]:
    """The i-th conversation asking for `schema_name` (i in 0..199 gives 200 different ones)."""
    subject = SUBJECTS[i % len(SUBJECTS)]
    ask = ASKS[(i // len(SUBJECTS)) % len(ASKS)]
    schema = json.dumps(SCHEMAS[schema_name])
    return [{"role": "system", "content": f"Answer with one JSON object that follows this JSON Schema: {schema}"},
            {"role": "user", "content": ask.format(s=subject)}]


def run_schema(llm, schema_name: str, n: int, sampled: bool, first: int = 0) -> dict:
    """Generations first..first+n-1 of `schema_name` (greedy: conversation i; sampled: conversation
    i at temperature 1.0, top_p 0.95, seed i), each parsed and validated. Returns
    {"n", "valid", "failures": [(i, text, finish_reason, why)], "tokens", "seconds"}."""
    import jsonschema

    schema = SCHEMAS[schema_name]
    grammar = llm.compile_grammar(response_format={"type": "json_schema",
                                                   "json_schema": {"name": schema_name, "schema": schema}})
    validator = jsonschema.Draft202012Validator(schema)
    valid, failures, tokens = 0, [], 0
    t0 = time.perf_counter()
    for i in range(first, first + n):
        kw = dict(temperature=1.0, top_p=0.95, seed=i) if sampled else {}
        r = llm.chat(messages(schema_name, i), max_tokens=MAX_TOKENS, grammar=grammar, **kw)
        tokens += len(r.tokens)
        try:
            value = json.loads(r.text)
            errors = sorted(validator.iter_errors(value), key=str)
            if errors:
                raise ValueError(errors[0].message)
        except ValueError as exc:
            failures.append((i, r.text, r.finish_reason, str(exc)))
            continue
        valid += 1
    return {"n": n, "valid": valid, "failures": failures, "tokens": tokens,
            "seconds": time.perf_counter() - t0}
