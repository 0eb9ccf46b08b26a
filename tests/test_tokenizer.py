"""Tokenizer and chat template vs transformers.

The oracle is transformers loading the same GGUF (its own GGUF -> tokenizers conversion):
token ids of 100,000 characters of a novel (in chunks cut at arbitrary points, and paragraph by
paragraph) and of an edge-case list must be identical, and so must the decoded text. Then the
HF-folder path (the oracle's save_pretrained), tiny GGUF files written here for the paths the
bundled models do not cover, bad inputs, and the chat templates (SmolLM2's own template vs
apply_chat_template, the sandbox, the Gemma fallback).
"""
from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest

from conftest import novel_text
from ringllm.chat_template import (CHATML_TEMPLATE, GEMMA_TEMPLATE, fallback_template,
                                   render_chat, validate_messages)
from ringllm.models.gguf_file import GGUFFile
from ringllm.models.tokenizer import (PRE_TOKENIZER_REGEXES, StreamDecoder, Tokenizer,
                                      TokenizerWarning, derive_merges)
from ringllm.runtime.errors import ConfigError, ModelFileError, RingLLMError, UnsupportedModelError

transformers = pytest.importorskip("transformers")

N_CHARS = 100_000

EDGE_CASES = [
    "",
    " ",
    "   ",
    "  leading spaces",
    " one leading space",
    "trailing spaces   ",
    "Hello world",
    "Héllo naïve café, Ångström, façade, Dvořák, Łódź, São Paulo, Ærø",
    "e\u0301 (e + combining acute) vs \u00e9",
    "日本語のテキスト。中文字符，한국어 텍스트",
    "Emoji: 👍 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🧑🏿‍💻 ❤️",
    "1 12 123 1234 12345 123456 1234567 12345678901234567890",
    "3.14159 1,000,000 -42 +7 0x1F 1e-9 2024-06-01 12:30",
    "a  1  22   333",
    "x\n\n  12\n   345",
    "a\tb\t\tc\t\t\td",
    "a  b   c    d     e",
    "\n",
    "\n\n\nx\n\n",
    "line1\r\nline2\r\n\r\n",
    "def f(x):\n    if x:\n        return x  # comment\n\treturn None\n",
    "    indented code {\n        nested();\n    }\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos> <pad><unk>",
    "text <|im_start|>inside<|im_end|> text",
    "<|endoftext|><|endoftext|>",
    "<0x41> <0xFF>",
    "it's I'LL we've they'd she'S",
    "\u00a0no-break\u3000ideographic\u2009thin space",
    "▁▁ literal lower one-eighth blocks ▁",
    "[multimodal] <unused0>",
    "Zero\u200bwidth\u200djoiner\ufeffbom",
    "Mathematical 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and ℌ𝔢𝔩𝔩𝔬",
    "'quotes' \"double\" «guillemets» „low“ — dashes – …",
    "x" * 300 + " " + "ab" * 200,
]


# ------------------------------------------------------------------------------ fixtures

def _gguf_oracle(name: str, path: str):
    directory, filename = os.path.dirname(path), os.path.basename(path)
    if name == "gemma3":
        # AutoTokenizer picks GemmaTokenizer for a gemma3 file (asserted here) after reading the
        # model config through the gguf package, which takes ~15 s for a 262k vocabulary;
        # the class itself does the same tokenizer conversion without that.
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES
        from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

        assert TOKENIZER_MAPPING_NAMES["gemma3"] == "GemmaTokenizer"
        return GemmaTokenizer.from_pretrained(directory, gguf_file=filename)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, gguf_file=filename)


@pytest.fixture(scope="module")
def built():
    """What the module builds once: GGUF metadata by path, (ours, oracle) by model name."""
    cache: dict = {}
    yield cache
    cache.clear()


def _metadata(built: dict, path: str) -> dict:
    key = ("metadata", path)
    if key not in built:
        built[key] = GGUFFile(path).metadata
    return built[key]


def _model(request, built: dict, name: str) -> SimpleNamespace:
    if name not in built:
        path = request.getfixturevalue(f"{name}_path")
        metadata = _metadata(built, path)
        built[name] = SimpleNamespace(name=name, path=path, metadata=metadata,
                                      ours=Tokenizer.from_gguf(metadata, path),
                                      oracle=_gguf_oracle(name, path))
    return built[name]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model(request, built):
    return _model(request, built, request.param)


@pytest.fixture(scope="module")
def smollm2(request, built):
    return _model(request, built, "smollm2")


@pytest.fixture(scope="module")
def gemma3(request, built):
    return _model(request, built, "gemma3")


@pytest.fixture(scope="module")
def novel() -> str:
    text = novel_text()[:N_CHARS]
    assert len(text) == N_CHARS
    return text


def _chunks(text: str, seed: int = 1234) -> list[str]:
    """~2,000-character pieces cut at arbitrary points (mid-word, mid-line, mid-space-run)."""
    rng = random.Random(seed)
    out, pos = [], 0
    while pos < len(text):
        n = rng.randint(1000, 3000)
        out.append(text[pos:pos + n])
        pos += n
    return out


def _first_difference(a: list[int], b: list[int]) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at token {i}: ours {a[i:i + 6]} vs oracle {b[i:i + 6]}"


def _assert_same_ids(ours: Tokenizer, oracle, text: str) -> list[int]:
    expected = oracle(text)["input_ids"]
    got = ours.encode(text)
    assert got == expected, f"{text[:80]!r}: {_first_difference(got, expected)}"
    return got


# ------------------------------------------------------------------------------ GGUF vs oracle

def test_properties(model):
    ours, oracle = model.ours, model.oracle
    assert ours.n_vocab == len(model.metadata["tokenizer.ggml.tokens"])
    assert ours.bos_id == oracle.bos_token_id and ours.bos_token == oracle.bos_token
    assert ours.eos_id == oracle.eos_token_id and ours.eos_token == oracle.eos_token
    assert ours.add_bos == bool(model.metadata["tokenizer.ggml.add_bos_token"])
    assert ours.eos_id in ours.eos_ids
    assert set(oracle.all_special_ids) <= ours.special_ids
    if model.name == "smollm2":
        assert ours.n_vocab == 49152 and not ours.add_bos
        assert ours.eos_ids == {ours.token_to_id("<|im_end|>"), ours.token_to_id("<|endoftext|>")}
        assert ours.chat_template == oracle.chat_template
        assert fallback_template(ours) == CHATML_TEMPLATE
    else:
        assert ours.n_vocab == 262144 and ours.add_bos
        assert ours.token_to_id("<end_of_turn>") in ours.eos_ids
        assert ours.chat_template is None
        assert fallback_template(ours) == GEMMA_TEMPLATE


def test_novel_in_arbitrary_chunks(model, novel):
    chunks = _chunks(novel)
    assert len(chunks) >= 40 and "".join(chunks) == novel
    for chunk in chunks:
        ids = _assert_same_ids(model.ours, model.oracle, chunk)
        assert model.ours.decode(ids) == model.oracle.decode(ids)
        assert model.ours.decode(ids, skip_special=True) == model.oracle.decode(ids, skip_special_tokens=True)
        assert model.ours.decode_bytes(ids).decode("utf-8") == model.ours.decode(ids)


def test_novel_by_paragraph(model, novel):
    paragraphs = novel.split("\n\n")
    assert len(paragraphs) > 100
    for paragraph in paragraphs:
        ids = _assert_same_ids(model.ours, model.oracle, paragraph)
        assert model.ours.decode(ids) == model.oracle.decode(ids)


def test_whole_text_at_once(model, novel):
    text = novel[:20_000]
    ids = _assert_same_ids(model.ours, model.oracle, text)
    skip = 1 if model.ours.add_bos else 0
    assert model.ours.decode(ids[skip:]) == text


@pytest.mark.parametrize("text", EDGE_CASES, ids=range(len(EDGE_CASES)))
def test_edge_cases(model, text):
    ours, oracle = model.ours, model.oracle
    ids = _assert_same_ids(ours, oracle, text)
    assert ours.encode(text, add_bos=False) == oracle(text, add_special_tokens=False)["input_ids"]
    # control-token strings as plain text
    assert ours.encode(text, parse_special=False) == oracle(text, split_special_tokens=True)["input_ids"]
    assert ours.decode(ids) == oracle.decode(ids)
    assert ours.decode(ids, skip_special=True) == oracle.decode(ids, skip_special_tokens=True)
    # byte-exact pieces put back together, one token at a time
    stream = ours.stream_decoder()
    assert isinstance(stream, StreamDecoder)
    assert "".join(stream.push(i) for i in ids) + stream.flush() == ours.decode(ids)


def test_add_bos_override(model):
    ours = model.ours
    assert ours.encode("Hi", add_bos=True)[0] == ours.bos_id
    assert ours.encode("Hi", add_bos=False) == ours.encode("Hi")[1 if ours.add_bos else 0:]
    assert ours.encode("", add_bos=False) == []


def test_special_tokens_whole(model):
    ours = model.ours
    for text in ("<|im_start|>", "<start_of_turn>", "<end_of_turn>", "<|im_end|>"):
        tid = ours.token_to_id(text)
        if tid is None:
            continue
        assert ours.encode(text, add_bos=False) == [tid]
        assert tid in ours.special_ids
        assert ours.encode(text, add_bos=False, parse_special=False) != [tid]
        assert ours.token_to_piece(tid) == text


def test_partial_utf8_pieces(model):
    ours = model.ours
    ids = ours.encode("👨‍👩‍👧‍👦 漢字", add_bos=False)
    whole = b"".join(ours.decode_bytes([i]) for i in ids)
    assert whole.decode("utf-8") == "👨‍👩‍👧‍👦 漢字"
    pieces = [ours.token_to_piece(i) for i in ids]
    assert all(isinstance(p, str) for p in pieces)


def test_decode_rejects_bad_ids(model):
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        model.ours.decode([0, model.ours.n_vocab])
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        model.ours.decode([-1])
    with pytest.raises(ConfigError):
        model.ours.encode(b"bytes")


# ------------------------------------------------------------------------------ HF folder

def test_hf_dir_from_save_pretrained(model, novel, tmp_path):
    model.oracle.save_pretrained(tmp_path)
    hf = Tokenizer.from_hf_dir(tmp_path)
    ours = model.ours
    assert (hf.n_vocab, hf.bos_id, hf.eos_id, hf.add_bos) == (ours.n_vocab, ours.bos_id, ours.eos_id, ours.add_bos)
    assert hf.chat_template == ours.chat_template
    assert hf.eos_ids == ours.eos_ids
    assert hf.special_ids >= set(model.oracle.all_special_ids)
    for text in EDGE_CASES + _chunks(novel[:20_000]):
        ids = _assert_same_ids(hf, model.oracle, text)
        assert hf.decode(ids) == model.oracle.decode(ids)
        assert hf.decode_bytes(ids).decode("utf-8", "replace") == hf.decode(ids)


def test_hf_dir_errors(tmp_path):
    with pytest.raises(ModelFileError, match="tokenizer.json is missing"):
        Tokenizer.from_hf_dir(tmp_path)
    with pytest.raises(ModelFileError, match="no such directory"):
        Tokenizer.from_hf_dir(tmp_path / "absent")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFileError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


# ------------------------------------------------------------------------------ tiny GGUF files

def _write_gguf(path, arch: str, kv: dict) -> str:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif key.endswith("token_type"):
            writer.add_array(key, [int(v) for v in value])
        elif key.endswith("scores"):
            writer.add_array(key, [float(v) for v in value])
        else:
            writer.add_array(key, list(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _tokenizer_kv(metadata: dict) -> dict:
    return {k: v for k, v in metadata.items() if k.startswith("tokenizer.") and k != "tokenizer.chat_template"}


@pytest.fixture(scope="module")
def smollm2_metadata(built, smollm2_path):
    return _metadata(built, smollm2_path)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-4o", "tekken"])
def test_byte_level_pre_tokenizers_vs_oracle(smollm2_metadata, tmp_path, novel, pre):
    """SmolLM2's vocabulary under the pre-tokenizers transformers also knows, written as a GGUF.

    The oracle is the class AutoTokenizer gives for these files (as for SmolLM2's own), built
    without AutoTokenizer's reading of the model config, which only costs time here."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    kv = dict(_tokenizer_kv(smollm2_metadata), **{"tokenizer.ggml.pre": pre})
    path = _write_gguf(tmp_path / "tok.gguf", "llama", kv)
    ours = Tokenizer.from_gguf(kv, path)
    oracle = TokenizersBackend.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
    for text in EDGE_CASES + _chunks(novel[:10_000]):
        ids = _assert_same_ids(ours, oracle, text)
        assert ours.decode(ids) == oracle.decode(ids)


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZER_REGEXES))
def test_every_pre_tokenizer_builds_and_round_trips(smollm2_metadata, pre):
    md = dict(smollm2_metadata, **{"tokenizer.ggml.pre": pre})
    tok = Tokenizer.from_gguf(md, "smollm2.gguf")
    for text in EDGE_CASES:
        assert tok.decode(tok.encode(text)) == text


def test_pre_tokenizer_choice_matters(smollm2_metadata):
    gpt2 = Tokenizer.from_gguf(dict(smollm2_metadata, **{"tokenizer.ggml.pre": "gpt-2"}), "x.gguf")
    star = Tokenizer.from_gguf(dict(smollm2_metadata, **{"tokenizer.ggml.pre": "starcoder"}), "x.gguf")
    llama3 = Tokenizer.from_gguf(dict(smollm2_metadata, **{"tokenizer.ggml.pre": "llama3"}), "x.gguf")
    text = "a  1 end.\n\nNext"
    assert gpt2.encode(text) != star.encode(text)      # digits cut apart first: "  " stays one piece
    assert gpt2.encode(text) != llama3.encode(text)    # "\n\n" before a word stays one piece
    for tok in (gpt2, star, llama3):
        assert tok.decode(tok.encode(text)) == text


def test_unknown_pre_tokenizer_warns_and_uses_gpt2(smollm2_metadata):
    with pytest.warns(TokenizerWarning, match="not-a-real-pre"):
        tok = Tokenizer.from_gguf(dict(smollm2_metadata, **{"tokenizer.ggml.pre": "not-a-real-pre"}), "x.gguf")
    gpt2 = Tokenizer.from_gguf(dict(smollm2_metadata, **{"tokenizer.ggml.pre": "gpt-2"}), "x.gguf")
    for text in EDGE_CASES:
        assert tok.encode(text) == gpt2.encode(text)


def _train_tiny_spm(text: str, n_merges: int) -> tuple[list[str], list[float]]:
    """A small SentencePiece-style BPE vocabulary (pieces and scores) learned from `text`,
    only to have a llama-kind GGUF to test with."""
    words = [list("\u2581" + w) for w in text.split()]
    pieces = sorted({c for w in words for c in w})
    scores = [-1000.0 - i for i in range(len(pieces))]
    for step in range(n_merges):
        counts: dict[tuple[str, str], int] = {}
        for w in words:
            for a, b in zip(w, w[1:]):
                counts[a, b] = counts.get((a, b), 0) + 1
        if not counts:
            break
        best = max(counts, key=lambda p: (counts[p], p))
        merged = best[0] + best[1]
        pieces.append(merged)
        scores.append(-float(step))
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == best:
                    w[i:i + 2] = [merged]
                i += 1
    return pieces, scores


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, novel):
    pieces, scores = _train_tiny_spm(novel[:30_000], 300)
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    extra = ["<|user|>", "<tool>"]
    tokens = specials + byte_tokens + pieces + extra
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [3, 4]
    all_scores = [0.0, 0.0, 0.0] + [0.0] * 256 + scores + [0.0, 0.0]
    directory = tmp_path_factory.mktemp("tiny_llama")
    kv = {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": all_scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": True,
    }
    path = _write_gguf(directory / "tiny.gguf", "llama", kv)
    from transformers import AutoTokenizer

    oracle = AutoTokenizer.from_pretrained(str(directory), gguf_file="tiny.gguf")
    return SimpleNamespace(path=path, ours=Tokenizer.from_gguf(GGUFFile(path).metadata, path),
                           oracle=oracle, kv=kv)


def test_llama_spm_with_score_merges_vs_oracle(tiny_llama, novel):
    """The SentencePiece path Gemma does not take: merges ranked by score, prefix space."""
    ours, oracle = tiny_llama.ours, tiny_llama.oracle
    assert ours.add_bos and ours.bos_id == 1 and ours.eos_id == 2
    texts = EDGE_CASES + _chunks(novel[30_000:50_000]) + ["<|user|>hi<tool> x", "<s>a</s>"]
    for text in texts:
        ids = _assert_same_ids(ours, oracle, text)
        assert ours.decode(ids) == oracle.decode(ids)
        assert ours.decode_bytes(ids).decode("utf-8", "replace") == ours.decode(ids)
    # the prefix space exists and decode takes it off again
    word = ours.encode("the", add_bos=False)
    assert ours.decode_bytes(word, strip_prefix=False).startswith(b" ")
    assert ours.decode(word) == "the"


def test_derive_merges_order():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    merges = derive_merges(tokens, [0, 0, 0, 5, 7, 6])
    # bc (7) before abc (6) before ab (5); abc's two splits by the length of the left part
    assert merges == [("b", "c"), ("ab", "c"), ("a", "bc"), ("a", "b")]


# ------------------------------------------------------------------------------ bad GGUF metadata

def test_unknown_tokenizer_model():
    md = {"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a", "b"]}
    with pytest.raises(UnsupportedModelError, match=r"weird\.gguf.*'rwkv'.*supported: gpt2, llama"):
        Tokenizer.from_gguf(md, "weird.gguf")


def test_missing_tokens():
    with pytest.raises(ModelFileError, match=r"broken\.gguf.*tokenizer\.ggml\.tokens.*missing"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2"}, "broken.gguf")
    with pytest.raises(ModelFileError, match=r"tokenizer\.ggml\.model.*missing"):
        Tokenizer.from_gguf({}, "empty.gguf")


def test_inconsistent_metadata(smollm2_metadata):
    md = dict(smollm2_metadata)
    md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"][:10]
    with pytest.raises(ModelFileError, match="token_type has 10 entries"):
        Tokenizer.from_gguf(md, "x.gguf")
    md = dict(smollm2_metadata)
    del md["tokenizer.ggml.merges"]
    with pytest.raises(ModelFileError, match="merges"):
        Tokenizer.from_gguf(md, "x.gguf")
    md = dict(smollm2_metadata, **{"tokenizer.ggml.eos_token_id": 10**6})
    with pytest.raises(ModelFileError, match="eos_token_id"):
        Tokenizer.from_gguf(md, "x.gguf")
    md = dict(smollm2_metadata, **{"tokenizer.ggml.merges": ["Ġ t", "zz9 qq8"]})
    with pytest.raises(ModelFileError, match="inconsistent"):
        Tokenizer.from_gguf(md, "x.gguf")


def test_errors_are_ringllm_errors():
    for exc in (ModelFileError, UnsupportedModelError, ConfigError):
        assert issubclass(exc, RingLLMError)


# ------------------------------------------------------------------------------ chat templates

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3+3? Answer in français, s'il te plaît 🙂"}],
    [{"role": "user", "content": "  spaces and\nnewlines\n\n  "}],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_smollm2_template_vs_oracle(smollm2, conversation, generation_prompt):
    model = smollm2
    ours = render_chat(model.ours.chat_template, conversation, add_generation_prompt=generation_prompt,
                       bos_token=model.ours.bos_token, eos_token=model.ours.eos_token)
    expected = model.oracle.apply_chat_template(conversation, tokenize=False,
                                                add_generation_prompt=generation_prompt)
    assert ours == expected
    assert model.ours.encode(ours) == model.oracle(expected)["input_ids"]


# A template written the way Hub templates are: whitespace control, namespace, loop controls,
# tojson, raise_exception, indented blocks (trim_blocks / lstrip_blocks).
RICH_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(system='') %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% set ns.system = message['content'] %}
        {% continue %}
    {% endif %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('bad role ' + message['role']) }}
    {% endif %}
<|{{ message['role'] }}|>{% if loop.first and ns.system %}[{{ ns.system }}] {% endif %}
{{ message['content'] | trim }}{{ eos_token }}
{% endfor %}
{% if tools is defined and tools %}tools: {{ tools | tojson }}
{% endif %}
{% if add_generation_prompt %}<|assistant|>
{% endif %}"""


def test_environment_matches_transformers(smollm2):
    model = smollm2
    tools = [{"name": "search", "description": "Look up « things » & <stuff>", "args": {"q": "str"}}]
    for conversation in CONVERSATIONS:
        ours = render_chat(RICH_TEMPLATE, conversation, bos_token="<s>", eos_token="</s>", tools=tools)
        expected = model.oracle.apply_chat_template(conversation, chat_template=RICH_TEMPLATE, tokenize=False,
                                                    add_generation_prompt=True, tools=tools,
                                                    bos_token="<s>", eos_token="</s>")
        assert ours == expected


def test_template_raise_exception():
    with pytest.raises(ConfigError, match="rejected the conversation: bad role tool"):
        render_chat(RICH_TEMPLATE, [{"role": "tool", "content": "x"}])


MALICIOUS = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ messages['__class__'] }}",
    "{{ lipsum | attr('__globals__') }}",
    "{% set x = namespace() %}{{ x.__dict__ }}",
]

MALICIOUS_AT_RUNTIME = [
    "{{ cycler | attr('_' ~ '_init__') }}",
    "{{ ''['_' ~ '_class__'] }}",
    "{{ '{0.__class__}'.format(1) }}",
    "{{ messages.append({'role': 'x'}) }}",
    "{% set ns = namespace(_secret=1) %}",
]


@pytest.mark.parametrize("template", MALICIOUS)
def test_unsafe_template_refused_before_running(template):
    # the raise_exception in front would fire first if the template ran at all
    with pytest.raises(ConfigError, match="unsafe and was not run"):
        render_chat("{{ raise_exception('it ran') }}" + template, [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("template", MALICIOUS_AT_RUNTIME)
def test_unsafe_template_stopped_while_running(template):
    with pytest.raises(ConfigError, match="unsafe"):
        render_chat(template, [{"role": "user", "content": "x"}])


def test_string_doubling_through_tilde_is_stopped_by_its_size_not_the_clock():
    """The atheris long run's find (tests/fuzz/corpus/chat_template/crash-memory-tilde-doubling): `~`
    joined str() of a namespace holding the last string, doubling it each loop, 1.7 GB before the 2 s
    bound stopped it. `~` is bounded like `+` now."""
    doubling = "{% set ns = namespace(s='xx') %}{% for i in range(65) %}{% set ns.s = ns,s ~ ns.s %}{% endfor %}"
    with pytest.raises(ConfigError, match=r"concatenation \(~\) longer than"):
        render_chat(doubling, [{"role": "user", "content": "x"}])
    assert render_chat("{{ 'a' ~ 1 ~ none ~ messages[0].content }}", [{"role": "user", "content": "x"}]) == "a1Nonex"


def test_bad_templates():
    with pytest.raises(ConfigError, match="not valid Jinja"):
        render_chat("{% for m in messages %}", [{"role": "user", "content": "x"}])
    with pytest.raises(ConfigError, match="larger than a chat template may use"):    # bounded before it runs
        render_chat("{{ range(10 ** 9) | list }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ConfigError, match="must be a string"):
        render_chat(42, [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("messages, problem", [
    ("hello", "must be a list"),
    ([["user", "hi"]], r"messages\[0\] must be a dict"),
    ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
    ([{"role": "", "content": "hi"}], "no 'role'"),
    ([{"role": "user"}], "has no 'content'"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}], r"messages\[1\].*must be a string"),
    ([{"role": "user", "content": "a", "meta": object()}], "cannot be passed"),
])
def test_message_validation(messages, problem):
    with pytest.raises(ConfigError, match=problem):
        render_chat(None, messages)


def test_validate_messages_copies():
    messages = [{"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": {"x": 1}}]}]
    out = validate_messages(messages)
    assert out == messages and out[0] is not messages[0]


def test_gemma_fallback_text():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there "},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    assert render_chat(GEMMA_TEMPLATE, messages) == (
        "<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n"
        "<start_of_turn>model\n")
    assert render_chat(GEMMA_TEMPLATE, messages[1:2], add_generation_prompt=False) == \
        "<start_of_turn>user\nHi there<end_of_turn>\n"


def test_chatml_fallback_text():
    messages = [{"role": "user", "content": "Hi"}]
    assert render_chat(None, messages) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert fallback_template(None) == CHATML_TEMPLATE


def test_gemma_fallback_with_the_model(gemma3):
    model = gemma3
    tok = model.ours
    text = render_chat(tok.chat_template, [{"role": "user", "content": "Hi"}], tokenizer=tok)
    ids = tok.encode(text)
    sot, eot = tok.token_to_id("<start_of_turn>"), tok.token_to_id("<end_of_turn>")
    assert ids[:2] == [tok.bos_id, sot] and ids.count(sot) == 2 and ids.count(eot) == 1
    assert ids == model.oracle(text)["input_ids"]


def test_derived_merges_are_cached_by_vocabulary(tmp_path, monkeypatch):
    """cached_merges derives once per vocabulary and ranks, reads the file afterwards, and derives
    again (rewriting it) when the file is damaged or the vocabulary differs."""
    from ringllm.models import merges_cache
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def derive(tokens, ranks):
        calls.append(len(tokens))
        return derive_merges(tokens, ranks)

    tokens, ranks = ["a", "b", "c", "ab", "bc", "abc"], [0, 0, 0, 5, 7, 6]
    first = merges_cache.cached_merges(tokens, ranks, derive)
    assert first == derive_merges(tokens, ranks) and len(calls) == 1
    assert merges_cache.cached_merges(tokens, ranks, derive) == first and len(calls) == 1
    files = list((tmp_path / "ringllm" / "merges").iterdir())
    assert len(files) == 1
    files[0].write_bytes(b"not an array")
    assert merges_cache.cached_merges(tokens, ranks, derive) == first and len(calls) == 2
    assert merges_cache.cached_merges(tokens, ranks, derive) == first and len(calls) == 2
    other = merges_cache.cached_merges(tokens, [0, 0, 0, 7, 5, 6], derive)     # other ranks, other file
    assert other == derive_merges(tokens, [0, 0, 0, 7, 5, 6]) and len(calls) == 3
