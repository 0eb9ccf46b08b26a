"""The `ringllm` command line.

    ringllm generate [-m MODEL] -p PROMPT [-n N] [--chat] [--kv-policy full|streaming] [--kv-capacity C]
                     [--kv-sinks S] [--positions reindexed|original] [--json]

This stage decodes greedily on the NumPy reference engine (the Numba engine replaces it as the
default once it lands); the KV options drive the reference engine's shift-and-append cache.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from ringllm.runtime.errors import RingLLMError


def _generate(args: argparse.Namespace) -> int:
    import numpy as np

    from ringllm.models.loader import load_model
    from ringllm.runtime.reference import ReferenceEngine

    t0 = time.perf_counter()
    model = load_model(args.model)
    tok = model.tokenizer
    text = args.prompt
    if args.chat:
        from ringllm.chat_template import render_chat
        text = render_chat(tok.chat_template, [{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                           bos_token=tok.bos_token or "", eos_token=tok.eos_token or "", tokenizer=tok)
    # a rendered template that already starts with BOS must not get a second one
    add_bos = False if args.chat and tok.bos_token and text.startswith(tok.bos_token) else None
    ids = tok.encode(text, add_bos=add_bos, parse_special=args.chat)
    eng = ReferenceEngine(model.spec, model.tensors)
    cache = eng.new_cache(capacity=args.kv_capacity, policy=args.kv_policy, sinks=args.kv_sinks,
                          positions=args.positions)
    t_load = time.perf_counter() - t0

    t1 = time.perf_counter()
    logits = eng.forward(ids, cache)[-1]
    t_prompt = time.perf_counter() - t1
    out: list[int] = []
    stream = tok.stream_decoder()
    finish = "length"
    t2 = time.perf_counter()
    for _ in range(args.n_predict):
        nxt = int(np.argmax(logits))
        if nxt in tok.eos_ids and not args.ignore_eos:
            finish = "stop"
            break
        out.append(nxt)
        if not args.json:
            sys.stdout.write(stream.push(nxt))   # holds back partial UTF-8 characters
            sys.stdout.flush()
        logits = eng.forward([nxt], cache)[-1]
    t_gen = time.perf_counter() - t2
    result = {"model": model.path, "prompt_tokens": len(ids), "tokens": out, "text": tok.decode(out),
              "finish_reason": finish, "load_s": round(t_load, 3),
              "prompt_tok_s": round(len(ids) / t_prompt, 2) if t_prompt else None,
              "gen_tok_s": round(len(out) / t_gen, 2) if t_gen and out else None,
              "kv": {"policy": args.kv_policy, "capacity": args.kv_capacity, "length": cache.length}}
    if args.json:
        print(json.dumps(result))
    else:
        sys.stdout.write(stream.flush() + "\n")
        print(f"[{len(ids)} prompt tokens, {len(out)} generated at {result['gen_tok_s']} tok/s, "
              f"reference engine]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ringllm", description="Embeddable LLM runtime with an in-place KV store.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("-m", "--model", default=None, help="GGUF file or HF directory (default: bundled SmolLM2-135M)")
    g.add_argument("-p", "--prompt", required=True)
    g.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--kv-policy", choices=("full", "streaming"), default="full")
    g.add_argument("--kv-capacity", type=int, default=None)
    g.add_argument("--kv-sinks", type=int, default=4)
    g.add_argument("--positions", choices=("reindexed", "original"), default="reindexed")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.set_defaults(func=_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "n_predict", 1) < 0:
        print("ringllm: error: -n must be >= 0", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except RingLLMError as exc:
        print(f"ringllm: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
