"""The fused decode layout (domino_jax/models/fused_layout.py): what the conversion does to
a parameter tree and its errors. Greedy decoding with fused models equal to the reference:
tests/test_decode_greedy.py's fixture test.

Parity of the fused models themselves: tests/test_target_parity.py (against transformers,
every target variant) and tests/test_drafters.py (the ``golden`` fixture runs every
reference-output check in both layouts).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode_helpers import FIXTURES, fixture_models
from domino_jax.decode.loading import load_pair
from domino_jax.models.domino_head import DecodeHead, decode_head
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


def test_unfused_config_rejects_fused_params():
    target, params, *_ = fixture_models("dflash")
    _, fused = fuse_model(target.config, params)
    plain = dataclasses.replace(target.config, fused_projections=False)
    with pytest.raises(Exception, match="q_proj"):
        TargetLM(plain).apply({"params": fused}, np.zeros((1, 2), np.int32),
                              np.zeros((1, 2), np.int32))


def test_decode_head_layout_and_errors():
    """``state_proj`` is ``[W_hh | W1_s]``; the table is ``embed @ W_ih`` in float32; the
    plain parameters are kept as they are; a second conversion and a misshaped embedding
    table are refused."""
    _, _, dcfg, dparams, _ = fixture_models("domino_shift")
    head = dparams["head"]
    rng = np.random.default_rng(0)
    embed = rng.standard_normal((dcfg.vocab_size, dcfg.hidden_size)).astype(np.float32)
    out = decode_head(head, embed)
    g = head["prefix_gru"]["weight_hh"].shape[0]
    w1 = np.asarray(head["embed_proj_0"]["kernel"])
    np.testing.assert_array_equal(
        np.asarray(out.state_proj),
        np.concatenate([np.asarray(head["prefix_gru"]["weight_hh"]), w1[-g:]], axis=1))
    table = np.asarray(out.input_table)
    assert table.dtype == np.float32 and table.shape == (dcfg.vocab_size, 3 * g)
    expected = embed.astype(np.float64) @ np.asarray(head["prefix_gru"]["weight_ih"], np.float64)
    np.testing.assert_allclose(table, expected, rtol=1e-4, atol=1e-4)
    assert out.params is head
    assert decode_head(head, embed, input_table=False).input_table is None
    with pytest.raises(ValueError, match="already in the decode layout"):
        decode_head(out, embed)
    with pytest.raises(ValueError, match="does not fit"):
        decode_head(head, embed[:, :-1])


def test_load_pair_adds_head_decode_leaves_for_head_methods():
    """The decode CLI's loader: Domino methods get the head's decode leaves (the table
    optional), DFlash on a Domino checkpoint does not pay for them."""
    folder = os.path.join(FIXTURES, "domino_shift")
    load = lambda method, **kw: load_pair(os.path.join(folder, "target"),  # noqa: E731
                                          os.path.join(folder, "draft"), method,
                                          jnp.float32, **kw)[3]["head"]
    for method in ("domino", "dominotree"):
        head = load(method)
        assert isinstance(head, DecodeHead) and head.input_table is not None
    no_table = load("domino", head_input_table=False)
    assert isinstance(no_table, DecodeHead) and no_table.input_table is None
    assert not isinstance(load("dflash"), DecodeHead)
    assert not isinstance(load("domino", fused=False), DecodeHead)


def test_load_pair_attention_option():
    """``load_pair(attention=)`` reaches the target and the drafter's backbone; an unknown
    value is refused before any weights are read."""
    folder = os.path.join(FIXTURES, "domino_shift")
    target, _, drafter, _ = load_pair(os.path.join(folder, "target"),
                                      os.path.join(folder, "draft"), "domino", jnp.float32,
                                      attention="pallas_interpret")
    assert target.attention_impl == "pallas_interpret"
    assert drafter.backbone.attention_impl == "pallas_interpret"
    default, *_ = load_pair(os.path.join(folder, "target"), None, "ar", jnp.float32)
    assert default.attention_impl == "xla"
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'"):
        load_pair(os.path.join(folder, "missing"), None, "ar", jnp.float32, attention="flash")
