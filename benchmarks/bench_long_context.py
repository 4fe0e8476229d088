"""Long context: prefill memory and time, draft cost against the context, tau at long context.

Three measurements (each writes ``long_<what>_<date>.{json,md}`` into ``--out``):

* ``prefill``: for each prompt length and each prefill mode, in a fresh child process (so
  peak memory is that configuration's own): XLA's memory analysis of the compiled prefill
  (``temp`` = the largest live set of intermediates), compile seconds, the median prefill
  time, the process's peak RSS (CPU) or the device's peak bytes in use (GPU), and the first
  token. Modes: ``whole`` (one forward: the decode loop's prefill before chunking, memory
  quadratic in the prompt) and ``chunked`` (``PrefillConfig()``: chunks of 2048 tokens,
  blockwise attention); ``chunked-xla`` and ``chunked-cudnn`` pick the chunks' attention.
  ``--compile-only`` skips running (memory analysis only: nothing large is allocated).
* ``draft``: one draft forward (``BlockDrafter.block_hidden`` + the LM head rows) over
  a draft cache holding ``C`` context positions, full attention against ``--windows``.
* ``tau``: every method's acceptance length on long real prompts (Python documentation to
  summarise, ``pydoc_data.topics``; Python source files to continue, ``argparse.py`` /
  ``dataclasses.py`` from the running interpreter), cut to 1K / 4K / 8K tokens, greedy, and
  whether each output equals AR's token for token. Demo pair only (real weights).

Shapes: ``--shape demo`` (SmolLM2-135M-Instruct + our Domino drafter, float32 on the CPU,
bfloat16 on a GPU), ``qwen3-8b`` (random bf16 weights, the Qwen3-8B target + Domino drafter
shapes; GPU), ``tiny`` (smoke test).

    python benchmarks/bench_long_context.py prefill --lengths 1024,4096,8192          # CPU
    python benchmarks/bench_long_context.py draft --contexts 1024,4096,8192 --windows 0,512
    python benchmarks/bench_long_context.py tau --lengths 1024,4096,8000
    # the GPU run (H200), Qwen3-8B shape at 8K / 16K / 32K:
    python benchmarks/bench_long_context.py prefill --shape qwen3-8b \\
        --lengths 8192,16384,32768 --modes whole,chunked,chunked-xla,chunked-cudnn
    python benchmarks/bench_long_context.py draft --shape qwen3-8b \\
        --contexts 8192,16384,32768 --windows 0,2048
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import resource
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODES = {"whole": dict(chunk=0), "chunked": dict(),
         "chunked-xla": dict(attention="xla"), "chunked-cudnn": dict(attention="cudnn")}


def log(msg: str) -> None:
    print(f"[long] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- models


def build_models(shape: str, method: str = "domino", context_window: int | None = None,
                 abstract: bool = False):
    """``(target, target_params, drafter, draft_params, description)``; ``abstract``: the
    random-weight shapes' parameters as ``ShapeDtypeStruct`` trees (compile only: nothing
    allocated, so the Qwen3-8B shape's memory analysis runs on any machine)."""
    import jax
    import jax.numpy as jnp

    if shape == "demo":
        from domino_jax.decode.loading import default_models, load_pair

        target_dir, draft_dir = default_models(None, None)
        dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
        options = {} if context_window is None else dict(context_window=context_window)
        target, tp, drafter, dp = load_pair(target_dir, draft_dir, method, dtype, **options)
        return target, tp, drafter, dp, f"SmolLM2-135M-Instruct + Domino drafter, {dtype.__name__}"
    from bench_util import random_params

    from domino_jax.config import QWEN3_8B, QWEN3_8B_DOMINO_DRAFT, DraftConfig, TargetConfig
    from domino_jax.decode.methods import make_drafter, method_options
    from domino_jax.models import dflash, domino_head, qwen3

    if shape == "qwen3-8b":
        tcfg, dcfg = QWEN3_8B, QWEN3_8B_DOMINO_DRAFT
    else:
        tcfg = TargetConfig("qwen3", 512, 64, 4, 4, 2, 16, 128, 1e-6, 1e6,
                            max_position_embeddings=65536)
        dcfg = DraftConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, intermediate_size=128, block_size=4,
                           num_target_layers=4, mask_token_id=511, target_layer_ids=(0, 2),
                           projector_type="domino", pure_draft_prefix_len=1, shift_label=True,
                           emb_dim=16, gru_hidden_dim=32)
    tcfg = dataclasses.replace(tcfg, fused_projections=True)
    dcfg = dataclasses.replace(dcfg, fused_projections=True)
    target = qwen3.TargetLM(tcfg)
    drafter = make_drafter(dcfg, target, method,
                           method_options(method, context_window=context_window))
    shapes = (qwen3.param_shapes(tcfg), domino_head.head_param_shapes(dcfg),
              dflash.param_shapes(dcfg))
    if abstract:
        head = jax.eval_shape(domino_head.decode_head, shapes[1],
                              shapes[0]["embed_tokens"]["embedding"])
        return (target, shapes[0], drafter, {"backbone": shapes[2], "head": head},
                f"{shape} shapes (compile only)")
    tp = random_params(shapes[0], 0)
    head = domino_head.decode_head(random_params(shapes[1], 2), tp["embed_tokens"]["embedding"])
    dp = {"backbone": random_params(shapes[2], 1), "head": head}
    return target, tp, drafter, dp, f"{shape} random bf16 weights"


def peak_memory_bytes() -> tuple[str, int | None]:
    """``("device", bytes)`` on an accelerator (peak bytes in use), else ``("rss", bytes)``
    (the process's peak resident set)."""
    import jax

    from bench_util import device_peak_bytes

    if jax.default_backend() != "cpu":
        return "device", device_peak_bytes()
    return "rss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ----------------------------------------------------------------------------- prefill


def prefill_child(args) -> dict:
    """One (length, mode): compile, memory analysis, optionally run ``--reps`` times."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from domino_jax.decode.prefill import PrefillConfig, chunk_plan, compiled_prefill
    from domino_jax.decode.speculative import prompt_bucket, required_capacity
    from domino_jax.kv_cache import align_slots

    target, tp, drafter, dp, models = build_models(
        args.shape, abstract=args.compile_only and args.shape != "demo")
    length, mode = args.length, args.mode
    config = PrefillConfig(**MODES[mode])
    width = prompt_bucket(length)
    capacity = align_slots(required_capacity(width, _decode_config(args), drafter.num_drafts))
    t0 = time.perf_counter()
    compiled = compiled_prefill(target, drafter, tp, dp, 1, width, capacity, config)
    compile_s = time.perf_counter() - t0
    memory = compiled.memory_analysis()
    row = dict(length=length, mode=mode, width=width, capacity=capacity, models=models,
               chunks=chunk_plan(width, config.chunk), attention=config.attention,
               compile_s=compile_s, temp_bytes=int(memory.temp_size_in_bytes),
               argument_bytes=int(memory.argument_size_in_bytes),
               output_bytes=int(memory.output_size_in_bytes))
    if not args.compile_only:
        rng = np.random.default_rng(length)
        vocab = target.config.vocab_size
        prompt = np.zeros((1, width), np.int32)
        prompt[0, :length] = rng.integers(0, vocab - 1, length)
        prompt_len = jnp.asarray([length], jnp.int32)
        times = []
        for _ in range(args.reps):
            t1 = time.perf_counter()
            out = compiled(tp, dp, jnp.asarray(prompt), prompt_len)
            jax.block_until_ready(out)
            times.append(time.perf_counter() - t1)
        logits = np.asarray(out.logits[0], np.float64)
        row.update(prefill_s=statistics.median(times), prefill_s_all=times,
                   first_token=int(np.argmax(logits)),
                   tokens_per_s=length / statistics.median(times))
    kind, peak = peak_memory_bytes()
    row.update(peak_kind=kind, peak_bytes=peak)
    return row


def _decode_config(args):
    from domino_jax.decode.speculative import DecodeConfig

    return DecodeConfig(method="domino", max_new_tokens=args.max_new_tokens)


def run_children(args, what: str, configs: list[dict]) -> list[dict]:
    """Each config in its own process (its own peak memory); failures recorded, not fatal."""
    from child_process import run_streaming

    rows = []
    for config in configs:
        cmd = [sys.executable, os.path.abspath(__file__), what, "--child",
               "--shape", args.shape, "--max-new-tokens", str(args.max_new_tokens),
               "--reps", str(args.reps)] + (["--compile-only"] if args.compile_only else [])
        for key, value in config.items():
            cmd += [f"--{key.replace('_', '-')}", str(value)]
        log(f"{what} {config}")
        rc, tail, wall = run_streaming(cmd, timeout=args.child_timeout_s, prefix="    | ")
        result = next((json.loads(line[len("RESULT "):]) for line in reversed(tail)
                       if line.startswith("RESULT ")), None)
        if result is None:
            result = dict(config, error=f"exit {rc}", tail=list(tail)[-8:])
        result["wall_s"] = wall
        rows.append(result)
        yield_rows(args, what, rows)
    return rows


# ----------------------------------------------------------------------------- draft


def draft_child(args) -> dict:
    """Median time of one ``draft_block`` over a cache of ``--context`` positions."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from domino_jax.kv_cache import align_slots

    window = args.window or None
    target, tp, drafter, dp, models = build_models(args.shape, context_window=window)
    cfg = drafter.config
    context = args.context
    capacity = align_slots(context + 64)
    cache = drafter.new_context_cache(1, capacity)
    rng = np.random.default_rng(0)
    keys = rng.standard_normal(cache.keys.shape).astype(np.float32) * 0.1
    cache = cache.replace(keys=jnp.asarray(keys, cache.keys.dtype),
                          values=jnp.asarray(keys[::-1].copy(), cache.values.dtype),
                          lengths=jnp.asarray([context - 1], jnp.int32))
    width = drafter.max_commit
    features = jnp.asarray(rng.standard_normal((1, width, cfg.num_taps * cfg.hidden_size)),
                           target.dtype)
    root = jnp.asarray([5], jnp.int32)
    start = jnp.asarray([context], jnp.int32)
    context_len = jnp.asarray([1], jnp.int32)

    def draft_block(tp_, dp_, c):
        hidden, c = drafter.block_hidden(tp_, dp_, root, start, features, context_len, c)
        return drafter.lm_head(tp_, hidden), c

    step = jax.jit(lambda tp_, dp_, c: draft_block(tp_, dp_, c)[0])
    t0 = time.perf_counter()
    compiled = step.lower(tp, dp, cache).compile()
    compile_s = time.perf_counter() - t0
    for _ in range(2):
        jax.block_until_ready(compiled(tp, dp, cache))
    times = []
    for _ in range(args.reps):
        t1 = time.perf_counter()
        jax.block_until_ready(compiled(tp, dp, cache))
        times.append(time.perf_counter() - t1)
    return dict(context=context, window=args.window, models=models, compile_s=compile_s,
                draft_ms=1e3 * statistics.median(times), draft_ms_min=1e3 * min(times),
                reps=args.reps, temp_bytes=int(compiled.memory_analysis().temp_size_in_bytes))


# ----------------------------------------------------------------------------- tau


def long_sources() -> dict[str, tuple[str, str]]:
    """name -> (instruction, text): real documents and code shipped with Python."""
    import argparse as argparse_module
    import dataclasses as dataclasses_module
    import inspect

    import pydoc_data.topics as topics

    def source(module) -> str:
        with open(inspect.getsourcefile(module)) as f:
            return f.read()

    return {
        "doc:compound": ("Summarize the following documentation in a few sentences.",
                         topics.topics["compound"]),
        "doc:specialnames": ("Summarize the following documentation in a few sentences.",
                             topics.topics["specialnames"]),
        "code:argparse.py": ("Continue the following Python file.", source(argparse_module)),
        "code:dataclasses.py": ("Continue the following Python file.",
                                source(dataclasses_module)),
    }


def cut_prompt(tokenizer, instruction: str, text: str, length: int) -> list[int]:
    """The chat-templated ``instruction + text`` with ``text`` cut (at a line) so the prompt
    has at most ``length`` tokens."""
    from domino_jax.decode.loading import encode_prompt

    lines = text.splitlines(keepends=True)
    low, high = 1, len(lines)
    best = None
    while low <= high:                               # most lines that fit
        mid = (low + high) // 2
        ids = encode_prompt(tokenizer, f"{instruction}\n\n{''.join(lines[:mid])}", True)
        if len(ids) <= length:
            best, low = ids, mid + 1
        else:
            high = mid - 1
    if best is None:
        raise ValueError(f"{length} tokens cannot hold even one line")
    return best


def tau_run(args) -> list[dict]:
    from domino_jax.decode.loading import default_models, load_tokenizer, stop_token_ids
    from domino_jax.decode.methods import make_drafter, method_options
    from domino_jax.decode.speculative import DecodeConfig, generate

    target_dir, _ = default_models(None, None)
    tokenizer = load_tokenizer(target_dir)
    target, tp, domino, dp, models = build_models("demo")
    stop = stop_token_ids(tokenizer, target.config)
    methods = [m for m in args.methods.split(",") if m]
    drafters = {}
    for m in methods:
        if m == "ar":
            drafters[m] = None
        elif m.startswith("domino@w"):                  # domino with a context window
            drafters[m] = make_drafter(domino.config, target, "domino", method_options(
                "domino", context_window=int(m[len("domino@w"):])))
        elif m in ("ddtree", "dominotree"):
            drafters[m] = make_drafter(domino.config, target, m,
                                       method_options(m, budget=args.budget))
        else:
            drafters[m] = make_drafter(domino.config, target, m)
    sources = long_sources()
    names = [n for n in sources if n.split(":")[0] in ("doc", "code")]
    per_kind = {"doc": [n for n in names if n.startswith("doc")][:args.per_kind],
                "code": [n for n in names if n.startswith("code")][:args.per_kind]}
    rows = []
    limit = target.config.max_position_embeddings - args.max_new_tokens
    for length in [int(x) for x in args.lengths.split(",")]:
        for name in per_kind["doc"] + per_kind["code"]:
            # the context at the end is at most `length` and within the target's positions
            ids = cut_prompt(tokenizer, *sources[name], min(length, limit))
            ar_tokens = None
            for m in methods:
                base = m.split("@")[0]
                config = DecodeConfig(method=base, max_new_tokens=args.max_new_tokens,
                                      stop_token_ids=stop)
                t0 = time.perf_counter()
                result = generate(target, tp, [ids], config, drafters[m], dp)
                wall = time.perf_counter() - t0
                if m == "ar":
                    ar_tokens = result.tokens
                row = dict(length=length, prompt=name, prompt_tokens=len(ids), method=m,
                           tau=result.tau, new_tokens=result.new_tokens,
                           rounds=int(result.rounds.sum()),
                           accept_hist=result.accept_hist.sum(0).tolist(),
                           prefill_s=result.prefill_seconds, decode_s=result.decode_seconds,
                           compile_s=result.compile_seconds, wall_s=wall,
                           identical_to_ar=None if ar_tokens is None or m == "ar"
                           else result.tokens == ar_tokens)
                log(f"tau {length} {name} {m}: tau {result.tau:.2f}, {result.new_tokens} "
                    f"tokens, identical to AR {row['identical_to_ar']}, {wall:.0f}s")
                rows.append(row)
                yield_rows(args, "tau", rows, extra=dict(models=models))
    return rows


# ----------------------------------------------------------------------------- reports

STAMP = datetime.datetime.now().strftime("%Y-%m-%d_%H%M%S")


def yield_rows(args, what: str, rows: list[dict], extra: dict | None = None) -> None:
    """(Re)write the results after every row: a stopped run keeps what it measured."""
    from bench_util import git_commit, versions

    import jax

    meta = dict(date=STAMP, commit=git_commit(args.git_commit), argv=sys.argv[1:],
                device=str(jax.devices()[0].device_kind), backend=jax.default_backend(),
                versions=versions(), python=sys.version.split()[0], shape=args.shape,
                max_new_tokens=args.max_new_tokens, cpu_count=os.cpu_count(),
                load_average=os.getloadavg(), **(extra or {}))
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"long_{what}_{STAMP}")
    with open(base + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=2)
    with open(base + ".md", "w") as f:
        f.write(REPORTS[what](meta, rows))


def _mb(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def prefill_report(meta, rows) -> str:
    lines = [f"# Prefill memory and time ({meta['shape']}, {meta['device']}, commit "
             f"{meta['commit']}, {meta['date']})", "", _load_line(meta), "",
             "XLA temp = the compiled prefill's largest live set of intermediates "
             "(`memory_analysis().temp_size_in_bytes`); peak = the child process's peak "
             "RSS (CPU) or the device's peak bytes in use (GPU), weights and compiler "
             "included.", "",
             "| prompt tokens | mode | chunks x len | XLA temp MB | args MB | peak MB | "
             "compile s | prefill s | tokens/s | first token |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r.get('length')} | {r.get('mode')} | error: {r['error']} "
                         "| | | | | | | |")
            continue
        chunks = "x".join(str(c) for c in r["chunks"])
        prefill = f"{r['prefill_s']:.2f}" if "prefill_s" in r else "-"
        tps = f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else "-"
        lines.append(f"| {r['length']} | {r['mode']} | {chunks} | {_mb(r['temp_bytes'])} | "
                     f"{_mb(r['argument_bytes'])} | {_mb(r['peak_bytes'])} | "
                     f"{r['compile_s']:.1f} | {prefill} | {tps} | {r.get('first_token', '-')} |")
    return "\n".join(lines) + "\n"


def _load_line(meta) -> str:
    load = meta.get("load_average")
    return ("" if load is None else f"Machine: {meta.get('cpu_count')} CPUs, load average "
            f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) when written; "
            "times on a shared machine are upper bounds.")


def draft_report(meta, rows) -> str:
    lines = [f"# Draft forward against the context ({meta['shape']}, {meta['device']}, "
             f"commit {meta['commit']}, {meta['date']})", "", _load_line(meta), "",
             "`draft_block`: backbone over one round's context rows + block, LM head on the "
             "draft rows; median of the reps.", "",
             "| context positions | window | draft ms | min ms | XLA temp MB |",
             "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r.get('context')} | {r.get('window')} | error: {r['error']} | | |")
            continue
        window = r["window"] or "full"
        lines.append(f"| {r['context']} | {window} | {r['draft_ms']:.2f} | "
                     f"{r['draft_ms_min']:.2f} | {_mb(r['temp_bytes'])} |")
    return "\n".join(lines) + "\n"


def tau_report(meta, rows) -> str:
    lines = [f"# tau at long context ({meta.get('models')}, {meta['device']}, commit "
             f"{meta['commit']}, {meta['date']}, greedy, {meta['max_new_tokens']} new tokens, "
             f"Python {meta['python']} sources)", "", _load_line(meta), "",
             "| context | prompt | tokens | method | tau | new tokens | identical to AR |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        same = "-" if r["identical_to_ar"] is None else ("yes" if r["identical_to_ar"] else "NO")
        lines.append(f"| {r['length']} | {r['prompt']} | {r['prompt_tokens']} | {r['method']} "
                     f"| {r['tau']:.2f} | {r['new_tokens']} | {same} |")
    by = {}
    for r in rows:
        by.setdefault((r["length"], r["method"]), []).append(r)
    lines += ["", "Mean over the prompts of each context length (tau pooled: committed "
              "tokens / rounds):", "", "| context | method | tau | prompts |", "|---|---|---|---|"]
    for (length, method), group in by.items():
        tokens = sum(r["new_tokens"] for r in group)
        rounds = sum(r["rounds"] for r in group)
        lines.append(f"| {length} | {method} | {tokens / max(rounds, 1):.2f} | {len(group)} |")
    return "\n".join(lines) + "\n"


REPORTS = dict(prefill=prefill_report, draft=draft_report, tau=tau_report)


# ----------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("prefill", "draft", "tau"))
    p.add_argument("--shape", choices=("demo", "qwen3-8b", "tiny"), default="demo")
    p.add_argument("--lengths", default="1024,4096,8192")
    p.add_argument("--modes", default="whole,chunked", help=f"prefill: of {list(MODES)}")
    p.add_argument("--contexts", default="1024,4096,8192", help="draft: context positions")
    p.add_argument("--windows", default="0,512", help="draft: 0 = full attention")
    p.add_argument("--methods", default="ar,dflash,domino,ddtree,dominotree",
                   help="tau: also domino@wN (Domino with a context window of N)")
    p.add_argument("--budget", type=int, default=16, help="tau: tree budget")
    p.add_argument("--per-kind", type=int, default=1, help="tau: prompts per kind (doc, code)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--compile-only", action="store_true", help="prefill: memory analysis only")
    p.add_argument("--child-timeout-s", type=float, default=1800)
    p.add_argument("--git-commit", default=None)
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "benchmarks",
                                                                          "results"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, help=argparse.SUPPRESS)
    p.add_argument("--window", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.shape == "tiny":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.child:
        row = (prefill_child if args.what == "prefill" else draft_child)(args)
        print("RESULT " + json.dumps(row), flush=True)
        return
    if args.what == "prefill":
        unknown = [m for m in args.modes.split(",") if m not in MODES]
        if unknown:
            raise SystemExit(f"--modes: unknown {unknown}; known: {list(MODES)}")
        run_children(args, "prefill", [dict(length=int(n), mode=m)
                                       for n in args.lengths.split(",")
                                       for m in args.modes.split(",")])
    elif args.what == "draft":
        run_children(args, "draft", [dict(context=int(c), window=int(w))
                                     for c in args.contexts.split(",")
                                     for w in args.windows.split(",")])
    else:
        tau_run(args)


if __name__ == "__main__":
    main()
