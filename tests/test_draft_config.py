"""DraftConfig parsing (docs/algorithms.md §2.1, §2.2, §3.1, §3.2, §9.1)."""

from __future__ import annotations

import json
import os

import pytest

from domino_jax.config import (QWEN3_8B, ConfigError, DraftConfig, build_target_layer_ids,
                               check_draft_fits_target)

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "reference")


def _raw(**overrides):
    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
           "num_target_layers": 36, "hidden_size": 4096, "num_hidden_layers": 5,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
           "intermediate_size": 12288, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
           "vocab_size": 151936, "dflash_config": {"mask_token_id": 151669}}
    raw.update(overrides)
    return raw


def test_target_layer_ids_rule():
    assert build_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert build_target_layer_ids(28, 5) == (1, 7, 13, 19, 25)
    assert build_target_layer_ids(36, 1) == (18,)
    cfg = DraftConfig.from_hf_dict(_raw())
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33)
    assert not cfg.has_domino_head and not cfg.shift_label
    assert cfg.k_draft == 15 and cfg.suffix_start == 2


def test_released_domino_config():
    raw = _raw(emb_dim=256, dflash_config={
        "mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33],
        "projector_type": "causal_v5", "pure_draft_prefix_len": 1, "gru_hidden_dim": 1024,
        "shift_label": True})
    cfg = DraftConfig.from_hf_dict(raw)
    assert cfg.projector_type == "domino" and cfg.has_domino_head
    assert (cfg.emb_dim, cfg.gru_hidden_dim) == (256, 1024)
    assert (cfg.k_draft, cfg.suffix_start) == (16, 1)
    check_draft_fits_target(cfg, QWEN3_8B)
    assert DraftConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_block_size_inside_dflash_config_and_gru_fallback():
    raw = _raw(dflash_config={"mask_token_id": 151669, "block_size": 8,
                              "projector_type": "domino", "emb_dim": 64,
                              "shift_label": False, "pure_draft_prefix_len": 2})
    del raw["block_size"]
    cfg = DraftConfig.from_hf_dict(raw)
    assert cfg.block_size == 8 and cfg.gru_hidden_dim == 64
    assert (cfg.k_draft, cfg.suffix_start) == (7, 3)


def test_missing_fields_are_named():
    raw = _raw()
    del raw["block_size"]
    with pytest.raises(ConfigError, match="block_size"):
        DraftConfig.from_hf_dict(raw)
    with pytest.raises(ConfigError, match="mask_token_id"):
        DraftConfig.from_hf_dict(_raw(dflash_config={}))
    with pytest.raises(ConfigError, match="projector_type='mlp'"):
        DraftConfig.from_hf_dict(_raw(dflash_config={"mask_token_id": 1, "projector_type": "mlp"}))
    with pytest.raises(ConfigError, match="emb_dim"):
        DraftConfig.from_hf_dict(_raw(dflash_config={"mask_token_id": 1,
                                                     "projector_type": "domino"}))


@pytest.mark.parametrize("name,domino,shift,prefix", [
    ("dflash", False, False, None), ("domino_noshift", True, False, 0),
    ("domino_shift", True, True, 1)])
def test_fixture_configs(name, domino, shift, prefix):
    cfg = DraftConfig.from_path(os.path.join(FIXTURES, name, "draft"))
    assert cfg.has_domino_head == domino and cfg.shift_label == shift
    if domino:
        assert cfg.pure_draft_prefix_len == prefix
    with open(os.path.join(FIXTURES, name, "draft", "config.json")) as f:
        raw = json.load(f)
    assert cfg.target_layer_ids == tuple(raw["dflash_config"]["target_layer_ids"])
