"""Long-run plumbing on the real SmolLM2 target, end to end at toy scale (any device).

corpus (small build) -> shards (the target's greedy answers) -> training streamed from the
shards with held-out tau from the real decode loop -> the same run interrupted, split into
parts, joined, resumed with ``resume_from`` -> the exported drafters compared by sha256
(an exact resume gives identical bytes). Also records checkpoint sizes and the parts a run
needs for the lent GPU machine's transfers (``--part-mib 15 --group-files 8 --group-mib
64``). Writes ``train_longrun_check_<date>.{json,md}`` into ``--out``.

    python benchmarks/train_longrun_check.py [--work /tmp/longrun] [--steps 6]

This is a plumbing check (6 steps: the drafter learns nothing); the numbers that matter are
``identical``, the sizes and the seconds.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def sh(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, check=True,
                         capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/domino_longrun_check")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "benchmarks",
                                                                          "results"))
    args = p.parse_args()
    import shutil

    import jax

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_smollm2 import git_commit
    from domino_jax.demo_model import demo_target_dir
    from domino_jax.train import checkpoint_parts as parts
    from domino_jax.train.config import TrainConfig
    from domino_jax.train.evaluate import EvalConfig
    from domino_jax.train.loop import train

    commit = git_commit()                       # the code that runs (read before it runs)
    shutil.rmtree(args.work, ignore_errors=True)
    w = lambda *names: os.path.join(args.work, *names)
    seconds = {}
    t = time.perf_counter()
    sh("domino_jax.train.corpus", "--out", w("corpus"), "--num-prompts", "1000", "--seed", "0")
    sh("domino_jax.train.shards", "generate", "--corpus", w("corpus", "train.jsonl"), "--out",
       w("shards"), "--modes", "greedy", "--max-new-tokens", "64", "--batch-size", "16",
       "--limit", "32", "--widths", "256", "--dtype", "float32", "--no-progress")
    seconds["corpus_and_shards"] = time.perf_counter() - t
    cfg = TrainConfig(drafter="domino", steps=args.steps, batch_size=4, max_length=256,
                      num_anchors=16, compute_dtype="float32", checkpoint_every=2, log_every=1)
    ev = EvalConfig(prompts=w("corpus", "heldout.jsonl"), every=3, max_new_tokens=16,
                    num_prompts=1)
    common = dict(draft_layers=2, block_size=16, gru_hidden_dim=256, emb_dim=64,
                  eval_config=ev, keep_checkpoints=2, keep_best=True, progress=False)
    target = demo_target_dir()
    t = time.perf_counter()
    full = train(cfg, target, w("shards"), w("full"), **common)
    seconds["full_run"] = time.perf_counter() - t
    t = time.perf_counter()
    train(cfg, target, w("shards"), w("cut"), stop_after=args.steps // 2 + 1, export=False,
          **common)
    seconds["interrupted_run"] = time.perf_counter() - t
    split = dict(part_mib=15, group_files=8, group_mib=64)
    plans = {"whole run": parts.plan_split(w("full"), **split),
             "latest checkpoint only": parts.plan_split(
                 w("full"), **split, exclude=parts.latest_only_excludes(w("full"))
                 + ["draft*"]),
             "draft/ export": parts.plan_split(w("full", "draft"), **split)}
    t = time.perf_counter()
    parts.split_directory(w("cut"), w("parts"), exclude=parts.latest_only_excludes(w("cut")),
                          **split)
    parts.join_parts(w("parts"), w("joined"))
    seconds["split_and_join"] = time.perf_counter() - t
    t = time.perf_counter()
    resumed = train(cfg, target, w("shards"), w("resumed"), resume_from=w("joined"), **common)
    seconds["resumed_run"] = time.perf_counter() - t
    digest = {name: sha256(w(name, "draft", "model.safetensors")) for name in ("full", "resumed")}
    strip = lambda c: [{k: v for k, v in q.items() if k not in ("wall_seconds", "eval_seconds")}
                       for q in c]
    step_dir = max(os.listdir(w("full", "checkpoints")), key=int)
    ckpt_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in
                     os.walk(w("full", "checkpoints", step_dir)) for f in fs)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    result = dict(
        date=stamp, commit=commit, device=str(jax.devices()[0].device_kind),
        jax=jax.__version__, steps=args.steps,
        identical_draft_sha256=digest["full"] == digest["resumed"], draft_sha256=digest,
        identical_curve=strip(full.curve) == strip(resumed.curve), curve=full.curve,
        checkpoint_step_bytes=ckpt_bytes, parts_plans=plans, seconds=seconds)
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"train_longrun_check_{stamp}")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# Long-run plumbing check, SmolLM2-135M target ({result['device']}, commit "
             f"{result['commit']}, {stamp})", "",
             "`python benchmarks/train_longrun_check.py` (corpus 1000 prompts -> 32 greedy "
             f"shards examples -> {args.steps} steps, eval every 3, interrupted after step "
             f"{args.steps // 2 + 1}, split/join, resume_from).", "",
             f"- resumed drafter export identical (sha256): **{result['identical_draft_sha256']}**;"
             f" curve identical: **{result['identical_curve']}**",
             f"- one checkpoint step: {ckpt_bytes / 2**20:.1f} MiB", ""]
    lines += ["| what | stream MiB | parts | transfers |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['stream_bytes'] / 2**20:.1f} | {v['parts']} | {v['transfers']} |"
              for k, v in plans.items()]
    lines += ["", "| stage | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.0f} |" for k, v in seconds.items()]
    lines += ["", "| step | tokens seen | loss | " + " | ".join(
        f"tau {m}" for m in full.curve[-1]["tau"]) + " |", "|---|---|---|" + "---|" *
        len(full.curve[-1]["tau"])]
    for q in full.curve:
        lines.append(f"| {q['step']} | {q['tokens_seen']} | "
                     f"{'-' if q['loss'] is None else format(q['loss'], '.3f')} | " + " | ".join(
                         f"{q['tau'][m]['all']:.3f}" for m in q["tau"]) + " |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not (result["identical_draft_sha256"] and result["identical_curve"]):
        raise SystemExit("resume was not exact")


if __name__ == "__main__":
    main()
