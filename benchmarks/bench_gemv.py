"""One-row matrix products (GEMVs) of a decode step: how close XLA gets to HBM bandwidth.

A batch-1 decode step of the Qwen3-8B target is 36 x 7 one-row products plus small
element-wise work. This script isolates the products: a ``lax.fori_loop`` of ``--steps``
steps whose body is ``--layers`` unrolled layers of only the projections (with a residual
and a SiLU so nothing can be hoisted or fused across layers), in three weight layouts:

* ``separate``: q, k, v, o, gate, up, down as seven ``[in, out]`` kernels (what the model
  stores, the Hugging Face layout transposed);
* ``fused``: one ``[H, (nH + 2 nKV) D]`` q/k/v kernel and one ``[H, 2 I]`` gate/up kernel
  (what vLLM's QKVParallelLinear / MergedColumnParallelLinear store): 4 products a layer;
* ``fused_t``: the fused kernels stored ``[out, in]`` (contracting the minor axis).

Each variant prints ms per step, the bytes it reads and ``% of floor`` at 4.3 TB/s.
Medians of ``--reps`` synchronised calls after a warm-up.

    python benchmarks/bench_gemv.py [--layers 36] [--steps 32] [--tiny] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

HBM_BYTES_PER_S = 4.3e12


def layer_shapes(hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int,
                 variant: str) -> dict[str, tuple[int, int]]:
    """Kernel shapes of one layer for ``variant`` (``[in, out]``; ``fused_t`` flips them)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    if variant == "separate":
        shapes = {"q": (hidden, q), "k": (hidden, kv), "v": (hidden, kv), "o": (q, hidden),
                  "gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}
    else:
        shapes = {"qkv": (hidden, q + 2 * kv), "o": (q, hidden), "gate_up": (hidden, 2 * inter),
                  "down": (inter, hidden)}
    if variant == "fused_t":
        shapes = {name: (o, i) for name, (i, o) in shapes.items()}
    return shapes


def make_step(variant: str, q_width: int, inter: int):
    """``step(weights, x) -> x'``: one pass over every layer's projections."""
    import jax
    import jax.numpy as jnp

    def mm(x, w):
        if variant == "fused_t":
            return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))
        return x @ w

    def step(weights, x):
        for w in weights:
            if variant == "separate":
                a = mm(x, w["q"]) + jnp.tile(mm(x, w["k"]) + mm(x, w["v"]), q_width // w["k"].shape[-1])
                g, u = mm(x, w["gate"]), mm(x, w["up"])
            else:
                qkv = mm(x, w["qkv"])
                a = qkv[:, :q_width]
                gu = mm(x, w["gate_up"])
                g, u = gu[:, :inter], gu[:, inter:]
            x = x + mm(a, w["o"])
            x = x + mm(jax.nn.silu(g) * u, w["down"])
        return x
    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--variants", default="separate,fused,fused_t")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--git-commit", default="unknown")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    hidden, heads, kv_heads, head_dim, inter = (4096, 32, 8, 128, 12288)
    if args.tiny:
        hidden, heads, kv_heads, head_dim, inter = (64, 4, 2, 16, 128)
        args.layers = min(args.layers, 2)
    dtype = jnp.bfloat16
    rows = []
    for variant in args.variants.split(","):
        shapes = layer_shapes(hidden, heads, kv_heads, head_dim, inter, variant)
        init = jax.jit(lambda key, shape: (0.02 * jax.random.normal(key, shape)).astype(dtype),
                       static_argnums=1)
        weights = [{n: init(jax.random.PRNGKey(100 * li + j), s)
                    for j, (n, s) in enumerate(shapes.items())} for li in range(args.layers)]
        nbytes = sum(w.size * w.dtype.itemsize for layer in weights for w in layer.values())
        step = make_step(variant, heads * head_dim, inter)

        @jax.jit
        def run(weights, x):
            return jax.lax.fori_loop(0, args.steps, lambda _, x: step(weights, x), x)

        x0 = jnp.ones((1, hidden), dtype)
        run(weights, x0).block_until_ready()
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            run(weights, x0).block_until_ready()
            times.append((time.perf_counter() - t0) / args.steps)
        ms = 1e3 * statistics.median(times)
        floor = 1e3 * nbytes / HBM_BYTES_PER_S
        rows.append({"variant": variant, "ms_per_step": ms, "bytes": nbytes,
                     "floor_ms": floor, "pct_of_floor": 100 * floor / ms,
                     "products_per_layer": len(shapes)})
        print(f"{variant:9s} {ms:.3f} ms/step  floor {floor:.3f}  {100 * floor / ms:.0f}%",
              flush=True)
        del weights

    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    dev = jax.devices()[0]
    report = {"date": stamp, "git_commit": args.git_commit, "device": dev.device_kind,
              "jax": jax.__version__, "layers": args.layers, "steps": args.steps, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"gemv_{stamp}.json"), "w") as f:
        json.dump(report, f, indent=1)
    lines = [f"# One-row products of a decode step, {dev.device_kind}, commit {args.git_commit}, "
             f"jax {jax.__version__}, {args.layers} layers", "",
             "| variant | products/layer | ms/step | floor ms | % of floor |", "|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['products_per_layer']} | {r['ms_per_step']:.3f} | "
              f"{r['floor_ms']:.3f} | {r['pct_of_floor']:.0f}% |" for r in rows]
    with open(os.path.join(args.out, f"gemv_{stamp}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
