"""`python -m ringllm.compile_helper`: the second process of a cold start (runtime/compile_share.py).

An LLM that finds the kernel cache empty starts this beside itself (compile_share.start_helper),
with the same model, KV configuration and precision. It builds its own engine for the model and runs a decode
step's kernels attention-first (runtime/warmup.warm_decode; first the one-thread attention, which
the parent's prompt runs until the threaded one is compiled), claiming each kernel it compiles in
the parent's claims directory; the parent, busy with the prompt's matrix products meanwhile, loads
those kernels from the cache when it reaches them instead of compiling them. It prints nothing and
exits when done (or when the parent stops it).

    python -m ringllm.compile_helper --model PATH --kv JSON [--precision f32|q8]
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def helper_argv(model_path: str, kv, precision: str) -> list[str]:
    """The command line that starts this helper for a model file or directory, a KVConfig and a precision."""
    kv_json = json.dumps(kv.to_dict(), default=lambda v: v.item() if hasattr(v, "item") else str(v))  # np.float32 knobs
    return [sys.executable, "-m", "ringllm.compile_helper", "--model", os.fspath(model_path),
            "--kv", kv_json, "--precision", precision]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ringllm.compile_helper", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--kv", required=True, help="KVConfig as a JSON object")
    ap.add_argument("--precision", default="f32")
    args = ap.parse_args(argv)
    from ringllm.gc_pause import collector_paused
    from ringllm.models.loader import load_model
    from ringllm.runtime import compile_clock, compile_share
    from ringllm.runtime.engine import CPUEngine
    from ringllm.runtime.kv_config import KVConfig
    from ringllm.runtime.warmup import warm_decode

    claims = os.environ.get(compile_share.CLAIMS_ENV)
    if not claims:
        ap.error(f"{compile_share.CLAIMS_ENV} must name the claims directory of the process this helps")
    compile_clock.quiet()
    compile_share.join(claims)
    with collector_paused():            # its start-up, as LLM's: no collector passes over what loading builds
        loaded = load_model(args.model, tokenizer=False)
        engine = CPUEngine(loaded.spec, loaded.tensors, n_threads=1, precision=args.precision)
    warm_decode(engine, KVConfig.from_dict(json.loads(args.kv)), one_thread_first=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
