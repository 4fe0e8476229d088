"""What an adaptive AR round costs against a plain AR step (issue 17), same process.

The adaptive loop (``decode/adaptive.py``) runs a plain AR step as its width-0 arm; a
policy that picks AR every round should then run as fast as the plain AR loop. This script
times, on copies of the same post-prefill state of the SmolLM2 demo pair (float32 on the
CPU, greedy, no stop tokens so no row finishes), or with ``--mode forced`` random weights at
``--shape`` (``qwen3-8b``: the Qwen3-8B target and Domino drafter in bf16 on a GPU; nothing
is accepted there, a round's cost does not depend on it):

* ``ar``: the plain AR loop (``method ar``), ms per round;
* ``auto-ar``: the adaptive Domino loop with the AR arm forced every round
  (``PolicyState.force = 0``; its context-buffer flushes included, as in a real run);
* ``auto-wK``: the same loop with arm ``K`` forced (``--arms``, e.g. ``2,16``), for scale;
* ``fixed-K``: the plain (non-adaptive) Domino loop at draft length ``K`` (``--fixed``):
  what ``auto-wK`` costs without the switch around it;
* ``auto+lookup-ar`` (``--lookup``): the adaptive loop with the CLI's prompt-lookup arms
  (``lookup_arm.DEFAULT_LOOKUP_ARMS``), the AR arm forced every round: what the per-round
  n-gram matching and the token history cost when the policy drafts nothing.

Each variant runs ``--rounds`` rounds per timing, ``--reps`` timings interleaved after an
untimed warm-up; reported: median and min ms per round and the ratio to ``ar``. With
``--hlo`` it also counts the ``copy`` instructions (and their bytes) of each compiled loop's
optimized HLO, and those of the whole target KV cache's shape, where a branch that cannot
update the KV caches in place shows (NOTES entry 21; ``DOMINO_JAX_XLA_DEFAULTS=0`` runs
without domino_jax's XLA flags, for the comparison).

    flock /tmp/cpu_heavy.lock python benchmarks/ar_arm_cost.py --batch 4 --hlo --arms 2,16 --fixed 2,16
    python benchmarks/ar_arm_cost.py --batch 32 --lookup --rounds 16 --reps 7
    python benchmarks/ar_arm_cost.py --mode forced --shape qwen3-8b --batch 32 --hlo \
        --arms 2,8 --fixed 2,8 --rounds 12 --reps 3                                  # H200
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("real", "forced"), default="real",
                   help="real: the SmolLM2 demo pair; forced: random weights at --shape")
    p.add_argument("--shape", choices=("smollm2", "qwen3-8b", "tiny"), default="smollm2",
                   help="--mode forced: the model shape (bench_batch_sweep's)")
    p.add_argument("--prompt-len", type=int, default=128, help="--mode forced: prompt tokens")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=24)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--arms", default="", help="also force these widths, e.g. 2,16")
    p.add_argument("--fixed", default="", help="also run fixed Domino at these draft "
                   "lengths (no adaptive loop), e.g. 2,16")
    p.add_argument("--lookup", action="store_true", help="also the adaptive loop with the "
                   "prompt-lookup arms, AR forced (auto+lookup-ar)")
    p.add_argument("--hlo", action="store_true", help="count copies in the optimized HLO")
    p.add_argument("--out", default=None, help="write JSON here")
    return p.parse_args(argv)


_COPY = re.compile(r"=\s*(\w+)\[([\d,]*)\][^=]*\bcopy\(")
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1, "s8": 1, "u8": 1}


def hlo_copies(compiled, cache_shape=None) -> dict:
    """``copy`` instructions of an optimized HLO module: count and bytes (all of them, in
    the while body or not: the loop's bodies dominate), and ``cache_copies``: those of the
    whole target KV cache's shape ``cache_shape`` (a branch that cannot update the cache in
    place: NOTES entry 21)."""
    count, nbytes, cache = 0, 0, 0
    for m in _COPY.finditer(compiled.as_text()):
        count += 1
        dims = [int(d) for d in m.group(2).split(",") if d]
        cache += tuple(dims) == tuple(cache_shape or ())
        size = 1
        for d in dims:
            size *= d
        nbytes += size * _BYTES.get(m.group(1), 4)
    return dict(copies=count, copy_mb=round(nbytes / 2**20, 1), cache_copies=cache)


def main(argv=None):
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    from bench_batch_sweep import Models
    from bench_util import git_commit, versions
    from domino_jax.decode import adaptive as adaptive_lib
    from domino_jax.decode.adaptive import AdaptiveConfig
    from domino_jax.decode.lookup_arm import DEFAULT_LOOKUP_ARMS
    from domino_jax.decode.speculative import DecodeConfig, _prepare

    sweep_args = argparse.Namespace(mode=args.mode, shape=args.shape,
                                    prompt_len=args.prompt_len)
    models = Models(sweep_args)
    prompts = models.prompts(args.batch)
    new_tokens = args.rounds * 17 + 2        # no row reaches the limit in --rounds rounds
    variants = {}

    def add(name, config, drafter, dp, force=None):
        prep = _prepare(models.target, models.tp, prompts, config, drafter, dp, 0)
        state = prep.prefill_fn(models.tp, dp, prep.prompt, prep.prompt_len, prep.key)
        variants[name] = (prep, dp, state, force, config.adaptive)

    add("ar", DecodeConfig(method="ar", max_new_tokens=new_tokens), None, None)
    auto = DecodeConfig(method="domino", max_new_tokens=new_tokens, adaptive=AdaptiveConfig())
    domino = models.make("domino")
    add("auto-ar", auto, domino, models.dp, force=0)
    widths = adaptive_lib.resolve_widths(auto.adaptive, domino)
    for w in [int(x) for x in args.arms.split(",") if x]:
        add(f"auto-w{w}", auto, domino, models.dp, force=widths.index(w))
    if args.lookup:
        with_lookup = DecodeConfig(method="domino", max_new_tokens=new_tokens,
                                   adaptive=AdaptiveConfig(lookup=DEFAULT_LOOKUP_ARMS))
        add("auto+lookup-ar", with_lookup, domino, models.dp, force=0)
    for k in [int(x) for x in args.fixed.split(",") if x]:
        add(f"fixed-{k}", DecodeConfig(method="domino", max_new_tokens=new_tokens),
            models.make("domino", draft_length=k), models.dp)

    def run(name):
        prep, dp, state, force, adaptive = variants[name]
        state = jax.tree_util.tree_map(jnp.copy, state)
        if force is None:
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            state = prep.rounds_fn(models.tp, dp, state, jnp.int32(args.rounds))
            ran = int(state.rounds.max())
        else:
            policy = adaptive_lib.init_policy(adaptive, prep.drafter, prep.widths,
                                              args.batch, [1.0] * len(prep.widths), force)
            jax.block_until_ready((state, policy))
            t0 = time.perf_counter()
            state, policy = prep.rounds_fn(models.tp, dp, state, policy,
                                           jnp.int32(args.rounds))
            ran = int(policy.arm_rounds.sum())
        return 1e3 * (time.perf_counter() - t0) / max(ran, 1)

    for name in variants:
        run(name)                                            # warm-up
    samples = {name: [] for name in variants}
    for _ in range(args.reps):
        for name in variants:
            samples[name].append(run(name))
    ar = statistics.median(samples["ar"])
    rows = []
    for name, ms in samples.items():
        row = dict(variant=name, median_ms=statistics.median(ms), min_ms=min(ms),
                   ratio_to_ar=statistics.median(ms) / ar, samples=ms)
        if args.hlo:
            cache_shape = variants[name][2].target_cache.keys.shape
            row.update(hlo_copies(variants[name][0].rounds_fn, cache_shape))
        rows.append(row)
        extra = (f", {row['copies']} copies ({row['copy_mb']} MB), {row['cache_copies']} of "
                 f"the whole target cache" if args.hlo else "")
        print(f"{name:10s} median {row['median_ms']:7.1f} ms/round  min {row['min_ms']:7.1f}"
              f"  x{row['ratio_to_ar']:.3f} of ar{extra}", flush=True)
    dev = jax.devices()[0]
    meta = dict(date=_dt.datetime.now().isoformat(timespec="seconds"),
                git_commit=git_commit(None), versions=versions(),
                device=f"{dev.platform}:{dev.device_kind}", batch=args.batch,
                mode=args.mode, shape=args.shape if args.mode == "forced" else "smollm2-pair",
                xla_flags=os.environ.get("XLA_FLAGS", ""),
                rounds=args.rounds, reps=args.reps, load=[round(x, 1) for x in os.getloadavg()])
    print(json.dumps(meta))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
