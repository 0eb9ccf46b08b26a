"""Soak: many tokens through one chat session, saved and reloaded on the way; memory, files, latency.

    python bench/soak.py                         # the full run: 1,000,000 tokens, capacity 512 (about an hour+)
    python bench/soak.py --tokens 4000 --capacity 64 --reload-every 1000 --name soak_short
    python bench/soak.py --legs parallel         # the two runs (below) at once, one core each

One ChatSession of the bundled SmolLM2 (greedy, ignore_eos) gets user turns of `--turn-chars`
characters of Pride and Prejudice (a few hundred tokens) and answers of `--answer-tokens` tokens, so
most tokens are prefilled, until `--tokens` tokens have gone through the KV store. Every
`--reload-every` tokens the session is saved and loaded back (ChatSession.save / load). The same
conversation runs a second time without reloads; the answers of the two runs must be the same
tokens (a save/load changes nothing). Sampled at each reload point: RSS, open file descriptors;
per-token latency (turn time / tokens the turn fed) per segment. The harness itself keeps 16 bytes
per turn (an answer's digest and its latency, in typed arrays), not the answers: a list of Python
ints per turn would grow the RSS it measures by about 0.4 MB per 100,000 tokens.

Writes bench/results/<name>.{json,md} (crash-safe, bench/common.py), and <name>_partial.{json,md} with
the samples so far at each reload (removed when the run completes). Not run by CI in this form;
tests/test_soak.py runs the short form.

The session keeps the last `--history-tokens` tokens of its history and the messages its chat
template needs (ChatSession(history_tokens=...)): with the store fixed, nothing grows with the tokens
fed, neither the RSS nor the saved file (`--history-tokens 0`: the whole transcript, which grows by
a Python int and the text of every turn).
"""
from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import sys
import tempfile
import time
from array import array
from concurrent.futures import ProcessPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import RESULTS, machine, write_results  # noqa: E402

CORPUS = os.path.join(os.path.dirname(__file__), "data", "prideprejudice.txt")


def rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def run_soak(llm, tokens: int, capacity: int, policy: str, reload_every: int | None, turn_chars: int,
             answer_tokens: int, folder: str, history_tokens: int | None = 4096, on_sample=None) -> dict:
    """One soak run; reload_every None: never saved. Returns answer_digests (per turn, the first 8
    bytes of the sha256 of its tokens as int32, as an int64), samples [(tokens fed, rss MB, open
    fds)], and per-segment latencies (seconds per token fed).
    on_sample(samples): called after each reload's sample (a long run's progress, kept on disk)."""
    import ringllm
    from ringllm.session import ChatSession

    text = open(CORPUS, encoding="utf-8").read()
    session = llm.chat_session(kv=ringllm.KVConfig(capacity=capacity, policy=policy), seed=0,
                               history_tokens=history_tokens)
    path = os.path.join(folder, "soak.session")
    digests, samples, lat, seg = array("q"), [(0, rss_mb(), open_files())], {}, 0
    at, next_reload, fed = 0, reload_every, 0
    while fed < tokens:
        if at + turn_chars > len(text):
            at = 0
        user = text[at:at + turn_chars]
        at += turn_chars
        before = session.n_fed
        t0 = time.perf_counter()
        out = session.send(user, stream=False, max_tokens=answer_tokens, temperature=0.0, ignore_eos=True)
        dt = time.perf_counter() - t0
        n = session.n_fed - before
        fed += n
        digests.append(int.from_bytes(hashlib.sha256(np.asarray(out.tokens, np.int32).tobytes()).digest()[:8],
                                      "little", signed=True))
        lat.setdefault(seg, array("d")).append(dt / max(n, 1))
        if reload_every and fed >= next_reload:
            session.save(path)
            session = ChatSession.load(llm, path)
            samples.append((fed, rss_mb(), open_files()))
            next_reload += reload_every
            seg += 1
            if on_sample is not None:
                on_sample(samples)
    samples.append((fed, rss_mb(), open_files()))
    segments = [{"segment": s, "p50_ms": float(np.percentile(v, 50) * 1e3), "p99_ms": float(np.percentile(v, 99) * 1e3),
                 "turns": len(v)} for s, v in sorted(lat.items())]
    return {"answer_digests": list(digests), "samples": samples, "segments": segments, "tokens_fed": fed,
            "kv": session.kv_stats()}


def _plain_leg(threads: int, kw: dict, folder: str) -> dict:
    """The run without reloads, in a process of its own (--legs parallel)."""
    import ringllm

    os.makedirs(folder, exist_ok=True)
    llm = ringllm.LLM(None, n_threads=threads, progress=False)
    return run_soak(llm, reload_every=None, folder=folder, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--capacity", type=int, default=512)
    ap.add_argument("--policy", default="streaming")
    ap.add_argument("--reload-every", type=int, default=100_000)
    ap.add_argument("--turn-chars", type=int, default=1200)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--history-tokens", type=int, default=4096,
                    help="tokens of history the session keeps (0: the whole transcript)")
    ap.add_argument("--name", default="soak")
    ap.add_argument("--legs", choices=("serial", "parallel"), default="serial",
                    help="parallel: the run without reloads goes in a second process at the same time (one "
                         "core each with -t 1: half the wall time, each leg's latency measured beside the other)")
    args = ap.parse_args()
    import ringllm
    t_start = time.perf_counter()
    partial = args.name + "_partial"

    def progress(samples):       # the samples so far, so that a run cut short still leaves them
        write_results(partial, {"args": vars(args), "samples": samples, "minutes": (time.perf_counter() - t_start) / 60},
                      "| tokens fed | RSS MB | open fds |\n|---|---|---|\n"
                      + "".join(f"| {t} | {r:.1f} | {f} |\n" for t, r, f in samples))
    with tempfile.TemporaryDirectory() as folder:
        kw = dict(tokens=args.tokens, capacity=args.capacity, policy=args.policy, turn_chars=args.turn_chars,
                  answer_tokens=args.answer_tokens, history_tokens=args.history_tokens or None)
        if args.legs == "parallel":
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                plain_leg = pool.submit(_plain_leg, args.threads, kw, os.path.join(folder, "plain"))
                llm = ringllm.LLM(None, n_threads=args.threads, progress=False)
                reloaded = run_soak(llm, reload_every=args.reload_every, folder=folder, on_sample=progress, **kw)
                plain = plain_leg.result()
        else:
            llm = ringllm.LLM(None, n_threads=args.threads, progress=False)
            reloaded = run_soak(llm, reload_every=args.reload_every, folder=folder, on_sample=progress, **kw)
            plain = run_soak(llm, reload_every=None, folder=folder, **kw)
    same = reloaded["answer_digests"] == plain["answer_digests"]
    s = reloaded["samples"]
    payload = {"machine": machine(), "args": vars(args), "same_answers_with_and_without_reloads": same,
               "samples": s, "segments": reloaded["segments"], "tokens_fed": reloaded["tokens_fed"],
               "kv": reloaded["kv"], "wall_s": time.perf_counter() - t_start}
    md = [f"# Soak: {reloaded['tokens_fed']} tokens, SmolLM2, {args.policy} capacity {args.capacity}",
          "", f"`python bench/soak.py {' '.join(sys.argv[1:])}`", "",
          f"Answers identical with and without a save/load every {args.reload_every} tokens: **{same}**", "",
          f"Wall time {payload['wall_s'] / 60:.1f} min (legs {args.legs}, {args.threads} thread(s) each); machine "
          f"{payload['machine']}", "",
          "| tokens fed | RSS MB | open fds |", "|---|---|---|"]
    md += [f"| {t} | {r:.1f} | {f} |" for t, r, f in s]
    md += ["", "| segment | turns | p50 ms/token | p99 ms/token |", "|---|---|---|---|"]
    md += [f"| {g['segment']} | {g['turns']} | {g['p50_ms']:.2f} | {g['p99_ms']:.2f} |" for g in reloaded["segments"]]
    write_results(args.name, payload, "\n".join(md) + "\n")
    for ext in (".json", ".md"):
        if os.path.exists(os.path.join(RESULTS, partial + ext)):
            os.remove(os.path.join(RESULTS, partial + ext))
    print("\n".join(md))
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
