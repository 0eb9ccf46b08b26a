"""The chat page `ringllm serve` answers at `/` (pyengine/web, ringllm.server_page).

First without a browser: the files and their content types, headers and the absence of anything
fetched from elsewhere. Then end to end in headless Chromium (Debian's `chromium` driven by
Playwright's Python client, never Playwright's own browser download) against a real `ringllm
serve` with an API key: the page asks for the key, an answer streams in with its tokens/s and
kv_stats, Stop ends one mid-way (and the server counts it cancelled), a KV policy chosen on the
page reaches the server, the prompt tokens the server's cache held are shown (and the cache can be
refused), the conversation survives a reload, a server error is shown.

The browser tests share one page, in file order: each continues the conversation of the last.
"""
from __future__ import annotations

import json
import os
import re
import time

import pytest

from ringllm.server_page import HEADERS, PAGE_FILES, WEB_DIR, install_chat_page

CHROMIUM = os.environ.get("RINGLLM_CHROMIUM", "/usr/bin/chromium")
KEY = "sk-chat-page-test"


# ------------------------------------------------------------------------------------------------
# Without a browser
# ------------------------------------------------------------------------------------------------

def test_page_and_assets_are_served_with_their_types():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    install_chat_page(app)
    client = TestClient(app)
    for path, (name, media_type) in PAGE_FILES.items():
        r = client.get(path)
        assert r.status_code == 200, path
        assert r.headers["content-type"] == media_type
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["content-security-policy"] == HEADERS["Content-Security-Policy"]
        with open(os.path.join(WEB_DIR, name), "rb") as fh:
            assert r.content == fh.read()
        assert client.head(path).status_code == 200
    html = client.get("/").text
    refs = set(re.findall(r'(?:src|href)="([^"]+)"', html))
    assert refs == {"/ui/app.js", "/ui/style.css", "data:,"}       # every file the page loads is served above
    assert "/ui/app.js" in PAGE_FILES and "/ui/style.css" in PAGE_FILES


def test_page_fetches_nothing_from_elsewhere_and_never_writes_html():
    texts = {name: open(os.path.join(WEB_DIR, name), encoding="utf-8").read() for name, _ in PAGE_FILES.values()}
    for name, text in texts.items():
        assert not re.search(r"https?://|//cdn|@import|url\(", text), f"{name} loads something from elsewhere"
    js = texts["app.js"]
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(|new Function", js)
    assert "textContent" in js


def test_setup_ships_the_page_files():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    setup = open(os.path.join(root, "setup.py"), encoding="utf-8").read()
    for name in os.listdir(WEB_DIR):
        ext = name.rsplit(".", 1)[-1]
        assert f'"web/*.{ext}"' in setup, f"setup.py package_data does not ship pyengine/web/{name}"


# ------------------------------------------------------------------------------------------------
# In Chromium, against `ringllm serve`
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM}: `apt-get install chromium` (or set RINGLLM_CHROMIUM to its path)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright's Python client is not installed: "
                                   "`pip install playwright` (its own browser download is not needed)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(browser, smollm2_path, tmp_path_factory):
    from ringllm.server_process import running_server

    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with running_server(["-m", smollm2_path, "--api-key", KEY, "--max-tokens-cap", "2048", "-t", "1",
                         "--no-progress", "--log-level", "warning"], log) as url:
        yield url


@pytest.fixture(scope="module")
def page(browser, server):
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    pg = context.new_page()
    errors = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.goto(server + "/")
    yield pg
    context.close()
    assert not errors, f"script errors on the page: {errors}"


def health(server) -> dict:
    import httpx

    return httpx.get(server + "/health", timeout=10).json()


def server_config(server) -> dict:
    import httpx

    return httpx.get(server + "/v1/config", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()


def set_field(page, field_id: str, value: str) -> None:
    """Fill a settings field as a user would; the page saves settings on change."""
    kind = page.eval_on_selector(f"#{field_id}", "el => el.type")
    if kind == "select-one":
        page.select_option(f"#{field_id}", value)
    elif kind == "checkbox":
        page.set_checked(f"#{field_id}", value == "on")
    else:
        page.fill(f"#{field_id}", value)
    page.dispatch_event(f"#{field_id}", "change")


def watch_answer(page) -> None:
    """Record the length of the last answer's text, and whether Stop is offered, at every change of
    the conversation."""
    page.evaluate("""() => {
        window.__lengths = [];      // the last answer's length at each change
        window.__stop = [];         // whether Stop was offered then
        if (window.__observer) window.__observer.disconnect();
        window.__observer = new MutationObserver(() => {
            const answers = document.querySelectorAll('.msg.assistant .content');
            if (!answers.length) return;
            window.__lengths.push(answers[answers.length - 1].textContent.length);
            window.__stop.push(!document.getElementById('stop').hidden);
        });
        window.__observer.observe(document.getElementById('messages'),
                                  {subtree: true, childList: true, characterData: true});
    }""")


def ask(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def wait_done(page, timeout_s: float = 60) -> None:
    page.wait_for_selector("#send", state="visible", timeout=timeout_s * 1000)


def last_answer(page):
    return page.locator(".msg.assistant").last


def kv_stats(page) -> dict:
    return json.loads(last_answer(page).locator(".meta .kv").get_attribute("title"))


def test_page_asks_for_the_api_key_then_reads_the_config(page, server):
    notice = page.locator("#notice")
    notice.wait_for(state="visible")
    assert "requires an API key" in notice.inner_text()
    assert page.is_hidden("#kv-settings"), "no KV settings before the server has said which it has"
    set_field(page, "api-key", KEY)
    page.wait_for_selector("#kv-settings", state="visible")
    assert page.is_hidden("#notice")
    model = health(server)["model"]
    assert page.inner_text("#model-name") == model
    policies = page.eval_on_selector_all("#kv-policy option", "els => els.map(e => e.value)")
    assert policies[0] == "" and {"full", "streaming", "h2o"} <= set(policies[1:])
    assert page.get_attribute("#max_tokens", "max") == "2048"


def test_answer_streams_with_speed_and_kv_stats(page, server):
    set_field(page, "temperature", "0")
    set_field(page, "max_tokens", "40")
    watch_answer(page)
    ask(page, "Write a short poem about the sea.")
    wait_done(page)
    text = last_answer(page).locator(".content").inner_text()
    lengths = page.evaluate("window.__lengths")
    assert len(text) > 20
    growing = sorted({n for n in lengths if 0 < n < len(text)})
    assert len(growing) >= 3, f"the answer appeared in {len(growing) + 1} pieces, not streamed: {lengths}"
    stop = page.evaluate("window.__stop")
    assert all(shown for n, shown in zip(lengths, stop) if 0 < n < len(text)), "Stop is offered while it streams"
    assert page.is_hidden("#stop")
    speed = last_answer(page).locator(".meta .speed").inner_text()
    m = re.fullmatch(r"(\d+) tokens · ([\d.]+) tok/s", speed)
    assert m and 0 < int(m.group(1)) <= 40 and float(m.group(2)) > 0, speed
    kv = kv_stats(page)
    assert kv["policy"] == "full" and kv["length"] > int(m.group(1))
    n_ctx = server_config(server)["n_ctx"]             # a full store's capacity is the context
    assert last_answer(page).locator(".meta .kv").inner_text().startswith(f"KV full {kv['length']}/{n_ctx}")


def test_stop_ends_an_answer_and_the_server_cancels_it(page, server):
    before = health(server)
    set_field(page, "max_tokens", "2000")
    ask(page, "Count from 1 to 1000, one number per line.")
    page.wait_for_function("""() => {
        const a = document.querySelectorAll('.msg.assistant .content');
        return a[a.length - 1].textContent.length > 40;
    }""", timeout=60_000)
    page.click("#stop")
    wait_done(page, 10)
    stopped = last_answer(page).locator(".content").inner_text()
    time.sleep(1.5)
    assert last_answer(page).locator(".content").inner_text() == stopped, "the answer grew after Stop"
    assert "stopped" in last_answer(page).locator(".meta .finish").inner_text()
    assert page.is_hidden("#stop") and page.is_enabled("#input")
    deadline = time.time() + 20
    while health(server)["cancelled"] == before["cancelled"] and time.time() < deadline:
        time.sleep(0.1)
    after = health(server)
    assert after["cancelled"] == before["cancelled"] + 1 and not after["busy"]
    assert after["completed"] == before["completed"]


def test_kv_policy_chosen_on_the_page_reaches_the_server(page, server):
    n_ctx = server_config(server)["n_ctx"]            # the server's store: full, as large as the context
    assert page.get_attribute("#kv-capacity", "placeholder") == f"{n_ctx} (context)"
    set_field(page, "kv-policy", "streaming")
    assert page.get_attribute("#kv-capacity", "placeholder") == "needed by streaming"
    set_field(page, "kv-capacity", "64")
    set_field(page, "max_tokens", "16")
    ask(page, "Thank you. Now say hello in French, in one short sentence.")
    wait_done(page)
    kv = kv_stats(page)
    assert kv["policy"] == "streaming" and kv["capacity"] == 64 and kv["length"] <= 64
    assert kv["evicted_total"] > 0, "the conversation is longer than 64 tokens: the streaming store evicted"
    label = last_answer(page).locator(".meta .kv").inner_text()
    assert label.startswith(f"KV streaming {kv['length']}/64 · {kv['tokens_seen'] - kv['length']} tokens evicted")


def test_prompt_tokens_from_the_server_cache_are_shown_and_the_cache_can_be_refused(page):
    ask(page, "And in Spanish?")
    wait_done(page)
    prompt = last_answer(page).locator(".meta .prompt").inner_text()
    m = re.fullmatch(r"prompt (\d+) tok \((\d+) from cache\) · (\d+) prefilled in [\d.]+ s, [\d.]+ tok/s", prompt)
    assert m, prompt
    total, cached, prefilled = map(int, m.groups())
    assert cached > 0 and total == cached + prefilled
    assert kv_stats(page)["policy"] == "streaming"
    set_field(page, "cache-prompt", "off")             # cache_prompt: false, the whole prompt prefilled again
    ask(page, "And in German?")
    wait_done(page)
    prompt = last_answer(page).locator(".meta .prompt").inner_text()
    m = re.fullmatch(r"prompt (\d+) tok in [\d.]+ s, [\d.]+ tok/s", prompt)
    assert m and int(m.group(1)) > total, prompt


def test_conversation_and_settings_survive_a_reload(page):
    before = page.eval_on_selector_all(".msg", "els => els.map(e => [e.className, e.innerText])")
    assert len(before) == 10
    page.reload()
    page.wait_for_selector("#kv-settings", state="visible")
    after = page.eval_on_selector_all(".msg", "els => els.map(e => [e.className, e.innerText])")
    assert after == before
    assert page.input_value("#kv-policy") == "streaming" and page.input_value("#kv-capacity") == "64"
    assert not page.is_checked("#cache-prompt")
    assert page.input_value("#api-key") == KEY            # kept for the tab's session
    assert page.locator("#chat-list li").count() == 1


def test_server_errors_are_shown(page):
    set_field(page, "kv-sinks", "64")               # sinks must leave the streaming store a free slot
    ask(page, "Hello?")
    wait_done(page)
    error = last_answer(page).locator(".meta .error").inner_text()
    assert error.startswith("Error 400: ") and "sinks" in error and "capacity" in error
    page.click("#reset-settings")
    assert page.input_value("#kv-policy") == "" and page.input_value("#max_tokens") == ""
    assert page.is_checked("#cache-prompt")
