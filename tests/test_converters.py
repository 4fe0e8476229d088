"""HF <-> TargetLM converters: error reporting, export round trip, sharded checkpoints."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, build_hf_model, forward, hf_forward, positions_for, \
    random_tokens, save_hf
from converters.hf_target import convert_target_tensors, export_target, load_target
from converters.table import CheckpointError, read_tensors, write_tensors
from domino_jax.config import TargetConfig


def test_all_problems_reported_together(hf_checkpoints):
    _, folder = hf_checkpoints("qwen3", False)
    config = TargetConfig.from_path(folder)
    tensors = read_tensors(folder)
    del tensors["model.layers.1.mlp.up_proj.weight"]                       # missing
    tensors["model.layers.2.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)  # shape
    tensors["model.layers.0.self_attn.extra_proj.weight"] = np.zeros((4,), np.float32)  # extra
    with pytest.raises(CheckpointError) as info:
        convert_target_tensors(config, tensors, "ckpt/dir", jnp.float32)
    message = str(info.value)
    assert "ckpt/dir" in message
    for key in ("model.layers.1.mlp.up_proj.weight", "model.layers.2.self_attn.k_proj.weight",
                "model.layers.0.self_attn.extra_proj.weight"):
        assert key in message, message
    assert "missing" in message and "unexpected" in message and "wrong shapes" in message
    assert "(16, 64)" in message and "(32, 64)" in message   # found vs expected torch shape
    # The shape-mismatched tensor is not also reported as missing.
    assert message.count("k_proj") == 1


def test_load_target_from_folder_reports_errors(hf_checkpoints, tmp_path):
    _, folder = hf_checkpoints("llama", True)
    tensors = read_tensors(folder)
    del tensors["model.norm.weight"]
    tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones((16,), np.float32)  # not llama
    write_tensors(tensors, str(tmp_path))
    (tmp_path / "config.json").write_text(open(os.path.join(folder, "config.json")).read())
    with pytest.raises(CheckpointError, match="model.norm.weight") as info:
        load_target(str(tmp_path), dtype=jnp.float32)
    assert "model.layers.0.self_attn.q_norm.weight" in str(info.value)
    assert str(tmp_path) in str(info.value)


def test_tied_checkpoint_with_differing_lm_head_is_rejected(hf_checkpoints):
    _, folder = hf_checkpoints("qwen3", True)
    tensors = read_tensors(folder)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1.0
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        convert_target_tensors(TargetConfig.from_path(folder), tensors, folder, jnp.float32)


def test_missing_checkpoint_path():
    with pytest.raises(CheckpointError, match="does not exist"):
        read_tensors("/nonexistent/checkpoint")


@pytest.mark.parametrize("variant,tied", [("qwen3", False), ("qwen3_wide", True),
                                          ("llama", True), ("qwen2", False)])
def test_export_round_trip(variant, tied, hf_checkpoints, float32_target, tmp_path):
    """export_target -> load_target gives identical params; transformers loads the export
    and gives the original model's logits."""
    import torch
    import transformers

    hf_model, folder = hf_checkpoints(variant, tied)
    config, params, model = float32_target(folder)
    export_target(config, params, str(tmp_path))
    config2, params2 = load_target(str(tmp_path), dtype=jnp.float32)
    assert config2 == config
    assert jax.tree_util.tree_structure(params2) == jax.tree_util.tree_structure(params)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, attn_implementation="eager").eval()
    assert type(reloaded) is type(hf_model)
    tokens = random_tokens(30, (1, 8))
    ref_logits = hf_forward(hf_model, tokens)[0]
    new_logits = hf_forward(reloaded, tokens)[0]
    np.testing.assert_allclose(new_logits, ref_logits, rtol=0, atol=1e-6 * np.abs(ref_logits).max())
    if variant == "qwen3":   # and our own forward on the exported weights
        assert_close(forward(model, params2, tokens, positions_for(1, 8)).logits, ref_logits,
                     what="exported params logits")


def test_sharded_checkpoint_loads(tmp_path):
    hf_model = build_hf_model("qwen3", False, seed=7)
    folder = save_hf(hf_model, tmp_path, max_shard_size="40KB")
    assert os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    shards = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    assert len(shards) > 1
    config, params = load_target(folder, dtype=jnp.float32)
    from domino_jax.models.qwen3 import TargetLM
    model = TargetLM(config, dtype=jnp.float32, param_dtype=jnp.float32)
    tokens = random_tokens(31, (1, 8))
    assert_close(forward(model, params, tokens, positions_for(1, 8)).logits,
                 hf_forward(hf_model, tokens)[0], what="sharded checkpoint logits")
    # A missing shard is named.
    os.remove(os.path.join(folder, sorted(shards)[0]))
    with pytest.raises(CheckpointError, match=sorted(shards)[0]):
        load_target(folder, dtype=jnp.float32)


def test_bfloat16_checkpoint_loads_exactly(tmp_path):
    """Real Qwen3 checkpoints are bf16: read without torch, values bit-exact."""
    import torch

    hf_model = build_hf_model("qwen3", True, seed=3).to(torch.bfloat16)
    folder = save_hf(hf_model, tmp_path)
    _, params = load_target(folder)   # default dtype bf16
    assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    ours = np.asarray(params["layers_1"]["mlp"]["up_proj"]["kernel"].astype(jnp.float32))
    ref = hf_model.model.layers[1].mlp.up_proj.weight.detach().float().numpy().T
    np.testing.assert_array_equal(ours, ref)
    _, params32 = load_target(folder, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(params32["embed_tokens"]["embedding"]),
                                  hf_model.model.embed_tokens.weight.detach().float().numpy())
