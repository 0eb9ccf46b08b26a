"""Every `ringllm` command run as the real program (a subprocess), chat driven through its stdin.
(`ringllm serve` is started as a program by tests/test_server.py.)"""
from __future__ import annotations

import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import DATA_DIR

RINGLLM = [sys.executable, "-m", "ringllm"]
T1 = ["-t", "1", "--no-progress"]


def run(*args, input=None, timeout=300):
    return subprocess.run(RINGLLM + list(args), input=input, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from ringllm.models.loader import load_model
    return load_model(smollm2_path).tokenizer


def test_help_lists_every_command():
    r = run("--help")
    assert r.returncode == 0
    for cmd in ("generate", "chat", "perplexity", "bench", "serve"):
        assert cmd in r.stdout
    r = run("serve", "--help")
    assert r.returncode == 0 and "--api-key" in r.stdout and "--kv-policy" in r.stdout


def test_serve_binds_loopback_by_default():
    from ringllm.cli import build_parser
    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.api_key is None


def test_cache_type_flags_parse():
    from ringllm.cli import build_parser
    args = build_parser().parse_args(["serve", "--cache-type-k", "q8_0", "--cache-type-v", "q4_0"])
    assert (args.kv_k_type, args.kv_v_type) == ("q8_0", "q4_0")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--cache-type-k", "q5_1"])


def test_generate_json_and_text_agree(smollm2_path, tokenizer):
    r = run("generate", "-m", smollm2_path, "-p", "The capital of France is", "-n", "12", "--ignore-eos", "--json", *T1)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["tokens"]) == 12 and out["finish_reason"] == "length"
    assert out["text"] == tokenizer.decode(out["tokens"]) and "Paris" in out["text"]
    assert out["prompt_tokens"] == len(tokenizer.encode("The capital of France is"))
    assert out["gen_tok_s"] > 0 and out["kv"]["policy"] == "full" and out["kv"]["length"] > 12
    assert set(out["timings"]) >= {"prompt_tok_s", "gen_tok_s", "peak_memory_bytes"}
    text = run("generate", "-m", smollm2_path, "-p", "The capital of France is", "-n", "12", "--ignore-eos", *T1)
    assert text.returncode == 0 and text.stdout == out["text"] + "\n"
    assert "tok/s" in text.stderr


def test_generate_speculative_matches_plain_greedy(smollm2_path):
    args = ["generate", "-m", smollm2_path, "-p", "The capital of France is", "-n", "24", "--ignore-eos", "--json",
            "--kv-policy", "streaming", "--kv-capacity", "16", *T1]
    plain = json.loads(run(*args).stdout)
    r = run(*args, "--speculative", "store:8", "--gamma", "2")
    assert r.returncode == 0, r.stderr
    spec = json.loads(r.stdout)
    assert spec["tokens"] == plain["tokens"] and spec["text"] == plain["text"]
    assert spec["speculation"]["gamma"] == 2 and 0 <= spec["speculation"]["acceptance"] <= 1
    bad = run("generate", "-m", smollm2_path, "-p", "Hi", "--speculative", "store:8", "--temp", "0.7", *T1)
    assert bad.returncode != 0 and "greedily" in bad.stderr and "--temp" in bad.stderr


def test_generate_kv_policy_sampling_and_stop(smollm2_path):
    prompt = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be"
    r = run("generate", "-p", prompt, "-n", "8", "--kv-policy", "streaming", "--kv-capacity", "16", "--kv-sinks", "2",
            "--positions", "original", "--json", *T1)
    assert r.returncode == 0, r.stderr
    kv = json.loads(r.stdout)["kv"]
    assert kv["capacity"] == 16 and kv["length"] == 16 and kv["evicted_total"] > 0 and kv["sinks"] == 2
    assert kv["positions"] == "original"
    a = [run("generate", "-p", "My cat", "-n", "10", "--temp", "0.9", "--top-p", "0.9", "--seed", "7",
             "--ignore-eos", "--json", *T1) for _ in range(2)]
    assert json.loads(a[0].stdout)["tokens"] == json.loads(a[1].stdout)["tokens"]
    s = run("generate", "-p", "The capital of France is", "-n", "12", "--ignore-eos", "--stop", "answer", "--json", *T1)
    out = json.loads(s.stdout)
    assert out["finish_reason"] == "stop" and "answer" not in out["text"] and out["text"].startswith(" Paris")


def test_generate_chat_flag(smollm2_path):
    r = run("generate", "--chat", "-p", "Say hello.", "-n", "24", "--json", *T1)
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["text"].strip() and out["prompt_tokens"] > 20


def test_generate_structured_output_flags(smollm2_path, tmp_path):
    schema = {"type": "object", "properties": {"user": {"type": "string", "maxLength": 16},
                                               "id": {"type": "integer", "minimum": 1, "maximum": 999}},
              "required": ["user", "id"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    r = run("generate", "--chat", "-p", "Give me a user record.", "-n", "60", "--json-schema", str(path), "--json", *T1)
    out = json.loads(r.stdout)
    value = json.loads(out["text"])
    assert r.returncode == 0 and set(value) == {"user", "id"} and 1 <= value["id"] <= 999
    assert out["finish_reason"] == "stop"
    grammar = tmp_path / "yn.gbnf"
    grammar.write_text('root ::= "yes" | "no"')
    r = run("generate", "--chat", "-p", "Is ice cold?", "-n", "8", "--grammar", str(grammar), "--json", *T1)
    assert json.loads(r.stdout)["text"] in ("yes", "no")
    r = run("generate", "-p", "x", "--regex", "a(b", *T1)
    assert r.returncode == 1 and "unclosed group" in r.stderr
    r = run("generate", "-p", "x", "--json-schema", "{not json", *T1)
    assert r.returncode == 1 and "neither a file nor valid JSON" in r.stderr


def test_errors_exit_nonzero_with_a_message():
    r = run("generate", "-p", "x", "--kv-policy", "streaming", *T1)
    assert r.returncode == 1 and "needs a capacity" in r.stderr
    r = run("generate", "-p", "x", "-n", "-3", *T1)
    assert r.returncode == 2 and "--n-predict must be >= 0" in r.stderr
    r = run("generate", "-m", "/no/such/model.gguf", "-p", "x", *T1)
    assert r.returncode == 1 and "no such file" in r.stderr
    r = run("generate", "-p", "x", "--kv-policy", "nonsense", *T1)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_perplexity_both_protocols(smollm2_path):
    path = os.path.join(DATA_DIR, "prideprejudice.txt")
    r = run("perplexity", "-f", path, "--ctx", "64", "--chunks", "2", "--json", *T1)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["protocol"] == "chunked" and out["n_scored"] == 2 * 31 and 1 < out["ppl"] < 1000
    assert out["settings"]["model"] == smollm2_path
    r = run("perplexity", "-f", path, "--protocol", "streaming", "--tokens", "80", "--kv-policy", "streaming",
            "--kv-capacity", "32", "--json", *T1)
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["protocol"] == "streaming" and math.isfinite(out["ppl"])
    assert out["settings"]["capacity"] == 32 and out["settings"]["policy"] == "streaming"
    txt = run("perplexity", "-f", path, "--ctx", "64", "--chunks", "1", *T1)
    assert txt.returncode == 0 and txt.stdout.startswith("perplexity (chunked):")


def test_bench_json():
    r = run("bench", "--tg", "4", "--pp", "16", "--repeats", "1", "--json", *T1)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tg_tok_s"] > 0 and out["pp_tok_s"] > 0 and out["tg_tokens"] == 4 and out["pp_tokens"] == 16
    assert out["threads"] == 1 and out["decode_gb_s"] > 0
    r = run("bench", "--tg", "2", "--pp", "8", "--repeats", "1", *T1)
    assert r.returncode == 0 and "tok/s" in r.stdout


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="the memory report reads /proc (Linux)")
def test_bench_memory_reports_rss_by_part(smollm2_path):
    """The parts and the rest add up to the RSS; the packed weights are the engine's buffers, all resident
    after a generation; the KV store holds the pp + tg tokens' rows (f16: 2 bytes a value, 30 layers x 3 kv
    heads x 64 x K and V, its pages rounded up per head); LLVM's clean pages are released."""
    from ringllm.runtime.engine import CPUEngine

    r = run("bench", "--memory", "--pp", "24", "--tg", "8", "--json", "--cache-type-k", "f16", "--cache-type-v",
            "f16", *T1)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    parts, status = out["parts_mib"], out["status_mib"]
    assert abs(sum(parts.values()) + out["rest_mib"] - status["VmRSS"]) < 0.5
    from ringllm.models.loader import load_model
    model = load_model(smollm2_path)
    eng = CPUEngine(model.spec, model.tensors, n_threads=1)
    packed = sum({id(pm.buf): pm.buf.nbytes for pm in eng.mats.values()}.values()) / 2 ** 20
    assert packed - 0.5 <= parts["packed weights"] <= packed + 0.5
    rows = (24 + 8) * 30 * 3 * 64 * 2 * 2 / 2 ** 20
    assert rows <= parts["KV store"] <= rows + 1.5
    assert parts["LLVM library (llvmlite)"] < 8 and 0 < parts["vocabulary table"] < 2
    assert out["kv"]["k_type"] == "f16" and out["rss_mib_before_load"] < out["rss_mib_after_load"]
    r = run("bench", "--memory", "--engine", "cuda", *T1)
    assert r.returncode != 0 and "bench --memory measures the cpu engine" in r.stderr
    r = run("bench", "--memory", "--repeats", "2", *T1)
    assert r.returncode != 0 and "--repeats is for the speed figures" in r.stderr
    r = run("bench", "--memory", "--pp", "8", "--tg", "2", *T1)
    assert r.returncode == 0 and "packed weights" in r.stdout and "RSS" in r.stdout


def test_chat_through_stdin_with_save_reset_load(tmp_path):
    session = tmp_path / "chat.session"
    script = "\n".join(["What is 2+2?", f"/save {session}", "And 3+3?", "/reset", "/stats", f"/load {session}",
                        "And 3+3?", f"/load {tmp_path / 'missing.session'}", "/bogus", "/quit", "never read"]) + "\n"
    r = run("chat", "-n", "24", "--kv-policy", "streaming", "--kv-capacity", "256", *T1, input=script)
    assert r.returncode == 0, r.stderr
    answers = r.stdout.strip("\n").split("\n")
    assert len(answers) == 3 and all(a.strip() for a in answers)
    # the answer given after /load equals the one given right after /save: the session was restored
    assert answers[1] == answers[2]
    assert f"[saved 1 turns to {session}]" in r.stderr and "[conversation reset]" in r.stderr
    assert f"[loaded {session}: 1 turns]" in r.stderr and '"length": 0' in r.stderr
    assert "missing.session: no such file" in r.stderr and "unknown command /bogus" in r.stderr
    assert session.exists()
    # --load at start-up continues the saved conversation too
    r2 = run("chat", "-n", "24", "--kv-policy", "streaming", "--kv-capacity", "256", "--load", str(session), *T1,
             input="And 3+3?\n")
    assert r2.returncode == 0 and r2.stdout.strip() == answers[1]
    # with --cache-type-k/-v the loaded session's store is converted to them, and the CLI says so
    r3 = run("chat", "-n", "8", "--kv-policy", "streaming", "--kv-capacity", "256", "--cache-type-k", "q8_0",
             "--cache-type-v", "q8_0", "--load", str(session), *T1, input="And 3+3?\n")
    assert r3.returncode == 0, r3.stderr
    assert "KV store converted from f32/f32 to q8_0/q8_0" in r3.stderr and r3.stdout.strip()


def test_chat_ctrl_c_stops_the_answer_not_the_program():
    # answers that would never end by themselves (no EOS, 10^6 tokens): only Ctrl-C stops them
    proc = subprocess.Popen(RINGLLM + ["chat", "-n", "1000000", "--ignore-eos", *T1], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    out: queue.Queue = queue.Queue()
    err: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [out.put(c) for c in iter(lambda: proc.stdout.read(1), "")], daemon=True).start()
    threading.Thread(target=lambda: [err.put(x) for x in iter(proc.stderr.readline, "")], daemon=True).start()

    def wait_for(q, pred, timeout=120):
        got, deadline = "", time.time() + timeout
        while time.time() < deadline:
            try:
                got += q.get(timeout=0.5)
            except queue.Empty:
                continue
            if pred(got):
                return got
        raise AssertionError(f"timed out; got {got[-300:]!r}")

    try:
        for message in ("Tell me a story.", "Now another one."):
            proc.stdin.write(message + "\n")
            proc.stdin.flush()
            wait_for(out, lambda g: len(g) >= 40)                   # this answer is streaming
            proc.send_signal(signal.SIGINT)
            wait_for(err, lambda g: "[answer stopped]" in g)         # stopped; the program goes on
        proc.stdin.write("/quit\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
