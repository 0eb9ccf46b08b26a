"""Constrained decoding with the real engine: JSON Schema outputs that parse and validate on SmolLM2
and Gemma 3 (greedy and sampled), regex and Lark / GBNF grammars, the place of the mask in the
sampling chain, stop strings, batched decode, a session saved mid-answer, and clear errors for
what does not compile.

The schema checks run RINGLLM_STRUCTURED_N generations per schema and mode (default 2);
bench/structured.py runs the same cases 200 times (bench/results/structured.md).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import ringllm
from ringllm import ConfigError
from ringllm.batch import BatchDecoder
from ringllm.constraints import GrammarError
from ringllm.sampling import Sampler, SamplingParams
from ringllm.session import ChatSession

import structured_cases as cases

jsonschema = pytest.importorskip("jsonschema")

N = int(os.environ.get("RINGLLM_STRUCTURED_N", "2"))
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                    "minItems": 1, "maxItems": 3}},
          "required": ["name", "tags"], "additionalProperties": False}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
ASK = [{"role": "user", "content": "Describe a cat as JSON."}]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return ringllm.LLM(smollm2_path, n_threads=1, progress=False)


@pytest.fixture(scope="module")
def gemma(gemma3_path):
    return ringllm.LLM(gemma3_path, n_threads=1, progress=False)


# ------------------------------------------------------------------------------------------------
# Every output parses and validates
# ------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("schema", list(cases.SCHEMAS))
@pytest.mark.parametrize("model", ["llm", "gemma"])
def test_schema_outputs_parse_and_validate(request, model, schema, mode):
    r = cases.run_schema(request.getfixturevalue(model), schema, N, sampled=mode == "sampled")
    assert r["valid"] == r["n"] == N, r["failures"]


def test_json_object_and_text_formats(llm):
    ask = [{"role": "user", "content": "Describe a person as JSON with name, age and favourite color."}]
    r = llm.chat(ask, max_tokens=120, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.text), dict) and r.finish_reason == "stop"
    free = llm.chat(ASK, max_tokens=12)
    assert llm.chat(ASK, max_tokens=12, response_format={"type": "text"}).tokens == free.tokens
    # json_schema's dict may also be the schema itself
    r = llm.chat(ASK, max_tokens=80, response_format={"type": "json_schema", "json_schema": PERSON})
    jsonschema.validate(json.loads(r.text), PERSON)


def test_regex_and_the_end_of_sequence_only_where_the_grammar_accepts(llm):
    r = llm.complete("The date today is", max_tokens=30, regex=r" [0-9]{4}-[0-9]{2}-[0-9]{2}")
    assert re.fullmatch(r" [0-9]{4}-[0-9]{2}-[0-9]{2}", r.text) and r.finish_reason == "stop"
    # the model would end sooner; EOS is masked until five letters are there
    r = llm.chat([{"role": "user", "content": "Say hi."}], max_tokens=30, regex="[a-z]{5}")
    assert re.fullmatch("[a-z]{5}", r.text)
    for seed in range(3):
        r = llm.complete("Pick a number:", max_tokens=10, regex=" (1|2|3)[0-9]?", temperature=1.5, seed=seed)
        assert re.fullmatch(" (1|2|3)[0-9]?", r.text) and r.finish_reason == "stop"


def test_lark_and_gbnf_grammars(llm):
    gbnf = 'root ::= answer "."\nanswer ::= "yes" | "no" | "maybe"'
    r = llm.chat([{"role": "user", "content": "Is the sea blue?"}], max_tokens=8, grammar=gbnf)
    assert r.text in ("yes.", "no.", "maybe.")
    lark = '''start: item ("," " " item){2}
item: NUMBER " " FRUIT
NUMBER: /[1-9]/
FRUIT: "apples" | "pears" | "plums"'''
    for seed in range(2):
        r = llm.chat([{"role": "user", "content": "List three fruits with counts."}], max_tokens=30, grammar=lark,
                     temperature=0.9, seed=seed)
        assert re.fullmatch(r"[1-9] (apples|pears|plums)(, [1-9] (apples|pears|plums)){2}", r.text), r.text
    # Lark with an inlined JSON Schema and a special token of the vocabulary
    embedded = 'start: "Result: " obj\nobj: %json ' + json.dumps(PERSON)
    r = llm.chat(ASK, max_tokens=60, grammar=embedded)
    assert r.text.startswith("Result: ")
    jsonschema.validate(json.loads(r.text[len("Result: "):]), PERSON)


# ------------------------------------------------------------------------------------------------
# The sampling chain
# ------------------------------------------------------------------------------------------------

def test_mask_comes_after_logit_bias_and_before_penalties(llm):
    grammar = llm.compile_grammar(regex="(cat|dog)")
    cat, dog = llm.tokenize("cat", add_bos=False), llm.tokenize("dog", add_bos=False)
    assert len(cat) == len(dog) == 1
    cat, dog = cat[0], dog[0]
    logits = np.zeros(llm.n_vocab, dtype=np.float32)
    logits[[cat, dog]] = [5.0, 4.0]
    logits[7] = 50.0                                   # the favourite, outside the grammar
    # greedy: the grammar removes token 7; the bias decides between the two left
    s = Sampler(SamplingParams(logit_bias={dog: 2.0}), 0, grammar.start())
    assert s.sample(logits) == dog
    # penalties act on what the mask left: cat, repeated, drops below dog
    s = Sampler(SamplingParams(repeat_penalty=2.0), 0, grammar.start())
    assert s.sample(logits, history=[cat]) == dog
    # sampling: every draw stays in the grammar (whole words or their first pieces), whatever the temperature
    draws = {Sampler(SamplingParams(temperature=5.0), seed, grammar.start()).sample(logits) for seed in range(30)}
    assert {cat, dog} <= draws and 7 not in draws
    assert all("cat".startswith(llm.detokenize([t])) or "dog".startswith(llm.detokenize([t])) for t in draws)
    # a bias that forces a token the grammar forbids leaves nothing: a clear error
    with pytest.raises(GrammarError, match="no token"):
        Sampler(SamplingParams(logit_bias={7: 100.0}), 0, grammar.start()).sample(logits)


def test_stop_strings_cut_a_constrained_answer(llm):
    r = llm.chat(ASK, max_tokens=80, response_format=PERSON_FORMAT, stop=['"tags"'])
    assert r.finish_reason == "stop" and r.text.startswith('{"name": ') and '"tags"' not in r.text


def test_batched_constrained_sequences_match_each_alone(llm):
    ids = llm.chat_ids(llm.render_chat(ASK))
    requests = [dict(response_format=PERSON_FORMAT), dict(response_format=PERSON_FORMAT, temperature=0.9, seed=4),
                dict(regex="[A-Z][a-z]+ (is|was) [a-z]+\\."), dict(temperature=0.8, seed=1)]
    alone = [llm.generate(ids, max_tokens=60, stream=False, **kw).tokens for kw in requests]
    batch = BatchDecoder(llm, max_batch=4)
    for i, kw in enumerate(requests):
        batch.join(llm.decoder(ids, max_tokens=60, **kw), tag=i)
    out = {i: [] for i in range(len(requests))}
    while batch.active:
        for tag, chunk in batch.step():
            out[tag].append(chunk.token)
    assert [out[i] for i in range(len(requests))] == alone
    jsonschema.validate(json.loads(llm.detokenize(alone[1])), PERSON)


# ------------------------------------------------------------------------------------------------
# Sessions
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_session_saved_mid_answer_continues_the_constrained_answer_identically(llm, tmp_path, temperature):
    a = llm.chat_session(seed=5, temperature=temperature, top_p=0.95)
    cut = a.send("Describe a cat as JSON.", response_format=PERSON_FORMAT, max_tokens=6, stream=False)
    assert cut.finish_reason == "length" and a.cut_answer["constraint"]["tokens"] == cut.tokens
    path = a.save(tmp_path / "mid.session")
    rest_a = a.continue_answer(max_tokens=120, stream=False)
    b = ChatSession.load(llm, path)
    rest_b = b.continue_answer(max_tokens=120, stream=False)
    assert rest_a.tokens == rest_b.tokens and a.messages == b.messages
    answer = a.messages[-1]["content"]
    assert answer == cut.text + rest_a.text and rest_a.finish_reason == "stop"
    with pytest.raises(ConfigError, match="no answer to continue"):
        a.continue_answer()
    jsonschema.validate(json.loads(answer), PERSON)
    # the same as never cutting it
    whole = llm.chat_session(seed=5, temperature=temperature, top_p=0.95).send(
        "Describe a cat as JSON.", response_format=PERSON_FORMAT, max_tokens=200, stream=False)
    assert whole.text == answer
    # the conversation goes on as usual after it
    assert a.send("Thanks.", max_tokens=4, stream=False).tokens == b.send("Thanks.", max_tokens=4, stream=False).tokens


def test_session_file_with_a_broken_constraint_is_refused(llm, tmp_path):
    from test_session import _rewrite
    a = llm.chat_session(seed=1)
    a.send("Give me JSON.", response_format={"type": "json_object"}, max_tokens=4, stream=False)
    path = a.save(tmp_path / "ok.session")

    def spoil(header, arrays):
        header["cut_answer"]["constraint"]["tokens"] = [llm.tokenizer.eos_id] * 3

    bad = _rewrite(path, tmp_path / "bad.npz", spoil)
    with pytest.raises(ringllm.SessionFileError, match="constraint"):
        ChatSession.load(llm, bad)


# ------------------------------------------------------------------------------------------------
# Errors: before any token, naming the problem
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "objekt"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 3,
                                                                              "maximum": 1}}}}, "minimum"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}}, "nope"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "no 'schema'"),
    ({"response_format": {"type": "yaml"}}, "not supported"),
    ({"response_format": "json"}, "must be a dict"),
    ({"grammar": "start: foo"}, "unknown name"),
    ({"grammar": 'root ::= "a'}, "GBNF"),
    ({"grammar": ""}, "non-empty"),
    ({"regex": "(a"}, "unclosed group"),
    ({"regex": "a", "grammar": "start: \"a\""}, "one constraint at a time"),
    ({"regex": "a", "ignore_eos": True}, "ignore_eos"),
])
def test_what_does_not_compile_is_a_value_error_before_any_token(llm, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate("Hello", max_tokens=4, **kwargs)        # raised by the call, no chunk consumed


def test_gemma_schema_with_its_large_vocabulary(gemma):
    r = gemma.chat(ASK, max_tokens=80, response_format=PERSON_FORMAT, temperature=0.8, seed=3)
    jsonschema.validate(json.loads(r.text), PERSON)
    assert r.finish_reason == "stop"


def test_a_plain_request_does_not_import_the_grammar_engine():
    """Only a request that asks for a constraint needs llguidance (it is imported on first use)."""
    code = ("import sys\n"
            "from ringllm.constraints import compile_grammar\n"
            "assert compile_grammar(None) is None\n"
            "assert compile_grammar(None, response_format={'type': 'text'}) is None\n"
            "assert 'llguidance' not in sys.modules, 'imported for a plain request'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
