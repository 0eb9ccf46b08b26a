"""`ringllm serve --ray`: the same OpenAI-compatible server with its engines spread over Ray Serve replicas.

    app = build_app(ServeOptions(model=None, replicas=2))          # a Ray Serve application
    serve.run(app, name="ringllm", route_prefix="/")

Two deployments, one implementation of the API:

    Ingress        one replica (no CPU reserved). It hosts ringllm.server.create_app, the routes,
                   checks, errors, auth and metrics of plain `ringllm serve`, over an LLM loaded
                   with backend "none" (tokenizer, chat template, grammars; the weights stay unread).
                   Its worker is a RemoteWorker: a request's Job goes to a Replica through a
                   streaming deployment handle, and the Replica's events come back onto the Job's
                   queue exactly as the local Worker puts them there.
    Replica        N replicas (or Ray Serve's autoscaler between --min-replicas and --max-replicas),
                   each one LLM and one ringllm.server_worker.Worker: the batched decode loop and the
                   prompt cache of plain `ringllm serve`. Each event stream starts with
                   ("start", replica name); the name ends up in the response's system_fingerprint.

Routing is Ray Serve's (ray.serve.request_router), with AffinityRouter deciding which replica a
request prefers: the replica that served the same conversation key (the request's `user` or
`session_id`), else the one that served the longest earlier prompt this prompt starts with (the
prompts' token prefixes hashed, all at once, with a polynomial hash), so that a follow-up turn lands
where its KV store is cached; a system prompt every conversation shares is not a whole earlier
prompt, so it does not pull all new conversations onto one replica. Load still counts: the preferred
replica is ranked first, the others after it from the least loaded, and Ray Serve moves on when the
first is full (its max_ongoing_requests).

Faults: a Replica that dies costs its in-flight requests only; each gets an "error" event (503,
"retry"): a non-streamed request answers 503, a stream ends with an error event. Ray Serve
replaces the replica; a replica is routed to once its constructor (model load and kernel warm-up)
has returned.
"""
from __future__ import annotations

import asyncio
import collections
import os
import random
import signal
import threading
from dataclasses import dataclass, field

import numpy as np

from ringllm.runtime.errors import ConfigError
from ringllm.runtime.kv_config import KVConfig
from ringllm.server_api import APIError, ServerSettings

__all__ = ["AffinityRouter", "Ingress", "RemoteWorker", "Replica", "ServeOptions", "build_app", "prefix_hashes",
           "require_ray", "run"]

MAX_KEYS = 200_000    # affinity entries the router remembers (least recently used out)
SHUTDOWN_WAIT_S = 20  # how long stopping waits for Ray Serve to take its application down


def require_ray():
    """(ray, ray.serve), or a ConfigError naming the extra to install."""
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise ConfigError(f"--ray needs Ray Serve, which is not installed ({exc}); install the extra: "
                          "pip install 'ringllm[ray]'  (or pip install 'ray[serve]')") from None
    return ray, serve


@dataclass
class ServeOptions:
    """What `ringllm serve --ray` builds: the model and its KV config, the server settings of the
    ingress, and the replicas (a fixed count, or min/max for Ray Serve's autoscaler)."""

    model: str | None = None
    kv: dict = field(default_factory=dict)
    n_threads: int = 1                   # engine threads per replica (and CPUs Ray reserves for it)
    precision: str = "f32"               # LLM(precision=...) of every replica
    chat_template: str | None = None
    seed: int = 0
    settings: ServerSettings = field(default_factory=ServerSettings)
    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    affinity: bool = True                # False: Ray Serve's default router (power of two choices)


# ------------------------------------------------------------------------------------------------
# Affinity
# ------------------------------------------------------------------------------------------------

_HASH_BASE = np.uint64(0x9E3779B97F4A7C15)            # odd: invertible modulo 2^64
_HASH_BASE_INV = np.uint64(pow(int(_HASH_BASE), -1, 1 << 64))


def prefix_hashes(ids) -> np.ndarray:
    """(n,) uint64: entry i is a polynomial hash (mod 2^64) of ids[:i + 1], all n at once.
    H[i] = sum_j (ids[j] + 1) B^(i - j) = B^i * cumsum((ids + 1) B^-j), vectorized."""
    x = np.asarray(ids, dtype=np.uint64) + np.uint64(1)
    if x.size == 0:
        return x
    with np.errstate(over="ignore"):
        up = np.ones(x.size, np.uint64)                 # B^i, wrapping
        up[1:] = np.cumprod(np.full(x.size - 1, _HASH_BASE, np.uint64))
        down = np.ones(x.size, np.uint64)               # B^-i
        down[1:] = np.cumprod(np.full(x.size - 1, _HASH_BASE_INV, np.uint64))
        return up * np.cumsum(x * down)


def _affinity(pending) -> tuple[str | None, list]:
    """(conversation key, prompt ids) of a routed request (its first argument is the job spec)."""
    if pending is None or not pending.args or not isinstance(pending.args[0], dict):
        return None, []
    spec = pending.args[0]
    key = spec.get("affinity")
    return ("s:" + key if key else None), list(spec.get("ids") or [])


try:
    from ray.serve.request_router import FIFOMixin, RequestRouter
    _ROUTER_BASES: tuple = (FIFOMixin, RequestRouter)
except ImportError:            # no Ray: the class below is never used (require_ray says so first)
    _ROUTER_BASES = (object,)


class AffinityRouter(*_ROUTER_BASES):
    """Ray Serve request router: the replica that holds a request's conversation or longest prompt
    prefix first, then the others from the least loaded (module docstring)."""

    def initialize_state(self, **kwargs):
        self._owner: collections.OrderedDict[str, object] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _preferred(self, pending, candidates: dict):
        """The replica that served the request's conversation key, else the one that served the
        longest earlier prompt the request starts with (a follow-up turn starts with the whole
        previous request; a system prompt that every conversation shares is no earlier request's
        whole prompt, so it pulls nothing); None when neither is among the candidates."""
        session, ids = _affinity(pending)
        with self._lock:
            if session is not None and self._owner.get(session) in candidates:
                return candidates[self._owner[session]]
            if not ids or not self._owner:
                return None
            h = prefix_hashes(ids)
            for n in range(len(ids) - 1, 0, -1):
                owner = self._owner.get((n, int(h[n - 1])))
                if owner in candidates:
                    return candidates[owner]
        return None

    def _load(self, replica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        first = self._preferred(pending_request, by_id)
        others = [r for r in candidate_replicas if r is not first]
        random.shuffle(others)                     # equal loads: spread new conversations
        others.sort(key=self._load)
        return [[first], others] if first is not None else [others]

    def on_request_routed(self, pending_request, replica_id, result):
        session, ids = _affinity(pending_request)
        keys = ([session] if session else []) + ([(len(ids), int(prefix_hashes(ids)[-1]))] if ids else [])
        with self._lock:
            for key in keys:
                self._owner[key] = replica_id
                self._owner.move_to_end(key)
            while len(self._owner) > MAX_KEYS:
                self._owner.popitem(last=False)

    def on_replica_actor_died(self, replica_id):
        super().on_replica_actor_died(replica_id)
        with self._lock:
            for key in [k for k, v in self._owner.items() if v == replica_id]:
                del self._owner[key]


# ------------------------------------------------------------------------------------------------
# Replica
# ------------------------------------------------------------------------------------------------

class Replica:
    """One engine: an LLM and the Worker of plain `ringllm serve` (batching, prompt cache)."""

    def __init__(self, opts: ServeOptions):
        from ray import serve

        import ringllm
        from ringllm.server_worker import Worker

        self.name = "ringllm-" + serve.get_replica_context().replica_id.to_full_id_str().rsplit("#", 1)[-1]
        self.llm = ringllm.LLM(opts.model, kv=KVConfig.from_dict(opts.kv) if opts.kv else None,
                               n_threads=opts.n_threads, seed=opts.seed, chat_template=opts.chat_template,
                               warmup=True, progress=False, precision=opts.precision)
        s = opts.settings
        from ringllm.prompt_cache import default_cache_bytes
        cache = default_cache_bytes() if s.cache_bytes is None else s.cache_bytes
        self.worker = Worker(self.llm, s.queue_size, s.max_batch, cache_bytes=cache, served_by=self.name)
        self._grammars: dict[tuple[str, str], object] = {}

    def _grammar(self, spec):
        """The request's grammar compiled against this replica's vocabulary (kept per text)."""
        if spec is None:
            return None
        from ringllm.constraints import Grammar
        key = (spec["kind"], spec["text"])
        if key not in self._grammars:
            self._grammars[key] = Grammar(self.llm.tokenizer, spec["text"], spec["kind"])
        return self._grammars[key]

    async def generate(self, spec: dict):
        """The events of one request (server_worker's protocol), as an async generator."""
        from ringllm.server_worker import Job

        params = dict(spec["params"])
        params["grammar"] = self._grammar(spec.get("grammar"))
        job = Job(spec["kind"], list(spec["ids"]), params, asyncio.get_running_loop(), asyncio.Queue(),
                  kv=KVConfig.from_dict(spec["kv"]) if spec.get("kv") else None,
                  cache_prompt=spec.get("cache_prompt", True), stream=spec.get("stream", True))
        try:
            self.worker.submit(job)
        except APIError as exc:
            yield ("error", exc.status, exc.message)
            return
        try:
            while True:
                ev = await job.events.get()
                yield ev
                if ev[0] in ("end", "error"):
                    return
        finally:
            job.cancel.set()          # the ingress went away (client gone) or the stream ended

    def check_health(self):
        if not self.worker._thread.is_alive():
            raise RuntimeError("the decode worker thread has stopped")

    def stats(self) -> dict:
        w = self.worker
        return {"name": self.name, "pid": os.getpid(), "queued": w.jobs.qsize(), "active": w.active,
                "peak_batch": w.peak_batch, **w.counters, "prompt_cache": w.cache_stats()}


# ------------------------------------------------------------------------------------------------
# Ingress
# ------------------------------------------------------------------------------------------------

class _Count:
    """qsize() of the requests the ingress has sent and not yet seen start (the metrics' queue depth)."""

    def __init__(self):
        self.n = 0

    def qsize(self) -> int:
        return self.n


class RemoteWorker:
    """The ingress's worker: sends each Job to a Replica through Ray Serve and forwards its events."""

    def __init__(self, handle):
        self.handle = handle.options(stream=True)
        self.jobs = _Count()
        self.live = 0
        self.busy = False
        self.peak_batch = 0
        self.counters = {"completed": 0, "cancelled": 0, "failed": 0}
        self._tasks: set = set()

    @property
    def active(self) -> int:
        return self.live

    def cache_stats(self) -> dict:
        return {"where": "per replica (GET /v1/replicas)"}

    def submit(self, job) -> None:
        grammar = job.params.get("grammar")
        spec = {"kind": job.kind, "ids": list(job.ids),
                "params": {k: v for k, v in job.params.items() if k != "grammar"},
                "grammar": None if grammar is None else {"kind": grammar.kind, "text": grammar.text},
                "kv": job.kv.to_dict() if job.kv is not None else None, "cache_prompt": job.cache_prompt,
                "affinity": job.affinity, "stream": job.stream}
        task = asyncio.get_running_loop().create_task(self._pump(job, spec))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _pump(self, job, spec) -> None:
        self.jobs.n += 1
        started = False
        self.live += 1
        self.busy = True
        try:
            gen = self.handle.generate.remote(spec)
            async for ev in gen:
                if not started:
                    started, self.jobs.n = True, self.jobs.n - 1
                job.events.put_nowait(ev)
                if ev[0] == "end":
                    self.counters["completed"] += 1
                elif ev[0] == "error":
                    self.counters["failed"] += 1
                if job.cancel.is_set() and ev[0] not in ("end", "error"):
                    gen.cancel()          # the client is gone: the replica drops the request
                    self.counters["cancelled"] += 1
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:          # the replica died or became unreachable mid-request
            self.counters["failed"] += 1
            job.events.put_nowait(("error", 503, f"the replica serving this request failed "
                                                 f"({type(exc).__name__}); retry the request"))
        finally:
            if not started:
                self.jobs.n -= 1
            self.live -= 1
            self.busy = self.live > 0
            self.peak_batch = max(self.peak_batch, self.live)

    def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()


class Ingress:
    """The HTTP front: create_app's routes over a backend-"none" LLM and a RemoteWorker."""

    def __init__(self, replica_handle, opts: ServeOptions):
        import ringllm

        self.opts = opts
        self.handle = replica_handle
        self.front = ringllm.LLM(opts.model, kv=KVConfig.from_dict(opts.kv) if opts.kv else None,
                                 backend="none", chat_template=opts.chat_template, progress=False)

    def __serve_build_asgi_app__(self):
        from ringllm.server import create_app

        app = create_app(self.front, self.opts.settings, worker_factory=lambda llm, s, m: RemoteWorker(self.handle))
        handle = self.handle

        @app.get("/v1/replicas", summary="the engine replicas: queue, batch, counters, prompt cache")
        async def replicas():
            return {"note": "one replica's stats per call, as Ray Serve routes it",
                    "replica": await handle.stats.remote()}

        return app


def build_app(opts: ServeOptions):
    """The Ray Serve application: Ingress over `opts.replicas` Replicas (or autoscaled)."""
    _, serve = require_ray()
    from ray.serve.config import RequestRouterConfig

    s = opts.settings
    scaling = ({"autoscaling_config": {"min_replicas": opts.min_replicas or 1,
                                       "max_replicas": opts.max_replicas or max(opts.replicas, opts.min_replicas or 1),
                                       "target_ongoing_requests": s.max_batch}}
               if opts.min_replicas is not None or opts.max_replicas is not None else {"num_replicas": opts.replicas})
    routing = {"request_router_config": RequestRouterConfig(request_router_class="ringllm.ray_serve:AffinityRouter")} \
        if opts.affinity else {}
    replica = serve.deployment(Replica, name="ringllm-replica", ray_actor_options={"num_cpus": opts.n_threads},
                               max_ongoing_requests=s.max_batch + s.queue_size, health_check_period_s=5,
                               **routing, **scaling)
    ingress = serve.deployment(serve.ingress()(Ingress), name="ringllm-ingress",
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000)
    return ingress.bind(replica.bind(opts), opts)


def run(opts: ServeOptions, host: str, port: int, address: str | None = None) -> None:
    """Start (or join, with `address`) Ray, run the application on host:port until SIGINT/SIGTERM,
    then take down what was started: the application, and the local Ray instance when this
    started it."""
    ray, serve = require_ray()
    started = address is None
    ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(opts), name="ringllm", route_prefix="/")
        stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # serve.shutdown waits on Ray's own processes, which a signal sent to the whole process group
        # (a terminal's Ctrl-C, `timeout`) may already have stopped: bounded, then the local Ray
        # instance this started is torn down whatever state it is in
        closing = threading.Thread(target=serve.shutdown if started else lambda: serve.delete("ringllm"),
                                   daemon=True)
        closing.start()
        closing.join(SHUTDOWN_WAIT_S)
        if started:
            ray.shutdown()
