"""Fuzz targets: one per parser of untrusted input, each a function of one `bytes` argument.

A target returns normally when the parser accepted the input or refused it the way it promises to
(a RingLLMError subclass naming the problem; for the server, an HTTP 4xx whose body names it). Any
other exception, a 5xx, or a crash of the process is a finding. The same functions serve the
coverage-guided runs (tests/fuzz/run_atheris.py), the hypothesis tests and the replay of the
committed corpus (tests/test_fuzz.py).

    gguf          GGUFFile: header, metadata of every value type, tensor table
    safetensors   read_safetensors: length prefix, JSON header, offsets
    session       ChatSession.load of: (first byte % 3 == 0) the bytes as the file; (1) the bytes as
                  the JSON header of an otherwise valid file, checksum fixed; (2) the reference
                  file with integer array entries patched, checksum fixed; so the fuzzer reaches
                  the checks behind the SHA-256
    chat_template render_chat of the bytes as a template (a GGUF's tokenizer.chat_template): no
                  file or attribute access, bounded time and output
    tokenizer     the bundled model's tokenizer: encode of arbitrary text (invalid UTF-8 as
                  surrogates), decode / decode_bytes / stream decoding of arbitrary ids
    spm_bpe       ringllm's SentencePiece BPE (models/spm_bpe.py) against the `tokenizers` backend
                  built from the same small vocabulary (tests/spm_vocabulary.py; the first byte picks
                  one of four and whether special tokens are parsed): the same ids for the text and
                  the same text for arbitrary ids
    byte_bpe      ringllm's byte-level BPE (models/byte_bpe.py) against the `tokenizers` backend built
                  from the same small vocabulary (tests/byte_vocabulary.py; the first byte picks one
                  of eight and whether special tokens are parsed), as spm_bpe
    server        the real FastAPI app in-process: the bytes are a request body (first byte picks
                  the route), sent as JSON
"""
from __future__ import annotations

import functools
import io
import json
import os
import tempfile

import numpy as np

import ringllm
from ringllm.runtime.errors import RingLLMError

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


class FuzzFinding(AssertionError):
    """A failure of the contract (not a RingLLMError, a 5xx, a wrong round trip)."""


@functools.lru_cache(maxsize=None)
def _scratch(name: str) -> str:
    """A per-process scratch file path (in /dev/shm when it exists: no disk writes per execution)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    folder = tempfile.mkdtemp(prefix="ringllm-fuzz-", dir=base)
    return os.path.join(folder, name)


def _as_file(data: bytes, name: str) -> str:
    path = _scratch(name)
    with open(path, "wb") as fh:
        fh.write(data)
    return path


@functools.lru_cache(maxsize=None)
def bundled_llm():
    """The bundled SmolLM2 with a small store: the model the session, tokenizer and server targets use."""
    from ringllm.models.bundled import default_model_path
    return ringllm.LLM(default_model_path(), n_threads=1, progress=False,
                       kv=ringllm.KVConfig(capacity=32, policy="streaming"))


# ---------------------------------------------------------------------------------------------
# File parsers
# ---------------------------------------------------------------------------------------------

def target_gguf(data: bytes) -> None:
    from ringllm.models.gguf_file import GGUFFile
    try:
        f = GGUFFile(_as_file(data, "f.gguf"))
        f.get("general.architecture")
        for t in f.tensors.values():
            t.data[:1].tobytes()             # the view is really inside the mapping
    except RingLLMError:
        pass


def target_safetensors(data: bytes) -> None:
    from ringllm.models.safetensors_file import read_safetensors
    try:
        for t in read_safetensors(_as_file(data, "f.safetensors")).values():
            t.data[:1].tobytes()
    except RingLLMError:
        pass


@functools.lru_cache(maxsize=None)
def reference_session() -> tuple[dict, dict]:
    """(header without checksum, arrays) of a real saved one-turn session of bundled_llm()."""
    llm = bundled_llm()
    s = llm.chat_session(system="Be terse.", seed=0)
    s.send("Hi", stream=False, max_tokens=2)
    path = s.save(_scratch("ref.session"))
    with np.load(path, allow_pickle=False) as z:
        header = json.loads(z["__header__"].tobytes().decode("utf-8"))
        arrays = {n: z[n] for n in z.files if n != "__header__"}
    header.pop("checksum")
    return header, arrays


def session_file_from_header(header_text: bytes) -> bytes:
    """A session file: `header_text` as its header (its checksum set when it is a JSON object) and the
    reference session's arrays."""
    from ringllm.session import file_checksum
    _, arrays = reference_session()
    try:
        header = json.loads(header_text)
    except (ValueError, UnicodeDecodeError, RecursionError):
        header = None
    if isinstance(header, dict):
        header.pop("checksum", None)
        try:
            header["checksum"] = file_checksum(header, arrays)
            header_text = json.dumps(header).encode("utf-8")
        except (TypeError, ValueError, RecursionError):
            pass
    buf = io.BytesIO()
    np.savez(buf, __header__=np.frombuffer(header_text, dtype=np.uint8), **arrays)   # uncompressed: fast
    return buf.getvalue()


def session_file_with_patches(patches: bytes) -> bytes:
    """The reference session with integer array entries overwritten and the checksum fixed: `patches`
    is a run of 7-byte records (array number u8, flat index u16, value i32), so the fuzzer reaches
    the slot-metadata checks of KVStore.restore (a count or position that would index out of
    bounds in a kernel)."""
    from ringllm.session import file_checksum
    header, arrays = reference_session()
    arrays = {n: a.copy() for n, a in arrays.items()}
    ints = sorted(n for n, a in arrays.items() if a.dtype.kind == "i" and a.size)
    for i in range(0, len(patches) - 6, 7):
        name = ints[patches[i] % len(ints)]
        flat = arrays[name].reshape(-1)
        flat[int.from_bytes(patches[i + 1:i + 3], "little") % flat.size] = \
            int.from_bytes(patches[i + 3:i + 7], "little", signed=True)
    header = dict(header, checksum=file_checksum(header, arrays))
    buf = io.BytesIO()
    np.savez(buf, __header__=np.frombuffer(json.dumps(header).encode("utf-8"), dtype=np.uint8), **arrays)
    return buf.getvalue()


def target_session(data: bytes) -> None:
    from ringllm.session import ChatSession
    if not data:
        return
    mode = data[0] % 3
    body = (data[1:] if mode == 0 else session_file_from_header(data[1:]) if mode == 1
            else session_file_with_patches(data[1:]))
    try:
        ChatSession.load(bundled_llm(), _as_file(body, "f.session"))
    except RingLLMError:
        pass


# ---------------------------------------------------------------------------------------------
# Chat template, tokenizer
# ---------------------------------------------------------------------------------------------

_MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]


def target_chat_template(data: bytes) -> None:
    from ringllm.chat_template import render_chat
    try:
        out = render_chat(data.decode("utf-8", "replace"), _MESSAGES, bos_token="<s>", eos_token="</s>")
    except RingLLMError:
        return
    if not isinstance(out, str):
        raise FuzzFinding(f"render_chat returned a {type(out).__name__}")


def target_tokenizer(data: bytes) -> None:
    tok = bundled_llm().tokenizer
    text = data.decode("utf-8", "surrogateescape")          # invalid UTF-8 -> lone surrogates
    special = bool(data[:1]) and data[0] % 2 == 1
    try:
        ids = tok.encode(text, add_bos=False, parse_special=special)
    except RingLLMError:
        ids = None
    if ids is not None and not all(isinstance(i, int) and 0 <= i < tok.n_vocab for i in ids):
        raise FuzzFinding(f"encode gave ids outside the vocabulary: {ids[:20]}")
    if ids is not None and not special and text.isprintable() and text == text.encode("utf-8", "replace").decode():
        back = tok.decode(ids)
        if back != text:
            raise FuzzFinding(f"decode(encode(text)) != text: {text[:60]!r} -> {back[:60]!r}")
    # arbitrary ids: two bytes each, some past the vocabulary, some negative
    raw = np.frombuffer(data[: len(data) // 2 * 2], dtype="<i2").astype(np.int64).tolist()
    for fn in (tok.decode, tok.decode_bytes):
        try:
            fn(raw)
        except RingLLMError:
            pass
    stream = tok.stream_decoder()
    try:
        for i in raw:
            stream.push(i)
        stream.flush()
    except RingLLMError:
        pass


@functools.lru_cache(maxsize=None)
def spm_pair(variant: int):
    """(ringllm's encoder, the tokenizers backend) of one of four small SentencePiece vocabularies."""
    from spm_vocabulary import tiny_spm_metadata

    from ringllm.models.tokenizer import Tokenizer
    md = tiny_spm_metadata(variant, with_meta=variant % 2 == 0, all_bytes=variant < 2, prefix=variant in (0, 3))
    return Tokenizer.from_gguf(md, "tiny.gguf"), Tokenizer.from_gguf(md, "tiny.gguf", lean=False)


@functools.lru_cache(maxsize=None)
def byte_pair(variant: int):
    """(ringllm's encoder, the tokenizers backend) of one of eight small byte-level vocabularies."""
    from byte_vocabulary import tiny_byte_metadata

    from ringllm.models.tokenizer import Tokenizer
    md = tiny_byte_metadata(variant, all_bytes=variant < 4)
    return Tokenizer.from_gguf(md, "tiny.gguf"), Tokenizer.from_gguf(md, "tiny.gguf", lean=False)


def _same_as_backend(lean, oracle, data: bytes, special: bool) -> None:
    """The lean encoder and its `tokenizers` oracle agree on data[1:] as text and as ids."""
    text = data[1:].decode("utf-8", "surrogateescape")
    outcomes = []
    for tok in (lean, oracle):
        try:
            outcomes.append(tok.encode(text, add_bos=False, parse_special=special))
        except RingLLMError as exc:
            outcomes.append(type(exc))
    if outcomes[0] != outcomes[1]:
        raise FuzzFinding(f"encode({text[:60]!r}, parse_special={special}): {outcomes[0]} != {outcomes[1]}")
    raw = [i % lean.n_vocab for i in np.frombuffer(data[1: 1 + (len(data) - 1) // 2 * 2], dtype="<u2").tolist()]
    for skip in (False, True):
        ours, theirs = lean.decode(raw, skip_special=skip), oracle.decode(raw, skip_special=skip)
        if ours != theirs:
            raise FuzzFinding(f"decode({raw[:20]}, skip_special={skip}): {ours[:60]!r} != {theirs[:60]!r}")


def target_spm_bpe(data: bytes) -> None:
    if data:
        _same_as_backend(*spm_pair(data[0] % 4), data, special=data[0] & 4 == 4)


def target_byte_bpe(data: bytes) -> None:
    if data:
        _same_as_backend(*byte_pair(data[0] % 8), data, special=data[0] & 8 == 8)


# ---------------------------------------------------------------------------------------------
# Server
# ---------------------------------------------------------------------------------------------

_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/chat/completions", "/v1/completions")


@functools.lru_cache(maxsize=None)
def server_client():
    """A TestClient on the real app (lifespan entered, so the worker runs), answers capped at 4 tokens."""
    from fastapi.testclient import TestClient

    from ringllm.server import ServerSettings, create_app
    app = create_app(bundled_llm(), ServerSettings(max_tokens_cap=4, default_max_tokens=4, web_ui=False,
                                                   cache_bytes=0))
    client = TestClient(app, raise_server_exceptions=False)
    client.__enter__()
    return client


def target_server(data: bytes) -> None:
    if not data:
        return
    route = _ROUTES[data[0] % len(_ROUTES)]
    r = server_client().post(route, content=data[1:], headers={"content-type": "application/json"})
    if r.status_code >= 500:
        raise FuzzFinding(f"{route} answered {r.status_code}: {r.text[:300]}")
    if r.status_code >= 400:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            raise FuzzFinding(f"{route} answered {r.status_code} without an error message: {r.text[:300]}") from None
        if not isinstance(message, str) or not message:
            raise FuzzFinding(f"{route} answered {r.status_code} with an empty error message")


TARGETS = {"gguf": target_gguf, "safetensors": target_safetensors, "session": target_session,
           "chat_template": target_chat_template, "tokenizer": target_tokenizer, "spm_bpe": target_spm_bpe,
           "byte_bpe": target_byte_bpe, "server": target_server}

def corpus_files(name: str) -> list[str]:
    folder = os.path.join(CORPUS, name)
    return sorted(os.path.join(folder, f) for f in os.listdir(folder)) if os.path.isdir(folder) else []
