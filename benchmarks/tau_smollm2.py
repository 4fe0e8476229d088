"""Acceptance length tau of every method on the real SmolLM2 target with our trained
Domino drafter, on held-out prompts (never in the training split), batched; the prompt
lookup (``ngram``, no drafter, the CLI's default settings) is the floor line.

tau does not depend on the device, so this runs anywhere (CPU included); the tok/s column
is the decode loop's throughput on this machine (compile excluded; on a shared CPU it is
only indicative: ``bench_smollm2.py`` / ``bench_decode.py`` measure speed on the GPU).
Methods: dflash (the Domino checkpoint's base logits, argmax), domino (chain), ddtree and
dominotree at several budgets, the lookup hybrids (``--lookup-branches 0,4``: each tree
also with the lookup's 4 tokens grafted in, ``ddtree@16+lookup4``, same budget;
``dominolookup``: the chain + the lookup block as a two-branch tree); T = 0 and T = 1.
``--per-kind N`` takes N held-out prompts of each kind (chat, math, code; with
``--prompt-file`` the first N of each kind of a ``{prompt, kind}`` JSONL file such as the
corpus's ``heldout.jsonl``) instead of the first ``--prompts`` and adds tau per kind.
Writes ``tau_smollm2_<date>.{json,md}`` into ``--out``.

    python benchmarks/tau_smollm2.py [--prompts 16 | --per-kind 4 [--prompt-file F]]
        [--max-new-tokens 96] [--budgets 8,16,32,64] [--lookup-branches 0,4]
        [--methods ar,ngram,dflash,domino,ddtree,dominotree,dominolookup]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--per-kind", type=int, default=0,
                   help="N held-out prompts per kind (chat, math, code) instead of --prompts")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--prompt-file", default=None,
                   help="with --per-kind: a {prompt, kind} JSONL file (e.g. heldout.jsonl)")
    p.add_argument("--budgets", default="8,16,32,64")
    p.add_argument("--lookup-branches", default="0",
                   help="tree methods: also run each budget with the prompt lookup's G "
                        "tokens grafted in as one more path (comma list of G; 0 = plain); "
                        "dominolookup runs at each G > 0 (default 4)")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--methods", default="ar,ngram,dflash,domino,ddtree,dominotree",
                   help="comma list (tree methods run at every --budgets entry)")
    p.add_argument("--git-commit", default=None, help="default: git rev-parse HEAD")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args()
    if args.git_commit is None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_smollm2 import git_commit

        args.git_commit = git_commit()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from domino_jax.decode.loading import default_models, load_pair
    from domino_jax.decode.methods import METHODS
    from domino_jax.decode.ngram import NGRAM_DEFAULTS
    from domino_jax.decode.sampling import SamplingConfig
    from domino_jax.decode.speculative import DecodeConfig, generate
    from domino_jax.text import encode_prompt, load_tokenizer, stop_token_ids
    from domino_jax.train.data import build_prompts, is_eval_prompt

    target_dir, draft_dir = default_models(None, None)
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    tokenizer = load_tokenizer(target_dir)
    if args.per_kind and args.prompt_file:
        from domino_jax.train.evaluate import read_eval_prompts

        by_kind = read_eval_prompts(args.prompt_file, args.per_kind)
        KINDS = tuple(by_kind)
        kinds = [k for k in KINDS for _ in by_kind[k]]
        prompts = [q for k in KINDS for q in by_kind[k]]
    elif args.per_kind:
        from ngram_smollm2 import KINDS, heldout_by_kind

        chosen = heldout_by_kind(args.per_kind)
        kinds, prompts = [k for k, _ in chosen], [q for _, q in chosen]
    else:
        prompts = [q for q in build_prompts(4000, seed=123) if is_eval_prompt(q)][:args.prompts]
        KINDS, kinds = (), []
    ids = [encode_prompt(tokenizer, q) for q in prompts]
    wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in wanted if m not in METHODS]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; known: {', '.join(METHODS)}")
    fields = {m: {f.name for f in dataclasses.fields(METHODS[m].Options)} for m in wanted}
    branches = [int(x) for x in args.lookup_branches.split(",")]
    grafts = [g for g in branches if g > 0] or [None]          # None: the method's default
    methods = [(m, {}) for m in wanted if "lookup_branch" not in fields[m]]
    methods += [(m, {} if g is None else dict(lookup_branch=g)) for m in wanted
                if "lookup_branch" in fields[m] and "budget" not in fields[m] for g in grafts]
    for b in [int(x) for x in args.budgets.split(",")]:
        methods += [(m, dict(budget=b, lookup_branch=g)) for m in wanted
                    if "budget" in fields[m] for g in branches if g <= b]
    import hashlib

    with open(os.path.join(draft_dir, "model.safetensors"), "rb") as f:
        draft_sha = hashlib.sha256(f.read()).hexdigest()
    rows = []
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H%M%S")

    def write():
        meta = dict(date=stamp, commit=args.git_commit, command=" ".join(sys.argv), device=str(jax.devices()[0].device_kind),
                    jax=jax.__version__, prompts=len(ids), max_new_tokens=args.max_new_tokens,
                    target=os.path.basename(target_dir), draft=draft_dir, kinds=kinds,
                    ngram=dataclasses.asdict(NGRAM_DEFAULTS), load_average=os.getloadavg(),
                    draft_sha256=draft_sha)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"tau_smollm2_{stamp}.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=2)
        temps = sorted({r["temperature"] for r in rows})
        names = list(dict.fromkeys(r["method"] for r in rows))
        columns = [(t, k) for t in temps for k in ("",) + tuple(KINDS) + ("tok/s",)]
        lines = [f"# tau on {len(ids)} held-out prompts, SmolLM2-135M-Instruct + our Domino drafter "
                 f"({meta['device']}, commit {args.git_commit}, {stamp})", "",
                 f"`{meta['command']}`; load average {meta['load_average'][0]:.1f}; tok/s: "
                 "the decode loop on this machine, compile excluded", "",
                 "| method | verify width | " + " | ".join(
                     (f"tok/s T={t:g}" if k == "tok/s" else f"tau T={t:g}" + (f" {k}" if k else ""))
                     for t, k in columns) + " |",
                 "|---|---|" + "---|" * len(columns)]
        key = lambda k: "tok_s" if k == "tok/s" else "tau" + (f"_{k}" if k else "")  # noqa: E731
        for n in names:
            cells = {r["temperature"]: r for r in rows if r["method"] == n}
            width = next(iter(cells.values()))["verify_width"]
            lines.append(f"| {n} | {width} | " + " | ".join(
                f"{cells[t][key(k)]:.{0 if k == 'tok/s' else 2}f}" if t in cells else "-"
                for t, k in columns) + " |")
        with open(os.path.join(args.out, f"tau_smollm2_{stamp}.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        return "\n".join(lines)

    for temp in [float(t) for t in args.temperatures.split(",")]:
        for method, options in methods:
            target, tparams, drafter, dparams = load_pair(
                target_dir, draft_dir if METHODS[method].needs_checkpoint else None, method,
                dtype, **options)
            stops = stop_token_ids(tokenizer, target.config)
            config = DecodeConfig(method=method, max_new_tokens=args.max_new_tokens,
                                  sampling=SamplingConfig(temp), stop_token_ids=stops)
            t0 = time.perf_counter()
            r = generate(target, tparams, ids, config, drafter, dparams, seed=0)
            name = method + (f"@{options['budget']}" if "budget" in options else "") + (
                f"+lookup{options['lookup_branch']}" if options.get("lookup_branch") else "")
            rows.append(dict(method=name, temperature=temp, tau=r.tau,
                             verify_width=r.verify_width, new_tokens=r.new_tokens,
                             tok_s=r.tokens_per_second, decode_seconds=r.decode_seconds,
                             compile_seconds=r.compile_seconds))
            for kind in KINDS:                       # tau over the rows of one kind
                hist = r.accept_hist[[i for i, k in enumerate(kinds) if k == kind]].sum(0)
                rows[-1][f"tau_{kind}"] = float((hist * np.arange(len(hist))).sum()
                                                / max(hist.sum(), 1))
            print(f"T={temp} {name}: tau {r.tau:.2f} (verify width {r.verify_width}, "
                  f"{time.perf_counter() - t0:.0f} s)", flush=True)
            write()                                   # partial results survive a time-out
    print(write(), flush=True)


if __name__ == "__main__":
    main()
