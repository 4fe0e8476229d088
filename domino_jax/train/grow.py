"""Growing a trained drafter: more draft layers, a wider GRU, a wider correction, starting
from the function it already computes (docs/design.md §28).

A size trial that starts a larger drafter from random weights compares it with one that has
had every round of the campaign; growing the trained one instead compares sizes at equal
history. Each new piece starts where it adds exactly nothing:

* a new decoder layer (appended after the last) has random attention and MLP inputs but
  zero output projections (``o_proj``, ``down_proj``): its residual adds 0;
* new GRU units have random input and recurrent weights of their own, but the old units'
  gates read nothing from them (zero rows of ``W_hh`` into the old units' columns), and the
  correction reads nothing from them (zero rows of ``W1``'s state part into the old
  correction features);
* new correction features (``emb_dim``) have random ``W1`` columns but zero rows of ``W2``.

Every new weight still gets a gradient from the first step on (the zero pieces multiply
nonzero activations), so nothing is stuck at its start. ``tests/test_grow.py`` checks both:
equal logits at the start (float32), nonzero gradients on the new pieces.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from domino_jax.config import DraftConfig

# the output projections of a decoder layer: zero in a new layer, so its residual adds 0
_LAYER_OUTPUTS = ("o_proj", "down_proj")


def grown_config(config: DraftConfig, num_layers: int | None = None,
                 gru_hidden_dim: int | None = None, emb_dim: int | None = None) -> DraftConfig:
    """``config`` with the new sizes (``None``: unchanged); the target layers it taps stay.
    ValueError when a size shrinks or the drafter has no Domino head to widen."""
    sizes = {"num_layers": num_layers, "gru_hidden_dim": gru_hidden_dim, "emb_dim": emb_dim}
    changes = {}
    for field, size in sizes.items():
        if size is None:
            continue
        if field != "num_layers" and not config.has_domino_head:
            raise ValueError(f"grow {field}: a DFlash drafter has no Domino head")
        if size < getattr(config, field):
            raise ValueError(f"grow {field}: {size} is below the drafter's "
                             f"{getattr(config, field)} (growing only adds)")
        changes[field] = size
    if config.fused_projections:
        raise ValueError("grow: the drafter's projections are fused (a decode layout); grow "
                         "the training layout (converters.hf_draft.load_draft's)")
    layers = changes.get("num_layers", config.num_layers)
    if config.layer_types and layers > len(config.layer_types):
        changes["layer_types"] = tuple(config.layer_types) + (config.layer_types[-1],) * (
            layers - len(config.layer_types))
    return dataclasses.replace(config, **changes)


def _gate_blocks(old: np.ndarray, fresh: np.ndarray, old_units: int, new_units: int
                 ) -> np.ndarray:
    """``fresh [in', 3 G']`` with each gate block's first ``G`` columns (``[r | z | n]``)
    taken from ``old [in, 3 G]`` on the first ``in`` rows."""
    out = fresh.copy()
    for gate in range(3):
        out[:old.shape[0], gate * new_units:gate * new_units + old_units] = \
            old[:, gate * old_units:(gate + 1) * old_units]
    return out


def _grow_head(old: dict, fresh: dict, config: DraftConfig, grown: DraftConfig) -> dict:
    hidden_size, g, g2, e = (config.hidden_size, config.gru_hidden_dim, grown.gru_hidden_dim,
                             config.emb_dim)
    w_ih = _gate_blocks(old["prefix_gru"]["weight_ih"], fresh["prefix_gru"]["weight_ih"], g, g2)
    w_hh = _gate_blocks(old["prefix_gru"]["weight_hh"], fresh["prefix_gru"]["weight_hh"], g, g2)
    for gate in range(3):                  # the old units' gates read no new unit
        w_hh[g:, gate * g2:gate * g2 + g] = 0.0
    w1 = fresh["embed_proj_0"]["kernel"].copy()            # [H + G', E'] rows [z ; s]
    w1[:hidden_size + g, :e] = old["embed_proj_0"]["kernel"]
    w1[hidden_size + g:, :e] = 0.0                         # old features read no new unit
    w2 = fresh["embed_proj_2"]["kernel"].copy()            # [E', V]
    w2[:e] = old["embed_proj_2"]["kernel"]
    w2[e:] = 0.0                                           # new features add nothing yet
    return {"prefix_gru": {"weight_ih": w_ih, "weight_hh": w_hh},
            "embed_proj_0": {"kernel": w1}, "embed_proj_2": {"kernel": w2}}


def grow_draft(config: DraftConfig, params: Any, rng: jax.Array,
               num_layers: int | None = None, gru_hidden_dim: int | None = None,
               emb_dim: int | None = None) -> tuple[DraftConfig, dict]:
    """The grown drafter ``(config, float32 params)`` of a trained one (``params``: the
    training tree ``{"backbone", ["head"], ["mask_embedding"]}``, any float dtype). New
    weights are drawn from ``rng`` as a fresh drafter's (``init_draft_params``), then the
    pieces the module docstring names are zeroed so that the grown drafter computes what the
    old one did."""
    from domino_jax.train.loss import init_draft_params

    grown = grown_config(config, num_layers, gru_hidden_dim, emb_dim)
    old = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params)
    fresh = jax.tree_util.tree_map(np.asarray, init_draft_params(grown, rng, False))
    backbone = {}
    for name, subtree in fresh["backbone"].items():
        if name in old["backbone"]:
            backbone[name] = old["backbone"][name]
            continue
        if not name.startswith("layers_"):
            raise ValueError(f"grow: a new backbone piece {name!r} that is not a layer")
        layer = jax.tree_util.tree_map(np.copy, subtree)
        for part in layer.values():
            for proj in _LAYER_OUTPUTS:
                if proj in part:
                    part[proj]["kernel"][...] = 0.0
        backbone[name] = layer
    out = {"backbone": backbone}
    if "head" in old:
        out["head"] = _grow_head(old["head"], fresh["head"], config, grown)
    if "mask_embedding" in old:
        out["mask_embedding"] = old["mask_embedding"]
    return grown, jax.tree_util.tree_map(jnp.asarray, out)
