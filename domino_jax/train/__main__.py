"""``python -m domino_jax.train``: train a DFlash or Domino drafter for a target.

    python -m domino_jax.train --target DIR --data data.npz --out runs/domino \\
        --drafter domino --draft-layers 2 --block-size 16 --gru-hidden-dim 256 --emb-dim 64 \\
        --steps 1000 --batch-size 32 --lr 6e-4 [--resume | --resume-from DIR] \\
        [--eval-prompts heldout.jsonl --eval-every 200 --keep-best]

Build the data first: ``python -m domino_jax.train.shards generate --corpus C.jsonl --out
SHARDS`` (then ``--data SHARDS``, streamed) or ``python -m domino_jax.train.data --out
data.npz``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Sequence

from domino_jax.console import add_verbose_flag, setup_logging
from domino_jax.train.distributed import (DEFAULT_HEARTBEAT_SECONDS, DISTRIBUTED_MODES,
                                          DistributedConfig)
from domino_jax.train.config import (DRAFTERS, INIT_FROM_TARGET, LABEL_MODES,
                                     POSITION_WEIGHTS, TrainConfig)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m domino_jax.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="HF target folder (default: demo SmolLM2)")
    p.add_argument("--data", required=True, help="shards directory (domino_jax.train.shards) "
                   "or .npz/.jsonl file (domino_jax.train.data)")
    # shards: select examples by label
    p.add_argument("--data-kinds", default=None,
                   help="shards only: comma list of corpus kinds to train on (default: all)")
    p.add_argument("--data-modes", default=None,
                   help="shards only: comma list of response modes, greedy,sampled (default: "
                        "all)")
    p.add_argument("--out", required=True, help="run folder (checkpoints, metrics, draft/)")
    p.add_argument("--drafter", choices=DRAFTERS, default="domino")
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gru-hidden-dim", type=int, default=256)
    p.add_argument("--emb-dim", type=int, default=64)
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="target embedding row used as the frozen mask token (default: the "
                        "tokenizer's mask token, else a spare row, else an unused special "
                        "token, else vocab_size - 1; see train/README.md)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--num-anchors", type=int, default=64)
    p.add_argument("--loss-chunk-rows", type=int, default=4096,
                   help="block slots per vocabulary chunk of the loss: the [rows, V] logits "
                        "are never stored whole (0 = one piece)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup-ratio", type=float, default=0.04)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--gamma", type=float, default=None)
    p.add_argument("--lambda-start", type=float, default=1.0)
    p.add_argument("--decay-ratio", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", help="compute dtype (masters are float32)")
    p.add_argument("--checkpoint-every", type=int, default=500)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--mesh", default="1,1,1", help="data,fsdp,tensor sizes")
    p.add_argument("--shard-drafter", action="store_true", help="fsdp-shard drafter params")
    p.add_argument("--peak-flops", type=float, default=989e12, help="per device, for MFU")
    p.add_argument("--resume", action="store_true")
    # multi-process (multi-host) runs: README "Training on several hosts"
    p.add_argument("--distributed", choices=DISTRIBUTED_MODES, default="auto",
                   help="start jax.distributed (one process per host): 'auto' (default) when "
                        "a flag below is given or the environment is a multi-process launch "
                        "(JAX_COORDINATOR_ADDRESS, SLURM / Open MPI with > 1 task, a multi-"
                        "host TPU slice); 'on': always (jax detects the cluster); 'off'")
    p.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="process 0's address, the same on every process")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None, help="0 .. num-processes - 1")
    p.add_argument("--heartbeat-timeout", type=int, default=DEFAULT_HEARTBEAT_SECONDS,
                   metavar="SECONDS", help="a process silent this long counts as dead: the "
                   "others exit with an error")
    # recipe options (train/README.md "Recipe options")
    p.add_argument("--labels", choices=LABEL_MODES, default="hard",
                   help="hard: CE on the data's tokens; soft: KL(target || draft) to the "
                        "target's own next-token distribution (no generation needed, plain "
                        "text works); mix: (1 - w) CE + w KL with w = --soft-weight")
    p.add_argument("--soft-weight", type=float, default=None,
                   help="weight of the KL term for --labels mix (default 0.5)")
    p.add_argument("--position-weights", choices=POSITION_WEIGHTS, default="decay",
                   help="decay: the paper's exp(-k/gamma) per block slot; uniform: all 1")
    p.add_argument("--init-draft-from-target", nargs="?", const="last", default="none",
                   choices=INIT_FROM_TARGET, metavar="{last,spread}",
                   help="seed the draft layers from target layers: 'last' (the bare flag: the "
                        "last L layers) or 'spread' (evenly spaced, first and last included); "
                        "default: random")
    p.add_argument("--learned-mask", action="store_true",
                   help="learn a mask_embedding instead of the target's mask row (domino_jax "
                        "only: the reference inference code ignores it; export warns)")
    p.add_argument("--init-draft", default=None, metavar="DRAFT_DIR",
                   help="fine-tune: start from this drafter (HF DFlashDraftModel folder, e.g. "
                        "a released or shipped drafter); its geometry and mask replace "
                        "--draft-layers/--block-size/--gru-hidden-dim/--emb-dim/--mask-token-id")
    p.add_argument("--grow-layers", type=int, default=None, metavar="N",
                   help="with --init-draft: grow it to N draft layers first (new layers add "
                        "nothing at the start; docs/design.md §28)")
    p.add_argument("--grow-gru-hidden-dim", type=int, default=None, metavar="G",
                   help="with --init-draft: widen its GRU to G units first")
    p.add_argument("--grow-emb-dim", type=int, default=None, metavar="E",
                   help="with --init-draft: widen its correction to E features first")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="a deadline: end the run (evaluate, checkpoint, export) after the "
                        "first step finishing this many seconds into the training loop, the "
                        "learning rate and lambda schedules fitted to the steps that fit")
    # long runs: resume from elsewhere, checkpoints kept, held-out tau (train/README.md)
    p.add_argument("--resume-from", default=None, metavar="DIR",
                   help="continue from the latest checkpoint of this run / checkpoint folder "
                        "(e.g. one joined by `python -m domino_jax.train.parts join`)")
    p.add_argument("--keep-checkpoints", type=int, default=2, help="last K kept")
    p.add_argument("--keep-best", action="store_true",
                   help="also keep OUT/best/ (highest held-out tau), exported as draft-best/")
    p.add_argument("--eval-prompts", default=None, metavar="FILE.jsonl",
                   help='held-out prompts ({"prompt", "kind"} lines, e.g. heldout.jsonl): '
                        "tau with the real decode loop, written to OUT/curve.json")
    p.add_argument("--eval-every", type=int, default=0,
                   help="steps between evaluations (0: at the start and the end only)")
    p.add_argument("--no-eval-at-start", dest="eval_at_start", action="store_false",
                   help="skip the step-0 evaluation (the starting drafter's tau is known)")
    p.add_argument("--eval-start-in-background", action="store_true",
                   help="run the step-0 evaluation on a thread while training starts: "
                        "training does not wait for it, and the last evaluation finds its "
                        "programs compiled (docs/design.md §29)")
    p.add_argument("--eval-max-new-tokens", type=int, default=32)
    p.add_argument("--eval-num-prompts", type=int, default=8, help="prompts per kind")
    p.add_argument("--eval-methods", default=None,
                   help="comma list of dflash,domino,ddtree,dominotree (ddtree@BUDGET) and "
                        "ngram (prompt lookup, the floor; evaluated once); default: "
                        "dflash,domino for a Domino drafter, dflash for DFlash")
    p.add_argument("--eval-batch-size", type=int, default=None,
                   help="decode rows per batch (default: all prompts, at most 64)")
    add_verbose_flag(p)
    args = p.parse_args(argv)
    try:
        args.eval_config = eval_config_from_args(args)
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    if args.keep_checkpoints < 1:
        p.error(f"--keep-checkpoints must be >= 1, got {args.keep_checkpoints}")
    if args.keep_best and args.eval_prompts is None:
        p.error("--keep-best ranks checkpoints by held-out tau: give --eval-prompts FILE")
    return args


def eval_config_from_args(args: argparse.Namespace):
    """The run's :class:`EvalConfig` (``None`` without ``--eval-prompts``); the prompts file
    is read once here so a bad one fails before any model is loaded."""
    from domino_jax.train.evaluate import EvalConfig, read_eval_prompts

    if args.eval_prompts is None:
        return None
    methods = None
    if args.eval_methods:
        methods = tuple(m.strip() for m in args.eval_methods.split(",") if m.strip())
        if args.drafter == "dflash" and any(m.split("@")[0] in ("domino", "dominotree")
                                            for m in methods):
            raise ValueError(f"--eval-methods {args.eval_methods}: domino / dominotree need "
                             "a Domino drafter (--drafter dflash trains plain DFlash)")
    read_eval_prompts(args.eval_prompts, 1)
    return EvalConfig(prompts=args.eval_prompts, every=args.eval_every,
                      max_new_tokens=args.eval_max_new_tokens,
                      num_prompts=args.eval_num_prompts, methods=methods,
                      batch_size=args.eval_batch_size, at_start=args.eval_at_start,
                      start_in_background=args.eval_start_in_background)


def with_recipe_options(cfg: TrainConfig, args: argparse.Namespace) -> TrainConfig:
    """``cfg`` with the recipe flags; a bad combination exits 2 naming the option."""
    def fail(msg: str):
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)

    weight = 0.5 if args.soft_weight is None else args.soft_weight
    if args.soft_weight is not None and args.labels != "mix":
        fail(f"--soft-weight applies to --labels mix (got --labels {args.labels})")
    if not 0.0 <= weight <= 1.0:
        fail(f"--soft-weight {weight} must be in [0, 1]")
    if args.init_draft is not None:
        if args.init_draft_from_target != "none" or args.learned_mask:
            fail("--init-draft takes the drafter's weights and mask from its folder: it "
                 "excludes --init-draft-from-target and --learned-mask")
        if not os.path.isfile(os.path.join(args.init_draft, "config.json")):
            fail(f"--init-draft {args.init_draft!r}: no config.json there (expected a drafter "
                 "folder in the HF DFlashDraftModel format)")
    grow = {"--grow-layers": args.grow_layers, "--grow-gru-hidden-dim": args.grow_gru_hidden_dim,
            "--grow-emb-dim": args.grow_emb_dim}
    if args.init_draft is None and any(v is not None for v in grow.values()):
        fail(f"{', '.join(k for k, v in grow.items() if v is not None)} grows a trained "
             "drafter: give it with --init-draft DIR")
    return dataclasses.replace(cfg, labels=args.labels, soft_weight=weight,
                               position_weights=args.position_weights,
                               init_from_target=args.init_draft_from_target,
                               learned_mask=args.learned_mask, init_draft=args.init_draft,
                               grow_layers=args.grow_layers,
                               grow_gru_hidden_dim=args.grow_gru_hidden_dim,
                               grow_emb_dim=args.grow_emb_dim)


def start_distributed(args: argparse.Namespace) -> bool:
    """``jax.distributed.initialize`` from the flags / environment (before any backend is
    used; bad flags exit 2); returns whether this is process 0. Other processes log only
    warnings."""
    import logging

    from domino_jax.console import OUR_LOGGERS
    from domino_jax.train.distributed import initialize, is_primary

    try:
        initialize(DistributedConfig(args.distributed, args.coordinator_address,
                                     args.num_processes, args.process_id,
                                     args.heartbeat_timeout))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    if not is_primary():
        logging.getLogger().setLevel(logging.WARNING)
        for name in OUR_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    return is_primary()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging(args.verbose, fmt="%(asctime)s %(message)s")
    primary = start_distributed(args)
    data, fsdp, tensor = (int(x) for x in args.mesh.split(","))
    cfg = TrainConfig(drafter=args.drafter, steps=args.steps, batch_size=args.batch_size,
                      micro_batches=args.micro_batches, max_length=args.max_length,
                      num_anchors=args.num_anchors, loss_chunk_rows=args.loss_chunk_rows,
                      lr=args.lr, warmup_ratio=args.warmup_ratio,
                      weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                      gamma=args.gamma, lambda_start=args.lambda_start,
                      decay_ratio=args.decay_ratio, seed=args.seed, compute_dtype=args.dtype,
                      checkpoint_every=args.checkpoint_every, log_every=args.log_every,
                      mesh_data=data, mesh_fsdp=fsdp, mesh_tensor=tensor,
                      shard_drafter=args.shard_drafter, peak_flops=args.peak_flops)
    cfg = with_recipe_options(cfg, args)
    from domino_jax.train.loop import train

    target_dir = args.target
    if target_dir is None:
        from domino_jax.demo_model import demo_target_dir
        target_dir = demo_target_dir()
    examples = None
    if args.data_kinds or args.data_modes:
        from domino_jax.train.data import load_dataset

        split = lambda text: text.split(",") if text else None
        examples = load_dataset(args.data, split(args.data_kinds), split(args.data_modes))
    from domino_jax.train.checkpoints import RunError

    try:
        result = train(cfg, target_dir, args.data, args.out, args.draft_layers, args.block_size,
                       args.gru_hidden_dim, args.emb_dim, args.mask_token_id, args.resume,
                       examples=examples, progress=not args.no_progress,
                       eval_config=args.eval_config, keep_checkpoints=args.keep_checkpoints,
                       keep_best=args.keep_best, resume_from=args.resume_from,
                       max_seconds=args.max_seconds)
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    if not primary:
        return
    last = result.history[-1] if result.history else {}
    print(json.dumps({"drafter": cfg.drafter, "steps": cfg.steps, "seconds": round(result.seconds, 1),
                      "final_loss": last.get("loss"), "acc": last.get("acc"),
                      "heldout_tau": result.curve[-1]["tau"] if result.curve else None,
                      "mfu": last.get("mfu"), "tokens_per_second": last.get("tokens_per_second"),
                      "export_dir": result.export_dir, "config": dataclasses.asdict(cfg)}))


if __name__ == "__main__":
    main()
