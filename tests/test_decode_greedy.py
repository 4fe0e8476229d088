"""Greedy decoding through ``generate``: losslessness, forced acceptance, stale cache slots,
stops and limits, argument errors (CPU, float32, tiny models).

* Golden fixtures (tests/fixtures/reference): every method equals the reference's
  speculative output and an independent cache-free greedy AR in a ragged batch (prompt
  lengths 3..12), in the fused decode layout and in the plain one.
* Hand-built permutation models (decode_helpers): the target's greedy next token is
  ``pi(current)`` (exactly, or mostly when some attention leaks in) and the Domino head drafts
  ``pi(last)``, so every round accepts all K drafts (tau == K + 1) or a row-dependent number
  of them; both ``shift_label`` settings, ``pure_draft_prefix_len`` 0 and 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode_helpers import (FIXTURE_NAMES, draft_config, fixture_models, fused_fixture_models,
                            perm_domino_params, perm_target, permutation, prefill_state,
                            reference_greedy, tiny_draft, zero_backbone_params)
from domino_jax.decode import loop, speculative
from domino_jax.decode.drafters import DominoOptions
from domino_jax.decode.methods import make_drafter, method_options
from domino_jax.decode.sampling import SamplingConfig
from domino_jax.decode.speculative import DecodeConfig, generate

jax.config.update("jax_default_matmul_precision", "highest")

RAGGED = [[3, 4, 5], [7, 1, 2, 9, 10, 6], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
          [0, 1, 30, 2, 8, 9, 25, 26, 5]]
PI = permutation(32, seed=0)
MAX_NEW = 16


def run(target, params, prompts, method, drafter_cfg=None, draft_params=None, head_topm=0,
        **kw):
    options = DominoOptions(head_topm=head_topm) if method == "domino" else None
    drafter = None if method == "ar" else make_drafter(drafter_cfg, target, method, options)
    return generate(target, params, prompts, DecodeConfig(method=method, **kw),
                    drafter=drafter, draft_params=draft_params)


# ----------------------------------------------------------------------- golden fixtures


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_greedy_lossless(name):
    """Every method reproduces the reference's speculative tokens and an independent greedy AR
    in a ragged batch: in the fused decode layout that ``load_pair`` serves (the tree methods
    once: they share the target path), and in the plain layout through the drafter with the
    candidate-pool head (other drafts, same output)."""
    target, params, dcfg, dparams, outputs = fixture_models(name)
    prompt = outputs["prompt"][0].tolist()
    expected = outputs["reference_spec_greedy_ids"][0, len(prompt):].tolist()
    assert len(expected) == 24
    rng = np.random.default_rng(7)
    prompts = [prompt] + [rng.integers(0, 255, n).tolist() for n in (3, 12, 6)]
    ref = reference_greedy(target, params, prompts, 24)
    assert ref[0] == expected
    ftarget, fparams, fcfg, fdparams = fused_fixture_models(name)
    methods = ["ar", "dflash"] + (["domino"] if dcfg.has_domino_head else [])
    if name == "domino_shift":
        methods += ["ddtree", "dominotree"]
    for method in methods:
        options = method_options(method, **({"budget": 6} if "tree" in method else {}))
        drafter = None if method == "ar" else make_drafter(fcfg, ftarget, method, options)
        result = generate(ftarget, fparams, prompts,
                          DecodeConfig(method=method, max_new_tokens=24), drafter=drafter,
                          draft_params=None if drafter is None else fdparams)
        assert result.tokens == ref, method
        assert result.accept_hist.sum() == result.rounds.sum()
    method, head_topm = ("domino", 2) if dcfg.has_domino_head else ("dflash", 0)
    result = run(target, params, prompts, method, dcfg, dparams, head_topm=head_topm,
                 max_new_tokens=24)
    assert result.tokens == ref, (method, head_topm)


# -------------------------------------------------------------- permutation (forced) models

HEADS = [(True, 0, 4), (False, 0, 5), (True, 1, 4), (False, 1, 5)]   # shift, P, block


@pytest.mark.parametrize("shift,prefix,block", HEADS)
def test_domino_forced_and_partial_acceptance(shift, prefix, block):
    cfg = draft_config(32, block=block, shift=shift, prefix=prefix, gru=32, emb=32)
    k = cfg.k_draft
    assert k == 4
    dparams = perm_domino_params(cfg, PI)
    # 1) exact permutation target: every round accepts all K drafts when P == 0.
    target, params = perm_target(PI, attn_scale=0.0, seed=1)
    ref = reference_greedy(target, params, RAGGED, MAX_NEW)
    for row, p in zip(ref, RAGGED):
        chain = [PI[p[-1]]]
        for _ in range(MAX_NEW - 1):
            chain.append(PI[chain[-1]])
        assert row == chain
    result = run(target, params, RAGGED, "domino", cfg, dparams, max_new_tokens=MAX_NEW)
    assert result.tokens == ref
    if prefix == 0:
        full_rounds = (MAX_NEW - 1) // (k + 1)                    # 1 + 3 * 5 = 16
        assert (result.accept_hist[:, k + 1] == full_rounds).all(), result.accept_hist
        assert result.accept_hist[:, :k + 1].sum() == 0
        assert result.tau == k + 1
        assert (result.rounds == full_rounds).all()
    # 2) attention leaks context in: ragged, row-dependent acceptance, still lossless.
    target, params = perm_target(PI, attn_scale=0.3, seed=1)
    ref = reference_greedy(target, params, RAGGED, MAX_NEW)
    result = run(target, params, RAGGED, "domino", cfg, dparams, max_new_tokens=MAX_NEW)
    assert result.tokens == ref
    if prefix == 0:
        assert result.tau > 1.5, result.accept_hist
        assert (result.accept_hist[:, 2:k + 1].sum() > 0), result.accept_hist   # partial
        assert len({tuple(h) for h in result.accept_hist}) > 1                   # row-dependent
    # 3) random head (low acceptance), same shapes.
    random_params = tiny_draft(cfg, seed=5)
    result = run(target, params, RAGGED, "domino", cfg, random_params, max_new_tokens=MAX_NEW)
    assert result.tokens == ref
    assert result.tau < 1.5


def test_dflash_full_acceptance_degenerate():
    """Target with all-equal logits (greedy 0) and a DFlash drafter with zero hidden."""
    target, params = perm_target(PI, final_norm=0.0, seed=2)
    cfg = draft_config(32, block=5, method="dflash")
    dparams = zero_backbone_params(cfg)
    result = run(target, params, RAGGED, "dflash", cfg, dparams, max_new_tokens=MAX_NEW)
    assert result.tokens == [[0] * MAX_NEW] * len(RAGGED)
    assert (result.accept_hist[:, 5] == 3).all() and result.accept_hist[:, :5].sum() == 0
    assert result.tau == 5
    # a plain random DFlash drafter on the partial-acceptance target: lossless
    target, params = perm_target(PI, attn_scale=0.3, seed=1)
    result = run(target, params, RAGGED, "dflash", cfg, tiny_draft(cfg, 3),
                 max_new_tokens=MAX_NEW)
    assert result.tokens == reference_greedy(target, params, RAGGED, MAX_NEW)


@pytest.mark.parametrize("method,shift,block", [("domino", True, 4), ("dflash", False, 5)])
def test_trimmed_block_drafts_from_fewer_slots_and_is_lossless(method, shift, block):
    """``trim_block``: the backbone over ``[root, MASK x k]`` (``k`` slots with
    ``shift_label``); other drafts than the whole block's (non-causal block attention),
    the same output as greedy AR."""
    cfg = draft_config(32, block=block, shift=shift, method=method)
    target, params = perm_target(PI, attn_scale=0.3, seed=1)        # partial acceptance
    dparams = tiny_draft(cfg, seed=5)
    whole = make_drafter(cfg, target, method, method_options(method, draft_length=2))
    trimmed = make_drafter(cfg, target, method, method_options(method, draft_length=2,
                                                                trim_block=True))
    assert whole.block_len == block and trimmed.block_len == (2 if shift else 3)
    assert make_drafter(cfg, target, method, method_options(
        method, trim_block=True)).block_len == block                  # all K: nothing to trim
    config = DecodeConfig(method=method, max_new_tokens=MAX_NEW)
    state = prefill_state(target, params, RAGGED[:2], config, whole, dparams)
    hidden = {}
    for name, drafter in (("whole", whole), ("trimmed", trimmed)):
        h, _, _ = jax.jit(drafter.draft_block)(params, dparams, state)   # eager: slower
        assert h.shape[1] == 2
        hidden[name] = np.asarray(h)
    assert not np.allclose(hidden["whole"], hidden["trimmed"], atol=1e-4)
    ref = reference_greedy(target, params, RAGGED, MAX_NEW)
    result = generate(target, params, RAGGED, config, drafter=trimmed, draft_params=dparams)
    assert result.tokens == ref
    assert result.verify_widths == {3: int(result.rounds.max())}


# ------------------------------------------------------------ stale (rejected) cache slots


def _poison(cache, key_value=jnp.nan, value_value=1e4):
    slots = jnp.arange(cache.capacity)[None, :] >= cache.lengths[:, None]      # [B, C]
    mask = slots[None, :, :, None, None]
    return cache.replace(keys=jnp.where(mask, key_value, cache.keys),
                         values=jnp.where(mask, value_value, cache.values))


@pytest.mark.parametrize("which", ["target", "draft"])
def test_stale_cache_slots_never_read(which):
    cfg = draft_config(32, block=4, shift=True, prefix=0, gru=32, emb=32)
    target, params = perm_target(PI, attn_scale=0.3, seed=1)
    dparams = perm_domino_params(cfg, PI)
    drafter = make_drafter(cfg, target, "domino")
    config = DecodeConfig(method="domino", max_new_tokens=MAX_NEW)
    expected = generate(target, params, RAGGED, config, drafter=drafter, draft_params=dparams)
    prompt, prompt_len = speculative.pad_prompts(RAGGED)
    capacity = speculative.required_capacity(int(prompt_len.max()), config, drafter.num_drafts)
    key = jax.random.PRNGKey(0)
    prefill_fn, rounds_fn, _ = speculative._compiled(target, drafter, config, params, dparams,
                                                     prompt, prompt_len, key, capacity)
    state = prefill_fn(params, dparams, prompt, prompt_len, key)
    policy = loop.init_policy(config, drafter, loop.loop_arms(config, drafter)[1],
                              len(RAGGED))
    rounds = 0
    while True:
        if which == "target":
            state = state.replace(target_cache=_poison(state.target_cache))
        else:
            state = state.replace(draft_cache=_poison(state.draft_cache))
        state, policy = rounds_fn(params, dparams, state, policy, jnp.int32(1))
        rounds += 1
        if bool(jnp.all(state.done)):
            break
    assert rounds > 2
    assert speculative._trim(state, config) == expected.tokens
    np.testing.assert_array_equal(np.asarray(state.accept_hist), expected.accept_hist)


# ----------------------------------------------------------------------- stops and limits


def _cut(tokens, stops):
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[:i + 1]
    return tokens


def test_stop_token_mid_block():
    cfg = draft_config(32, block=4, shift=True, prefix=0, gru=32, emb=32)
    dparams = perm_domino_params(cfg, PI)
    target, params = perm_target(PI, attn_scale=0.0, seed=1)
    ref = reference_greedy(target, params, RAGGED, MAX_NEW)
    # row 0 stops at index 3 (inside round 1's block, which commits indices 1..5);
    # row 1 stops at its very first token (sampled at prefill).
    stops = (ref[0][3], ref[1][0])
    assert ref[0][3] not in ref[0][:3]
    expected = [_cut(r, stops) for r in ref]
    assert len(expected[0]) == 4 and len(expected[1]) == 1
    for method in ("ar", "domino"):
        result = run(target, params, RAGGED, method, cfg, dparams, max_new_tokens=MAX_NEW,
                     stop_token_ids=stops)
        assert result.tokens == expected, method
    assert result.rounds[1] == 0                 # done at prefill
    # partial-acceptance target, same compiled functions
    target, params = perm_target(PI, attn_scale=0.3, seed=1)
    ref = reference_greedy(target, params, RAGGED, MAX_NEW)
    result = run(target, params, RAGGED, "domino", cfg, dparams, max_new_tokens=MAX_NEW,
                 stop_token_ids=stops)
    assert result.tokens == [_cut(r, stops) for r in ref]


@pytest.mark.parametrize("max_new", [1, 2, 7])
def test_max_new_tokens_not_multiple_of_block(max_new):
    cfg = draft_config(32, block=4, shift=True, prefix=0, gru=32, emb=32)   # K + 1 = 5
    target, params = perm_target(PI, attn_scale=0.0, seed=1)
    ref = reference_greedy(target, params, RAGGED, max_new)
    result = run(target, params, RAGGED, "domino", cfg, perm_domino_params(cfg, PI),
                 max_new_tokens=max_new)
    assert result.tokens == ref
    assert all(len(t) == max_new for t in result.tokens)


# --------------------------------------------------------------------------------- errors


def test_capacity_overflow_raises_before_compute(monkeypatch):
    target, params = perm_target(PI, seed=1)

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled before checking the capacity")

    monkeypatch.setattr(speculative, "_compiled", no_compile)
    with pytest.raises(ValueError) as err:
        generate(target, params, [[1, 2, 3, 4, 5]], DecodeConfig(max_new_tokens=10, capacity=12))
    message = str(err.value)
    for number in ("5", "10", "16", "12"):          # prompt, max_new, needed, capacity
        assert number in message, message
    cfg = draft_config(32, block=4)
    drafter = make_drafter(cfg, target, "domino")
    with pytest.raises(ValueError, match="20 cache slots"):   # 5 + 10 + K(4) + 1
        generate(target, params, [[1, 2, 3, 4, 5]],
                 DecodeConfig(method="domino", max_new_tokens=10, capacity=19),
                 drafter=drafter, draft_params=tiny_draft(cfg, 0))


def test_argument_errors():
    target, params = perm_target(PI, seed=1)
    with pytest.raises(ValueError, match="empty"):
        generate(target, params, [[1, 2], []], DecodeConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match="unknown method"):
        DecodeConfig(method="tree")
    with pytest.raises(ValueError, match="draft policy"):
        DecodeConfig(method="domino", draft_policy="topk")
    with pytest.raises(ValueError, match="verification rule"):
        DecodeConfig(method="domino", verify="typical")
    with pytest.raises(ValueError):
        DecodeConfig(max_new_tokens=0)
    with pytest.raises(ValueError):
        DecodeConfig(method="domino", draft_policy="sample", draft_temperature=0.0)
    with pytest.raises(ValueError):
        SamplingConfig(top_p=0.0)
    dflash_cfg = draft_config(32, block=4, method="dflash")
    with pytest.raises(ValueError, match="'domino' needs a Domino checkpoint"):
        make_drafter(dflash_cfg, target, "domino")
    with pytest.raises(ValueError, match="unknown method 'medusa'"):
        make_drafter(dflash_cfg, target, "medusa")
    with pytest.raises(ValueError, match="head_topm must be >= 0"):
        DominoOptions(head_topm=-1)
    with pytest.raises(ValueError, match="'dflash' has no option head_topm"):
        method_options("dflash", head_topm=2)
    with pytest.raises(ValueError, match="'dflash' takes BlockOptions, got DominoOptions"):
        make_drafter(dflash_cfg, target, "dflash", DominoOptions(head_topm=2))
    drafter = make_drafter(dflash_cfg, target, "dflash")
    with pytest.raises(ValueError, match="takes no drafter"):
        generate(target, params, [[1]], DecodeConfig(method="ar"), drafter=drafter)
    with pytest.raises(ValueError, match="needs a drafter"):
        generate(target, params, [[1]], DecodeConfig(method="dflash"))
    with pytest.raises(ValueError, match="does not match"):     # would silently run DFlash
        generate(target, params, [[1]], DecodeConfig(method="domino"), drafter=drafter)
