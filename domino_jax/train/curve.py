"""The training curve: ``curve.json`` per run and plots of one or several runs.

``RUN/curve.json`` is ``{"points": [point, ...]}``, one point per held-out evaluation:

    {"step": 500, "tokens_seen": 1.2e6, "examples_seen": 16000, "loss": 2.31, "acc": 0.41,
     "lr": 5.9e-4, "tau": {"domino": {"chat": 2.4, "math": 2.9, "all": 2.6}, "dflash": {...}},
     "wall_seconds": 812.4, "eval_seconds": 9.1}

``loss`` / ``acc`` are means over the steps since the previous point (``None`` at step 0),
``tokens_seen`` counts response (loss-mask) tokens of every batch so far, ``wall_seconds``
the run's wall time so far (training and evaluation, summed over resumed sessions).
``RUN/curve.png`` is drawn after each evaluation when matplotlib is importable (the
optional extra ``pip install domino_jax[plot]``).

    python -m domino_jax.train.curve RUN_DIR [RUN_DIR ...] [--out cmp.png] [--x tokens_seen]

prints each run's points as a table and draws the runs together (loss and tau of every
method, pooled over kinds, against ``--x``: ``step``, ``tokens_seen``, ``examples_seen``,
``distinct_examples`` or ``wall_seconds``). A JSON file in place of a run folder is a
campaign curve (``python -m domino_jax.train.campaign``'s list of round points): one point per
round, at its running totals of steps, examples seen and distinct examples.

    python -m domino_jax.train.curve CAMPAIGN_CURVE.json --slope-rounds 1,2,3,4,6,7,8

prints, per method, the least-squares slope of tau against log2 of the distinct examples
over those rounds (one lineage: a dead branch left out): tau gained per doubling of the
data, the measure the campaign's stopping rule reads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Sequence

import numpy as np

CURVE_JSON = "curve.json"
CURVE_PNG = "curve.png"
X_AXES = ("step", "tokens_seen", "examples_seen", "distinct_examples", "wall_seconds")


def read_curve(run_dir: str) -> list[dict]:
    """The points of ``run_dir/curve.json`` (``[]`` when there is none yet)."""
    path = os.path.join(run_dir, CURVE_JSON)
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        try:
            return list(json.load(f)["points"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a curve file ({e})") from e


def campaign_points(path: str) -> list[dict]:
    """A campaign curve file's rounds as curve points (``step``, ``examples_seen`` and
    ``distinct_examples``: the running totals; ``tau``; ``loss``)."""
    with open(path) as f:
        try:
            rounds = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a campaign curve ({e})") from e
    if not isinstance(rounds, list) or not all(isinstance(r, dict) and "tau" in r
                                               for r in rounds):
        raise ValueError(f"{path}: not a campaign curve (expected a JSON list of round "
                         "points, each with 'tau')")
    return [{"round": r.get("round"), "step": r.get("steps_total"),
             "examples_seen": r.get("examples_seen_total"),
             "distinct_examples": r.get("distinct_examples_total", r.get("distinct_examples")),
             "loss": r.get("loss"), "tau": r["tau"], "parent": r.get("parent")}
            for r in rounds]


def campaign_lineages(points: Sequence[dict]) -> list[list[dict]]:
    """A campaign curve's points split into lineages, for drawing. A point's parent (the
    drafter it was trained from) is its ``parent`` round where it names one; otherwise a
    point whose ``step`` total is above the last point's continues that line, and one whose
    total is not is a branch led by the earlier point with the largest step total below its
    own. A point continues the last line when its parent ends that line; otherwise it begins
    a new line, led by its parent."""
    lineages: list[list[dict]] = []
    for i, point in enumerate(points):
        if point.get("parent") is not None:
            parent = next((p for p in reversed(points[:i])
                           if str(p.get("round")) == str(point["parent"])), None)
        elif lineages and (point.get("step") or 0) > (lineages[-1][-1].get("step") or 0):
            parent = lineages[-1][-1]
        else:
            parents = [p for p in points[:i] if (p.get("step") or 0) < (point.get("step") or 0)]
            parent = max(parents, key=lambda p: p.get("step") or 0, default=None)
        if lineages and parent is not None and lineages[-1][-1] is parent:
            lineages[-1].append(point)
        else:
            lineages.append(([parent] if parent is not None else []) + [point])
    return lineages


def slope_per_doubling(points: Sequence[dict], method: str, kind: str = "all") -> float:
    """Least-squares slope of ``tau[method][kind]`` against ``log2(distinct_examples)`` over
    ``points`` (at least two distinct x values): tau gained per doubling of the data."""
    rows = [(math.log2(p["distinct_examples"]), p["tau"][method][kind]) for p in points
            if p.get("distinct_examples") and kind in (p.get("tau") or {}).get(method, {})]
    if len({x for x, _ in rows}) < 2:
        raise ValueError(f"tau {method}/{kind}: fewer than two points with distinct "
                         "distinct_examples to fit a slope")
    xs, ys = zip(*rows)
    return float(np.polyfit(xs, ys, 1)[0])


def select_rounds(points: Sequence[dict], rounds: Sequence[str]) -> list[dict]:
    """``points`` whose ``round`` is named in ``rounds`` (compared as text), in that order;
    an unknown name is a ``ValueError``."""
    by_name = {str(p.get("round")): p for p in points}
    missing = [r for r in rounds if r not in by_name]
    if missing:
        raise ValueError(f"no round {', '.join(missing)} in the curve (it has "
                         f"{', '.join(by_name)})")
    return [by_name[r] for r in rounds]


def format_slopes(points: Sequence[dict], kind: str = "all") -> str:
    """One line per method: its slope per doubling over ``points`` and the points' span."""
    lines = [f"tau ({kind}) per doubling of distinct examples over rounds "
             f"{', '.join(str(p.get('round')) for p in points)} "
             f"({points[0]['distinct_examples']:,} to {points[-1]['distinct_examples']:,}):"]
    for method in _methods([("", list(points))]):
        try:
            lines.append(f"  {method}: {slope_per_doubling(points, method, kind):+.3f}")
        except ValueError as e:
            lines.append(f"  {method}: - ({e})")
    return "\n".join(lines)


def write_curve(run_dir: str, points: Sequence[dict]) -> None:
    """Atomically (re)write ``run_dir/curve.json``."""
    path = os.path.join(run_dir, CURVE_JSON)
    with open(path + ".tmp", "w") as f:
        json.dump({"points": list(points)}, f, indent=1)
    os.replace(path + ".tmp", path)


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _methods(runs: Sequence[tuple[str, list[dict]]]) -> list[str]:
    names: dict[str, None] = {}
    for _, points in runs:
        for p in points:
            names.update(dict.fromkeys(p.get("tau") or {}))
    return list(names)


def plot_curves(runs: Sequence[tuple[str, list[dict]]], out_png: str, x: str = "step",
                kind: str = "all") -> None:
    """Loss and tau (``kind``, default pooled) per method against ``x``, one line per run
    (``runs``: ``(label, points)``). Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = _methods(runs)
    fig, axes = plt.subplots(1, 1 + len(methods), figsize=(5 * (1 + len(methods)), 3.8),
                             squeeze=False)
    loss_ax = axes[0, 0]
    for label, points in runs:
        xs = [p.get(x) for p in points if p.get("loss") is not None]
        loss_ax.plot(xs, [p["loss"] for p in points if p.get("loss") is not None],
                     marker=".", label=label)
        for ax, method in zip(axes[0, 1:], methods):
            rows = [(p.get(x), p["tau"][method].get(kind)) for p in points
                    if method in (p.get("tau") or {})]
            rows = [r for r in rows if r[1] is not None]
            ax.plot([r[0] for r in rows], [r[1] for r in rows], marker="o", label=label)
    loss_ax.set(title="train loss (mean since last point)", xlabel=x, ylabel="loss")
    for ax, method in zip(axes[0, 1:], methods):
        ax.set(title=f"held-out tau: {method} ({kind})", xlabel=x, ylabel="tau")
    for ax in axes[0]:
        ax.grid(alpha=0.3)
        if len(runs) > 1 or ax is not loss_ax:
            ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def plot_run(run_dir: str) -> bool:
    """Draw ``run_dir/curve.png`` from its curve when matplotlib is importable."""
    points = read_curve(run_dir)
    if not points or not have_matplotlib():
        return False
    plot_curves([(os.path.basename(os.path.abspath(run_dir)), points)],
                os.path.join(run_dir, CURVE_PNG))
    return True


def format_table(label: str, points: Sequence[dict], kind: str = "all") -> str:
    """A markdown table of one run's points (tau of ``kind`` per method)."""
    methods = _methods([(label, list(points))])
    head = ["step", "tokens_seen", "loss", "lr"] + [f"tau {m}" for m in methods] + ["wall s"]
    lines = [f"## {label}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    for p in points:
        taus = [fmt((p.get("tau") or {}).get(m, {}).get(kind), ".3f") for m in methods]
        lines.append("| " + " | ".join([str(p.get("step")), fmt(p.get("tokens_seen"), ".3g"),
                                        fmt(p.get("loss"), ".4f"), fmt(p.get("lr"), ".3g")]
                                       + taus + [fmt(p.get("wall_seconds"), ".0f")]) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m domino_jax.train.curve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders holding curve.json, or campaign "
                   "curve files (JSON)")
    p.add_argument("--out", default=None, help="PNG to draw (default: curves.png beside "
                   "the first run, or RUN/curve.png for one run)")
    p.add_argument("--x", choices=X_AXES, default="step")
    p.add_argument("--kind", default="all", help="tau of this prompt kind (default: pooled)")
    p.add_argument("--slope-rounds", default=None, metavar="R,R,...",
                   help="campaign curve: also print each method's tau gained per doubling of "
                        "the distinct examples over these rounds (one lineage)")
    args = p.parse_args(argv)
    runs = []
    for run in args.runs:
        try:
            points = campaign_points(run) if os.path.isfile(run) else read_curve(run)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2)
        if not points:
            print(f"error: {os.path.join(run, CURVE_JSON)} not found or empty (train with "
                  "--eval-prompts to write it)", file=sys.stderr)
            raise SystemExit(2)
        runs.append((os.path.basename(os.path.abspath(run)) or run, points))
    for label, points in runs:
        print(format_table(label, points, args.kind) + "\n")
    if args.slope_rounds:
        for run, (label, points) in zip(args.runs, runs):
            try:
                chosen = select_rounds(points, [r.strip() for r in
                                                args.slope_rounds.split(",") if r.strip()])
            except ValueError as e:
                print(f"error: {run}: {e}", file=sys.stderr)
                raise SystemExit(2)
            print(f"{label}: {format_slopes(chosen, args.kind)}\n")
    if not have_matplotlib():
        print("no plot: matplotlib is not installed (pip install 'domino_jax[plot]')",
              file=sys.stderr)
        return
    out = args.out or (os.path.join(args.runs[0], CURVE_PNG)
                       if len(runs) == 1 and os.path.isdir(args.runs[0]) else
                       os.path.join(os.path.dirname(os.path.abspath(args.runs[0])),
                                    "curves.png"))
    lines = []      # a campaign curve's branches drawn as lines of their own
    for run, (label, points) in zip(args.runs, runs):
        lineages = campaign_lineages(points) if os.path.isfile(run) else [points]
        lines += ([(label, points)] if len(lineages) == 1 else
                  [(f"{label}: rounds {ln[0]['round']}-{ln[-1]['round']}", ln)
                   for ln in lineages])
    plot_curves(lines, out, args.x, args.kind)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
