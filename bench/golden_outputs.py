"""Golden outputs of the CPU engine, for refactors that must change nothing: record, then compare bitwise.

    python bench/golden_outputs.py record DIR [--no-smol]     every case, each in a fresh process
    python bench/golden_outputs.py compare DIR_A DIR_B        exit 1 when any array differs

Run `record` from each checkout to compare (same machine, same thread count) into its own DIR, then
`compare`. Cases: 4 tiny random architectures (built once with transformers into DIR/tiny) x every
policy, each plain, with original positions, staged (lazy 4, slack 4, max_drop 3) and with the fused
RoPE strategy; streaming with every ring RoPE strategy; the shift-and-append update; and the bundled
SmolLM2 at budget 64 for every evicting policy. Recorded per case: the logits of every prefill and
decode step, the greedy tokens, and every array of the store's saved state after the run.

Each case runs in its own process because a process's history can move float results by ~1e-6:
Numba may reuse an already compiled specialization of a kernel (another array layout) for a later
call, so what ran before, and whether the disk cache was warm, can change the machine code used.
Compare recordings made under the same cache conditions (both with a warm cache, or both cold).
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

ARCHS = ("llama", "qwen2", "gemma3", "gptneox")
POLICIES = ("full", "streaming", "h2o", "tova", "scissorhands", "knorm", "lsh", "random", "snapkv", "pyramidkv",
            "adakv", "rkv", "gvote")


def cases(smol: bool):
    """(model, name, KVConfig kwargs, engine rope, prompt tokens, decode steps)."""
    for p in POLICIES:
        if p == "full":
            yield "tiny", p, dict(policy=p, sinks=0), "stored", 40, 30
            continue
        base = dict(capacity=24, policy=p, sinks=2)
        yield "tiny", p, base, "stored", 40, 30
        yield "tiny", p + "+orig", dict(base, positions="original"), "stored", 40, 30
        yield "tiny", p + "+staged", dict(base, lazy=4, slack=4, max_drop=3), "stored", 40, 30
        yield "tiny", p + "+fusedrope", base, "fused", 40, 20
    for rope in ("fused", "rk", "kshift"):
        yield "tiny", "streaming+" + rope, dict(capacity=24, policy="streaming", sinks=2), rope, 40, 30
    for p in ("h2o", "streaming"):
        yield "tiny", p + "+shift", dict(capacity=24, policy=p, sinks=2, update="shift"), "stored", 40, 30
    if smol:
        for p in POLICIES[1:]:
            yield "smol", p, dict(capacity=64, policy=p, sinks=4), "stored", 120, 60


def run_one(out_dir: str, arch: str, name: str) -> None:
    """One case, in this process: writes out_dir/ARCH__NAME.npz."""
    from ringllm.models.loader import load_model
    from ringllm.runtime.engine import CPUEngine
    from ringllm.runtime.kv_config import KVConfig

    smol = arch == "smol"
    for kind, case, kv, rope, n_prompt, n_gen in cases(smol):
        if case != name or (kind == "smol") != smol:
            continue
        if smol:
            from ringllm.models.bundled import default_model_path
            m = load_model(default_model_path(), tokenizer=False)
        else:
            m = load_model(os.path.join(out_dir, "tiny", arch), tokenizer=False)
        eng = CPUEngine(m.spec, m.tensors, n_batch=16, rope=rope)
        res = {}
        try:
            st = eng.new_store(KVConfig(**kv))
            prompt = np.random.default_rng(len(name) + 7).integers(0, m.spec.n_vocab, n_prompt)
            logits = [eng.logits(prompt, st)]
            tok, toks = int(np.argmax(logits[0][-1])), []
            for _ in range(n_gen):
                toks.append(tok)
                step = eng.step(tok, st).copy()
                logits.append(step[None])
                tok = int(np.argmax(step))
            res["logits"], res["tokens"] = np.concatenate(logits), np.array(toks)
            res.update({"st/" + k: v for k, v in st.state()["arrays"].items()})
        except Exception as e:  # noqa: BLE001 - an error is an outcome to compare too
            res["error"] = np.array(repr(e))
        np.savez(os.path.join(out_dir, f"{arch}__{name}.npz"), **res)
        return
    raise SystemExit(f"no case {arch} {name}")


def record(out_dir: str, smol: bool) -> None:
    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    sys.path.insert(0, tests)
    from tiny_checkpoints import build_tiny

    os.makedirs(out_dir, exist_ok=True)
    for arch in ARCHS:
        d = os.path.join(out_dir, "tiny", arch)
        if not os.path.exists(os.path.join(d, "config.json")):
            build_tiny(arch, d)
    todo = [("smol", name) if kind == "smol" else (arch, name)
            for kind, name, *_ in cases(smol) for arch in (("smol",) if kind == "smol" else ARCHS)]
    for i, (arch, name) in enumerate(todo):
        subprocess.run([sys.executable, __file__, "one", out_dir, arch, name], check=True)
        print(f"{i + 1}/{len(todo)} {arch} {name}", flush=True)


def compare(a_dir: str, b_dir: str) -> int:
    names = sorted(f for f in set(os.listdir(a_dir)) | set(os.listdir(b_dir)) if f.endswith(".npz"))
    differ, arrays = [], 0
    for f in names:
        if not (os.path.exists(os.path.join(a_dir, f)) and os.path.exists(os.path.join(b_dir, f))):
            differ.append(f"{f}: recorded on one side only")
            continue
        a, b = dict(np.load(os.path.join(a_dir, f))), dict(np.load(os.path.join(b_dir, f)))
        for k in sorted(set(a) | set(b)):
            arrays += 1
            if k not in a or k not in b or a[k].shape != b[k].shape or a[k].dtype != b[k].dtype \
                    or not np.array_equal(a[k], b[k]):
                differ.append(f"{f} {k}")
    print("\n".join(differ))
    print(f"{len(names)} cases, {arrays} arrays, {len(differ)} differ")
    return 1 if differ else 0


def main():
    if len(sys.argv) >= 5 and sys.argv[1] == "one":
        run_one(*sys.argv[2:5])
    elif len(sys.argv) >= 3 and sys.argv[1] == "record":
        record(sys.argv[2], "--no-smol" not in sys.argv)
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
