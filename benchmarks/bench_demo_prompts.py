"""The README demo (``./dev demo --compare-ar``) on several prompts: AR against Domino with
adaptive widths (``--draft-length auto``, the CLI default) and with the fixed full block.

    python benchmarks/bench_demo_prompts.py                       # the shipped drafter
    python benchmarks/bench_demo_prompts.py --draft DIR --tag new  # another drafter
    python benchmarks/bench_demo_prompts.py --prompt-file heldout.jsonl --per-kind 2 \
        --lookup-arms 4 --ngram --no-fixed     # auto with and without the lookup arms

Same settings as the demo: the SmolLM2-135M-Instruct target with the bundled (or
``--draft``) Domino drafter, chat template, greedy, 128 new tokens, float32 on the CPU. Per
prompt every run is compiled first, then timed ``--reps`` times interleaved (AR first) and
the fastest run of each kept, as the CLI's ``--compare-ar`` does (a busy machine only ever
slows a run down). The adaptive cost table is calibrated once per prompt shape (excluded
from the timings) in ``--cost-table``. Reports the speedup over AR, tau, the verify-width
histogram and whether the outputs equal AR's, as JSON and Markdown in ``--out``.
``--lookup-arms K[,K]`` adds ``domino auto+lookup`` (the adaptive policy with prompt-lookup
arms, ``--adaptive-lookup``; its arm histogram is reported), ``--ngram`` the prompt lookup
alone (``--method ngram``, the CLI defaults); ``--prompt-file F --per-kind N`` takes the
first N prompts of each kind of a ``{prompt, kind}`` JSONL file (the corpus's
``heldout.jsonl``) instead of the built-in prompts, in turn over the kinds, the first
``--prompts`` of them; ``--prompt-bucket W[,W]`` keeps only those padded to these widths
(one compile and one calibration per run and width: on a GPU each costs minutes; with the
SmolLM2 chat template, ``64,128`` holds prompts of every kind of the corpus's held-out
split). A summary per run closes the Markdown: the geometric mean of the speedups and the
mean tau. With lookup arms, ``domino auto`` runs on the drafter arms' costs of ``domino
auto+lookup``'s calibration (one calibration per prompt: the two differ by the lookup arms
only, not by calibration noise).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

PROMPTS = (
    "Explain in three sentences why the sky is blue.",            # the demo's own prompt
    "Write a short poem about the sea.",
    "What is 17 times 23? Show your work.",
    "Write a Python function that reverses a string.",
    "List five fruits that are red.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", default=None, help="drafter folder (default: the bundled one)")
    p.add_argument("--tag", default="shipped", help="a name for the drafter in the results")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--no-fixed", dest="fixed", action="store_false",
                   help="skip the fixed-width (16 drafts) run")
    p.add_argument("--prompts", type=int, default=None,
                   help="first N prompts (with --prompt-file: taken round-robin over kinds)")
    p.add_argument("--prompt-file", default=None,
                   help="a {prompt, kind} JSONL file (with --per-kind) instead of PROMPTS")
    p.add_argument("--per-kind", type=int, default=2)
    p.add_argument("--prompt-bucket", default=None, metavar="WIDTH[,WIDTH]",
                   help="with --prompt-file: only prompts (chat template applied) padded to "
                        "these widths (16, 32, ..., 256, 512, ...): one compile and one cost "
                        "calibration per run and width (a GPU's compiles are slow)")
    p.add_argument("--lookup-arms", default="off",
                   help="also run auto with these prompt-lookup arms (on | K[,K...]; off)")
    p.add_argument("--ngram", action="store_true", help="also run --method ngram")
    p.add_argument("--draft-vocab", default="", metavar="N[,N]",
                   help="also the adaptive run (with the lookup arms when given) with the "
                        "drafter's LM head over the N most frequent tokens (the CLI's "
                        "--draft-vocab N; the folder's draft_vocab.npy), per N")
    p.add_argument("--cost-table", default=None,
                   help="default: OUT/demo_prompts_costs.json (calibrated on first use)")
    p.add_argument("--git-commit", default=None)
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench_util import git_commit, versions
    from domino_jax.decode.adaptive import AdaptiveConfig
    from domino_jax.decode.config import DecodeConfig
    from domino_jax.decode.cost_model import CostModel
    from domino_jax.decode.loading import (default_models, draft_vocab_params, encode_prompt,
                                           load_pair, load_tokenizer, read_draft_vocab,
                                           stop_token_ids)
    from domino_jax.decode.methods import make_drafter
    from domino_jax.decode.lookup_arm import parse_lookup_arms
    from domino_jax.decode.speculative import generate, precompile, prompt_bucket

    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    target_dir, draft_dir = default_models(None, args.draft)
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    target, tp, drafter, dp = load_pair(target_dir, draft_dir, "domino", dtype)
    tokenizer = load_tokenizer(target_dir)
    stops = stop_token_ids(tokenizer, target.config, [])
    base = DecodeConfig(method="domino", max_new_tokens=args.max_new_tokens,
                        stop_token_ids=stops)
    runs = {"ar": (dataclasses.replace(base, method="ar"), None, None),
            "domino auto": (dataclasses.replace(base, adaptive=AdaptiveConfig()), drafter, dp)}
    if args.fixed:
        runs["domino 16"] = (base, drafter, dp)
    lookup = parse_lookup_arms(args.lookup_arms)
    if lookup:                  # before "domino auto", which reuses its calibration
        runs = {"ar": runs.pop("ar"), "domino auto+lookup": (dataclasses.replace(
            base, adaptive=AdaptiveConfig(lookup=lookup)), drafter, dp), **runs}
    if args.ngram:
        runs["ngram"] = (dataclasses.replace(base, method="ngram"), None, None)
    for size in [int(n) for n in args.draft_vocab.split(",") if n]:
        name = "domino auto+lookup" if lookup else "domino auto"
        runs[f"{name} vocab{size}"] = (
            runs[name][0], make_drafter(drafter.config, target, "domino", dataclasses.replace(
                drafter.options, draft_vocab=size)),
            dict(dp, vocab=draft_vocab_params(target.config, tp, read_draft_vocab(
                draft_dir, size, target.config.vocab_size))))
    texts, kinds = list(PROMPTS[:args.prompts]), [""] * len(PROMPTS[:args.prompts])
    if args.prompt_file:
        from domino_jax.train.evaluate import read_eval_prompts

        # --prompt-bucket: only prompts padded to those widths (one compile and calibration
        # a width), in the file's order per kind
        by_kind = read_eval_prompts(args.prompt_file,
                                    None if args.prompt_bucket else args.per_kind)
        if args.prompt_bucket:
            widths = {int(w) for w in args.prompt_bucket.split(",")}
            by_kind = {k: [q for q in qs if prompt_bucket(len(encode_prompt(
                tokenizer, q, True))) in widths][:args.per_kind]
                for k, qs in by_kind.items()}
        pairs = [(by_kind[k][i], k) for i in range(args.per_kind) for k in by_kind
                 if i < len(by_kind[k])][:args.prompts]   # round-robin: every kind early
        if not pairs:
            raise SystemExit(f"no prompt of {args.prompt_file} pads to width(s) "
                             f"{args.prompt_bucket}")
        texts, kinds = [q for q, _ in pairs], [k for _, k in pairs]
    cost_model = CostModel(path=args.cost_table or os.path.join(args.out,
                                                                "demo_prompts_costs.json"))
    stamp = _dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    dev = jax.devices()[0]
    meta = dict(date=stamp, git_commit=git_commit(args.git_commit), versions=versions(),
                device=f"{dev.platform}:{dev.device_kind}", draft=draft_dir, tag=args.tag,
                max_new_tokens=args.max_new_tokens, reps=args.reps,
                cost_table=cost_model.path, argv=sys.argv[1:], lookup_arms=list(lookup),
                load_start=[round(x, 1) for x in os.getloadavg()])
    rows = []
    for text, kind in zip(texts, kinds):
        prompts = [encode_prompt(tokenizer, text, True)]
        for config, d, p in runs.values():
            precompile(target, tp, prompts, config, d, p)
        best: dict = {}
        models = {}                  # per run; default: the shared table
        for _ in range(max(args.reps, 1)):
            for name, (config, d, p) in runs.items():
                result = generate(target, tp, prompts, config, d, p,
                                  cost_model=models.get(name, cost_model))
                if name == "domino auto+lookup" and "domino auto" not in models:
                    models["domino auto"] = CostModel(costs=result.arm_costs[:-len(lookup)])
                if name not in best or result.tokens_per_second > best[name].tokens_per_second:
                    best[name] = result
        ar = best["ar"]
        for name, result in best.items():
            rows.append(dict(prompt=text, kind=kind, run=name, new_tokens=result.new_tokens,
                             tokens_per_s=round(result.tokens_per_second, 2),
                             tau=round(result.tau, 3),
                             speedup=round(result.tokens_per_second / ar.tokens_per_second, 3),
                             identical_to_ar=result.tokens == ar.tokens,
                             verify_widths={str(w): n for w, n in
                                            sorted(result.verify_widths.items())},
                             arms=result.arm_rounds, arm_costs=result.arm_costs,
                             cost_source=result.cost_source))
            print(f"{text[:40]!r:44} {name:12} {rows[-1]['tokens_per_s']:6.2f} tok/s  "
                  f"{rows[-1]['speedup']:.2f}x  tau {rows[-1]['tau']:.2f}  "
                  f"{rows[-1]['arms'] or rows[-1]['verify_widths']}  "
                  f"identical={rows[-1]['identical_to_ar']}",
                  flush=True)
    meta["seconds"] = round(time.perf_counter() - t_start, 1)
    meta["load_end"] = [round(x, 1) for x in os.getloadavg()]
    name = os.path.join(args.out, f"demo_prompts_{args.tag}_{stamp}")
    with open(name + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# The demo on {len(texts)} prompts ({stamp}, {meta['device']}, "
             f"drafter {args.tag}, commit {meta['git_commit']})", "",
             f"`python benchmarks/bench_demo_prompts.py {' '.join(sys.argv[1:])}`: greedy, "
             f"{args.max_new_tokens} new tokens, fastest of {args.reps} interleaved runs; load "
             f"average {meta['load_start']} at the start, {meta['load_end']} at the end.", "",
             "| prompt | kind | run | tok/s | speedup over AR | tau | verify widths (arms) | "
             "= AR |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        hist = " ".join(f"{w}:{n}" for w, n in r["verify_widths"].items())
        if r["arms"]:
            hist += " (" + " ".join(f"{a}:{n}" for a, n in r["arms"].items()) + ")"
        prompt = r["prompt"][:40].replace("|", "/").replace("\n", " ")
        lines.append(f"| {prompt} | {r['kind']} | {r['run']} | {r['tokens_per_s']:.2f} | "
                     f"**{r['speedup']:.2f}x** | {r['tau']:.2f} | {hist} | "
                     f"{'yes' if r['identical_to_ar'] else 'NO'} |")
    lines += ["", "| run | geometric mean speedup over AR | mean tau | = AR |",
              "|---|---|---|---|"]
    for run in runs:
        mine = [r for r in rows if r["run"] == run]
        geo = float(np.exp(np.mean(np.log([r["speedup"] for r in mine]))))
        lines.append(f"| {run} | **{geo:.2f}x** | {np.mean([r['tau'] for r in mine]):.2f} | "
                     f"{sum(r['identical_to_ar'] for r in mine)}/{len(mine)} |")
    with open(name + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {name}.json/.md")


if __name__ == "__main__":
    main()
