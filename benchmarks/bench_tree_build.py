"""On-device tree build time per round at the Qwen3-8B drafter shape (random weights).

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

    python benchmarks/bench_tree_build.py [--budgets 8,16,32,64] [--head-kernels xla,pallas]
                                          [--tiny] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budgets", default="8,16,32,64")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke test)")
    p.add_argument("--head-kernels", default="xla",
                   help="comma list of DominoTree depth-step implementations to time with "
                        "the decode head (pallas.head_kernels: xla, pallas, reference, "
                        "pallas_interpret); the first is the baseline the trees are "
                        "compared with")
    p.add_argument("--git-commit", default="unknown")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args()

    import dataclasses

    import jax
    import jax.numpy as jnp

    from domino_jax.config import QWEN3_8B_DOMINO_DRAFT
    from domino_jax.decode import tree as tree_lib
    from domino_jax.models.domino_head import decode_head, init_head_params, root_gru_state
    from domino_jax.pallas import HEAD_IMPLEMENTATIONS, head_kernels

    cfg = QWEN3_8B_DOMINO_DRAFT
    if args.tiny:
        cfg = dataclasses.replace(cfg, vocab_size=512, hidden_size=64, gru_hidden_dim=32,
                                  emb_dim=16)
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    k, h, v = cfg.block_size, cfg.hidden_size, cfg.vocab_size
    k_rows = k                                   # draft depths (rows of the top-k inputs)
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    head = jax.jit(lambda r: init_head_params(cfg, r, dtype))(keys[0])
    hidden = jax.random.normal(keys[1], (k, h), dtype)
    base = (4.0 * jax.random.normal(keys[2], (k, v), jnp.float32)).astype(dtype)
    embed = (0.02 * jax.random.normal(keys[3], (v, h), jnp.float32)).astype(dtype)
    root_state = root_gru_state(head, embed[7])
    head_for_decode = decode_head(head, embed)            # + [V, 3G] GRU input table

    def timed(fn, *xs):
        jax.block_until_ready(fn(*xs))                        # compile + warm up
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*xs))
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    impls = [x.strip() for x in args.head_kernels.split(",") if x.strip()]
    bad = sorted(set(impls) - set(HEAD_IMPLEMENTATIONS))
    if bad:
        p.error(f"unknown --head-kernels {bad}; choose from {HEAD_IMPLEMENTATIONS}")
    rows = []
    for budget in [int(b) for b in args.budgets.split(",")]:
        row = dict(budget=budget)

        def domino_fn(impl, n=budget):
            kernels = head_kernels.tree_kernels(impl, head_for_decode, n, v, 8, 64)
            return jax.jit(lambda hp, hd, b, s, e: tree_lib.build_dominotree(
                hp, cfg, hd, b, s, e, n, node_topk=8, topm=64, kernels=kernels))

        domino = domino_fn("xla")
        ddtree = jax.jit(lambda b, n=budget: tree_lib.build_ddtree(b, n))
        trees = {}
        for impl in impls:                # the decode head, XLA and kernel depth steps
            fn = domino_fn(impl)
            key = "dominotree_decode_head_ms" if impl == "xla" else \
                f"dominotree_decode_head_{impl}_ms"
            row[key] = timed(fn, head_for_decode, hidden, base, root_state, embed)
            trees[impl] = fn(head_for_decode, hidden, base, root_state, embed)
            if impl != impls[0]:          # the same tree as the baseline's (bf16: near-ties)
                same = trees[impl].tokens == trees[impls[0]].tokens
                row[f"same_tree_{impl}"] = bool(jnp.all(same & (
                    trees[impl].parents == trees[impls[0]].parents)))
        if "xla" not in impls:
            row["dominotree_decode_head_ms"] = timed(domino, head_for_decode, hidden, base,
                                                     root_state, embed)
        row["dominotree_plain_head_ms"] = timed(domino, head, hidden, base, root_state, embed)
        row["ddtree_ms"] = timed(ddtree, base[1:].astype(jnp.float32))
        rows.append(row)
        print(" ".join(f"{name} {value:.3f}" if isinstance(value, float) else f"{name} {value}"
                       for name, value in row.items()), flush=True)
    # the vocabulary-wide top-k that every build starts with ([K, V] float32): XLA's
    # lax.top_k against the two-stage top-k of domino_jax/topk.py (docs/design.md §7)
    from domino_jax import topk as topk_lib
    logits32 = base.astype(jnp.float32)
    topk_rows = []
    for top in (8, 16, 32, 64):
        lax_ms = timed(jax.jit(lambda x, t=top: jax.lax.top_k(x, t)), logits32)
        two_ms = (timed(jax.jit(lambda x, t=top: topk_lib.two_stage_top_k(x, t)), logits32)
                  if top <= v // topk_lib.CHUNK else None)
        topk_rows.append(dict(k=top, lax_top_k_ms=lax_ms, two_stage_ms=two_ms))
        print(f"top-{top} over [{k_rows}, {v}]: lax {lax_ms:.3f} ms, two-stage "
              + (f"{two_ms:.3f} ms" if two_ms is not None else "n/a"), flush=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    meta = dict(date=stamp, commit=args.git_commit, device=str(jax.devices()[0].device_kind),
                jax=jax.__version__, dtype=str(jnp.dtype(dtype)), K=k, H=h, V=v,
                G=cfg.gru_hidden_dim, E=cfg.emb_dim, node_topk=8, topm=64, tiny=args.tiny,
                head_kernels=impls)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"tree_build_{stamp}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, topk=topk_rows), f, indent=2)
    kernel_impls = [i for i in impls if i != "xla"]
    lines = [f"# Tree build per round ({meta['device']}, {meta['dtype']}, commit "
             f"{args.git_commit}; K={k}, V={v}, H={h}, G={meta['G']}, E={meta['E']}, "
             "node_topk 8, topm 64)", "",
             "| budget | DominoTree ms (decode head) | "
             + "".join(f"DominoTree ms (decode head, {i} depth steps; same tree) | "
                       for i in kernel_impls)
             + "DominoTree ms (plain head) | DDTree ms |",
             "|---|---|" + "---|" * len(kernel_impls) + "---|---|"]
    lines += [f"| {r['budget']} | {r['dominotree_decode_head_ms']:.3f} | "
              + "".join(f"{r[f'dominotree_decode_head_{i}_ms']:.3f} "
                        f"({'yes' if r.get(f'same_tree_{i}', True) else 'NO'}) | "
                        for i in kernel_impls)
              + f"{r['dominotree_plain_head_ms']:.3f} | {r['ddtree_ms']:.3f} |" for r in rows]
    lines += ["", f"Vocabulary-wide top-k over [{k}, {v}] float32 (every build's setup):", "",
              "| k | lax.top_k ms | two-stage ms |", "|---|---|---|"]
    lines += [f"| {r['k']} | {r['lax_top_k_ms']:.3f} | "
              + (f"{r['two_stage_ms']:.3f}" if r["two_stage_ms"] is not None else "-") + " |"
              for r in topk_rows]
    with open(os.path.join(args.out, f"tree_build_{stamp}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
