"""On-device tree build time per round at the Qwen3-8B drafter shape (random weights), and the
Domino head's kernel sweep.

DominoTree (K = 16 depths, node_topk 8, topm 64, the real head shape: H 4096, G 1024,
E 256, V 151936) and DDTree (K = 15 depths over V = 151936), budgets 8/16/32/64, batch 1,
with the library's builder (domino_jax/decode/tree.py, one batched step per depth),
DominoTree with the head in its decode layout (``DecodeHead`` with the GRU input table, what
``load_pair`` gives) and in its checkpoint layout. (Older results also timed the heap
builders now kept in tests/heap_tree_builders.py as the reference.)
Each build is one jitted call; warm-up first, then the median of ``--reps`` calls with
``block_until_ready``. Target: <= 0.5 ms per round at budget 16 (docs/design.md §6-7).
``--head-kernels xla,pallas`` also times DominoTree (decode head) with its depth steps through
the fused Pallas kernel (``domino_jax/pallas/tree_step.py``) in the same process, and checks
that it builds the XLA path's tree.

The kernel sweep (docs/design.md §6), for one device call: ``--tunings`` times every kernel
implementation under each blocking (``pallas.step_plan.KernelTuning``; presets in
:data:`PRESETS` or ``label:field=int,...``), ``--head-rollout`` also the chain head's
rollout (16 greedy steps, batch 1, own jit) through XLA and each kernel variant (same
drafts checked), every time beside its bandwidth floor at this device's bandwidth;
``--only-kernels`` skips the plain head, DDTree and the top-k; ``--trace DIR`` records a
``jax.profiler`` trace of ``--trace-reps`` warm calls of every variant and summarises its
device kernels per call (``--summarise-trace DIR`` re-reads such a folder on any machine);
``--time-budget-s`` stops starting variants (each compiles its kernels, ~1 s each on a GPU)
past it, and results are rewritten after every variant.

    python benchmarks/bench_tree_build.py [--budgets 8,16,32,64] [--head-kernels xla,pallas]
                                          [--tiny] [--out DIR]
    python benchmarks/bench_tree_build.py --head-kernels xla,pallas --tunings default,rowgru \\
        --head-rollout --only-kernels --budgets 16 --trace DIR/trace --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

# Named blockings for --tunings (pallas.step_plan.KernelTuning fields; docs/design.md §6
# says what each trades), in the order a time-limited sweep should run them.
PRESETS = {
    "default": "",
    "rowgru": "row_gru=1",                       # kernel B: the GRU on the live row (batch 1)
    "split": "split_advance=1",                  # advance: GRU per G-chunk, products in XLA
    "split_gc32": "split_advance=1,gru_chunk=32",
    "ec32": "emb_chunk=32",                      # kernel A: 3 programs per SM, one wave
    "gc32": "gru_chunk=32",                      # kernel B / depth step without spills
    "best_guess": "row_gru=1,split_advance=1,gru_chunk=32,emb_chunk=32",
    "bv1024w8": "block_v=1024,num_warps=8",      # kernel A: half the partials
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budgets", default="8,16,32,64")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke test)")
    p.add_argument("--head-kernels", default="xla",
                   help="comma list of DominoTree depth-step (and head) implementations to "
                        "time with the decode head (pallas.head_kernels: xla, pallas, "
                        "reference, pallas_interpret); the first is the baseline the trees "
                        "and drafts are compared with")
    p.add_argument("--tunings", default="default",
                   help="comma list of kernel blockings for every implementation but xla: "
                        f"a preset ({', '.join(PRESETS)}) or LABEL:field=int[+field=int...]"
                        " (pallas.step_plan.KernelTuning fields)")
    p.add_argument("--head-rollout", action="store_true",
                   help="also time the chain head's rollout (own jit) per implementation")
    p.add_argument("--only-kernels", action="store_true",
                   help="skip the plain head, DDTree and top-k timings (the kernel sweep)")
    p.add_argument("--trace", default=None, help="folder for a jax.profiler trace per variant")
    p.add_argument("--trace-reps", type=int, default=3, help="warm calls per trace")
    p.add_argument("--summarise-trace", default=None, metavar="DIR",
                   help="only summarise the traces under DIR (a --trace folder) and exit")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="start no variant past this many seconds (default: no limit)")
    p.add_argument("--git-commit", default="unknown")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    args = p.parse_args(argv)
    args.budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    args.impls = [x.strip() for x in args.head_kernels.split(",") if x.strip()]
    from domino_jax.pallas import HEAD_IMPLEMENTATIONS     # imports no jax
    bad = sorted(set(args.impls) - set(HEAD_IMPLEMENTATIONS))
    if bad:
        p.error(f"unknown --head-kernels {bad}; choose from {HEAD_IMPLEMENTATIONS}")
    try:
        args.tunings = parse_tunings(args.tunings)
    except ValueError as e:
        p.error(str(e))
    return args


def parse_tunings(spec: str) -> list[tuple[str, object]]:
    """``[(label, KernelTuning)]`` from ``--tunings`` (``ValueError`` naming a bad entry)."""
    from domino_jax.pallas.head_kernels import parse_tuning

    out = []
    for entry in [e.strip() for e in spec.split(",") if e.strip()]:
        label, sep, fields = entry.partition(":")
        if not sep:
            if entry not in PRESETS:
                raise ValueError(f"--tunings entry {entry!r}: not a preset ({', '.join(PRESETS)})"
                                 " nor LABEL:field=int[+field=int...]")
            fields = PRESETS[entry]
        if label in [x for x, _ in out]:
            raise ValueError(f"--tunings label {label!r} given twice")
        out.append((label, parse_tuning(fields.replace("+", ","))))
    return out or [("default", parse_tuning(""))]


def variants(impls, tunings) -> list[tuple[str, str, object]]:
    """``(impl, label, tuning)``: ``xla`` once, every other implementation per tuning."""
    return [(i, "-", None) if i == "xla" else (i, label, t)
            for i in impls for label, t in ([(None, None)] if i == "xla" else tunings)]


def variant_name(impl: str, label: str) -> str:
    return impl if label in ("-", "default") else f"{impl}[{label}]"


class Sweep:
    """Times variants within the time budget; records each (and its trace summary)."""

    def __init__(self, args, start: float):
        self.args, self.start, self.skipped = args, start, []

    def run(self, name: str, fn, xs) -> dict | None:
        import jax

        from bench_util import summarise_trace, time_calls, trace_calls, load_perfetto

        a = self.args
        if a.time_budget_s is not None and time.perf_counter() - self.start > a.time_budget_s:
            self.skipped.append(name)
            print(f"SKIP {name}: past --time-budget-s {a.time_budget_s:.0f}", flush=True)
            return None
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*xs))                  # compile + first run
        entry = dict(compile_s=time.perf_counter() - t0,
                     **time_calls(lambda: fn(*xs), a.reps, warmup=1))
        if a.trace:
            folder = os.path.join(a.trace, name.replace("[", "_").replace("]", "")
                                  .replace("/", "_"))
            trace_calls(lambda: fn(*xs), folder, a.trace_reps)
            entry["trace"] = summarise_trace(load_perfetto(folder), a.trace_reps)
            entry["trace_dir"] = folder
        entry["_out"] = out
        return entry


def rollout_bench(cfg, head, hidden, base, embed):
    """``(fn(impl, tuning) -> jitted rollout, inputs, floor bytes)`` for the chain head's
    greedy rollout at batch 1 (own jit): ``domino_head.rollout`` for XLA, else
    ``head_kernels.fused_rollout`` (floor: ``bench_util.head_rollout_bytes``)."""
    import jax
    import jax.numpy as jnp

    from bench_util import head_rollout_bytes
    from domino_jax.models import domino_head
    from domino_jax.pallas import head_kernels

    hidden, base, root = hidden[None], base[None], embed[7][None]
    k, v = base.shape[1], base.shape[2]
    key = jax.random.PRNGKey(0)
    argmax = lambda logits, _: jnp.argmax(logits, axis=-1).astype(jnp.int32)   # noqa: E731
    nbytes = head_rollout_bytes(head, k, cfg.pure_draft_prefix_len, 1, v,
                                base_itemsize=jnp.dtype(base.dtype).itemsize)

    def rollout_fn(impl, tuning):
        kernels = head_kernels.rollout_kernels(impl, head, 1, v, tuning=tuning)
        if kernels is None:
            return jax.jit(lambda hd, h, b, r, e: domino_head.rollout(
                hd, cfg, h, b, r, e, argmax, key)[0])
        return jax.jit(lambda hd, h, b, r, e: head_kernels.fused_rollout(
            hd, cfg, h, b, r.astype(h.dtype), kernels, None, key, need_logits=False)[0])

    return rollout_fn, (head, hidden, base, root, embed), nbytes


def tree_floor_bytes(head, cfg, k: int, v: int, budget: int, base_itemsize: int) -> int:
    """Bytes a DominoTree build must read: the base logits twice (top-k, log-softmax), the
    top-M ``W2`` columns and ``W1_z`` once, and per advanced depth ``state_proj`` and the
    ``budget`` gathered input-table rows."""
    import numpy as np

    from domino_jax.models import domino_head

    params = domino_head.plain_params(head)
    emb = params["embed_proj_2"]["kernel"].shape[0]
    w1 = params["embed_proj_0"]["kernel"]
    w1_z = int(np.prod(w1.shape)) * w1.dtype.itemsize * cfg.hidden_size // w1.shape[0]
    proj = int(np.prod(head.state_proj.shape)) * head.state_proj.dtype.itemsize
    gates = budget * head.input_table.shape[1] * head.input_table.dtype.itemsize
    return 2 * k * v * base_itemsize + k * 64 * emb * 2 + w1_z + (k - 1) * (proj + gates)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.summarise_trace:
        return print_trace_summaries(args.summarise_trace, args.trace_reps)
    start = time.perf_counter()

    import jax
    import jax.numpy as jnp

    from bench_util import hbm_bytes_per_s, time_calls, with_floor
    from domino_jax.config import QWEN3_8B_DOMINO_DRAFT
    from domino_jax.decode import tree as tree_lib
    from domino_jax.models.domino_head import decode_head, init_head_params, root_gru_state
    from domino_jax.pallas import head_kernels

    cfg = QWEN3_8B_DOMINO_DRAFT
    if args.tiny:
        cfg = dataclasses.replace(cfg, vocab_size=512, hidden_size=64, gru_hidden_dim=32,
                                  emb_dim=16)
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    k, h, v = cfg.block_size, cfg.hidden_size, cfg.vocab_size
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    head = jax.jit(lambda r: init_head_params(cfg, r, dtype))(keys[0])
    hidden = jax.random.normal(keys[1], (k, h), dtype)
    base = (4.0 * jax.random.normal(keys[2], (k, v), jnp.float32)).astype(dtype)
    embed = (0.02 * jax.random.normal(keys[3], (v, h), jnp.float32)).astype(dtype)
    root_state = root_gru_state(head, embed[7])
    head_for_decode = decode_head(head, embed)            # + [V, 3G] GRU input table
    sweep = Sweep(args, start)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    meta = dict(date=stamp, commit=args.git_commit, device=str(jax.devices()[0].device_kind),
                jax=jax.__version__, dtype=str(jnp.dtype(dtype)), K=k, H=h, V=v,
                G=cfg.gru_hidden_dim, E=cfg.emb_dim, node_topk=8, topm=64, tiny=args.tiny,
                head_kernels=args.impls, hbm_bytes_per_s=hbm_bytes_per_s(),
                tunings={label: t._asdict() for label, t in args.tunings}, argv=sys.argv[1:])
    result = dict(meta=meta, rollout=[], rows=[], topk=[], skipped=sweep.skipped)

    def save():
        os.makedirs(args.out, exist_ok=True)
        result["elapsed_s"] = time.perf_counter() - start
        with open(os.path.join(args.out, f"tree_build_{stamp}.json"), "w") as f:
            json.dump(result, f, indent=2)
        with open(os.path.join(args.out, f"tree_build_{stamp}.md"), "w") as f:
            f.write(markdown(result) + "\n")

    itemsize = jnp.dtype(dtype).itemsize
    rollout_fn, rollout_inputs, rollout_floor = rollout_bench(cfg, head_for_decode, hidden,
                                                              base, embed)
    rows = {b: dict(budget=b, variants=[]) for b in args.budgets}
    result["rows"] = list(rows.values())
    first_drafts, trees = None, {b: {} for b in args.budgets}

    def domino_fn(impl, n, tuning=None):
        kernels = head_kernels.tree_kernels(impl, head_for_decode, n, v, 8, 64, tuning=tuning)
        return jax.jit(lambda hp, hd, b, s, e: tree_lib.build_dominotree(
            hp, cfg, hd, b, s, e, n, node_topk=8, topm=64, kernels=kernels))

    # variant by variant (rollout, then each budget's tree): a time budget cuts whole variants
    for impl, label, tuning in variants(args.impls, args.tunings):
        name = variant_name(impl, label)
        fields = dict(impl=impl, tuning=label)
        if args.head_rollout:
            entry = sweep.run("rollout_" + name, rollout_fn(impl, tuning), rollout_inputs)
            if entry is not None:
                drafts = entry.pop("_out")
                first_drafts = drafts if first_drafts is None else first_drafts
                entry.update(fields, same_drafts=float(jnp.mean(drafts == first_drafts)))
                result["rollout"].append(with_floor(entry, rollout_floor))
                print(f"rollout {name}: {entry['ms']:.3f} ms (pipelined "
                      f"{entry['ms_pipelined_mean']:.3f}), floor {entry['floor_ms']:.3f}, same "
                      f"drafts {entry['same_drafts']:.3f}, compile {entry['compile_s']:.1f} s",
                      flush=True)
                save()
        for budget, row in rows.items():
            entry = sweep.run(f"tree{budget}_{name}", domino_fn(impl, budget, tuning),
                              (head_for_decode, hidden, base, root_state, embed))
            if entry is None:
                continue
            tree = trees[budget][name] = entry.pop("_out")
            first = trees[budget][next(iter(trees[budget]))]
            same = bool(jnp.all((tree.tokens == first.tokens) & (tree.parents == first.parents)))
            entry.update(fields, same_tree=same)
            row["variants"].append(with_floor(entry, tree_floor_bytes(
                head_for_decode, cfg, k, v, budget, itemsize)))
            # the former flat keys, as older results have them
            row["dominotree_decode_head_ms" if impl == "xla" else
                f"dominotree_decode_head_{name}_ms"] = entry["ms"]
            if name != next(iter(trees[budget])):
                row[f"same_tree_{name}"] = same
            print(f"tree budget {budget} {name}: {entry['ms']:.3f} ms (pipelined "
                  f"{entry['ms_pipelined_mean']:.3f}), same tree {same}, compile "
                  f"{entry['compile_s']:.1f} s", flush=True)
            save()
    for budget, row in rows.items():
        if args.only_kernels:
            continue
        domino = domino_fn("xla", budget)
        ddtree = jax.jit(lambda b, n=budget: tree_lib.build_ddtree(b, n))
        if "dominotree_decode_head_ms" not in row:
            row["dominotree_decode_head_ms"] = time_calls(
                lambda: domino(head_for_decode, hidden, base, root_state, embed), args.reps)["ms"]
        row["dominotree_plain_head_ms"] = time_calls(
            lambda: domino(head, hidden, base, root_state, embed), args.reps)["ms"]
        row["ddtree_ms"] = time_calls(lambda: ddtree(base[1:].astype(jnp.float32)),
                                      args.reps)["ms"]
        print(" ".join(f"{key} {value:.3f}" if isinstance(value, float) else f"{key} {value}"
                       for key, value in row.items() if key != "variants"), flush=True)
        save()
    if not args.only_kernels:
        result["topk"] = topk_section(args, base)
    save()
    print(markdown(result), flush=True)


def topk_section(args, base) -> list[dict]:
    """The vocabulary-wide top-k that every build starts with ([K, V] float32): XLA's
    lax.top_k against the two-stage top-k of domino_jax/topk.py (docs/design.md §7)."""
    import jax
    import jax.numpy as jnp

    from bench_util import time_calls
    from domino_jax import topk as topk_lib

    logits32 = base.astype(jnp.float32)
    rows = []
    for top in (8, 16, 32, 64):
        lax_fn = jax.jit(lambda x, t=top: jax.lax.top_k(x, t))
        two_fn = jax.jit(lambda x, t=top: topk_lib.two_stage_top_k(x, t))
        lax_ms = time_calls(lambda: lax_fn(logits32), args.reps)["ms"]
        two_ms = (time_calls(lambda: two_fn(logits32), args.reps)["ms"]
                  if top <= base.shape[1] // topk_lib.CHUNK else None)
        rows.append(dict(k=top, lax_top_k_ms=lax_ms, two_stage_ms=two_ms))
        print(f"top-{top} over {list(base.shape)}: lax {lax_ms:.3f} ms, two-stage "
              + (f"{two_ms:.3f} ms" if two_ms is not None else "n/a"), flush=True)
    return rows


from tree_build_report import markdown, print_trace_summaries  # noqa: E402

if __name__ == "__main__":
    main()
