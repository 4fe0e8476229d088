"""The decode parameter layout: q/k/v and gate/up kernels concatenated.

At batch 1 every decode step is a chain of one-row products, each reading its whole weight
matrix once. XLA reaches a larger share of HBM bandwidth on a few large products than on
many small ones (``docs/design.md`` §2). So, like vLLM's
``QKVParallelLinear`` / ``MergedColumnParallelLinear`` and MaxText's ``fused_qkv``, decoding
stores per layer

* ``self_attn/qkv_proj/{kernel [H, (nH + 2 nKV) D], bias}`` = ``[q | k | v]`` along the
  output axis, instead of ``q_proj``, ``k_proj``, ``v_proj``;
* ``mlp/gate_up_proj/kernel [H, 2 I]`` = ``[gate | up]``, instead of ``gate_proj``, ``up_proj``.

The models read the layout from ``config.fused_projections``. Checkpoints on disk, the
converters, training and the sharding rules for tensor parallelism all use the unfused
(Hugging Face) layout; :func:`fuse_model` converts once, at load time, for decoding.

The Domino head has its own decode layout: :func:`domino_jax.models.domino_head.decode_head`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

_GROUPS = (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
           ("gate_up_proj", ("gate_proj", "up_proj")))


def _concat(arrays):
    if all(isinstance(a, np.ndarray) for a in arrays):
        return np.concatenate(arrays, axis=-1)
    return jnp.concatenate(arrays, axis=-1)


def fuse_projections(params: Any, where: str = "params") -> Any:
    """A copy of ``params`` with every q/k/v and gate/up group concatenated (see module doc).

    Works on any subtree (target, DFlash backbone, a whole drafter tree); subtrees without
    those names are returned unchanged. Raises ``ValueError`` naming the path when a group
    is incomplete (e.g. ``q_proj`` without ``v_proj``) or a tree is already fused.
    """
    if not isinstance(params, dict):
        return params
    out = {}
    consumed: set[str] = set()
    for fused_name, parts in _GROUPS:
        present = [p for p in parts if p in params]
        if fused_name in params and present:
            raise ValueError(f"{where}: has both {fused_name!r} and {present}")
        if not present:
            continue
        if len(present) != len(parts):
            missing = sorted(set(parts) - set(present))
            raise ValueError(f"{where}: {present} without {missing}: cannot fuse {fused_name}")
        leaves = sorted(params[parts[0]])
        for p in parts:
            if sorted(params[p]) != leaves:
                raise ValueError(f"{where}/{p}: leaves {sorted(params[p])}, expected {leaves}")
        out[fused_name] = {leaf: _concat([params[p][leaf] for p in parts]) for leaf in leaves}
        consumed.update(parts)
    for name, value in params.items():
        if name not in consumed:
            out[name] = fuse_projections(value, f"{where}/{name}")
    return out


def fuse_model(config, params: Any) -> tuple[Any, Any]:
    """``(config with fused_projections=True, fused params)`` for a target or draft config.

    Raises ``ValueError`` when ``config`` is already fused.
    """
    if config.fused_projections:
        raise ValueError(f"{type(config).__name__} is already in the fused layout")
    return dataclasses.replace(config, fused_projections=True), fuse_projections(params)

