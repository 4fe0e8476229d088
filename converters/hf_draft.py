"""Released DFlash / Domino draft checkpoints <-> domino_jax draft params.

    config, params = load_draft("path/to/draft", dtype=jnp.bfloat16)
    params["backbone"]   # DFlashBackbone params (models/dflash.py)
    params["head"]       # Domino head params (models/domino_head.py), Domino only
    export_draft(config, params, "out_folder")       # exact round trip, released format
    cast_draft("run/draft", "shipped", "bfloat16")    # a float32 export as the released bf16

    python -m converters.hf_draft cast SRC DST [--dtype bfloat16]

HF keys carry no ``model.`` prefix (``fc.weight``, ``layers.0.self_attn.q_proj.weight``);
a ``model.`` prefix is accepted on import. The drafter has no embedding / LM head (it
borrows the target's), so a checkpoint carrying ``embed_tokens``/``lm_head`` copies is
reported as unexpected.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from converters.table import (CheckpointError, Rule, hf_to_params, params_to_hf, read_tensors,
                              write_tensors)
from converters.hf_target import decoder_layer_rules
from domino_jax.config import DraftConfig
from domino_jax.models.dflash import param_shapes
from domino_jax.models.domino_head import head_param_shapes

BACKBONE_RULES = [
    Rule("fc.weight", "backbone/fc/kernel", "T"),
    Rule("hidden_norm.weight", "backbone/hidden_norm/weight"),
    Rule("norm.weight", "backbone/norm/weight"),
    *decoder_layer_rules("layers.{i}.", "backbone/layers_{i}/", biases=False),
]
HEAD_RULES = [
    Rule("prefix_gru.weight_ih_l0", "head/prefix_gru/weight_ih", "T"),
    Rule("prefix_gru.weight_hh_l0", "head/prefix_gru/weight_hh", "T"),
    Rule("embed_proj.0.weight", "head/embed_proj_0/kernel", "T"),
    Rule("embed_proj.2.weight", "head/embed_proj_2/kernel", "T"),
]
DRAFT_RULES = BACKBONE_RULES + HEAD_RULES
_IGNORED = [r"rotary_emb\.inv_freq$"]
MASK_EMBEDDING = "mask_embedding"   # our learned mask token (docs/algorithms.md §9.15)


def draft_param_shapes(config: DraftConfig, dtype=jnp.bfloat16) -> dict:
    """``{"backbone": ..., "head": ...}`` ``ShapeDtypeStruct`` tree (head only for Domino)."""
    shapes = {"backbone": param_shapes(config, dtype)}
    if config.has_domino_head:
        shapes["head"] = head_param_shapes(config, dtype)
    return shapes


def convert_draft_tensors(config: DraftConfig, tensors: dict[str, np.ndarray], where: str,
                          dtype=jnp.bfloat16) -> dict:
    """HF draft tensors -> ``{"backbone", "head"}`` numpy params cast to ``dtype``."""
    stripped = {}
    for key, value in tensors.items():
        plain = key[len("model."):] if key.startswith("model.") else key
        if plain in stripped:
            raise CheckpointError(f"{where}: tensor {plain!r} appears with and without the "
                                  "'model.' prefix")
        stripped[plain] = value
    return hf_to_params(stripped, DRAFT_RULES, draft_param_shapes(config), where,
                        ignore=_IGNORED, dtype=np.dtype(dtype))


def load_draft(path: str, dtype=jnp.bfloat16,
               config: DraftConfig | None = None) -> tuple[DraftConfig, dict]:
    """Config and params (``jax.Array`` s of ``dtype``) from a draft checkpoint folder
    (``config``: the folder's config when already read).

    A drafter trained by us for a target with no spare embedding row carries its own
    learned mask token as an extra tensor ``mask_embedding [H]`` (our extension, flagged by
    ``dflash_config.learned_mask_embedding``); it is returned as ``params["mask_embedding"]``.
    """
    config = config or DraftConfig.from_path(path)
    tensors = dict(read_tensors(path))
    mask = tensors.pop(MASK_EMBEDDING, None)
    params = convert_draft_tensors(config, tensors, path, dtype)
    if mask is not None:
        if tuple(np.shape(mask)) != (config.hidden_size,):
            raise CheckpointError(f"{path}: {MASK_EMBEDDING} has shape {tuple(np.shape(mask))}, "
                                  f"expected ({config.hidden_size},)")
        params[MASK_EMBEDDING] = np.asarray(mask).astype(np.dtype(dtype))
    return config, jax.tree_util.tree_map(jnp.asarray, params)


def export_draft(config: DraftConfig, params: dict, path: str) -> None:
    """Write ``config.json`` (released ``DFlashDraftModel`` format) + ``model.safetensors``."""
    expected = set(draft_param_shapes(config))
    if set(params) != expected:
        raise CheckpointError(f"draft params have parts {sorted(params)}, config "
                              f"(projector_type={config.projector_type!r}) expects "
                              f"{sorted(expected)}")
    tensors = params_to_hf(jax.tree_util.tree_map(np.asarray, params), DRAFT_RULES)
    write_tensors(tensors, path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config.to_hf_dict(), f, indent=2)


CAST_DTYPES = ("bfloat16", "float32")


def cast_draft(src: str, dst: str, dtype: str = "bfloat16") -> None:
    """Copy the drafter folder ``src`` to ``dst`` with its floating tensors cast to ``dtype``.

    Training exports float32 (exact, resumable); the released drafters ship in bf16, half the
    bytes, and load identically in any compute dtype (bf16 values are exact in float32). The
    config's ``torch_dtype`` is set to ``dtype``; every tensor name and shape is kept. The
    folder is checked with :func:`load_draft` before and after, so a broken ``src`` is named.
    """
    import ml_dtypes
    from safetensors.numpy import load_file

    if dtype not in CAST_DTYPES:
        raise ValueError(f"cast_draft: dtype {dtype!r} is not one of {CAST_DTYPES}")
    load_draft(src, jnp.float32)                         # names the file/key if src is broken
    target = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    tensors = load_file(os.path.join(src, "model.safetensors"))
    cast = {k: v.astype(target) if np.issubdtype(v.dtype, np.floating) or v.dtype == ml_dtypes.bfloat16
            else v for k, v in tensors.items()}
    write_tensors(cast, dst)
    with open(os.path.join(src, "config.json")) as f:
        raw = json.load(f)
    raw["torch_dtype"] = dtype
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    load_draft(dst, jnp.float32)


def _main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m converters.hf_draft",
                                     description="drafter checkpoint tools")
    sub = parser.add_subparsers(dest="command", required=True)
    cast = sub.add_parser("cast", help="copy a drafter folder with its tensors cast to --dtype")
    cast.add_argument("src")
    cast.add_argument("dst")
    cast.add_argument("--dtype", default="bfloat16", choices=CAST_DTYPES)
    args = parser.parse_args(argv)
    try:
        cast_draft(args.src, args.dst, args.dtype)
    except (CheckpointError, OSError, ValueError) as e:
        print(f"error: {e}")
        return 2
    print(f"wrote {args.dst} ({args.dtype})")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
