"""Attention over the KV cache at decode shapes: our ``attend`` against other formulations.

At prompt 2048 a 17-row verify costs ~2 ms more per round than a 1-row AR step on the H200
(NOTES entry 10), against ~0.3 ms from the extra bytes. This script times, for the Qwen3-8B
attention shape (32 query heads, 8 KV heads, head dim 128, bf16), one attention per layer
over ``--layers`` distinct cache layers (so nothing stays in L2), inside a ``fori_loop``:

* ``ours``: the einsum formulation, ``models.layers.attend_reference`` (``attend`` itself
  until it switched to ``jax.nn.dot_product_attention``, i.e. ``dpa_xla`` below), on the
  cache layout ``[B, S, nKV, D]`` (what ``kv_cache.py`` stores), masked with ``where``;
* ``heads_major``: the same maths on a ``[B, nKV, S, D]`` cache (no transposes before the
  batched products);
* ``bias``: ``ours`` with an additive ``0 / -inf`` bias instead of ``where``;
* ``dpa_xla`` / ``dpa_cudnn``: ``jax.nn.dot_product_attention`` with the XLA and the cuDNN
  implementations (a failure is reported, not raised);
* ``split_k128`` / ``split_k256``: flash-decoding's split of the keys into chunks, the
  ``P V`` product batched over chunks (contexts must be multiples of the chunk);
* ``pallas``: the library's split-K Pallas kernel (``pallas/cache_attention.py``; contexts
  must be multiples of 16; it skips the chunks past the last visible slot) on a layer slice
  (which XLA copies out before the custom call); ``pallas_stacked``: the kernel reading the
  layer of the stacked cache in place, as the models call it.

Rows: queries ``T`` in ``--queries`` x context ``S`` in ``--contexts``; us per layer, median
of ``--reps`` calls.

    python benchmarks/bench_attention.py [--tiny] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def variants():
    import jax
    import jax.numpy as jnp

    from domino_jax.models.layers import MASK_VALUE, attend_reference
    from domino_jax.pallas import cache_attention as kernel

    # off the GPU (the --tiny smoke test) the kernel variants run in the Pallas interpreter
    cache_attention = functools.partial(kernel.cache_attention,
                                        interpret=jax.default_backend() != "gpu")

    def heads_major(q, k, v, visible):            # k, v [B, nKV, S, D]
        b, t, nh, d = q.shape
        kv = k.shape[1]
        qg = q.reshape(b, t, kv, nh // kv, d)
        s = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32)
        s = jnp.where(visible[:, None, None], s * d ** -0.5, MASK_VALUE)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        return jnp.einsum("bkgts,bksd->btkgd", p, v).reshape(b, t, nh, d)

    def bias(q, k, v, visible):
        b, t, nh, d = q.shape
        kv = k.shape[2]
        qg = q.reshape(b, t, kv, nh // kv, d)
        add = jnp.where(visible, 0.0, MASK_VALUE).astype(jnp.float32)[:, None, None]
        s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
        p = jax.nn.softmax(s * d ** -0.5 + add, axis=-1).astype(v.dtype)
        return jnp.einsum("bkgts,bskd->btkgd", p, v).reshape(b, t, nh, d)

    def dpa(impl):
        def f(q, k, v, visible):
            return jax.nn.dot_product_attention(q, k, v, mask=visible[:, None],
                                                implementation=impl)
        return f

    def split_k(chunk):
        """Flash-decoding's split over the keys: the ``S`` keys as ``[S / chunk, chunk]``, one
        global softmax max and sum, then ``P V`` as a product batched over the chunks (more
        blocks in flight than one long ``S`` reduction per head) summed in float32."""
        def f(q, k, v, visible):
            b, t, nh, d = q.shape
            s_len, kv = k.shape[1], k.shape[2]
            if s_len % chunk:
                raise ValueError(f"context {s_len} is not a multiple of chunk {chunk}")
            n = s_len // chunk
            qg = q.reshape(b, t, kv, nh // kv, d)
            kc, vc = k.reshape(b, n, chunk, kv, d), v.reshape(b, n, chunk, kv, d)
            sc = jnp.einsum("btkgd,bnckd->bkgtnc", qg, kc, preferred_element_type=jnp.float32)
            sc = jnp.where(visible.reshape(b, 1, 1, t, n, chunk), sc * d ** -0.5, MASK_VALUE)
            m = jnp.max(sc, axis=(-2, -1), keepdims=True)
            e = jnp.exp(sc - m)
            norm = jnp.sum(e, axis=(-2, -1))                                # [b, kv, g, t]
            part = jnp.einsum("bkgtnc,bnckd->bkgtnd", e.astype(v.dtype), vc,
                              preferred_element_type=jnp.float32)
            out = (jnp.sum(part, axis=-2) / norm[..., None]).astype(v.dtype)  # [b, kv, g, t, d]
            return jnp.moveaxis(out, 3, 1).reshape(b, t, nh, d)
        return f

    # name -> (fn, cache layout): "slice" = fn(q, k[layer], v[layer]) on [B, S, nKV, D],
    # "heads" = the same on a [B, nKV, S, D] cache, "stacked" = fn(q, k, v, layer=) on the
    # whole [L, B, S, nKV, D] cache, read in place (what the models do)
    return {"ours": (attend_reference, "slice"), "heads_major": (heads_major, "heads"),
            "bias": (bias, "slice"), "dpa_xla": (dpa("xla"), "slice"),
            "dpa_cudnn": (dpa("cudnn"), "slice"), "split_k128": (split_k(128), "slice"),
            "split_k256": (split_k(256), "slice"), "pallas": (cache_attention, "slice"),
            "pallas_p256": (functools.partial(cache_attention, target_programs=256), "slice"),
            "pallas_p1024_bk32": (functools.partial(cache_attention, target_programs=1024,
                                                    block_k=32), "slice"),
            "pallas_bk128_w8": (functools.partial(cache_attention, block_k=128, num_warps=8),
                                "slice"),
            "pallas_stacked": (cache_attention, "stacked"),
            "pallas_p256_stacked": (functools.partial(cache_attention, target_programs=256),
                                    "stacked")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--queries", default="1,17")
    p.add_argument("--contexts", default="769,2321")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--variants", default=None,
                   help="comma list (default all); the first one is the diff reference")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--git-commit", default="unknown")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    nh, kv, d = 32, 8, 128
    if args.tiny:
        nh, kv, d, args.layers, args.contexts = 4, 2, 16, 2, "256"
    dtype = jnp.bfloat16
    rows = []
    for s_len in [int(x) for x in args.contexts.split(",")]:
        k_cache = (jax.random.normal(jax.random.PRNGKey(1), (args.layers, 1, s_len, kv, d))
                   ).astype(dtype)
        v_cache = (jax.random.normal(jax.random.PRNGKey(2), (args.layers, 1, s_len, kv, d))
                   ).astype(dtype)
        k_heads, v_heads = (jnp.swapaxes(x, 2, 3) for x in (k_cache, v_cache))
        for t_len in [int(x) for x in args.queries.split(",")]:
            q0 = jax.random.normal(jax.random.PRNGKey(3), (1, t_len, nh, d)).astype(dtype)
            # committed prefix + the new rows; the last 256 slots are unused capacity
            used = s_len - 256 if s_len > 512 else s_len - s_len // 4
            key_pos = jnp.arange(s_len)[None, None, :]
            query_pos = used - t_len + jnp.arange(t_len)[None, :, None]
            visible = key_pos <= query_pos                              # [1, T, S]
            reference = None
            table = variants()
            names = args.variants.split(",") if args.variants else list(table)
            for name in names:
                fn, layout = table[name]
                ks, vs = (k_heads, v_heads) if layout == "heads" else (k_cache, v_cache)
                if layout == "stacked":
                    attend_layer = lambda q, layer, fn=fn, ks=ks, vs=vs: fn(  # noqa: E731
                        q, ks, vs, visible, layer=layer)
                else:
                    attend_layer = lambda q, layer, fn=fn, ks=ks, vs=vs: fn(  # noqa: E731
                        q, ks[layer], vs[layer], visible)

                def run(q, attend_layer=attend_layer):
                    def step(_, q):
                        for layer in range(args.layers):
                            q = q + 1e-3 * attend_layer(q, layer).astype(q.dtype)
                        return q
                    return jax.lax.fori_loop(0, args.steps, step, q)

                row = {"variant": name, "queries": t_len, "context": s_len}
                try:
                    jitted = jax.jit(run)
                    out = jitted(q0).block_until_ready()
                    times = []
                    for _ in range(args.reps):
                        t0 = time.perf_counter()
                        jitted(q0).block_until_ready()
                        times.append(time.perf_counter() - t0)
                    row["us_per_layer"] = 1e6 * statistics.median(times) / (args.steps * args.layers)
                    if reference is None:
                        reference = out
                    row["max_abs_diff_vs_ours"] = float(jnp.max(jnp.abs(
                        out.astype(jnp.float32) - reference.astype(jnp.float32))))
                except Exception as e:  # noqa: BLE001 - report unsupported variants
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                print(json.dumps(row), flush=True)

    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    dev = jax.devices()[0].device_kind
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"attention_{stamp}.json"), "w") as f:
        json.dump({"date": stamp, "git_commit": args.git_commit, "device": dev,
                   "jax": jax.__version__, "rows": rows}, f, indent=1)
    lines = [f"# Attention over the cache, {dev}, commit {args.git_commit}, jax {jax.__version__}"
             f", {args.layers} layers, us per layer", "",
             "| queries | context | variant | us/layer | max abs diff vs the first variant |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['queries']} | {r['context']} | {r['variant']} | "
              + (f"{r['us_per_layer']:.1f} | {r['max_abs_diff_vs_ours']:.2e} |" if "error" not in r
                 else f"failed | {r['error'][:80]} |") for r in rows]
    with open(os.path.join(args.out, f"attention_{stamp}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
