"""A/B of two library trees on the CPU: optimized-HLO op counts and decode timing.

For a code change that must not slow decoding (the round contract, issue 16), this script
runs the *same* measurement against the library at ``--root`` (default: this checkout), so
the old tree (``git archive OLD | tar -x -C /tmp/old``) and the new one can be compared:

* ``hlo``: for each method, the optimized HLO of the compiled round loop (what
  ``generate`` runs; XLA CPU), and the instructions of its ``while`` body (with every
  computation it calls: fusions, nested loops, reductions) counted by opcode;
* ``time``: decode tokens/s of ``generate`` per method (median of ``--reps`` warm calls
  after one compile call), and the tokens, so outputs can be compared as well.

Models: the demo pair (SmolLM2-135M-Instruct target, the shipped Domino drafter) loaded by
``load_pair`` in float32 (the CPU default of the CLI), the library's default options.

    python benchmarks/round_ab.py hlo --root /tmp/old --out old_hlo.json
    python benchmarks/round_ab.py time --root /tmp/old --out old_time.json
    python benchmarks/round_ab.py compare old_hlo.json new_hlo.json
    python benchmarks/round_ab.py time-table --old o1.json o2.json --new n1.json n2.json

``time`` on a shared machine measures the load as much as the code: run the two trees
alternately (old, new, old, new, ...: each ``time`` call a fresh process) and pool them
with ``time-table``, which prints per method the median decode ms of all old and all new
calls, their ratio, and whether every call's tokens agree.
"""

from __future__ import annotations

import argparse
import collections
import datetime as _dt
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
METHODS = ("ar", "dflash", "domino", "ddtree", "dominotree")
QUESTIONS = ("Explain in three sentences why the sky is blue.",
             "Write a short poem about the ocean tides.")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("hlo", "time", "compare", "time-table"))
    p.add_argument("--old", nargs="*", default=[], help="time-table: the old tree's JSONs")
    p.add_argument("--new", nargs="*", default=[], help="time-table: the new tree's JSONs")
    p.add_argument("files", nargs="*", help="compare: two JSON files written by 'hlo'")
    p.add_argument("--root", default=os.path.dirname(HERE),
                   help="the tree whose domino_jax is measured (default: this checkout)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--git-commit", default=None,
                   help="recorded as the tree's commit (an archived tree has no .git)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------- HLO parsing

_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.*)$")
_CALLS = re.compile(r"(?:calls|body|condition|to_apply)=%?([\w.\-]+)")
_CALL_LISTS = re.compile(r"(?:branch_computations|called_computations)=\{([^}]*)\}")


def _opcode(rest: str) -> str | None:
    """The opcode of an instruction's right-hand side ``TYPE opcode(...)`` (a tuple type
    in balanced parentheses, or one token)."""
    i = 0
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        i += 1
    else:
        i = rest.find(" ")
    m = re.match(r"\s*([\w\-]+)\(", rest[i:])
    return m.group(1) if m else None


def parse_hlo(text: str):
    """``{computation: (opcodes, callees)}`` and the entry computation's name."""
    comps, entry, current = {}, None, None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m and not line.lstrip().startswith(("ROOT", "%param")) and " = " not in line:
            current = m.group(1)
            comps[current] = ([], set())
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is None or line.strip() == "}":
            continue
        im = _INSTR.match(line)
        opcode = _opcode(im.group(1)) if im else None
        if opcode is None:
            continue
        comps[current][0].append(opcode)
        comps[current][1].update(_CALLS.findall(line))
        for group in _CALL_LISTS.findall(line):
            comps[current][1].update(n.strip().lstrip("%") for n in group.split(",") if n.strip())
    return comps, entry


def while_body_ops(text: str) -> tuple[dict, dict]:
    """Opcode counts of the outermost ``while`` body of the entry computation: its own
    instructions (on a GPU: roughly the kernels a round launches), and all instructions
    with every computation it calls transitively (fusion bodies, nested loops, reduction
    bodies; each once per call site)."""
    comps, entry = parse_hlo(text)
    bodies = []
    for line in text.splitlines():
        if " while(" in line and "body=" in line:
            bodies.append(re.search(r"body=%?([\w.\-]+)", line).group(1))
    entry_calls = comps[entry][1] if entry else set()
    outer = [b for b in bodies if b in entry_calls] or bodies[:1]
    if not outer:
        return {}, {}
    counts: collections.Counter = collections.Counter()

    def visit(name, depth=0):
        ops, callees = comps.get(name, ([], set()))
        counts.update(ops)
        for c in sorted(callees):
            if depth < 50:
                visit(c, depth + 1)

    visit(outer[0])
    top = collections.Counter(comps[outer[0]][0])
    return dict(sorted(top.items())), dict(sorted(counts.items()))


# ------------------------------------------------------------------------- measurement

def _prompts(target_dir):
    """The questions chat-templated by the target's tokenizer (transformers directly, so
    both trees get the same ids)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    out = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                      add_generation_prompt=True, enable_thinking=False)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def _models(method):
    import jax.numpy as jnp

    from domino_jax.decode.loading import default_models, load_pair

    target_dir, draft_dir = default_models(None, None)
    return (*load_pair(target_dir, None if method == "ar" else draft_dir, method, jnp.float32),
            _prompts(target_dir))


def _config(method, max_new):
    from domino_jax.decode.speculative import DecodeConfig

    return DecodeConfig(method=method, max_new_tokens=max_new)


def measure_hlo(args) -> dict:
    from domino_jax.decode import speculative

    out = {}
    for method in args.methods:
        target, tp, drafter, dp, prompts = _models(method)
        speculative._COMPILED.clear()
        speculative.precompile(target, tp, prompts[:1], _config(method, args.max_new_tokens),
                               drafter, dp)
        rounds_fn, = [program for key, (program, _) in speculative._COMPILED.items()
                      if key[0] == "rounds"]
        text = rounds_fn.as_text()
        top, everything = while_body_ops(text)
        out[method] = {"while_body_ops": top, "while_body_ops_transitive": everything}
        print(f"{method}: {sum(top.values())} instructions in the while body, "
              f"{sum(everything.values())} with the computations it calls", flush=True)
        _release()
    return out


def measure_time(args) -> dict:
    from domino_jax.decode.speculative import generate

    out = {}
    for method in args.methods:
        target, tp, drafter, dp, prompts = _models(method)
        config = _config(method, args.max_new_tokens)
        first = generate(target, tp, prompts, config, drafter, dp)
        runs = [generate(target, tp, prompts, config, drafter, dp) for _ in range(args.reps)]
        tps = [r.tokens_per_second for r in runs]
        out[method] = {"tokens_per_second": statistics.median(tps), "runs": tps,
                       "decode_ms": [1e3 * r.decode_seconds for r in runs],
                       "rounds": [int(x) for x in first.rounds], "tau": first.tau,
                       "tokens": first.tokens, "compile_s": first.compile_seconds}
        print(f"{method}: {statistics.median(tps):.1f} tok/s (runs {[round(t, 1) for t in tps]}),"
              f" tau {first.tau:.2f}", flush=True)
        _release()
    return out


def _release():
    """Drop the compiled programs and models of the last method (the demo pair's float32
    programs take GBs; a 2-core, 23 GB machine shared by many processes ran out)."""
    import gc

    import jax

    from domino_jax.decode import speculative

    speculative._COMPILED.clear()
    jax.clear_caches()
    gc.collect()


def compare(files) -> int:
    a, b = (json.load(open(f)) for f in files)
    same = True
    for method in a["results"]:
        if method not in b["results"]:
            continue
        for key in ("while_body_ops", "while_body_ops_transitive"):
            x, y = a["results"][method][key], b["results"][method][key]
            diff = {k: (x.get(k, 0), y.get(k, 0)) for k in sorted(set(x) | set(y))
                    if x.get(k, 0) != y.get(k, 0)}
            same &= not diff
            print(f"{method} {key}: {sum(x.values())} -> {sum(y.values())}"
                  + ("; identical counts" if not diff else f"; differences (old, new) {diff}"))
    return 0 if same else 1


def time_table(old_files, new_files) -> str:
    """Markdown: per method, the pooled median decode ms of the old and new ``time`` JSONs
    (every warm call of every file), new / old, and whether all tokens agree."""
    if not old_files or not new_files:
        raise SystemExit("error: time-table needs --old FILE... and --new FILE...")
    sides = {name: [json.load(open(f)) for f in files]
             for name, files in (("old", old_files), ("new", new_files))}
    methods = [m for m in sides["old"][0]["results"]
               if all(m in r["results"] for rs in sides.values() for r in rs)]
    lines = ["| method | old decode ms (median of all calls) | new decode ms | new / old | "
             "calls (old, new) | tokens identical |", "|---|---|---|---|---|---|"]
    for m in methods:
        ms = {k: [x for r in rs for x in r["results"][m]["decode_ms"]] for k, rs in sides.items()}
        toks = [r["results"][m]["tokens"] for rs in sides.values() for r in rs]
        med = {k: statistics.median(v) for k, v in ms.items()}
        lines.append(f"| {m} | {med['old']:.0f} | {med['new']:.0f} | "
                     f"{med['new'] / med['old']:.3f} | {len(ms['old'])}, {len(ms['new'])} | "
                     f"{all(t == toks[0] for t in toks)} |")
    loads = {k: [round(r["load_average"][0], 1) for r in rs] for k, rs in sides.items()}
    lines.append(f"\nLoad average (1 min) at the end of each call: old {loads['old']}, "
                 f"new {loads['new']}; commits old {sides['old'][0]['commit']}, "
                 f"new {sides['new'][0]['commit']}.")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.mode == "compare":
        return compare(args.files)
    if args.mode == "time-table":
        text = time_table(args.old, args.new)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        return 0
    sys.path.insert(0, os.path.abspath(args.root))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    args.methods = [m for m in args.methods.split(",") if m]
    import jax

    import domino_jax
    results = measure_hlo(args) if args.mode == "hlo" else measure_time(args)
    commit = args.git_commit
    if commit is None:
        try:
            commit = subprocess.run(["git", "-C", args.root, "rev-parse", "--short", "HEAD"],
                                    capture_output=True, text=True).stdout.strip() or None
        except OSError:
            commit = None
    import importlib.metadata as metadata

    versions = {name: metadata.version(name) for name in ("jax", "jaxlib", "flax")}
    report = {"mode": args.mode, "date": _dt.datetime.now().isoformat(timespec="seconds"),
              "root": os.path.abspath(args.root), "commit": commit,
              "library": os.path.dirname(domino_jax.__file__), "jax": jax.__version__,
              "versions": versions, "load_average": os.getloadavg(),
              "device": jax.devices()[0].device_kind, "max_new_tokens": args.max_new_tokens,
              "reps": args.reps, "results": results}
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
