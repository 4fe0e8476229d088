"""A drafter's token ranking, for drafting over the most frequent tokens only
(``--draft-vocab N``, ``BlockOptions.draft_vocab``; docs/design.md §32).

    python -m domino_jax.train.draft_vocab SHARDS_DIR [SHARDS_DIR ...] --draft DRAFT_DIR

Counts the response tokens of self-distilled shards (:mod:`domino_jax.train.shards`: the
target's own answers, which is what drafts must match), ranks every token id of the
drafter's vocabulary by its count (most frequent first, ties by id) and writes the ranking
to ``DRAFT_DIR/draft_vocab.npy`` (int32 ``[V]``), where
:func:`domino_jax.decode.loading.read_draft_vocab` takes its first ``N``. Prints the share of
the response tokens the first 2k .. 32k cover.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

import numpy as np

COVERAGE_SIZES = (2048, 4096, 8192, 16384, 32768)


def token_counts(shards_dirs: Sequence[str], vocab_size: int) -> np.ndarray:
    """How often each token id occurs in the responses of ``shards_dirs``: int64 ``[V]``.
    Raises ``ValueError`` naming the folder for a token id outside ``[0, V)``."""
    from domino_jax.train.shard_store import ShardDataset

    counts = np.zeros(vocab_size, np.int64)
    for folder in shards_dirs:
        data = ShardDataset(folder)
        responses = [data[i]["input_ids"][data[i]["loss_mask"] == 1] for i in range(len(data))]
        tokens = np.concatenate(responses) if responses else np.zeros(0, np.int32)
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab_size):
            raise ValueError(f"{folder}: a response has a token id outside [0, {vocab_size})")
        counts += np.bincount(tokens, minlength=vocab_size)
    return counts


def rank_tokens(counts: np.ndarray) -> np.ndarray:
    """Every token id, most frequent first (ties: the smaller id first): int32 ``[V]``."""
    return np.argsort(-counts, kind="stable").astype(np.int32)


def coverage(counts: np.ndarray, ranking: np.ndarray,
             sizes: Sequence[int] = COVERAGE_SIZES) -> dict[int, float]:
    """The share of all counted tokens that the first ``n`` of ``ranking`` cover, per size."""
    total = max(int(counts.sum()), 1)
    cumulative = np.cumsum(counts[ranking])
    return {n: round(float(cumulative[min(n, len(ranking)) - 1]) / total, 4) for n in sizes}


def write_ranking(shards_dirs: Sequence[str], draft_dir: str) -> dict:
    """Rank the tokens of ``shards_dirs``' responses for the drafter in ``draft_dir`` (its
    config's vocabulary) and write ``draft_dir/draft_vocab.npy``; returns a summary
    (the file, response tokens counted, distinct tokens seen, :func:`coverage`)."""
    from domino_jax.config import DraftConfig
    from domino_jax.decode.loading import DRAFT_VOCAB_FILE

    counts = token_counts(shards_dirs, DraftConfig.from_path(draft_dir).vocab_size)
    ranking = rank_tokens(counts)
    out = os.path.join(draft_dir, DRAFT_VOCAB_FILE)
    np.save(out, ranking)
    return {"out": out, "response_tokens": int(counts.sum()),
            "tokens_seen": int((counts > 0).sum()), "coverage": coverage(counts, ranking)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m domino_jax.train.draft_vocab",
                                description="Rank a drafter's tokens by their frequency in "
                                            "self-distilled responses")
    p.add_argument("shards", nargs="+", help="shards directories (their responses are counted)")
    p.add_argument("--draft", required=True,
                   help="the drafter folder (config.json); draft_vocab.npy is written there")
    args = p.parse_args(argv)
    from domino_jax.train.shard_store import is_shard_dir

    for folder in args.shards:
        if not is_shard_dir(folder):
            p.error(f"{folder!r} is not a shards directory (no manifest.json)")
    if not os.path.isfile(os.path.join(args.draft, "config.json")):
        p.error(f"--draft {args.draft!r}: no config.json there")
    print(json.dumps(write_ranking(args.shards, args.draft)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
