"""KV eviction quality: streaming perplexity and a needle-retrieval probe per policy and budget.

    python bench/kv_quality.py [--models smollm2,gemma3] [--tokens 20000] [--budgets 128,256,512]
                               [--policies all] [--needles 4] [-t THREADS] [--name kv_quality]

Perplexity: StreamingLLM's protocol, every token of a novel fed one at a time through the bounded
store (engine.logits: chunked projections, attention token by token), NLL of each next token.
Ceiling: the streaming policy at the model's whole context (8192 for SmolLM2, far above the budgets).
Needle: a passphrase sentence planted 10-60% into ~1,300 tokens of the novel, then a completion-style
question at the end, 12 greedy tokens; a hit when the passphrase comes back. --needles positions.
Attention loss (LSH-E): the share of full attention that falls on evicted tokens, over the first
--loss-tokens tokens (a full store runs beside the policy's and reports its per-token mass).
Writes bench/results/<name>.{json,md} and <name>.png (perplexity against budget per policy).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import RESULTS, machine, write_results  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data", "prideprejudice.txt")
NEEDLE = "Remember this: the secret passphrase of the Bennet family is {code}."
QUESTION = "\n\nQuestion: what is the secret passphrase of the Bennet family?\nAnswer: the secret passphrase of the Bennet family is"
CODES = ["amber-falcon-417", "violet-harbor-236", "copper-lantern-958", "silver-meadow-601", "crimson-otter-342",
         "golden-quarry-775"]


def log_softmax_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    m = logits.max(axis=1, keepdims=True)
    lse = (m[:, 0] + np.log(np.exp(logits - m).sum(axis=1))).astype(np.float64)
    return lse - logits[np.arange(len(targets)), targets]


def streaming_ppl(eng, kv, ids: np.ndarray, chunk: int = 512) -> tuple[float, dict]:
    """(perplexity, store stats at the end) of ids fed through one bounded store."""
    st = eng.new_store(kv)
    nll = []
    for start in range(0, len(ids) - 1, chunk):
        part = ids[start:start + chunk + 1]
        logits = eng.logits(part[:-1], st)
        nll.append(log_softmax_nll(logits, part[1:]))
    return float(math.exp(np.concatenate(nll).mean())), st.stats()


def attention_loss(eng, kv, ids: np.ndarray) -> float:
    """LSH-E's attention loss: the share of full attention that falls on tokens the policy evicted.

    The ids are fed one at a time through two stores of one engine: the policy's and a full one
    whose attention emits per-token mass (engine mass hook). At every step, layer and kv head, the
    full attention mass of the tokens missing from the policy's store is summed (over the GQA
    group, / group: a share in [0, 1]); the mean over steps, layers and heads is returned. Tokens are
    matched by sequence index; a sliding-window layer's full store holds the model's own window.
    """
    from ringllm.runtime.kv_config import KVConfig

    spec = eng.spec
    group = spec.n_head // spec.n_head_kv
    full = eng.new_store(KVConfig(capacity=len(ids) + 1, policy="full"))
    pol = eng.new_store(kv)
    held = [None] * spec.n_layer
    acc = {"loss": 0.0, "n": 0}

    def on_mass(il, mass, store):
        if held[il] is None:
            return
        for h in range(spec.n_head_kv):
            n = int(store.count[il][h])
            # the full store's tokens by slot (a sliding-window layer is a ring: slot j is not token j)
            gone = ~np.isin(store.seq[il][h, :n], held[il][h])
            acc["loss"] += float(mass[h, :n][gone].sum()) / group
            acc["n"] += 1

    full.mass_hook = on_mass
    for t in ids:
        eng.step(int(t), pol)
        for il in range(spec.n_layer):
            held[il] = [pol.seq[il][h, :int(pol.count[il][h])].copy() for h in range(spec.n_head_kv)]
        eng.step(int(t), full)
    return acc["loss"] / max(acc["n"], 1)


def needle_hits(eng, model, kv, text: str, n_needles: int, filler_words: int = 1000) -> list[bool]:
    """Completion-style needle probes (a 135M model answers these, not chat questions): the passphrase
    sentence planted 10%..60% into ~1,300 tokens of the novel, then "Answer: the secret passphrase ...
    is" and 12 greedy tokens; a hit when the passphrase comes back."""
    tok = model.tokenizer
    words = text.split(" ")
    hits = []
    for i in range(n_needles):
        code = CODES[i % len(CODES)]
        frac = 0.1 + 0.5 * i / max(1, n_needles - 1)
        body = " ".join(words[3000 + 2000 * i:3000 + 2000 * i + filler_words])
        cut = int(len(body) * frac)
        body = body[:cut] + " " + NEEDLE.format(code=code) + " " + body[cut:]
        ids = tok.encode(body + QUESTION)
        st = eng.new_store(kv)
        logits = eng.prefill(ids, st)
        out = []
        for _ in range(12):
            t = int(np.argmax(logits))
            out.append(t)
            logits = eng.step(t, st)
        hits.append(code in tok.decode(out))
    return hits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--budgets", default="128,256,512")
    ap.add_argument("--policies", default="all")
    ap.add_argument("--needles", type=int, default=4)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("--name", default="kv_quality")
    ap.add_argument("--loss-tokens", type=int, default=2000, help="tokens for the attention-loss measure (0: skip)")
    ap.add_argument("--resume", action="store_true", help="keep the entries of bench/results/<name>.json, run the rest")
    ap.add_argument("--ppl-from", default="", help="with --resume: start <name> from this result's needle and "
                    "attention-loss entries (they do not depend on --tokens) and rerun only the perplexities")
    ap.add_argument("--skip-ceiling", action="store_true", help="a shard without the ceiling run (another shard "
                    "has it; --merge that one first)")
    ap.add_argument("--loss-only", action="store_true", help="with --resume: rerun only the attention loss, over "
                    "--loss-tokens tokens, of the entries that have none or one over fewer tokens")
    ap.add_argument("--merge", default="", help="comma list of result names whose models are merged into <name>")
    args = ap.parse_args()
    if args.merge:
        return merge(args)
    from ringllm.models.bundled import default_model_path, gemma3_model_path
    from ringllm.models.loader import load_model
    from ringllm.runtime.engine import CPUEngine
    from ringllm.runtime.kv_config import KVConfig
    from ringllm.runtime.policies import REGISTRY

    policies = [p for p in REGISTRY if p != "full"] if args.policies == "all" else args.policies.split(",")
    budgets = [int(b) for b in args.budgets.split(",")]
    text = open(DATA, encoding="utf-8").read()
    paths = {"smollm2": default_model_path, "gemma3": gemma3_model_path}
    results = {"machine": machine(), "tokens": args.tokens, "budgets": budgets, "policies": policies, "models": {}}
    old = {}
    path = os.path.join(RESULTS, args.name + ".json")
    if args.resume and os.path.exists(path):
        with open(path) as fh:
            old = json.load(fh)["models"]
    elif args.resume and args.ppl_from:
        with open(os.path.join(RESULTS, args.ppl_from + ".json")) as fh:
            old = {name: {"ceiling": None, "needle_ceiling": m["needle_ceiling"], "tokens": args.tokens, "ppl": {},
                          "needle": m["needle"], "attention_loss": m["attention_loss"], "seconds": {}, "stats": {}}
                   for name, m in json.load(fh)["models"].items()}
    for name in args.models.split(","):
        model = load_model(paths[name]())
        eng = CPUEngine(model.spec, model.tensors, n_threads=args.threads)
        ids = np.asarray(model.tokenizer.encode(text), np.int64)[:args.tokens + 1]
        res = old.get(name) or {"ceiling": None, "ppl": {}, "needle": {}, "attention_loss": {}, "seconds": {},
                                "stats": {}}
        if res.get("tokens", args.tokens) != args.tokens:
            raise SystemExit(f"--resume: {name} was measured over {res['tokens']} tokens, not {args.tokens}")
        res["tokens"] = args.tokens
        results["models"][name] = res
        t0 = time.time()
        if args.loss_only:
            loss_only(eng, res, policies, budgets, ids, args, results)
            continue
        if res["ceiling"] is None and not args.skip_ceiling:
            ceiling_kv = KVConfig(capacity=model.spec.n_ctx, policy="streaming", sinks=4)
            res["ceiling"] = streaming_ppl(eng, ceiling_kv, ids)[0]
            if args.needles or "needle_ceiling" not in res:
                res["needle_ceiling"] = needle_hits(eng, model, ceiling_kv, text, args.needles)
            print(name, "ceiling", res["ceiling"], res["needle_ceiling"], f"{time.time() - t0:.0f}s", flush=True)
        for pol in policies:
            for b in budgets:
                kv = KVConfig(capacity=b, policy=pol, sinks=4)
                t0 = time.time()
                key = f"{pol}@{b}"
                if key in res["ppl"]:
                    continue
                res["ppl"][key], stats = streaming_ppl(eng, kv, ids)
                res["stats"][key] = {k: v for k, v in stats.items() if k.startswith("gvote_budget_mean")
                                     or k in ("length", "evicted_total")}
                if args.needles or key not in res["needle"]:     # --needles 0 keeps probes resumed from a file
                    res["needle"][key] = needle_hits(eng, model, kv, text, args.needles)
                if args.loss_tokens:
                    record_loss(eng, res, key, kv, ids, args.loss_tokens)
                res["seconds"][key] = time.time() - t0
                print(name, key, f"ppl {res['ppl'][key]:.3f}", "needle", sum(res["needle"][key]), "/", args.needles,
                      "loss", res["attention_loss"].get(key),
                      f"{res['seconds'][key]:.0f}s", flush=True)
                write(results, args)
    write(results, args)


def record_loss(eng, res: dict, key: str, kv, ids: np.ndarray, n: int) -> None:
    """res's attention loss of entry `key` over the first n ids, and the span it was measured over."""
    res["attention_loss"][key] = attention_loss(eng, kv, ids[:n])
    res.setdefault("loss_tokens", {})[key] = n


def loss_only(eng, res: dict, policies, budgets, ids, args, results) -> None:
    """--loss-only: the attention loss of each (policy, budget) over the first --loss-tokens tokens,
    where the entry has none or one measured over fewer tokens; perplexities and needles are kept."""
    from ringllm.runtime.kv_config import KVConfig
    done = res.setdefault("loss_tokens", {})
    for pol in policies:
        for b in budgets:
            key = f"{pol}@{b}"
            if done.get(key, 0) >= args.loss_tokens:
                continue
            t0 = time.time()
            record_loss(eng, res, key, KVConfig(capacity=b, policy=pol, sinks=4), ids, args.loss_tokens)
            print(key, "loss", f"{res['attention_loss'][key]:.4f}", f"{time.time() - t0:.0f}s", flush=True)
            write(results, args)
    write(results, args)


def merge(args) -> None:
    """Combine the models of several result files (runs made in parallel, one model each) into <name>."""
    out = None
    for part in args.merge.split(","):
        with open(os.path.join(RESULTS, part + ".json")) as fh:
            res = json.load(fh)
        if out is None:
            out = res
            continue
        for name, model in res["models"].items():      # the same model from several shards: union of entries
            have = out["models"].setdefault(name, model)
            if have is not model:
                for field in ("ppl", "needle", "attention_loss", "loss_tokens", "seconds", "stats"):
                    have.setdefault(field, {}).update(model.get(field, {}))
        out["policies"] += [p for p in res["policies"] if p not in out["policies"]]
    args.models = ",".join(out["models"])
    write(out, args)


def write(results: dict, args) -> None:
    md = ["# KV eviction quality: streaming perplexity over a novel (Pride and Prejudice), needle retrieval, "
          "attention loss\n",
          f"Machine: {results['machine']['cpu']}, {results['machine']['cores']} cores. Command per model: "
          "`python bench/kv_quality.py --models M --tokens N --budgets 128,256,512 --needles K --loss-tokens L "
          "--name kv_quality_M`, then `--merge` of the parts.\n",
          "Perplexity: lower is better; the ceiling is the streaming policy at the model's whole context. "
          "Needle: hits / probes (passphrase planted 10-60% into a ~1,300-token prompt, asked at the end).\n"]
    for name, res in results["models"].items():
        md.append(f"## {name}: {res.get('tokens', results['tokens'])} tokens\n")
        if res["ceiling"] is None:
            md.append("Ceiling: not measured in this shard (--skip-ceiling; see the merged table)\n")
        else:
            md.append(f"Ceiling (streaming at the model's whole context): perplexity {res['ceiling']:.3f}, needle "
                      f"{sum(res['needle_ceiling'])}/{len(res['needle_ceiling'])}\n")
        md.append("| policy | " + " | ".join(f"ppl @{b}" for b in results["budgets"]) + " | "
                  + " | ".join(f"needle @{b}" for b in results["budgets"]) + " | "
                  + " | ".join(f"attn loss @{b}" for b in results["budgets"]) + " |")
        md.append("|---" * (1 + 3 * len(results["budgets"])) + "|")
        for pol in results["policies"]:
            cells = [f"{res['ppl'][f'{pol}@{b}']:.3f}" if f"{pol}@{b}" in res["ppl"] else "-" for b in results["budgets"]]
            cells += [f"{sum(res['needle'][f'{pol}@{b}'])}/{len(res['needle'][f'{pol}@{b}'])}"
                      if f"{pol}@{b}" in res["needle"] else "-" for b in results["budgets"]]
            cells += [f"{res['attention_loss'][f'{pol}@{b}']:.4f}" if f"{pol}@{b}" in res.get("attention_loss", {})
                      else "-" for b in results["budgets"]]
            md.append(f"| {pol} | " + " | ".join(cells) + " |")
        spans = sorted(set(res.get("loss_tokens", {}).values()))
        if spans:
            md.append("\nAttention loss measured over the first " + " / ".join(f"{n:,}" for n in spans)
                      + " tokens of the text (every token fed one at a time through the policy's store and a "
                      "full one).")
        chosen = {k: v["gvote_budget_mean"] for k, v in res.get("stats", {}).items() if v.get("gvote_budget_mean")}
        if chosen:
            md.append("\nGVote's chosen budgets (mean over steps and layers of the nucleus size it kept, the "
                      "capacity being the ceiling): " + ", ".join(f"{k}: {v:.1f}" for k, v in sorted(chosen.items())))
        md.append("")
    text = "\n".join(md) + "\n"
    write_results(args.name, results, text)
    if any(res["ceiling"] is None for res in results["models"].values()):
        return                                  # a shard: the merged result gets the plot
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = list(results["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 6), squeeze=False)
    colors = plt.get_cmap("tab20").colors
    markers = "osD^v<>pPhX*"
    for ax, name in zip(axes[0], models):
        res = results["models"][name]
        top = 1.6 * res["ceiling"]          # policies that blow up are drawn at the top edge, value written
        for i, pol in enumerate(results["policies"]):
            xs = [b for b in results["budgets"] if f"{pol}@{b}" in res["ppl"]]
            ys = [res["ppl"][f"{pol}@{b}"] for b in xs]
            ax.plot(xs, [min(y, top) for y in ys], marker=markers[i % len(markers)], color=colors[i % len(colors)],
                    ls="-" if i < 10 else "--", label=pol)
            for x, y in zip(xs, ys):
                if y > top:
                    ax.annotate(f"{pol} {y:.0f}", (x, top), textcoords="offset points", xytext=(0, -12 - 9 * (i % 2)),
                                ha="center", fontsize=7, color=colors[i % len(colors)])
        ax.axhline(res["ceiling"], color="k", ls=":", label="ceiling (whole context)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(results["budgets"], [str(b) for b in results["budgets"]])
        ax.set_ylim(0.97 * res["ceiling"], 1.03 * top)
        ax.set_xlabel("KV budget (tokens)")
        ax.set_ylabel("streaming perplexity (clipped at 1.6x the ceiling)")
        ax.set_title(f"{name}, {res.get('tokens', results['tokens'])} tokens")
        ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.13))
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, args.name + ".png"), dpi=110)


if __name__ == "__main__":
    main()
