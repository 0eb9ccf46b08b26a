"""`ringllm serve` as a deployed server: the prompt cache across requests (a multi-turn chat
prefills only each turn's new tokens and answers exactly as without the cache, under several
policies), per-request KV settings, GET /metrics, GET /v1/config, model aliases and
--strict-model. A real server process on a loopback port."""
from __future__ import annotations

import json
import re

import pytest

httpx = pytest.importorskip("httpx")

from ringllm.server_process import running_server  # noqa: E402


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve_cache") / "serve.log"
    with running_server(["-m", smollm2_path, "-t", "1", "--no-progress", "--log-level", "warning",
                         "--model-name", "smol", "--model-alias", "gpt-4o-mini", "--strict-model",
                         "--cache-mb", "256"], log) as url:
        yield url


def _chat(server, messages, **kw) -> dict:
    body = {"model": "smol", "messages": messages, "max_tokens": 24, "temperature": 0, **kw}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


USER_TURNS = ["Tell me about the sea in two sentences.", "Now about mountains.", "Which of the two is older?",
              "Say it as a haiku.", "Thank you. One word to sum up?"]


def _conversation(server, kv=None, cache=True) -> list[dict]:
    """Five chat turns, each request carrying the whole conversation so far (as an OpenAI client
    does); returns every response."""
    messages = [{"role": "system", "content": "You are a concise assistant."}]
    out = []
    extra = {"cache_prompt": cache, **({"kv": kv} if kv else {})}
    for text in USER_TURNS:
        messages.append({"role": "user", "content": text})
        r = _chat(server, messages, **extra)
        out.append(r)
        messages.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
    return out


@pytest.mark.parametrize("kv", [None, {"policy": "streaming", "capacity": 96, "sinks": 4},
                                {"policy": "h2o", "capacity": 96, "sinks": 4}], ids=["full", "streaming", "h2o"])
def test_a_five_turn_chat_prefills_only_new_tokens_and_answers_as_without_the_cache(server, kv):
    cached = _conversation(server, kv)
    fresh = _conversation(server, kv, cache=False)
    assert [r["choices"][0]["message"]["content"] for r in cached] == \
           [r["choices"][0]["message"]["content"] for r in fresh]
    for turn, (c, f) in enumerate(zip(cached, fresh)):
        assert c["usage"]["prompt_tokens"] == f["usage"]["prompt_tokens"]
        assert f["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        hit = c["usage"]["prompt_tokens_details"]["cached_tokens"]
        # every later turn reuses the whole previous request (prompt and answer) but a few tokens
        # at the seam (the template closing the answer, the re-tokenized last answer)
        if turn:
            prev = cached[turn - 1]["usage"]
            assert hit >= prev["prompt_tokens"] + prev["completion_tokens"] - 4, (turn, hit, prev)
            assert c["timings"]["prompt_tokens"] == c["usage"]["prompt_tokens"] - hit
        assert c["kv_stats"]["policy"] == (kv or {}).get("policy", "full")
        assert c["kv_stats"]["tokens_seen"] == f["kv_stats"]["tokens_seen"]
        assert c["kv_stats"]["evicted_total"] == f["kv_stats"]["evicted_total"]


def test_streamed_answers_carry_timings_kv_stats_and_cached_tokens(server):
    messages = [{"role": "user", "content": "Count to five."}]
    _chat(server, messages)
    body = {"model": "gpt-4o-mini", "messages": messages + [{"role": "assistant", "content": "1 2 3 4 5"},
                                                             {"role": "user", "content": "And back?"}],
            "max_tokens": 8, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "kv": {"policy": "streaming", "capacity": 64}}
    chunks = []
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    last = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    assert last["model"] == "smol" and last["kv_stats"]["policy"] == "streaming"
    assert last["kv_stats"]["capacity"] == 64 and last["timings"]["gen_tokens"] >= 1
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0       # another KVConfig: nothing to reuse


def test_metrics_are_prometheus_text(server):
    _chat(server, [{"role": "user", "content": "Hi"}], max_tokens=4)
    r = httpx.get(server + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text

    def value(name: str) -> float:
        m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
        assert m, name
        return float(m.group(1))

    assert value('ringllm_requests_total{outcome="completed"}') >= 1
    assert value("ringllm_completion_tokens_total") >= 4
    assert value("ringllm_prompt_tokens_total") >= value("ringllm_prompt_tokens_cached_total")
    assert value("ringllm_time_to_first_token_seconds_count") >= 1
    assert value("ringllm_inter_token_seconds_count") >= 3
    assert value("ringllm_batch_size_count") >= 3
    assert value("ringllm_queue_depth") == 0 and value("ringllm_active_requests") == 0
    assert value("ringllm_prompt_cache_entries") >= 1 and value("ringllm_prompt_cache_bytes") > 0
    assert value("ringllm_prompt_cache_bytes") <= 256 * 2 ** 20
    assert "ringllm_kv_evictions_total" in text and value("process_resident_memory_bytes") > 1e7
    assert 'ringllm_time_to_first_token_seconds_bucket{le="+Inf"}' in text


def test_config_aliases_and_strict_model(server):
    cfg = httpx.get(server + "/v1/config", timeout=10).json()
    assert cfg["model"] == "smol" and cfg["aliases"] == ["gpt-4o-mini"] and cfg["strict_model"] is True
    assert "h2o" in cfg["policies"] and cfg["kv"]["policy"] == "full" and cfg["n_ctx"] > 0
    assert cfg["prompt_cache"]["max_bytes"] == 256 * 2 ** 20
    assert _chat(server, [{"role": "user", "content": "Hi"}], model="gpt-4o-mini", max_tokens=2)["model"] == "smol"
    r = httpx.post(server + "/v1/chat/completions", json={"model": "gpt-9", "messages": [
        {"role": "user", "content": "Hi"}]}, timeout=30)
    assert r.status_code == 404 and "gpt-9" in r.json()["error"]["message"]


def test_no_webui_leaves_only_the_api(smollm2_path):
    """--no-webui: / is 404, the API is unchanged (an in-process app: the flag only decides a route)."""
    from fastapi.testclient import TestClient

    import ringllm
    from ringllm.server import ServerSettings, create_app

    llm = ringllm.LLM(smollm2_path)
    with TestClient(create_app(llm, ServerSettings(web_ui=False))) as c:
        assert c.get("/").status_code == 404 and c.get("/v1/models").status_code == 200
    with TestClient(create_app(llm, ServerSettings())) as c:
        assert c.get("/").status_code == 200
