"""Does trimming the draft block keep the acceptance? (``BlockOptions.trim_block``)

A ``k``-draft round normally runs the DFlash backbone over the whole 16-slot block and
keeps the first ``k`` positions; with ``trim_block`` it runs over ``[root, MASK x k]`` only,
which costs less (the layers' work is the block rows'), but the block attends non-causally,
so the drafts change. This measures, on the SmolLM2 demo pair with its trained Domino
drafter, greedy, float32, on ``--batch`` held-out prompts (the batch sweep's: generated
prompts that are not in training, ``domino_jax.train.data.is_eval_prompt``): tau (tokens
per round) at each ``--lengths`` with the whole and the trimmed block, that every output
equals AR's, and ms per round (the machine's load makes those rough; ``ar_arm_cost.py``
and the batch sweep time properly).

    python benchmarks/trim_block_tau.py --lengths 2,4,8 --batch 16 --new-tokens 64
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2,4,8")
    p.add_argument("--methods", default="domino", help="comma list: domino, dflash")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    args = p.parse_args(argv)

    import jax
    import numpy as np

    from bench_batch_sweep import Models, parse_args as sweep_args
    from bench_util import git_commit, versions
    from domino_jax.decode.methods import make_drafter, method_options
    from domino_jax.decode.speculative import DecodeConfig, generate

    models = Models(sweep_args(["--mode", "real", "--batches", str(args.batch)]))
    prompts = models.prompts(args.batch)
    ar = generate(models.target, models.tp, prompts,
                  DecodeConfig(method="ar", max_new_tokens=args.new_tokens,
                               stop_token_ids=models.stops()))
    reference = ar.tokens
    rows = []
    for method in args.methods.split(","):
        for k in (int(x) for x in args.lengths.split(",")):
            for trim in (False, True):
                drafter = make_drafter(models.draft_config, models.target, method,
                                       method_options(method, draft_length=k, trim_block=trim))
                config = DecodeConfig(method=method, max_new_tokens=args.new_tokens,
                                      stop_token_ids=models.stops())
                generate(models.target, models.tp, prompts, config, drafter, models.dp)  # warm
                start = time.perf_counter()
                result = generate(models.target, models.tp, prompts, config, drafter, models.dp)
                seconds = time.perf_counter() - start
                rounds = max(int(np.max(result.rounds)), 1)
                row = dict(method=method, drafts=k, trim=trim, block_slots=drafter.block_len,
                           tau=round(float(result.tau), 3), rounds=rounds,
                           ms_per_round=round(1e3 * result.decode_seconds / rounds, 1),
                           wall_s=round(seconds, 1),
                           identical_to_ar=result.tokens == reference)
                print(row, flush=True)
                rows.append(row)
    stamp = _dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    meta = dict(date=stamp, git_commit=git_commit(None), versions=versions(),
                device=f"{jax.default_backend()}:{jax.devices()[0].device_kind}",
                batch=args.batch, new_tokens=args.new_tokens, argv=sys.argv[1:])
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"trim_block_tau_{stamp}")
    with open(base + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(f"# Trimmed draft block: tau ({stamp}, {meta['device']}, commit "
                f"{meta['git_commit']})\n\nSmolLM2 pair, greedy float32, {args.batch} held-out "
                f"prompts, {args.new_tokens} new tokens. `python benchmarks/trim_block_tau.py "
                f"{' '.join(sys.argv[1:])}`\n\n| method | drafts | block slots | tau | ms / round"
                f" | identical to AR |\n|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['method']} | {r['drafts']} | {r['block_slots']} | {r['tau']} | "
                    f"{r['ms_per_round']} | {r['identical_to_ar']} |\n")
    print("wrote", base + ".md")


if __name__ == "__main__":
    main()
