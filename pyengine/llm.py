"""`ringllm.LLM`: one loaded model behind the verbs an application needs.

    llm = ringllm.LLM()                                   # the bundled SmolLM2-135M-Instruct
    llm = ringllm.LLM("model.gguf", kv=ringllm.KVConfig(capacity=512, policy="streaming"))
    for chunk in llm.generate("Once upon a time", max_tokens=32):
        print(chunk.text, end="", flush=True)
    llm.complete("2 + 2 =", max_tokens=4).text
    llm.chat([{"role": "user", "content": "Hi"}]).text
    session = llm.chat_session(); session.send("Hi")      # multi-turn, the KV store kept between turns

Every generation runs under the LLM's lock: threads sharing one LLM take turns (a generation
holds the lock from its first chunk to its last, or until it is closed); a thread that starts a
second generation while its own first one is still open gets an error instead of a deadlock.

Streams are chunk objects (`Chunk`): .text (the new text, never a partial UTF-8 character nor a
piece that could still become a stop string), .token (the token id), .finish_reason (None, or on
the last chunk "stop" | "length"), .timings. The chunk that carries a finish reason is the last
token's own chunk: the engine looks one token ahead, so that EOS is known before that chunk is
handed out. The iterator (`Generation`) keeps .tokens, .text, .finish_reason and .timings.
"""
from __future__ import annotations

import os
import resource
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from ringllm.runtime.errors import ConfigError, RingLLMError
from ringllm.runtime.kv_config import KVConfig
from ringllm.sampling import Sampler, SamplingParams, StopMatcher

__all__ = ["LLM", "Chunk", "Completion", "Decoder", "Generation", "Timings", "BACKENDS"]

BACKENDS = ("cpu", "cuda", "reference")
DEFAULT_MAX_TOKENS = 256


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (bytes)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


@dataclass
class Timings:
    """Speed of one generation. prompt_*: the prefill; gen_*: the generated tokens (time spent
    producing them, not the caller's time between chunks); peak_memory_bytes: the process's peak
    resident memory so far (plus the GPU's peak where the backend reports one)."""

    prompt_tokens: int = 0
    prompt_s: float = 0.0
    gen_tokens: int = 0
    gen_s: float = 0.0
    peak_memory_bytes: int = 0

    @property
    def prompt_tok_s(self) -> float | None:
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 and self.prompt_tokens else None

    @property
    def gen_tok_s(self) -> float | None:
        return self.gen_tokens / self.gen_s if self.gen_s > 0 and self.gen_tokens else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prompt_tok_s"] = None if self.prompt_tok_s is None else round(self.prompt_tok_s, 2)
        d["gen_tok_s"] = None if self.gen_tok_s is None else round(self.gen_tok_s, 2)
        return d


@dataclass
class Chunk:
    """One generated token: its text delta, id, index, and the finish reason on the last one."""

    text: str
    token: int
    finish_reason: str | None
    timings: Timings
    index: int = 0


@dataclass
class Completion:
    """A finished (non-streaming) generation."""

    text: str
    tokens: list[int]
    finish_reason: str | None
    prompt_tokens: int
    timings: Timings = field(default_factory=Timings)
    speculation: dict | None = None     # LLM.speculate(): rounds, drafted, accepted, acceptance, seconds

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.tokens),
                "total_tokens": self.prompt_tokens + len(self.tokens)}


class _Record:
    """What a generation has produced so far. The running generator writes here, never into the
    Generation itself, so no reference cycle keeps an abandoned generation (and the LLM's lock)
    alive until the garbage collector runs: dropping the iterator closes it at once."""

    def __init__(self):
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.prompt_tokens = 0
        self.timings = Timings()
        self.fed: list[int] = []          # tokens this generation fed into the store
        self.done = False
        self.in_engine = False            # True while an engine call runs (a store cut there is unusable)


class Generation:
    """The iterator `generate(stream=True)` returns. Iterate it for chunks; afterwards (or at any
    time) .tokens, .text, .finish_reason, .timings describe what was produced. close() stops it
    (the store stays consistent: it is only ever cut between tokens)."""

    def __init__(self, record: _Record | None = None):
        self.record = record or _Record()
        self._it: Iterator[Chunk] | None = None

    def __getattr__(self, name: str):
        if name in ("record", "_it"):
            raise AttributeError(name)
        return getattr(self.record, name)

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> Chunk:
        return next(self._it)

    def close(self) -> None:
        if self._it is not None:
            self._it.close()

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def result(self) -> Completion:
        """Run to the end and return the Completion."""
        for _ in self:
            pass
        r = self.record
        return Completion(r.text, list(r.tokens), r.finish_reason, r.prompt_tokens, r.timings)


class Decoder:
    """One generation advanced a token at a time by a caller that runs the engine itself: alone
    (LLM.generate), or beside other sequences through CPUEngine.step_batch (ringllm.batch).

        dec = llm.decoder(prompt, max_tokens=32)      # a fresh store; nothing computed yet
        dec.prefill()                                 # engine prefill + first sample (may finish: EOS, max_tokens 0)
        while not dec.done:
            token = dec.feed()                        # the token the engine must run next, or None (it ends here)
            logits = None if token is None else engine.step(token, dec.store)     # (n_vocab,)
            chunk = dec.advance(logits)               # the Chunk of that token (finish_reason on the last)

    feed() and advance() alternate strictly. The decoder never takes the LLM's lock: whoever calls
    the engine (and prefill()) serializes engine use. .record holds tokens, text, timings, as a
    Generation's."""

    def __init__(self, llm: "LLM", record: _Record, store, prefill_ids: list[int], history: list[int],
                 sampler: Sampler, max_tokens: int | None, stopper: StopMatcher, ignore_eos: bool):
        self.llm, self.record, self.store = llm, record, store
        self.prefill_ids, self.history, self.sampler = prefill_ids, history, sampler
        self.max_tokens, self.stopper = max_tokens, stopper
        self.eos = frozenset() if ignore_eos else llm.tokenizer.eos_ids
        self._next: int | None = None           # the sampled token whose chunk comes next
        self._fed: int | None = None            # the token feed() handed out, awaiting its logits
        self._pending: tuple[str, bool, str | None] | None = None     # (text, stop hit, finish) of feed()
        self._index = 0
        self._t1: float | None = None
        self._text_dec = None

    @property
    def done(self) -> bool:
        return self.record.done

    def prefill(self) -> None:
        """Prefill the prompt into the store and sample the first token (one engine call)."""
        rec, tm, llm = self.record, self.record.timings, self.llm
        ids = self.prefill_ids
        rec.prompt_tokens = len(ids)
        t0 = time.perf_counter()
        rec.in_engine = True
        logits = llm._engine.prefill(ids, self.store)
        rec.in_engine = False
        rec.fed.extend(ids)
        tm.prompt_tokens, tm.prompt_s = len(ids), time.perf_counter() - t0
        tm.peak_memory_bytes = llm._peak_memory()
        if self.max_tokens == 0:
            rec.finish_reason, rec.done = "length", True
            return
        self._text_dec = llm.tokenizer.stream_decoder()
        self._t1 = time.perf_counter()
        self._next = self.sampler.sample(logits, self.history)
        if self._next in self.eos:
            rec.finish_reason, rec.done = "stop", True
            tm.gen_s = time.perf_counter() - self._t1

    def feed(self) -> int | None:
        """Take the sampled token into the output; returns it when the engine must run it (its
        logits give the next token), None when the generation ends with it (stop string,
        max_tokens, or a policy-full store that has no room)."""
        if self.record.done or self._pending is not None or self._text_dec is None:
            raise RingLLMError("Decoder.feed() out of turn: call prefill() first, then feed() and advance() "
                               "alternately until done")
        if self._t1 is None:
            self._t1 = time.perf_counter()
        rec, token = self.record, self._next
        self.history.append(token)
        rec.tokens.append(token)
        text, hit = self.stopper.push(self._text_dec.push(token))
        finish = None
        if hit:
            finish = "stop"
        elif self.max_tokens is not None and len(rec.tokens) >= self.max_tokens:
            finish = "length"
        else:
            try:
                check_room(self.store, self.llm.spec, 1)
            except ConfigError:
                finish = "length"        # policy full and the context is full
        self._pending = (text, hit, finish)
        self._fed = token if finish is None else None
        return self._fed

    def advance(self, logits: np.ndarray | None) -> Chunk:
        """The Chunk of the token feed() returned. logits (n_vocab,): the engine's output for that
        token (required when feed() returned a token, None when it returned None)."""
        if self._pending is None or (logits is None) != (self._fed is None):
            raise RingLLMError("Decoder.advance() needs the logits of the token feed() returned (None when "
                               "feed() returned None)")
        rec, tm = self.record, self.record.timings
        text, hit, finish = self._pending
        token = self.history[-1]
        if logits is not None:
            rec.fed.append(token)
            self._next = self.sampler.sample(logits, self.history)
            if self._next in self.eos:
                finish = "stop"
        if finish is not None and not hit:
            tail, hit2 = self.stopper.push(self._text_dec.flush())
            text += tail if hit2 else tail + self.stopper.flush()
        rec.text += text
        tm.gen_tokens = len(rec.tokens)
        tm.gen_s += time.perf_counter() - self._t1
        tm.peak_memory_bytes = self.llm._peak_memory()
        if finish is not None:
            rec.finish_reason, rec.done = finish, True
        chunk = Chunk(text, token, finish, tm, self._index)
        self._index += 1
        self._pending, self._fed, self._t1 = None, None, None
        return chunk


class _ReferenceBackend:
    """The NumPy reference engine behind CPUEngine's verbs (slow; the oracle)."""

    def __init__(self, spec, tensors):
        from ringllm.runtime.reference import ReferenceEngine
        self.ref = ReferenceEngine(spec, tensors)
        self.spec = spec

    def new_store(self, kv: KVConfig):
        return self.ref.new_cache(kv)

    def prefill(self, ids, store):
        return self.ref.forward(ids, store)[-1]

    def step(self, token, store):
        return self.ref.forward([token], store)[-1]

    def logits(self, ids, store):
        return self.ref.forward(ids, store)


def check_room(store, spec, n: int) -> None:
    """ConfigError when n more tokens do not fit (policy full past the context)."""
    fn = getattr(store, "check_room", None)
    if fn is not None:
        fn(n)
    elif getattr(store, "policy", None) == "full" and store.n_seen + n > spec.n_ctx:
        raise ConfigError(f"{store.n_seen + n} tokens exceed the model's context {spec.n_ctx} with policy 'full'; "
                          "choose an eviction policy (e.g. streaming) or a shorter input")


def store_stats(store, kv: KVConfig) -> dict:
    fn = getattr(store, "stats", None)
    if fn is not None:
        return dict(fn())
    n = int(getattr(store, "n_seen", 0))
    return {"capacity": kv.capacity, "length": n if kv.capacity is None else min(n, kv.capacity),
            "evicted_total": None, "policy": kv.policy, "tokens_seen": n}


class LLM:
    """A loaded model, its engine and tokenizer.

    Args:
        model: None (the bundled SmolLM2-135M-Instruct), a GGUF file, or an HF checkpoint directory.
        kv: KVConfig of every sequence this LLM decodes (default: policy full at the model's context).
        backend: "cpu" (Numba engine), "cuda" (ringllm.native), "reference" (the NumPy oracle; slow).
        n_threads: CPU threads (None: all cores).
        seed: seeds the generator that seeds each call made without its own seed.
        progress: tqdm bars while loading (None: only when stderr is a terminal).
        chat_template: overrides the model's chat template.
    """

    def __init__(self, model: str | os.PathLike | None = None, kv: KVConfig | dict | None = None,
                 backend: str = "cpu", n_threads: int | None = None, seed: int = 0, *,
                 n_batch: int = 64, progress: bool | None = None, chat_template: str | None = None,
                 warmup: bool = True):
        from tqdm import tqdm

        from ringllm.models.loader import load_model

        if kv is None:
            kv = KVConfig()
        elif isinstance(kv, dict):
            kv = KVConfig.from_dict(kv)
        elif not isinstance(kv, KVConfig):
            raise ConfigError(f"kv must be a KVConfig (or a dict of its fields), got {type(kv).__name__}")
        kv.validate()
        if backend not in BACKENDS:
            raise ConfigError(f"backend {backend!r} unknown; valid: {', '.join(BACKENDS)}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
        if n_threads is not None and (isinstance(n_threads, bool) or not isinstance(n_threads, int) or n_threads < 1):
            raise ConfigError(f"n_threads must be a positive integer, got {n_threads!r}")
        show = sys.stderr.isatty() if progress is None else bool(progress)
        bar = tqdm(total=3 if warmup else 2, desc="loading model", unit="step", file=sys.stderr, disable=not show,
                   leave=False)
        try:
            self.model = load_model(model)
            bar.update(1)
            bar.set_description("preparing engine")
            self.spec, self.tokenizer = self.model.spec, self.model.tokenizer
            self.kv, self.backend, self.n_threads, self.seed = kv, backend, n_threads, int(seed)
            self._engine = self._make_engine(backend, n_threads, n_batch)
            bar.update(1)
            if warmup and backend != "reference":
                bar.set_description("warming up")
                st = self._engine.new_store(KVConfig(capacity=4, policy="full"))
                self._engine.prefill([0, 0], st)
                self._engine.step(0, st)
                bar.update(1)
        finally:
            bar.close()
        self.chat_template = chat_template if chat_template is not None else self.tokenizer.chat_template
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._seeds = np.random.Generator(np.random.PCG64(self.seed))
        self._seed_lock = threading.Lock()
        self._store = None
        self._layer_drafts: dict[int, Any] = {}       # speculate(): early-exit drafts by layer count

    # ------------------------------------------------------------------------------------------
    # Construction helpers
    # ------------------------------------------------------------------------------------------

    def _make_engine(self, backend: str, n_threads: int | None, n_batch: int):
        if backend == "cpu":
            from ringllm.runtime.engine import CPUEngine
            return CPUEngine(self.spec, self.model.tensors, n_threads=n_threads, n_batch=n_batch)
        if backend == "reference":
            return _ReferenceBackend(self.spec, self.model.tensors)
        try:
            from ringllm.native import CUDAEngine
        except ImportError as exc:
            raise ConfigError(f"the CUDA backend is not built (ringllm.native could not be imported: {exc}); "
                              "build it or use backend='cpu'") from None
        return CUDAEngine(self.spec, self.model.tensors)

    # ------------------------------------------------------------------------------------------
    # Properties
    # ------------------------------------------------------------------------------------------

    @property
    def engine(self):
        return self._engine

    @property
    def model_path(self) -> str:
        return self.model.path

    @property
    def model_name(self) -> str:
        """The model's name: its file (or directory) name without extension."""
        base = os.path.basename(os.path.normpath(self.model.path))
        return base[:-5] if base.endswith(".gguf") else base

    @property
    def n_ctx(self) -> int:
        return self.spec.n_ctx

    @property
    def n_vocab(self) -> int:
        return self.spec.n_vocab

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.tokenizer.eos_ids

    def __repr__(self) -> str:
        return (f"LLM(model={self.model_name!r}, backend={self.backend!r}, kv=KVConfig(capacity={self.kv.capacity}, "
                f"policy={self.kv.policy!r}, sinks={self.kv.sinks}, positions={self.kv.positions!r}))")

    # ------------------------------------------------------------------------------------------
    # Lock
    # ------------------------------------------------------------------------------------------

    def _acquire(self) -> None:
        me = threading.get_ident()
        if self._owner == me:
            raise RingLLMError("this thread already has a generation of this LLM open; finish it or close() it "
                               "before starting another")
        self._lock.acquire()
        self._owner = me

    def _release(self) -> None:
        self._owner = None
        self._lock.release()

    # ------------------------------------------------------------------------------------------
    # Tokens
    # ------------------------------------------------------------------------------------------

    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of text. add_bos None follows the model's rule; special: match control-token
        strings ("<|im_start|>") as those tokens (False for untrusted text)."""
        return self.tokenizer.encode(text, add_bos=add_bos, parse_special=special)

    def detokenize(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special=skip_special)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids = []
            for t in prompt:
                if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                    raise ConfigError(f"prompt token ids must be integers, got {t!r}")
                if not 0 <= int(t) < self.n_vocab:
                    raise ConfigError(f"prompt token id {int(t)} is outside the vocabulary (0..{self.n_vocab - 1})")
                ids.append(int(t))
        else:
            raise ConfigError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            start = self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.tokenizer.eos_id
            if start is None:
                raise ConfigError("the prompt is empty and this model has no BOS/EOS token to start from")
            ids = [start]
        return ids

    # ------------------------------------------------------------------------------------------
    # Chat templates
    # ------------------------------------------------------------------------------------------

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The conversation as the model's chat template writes it (sandboxed Jinja; a fallback
        template for a model without one)."""
        from ringllm.chat_template import render_chat
        tok = self.tokenizer
        return render_chat(self.chat_template, messages, add_generation_prompt, bos_token=tok.bos_token or "",
                           eos_token=tok.eos_token or "", tokenizer=tok, **extra)

    def chat_ids(self, text: str) -> list[int]:
        """Ids of a rendered chat: a template that writes BOS itself does not get a second one."""
        tok = self.tokenizer
        add_bos = False if tok.bos_token and text.startswith(tok.bos_token) else None
        return tok.encode(text, add_bos=add_bos, parse_special=True)

    # ------------------------------------------------------------------------------------------
    # Generation
    # ------------------------------------------------------------------------------------------

    def _sampler(self, params: SamplingParams, seed: int | None) -> Sampler:
        if seed is None:
            with self._seed_lock:
                seed = int(self._seeds.integers(0, 2 ** 63 - 1))
        return Sampler(params, seed)

    @staticmethod
    def _check_max_tokens(max_tokens) -> None:
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer))
                                       or max_tokens < 0):
            raise ConfigError(f"max_tokens must be a non-negative integer or None, got {max_tokens!r}")

    def generate(self, prompt: str | Sequence[int], max_tokens: int | None = DEFAULT_MAX_TOKENS,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 repeat_penalty: float = 1.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                 logit_bias: dict[int, float] | None = None, stop: str | Sequence[str] | None = None,
                 ignore_eos: bool = False, seed: int | None = None, stream: bool = True,
                 penalty_last_n: int = 64) -> "Generation | Completion":
        """Generate after `prompt` (text, or token ids) from a fresh KV store.

        max_tokens: tokens to generate at most (None: until EOS, a stop string or a full context).
        temperature 0 is greedy; the other sampling knobs are described in ringllm.sampling.
        stop: strings that end the generation (not included in the text).
        seed: the sampler's seed (None: drawn from the LLM's seeded generator).
        stream: True returns a Generation (iterator of Chunk); False runs it and returns a Completion.
        Errors (ConfigError) for bad arguments and for a prompt longer than a policy-full context
        are raised here, before any chunk.
        """
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                                presence_penalty=presence_penalty, logit_bias=dict(logit_bias or {}),
                                penalty_last_n=penalty_last_n)
        dec = self._new_decoder(prompt, params, max_tokens, stop, ignore_eos, seed)
        gen = Generation(dec.record)

        def body():
            self._acquire()
            try:
                self._store = dec.store
                yield from self._run(dec)
            finally:
                self._release()

        gen._it = body()
        return gen if stream else gen.result()

    def decoder(self, prompt: str | Sequence[int], max_tokens: int | None = DEFAULT_MAX_TOKENS,
                stop: str | Sequence[str] | None = None, ignore_eos: bool = False, seed: int | None = None,
                **sampling: Any) -> Decoder:
        """A Decoder of `prompt` from a fresh KV store, for a caller that drives the engine itself
        (e.g. several sequences batched by ringllm.batch.BatchDecoder). Keywords as generate();
        sampling: the SamplingParams fields (temperature, top_k, top_p, min_p, repeat_penalty,
        frequency_penalty, presence_penalty, logit_bias, penalty_last_n). Nothing is computed yet."""
        unknown = set(sampling) - set(SamplingParams.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown sampling option(s) {sorted(unknown)}; valid: "
                              f"{sorted(SamplingParams.__dataclass_fields__)}")
        sampling["logit_bias"] = dict(sampling.get("logit_bias") or {})
        return self._new_decoder(prompt, SamplingParams(**sampling), max_tokens, stop, ignore_eos, seed)

    def _new_decoder(self, prompt, params: SamplingParams, max_tokens, stop, ignore_eos: bool,
                     seed: int | None) -> Decoder:
        """Checks every argument (ConfigError before anything runs) and builds the Decoder."""
        params.validate(self.n_vocab)
        self._check_max_tokens(max_tokens)
        ids = self._prompt_ids(prompt)
        stopper = StopMatcher(stop)
        sampler = self._sampler(params, seed)
        store = self._engine.new_store(self.kv)
        check_room(store, self.spec, len(ids))      # the clear error, before a generator exists
        return Decoder(self, _Record(), store, ids, list(ids), sampler, max_tokens, stopper, ignore_eos)

    def complete(self, prompt: str | Sequence[int], **kwargs) -> Completion:
        """generate(..., stream=False)."""
        kwargs["stream"] = False
        return self.generate(prompt, **kwargs)

    def speculate(self, prompt: str | Sequence[int], max_tokens: int = DEFAULT_MAX_TOKENS, draft: str = "store:64",
                  gamma: int = 3, ignore_eos: bool = False) -> Completion:
        """Greedy decoding sped up by a draft (runtime/speculative.py): the draft proposes `gamma`
        tokens, the model verifies them in one forward, rejected ones are rolled back out of both KV
        stores. The tokens are those of generate(prompt, temperature=0) up to the first EOS.

        draft: "store:C" (this model over a streaming store of C tokens) or "layers:N" (its first N
        layers + output head, early exit). Greedy only (no sampling, no stop strings); the model's
        KV config applies to the target store. Decodes max_tokens tokens and cuts at the first EOS
        (finish "stop"), so EOS costs the tokens after it. CPU backend only. The Completion's
        .speculation holds rounds, drafted, accepted, acceptance, tokens_per_round and seconds.
        On this 2-core CPU speculation is slower than plain decoding (bench/results/speculative.md)."""
        from ringllm.runtime.speculative import make_layer_draft, speculative_generate

        if self.backend != "cpu":
            raise ConfigError(f"speculate() needs the cpu backend, this LLM uses {self.backend!r}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
            raise ConfigError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer)) or not 1 <= gamma <= 16:
            raise ConfigError(f"gamma must be an integer in 1..16, got {gamma!r}")
        kind, _, value = str(draft).partition(":")
        if kind not in ("store", "layers") or not value.isdigit() or int(value) < 1:
            raise ConfigError(f"draft must be 'store:C' or 'layers:N' with a positive integer, got {draft!r}")
        ids = self._prompt_ids(prompt)
        store = self._engine.new_store(self.kv)
        check_room(store, self.spec, len(ids) + max_tokens + gamma)     # the verify runs gamma rows ahead
        if kind == "layers":
            drafts = self._layer_drafts
            if int(value) not in drafts:
                drafts[int(value)] = make_layer_draft(self.spec, self.model.tensors, int(value),
                                                      n_threads=self.n_threads)
            d_engine = drafts[int(value)]
            d_kv = self.kv
        else:
            if int(value) < 2:
                raise ConfigError(f"a draft store needs at least 2 slots, got {draft!r}")
            d_engine, d_kv = self._engine, KVConfig(capacity=int(value), policy="streaming", sinks=min(4, int(value) - 1))
        d_store = d_engine.new_store(d_kv)
        self._acquire()
        try:
            self._store = store
            t0 = time.perf_counter()
            toks, stats = speculative_generate(self._engine, store, d_engine, d_store, ids, int(max_tokens), int(gamma))
            wall = time.perf_counter() - t0
        finally:
            self._release()
        finish = "length"
        eos = frozenset() if ignore_eos else self.tokenizer.eos_ids
        cut = next((i for i, t in enumerate(toks) if t in eos), None)
        if cut is not None:
            toks, finish = toks[:cut], "stop"
        tm = Timings(prompt_tokens=len(ids), prompt_s=wall - stats["total_s"], gen_tokens=len(toks),
                     gen_s=stats["total_s"], peak_memory_bytes=self._peak_memory())
        return Completion(self.tokenizer.decode(toks), toks, finish, len(ids), tm, stats)

    def chat(self, messages: list[dict], stream: bool = False, **kwargs) -> "Generation | Completion":
        """Answer a conversation (list of {"role", "content"}) with the chat template, from a fresh
        store. Same keywords as generate(); non-streaming by default."""
        text = self.render_chat(messages, add_generation_prompt=True)
        return self.generate(self.chat_ids(text), stream=stream, **kwargs)

    def chat_session(self, system: str | None = None, kv: KVConfig | None = None, seed: int | None = None,
                     **defaults: Any):
        """A multi-turn ChatSession that keeps its KV store between turns (ringllm.session)."""
        from ringllm.session import ChatSession
        return ChatSession(self, system=system, kv=kv, seed=seed, **defaults)

    def _decode(self, gen: _Record, store, prefill_ids: list[int], history: list[int], sampler: Sampler,
                max_tokens: int | None, stopper: StopMatcher, ignore_eos: bool) -> Iterator[Chunk]:
        """Prefill `prefill_ids` into `store`, then sample, step and stream. Runs under the lock.
        history: the token history the penalties see (extended with every sampled token)."""
        yield from self._run(Decoder(self, gen, store, prefill_ids, history, sampler, max_tokens, stopper,
                                     ignore_eos))

    def _run(self, dec: Decoder) -> Iterator[Chunk]:
        """Drive one Decoder alone (engine.step per token). Runs under the lock."""
        rec = dec.record
        dec.prefill()
        while not dec.done:
            token = dec.feed()
            logits = None
            if token is not None:
                rec.in_engine = True
                logits = self._engine.step(token, dec.store)
                rec.in_engine = False
            yield dec.advance(logits)

    def _peak_memory(self) -> int:
        gpu = getattr(self._engine, "peak_memory_bytes", None)
        extra = 0
        if gpu is not None:
            try:
                extra = int(gpu() if callable(gpu) else gpu)
            except Exception:       # a backend gauge must never break a generation
                extra = 0
        return peak_rss_bytes() + extra

    # ------------------------------------------------------------------------------------------
    # Logits and stats
    # ------------------------------------------------------------------------------------------

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits (len(ids), n_vocab) float32: the tokens fed through a fresh store configured as
        this LLM's kv (decode semantics: with an eviction policy, each token sees only what the
        store holds when it arrives)."""
        if isinstance(ids, str) or len(ids) == 0:
            raise ConfigError("logits() takes a non-empty list of token ids (use tokenize() for text)")
        ids = self._prompt_ids(list(ids))
        self._acquire()
        try:
            store = self._engine.new_store(self.kv)
            check_room(store, self.spec, len(ids))
            self._store = store
            return np.asarray(self._engine.logits(ids, store), dtype=np.float32)
        finally:
            self._release()

    def kv_stats(self) -> dict:
        """Stats of the KV store of the latest generate()/logits() call (an empty store before
        any): at least capacity, length, evicted_total."""
        store = self._store
        if store is None:
            store = self._store = self._engine.new_store(self.kv)
        return store_stats(store, self.kv)
