"""`ringllm serve` started as the real program on a loopback port, driven by the official `openai`
client and raw httpx: completions, chat, streaming, 20 concurrent streams, a malformed-request
battery, disconnects, auth, limits, OpenAPI."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from ringllm.server_process import running_server  # noqa: E402

KEY = "sk-ringllm-test"
CAP = 256


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with running_server(["-m", smollm2_path, "--api-key", KEY, "--max-tokens-cap", str(CAP), "-t", "1",
                         "--no-progress", "--log-level", "warning"], log) as url:
        yield url


@pytest.fixture(scope="module")
def server_key():
    return KEY


AUTH = {"Authorization": f"Bearer {KEY}"}


def health(server) -> dict:
    r = httpx.get(server + "/health", timeout=10)
    assert r.status_code == 200
    return r.json()


def test_models_and_health(client, server, model_id):
    models = client.models.list().data
    assert [m.id for m in models] == [model_id] and model_id.startswith("SmolLM2-135M")
    assert client.models.retrieve(model_id).id == model_id
    h = health(server)
    assert h["status"] == "ok" and h["model"] == model_id


def test_openai_client_completes(client, model_id):
    r = client.completions.create(model=model_id, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.choices[0].text.startswith(" Paris") and r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens == 5
    stream = client.completions.create(model=model_id, prompt="The capital of France is", max_tokens=8,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == r.choices[0].text


def test_openai_client_chats_and_streams(client, model_id):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a color."}]
    r = client.chat.completions.create(model=model_id, messages=messages, max_tokens=24, temperature=0)
    text = r.choices[0].message.content
    assert text and r.choices[0].message.role == "assistant" and r.usage.total_tokens > r.usage.prompt_tokens
    stream = client.chat.completions.create(model=model_id, messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == text and finish == r.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == r.usage.completion_tokens


def test_seeded_sampling_is_reproducible(client, model_id):
    kw = dict(model=model_id, messages=[{"role": "user", "content": "Tell me a word."}], max_tokens=16,
              temperature=0.9, seed=1234)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def _stream_chat(client, model_id, req) -> str:
    stream = client.chat.completions.create(model=model_id, stream=True, **req)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_twenty_concurrent_streams_match_each_alone(client, model_id, server):
    words = ["cat", "dog", "sun", "tree", "blue", "rain", "star", "fish", "book", "milk",
             "snow", "ship", "bird", "rock", "salt", "wind", "gold", "rose", "lamp", "bell"]
    reqs = []
    for i, w in enumerate(words):
        req = dict(messages=[{"role": "user", "content": f"Write a sentence with the word {w}."}], max_tokens=20)
        req.update(temperature=0) if i % 2 == 0 else req.update(temperature=0.8, seed=i)
        reqs.append(req)
    alone = [_stream_chat(client, model_id, r) for r in reqs]
    before = health(server)["completed"]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=20) as pool:
        together = list(pool.map(lambda r: _stream_chat(client, model_id, r), reqs))
    wall = time.perf_counter() - t0
    print(f"\n20 concurrent streaming chats: {wall:.1f} s wall; all identical to alone: {together == alone}")
    assert together == alone
    assert all(together) and len(set(together)) > 10
    assert health(server)["completed"] - before == 20


def _raw(server, body: bytes | None = None, path="/v1/chat/completions", headers=None, **kw):
    h = {"Content-Type": "application/json", **AUTH, **(headers or {})}
    return httpx.post(server + path, content=body, headers=h, timeout=60, **kw)


def test_malformed_request_battery_gets_4xx_and_the_server_stays_up(server, model_id):
    ok_msgs = [{"role": "user", "content": "hi"}]

    def j(**kw):
        return json.dumps({"model": model_id, "messages": ok_msgs, **kw}).encode()

    def big_chunks():
        yield b'{"model": null, "prompt": "'
        for _ in range(10):
            yield b"a" * (1 << 20)
        yield b'"}'

    cases = [
        ("bad JSON", lambda: _raw(server, b'{"model": "x", "messages": [}'), 400, "not valid JSON"),
        ("not an object", lambda: _raw(server, b'[1, 2, 3]'), 400, "invalid request"),
        ("empty body", lambda: _raw(server, b""), 400, "missing"),
        ("messages wrong type", lambda: _raw(server, j(messages="hello")), 400, "messages"),
        ("content wrong type", lambda: _raw(server, j(messages=[{"role": "user", "content": 5}])), 400, "content"),
        ("bad role", lambda: _raw(server, j(messages=[{"role": "wizard", "content": "x"}])), 400, "role"),
        ("no messages", lambda: _raw(server, j(messages=[])), 400, "messages"),
        ("max_tokens as string", lambda: _raw(server, j(max_tokens="5")), 400, "max_tokens"),
        ("negative max_tokens", lambda: _raw(server, j(max_tokens=-1)), 400, "max_tokens"),
        ("max_tokens over the cap", lambda: _raw(server, j(max_tokens=CAP + 1)), 400, "limit"),
        ("temperature out of range", lambda: _raw(server, j(temperature=5)), 400, "temperature"),
        ("stream not a bool", lambda: _raw(server, j(stream="yes")), 400, "stream"),
        ("n > 1", lambda: _raw(server, j(n=3)), 400, "n"),
        ("bad logit_bias", lambda: _raw(server, j(logit_bias={"abc": 1})), 400, "logit_bias"),
        ("chat_template_kwargs not an object", lambda: _raw(server, j(chat_template_kwargs=[1])), 400,
         "chat_template_kwargs"),
        ("chat_template_kwargs sets a reserved name",
         lambda: _raw(server, j(chat_template_kwargs={"add_generation_prompt": False})), 400, "cannot set"),
        ("unknown field", lambda: _raw(server, j(frobnicate=1)), 400, "unrecognized request argument 'frobnicate'"),
        ("OpenAI field not implemented", lambda: _raw(server, j(top_logprobs=2)), 400, "top_logprobs"),
        ("kv: unknown policy", lambda: _raw(server, j(kv={"policy": "nope", "capacity": 64})), 400, "policy"),
        ("kv: unknown field", lambda: _raw(server, j(kv={"colour": 1})), 400, "colour"),
        ("kv: not an object", lambda: _raw(server, j(kv=[1])), 400, "kv"),
        ("kv: past the context", lambda: _raw(server, j(kv={"policy": "streaming", "capacity": 10 ** 6})), 400,
         "context"),
        ("10 MB body", lambda: _raw(server, b"x" * (10 << 20)), 413, "limit"),
        ("10 MB chunked body", lambda: _raw(server, big_chunks(), path="/v1/completions"), 413, "limit"),
        ("missing key", lambda: httpx.post(server + "/v1/chat/completions", content=j(), timeout=60,
                                           headers={"Content-Type": "application/json"}), 401, "API key"),
        ("wrong key", lambda: _raw(server, j(), headers={"Authorization": "Bearer nope"}), 401, "API key"),
        ("prompt ids out of vocabulary", lambda: _raw(server, json.dumps({"prompt": [1, 10 ** 7]}).encode(),
                                                      path="/v1/completions"), 400, "vocabulary"),
        ("unknown path", lambda: _raw(server, j(), path="/v1/nothing"), 404, ""),
    ]
    for name, call, status, needle in cases:
        r = call()
        assert r.status_code == status, (name, r.status_code, r.text)
        err = r.json()["error"]
        assert needle.lower() in err["message"].lower(), (name, err)
        assert health(server)["status"] == "ok", name
    # and real work still goes through
    r = _raw(server, j(max_tokens=4, temperature=0))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_chat_template_kwargs_are_accepted(server, model_id):
    """chat_template_kwargs (vLLM's and llama-server's extension) reach the template as variables:
    this model's template reads none, so the prompt is the same with or without them."""
    def chat(**kw):
        body = {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "temperature": 0, **kw}
        r = _raw(server, json.dumps(body).encode())
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    assert chat(chat_template_kwargs={"enable_thinking": False, "date_string": "01 Jan 2025"}) == chat()


def test_openai_client_sees_errors(client, model_id):
    with pytest.raises(openai.BadRequestError, match="limit"):
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=CAP * 10)
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_disconnect_mid_stream_frees_the_slot(server, model_id):
    before = health(server)
    body = {"prompt": "Once upon a time", "max_tokens": CAP, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data:")
            if n >= 4:
                break                       # leave with 250 tokens still to go
    deadline = time.time() + 30
    while health(server)["cancelled"] == before["cancelled"] and time.time() < deadline:
        time.sleep(0.1)
    after = health(server)
    assert after["cancelled"] == before["cancelled"] + 1 and not after["busy"]
    assert after["completed"] == before["completed"]
    t0 = time.perf_counter()
    r = httpx.post(server + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=AUTH, timeout=60)
    assert r.status_code == 200 and time.perf_counter() - t0 < 20


def test_queued_requests_are_served_in_turn(server, model_id):
    # three slow requests and a quick one at once: all complete, the queue drains
    def call(n):
        return httpx.post(server + "/v1/completions", headers=AUTH, timeout=120,
                          json={"prompt": "Count:", "max_tokens": n, "ignore_eos": True, "temperature": 0})
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(call, [40, 40, 40, 1]))
    assert [r.status_code for r in results] == [200] * 4
    assert [r.json()["usage"]["completion_tokens"] for r in results] == [40, 40, 40, 1]
    assert health(server)["queued"] == 0


def test_openapi_schema_and_docs(server):
    schema = httpx.get(server + "/openapi.json", timeout=10).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= set(schema["paths"])
    assert "ChatCompletionRequest" in schema["components"]["schemas"]
    assert httpx.get(server + "/docs", timeout=10).status_code == 200


# ---------------------------------------------------------------------------------------------- in-process units

class _BlockingLLM:
    """Stands in for an LLM: decoder() blocks until released (for the queue-full check)."""
    model_name, n_vocab = "fake", 10

    def __init__(self):
        self.release = threading.Event()

    def decoder(self, ids, **kw):
        self.release.wait(10)
        raise RuntimeError("the fake model fails")


def test_full_queue_answers_503():
    import asyncio

    from ringllm.server import APIError, Worker, Job as _Job

    llm = _BlockingLLM()
    w = Worker(llm, queue_size=1)
    loop = asyncio.new_event_loop()
    try:
        jobs = [_Job("completion", [1], {}, loop, asyncio.Queue()) for _ in range(3)]
        w.submit(jobs[0])
        time.sleep(0.2)                    # the worker takes it and blocks
        w.submit(jobs[1])                  # waits in the queue (size 1)
        with pytest.raises(APIError) as exc:
            w.submit(jobs[2])
        assert exc.value.status == 503 and "busy" in exc.value.message
        llm.release.set()
        # the failing model does not kill the worker: both jobs get an error, the worker goes on
        deadline = time.time() + 10
        while w.counters["failed"] < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert w.counters["failed"] == 2 and w._thread.is_alive()
    finally:
        llm.release.set()
        w.stop()
        w._thread.join(5)
        loop.close()
    assert not w._thread.is_alive()


def test_unstreamed_job_gets_its_text_once_with_its_end(smollm2_path):
    """A streamed job gets a chunk event per token; one not streamed (Job.stream False) gets all its
    text as one chunk just before its end, and the same text, so its handler wakes once."""
    import asyncio

    from ringllm.llm import LLM
    from ringllm.server import Worker, Job as _Job

    llm = LLM(smollm2_path, progress=False)
    w = Worker(llm, queue_size=4)
    ids = llm.prompt_ids("The capital of France is")
    params = dict(max_tokens=12, ignore_eos=True, temperature=0.0)

    async def events_of(job):
        out = []
        while not out or out[-1][0] not in ("end", "error"):
            out.append(await asyncio.wait_for(job.events.get(), 120))
        return out

    async def both():
        loop = asyncio.get_running_loop()
        jobs = [_Job("completion", ids, params, loop, asyncio.Queue(), stream=s) for s in (True, False)]
        for job in jobs:
            w.submit(job)
        return await asyncio.gather(*(events_of(j) for j in jobs))

    try:
        streamed, whole = asyncio.run(both())
    finally:
        w.stop()
    assert [e[0] for e in streamed] == ["start"] + ["chunk"] * 12 + ["end"]
    assert [e[0] for e in whole] == ["start", "chunk", "end"]
    assert whole[1][1] == "".join(e[1] for e in streamed[1:-1]) != ""
    assert whole[1][3] == streamed[-2][3] == "length"
    assert whole[-1][2]["completion_tokens"] == streamed[-1][2]["completion_tokens"] == 12


# ---------------------------------------------------------------------------------------------- batched decoding

def _stream_completion(server, body: dict, started: threading.Event | None = None,
                       leave_when: threading.Event | None = None) -> str:
    """The streamed text of a completion. started: set once two chunks have arrived; leave_when:
    disconnect at the first chunk after that event is set."""
    parts = []
    with httpx.stream("POST", server + "/v1/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            choices = json.loads(line[5:])["choices"]
            if choices:
                parts.append(choices[0]["text"])
            if started is not None and len(parts) >= 2:
                started.set()
            if leave_when is not None and leave_when.is_set():
                break
    return "".join(parts)


def _concurrently(*calls):
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(c) for c in calls]
        return [f.result() for f in futures]


def test_two_concurrent_streams_are_batched_and_match_each_alone(server):
    a = {"prompt": "It is a truth universally acknowledged, that", "max_tokens": 48, "ignore_eos": True,
         "temperature": 0}
    b = {"prompt": "The three primary colors are", "max_tokens": 32, "ignore_eos": True, "temperature": 0}
    alone = [_stream_completion(server, a), _stream_completion(server, b)]
    started = threading.Event()
    # b joins once a is streaming: from then on both advance in one batched engine step per token
    together = _concurrently(lambda: _stream_completion(server, a, started=started),
                             lambda: started.wait(60) and _stream_completion(server, b))
    assert together == alone and all(alone)
    assert health(server)["peak_batch"] >= 2


def test_cancelling_one_batched_stream_leaves_the_other_intact(server):
    long = {"prompt": "Once upon a time", "max_tokens": CAP, "ignore_eos": True, "temperature": 0}
    short = {"prompt": "A list of fruits: apple,", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    want = _stream_completion(server, short)
    before = health(server)
    long_started, short_started = threading.Event(), threading.Event()
    # short joins while long streams; long's client leaves once short streams too (both in the batch)
    cut, got = _concurrently(lambda: _stream_completion(server, long, long_started, leave_when=short_started),
                             lambda: long_started.wait(60) and _stream_completion(server, short, short_started))
    assert got == want and cut
    deadline = time.time() + 30
    while health(server)["cancelled"] == before["cancelled"] and time.time() < deadline:
        time.sleep(0.1)
    after = health(server)
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["completed"] == before["completed"] + 1 and after["active"] == 0
