"""Write the seed corpus under tests/fuzz/corpus/<target>/ (run once; the output is committed).

    python tests/fuzz/make_seeds.py

Seeds are small valid inputs of each format (every GGUF value type, each safetensors dtype, a real
session header, the chat templates of tests/data plus hostile ones, texts with invalid UTF-8, OpenAI
request bodies) so the fuzzer starts from the format rather than from nothing. Crashers found by a
run are added next to them by hand, named crash-<what>.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))      # tests/
from fuzz.targets import CORPUS, reference_session  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATES = os.path.join(HERE, "..", "data", "chat_templates")


def put(target: str, data: bytes, name: str | None = None) -> None:
    folder = os.path.join(CORPUS, target)
    os.makedirs(folder, exist_ok=True)
    name = name or "seed-" + hashlib.sha1(data).hexdigest()[:12]
    with open(os.path.join(folder, name), "wb") as fh:
        fh.write(data)


def gguf_seeds() -> None:
    import gguf
    path = "/tmp/ringllm-seed.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 7); w.add_int8("t.i8", -7); w.add_uint16("t.u16", 700); w.add_int16("t.i16", -700)
    w.add_uint32("t.u32", 70000); w.add_int32("t.i32", -70000); w.add_float32("t.f32", 1.5)
    w.add_bool("t.bool", True); w.add_uint64("t.u64", 1 << 40); w.add_int64("t.i64", -(1 << 40))
    w.add_float64("t.f64", 2.5); w.add_string("t.str", "héllo")
    w.add_array("t.arr_i32", [1, 2, 3]); w.add_array("t.arr_str", ["a", "bc", ""])
    w.add_tensor("w.f32", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.add_tensor("w.f16", np.ones((32,), np.float16))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    data = open(path, "rb").read()
    put("gguf", data, "seed-all-types.gguf")
    put("gguf", data[:200], "seed-truncated-header.gguf")
    put("gguf", data[:4] + (2).to_bytes(4, "little") + data[8:], "seed-version2.gguf")


def safetensors_seeds() -> None:
    from safetensors.numpy import save
    put("safetensors", save({"a": np.ones((2, 3), np.float32), "b": np.zeros(4, np.float16),
                             "pos": np.arange(3, dtype=np.int64)}, metadata={"format": "pt"}), "seed-mixed.safetensors")
    put("safetensors", save({"x": np.ones((1, 8), np.float32)}), "seed-one.safetensors")


def session_seeds() -> None:
    header, arrays = reference_session()
    put("session", b"\x01" + json.dumps(header).encode(), "seed-header.json")
    small = dict(header, store=None, tokens=[], pending=[], cut_answer=None)
    put("session", b"\x01" + json.dumps(small).encode(), "seed-header-nostore.json")
    buf = io.BytesIO()
    np.savez_compressed(buf, __header__=np.frombuffer(json.dumps(small).encode(), np.uint8))
    put("session", b"\x00" + buf.getvalue(), "seed-raw-nostore.npz")
    put("session", b"\x02" + bytes([0, 0, 0]) + (5).to_bytes(4, "little", signed=True), "seed-patch-one.bin")


HOSTILE = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ self._TemplateReference__context }}", "{{ 'x' * 10**9 }}", "{{ 10 ** 100000 }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ 'x'|center(999999999) }}", "{{ '{:>999999999}'.format(1) }}", "{{ '%*s' % (999999999, 'x') }}",
    "{% set ns = namespace(s='xx') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('ab') }}", "{% include 'x' %}", "{% import 'os' as os %}",
    "{{ range(100000)|join('x'*999999) }}", "{{ ('ab'*400000).replace('a', 'x'*999999) }}",
    "{{ messages|attr('__class__') }}", "{{ raise_exception('no') }}", "{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}",
]


def template_seeds() -> None:
    for name in sorted(os.listdir(TEMPLATES)):
        if name.endswith(".jinja"):
            put("chat_template", open(os.path.join(TEMPLATES, name), "rb").read(), "seed-" + name)
    for t in HOSTILE:
        put("chat_template", t.encode())


def tokenizer_seeds() -> None:
    for t in [b"Hello, world!", "héllo wörld 你好 🙂".encode(), b"\xff\xfe\x80abc\xc3", b"<|im_start|>user\nHi<|im_end|>",
              b"\x01<|im_start|>x", b"  leading and trailing  ", b"\x00\x01\x02", "a\u0301\u200b".encode()]:
        put("tokenizer", t)


def spm_bpe_seeds() -> None:
    for t in [b"\x00abc d", b"\x05<tool>a<<tool>>b", "\x02\u2581a\u2581\u2581b> </c".encode(), b"\x03 x  y   z",
              "\x01\u65e5\u65e5a\u00e9".encode(), b"\x04<s>ab</s>\xff\xfe", b"\x06>\xe2\x96\x81</ b\xe2\x96\x81c"]:
        put("spm_bpe", t)


def byte_bpe_seeds() -> None:
    for t in [b"\x00abc d", b"\x08<|im_start|>ab<|im|>c<tool>", b"\x01ab c a bc  abcabc", b"\x0a x  y   z\n\n1234",
              "\x05\u65e5\u672c\u65e5a\u00e6\u0157".encode(), b"\x0c'sab'll\xff\xfe", b"\x07\t\tab\r\nc 1 22 333"]:
        put("byte_bpe", t)


def server_seeds() -> None:
    chat = {"model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    bodies = [(0, chat), (1, {"prompt": "Once", "max_tokens": 2}),
              (0, dict(chat, stream=True)), (0, dict(chat, response_format={"type": "json_object"})),
              (0, dict(chat, tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])),
              (0, dict(chat, kv={"policy": "h2o", "capacity": 16})), (1, {"prompt": [1, 2, 3], "logprobs": 2}),
              (0, dict(chat, stop=["a", "b"], temperature=0.5, seed=3)), (0, dict(chat, max_tokens=10**9))]
    for route, body in bodies:
        put("server", bytes([route]) + json.dumps(body).encode())
    put("server", b"\x00{not json")


if __name__ == "__main__":
    gguf_seeds(); safetensors_seeds(); session_seeds(); template_seeds(); tokenizer_seeds(); spm_bpe_seeds(); byte_bpe_seeds(); server_seeds()
    for t in sorted(os.listdir(CORPUS)):
        print(t, len(os.listdir(os.path.join(CORPUS, t))))
