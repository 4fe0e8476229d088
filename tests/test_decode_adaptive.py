"""Adaptive speculation (decode/adaptive.py, decode/cost_model.py): the policy's arithmetic,
losslessness whatever widths it picks (greedy == AR; T > 0 chi-square), the context buffer
of AR rounds, the cost table and calibration, the CLI flags. Tiny float32 models; every
generate call of one shape shares one compiled adaptive program (costs are an input)."""

from __future__ import annotations

import dataclasses
import json
import os
import types
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode_helpers import (assert_first_three_follow_target, draft_config,
                            perm_domino_params, perm_target, prefill_state, reference_greedy,
                            tiny_draft)
from test_decode_greedy import PI, RAGGED  # the greedy tests' permutation pair, ragged rows
from test_decode_sampling import PROMPT, V, models  # noqa: F401  (the T > 0 tiny pair)
from domino_jax.decode import adaptive, speculative
from domino_jax.decode.adaptive import AdaptiveConfig
from domino_jax.decode.cost_model import CostModel, calibration_line
from domino_jax.decode.drafters import DominoOptions
from domino_jax.decode.methods import make_drafter
from domino_jax.decode.tree_drafters import TreeOptions
from domino_jax.decode.sampling import SamplingConfig
from domino_jax.decode.speculative import DecodeConfig, generate

jax.config.update("jax_default_matmul_precision", "highest")

MAX_NEW = 20
AD = AdaptiveConfig(widths=(0, 2, 4), probe_min=2, probe_max=4, buffer_slack=4)
AR_FAVOURED = CostModel(costs=[1.0, 3.0, 5.0])   # loses even if every draft is accepted
SPEC_FAVOURED = CostModel(costs=[1.0, 1.05, 1.1])
MIXED = CostModel(costs=[1.0, 1.6, 2.4])


# ------------------------------------------------------------------- the policy, by hand


def _policy(accepted, observed, costs=(1.0, 1.5, 2.0), force=-1, since=0, interval=2,
            since_widen=0, widen_interval=2):
    acc = jnp.asarray(accepted, jnp.float32)
    return adaptive.PolicyState(acc, jnp.asarray(observed, jnp.float32),
                                jnp.asarray(costs, jnp.float32), jnp.int32(force),
                                jnp.int32(since), jnp.int32(interval), jnp.zeros(3, jnp.int32),
                                jnp.int32(since_widen), jnp.int32(widen_interval))


def _chain_base():
    target, _ = perm_target(PI, seed=1)
    return adaptive.base_drafter(make_drafter(draft_config(32, block=4, shift=True), target,
                                              "domino"), AD)


def test_expected_tokens_and_rates():
    base = _chain_base()                       # K = 4, widths (0, 2, 4)
    widths = adaptive.resolve_widths(AD, base)
    assert widths == (0, 2, 4)
    # row 0: depth 1 seen 4x, accepted 2x; depth 2 seen 2x, accepted 2x; deeper never seen
    policy = _policy([[[2, 2, 0, 0]]], [[[4, 2, 0, 0]]])
    rates = np.asarray(adaptive.acceptance_rates(AD, policy))[0, 0]
    d = AD.depth_discount
    r1 = (2 + AD.prior_rate) / (4 + 1)
    r2 = (2 + d * r1) / (2 + 1)
    r3, r4 = d * r2, d * d * r2                                         # unseen: discounted
    np.testing.assert_allclose(rates, [r1, r2, r3, r4], rtol=1e-6)
    tokens = np.asarray(adaptive.expected_tokens(AD, base, widths, policy))[0]
    np.testing.assert_allclose(tokens, [1, 1 + r1 + r1 * r2,
                                        1 + r1 + r1 * r2 + r1 * r2 * r3 + r1 * r2 * r3 * r4],
                               rtol=1e-6)
    # exploration: a bonus shrinking with the observations, not passed down the depths
    bold = dataclasses.replace(AD, explore=0.2)
    np.testing.assert_allclose(np.asarray(adaptive.acceptance_rates(bold, policy))[0, 0],
                               np.minimum([r1 + 0.2 / 5 ** 0.5, r2 + 0.2 / 3 ** 0.5,
                                           r3 + 0.2, r4 + 0.2], 1.0), rtol=1e-6)
    # without the discount, unseen depths inherit the deepest observed rate
    flat = dataclasses.replace(AD, depth_discount=1.0)
    rates = np.asarray(adaptive.acceptance_rates(flat, policy))[0, 0]
    np.testing.assert_allclose(rates[2:], [(2 + r1) / 3] * 2, rtol=1e-6)


def _fake_state(done, context_len, buffer=9, num_out=None):
    return types.SimpleNamespace(done=jnp.asarray(done), context_len=jnp.asarray(context_len),
                                 context=jnp.zeros((len(done), buffer, 1)),
                                 num_out=jnp.asarray(num_out or [0] * len(done)))


def test_choose_arm_value_probe_buffer_and_force():
    base = _chain_base()
    widths = (0, 2, 4)
    low = _policy([[[0, 0, 0, 0]]] * 2, [[[20, 0, 0, 0]]] * 2)          # nothing accepted
    high = _policy([[[20, 20, 20, 20]]] * 2, [[[20, 20, 20, 20]]] * 2)  # everything accepted
    state = _fake_state([False, False], [1, 1])
    choose = lambda policy, st: tuple(
        int(x) for x in adaptive.choose_arm(AD, base, widths, policy, st))
    assert choose(low, state) == (0, 0, 0)
    assert choose(high, state) == (2, 0, 0)
    probe_due = low.replace(since_spec=jnp.int32(2))                    # interval 2 reached
    arm, probed, flush = choose(probe_due, state)
    assert arm > 0 and probed and not flush
    dear = probe_due.replace(costs=jnp.asarray([1.0, 5.0, 6.0], jnp.float32))  # 4 AR steps extra
    assert choose(dear, state) == (0, 0, 0)                             # 2 < interval 2 * 4
    assert choose(dear.replace(since_spec=jnp.int32(8)), state)[1] == 1
    # a probe needs 2 * 8 = 16 tokens left to repay it (the longest live row counts)
    late = lambda num_out, done=(False, False): tuple(int(x) for x in adaptive.choose_arm(
        AD, base, widths, dear.replace(since_spec=jnp.int32(8)),
        _fake_state(list(done), [1, 1], num_out=num_out), None, 30))
    assert late([14, 20])[1] == 1                                       # 16 left in row 0
    assert late([15, 20]) == (0, 0, 0)                                  # 15 left: no probe
    assert late([0, 15], done=(True, False)) == (0, 0, 0)               # done rows don't count
    full = _fake_state([False, False], [1, 9])                          # row 1 cannot append
    assert choose(low, full) == (0, 0, 1)                               # AR after a flush
    assert choose(high, full) == (2, 0, 0)                              # drafting reads it
    done_row = _fake_state([False, True], [1, 9])                       # done rows don't count
    assert choose(low, done_row) == (0, 0, 0)
    forced = high.replace(force=jnp.int32(1))
    assert choose(forced, state) == (1, 0, 0)
    assert choose(low.replace(force=jnp.int32(0), since_spec=jnp.int32(9)), full) == (0, 0, 1)
    # value w2 = 2.94 / 2.8 = 1.05 AR's: taken without a margin, not within the default 10%
    close = high.replace(costs=jnp.asarray([1.0, 2.8, 4.8], jnp.float32))
    no_margin = dataclasses.replace(AD, margin=0.0)
    assert int(adaptive.choose_arm(no_margin, base, widths, close, state)[0]) == 1
    assert choose(close, state) == (0, 0, 0)


def test_widening_probe_runs_the_next_wider_chain_arm():
    base = _chain_base()
    widths = (0, 2, 4)
    # depths 1-2 accepted 20 of 20, 3-4 never verified: with the discount the 2-draft arm
    # wins (value 2.91 / 1.5 = 1.94 against 4.1 / 2.2 = 1.86), without it the 4-draft arm
    # would (4.7 / 2.2 = 2.14)
    seen = _policy([[[20, 20, 0, 0]]], [[[20, 20, 0, 0]]], costs=(1.0, 1.5, 2.2))
    state = _fake_state([False], [1])
    choose = lambda policy, **kw: tuple(
        int(x) for x in adaptive.choose_arm(AD, base, widths, policy, state, **kw))
    assert choose(seen) == (1, 0, 0)                   # since_widen 0 < 2 * (2.2/1.5 - 1)
    due = seen.replace(since_widen=jnp.int32(1))
    assert choose(due) == (2, adaptive.WIDEN_PROBE, 0)
    assert choose(due.replace(force=jnp.int32(1))) == (1, 0, 0)         # calibration: never
    assert tuple(int(x) for x in adaptive.choose_arm(
        dataclasses.replace(AD, widen=False), base, widths, due, state)) == (1, 0, 0)  # off
    assert choose(due.replace(widen_interval=jnp.int32(4))) == (1, 0, 0)  # 1 < 4 * 0.47
    # a poor depth 2 promises nothing deeper, discount or not
    poor = _policy([[[20, 2, 0, 0]]], [[[20, 20, 0, 0]]], costs=(1.0, 1.5, 2.2),
                   since_widen=9)
    assert choose(poor)[:2] == (1, 0)
    # the widest arm has nothing wider; AR's probes are the AR probes
    assert adaptive._next_wider(base, widths) == (0, 2, 2)
    # a widening probe that found no accepted draft past the narrower width doubles its
    # interval; the AR probes' is left as after any speculative round
    before = types.SimpleNamespace(done=jnp.asarray([False]), target_cache=types.SimpleNamespace(
        lengths=jnp.asarray([10])))
    after = types.SimpleNamespace(target_cache=types.SimpleNamespace(lengths=jnp.asarray([15])))
    new = adaptive.observe(AD, base, widths, due, jnp.int32(2), jnp.int32(adaptive.WIDEN_PROBE),
                           before, after)
    assert int(new.widen_interval) == 2 and int(new.since_widen) == 0   # 4 > 2 accepted: paid
    short = types.SimpleNamespace(target_cache=types.SimpleNamespace(lengths=jnp.asarray([12])))
    unpaid = adaptive.observe(AD, base, widths, due, jnp.int32(2),
                              jnp.int32(adaptive.WIDEN_PROBE), before, short)  # 1 accepted
    assert int(unpaid.widen_interval) == 4 and int(unpaid.since_widen) == 0
    assert int(new.probe_interval) == AD.probe_min and int(new.since_spec) == 0
    np.testing.assert_allclose(np.asarray(new.observed)[0, 0], [19, 19, 1, 1])   # decay 0.9
    np.testing.assert_allclose(np.asarray(new.accepted)[0, 0], [19, 19, 1, 1])
    plain = adaptive.observe(AD, base, widths, due, jnp.int32(1), jnp.int32(0), before, after)
    assert int(plain.widen_interval) == 2 and int(plain.since_widen) == 2


def test_observe_counts_accepts_and_the_first_rejection():
    base = _chain_base()
    widths = (0, 2, 4)
    policy = _policy(np.zeros((3, 1, 4)), np.zeros((3, 1, 4)))
    before = types.SimpleNamespace(done=jnp.asarray([False, False, True]),
                                   target_cache=types.SimpleNamespace(
                                       lengths=jnp.asarray([10, 10, 10])))
    after = types.SimpleNamespace(target_cache=types.SimpleNamespace(
        lengths=jnp.asarray([11, 13, 10])))                # accepted 0, 2 (row 2 done)
    new = adaptive.observe(AD, base, widths, policy, jnp.int32(2), jnp.bool_(False), before,
                           after)                          # arm 2 = 4 drafts
    np.testing.assert_array_equal(np.asarray(new.observed)[:, 0], [[1, 0, 0, 0], [1, 1, 1, 0],
                                                                  [0, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(new.accepted)[:, 0], [[0, 0, 0, 0], [1, 1, 0, 0],
                                                                  [0, 0, 0, 0]])
    assert int(new.since_spec) == 0 and int(new.probe_interval) == AD.probe_min
    assert list(np.asarray(new.arm_rounds)) == [0, 0, 1]
    probed = adaptive.observe(AD, base, widths, policy, jnp.int32(1), jnp.bool_(True), before,
                              after)
    # rows 0, 1 committed 1 and 3 tokens: 2 per live row, under the 2-draft arm's cost of 1.5
    # AR steps: the probe paid, the interval goes back to probe_min
    assert int(probed.probe_interval) == AD.probe_min
    dear = policy.replace(costs=jnp.asarray([1.0, 2.5, 3.0], jnp.float32))
    unpaid = adaptive.observe(AD, base, widths, dear, jnp.int32(1), jnp.bool_(True), before,
                              after)
    assert int(unpaid.probe_interval) == 4                 # doubled, capped at probe_max
    # 2 tokens per row at a cost of 1.9 AR steps: break-even, short of the 10% margin the
    # choice asks of speculation, so not paid
    even = policy.replace(costs=jnp.asarray([1.0, 1.9, 3.0], jnp.float32))
    assert int(adaptive.observe(AD, base, widths, even, jnp.int32(1), jnp.bool_(True),
                                before, after).probe_interval) == 4
    ar = adaptive.observe(AD, base, widths, policy, jnp.int32(0), jnp.bool_(False), before,
                          before)
    assert int(ar.since_spec) == 1 and float(ar.observed.sum()) == 0


def test_config_errors():
    for bad in (dict(widths=(2, 4)), dict(widths=(0, 4, 2)), dict(widths=(0,)),
                dict(decay=0.0), dict(depth_discount=0.0), dict(probe_min=5, probe_max=4), dict(margin=-0.1),
                dict(explore=-0.1)):
        with pytest.raises(ValueError):
            AdaptiveConfig(**bad)
    for method in ("ar", "ngram"):
        with pytest.raises(ValueError, match="take a block drafter method"):
            DecodeConfig(method=method, adaptive=AD)
    target, _ = perm_target(PI, seed=1)
    with pytest.raises(ValueError, match="draft length must be in 1..4"):
        make_drafter(draft_config(32, block=4, shift=True), target, "domino",
                     DominoOptions(draft_length=5))


# ------------------------------------------------------------------- lossless end to end


def _run(target, params, cfg, dparams, cost_model, method="domino", max_new=MAX_NEW, **kw):
    drafter = make_drafter(cfg, target, method)
    config = DecodeConfig(method=method, max_new_tokens=max_new, adaptive=AD, **kw)
    return generate(target, params, RAGGED, config, drafter, dparams, cost_model=cost_model)


@pytest.mark.parametrize("head", ["forced", "random"])
def test_greedy_auto_equals_ar(head):
    cfg = draft_config(32, block=4, shift=True, prefix=0, gru=32, emb=32)
    target, params = perm_target(PI, attn_scale=0.3, seed=1)       # partial acceptance
    dparams = perm_domino_params(cfg, PI) if head == "forced" else tiny_draft(cfg, seed=5)
    ref = reference_greedy(target, params, RAGGED, MAX_NEW)
    hists = {}
    for name, costs in (("ar", AR_FAVOURED), ("spec", SPEC_FAVOURED), ("mixed", MIXED)):
        result = _run(target, params, cfg, dparams, costs)
        assert result.tokens == ref, name
        assert result.cost_source == "given"
        assert sum(result.verify_widths.values()) == int(result.rounds.max())
        hists[name] = result.verify_widths
    # AR-favoured costs: mostly AR steps, and probes now and then
    assert hists["ar"].get(1, 0) > sum(n for w, n in hists["ar"].items() if w > 1) > 0
    if head == "forced":    # drafts accepted: speculation pays even at costs 1 : 1.1
        assert max(hists["spec"], key=hists["spec"].get) == 5


def test_dflash_auto_equals_ar():
    cfg = draft_config(32, block=5, method="dflash")                      # K = 4
    target, params = perm_target(PI, attn_scale=0.3, seed=1)
    ref = reference_greedy(target, params, RAGGED, MAX_NEW)
    assert _run(target, params, cfg, tiny_draft(cfg, seed=3), MIXED, method="dflash").tokens == ref


@pytest.mark.slow
def test_ar_rounds_feed_the_draft_cache_as_prefill_would():
    """AR forced for 12 rounds (the 4-row buffer slack overflows: flushes), then the buffer's
    rest committed: the draft cache equals the one a prefill over prompt + those tokens
    builds, row by row (so drafting after AR steps sees the complete context); the tokens
    equal greedy AR."""
    from decode_helpers import fixture_models

    target, params, dcfg, dparams, _ = fixture_models("dflash")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 255, n).tolist() for n in (5, 9)]
    drafter = make_drafter(dcfg, target, "dflash")
    config = DecodeConfig(method="dflash", max_new_tokens=MAX_NEW, adaptive=AD)
    prep = speculative._prepare(target, params, prompts, config, drafter, dparams, 0)
    base = prep.drafter
    state = prep.prefill_fn(params, dparams, prep.prompt, prep.prompt_len, prep.key)
    arms = len(prep.widths)
    policy = adaptive.init_policy(AD, base, prep.widths, 2, [1.0] * arms, force=0)
    state, policy = prep.rounds_fn(params, dparams, state, policy, jnp.int32(12))
    assert list(np.asarray(policy.arm_rounds)) == [12] + [0] * (arms - 1)
    positions = ((state.target_cache.lengths - state.context_len)[:, None]
                 + jnp.arange(state.context.shape[1], dtype=jnp.int32)[None, :])
    cache = jax.jit(base.ingest_features)(params, dparams, state.context, positions,
                                          state.context_len, state.draft_cache)
    generated = speculative._trim(state, config)
    assert generated == [r[:13] for r in reference_greedy(target, params, prompts, 13)]
    longer = [p + g[:12] for p, g in zip(prompts, generated)]      # the committed tokens
    plain = DecodeConfig(method="dflash", max_new_tokens=MAX_NEW)
    ref_state = prefill_state(target, params, longer, plain, drafter, dparams)
    np.testing.assert_array_equal(np.asarray(cache.lengths),
                                  np.asarray(ref_state.draft_cache.lengths))
    for row, n in enumerate(np.asarray(cache.lengths)):
        for got, want in ((cache.keys, ref_state.draft_cache.keys),
                          (cache.values, ref_state.draft_cache.values)):
            np.testing.assert_allclose(np.asarray(got[:, row, :n]), np.asarray(want[:, row, :n]),
                                       rtol=1e-5, atol=1e-5)


def test_narrow_drafting_proposes_what_the_whole_buffer_does():
    """A 2-draft arm drafts from the buffer's first ``narrow_rows`` rows when every row's
    buffered context fits there (same drafts, same draft cache), else from the whole
    buffer (a row with more rows: nothing clipped)."""
    from decode_helpers import fixture_models
    from domino_jax.decode import round as round_lib

    target, params, dcfg, dparams, _ = fixture_models("dflash")
    prompts = [list(range(3, 8)), list(range(10, 19))]
    drafter = make_drafter(dcfg, target, "dflash")
    config = DecodeConfig(method="dflash", max_new_tokens=MAX_NEW, adaptive=AD)
    prep = speculative._prepare(target, params, prompts, config, drafter, dparams, 0)
    state = prep.prefill_fn(params, dparams, prep.prompt, prep.prompt_len, prep.key)
    state = state.replace(context=jax.random.normal(jax.random.PRNGKey(1), state.context.shape))
    arm = adaptive.arm_drafter(prep.drafter, 2)
    rows = adaptive.narrow_rows(prep.drafter, arm)
    assert rows == adaptive.NARROW_MIN_ROWS < state.context.shape[1]
    key = jax.random.PRNGKey(0)
    # jitted (one compile each, both lengths): eager dispatch of the drafts is slower
    narrow = jax.jit(lambda p, d, s, k: adaptive.draft_narrow(arm, rows, config, p, d, s, k))
    whole = jax.jit(lambda p, d, s, k: round_lib.draft(arm, config, p, d, s, k))
    for lens in ([3, rows], [3, rows + 1]):
        s = state.replace(context_len=jnp.asarray(lens, jnp.int32))
        got = narrow(params, dparams, s, key)
        want = whole(params, dparams, s, key)
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
        lengths = np.asarray(want.draft_cache.lengths)
        np.testing.assert_array_equal(np.asarray(got.draft_cache.lengths), lengths)
        for row, n in enumerate(lengths):
            for a, b in ((got.draft_cache.keys, want.draft_cache.keys),
                         (got.draft_cache.values, want.draft_cache.values)):
                np.testing.assert_allclose(np.asarray(a[:, row, :n]), np.asarray(b[:, row, :n]),
                                           rtol=1e-5, atol=1e-5)


def test_tree_budget_auto_equals_ar():
    cfg = draft_config(32, block=4, shift=True, prefix=0, gru=32, emb=32)
    target, params = perm_target(PI, attn_scale=0.3, seed=1)
    dparams = perm_domino_params(cfg, PI)
    ref = reference_greedy(target, params, RAGGED, MAX_NEW)
    tree_ad = AdaptiveConfig(widths=(0, 2, 4), probe_min=2, probe_max=4)
    drafter = make_drafter(cfg, target, "ddtree", TreeOptions(budget=4))
    config = DecodeConfig(method="ddtree", max_new_tokens=MAX_NEW, adaptive=tree_ad)
    for costs in (AR_FAVOURED, MIXED):
        result = generate(target, params, RAGGED, config, drafter, dparams, cost_model=costs)
        assert result.tokens == ref
        assert set(result.verify_widths) <= {1, 3, 5}


# ------------------------------------------------------------------- T > 0: chi-square

ROWS = 1000       # per cost setting; three settings pooled (a mixture of exact samplers)


@pytest.mark.slow
@pytest.mark.parametrize("method,verify,policy", [("domino", "rejection", "sample"),
                                                  ("dflash", "match", "greedy")])
def test_auto_joint_distribution_chi_square(models, method, verify, policy):
    cfg, dparams = models[method]
    target, params = models["target"], models["params"]
    sampling = SamplingConfig(1.0)
    widths = (0, 2, cfg.k_draft)
    config = DecodeConfig(method=method, max_new_tokens=3, sampling=sampling, verify=verify,
                          draft_policy=policy,
                          adaptive=AdaptiveConfig(widths=widths, probe_min=1, probe_max=2))
    drafter = make_drafter(cfg, target, method)
    tokens, used = [], set()
    for i, costs in enumerate(([1.0, 5.0, 6.0], [1.0, 1.3, 1.6], [1.0, 1.01, 1.02])):
        seed = zlib.crc32(f"{method}{verify}{i}".encode()) % 1000
        result = generate(target, params, [PROMPT] * ROWS, config, drafter, dparams, seed=seed,
                          cost_model=CostModel(costs=costs))
        tokens += result.tokens
        used |= set(result.verify_widths)
    assert len(used) >= 2, used
    assert_first_three_follow_target(target, params, PROMPT, V, tokens, sampling)


# ------------------------------------------------------------------- cost table


def test_calibrate_fastest_never_falls_with_the_width():
    from domino_jax.decode.cost_model import calibrate

    times = {0: [5.0, 4.0, 6.0], 1: [3.0, 3.0, 9.0], 2: [8.0, 7.0, 9.0]}     # ms per round
    calls = {a: 0 for a in times}

    overheads = iter([0.009, 0.006, 0.008])               # s per call: the fastest counts

    def run_forced(arm, rounds):
        if rounds == 1:                                   # the untimed warm-up
            return 1.0, 1
        if rounds == 0:                                   # the call's fixed cost
            return next(overheads), 0
        value = times[arm][calls[arm]]
        calls[arm] += 1
        return 0.006 + value * rounds / 1e3, rounds       # 6 ms a call + the rounds

    costs, samples = calibrate(run_forced, 3, rounds=2, reps=3)
    np.testing.assert_allclose(costs, [4.0, 4.0, 7.0])    # fastest; arm 1's 3 lifted to 4
    assert samples[1] == pytest.approx([3.0, 3.0, 9.0])


def test_calibration_line_is_short():
    line = calibration_line((0, 2, 4, 8, 16), [211.9, 225.4, 259.9, 317.0, 429.3], 19.84)
    assert line == (f"[cost model] calibrated widths 0/2/4/8/16 on {jax.devices()[0].platform}"
                    " in 19.8 s (ms per round: 212 225 260 317 429)")
    line = calibration_line((0, 2, -4), [58.2, 60.1, 55.0], 6.7)
    assert "widths 0/2/lookup4 on" in line and line.endswith("(ms per round: 58 60 55)")


@pytest.mark.slow
def test_cost_table_calibrates_once_then_reads(tmp_path):
    cfg = draft_config(32, block=4, shift=True, prefix=0, gru=32, emb=32)
    target, params = perm_target(PI, attn_scale=0.3, seed=1)
    dparams = perm_domino_params(cfg, PI)
    path = str(tmp_path / "costs.json")
    model = CostModel(path=path, rounds=2, reps=1)
    first = _run(target, params, cfg, dparams, model)
    assert first.cost_source == "calibrated" and first.calibration_seconds > 0
    table = json.load(open(path))
    (key, entry), = table["entries"].items()
    assert entry["widths"] == [0, 2, 4] and all(ms > 0 for ms in entry["ms"])
    assert "B=4" in key and "cpu" in key
    second = _run(target, params, cfg, dparams, model)
    assert second.cost_source == f"table {path}" and second.calibration_seconds == 0
    assert second.tokens == first.tokens
    again = _run(target, params, cfg, dparams, CostModel(path=path, rounds=2, reps=1,
                                                          recalibrate=True))
    assert again.cost_source == "calibrated"
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="costs.json"):
        _run(target, params, cfg, dparams, model)
    with pytest.raises(ValueError, match="one positive cost"):
        _run(target, params, cfg, dparams, CostModel(costs=[1.0, 2.0]))


def test_cli_width_flags(capsys, monkeypatch):
    from domino_jax.decode.__main__ import main

    for flag, bad in (("--draft-length", "x"), ("--budget", "0")):
        with pytest.raises(SystemExit) as err:
            main([flag, bad])
        assert err.value.code == 2
        assert flag in capsys.readouterr().err
    import domino_jax.decode.loading as loading

    seen = []

    def fake_load_pair(*args, **kwargs):
        seen.append(kwargs)
        raise FileNotFoundError("stop here")

    monkeypatch.setattr(loading, "load_pair", fake_load_pair)
    monkeypatch.setattr(loading, "load_tokenizer", lambda folder: types.SimpleNamespace(
        chat_template=None, eos_token_id=None, encode=lambda text: [1, 2, 3]))
    fix = os.path.join(os.path.dirname(__file__), "fixtures", "reference", "domino_shift")
    pair = ["--target", os.path.join(fix, "target"), "--draft", os.path.join(fix, "draft")]
    # "auto" reaches the options as "auto"; the fixed_* properties give the widest width
    for extra, expected in (([], dict(draft_length="auto", fixed_draft_length=0)),
                            (["--draft-length", "3"], dict(draft_length=3)),
                            (["--method", "ddtree"], dict(budget="auto", fixed_budget=16)),
                            (["--method", "ddtree", "--budget", "8"], dict(budget=8)),
                            (["--method", "ddtree", "--draft-length", "2"],
                             dict(budget="auto", fixed_budget=16, draft_length=2)),
                            ([], dict(trim_block=False)),
                            (["--draft-length", "2", "--trim-block", "on"],
                             dict(draft_length=2, trim_block=True))):
        assert main(pair + extra) == 2
        for k, v in expected.items():
            assert getattr(seen[-1]["options"], k) == v, (extra, seen[-1])
    assert main(pair + ["--budget", "8"]) == 2              # a tree flag on a chain method
    assert "--budget is not an option" in capsys.readouterr().err
    assert main(pair[:2] + ["--method", "ngram", "--trim-block", "on"]) == 2
    assert "--trim-block is not an option" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(pair + ["--trim-block", "yes"])
    assert "expected on or off, got 'yes'" in capsys.readouterr().err


# ------------------------------------------------------------------- forced acceptance


def test_forced_acceptance_rates_and_rounds():
    """The benchmarks' timing hook: per-row taus spread around the mean; constant mode
    commits round(tau) tokens per round; random mode's mean matches the rate model; trees
    walk first children."""
    from domino_jax.decode.verify import ForcedAcceptance, _rate_for_tau, forced_walk

    forced = ForcedAcceptance(4.0, width=4, spread=0.5)
    np.testing.assert_allclose(forced.row_taus(3), [3.0, 4.0, 5.0])
    a = _rate_for_tau(3.0, 4)
    assert abs((1 - a ** 5) / (1 - a) - 3.0) < 1e-6
    draws = ForcedAcceptance(3.0, width=4).accepted(jax.random.PRNGKey(0), 20000, 4)
    assert abs(float(draws.mean()) + 1 - 3.0) < 0.03
    with pytest.raises(ValueError):
        ForcedAcceptance(6.0, width=4)
    cfg = draft_config(32, block=4, shift=True, prefix=0, gru=32, emb=32)
    target, params = perm_target(PI, attn_scale=0.3, seed=1)
    dparams = tiny_draft(cfg, seed=5)                       # accepts ~nothing on its own
    config = DecodeConfig(method="domino", max_new_tokens=MAX_NEW,
                          verify=ForcedAcceptance(3.0, width=4, constant=True))
    result = generate(target, params, RAGGED, config, make_drafter(cfg, target, "domino"),
                      dparams)
    hist = result.accept_hist
    assert hist[:, 3].sum() >= hist.sum() - len(RAGGED)     # 3 per round (last may stop)
    parents = jnp.asarray([-1, -1, 0, 2, 0])               # 0 -> {2 -> 3, 4}, and 1
    valid = jnp.asarray([True, True, True, True, True])
    path, accepted, last = forced_walk(parents, valid, jnp.int32(5), 4)
    assert list(np.asarray(path)) == [0, 1, 3, 4, 0] and int(accepted) == 3 and int(last) == 4
