"""The Markdown report of a ``bench_tree_build.py`` run (from its results dict), and the
offline summary of its ``--trace`` folder (``--summarise-trace DIR``).

A trace folder holds one subfolder per variant (``rollout_pallas[rowgru]``, ``tree16_xla``,
...), each a ``jax.profiler`` trace of ``--trace-reps`` warm calls with a Perfetto JSON file
(``*perfetto_trace.json.gz``); :func:`bench_util.summarise_trace` reads it with the standard
library only. On a GPU the device's kernels are its ``/device:GPU`` processes: the Pallas
kernels appear by their ``pallas_call`` names (``domino_head_logits_argmax``,
``domino_head_state_step``, ``dominotree_depth_step``), XLA's as its fusions
(``gemm_fusion_dot_*``, ``input_reduce_fusion_*``, ...). The same folder opens in Perfetto
(ui.perfetto.dev) or TensorBoard's profile plugin for a timeline.
"""

from __future__ import annotations

import os


def _variant_rows(entries: list[dict], baseline_ms: float | None, same_key: str) -> list[str]:
    lines = []
    for e in entries:
        name = e["impl"] if e["tuning"] in ("-", "default") else f"{e['impl']}[{e['tuning']}]"
        ratio = f"{e['ms'] / baseline_ms:.2f}" if baseline_ms else "-"
        same = e.get(same_key)
        same = f"{same:.3f}" if isinstance(same, float) else ("yes" if same else "NO")
        lines.append(f"| {name} | {e['ms']:.3f} | {e['ms_pipelined_mean']:.3f} | "
                     f"{e['floor_ms']:.3f} | {e.get('pct_of_floor', 0):.0f} | {ratio} | {same} | "
                     f"{e['compile_s']:.1f} |")
    return lines


def _baseline(entries: list[dict]) -> float | None:
    return next((e["ms"] for e in entries if e["impl"] == "xla"), None)


HEADER = ("| variant | ms | pipelined ms | floor ms | % of floor | / XLA | {same} | compile s |",
          "|---|---|---|---|---|---|---|---|")


def trace_lines(name: str, summary: dict) -> list[str]:
    """One variant's trace summary (``bench_util.summarise_trace``) as Markdown."""
    if not summary.get("kernels_per_call"):
        return [f"### {name}: no {summary.get('source', '?')} events", ""]
    lines = [f"### {name}: {summary['kernels_per_call']:.0f} {summary['source']} events per "
             f"call, busy {summary['busy_us_per_call']:.1f} us of a "
             f"{summary['window_us_per_call']:.1f} us window "
             f"({100 * (summary['busy_fraction'] or 0):.0f}%)", "",
             "| kernel | launches per call | us per call | mean us |", "|---|---|---|---|"]
    lines += [f"| `{t['name']}` | {t['count']:.1f} | {t['us']:.1f} | {t['mean_us']:.2f} |"
              for t in summary["top"]]
    return lines + [""]


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [f"# Tree build per round ({m['device']}, {m['dtype']}, commit {m['commit']}; "
             f"K={m['K']}, V={m['V']}, H={m['H']}, G={m['G']}, E={m['E']}, node_topk 8, "
             f"topm 64; floors at {m['hbm_bytes_per_s'] / 1e12:.2f} TB/s)", ""]
    if m.get("tunings"):
        lines += ["Tunings: " + "; ".join(
            f"`{label}` " + (",".join(f"{k}={v}" for k, v in t.items() if v is not None)
                             or "(default)") for label, t in m["tunings"].items()), ""]
    if result.get("rollout"):
        lines += ["## Domino head rollout (K greedy steps, batch 1, own jit)", "",
                  HEADER[0].format(same="same drafts"), HEADER[1]]
        lines += _variant_rows(result["rollout"], _baseline(result["rollout"]), "same_drafts")
        lines.append("")
    if any(r.get("variants") for r in result["rows"]):
        lines += ["## DominoTree build (decode head) per depth-step variant", ""]
        for r in result["rows"]:
            lines += [f"Budget {r['budget']}:", "", HEADER[0].format(same="same tree"),
                      HEADER[1]]
            lines += _variant_rows(r["variants"], _baseline(r["variants"]), "same_tree")
            lines.append("")
    full = [r for r in result["rows"] if "dominotree_plain_head_ms" in r]
    if full:
        lines += ["| budget | DominoTree ms (decode head) | DominoTree ms (plain head) | "
                  "DDTree ms |", "|---|---|---|---|"]
        lines += [f"| {r['budget']} | {r['dominotree_decode_head_ms']:.3f} | "
                  f"{r['dominotree_plain_head_ms']:.3f} | {r['ddtree_ms']:.3f} |" for r in full]
        lines.append("")
    if result.get("topk"):
        lines += [f"Vocabulary-wide top-k over [{m['K']}, {m['V']}] float32 (every build's "
                  "setup):", "", "| k | lax.top_k ms | two-stage ms |", "|---|---|---|"]
        lines += [f"| {r['k']} | {r['lax_top_k_ms']:.3f} | "
                  + (f"{r['two_stage_ms']:.3f}" if r["two_stage_ms"] is not None else "-") + " |"
                  for r in result["topk"]]
        lines.append("")
    traced = [(e, f"rollout {e['impl']}[{e['tuning']}]") for e in result.get("rollout", [])]
    traced += [(e, f"tree {r['budget']} {e['impl']}[{e['tuning']}]")
               for r in result["rows"] for e in r.get("variants", [])]
    traced = [(e, name) for e, name in traced if "trace" in e]
    if traced:
        lines += ["## Traces (per call)", ""]
        for e, name in traced:
            lines += trace_lines(name, e["trace"])
    if result.get("skipped"):
        lines += [f"Skipped past the time budget: {', '.join(result['skipped'])}", ""]
    return "\n".join(lines)


def print_trace_summaries(folder: str, calls: int) -> None:
    """Print :func:`trace_lines` for every variant subfolder of a ``--trace`` folder
    (``calls``: the run's ``--trace-reps``)."""
    from bench_util import load_perfetto, summarise_trace

    names = sorted(n for n in os.listdir(folder) if os.path.isdir(os.path.join(folder, n)))
    if not names:
        raise SystemExit(f"no variant folders under {folder}")
    for name in names:
        try:
            trace = load_perfetto(os.path.join(folder, name))
        except FileNotFoundError as e:
            print(f"### {name}: {e}\n")
            continue
        print("\n".join(trace_lines(name, summarise_trace(trace, calls))), flush=True)
