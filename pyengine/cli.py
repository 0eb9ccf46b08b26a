"""The `ringllm` command line (`python -m ringllm` is the same).

    ringllm generate   [-m MODEL] -p PROMPT [-n N] [--chat] [sampling] [KV options] [--engine E] [-t T] [--json]
                       [--speculative store:C|layers:N [--gamma G]]
                       [--json-object | --json-schema SCHEMA | --grammar FILE | --regex RE] [--chat-template FILE]
    ringllm chat       [-m MODEL] [--system TEXT] [-n N] [--load FILE] [sampling] [KV options] [-t T]
                       [--chat-template FILE]
    ringllm perplexity [-m MODEL] -f FILE [--protocol chunked|streaming] [--ctx N] [--chunks K] [--tokens N]
                       [KV options] [-t T] [--json]
    ringllm bench      [-m MODEL] [--tg 128] [--pp 512] [--repeats 3] [KV options] [-t T] [--json]
    ringllm serve      [-m MODEL] [--host 127.0.0.1] [--port 8080] [--api-key KEY] [--max-tokens-cap N]
                       [--max-body-bytes B] [--queue-size Q] [--max-batch N] [--model-alias NAME]
                       [--strict-model] [--cache-mb MB] [--no-webui] [--ray --replicas N [--ray-address A]
                       [--min-replicas N --max-replicas M]] [KV options] [-t T] [--chat-template FILE]

KV options: --kv-policy (any of KVConfig's policies), --kv-capacity C, --kv-sinks S,
--positions reindexed|original, and the policy knobs --kv-recent, --kv-lazy, --kv-slack,
--kv-max-drop, --kv-window, --kv-pool, --kv-lsh-bits, --kv-history, --kv-pyramid-beta,
--kv-ada-floor, --kv-gvote-p, --kv-gvote-samples, --kv-rkv-lambda, --kv-seed, --kv-update.
Prompt compression after prefill: --kv-compress PRESS (snapkv, pyramidkv, adakv, gvote, tova, knorm,
streaming, random) with --kv-compress-budget B or --kv-compress-ratio R (gvote: neither),
--kv-compress-window W, --kv-compress-pool K, --kv-max-prompt N, --kv-compress-overflow error|stream
(a prompt past N: an error, or streamed through --kv-policy streaming uncompressed).
Sampling: --temp (0 = greedy, the default), --top-k, --top-p, --min-p, --repeat-penalty,
--frequency-penalty, --presence-penalty, --seed, --stop (repeatable), --ignore-eos.
`--engine reference` runs the NumPy reference engine (the oracle; slow); `--engine cuda` the GPU backend.

chat reads lines from stdin; commands: /reset, /save FILE, /load FILE, /stats, /help, /quit.
Ctrl-C stops the current answer (not the program); Ctrl-D (end of input) or /quit ends it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from dataclasses import fields

from ringllm.backends import make_engine
from ringllm.runtime.errors import ConfigError, RingLLMError
from ringllm.runtime.kv_config import COMPRESS_OVERFLOW, POLICIES, POSITION_MODES, PRESSES, UPDATE_MODES, KVConfig
from ringllm.runtime.kv_types import KV_TYPES
from ringllm.sampling import SamplingParams

# Each command imports the model loader, engines, LLM and server when it runs (not here), so that
# `ringllm --help` and argument errors answer without loading Numba kernels or FastAPI.

# KVConfig knobs exposed as --kv-<name> (capacity, policy, sinks and positions have their own options)
_KV_KNOBS = [f for f in fields(KVConfig) if f.name not in ("capacity", "policy", "sinks", "positions")]


def _kv_config(args) -> KVConfig:
    knobs = {f.name: getattr(args, "kv_" + f.name) for f in _KV_KNOBS if getattr(args, "kv_" + f.name) is not None}
    return KVConfig(capacity=args.kv_capacity, policy=args.kv_policy, sinks=args.kv_sinks, positions=args.positions,
                    **knobs)


def _kv_summary(args) -> dict:
    return dict(capacity=args.kv_capacity, policy=args.kv_policy, sinks=args.kv_sinks, positions=args.positions)


class _Runner:
    """One engine + store behind the verbs perplexity needs: feed, new store."""

    def __init__(self, model, args):
        self.model = model
        self.kv = _kv_summary(args)
        kv = _kv_config(args)
        if kv.compress is not None:
            raise ConfigError("perplexity feeds the text token by token (decode semantics); --kv-compress compresses "
                              "a prompt after its prefill (generate, chat, serve)")
        if args.engine == "reference":
            from ringllm.runtime.reference import ReferenceEngine
            self.eng = ReferenceEngine(model.spec, model.tensors)
            self.new = lambda: self.eng.new_cache(kv)
            self.feed = lambda ids, st: self.eng.forward(ids, st)
        else:
            if args.engine == "cuda":
                self.eng = make_engine("cuda", model.spec, model.tensors, args.threads, 64, args.precision)
            else:
                from ringllm.runtime.engine import CPUEngine
                self.eng = CPUEngine(model.spec, model.tensors, n_threads=args.threads, precision=args.precision)
            self.new = lambda: self.eng.new_store(kv)
            self.feed = lambda ids, st: self.eng.logits(ids, st)
        self.store = self.new()

    def last(self, ids):
        return self.feed(ids, self.store)[-1]


def _load(args, tokenizer: bool = True):
    from tqdm import tqdm

    from ringllm.models.loader import load_model
    with tqdm(total=1, desc="loading model", file=sys.stderr, disable=args.no_progress, leave=False) as bar:
        model = load_model(args.model, tokenizer=tokenizer)
        bar.update(1)
    return model


def _read_text(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} file {path!r}: {exc.strerror or exc}") from None


def _llm(args, warmup: bool = False):
    """The LLM the arguments describe. warmup: compile (or load) its kernels before returning (chat and
    serve, which wait for input anyway) rather than at the first prompt (generate, where the
    compile time is reported apart: "compiled kernels in N s")."""
    from ringllm.llm import LLM
    template = getattr(args, "chat_template", None)
    return LLM(args.model, kv=_kv_config(args), backend=args.engine, n_threads=args.threads,
               seed=args.seed if args.seed is not None else 0, progress=not args.no_progress, warmup=warmup,
               precision=args.precision,
               chat_template=_read_text(template, "chat template") if template else None)


def _say_compiled(seconds: float) -> None:
    """One stderr line for kernels compiled in this run (none: nothing printed)."""
    if seconds >= 0.05:
        print(f"[compiled kernels in {seconds:.1f} s; later runs load them from the cache]", file=sys.stderr)


def _constraint(args) -> dict:
    """generate's --json-object / --json-schema / --grammar / --regex as LLM.generate keywords."""
    out: dict = {}
    if args.json_object:
        out["response_format"] = {"type": "json_object"}
    if args.json_schema is not None:
        text = _read_text(args.json_schema, "JSON Schema") if os.path.isfile(args.json_schema) else args.json_schema
        try:
            schema = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"--json-schema is neither a file nor valid JSON: {exc}") from None
        if "response_format" in out:
            raise ConfigError("give --json-object or --json-schema, not both")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "cli", "schema": schema}}
    if args.grammar is not None:
        out["grammar"] = _read_text(args.grammar, "grammar")
    if args.regex is not None:
        out["regex"] = args.regex
    return out


def _sampling(args) -> dict:
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty, frequency_penalty=args.frequency_penalty,
                presence_penalty=args.presence_penalty, stop=args.stop or None, ignore_eos=args.ignore_eos)


# ------------------------------------------------------------------------------------------------
# generate
# ------------------------------------------------------------------------------------------------

def _generate(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    llm = _llm(args)
    tok = llm.tokenizer
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": args.prompt}]
        ids = llm.chat_ids(llm.render_chat(messages, add_generation_prompt=True))
    else:
        # a plain prompt is text: control-token strings in it are not parsed as tokens
        ids = tok.encode(args.prompt, parse_special=False) or llm.prompt_ids("")
    t_load = time.perf_counter() - t0
    if args.speculative:
        return _speculate(args, llm, ids, t_load)
    gen = llm.generate(ids, max_tokens=args.n_predict, seed=args.seed, **_sampling(args), **_constraint(args))
    stop = _Interrupt()
    with stop:
        for chunk in gen:
            if not args.json:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            if stop.requested:
                gen.close()
                break
    tm = gen.timings
    result = {"model": llm.model_path, "engine": args.engine, "prompt_tokens": len(ids), "tokens": gen.tokens,
              "text": gen.text, "finish_reason": gen.finish_reason or ("interrupted" if stop.requested else None),
              "load_s": round(t_load, 3),
              "prompt_tok_s": None if tm.prompt_tok_s is None else round(tm.prompt_tok_s, 2),
              "gen_tok_s": None if tm.gen_tok_s is None else round(tm.gen_tok_s, 2),
              "kv": {**_kv_summary(args), **llm.kv_stats()}, "timings": tm.to_dict()}
    if args.json:
        print(json.dumps(result))
    else:
        sys.stdout.write("\n")
        _say_compiled(llm.compile_s + tm.compile_s)
        print(f"[{len(ids)} prompt tokens at {result['prompt_tok_s']} tok/s, {len(gen.tokens)} generated at "
              f"{result['gen_tok_s']} tok/s, {args.engine} engine, finish: {result['finish_reason']}]",
              file=sys.stderr)
    return 130 if stop.requested else 0


def _speculate(args: argparse.Namespace, llm, ids: list[int], t_load: float) -> int:
    """generate --speculative: greedy decoding with a draft (LLM.speculate), printed when done."""
    plain = SamplingParams()
    changed = [flag for flag, value, default in (
        ("--temp", args.temp, plain.temperature), ("--top-k", args.top_k, plain.top_k), ("--top-p", args.top_p, plain.top_p),
        ("--min-p", args.min_p, plain.min_p), ("--repeat-penalty", args.repeat_penalty, plain.repeat_penalty),
        ("--frequency-penalty", args.frequency_penalty, plain.frequency_penalty),
        ("--presence-penalty", args.presence_penalty, plain.presence_penalty), ("--stop", args.stop, None))
        if value != default]
    if changed:
        raise ConfigError(f"--speculative decodes greedily; drop {', '.join(changed)}")
    if _constraint(args):
        raise ConfigError("--speculative does not constrain its output; drop --json-object, --json-schema, "
                          "--grammar and --regex")
    out = llm.speculate(ids, max_tokens=args.n_predict, draft=args.speculative, gamma=args.gamma,
                        ignore_eos=args.ignore_eos)
    tm, sp = out.timings, out.speculation
    result = {"model": llm.model_path, "engine": args.engine, "prompt_tokens": len(ids), "tokens": out.tokens,
              "text": out.text, "finish_reason": out.finish_reason, "load_s": round(t_load, 3),
              "prompt_tok_s": None if tm.prompt_tok_s is None else round(tm.prompt_tok_s, 2),
              "gen_tok_s": None if tm.gen_tok_s is None else round(tm.gen_tok_s, 2),
              "speculation": {"draft": args.speculative, "gamma": args.gamma,
                              **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in sp.items()}},
              "kv": {**_kv_summary(args), **llm.kv_stats()}, "timings": tm.to_dict()}
    if args.json:
        print(json.dumps(result))
    else:
        print(out.text)
        _say_compiled(llm.compile_s + tm.compile_s)
        print(f"[{len(ids)} prompt tokens, {len(out.tokens)} generated at {result['gen_tok_s']} tok/s, draft "
              f"{args.speculative} gamma {args.gamma}: acceptance {sp['acceptance']:.2f}, "
              f"{sp['tokens_per_round']:.2f} tokens/round, finish: {out.finish_reason}]", file=sys.stderr)
    return 0


class _Interrupt:
    """While active, Ctrl-C (SIGINT) sets .requested instead of raising KeyboardInterrupt, so a
    generation is stopped between two tokens (never inside an engine step)."""

    def __init__(self):
        self.requested = False
        self._old = None

    def _handler(self, signum, frame):
        self.requested = True

    def __enter__(self):
        self.requested = False
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None


# ------------------------------------------------------------------------------------------------
# chat
# ------------------------------------------------------------------------------------------------

_CHAT_HELP = ("commands: /reset (forget the conversation), /save FILE, /load FILE, /stats (KV store), /help, "
              "/quit; Ctrl-C stops an answer, Ctrl-D ends")


def _load_session(session, path: str, kv_types, err) -> None:
    """/load and --load: the saved session, its KV store converted to kv_types when given and different."""
    saved = session.restore(path, kv_types=kv_types)
    note = ""
    if saved != (session.kv.k_type, session.kv.v_type):
        note = f", KV store converted from {saved[0]}/{saved[1]} to {session.kv.k_type}/{session.kv.v_type}"
    print(f"[loaded {path}: {session.turns} turns{note}]", file=err)


def _chat(args: argparse.Namespace) -> int:
    llm = _llm(args, warmup=True)
    defaults = {k: v for k, v in _sampling(args).items() if v is not None}
    session = llm.chat_session(system=args.system, seed=args.seed, max_tokens=args.n_predict, **defaults)
    # --cache-type-k/-v given: a loaded session's store is converted to them (else it keeps its own)
    kv_types = (llm.kv.k_type, llm.kv.v_type) if args.kv_k_type or args.kv_v_type else None
    if args.load:
        _load_session(session, args.load, kv_types, sys.stderr)
    interactive = sys.stdin.isatty()
    err = sys.stderr
    print(f"ringllm chat with {llm.model_name} (KV: {session.kv.policy}, capacity {session.kv.capacity or llm.n_ctx}). "
          + _CHAT_HELP, file=err)
    while True:
        try:
            if interactive:
                line = input("> ")
            else:
                line = sys.stdin.readline()
                if line == "":
                    break
                line = line.rstrip("\n")
        except EOFError:
            break
        except KeyboardInterrupt:
            print("\n[Ctrl-D or /quit to exit]", file=err)
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd, _, arg = text.partition(" ")
            arg = arg.strip()
            try:
                if cmd in ("/quit", "/exit"):
                    break
                elif cmd == "/reset":
                    session.reset()
                    print("[conversation reset]", file=err)
                elif cmd == "/save":
                    if not arg:
                        print("[usage: /save FILE]", file=err)
                        continue
                    session.save(arg)
                    print(f"[saved {session.turns} turns to {arg}]", file=err)
                elif cmd == "/load":
                    if not arg:
                        print("[usage: /load FILE]", file=err)
                        continue
                    _load_session(session, arg, kv_types, err)
                elif cmd == "/stats":
                    print(json.dumps({k: v for k, v in session.kv_stats().items() if k != "layer_capacity"}), file=err)
                elif cmd == "/help":
                    print(_CHAT_HELP, file=err)
                else:
                    print(f"[unknown command {cmd}; {_CHAT_HELP}]", file=err)
            except RingLLMError as exc:
                print(f"[error: {exc}]", file=err)
            continue
        try:
            gen = session.send(text)
        except RingLLMError as exc:
            print(f"[error: {exc}]", file=err)
            continue
        stop = _Interrupt()
        try:
            with stop:
                for chunk in gen:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    if stop.requested:
                        gen.close()
                        break
        except RingLLMError as exc:
            print(f"\n[error: {exc}]", file=err)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        if stop.requested:
            print("[answer stopped]", file=err)
        elif args.verbose:
            tm = gen.timings
            print(f"[{tm.prompt_tokens} new prompt tokens, {tm.gen_tokens} generated at "
                  f"{tm.gen_tok_s and round(tm.gen_tok_s, 1)} tok/s; KV length {session.kv_stats()['length']}]",
                  file=err)
    return 0


# ------------------------------------------------------------------------------------------------
# perplexity
# ------------------------------------------------------------------------------------------------

def _perplexity(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ringllm import perplexity as ppl

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
        for f in _KV_KNOBS:
            if f.name in ("lazy", "slack", "max_drop"):
                setattr(args, "kv_" + f.name, None)
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


# ------------------------------------------------------------------------------------------------
# bench
# ------------------------------------------------------------------------------------------------

def _bench(args: argparse.Namespace) -> int:
    import numpy as np
    from tqdm import tqdm

    if args.engine == "reference":
        raise ConfigError("bench measures the cpu or cuda engine, not the reference engine")
    if args.kv_compress is not None:
        raise ConfigError("bench times plain prefill and decode; prompt compression's cost is measured by "
                          "bench/compression_speed.py")
    if args.memory:
        if args.repeats is not None:
            raise ConfigError("bench --memory measures one run; --repeats is for the speed figures")
        return _bench_memory(args)
    args.repeats = 3 if args.repeats is None else args.repeats
    model = _load(args, tokenizer=False)
    if args.engine == "cuda":
        eng = make_engine("cuda", model.spec, model.tensors, args.threads, min(512, args.pp), args.precision)
    else:
        from ringllm.runtime.engine import CPUEngine
        eng = CPUEngine(model.spec, model.tensors, n_threads=args.threads, n_batch=min(512, args.pp),
                        precision=args.precision)
    if args.kv_policy == "full":
        cap = args.kv_capacity or min(model.spec.n_ctx, args.pp + args.tg + 8)
        kv = KVConfig(capacity=cap, policy="full", positions=args.positions)
    else:
        kv = _kv_config(args)
    rng = np.random.default_rng(0)
    prompt = rng.integers(min(100, model.spec.n_vocab - 1), min(5000, model.spec.n_vocab), args.pp).tolist()
    from ringllm.runtime.warmup import warm
    warm(eng, kv)              # compile or load every kernel the runs use, page in the weights
    tg, pp = [], []
    for _ in tqdm(range(args.repeats), desc="bench", file=sys.stderr, disable=args.no_progress, leave=False):
        st = eng.new_store(kv)
        t0 = time.perf_counter()
        logits = eng.prefill(prompt, st)
        pp.append(args.pp / (time.perf_counter() - t0))
        st = eng.new_store(kv)
        logits = eng.prefill(prompt[:8], st)
        t0 = time.perf_counter()
        for _ in range(args.tg):
            logits = eng.step(int(np.argmax(logits)), st)
        tg.append(args.tg / (time.perf_counter() - t0))
    decode_bytes = sum(t.nbytes for n, t in model.tensors.items() if n != "token_embd.weight")
    if model.spec.tied_output:
        decode_bytes += model.tensors["token_embd.weight"].nbytes
    tg_med, pp_med = float(np.median(tg)), float(np.median(pp))
    result = {"model": model.path, "engine": args.engine, "precision": args.precision,
              "threads": args.threads or os.cpu_count(),
              "tg_tokens": args.tg, "pp_tokens": args.pp, "repeats": args.repeats,
              "tg_tok_s": round(tg_med, 2), "pp_tok_s": round(pp_med, 2),
              "tg_runs": [round(x, 2) for x in tg], "pp_runs": [round(x, 2) for x in pp],
              "weight_bytes": int(sum(t.nbytes for t in model.tensors.values())),
              "decode_gb_s": round(decode_bytes * tg_med / 1e9, 2), "kv": kv.to_dict()}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{os.path.basename(model.path)} ({args.engine}, {args.precision}, {result['threads']} threads): "
              f"tg{args.tg} {result['tg_tok_s']} tok/s ({result['decode_gb_s']} GB/s of weights), "
              f"pp{args.pp} {result['pp_tok_s']} tok/s; medians of {args.repeats}")
    return 0


def _bench_memory(args: argparse.Namespace) -> int:
    """bench --memory: an LLM as `generate` makes it, a prompt of --pp random token ids and --tg generated
    tokens, then the process's RSS and the part each component holds (ringllm.memory_report)."""
    import numpy as np

    from ringllm.memory_report import report, status_mib

    if args.engine != "cpu":
        raise ConfigError("bench --memory measures the cpu engine's buffers; --engine cuda holds its weights "
                          "in GPU memory")
    before = status_mib()                 # (a ConfigError first where there is no /proc: not Linux)
    if args.kv_policy == "full" and args.kv_capacity is None:
        args.kv_capacity = args.pp + args.tg + 8
    from ringllm.llm import LLM
    llm = LLM(args.model, kv=_kv_config(args), n_threads=args.threads, progress=not args.no_progress,
              precision=args.precision)
    loaded = status_mib()
    rng = np.random.default_rng(0)
    n_vocab = llm.spec.n_vocab
    prompt = rng.integers(min(100, n_vocab - 1), min(5000, n_vocab), args.pp).tolist()
    llm.complete(prompt, max_tokens=args.tg, ignore_eos=True)
    rep = report(llm)
    result = {"model": llm.model_path, "threads": args.threads or os.cpu_count(), "pp_tokens": args.pp,
              "tg_tokens": args.tg, "kv": llm.kv.to_dict(), "rss_mib_before_load": round(before["VmRSS"], 1),
              "rss_mib_after_load": round(loaded["VmRSS"], 1),
              "status_mib": {k: round(v, 1) for k, v in rep["status"].items()},
              "parts_mib": {k: round(v, 1) for k, v in rep["parts"].items()}, "rest_mib": round(rep["rest"], 1)}
    if args.json:
        print(json.dumps(result))
        return 0
    st = rep["status"]
    print(f"{os.path.basename(llm.model_path)}: RSS {st['VmRSS']:.0f} MiB after {args.pp} prompt and {args.tg} "
          f"generated tokens (anonymous {st['RssAnon']:.0f}, file {st['RssFile']:.0f}; peak {st['VmHWM']:.0f}); "
          f"{before['VmRSS']:.0f} MiB before loading, {loaded['VmRSS']:.0f} after; KV {llm.kv.policy}, capacity "
          f"{llm.kv.capacity}, {llm.kv.k_type}/{llm.kv.v_type}")
    for part, mib in [*rep["parts"].items(), ("rest", rep["rest"])]:
        print(f"  {part:<24} {mib:7.1f} MiB {100 * mib / st['VmRSS']:3.0f}%")
    print("  (rest: Python, NumPy, Numba's registries and kernels, the tokenizers library, other libraries)")
    return 0


# ------------------------------------------------------------------------------------------------
# serve
# ------------------------------------------------------------------------------------------------

def _serve(args: argparse.Namespace) -> int:
    from ringllm.server import ServerSettings, serve

    key = args.api_key if args.api_key is not None else os.environ.get("RINGLLM_API_KEY") or None
    settings = ServerSettings(api_key=key, max_tokens_cap=args.max_tokens_cap, max_body_bytes=args.max_body_bytes,
                              queue_size=args.queue_size, max_batch=args.max_batch, model_name=args.model_name,
                              default_max_tokens=min(args.default_max_tokens, args.max_tokens_cap),
                              aliases=tuple(args.model_alias or ()), strict_model=args.strict_model,
                              cache_bytes=None if args.cache_mb is None else int(args.cache_mb * (1 << 20)),
                              web_ui=not args.no_webui)
    if args.ray:
        return _serve_ray(args, settings)
    ray_only = [f for f in ("replicas", "min_replicas", "max_replicas", "ray_address") if getattr(args, f) is not None]
    if ray_only or args.no_affinity:
        flags = ", ".join("--" + f.replace("_", "-") for f in ray_only + (["no_affinity"] if args.no_affinity else []))
        raise ConfigError(f"{flags} only apply with --ray (replicas on Ray Serve)")
    llm = _llm(args, warmup=True)
    name = args.model_name or llm.model_name
    print(f"ringllm serve: model {name!r} on http://{args.host}:{args.port}/v1 "
          f"({'API key required' if key else 'no API key'}; docs at /docs)", file=sys.stderr, flush=True)
    serve(llm, host=args.host, port=args.port, settings=settings, log_level=args.log_level)
    return 0


def _serve_ray(args: argparse.Namespace, settings) -> int:
    """serve --ray: the same server on Ray Serve replicas (ringllm.ray_serve)."""
    from ringllm import ray_serve

    ray_serve.require_ray()
    if args.engine != "cpu":
        raise ConfigError("--ray runs the cpu engine on every replica")
    for flag in ("replicas", "min_replicas", "max_replicas"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    template = getattr(args, "chat_template", None)
    opts = ray_serve.ServeOptions(
        model=args.model, kv=_kv_config(args).to_dict(), n_threads=args.threads or 1, precision=args.precision,
        chat_template=_read_text(template, "chat template") if template else None,
        seed=args.seed if args.seed is not None else 0, settings=settings, replicas=args.replicas or 1,
        min_replicas=args.min_replicas, max_replicas=args.max_replicas, affinity=not args.no_affinity)
    where = f"Ray at {args.ray_address}" if args.ray_address else "a local Ray instance"
    print(f"ringllm serve --ray: {opts.replicas if args.min_replicas is None and args.max_replicas is None else 'autoscaled'} "
          f"replica(s) on {where}, http://{args.host}:{args.port}/v1 (Ctrl-C stops it)", file=sys.stderr, flush=True)
    ray_serve.run(opts, args.host, args.port, args.ray_address)
    return 0


def _warmup(args: argparse.Namespace) -> int:
    from ringllm.kernel_warmup import warmup

    if args.engine != "cpu":
        raise ConfigError("warmup compiles the cpu engine's kernels (the cuda backend is built at install time)")
    policies = args.policy or None
    t0 = time.perf_counter()

    def report(r):
        if not args.json:
            what = "shared kernels and policy full" if r.what == "policy full" else r.what
            print(f"  {what}: compiled {r.signatures} kernel signatures in {r.compile_s:.1f} s", file=sys.stderr,
                  flush=True)

    if not args.json:
        print(f"ringllm warmup: compiling kernels for this CPU into {os.environ.get('NUMBA_CACHE_DIR') or 'the cache'}",
              file=sys.stderr, flush=True)
    knobs = {"positions": args.positions, "k_type": args.kv_k_type, "v_type": args.kv_v_type}
    results = warmup(args.model, policies, jobs=args.jobs, knobs=knobs,
                     all_types=args.all_types, report=report, precision=args.precision)
    wall = time.perf_counter() - t0
    total = sum(r.compile_s for r in results)
    if args.json:
        print(json.dumps({"cache_dir": os.environ.get("NUMBA_CACHE_DIR"), "wall_s": round(wall, 3),
                          "compile_s": round(total, 3), "results": [vars(r) for r in results]}))
    else:
        print(f"[warm: {sum(r.signatures for r in results)} signatures compiled ({total:.1f} s of compiling) in "
              f"{wall:.1f} s; a new process now loads them from the cache]", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------------------
# Parser
# ------------------------------------------------------------------------------------------------

def _add_common(p: argparse.ArgumentParser, json_flag: bool = True) -> None:
    p.add_argument("-m", "--model", default=None, help="GGUF file or HF directory (default: bundled SmolLM2-135M)")
    p.add_argument("--engine", "--backend", dest="engine", choices=("cpu", "cuda", "reference"), default="cpu",
                   help="cpu (Numba), cuda (GPU backend), reference (NumPy oracle, slow)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--precision", choices=("f32", "q8"), default="f32",
                   help="activations of the weight products: f32 (exact, default) or q8 (8-bit per block as "
                        "llama.cpp, integer dot products: faster; cpu engine)")
    p.add_argument("--kv-policy", choices=POLICIES, default="full")
    p.add_argument("--kv-capacity", type=int, default=None, help="KV slots per layer (full: the context size)")
    p.add_argument("--kv-sinks", type=int, default=4)
    p.add_argument("--positions", choices=POSITION_MODES, default="reindexed")
    g = p.add_argument_group("KV policy knobs (see KVConfig; default: the policy's own)")
    for f in _KV_KNOBS:
        opt = "--kv-" + f.name.replace("_", "-")
        if f.name == "update":
            g.add_argument(opt, dest="kv_update", choices=UPDATE_MODES, default=None)
        elif f.name in ("k_type", "v_type"):
            which = f.name[0]
            g.add_argument(f"--cache-type-{which}", opt, dest="kv_" + f.name, choices=KV_TYPES, default=None,
                           help=f"how the KV store holds {'keys' if which == 'k' else 'values'}: f32 (default), "
                                "f16, q8_0 or q4_0 (llama.cpp's blocks of 32, quantized once as written)")
        elif f.name == "compress_overflow":
            g.add_argument(opt, dest="kv_compress_overflow", choices=COMPRESS_OVERFLOW, default=None,
                           help="a prompt too long to compress (past --kv-max-prompt): error (default) or stream "
                                "it through the decode-time policy (--kv-policy streaming)")
        elif f.name == "compress":
            g.add_argument(opt, dest="kv_compress", choices=PRESSES, default=None,
                           help="compress the prompt after prefill with this press (with --kv-compress-budget B or "
                                "--kv-compress-ratio R; gvote takes neither)")
        else:
            typ = float if "float" in str(f.type) else int
            g.add_argument(opt, dest="kv_" + f.name, type=typ, default=None, metavar=typ.__name__.upper())
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    if json_flag:
        p.add_argument("--json", action="store_true", help="print one JSON object")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temp", "--temperature", dest="temp", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repeat-penalty", type=float, default=1.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def _add_chat_template(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file instead of the model's (e.g. one with tool syntax)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ringllm", description="Embeddable LLM runtime with an in-place KV store.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt")
    _add_common(g)
    _add_sampling(g)
    g.add_argument("-p", "--prompt", required=True)
    g.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--system", default=None, help="system message (with --chat)")
    g.add_argument("--speculative", default=None, metavar="DRAFT",
                   help="greedy speculative decoding with draft store:C (this model, streaming store of C) or "
                        "layers:N (its first N layers); output printed when done")
    g.add_argument("--gamma", type=int, default=3, help="tokens drafted per round (with --speculative)")
    _add_chat_template(g)
    k = g.add_argument_group("structured output (one of them)")
    k.add_argument("--json-object", action="store_true", help="the answer is a JSON object")
    k.add_argument("--json-schema", default=None, metavar="SCHEMA", help="the answer follows this JSON Schema "
                   "(a file, or the schema's JSON text)")
    k.add_argument("--grammar", default=None, metavar="FILE", help="the answer follows this Lark or GBNF grammar")
    k.add_argument("--regex", default=None, help="the answer matches this regular expression")
    g.set_defaults(func=_generate)

    c = sub.add_parser("chat", help="interactive chat (reads stdin; /reset /save /load /quit)")
    _add_common(c, json_flag=False)
    _add_sampling(c)
    c.add_argument("--system", default=None, help="system message")
    c.add_argument("-n", "--n-predict", type=int, default=512, help="tokens per answer at most")
    _add_chat_template(c)
    c.add_argument("--load", default=None, help="start from a saved session file")
    c.add_argument("-v", "--verbose", action="store_true", help="speed and KV length after each answer")
    c.set_defaults(func=_chat)

    q = sub.add_parser("perplexity", help="perplexity of a text file")
    _add_common(q)
    q.add_argument("-f", "--file", required=True)
    q.add_argument("--protocol", choices=("chunked", "streaming"), default="chunked",
                   help="chunked: llama-perplexity's; streaming: token by token through the KV store")
    q.add_argument("--ctx", type=int, default=512, help="chunk size of the chunked protocol")
    q.add_argument("--chunks", type=int, default=None, help="score only the first K chunks")
    q.add_argument("--tokens", type=int, default=None, help="streaming: score the first N tokens")
    q.set_defaults(func=_perplexity)

    b = sub.add_parser("bench", help="decode (tg) and prefill (pp) tokens/s of the engine")
    _add_common(b)
    b.add_argument("--tg", type=int, default=128, help="tokens decoded per run")
    b.add_argument("--pp", type=int, default=512, help="prompt tokens prefilled per run")
    b.add_argument("--repeats", type=int, default=None, help="runs of each speed figure, medians (default 3)")
    b.add_argument("--memory", action="store_true",
                   help="instead of speeds: the process's RSS after --pp prompt and --tg generated tokens, and "
                        "the part each component holds (Linux)")
    b.set_defaults(func=_bench)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_common(s, json_flag=False)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or env RINGLLM_API_KEY)")
    s.add_argument("--model-name", default=None, help="model id to serve under (default: the file name)")
    s.add_argument("--model-alias", action="append", default=None, metavar="NAME",
                   help="another id /v1/models lists for the model (repeatable)")
    s.add_argument("--strict-model", action="store_true",
                   help="404 for a request naming a model other than --model-name and its aliases (default: any "
                        "model id is served by the one model)")
    s.add_argument("--no-webui", action="store_true", help="do not serve the chat page at /")
    r = s.add_argument_group("scale-out on Ray Serve (the ray extra: pip install 'ringllm[ray]')")
    r.add_argument("--ray", action="store_true", help="serve from Ray Serve replicas, one engine each")
    r.add_argument("--replicas", type=int, default=None, help="engine replicas (default 1; -t threads each)")
    r.add_argument("--min-replicas", type=int, default=None, help="autoscale: Ray Serve's lower bound")
    r.add_argument("--max-replicas", type=int, default=None, help="autoscale: Ray Serve's upper bound")
    r.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting a local one")
    r.add_argument("--no-affinity", action="store_true",
                   help="route with Ray Serve's default router instead of by conversation and prompt prefix")
    s.add_argument("--cache-mb", type=float, default=None,
                   help="prompt cache budget in MiB (0: off; default: a quarter of the machine's memory, at most 4 GiB)")
    s.add_argument("--max-tokens-cap", type=int, default=4096, help="largest max_tokens a request may ask")
    s.add_argument("--default-max-tokens", type=int, default=512, help="chat answers without max_tokens")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    s.add_argument("--queue-size", type=int, default=256, help="waiting requests before 503")
    s.add_argument("--max-batch", type=int, default=8, help="requests decoded together (batched steps)")
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    s.add_argument("--seed", type=int, default=None, help="seed of requests that give none")
    _add_chat_template(s)
    s.set_defaults(func=_serve)

    w = sub.add_parser("warmup", help="compile a model's kernels now (once per CPU and ringllm version), so later "
                                      "runs start without compiling")
    w.add_argument("-m", "--model", default=None, help="GGUF file or HF directory (default: bundled SmolLM2-135M)")
    w.add_argument("--engine", "--backend", dest="engine", choices=("cpu", "cuda", "reference"), default="cpu")
    w.add_argument("--policy", action="append", choices=POLICIES, default=None,
                   help="eviction policy to compile for (repeatable; default: every policy)")
    w.add_argument("--positions", choices=POSITION_MODES, default="reindexed")
    w.add_argument("--cache-type-k", dest="kv_k_type", choices=KV_TYPES, default="f32",
                   help="the KV store's key type to compile for (each type's kernels compile apart)")
    w.add_argument("--cache-type-v", dest="kv_v_type", choices=KV_TYPES, default="f32",
                   help="the KV store's value type to compile for")
    w.add_argument("--precision", choices=("f32", "q8"), default="f32", help="the engine precision to compile for")
    w.add_argument("--all-types", action="store_true",
                   help="also compile every supported weight type's kernels (for models not at hand)")
    w.add_argument("-j", "--jobs", type=int, default=None, help="processes compiling side by side (default: cores)")
    w.add_argument("--json", action="store_true", help="print one JSON object")
    w.set_defaults(func=_warmup)
    return p


_POSITIVE = ("threads", "jobs", "kv_capacity", "chunks", "tokens", "tg", "pp", "repeats", "max_tokens_cap", "max_body_bytes",
             "queue_size", "max_batch", "default_max_tokens")
_NON_NEGATIVE = ("n_predict", "seed", "port")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in _POSITIVE + _NON_NEGATIVE:
        val = getattr(args, name, None)
        low = 1 if name in _POSITIVE else 0
        if val is not None and val < low:
            print(f"ringllm: error: --{name.replace('_', '-')} must be >= {low}, got {val}", file=sys.stderr)
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
