"""ChatSession: turns prefill only what is new, eviction keeps long chats bounded, and session files
round-trip token-identically and refuse damaged input without changing anything."""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

import ringllm
from ringllm import ConfigError, KVConfig, SessionFileError
from ringllm.session import ChatSession, file_checksum


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return ringllm.LLM(smollm2_path, n_threads=1, progress=False)


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_turns_prefill_only_the_new_messages(llm):
    s = llm.chat_session()
    first = s.send("What is the capital of France?", max_tokens=24)
    list(first)
    assert first.prompt_tokens == len(llm.chat_ids(llm.render_chat(s.messages[:1])))
    n_before = len(s.tokens)
    # the next turn feeds the end of the answer, the new user message and the generation prompt
    delta = s._turn_delta({"role": "user", "content": "And of Spain?"})
    assert delta == "<|im_end|>\n<|im_start|>user\nAnd of Spain?<|im_end|>\n<|im_start|>assistant\n"
    second = s.send("And of Spain?", max_tokens=8)
    list(second)
    assert second.prompt_tokens == len(llm.tokenize(delta, add_bos=False))
    assert second.prompt_tokens < 20 < n_before
    # the store now holds exactly the conversation as the template renders it
    canonical = llm.chat_ids(llm.render_chat(s.messages[:-1], add_generation_prompt=True))
    assert s.tokens[:len(canonical)] == canonical
    assert s.store.n_seen == len(s.tokens)
    assert [m["role"] for m in s.messages] == ["user", "assistant", "user", "assistant"]
    assert s.messages[1]["content"] == first.text and s.turns == 2


def test_system_message_and_reset(llm):
    s = llm.chat_session(system="You are a pirate.", max_tokens=6)
    r = s.send("Hello", stream=False)
    assert s.messages[0] == {"role": "system", "content": "You are a pirate."} and r.tokens
    s.reset()
    assert s.messages == [{"role": "system", "content": "You are a pirate."}] and s.store is None and s.tokens == []
    g = s.send("Hello")
    list(g)
    # after a reset the whole (new) conversation is prefilled from a fresh store
    assert g.prompt_tokens == len(llm.chat_ids(llm.render_chat(s.messages[:2])))
    assert g.tokens == r.tokens                    # greedy: same question, same answer


def test_streaming_policy_keeps_a_long_chat_bounded(llm):
    s = llm.chat_session(kv=KVConfig(capacity=64, policy="streaming", sinks=4), max_tokens=12, ignore_eos=True)
    for i in range(6):
        s.send(f"Tell me fact number {i} about the sea.", stream=False)
    stats = s.kv_stats()
    assert len(s.tokens) > 64 * 2
    assert stats["length"] == 64 and stats["capacity"] == 64 and stats["evicted_total"] > 0


def test_full_context_error_leaves_the_session_unchanged(llm):
    s = llm.chat_session(kv=KVConfig(capacity=80, policy="full"), max_tokens=16, ignore_eos=True)
    s.send("Hi", stream=False)
    with pytest.raises(ConfigError, match="context"):
        for _ in range(10):
            s.send("Tell me more, please, with many details.", stream=False)
    turns, tokens, n_seen = s.turns, list(s.tokens), s.store.n_seen
    with pytest.raises(ConfigError):
        s.send("Tell me more, please, with many details.")
    assert (s.turns, s.tokens, s.store.n_seen) == (turns, tokens, n_seen)


def test_interrupted_answer_keeps_a_consistent_session(llm):
    s = llm.chat_session(max_tokens=40, ignore_eos=True)
    g = s.send("Count from one to twenty.")
    for i, _ in enumerate(g):
        if i == 5:
            break
    g.close()
    assert s.turns == 1 and s.store.n_seen == len(s.tokens)
    assert s.messages[-1]["role"] == "assistant" and s.messages[-1]["content"]
    r = s.send("Thanks.", stream=False, max_tokens=4)        # goes on from there
    assert len(r.tokens) == 4 and s.store.n_seen == len(s.tokens)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_save_load_round_trip_is_token_identical(llm, tmp_path, temperature):
    kv = KVConfig(capacity=96, policy="streaming", sinks=4)
    a = llm.chat_session(kv=kv, seed=11, max_tokens=24, temperature=temperature, top_p=0.9)
    a.send("Write one sentence about cats.", stream=False)
    a.send("Now one about dogs.", stream=False)
    path = a.save(tmp_path / "chat.session")
    assert os.path.getsize(path) > 0
    cont_a = [a.send(q, stream=False).tokens for q in ("And birds?", "And fish?")]
    b = ChatSession.load(llm, path)
    assert b.turns == 2 and b.kv == kv and b.store.n_seen == len(b.tokens)
    cont_b = [b.send(q, stream=False).tokens for q in ("And birds?", "And fish?")]
    assert cont_a == cont_b
    assert b.kv_stats()["evicted_total"] == a.kv_stats()["evicted_total"] > 0


def test_empty_session_round_trip(llm, tmp_path):
    a = llm.chat_session(system="Be brief.", seed=3)
    path = a.save(tmp_path / "empty.session")
    b = ChatSession.load(llm, path)
    assert b.messages == a.messages and b.store is None
    assert b.send("Hi", stream=False, max_tokens=5).tokens == a.send("Hi", stream=False, max_tokens=5).tokens


def _rewrite(path, out, mutate):
    """Rewrite a session file with a mutated header and a valid checksum (a foreign but intact file)."""
    with np.load(path, allow_pickle=False) as z:
        arrays = {n: z[n] for n in z.files if n != "__header__"}
        header = json.loads(z["__header__"].tobytes())
    header.pop("checksum")
    mutate(header, arrays)
    header["checksum"] = file_checksum(header, arrays)
    np.savez_compressed(out, __header__=np.frombuffer(json.dumps(header).encode(), np.uint8), **arrays)
    return str(out)


def test_damaged_files_give_clear_errors_and_change_nothing(llm, tmp_path):
    s = llm.chat_session(kv=KVConfig(capacity=64, policy="streaming"), seed=2, max_tokens=10)
    s.send("Hello there.", stream=False)
    good = s.save(tmp_path / "good.session")
    raw = open(good, "rb").read()

    def write(name, data):
        p = tmp_path / name
        p.write_bytes(data)
        return str(p)

    flipped = bytearray(raw)
    mid = len(raw) // 2
    flipped[mid:mid + 64] = bytes(b ^ 0xFF for b in flipped[mid:mid + 64])
    cases = {
        "truncated": (write("trunc.session", raw[:len(raw) // 3]), "truncated or corrupt"),
        "corrupted": (write("flip.session", bytes(flipped)), "corrupt|checksum"),
        "not a zip": (write("text.session", b"hello, I am not a session"), "truncated or corrupt"),
        "empty": (write("empty.session", b""), "truncated or corrupt"),
        "missing": (str(tmp_path / "nope.session"), "no such file"),
        "other model": (_rewrite(good, tmp_path / "other.npz",
                                 lambda h, a: h["model"].update(name="OtherModel", n_layer=12)), "another model"),
        "bad array": (_rewrite(good, tmp_path / "shape.npz",
                               lambda h, a: a.update({"kv/k.0": a["kv/k.0"][:, :3]})), "inconsistent|shape"),
        "bad version": (_rewrite(good, tmp_path / "ver.npz", lambda h, a: h.update(version=99)), "version"),
        "bad token": (_rewrite(good, tmp_path / "tok.npz", lambda h, a: h["tokens"].__setitem__(0, -5)),
                      "inconsistent"),
    }
    before = (list(s.messages), list(s.tokens), s.store, s.store.n_seen, dict(s.sampler_state["rng"]))
    for name, (path, match) in cases.items():
        with pytest.raises(SessionFileError, match=match):
            ChatSession.load(llm, path)
        with pytest.raises(SessionFileError):
            s.restore(path)                        # in place: all or nothing
        assert (list(s.messages), list(s.tokens), s.store, s.store.n_seen, dict(s.sampler_state["rng"])) == before, name
    # and it still works: the same continuation as a clean copy of the file
    clean = ChatSession.load(llm, good)
    assert s.send("Go on.", stream=False).tokens == clean.send("Go on.", stream=False).tokens


def test_fifty_turns_constant_memory_and_time(llm):
    """Acceptance: 50 turns at capacity 256 with the streaming policy; memory flat, turn 50 within
    1.5x of turn 2 (each turn: a same-size question, 16 generated tokens)."""
    s = llm.chat_session(kv=KVConfig(capacity=256, policy="streaming", sinks=4), max_tokens=16, ignore_eos=True)
    times, rss, lengths = [], [], []
    for turn in range(1, 51):
        t0 = time.perf_counter()
        r = s.send(f"Question {turn:02d}: name an animal.", stream=False)
        times.append(time.perf_counter() - t0)
        assert len(r.tokens) == 16
        rss.append(rss_bytes())
        lengths.append(s.kv_stats()["length"])
    stats = s.kv_stats()
    assert stats["evicted_total"] > 0 and max(lengths) == 256 == stats["capacity"]
    assert len(s.tokens) > 4 * 256
    growth = rss[-1] - rss[4]
    t2, t50 = times[1], times[49]
    early, late = float(np.median(times[1:6])), float(np.median(times[45:50]))
    print(f"\n50-turn chat: turn 2 {t2 * 1000:.0f} ms, turn 50 {t50 * 1000:.0f} ms (ratio {t50 / t2:.2f}); "
          f"median turns 2-6 {early * 1000:.0f} ms, 46-50 {late * 1000:.0f} ms (ratio {late / early:.2f}); "
          f"RSS turn 5 -> 50: {growth / 1e6:+.1f} MB; tokens seen {len(s.tokens)}, KV length {stats['length']}")
    assert growth < 16e6
    # single turns are noisy on a shared machine: the medians carry the assertion
    assert late <= 1.5 * early


def test_gemma_fallback_template_session(gemma3_path):
    """Gemma 3's GGUF has no chat template: the fallback (Gemma's turn format) renders it, BOS comes
    from the tokenizer, and later turns still prefill only what is new."""
    llm = ringllm.LLM(gemma3_path, n_threads=1, progress=False)
    assert llm.chat_template is None
    s = llm.chat_session(max_tokens=8)
    s.send("What is the capital of France?", stream=False)
    assert s.tokens[0] == llm.tokenizer.bos_id and s.tokens.count(llm.tokenizer.bos_id) == 1
    delta = s._turn_delta({"role": "user", "content": "And Spain?"})
    assert delta == "<end_of_turn>\n<start_of_turn>user\nAnd Spain?<end_of_turn>\n<start_of_turn>model\n"
    g = s.send("And Spain?")
    list(g)
    assert g.prompt_tokens <= len(llm.tokenize(delta, add_bos=False)) + 1     # + an answer token not yet fed
    canonical = llm.chat_ids(llm.render_chat(s.messages[:-1], add_generation_prompt=True))
    assert s.tokens[:len(canonical)] == canonical


def test_session_chat_template_kwargs_reach_every_turn_and_the_file(llm, tmp_path):
    """A session's chat_template_kwargs render its first prompt and each turn's delta (Qwen3's
    enable_thinking=False writes an empty think block after every generation prompt), and are
    saved and loaded with it."""
    from pathlib import Path
    qwen3 = (Path(__file__).parent / "data" / "chat_templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
    saved = llm.chat_template
    llm.chat_template = qwen3
    try:
        s = llm.chat_session(chat_template_kwargs={"enable_thinking": False}, seed=1)
        first = s.send("Hi", max_tokens=4, ignore_eos=True, stream=False)
        prompt = llm.render_chat(s.messages[:1], enable_thinking=False)
        assert prompt.endswith("<think>\n\n</think>\n\n")
        assert first.prompt_tokens == len(llm.chat_ids(prompt))
        assert s._turn_delta({"role": "user", "content": "More"}).endswith(
            "<|im_start|>user\nMore<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
        b = ChatSession.load(llm, s.save(tmp_path / "kw.session"))
        assert b.chat_template_kwargs == {"enable_thinking": False}
        with pytest.raises(ConfigError, match="cannot set"):
            llm.chat_session(chat_template_kwargs={"bos_token": "x"})
    finally:
        llm.chat_template = saved


def test_bounded_history_keeps_the_last_tokens_and_exchange(llm, tmp_path):
    """history_tokens=N: the session keeps the last N tokens and the system message with the last
    exchange; the answers are those of a session keeping everything (greedy, no penalties: the
    history is not read), a save of it round-trips (n_fed counts every token), and the saved file
    stops growing once the history is full."""
    kv = KVConfig(capacity=96, policy="streaming", sinks=4)
    questions = ["Write one sentence about cats.", "Now one about dogs.", "And birds?", "And fish?", "And frogs?"]
    full = llm.chat_session(system="Be brief.", kv=kv, seed=3, max_tokens=16)
    bounded = llm.chat_session(system="Be brief.", kv=kv, seed=3, max_tokens=16, history_tokens=40)
    sizes = []
    for k, q in enumerate(questions):
        assert bounded.send(q, stream=False).tokens == full.send(q, stream=False).tokens
        assert bounded.tokens == full.tokens[-40:] and bounded.n_fed == full.n_fed == len(full.tokens)
        assert bounded.messages == full.messages[:1] + full.messages[-2:]
        sizes.append(os.path.getsize(bounded.save(tmp_path / f"b{k}.session")))
    assert len(full.messages) == 1 + 2 * len(questions) and bounded.store.n_seen == bounded.n_fed
    assert max(sizes[2:]) - min(sizes[2:]) < 0.02 * sizes[-1], sizes   # the store is full, the history bounded
    b = ChatSession.load(llm, tmp_path / f"b{len(questions) - 1}.session")
    assert (b.history_tokens, b.n_fed, b.tokens, b.messages) == (40, bounded.n_fed, bounded.tokens, bounded.messages)
    assert b.send("And cows?", stream=False).tokens == full.send("And cows?", stream=False).tokens
    with pytest.raises(ConfigError, match="history_tokens"):
        llm.chat_session(history_tokens=0)


def test_quantized_kv_session_saves_and_converts(llm, tmp_path):
    """A session with a q8_0 store saves and restores token-identically, keeping its types; loaded with
    kv_types=(f32, f32) its store is converted (rows decoded) and it says so; a bad type is a ConfigError."""
    kv = KVConfig(capacity=64, policy="streaming", sinks=4, k_type="q8_0", v_type="q8_0")
    a = llm.chat_session(kv=kv, seed=5, max_tokens=12)
    a.send("Name three colours.", stream=False)
    path = a.save(tmp_path / "q8.session")
    cont_a = a.send("And two fruits?", stream=False).tokens
    b = ChatSession.load(llm, path)
    assert b.kv == kv and b.store.k[0].dtype == np.int8 and b.saved_kv_types == ("q8_0", "q8_0")
    assert b.send("And two fruits?", stream=False).tokens == cont_a
    c = ChatSession.load(llm, path, kv_types=("f32", "f32"))
    assert (c.kv.k_type, c.kv.v_type) == ("f32", "f32") and c.store.k[0].dtype == np.float32
    assert c.saved_kv_types == ("q8_0", "q8_0")
    assert c.store.n_seen == c.n_fed
    c.send("And two fruits?", stream=False)                  # the converted store decodes on
    with pytest.raises(ConfigError, match="k_type 'q3' unknown"):
        ChatSession.load(llm, path, kv_types=("q3", "f32"))


def test_q4_0_session_keeps_its_rows(llm, tmp_path):
    """A q4_0 store (rows of the blocks' rotation) saves and loads byte for byte: the file says the
    rows are rotated, so loading never takes them for the older unrotated form and rounds them again."""
    kv = KVConfig(capacity=64, policy="streaming", sinks=4, k_type="q4_0", v_type="q4_0")
    a = llm.chat_session(kv=kv, seed=5, max_tokens=12)
    a.send("Name three colours.", stream=False)
    b = ChatSession.load(llm, a.save(tmp_path / "q4.session"))
    assert b.store.k[0].dtype == np.uint8 and b.saved_kv_types == ("q4_0", "q4_0")
    for name in ("k", "v"):
        for mine, theirs in zip(getattr(a.store, name), getattr(b.store, name)):
            np.testing.assert_array_equal(mine, theirs)
    assert b.send("And two fruits?", stream=False).tokens == a.send("And two fruits?", stream=False).tokens
