"""Self-distillation throughput: ``domino_jax.train.shards`` generation on the real target.

    python benchmarks/bench_selfdistill.py --num-prompts 64 --batch-size 32 \\
        --max-new-tokens 64 --dtypes float32,bfloat16 --out benchmarks/results

Per dtype, runs of ``python -m domino_jax.train.shards generate`` (in process, each into a
fresh shards directory): ``cold`` (compiles the programs) and ``warm`` (the same prompts
again, programs cached: the steady-state rate a long run approaches); ``--phases`` picks.
Prompts: ``--corpus`` records, else the first ``--num-prompts`` of
``domino_jax.train.data.build_prompts`` written as corpus records. Reports response tokens/s
over the wall time and over the device (generate) time, compile seconds, CPU seconds and
the machine's load average (shared CPUs make every number a lower bound). Writes
``selfdistill_<device>_<date>.md`` and ``.json`` to ``--out`` (rewritten after every run, so
a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def corpus_from_build_prompts(num: int, path: str) -> str:
    from domino_jax.train.data import build_prompts

    def kind(prompt: str) -> str:
        return "code" if "```python" in prompt else "math" if "step by step" in prompt \
            else "chat"

    with open(path, "w") as f:
        for p in build_prompts(num, seed=0):
            f.write(json.dumps({"id": hashlib.sha256(p.encode()).hexdigest()[:16],
                                "kind": kind(p), "source": "train.data.build_prompts",
                                "prompt": p}) + "\n")
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--modes", default="greedy,sampled")
    p.add_argument("--widths", default="64,128,256,512")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--queues", default="1",
                   help="comma list of `shards generate --queue` values, each timed: 1 = "
                        "static batches, Q > 1 = Q x batch-size prompts through batch-size "
                        "slots with continuous batching")
    p.add_argument("--phases", default="cold,warm", choices=("cold", "cold,warm"),
                   help="cold: compiles; warm: again with the programs cached")
    p.add_argument("--target", default=None)
    p.add_argument("--git-commit", default=None)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()

    import jax

    from bench_util import git_commit, versions
    from domino_jax.train import shards

    work = tempfile.mkdtemp(prefix="selfdistill_")
    corpus = args.corpus or corpus_from_build_prompts(args.num_prompts,
                                                      os.path.join(work, "corpus.jsonl"))
    device = jax.default_backend()
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    meta = {"date": stamp, "commit": git_commit(args.git_commit), "device": device,
            "devices": [str(d) for d in jax.devices()], "cpu_count": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version(),
            "versions": versions(), "args": vars(args), "commands": []}
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"selfdistill_{device}_{stamp}")
    rows = []
    runs = [(d, int(q), ph) for d in args.dtypes.split(",") for q in args.queues.split(",")
            for ph in args.phases.split(",")]
    for dtype, queue, phase in runs:
        argv = ["generate", "--corpus", corpus,
                "--out", os.path.join(work, f"{dtype}_q{queue}_{phase}"),
                "--modes", args.modes, "--max-new-tokens", str(args.max_new_tokens),
                "--batch-size", str(args.batch_size), "--queue", str(queue),
                "--limit", str(args.num_prompts),
                "--widths", args.widths, "--dtype", dtype, "--no-progress"]
        if args.target:
            argv += ["--target", args.target]
        load_before, cpu_before = os.getloadavg()[0], time.process_time()
        summary = run_cli(shards, argv)
        cpu = time.process_time() - cpu_before
        summary.update(dtype=dtype, queue=queue, phase=phase, load_before=round(load_before, 2),
                       load_after=round(os.getloadavg()[0], 2), cpu_seconds=round(cpu, 1),
                       tokens_per_cpu_second=round(summary["response_tokens"] / cpu, 1))
        rows.append(summary)
        meta["commands"].append("python -m domino_jax.train.shards " + " ".join(argv))
        print(json.dumps(summary), flush=True)
        with open(base + ".json", "w") as f:          # rewritten after every run
            json.dump({"meta": meta, "runs": rows}, f, indent=1)
        with open(base + ".md", "w") as f:
            f.write(report(meta, rows))
    print(base + ".md")


def run_cli(shards, argv) -> dict:
    """``shards.main(argv)``'s JSON summary (its last stdout line)."""
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = shards.main(argv)
    if code != 0:
        raise SystemExit(f"shards {' '.join(argv)} exited {code}")
    return json.loads(buffer.getvalue().strip().splitlines()[-1])


def report(meta: dict, rows: list[dict]) -> str:
    lines = [f"# Self-distillation throughput ({meta['device']}, {meta['date']})", "",
         f"Commit `{meta['commit']}`; {meta['platform']}, {meta['cpu_count']} cores; "
         f"python {meta['python']}; " + ", ".join(f"{k} {v}" for k, v in
                                                   meta["versions"].items()), "",
         "Command: `python benchmarks/bench_selfdistill.py " + " ".join(
             f"--{k.replace('_', '-')} {v}" for k, v in meta["args"].items()
             if v is not None and k != "out") + "`", "",
         "Each dtype runs twice into fresh shards directories: `cold` compiles, `warm` "
         "reuses the compiled programs. tok/s counts response tokens (prompt tokens "
         "excluded); `wall` is the whole command (tokenizing, writing shards, compiling), "
         "`device` is the time inside `generate` (prefill + decode loop), `decode loop` "
         "the decode loop alone. Every batch has `--batch-size` rows padded to its "
         "width bucket, so a small corpus with a few long prompts pays for mostly-filler "
         "batches of width 256/512 (prefill dominates on a CPU).", "",
         "The CPUs are shared with other jobs: `CPU s` is this process's CPU time (all "
         "threads; it includes target loading), `tok/CPU-s` the rate per CPU-second, "
         "which contention affects less than the wall-clock rates.", "",
         "`queue` 1: static batches (each waits for its longest response); Q > 1: Q x "
         "batch-size prompts through batch-size slots, a finished row's slot refilled "
         "(continuous batching, `decode/serving.py`).", "",
         "| dtype | queue | run | examples | batches | prompt / response tokens | wall s | "
         "compile s | prefill s | decode s | tok/s (wall) | tok/s (device) | "
         "tok/s (decode loop) | CPU s | tok/CPU-s | load avg before/after |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r.get('queue', 1)} | {r['phase']} | {r['written']} | {r['batches']} | "
                 f"{r['prompt_tokens']} / {r['response_tokens']} | {r['seconds']:.1f} | "
                 f"{r['compile_seconds']:.1f} | {r['prefill_seconds']:.1f} | "
                 f"{r['decode_seconds']:.1f} | {r['tokens_per_second']:.1f} | "
                 f"{r['device_tokens_per_second']:.1f} | {r['decode_tokens_per_second']:.1f} | "
                 f"{r['cpu_seconds']:.0f} | {r['tokens_per_cpu_second']:.0f} | "
                 f"{r['load_before']} / {r['load_after']} |")
    lines += ["", "Commands run (in process, via `domino_jax.train.shards.main`):", ""]
    lines += [f"    {c}" for c in meta["commands"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
