"""Helpers shared by the decode benchmarks: bandwidth floors, random weights made on the
device, synchronised timing, versions and the commit.

Import after ``bench_decode.setup_env`` (it imports jax, which reads its environment once).
"""

from __future__ import annotations

import functools
import os
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HBM_BYTES_PER_S = 4.3e12          # the floors' bandwidth (docs/design.md §22)


def tree_bytes(tree) -> int:
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize
                   for x in jax.tree_util.tree_leaves(tree)))


def floor_ms(nbytes: float) -> float:
    return 1e3 * nbytes / HBM_BYTES_PER_S


def with_floor(entry: dict, nbytes: float) -> dict:
    """Add ``floor_ms`` and ``pct_of_floor`` (floor / measured, 100 = at the floor)."""
    entry["floor_bytes"] = int(nbytes)
    entry["floor_ms"] = floor_ms(nbytes)
    ms = entry.get("ms")
    if ms:
        entry["pct_of_floor"] = 100.0 * entry["floor_ms"] / ms
    return entry


def _leaf_kind(name: str, shape) -> str:
    if "norm" in name and len(shape) == 1:
        return "ones"
    return "embed" if "embed_tokens" in name else "kernel"


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _random_leaf(key, shape, dtype, kind):
    """One parameter leaf. Jitted per (shape, dtype, kind), so the 36 identically shaped
    layers reuse a handful of small compiled RNG programs; the float32 draw is fused into
    the cast, and the largest transient is one leaf's random bits (2.5 GB for the
    151936 x 4096 embedding), not the model."""
    if kind == "ones":
        return jnp.ones(shape, dtype)
    scale = 0.02 if kind == "embed" else float(shape[0]) ** -0.5
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def random_params(shape_tree, seed: int):
    """Random weights made on the device, leaf by leaf (no host copy of the model).

    Norm weights are 1, the embedding N(0, 0.02), every kernel N(0, 1/fan_in): hidden
    states stay finite over 36 layers (NaN logits would make every argmax 0 and every
    draft 'accepted'). Leaf ``i`` uses ``split(PRNGKey(seed), n)[i]`` (the same values as
    the former one-jit version)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(shape_tree)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(flat))
    leaves = []
    for i, (path, leaf) in enumerate(flat):
        shape = tuple(int(s) for s in leaf.shape)
        kind = _leaf_kind(jax.tree_util.keystr(path), shape)
        leaves.append(_random_leaf(keys[i], shape, jnp.dtype(leaf.dtype), kind))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def device_peak_bytes() -> int | None:
    """Peak bytes in use on device 0 so far (None where the backend does not say)."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001
        return None
    peak = stats.get("peak_bytes_in_use")
    return int(peak) if peak is not None else None


def time_calls(call, reps: int, warmup: int = 2) -> dict:
    """Median over ``reps`` synchronised calls of ``call()`` (returns arrays to wait on),
    plus the mean over ``reps`` calls issued back to back (dispatch pipelined)."""
    for _ in range(warmup):
        jax.block_until_ready(call())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(1e3 * (time.perf_counter() - t0))
    t0 = time.perf_counter()
    out = None
    for _ in range(reps):
        out = call()
    jax.block_until_ready(out)
    pipelined = 1e3 * (time.perf_counter() - t0) / reps
    return {"ms": statistics.median(times), "ms_min": min(times), "ms_max": max(times),
            "ms_pipelined_mean": pipelined, "reps": reps}


def compile_timed(jitted, *args):
    t0 = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    return compiled, time.perf_counter() - t0


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, min(vocab, 150000), size=length).tolist()


def git_commit(override: str | None) -> str:
    if override:
        return override
    try:
        out = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--",
                                    "domino_jax", "benchmarks/bench_decode.py",
                                    "benchmarks/bench_util.py"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return out.stdout.strip() + ("+dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        pass
    return os.environ.get("BENCH_GIT_COMMIT", "unknown")


def versions() -> dict:
    import importlib.metadata as md
    found = {}
    for name in ("jax", "jaxlib", "flax", "numpy", "torch", "transformers"):
        try:
            found[name] = md.version(name)
        except Exception:  # noqa: BLE001
            found[name] = None
    return found
