"""TargetLM vs transformers (float32, eager): logits and every hidden-state tap.

Also: incremental decoding with the KV cache equals the full forward, and right-padded
batch rows with per-row cache lengths equal each row alone.
"""

from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (VARIANTS, assert_close, forward, hf_forward, positions_for, random_tokens,
                      rel_err)
from converters.hf_target import load_target
from domino_jax.models.qwen3 import new_cache

CASES = [(v, t) for v in VARIANTS for t in (False, True)]


_forward = forward


@pytest.mark.parametrize("variant,tied", CASES, ids=[f"{v}-{'tied' if t else 'untied'}"
                                                     for v, t in CASES])
def test_logits_and_every_tap_match_transformers(variant, tied, hf_checkpoints, float32_target):
    hf_model, folder = hf_checkpoints(variant, tied)
    config, params, model = float32_target(folder)
    assert config.tie_word_embeddings == tied
    assert ("lm_head" in params) == (not tied)
    if variant.endswith("_wide"):
        assert config.q_width != config.hidden_size
    if variant == "qwen2":
        bias = np.asarray(params["layers_0"]["self_attn"]["q_proj"]["bias"])
        assert config.qkv_bias and np.abs(bias).min() > 0

    tokens = random_tokens(1, (2, 11))
    ref_logits, ref_hidden, ref_layers = hf_forward(hf_model, tokens)
    num_layers = config.num_layers
    out = _forward(model, params, tokens, positions_for(2, 11),
                   tap_ids=tuple(range(num_layers + 1)))

    errors = [assert_close(out.logits, ref_logits, what="logits")]
    errors.append(assert_close(out.taps[0], ref_hidden[0], what="tap 0 (embeddings)"))
    for i in range(num_layers):
        # tap i + 1 = output of decoder layer i (captured by a hook on the HF layer).
        errors.append(assert_close(out.taps[i + 1], ref_layers[i],
                                   what="taps (vs layer hooks)"))
    # output_hidden_states: entries 1..L-1 are layer outputs; the last one is either the raw
    # output of the last layer (transformers v4) or the final-normed state (recent versions).
    assert len(ref_hidden) == num_layers + 1
    for i in range(1, num_layers):
        errors.append(assert_close(out.taps[i], ref_hidden[i],
                                   what="taps (vs output_hidden_states)"))
    last = ref_hidden[num_layers]
    best = min(rel_err(out.taps[num_layers], last), rel_err(out.hidden, last))
    assert best <= 1e-5, f"hidden_states[-1] matches neither tap {num_layers} nor final norm"
    errors.append(best)
    print(f"\n{variant} tied={tied}: max relative error {max(errors):.2e}")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fused_layout_matches_transformers(variant, hf_checkpoints, float32_target):
    """The decode layout (q/k/v and gate/up concatenated, incl. Qwen2's q/k/v biases) gives
    transformers' logits, and the same logits as the checkpoint layout."""
    from domino_jax.models.fused_layout import fuse_model
    from domino_jax.models.qwen3 import TargetLM

    hf_model, folder = hf_checkpoints(variant, False)
    config, params, model = float32_target(folder)
    fused_config, fused_params = fuse_model(config, params)
    attn = fused_params["layers_0"]["self_attn"]
    assert "q_proj" not in attn and attn["qkv_proj"]["kernel"].shape == (
        config.hidden_size, config.q_width + 2 * config.kv_width)
    assert ("bias" in attn["qkv_proj"]) == config.qkv_bias
    assert fused_params["layers_0"]["mlp"]["gate_up_proj"]["kernel"].shape == (
        config.hidden_size, 2 * config.intermediate_size)
    tokens = random_tokens(6, (2, 9))
    fused = _forward(TargetLM(fused_config, dtype=jnp.float32, param_dtype=jnp.float32),
                     fused_params, tokens, positions_for(2, 9)).logits
    assert_close(fused, hf_forward(hf_model, tokens)[0], what="fused-layout logits")
    plain = _forward(model, params, tokens, positions_for(2, 9)).logits
    assert rel_err(fused, plain) < 1e-5


def test_rope_theta_v4_and_v5_config_layouts(hf_checkpoints, tmp_path):
    """Same weights, config.json rewritten in the v4 layout (top-level rope_theta): same
    theta, same logits. The saved (v5) layout uses ``rope_parameters``."""
    hf_model, folder = hf_checkpoints("qwen3", False)
    raw = json.load(open(os.path.join(folder, "config.json")))
    theta = VARIANTS["qwen3"][1]["rope_theta"]
    v4 = tmp_path / "v4"
    shutil.copytree(folder, v4)
    raw_v4 = {k: v for k, v in raw.items() if k != "rope_parameters"}
    raw_v4["rope_theta"] = theta
    raw_v4["rope_scaling"] = None
    json.dump(raw_v4, open(v4 / "config.json", "w"))
    config5, params5 = load_target(folder, dtype=jnp.float32)
    config4, params4 = load_target(str(v4), dtype=jnp.float32)
    assert config4.rope_theta == config5.rope_theta == theta
    from domino_jax.models.qwen3 import TargetLM
    tokens = random_tokens(2, (1, 9))
    logits = [_forward(TargetLM(c, dtype=jnp.float32, param_dtype=jnp.float32), p, tokens,
                       positions_for(1, 9)).logits for c, p in ((config4, params4),
                                                               (config5, params5))]
    np.testing.assert_array_equal(np.asarray(logits[0]), np.asarray(logits[1]))
    assert_close(logits[0], hf_forward(hf_model, tokens)[0], what="v4 layout logits")


def test_incremental_decoding_equals_full_forward(hf_checkpoints, float32_target):
    _, folder = hf_checkpoints("qwen2", False)
    config, params, model = float32_target(folder)
    batch, total, prefill = 2, 12, 5
    tokens = random_tokens(3, (batch, total))
    full = _forward(model, params, tokens, positions_for(batch, total)).logits

    # Prefill then one token at a time.
    cache = new_cache(config, batch, 16, jnp.float32)
    out = _forward(model, params, tokens[:, :prefill], positions_for(batch, prefill), cache=cache)
    assert_close(out.logits, full[:, :prefill], what="prefill")
    cache = out.cache.advance(prefill)
    for t in range(prefill, total):
        out = _forward(model, params, tokens[:, t:t + 1], positions_for(batch, 1, t), cache=cache)
        assert_close(out.logits, full[:, t:t + 1], what="cached decode step")
        cache = out.cache.advance(1)
    assert int(cache.lengths[0]) == total

    # Prefill then a 3-token block, then one more token.
    cache = new_cache(config, batch, 16, jnp.float32)
    cache = _forward(model, params, tokens[:, :prefill], positions_for(batch, prefill),
                     cache=cache).cache.advance(prefill)
    out = _forward(model, params, tokens[:, prefill:prefill + 3],
                   positions_for(batch, 3, prefill), cache=cache)
    assert_close(out.logits, full[:, prefill:prefill + 3], what="3-token block")
    cache = out.cache.advance(3)
    out = _forward(model, params, tokens[:, prefill + 3:prefill + 4],
                   positions_for(batch, 1, prefill + 3), cache=cache)
    assert_close(out.logits, full[:, prefill + 3:prefill + 4], what="after block")


def test_ragged_batch_rows_equal_each_row_alone(hf_checkpoints, float32_target):
    """Right-padded prompts of lengths (7, 3, 5), per-row cache lengths, two decode steps."""
    hf_model, folder = hf_checkpoints("qwen3", True)
    config, params, model = float32_target(folder)
    lengths = np.array([7, 3, 5])
    batch, width = len(lengths), int(lengths.max())
    prompts = random_tokens(4, (batch, width))
    pad = 0
    padded = np.where(np.arange(width)[None, :] < lengths[:, None], prompts, pad)
    steps = random_tokens(5, (batch, 2))

    cache = new_cache(config, batch, 16, jnp.float32)
    out = _forward(model, params, padded, positions_for(batch, width), cache=cache)
    prefill_logits = np.asarray(out.logits)
    cache = out.cache.advance(jnp.asarray(lengths, jnp.int32))
    step_logits = []
    for s in range(2):
        out = _forward(model, params, steps[:, s:s + 1],
                       positions_for(batch, 1, jnp.asarray(lengths + s, jnp.int32)), cache=cache)
        step_logits.append(np.asarray(out.logits[:, 0]))
        cache = out.cache.advance(1)
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + 2)

    for b, n in enumerate(lengths):
        # The row alone (batch of one; right-padded to one shape so this compiles once).
        row = np.zeros((1, width + 2), np.int32)
        row[0, :n + 2] = np.concatenate([prompts[b, :n], steps[b]])
        alone = np.asarray(_forward(model, params, row, positions_for(1, width + 2)).logits[0])
        assert_close(prefill_logits[b, :n], alone[:n], what=f"row {b} prefill")
        assert_close(step_logits[0][b], alone[n], what=f"row {b} step 0")
        assert_close(step_logits[1][b], alone[n + 1], what=f"row {b} step 1")
        # and against transformers with an attention mask on the padded batch
    ref_logits, _, _ = hf_forward(hf_model, padded,
                                  attention_mask=np.arange(width)[None, :] < lengths[:, None])
    for b, n in enumerate(lengths):
        assert_close(prefill_logits[b, :n], ref_logits[b, :n], what=f"row {b} vs HF padded")
