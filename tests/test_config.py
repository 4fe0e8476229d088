"""TargetConfig from raw config.json: layouts, errors naming the field, eval_shape sizes."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from domino_jax.config import QWEN3_4B, QWEN3_8B, ConfigError, TargetConfig
from domino_jax.models.qwen3 import param_shapes

BASE = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 128,
    "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "tie_word_embeddings": True, "max_position_embeddings": 256,
    "use_sliding_window": False, "sliding_window": None, "eos_token_id": [5, 7],
}


def _raw(**changes):
    raw = dict(BASE)
    for key, value in changes.items():
        if value is ...:
            raw.pop(key, None)
        else:
            raw[key] = value
    return raw


def test_rope_theta_v4_layout():
    config = TargetConfig.from_hf_dict(_raw(rope_theta=123456.0, rope_scaling=None))
    assert config.rope_theta == 123456.0


def test_rope_theta_v5_layout():
    config = TargetConfig.from_hf_dict(_raw(rope_parameters={"rope_type": "default",
                                                             "rope_theta": 654321.0}))
    assert config.rope_theta == 654321.0


def test_fields_read():
    config = TargetConfig.from_hf_dict(_raw(rope_theta=1e6))
    assert (config.architecture, config.qk_norm, config.qkv_bias) == ("qwen3", True, False)
    assert config.eos_token_ids == (5, 7) and config.tie_word_embeddings
    assert config.head_dim == 16 and config.num_kv_heads == 2
    llama = TargetConfig.from_hf_dict(_raw(architectures=["LlamaForCausalLM"], model_type="llama",
                                           head_dim=..., eos_token_id=2))
    assert (llama.qk_norm, llama.head_dim, llama.eos_token_ids) == (False, 16, (2,))
    qwen2 = TargetConfig.from_hf_dict(_raw(architectures=None, model_type="qwen2",
                                           use_sliding_window=False, sliding_window=4096))
    assert (qwen2.architecture, qwen2.qkv_bias) == ("qwen2", True)


def test_to_hf_dict_round_trip():
    for config in (QWEN3_8B, QWEN3_4B,
                   dataclasses.replace(QWEN3_4B, architecture="llama", qk_norm=False)):
        assert TargetConfig.from_hf_dict(json.loads(json.dumps(config.to_hf_dict()))) == config


@pytest.mark.parametrize("changes,field", [
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}), "rope_type"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_type"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}), "llama3"),
    (dict(use_sliding_window=True, sliding_window=4096), "sliding_window"),
    (dict(layer_types=["full_attention", "sliding_attention", "full_attention"]), "layer_types"),
    (dict(num_experts=8), "num_experts"),
    (dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=128,
          moe_intermediate_size=768), "architecture"),
    (dict(architectures=["MistralForCausalLM"], model_type="mistral"), "architecture"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(hidden_size=...), "hidden_size"),
])
def test_unsupported_config_names_the_field(changes, field):
    with pytest.raises(ConfigError, match=field) as info:
        TargetConfig.from_hf_dict(_raw(**changes), where="some/dir/config.json")
    assert "some/dir/config.json" in str(info.value)


def test_moe_field_on_supported_arch_names_it():
    with pytest.raises(ConfigError, match="num_local_experts"):
        TargetConfig.from_hf_dict(_raw(num_local_experts=8))


def test_from_path_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        TargetConfig.from_path(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        TargetConfig.from_path(str(tmp_path))


def _count(config) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(param_shapes(config)))


def test_eval_shape_qwen3_8b_parameter_count():
    assert _count(QWEN3_8B) == 8_190_735_360


def test_eval_shape_qwen3_4b_parameter_count():
    # embed 151936*2560 (tied) + 36 * (q 2560*4096 + k,v 2*2560*1024 + o 4096*2560
    # + mlp 3*2560*9728 + norms 2*2560 + 2*128) + final norm 2560
    expected = 151936 * 2560 + 36 * (2 * 2560 * 4096 + 2 * 2560 * 1024 + 3 * 2560 * 9728
                                     + 2 * 2560 + 2 * 128) + 2560
    assert expected == 4_022_468_096
    assert _count(QWEN3_4B) == expected
