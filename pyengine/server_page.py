"""The chat page `ringllm serve` answers at `/`: static files shipped in the package (pyengine/web/).

    GET /                 web/index.html
    GET /ui/app.js        web/app.js      (vanilla JS: streams /v1/chat/completions, reads /v1/config)
    GET /ui/style.css     web/style.css

No build step and nothing fetched from elsewhere: the three files are read once when the app is
built and answered from memory. The page itself is public (it holds no data); what it calls is
under /v1, behind the server's API key when one is set (the page asks for it on a 401).

Every file goes out with `X-Content-Type-Options: nosniff` and a Content-Security-Policy that
allows this origin's script, style and fetches only: no inline script runs, so even a rendering
mistake could not execute model output (the page writes model text with textContent anyway).
"""
from __future__ import annotations

import os

from fastapi import FastAPI
from fastapi.responses import Response

__all__ = ["PAGE_FILES", "install_chat_page"]

WEB_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "web")

# URL path -> (file in web/, content type)
PAGE_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/style.css": ("style.css", "text/css; charset=utf-8"),
}

HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
}


def install_chat_page(app: FastAPI, settings=None) -> None:
    """Register the chat page's routes on app (settings: the server's, unused today; the page reads
    everything it needs from GET /v1/config)."""
    for path, (name, media_type) in PAGE_FILES.items():
        with open(os.path.join(WEB_DIR, name), "rb") as fh:
            body = fh.read()

        app.api_route(path, methods=["GET", "HEAD"], include_in_schema=False, name=f"chat_page_{name}")(
            _static(body, media_type))


def _static(body: bytes, media_type: str):
    """A handler without parameters (FastAPI would read any as query parameters) answering body."""

    async def handler():
        return Response(body, media_type=media_type, headers=HEADERS)

    return handler
