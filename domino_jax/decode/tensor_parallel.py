"""Tensor-parallel decoding: the target (and drafter) split over a ``tensor`` mesh axis.

    mesh = tensor_mesh(4)                                  # the first 4 devices
    check_tensor_parallel(4, target.config, draft_config)  # heads must divide
    target_params, draft_params = shard_for_decode(mesh, target.config, target_params,
                                                   draft_params, draft_config)
    with mesh_context(mesh):
        result = generate(target, target_params, prompts, config, drafter, draft_params)

Megatron-style placement through :mod:`domino_jax.sharding`'s one table of rules: q/k/v
kernels split by attention heads (output columns), o_proj by its input rows, gate/up by MLP
columns, down_proj by its rows, the LM head and the embedding by vocabulary; norms and
everything of the drafter without a rule (the Domino head's GRU, the projector) are
replicated. The jitted prefill and round loop (:mod:`~domino_jax.decode.speculative`) take
the params' shardings; XLA's SPMD partitioner inserts the all-reduces, and the KV caches
(created inside the jitted prefill) follow the k/v projections' head split. The fused decode
layout (``[q | k | v]`` in one kernel) cannot be cut at head boundaries, so tensor-parallel
decoding loads the checkpoint layout (:func:`~domino_jax.decode.loading.load_pair` with
``fused=False``).

Greedy float32 output equals the single-device output token for token
(``tests/test_decode_tensor_parallel.py``, simulated CPU devices).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from domino_jax.sharding import (TARGET_PARAM_AXES, _path_str, logical_sharding, make_mesh,
                                 target_param_shardings)


def check_tensor_parallel(n: int, target_config, draft_config=None,
                          num_devices: int | None = None) -> None:
    """Raise ``ValueError`` (naming ``--tensor-parallel``) unless ``n`` devices exist and
    ``n`` divides the attention and kv head counts of the target (and the drafter)."""
    num_devices = jax.device_count() if num_devices is None else num_devices
    if n < 1:
        raise ValueError(f"--tensor-parallel {n} must be >= 1")
    if n > num_devices:
        raise ValueError(f"--tensor-parallel {n} exceeds the {num_devices} available "
                         f"{jax.default_backend()} device(s)")
    for name, cfg in (("target", target_config), ("drafter", draft_config)):
        if cfg is None:
            continue
        for field in ("num_heads", "num_kv_heads"):
            count = getattr(cfg, field)
            if count % n:
                raise ValueError(f"--tensor-parallel {n} does not divide the {name}'s "
                                 f"{field} {count} (a head cannot be split across devices)")


def tensor_mesh(n: int) -> Mesh:
    """A ``(data 1, fsdp 1, tensor n)`` mesh over the first ``n`` devices."""
    return make_mesh(tensor=n, devices=jax.devices()[:n])


def draft_param_shardings(params: Any, mesh: Mesh, config=None) -> Any:
    """NamedSharding per drafter parameter: the target's rules where a path matches one
    (attention and MLP projections of the backbone), replicated elsewhere."""
    units = None if config is None else {"heads": config.num_heads,
                                         "kv_heads": config.num_kv_heads}
    replicated = NamedSharding(mesh, PartitionSpec())

    def leaf(path, x):
        name = _path_str(path)
        for pattern, axes in TARGET_PARAM_AXES:
            if re.search(pattern, name) and len(axes) == x.ndim:
                return logical_sharding(mesh, axes, x.shape, units=units)
        return replicated
    return jax.tree_util.tree_map_with_path(leaf, params)


def shard_for_decode(mesh: Mesh, target_config, target_params, draft_params=None,
                     draft_config=None) -> tuple[Any, Any]:
    """``(target_params, draft_params)`` placed on ``mesh`` (``draft_params`` may be None)."""
    target_params = jax.device_put(
        target_params, target_param_shardings(target_params, mesh, target_config))
    if draft_params is not None:
        draft_params = jax.device_put(
            draft_params, draft_param_shardings(draft_params, mesh, draft_config))
    return target_params, draft_params


def mesh_context(mesh: Mesh | None):
    """``jax.set_mesh(mesh)`` (a no-op context for ``None``)."""
    if mesh is None:
        return contextlib.nullcontext()
    return jax.set_mesh(mesh)
