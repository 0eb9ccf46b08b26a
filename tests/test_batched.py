"""Batched decode (CPUEngine.step_batch) against one-sequence decode (CPUEngine.step).

B sequences with their own stores (different capacities, policies, positions and lengths) advance
together; sequences join and leave between steps. The batch runs the projections through the
matrix-matrix kernels of chunked prefill, decode through the matvec kernels. For quantized GGUF
weights (SmolLM2, Q4_1/Q8_0 blocks) both accumulate in the same order: the logits are bit-identical
(measured max |diff| 0 over 600 rows). For float32 weights (the tiny random model) the matmul
path rounds differently: measured max |diff| 1.1e-6 of max |logit| (50 steps), bounded here at
1e-5 of max |logit| per row. Greedy tokens are the same, and every store holds the same survivors
as its one-sequence twin. BatchDecoder (ringllm.batch) gives each sequence exactly what
LLM.generate gives it alone.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import novel_text as _novel_text

from ringllm.models.loader import load_model
from ringllm.runtime.engine import CPUEngine
from ringllm.runtime.errors import ConfigError, RingLLMError
from ringllm.runtime.kv_config import KVConfig

TINY_TOL = 1e-5        # float32 weights: |batched - alone| <= TINY_TOL * max |logit| (rounding)

CONFIGS = [KVConfig(capacity=32, policy="streaming", sinks=4),
           KVConfig(capacity=48, policy="h2o", sinks=2),
           KVConfig(capacity=24, policy="snapkv", sinks=2, window=4, positions="original"),
           KVConfig(capacity=40, policy="adakv", sinks=2, window=4)]


def _same_stores(a, b) -> None:
    for il in range(len(a.seq)):
        np.testing.assert_array_equal(a.count[il], b.count[il])
        for h in range(a.seq[il].shape[0]):
            n = int(a.count[il][h])
            np.testing.assert_array_equal(np.sort(a.seq[il][h, :n]), np.sort(b.seq[il][h, :n]))


def _batch_vs_alone(eng, prompts, n_steps, tol, join_at=None, leave_at=None):
    """Greedy decode of len(prompts) sequences (config i % len(CONFIGS)), batched and alone; every
    row within tol * max |logit| (tol 0: bit-identical). join_at: {i: step} sequence i enters the
    batch at that step; leave_at: {i: step} it leaves. Returns (batched stores, max relative diff)."""
    join_at, leave_at = join_at or {}, leave_at or {}
    n = len(prompts)
    cfg = [CONFIGS[i % len(CONFIGS)] for i in range(n)]
    alone = [eng.new_store(c) for c in cfg]
    batch = [eng.new_store(c) for c in cfg]
    next_alone = [int(np.argmax(eng.prefill(p, st))) for p, st in zip(prompts, alone)]
    next_batch = [int(np.argmax(eng.prefill(p, st))) for p, st in zip(prompts, batch)]
    assert next_alone == next_batch
    worst = 0.0
    for step in range(n_steps):
        active = [i for i in range(n) if join_at.get(i, 0) <= step < leave_at.get(i, n_steps)]
        logits = eng.step_batch([next_batch[i] for i in active], [batch[i] for i in active])
        for row, i in enumerate(active):
            want = eng.step(next_alone[i], alone[i]).copy()
            diff = float(np.abs(logits[row] - want).max()) / float(np.abs(want).max())
            worst = max(worst, diff)
            assert diff <= tol, f"sequence {i} step {step}: max |diff| {diff:.2e} of max |logit|"
            next_alone[i], next_batch[i] = int(np.argmax(want)), int(np.argmax(logits[row]))
            assert next_alone[i] == next_batch[i], f"sequence {i} step {step}"
    for a, b in zip(alone, batch):
        assert a.n_seen == b.n_seen
        _same_stores(a, b)
    return batch, worst


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    pytest.importorskip("transformers")
    from tiny_checkpoints import build_tiny

    d = str(tmp_path_factory.mktemp("llama"))
    build_tiny("llama", d)
    return load_model(d, tokenizer=False)


def test_tiny_batch_equals_alone_with_join_and_leave(tiny_llama):
    eng = CPUEngine(tiny_llama.spec, tiny_llama.tensors, n_batch=16)
    rng = np.random.default_rng(0)
    prompts = [rng.permutation(256)[:L].tolist() for L in (5, 40, 17, 60, 9)]
    stores, worst = _batch_vs_alone(eng, prompts, 50, TINY_TOL, join_at={3: 10}, leave_at={1: 30})
    print(f"\ntiny float32 model: max |batched - alone| = {worst:.2e} of max |logit|")
    assert all(st.stats()["evicted_total"] > 0 for st in stores)


def test_step_batch_bad_input(tiny_llama):
    eng = CPUEngine(tiny_llama.spec, tiny_llama.tensors)
    a, b = eng.new_store(capacity=8, policy="streaming"), eng.new_store(capacity=8, policy="streaming")
    with pytest.raises(ConfigError, match="one token per store"):
        eng.step_batch([1, 2, 3], [a, b])
    with pytest.raises(ConfigError, match="appears twice"):
        eng.step_batch([1, 2], [a, a])
    with pytest.raises(ConfigError, match="token ids"):
        eng.step_batch([1, 10 ** 6], [a, b])
    assert a.n_seen == b.n_seen == 0          # nothing was written by the refused calls


def test_smollm2_batch_of_four(smollm2_path):
    from conftest import novel_text

    loaded = load_model(smollm2_path)
    eng = CPUEngine(loaded.spec, loaded.tensors)
    text = novel_text()
    prompts = [loaded.tokenizer.encode(text[5000 * i:5000 * i + 800])[:L] for i, L in enumerate((60, 20, 90, 45))]
    _, worst = _batch_vs_alone(eng, prompts, 40, 0.0, join_at={2: 5}, leave_at={0: 25})
    assert worst == 0.0                   # quantized weights: the same kernels, bit-identical


# ---------------------------------------------------------------------------------------------- BatchDecoder

@pytest.fixture(scope="module")
def llm(smollm2_path):
    from ringllm.llm import LLM

    return LLM(smollm2_path, kv=KVConfig(capacity=64, policy="streaming", sinks=4), progress=False)


def test_batch_decoder_gives_each_sequence_what_it_gets_alone(llm):
    """Five generations (greedy, stop string, seeded sampling with penalties, max_tokens 0) join a
    BatchDecoder at different steps, one leaves early; each streams what LLM.generate streams alone,
    its store evicting past capacity 64."""
    from ringllm.batch import BatchDecoder

    reqs = [("Once upon a time", dict(max_tokens=90, ignore_eos=True)),
            ("The capital of France is", dict(max_tokens=20, stop=["."])),
            ("Count: 1, 2, 3,", dict(max_tokens=30, temperature=0.8, seed=7, ignore_eos=True)),
            ("Pride and Prejudice", dict(max_tokens=0)),
            ("A list of fruits: apple,", dict(max_tokens=40, temperature=0.7, top_k=20, seed=3, repeat_penalty=1.1))]
    alone = [list(llm.generate(p, **kw)) for p, kw in reqs]
    join_at, leave_at = {0: 0, 1: 0, 2: 5, 3: 7, 4: 12}, {0: 70}
    batch = BatchDecoder(llm, max_batch=4)
    got: dict[int, list] = {i: [] for i in range(len(reqs))}
    decs, step = {}, 0
    while step < 200 and (batch.active or len(decs) < len(reqs)):
        for i, at in join_at.items():
            if at == step:
                decs[i] = llm.decoder(reqs[i][0], **reqs[i][1])
                assert batch.join(decs[i], tag=i) == (i != 3)       # max_tokens 0 ends at its prefill
        if leave_at.get(0) == step:
            assert batch.leave(0) is decs[0]
        assert batch.active <= 4
        for tag, chunk in batch.step() if batch.active else []:
            got[tag].append(chunk)
        step += 1
    for i, want in enumerate(alone):
        have = got[i]
        if i == 0:                                       # left after 70 steps: a prefix of the whole
            assert len(have) == 70 and decs[0].record.finish_reason is None
            want = want[:70]
        assert [c.token for c in have] == [c.token for c in want], i
        assert [c.text for c in have] == [c.text for c in want], i
        assert [c.finish_reason for c in have] == [c.finish_reason for c in want], i
        assert decs[i].record.text == "".join(c.text for c in have)
    assert decs[0].store.stats()["evicted_total"] > 0


@pytest.fixture(scope="module")
def novel_text():
    return _novel_text()


def test_a_long_prompt_goes_in_by_chunks_between_the_running_streams_steps(llm, novel_text):
    """admit() + prefill_step(64): a 300-token prompt enters in five chunks while a running stream
    gets a token after each one; both generate what they generate alone (the prompt's chunks are
    the engine's own 64-row chunks, so its store is the one a whole prefill gives)."""
    from ringllm.batch import BatchDecoder

    long_prompt = llm.tokenize(novel_text[:3000])[:300]
    want_long = [c.token for c in llm.generate(long_prompt, max_tokens=12, ignore_eos=True)]
    want_run = [c.token for c in llm.generate("Once upon a time", max_tokens=30, ignore_eos=True)]
    batch = BatchDecoder(llm, max_batch=2)
    assert batch.join(llm.decoder("Once upon a time", max_tokens=30, ignore_eos=True), tag="run")
    got = {"run": [], "long": []}
    for tag, chunk in batch.step():
        got[tag].append(chunk.token)
    long_dec = llm.decoder(long_prompt, max_tokens=12, ignore_eos=True)
    batch.admit(long_dec, tag="long")
    assert batch.prefilling == 1 and batch.full and "long" in batch
    chunks, tokens_meanwhile = 0, 0
    while batch.prefilling:
        done = batch.prefill_step(64)
        chunks += 1
        assert (done is None) == (chunks < 5)
        if done is None:
            for tag, chunk in batch.step():
                got[tag].append(chunk.token)
                tokens_meanwhile += 1
    assert done == ("long", long_dec, True) and tokens_meanwhile == 4
    while batch.active:
        for tag, chunk in batch.step():
            got[tag].append(chunk.token)
    assert got["run"] == want_run and got["long"] == want_long
    assert long_dec.record.timings.prompt_tokens == 300


def test_batch_decoder_refuses_misuse(llm):
    from ringllm.batch import BatchDecoder

    batch = BatchDecoder(llm, max_batch=1)
    assert batch.join(llm.decoder("Hi", max_tokens=3, ignore_eos=True), tag="a")
    with pytest.raises(ConfigError, match="full"):
        batch.join(llm.decoder("Hi", max_tokens=3), tag="b")
    with pytest.raises(ConfigError, match="unknown sampling"):
        llm.decoder("Hi", temprature=0.5)
    with pytest.raises(ConfigError, match="max_batch"):
        BatchDecoder(llm, max_batch=0)
    dec = llm.decoder("Hi", max_tokens=3)
    with pytest.raises(RingLLMError, match="out of turn"):
        dec.feed()                                       # before prefill()
