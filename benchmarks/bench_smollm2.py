"""Real-model speed at batch 1: SmolLM2-135M-Instruct target + our trained Domino drafter.

For each temperature in ``--temperatures``, runs our jitted AR baseline and every method in
``--methods`` on the same held-out prompts (never in the training split,
``domino_jax.train.data.is_eval_prompt``): the prompt lookup ``ngram`` (no drafter, the
CLI's default settings: the floor a drafter must beat), the chain methods ``dflash`` (the Domino
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

Compilation (~40 s per task on the H200, against ~1 s of decoding) happens first, for every
task at once: ``--compile-threads N`` threads (default ``min(8, cpu_count)``; 1 = one after
another) each AOT-compile a task's programs (``speculative.precompile``) on the first prompt,
whose padding bucket every prompt shares, so no timed call compiles. Tasks are taken in the
timing loop's order (temperature by temperature, AR first). Then the timing loop runs the
tasks in that order.

Time budget, ``--time-budget-s`` seconds from the start (loading included): the precompile
phase starts no compile past ``--time-budget-s`` minus ``--timing-reserve-s`` (kept for the
timing loop; in-flight compiles finish), and the timing loop starts no task past
``--time-budget-s``. Tasks cut by either are not run and are listed in ``meta["skipped"]``
(and ``meta["precompile"]["not_compiled"]`` for the first kind). The JSON and Markdown are
rewritten after every task, so a killed run leaves partial results.

    python benchmarks/bench_smollm2.py [--prompts 16] [--max-new-tokens 256] \\
        [--methods ar,ngram,dflash,domino,ddtree,dominotree] [--budgets 8,16,32,64] \\
        [--temperatures 0,1] [--compile-threads 8] [--time-budget-s 540] \\
        [--timing-reserve-s 90] [--out DIR]

Writes ``smollm2_<date>.json`` and ``.md`` into ``--out`` (default ``$OUT`` or
``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
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
    """Warm-up, then one prompt at a time: tokens/s, tau, verify width and the outputs.
    ``compile_seconds``: compiles inside this call (0 when :func:`precompile_all` ran)."""
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


def precompile_all(jobs: list, threads: int, deadline_s: float, t_start: float,
                   log=print) -> tuple[dict, list, float]:
    """Compile every job's programs, ``threads`` at a time, in the order given.

    ``jobs``: ``[(name, fn)]`` where ``fn()`` compiles and returns its compile seconds
    (``speculative.precompile``). A job not started by ``deadline_s`` seconds after
    ``t_start`` is not run. Returns ``({name: seconds}, [names not compiled], wall seconds)``.
    An exception in a job cancels the jobs not yet started and is re-raised.
    """
    t0 = time.perf_counter()

    def run(fn):
        if time.perf_counter() - t_start > deadline_s:
            return None                             # past the deadline: not started
        return fn()

    seconds, not_compiled = {}, []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(threads, 1),
                                                 thread_name_prefix="precompile")
    try:
        futures = {pool.submit(run, fn): name for name, fn in jobs}   # FIFO: in job order
        for future in concurrent.futures.as_completed(futures):
            name, s = futures[future], future.result()
            if s is None:
                not_compiled.append(name)
                continue
            seconds[name] = s
            log(f"compiled {name} in {s:.1f} s ({len(seconds)}/{len(jobs)}, "
                f"{time.perf_counter() - t0:.0f} s into the precompile phase)")
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    order = [name for name, _ in jobs]
    return ({n: seconds[n] for n in order if n in seconds},
            sorted(not_compiled, key=order.index), time.perf_counter() - t0)


def markdown(meta: dict, rows: list[dict]) -> str:
    fmt = lambda v, spec, suffix="": "-" if v is None else f"{v:{spec}}{suffix}"
    pre = meta["precompile"]
    lines = [f"# SmolLM2-135M-Instruct + trained Domino drafter, batch 1 ({meta['device']}, "
             f"commit {meta['commit'][:12]}, {meta['date']})", "",
             f"{meta['prompts']} held-out prompts, max_new_tokens {meta['max_new_tokens']}, "
             f"jax {meta['jax']}.", "",
             f"Compiled {len(pre['seconds'])} tasks up front in {pre['wall_s']:.0f} s wall "
             f"with {pre['threads']} threads (per-task compile times sum to "
             f"{sum(pre['seconds'].values()):.0f} s).", "",
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
    p.add_argument("--methods", default="ar,ngram,dflash,domino,ddtree,dominotree")
    p.add_argument("--budgets", default="8,16,32,64", help="tree budgets (tree methods)")
    p.add_argument("--compile-threads", type=int, default=min(8, os.cpu_count() or 1),
                   help="threads compiling the tasks up front (1: one after another)")
    p.add_argument("--time-budget-s", type=float, default=540.0,
                   help="start no new task past this many seconds (loading included)")
    p.add_argument("--timing-reserve-s", type=float, default=90.0,
                   help="seconds of --time-budget-s kept for the timing loop: no compile "
                        "starts past time-budget-s minus this")
    p.add_argument("--git-commit", default=None, help="default: git rev-parse HEAD")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "benchmarks",
                                                                          "results"))
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from domino_jax.decode.loading import default_models, load_pair
    from domino_jax.decode.methods import make_drafter, method_options
    from domino_jax.decode.sampling import SamplingConfig
    from domino_jax.decode.speculative import DecodeConfig, precompile, prompt_bucket
    from domino_jax.models.domino_head import decode_head
    from domino_jax.text import encode_prompt, load_tokenizer, stop_token_ids
    from domino_jax.train.data import build_prompts, is_eval_prompt

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    budgets = [int(b) for b in args.budgets.split(",")]
    tasks = [(m, None) for m in methods if m not in TREE_METHODS]
    tasks += [(m, b) for b in budgets for m in methods if m in TREE_METHODS]
    target_dir, draft_dir = default_models(args.target, args.draft)
    if draft_dir is None and any(m not in ("ar", "ngram") for m in methods):
        raise SystemExit("no drafter found: pass --draft DIR or --methods ar,ngram")
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    # One load: "dflash" fits any DFlash/Domino checkpoint; the other drafters share its
    # config and weights.
    target, tparams, base, dparams = load_pair(target_dir, draft_dir,
                                               "dflash" if draft_dir else "ar", dtype)
    if dparams is not None and "head" in dparams:
        # the head's decode layout, as load_pair gives the head methods
        dparams = dict(dparams, head=decode_head(
            dparams["head"], tparams["embed_tokens"]["embedding"]))
    draft_config = getattr(base, "config", None)         # None: no checkpoint (ar, ngram)

    def drafter_for(method: str, budget: int | None):
        if method == "ar":
            return None
        options = method_options(method, **({} if budget is None else dict(budget=budget)))
        return make_drafter(draft_config, target, method, options)

    def params_for(drafter):
        return dparams if drafter is not None and drafter.needs_checkpoint else None

    tokenizer = load_tokenizer(target_dir)
    # held-out prompts whose chat length falls in one padding bucket: one compiled program
    # per task instead of one per bucket (the bench's wall time is mostly compilation)
    pool = [q for q in build_prompts(4000, seed=123) if is_eval_prompt(q)]
    pool_ids = [encode_prompt(tokenizer, q) for q in pool[:8 * args.prompts]]
    buckets = [prompt_bucket(len(x)) for x in pool_ids]
    common = max(set(buckets), key=buckets.count)
    chosen = [i for i, b in enumerate(buckets) if b == common][:args.prompts]
    prompts, ids = [pool[i] for i in chosen], [pool_ids[i] for i in chosen]
    stops = stop_token_ids(tokenizer, target.config)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    meta = dict(date=stamp, commit=args.git_commit or git_commit(),
                device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                prompts=len(ids), prompt_bucket=common, max_new_tokens=args.max_new_tokens,
                batch=1,
                time_budget_s=args.time_budget_s, timing_reserve_s=args.timing_reserve_s,
                target=target_dir, draft=draft_dir, prompt_texts=prompts, skipped=[])
    print(f"{len(ids)} held-out prompts; backend {jax.default_backend()}; draft {draft_dir}; "
          f"{len(tasks)} tasks per temperature, T in {args.temperatures}", flush=True)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    # every (temperature, method, budget) in the timing loop's (priority) order
    runs = [(temp, method, budget) for temp in temperatures for method, budget in tasks]
    name_of = lambda temp, method, budget: (f"T={temp:g} {method}"
                                            + (f"@{budget}" if budget is not None else ""))

    def config_for(temp: float, method: str) -> DecodeConfig:
        return DecodeConfig(method=method, max_new_tokens=args.max_new_tokens,
                            sampling=SamplingConfig(temp), stop_token_ids=stops)

    def compile_job(temp, method, budget):
        drafter = drafter_for(method, budget)
        # measure()'s warm-up prompt; every prompt pads to the same bucket, so one program
        return lambda: precompile(target, tparams, [ids[0]], config_for(temp, method), drafter,
                                  params_for(drafter))

    os.makedirs(args.out, exist_ok=True)
    rows = []

    def write() -> str:
        with open(os.path.join(args.out, f"smollm2_{stamp}.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=2)
        text = markdown(meta, rows)
        with open(os.path.join(args.out, f"smollm2_{stamp}.md"), "w") as f:
            f.write(text + "\n")
        return text

    print(f"precompiling {len(runs)} tasks in {args.compile_threads} threads", flush=True)
    compiled, not_compiled, pre_wall = precompile_all(
        [(name_of(*r), compile_job(*r)) for r in runs], args.compile_threads,
        args.time_budget_s - args.timing_reserve_s, t_start,
        log=lambda line: print(line, flush=True))
    meta["precompile"] = dict(threads=args.compile_threads, wall_s=pre_wall, seconds=compiled,
                              not_compiled=not_compiled)
    meta["skipped"] += not_compiled
    print(f"precompile: {len(compiled)} tasks in {pre_wall:.1f} s wall with "
          f"{args.compile_threads} threads (per-task compile times sum to "
          f"{sum(compiled.values()):.1f} s)"
          + (f"; not compiled (time budget): {', '.join(not_compiled)}" if not_compiled else ""),
          flush=True)
    write()
    for temp in temperatures:
        ar = None                                   # AR's measurement at this temperature
        for method, budget in tasks:
            name = name_of(temp, method, budget)
            if name not in compiled:                # already listed as skipped
                continue
            if time.perf_counter() - t_start > args.time_budget_s:
                meta["skipped"].append(name)
                continue
            config = config_for(temp, method)
            drafter = drafter_for(method, budget)
            m = measure(target, tparams, drafter, params_for(drafter), config, ids)
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
                             decode_seconds=m["seconds"],
                             # up front (concurrent with other tasks' compiles) + any in
                             # measure (0 unless a prompt needed another program)
                             compile_seconds=compiled[name] + m["compile_seconds"],
                             task_seconds=m["task_seconds"],
                             tokens_per_second=m["tokens_per_second"],
                             ms_per_token=1e3 / max(m["tokens_per_second"], 1e-9),
                             speedup=speedup, round_cost_c=m["tau"] / speedup if speedup else None,
                             identical_to_ar=all(same) if compare else None,
                             prompts_identical_to_ar=sum(same) if compare else None,
                             first_difference=first_diff))
            print(f"{name}: tau {m['tau']:.2f}, {m['tokens_per_second']:.1f} tok/s"
                  + (f", {speedup:.2f}x AR" if speedup else "")
                  + f" (timing {m['task_seconds']:.1f} s, of which compile "
                  f"{m['compile_seconds']:.1f} s; compiled up front in {compiled[name]:.1f} s; "
                  f"{time.perf_counter() - t_start:.0f} s elapsed)", flush=True)
            write()                                 # partial results survive a kill
    print(write(), flush=True)


if __name__ == "__main__":
    main()
