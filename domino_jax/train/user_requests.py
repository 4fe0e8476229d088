"""User requests the target writes, kept as a corpus keeps its training prompts: new
prompts beyond any corpus for the drafter campaign (``campaign --self-instruct``), and
evaluation sets of requests (docs/design.md §31).

    kept, summary = new_requests(target_dir, 4096, seed=13000,
                                 against=["corpus/heldout.jsonl"], eval_fraction=0.02)

    python -m domino_jax.train.user_requests --out requests.jsonl --num 40 --keep 32 \\
        --seed 1000000 --batch-size 64 --dtype float32 --against CORPUS/heldout.jsonl \\
        [--kind request] [--target DIR]

Generation: :mod:`domino_jax.train.self_instruct` (the chat template's user-turn prefix,
sampled); the filters: :func:`domino_jax.train.corpus.training_records`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from domino_jax.train import self_instruct
from domino_jax.train.corpus import training_records
from domino_jax.train.corpus_dedup import iter_jsonl


def new_requests(target_dir: str | None, num: int, *, seed: int = 0,
                 against: Sequence[str] = (), exclude: Sequence[str] = (),
                 eval_fraction: float = 0.0, batch_size: int = 256, max_new_tokens: int = 96,
                 dtype: str = "bfloat16") -> tuple[list[dict], dict]:
    """Up to ``num`` requests the target (``target_dir``, default the demo SmolLM2) writes,
    kept as a corpus keeps training prompts (:func:`domino_jax.train.corpus.training_records`):
    not a repeat, near copy or 8-gram sharer of a prompt of the ``against`` .jsonl files
    (e.g. a held-out split), no 8-gram of an ``exclude`` file's text, none held out by the
    id rule at ``eval_fraction``. Returns the kept records (with their corpus ids) and a
    summary: requested, generated, kept, rejected (by reason) and kinds."""
    if target_dir is None:
        from domino_jax.demo_model import demo_target_dir
        target_dir = demo_target_dir()
    written = self_instruct.self_instruct_from_dir(target_dir, num, seed=seed,
                                                   batch_size=batch_size,
                                                   max_new_tokens=max_new_tokens, dtype=dtype)
    taken = [r for path in against for _, r in iter_jsonl(path)]
    kept, rejected = training_records(written, taken, eval_fraction=eval_fraction,
                                      exclude_files=[*against, *exclude])
    kinds: dict[str, int] = {}
    for r in kept:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    return kept, {"requested": num, "generated": len(written), "kept": len(kept),
                  "rejected": rejected, "kinds": kinds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m domino_jax.train.user_requests",
                                description="User requests written by the target, as .jsonl")
    p.add_argument("--out", required=True, help="the .jsonl to write")
    p.add_argument("--num", type=int, required=True, help="requests to have the target write")
    p.add_argument("--keep", type=int, default=None, help="the first KEEP of those kept")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--against", action="append", default=[], metavar="JSONL",
                   help="prompts the requests must not repeat or near-copy (e.g. a held-out "
                        "split); repeatable")
    p.add_argument("--kind", default=None,
                   help="every record's kind (the guessed one goes to guessed_kind)")
    p.add_argument("--target", default=None, help="HF target folder (default: demo SmolLM2)")
    args = p.parse_args(argv)
    for path in args.against:
        if not os.path.isfile(path):
            p.error(f"--against {path!r}: no such file")
    kept, summary = new_requests(args.target, args.num, seed=args.seed, against=args.against,
                                 batch_size=args.batch_size,
                                 max_new_tokens=args.max_new_tokens, dtype=args.dtype)
    kept = kept[:args.keep]
    with open(args.out, "w") as f:
        for r in kept:
            if args.kind:
                r = {"id": r["id"], "kind": args.kind, "source": r["source"],
                     "guessed_kind": r["kind"], "prompt": r["prompt"]}
            f.write(json.dumps(r) + "\n")
    print(json.dumps({"out": args.out, "written": summary["generated"], "kept": len(kept),
                      "rejected": summary["rejected"]}))
    return 0



if __name__ == "__main__":
    sys.exit(main())
