"""The prompt-lookup arms of adaptive speculation (decode/lookup_arm.py, issue 18 item 3):
the per-match-length statistics by hand, greedy equality with AR with the lookup arm in
play (a repetitive prompt where it is chosen, seen in the arm histogram), the T > 0
chi-square test, the cost calibration's kinds and the CLI flag. Tiny float32 models."""

from __future__ import annotations

import types
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode_helpers import (assert_first_three_follow_target, draft_config,
                            perm_domino_params, perm_target, reference_greedy, tiny_draft)
from test_decode_greedy import PI, RAGGED
from test_decode_sampling import PROMPT, V, models  # noqa: F401  (the T > 0 tiny pair)
from domino_jax.decode import adaptive, lookup_arm
from domino_jax.decode.adaptive import AdaptiveConfig
from domino_jax.decode.cost_model import CostModel, calibrate
from domino_jax.decode.methods import make_drafter
from domino_jax.decode.sampling import SamplingConfig
from domino_jax.decode.speculative import DecodeConfig, generate

jax.config.update("jax_default_matmul_precision", "highest")

MAX_NEW = 24
AD = AdaptiveConfig(widths=(0, 2, 4), probe_min=2, probe_max=4, buffer_slack=4, lookup=(3,))
LOOKUP_CHEAP = CostModel(costs=[1.0, 1.6, 2.4, 1.1])       # AR, chain 2, chain 4, lookup 3
LOOKUP_DEAR = CostModel(costs=[1.0, 1.05, 1.1, 3.0])


def _base(ad=AD):
    target, _ = perm_target(PI, seed=1)
    return adaptive.base_drafter(make_drafter(draft_config(32, block=4, shift=True), target,
                                              "domino"), ad)


def test_arms_groups_and_config():
    base = _base()
    assert base.reads_history
    widths = adaptive.resolve_widths(AD, base)
    assert widths == (0, 2, 4, -3)
    assert adaptive.arm_groups(base, widths) == ((-1, 0), (0, 2), (0, 4), (1, 3))
    policy = adaptive.init_policy(AD, base, widths, 2, [1.0] * 4)
    assert policy.accepted.shape == (2, 1 + AD.lookup_ngram.max_ngram, 4)
    assert adaptive.width_histogram(widths, [1, 0, 2, 3]) == {1: 1, 4: 3, 5: 2}
    assert adaptive.arm_histogram(widths, [1, 0, 2, 3]) == {"ar": 1, "draft4": 2,
                                                           "lookup3": 3}
    for bad in ((3, 2), (0,), (2, 2)):
        with pytest.raises(ValueError, match="lookup arms"):
            AdaptiveConfig(lookup=bad)
    with pytest.raises(ValueError, match="must be in 1..4"):
        adaptive.resolve_widths(AdaptiveConfig(lookup=(5,)), base)
    target, _ = perm_target(PI, seed=1)
    tree = make_drafter(draft_config(32, block=4, shift=True), target, "ddtree")
    with pytest.raises(ValueError, match="take a chain method"):
        adaptive.resolve_widths(AdaptiveConfig(lookup=(3,)), tree)


def test_expected_tokens_and_observe_per_match_length():
    base = _base()
    widths = adaptive.resolve_widths(AD, base)
    groups = 1 + AD.lookup_ngram.max_ngram
    acc = np.zeros((3, groups, 4), np.float32)
    obs = np.zeros((3, groups, 4), np.float32)
    acc[:, 2, :3], obs[:, 2, :3] = 10.0, 10.0          # 2-token matches: always accepted
    obs[:, 1, :3] = 10.0                               # 1-token matches: never
    policy = adaptive.init_policy(AD, base, widths, 3, [1.0] * 4).replace(
        accepted=jnp.asarray(acc), observed=jnp.asarray(obs))
    matched = jnp.asarray([0, 1, 2])
    tokens = np.asarray(adaptive.expected_tokens(AD, base, widths, policy, matched))[:, 3]
    def chain(hits):                                   # 10 observations per depth
        rates, prior = [], AD.prior_rate
        for _ in range(3):
            rates.append((hits + prior) / 11)
            prior = AD.depth_discount * rates[-1]
        return 1 + rates[0] + rates[0] * rates[1] + rates[0] * rates[1] * rates[2]

    np.testing.assert_allclose(tokens, [1.0, chain(0.0), chain(10.0)], rtol=1e-5)
    with pytest.raises(ValueError, match="match lengths"):
        adaptive.expected_tokens(AD, base, widths, policy)
    # one lookup round: rows 0 (no match), 1 (1-token match, 1 accepted), 2 (2-token, 3)
    fresh = adaptive.init_policy(AD, base, widths, 3, [1.0] * 4)
    before = types.SimpleNamespace(done=jnp.asarray([False] * 3),
                                   target_cache=types.SimpleNamespace(
                                       lengths=jnp.asarray([10, 10, 10])))
    after = types.SimpleNamespace(target_cache=types.SimpleNamespace(
        lengths=jnp.asarray([11, 12, 14])))
    new = adaptive.observe(AD, base, widths, fresh, jnp.int32(3), jnp.bool_(False), before,
                           after, matched)
    observed, accepted = np.asarray(new.observed), np.asarray(new.accepted)
    assert observed[0].sum() == 0                                   # no match: not counted
    np.testing.assert_array_equal(observed[1, 1], [1, 1, 0, 0])     # its own group
    np.testing.assert_array_equal(accepted[1, 1], [1, 0, 0, 0])
    np.testing.assert_array_equal(observed[2, 2], [1, 1, 1, 0])     # 3 of 3 accepted
    np.testing.assert_array_equal(accepted[2, 2], [1, 1, 1, 0])
    assert observed[:, 0].sum() == 0 and list(np.asarray(new.arm_rounds)) == [0, 0, 0, 1]


def test_a_chosen_lookup_arm_still_lets_the_drafter_be_probed():
    """A chosen lookup arm observes no drafts: once the probe clock (rounds since the drafter
    last ran) reaches the wait, the round runs the best drafter arm as an AR probe; lookup
    rounds do not reset that clock, a drafter round does."""
    base = _base()
    widths = adaptive.resolve_widths(AD, base)                 # (0, 2, 4, -3)
    groups = 1 + AD.lookup_ngram.max_ngram
    acc = np.zeros((2, groups, 4), np.float32)
    obs = np.zeros((2, groups, 4), np.float32)
    acc[:, 3, :3], obs[:, 3, :3] = 10.0, 10.0                   # 3-token matches: all accepted
    policy = adaptive.init_policy(AD, base, widths, 2, [1.0, 1.6, 2.4, 1.1]).replace(
        accepted=jnp.asarray(acc), observed=jnp.asarray(obs), since_spec=jnp.int32(0))
    state = types.SimpleNamespace(done=jnp.asarray([False, False]),
                                  context_len=jnp.zeros(2, jnp.int32),
                                  context=jnp.zeros((2, 8, 1)),
                                  num_out=jnp.zeros(2, jnp.int32))
    matched = jnp.asarray([3, 3])
    arm, kind, _ = adaptive.choose_arm(AD, base, widths, policy, state, matched, 100)
    assert (int(arm), int(kind)) == (3, adaptive.NO_PROBE)     # the lookup arm wins
    due = policy.replace(since_spec=jnp.int32(8))
    arm, kind, _ = adaptive.choose_arm(AD, base, widths, due, state, matched, 100)
    assert int(kind) == adaptive.AR_PROBE and 1 <= int(arm) <= 2   # a drafter arm
    before = types.SimpleNamespace(done=jnp.asarray([False] * 2),
                                   target_cache=types.SimpleNamespace(
                                       lengths=jnp.asarray([10, 10])))
    after = types.SimpleNamespace(target_cache=types.SimpleNamespace(
        lengths=jnp.asarray([14, 14])))
    looked = adaptive.observe(AD, base, widths, policy, jnp.int32(3), jnp.int32(0), before,
                              after, matched)
    assert int(looked.since_spec) == 1                         # lookup rounds keep counting
    drafted = adaptive.observe(AD, base, widths, due, arm, kind, before, after, matched)
    assert int(drafted.since_spec) == 0


def test_one_lookup_serves_every_arm():
    """The loop's one lookup a round (``round_lookup`` at the widest arm) gives each
    ``k``-token arm what its own lookup (``LookupArm.propose``) would: the first ``k``."""
    from domino_jax.decode.ngram import NGRAM_DEFAULTS

    rng = np.random.default_rng(0)
    history = jnp.asarray(rng.integers(0, 6, (4, 40)), jnp.int32)     # repeats: matches
    state = types.SimpleNamespace(history=history, draft_cache=None,
                                  target_cache=types.SimpleNamespace(
                                      lengths=jnp.asarray([5, 17, 30, 38], jnp.int32)))
    wide = lookup_arm.round_lookup(NGRAM_DEFAULTS, state, 6)
    assert int((wide.match_len > 0).sum()) >= 3
    for k in (1, 3, 6):
        arm = lookup_arm.LookupArm(num_tokens=k, options=NGRAM_DEFAULTS)
        own = arm.propose(None, None, state, None, None)
        np.testing.assert_array_equal(np.asarray(wide.drafts[:, :k]), np.asarray(own.tokens))


def test_calibrate_kinds_are_monotone_apart():
    times = [4.0, 6.0, 8.0, 3.0, 5.0]                 # AR, chains 2/4, lookups 2/4 (ms)

    def run_forced(arm, rounds):
        return (times[arm] * rounds / 1e3, rounds) if rounds else (0.0, 0)

    costs, _ = calibrate(run_forced, 5, rounds=2, reps=1, kinds=[0, 0, 0, 1, 1])
    # each kind monotone on its own (the 5 ms lookup is not lifted to the 8 ms chain), and
    # no arm under the AR step: the 3 ms lookup (load noise) is lifted to AR's 4 ms
    np.testing.assert_allclose(costs, [4.0, 6.0, 8.0, 4.0, 5.0])


# ------------------------------------------------------------------- lossless end to end

# a repetitive prompt: the permutation target's own cycle, so the lookup predicts it
CYCLE = [0]
for _ in range(40):
    CYCLE.append(int(PI[CYCLE[-1]]))
REPEAT = [CYCLE[:40], CYCLE[5:30]]


def _run(prompts, cfg, dparams, costs, ad=AD, max_new=MAX_NEW, **kw):
    target, params = perm_target(PI, attn_scale=0.3, seed=1)
    config = DecodeConfig(method="domino", max_new_tokens=max_new, adaptive=ad, **kw)
    result = generate(target, params, prompts, config, make_drafter(cfg, target, "domino"),
                      dparams, cost_model=costs)
    return result, reference_greedy(target, params, prompts, max_new)


def test_greedy_with_lookup_arms_equals_ar():
    cfg = draft_config(32, block=4, shift=True, prefix=0, gru=32, emb=32)
    weak = tiny_draft(cfg, seed=5)                    # the drafter accepts ~nothing
    result, ref = _run(REPEAT, cfg, weak, LOOKUP_CHEAP)
    assert result.tokens == ref
    arms = result.arm_rounds
    assert arms.get("lookup3", 0) > sum(n for a, n in arms.items() if a != "lookup3"), arms
    assert arms.get("draft2", 0) + arms.get("draft4", 0) > 0, arms   # the drafter probed
    assert sum(arms.values()) == sum(result.verify_widths.values()) == int(result.rounds.max())
    assert result.tau >= 1.8       # lookup rounds commit ~3 tokens; probes (tiny bounds) ~1
    assert result.arm_costs == pytest.approx([1.0, 1.6, 2.4, 1.1])
    for prompts, dparams, costs in ((RAGGED, weak, LOOKUP_CHEAP),
                                    (RAGGED, perm_domino_params(cfg, PI), LOOKUP_DEAR),
                                    (REPEAT, perm_domino_params(cfg, PI), LOOKUP_CHEAP)):
        result, ref = _run(prompts, cfg, dparams, costs)
        assert result.tokens == ref, result.arm_rounds


def test_lookup_rounds_buffer_and_flush():
    """The lookup arm forced for every round (buffer slack 4: the rows it appends overflow
    the buffer, so it flushes), then the drafter's chain: still greedy AR."""
    cfg = draft_config(32, block=4, shift=True, prefix=0, gru=32, emb=32)
    forced = perm_domino_params(cfg, PI)
    result, ref = _run(RAGGED, cfg, forced, CostModel(costs=[1.0, 9.0, 9.5, 1.01]))
    assert result.tokens == ref
    assert result.arm_rounds.get("lookup3", 0) > 0 and len(result.arm_rounds) > 1


# ------------------------------------------------------------------- T > 0: chi-square

ROWS = 1000


@pytest.mark.slow
def test_lookup_arm_joint_distribution_chi_square(models):
    cfg, dparams = models["domino"]
    target, params = models["target"], models["params"]
    sampling = SamplingConfig(1.0)
    ad = AdaptiveConfig(widths=(0, 2, cfg.k_draft), probe_min=1, probe_max=2, lookup=(2,))
    config = DecodeConfig(method="domino", max_new_tokens=3, sampling=sampling,
                          verify="rejection", draft_policy="sample", adaptive=ad)
    drafter = make_drafter(cfg, target, "domino")
    tokens, used = [], {}
    for i, costs in enumerate(([1.0, 5.0, 6.0, 1.01], [1.0, 1.3, 1.6, 1.2])):
        seed = zlib.crc32(f"lookup{i}".encode()) % 1000
        result = generate(target, params, [PROMPT * 2] * ROWS, config,
                          drafter, dparams, seed=seed, cost_model=CostModel(costs=costs))
        tokens += result.tokens
        for arm, n in result.arm_rounds.items():
            used[arm] = used.get(arm, 0) + n
    assert used.get("lookup2", 0) > 0 and len(used) >= 2, used
    assert_first_three_follow_target(target, params, PROMPT * 2, V, tokens, sampling)


# ------------------------------------------------------------------- the CLI flag


def test_cli_adaptive_lookup_flag(capsys):
    from domino_jax.decode.__main__ import _adaptive_config, _given_options, build_parser, main
    from domino_jax.decode.drafters import DominoDrafter, DominoOptions
    from domino_jax.decode.lookup_arm import DEFAULT_LOOKUP_ARMS
    from domino_jax.decode.tree_drafters import DDTreeDrafter

    parse = build_parser().parse_args
    args = parse(["--adaptive-lookup", "8,4", "--ngram-max", "3"])
    config = _adaptive_config(args, DominoDrafter)
    assert config.lookup == (4, 8) and config.lookup_ngram.max_ngram == 3
    assert "max_ngram" not in _given_options(args, DominoOptions)   # the arms' matcher
    assert _adaptive_config(parse(["--adaptive-lookup", "on"]), DominoDrafter).lookup \
        == DEFAULT_LOOKUP_ARMS
    assert _adaptive_config(parse(["--adaptive-lookup", "off"]), DominoDrafter).lookup == ()
    assert _adaptive_config(parse(["--adaptive-lookup", "on"]), DDTreeDrafter).lookup == ()
    with pytest.raises(ValueError, match="take a chain method"):
        _adaptive_config(parse(["--adaptive-lookup", "4"]), DDTreeDrafter)
    with pytest.raises(ValueError, match="--ngram-max is not an option"):
        _given_options(parse(["--adaptive-lookup", "off", "--ngram-max", "3"]), DominoOptions)
    for bad in ("x", "0", "4,y"):
        assert main(["--adaptive-lookup", bad]) == 2
        assert "--adaptive-lookup" in capsys.readouterr().err


def test_summary_table_shows_the_lookup_rounds():
    from domino_jax.decode.report import summary_table

    rows = [dict(method="domino", new_tokens=9, rounds=3, tau=3.0, tokens_per_second=1.0,
                 verify_widths={"3": 2, "5": 1}, arm_rounds={"draft2": 2, "lookup4": 1})]
    assert summary_table(rows).splitlines()[1].split()[5:8] == ["3:2", "5:1", "(lookup4:1)"]


def test_a_stored_table_is_floored_at_the_ar_step(tmp_path):
    """Costs read back from a cost table written before the floor: a lookup arm stored under
    the AR step's cost comes back at the AR step's."""
    from domino_jax.decode import cost_model

    path = str(tmp_path / "costs.json")
    cost_model._save(path, "k", {"widths": [0, 2, -4], "ms": [56.0, 57.0, 52.0]})
    costs, seconds, source = cost_model.CostModel(path=path).resolve(
        "k", (0, 2, -4), lambda arm, rounds: pytest.fail("no calibration expected"))
    assert costs == [56.0, 57.0, 56.0] and seconds == 0.0 and source.startswith("table")
