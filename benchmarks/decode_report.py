"""The Markdown report and the plot of a ``bench_decode.py`` run (from its results dict)."""

from __future__ import annotations

from bench_util import FALLBACK_BYTES_PER_S


def markdown(r: dict) -> str:
    """The Markdown report of a ``bench_decode`` results dict."""
    lines = [f"# Decode benchmark {r['date']}", "",
             f"- device: {r['device']['kind']} ({r['device']['platform']}); commit "
             f"`{r['git_commit']}`; shape {r['shape']}, batch 1, {r['new_tokens']} new tokens",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()),
             f"- parameter layout: {r.get('layout', 'unfused')}; XLA_FLAGS: "
             f"`{r['xla_flags'] or '(none)'}`; floors at "
             f"{r.get('hbm_bytes_per_s', FALLBACK_BYTES_PER_S) / 1e12:.2f} TB/s; "
             "% = floor / measured",
             f"- random weight init: {r.get('init_seconds', float('nan')):.1f} s", ""]
    for plen_s, pr in r["prompts"].items():
        lines += [f"## prompt {plen_s}", "",
                  "| what | ms | floor ms | % of floor | c | note |", "|---|---|---|---|---|---|"]
        loops = pr.get("loops", {})
        for method, loop in loops.items():
            note = (f"{loop['decode_ms_per_token']:.3f} ms/token decode, "
                    f"{loop['generate_ms_per_token']:.3f} generate; tau {loop['tau_observed']:.2f}")
            if "projected_speedup" in loop:
                note += "; speedup at tau 4/6/8: " + "/".join(
                    f"{v:.2f}" for v in loop["projected_speedup"].values())
            lines.append(f"| {method} round (loop) | {loop['round_ms']:.3f} | "
                         f"{loop.get('floor_ms', float('nan')):.3f} | "
                         f"{loop.get('pct_of_floor', float('nan')):.0f} | "
                         f"{loop.get('c', 1.0 if method == 'ar' else float('nan')):.3f} | {note} |")
        for method, stages in pr.get("stages", {}).items():
            for name, s in stages.items():
                if not isinstance(s, dict):
                    continue
                lines.append(f"| {method} {name} (own jit) | {s['ms']:.3f} | "
                             f"{s.get('floor_ms', float('nan')):.3f} | "
                             f"{s.get('pct_of_floor', float('nan')):.0f} | | "
                             f"pipelined {s['ms_pipelined_mean']:.3f} |")
        for key, f in pr.get("forced", {}).items():
            lines.append(f"| {key} (loop) | {f['round_ms']:.3f} | | | {f.get('c', float('nan')):.3f}"
                         f" | {f['decode_ms_per_token']:.3f} ms/token, measured speedup "
                         f"{f.get('speedup_vs_ar', float('nan')):.2f} |")
        hf = r["hf"].get(plen_s)
        if hf:
            for mode in ("static", "static_eager", "dynamic"):
                m = hf.get(mode) or {}
                if m.get("ms_per_token"):
                    lines.append(f"| HF generate {mode} cache | {m['ms_per_token']:.3f} "
                                 f"ms/token | | | | HF/ours (generate) "
                                 f"{m.get('hf_over_ours_generate', float('nan')):.2f}x |")
                elif m.get("error"):
                    lines.append(f"| HF generate {mode} cache | error | | | | "
                                 f"{m['error'][:80]} |")
            if hf.get("error"):
                lines.append(f"| HF worker | error | | | | {hf['error'][:160]} |")
            if hf.get("init_s") is not None:
                lines.append(f"| HF model init (random bf16) | {1e3 * hf['init_s']:.0f} | | "
                             f"| | torch {hf.get('torch')}, transformers "
                             f"{hf.get('transformers')} |")
        lines.append("")
    if r["skipped"]:
        lines.append("Skipped (time budget): " + ", ".join(s["task"] for s in r["skipped"]))
    if r["errors"]:
        lines.append("Errors: " + "; ".join(f"{e['task']}: {e['error'][:120]}"
                                            for e in r["errors"]))
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str) -> bool:
    """A bar chart of ms/token per method (ours, the floor, projected at tau 6, HF) to
    ``path``; ``False`` when matplotlib is missing or nothing was measured."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return False
    labels, values = [], []
    for plen_s, pr in results["prompts"].items():
        loops = pr.get("loops", {})
        if "ar" in loops:
            labels.append(f"ours AR\nL={plen_s}")
            values.append(loops["ar"]["decode_ms_per_token"])
            labels.append(f"AR floor\nL={plen_s}")
            values.append(loops["ar"].get("floor_ms", 0.0))
        for m in [m for m in loops if m != "ar"]:
            if m in loops and "projected_ms_per_token" in loops[m]:
                labels.append(f"{m} @tau6\nL={plen_s}")
                values.append(loops[m]["projected_ms_per_token"]["6"])
        for mode in ("static", "static_eager", "dynamic"):
            m = (results["hf"].get(plen_s) or {}).get(mode) or {}
            if m.get("ms_per_token"):
                labels.append(f"HF {mode}\nL={plen_s}")
                values.append(m["ms_per_token"])
    if not values:
        return False
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(values)), 4))
    ax.bar(range(len(values)), values, color="tab:blue")
    ax.set_xticks(range(len(values)), labels, fontsize=7)
    ax.set_ylabel("ms / token")
    ax.set_title(f"decode, {results['device']['kind']}, batch 1")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
