"""``python -m domino_jax.train.parts``: split a run or checkpoint folder into checksummed
parts of at most N MiB, plan a split, or join parts back (see :mod:`checkpoint_parts`).

    python -m domino_jax.train.parts plan  runs/domino --part-mib 15 --group-files 8 --group-mib 64
    python -m domino_jax.train.parts split runs/domino parts/ --part-mib 15 --group-files 8 --group-mib 64
    python -m domino_jax.train.parts split runs/domino parts/ --latest-only ...   # to resume
    python -m domino_jax.train.parts join  parts/ runs/domino      # verified, then restored
    python -m domino_jax.train --resume --out runs/domino ...      # continues the run

For the lent GPU machine (at most 8 files of 16 MiB, 64 MiB together, come back per call):
``--part-mib 15 --group-files 8 --group-mib 64`` gives ``transfer-NN/`` folders of four
parts each (the manifest rides in ``transfer-00``); copy one folder to ``$OUT`` per call.
Exit status 2 on a bad request or a missing / corrupt part (the message names it).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from domino_jax.train.checkpoint_parts import (PartsError, join_parts, latest_only_excludes,
                                               plan_split, split_directory)


def _grouping_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part-mib", type=float, default=16.0, help="largest part, MiB (16)")
    p.add_argument("--group-files", type=int, default=None,
                   help="files per transfer folder, manifest included (e.g. 8)")
    p.add_argument("--group-mib", type=float, default=None,
                   help="MiB per transfer folder, manifest included (e.g. 64)")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="leave out relative paths matching GLOB (repeatable; a matching "
                        "folder drops all below it), e.g. 'draft*'")
    p.add_argument("--latest-only", action="store_true",
                   help="keep only the latest orbax step (checkpoints/<step>; best/ dropped): "
                        "what resuming elsewhere needs")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m domino_jax.train.parts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    split = sub.add_parser("split", help="SRC_DIR -> OUT_DIR of parts + manifest.json")
    split.add_argument("src")
    split.add_argument("out")
    _grouping_flags(split)
    plan = sub.add_parser("plan", help="how many parts / transfers SRC_DIR needs")
    plan.add_argument("src")
    _grouping_flags(plan)
    join = sub.add_parser("join", help="PARTS_DIR -> DEST_DIR (verified)")
    join.add_argument("parts")
    join.add_argument("dest")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        exclude = list(getattr(args, "exclude", []))
        if getattr(args, "latest_only", False):
            exclude += latest_only_excludes(args.src)
        if args.command == "split":
            m = split_directory(args.src, args.out, args.part_mib, args.group_files,
                                args.group_mib, exclude)
            summary = {"out": args.out, "parts": m["num_parts"],
                       "transfers": m["num_transfers"], "stream_bytes": m["stream_bytes"],
                       "stream_sha256": m["stream_sha256"], "files": len(m["files"])}
        elif args.command == "plan":
            summary = dict(plan_split(args.src, args.part_mib, args.group_files,
                                      args.group_mib, exclude), src=args.src)
        else:
            m = join_parts(args.parts, args.dest)
            summary = {"dest": args.dest, "parts": m["num_parts"], "files": len(m["files"]),
                       "stream_sha256": m["stream_sha256"], "verified": True}
    except PartsError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
