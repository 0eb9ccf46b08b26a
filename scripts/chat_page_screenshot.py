"""Take docs/chat_page.png (and docs/chat_page_narrow.png): the chat page of a real `ringllm serve`
with the bundled model, two answers with their tokens/s and kv_stats, in headless Chromium.

    python scripts/chat_page_screenshot.py [--out docs] [--chromium /usr/bin/chromium]

Needs what tests/test_chat_page.py needs: Debian's chromium and `pip install playwright`.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from playwright.sync_api import sync_playwright

from ringllm.server_process import running_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

QUESTIONS = ["What is the capital of France? Answer in one sentence.",
             "Show me a Python function that adds two numbers."]


def set_field(page, field_id: str, value: str) -> None:
    if page.eval_on_selector(f"#{field_id}", "el => el.tagName") == "SELECT":
        page.select_option(f"#{field_id}", value)
    else:
        page.fill(f"#{field_id}", value)
    page.dispatch_event(f"#{field_id}", "change")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "docs"))
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args()
    log = os.path.join(tempfile.mkdtemp(), "serve.log")
    with running_server(["-t", "1", "--no-progress", "--log-level", "warning"], log) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(url + "/")
        page.wait_for_selector("#kv-settings", state="visible")
        set_field(page, "system", "You are a concise assistant.")
        set_field(page, "temperature", "0")
        set_field(page, "max_tokens", "96")
        set_field(page, "kv-policy", "streaming")
        set_field(page, "kv-capacity", "64")
        for q in QUESTIONS:
            page.fill("#input", q)
            page.press("#input", "Enter")
            page.wait_for_selector("#send", state="visible", timeout=120_000)
        page.screenshot(path=os.path.join(args.out, "chat_page.png"))
        page.set_viewport_size({"width": 390, "height": 760})
        page.evaluate("() => { const m = document.getElementById('messages'); m.scrollTop = m.scrollHeight; }")
        page.screenshot(path=os.path.join(args.out, "chat_page_narrow.png"))
        browser.close()
    print(f"wrote {args.out}/chat_page.png and chat_page_narrow.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
