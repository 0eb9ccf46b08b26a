"""`ringllm.LLM`: one loaded model behind the verbs an application needs.

    llm = ringllm.LLM()                                   # the bundled SmolLM2-135M-Instruct
    llm = ringllm.LLM("model.gguf", kv=ringllm.KVConfig(capacity=512, policy="streaming"))
    for chunk in llm.generate("Once upon a time", max_tokens=32):
        print(chunk.text, end="", flush=True)
    llm.complete("2 + 2 =", max_tokens=4).text
    llm.chat([{"role": "user", "content": "Hi"}]).text
    session = llm.chat_session(); session.send("Hi")      # multi-turn, the KV store kept between turns

The LLM owns the model, its tokenizer, one engine (ringllm.backends) and the lock of that engine;
everything particular to one sequence lives elsewhere: the decode loop in ringllm.decoder
(Decoder), the result types in ringllm.generation (Chunk, Completion, Generation, Timings),
multi-turn state in ringllm.session, batching in ringllm.batch. Those modules use the LLM only
through its public seams:

    llm.engine_lock(store)    context manager: the engine lock, for any engine call
    llm.next_seed()           a seed from the LLM's seeded generator, for calls made without one
    llm.decoder(...)          a checked Decoder on a fresh store, for a caller that drives the engine
    llm.prompt_ids(prompt)    token ids of a text or id prompt, checked against the vocabulary

Every generation runs under the engine lock: threads sharing one LLM take turns (a generation
holds the lock from its first chunk to its last, or until it is closed); a thread that starts a
second generation while its own first one is still open gets an error instead of a deadlock.
Argument errors (ConfigError) are raised by the call itself, before any chunk.

Streams are Chunk objects (.text, .token, .finish_reason on the last, .timings); the iterator,
Generation, keeps .tokens, .text, .finish_reason and .timings (ringllm.generation says what they
guarantee).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from ringllm.backends import BACKENDS, check_room, engine_peak_memory, make_engine, store_stats
from ringllm.chat_template import check_template_kwargs, render_chat
from ringllm.compile_helper import helper_argv
from ringllm.constraints import Grammar, compile_grammar, json_schema_of
from ringllm.decoder import Decoder, check_max_tokens
from ringllm.generation import Chunk, Completion, Generation, Record, Timings
from ringllm.gc_pause import collector_paused
from ringllm.models.bundled import default_model_path
from ringllm.models.loader import load_model
from ringllm.runtime import compile_clock, compile_share, compiler_pages
from ringllm.runtime.compile_clock import CompileSpan
from ringllm.runtime.errors import ConfigError, RingLLMError
from ringllm.runtime.host_memory import release_file_pages, trim_heap
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.speculative import make_layer_draft, speculative_generate
from ringllm.runtime.warmup import estimate_compile_seconds, warm
from ringllm.sampling import Sampler, SamplingParams, StopMatcher
from ringllm.session import ChatSession
from ringllm.tools import ToolPlan

# Chunk, Completion, Generation, Timings (ringllm.generation), Decoder (ringllm.decoder), BACKENDS
# and the store helpers check_room, store_stats (ringllm.backends) are importable from here too.
__all__ = ["LLM", "Chunk", "Completion", "Decoder", "Generation", "Timings", "BACKENDS"]

DEFAULT_MAX_TOKENS = 256


def _start_compile_helper(model, kv: KVConfig, precision: str) -> None:
    """Start the compile helper of a cold start for `model` (None: the bundled one) where
    compile_share.start_helper says one pays; a model that cannot be found is left for load_model to
    report."""
    try:
        path = default_model_path() if model is None else os.fspath(model)
    except (RingLLMError, TypeError):
        return
    if not os.path.exists(path):
        return
    if os.path.isdir(path):
        size = sum(e.stat().st_size for e in os.scandir(path) if e.is_file() and e.name.endswith(".safetensors"))
    else:
        size = os.path.getsize(path)
    compile_share.start_helper(helper_argv(path, kv, precision), size)


def _progress_bar(steps: int):
    """The loading bar on stderr (tqdm, imported here: a process that shows no bar never imports it)."""
    from tqdm import tqdm
    return tqdm(total=steps, desc="loading model", unit="step", file=sys.stderr, leave=False)


class _NoBar:
    """The loading bar's methods LLM calls, doing nothing: no bar shown."""

    def update(self, n: int = 1) -> None:
        pass

    def set_description(self, desc: str) -> None:
        pass

    def close(self) -> None:
        pass


class LLM:
    """A loaded model, its engine and tokenizer.

    Args:
        model: None (the bundled SmolLM2-135M-Instruct), a GGUF file, or an HF checkpoint directory.
        kv: KVConfig of every sequence this LLM decodes (default: policy full at the model's context).
        backend: "cpu" (Numba engine), "cuda" (ringllm.native), "reference" (the NumPy oracle; slow),
            "none" (no engine: tokenizer, chat template and grammars only, for a front end such as
            the Ray Serve ingress; the weights stay unread in the file's mapping).
        n_threads: CPU threads (None: all cores).
        seed: seeds the generator that seeds each call made without its own seed.
        progress: tqdm bars while loading (None: only when stderr is a terminal).
        chat_template: overrides the model's chat template.
        warmup: run every kernel this LLM's KV config uses once now (runtime/warmup.py), so the first
            generation does not pay for compiling them; .compile_s holds the seconds that took.
            Without it, kernels compile when first used and Timings.compile_s reports that time.
        precision: "f32" (default): exact float32 activations in the weight products; "q8":
            llama.cpp's numerics and speed, activations quantized to 8 bits per block (Q8_0 / Q8_K)
            and integer dot products for Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K weights (other types
            stay exact). CPU backend only.
    """

    def __init__(self, model: str | os.PathLike | None = None, kv: KVConfig | dict | None = None,
                 backend: str = "cpu", n_threads: int | None = None, seed: int = 0, *,
                 n_batch: int = 64, progress: bool | None = None, chat_template: str | None = None,
                 warmup: bool = False, precision: str = "f32"):
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
        if precision not in ("f32", "q8"):
            raise ConfigError(f"precision {precision!r} unknown; valid: 'f32', 'q8'")
        if precision != "f32" and backend != "cpu":
            raise ConfigError(f"precision {precision!r} is implemented by the cpu backend only, not {backend!r}")
        if n_threads is not None and (isinstance(n_threads, bool) or not isinstance(n_threads, int) or n_threads < 1):
            raise ConfigError(f"n_threads must be a positive integer, got {n_threads!r}")
        show = sys.stderr.isatty() if progress is None else bool(progress)
        bar = _progress_bar(3 if warmup else 2) if show else _NoBar()
        try:
            if backend == "cpu" and n_threads != 1:      # a cold start compiles on two cores (compile_share)
                _start_compile_helper(model, kv, precision)
            with collector_paused():         # start-up makes no cyclic garbage: no collector passes over it
                self.model = load_model(model)
                trim_heap()      # the tokenizer's build freed tens of MB (262k-token vocabularies): returned now
                bar.update(1)
                bar.set_description("preparing engine")
                # LongRoPE models take their long factors when this LLM's positions can pass the original
                # context (reindexed positions stay below the capacity; original ones grow to the model's)
                reach = (kv.capacity if kv.capacity is not None and kv.positions == "reindexed"
                         else self.model.spec.n_ctx)
                self.spec, self.tokenizer = self.model.spec.for_context(reach), self.model.tokenizer
                self.kv, self.backend, self.n_threads, self.seed = kv, backend, n_threads, int(seed)
                self.precision = precision
                if backend == "cpu":         # what the first-compile notice quotes, should one be needed
                    compile_clock.expect(estimate_compile_seconds(
                        {t.qtype for t in self.model.tensors.values() if len(t.shape) == 2}, kv))
                self._engine = make_engine(backend, self.spec, self.model.tensors, n_threads, n_batch, precision)
                if self._engine is not None:    # the engine holds its own copy of the weights: the file's pages go
                    release_file_pages(t.stored for t in self.model.tensors.values())
                    trim_heap()                  # and the heap memory the repacking's temporaries were freed into
                if backend == "cpu":             # a cold start: what to compile while the helper has the attention
                    for job in self._engine.warm_ahead():
                        compile_share.when_idle(job)
            self.compile_s = 0.0
            bar.update(1)
            if warmup and backend in ("cpu", "cuda"):
                bar.set_description("warming up")
                with CompileSpan() as compiling:
                    warm(self._engine, kv, few_rows=False)
                self.compile_s = compiling.seconds
                bar.update(1)
        except BaseException:
            compile_share.stop_helper()
            raise
        finally:
            bar.close()
        compiler_pages.release()         # the repacking's kernels are loaded: LLVM's code pages can go
        self.chat_template = chat_template if chat_template is not None else self.tokenizer.chat_template
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._seeds = np.random.Generator(np.random.PCG64(self.seed))
        self._seed_lock = threading.Lock()
        self._store = None
        self._layer_drafts: dict[int, Any] = {}       # speculate(): early-exit drafts by layer count

    # ------------------------------------------------------------------------------------------
    # Properties
    # ------------------------------------------------------------------------------------------

    @property
    def engine(self):
        if self._engine is None:
            raise ConfigError("this LLM was loaded with backend 'none': it tokenizes, renders chats and compiles "
                              "grammars, but has no engine to run the model")
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

    @contextmanager
    def engine_lock(self, store=None) -> Iterator[None]:
        """Hold the LLM's lock for engine calls (the engine's run buffers are shared): threads take
        turns; the thread that already holds it gets a RingLLMError instead of a deadlock (e.g. a
        second generation started while its own first one is still open). store: the store those
        calls use, which kv_stats() then reports."""
        me = threading.get_ident()
        if self._owner == me:
            raise RingLLMError("this thread already has a generation of this LLM open; finish it or close() it "
                               "before starting another")
        self._lock.acquire()
        self._owner = me
        try:
            if store is not None:
                self._store = store
            yield
        finally:
            self._owner = None
            self._lock.release()
            compiler_pages.release()     # the kernels these calls loaded are in: LLVM's code pages can go

    def next_seed(self) -> int:
        """A seed drawn from the LLM's seeded generator (thread-safe): what a call made without
        its own seed uses."""
        with self._seed_lock:
            return int(self._seeds.integers(0, 2 ** 63 - 1))

    # ------------------------------------------------------------------------------------------
    # Tokens
    # ------------------------------------------------------------------------------------------

    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of text. add_bos None follows the model's rule; special: match control-token
        strings ("<|im_start|>") as those tokens (False for untrusted text)."""
        return self.tokenizer.encode(text, add_bos=add_bos, parse_special=special)

    def detokenize(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special=skip_special)

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt given as text or as ids (each checked against the vocabulary); an
        empty prompt becomes [BOS] (or [EOS] without one). ConfigError on anything else."""
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
            seed = self.next_seed()
        return Sampler(params, seed)

    def generate(self, prompt: str | Sequence[int], max_tokens: int | None = DEFAULT_MAX_TOKENS,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 repeat_penalty: float = 1.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                 logit_bias: dict[int, float] | None = None, stop: str | Sequence[str] | None = None,
                 ignore_eos: bool = False, seed: int | None = None, stream: bool = True,
                 penalty_last_n: int = 64, response_format: dict | None = None, grammar: Any = None,
                 regex: str | None = None) -> "Generation | Completion":
        """Generate after `prompt` (text, or token ids) from a fresh KV store.

        max_tokens: tokens to generate at most (None: until EOS, a stop string or a full context).
        temperature 0 is greedy; the other sampling knobs are described in ringllm.sampling.
        stop: strings that end the generation (not included in the text).
        seed: the sampler's seed (None: drawn from the LLM's seeded generator).
        stream: True returns a Generation (iterator of Chunk); False runs it and returns a Completion.
        response_format / grammar / regex (at most one): constrain the answer to JSON, a JSON Schema,
        a Lark or GBNF grammar (or a Grammar from compile_grammar) or a regex (ringllm.constraints);
        the answer ends ("stop") where the grammar is complete. Not with ignore_eos.
        Errors (ConfigError; GrammarError for a constraint that does not compile) for bad arguments
        and for a prompt longer than a policy-full context are raised here, before any chunk.
        """
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                                presence_penalty=presence_penalty, logit_bias=dict(logit_bias or {}),
                                penalty_last_n=penalty_last_n)
        compiled = self.compile_grammar(response_format=response_format, grammar=grammar, regex=regex)
        dec = self._new_decoder(prompt, params, max_tokens, stop, ignore_eos, seed, compiled)

        def body():
            with self.engine_lock(dec.store):
                yield from dec.run()

        gen = Generation(dec.record, body())
        return gen if stream else gen.result()

    def decoder(self, prompt: str | Sequence[int], max_tokens: int | None = DEFAULT_MAX_TOKENS,
                stop: str | Sequence[str] | None = None, ignore_eos: bool = False, seed: int | None = None,
                response_format: dict | None = None, grammar: Any = None, regex: str | None = None,
                kv: KVConfig | None = None, store=None, **sampling: Any) -> Decoder:
        """A Decoder of `prompt`, for a caller that drives the engine itself (e.g. several sequences
        batched by ringllm.batch.BatchDecoder). Keywords as generate(); sampling: the SamplingParams
        fields (temperature, top_k, top_p, min_p, repeat_penalty, frequency_penalty,
        presence_penalty, logit_bias, penalty_last_n). Nothing is computed yet.

        kv: the store's KVConfig (None: the LLM's). store: a store already fed the prompt's first
        store.n_seen tokens (fewer than the prompt has; e.g. a fork from ringllm.prompt_cache),
        which the decoder continues: prefill feeds only the rest. The caller vouches that those
        tokens are the prompt's; None: a fresh store."""
        unknown = set(sampling) - set(SamplingParams.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown sampling option(s) {sorted(unknown)}; valid: "
                              f"{sorted(SamplingParams.__dataclass_fields__)}")
        if kv is not None and not isinstance(kv, KVConfig):
            raise ConfigError(f"kv must be a KVConfig, got {type(kv).__name__}")
        sampling["logit_bias"] = dict(sampling.get("logit_bias") or {})
        compiled = self.compile_grammar(response_format=response_format, grammar=grammar, regex=regex)
        return self._new_decoder(prompt, SamplingParams(**sampling), max_tokens, stop, ignore_eos, seed, compiled,
                                 kv=kv, store=store)

    def compile_grammar(self, response_format: dict | None = None, grammar: Any = None,
                        regex: str | None = None) -> Grammar | None:
        """The constraint a request asks for, compiled against this model's vocabulary (None when
        it asks for none); pass it as generate(grammar=...) to reuse it. GrammarError (a ConfigError)
        names what does not compile. ringllm.constraints says what each keyword takes."""
        return compile_grammar(self.tokenizer, response_format=response_format, grammar=grammar, regex=regex)

    def _new_decoder(self, prompt, params: SamplingParams, max_tokens, stop, ignore_eos: bool,
                     seed: int | None, grammar: Grammar | None = None, kv: KVConfig | None = None,
                     store=None) -> Decoder:
        """Checks every argument (ConfigError before anything runs) and builds the Decoder."""
        params.validate(self.n_vocab)
        check_max_tokens(max_tokens)
        if grammar is not None and grammar.tokenizer is not self.tokenizer:
            raise ConfigError("this grammar was compiled for another model's vocabulary; compile it with this "
                              "LLM's compile_grammar()")
        if grammar is not None and ignore_eos:
            raise ConfigError("ignore_eos cannot be combined with a response_format, grammar or regex: the "
                              "grammar decides where the answer ends")
        ids = self.prompt_ids(prompt)
        stopper = StopMatcher(stop)
        sampler = self._sampler(params, seed)
        kv = kv or self.kv
        compress = None
        if kv.compress is not None and store is None and self.streams_prompt(len(ids), kv):
            kv = kv.decode_config(kv.capacity)      # too long to compress: through the decode-time policy
        if kv.compress is not None:          # prefill whole, press, release (runtime/compress.py)
            if store is not None:
                raise ConfigError("a compressing KVConfig prefills the whole prompt into a store of its own; it "
                                  "cannot continue a given store")
            self.check_prompt(len(ids), kv)
            room = self.n_ctx - len(ids) if max_tokens is None else min(int(max_tokens), self.n_ctx - len(ids))
            done = 0

            def compress(prefill_ids):
                return self.compress_prefill(prefill_ids, kv, room)
        elif store is None:
            store = self.engine.new_store(kv)
            done = 0
            check_room(store, self.spec, len(ids))      # the clear error, before a generator exists
        else:
            done = store.n_seen
            if not 0 <= done < len(ids):
                raise ConfigError(f"a store continued by a decoder must hold fewer tokens than the prompt ({len(ids)}); "
                                  f"it holds {done}")
            check_room(store, self.spec, len(ids) - done)
        record = Record()
        if grammar is not None:
            sampler.constraint = record.constraint = grammar.start()
        return Decoder(self, record, store, ids[done:], list(ids), sampler, max_tokens, stopper, ignore_eos,
                       compress=compress)

    # ------------------------------------------------------------------------------------------
    # Prompt compression (KVConfig.compress)
    # ------------------------------------------------------------------------------------------

    def check_prompt(self, n: int, kv: KVConfig, held: int = 0) -> None:
        """ConfigError before anything runs when a compressing call cannot take an n-token prompt:
        past KVConfig.max_prompt (default the model's context), past the context with what the
        store holds (`held`), or on a backend without compression. (Past those limits a KVConfig with
        compress_overflow "stream" does not call this: streams_prompt.)"""
        if self.backend not in ("cpu", "reference"):
            raise ConfigError(f"prompt compression runs on the cpu and reference backends, not {self.backend!r}")
        limit = kv.max_prompt or self.n_ctx
        if n > limit:
            raise ConfigError(f"the prompt has {n} tokens, more than max_prompt {limit}: raise KVConfig.max_prompt "
                              "or shorten the prompt")
        if held + n > self.n_ctx:
            raise ConfigError(f"{held + n} tokens (held and new) exceed the model's context {self.n_ctx}: a "
                              "compressing prefill holds the whole prompt first")

    def streams_prompt(self, n: int, kv: KVConfig, held: int = 0) -> bool:
        """True when an n-token prompt (after `held` tokens a store holds) is past what a compressing
        call takes (check_prompt) and KVConfig.compress_overflow is "stream": it then goes through the
        decode-time policy uncompressed instead of failing."""
        if kv.compress is None or kv.compress_overflow != "stream":
            return False
        return n > (kv.max_prompt or self.n_ctx) or held + n > self.n_ctx

    def compress_prefill(self, ids: Sequence[int], kv: KVConfig, room: int, prior=None):
        """Prefill ids after `prior` (a store, or None: a fresh one) and compress them with kv's press
        (runtime/compress.py; the reference engine's runtime/reference_press.py on backend
        "reference"). Returns (the decode store, the last token's logits (n_vocab,)); the store is
        the one kv_stats() reports from now on. The caller holds the engine lock."""
        if self.backend == "reference":
            from ringllm.runtime.reference_press import reference_compress_prefill
            store, logits = reference_compress_prefill(self._engine.ref, ids, kv, room, prior)
        else:
            from ringllm.runtime.compress import compress_prefill
            store, logits = compress_prefill(self._engine, ids, kv, room, prior)
        self._store = store
        return store, logits

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
        On this 2-core CPU speculation is slower than plain decoding over short stores
        (bench/results/speculative*.md) and about even over a 4096-slot one (speculative_long_*.md): a
        drafted token costs most of a decode step, the draft's weights being the model's."""
        if self.backend != "cpu":
            raise ConfigError(f"speculate() needs the cpu backend, this LLM uses {self.backend!r}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
            raise ConfigError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer)) or not 1 <= gamma <= 16:
            raise ConfigError(f"gamma must be an integer in 1..16, got {gamma!r}")
        kind, _, value = str(draft).partition(":")
        if kind not in ("store", "layers") or not value.isdigit() or int(value) < 1:
            raise ConfigError(f"draft must be 'store:C' or 'layers:N' with a positive integer, got {draft!r}")
        ids = self.prompt_ids(prompt)
        store = self.engine.new_store(self.kv)
        check_room(store, self.spec, len(ids) + max_tokens + gamma)     # the verify runs gamma rows ahead
        if kind == "layers":
            drafts = self._layer_drafts
            if int(value) not in drafts:
                drafts[int(value)] = make_layer_draft(self.spec, self.model.tensors, int(value),
                                                      n_threads=self.n_threads, precision=self.precision)
            d_engine = drafts[int(value)]
            d_kv = self.kv
        else:
            if int(value) < 2:
                raise ConfigError(f"a draft store needs at least 2 slots, got {draft!r}")
            d_engine, d_kv = self._engine, KVConfig(capacity=int(value), policy="streaming", sinks=min(4, int(value) - 1))
        d_store = d_engine.new_store(d_kv)
        with self.engine_lock(store):
            t0 = time.perf_counter()
            with CompileSpan() as compiling:
                toks, stats = speculative_generate(self._engine, store, d_engine, d_store, ids, int(max_tokens),
                                                   int(gamma))
            wall = time.perf_counter() - t0 - compiling.seconds
        finish = "length"
        eos = frozenset() if ignore_eos else self.tokenizer.eos_ids
        cut = next((i for i, t in enumerate(toks) if t in eos), None)
        if cut is not None:
            toks, finish = toks[:cut], "stop"
        tm = Timings(prompt_tokens=len(ids), prompt_s=wall - stats["total_s"], gen_tokens=len(toks),
                     gen_s=stats["total_s"], compile_s=compiling.seconds,
                     peak_memory_bytes=engine_peak_memory(self._engine))
        return Completion(self.tokenizer.decode(toks), toks, finish, len(ids), tm, stats)

    def chat(self, messages: list[dict], stream: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None, tool_choice: Any = None, parallel_tool_calls: bool = True,
             **kwargs) -> "Generation | Completion":
        """Answer a conversation (list of {"role", "content"}) with the chat template, from a fresh
        store. Same keywords as generate() (response_format, grammar, regex included);
        non-streaming by default.

        chat_template_kwargs: extra variables for the template, as apply_chat_template's keywords
        and the OpenAI servers' field of that name: {"enable_thinking": False} for Qwen3 and
        SmolLM3, Llama 3's "date_string", ... (checked by check_template_kwargs).
        tools, tool_choice ("auto" | "none" | "required" | {"type": "function", "function": {"name"}}),
        parallel_tool_calls: OpenAI's function calling (ringllm.tools). The result's .tool_calls
        lists the calls (OpenAI's shape; finish_reason "tool_calls"), .content the text beside them,
        .message the assistant message to append; messages with role "tool" give the results back.
        With stream=True the chunks carry the raw text and the Generation's .tool_calls and
        .content are set when it ends."""
        extra = check_template_kwargs(chat_template_kwargs)
        if tools is None:
            if tool_choice is not None:
                raise ConfigError("tool_choice needs tools")
            text = self.render_chat(messages, add_generation_prompt=True, **extra)
            return self.generate(self.chat_ids(text), stream=stream, **kwargs)
        if "tools" in extra:
            raise ConfigError("give tools either as tools= or in chat_template_kwargs, not both")
        plan = ToolPlan.build(self, messages, tools, tool_choice, parallel_tool_calls, extra)
        if plan.grammar is not None:
            asked = [k for k in ("response_format", "grammar", "regex") if kwargs.get(k) is not None
                     and not (k == "response_format" and json_schema_of(kwargs[k]) is None)]
            if asked:
                raise ConfigError(f"{asked[0]} cannot be combined with tools unless tool_choice is 'none'")
            kwargs["grammar"] = plan.grammar
        text = self.render_chat(messages, add_generation_prompt=True, **{**extra, **plan.template_kwargs})
        gen = self.generate(self.chat_ids(text), stream=True, **kwargs)
        record = gen.record

        def parsed():
            for chunk in gen:
                if chunk.finish_reason is not None:
                    record.content, record.tool_calls = plan.parse(record.text)
                    if record.tool_calls:
                        record.finish_reason = chunk.finish_reason = "tool_calls"
                yield chunk
            if record.tool_calls is None and record.done:       # ended at its prefill: no chunk
                record.content, record.tool_calls = plan.parse(record.text)

        out = Generation(record, parsed())
        return out if stream else out.result()

    def chat_session(self, system: str | None = None, kv: KVConfig | None = None, seed: int | None = None,
                     history_tokens: int | None = None, **defaults: Any):
        """A multi-turn ChatSession that keeps its KV store between turns (ringllm.session);
        history_tokens bounds what else it keeps (ChatSession)."""
        return ChatSession(self, system=system, kv=kv, seed=seed, history_tokens=history_tokens, **defaults)

    # ------------------------------------------------------------------------------------------
    # Logits and stats
    # ------------------------------------------------------------------------------------------

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits (len(ids), n_vocab) float32: the tokens fed through a fresh store configured as
        this LLM's kv (decode semantics: with an eviction policy, each token sees only what the
        store holds when it arrives)."""
        if isinstance(ids, str) or len(ids) == 0:
            raise ConfigError("logits() takes a non-empty list of token ids (use tokenize() for text)")
        if self.kv.compress is not None:
            raise ConfigError("logits() feeds tokens one at a time (decode semantics); KVConfig.compress compresses "
                              "a prompt after its prefill (generate, chat, chat sessions)")
        ids = self.prompt_ids(list(ids))
        with self.engine_lock():
            store = self.engine.new_store(self.kv)
            check_room(store, self.spec, len(ids))
            self._store = store
            return np.asarray(self.engine.logits(ids, store), dtype=np.float32)

    def kv_stats(self) -> dict:
        """Stats of the KV store of the latest generate()/logits() call (an empty store before
        any): at least capacity, length, evicted_total."""
        store = self._store
        if store is None:
            store = self._store = self.engine.new_store(self.kv)
        return store_stats(store, self.kv)
