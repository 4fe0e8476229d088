"""The fused decode layout (domino_jax/models/fused_layout.py): what the conversion does to
a parameter tree, its errors, and greedy decoding with fused models equal to the reference.

Parity of the fused models themselves: tests/test_target_parity.py (against transformers,
every target variant) and tests/test_drafters.py (the ``golden`` fixture runs every
reference-output check in both layouts).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from decode_helpers import FIXTURE_NAMES, fixture_models, reference_greedy
from domino_jax.decode.loading import make_drafter
from domino_jax.decode.speculative import DecodeConfig, generate
from domino_jax.models.fused_layout import fuse_model, fuse_projections
from domino_jax.models.qwen3 import TargetLM

jax.config.update("jax_default_matmul_precision", "highest")


def test_fuse_projections_concatenates_in_order():
    a, b, c = (np.full((3, n), i, np.float32) for i, n in ((1, 4), (2, 2), (3, 2)))
    tree = {"layers_0": {"self_attn": {"q_proj": {"kernel": a}, "k_proj": {"kernel": b},
                                       "v_proj": {"kernel": c}, "o_proj": {"kernel": a.T}},
                         "mlp": {"gate_proj": {"kernel": b}, "up_proj": {"kernel": c},
                                 "down_proj": {"kernel": b.T}}},
            "head": {"prefix_gru": {"weight_ih": a}}}
    fused = fuse_projections(tree)
    qkv = fused["layers_0"]["self_attn"]["qkv_proj"]["kernel"]
    assert qkv.shape == (3, 8) and qkv[0].tolist() == [1] * 4 + [2] * 2 + [3] * 2
    assert sorted(fused["layers_0"]["self_attn"]) == ["o_proj", "qkv_proj"]
    assert fused["layers_0"]["mlp"]["gate_up_proj"]["kernel"][0].tolist() == [2, 2, 3, 3]
    assert fused["head"] is not tree["head"] and fused["head"]["prefix_gru"]["weight_ih"] is a
    assert "q_proj" in tree["layers_0"]["self_attn"]          # the input is not modified


def test_fuse_errors_name_the_path():
    with pytest.raises(ValueError, match=r"params/layers_3/self_attn.*without \['v_proj'\]"):
        fuse_projections({"layers_3": {"self_attn": {"q_proj": {"kernel": 1},
                                                     "k_proj": {"kernel": 2}}}})
    with pytest.raises(ValueError, match="both 'gate_up_proj'"):
        fuse_projections({"mlp": {"gate_up_proj": {}, "gate_proj": {}, "up_proj": {}}})
    with pytest.raises(ValueError, match=r"k_proj: leaves \['kernel'\], expected"):
        fuse_projections({"q_proj": {"kernel": 1, "bias": 2}, "k_proj": {"kernel": 1},
                          "v_proj": {"kernel": 1, "bias": 2}})
    target, params, *_ = fixture_models("dflash")
    config, fused = fuse_model(target.config, params)
    with pytest.raises(ValueError, match="already in the fused layout"):
        fuse_model(config, fused)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fused_greedy_equals_reference(name):
    """Every method on fused target + drafter reproduces the reference's greedy tokens."""
    target, params, dcfg, dparams, outputs = fixture_models(name)
    prompt = outputs["prompt"][0].tolist()
    expected = outputs["reference_spec_greedy_ids"][0, len(prompt):].tolist()
    prompts = [prompt, [5, 9, 2]]
    ref = reference_greedy(target, params, prompts, 24)
    assert ref[0] == expected
    tcfg, fparams = fuse_model(target.config, params)
    fcfg, fdparams = fuse_model(dcfg, dparams)
    ftarget = TargetLM(tcfg, dtype=target.dtype, param_dtype=target.param_dtype)
    methods = ["ar", "dflash"] + (["domino"] if dcfg.has_domino_head else [])
    if name == "domino_shift":            # the tree methods once (they share the target path)
        methods += ["ddtree", "dominotree"]
    for method in methods:
        drafter = None if method == "ar" else make_drafter(
            fcfg, ftarget, method, **({"budget": 6} if "tree" in method else {}))
        result = generate(ftarget, fparams, prompts,
                          DecodeConfig(method=method, max_new_tokens=24), drafter=drafter,
                          draft_params=None if drafter is None else fdparams)
        assert result.tokens == ref, method


def test_unfused_config_rejects_fused_params():
    target, params, *_ = fixture_models("dflash")
    _, fused = fuse_model(target.config, params)
    plain = dataclasses.replace(target.config, fused_projections=False)
    with pytest.raises(Exception, match="q_proj"):
        TargetLM(plain).apply({"params": fused}, np.zeros((1, 2), np.int32),
                              np.zeros((1, 2), np.int32))
