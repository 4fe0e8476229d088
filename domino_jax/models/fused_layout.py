"""The decode parameter layout: q/k/v and gate/up kernels concatenated.

At batch 1 every decode step is a chain of one-row products, each reading its whole weight
matrix once. XLA reaches a larger share of HBM bandwidth on a few large products than on
many small ones: on the H200 the 36 layers of Qwen3-8B run their products at 68% of the
bandwidth floor with the seven Hugging Face matrices per layer and at 92% with four
(``benchmarks/bench_gemv.py``, ``benchmarks/NOTES.md`` entry 7). So, like vLLM's
``QKVParallelLinear`` / ``MergedColumnParallelLinear`` and MaxText's ``fused_qkv``, decoding
stores per layer

* ``self_attn/qkv_proj/{kernel [H, (nH + 2 nKV) D], bias}`` = ``[q | k | v]`` along the
  output axis, instead of ``q_proj``, ``k_proj``, ``v_proj``;
* ``mlp/gate_up_proj/kernel [H, 2 I]`` = ``[gate | up]``, instead of ``gate_proj``, ``up_proj``.

The models read the layout from ``config.fused_projections``. Checkpoints on disk, the
converters, training and the sharding rules for tensor parallelism all use the unfused
(Hugging Face) layout; :func:`fuse_model` converts once, at load time, for decoding.

The Domino head has a decode layout too (:func:`head_decode_params`): its 15 rollout steps
are sequential and each is a few one-row products, so every product saved per step is a
kernel launch saved 15 times per round. Two extra leaves, the plain ones kept (training and
the teacher-forced path read those):

* ``state_proj/kernel [G, E + 3G]`` = ``[W1_s | W_hh]``: the two products of the GRU state
  (its correction input and its hidden gates) become one;
* ``gru_input_table [V, 3G]`` float32 = ``embed_table @ W_ih`` (algorithms.md §3.1's table):
  a step's input gates become a row gather instead of an ``[H, 3G]`` product. It costs
  ``12 V G`` bytes (1.87 GB for Qwen3's vocabulary and G = 1024; float32 so the gates are
  the ones the plain path computes, where the reference fast paths keep a bf16 table).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
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


def head_decode_params(head_params: dict, embed_table: Any, input_table: bool = True) -> dict:
    """A copy of the Domino head's params with the decode leaves added (see module doc).

    ``embed_table [V, H]``: the target's embedding table (the GRU's inputs are its rows).
    ``input_table=False`` adds only ``state_proj`` (no ``[V, 3G]`` table). Raises
    ``ValueError`` when the head already has decode leaves or the shapes disagree.
    """
    from domino_jax.models.domino_head import gru_input_table, state_kernels

    present = sorted({"state_proj", "gru_input_table"} & set(head_params))
    if present:
        raise ValueError(f"head params already in the decode layout (has {present})")
    w_ih = head_params["prefix_gru"]["weight_ih"]
    if tuple(embed_table.shape[1:]) != (w_ih.shape[0],):
        raise ValueError(f"embed_table {tuple(embed_table.shape)} does not fit the head's "
                         f"prefix_gru/weight_ih {tuple(w_ih.shape)} (hidden size)")
    out = dict(head_params)
    out["state_proj"] = {"kernel": _concat(list(state_kernels(head_params)))}  # [G, E + 3G]
    if input_table:
        out["gru_input_table"] = jax.jit(gru_input_table)(
            head_params, jnp.asarray(embed_table).astype(w_ih.dtype))
    return out
