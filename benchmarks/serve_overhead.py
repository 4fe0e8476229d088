"""What continuous batching adds to a round: per-call, refill and insertion costs (issue 17).

``decode/serving.py`` runs the same round loop as a static batch, but returns to the host
whenever a row is done, prefills the next request and writes it into the slot. This script
times each of those against the loop itself, on one fixed-width Domino arm (``--draft-length``
drafts; models as ``bench_batch_sweep.py``: ``--mode forced`` random weights at ``--shape``
with forced acceptance ``--tau``), median ms over ``--reps``:

* ``round_in_one_call``: ms per round of one loop call over ``--rounds`` rounds;
* ``round_per_call``: ms per round of ``--rounds`` calls of one round each (a host sync on
  ``done`` after each, as the scheduler does): the difference is the per-call cost;
* ``round_after_insert``: the same, with a refill (a batch-1 prefill written into row 0)
  between the calls, the refill itself not counted: whether an insertion slows the round;
* ``zero_round_call``: ms of a loop call that runs no round (``done_limit`` 0): what a
  call costs outside its rounds (dispatch, the copies of the loop's entry and exit);
* ``ar_zero_round_call``: the same for the AR loop (the baseline's per-call cost);
* ``prefill_1`` / ``insert``: a batch-1 prefill and its insertion alone;
* ``entry_copies``: the copies in the compiled loop's entry computation outside the while
  loop (count and bytes, from the optimized HLO), the candidates for a per-call cost;
* ``serve``: ``serve()`` on ``--serve`` requests per slot: its ``timings`` and the
  least-squares split of its loop calls' seconds into per-round and per-call parts.

    python benchmarks/serve_overhead.py --mode forced --shape qwen3-8b --batch 32 --tau 6
    python benchmarks/serve_overhead.py --mode forced --shape tiny --batch 2 --reps 2   # smoke
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
    p.add_argument("--mode", choices=("forced",), default="forced")
    p.add_argument("--shape", choices=("smollm2", "qwen3-8b", "tiny"), default="qwen3-8b")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tau", type=float, default=6.0)
    p.add_argument("--spread", type=float, default=0.5)
    p.add_argument("--draft-length", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--serve", type=int, default=3, help="requests per slot of the serve run")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile", default=None,
                   help="write a jax.profiler trace (perfetto JSON) of 3 zero-round calls here")
    p.add_argument("--many-calls", action="store_true",
                   help="compile the loop as serve() does (speculative.rounds_compiler_options)")
    p.add_argument("--git-commit", default=None)
    p.add_argument("--out", default=None, help="write JSON here")
    return p.parse_args(argv)


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def entry_copies(hlo: str) -> dict:
    """``{"count", "bytes", "largest"}`` of the ``copy`` / ``copy-start`` instructions of
    optimized HLO text's ENTRY computation (outside its while loop's body)."""
    import re

    entry, inside = [], False
    for line in hlo.splitlines():
        if line.startswith("ENTRY "):
            inside = True
        elif inside and line.startswith("}"):
            break
        elif inside:
            entry.append(line)
    sizes = []
    for line in entry:
        m = re.search(r"= (\w+)\[([\d,]*)\][^ ]* (copy|copy-start)\(", line)
        if m:
            n = 1
            for d in filter(None, m.group(2).split(",")):
                n *= int(d)
            sizes.append(n * _DTYPE_BYTES.get(m.group(1), 4))
    return dict(count=len(sizes), bytes=sum(sizes), largest=sorted(sizes)[-5:])


def main(argv=None):
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench_batch_sweep import Models
    from bench_util import git_commit, random_prompt, versions
    from profile_decode import profile_summary
    from domino_jax.decode import serving, speculative
    from domino_jax.decode.speculative import DecodeConfig
    from domino_jax.decode.verify import ForcedAcceptance

    models = Models(argparse.Namespace(mode="forced", shape=args.shape,
                                       prompt_len=args.prompt_len))
    drafter = models.make("domino", draft_length=args.draft_length)
    config = DecodeConfig(method="domino", max_new_tokens=args.new_tokens,
                          verify=ForcedAcceptance(args.tau, width=16, spread=args.spread))
    vocab = models.target.config.vocab_size
    prompts = [random_prompt(args.prompt_len, vocab, 100 + r)
               for r in range(args.batch * args.serve)]
    tp, dp = models.tp, models.dp
    prep = speculative._prepare(models.target, tp, prompts[:args.batch], config, drafter, dp, 0,
                                many_calls=args.many_calls)
    axes = serving.state_batch_axes(models.target, prep.drafter, config, tp, dp,
                                    prep.prompt.shape[1], prep.capacity)
    one, one_len = speculative.pad_prompts(prompts[-1:], width=prep.prompt.shape[1])
    prefill_1, _ = speculative.compiled_prefill(models.target, prep.drafter, config, tp, dp,
                                                one, one_len, prep.key, prep.capacity)
    row0 = jnp.asarray([0], jnp.int32)
    insert_fn = prep.rounds_fn.keeping_layouts(serving.insert_rows, static_argnums=(3,))

    def fresh():
        state = prep.prefill_fn(tp, dp, prep.prompt, prep.prompt_len, prep.key)
        return jax.block_until_ready(prep.rounds_fn.adopt(state))   # the loop's layouts

    def one_call():
        state = fresh()
        t0 = time.perf_counter()
        state = prep.rounds_fn(tp, dp, state, jnp.int32(args.rounds))
        n = int(np.asarray(state.rounds).max())
        return 1e3 * (time.perf_counter() - t0) / n

    def per_call(insert: bool):
        state, spent, n = fresh(), 0.0, 0
        for _ in range(args.rounds):
            if insert:
                part = prefill_1(tp, dp, one, one_len, prep.key)
                state = jax.block_until_ready(insert_fn(state, part, row0, axes))
            t0 = time.perf_counter()
            before = np.asarray(state.rounds)
            state = prep.rounds_fn(tp, dp, state, jnp.int32(1))
            n += int((np.asarray(state.rounds) - before).max())
            spent += time.perf_counter() - t0
        return 1e3 * spent / max(n, 1)

    def zero_round_call():
        state = fresh()
        t0 = time.perf_counter()
        state = prep.rounds_fn(tp, dp, state, jnp.int32(args.rounds), done_limit=0)
        jax.block_until_ready(state)
        return 1e3 * (time.perf_counter() - t0)

    ar_prep = speculative._prepare(models.target, tp, prompts[:args.batch],
                                   DecodeConfig(method="ar", max_new_tokens=args.new_tokens),
                                   None, None, 0, many_calls=args.many_calls)

    def ar_zero_round_call():
        state = jax.block_until_ready(ar_prep.prefill_fn(tp, None, ar_prep.prompt,
                                                         ar_prep.prompt_len, ar_prep.key))
        t0 = time.perf_counter()
        jax.block_until_ready(ar_prep.rounds_fn(tp, None, state, jnp.int32(1), done_limit=0))
        return 1e3 * (time.perf_counter() - t0)

    def prefill_ms():
        t0 = time.perf_counter()
        jax.block_until_ready(prefill_1(tp, dp, one, one_len, prep.key))
        return 1e3 * (time.perf_counter() - t0)

    def insert_ms():
        state = fresh()
        part = jax.block_until_ready(prefill_1(tp, dp, one, one_len, prep.key))
        t0 = time.perf_counter()
        jax.block_until_ready(insert_fn(state, part, row0, axes))
        return 1e3 * (time.perf_counter() - t0)

    out = {}
    out["entry_copies"] = entry_copies(prep.rounds_fn.as_text())
    print("entry_copies:", out["entry_copies"], flush=True)
    for name, fn in (("round_in_one_call", one_call), ("zero_round_call", zero_round_call),
                     ("ar_zero_round_call", ar_zero_round_call),
                     ("round_per_call", lambda: per_call(False)),
                     ("round_after_insert", lambda: per_call(True)), ("prefill_1", prefill_ms),
                     ("insert", insert_ms)):
        times = [fn() for _ in range(args.reps + 1)][1:]        # the first warms up
        out[name] = statistics.median(times)
        print(f"{name}: {out[name]:.2f} ms ({', '.join(f'{t:.2f}' for t in times)})", flush=True)
    if args.profile:
        states = [fresh() for _ in range(3)]
        with jax.profiler.trace(args.profile, create_perfetto_trace=True):
            for state in states:
                jax.block_until_ready(prep.rounds_fn(tp, dp, state, jnp.int32(1), done_limit=0))
        out["profile_top"] = profile_summary(args.profile)
        for row in out["profile_top"]:
            print("profile:", *row, flush=True)
    runs = []
    for _ in range(2):                                          # the first warms up
        result = serving.serve(models.target, tp, prompts, config, drafter, dp,
                               slots=args.batch)
        split = serving.call_split(result.calls)
        runs.append(dict(timings=result.timings, loop_calls=result.loop_calls,
                         loop_rounds=result.loop_rounds, refills=result.refills,
                         ms_per_round_and_per_call=split,
                         ms_per_loop_round=1e3 * result.timings["loop"]
                         / max(result.loop_rounds, 1)))
    out["serve"] = runs[-1]
    print("serve:", json.dumps(runs[-1]), flush=True)
    dev = jax.devices()[0]
    if args.out:
        import gzip
        os.makedirs(args.out, exist_ok=True)
        with gzip.open(os.path.join(args.out, "serve_overhead_rounds_hlo.txt.gz"), "wt") as f:
            f.write(prep.rounds_fn.as_text())
    meta = dict(date=_dt.datetime.now().isoformat(timespec="seconds"),
                git_commit=git_commit(args.git_commit), versions=versions(),
                device=f"{dev.platform}:{dev.device_kind}", argv=sys.argv[1:])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "serve_overhead_"
                            + _dt.datetime.now().strftime("%Y-%m-%d_%H%M%S") + ".json")
        with open(path, "w") as f:
            json.dump(dict(meta=meta, results=out), f, indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()
