"""Prompt-lookup drafting (``method="ngram"``): the on-device matcher against the plain
Python reference, greedy identity with AR, the loop's context buffer, the T > 0 joint
distribution (CPU, float32, tiny models)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode_helpers import (assert_first_three_follow_target, perm_target, permutation,
                            reference_greedy, tiny_target)
from domino_jax.decode import loop, speculative
from domino_jax.decode.ngram import NgramDrafter, NgramOptions, lookup_drafts, reference_lookup
from domino_jax.decode.sampling import SamplingConfig
from domino_jax.decode.speculative import DecodeConfig, generate

jax.config.update("jax_default_matmul_precision", "highest")


def _matcher(max_ngram, min_ngram, num_tokens, occurrence, wrap):
    # op by op: the 80 settings share their few small primitives' programs (a jit per setting
    # compiles 80 programs, 5x the time); the decode tests below run it inside the loop's jit
    return functools.partial(lookup_drafts, max_ngram=max_ngram, min_ngram=min_ngram,
                             num_tokens=num_tokens, occurrence=occurrence, wrap=wrap)


def _contexts(rng):
    """Rows of different lengths: random over small vocabularies (many chance matches),
    periodic patterns with and without noise, a row of one token, a row with no repeat."""
    rows = [rng.integers(0, v, n).tolist() for v, n in ((2, 9), (3, 17), (4, 30), (6, 23),
                                                         (3, 2), (5, 40))]
    for period, n in ((1, 7), (2, 11), (3, 20), (5, 33), (7, 12)):
        base = rng.integers(0, 50, period).tolist()
        row = [base[i % period] for i in range(n)]
        rows.append(row)
        noisy = list(row)
        noisy[rng.integers(0, n)] = 99
        rows.append(noisy)
    rows += [[4], list(range(15)), list(range(10)) + [3, 4]]
    return rows


def _buffer(rows, width, rng):
    """``[B, width]`` with each row's context at the front and stale garbage after it."""
    buffer = rng.integers(0, 6, (len(rows), width)).astype(np.int32)
    for i, row in enumerate(rows):
        buffer[i, :len(row)] = row
    return buffer, np.array([len(r) for r in rows], np.int32)


@pytest.mark.parametrize("wrap", [True, False])
@pytest.mark.parametrize("occurrence", ["first", "latest"])
def test_matcher_equals_reference(occurrence, wrap):
    rng = np.random.default_rng(0)
    rows = _contexts(rng)
    buffer, length = _buffer(rows, 48, rng)
    found_any = lens_seen = 0
    for max_ngram in range(1, 5):
        for min_ngram in range(1, max_ngram + 1):
            for num_tokens in (1, 5):
                got = _matcher(max_ngram, min_ngram, num_tokens, occurrence, wrap)(
                    jnp.asarray(buffer), jnp.asarray(length))
                drafts, match_len, start = map(np.asarray, got)
                for i, row in enumerate(rows):
                    want = reference_lookup(row, max_ngram=max_ngram, min_ngram=min_ngram,
                                            num_tokens=num_tokens, occurrence=occurrence,
                                            wrap=wrap)
                    have = (drafts[i].tolist(), int(match_len[i]), int(start[i]))
                    assert have == want, (i, row, max_ngram, min_ngram, num_tokens)
                found_any += int((match_len > 0).sum())
                lens_seen |= sum(1 << int(n) for n in set(match_len.tolist()))
    assert found_any > 100 and lens_seen == 0b11111        # no match and n = 1..4 all occur


def test_matcher_known_answers():
    """Hand-checked cases: which occurrence, which n, the periodic continuation."""
    context = [7, 1, 2, 3, 9, 1, 2, 5, 1, 2]                 # suffix "1 2" twice before
    first, n, start = reference_lookup(context, max_ngram=2, min_ngram=1, num_tokens=3,
                                       occurrence="first")
    assert (first, n, start) == ([3, 9, 1], 2, 3)
    latest, n, start = reference_lookup(context, max_ngram=2, min_ngram=1, num_tokens=3,
                                        occurrence="latest")
    assert (latest, n, start) == ([5, 1, 2], 2, 7)
    # "4 5 6 4 5": the suffix "4 5" recurs at 0; continuation "6 4 5" then wraps "6 4 ..."
    drafts, n, start = reference_lookup([4, 5, 6, 4, 5], max_ngram=3, min_ngram=1,
                                        num_tokens=5)
    assert (drafts, n, start) == ([6, 4, 5, 6, 4], 2, 2)
    assert reference_lookup([4, 5, 6, 4, 5], max_ngram=3, min_ngram=1, num_tokens=5,
                            wrap=False)[0] == [6, 4, 5, 5, 5]
    assert reference_lookup([1, 2, 3], max_ngram=2, min_ngram=1, num_tokens=2) == ([3, 3], 0, -1)
    # min_ngram: a 1-token match is not enough
    assert reference_lookup([8, 1, 2, 1], max_ngram=3, min_ngram=2, num_tokens=2)[1] == 0
    out = lookup_drafts(jnp.asarray([[4, 5, 6, 4, 5, 0, 0]]), jnp.asarray([5]), max_ngram=3,
                        min_ngram=1, num_tokens=5)
    assert np.asarray(out.drafts).tolist() == [[6, 4, 5, 6, 4]]


def test_option_errors():
    for kwargs, match in ((dict(min_ngram=0), "min must be >= 1"),
                          (dict(max_ngram=1, min_ngram=2), "must be >= ngram min"),
                          (dict(num_tokens=0), "tokens"),
                          (dict(occurrence="last"), "occurrence")):
        options = dict(max_ngram=3, min_ngram=1, num_tokens=4, occurrence="latest")
        options.update(kwargs)
        with pytest.raises(ValueError, match=match):
            NgramOptions(**options)
        with pytest.raises(ValueError, match=match):
            reference_lookup([1, 2], **options)
    with pytest.raises(ValueError, match="greedy"):
        DecodeConfig(method="ngram", draft_policy="sample")


# ------------------------------------------------------------------- in the decode loop

PI = permutation(32, seed=0)
RAGGED = [[3, 4, 5], [7, 1, 2, 9, 10, 6], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
          [0, 1, 30, 2, 8, 9, 25, 26, 5]]
MAX_NEW = 24


def _cycle_prompt(start: int, n: int) -> list[int]:
    out = [start]
    for _ in range(n - 1):
        out.append(int(PI[out[-1]]))
    return out


def _ngram(target, params, prompts, drafter, **kw):
    return generate(target, params, prompts, DecodeConfig(method="ngram", **kw),
                    drafter=drafter)


def test_forced_acceptance_on_a_cycle():
    """Target: next token = pi(current). Prompts that already contain a full cycle of pi:
    the lookup predicts every token, so every round commits K + 1 (tau = K + 1) and the
    output equals AR."""
    target, params = perm_target(PI, attn_scale=0.0, seed=1)
    prompts = [_cycle_prompt(3, 33), _cycle_prompt(9, 40)]
    ref = reference_greedy(target, params, prompts, MAX_NEW, width=80)
    drafter = NgramDrafter(options=NgramOptions(max_ngram=3, min_ngram=1, num_tokens=5))
    result = _ngram(target, params, prompts, drafter, max_new_tokens=MAX_NEW)
    assert result.tokens == ref
    # 24 tokens: the first from prefill, then 4 full rounds of 6 (the last overruns by 1)
    assert result.rounds.tolist() == [4, 4] and result.tau == 6.0


@pytest.mark.parametrize("occurrence", ["first", "latest"])
@pytest.mark.parametrize("attn_scale", [0.0, 0.3])
def test_greedy_equals_ar_ragged(attn_scale, occurrence):
    """Ragged prompts without a cycle in them: the lookup learns the target's loop from the
    generated tokens themselves (attn_scale 0) or only partly (0.3, context leaks in)."""
    target, params = perm_target(PI, attn_scale=attn_scale, seed=1)
    ref = reference_greedy(target, params, RAGGED, 40)
    drafter = NgramDrafter(options=NgramOptions(max_ngram=2, min_ngram=1, num_tokens=4,
                                                occurrence=occurrence))
    result = _ngram(target, params, RAGGED, drafter, max_new_tokens=40)
    assert result.tokens == ref
    assert result.accept_hist[:, 2:].sum() > 0               # drafts were accepted
    assert result.accept_hist.sum() == result.rounds.sum()


def test_context_buffer_and_stale_entries():
    """The loop's context buffer holds prompt + committed tokens by position; whatever lies
    past the root (stale drafts of rejected rounds) is never read: random garbage written
    there before every round leaves the output and acceptance unchanged. (The default
    lookup: the programs of test_heldout_evaluator_lookup_floor's direct decode.)"""
    target, params = perm_target(PI, attn_scale=0.3, seed=1)
    drafter = NgramDrafter()
    config = DecodeConfig(method="ngram", max_new_tokens=MAX_NEW, stop_token_ids=())
    expected = _ngram(target, params, RAGGED, drafter, max_new_tokens=MAX_NEW)
    prompt, prompt_len = speculative.pad_prompts(RAGGED)
    capacity = speculative.required_capacity(int(prompt_len.max()), config, drafter.num_drafts)
    key = jax.random.PRNGKey(0)
    prefill_fn, rounds_fn, _ = speculative._compiled(target, drafter, config, params, None,
                                                     prompt, prompt_len, key, capacity)
    state = prefill_fn(params, None, prompt, prompt_len, key)
    policy = loop.init_policy(config, drafter, loop.loop_arms(config, drafter)[1],
                              len(RAGGED))
    rng = np.random.default_rng(3)
    rounds = 0
    while not bool(jnp.all(state.done)):
        valid = np.arange(capacity)[None, :] <= np.asarray(state.target_cache.lengths)[:, None]
        garbage = rng.integers(0, 32, valid.shape).astype(np.int32)
        state = state.replace(history=jnp.where(valid, state.history, garbage))
        state, policy = rounds_fn(params, None, state, policy, jnp.int32(1))
        rounds += 1
    assert rounds > 2
    assert speculative._trim(state, config) == expected.tokens
    np.testing.assert_array_equal(np.asarray(state.accept_hist), expected.accept_hist)
    history, lengths = np.asarray(state.history), np.asarray(state.target_cache.lengths)
    for row, p, out, n in zip(history, RAGGED, np.asarray(state.out_tokens),
                              np.asarray(state.num_out)):
        assert row[:len(p)].tolist() == p
        assert row[len(p):len(p) + n].tolist() == out[:n].tolist()
    assert (lengths + 1 == np.array([len(p) for p in RAGGED]) + np.asarray(state.num_out)).all()


def test_stop_token_and_limit():
    target, params = perm_target(PI, attn_scale=0.0, seed=1)
    prompts = [_cycle_prompt(3, 33), _cycle_prompt(9, 40)]
    ref = reference_greedy(target, params, prompts, 7, width=80)
    stop = ref[0][4]                                         # mid-block in round 1
    drafter = NgramDrafter(options=NgramOptions(max_ngram=3, min_ngram=1, num_tokens=5))
    result = _ngram(target, params, prompts, drafter, max_new_tokens=7, stop_token_ids=(stop,))
    expected = [r[:r.index(stop) + 1] if stop in r else r for r in ref]
    assert result.tokens == expected and len(result.tokens[0]) == 5


# ------------------------------------------------------------- T > 0: joint distribution

V = 8
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]        # the lookup always has a continuation to propose
ROWS = 3000


@pytest.mark.parametrize("verify,sampling", [
    ("match", SamplingConfig(1.0)),
    ("rejection", SamplingConfig(1.0)),
    ("match", SamplingConfig(1.0, top_p=0.8)),
])
def test_joint_distribution_chi_square(verify, sampling):
    target, params = tiny_target(seed=21, vocab=V, lm_scale=2.5)
    drafter = NgramDrafter(options=NgramOptions(max_ngram=2, min_ngram=1, num_tokens=3))
    result = generate(target, params, [PROMPT] * ROWS,
                      DecodeConfig(method="ngram", max_new_tokens=3, sampling=sampling,
                                   verify=verify), drafter=drafter, seed=5)
    tokens = np.asarray(result.tokens)
    assert tokens.shape == (ROWS, 3)
    assert_first_three_follow_target(target, params, PROMPT, V, tokens, sampling)
    assert result.accept_hist[:, 2:].sum() > 0.05 * ROWS, "drafts were rarely accepted"


def test_heldout_evaluator_lookup_floor(monkeypatch):
    """The training curve's floor line: ``ngram`` in the held-out evaluator is the CLI's
    lookup, evaluated once (it does not depend on the drafter) and never the best-checkpoint
    metric."""
    from decode_helpers import draft_config
    from domino_jax.train import evaluate

    target, params = perm_target(PI, attn_scale=0.3, seed=1)
    cfg = draft_config(32, block=4, method="dflash")
    evaluator = evaluate.HeldoutEvaluator(target, params, cfg, {"a": RAGGED[:2],
                                                                "b": RAGGED[2:]},
                                          ("ngram",), max_new_tokens=MAX_NEW)
    taus = evaluator(None)["ngram"]
    direct = generate(target, params, RAGGED, DecodeConfig(method="ngram",
                                                           max_new_tokens=MAX_NEW),
                      drafter=NgramDrafter())
    assert abs(taus[evaluate.ALL] - direct.tau) < 1e-9 and taus[evaluate.ALL] > 1.2
    monkeypatch.setattr(speculative, "generate", lambda *a, **k: 1 / 0)   # never called again
    assert evaluator(None)["ngram"] == taus
    assert evaluate.parse_method("ngram") == ("ngram", {})
    with pytest.raises(ValueError, match="BUDGET"):
        evaluate.parse_method("ngram@4")
    fake = {"ngram": {evaluate.ALL: 9.0}, "ddtree@8": {evaluate.ALL: 2.0}}
    assert evaluate.best_metric(fake, cfg) == 2.0
