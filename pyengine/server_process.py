"""`ringllm serve` as a real child process on a free loopback port: for tests and benchmarks that
drive the server as its clients do (HTTP over loopback), and for applications' own integration tests.

    with running_server(["-m", "model.gguf", "--log-level", "warning"], "serve.log") as url:
        httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 8})
"""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from contextlib import contextmanager


__all__ = ["free_port", "running_server"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(args: list[str], log_path, timeout_s: float = 180):
    """Start `python -m ringllm serve ARGS --port P` (output to log_path), wait for /health, yield
    its base URL, stop it at the end."""
    import httpx        # the test extra's client: only what drives a server needs it
    port = free_port()
    fh = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "ringllm", "serve", *args, "--port", str(port)],
                            stdout=fh, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {open(log_path).read()}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"server did not start: {open(log_path).read()}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        fh.close()
