"""`ringllm serve` as the real program on a free loopback port, for the server tests."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(args: list[str], log_path, timeout_s: float = 180):
    """Start `python -m ringllm serve ARGS --port P` (output to log_path), wait for /health, yield
    its base URL, stop it at the end."""
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
