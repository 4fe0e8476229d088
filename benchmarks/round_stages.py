"""Where a fixed-width Domino round's time goes, stage by stage, at any batch (issue 17).

The round (``decode/round.py``) is draft -> verify -> commit; ``draft`` is the backbone over
the block (:meth:`BlockDrafter.block_hidden`), the target's LM head over the ``k`` draft
rows and the head's rollout. This script jits each piece alone on the same post-prefill
state (models as ``bench_batch_sweep.py``: ``--mode forced`` random weights at ``--shape``,
``--mode real`` the SmolLM2 demo pair) and times it, beside the whole round
(``rounds_fn`` over ``--rounds`` rounds) and a plain AR step:

* ``backbone``: the drafter layers over ``[context rows, root, MASK x 15]``;
* ``lm_head``: the target LM head over the ``k`` draft hiddens (``[B, k, V]`` float32);
* ``rollout``: the Domino head's ``k`` causal steps (drafts from base logits + corrections);
* ``verify_forward``: the target over ``k + 1`` rows with the KV cache; ``accept``: the
  verification rule on its logits; ``commit``: outputs, cache advance, next context;
* ``round``: one whole round (the loop's ms per round); ``sum`` of the stages against it
  shows what the loop adds (or what XLA overlaps); ``ar``: a plain AR round.

Each piece is a separate jitted call timed ``--reps`` times after a warm-up (median, in ms;
``dispatch``: the median of an empty jitted call, the per-call floor in these numbers).
Beside the times, ``backbone_gflop`` / ``backbone_gflop_all_slots``: XLA's cost analysis of
the compiled backbone with its last layer over the ``k`` slots the drafts read (what
``block_hidden`` runs, ``DFlashBackbone(output_rows=...)``) and over the whole block.

``--trim-block`` also times each ``k`` with ``BlockOptions.trim_block`` (rows ``Kt``: the
backbone over ``[root, MASK x k]`` only). ``--profile DIR`` traces one whole-round call
(``--rounds`` rounds) and ``--rounds`` backbone calls per row (``jax.profiler``, perfetto JSON
under ``DIR/<row>/round`` and ``DIR/<row>/backbone``) and stores their summaries as
``profile`` / ``profile_backbone`` (``profile_decode.py``: device busy time and window, the top
kernels, and ``classes``: device us per round or call by kind of kernel). ``--from-traces DIR``
summarises such a folder again without running anything.

    python benchmarks/round_stages.py --mode forced --shape qwen3-8b --batch 32 --widths 2,4,8,16
    python benchmarks/round_stages.py --mode forced --shape qwen3-8b --batch 32 --widths 4 \
        --trim-block --profile /tmp/prof                                             # H200
    python benchmarks/round_stages.py --from-traces benchmarks/results/traces_2026-12-04_185315_b32
    python benchmarks/round_stages.py --mode forced --shape tiny --batch 2 --widths 2   # CPU smoke
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("real", "forced"), default="forced")
    p.add_argument("--shape", choices=("smollm2", "qwen3-8b", "tiny"), default="qwen3-8b")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--widths", default="2,4,8,16", help="draft lengths k to time")
    p.add_argument("--rounds", type=int, default=8, help="rounds per whole-round timing")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--trim-block", action="store_true",
                   help="also time each k with the block trimmed to the drafts (rows 'Kt')")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="trace one whole-round call and the backbone calls per row here; their "
                        "summaries into the JSON")
    p.add_argument("--from-traces", default=None, metavar="DIR",
                   help="no run: summarise the traces a --profile DIR run left (per --rounds)")
    p.add_argument("--out", default=None, help="write JSON (and .md beside it) here")
    return p.parse_args(argv)


def _timer(reps: int):
    import jax

    def median_ms(fn, *args):
        jax.block_until_ready(fn(*args))                    # compile + warm up
        ms = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            ms.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(ms)

    return median_ms


def stage_times(models, prompts, k: int, args, median_ms, trim_block: bool = False,
                profile_dir: str | None = None) -> dict:
    """Median ms of each stage of a fixed ``k``-draft Domino round at ``len(prompts)`` rows
    (``trim_block``: the backbone over the drafts' slots only); with ``profile_dir`` also
    ``profile`` / ``profile_backbone``: :func:`profiled` summaries of one whole-round call
    and of ``args.rounds`` backbone calls."""
    import jax

    from domino_jax.decode import round as round_lib
    from domino_jax.decode.speculative import DecodeConfig, _prepare

    new_tokens = args.rounds * (k + 1) + 2
    config = DecodeConfig(method="domino", max_new_tokens=new_tokens)
    drafter = models.make("domino", draft_length=k, trim_block=trim_block)
    prep = _prepare(models.target, models.tp, prompts, config, drafter, models.dp, 0)
    state = prep.prefill_fn(models.tp, models.dp, prep.prompt, prep.prompt_len, prep.key)
    tp, dp, target = models.tp, models.dp, models.target
    key = jax.random.PRNGKey(0)

    backbone = jax.jit(lambda tp, dp, s: drafter.block_hidden(
        tp, dp, s.root, s.target_cache.lengths, s.context, s.context_len, s.draft_cache))
    hidden, _ = backbone(tp, dp, state)
    lm_head = jax.jit(drafter.lm_head)
    base = lm_head(tp, hidden)
    rollout = jax.jit(lambda tp, dp, h, b, root, key: drafter.rollout(
        tp, dp, h, b, root, key, config)[0])
    draft = jax.jit(lambda tp, dp, s, key: round_lib.draft(drafter, config, tp, dp, s, key))
    proposal = draft(tp, dp, state, key)
    vforward = jax.jit(lambda tp, s, p: round_lib.verify_forward(target, drafter, tp, s, p))
    out = vforward(tp, state, proposal)
    accept = jax.jit(lambda p, o, key: round_lib.accept(drafter, config, p, o, key))
    verdict = accept(proposal, out, key)
    commit = jax.jit(lambda s, v, key: round_lib.commit(drafter, config, s, v, key))
    verified = round_lib.Verified(verdict, proposal, out)

    times = {
        "backbone": median_ms(backbone, tp, dp, state),
        "lm_head": median_ms(lm_head, tp, hidden),
        "rollout": median_ms(rollout, tp, dp, hidden, base, state.root, key),
        "draft": median_ms(draft, tp, dp, state, key),
        "verify_forward": median_ms(vforward, tp, state, proposal),
        "accept": median_ms(accept, proposal, out, key),
        "commit": median_ms(commit, state, verified, key),
    }
    times["round"] = round_ms(prep, tp, dp, state, args)
    times["backbone_gflop"], times["backbone_gflop_all_slots"] = backbone_gflop(
        drafter, tp, dp, state)
    times["sum"] = sum(times[s] for s in ("draft", "verify_forward", "accept", "commit"))
    if profile_dir:
        copy = jax.tree_util.tree_map(jax.numpy.copy, state)
        times["profile"] = profiled(os.path.join(profile_dir, "round"), lambda: prep.rounds_fn(
            tp, dp, copy, jax.numpy.int32(args.rounds)), args.rounds)
        times["profile_backbone"] = profiled(os.path.join(profile_dir, "backbone"), lambda: [
            backbone(tp, dp, state) for _ in range(args.rounds)], args.rounds)
    return times


def profiled(directory: str, call, per: int) -> dict:
    """A ``jax.profiler`` trace of ``call()`` (compiled programs only) under ``directory``,
    summarised (``profile_decode``): device busy time and window, the top kernels, and the
    device time per ``per`` (rounds or calls) by kind of kernel (``classes``)."""
    import jax

    with jax.profiler.trace(directory, create_perfetto_trace=True):
        jax.block_until_ready(call())
    return trace_summary(directory, per)


def trace_summary(directory: str, per: int) -> dict:
    """``profiled``'s summary of a trace already under ``directory`` (``--from-traces``)."""
    from profile_decode import kernel_classes, load_perfetto, summarise_trace

    trace = load_perfetto(directory)
    summary = summarise_trace(trace, top=20)
    summary["classes"] = kernel_classes(trace, per)
    summary["per"] = per
    return summary


def backbone_gflop(drafter, tp, dp, state) -> tuple[float, float]:
    """XLA's flop count (GFLOP) of the compiled backbone over this round's block, with the
    last layer over the slots the drafts read and over every slot."""
    import jax

    def flops(rows):
        def forward(tp, dp, s):
            width = s.context.shape[1]
            start = s.target_cache.lengths
            ctx_pos = (start - s.context_len)[:, None] + jax.numpy.arange(width)[None]
            embeds, block_pos = drafter.block_inputs(tp, s.root, start, dp)
            return drafter.backbone.apply({"params": dp["backbone"]}, s.context, ctx_pos,
                                          s.context_len, embeds, block_pos, s.draft_cache,
                                          output_rows=rows)
        cost = jax.jit(forward).lower(tp, dp, state).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        return float(cost.get("flops", float("nan"))) / 1e9

    rows = drafter.num_positions + (0 if drafter.config.shift_label else 1)
    return flops(rows), flops(None)


def round_ms(prep, tp, dp, state, args) -> float:
    """Median ms per round of ``prep.rounds_fn`` over ``args.rounds`` rounds from copies of
    ``state`` (after one untimed call that compiles)."""
    import jax
    import jax.numpy as jnp

    ms = []
    for _ in range(max(3, args.reps // 2) + 1):
        copy = jax.tree_util.tree_map(jnp.copy, state)
        jax.block_until_ready(copy)
        t0 = time.perf_counter()
        ran = prep.rounds_fn(tp, dp, copy, jnp.int32(args.rounds))
        jax.block_until_ready(ran)
        ms.append(1e3 * (time.perf_counter() - t0) / max(int(ran.rounds.max()), 1))
    return statistics.median(ms[1:])


def ar_time(models, prompts, args) -> float:
    """Median ms of a plain AR round on the same prompts."""
    from domino_jax.decode.speculative import DecodeConfig, _prepare

    config = DecodeConfig(method="ar", max_new_tokens=args.rounds + 2)
    prep = _prepare(models.target, models.tp, prompts, config, None, None, 0)
    state = prep.prefill_fn(models.tp, None, prep.prompt, prep.prompt_len, prep.key)
    return round_ms(prep, models.tp, None, state, args)


def summary_line(summary: dict) -> str:
    """One line of a trace summary: busy and window per round/call, the classes."""
    per = summary.get("per", 1)
    if not summary.get("kernels"):
        return f"no {summary.get('source', 'device')} kernels"
    return (f"busy {summary['busy_us'] / per:.1f} us of {summary['window_us'] / per:.1f} per "
            f"round/call ({summary['source']}); " + ", ".join(
                f"{k} {v:.1f}" for k, v in summary["classes"].items()))


def from_traces(directory: str, per: int) -> dict:
    """Summaries of the traces a ``--profile DIR`` run left (``DIR/<row>/<round|backbone>``)."""
    out = {}
    for row in sorted(os.listdir(directory)):
        for kind, key in (("round", "profile"), ("backbone", "profile_backbone")):
            where = os.path.join(directory, row, kind)
            if os.path.isdir(where):
                out.setdefault(row, {})[key] = trace_summary(where, per)
                print(f"k={row} {key}: {summary_line(out[row][key])}", flush=True)
    return out


def main(argv=None):
    args = parse_args(argv)
    if args.from_traces:
        out = from_traces(args.from_traces, args.rounds)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
        return
    import jax
    import jax.numpy as jnp

    from bench_batch_sweep import Models
    from bench_util import git_commit, versions

    models = Models(argparse.Namespace(mode=args.mode, shape=args.shape,
                                       prompt_len=args.prompt_len))
    prompts = models.prompts(args.batch)
    median_ms = _timer(args.reps)
    dispatch = median_ms(jax.jit(lambda x: x + 1), jnp.zeros((), jnp.int32))
    ar = ar_time(models, prompts, args)
    rows = {}
    for k in [int(x) for x in args.widths.split(",") if x]:
        for trim in (False, True) if args.trim_block else (False,):
            name = f"{k}t" if trim else str(k)
            where = os.path.join(args.profile, name) if args.profile else None
            rows[name] = stage_times(models, prompts, k, args, median_ms, trim, where)
            print(f"k={name}: " + "  ".join(f"{n} {v:.2f}" for n, v in rows[name].items()
                                             if not n.startswith("profile"))
                  + f"  (ar {ar:.2f} ms, dispatch {dispatch:.3f})", flush=True)
            for kind in ("profile", "profile_backbone"):
                if kind in rows[name]:
                    print(f"  {kind} k={name}: {summary_line(rows[name][kind])}", flush=True)
    dev = jax.devices()[0]
    meta = dict(date=_dt.datetime.now().strftime("%Y-%m-%d_%H%M%S"), git_commit=git_commit(None),
                versions=versions(), device=f"{dev.platform}:{dev.device_kind}",
                argv=sys.argv[1:], batch=args.batch, mode=args.mode, shape=args.shape,
                ar_ms=ar, dispatch_ms=dispatch, load=[round(x, 1) for x in os.getloadavg()],
                xla_flags=os.environ.get("XLA_FLAGS", ""))
    names = [n for n in next(iter(rows.values())) if not n.startswith("profile")] if rows else []
    lines = [f"# Round stages {meta['date']} ({meta['device']}, {args.mode} {args.shape}, batch "
             f"{args.batch}, commit {meta['git_commit']})", "",
             f"`python benchmarks/round_stages.py {' '.join(sys.argv[1:])}`: median ms per "
             f"jitted call; AR round {ar:.2f} ms; empty call {dispatch:.3f} ms; XLA_FLAGS "
             f"`{meta['xla_flags'] or '(none)'}`.", "",
             "| k | " + " | ".join(names) + " | round / AR |",
             "|---|" + "---|" * (len(names) + 1)]
    lines += [f"| {k} | " + " | ".join(f"{t[n]:.2f}" for n in names)
              + f" | {t['round'] / ar:.2f} |" for k, t in rows.items()]
    print("\n".join(lines), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, stages=rows), f, indent=1)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
