"""Helpers shared by the decode benchmarks: bandwidth floors (at the device's own memory
bandwidth), random weights made on the device, synchronised timing, ``jax.profiler`` traces
and their per-kernel summary, versions and the commit.

Import after ``bench_decode.setup_env`` (it imports jax, which reads its environment once).
"""

from __future__ import annotations

import collections
import functools
import glob
import gzip
import json
import os
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# HBM bandwidth per device kind (vendor peak figures), the floors' denominator
# (docs/design.md §22): the first entry whose words all occur in ``device_kind`` wins.
DEVICE_BANDWIDTH = ((("H100", "PCIe"), 2.0e12), (("H100", "NVL"), 3.9e12),
                    (("H100",), 3.35e12), (("H200",), 4.8e12),
                    (("A100", "40GB"), 1.555e12), (("A100",), 2.0e12))
FALLBACK_BYTES_PER_S = 4.3e12     # any other device (a CPU's floors mean nothing)


def hbm_bytes_per_s(device_kind: str | None = None) -> float:
    """The memory bandwidth the floors assume for ``device_kind`` (default: device 0's)."""
    kind = jax.devices()[0].device_kind if device_kind is None else device_kind
    for words, rate in DEVICE_BANDWIDTH:
        if all(w in kind for w in words):
            return rate
    return FALLBACK_BYTES_PER_S


def tree_bytes(tree) -> int:
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize
                   for x in jax.tree_util.tree_leaves(tree)))


def floor_ms(nbytes: float, bytes_per_s: float | None = None) -> float:
    """``nbytes`` at ``bytes_per_s`` (default: this device's, :func:`hbm_bytes_per_s`)."""
    return 1e3 * nbytes / (bytes_per_s or hbm_bytes_per_s())


def head_rollout_bytes(head, num_drafts: int, prefix: int, batch: int, vocab: int,
                       base_itemsize: int = 4, topm: int = 0) -> int:
    """Bytes a Domino head rollout must read (the floor's numerator): ``W1_z`` (the draft
    positions' ``z``) and ``W_ih`` (the root state) once; per corrected step (``num_drafts -
    prefix``) ``W2`` (``78 MB`` at the Qwen3-8B shape, larger than L2, so every step) and
    one row of base logits per batch row (with a ``topm`` pool instead: the pool's ``M``
    columns of ``W2`` per row); per GRU advance (``num_drafts - 1``)
    the state's weights: ``state_proj = [W_hh | W1_s]`` and one gathered row of the ``[V,
    3G]`` input table per batch row with the decode layout (the table itself is never read
    whole), else ``W_hh``, ``W1_s`` and ``W_ih`` (the input gates as a product)."""
    from domino_jax.models import domino_head

    params = domino_head.plain_params(head)
    hidden, emb = params["embed_proj_0"]["kernel"].shape
    hidden -= params["prefix_gru"]["weight_hh"].shape[0]                # rows of W1_z
    nbytes = lambda x: int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize  # noqa: E731
    w_ih = nbytes(params["prefix_gru"]["weight_ih"])
    w_hh = nbytes(params["prefix_gru"]["weight_hh"])
    w1 = nbytes(params["embed_proj_0"]["kernel"])
    w1_z = w1 * hidden // params["embed_proj_0"]["kernel"].shape[0]
    w2 = nbytes(params["embed_proj_2"]["kernel"])
    corrected, advances = num_drafts - prefix, num_drafts - 1
    if topm:
        per_step = batch * topm * (w2 // vocab)
    else:
        per_step = w2 + batch * vocab * base_itemsize
    if isinstance(head, domino_head.DecodeHead) and head.input_table is not None:
        gates_row = head.input_table.shape[1] * np.dtype(head.input_table.dtype).itemsize
        per_advance = nbytes(head.state_proj) + batch * gates_row
    else:
        per_advance = w_hh + (w1 - w1_z) + w_ih
    return int(w1_z + w_ih + corrected * per_step + advances * per_advance)


def with_floor(entry: dict, nbytes: float) -> dict:
    """Add ``floor_ms`` and ``pct_of_floor`` (floor / measured, 100 = at the floor) at this
    device's bandwidth (``floor_bytes_per_s``)."""
    entry["floor_bytes"] = int(nbytes)
    entry["floor_bytes_per_s"] = hbm_bytes_per_s()
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


# ------------------------------------------------------------------------------- traces

def trace_calls(call, directory: str, reps: int) -> None:
    """``reps`` synchronised warm calls of ``call()`` under ``jax.profiler.trace`` into
    ``directory`` (with a Perfetto JSON trace, :func:`load_perfetto`; no Python tracer, no
    HLO protos: small files)."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.enable_hlo_proto = False
    jax.block_until_ready(call())
    with jax.profiler.trace(directory, create_perfetto_trace=True, profiler_options=options):
        for _ in range(reps):
            jax.block_until_ready(call())


def load_perfetto(directory: str) -> dict:
    """The newest ``*perfetto_trace.json.gz`` / ``*.trace.json.gz`` under ``directory``."""
    files = sorted(glob.glob(os.path.join(directory, "**", "*perfetto_trace.json.gz"),
                             recursive=True)
                   + glob.glob(os.path.join(directory, "**", "*.trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no *perfetto_trace.json.gz / *.trace.json.gz under {directory}")
    with gzip.open(files[-1], "rt") as f:
        return json.load(f)


def _union_us(spans: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if start > end:
            busy, end = busy + stop - start, stop
        elif stop > end:
            busy, end = busy + stop - end, stop
    return busy


def device_events(trace: dict) -> tuple[list, str]:
    """The complete (``ph: X``) events of the trace's GPU/TPU device processes and
    ``"device"``; without any (a CPU run), the host's complete events but the Python
    tracer's (``$file:line``) and ``"host"``."""
    events = trace.get("traceEvents", [])
    names = {e.get("pid"): e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, n in names.items()
              if any(t in n.lower() for t in ("/device:gpu", "/device:tpu", "gpu:", "stream"))}
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if device:
        return [e for e in complete if e.get("pid") in device], "device"
    return [e for e in complete if not e.get("name", "").startswith("$")], "host"  # no Python


def summarise_trace(trace: dict, calls: int, top: int = 12) -> dict:
    """Per traced call (``calls`` of them): the device's kernels (``source`` ``"device"``;
    ``"host"`` events where the trace has no device, as on a CPU), their busy time (union of
    intervals) against the window from the first kernel's start to the last one's end (the
    rest: launch gaps), and the ``top`` kernels by total time: ``count`` and ``us`` per
    call, ``mean_us`` per launch."""
    events, source = device_events(trace)
    if not events:
        return {"source": source, "kernels_per_call": 0}
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events]
    window = max(b for _, b in spans) - min(a for a, _ in spans)
    busy = _union_us(spans)
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        by_name[e.get("name", "?")].append(float(e["dur"]))
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    return {"source": source, "calls": calls, "kernels_per_call": len(events) / calls,
            "busy_us_per_call": busy / calls, "window_us_per_call": window / calls,
            "busy_fraction": busy / window if window else None,
            "top": [{"name": n[:100], "count": len(d) / calls, "us": sum(d) / calls,
                     "mean_us": sum(d) / len(d)} for n, d in ranked[:top]]}


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
