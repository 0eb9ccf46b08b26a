"""RULER-style accuracy against average KV memory of the prompt-compression presses (KVConfig.compress).

    python bench/compression_ruler.py --lengths 1024,2048,4096 --instances 2 --name compression_ruler_smollm2
    python bench/compression_ruler.py --merge compression_ruler_smollm2_a,compression_ruler_smollm2_b \
        --name compression_ruler_smollm2

Tasks (RULER, Hsieh et al. 2024, rebuilt from the project's public-domain novels in bench/data; a
fixed seed makes every instance the same on every run): niah_single (one "special magic number" in
the novel text, asked for), niah_multikey (four keys, one asked), niah_multivalue (four numbers of one
key, all asked), variable_tracking (a chain of four assignments VAR X = 12345, VAR Y = VAR X, ...,
every name asked), common_words (a numbered word list where ten words come often, the ten asked),
qa_paragraph (a planted paragraph of made-up facts, one asked). The prompt is the model's chat
template around context + question, ending with the answer's start (RULER's answer prefix), so the
press's window (the last compress_window = 64 tokens) holds the question.

Each instance is prefilled ONCE (runtime/compress.prefill_whole); every press x budget is then
applied to that same prefill (press_store) and decoded greedily, so a cell costs its press and its
decode, not a prefill. Score: the share of the expected strings found in the answer (0/1 for the
single-answer tasks). Memory: the share of the prompt's tokens kept, averaged over the pressed
layers and kv heads (the seed's "average memory usage"); 100% is the uncompressed prompt.

Results: bench/results/NAME.md and .png, and every instance's record (answer, score, timings) in
NAME.json.gz; --merge reads those of earlier runs (or a plain NAME.json of older ones).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import RESULTS, machine, read_results, write_results  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data")
TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "common_words", "qa_paragraph")
GEN_TOKENS = {"niah_single": 12, "niah_multikey": 12, "niah_multivalue": 36, "variable_tracking": 24,
              "common_words": 40, "qa_paragraph": 8}
PRESSES = ("snapkv", "pyramidkv", "adakv", "tova", "knorm", "streaming", "random")     # + gvote, own budget
KEY_WORDS = ("amber", "harbor", "velvet", "quarry", "lantern", "meadow", "copper", "falcon", "thistle", "orchard",
             "saddle", "willow", "ember", "garnet", "hollow", "pebble", "raven", "cobalt", "juniper", "marble")
NAMES = ("Mr. Hartwell", "Mrs. Pendry", "Captain Ollerton", "Miss Garrow", "Dr. Thackery", "Lady Ferrand")
JOBS = ("clockmaker", "bookbinder", "glazier", "saddler", "apothecary", "cooper")
TOWNS = ("Bristol", "Norwich", "Exeter", "Lincoln", "Chester", "Bath")
ANIMALS = ("horse", "parrot", "spaniel", "goat", "cat", "pony")
PETS = ("Juniper", "Bramble", "Mercury", "Tansy", "Orion", "Clover", "Sorrel", "Pippin")


# ---------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------


class Builder:
    """Makes task instances of about n_tokens prompt tokens for one LLM (its tokenizer and template)."""

    def __init__(self, llm):
        self.llm = llm
        text = "".join(open(os.path.join(DATA, f), encoding="utf-8").read()[5000:] for f in ("emma.txt",
                                                                                          "prideprejudice.txt"))
        self.text = " ".join(text.split())
        self.words = sorted({w.strip(".,;:!?\"'()").lower() for w in self.text.split()[:60000]
                             if w.isalpha() and 4 <= len(w) <= 9})

    def ntok(self, s: str) -> int:
        return len(self.llm.tokenize(s, add_bos=False))

    def haystack(self, rng, n_tokens: int) -> list[str]:
        """Sentences of the novels from a random place, about n_tokens tokens."""
        start = int(rng.integers(0, len(self.text) - 40 * n_tokens))
        chunk = self.text[start:start + 6 * n_tokens]
        chunk = chunk[chunk.find(". ") + 2:]
        sents = [s.strip() + "." for s in chunk.split(". ") if s.strip()]
        out, used = [], 0
        for s in sents:
            used += self.ntok(" " + s)
            if used > n_tokens:
                break
            out.append(s)
        return out

    def plant(self, rng, sents: list[str], needles: list[str]) -> str:
        """The haystack with each needle at a random depth (between sentences)."""
        sents = list(sents)
        for nd in needles:
            sents.insert(int(rng.integers(0, len(sents) + 1)), nd)
        return " ".join(sents)

    def prompt(self, context: str, question: str, prefix: str) -> list[int]:
        """Chat-template ids: the user turn holds context and question; the answer starts with prefix."""
        llm = self.llm
        text = llm.render_chat([{"role": "user", "content": context + "\n\n" + question}], add_generation_prompt=True)
        return llm.chat_ids(text + prefix)

    def make(self, task: str, rng, n_tokens: int) -> dict:
        body = n_tokens - 90                            # template, question and answer prefix
        key = lambda: f"{KEY_WORDS[int(rng.integers(len(KEY_WORDS)))]}-{KEY_WORDS[int(rng.integers(len(KEY_WORDS)))]}"
        num = lambda: str(int(rng.integers(1_000_000, 9_999_999)))
        if task in ("niah_single", "niah_multikey", "niah_multivalue"):
            k = key()
            if task == "niah_single":
                vals, needles = [num()], None
            elif task == "niah_multikey":
                others = set()
                while len(others) < 3:
                    o = key()
                    if o != k:
                        others.add(o)
                vals = [num()]
                needles = [f"One of the special magic numbers for {o} is: {num()}." for o in sorted(others)]
            else:
                vals, needles = [num() for _ in range(4)], []
            needles = (needles or []) + [f"One of the special magic numbers for {k} is: {v}." for v in vals]
            ctx = self.plant(rng, self.haystack(rng, body - sum(self.ntok(n) for n in needles)), needles)
            if task == "niah_multivalue":
                q = f"What are all the special magic numbers for {k} mentioned in the provided text?"
                prefix = f"The special magic numbers for {k} mentioned in the provided text are"
            else:
                q = f"What is the special magic number for {k} mentioned in the provided text?"
                prefix = f"The special magic number for {k} mentioned in the provided text is"
            return {"ids": self.prompt("Some special magic numbers are hidden within the following text. Make sure "
                                       "to memorize them. I will quiz you about the numbers afterwards.\n" + ctx, q,
                                       prefix), "answers": vals}
        if task == "variable_tracking":
            names = ["".join(chr(65 + int(c)) for c in rng.integers(0, 26, 5)) for _ in range(4)]
            value = num()[:5]
            chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 4)]
            sents = self.haystack(rng, body - sum(self.ntok(c) for c in chain))
            pos = sorted(int(x) for x in rng.integers(0, len(sents) + 1, 4))
            for i, (p, c) in enumerate(zip(pos, chain)):
                sents.insert(p + i, c)
            q = f"Find all variables that are assigned the value {value} in the text above."
            prefix = (f"Answer: According to the chain(s) of variable assignment in the text above, 4 variables are "
                      f"assigned the value {value}, they are:")
            return {"ids": self.prompt("Memorize and track the chain(s) of variable assignment hidden in the "
                                       "following text.\n" + " ".join(sents), q, prefix), "answers": names}
        if task == "common_words":
            pick = rng.choice(len(self.words), size=400, replace=False)
            common, rare = [self.words[i] for i in pick[:10]], [self.words[i] for i in pick[10:]]
            seq = [w for w in common for _ in range(max(3, body // 120))]
            seq += rare[:max(0, body // 4 - len(seq))]
            seq = [seq[i] for i in rng.permutation(len(seq))]
            lines, used = [], 0
            for i, w in enumerate(seq):
                line = f"{i + 1}. {w}"
                used += self.ntok("\n" + line)
                if used > body:
                    break
                lines.append(line)
            q = "Question: What are the 10 most common words in the above list?"
            return {"ids": self.prompt("Below is a numbered list of words. In these words, some appear more often "
                                       "than others. Memorize the ones that appear most often.\n" + "\n".join(lines),
                                       q, "Answer: The top 10 words that appear most often in the list are:"),
                    "answers": common}
        if task == "qa_paragraph":
            i = rng.permutation(len(NAMES))
            facts = [(NAMES[i[j]], JOBS[int(rng.integers(len(JOBS)))], TOWNS[int(rng.integers(len(TOWNS)))],
                      ANIMALS[j], PETS[int(rng.integers(len(PETS)))]) for j in range(3)]
            para = " ".join(f"{n}, a {job} from {town}, kept a {a} named {p}." for n, job, town, a, p in facts)
            n, _, _, a, p = facts[int(rng.integers(3))]
            ctx = self.plant(rng, self.haystack(rng, body - self.ntok(para)), [para])
            return {"ids": self.prompt("Read the following text and answer the question about it.\n" + ctx,
                                       f"Question: What was the name of the {a} that {n} kept?",
                                       "Answer: The name was"), "answers": [p]}
        raise ValueError(task)


def score(text: str, answers: list[str]) -> float:
    low = text.lower()
    return sum(a.lower() in low for a in answers) / len(answers)


# ---------------------------------------------------------------------------------------------
# Run
# ---------------------------------------------------------------------------------------------


def configs(presses, budgets):
    """(label, press, budget %) for every cell: the uncompressed prompt, gvote, each press x budget < 100."""
    out = [("full", None, 100)]
    if "gvote" in presses:
        out.append(("gvote", "gvote", None))
    for p in presses:
        if p != "gvote":
            out += [(f"{p}@{b}", p, b) for b in budgets if b < 100]
    return out


def greedy(engine, store, logits, n, eos, nl_ids):
    toks = []
    for _ in range(n):
        t = int(np.argmax(logits))
        if t in eos:
            break
        toks.append(t)
        if len(toks) > 2 and t in nl_ids:
            break
        logits = engine.step(t, store)
    return toks


def run(args) -> dict:
    import ringllm
    from ringllm.runtime.compress import layer_prompts, prefill_whole, press_store
    from ringllm.runtime.kv_config import KVConfig

    model = {"smollm2": None}.get(args.model, args.model)
    if args.model == "gemma3":
        from ringllm.models.bundled import gemma3_model_path
        model = gemma3_model_path()
    llm = ringllm.LLM(model, n_threads=args.threads, progress=False)
    eng = llm.engine
    b = Builder(llm)
    nl_ids = {i for i in range(min(llm.n_vocab, 50000)) if "\n" in llm.detokenize([i])} if args.stop_newline else set()
    presses = args.presses.split(",")
    budgets = [int(x) for x in args.budgets.split(",")]
    cells = configs(presses, budgets)
    records = []
    t_all = time.perf_counter()
    for L in [int(x) for x in args.lengths.split(",")]:
        for task in args.tasks.split(","):
            for inst in range(args.instances):
                rng = np.random.default_rng([args.seed, L, TASKS.index(task), inst])
                item = b.make(task, rng, L)
                ids = item["ids"]
                t0 = time.perf_counter()
                transient, cap, logits = prefill_whole(eng, ids, args.positions, 64, hidden=True)
                prefill_s = time.perf_counter() - t0
                prompts = layer_prompts(transient, cap)        # rotated keys and window attention, once
                for label, press, pct in cells:
                    t1 = time.perf_counter()
                    if press is None:
                        kv = KVConfig(compress="snapkv", compress_budget=len(ids), positions=args.positions)
                    elif press == "gvote":
                        kv = KVConfig(compress="gvote", positions=args.positions)
                    else:
                        kv = KVConfig(compress=press, compress_ratio=pct / 100.0, positions=args.positions)
                    store = press_store(eng, transient, cap, kv, room=GEN_TOKENS[task] + 1, prompts=prompts)
                    press_s = time.perf_counter() - t1
                    toks = greedy(eng, store, logits, GEN_TOKENS[task], llm.eos_ids, nl_ids)
                    text = llm.detokenize(toks)
                    records.append({"length": L, "task": task, "instance": inst, "cell": label, "press": press or "full",
                                    "budget": pct, "prompt_tokens": len(ids), "kept_share": store.press_stats["kept_share"],
                                    "store_bytes": store.stats()["bytes"], "score": score(text, item["answers"]),
                                    "answer": text, "expected": item["answers"], "prefill_s": prefill_s,
                                    "press_s": press_s, "decode_s": time.perf_counter() - t1 - press_s})
                    del store
                del transient
                done = [r for r in records if r["length"] == L and r["task"] == task and r["instance"] == inst]
                print(f"L={L} {task} #{inst}: {len(ids)} tokens, prefill {prefill_s:.1f}s, cells "
                      f"{sum(r['press_s'] + r['decode_s'] for r in done):.1f}s, full score {done[0]['score']:.2f}",
                      flush=True)
    return {"model": args.model, "machine": machine(), "command": " ".join(sys.argv), "seed": args.seed,
            "positions": args.positions,
            "instances_per_cell": args.instances, "wall_s": time.perf_counter() - t_all, "records": records}


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def sample_note(table: dict, lengths: list) -> str:
    """What the sample is against the issue's 100+ instances per cell (a cell: one press and budget at
    one prompt length, its n instances over every task)."""
    per_length = {L: min(n for (l2, _), (_, _, n) in table.items() if l2 == L) for L in lengths}
    ok = [L for L, n in per_length.items() if n >= 100]
    short = [f"{L} ({n})" for L, n in per_length.items() if n < 100]
    said = [f"Cells at {', '.join(map(str, ok))} tokens hold 100+ instances each."] if ok else []
    if short:
        said.append(f"Fewer than the 100+ per cell the full run takes at: {', '.join(short)} (the time budget of "
                    "this 2-core machine).")
    return " ".join(said)


def summarize(payload: dict) -> tuple[dict, str]:
    recs = payload["records"]
    lengths = sorted({r["length"] for r in recs})
    cells = list(dict.fromkeys(r["cell"] for r in recs))
    table = {}
    for L in lengths + ["all"]:
        for c in cells:
            rs = [r for r in recs if r["cell"] == c and (L == "all" or r["length"] == L)]
            if rs:
                table[(L, c)] = (float(np.mean([r["score"] for r in rs])), float(np.mean([r["kept_share"] for r in rs])),
                                 len(rs))
    tasks = list(dict.fromkeys(r["task"] for r in recs))
    n_inst = {(L, t): len({(r.get("seed"), r["instance"]) for r in recs if r["length"] == L and r["task"] == t})
              for L in lengths for t in tasks}
    md = [f"# Prompt compression on RULER-style tasks: accuracy against average KV memory ({payload['model']})", "",
          f"Machine: {payload['machine'].get('cpu')}, {payload['machine'].get('cores')} cores (shared with other work). "
          f"Command: `{payload['command']}`. Seed {payload['seed']}; positions {payload.get('positions', 'reindexed')}; "
          f"wall time {payload['wall_s'] / 60:.1f} min.", "",
          "Memory: the share of the prompt's tokens kept, mean over pressed layers and kv heads (the seed's "
          "average memory usage). Accuracy: the share of expected strings in the greedy answer, mean over tasks "
          "and instances. Every cell of a row is pressed from the same prefill of the same instances.", "",
          "**Instances per (length, task): " + ", ".join(f"{L}/{t}: {n}" for (L, t), n in n_inst.items()) +
          "**. " + sample_note(table, lengths), ""]
    for L in lengths + ["all"]:
        md += [f"## {L if L == 'all' else f'{L} tokens'}", "", "| cell | accuracy | avg memory | n |", "|---|---|---|---|"]
        for c in cells:
            if (L, c) in table:
                a, mem, n = table[(L, c)]
                md.append(f"| {c} | {a:.3f} | {mem:.3f} | {n} |")
        md.append("")
    md += ["## Per task (all lengths)", "", "| cell | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
    for c in cells:
        row = [np.mean([r["score"] for r in recs if r["cell"] == c and r["task"] == t] or [np.nan]) for t in tasks]
        md.append(f"| {c} | " + " | ".join(f"{x:.2f}" for x in row) + " |")
    md.append("")
    return table, "\n".join(md)


def plot(payload: dict, table: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = payload["records"]
    lengths = sorted({r["length"] for r in recs}) + ["all"]
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 3.8), squeeze=False)
    presses = list(dict.fromkeys(r["press"] for r in recs if r["press"] not in ("full", "gvote")))
    for ax, L in zip(axes[0], lengths):
        for p in presses:
            pts = sorted((table[(L, c)][1], table[(L, c)][0]) for (LL, c) in table if LL == L and c.startswith(p + "@"))
            full = table.get((L, "full"))
            if full:
                pts.append((full[1], full[0]))
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=p)
        if (L, "gvote") in table:
            a, mem, _ = table[(L, "gvote")]
            ax.plot([mem], [a], marker="s", ms=9, color="tab:orange", linestyle="none", label="gvote")
        ax.set_title(f"{L} tokens" if L != "all" else "all lengths")
        ax.set_xlabel("average KV memory (share of prompt kept)")
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"RULER-style tasks, {payload['model']}: accuracy vs average memory")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2 (bundled), gemma3 (the gemma3 extra) or a path")
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--presses", default="snapkv,pyramidkv,adakv,gvote,tova,knorm,streaming,random")
    ap.add_argument("--budgets", default="10,20,30,50,100", help="kept share in percent (100 = the uncompressed prompt)")
    ap.add_argument("--instances", type=int, default=100, help="instances per (length, task)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--positions", default="original", choices=("original", "reindexed"),
                    help="positions of the kept tokens (original: the papers' choice)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--stop-newline", action="store_true", help="end an answer at its first newline (faster)")
    ap.add_argument("--name", default="compression_ruler")
    ap.add_argument("--merge", default=None, help="comma-separated result names to merge into --name")
    args = ap.parse_args(argv)
    if args.merge:
        parts = [read_results(n) for n in args.merge.split(",")]
        # each record keeps its run's seed: runs with other seeds draw other instances under the same numbers
        records = [{**r, "seed": r.get("seed", p["seed"])} for p in parts for r in p["records"]]
        seeds = sorted({r["seed"] for r in records})
        payload = {**parts[0], "records": records, "seed": seeds[0] if len(seeds) == 1 else ", ".join(map(str, seeds)),
                   "wall_s": sum(p["wall_s"] for p in parts),
                   "command": " ; ".join(p["command"] for p in parts)}
    else:
        payload = run(args)
    table, md = summarize(payload)
    write_results(args.name, payload, md, compress=True)
    plot(payload, table, os.path.join(RESULTS, args.name + ".png"))
    print(md)


if __name__ == "__main__":
    main()
