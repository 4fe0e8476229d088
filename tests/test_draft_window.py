"""Sliding-window draft context: SpecForge's ``sliding_attention`` draft layers and the
``context_window`` inference option (``--draft-window``).

* config: the SpecForge / transformers Qwen3 layout (``layer_types``, ``use_sliding_window``,
  ``sliding_window``, ``max_window_layers``) parses, round-trips and fails clearly;
* the backbone with sliding layers (and a context window on the full layers) equals the
  torch reference of ``test_drafters.py`` with the masks written from SpecForge's
  definition (context ``p >= p_q - (W - 1)``, causal block keys within the window), over
  two successive forwards with ragged context and the gathered-window path;
* decoding: a window that holds the whole context gives exactly the full-window run
  (tokens and acceptance); a window that bites stays lossless (== greedy AR).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_helpers import draft_config, reference_greedy, tiny_draft, tiny_target
from test_drafters import SMALL, _random_draft, draft_rounds_vs_torch

from domino_jax.config import ConfigError, DraftConfig
from domino_jax.decode.drafters import BlockOptions, DominoOptions
from domino_jax.decode.methods import make_drafter
from domino_jax.decode.speculative import DecodeConfig, generate
from domino_jax.models import dflash

SLIDING = dataclasses.replace(SMALL, layer_types=("sliding_attention", "full_attention"),
                              sliding_window=4)


def test_sliding_layout_parses_and_round_trips():
    raw = SLIDING.to_hf_dict()
    assert raw["use_sliding_window"] is True and raw["sliding_window"] == 4
    assert DraftConfig.from_hf_dict(json.loads(json.dumps(raw))) == SLIDING
    assert DraftConfig.from_hf_dict(SMALL.to_hf_dict()) == SMALL       # all full: ()
    assert SLIDING.layer_window(0) == 4 and SLIDING.layer_window(1) is None
    derived = dict(raw, max_window_layers=1)
    del derived["layer_types"]                       # transformers' Qwen3Config rule
    assert DraftConfig.from_hf_dict(derived).layer_types == ("full_attention",
                                                             "sliding_attention")
    with pytest.raises(ConfigError, match="use_sliding_window=true"):
        DraftConfig.from_hf_dict(dict(raw, use_sliding_window=False))
    with pytest.raises(ConfigError, match="'chunked_attention'"):
        DraftConfig.from_hf_dict(dict(raw, layer_types=["chunked_attention"] * 2))
    with pytest.raises(ConfigError, match="layer_types has 1 entries"):
        DraftConfig.from_hf_dict(dict(raw, layer_types=["full_attention"]))
    with pytest.raises(ValueError, match="--draft-window"):
        BlockOptions(context_window=0)


def _specforge_mask(window, causal, positions_context, block_len):
    """SpecForge's draft mask for one row: ``[Bk, Tctx + Bk]`` over [context, block] keys,
    block query ``j`` at position ``a + j`` (``a`` = the root's position)."""
    if window is None:
        return None
    anchor = positions_context[-1] + 1 if len(positions_context) else 0
    query = np.arange(block_len)[:, None]
    context = np.asarray(positions_context)[None, :] >= anchor + query - (window - 1)
    offset = np.arange(block_len)[None, :]
    block = offset >= query - (window - 1)
    if causal:
        block &= offset <= query
    return np.concatenate([np.broadcast_to(context, (block_len, len(positions_context))),
                           block], axis=1)


@pytest.mark.parametrize("context_window", [None, 6])
def test_sliding_backbone_matches_torch(context_window):
    """Layer 0 slides (W 4, causal block), layer 1 is full (or windowed by the option);
    capacity 64 > the window span, so windowed layers gather their slots."""
    params, sd = _random_draft(SMALL)
    backbone = dflash.DFlashBackbone(SLIDING, dtype=jnp.float32, param_dtype=jnp.float32,
                                     context_window=context_window)
    views = backbone.layer_windows()
    assert views == ((4, True), (context_window, False))
    apply = jax.jit(lambda *a: backbone.apply({"params": params["backbone"]}, *a))
    cache = dflash.new_draft_cache(SLIDING, 2, 64, jnp.float32)

    def masks(committed, n):                        # every context position seen so far
        seen = np.arange(committed + n)
        return [_specforge_mask(w, causal, seen, SLIDING.block_size) for w, causal in views]

    rounds = (([7, 4], 7), ([2, 3], 7), ([5, 1], 6))
    for _ in draft_rounds_vs_torch(apply, sd, SLIDING, cache, rounds,
                                   np.random.default_rng(0), masks):
        pass


def _decode(method_window, prompts, capacity=None, max_new=12):
    target, params = tiny_target(3, vocab=64)
    cfg = draft_config(64, block=4)
    drafter = make_drafter(cfg, target, "domino", DominoOptions(context_window=method_window))
    return generate(target, params, prompts,
                    DecodeConfig(method="domino", max_new_tokens=max_new, capacity=capacity),
                    drafter, tiny_draft(cfg, 5)), (target, params)


def test_window_that_holds_the_context_equals_full_and_a_small_one_is_lossless():
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 63, n).tolist() for n in (21, 30)]
    full, _ = _decode(None, prompts, capacity=256, max_new=10)
    held, _ = _decode(48, prompts, capacity=256, max_new=10)   # 30 + 10 < 48; span 55 < 320
    assert held.tokens == full.tokens
    np.testing.assert_array_equal(held.accept_hist, full.accept_hist)
    small, (target, params) = _decode(3, prompts, max_new=10)
    assert small.tokens == reference_greedy(target, params, prompts, 10)
