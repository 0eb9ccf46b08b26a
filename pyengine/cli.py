"""The `ringllm` command line.

    ringllm generate   [-m MODEL] -p PROMPT [-n N] [--chat] [KV options] [--engine cpu|reference] [-t T] [--json]
    ringllm perplexity [-m MODEL] -f FILE [--protocol chunked|streaming] [--ctx N] [--chunks K] [--tokens N]
                       [KV options] [-t T] [--json]

KV options: --kv-policy full|streaming, --kv-capacity C, --kv-sinks S, --positions reindexed|original.
`--engine reference` runs the NumPy reference engine (the oracle; slow) instead of the Numba engine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from ringllm.runtime.errors import RingLLMError


class _Runner:
    """One engine + store behind the three verbs the commands need: feed, step, logits."""

    def __init__(self, model, args):
        self.model = model
        kv = dict(capacity=args.kv_capacity, policy=args.kv_policy, sinks=args.kv_sinks, positions=args.positions)
        self.kv = kv
        if args.engine == "reference":
            from ringllm.runtime.reference import ReferenceEngine
            self.eng = ReferenceEngine(model.spec, model.tensors)
            self.new = lambda: self.eng.new_cache(**kv)
            self.feed = lambda ids, st: self.eng.forward(ids, st)
        else:
            from ringllm.runtime.engine import CPUEngine
            self.eng = CPUEngine(model.spec, model.tensors, n_threads=args.threads)
            self.new = lambda: self.eng.new_store(**kv)
            self.feed = lambda ids, st: self.eng.logits(ids, st)
        self.store = self.new()

    def last(self, ids):
        return self.feed(ids, self.store)[-1]


def _load(args):
    from ringllm.models.loader import load_model
    return load_model(args.model)


def _generate(args: argparse.Namespace) -> int:
    import numpy as np

    t0 = time.perf_counter()
    model = _load(args)
    tok = model.tokenizer
    text = args.prompt
    if args.chat:
        from ringllm.chat_template import render_chat
        text = render_chat(tok.chat_template, [{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                           bos_token=tok.bos_token or "", eos_token=tok.eos_token or "", tokenizer=tok)
    # a rendered template that already starts with BOS must not get a second one
    add_bos = False if args.chat and tok.bos_token and text.startswith(tok.bos_token) else None
    ids = tok.encode(text, add_bos=add_bos, parse_special=args.chat)
    run = _Runner(model, args)
    t_load = time.perf_counter() - t0

    t1 = time.perf_counter()
    logits = run.last(ids)
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
        logits = run.last([nxt])
    t_gen = time.perf_counter() - t2
    stats = run.store.stats() if hasattr(run.store, "stats") else {"length": run.store.length}
    result = {"model": model.path, "engine": args.engine, "prompt_tokens": len(ids), "tokens": out,
              "text": tok.decode(out), "finish_reason": finish, "load_s": round(t_load, 3),
              "prompt_tok_s": round(len(ids) / t_prompt, 2) if t_prompt else None,
              "gen_tok_s": round(len(out) / t_gen, 2) if t_gen and out else None,
              "kv": {**run.kv, **stats}}
    if args.json:
        print(json.dumps(result))
    else:
        sys.stdout.write(stream.flush() + "\n")
        print(f"[{len(ids)} prompt tokens at {result['prompt_tok_s']} tok/s, {len(out)} generated at "
              f"{result['gen_tok_s']} tok/s, {args.engine} engine]", file=sys.stderr)
    return 0


def _perplexity(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ringllm import perplexity as ppl
    from ringllm.runtime.errors import ConfigError

    try:
        with open(args.file, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read text file {args.file}: {exc}") from exc
    model = _load(args)
    tok = model.tokenizer
    ids = tok.encode(text, add_bos=False, parse_special=False)
    bar = (lambda it: it) if args.no_progress else (lambda it: tqdm(it, file=sys.stderr, mininterval=1.0))
    if args.protocol == "chunked":
        args.kv_policy, args.kv_capacity = "full", args.ctx
        run = _Runner(model, args)
        res = ppl.chunked(lambda chunk: run.feed(chunk, run.new()), ids, args.ctx,
                          tok.bos_id if tok.add_bos else None, args.chunks, bar)
    else:
        run = _Runner(model, args)
        res = ppl.streaming(lambda t: run.feed([t], run.store)[-1], ids, args.tokens, bar, settings=run.kv)
    res.settings.update({"model": model.path, "file": args.file, "engine": args.engine})
    if args.json:
        print(json.dumps(res.to_dict()))
    else:
        print(f"perplexity ({res.protocol}): {res.ppl:.4f} over {res.n_scored} scored tokens")
    return 0


def _add_kv_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None, help="GGUF file or HF directory (default: bundled SmolLM2-135M)")
    p.add_argument("--engine", choices=("cpu", "reference"), default="cpu")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--kv-policy", choices=("full", "streaming"), default="full")
    p.add_argument("--kv-capacity", type=int, default=None, help="KV slots per layer (full: the context size)")
    p.add_argument("--kv-sinks", type=int, default=4)
    p.add_argument("--positions", choices=("reindexed", "original"), default="reindexed")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ringllm", description="Embeddable LLM runtime with an in-place KV store.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt (greedy)")
    _add_kv_options(g)
    g.add_argument("-p", "--prompt", required=True)
    g.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=_generate)
    q = sub.add_parser("perplexity", help="perplexity of a text file")
    _add_kv_options(q)
    q.add_argument("-f", "--file", required=True)
    q.add_argument("--protocol", choices=("chunked", "streaming"), default="chunked",
                   help="chunked: llama-perplexity's; streaming: token by token through the KV store")
    q.add_argument("--ctx", type=int, default=512, help="chunk size of the chunked protocol")
    q.add_argument("--chunks", type=int, default=None, help="score only the first K chunks")
    q.add_argument("--tokens", type=int, default=None, help="streaming: score the first N tokens")
    q.add_argument("--no-progress", action="store_true")
    q.set_defaults(func=_perplexity)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("n_predict", "threads", "kv_capacity", "chunks", "tokens"):
        val = getattr(args, name, None)
        if val is not None and val < (0 if name == "n_predict" else 1):
            print(f"ringllm: error: --{name.replace('_', '-')} must be {'>= 0' if name == 'n_predict' else '>= 1'}, "
                  f"got {val}", file=sys.stderr)
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
