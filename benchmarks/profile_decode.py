"""Where a decode step's time goes: a ``jax.profiler`` trace of the round loop, summarised.

Builds the same random-weight Qwen3-8B models as ``bench_decode.py`` (its ``Bench``), runs
one warm-up ``generate`` per method, then traces one more under ``jax.profiler.trace`` with
a Perfetto JSON trace, and summarises the device events of the traced window:

* busy time (union of kernel intervals) over the window's span: the rest is gaps between
  kernels (launch latency, host round trips, loop-condition copies);
* kernels per generated token, and the top kernels by total time (name, count, mean us).

On a CPU (``--tiny``) there are no device kernels; the summary then covers the XLA host
events, which is enough to test the script.

    python benchmarks/profile_decode.py --methods ar,domino --prompt-len 512 --new-tokens 64
    python benchmarks/profile_decode.py --tiny --methods ar         # CPU smoke test

Writes ``profile_<stamp>.json`` / ``.md`` (and the raw ``trace/`` folder) into ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import datetime as _dt
import glob
import gzip
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="ar,domino")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--top", type=int, default=25, help="kernels listed per method")
    p.add_argument("--layout", choices=("fused", "unfused"), default="fused")
    p.add_argument("--attention", default="xla",
                   help="attention over the caches, as bench_decode.py --attention")
    p.add_argument("--git-commit", default=None)
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    return p.parse_args(argv)


def _intervals_busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    busy, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy


def _process_names(events: list) -> dict:
    """``pid -> process name`` from a trace's metadata events."""
    return {e.get("pid"): e.get("args", {}).get("name", "") for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"}


def device_events(trace: dict) -> tuple[list, str]:
    """The complete (``ph: X``) events of the processes whose name mentions a GPU/TPU device,
    and ``"device"``; without any such process, every complete event and ``"host"``."""
    events = trace.get("traceEvents", [])
    device_pids = {pid for pid, n in _process_names(events).items()
                   if any(t in n.lower() for t in ("/device:gpu", "/device:tpu", "gpu:", "stream"))}
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if device_pids:
        return [e for e in complete if e.get("pid") in device_pids], "device"
    return complete, "host"


def summarise_trace(trace: dict, top: int) -> dict:
    """Device-side kernel events of a Perfetto/Chrome trace (``traceEvents`` with ``ph: X``,
    ``ts``/``dur`` in us; :func:`device_events`: without device processes, the host's XLA
    events are used)."""
    kernels, source = device_events(trace)
    if not kernels:
        return {"source": source, "kernels": 0}
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels]
    window = max(e for _, e in spans) - min(s for s, _ in spans)
    busy = _intervals_busy(spans)
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in kernels:
        by_name[e.get("name", "?")].append(float(e["dur"]))
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    return {"source": source, "kernels": len(kernels), "window_us": window, "busy_us": busy,
            "busy_fraction": busy / window if window else None,
            "top": [{"name": n[:120], "count": len(d), "total_us": sum(d),
                     "mean_us": sum(d) / len(d), "share": sum(d) / max(busy, 1e-9)}
                    for n, d in ranked[:top]]}


def kernel_classes(trace: dict, per: int) -> dict:
    """Device time per ``per`` (rounds or calls of the traced window), us, by kind of kernel:
    ``per_layer_products`` / ``per_layer_other`` (kernels that run >= 30 times per ``per``:
    one per target layer, so the verify's or AR step's layers), ``other_products`` /
    ``other_fusions`` (the rest: LM heads, the drafter's layers, small fusions), ``memcpy``
    (device-to-device copies); products are cuBLAS/nvjet/cutlass calls and XLA gemm fusions.
    A trace without device processes (the CPU) gives ``{}``."""
    kernels, source = device_events(trace)
    if source != "device":
        return {}
    total: dict[str, float] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    for e in kernels:
        total[e["name"]] += float(e["dur"])
        count[e["name"]] += 1
    classes: dict[str, float] = collections.Counter()
    for name, us in total.items():
        product = any(t in name.lower() for t in ("nvjet", "gemm", "cublas", "cutlass"))
        if name.startswith("Memcpy"):
            kind = "memcpy"
        elif count[name] >= 30 * per:
            kind = "per_layer_products" if product else "per_layer_other"
        else:
            kind = "other_products" if product else "other_fusions"
        classes[kind] += us / per
    return {k: round(v, 1) for k, v in sorted(classes.items())}


def profile_summary(directory: str, top: int = 30) -> list:
    """The ``top`` events of the trace under ``directory`` (:func:`load_perfetto`) by summed
    duration, every process: ``[us, process, name]`` (host threads and device streams)."""
    events = load_perfetto(directory).get("traceEvents", [])
    process = _process_names(events)
    total = collections.Counter()
    for e in events:
        if e.get("ph") == "X":
            total[(process.get(e["pid"], str(e["pid"])), e["name"][:90])] += e.get("dur", 0)
    return [[round(us, 1), proc, name] for (proc, name), us in total.most_common(top)]


def load_perfetto(trace_dir: str) -> dict:
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
                   + glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                               recursive=True))
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz / perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(files[-1], "rt") as f:
        return json.load(f)


def main(argv=None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, HERE)
    bench_args = ["--methods", args.methods, "--prompt-lens", str(args.prompt_len),
                  "--new-tokens", str(args.new_tokens), "--skip-hf", "--out", args.out,
                  "--layout", args.layout, "--attention", args.attention]
    if args.tiny:
        bench_args.append("--tiny")
    if args.git_commit:
        bench_args += ["--git-commit", args.git_commit]
    import bench_decode                    # builds no model at import time
    bargs = bench_decode.parse_args(bench_args)
    bench_decode.setup_env(bargs)
    import jax

    bench = bench_decode.Bench(bargs)
    bench.build_models()
    stamp = _dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    vocab = bench.tcfg.vocab_size
    report = {"date": stamp, "git_commit": bench.results["git_commit"],
              "device": bench.results["device"], "versions": bench.results["versions"],
              "prompt_len": args.prompt_len, "layout": args.layout, "attention": args.attention,
              "new_tokens": args.new_tokens, "methods": {}}
    lines = [f"# Decode profile {stamp} ({report['device']['kind']}, commit "
             f"{report['git_commit']}, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
             f"attention {args.attention})"]
    for method in bargs.methods:
        config = bench.decode_config(method)
        prompt = bench_decode.random_prompt(args.prompt_len, vocab, 100)
        bench.gen(method, prompt, config, seed=0)                    # compile + warm up
        trace_dir = os.path.join(args.out, f"profile_{stamp}_trace", method)
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            res, wall = bench.gen(method, prompt, config, seed=1)
        summary = summarise_trace(load_perfetto(trace_dir), args.top)
        summary.update(wall_s=wall, decode_s=res.decode_seconds, new_tokens=res.new_tokens,
                       rounds=int(res.rounds[0]),
                       kernels_per_round=summary["kernels"] / max(int(res.rounds[0]), 1))
        report["methods"][method] = summary
        lines += ["", f"## {method}: {res.new_tokens} tokens in {int(res.rounds[0])} rounds, "
                  f"decode {1e3 * res.decode_seconds:.1f} ms",
                  f"{summary['kernels']} {summary['source']} events "
                  f"({summary['kernels_per_round']:.0f} per round); busy "
                  + (f"{summary['busy_us'] / 1e3:.2f} ms of a {summary['window_us'] / 1e3:.2f} ms "
                     f"window ({100 * summary['busy_fraction']:.0f}%)" if summary["kernels"]
                     else "n/a"), "",
                  "| kernel | count | total ms | mean us | share of busy |", "|---|---|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['count']} | {k['total_us'] / 1e3:.3f} | "
                  f"{k['mean_us']:.1f} | {100 * k['share']:.1f}% |" for k in summary.get("top", [])]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"profile_{stamp}.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, f"profile_{stamp}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
