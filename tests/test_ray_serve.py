"""`ringllm serve --ray`: two engine replicas on a local Ray instance (1 CPU each), loopback only.
The official openai client gets the answers of a plain server; a 5-turn chat stays on one replica
(by its `user`, and by its prompt prefix alone); a replica SIGKILLed mid-stream costs only its own
stream, which ends with an error event, while the other replica's stream completes, and the service
answers again; stopping the server leaves no Ray process. Skipped where Ray Serve is not installed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'ringllm[ray]')")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import ringllm  # noqa: E402
from ringllm.server_process import running_server  # noqa: E402

pytestmark = pytest.mark.slow


def _ray_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in out if any(k in line for k in ("raylet", "gcs_server", "ray::"))]


@pytest.fixture(scope="module")
def cluster(smollm2_path, tmp_path_factory):
    if _ray_processes():
        pytest.skip("another Ray instance is running on this machine")
    log = tmp_path_factory.mktemp("ray") / "serve.log"
    with running_server(["--ray", "--replicas", "2", "-t", "1", "-m", smollm2_path, "--model-name", "smol",
                         "--log-level", "warning", "--no-progress"], log, timeout_s=300) as url:
        yield url
    deadline = time.time() + 60
    while _ray_processes() and time.time() < deadline:
        time.sleep(1)
    assert not _ray_processes(), "stopping `serve --ray` left Ray processes behind"


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return ringllm.LLM(smollm2_path)


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_answers_equal_a_plain_server(cluster, llm):
    messages = [{"role": "user", "content": "Name three colors."}]
    r = _client(cluster).chat.completions.create(model="smol", messages=messages, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == llm.chat(messages, max_tokens=24, temperature=0.0).text
    assert r.system_fingerprint and r.system_fingerprint.startswith("ringllm-")
    c = _client(cluster).completions.create(model="smol", prompt="The capital of France is", max_tokens=8,
                                            temperature=0)
    assert c.choices[0].text == llm.complete("The capital of France is", max_tokens=8, temperature=0.0).text


@pytest.mark.parametrize("key", [{"user": "alice"}, {}], ids=["user", "prefix"])
def test_a_five_turn_chat_stays_on_one_replica(cluster, key):
    client = _client(cluster)
    messages = [{"role": "system", "content": f"You are terse. Conversation {time.time()}."}]
    served, cached = set(), []
    for text in ["Hello!", "What is the sea?", "And a lake?", "Which is bigger?", "Thanks, bye."]:
        messages.append({"role": "user", "content": text})
        r = client.chat.completions.create(model="smol", messages=messages, max_tokens=16, temperature=0,
                                           extra_body=key or None)
        served.add(r.system_fingerprint)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    assert len(served) == 1, served
    assert all(c > 0 for c in cached[1:]), cached          # every follow-up continued its cached store


def _stream(url, body, out: dict, name: str):
    events = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
            out[name + "_status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
    except httpx.HTTPError as exc:
        out[name + "_exc"] = repr(exc)
    out[name] = events


def test_a_killed_replica_costs_only_its_own_stream(cluster):
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    # two sessions that Ray places on the two replicas
    where = {}
    for i in range(40):
        r = httpx.post(cluster + "/v1/completions", json={**body, "max_tokens": 1, "session_id": f"s{i}"}, timeout=120)
        where.setdefault(r.json()["system_fingerprint"], f"s{i}")
        if len(where) == 2:
            break
    assert len(where) == 2, where
    (victim_name, victim), (survivor_name, survivor) = sorted(where.items())
    out: dict = {}
    threads = [threading.Thread(target=_stream, args=(cluster, {**body, "session_id": s}, out, s))
               for s in (victim, survivor)]
    for t in threads:
        t.start()
    time.sleep(3)                                         # both streams are producing tokens
    pids = [int(line.split()[0]) for line in _ray_processes() if "ringllm-replica" in line]
    assert len(pids) == 2, _ray_processes()
    # the victim's pid: ask its replica (session affinity routes the query there)
    stats = httpx.get(cluster + "/v1/replicas", timeout=30).json()["replica"]
    pid = stats["pid"] if stats["name"] == victim_name else next(p for p in pids if p != stats["pid"])
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(300)
    v, s = out[victim], out[survivor]
    assert v and "error" in v[-1] and "retry" in v[-1]["error"]["message"], v[-1:]
    assert s and s[-1].get("choices") is not None
    assert sum(len(e["choices"][0]["text"]) > 0 for e in s if e.get("choices")) >= 300       # it went on to the end
    assert any(e["choices"] and e["choices"][0]["finish_reason"] == "length" for e in s)
    r = httpx.post(cluster + "/v1/completions", json={**body, "max_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text                   # the service answers meanwhile
    deadline = time.time() + 90                           # and Ray Serve brings a second replica back
    while len([line for line in _ray_processes() if "ringllm-replica" in line and str(pid) not in line]) < 2:
        assert time.time() < deadline, _ray_processes()
        time.sleep(2)
    names = set()
    while len(names) < 2:                                 # ... that serves requests
        assert time.time() < deadline, names
        r = httpx.post(cluster + "/v1/completions", json={**body, "max_tokens": 1, "session_id": str(time.time())},
                       timeout=120)
        names.add(r.json()["system_fingerprint"])
    assert victim_name not in names


def test_without_ray_the_flag_names_the_extra(tmp_path):
    """--ray where Ray Serve cannot be imported: a clear message naming the extra (run with a
    Python path that hides the ray package)."""
    hide = tmp_path / "ray"
    hide.mkdir()
    (hide / "__init__.py").write_text("raise ImportError('hidden for this test')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([os.sys.executable, "-m", "ringllm", "serve", "--ray"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode != 0 and "ringllm[ray]" in r.stderr, r.stderr[-500:]
