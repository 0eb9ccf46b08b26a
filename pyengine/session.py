"""Multi-turn chat that keeps its KV store between turns, and session files.

    session = llm.chat_session(system="You are terse.")
    for chunk in session.send("Hi!"):           # streams, like LLM.generate
        print(chunk.text, end="")
    session.send("And then?", stream=False).text
    session.save("chat.session"); session = ChatSession.load(llm, "chat.session")
    session.send("Give me JSON.", response_format={"type": "json_object"}, max_tokens=8)   # cut at 8 tokens
    session.continue_answer(max_tokens=200)     # the same answer goes on, under the same constraint

A turn prefills only what is new: the end of the previous answer as the chat template closes it
(e.g. "<|im_end|>\\n"), the new user message, and the generation prompt. That text is the
difference between two renderings of the template (the last exchange with and without the new
message), so any template works; the whole history is never prefilled again. With an eviction
policy (KVConfig(policy="streaming", capacity=256)) the store stays the same size however long the
conversation runs; with history_tokens=N so does the rest of the session (it keeps the last N
tokens of its history, which the repetition penalties read, and only the messages the chat template
needs to close a turn: the system message and the last exchange), so memory and each save's size
stay flat over a conversation of any length. By default the whole transcript is kept.

Session file: a NumPy .npz archive (never pickle; loaded with allow_pickle=False) holding the KV
store's arrays and one JSON header: format name and version, the model's identity, the KV config,
the messages, the token history, tokens sampled but not yet fed, the sampler's generator state and
defaults, the state of an answer max_tokens cut (its grammar and the tokens the grammar accepted,
replayed on load, so continue_answer() after a load goes on exactly as without it), and a SHA-256
over header and arrays. A file is written through runtime/atomic_file.py (temporary
file in the same folder, fsync, rename, folder fsync), so a crash never leaves half a file and a
full disk raises SessionFileError with the old file kept; a damaged, truncated or foreign file raises SessionFileError
(a ConfigError) naming the problem, and nothing is changed until everything has been checked.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from typing import Any

import numpy as np

from ringllm.backends import check_room, store_stats
from ringllm.chat_template import check_template_kwargs, validate_messages
from ringllm.constraints import constraint_from_state
from ringllm.decoder import Decoder, check_max_tokens
from ringllm.generation import Completion, Generation, Record
from ringllm.runtime.atomic_file import atomic_open
from ringllm.runtime.errors import ConfigError, RingLLMError
from ringllm.runtime.host_memory import trim_heap
from ringllm.runtime.kv_config import KVConfig
from ringllm.sampling import Sampler, SamplingParams, StopMatcher

__all__ = ["ChatSession", "SessionFileError", "SESSION_FORMAT", "SESSION_VERSION"]

SESSION_FORMAT = "ringllm-session"
SESSION_VERSION = 1
# what a compressed prompt's store keeps beside its arrays (KVStore.state), saved in the header
STORE_META = ("released", "ring_rope", "layer_capacity", "press_stats", "q4_0_rows")
_SENTINEL = "\x00ringllm-answer\x00"
_SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "frequency_penalty",
                  "presence_penalty", "penalty_last_n", "logit_bias")
_OTHER_KEYS = ("max_tokens", "stop", "ignore_eos")
_CONSTRAINT_KEYS = ("response_format", "grammar", "regex")      # per answer (send), never defaults


class SessionFileError(ConfigError):
    """A session file that cannot be loaded: missing, truncated, corrupt, or made for another model."""

    def __init__(self, path: str | os.PathLike, problem: str):
        self.path, self.problem = os.fspath(path), problem
        super().__init__(f"session file {self.path}: {problem}")


def _check_history_tokens(n) -> int | None:
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"history_tokens must be a positive integer or None, got {n!r}")
    return n


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def model_identity(llm) -> dict:
    """What a session file must match: the architecture's sizes, the model's name, and a hash of
    its final norm weights (tells finetunes of one architecture apart)."""
    s = llm.spec
    t = llm.model.tensors.get("output_norm.weight")
    digest = hashlib.sha256(np.ascontiguousarray(t.data).tobytes()).hexdigest()[:16] if t is not None else ""
    return {"arch": s.arch, "n_vocab": s.n_vocab, "n_layer": s.n_layer, "n_embd": s.n_embd, "n_head": s.n_head,
            "n_head_kv": s.n_head_kv, "head_dim": s.head_dim, "name": llm.model_name, "weights": digest}


def file_checksum(header: dict, arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256(json.dumps(header, sort_keys=True).encode("utf-8"))
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


class ChatSession:
    """A conversation with one LLM that keeps its KV store between turns.

    Args:
        llm: the LLM.
        system: an optional system message.
        kv: the KV config of this conversation (default: the LLM's).
        seed: the sampler's seed (None: drawn from the LLM's generator).
        chat_template_kwargs: extra chat template variables for every turn, as LLM.chat takes them
            ({"enable_thinking": False}, ...); fixed for the session (saved with it), since each
            turn's prefill is the difference of two renderings that must agree on them.
        history_tokens: keep only the last N tokens of the token history and the messages the chat
            template needs (the system message and the last exchange); None (default) keeps every
            message and token. Penalties with penalty_last_n -1 ("the whole history") then see the
            last N tokens.
        defaults: default keywords of send() (max_tokens, temperature, top_p, stop, ...).
    """

    def __init__(self, llm, system: str | None = None, kv: KVConfig | None = None, seed: int | None = None,
                 chat_template_kwargs: dict | None = None, history_tokens: int | None = None, **defaults: Any):
        if kv is not None and not isinstance(kv, KVConfig):
            raise ConfigError(f"kv must be a KVConfig, got {type(kv).__name__}")
        if system is not None and not isinstance(system, str):
            raise ConfigError(f"system must be a string, got {type(system).__name__}")
        unknown = sorted(set(defaults) - set(_SAMPLING_KEYS) - set(_OTHER_KEYS))
        if unknown:
            raise ConfigError(f"unknown session defaults {unknown}; valid: {sorted(_SAMPLING_KEYS + _OTHER_KEYS)}")
        self.chat_template_kwargs = check_template_kwargs(chat_template_kwargs)
        self.history_tokens = _check_history_tokens(history_tokens)
        self.llm = llm
        self.kv = kv or llm.kv
        self.system = system
        self.defaults = dict(defaults)
        self._split(dict(defaults))          # validate now
        if seed is None:
            seed = llm.next_seed()
        self.seed = seed
        self.reset()

    # ------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the conversation (the system message stays); the next turn starts a fresh store."""
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        self.store = None
        self.tokens: list[int] = []        # the tokens fed into the store, in order (the last history_tokens)
        self.n_fed = 0                     # every token ever fed into the store (== store.n_seen)
        self.pending: list[int] = []       # answer tokens sampled but not yet fed (fed first next turn)
        self.sampler_state = Sampler(SamplingParams(), self.seed).state()
        self.turns = 0
        self.cut_answer: dict | None = None     # the last answer, cut by max_tokens: {"constraint": state | None}
        self._damaged: str | None = None

    def kv_stats(self) -> dict:
        if self.store is None:
            return store_stats(self.llm.engine.new_store(self.kv), self.kv)
        return store_stats(self.store, self.kv)

    def _split(self, kw: dict) -> tuple[SamplingParams, dict]:
        unknown = sorted(set(kw) - set(_SAMPLING_KEYS) - set(_OTHER_KEYS))
        if unknown:
            raise ConfigError(f"unknown send() arguments {unknown}; valid: {sorted(_SAMPLING_KEYS + _OTHER_KEYS)}")
        params = SamplingParams(**{k: kw[k] for k in _SAMPLING_KEYS if k in kw})
        params.validate(self.llm.n_vocab)
        other = {"max_tokens": kw.get("max_tokens", 256), "stop": kw.get("stop"),
                 "ignore_eos": bool(kw.get("ignore_eos", False))}
        check_max_tokens(other["max_tokens"])
        return params, other

    def _turn_delta(self, user: dict) -> str:
        """Text that takes the store from the end of the last answer to the new generation prompt."""
        llm, prev = self.llm, self.messages
        head = prev[:1] if prev and prev[0]["role"] == "system" else []
        body = prev[len(head):]
        # the last exchange (user, assistant) is enough context for the template to close it
        ctx = head + body[-2:-1]
        answer = body[-1]
        extra = self.chat_template_kwargs
        a = llm.render_chat(ctx + [answer], add_generation_prompt=False, **extra)
        b = llm.render_chat(ctx + [answer, user], add_generation_prompt=True, **extra)
        s = llm.render_chat(ctx + [{"role": "assistant", "content": _SENTINEL}], add_generation_prompt=False,
                            **extra)
        close = s[s.index(_SENTINEL) + len(_SENTINEL):] if _SENTINEL in s else ""
        new = b[len(a):] if b.startswith(a) else b[_common_prefix(a, b):]
        return close + new

    def send(self, text: str, stream: bool = True, **kwargs: Any) -> "Generation | Completion":
        """Add a user message and answer it. Keywords as LLM.generate (max_tokens, temperature, ...,
        stop, ignore_eos, response_format / grammar / regex for this answer); the session's defaults
        fill the rest. Returns a Generation (stream) or a Completion. Only new tokens are
        prefilled. A ConfigError (e.g. the context of policy full is exhausted, a grammar that does
        not compile) is raised before anything changes."""
        if self._damaged:
            raise RingLLMError(self._damaged)
        if not isinstance(text, str):
            raise ConfigError(f"the message must be a string, got {type(text).__name__}")
        constraint_kw = {k: kwargs.pop(k) for k in _CONSTRAINT_KEYS if k in kwargs}
        params, other = self._split({**self.defaults, **kwargs})
        llm = self.llm
        grammar = llm.compile_grammar(**constraint_kw)
        if grammar is not None and other["ignore_eos"]:
            raise ConfigError("ignore_eos cannot be combined with a response_format, grammar or regex")
        user = {"role": "user", "content": text}
        if self.store is None:
            ids = llm.chat_ids(llm.render_chat(self.messages + [user], add_generation_prompt=True,
                                               **self.chat_template_kwargs))
            store = llm.engine.new_store(self.kv) if self.kv.compress is None else None
        else:
            delta = self._turn_delta(user)
            ids = list(self.pending) + llm.tokenizer.encode(delta, add_bos=False, parse_special=True)
            store = self.store
        store = self._check_turn(ids, store)

        def commit(gen: Record) -> None:
            self.messages = self.messages + [user, {"role": "assistant", "content": gen.text}]
            self.turns += 1

        return self._answer(ids, store, params, other, grammar.start() if grammar else None, commit, stream)

    def continue_answer(self, stream: bool = True, **kwargs: Any) -> "Generation | Completion":
        """Go on with the last answer where max_tokens cut it (finish_reason "length"), under the
        same response_format / grammar / regex, which a saved session keeps: a session saved after
        the cut, loaded and continued, gives the same tokens as the original continued. Keywords as
        send() (sampling, max_tokens, stop) except the constraint, which is the answer's. The text
        is added to the last assistant message. ConfigError when there is nothing to continue."""
        if self._damaged:
            raise RingLLMError(self._damaged)
        if self.cut_answer is None or not self.pending:
            raise ConfigError("there is no answer to continue: the last one ended (or none was cut by max_tokens)")
        unknown = sorted(set(kwargs) & set(_CONSTRAINT_KEYS))
        if unknown:
            raise ConfigError(f"continue_answer() keeps the answer's own constraint; it does not take {unknown}")
        params, other = self._split({**self.defaults, **kwargs})
        saved = self.cut_answer.get("constraint")
        constraint = constraint_from_state(self.llm.tokenizer, saved) if saved else None
        if constraint is not None and other["ignore_eos"]:
            raise ConfigError("ignore_eos cannot be combined with the answer's constraint")
        ids = list(self.pending)
        self._check_turn(ids, self.store)

        def commit(gen: Record) -> None:
            last = dict(self.messages[-1])
            last["content"] = (last.get("content") or "") + gen.text
            self.messages = self.messages[:-1] + [last]

        return self._answer(ids, self.store, params, other, constraint, commit, stream)

    def _held(self) -> int:
        """Tokens the session's store holds now (the most any layer holds; 0 before the first turn)."""
        if self.store is None:
            return 0
        return int(self.store.n_seen) - int(getattr(self.store, "released", 0))

    def _check_turn(self, ids: list[int], store):
        """The store a turn of `ids` is prefilled into (`store`; for a first turn too long to compress,
        with compress_overflow "stream", a new store of the decode-time policy), after the checks that
        raise ConfigError before anything runs."""
        llm, kv = self.llm, self.kv
        if kv.compress is not None:
            if not llm.streams_prompt(len(ids), kv, self._held()):
                llm.check_prompt(len(ids), kv, self._held())
                return store
            if store is None:                # streams through the decode-time policy (KVConfig)
                store = llm.engine.new_store(kv.decode_config(kv.capacity))
        check_room(store, llm.spec, len(ids))
        return store

    def _compressor(self, store, ids: list[int], max_tokens):
        """With KVConfig.compress: the Decoder's compress callable for a turn of `ids` after `store`
        (each turn's new tokens are pressed on their own; the earlier turns stay as they were kept),
        else None; None too for a turn that streams through the decode-time policy instead
        (KVConfig.compress_overflow)."""
        if self.kv.compress is None or self.llm.streams_prompt(len(ids), self.kv, self._held()):
            return None
        llm, kv = self.llm, self.kv
        held = self._held()

        def compress(ids):
            free = llm.n_ctx - held - len(ids)
            room = free if max_tokens is None else min(int(max_tokens), free)
            return llm.compress_prefill(ids, kv, room, prior=store)
        return compress

    def _answer(self, ids: list[int], store, params: SamplingParams, other: dict, constraint, commit,
                stream: bool) -> "Generation | Completion":
        """Run one answer: prefill `ids` into `store`, sample on; when it stops (ends, is cut or
        closed) the session takes the store, tokens, sampler state and the answer's cut state, and
        commit(record) updates the messages."""
        llm = self.llm
        stopper = StopMatcher(other["stop"])
        sampler = Sampler(params, 0, constraint)
        sampler.set_state(self.sampler_state)
        gen = Record()
        gen.constraint = constraint

        dec = Decoder(llm, gen, store, ids, self.tokens + ids, sampler, other["max_tokens"], stopper,
                      other["ignore_eos"], compress=self._compressor(store, ids, other["max_tokens"]))

        def body():
            with llm.engine_lock():
                try:
                    yield from dec.run()
                except GeneratorExit:
                    raise
                except BaseException as exc:
                    if gen.in_engine and not isinstance(exc, ConfigError):
                        self._damaged = ("the session's KV store was interrupted inside an engine step; "
                                         "reset() it or load a saved session")
                    raise
                finally:
                    if gen.fed and not self._damaged:
                        n_prompt = len(ids)
                        self.store = dec.store
                        self.tokens.extend(gen.fed)
                        self.n_fed += len(gen.fed)
                        unfed = gen.tokens[len(gen.fed) - n_prompt:]
                        self.pending = [] if gen.finish_reason == "stop" else list(unfed)
                        # only a max_tokens cut leaves every sampled token in the answer: that one can go on
                        cut = gen.finish_reason == "length" and bool(self.pending)
                        self.cut_answer = {"constraint": constraint.state() if constraint else None} if cut else None
                        commit(gen)
                        self._bound_history()
                        self.sampler_state = sampler.state()

        handle = Generation(gen, body())
        return handle if stream else handle.result()

    def _bound_history(self) -> None:
        """With history_tokens: drop all but the last history_tokens tokens and all messages but the
        system message and the last exchange (what _turn_delta renders)."""
        limit = self.history_tokens
        if limit is None:
            return
        if len(self.tokens) > limit:
            self.tokens = self.tokens[-limit:]
        head = self.messages[:1] if self.messages and self.messages[0]["role"] == "system" else []
        if len(self.messages) > len(head) + 2:
            self.messages = head + self.messages[-2:]

    # ------------------------------------------------------------------------------------------
    # Files
    # ------------------------------------------------------------------------------------------

    def _defaults_json(self) -> dict:
        d = dict(self.defaults)
        if d.get("logit_bias"):
            d["logit_bias"] = {str(k): float(v) for k, v in d["logit_bias"].items()}
        return d

    def save(self, path: str | os.PathLike) -> str:
        """Write the session (store, metadata, history, sampler state) to `path`; returns the path."""
        path = os.fspath(path)
        llm = self.llm
        if self._damaged:
            raise RingLLMError(self._damaged)
        with llm.engine_lock():          # never save in the middle of a turn of another thread
            arrays: dict[str, np.ndarray] = {}
            kv_state = None
            if self.store is not None:
                state_fn = getattr(self.store, "state", None)
                if state_fn is None:
                    raise ConfigError(f"the {llm.backend} backend's KV store cannot be saved")
                st = state_fn()
                kv_state = {"kv": st["kv"], "n_seen": int(st["n_seen"]), "hist_layout": st.get("hist_layout")}
                for key in STORE_META:          # a compressed prompt's store
                    if st.get(key):
                        kv_state[key] = st[key]
                arrays = {f"kv/{name}": np.asarray(a) for name, a in st["arrays"].items()}
            header = {"format": SESSION_FORMAT, "version": SESSION_VERSION, "model": model_identity(llm),
                      "session_kv": self.kv.to_dict(), "system": self.system, "seed": int(self.seed),
                      "defaults": self._defaults_json(), "chat_template_kwargs": self.chat_template_kwargs,
                      "messages": self.messages, "tokens": list(self.tokens), "n_fed": self.n_fed,
                      "history_tokens": self.history_tokens,
                      "pending": list(self.pending), "turns": self.turns, "sampler": self.sampler_state,
                      "store": kv_state, "cut_answer": self.cut_answer}
            header["checksum"] = file_checksum(header, arrays)
            blob = np.frombuffer(json.dumps(header).encode("utf-8"), dtype=np.uint8)
            try:
                with atomic_open(path, "wb") as fh:
                    np.savez_compressed(fh, __header__=blob, **arrays)
            except OSError as exc:
                raise SessionFileError(path, f"cannot be written ({exc.strerror or exc}); the previous "
                                       "file, if any, is unchanged") from exc
        return path

    @classmethod
    def load(cls, llm, path: str | os.PathLike, kv_types: tuple[str, str] | None = None) -> "ChatSession":
        """A session saved by save(), bound to `llm` (which must be the same model). Everything is
        checked (format, version, model, checksum, every array's shape and dtype) before the session
        exists; errors are SessionFileError. The session keeps the KVConfig it was saved with, KV
        types (k_type, v_type) included, unless kv_types = (k_type, v_type) asks for others: its
        store is then converted (KVStore.convert_types: each row decoded and encoded again) and its
        KVConfig says so; an unknown type, or one the backend lacks, is a ConfigError.

        The file's arrays pass through decompressed temporaries as large as the store; glibc keeps
        the heap they were freed into, so each load gives that memory back (host_memory.trim_heap):
        without it a process that loads a session holds a second store's worth of RSS from then on."""
        try:
            return cls._load(llm, path, kv_types)
        finally:
            trim_heap()

    @classmethod
    def _load(cls, llm, path: str | os.PathLike, kv_types: tuple[str, str] | None) -> "ChatSession":
        """load() without the heap trim."""
        if kv_types is not None:                           # checked before the file is read
            replace(llm.kv, k_type=kv_types[0], v_type=kv_types[1]).check_types_fit(llm.spec.head_dim)
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise SessionFileError(path, "no such file")
        try:
            with np.load(path, allow_pickle=False) as z:
                names = list(z.files)
                if "__header__" not in names:
                    raise SessionFileError(path, "not a ringllm session file (no header)")
                raw = z["__header__"]
                arrays = {n: z[n] for n in names if n != "__header__"}
            # np.load gives the raw bytes of a zip member that is not an .npy file: not a session's
            odd = [n for n, a in [("__header__", raw), *arrays.items()] if not isinstance(a, np.ndarray)]
            if odd:
                raise SessionFileError(path, f"member {odd[0]!r} is not an array; the file is corrupt")
        except SessionFileError:
            raise
        except Exception as exc:        # zip/npy/zlib errors of a truncated or corrupt file
            raise SessionFileError(path, f"cannot be read ({type(exc).__name__}: {exc}); the file is truncated "
                                   "or corrupt") from None
        try:
            header = json.loads(raw.tobytes().decode("utf-8"))
            if not isinstance(header, dict):
                raise ValueError("header is not an object")
        except (ValueError, UnicodeDecodeError) as exc:
            raise SessionFileError(path, f"header is not valid JSON ({exc})") from None
        if header.get("format") != SESSION_FORMAT:
            raise SessionFileError(path, f"not a ringllm session file (format {header.get('format')!r})")
        if header.get("version") != SESSION_VERSION:
            raise SessionFileError(path, f"session format version {header.get('version')!r}; this ringllm reads "
                                   f"version {SESSION_VERSION}")
        expected = header.pop("checksum", None)
        if expected != file_checksum(header, arrays):
            raise SessionFileError(path, "checksum mismatch: the file was modified or damaged")
        want, have = header.get("model"), model_identity(llm)
        if want != have:
            diff = sorted(k for k in set(have) | set(want or {}) if (want or {}).get(k) != have.get(k))
            raise SessionFileError(path, f"saved with another model ({', '.join(f'{k}: {(want or {}).get(k)!r}' for k in diff)}); "
                                   f"this LLM is {have['name']!r}")
        try:
            session_kv = KVConfig.from_dict(header["session_kv"])
            messages = validate_messages(header["messages"])
            tokens = [int(t) for t in header["tokens"]]
            n_fed = int(header.get("n_fed", len(tokens)))          # absent: a file of the whole history
            history_tokens = _check_history_tokens(header.get("history_tokens"))
            if n_fed < len(tokens) or (history_tokens is None and n_fed != len(tokens)) or \
                    (history_tokens is not None and len(tokens) > history_tokens):
                raise ValueError(f"a history of {len(tokens)} tokens does not fit {n_fed} tokens fed "
                                 f"(history_tokens {history_tokens})")
            pending = [int(t) for t in header["pending"]]
            for t in tokens + pending:
                if not 0 <= t < llm.n_vocab:
                    raise ValueError(f"token id {t} outside the vocabulary")
            sampler = Sampler(SamplingParams(), 0)
            sampler.set_state(header["sampler"])
            seed, turns, system = int(header["seed"]), int(header["turns"]), header["system"]
            defaults = dict(header["defaults"])
            template_kwargs = check_template_kwargs(header.get("chat_template_kwargs"))
            cut_answer = header.get("cut_answer")
            if cut_answer is not None:
                if not isinstance(cut_answer, dict) or not pending:
                    raise ValueError("a cut answer without its pending token")
                if cut_answer.get("constraint") is not None:    # compiled now: a bad one fails the load
                    constraint_from_state(llm.tokenizer, cut_answer["constraint"])
            store = None
            if header["store"] is not None:
                # imported on use: the KV store module compiles (or loads) its Numba kernels on
                # import, and only restoring a saved store needs it here
                from ringllm.runtime.kv_store import KVStore
                st = header["store"]
                state = {"kv": st["kv"], "n_seen": int(st["n_seen"]), "hist_layout": st.get("hist_layout"),
                         "arrays": {n[3:]: a for n, a in arrays.items() if n.startswith("kv/")},
                         **{key: st[key] for key in STORE_META if key in st}}
                if len(state["arrays"]) != len(arrays):
                    raise ValueError("unexpected arrays in the file")
                restore = getattr(llm.engine, "restore_store", None)
                if restore is not None:
                    store = restore(state)
                else:
                    store = llm.engine.adopt_store(KVStore.restore(llm.spec, state))
                if int(store.n_seen) != n_fed:
                    raise ValueError(f"the store has seen {store.n_seen} tokens, the history counts {n_fed}")
            elif arrays or tokens or n_fed:
                raise ValueError("a history without a store")
        except SessionFileError:
            raise
        except (RingLLMError, KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise SessionFileError(path, f"inconsistent content: {exc}") from None
        saved_kv_types = (session_kv.k_type, session_kv.v_type)
        if kv_types is not None and saved_kv_types != tuple(kv_types):
            session_kv = replace(session_kv, k_type=kv_types[0], v_type=kv_types[1])
            if store is not None:
                convert = getattr(store, "convert_types", None)
                if convert is None:
                    raise ConfigError(f"this backend's KV store cannot change KV types (saved {st['kv'].get('k_type', 'f32')}"
                                      f"/{st['kv'].get('v_type', 'f32')}, asked {kv_types[0]}/{kv_types[1]})")
                store = llm.engine.adopt_store(convert(*kv_types))
        obj = cls.__new__(cls)
        obj.llm, obj.kv, obj.system, obj.seed = llm, session_kv, system, seed
        obj.defaults, obj.chat_template_kwargs = defaults, template_kwargs
        try:
            obj._split(dict(defaults))
        except ConfigError as exc:
            raise SessionFileError(path, f"invalid defaults: {exc}") from None
        obj.messages, obj.store, obj.tokens, obj.pending = messages, store, tokens, pending
        obj.n_fed, obj.history_tokens = n_fed, history_tokens
        obj.sampler_state, obj.turns, obj._damaged = sampler.state(), turns, None
        obj.cut_answer = cut_answer
        obj.saved_kv_types = saved_kv_types        # (k_type, v_type) of the file, before any conversion
        return obj

    def restore(self, path: str | os.PathLike, kv_types: tuple[str, str] | None = None) -> tuple[str, str]:
        """Replace this session's state with a saved one (all or nothing); kv_types as in load().
        Returns the (k_type, v_type) the file was saved with."""
        loaded = ChatSession.load(self.llm, path, kv_types=kv_types)
        self.__dict__.update(loaded.__dict__)
        return loaded.saved_kv_types
