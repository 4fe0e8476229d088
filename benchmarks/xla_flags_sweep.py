"""XLA_FLAGS sweep for the AR decode step: one ``bench_decode.py`` child per flag variant.

Each variant runs

    bench_decode.py --methods ar --prompt-lens 512 --new-tokens 128 --skip-hf \\
        --forced-taus '' --xla-flags=<flags> --out <out>/xla_flags_<stamp>_runs/<name>

in its own process (XLA reads XLA_FLAGS once, at backend start), with a wall-clock limit
(``--timeout-s``, default 150 s; the child gets a ``--time-budget-s`` a little under it, so a
slow variant still writes partial results). The AR ms/token (``decode_ms_per_token`` of the
loop: decode time over the tokens after the first) is read from the child's result JSON. A
variant that crashes (XLA aborts on an unknown flag) is recorded with its output tail and the
sweep goes on. The table (variant | XLA_FLAGS | AR ms/token | vs default) is printed and
written as ``xla_flags_<stamp>.json`` / ``.md`` into ``--out`` (default ``$OUT``, else
benchmarks/results) after every variant.

    python benchmarks/xla_flags_sweep.py                          # H200, ~45 s per variant
    python benchmarks/xla_flags_sweep.py --variants default,lhs --extra 'big=--xla_foo=1'
    python benchmarks/xla_flags_sweep.py --methods ar,domino      # domino round too
    python benchmarks/xla_flags_sweep.py --tiny-smoke --variants default,autotune0   # CPU
"""

from __future__ import annotations

import argparse
import collections
import datetime as _dt
import glob
import json
import os
import re
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from child_process import run_streaming  # noqa: E402
REPO = os.path.dirname(HERE)
BENCH = os.path.join(HERE, "bench_decode.py")
T_START = time.perf_counter()

# name -> XLA_FLAGS (XLA GPU, jax 0.11)
VARIANTS = collections.OrderedDict([
    ("default", ""),
    ("cmdbuf_while", "--xla_gpu_enable_command_buffer="
                     "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"),
    ("no_cmdbuf", "--xla_gpu_enable_command_buffer="),
    ("lhs", "--xla_gpu_enable_latency_hiding_scheduler=true"),
    ("no_triton_gemm", "--xla_gpu_enable_triton_gemm=false"),
    ("autotune0", "--xla_gpu_autotune_level=0"),
])
NAME_RE = re.compile(r"^[A-Za-z0-9_.+-]+$")


def log(msg: str) -> None:
    print(f"[sweep {time.perf_counter() - T_START:7.1f}s] {msg}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=None,
                   help="comma list of variant names (default: all built-in, in order: "
                        + ", ".join(VARIANTS) + ")")
    p.add_argument("--extra", action="append", default=[], metavar="NAME=FLAGS",
                   help="add a variant (repeatable), e.g. --extra 'lhs2=--xla_gpu_...=true'")
    p.add_argument("--methods", default="ar", help="passed to bench_decode (default ar)")
    p.add_argument("--prompt-lens", default=None, help="default 512 (tiny-smoke: 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 128 (tiny-smoke: 12)")
    p.add_argument("--timeout-s", type=float, default=150.0, help="limit per variant")
    p.add_argument("--total-budget-s", type=float, default=560.0,
                   help="start no variant past this (a variant gets min(timeout, what is left))")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    p.add_argument("--tiny-smoke", action="store_true",
                   help="pass --tiny to bench_decode (CPU, tiny shapes); flags passed unchanged")
    p.add_argument("--bench-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for bench_decode (repeatable; use --bench-arg=--x=y)")
    args = p.parse_args(argv)
    if args.prompt_lens is None:
        args.prompt_lens = "16" if args.tiny_smoke else "512"
    if args.new_tokens is None:
        args.new_tokens = 12 if args.tiny_smoke else 128
    variants = collections.OrderedDict(VARIANTS)
    extras = collections.OrderedDict()
    for item in args.extra:
        name, sep, flags = item.partition("=")
        name = name.strip()
        if not sep or not NAME_RE.match(name):
            p.error(f"--extra wants NAME=FLAGS with NAME in [A-Za-z0-9_.+-], got {item!r}")
        extras[name] = flags.strip()
    variants.update(extras)
    if args.variants:
        names = [n.strip() for n in args.variants.split(",") if n.strip()]
        unknown = [n for n in names if n not in variants]
        if unknown:
            p.error(f"unknown variant(s) {unknown}; known: {list(variants)}")
        names += [n for n in extras if n not in names]       # --extra always runs
    else:
        names = list(variants)
    args.selected = collections.OrderedDict((n, variants[n]) for n in names)
    return args


def run_variant(args, name: str, flags: str, run_dir: str, timeout: float) -> dict:
    os.makedirs(run_dir, exist_ok=True)
    cmd = [sys.executable, BENCH, "--methods", args.methods, "--prompt-lens", args.prompt_lens,
           "--new-tokens", str(args.new_tokens), "--skip-hf", "--forced-taus", "",
           f"--xla-flags={flags}",              # '=' form: the value starts with '--'
           "--out", run_dir, "--time-budget-s", str(max(20.0, timeout - 20.0))]
    if args.tiny_smoke:
        cmd.append("--tiny")
    cmd += args.bench_arg
    entry: dict = {"name": name, "xla_flags": flags, "cmd": cmd[1:], "run_dir": run_dir,
                   "timeout_s": timeout}
    log(f"variant {name}: XLA_FLAGS+={flags!r} (timeout {timeout:.0f}s)")
    rc, tail, wall = run_streaming(cmd, timeout, prefix=f"    {name} | ", cwd=REPO,
                                   log_path=os.path.join(run_dir, "run.log"), grace_s=15.0)
    entry["returncode"] = rc
    entry["wall_s"] = wall
    parse_result(entry, run_dir, args)
    wants_ar = "ar" in [m.strip() for m in args.methods.split(",")]
    ok = (entry.get("ar_ms_per_token") is not None if wants_ar
          else any(m.get("round_ms") for m in entry.get("methods", {}).values()))
    entry["ok"] = ok
    if rc != 0 or not ok:
        entry["error_tail"] = "\n".join(tail)[-3000:]
        entry["error"] = (f"timed out after {timeout:.0f}s" if rc == "timeout"
                          else f"exit code {rc}" if rc != 0 else "no loop result in the JSON")
        hint = [ln for ln in tail if re.search(r"Unknown flag|unknown flag|Fatal|Check failed|"
                                                r"Error|error:", ln)]
        if hint:
            entry["error"] += ": " + hint[-1].strip()[:300]
        log(f"variant {name} FAILED ({entry['error']})")
    else:
        log(f"variant {name}: AR {fmt(entry.get('ar_ms_per_token'))} ms/token (compile "
            f"{fmt(entry.get('ar_compile_s'), '.1f')}s, wall {entry['wall_s']:.0f}s)")
    return entry


def parse_result(entry: dict, run_dir: str, args) -> None:
    files = sorted(glob.glob(os.path.join(run_dir, "decode_*.json")), key=os.path.getmtime)
    if not files:
        return
    entry["result_json"] = files[-1]
    try:
        with open(files[-1]) as f:
            res = json.load(f)
    except Exception as e:  # noqa: BLE001
        entry["parse_error"] = repr(e)
        return
    entry["xla_flags_effective"] = res.get("xla_flags")
    entry["device"] = res.get("device")
    entry["init_seconds"] = res.get("init_seconds")
    entry["complete"] = res.get("complete")
    if res.get("errors"):
        entry["bench_errors"] = [e.get("task", "") + ": " + e.get("error", "")[:300]
                                 for e in res["errors"]]
    plen = str(args.prompt_lens).split(",")[0].strip()
    pr = (res.get("prompts") or {}).get(plen) or {}
    loops = pr.get("loops") or {}
    ar = loops.get("ar")
    if ar:
        entry["ar_ms_per_token"] = ar.get("decode_ms_per_token")
        entry["ar_generate_ms_per_token"] = ar.get("generate_ms_per_token")
        entry["ar_compile_s"] = ar.get("compile_s")
        entry["ar_pct_of_floor"] = ar.get("pct_of_floor")
    step = (pr.get("stages") or {}).get("ar", {}).get("ar_step")
    if step:
        entry["ar_step_own_jit_ms"] = step.get("ms")
        entry["ar_step_pipelined_ms"] = step.get("ms_pipelined_mean")
    others = {}
    for method, loop in loops.items():
        if method != "ar":
            others[method] = {"round_ms": loop.get("round_ms"), "c": loop.get("c"),
                              "compile_s": loop.get("compile_s")}
    if others:
        entry["methods"] = others


def fmt(x, spec=".3f"):
    return "" if x is None else format(x, spec)


def table(summary: dict) -> str:
    variants = summary["variants"]
    base = next((v.get("ar_ms_per_token") for v in variants if v["name"] == "default"), None)
    methods = []
    for v in variants:
        for m in v.get("methods", {}):
            if m not in methods:
                methods.append(m)
    head = ["variant", "XLA_FLAGS", "AR ms/token", "vs default"]
    head += ["AR generate ms/token", "ar_step own jit ms (pipelined)", "AR compile s"]
    for m in methods:
        head += [f"{m} round ms", f"{m} c"]
    head += ["status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in variants:
        ms = v.get("ar_ms_per_token")
        if ms and base:
            vs = f"{ms / base:.3f}x ({100.0 * (ms - base) / base:+.1f}%)"
        else:
            vs = ""
        step = ""
        if v.get("ar_step_own_jit_ms") is not None:
            step = f"{v['ar_step_own_jit_ms']:.3f} ({fmt(v.get('ar_step_pipelined_ms'))})"
        row = [v["name"], f"`{v['xla_flags']}`" if v["xla_flags"] else "(none)", fmt(ms), vs,
               fmt(v.get("ar_generate_ms_per_token")), step, fmt(v.get("ar_compile_s"), ".1f")]
        for m in methods:
            mm = v.get("methods", {}).get(m, {})
            row += [fmt(mm.get("round_ms")), fmt(mm.get("c"))]
        status = "ok" if v.get("ok") and not v.get("error") else (v.get("error") or "no result")
        row.append(status.replace("|", "/").replace("\n", " ")[:200])
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def markdown(summary: dict) -> str:
    dev = next((v.get("device") for v in summary["variants"] if v.get("device")), None) or {}
    lines = [f"# XLA_FLAGS sweep {summary['date']}", "",
             f"- device: {dev.get('kind', '?')} ({dev.get('platform', '?')}); methods "
             f"{summary['methods']}; prompt {summary['prompt_lens']}, {summary['new_tokens']} new "
             f"tokens, batch 1{'; tiny smoke' if summary['tiny_smoke'] else ''}",
             f"- XLA_FLAGS inherited by every variant: `{summary['base_xla_flags'] or '(none)'}`",
             "- AR ms/token: the AR loop's decode time over the tokens after the first "
             "(bench_decode `decode_ms_per_token`); vs default: variant / default", "",
             table(summary), ""]
    for v in summary["variants"]:
        if v.get("error_tail"):
            lines += [f"## {v['name']}: {v.get('error', '')}", "", "```",
                      v["error_tail"][-1500:], "```", ""]
    return "\n".join(lines)


def save(summary: dict, base: str) -> None:
    tmp = base + ".json.tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    os.replace(tmp, base + ".json")
    with open(base + ".md", "w") as f:
        f.write(markdown(summary))


def main(argv=None) -> int:
    args = parse_args(argv)
    stamp = _dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"xla_flags_{stamp}")
    runs_root = base + "_runs"
    summary = {"schema": "xla_flags_sweep/1", "date": _dt.datetime.now().isoformat(timespec="seconds"),
               "methods": args.methods, "prompt_lens": args.prompt_lens,
               "new_tokens": args.new_tokens, "tiny_smoke": args.tiny_smoke,
               "base_xla_flags": os.environ.get("XLA_FLAGS", ""), "timeout_s": args.timeout_s,
               "variants": [], "complete": False}

    def on_term(signum, _frame):
        raise SystemExit(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)
    log(f"{len(args.selected)} variants: {', '.join(args.selected)}; out {base}.*")
    try:
        for name, flags in args.selected.items():
            left = args.total_budget_s - (time.perf_counter() - T_START)
            if left < 30.0:
                log(f"SKIP {name}: {left:.0f}s of the total budget left")
                summary["variants"].append({"name": name, "xla_flags": flags,
                                            "error": f"skipped: {left:.0f}s of budget left"})
                continue
            entry = run_variant(args, name, flags, os.path.join(runs_root, name),
                                min(args.timeout_s, left))
            summary["variants"].append(entry)
            save(summary, base)
        summary["complete"] = True
    finally:
        save(summary, base)
        print(markdown(summary), flush=True)
        log(f"wrote {base}.json and {base}.md")
    ok = any(v.get("ok") for v in summary["variants"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
