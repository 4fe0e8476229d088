"""One round of the drafter campaign per command: fresh self-distilled data, training from
the last round's drafter, the held-out evaluation, and what the next round starts from.

    python -m domino_jax.train.campaign --round 1 --corpus CORPUS --work /tmp/campaign \\
        --init DRAFT_DIR --curve campaign_curve.json --out OUT \\
        [--phases generate,train] [--prompts-per-round 16384] [--steps 3000] ...

A round (``--phases``, both by default; a lent GPU may run them in separate calls while
``--work`` lives):

* ``generate``: this round's prompts are a fresh slice of a seeded permutation of the
  corpus's ``train.jsonl`` (round ``r`` takes prompts ``r*N .. (r+1)*N``, wrapping), answered
  greedily (new prompts give new greedy responses) and sampled at ``--temperature`` with the
  round as the seed (a sampled record's id carries ``~r<round>``, so every round's samples
  are new examples); appended to ``WORK/shards`` (:mod:`domino_jax.train.shards`, continuous
  batching with ``--gen-queue``), within ``--gen-seconds``, of which ``--sampled-share`` is
  kept for the sampled mode. Greedy responses are new examples only for prompts new to the
  drafter: once a corpus is used up, continue on a follow-on corpus
  (``python -m domino_jax.train.corpus --extends EARLIER``) and name the earlier one in
  ``--top-up``, whose prompts, sampled afresh, bring the kinds the new corpus runs short of
  up to their share (:func:`top_up`; ``--top-up-by-source``: each source of a kind, e.g. a
  chat template, up to its part); with ``--top-up-greedy`` those prompts are also
  answered greedily first (a rehearsal of kinds the drafter drifted from, docs/design.md
  §25; repeats, so not counted as distinct examples). ``--self-instruct N``: the target
  first writes up to N user requests with the round's seed, kept as a corpus would keep
  training prompts, which join the new prompts (docs/design.md §31).
* ``train``: ``python -m domino_jax.train`` on all of ``WORK/shards`` from ``--init`` (a
  drafter folder: params only, a fresh optimizer and schedule: a warm restart; or ``fresh``:
  a new drafter of the shape ``--train-args`` gives, to try another size on the data a
  machine holds), held-out tau
  of ``--eval-methods`` at the end (and at the start with ``--initial-eval``, or on a thread
  beside training with ``--eval-ahead``); with
  ``--deadline-seconds`` (a lent machine's limit for the whole command) training stops in
  time for the evaluation and the export, its schedules fitted to the steps that fit
  (docs/design.md §26); the result cast to bf16 (the shipped
  drafters' dtype) into ``WORK/round-<r>/draft-bf16`` (the next round's ``--init``) and
  split into checksummed parts of at most ``--part-mib`` in ``OUT/draft``
  (``python -m domino_jax.train.parts join OUT/draft DIR`` restores it).

``OUT/curve.json`` is ``--curve`` with this round's point appended: examples seen, optimizer
steps, the round's training set (``distinct_examples``: the examples in ``WORK/shards``) and
the distinct examples of the drafter's whole history (``distinct_examples_total``: the last
point's, plus this round's fresh responses), held-out tau per method and kind before and
after, and where the round's seconds went (loading, generation, training, evaluation, export).
``OUT/round.json`` holds the point and the commands' summaries.

A machine's ``WORK/shards`` lives only as long as the machine: ``--export-shards`` sends them
back as parts (``OUT/shards``), and a later machine's ``--replay DIR`` (the parts joined)
merges them in first, so its round trains on every earlier session's examples as well
(docs/design.md §26).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import os
import random
import shutil
import sys
import time
from typing import Sequence

from domino_jax.console import add_verbose_flag, setup_logging

log = logging.getLogger(__name__)
SAMPLED_ID = "{id}~r{round}"
SELF_INSTRUCT_SEEDS = 1000   # round r's self-instruct batches use seeds 1000 r + prompt seed + b
COUNTED_PASSES = ("greedy", "sampled")   # generate passes whose responses are new examples
FRESH = "fresh"          # --init: a new drafter, its shape from --train-args (the train CLI's)


@dataclasses.dataclass(frozen=True)
class RoundPrompts:
    greedy: list[dict]       # corpus records, their own ids
    sampled: list[dict]      # the same prompts, ids marked with the round
    wrapped: int = 0         # how many of greedy's last prompts an earlier slice took too


def round_prompts(records: Sequence[dict], round_index: int, per_round: int,
                  seed: int = 0) -> RoundPrompts:
    """Round ``round_index``'s slice of a ``seed`` permutation of ``records`` (``per_round``
    of them, wrapping around the corpus), for the greedy and the sampled mode. Past the
    corpus's end the slice wraps onto prompts that earlier slices took: ``wrapped`` counts
    them (the greedy list's tail)."""
    if per_round < 1 or round_index < 0:
        raise ValueError(f"per_round must be >= 1 and round >= 0, got {per_round}, "
                         f"{round_index}")
    if not records:
        raise ValueError("the corpus has no training records")
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    start = round_index * per_round
    picked = [records[order[(start + i) % len(records)]] for i in range(min(per_round,
                                                                             len(records)))]
    sampled = [dict(r, id=SAMPLED_ID.format(id=r["id"], round=round_index)) for r in picked]
    wrapped = sum(start + i >= len(records) for i in range(len(picked)))
    return RoundPrompts(picked, sampled, wrapped)


def top_up(greedy: Sequence[dict], earlier: Sequence[dict], mix: dict[str, float],
           round_index: int, seed: int = 0, by_source: bool = False) -> list[dict]:
    """Earlier-corpus prompts that bring each kind of the round up to its ``mix`` share.

    A follow-on corpus (``corpus --extends``) runs short of the kinds whose sources are
    exhausted (summaries, code tasks), so its slices under-represent them and the drafter
    forgets them (docs/design.md §25). Their greedy responses were trained on already;
    sampled ones at a new seed are new examples. So: for each kind,
    ``round(len(greedy) * share)`` minus the kind's greedy count records of that kind from
    ``earlier``, drawn afresh each round, with their own ids (the caller marks the sampled
    mode's with the round).

    ``by_source``: the same within each kind, per ``source`` (e.g. a chat template): the
    kind's wanted count is split over its sources as ``earlier`` splits it, and each source
    is filled up to its part, so a kind at its share whose slice holds only some of its
    sources (a follow-on corpus's chat: two templates of ten) gets the others back."""
    rng = random.Random(seed * 1_000_003 + round_index)
    def key(r):
        return r.get("kind", ""), r.get("source", "") if by_source else ""

    have = collections.Counter(key(r) for r in greedy)
    pools = collections.defaultdict(list)
    for r in earlier:
        pools[key(r)].append(r)
    extra = []
    for kind, share in sorted(mix.items()):
        groups = sorted(g for g in pools if g[0] == kind)
        in_kind = sum(len(pools[g]) for g in groups)
        for group in groups:
            pool = pools[group]
            want = round(round(len(greedy) * share) * len(pool) / in_kind) - have[group]
            if want <= 0:
                continue
            extra += rng.sample(pool, want) if want <= len(pool) else rng.choices(pool, k=want)
    return extra


def _card(corpus_dir: str) -> dict:
    card = os.path.join(corpus_dir, "card.json")
    if not os.path.isfile(card):
        return {}
    with open(card) as f:
        return json.load(f)


def corpus_mix(corpus_dir: str) -> dict[str, float]:
    """The kind shares the corpus was built for (its card's ``mix``), else the default."""
    from domino_jax.train.corpus import DEFAULT_MIX
    mix = _card(corpus_dir).get("mix")
    if mix:
        return {k: float(v) for k, v in mix.items()}
    return dict(DEFAULT_MIX)


def self_instruct_requests(args, work: str) -> tuple[list[dict], dict]:
    """``--self-instruct N``: up to N user requests the target writes with the round's seed,
    kept as a corpus would keep them for training against the held-out split and the
    ``--exclude`` files (:func:`domino_jax.train.user_requests.new_requests`), each with its
    corpus id. Written to ``WORK/round-<r>-self-instruct.jsonl``; returns them and their
    summary for the round's record (docs/design.md §31)."""
    from domino_jax.train.user_requests import new_requests

    t0 = time.perf_counter()
    kept, summary = new_requests(
        args.target, args.self_instruct,
        seed=SELF_INSTRUCT_SEEDS * args.round + args.prompt_seed,
        against=[os.path.join(args.corpus, "heldout.jsonl")], exclude=args.exclude,
        eval_fraction=float(_card(args.corpus).get("eval_fraction", 0.02)),
        batch_size=args.self_instruct_batch, max_new_tokens=args.self_instruct_max_new_tokens)
    _write_jsonl(kept, os.path.join(work, f"round-{args.round}-self-instruct.jsonl"))
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    log.info("round %d: self-instruct %s", args.round, summary)
    return kept, summary


def read_curve(path: str | None) -> list[dict]:
    if not path or not os.path.isfile(path):
        return []
    with open(path) as f:
        points = json.load(f)
    if not isinstance(points, list):
        raise ValueError(f"--curve {path!r}: expected a JSON list of round points")
    return points


def totals(curve: Sequence[dict], init_round=None) -> dict:
    """Steps, examples seen and distinct examples over the drafter's rounds so far: the
    running totals of round ``init_round``'s point (the drafter the new round starts from),
    by default the last point's. A point without ``distinct_examples_total``, such as the
    shipped drafter's first, counts its ``distinct_examples``. ValueError: no such round."""
    if init_round is None:
        last = curve[-1] if curve else {}
    else:
        last = next((p for p in reversed(curve) if str(p.get("round")) == str(init_round)),
                    None)
        if last is None:
            raise ValueError(f"no round {init_round} in the curve (rounds: "
                             f"{', '.join(str(p.get('round')) for p in curve) or 'none'})")
    return {"steps": int(last.get("steps_total", 0)),
            "examples_seen": int(last.get("examples_seen_total", 0)),
            "distinct": int(last.get("distinct_examples_total",
                                     last.get("distinct_examples", 0)))}


def _write_jsonl(records: Sequence[dict], path: str) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def _read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _kinds(corpus: str) -> int:
    """Number of prompt kinds in the corpus's ``heldout.jsonl`` (at least 1)."""
    kinds = {r.get("kind", "all") for r in _read_jsonl(os.path.join(corpus, "heldout.jsonl"))}
    return max(1, len(kinds))


def generate_phase(args, work: str, replayed: dict | None = None) -> dict:
    """Append this round's greedy and sampled responses to ``WORK/shards``. A pass the
    device fails (``JaxRuntimeError``, e.g. out of memory) is recorded as ``{"failed",
    "written"}`` with the examples it committed, and the next pass runs. ``replayed``
    (``--replay-new``'s merge record) is kept in the round's generate record as ``replay``:
    its examples count as new (:func:`new_examples`)."""
    import jax

    from domino_jax.train import shards

    prompts = round_prompts(_read_jsonl(os.path.join(args.corpus, "train.jsonl")),
                            args.round - args.first_round, args.prompts_per_round,
                            args.prompt_seed)
    fresh = prompts.greedy[:len(prompts.greedy) - prompts.wrapped]
    repeats = prompts.greedy[len(fresh):]
    if repeats:
        log.warning("round %d: %d of its %d prompts wrap onto earlier rounds' (the corpus is "
                    "used up: build a follow-on one); their greedy responses are not counted "
                    "as new examples", args.round, len(repeats), len(prompts.greedy))
    sampled, rehearsal = prompts.sampled, []
    summaries = {}
    deadline = time.perf_counter() + args.gen_seconds
    if args.self_instruct:
        requests, summaries["self_instruct"] = self_instruct_requests(args, work)
        # new prompts beside the slice's, mixed in so that a pass cut short by its time
        # keeps both in proportion
        rng = random.Random(SELF_INSTRUCT_SEEDS * args.round + args.prompt_seed)
        fresh = fresh + requests
        rng.shuffle(fresh)
        sampled = sampled + [dict(r, id=SAMPLED_ID.format(id=r["id"], round=args.round))
                             for r in requests]
        rng.shuffle(sampled)
    if args.top_up:
        extra = top_up(prompts.greedy, _read_jsonl(os.path.join(args.top_up, "train.jsonl")),
                       corpus_mix(args.corpus), args.round, args.prompt_seed,
                       by_source=args.top_up_by_source)
        sampled = [dict(r, id=SAMPLED_ID.format(id=r["id"], round=args.round))
                   for r in extra] + sampled
        if args.top_up_greedy and "greedy" in args.modes:
            rehearsal = extra
    passes = (("rehearsal", "greedy", rehearsal), ("greedy", "greedy", fresh),
              ("repeat", "greedy", repeats), ("sampled", "sampled", sampled))
    for name, mode, records in passes:
        if mode not in args.modes or not records:
            continue
        left = deadline - time.perf_counter()
        if mode == "greedy" and "sampled" in args.modes:
            left -= args.sampled_share * args.gen_seconds    # the sampled mode's reserve
        if left <= 0:
            summaries[name] = {"skipped": "no time left"}
            continue
        path = os.path.join(work, f"round-{args.round}-{name}.jsonl")
        _write_jsonl(records, path)
        argv = ["generate", "--corpus", path, "--out", os.path.join(work, "shards"),
                "--modes", mode, "--max-new-tokens", str(args.max_new_tokens),
                "--batch-size", str(args.gen_batch_size), "--queue", str(args.gen_queue),
                "--batch-tokens", str(args.gen_batch_tokens),
                "--seed", str(args.round), "--temperature", str(args.temperature),
                "--seconds", str(left), "--no-progress"]
        if args.target:
            argv += ["--target", args.target]
        if args.gen_widths:
            argv += ["--widths", args.gen_widths]
        argv += ["--compile-workers", str(args.gen_compile_workers)]
        before = examples_in(os.path.join(work, "shards"))
        try:
            summaries[name] = shards._generate(shards.build_parser().parse_args(argv))
        except jax.errors.JaxRuntimeError as error:
            # the device failed the pass (e.g. out of memory): the shards it committed stay
            # and count, the other passes and the training go on
            log.exception("round %d: the %s pass failed", args.round, name)
            summaries[name] = {"failed": f"{type(error).__name__}: {str(error)[:400]}",
                               "written": examples_in(os.path.join(work, "shards")) - before}
    if replayed is not None:
        summaries["replay"] = replayed
    with open(_generate_record(work, args.round), "w") as f:   # for a later --phases train
        json.dump(summaries, f, indent=1, default=str)
    return summaries


def examples_in(shards_dir: str) -> int:
    """Examples committed to a shards directory (0 when there is none yet)."""
    from domino_jax.train.shard_store import is_shard_dir, read_manifest

    if not is_shard_dir(shards_dir):
        return 0
    return sum(int(entry["examples"]) for entry in read_manifest(shards_dir)["shards"])


def new_examples(generated: dict | None) -> int:
    """Examples of a round new to the drafter: the responses of its ``greedy`` and
    ``sampled`` passes (not ``rehearsal``'s or ``repeat``'s greedy ones, which its history
    already holds: ``--top-up-greedy``'s and the prompts a slice wrapped onto), and the
    examples ``--replay-new`` merged (``replay``: a dead branch's data, new to the drafter
    the round starts from)."""
    generated = generated or {}
    count = sum(int(generated.get(name, {}).get("written", 0)) for name in COUNTED_PASSES)
    return count + int(generated.get("replay", {}).get("added", 0))


def _generate_record(work: str, round_index: int) -> str:
    return os.path.join(work, f"round-{round_index}-generate.json")


def train_seconds_left(args, t_start: float) -> float | None:
    """The training loop's deadline (``--max-seconds``): what ``--deadline-seconds`` leaves
    after the time spent and ``--finish-seconds`` (the target's loading, the step's
    compile, the final evaluation and the export), or ``--train-args``' own
    ``--max-seconds`` if that is sooner; ``None`` without either."""
    own = None
    if "--max-seconds" in args.train_args:
        own = float(args.train_args[args.train_args.index("--max-seconds") + 1])
    if args.deadline_seconds is None:
        return own
    left = max(0.0, args.deadline_seconds - (time.perf_counter() - t_start)
               - args.finish_seconds)
    return left if own is None else min(own, left)


def train_phase(args, work: str, out: str, max_seconds: float | None = None) -> dict:
    """Train from ``--init`` on ``WORK/shards`` (within ``max_seconds`` of steps, the
    schedules fitted to them); cast, split and report."""
    from converters.hf_draft import cast_draft
    from domino_jax.train import __main__ as train_cli
    from domino_jax.train import draft_vocab
    from domino_jax.train.checkpoint_parts import split_directory
    from domino_jax.train.shard_store import ShardDataset

    run = os.path.join(work, f"round-{args.round}")
    data = os.path.join(work, "shards")
    argv = ["--data", data, "--out", run, "--drafter", "domino",
            "--steps", str(args.steps), "--batch-size", str(args.batch_size),
            "--max-length", str(args.max_length), "--lr", str(args.lr),
            "--num-anchors", str(args.num_anchors), "--seed", str(args.round),
            "--checkpoint-every", str(args.steps), "--log-every", "50",
            "--eval-prompts", os.path.join(args.corpus, "heldout.jsonl"),
            "--eval-every", "0", "--eval-num-prompts", str(args.eval_num_prompts),
            "--eval-max-new-tokens", str(args.eval_max_new_tokens),
            # every held-out prompt in one batch: one padded width, one compile per method
            "--eval-batch-size", str(args.eval_num_prompts * _kinds(args.corpus)),
            "--eval-methods", ",".join(args.eval_methods)] + args.train_args
    if args.init != FRESH:
        argv += ["--init-draft", args.init]
    if args.eval_ahead and not args.initial_eval:
        argv += ["--eval-start-in-background"]
    elif not args.initial_eval:
        argv += ["--no-eval-at-start"]
    if max_seconds is not None:
        argv += ["--max-seconds", f"{max_seconds:.1f}"]     # the last one counts
    if args.target:
        argv += ["--target", args.target]
    t0 = time.perf_counter()
    train_cli.main(argv)
    train_seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    bf16 = os.path.join(run, "draft-bf16")
    cast_draft(os.path.join(run, "draft"), bf16)
    # the token ranking for --draft-vocab, from the responses the drafter trained on
    log.info("round %d: token ranking %s", args.round,
             json.dumps(draft_vocab.write_ranking([data], bf16)))
    split_directory(bf16, os.path.join(out, "draft"), part_mib=args.part_mib)
    export_seconds = time.perf_counter() - t1
    with open(os.path.join(run, "curve.json")) as f:
        run_curve = json.load(f)
    points = run_curve["points"] if isinstance(run_curve, dict) else run_curve
    return {"run": run, "draft": bf16, "distinct_examples": len(ShardDataset(data)),
            "train_seconds": train_seconds, "export_seconds": export_seconds,
            "eval_seconds": sum(float(p.get("eval_seconds", 0.0)) for p in points),
            "tau_before": points[0]["tau"] if len(points) > 1 else None,
            "tau_after": points[-1]["tau"], "loss": points[-1].get("loss"),
            "steps": int(points[-1]["step"]),
            "wall_seconds": points[-1].get("wall_seconds")}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--round", type=int, required=True, help="round index (0, 1, ...)")
    p.add_argument("--corpus", required=True, help="corpus folder (train.jsonl, heldout.jsonl)")
    p.add_argument("--work", required=True, help="folder kept between the round's phases")
    p.add_argument("--out", required=True, help="what comes back: curve, round, drafter parts")
    p.add_argument("--phases", default="generate,train")
    p.add_argument("--init", default=None,
                   help="drafter folder to start from (train phase), or 'fresh': a new "
                        "drafter shaped by --train-args (--draft-layers, --gru-hidden-dim, "
                        "...), its curve point counting from zero (use a new --curve)")
    p.add_argument("--curve", default=None, help="the campaign curve so far (JSON list)")
    p.add_argument("--init-round", default=None, metavar="ROUND",
                   help="the curve's round whose drafter --init is (default: the last): the "
                        "new point continues its running totals and names it as its parent "
                        "(a branch from an earlier drafter, docs/design.md §27)")
    p.add_argument("--replay-new", action="store_true",
                   help="count --replay's examples as new to the drafter (a dead branch's "
                        "data, not in --init's history); set on the --replay call")
    p.add_argument("--target", default=None, help="HF target folder (default: demo SmolLM2)")
    p.add_argument("--prompts-per-round", type=int, default=16384)
    p.add_argument("--prompt-seed", type=int, default=0)
    p.add_argument("--first-round", type=int, default=0,
                   help="the first round on this --corpus: round R takes its slice R - K "
                        "(a follow-on corpus starts from its first prompt)")
    p.add_argument("--modes", default="greedy,sampled")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--sampled-share", type=float, default=0.3,
                   help="share of --gen-seconds kept for the sampled mode (default 0.3)")
    p.add_argument("--top-up", default=None, metavar="EARLIER_CORPUS",
                   help="an earlier corpus folder: its prompts, sampled afresh, fill each "
                        "kind up to the corpus's mix share (a follow-on corpus's short kinds)")
    p.add_argument("--top-up-by-source", action="store_true",
                   help="fill each kind's sources (e.g. chat templates) up to their share of "
                        "the kind in the --top-up corpus, not only the kind")
    p.add_argument("--top-up-greedy", action="store_true",
                   help="answer the --top-up prompts greedily too, before the new prompts "
                        "(rehearsal of kinds the drafter drifted from; not counted as "
                        "distinct examples)")
    p.add_argument("--self-instruct", type=int, default=0, metavar="N",
                   help="the target writes up to N new user requests (seeded by the round), "
                        "answered beside the slice's prompts: new prompts beyond the corpus "
                        "(docs/design.md §31; 0 = off)")
    p.add_argument("--exclude", action="append", default=[], metavar="FILE",
                   help="--self-instruct: drop requests sharing a word 8-gram with a text of "
                        "FILE (.jsonl or .txt, as the corpus's --exclude), e.g. an evaluation "
                        "set; repeatable")
    p.add_argument("--self-instruct-batch", type=int, default=1024)
    p.add_argument("--self-instruct-max-new-tokens", type=int, default=96)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--gen-batch-size", type=int, default=1024)
    p.add_argument("--gen-queue", type=int, default=4)
    p.add_argument("--gen-batch-tokens", type=int, default=131072, metavar="N",
                   help="a prompt width's rows at most N // width (default: 1,024 rows up to "
                        "128-token prompts, 256 rows of 512-token ones; 0: --gen-batch-size "
                        "for all)")
    p.add_argument("--gen-compile-workers", type=int, default=4, metavar="N",
                   help="compile a generate pass's programs on N threads from its start, "
                        "while its first batches decode (0: each when first needed)")
    p.add_argument("--gen-widths", default=None, metavar="W,W,..",
                   help="prompt width buckets of the self-distillation programs (default: "
                        "shards' 64,128,256,512); each width compiles its own programs, a "
                        "mode each, so a fresh machine may take fewer (docs/design.md §26)")
    p.add_argument("--gen-seconds", type=float, default=300.0)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-length", type=int, default=448)
    p.add_argument("--num-anchors", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--eval-methods", default="dflash,domino,dominotree@16,domino:T1",
                   help="each method compiles its decode program once a round (~20 s on a "
                        "GPU); ngram, the drafter-free floor, needs measuring once")
    p.add_argument("--eval-num-prompts", type=int, default=16, help="per kind")
    p.add_argument("--eval-max-new-tokens", type=int, default=64)
    p.add_argument("--part-mib", type=float, default=15.0)
    p.add_argument("--initial-eval", action="store_true",
                   help="also evaluate --init before training (the curve's last point holds "
                        "its tau when it is the last round's drafter)")
    p.add_argument("--eval-ahead", action="store_true",
                   help="evaluate --init on a thread while training starts (its tau is the "
                        "point's tau_before): the final evaluation finds its programs "
                        "compiled, so --finish-seconds can be ~100 s shorter on a fresh "
                        "machine (docs/design.md §29)")
    p.add_argument("--deadline-seconds", type=float, default=None,
                   help="the whole command's time limit (a lent machine's): training stops "
                        "in time for --finish-seconds, its schedules fitted to it")
    p.add_argument("--finish-seconds", type=float, default=240.0,
                   help="kept after training's deadline for loading, compiling, the final "
                        "evaluation and the export (default 240: a fresh GPU machine's, "
                        "docs/design.md §26)")
    p.add_argument("--replay", action="append", default=[], metavar="SHARDS_DIR",
                   help="earlier shards (e.g. an earlier session's --export-shards, joined) "
                        "merged into WORK/shards first: trained on again, their prompts not "
                        "answered again (repeatable)")
    p.add_argument("--export-shards", action="store_true",
                   help="also write WORK/shards as checksummed parts to OUT/shards, for a "
                        "later machine's --replay")
    p.add_argument("--train-args", default="", help="more `python -m domino_jax.train` flags")
    add_verbose_flag(p)
    args = p.parse_args(argv)
    args.phases = [x for x in args.phases.split(",") if x]
    args.modes = [x for x in args.modes.split(",") if x]
    args.eval_methods = [x for x in args.eval_methods.split(",") if x]
    args.train_args = args.train_args.split()
    bad = set(args.phases) - {"generate", "train"}
    if bad or not args.phases:
        p.error(f"--phases {','.join(args.phases)}: choose from generate,train")
    if "train" in args.phases and not args.init:
        p.error(f"--phases train needs --init (the drafter folder to start from, or "
                f"{FRESH!r})")
    if args.init and args.init != FRESH and not os.path.isfile(
            os.path.join(args.init, "config.json")):
        p.error(f"--init {args.init!r}: no config.json there (a drafter folder, or {FRESH!r})")
    for flag, folder in (("--corpus", args.corpus), ("--top-up", args.top_up)):
        if folder and not os.path.isfile(os.path.join(folder, "train.jsonl")):
            p.error(f"{flag} {folder!r}: no train.jsonl there")
    for folder in args.replay:
        if not os.path.isfile(os.path.join(folder, "manifest.json")):
            p.error(f"--replay {folder!r}: not a shards directory (no manifest.json; join "
                    "exported parts first: python -m domino_jax.train.parts join DIR DEST)")
    if args.init_round is not None:
        try:
            totals(read_curve(args.curve), args.init_round)
        except ValueError as e:
            p.error(f"--init-round {args.init_round}: {e}")
    if args.replay_new and not args.replay:
        p.error("--replay-new counts --replay's examples: give --replay too")
    if not 0 <= args.first_round <= args.round:
        p.error(f"--first-round {args.first_round}: must be in [0, --round {args.round}]")
    if args.self_instruct < 0:
        p.error(f"--self-instruct must be >= 0, got {args.self_instruct}")
    for path in args.exclude:
        if not os.path.isfile(path):
            p.error(f"--exclude {path!r}: no such file")
    if not 0.0 <= args.sampled_share < 1.0:
        p.error(f"--sampled-share must be in [0, 1), got {args.sampled_share}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose, fmt="%(asctime)s %(message)s")
    t_start = time.perf_counter()
    os.makedirs(args.work, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    curve = read_curve(args.curve)
    record: dict = {"round": args.round, "phases": args.phases, "argv": sys.argv[1:]}
    if args.replay:
        from domino_jax.train.shard_store import merge_shards

        record["replay"] = merge_shards(os.path.join(args.work, "shards"), args.replay)
        log.info("replayed %s: %s", ", ".join(args.replay), record["replay"])
    if "generate" in args.phases:
        t0 = time.perf_counter()
        record["generate"] = generate_phase(args, args.work,
                                            record["replay"] if args.replay_new else None)
        record["generate_seconds"] = time.perf_counter() - t0
        requests = os.path.join(args.work, f"round-{args.round}-self-instruct.jsonl")
        if args.self_instruct and os.path.isfile(requests):    # what the target asked
            shutil.copy(requests, args.out)
    if "train" in args.phases:
        record["train"] = train_phase(args, args.work, args.out,
                                      train_seconds_left(args, t_start))
        steps = record["train"]["steps"]                         # fewer on a deadline
        generated = record.get("generate")
        if generated is None and os.path.isfile(_generate_record(args.work, args.round)):
            with open(_generate_record(args.work, args.round)) as f:   # an earlier call's
                generated = json.load(f)
        if args.replay_new and "replay" in record:        # replayed by this call
            generated = dict(generated or {}, replay=record["replay"])
        if args.init == FRESH:     # its history is this round: its whole training set is new
            done = {"steps": 0, "examples_seen": 0, "distinct": 0}
            new, init = record["train"]["distinct_examples"], FRESH
        else:
            done, init = totals(curve, args.init_round), os.path.abspath(args.init)
            new = new_examples(generated)
        point = {"round": args.round, "init": init,
                 "steps_round": steps, "steps_total": done["steps"] + steps,
                 "examples_seen_total": done["examples_seen"] + steps * args.batch_size,
                 "distinct_examples": record["train"]["distinct_examples"],
                 "distinct_examples_total": done["distinct"] + new,
                 **({"parent": args.init_round} if args.init_round is not None else {}),
                 "tau_before": record["train"]["tau_before"],
                 "tau": record["train"]["tau_after"], "loss": record["train"]["loss"],
                 "seconds": {"generate": record.get("generate_seconds"),
                             "train_total": record["train"]["train_seconds"],
                             "eval": record["train"]["eval_seconds"],
                             "export": record["train"]["export_seconds"]}}
        curve.append(point)
        record["point"] = point
        with open(os.path.join(args.out, "curve.json"), "w") as f:
            json.dump(curve, f, indent=1)
    if args.export_shards:
        from domino_jax.train.checkpoint_parts import split_directory

        shutil.rmtree(os.path.join(args.out, "shards"), ignore_errors=True)   # a rerun's
        split_directory(os.path.join(args.work, "shards"), os.path.join(args.out, "shards"),
                        part_mib=args.part_mib, exclude=[".lock"])
    record["seconds"] = time.perf_counter() - t_start
    with open(os.path.join(args.out, "round.json"), "w") as f:
        json.dump(record, f, indent=1, default=str)
    log.info("round %d done in %.0f s: %s", args.round, record["seconds"],
             json.dumps(record.get("point", record.get("generate")), default=str)[:2000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
