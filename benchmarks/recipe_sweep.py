"""The recipe sweep: training options compared at equal compute.

Every variant trains a fresh Domino drafter on the same shards with the same schedule (steps,
batch, sequence length, learning rate, seed) and differs from the base recipe (the shipped
drafter's: 2 draft layers, block 16, GRU 256, embedding 64, hard labels, decay position
weights, the base-anchored curriculum from lambda 1, random init) in ONE option. Tau on the
held-out split (the trainer's evaluator: the real decode loop, greedy) decides.

    python benchmarks/recipe_sweep.py run --data SHARDS --heldout heldout.jsonl --out SWEEP \
        [--variants base,layers1,...] [--parallel 4] [--steps 600] [--deadline 540]
    python benchmarks/recipe_sweep.py report SWEEP [--out results/recipe_sweep_DATE]

``run`` starts up to ``--parallel`` trainers at once (one GPU shared: each gets
``--mem-fraction`` of its memory; small drafters leave the device idle between kernels, so
several runs share it better than one after another) and stops them at ``--deadline``
seconds; a stopped variant resumes exactly from its last checkpoint (``--resume``, same
schedule) when ``run`` is called again, a finished one (``SWEEP/NAME/draft/`` exported) is
skipped. ``report`` writes the table (final tau per method and kind, the loss, the step time)
as Markdown and JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# name -> (what differs from the base recipe, trainer flags)
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "base": ("the shipped recipe", []),
    "layers1": ("1 draft layer", ["--draft-layers", "1"]),
    "layers3": ("3 draft layers", ["--draft-layers", "3"]),
    "layers5": ("5 draft layers (the reference Qwen3-8B drafter's depth)", ["--draft-layers", "5"]),
    "soft": ("soft labels: KL to the target's distribution", ["--labels", "soft"]),
    "mix": ("0.5 CE + 0.5 KL", ["--labels", "mix"]),
    "init_last": ("draft layers from the target's last 2", ["--init-draft-from-target", "last"]),
    "init_spread": ("draft layers from 2 target layers spread over the depth",
                    ["--init-draft-from-target", "spread"]),
    "uniform": ("uniform position weights", ["--position-weights", "uniform"]),
    "no_curriculum": ("lambda 0: the final logits' loss only from step 1",
                      ["--lambda-start", "0"]),
    "gru512": ("GRU 512, embedding 128", ["--gru-hidden-dim", "512", "--emb-dim", "128"]),
    "block8": ("block 8", ["--block-size", "8"]),
}
DEFAULT_VARIANTS = "base,layers1,layers3,soft,mix,init_last,uniform,no_curriculum"


def finished(run_dir: str) -> bool:
    return os.path.isfile(os.path.join(run_dir, "draft", "config.json"))


def started(run_dir: str) -> bool:
    ckpt = os.path.join(run_dir, "checkpoints")
    return os.path.isdir(ckpt) and any(n.isdigit() for n in os.listdir(ckpt))


def trainer_command(args, name: str) -> list[str]:
    run_dir = os.path.join(args.out, name)
    cmd = [sys.executable, "-m", "domino_jax.train", "--data", args.data, "--out", run_dir,
           "--drafter", "domino", "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           "--max-length", str(args.max_length), "--checkpoint-every", str(args.checkpoint_every),
           "--eval-prompts", args.heldout, "--eval-every", "0",
           "--eval-num-prompts", str(args.eval_num_prompts),
           "--eval-max-new-tokens", str(args.eval_max_new_tokens),
           "--eval-methods", args.eval_methods, "--seed", str(args.seed), "--no-progress",
           "--micro-batches", str(args.micro_batches)]
    cmd += VARIANTS[name][1]
    if started(run_dir):
        cmd.append("--resume")
    return cmd


def run(args) -> int:
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"error: unknown variant(s) {unknown}; known: {sorted(VARIANTS)}")
    os.makedirs(args.out, exist_ok=True)
    todo = [n for n in names if not finished(os.path.join(args.out, n))]
    print(f"[sweep] {len(names) - len(todo)} finished, to run: {todo}", flush=True)
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=str(args.mem_fraction),
               PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    running: list[tuple[str, subprocess.Popen, object]] = []
    while todo or running:
        while todo and len(running) < args.parallel:
            name = todo.pop(0)
            cmd = trainer_command(args, name)
            os.makedirs(os.path.join(args.out, name), exist_ok=True)
            log = open(os.path.join(args.out, name, "sweep.log"), "a")
            print(f"[sweep] start {name}: {' '.join(cmd[2:])}", flush=True)
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
            running.append((name, proc, log))
        time.sleep(5)
        for item in list(running):
            name, proc, log = item
            if proc.poll() is not None:
                log.close()
                running.remove(item)
                print(f"[sweep] {name} exited {proc.returncode} at {time.monotonic() - t0:.0f} s",
                      flush=True)
        if time.monotonic() - t0 > args.deadline:
            for name, proc, log in running:
                proc.terminate()
                proc.wait(timeout=30)
                log.close()
                print(f"[sweep] {name} stopped at the deadline (resumes next call)", flush=True)
            return 3
    return 0


def summarize(run_dir: str) -> dict | None:
    """Final held-out tau, loss, accuracy and step time of one run folder (None if it has
    no curve yet). ``loss`` is the last logged step's (not comparable across ``--labels``
    modes: KL and CE differ); ``acc_mean`` (argmax = data token, mean over the block) is."""
    curve_path = os.path.join(run_dir, "curve.json")
    if not os.path.isfile(curve_path):
        return None
    with open(curve_path) as f:
        points = json.load(f)["points"]
    last = points[-1]
    with open(os.path.join(run_dir, "train_config.json")) as f:
        planned = json.load(f)["train"]["steps"]
    rows = []
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(metrics_path):
        with open(metrics_path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    steps = [r["step_time"] for r in rows[1:] if "step_time" in r]   # row 0 holds the compile
    final = rows[-1] if rows else {}
    return {"step": last["step"], "planned_steps": planned, "finished": last["step"] >= planned,
            "tokens_seen": last["tokens_seen"], "loss": final.get("loss"),
            "acc_mean": final.get("acc_mean"), "tau": last["tau"],
            "median_step_seconds": statistics.median(steps) if steps else None}


def report(args) -> int:
    rows = {}
    for name in sorted(os.listdir(args.sweep)):
        if name in VARIANTS:
            s = summarize(os.path.join(args.sweep, name))
            if s is not None:
                rows[name] = s
    if not rows:
        raise SystemExit(f"error: no run with a curve.json under {args.sweep}")
    kinds = sorted({k for s in rows.values() for k in s["tau"].get("domino", {}) if k != "all"})
    lines = ["| variant | what differs | steps | loss | acc | s/step | DFlash all | Domino all | "
             + " | ".join(kinds) + " | ngram all |", "|---" * (9 + len(kinds)) + "|"]
    order = sorted(rows, key=lambda n: -rows[n]["tau"].get("domino", {}).get("all", 0.0))
    for name in order:
        s = rows[name]
        tau = s["tau"]
        dom = tau.get("domino", {})
        cells = [name, VARIANTS[name][0], str(s["step"]) + ("" if s["finished"] else " (cut)"),
                 f"{s['loss']:.3f}" if s["loss"] is not None else "-",
                 f"{s['acc_mean']:.3f}" if s["acc_mean"] is not None else "-",
                 f"{s['median_step_seconds']:.2f}" if s["median_step_seconds"] else "-",
                 f"{tau.get('dflash', {}).get('all', float('nan')):.2f}",
                 f"**{dom.get('all', float('nan')):.2f}**"]
        cells += [f"{dom.get(k, float('nan')):.2f}" for k in kinds]
        cells.append(f"{tau.get('ngram', {}).get('all', float('nan')):.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(rows, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(table + "\n")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--data", required=True)
    r.add_argument("--heldout", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--variants", default=DEFAULT_VARIANTS)
    r.add_argument("--parallel", type=int, default=4)
    r.add_argument("--mem-fraction", type=float, default=0.235)
    r.add_argument("--steps", type=int, default=400)
    r.add_argument("--batch-size", type=int, default=64)
    r.add_argument("--max-length", type=int, default=448)
    r.add_argument("--micro-batches", type=int, default=2,
                   help="gradient accumulation: one step of batch 64 x 448 needs 47-63 GiB in one "
                        "micro-batch, so 2 lets several runs share an H200")
    r.add_argument("--checkpoint-every", type=int, default=100)
    r.add_argument("--eval-num-prompts", type=int, default=8)
    r.add_argument("--eval-max-new-tokens", type=int, default=64)
    r.add_argument("--eval-methods", default="dflash,domino,ngram")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--deadline", type=float, default=540.0, help="seconds, then stop (resumable)")
    q = sub.add_parser("report")
    q.add_argument("sweep")
    q.add_argument("--out", default=None, help="path prefix for .md and .json")
    args = p.parse_args(argv)
    return run(args) if args.cmd == "run" else report(args)


if __name__ == "__main__":
    sys.exit(main())
