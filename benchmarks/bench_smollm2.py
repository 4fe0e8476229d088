"""Real-model speed at batch 1: SmolLM2-135M-Instruct target + our trained Domino drafter.

For each temperature in ``--temperatures``, runs our jitted AR baseline and every method in
``--methods`` on the same held-out prompts (never in the training split,
``domino_jax.train.data.is_eval_prompt``): the chain methods ``dflash`` (the Domino
checkpoint's base logits) and ``domino``, and the tree methods ``ddtree`` and
``dominotree`` at every tree budget in ``--budgets``. Each (temperature, method, budget)
task makes one warm-up call (compile excluded), then generates for each prompt one at a
time (batch 1) and reports:

* tau: mean tokens committed per round (accepted drafts + bonus), from ``accept_hist``;
* tok/s: decode tokens (after the prefill's first one) over ``decode_seconds``;
* speedup over AR at the same temperature and the round cost ``c = tau / speedup``
  (one round's time in AR steps);
* verify width: tokens the target verifies per round;
* at T = 0, whether every output is identical to AR's (it must be: lossless decoding).

The target is loaded once; each method's drafter is built on the same draft weights.
Tasks run temperature by temperature (AR first); past ``--time-budget-s`` seconds from the
start (loading included) no new task starts, and the skipped ones are listed. The JSON and
Markdown are rewritten after every task, so a killed run leaves partial results.

    python benchmarks/bench_smollm2.py [--prompts 16] [--max-new-tokens 256] \\
        [--methods ar,dflash,domino,ddtree,dominotree] [--budgets 8,16,32,64] \\
        [--temperatures 0,1] [--time-budget-s 540] [--out DIR]

Writes ``smollm2_<date>.json`` and ``.md`` into ``--out`` (default ``$OUT`` or
``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
TREE_METHODS = ("ddtree", "dominotree")


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def measure(target, tparams, drafter, dparams, config, ids) -> dict:
    """Warm-up, then one prompt at a time: tokens/s, tau, verify width and the outputs."""
    from domino_jax.decode.speculative import generate

    t0 = time.perf_counter()
    warm = generate(target, tparams, [ids[0]], config, drafter, dparams, seed=0)  # warm-up
    compile_s = warm.compile_seconds
    tokens, seconds, rounds, committed, outputs = 0, 0.0, 0, 0, []
    for i, prompt in enumerate(ids):
        r = generate(target, tparams, [prompt], config, drafter, dparams, seed=i)
        tokens += r.new_tokens - 1              # the first token comes from prefill
        seconds += r.decode_seconds
        compile_s += r.compile_seconds          # 0 unless a prompt needed a new program
        hist = r.accept_hist.sum(0)
        rounds += int(hist.sum())
        committed += int((hist * range(len(hist))).sum())
        outputs.append(r.tokens[0])
    return dict(tokens=tokens, seconds=seconds, tau=committed / max(rounds, 1),
                tokens_per_second=tokens / max(seconds, 1e-9), verify_width=r.verify_width,
                outputs=outputs, compile_seconds=compile_s,
                task_seconds=time.perf_counter() - t0)


def markdown(meta: dict, rows: list[dict]) -> str:
    fmt = lambda v, spec, suffix="": "-" if v is None else f"{v:{spec}}{suffix}"
    lines = [f"# SmolLM2-135M-Instruct + trained Domino drafter, batch 1 ({meta['device']}, "
             f"commit {meta['commit'][:12]}, {meta['date']})", "",
             f"{meta['prompts']} held-out prompts, max_new_tokens {meta['max_new_tokens']}, "
             f"jax {meta['jax']}.", "",
             "| T | method | budget | verify width | tau | tok/s | speedup vs AR | c | "
             "prompts identical to AR (T=0) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        same = ("-" if r["identical_to_ar"] is None else
                f"{r['prompts_identical_to_ar']}/{meta['prompts']} (first difference at token "
                f"{r['first_difference']})" if not r["identical_to_ar"] else "all")
        lines.append(f"| {r['temperature']:g} | {r['method']} | {fmt(r['budget'], 'd')} | "
                     f"{r['verify_width']} | {r['tau']:.2f} | {r['tokens_per_second']:.1f} | "
                     f"{fmt(r['speedup'], '.2f', 'x')} | {fmt(r['round_cost_c'], '.2f')} | "
                     f"{same} |")
    if meta["skipped"]:
        lines += ["", f"Not run (time budget {meta['time_budget_s']:g} s): "
                  + ", ".join(meta["skipped"]) + "."]
    return "\n".join(lines)


def main() -> None:
    t_start = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--methods", default="ar,dflash,domino,ddtree,dominotree")
    p.add_argument("--budgets", default="8,16,32,64", help="tree budgets (tree methods)")
    p.add_argument("--time-budget-s", type=float, default=540.0,
                   help="start no new (temperature, method) task past this many seconds")
    p.add_argument("--git-commit", default=None, help="default: git rev-parse HEAD")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "benchmarks",
                                                                          "results"))
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from domino_jax.decode.loading import (default_models, load_pair, load_tokenizer,
                                           make_drafter)
    from domino_jax.decode.sampling import SamplingConfig
    from domino_jax.decode.speculative import DecodeConfig, prompt_bucket
    from domino_jax.train.data import build_prompts, chat_ids, is_eval_prompt, stop_ids_of

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    budgets = [int(b) for b in args.budgets.split(",")]
    tasks = [(m, None) for m in methods if m not in TREE_METHODS]
    tasks += [(m, b) for b in budgets for m in methods if m in TREE_METHODS]
    target_dir, draft_dir = default_models(args.target, args.draft)
    if draft_dir is None and any(m != "ar" for m in methods):
        raise SystemExit("no drafter found: pass --draft DIR or --methods ar")
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    # One load: "dflash" fits any DFlash/Domino checkpoint; the other drafters share its
    # config and weights.
    target, tparams, base, dparams = load_pair(target_dir, draft_dir, "dflash", dtype)

    def drafter_for(method: str, budget: int | None):
        options = {} if budget is None else dict(budget=budget)
        return None if method == "ar" else make_drafter(base.config, target, method, **options)

    tokenizer = load_tokenizer(target_dir)
    # held-out prompts whose chat length falls in one padding bucket: one compiled program
    # per task instead of one per bucket (the bench's wall time is mostly compilation)
    pool = [q for q in build_prompts(4000, seed=123) if is_eval_prompt(q)]
    pool_ids = [chat_ids(tokenizer, q) for q in pool[:8 * args.prompts]]
    buckets = [prompt_bucket(len(x)) for x in pool_ids]
    common = max(set(buckets), key=buckets.count)
    chosen = [i for i, b in enumerate(buckets) if b == common][:args.prompts]
    prompts, ids = [pool[i] for i in chosen], [pool_ids[i] for i in chosen]
    stops = stop_ids_of(tokenizer, target.config)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    meta = dict(date=stamp, commit=args.git_commit or git_commit(),
                device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                prompts=len(ids), prompt_bucket=common, max_new_tokens=args.max_new_tokens,
                batch=1,
                time_budget_s=args.time_budget_s, target=target_dir, draft=draft_dir,
                prompt_texts=prompts, skipped=[])
    print(f"{len(ids)} held-out prompts; backend {jax.default_backend()}; draft {draft_dir}; "
          f"{len(tasks)} tasks per temperature, T in {args.temperatures}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    rows = []

    def write() -> str:
        with open(os.path.join(args.out, f"smollm2_{stamp}.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=2)
        text = markdown(meta, rows)
        with open(os.path.join(args.out, f"smollm2_{stamp}.md"), "w") as f:
            f.write(text + "\n")
        return text

    for temp in [float(t) for t in args.temperatures.split(",")]:
        ar = None                                   # AR's measurement at this temperature
        for method, budget in tasks:
            name = method + (f"@{budget}" if budget is not None else "")
            if time.perf_counter() - t_start > args.time_budget_s:
                meta["skipped"].append(f"T={temp:g} {name}")
                continue
            config = DecodeConfig(method=method, max_new_tokens=args.max_new_tokens,
                                  sampling=SamplingConfig(temp), stop_token_ids=stops)
            drafter = drafter_for(method, budget)
            m = measure(target, tparams, drafter, dparams if drafter else None, config, ids)
            if method == "ar":
                ar = m
            speedup = m["tokens_per_second"] / ar["tokens_per_second"] if ar else None
            compare = temp == 0 and ar and method != "ar"
            same = [a == b for a, b in zip(m["outputs"], ar["outputs"])] if compare else []
            # bf16: a near-tie argmax can flip between a wide verify and a 1-token AR step
            first_diff = min((next(i for i, (x, y) in enumerate(zip(a + [None], b + [None]))
                                   if x != y) for a, b in zip(m["outputs"], ar["outputs"])
                              if a != b), default=None) if compare else None
            rows.append(dict(temperature=temp, method=method, budget=budget,
                             verify_width=m["verify_width"], tau=m["tau"], tokens=m["tokens"],
                             decode_seconds=m["seconds"], compile_seconds=m["compile_seconds"],
                             task_seconds=m["task_seconds"],
                             tokens_per_second=m["tokens_per_second"],
                             ms_per_token=1e3 / max(m["tokens_per_second"], 1e-9),
                             speedup=speedup, round_cost_c=m["tau"] / speedup if speedup else None,
                             identical_to_ar=all(same) if compare else None,
                             prompts_identical_to_ar=sum(same) if compare else None,
                             first_difference=first_diff))
            print(f"T={temp:g} {name}: tau {m['tau']:.2f}, {m['tokens_per_second']:.1f} tok/s"
                  + (f", {speedup:.2f}x AR" if speedup else "")
                  + f" (compile {m['compile_seconds']:.0f} s of {m['task_seconds']:.0f} s; "
                  f"{time.perf_counter() - t_start:.0f} s elapsed)", flush=True)
            write()                                 # partial results survive a kill
    print(write(), flush=True)


if __name__ == "__main__":
    main()
