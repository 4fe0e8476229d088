"""Which prompt-lookup settings to ship: tau of every (max n, min n, occurrence, wrap, K) on
held-out chat / math / code prompts of the SmolLM2 demo target, and a device check.

The lookup is deterministic and verified by ``match``, so its rounds are a function of the
target's own continuation: at T = 0 the greedy AR output *is* what every lossless method
commits, and the lookup's acceptance in each round is the number of its drafts that equal
the next AR tokens. At T = 1 the same holds in distribution (``match`` accepts a draft iff
it equals the target's sample given the accepted prefix, so sampling the continuation first
and then checking the drafts gives the same joint law of tokens and rounds). One AR run per
temperature therefore prices the whole grid offline: ``lookup_drafts`` (the device matcher)
runs once per setting over every prefix of every row, and the rounds are walked on the
host exactly as the decode loop commits them (first token at prefill, ``accepted + 1`` per
round, a stop token ends the row inside its round, ``max_new_tokens`` may be overrun by the
last round). ``--device-check`` then runs ``method="ngram"`` with the chosen setting through
``generate`` and asserts that its per-row acceptance histogram at T = 0 equals the
simulated one.

    python benchmarks/ngram_smollm2.py [--per-kind 6] [--max-new-tokens 128] [--device-check]

Writes ``ngram_sweep_<date>.{json,md}`` into ``--out`` (default benchmarks/results).

``--round-cost SWEEP_JSON`` instead measures what a round costs on this device at batch 1:
milliseconds per round of AR (verify width 1) and of the lookup at every K (the round's
time does not depend on acceptance: static shapes), streamed chunks of ``--cost-rounds``
rounds on one held-out prompt, ``--repeats`` interleaved repeats; with the sweep's tau it
predicts the speedup ``tau(K) / c(K)`` (``c`` = the round's time in AR steps).
Writes ``ngram_cost_<date>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

KINDS = ("chat", "math", "code")
K_MAX = 16


def prompt_kind(text: str) -> str:
    """The kind of a prompt of ``domino_jax.train.data.build_prompts``."""
    if "```python" in text:
        return "code"
    if text.endswith("Solve it step by step."):
        return "math"
    return "chat"


def heldout_by_kind(per_kind: int, seed: int = 123) -> list[tuple[str, str]]:
    """``per_kind`` held-out prompts (never in a training split: ``is_eval_prompt``) of each
    kind, as ``(kind, text)`` in kind order."""
    from domino_jax.train.data import build_prompts, is_eval_prompt

    pool = [q for q in build_prompts(4000, seed=seed) if is_eval_prompt(q)]
    out = []
    for kind in KINDS:
        chosen = [q for q in pool if prompt_kind(q) == kind][:per_kind]
        if len(chosen) < per_kind:
            raise SystemExit(f"--per-kind {per_kind}: only {len(chosen)} held-out {kind} "
                             "prompts")
        out += [(kind, q) for q in chosen]
    return out


def settings_grid(max_ns, min_ns):
    """Matcher settings ``(max_ngram, min_ngram, occurrence, wrap)``."""
    return [(hi, lo, occ, wrap) for hi in max_ns for lo in min_ns if lo <= hi
            for occ in ("first", "latest") for wrap in (True, False)]


@functools.lru_cache(maxsize=None)
def _matcher(max_ngram, min_ngram, occurrence, wrap):
    import jax

    from domino_jax.decode.ngram import lookup_drafts

    return jax.jit(functools.partial(lookup_drafts, max_ngram=max_ngram, min_ngram=min_ngram,
                                     num_tokens=K_MAX, occurrence=occurrence, wrap=wrap))


def prefix_acceptance(setting, prompts, continuations, max_new):
    """``accepted [R, max_new]``: drafts of ``setting`` accepted in a round whose context is
    ``prompt + continuation[:c]`` (index ``c``, 1 <= c < max_new), with K = 16 (a smaller K
    accepts ``min(accepted, K)``: the first K drafts do not depend on K); ``matched
    [R, max_new]`` whether the round had a match."""
    import jax.numpy as jnp
    import numpy as np

    rows = len(prompts)
    width = max(len(p) + len(c) for p, c in zip(prompts, continuations))
    buffer = np.zeros((rows, width), np.int32)
    truth = np.full((rows, max_new + K_MAX), -1, np.int64)
    for i, (p, c) in enumerate(zip(prompts, continuations)):
        buffer[i, :len(p) + len(c)] = p + c
        truth[i, :min(len(c), max_new + K_MAX)] = c[:max_new + K_MAX]
    counts = np.arange(max_new)                                          # c
    lengths = np.array([[len(p) + c for c in counts] for p in prompts], np.int32)
    tiled = np.repeat(buffer[:, None, :], max_new, axis=1).reshape(rows * max_new, width)
    drafts, match_len, _ = _matcher(*setting)(jnp.asarray(tiled),
                                              jnp.asarray(lengths.reshape(-1)))
    drafts = np.asarray(drafts).reshape(rows, max_new, K_MAX)
    want = np.stack([truth[:, c:c + K_MAX] for c in counts], axis=1)     # [R, M, K]
    accepted = np.cumprod(drafts == want, axis=-1).sum(-1)
    return accepted, np.asarray(match_len).reshape(rows, max_new) > 0


def walk_rounds(accepted_at, matched_at, continuation, max_new, k, stop_ids):
    """Tokens committed per round for one row, as the decode loop commits them."""
    ends_with_stop = bool(continuation) and continuation[-1] in stop_ids
    end = len(continuation)
    commits, matches = [], 0
    c = 1                                         # the first token comes from prefill
    if ends_with_stop and end == 1:
        return commits, matches
    while c < max_new:
        count = min(int(accepted_at[c]), k) + 1
        matches += bool(matched_at[c])
        if ends_with_stop and c + count >= end:
            commits.append(end - c)
            break
        commits.append(count)
        c += count
    return commits, matches


def tau_of(commits) -> float:
    return sum(commits) / max(len(commits), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-kind", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--max-ngrams", default="1,2,3,4,5")
    p.add_argument("--min-ngrams", default="1,2,3")
    p.add_argument("--tokens", default="2,4,6,8,10,12,16", help="K values (<= 16)")
    p.add_argument("--device-check", action="store_true",
                   help="run method='ngram' with the chosen setting through generate and "
                        "check its acceptance against the simulation (T=0: exactly)")
    p.add_argument("--device-check-t0-only", action="store_true",
                   help="the device check at the first temperature only (the exact one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--round-cost", metavar="SWEEP_JSON", default=None,
                   help="measure ms per round (AR and every K) instead of sweeping")
    p.add_argument("--cost-rounds", type=int, default=8, help="rounds per timed chunk")
    p.add_argument("--cost-kind", default="chat", choices=KINDS,
                   help="the held-out prompt timed (one program per K)")
    p.add_argument("--cost-tokens", default=None, help="K values (default: the sweep's)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "results"))
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench_util import git_commit, versions
    from domino_jax.decode.loading import default_models, load_pair, load_tokenizer
    from domino_jax.decode.sampling import SamplingConfig
    from domino_jax.decode.speculative import DecodeConfig, generate
    from domino_jax.train.data import chat_ids, stop_ids_of

    t_start = time.perf_counter()
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    if args.round_cost:
        return round_cost(args, stamp, t_start)
    target_dir, _ = default_models(None, None)
    tokenizer = load_tokenizer(target_dir)
    target, tparams, _, _ = load_pair(target_dir, None, "ar", jnp.float32)
    stops = stop_ids_of(tokenizer, target.config)
    chosen = heldout_by_kind(args.per_kind)
    kinds = [k for k, _ in chosen]
    prompts = [chat_ids(tokenizer, q) for _, q in chosen]
    ks = [int(x) for x in args.tokens.split(",")]
    grid = settings_grid([int(x) for x in args.max_ngrams.split(",")],
                         [int(x) for x in args.min_ngrams.split(",")])
    meta = dict(date=stamp, commit=git_commit(None), versions=versions(),
                device=str(jax.devices()[0].device_kind), dtype="float32",
                target=os.path.basename(target_dir), per_kind=args.per_kind,
                max_new_tokens=args.max_new_tokens, seed=args.seed,
                prompt_lengths=dict(zip(KINDS, [
                    [len(x) for x, k in zip(prompts, kinds) if k == kind] for kind in KINDS])),
                load_average=os.getloadavg())
    rows, ar_runs = [], {}
    for temp in [float(t) for t in args.temperatures.split(",")]:
        t0 = time.perf_counter()
        config = DecodeConfig(method="ar", max_new_tokens=args.max_new_tokens + K_MAX,
                              sampling=SamplingConfig(temp), stop_token_ids=stops)
        ar = generate(target, tparams, prompts, config, seed=args.seed)
        ar_runs[temp] = ar
        print(f"T={temp:g}: AR {ar.new_tokens} tokens, {time.perf_counter() - t0:.0f} s "
              f"({ar.compile_seconds:.0f} s compile)", flush=True)
        for setting in grid:
            accepted, matched = prefix_acceptance(setting, prompts, ar.tokens,
                                                  args.max_new_tokens)
            for k in ks:
                per_row = [walk_rounds(accepted[i], matched[i], ar.tokens[i],
                                       args.max_new_tokens, k, stops)
                           for i in range(len(prompts))]
                row = dict(temperature=temp, max_ngram=setting[0], min_ngram=setting[1],
                           occurrence=setting[2], wrap=setting[3], tokens=k)
                for kind in KINDS + ("all",):
                    sel = [r for r, kd in zip(per_row, kinds) if kind in ("all", kd)]
                    commits = [c for r in sel for c in r[0]]
                    row[f"tau_{kind}"] = tau_of(commits)
                    row[f"match_rate_{kind}"] = sum(r[1] for r in sel) / max(len(commits), 1)
                row["tau_mean_of_kinds"] = float(np.mean([row[f"tau_{k}"] for k in KINDS]))
                row["hist"] = [np.bincount(r[0], minlength=K_MAX + 2).tolist() for r in per_row]
                rows.append(row)
        print(f"  grid of {len(grid)} settings x {len(ks)} K priced, "
              f"{time.perf_counter() - t0:.0f} s", flush=True)

    best = pick_defaults(rows)
    meta["chosen"] = best
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"ngram_sweep_{stamp}")

    def write(checks) -> str:
        meta["seconds"] = time.perf_counter() - t_start
        kept = [r if all(r[k] == v for k, v in best.items() if k != "tokens")
                else {k: v for k, v in r.items() if k != "hist"} for r in rows]
        with open(base + ".json", "w") as f:     # per-row histograms: chosen setting only
            json.dump(dict(meta=meta, rows=kept, device_checks=checks), f, indent=1)
        text = markdown(meta, rows, checks, ks)
        with open(base + ".md", "w") as f:
            f.write(text)
        return text

    write([])                                    # the sweep survives a slow device check
    checks = []
    if args.device_check:
        checks = device_check(best, target, tparams, prompts, kinds, stops, rows, ar_runs,
                              args, write)
    print(write(checks), flush=True)


def round_cost(args, stamp, t_start) -> None:
    """``--round-cost``: ms per round at batch 1 for AR and the lookup at each K."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench_util import git_commit, versions
    from domino_jax.decode.loading import default_models, load_pair, load_tokenizer
    from domino_jax.decode.ngram import NgramDrafter, NgramOptions
    from domino_jax.decode.speculative import DecodeConfig, generate
    from domino_jax.train.data import chat_ids

    with open(args.round_cost) as f:
        sweep = json.load(f)
    best = sweep["meta"]["chosen"]
    ks = sorted({r["tokens"] for r in sweep["rows"]})
    target_dir, _ = default_models(None, None)
    tokenizer = load_tokenizer(target_dir)
    target, tparams, _, _ = load_pair(target_dir, None, "ar", jnp.float32)
    kind, text = next(x for x in heldout_by_kind(1) if x[0] == args.cost_kind)
    prompts = {kind: chat_ids(tokenizer, text)}
    if args.cost_tokens:
        ks = [int(x) for x in args.cost_tokens.split(",")]
    chunk = args.cost_rounds
    runs = {}                         # k -> (config, drafter): at least 4 full chunks of rounds
    for k in [0] + ks:
        drafter = None if k == 0 else NgramDrafter(options=NgramOptions(
            max_ngram=best["max_ngram"], min_ngram=best["min_ngram"], num_tokens=k,
            occurrence=best["occurrence"], wrap=best["wrap"]))
        # no stop token, so every chunk but the last runs exactly `chunk` rounds
        runs[k] = (DecodeConfig(method="ar" if k == 0 else "ngram",
                                max_new_tokens=1 + 4 * chunk * (k + 1)), drafter)

    def timed(k):
        """Wall and process-CPU seconds of the 2nd and 3rd chunk of ``chunk`` rounds (one
        host sync each, no prefill, no compile)."""
        config, drafter = runs[k]
        marks = []
        generate(target, tparams, [prompts[kind]], config, drafter, chunk_rounds=chunk,
                 on_chunk=lambda _: marks.append((time.perf_counter(), time.process_time())))
        return [((w1 - w0) / chunk, (c1 - c0) / chunk)
                for (w0, c0), (w1, c1) in zip(marks[1:3], marks[2:4])]

    for k in runs:                                                 # compile everything
        timed(k)
    samples = {k: [] for k in runs}
    for _ in range(args.repeats):                 # interleaved: load drifts hit all alike
        for k in runs:
            samples[k] += timed(k)
    entries = []
    for k in runs:
        wall_ms = 1e3 * float(np.median([w for w, _ in samples[k]]))
        cpu_ms = 1e3 * float(np.median([c for _, c in samples[k]]))
        entries.append(dict(tokens=k, verify_width=k + 1, kind=kind, ms_per_round=wall_ms,
                            cpu_ms_per_round=cpu_ms, samples=samples[k]))
        print(f"K={k} {kind}: {wall_ms:.1f} ms/round wall, {cpu_ms:.1f} ms CPU", flush=True)
    ar = {e["kind"]: e for e in entries if e["tokens"] == 0}
    lines = ["# Round cost at batch 1 and predicted lookup speedup, SmolLM2-135M, float32",
             "", f"{stamp}, commit {git_commit(None)}, {jax.devices()[0].device_kind}, jax "
             f"{versions().get('jax')}, load average {os.getloadavg()[0]:.1f}. Per round: the "
             f"median over {args.repeats} interleaved repeats x 2 chunks of "
             f"{args.cost_rounds} rounds (streamed: one host sync per chunk, no prefill), wall "
             "and process CPU time (CPU time is what a busy shared machine distorts least; "
             "one held-out prompt). c = the round's time in AR "
             "steps; predicted speedup = tau / c (CPU c), tau from "
             f"`{os.path.basename(args.round_cost)}` (chosen matcher setting).", "",
             "| K | verify width | kind | ms wall | c wall | ms CPU | c CPU | tau T=0 | "
             "speedup T=0 | tau T=1 | speedup T=1 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        k, kind = e["tokens"], e["kind"]
        c_wall = e["ms_per_round"] / ar[kind]["ms_per_round"]
        c_cpu = e["cpu_ms_per_round"] / ar[kind]["cpu_ms_per_round"]
        cells = []
        for temp in (0.0, 1.0):
            row = next((r for r in sweep["rows"] if r["temperature"] == temp and
                        r["tokens"] == k and all(r[f] == best[f] for f in
                                                 ("max_ngram", "min_ngram", "occurrence",
                                                  "wrap"))), None)
            tau = 1.0 if k == 0 else (row[f"tau_{kind}"] if row else None)
            cells += ([f"{tau:.2f}", f"{tau / c_cpu:.2f}x"] if tau else ["-", "-"])
        lines.append(f"| {k or 'AR'} | {k + 1} | {kind} | {e['ms_per_round']:.1f} | "
                     f"{c_wall:.2f} | {e['cpu_ms_per_round']:.1f} | {c_cpu:.2f} | "
                     + " | ".join(cells) + " |")
    lines += ["", f"{time.perf_counter() - t_start:.0f} s.", ""]
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"ngram_cost_{stamp}")
    with open(base + ".json", "w") as f:
        json.dump(dict(meta=dict(date=stamp, commit=git_commit(None), versions=versions(),
                                 device=str(jax.devices()[0].device_kind), sweep=args.round_cost,
                                 chosen=best, load_average=os.getloadavg()),
                       entries=entries), f, indent=1)
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines), flush=True)


def pick_defaults(rows) -> dict:
    """The setting with the highest T=0 tau (mean over kinds, so each kind weighs the same)
    at K = 10 (transformers' default), ties to the smaller n; T = 1 reported beside."""
    at = [r for r in rows if r["temperature"] == 0.0 and r["tokens"] == 10] or \
        [r for r in rows if r["temperature"] == 0.0]
    top = max(at, key=lambda r: (round(r["tau_mean_of_kinds"], 6), -r["max_ngram"],
                                 -r["min_ngram"]))
    return {k: top[k] for k in ("max_ngram", "min_ngram", "occurrence", "wrap", "tokens")}


def device_check(best, target, tparams, prompts, kinds, stops, rows, ar_runs, args, write):
    """``generate(method="ngram")`` with ``best``: per-row histogram == the simulation (T=0)."""
    import numpy as np

    from domino_jax.decode.ngram import NgramDrafter, NgramOptions
    from domino_jax.decode.sampling import SamplingConfig
    from domino_jax.decode.speculative import DecodeConfig, generate

    drafter = NgramDrafter(options=NgramOptions(
        max_ngram=best["max_ngram"], min_ngram=best["min_ngram"], num_tokens=best["tokens"],
        occurrence=best["occurrence"], wrap=best["wrap"]))
    out = []
    for temp in sorted(ar_runs)[:1 if args.device_check_t0_only else None]:
        config = DecodeConfig(method="ngram", max_new_tokens=args.max_new_tokens,
                              sampling=SamplingConfig(temp), stop_token_ids=stops)
        t0 = time.perf_counter()
        result = generate(target, tparams, prompts, config, drafter, seed=args.seed)
        sim = next(r for r in rows if r["temperature"] == temp and all(
            r[k] == v for k, v in best.items()))
        hist = result.accept_hist
        simulated = np.array([h[:hist.shape[1]] for h in sim["hist"]])
        entry = dict(temperature=temp, tau_device=result.tau, tau_simulated=sim["tau_all"],
                     seconds=time.perf_counter() - t0)
        if temp == 0.0:
            entry["outputs_equal_ar"] = [a[:args.max_new_tokens] == b for a, b in
                                         zip(ar_runs[temp].tokens, result.tokens)]
            entry["hist_equal"] = bool((hist == simulated).all())
            if not entry["hist_equal"] or not all(entry["outputs_equal_ar"]):
                raise SystemExit(f"device check failed: {entry}")
        out.append(entry)
        write(out)
        print(f"device check T={temp:g}: tau {result.tau:.3f} (simulated "
              f"{sim['tau_all']:.3f}) {entry['seconds']:.0f} s", flush=True)
    return out


def markdown(meta, rows, checks, ks) -> str:
    best = meta["chosen"]
    temps = sorted({r["temperature"] for r in rows})
    lines = [f"# Prompt lookup on held-out prompts: SmolLM2-135M-Instruct, float32, "
             f"{meta['per_kind']} prompts per kind, {meta['max_new_tokens']} new tokens",
             "", f"{meta['date']}, commit {meta['commit']}, {meta['device']}, jax "
             f"{meta['versions'].get('jax')}, load average {meta['load_average'][0]:.1f}; "
             f"{meta['seconds']:.0f} s. tau = tokens committed per round (acceptance + 1), "
             "from AR outputs (see the script's docstring). `mean` = mean over kinds.", "",
             f"**Chosen**: max n {best['max_ngram']}, min n {best['min_ngram']}, "
             f"{best['occurrence']} occurrence, wrap {best['wrap']}, K {best['tokens']} "
             "(highest T=0 mean tau at K = 10).", ""]
    for temp in temps:
        lines += [f"## T={temp:g}, K = 10: every matcher setting", "",
                  "| max n | min n | occurrence | wrap | tau chat | tau math | tau code | "
                  "tau mean | match rate |", "|---|---|---|---|---|---|---|---|---|"]
        for r in sorted((r for r in rows if r["temperature"] == temp and r["tokens"] == 10),
                        key=lambda r: -r["tau_mean_of_kinds"]):
            lines.append(f"| {r['max_ngram']} | {r['min_ngram']} | {r['occurrence']} | "
                         f"{r['wrap']} | {r['tau_chat']:.2f} | {r['tau_math']:.2f} | "
                         f"{r['tau_code']:.2f} | {r['tau_mean_of_kinds']:.3f} | "
                         f"{r['match_rate_all']:.2f} |")
        lines.append("")
    for temp in temps:
        lines += [f"## T={temp:g}: tau against K (chosen matcher setting)", "",
                  "| K | verify width | tau chat | tau math | tau code | tau mean | "
                  "tau first occurrence (mean) |", "|---|---|---|---|---|---|---|"]
        for k in ks:
            pick = lambda occ: next(r for r in rows if r["temperature"] == temp and  # noqa
                                    r["tokens"] == k and r["occurrence"] == occ and all(
                                        r[f] == best[f] for f in ("max_ngram", "min_ngram",
                                                                  "wrap")))
            r, first = pick(best["occurrence"]), pick("first")
            lines.append(f"| {k} | {k + 1} | {r['tau_chat']:.2f} | {r['tau_math']:.2f} | "
                         f"{r['tau_code']:.2f} | {r['tau_mean_of_kinds']:.3f} | "
                         f"{first['tau_mean_of_kinds']:.3f} |")
        lines.append("")
    if checks:
        lines += ["## Device check (`generate(method='ngram')`, chosen setting)", "",
                  "| T | tau device | tau simulated | histogram equal | outputs equal AR |",
                  "|---|---|---|---|---|"]
        for c in checks:
            lines.append(f"| {c['temperature']:g} | {c['tau_device']:.3f} | "
                         f"{c['tau_simulated']:.3f} | {c.get('hist_equal', '-')} | "
                         + (f"{sum(c['outputs_equal_ar'])}/{len(c['outputs_equal_ar'])} |"
                            if "outputs_equal_ar" in c else "- (T > 0) |"))
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
