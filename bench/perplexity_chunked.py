"""llama.cpp's chunked perplexity protocol, ringllm beside llama.cpp (llama-cpp-python), one run.

    python bench/perplexity_chunked.py [-m MODEL] [-f FILE] [--ctx 512] [--chunks K] [-t THREADS]

Both score the same token ids with pyengine/perplexity.py's `chunked` (llama-perplexity's protocol:
n_ctx chunks, first token -> BOS when the model adds one, second half scored); only the logits
differ: ringllm's Numba engine (f32 activations) vs llama.cpp (which quantizes activations to
Q8 in its matmuls). Writes bench/results/perplexity_chunked.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import llama_cpp_model, machine, write_results  # noqa: E402

DEFAULT_TEXT = os.path.join(os.path.dirname(__file__), "data", "prideprejudice.txt")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-f", "--file", default=DEFAULT_TEXT)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()

    from ringllm import perplexity as ppl
    from ringllm.models.bundled import default_model_path
    from ringllm.models.loader import load_model
    from ringllm.runtime.engine import CPUEngine

    path = args.model or default_model_path()
    model = load_model(path)
    tok = model.tokenizer
    ids = tok.encode(open(args.file, encoding="utf-8").read(), add_bos=False, parse_special=False)
    bos = tok.bos_id if tok.add_bos else None

    eng = CPUEngine(model.spec, model.tensors, n_threads=args.threads, n_batch=args.ctx)
    t0 = time.perf_counter()
    ours = ppl.chunked(lambda c: eng.logits(c, eng.new_store(capacity=args.ctx, policy="full")), ids, args.ctx,
                       bos, args.chunks)
    t_ours = time.perf_counter() - t0

    anchor, t_anchor = None, None
    llm = llama_cpp_model(path, n_ctx=args.ctx, n_threads=args.threads, logits_all=True)
    if llm is not None:
        def lcpp_logits(chunk):
            llm.reset()
            llm.eval(chunk)
            return np.array(llm.scores[:len(chunk)], dtype=np.float32)
        t0 = time.perf_counter()
        anchor = ppl.chunked(lcpp_logits, ids, args.ctx, bos, args.chunks)
        t_anchor = time.perf_counter() - t0

    rel = (ours.ppl / anchor.ppl - 1.0) if anchor else None
    payload = {"model": os.path.basename(path), "file": os.path.basename(args.file), "n_ctx": args.ctx,
               "chunks": ours.settings["n_chunks"], "tokens_in_file": len(ids), "ringllm": ours.to_dict(),
               "ringllm_s": t_ours, "llama_cpp": anchor.to_dict() if anchor else None, "llama_cpp_s": t_anchor,
               "relative_difference": rel, "machine": machine()}
    md = [f"# Chunked perplexity (llama-perplexity protocol): {os.path.basename(path)}\n",
          f"Text: {os.path.basename(args.file)} ({len(ids)} tokens), n_ctx {args.ctx}, first "
          f"{ours.settings['n_chunks']} chunks, {ours.n_scored} scored tokens. Machine: {payload['machine']['cpu']}.\n",
          "| engine | perplexity | seconds |", "|---|---|---|", f"| ringllm (Numba, f32 activations) | {ours.ppl:.4f} | {t_ours:.1f} |"]
    if anchor:
        md.append(f"| llama.cpp (llama-cpp-python {payload['machine'].get('llama_cpp_python')}) | {anchor.ppl:.4f} | {t_anchor:.1f} |")
        md.append(f"\nringllm vs llama.cpp: {100 * rel:+.3f}%\n")
    text = "\n".join(md) + "\n"
    print(text)
    write_results("perplexity_chunked", payload, text)


if __name__ == "__main__":
    main()
