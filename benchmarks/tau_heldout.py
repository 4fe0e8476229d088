"""tau per prompt kind on a corpus's held-out split, for one or more trained drafters.

    python benchmarks/tau_heldout.py --prompts corpus/heldout.jsonl \\
        --draft domino_jax/assets/smollm2-domino --draft runs/e2e/draft \\
        --num-per-kind 6 --max-new-tokens 64 --methods dflash,domino [--target DIR]

Each drafter is evaluated with :class:`domino_jax.train.evaluate.HeldoutEvaluator` (the
real jitted decode loop, greedy, the drafter in the decode layout ``load_pair`` gives), on
the same prompts: the first ``--num-per-kind`` prompts of each kind in file order. tau is
tokens committed per target forward, pooled over the rows of a kind. float32 by default
(tau does not depend on the device in float32). Writes ``tau_heldout_<date>.json`` and
``.md`` to ``--out`` (default ``$OUT`` or ``benchmarks/results``), with commit and versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True, help="held-out .jsonl ({prompt, kind})")
    p.add_argument("--draft", action="append", required=True,
                   help="drafter folder (HF DFlashDraftModel format); repeatable")
    p.add_argument("--target", default=None, help="HF target folder (default: demo SmolLM2)")
    p.add_argument("--num-per-kind", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--methods", default="dflash,domino")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--draft-vocab", default="0", metavar="N[,N]",
                   help="draft over each drafter folder's N most frequent tokens "
                        "(draft_vocab.npy; docs/design.md §32), one evaluation per N; 0 = the "
                        "whole vocabulary (default)")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    if args.dtype == "float32":
        jax.config.update("jax_default_matmul_precision", "highest")
    from converters.hf_target import load_target
    from domino_jax.decode.loading import (encode_prompt, load_tokenizer, read_draft_vocab,
                                           stop_token_ids)
    from domino_jax.models.qwen3 import TargetLM
    from domino_jax.train.evaluate import (HeldoutEvaluator, encode_prompts,
                                           read_eval_prompts)
    from domino_jax.train.loop import load_trained_draft

    target_dir = args.target
    if target_dir is None:
        from domino_jax.demo_model import demo_target_dir
        target_dir = demo_target_dir()
    dtype = jnp.dtype(args.dtype)
    tconfig, tparams = load_target(target_dir, dtype)
    target = TargetLM(tconfig, dtype=dtype, param_dtype=dtype)
    tokenizer = load_tokenizer(target_dir)
    texts = read_eval_prompts(args.prompts, args.num_per_kind)
    ids = encode_prompts(texts, lambda t: encode_prompt(tokenizer, t))
    methods = tuple(m for m in args.methods.split(",") if m)
    rows = []
    sizes = [int(n) for n in args.draft_vocab.split(",") if n]
    for draft_dir in args.draft:
        dconfig, dparams = load_trained_draft(draft_dir, dtype)
        for size in sizes:
            t0 = time.perf_counter()
            evaluator = HeldoutEvaluator(
                target, tparams, dconfig, ids, methods, args.max_new_tokens, args.batch_size,
                stop_token_ids(tokenizer, tconfig),
                draft_vocab=read_draft_vocab(draft_dir, size, tconfig.vocab_size)
                if size else None)
            taus = evaluator(dparams)
            seconds = time.perf_counter() - t0
            rows.append({"draft": draft_dir + (f" (draft vocab {size})" if size else ""),
                         "tau": taus, "seconds": round(seconds, 1)})
            print(json.dumps(rows[-1]), flush=True)

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d_%H%M%S")
    meta = {"date": stamp, "commit": git_commit(), "device": str(jax.devices()[0]),
            "platform": platform.platform(), "jax": jax.__version__,
            "prompts": args.prompts, "num_per_kind": args.num_per_kind,
            "prompts_per_kind": {k: len(v) for k, v in ids.items()},
            "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "greedy": True,
            "command": " ".join(sys.argv)}
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"tau_heldout_{stamp}")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    kinds = sorted(ids) + ["all"]
    lines = [f"# tau on held-out prompts ({stamp}, commit {meta['commit']}, {meta['device']}, "
             f"jax {meta['jax']}, {args.dtype}, greedy, {args.max_new_tokens} new tokens)", "",
             f"`{meta['command']}`", "",
             "prompts per kind: " + ", ".join(f"{k} {n}" for k, n in
                                              meta["prompts_per_kind"].items()), "",
             "| drafter | method | " + " | ".join(kinds) + " |",
             "|---|---|" + "---|" * len(kinds)]
    for row in rows:
        for method, taus in row["tau"].items():
            lines.append(f"| {row['draft']} | {method} | "
                         + " | ".join(f"{taus.get(k, float('nan')):.2f}" for k in kinds) + " |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
