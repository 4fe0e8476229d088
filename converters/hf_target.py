"""HF ``Qwen3ForCausalLM`` / ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` <-> TargetLM params.

    config, params = load_target("path/to/hf_folder", dtype=jnp.bfloat16)
    export_target(config, params, "out_folder")      # exact round trip

One table serves all three architectures; entries whose parameter a given config does not
have (q/k norms for Llama, biases for Qwen3, ``lm_head`` when tied) simply never match.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from converters.table import (CheckpointError, Rule, hf_to_params, params_to_hf, read_tensors,
                              write_tensors)
from domino_jax.config import TargetConfig
from domino_jax.models.qwen3 import param_shapes

def decoder_layer_rules(hf_prefix: str, path_prefix: str, biases: bool = True) -> list[Rule]:
    """Rules for one Qwen3-style decoder layer (shared by the target and the DFlash drafter)."""
    L, P = hf_prefix, path_prefix
    rules = [
        Rule(L + "input_layernorm.weight", P + "input_layernorm/weight"),
        Rule(L + "post_attention_layernorm.weight", P + "post_attention_layernorm/weight"),
        Rule(L + "self_attn.q_norm.weight", P + "self_attn/q_norm/weight"),
        Rule(L + "self_attn.k_norm.weight", P + "self_attn/k_norm/weight"),
        *[Rule(L + f"self_attn.{n}.weight", P + f"self_attn/{n}/kernel", "T")
          for n in ("q_proj", "k_proj", "v_proj", "o_proj")],
        *[Rule(L + f"mlp.{n}.weight", P + f"mlp/{n}/kernel", "T")
          for n in ("gate_proj", "up_proj", "down_proj")],
    ]
    if biases:
        rules += [Rule(L + f"self_attn.{n}.bias", P + f"self_attn/{n}/bias")
                  for n in ("q_proj", "k_proj", "v_proj")]
    return rules


TARGET_RULES = [
    Rule("model.embed_tokens.weight", "embed_tokens/embedding"),
    Rule("model.norm.weight", "norm/weight"),
    Rule("lm_head.weight", "lm_head/kernel", "T"),
    *decoder_layer_rules("model.layers.{i}.", "layers_{i}/"),
]
_IGNORED = [r"rotary_emb\.inv_freq$"]


def convert_target_tensors(config: TargetConfig, tensors: dict[str, np.ndarray], where: str,
                           dtype=jnp.bfloat16) -> dict:
    """HF tensors -> params (numpy, cast to ``dtype``). Tied checkpoints may carry a copy of
    the embedding as ``lm_head.weight``; it is dropped (after checking it is a copy)."""
    tensors = dict(tensors)
    if config.tie_word_embeddings and "lm_head.weight" in tensors:
        head = tensors.pop("lm_head.weight")
        embed = tensors.get("model.embed_tokens.weight")
        if embed is not None and not np.array_equal(np.asarray(head), np.asarray(embed)):
            raise CheckpointError(f"{where}: tie_word_embeddings=true but lm_head.weight "
                                  "differs from model.embed_tokens.weight")
    expected = param_shapes(config)
    return hf_to_params(tensors, TARGET_RULES, expected, where, ignore=_IGNORED,
                        dtype=np.dtype(dtype))


def load_target(path: str, dtype=jnp.bfloat16,
                config: TargetConfig | None = None) -> tuple[TargetConfig, dict]:
    """Config and params (as ``jax.Array`` s of ``dtype``) from an HF checkpoint folder
    (``config``: the folder's config when already read)."""
    config = config or TargetConfig.from_path(path)
    params = convert_target_tensors(config, read_tensors(path), path, dtype)
    return config, jax.tree_util.tree_map(jnp.asarray, params)


def export_target(config: TargetConfig, params: dict, path: str) -> None:
    """Write ``config.json`` + ``model.safetensors`` that transformers loads."""
    tensors = params_to_hf(jax.tree_util.tree_map(np.asarray, params), TARGET_RULES)
    write_tensors(tensors, path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config.to_hf_dict(), f, indent=2)
