"""Moved to ringllm.server_process (kept for test modules that still import it from here)."""
from ringllm.server_process import free_port, running_server  # noqa: F401
