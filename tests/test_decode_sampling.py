"""Sampled decoding is lossless: committed tokens follow the processed target distribution.

* ``verify_match`` / ``verify_rejection`` on synthetic ``p``, ``q`` (200k draws): the first
  committed token is distributed as ``p`` within binomial bounds; acceptance rates are
  ``sum p q`` (match) and ``1 - TV(p, q)`` (rejection).
* End to end: one ``generate`` call over thousands of identical prompt rows (per-row
  randomness), ``max_new_tokens=3``; the joint frequency of ``(t1, t2, t3)`` is compared
  with the exact target probabilities (enumerated with a cache-free forward and
  ``target_log_probs``) by a Pearson chi-square test at the 0.999 quantile, for ar,
  dflash/domino + match, dflash/domino + rejection with sampled drafts, domino + rejection
  with greedy drafts, at T = 1 and with top-p / top-k.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode_helpers import (chi_square_test, draft_config, exact_joint_probs, tiny_draft,
                            tiny_target)
from domino_jax.decode.drafters import DominoOptions
from domino_jax.decode.methods import make_drafter
from domino_jax.decode.sampling import SamplingConfig
from domino_jax.decode.speculative import DecodeConfig, generate
from domino_jax.decode.verify import verify_match, verify_rejection

jax.config.update("jax_default_matmul_precision", "highest")

# ------------------------------------------------------------------ verify rules, synthetic

P = np.array([0.45, 0.25, 0.15, 0.1, 0.05])
Q = np.array([0.1, 0.2, 0.2, 0.3, 0.2])
P2 = np.array([0.05, 0.05, 0.3, 0.3, 0.3])
N = 200_000


def _within(freq, prob, n, sigmas=5.0):
    bound = sigmas * np.sqrt(prob * (1 - prob) / n) + 1e-9
    assert np.all(np.abs(freq - prob) <= bound), (freq, prob, bound)


def _inputs(q, seed):
    key = jax.random.PRNGKey(seed)
    draft_key, verify_key = jax.random.split(key)
    drafts = jax.random.categorical(draft_key, jnp.log(jnp.asarray(q, jnp.float32)),
                                    shape=(N, 1)).astype(jnp.int32)
    log_p = jnp.log(jnp.broadcast_to(jnp.asarray(np.stack([P, P2]), jnp.float32), (N, 2, 5)))
    log_q = jnp.log(jnp.broadcast_to(jnp.asarray(q, jnp.float32), (N, 1, 5)))
    return verify_key, drafts, log_p, log_q


def _check_committed(drafts, accepted, bonus, accept_rate):
    drafts, accepted, bonus = map(np.asarray, (drafts, accepted, bonus))
    first = np.where(accepted >= 1, drafts[:, 0], bonus)
    _within(np.bincount(first, minlength=5) / N, P, N)
    rate = accepted.mean()
    assert abs(rate - accept_rate) <= 5 * np.sqrt(accept_rate * (1 - accept_rate) / N) + 1e-9
    after = bonus[accepted == 1]                  # bonus after an accepted draft ~ P2
    _within(np.bincount(after, minlength=5) / len(after), P2, len(after))


@pytest.mark.parametrize("rule", ["match", "rejection"])
def test_verify_rules_synthetic(rule):
    key, drafts, log_p, log_q = _inputs(Q, seed=1)
    if rule == "match":
        accepted, bonus = verify_match(key, drafts, log_p)
        rate = float((P * Q).sum())
    else:
        accepted, bonus = verify_rejection(key, drafts, log_p, log_q)
        rate = 1.0 - 0.5 * float(np.abs(P - Q).sum())
    _check_committed(drafts, accepted, bonus, rate)


def test_verify_rejection_greedy_and_equal_drafts():
    # one-hot q (a greedy draft of token 3): accepted with probability p(3)
    q = np.eye(5)[3]
    key, drafts, log_p, log_q = _inputs(q, seed=2)
    accepted, bonus = verify_rejection(key, drafts, log_p, log_q)
    _check_committed(drafts, accepted, bonus, P[3])
    # q == p: always accepted (residual has no mass), bonus from the next position
    key, drafts, log_p, log_q = _inputs(P, seed=3)
    accepted, bonus = verify_rejection(key, drafts, log_p, log_q)
    assert np.asarray(accepted).min() == 1
    _check_committed(drafts, accepted, bonus, 1.0)
    # a draft the target forbids (p = 0) is never accepted
    p0 = jnp.log(jnp.asarray(np.stack([[0.5, 0.5, 0, 0, 0], P2]), jnp.float32))[None]
    acc, bon = verify_rejection(key, jnp.full((1, 1), 3, jnp.int32), p0,
                                jnp.log(jnp.asarray(Q, jnp.float32))[None, None])
    assert int(acc[0]) == 0 and int(bon[0]) in (0, 1)


# ----------------------------------------------------------------- end to end, chi-square

V = 8
PROMPT = [1, 2, 3, 4]
ROWS = 3000


@pytest.fixture(scope="module")
def models():
    target, params = tiny_target(seed=11, vocab=V, lm_scale=2.5)
    dflash_cfg = draft_config(V, block=4, method="dflash")                      # K = 3
    domino_cfg = draft_config(V, block=4, shift=True, prefix=1)                  # K = 4
    return dict(target=target, params=params,
                dflash=(dflash_cfg, tiny_draft(dflash_cfg, seed=12)),
                domino=(domino_cfg, tiny_draft(domino_cfg, seed=14, head_scale=3.0)))


def exact_probs(target, params, sampling):
    """``[V, V, V]`` probability of (t1, t2, t3) after PROMPT under ``sampling``."""
    return exact_joint_probs(target, params, PROMPT, V, sampling)


CASES = [  # (name, method, verify, draft_policy, sampling)
    ("ar", "ar", "match", "greedy", SamplingConfig(1.0)),
    ("dflash_match_sampled", "dflash", "match", "sample", SamplingConfig(1.0)),
    ("domino_match", "domino", "match", "greedy", SamplingConfig(1.0)),
    ("dflash_rejection_sampled", "dflash", "rejection", "sample", SamplingConfig(1.0)),
    ("domino_rejection_sampled", "domino", "rejection", "sample", SamplingConfig(1.0)),
    ("domino_rejection_greedy", "domino", "rejection", "greedy", SamplingConfig(1.0)),
    ("domino_rejection_sampled_top_p", "domino", "rejection", "sample", SamplingConfig(1.0, top_p=0.8)),
    ("dflash_match_top_p", "dflash", "match", "greedy", SamplingConfig(1.0, top_p=0.8)),
    ("domino_match_top_k", "domino", "match", "sample", SamplingConfig(0.9, top_k=3)),
    ("dflash_rejection_sampled_top_k", "dflash", "rejection", "sample", SamplingConfig(1.0, top_k=3)),
    ("domino_rejection_sampled_pool", "domino", "rejection", "sample", SamplingConfig(1.0)),
]
HEAD_TOPM = {"domino_rejection_sampled_pool": 3}   # Domino candidate pool (q is -inf outside)
_RESULTS: dict = {}


def run_case(models, name):
    if name not in _RESULTS:
        _, method, verify, policy, sampling = next(c for c in CASES if c[0] == name)
        drafter, dparams = None, None
        if method != "ar":
            cfg, dparams = models[method]
            options = DominoOptions(head_topm=HEAD_TOPM.get(name, 0)) if method == "domino" else None
            drafter = make_drafter(cfg, models["target"], method, options)
        config = DecodeConfig(method=method, max_new_tokens=3, sampling=sampling,
                              draft_policy=policy, verify=verify)
        _RESULTS[name] = generate(models["target"], models["params"], [PROMPT] * ROWS, config,
                                  drafter=drafter, draft_params=dparams,
                                  seed=zlib.crc32(name.encode()) % 1000)
    return _RESULTS[name]


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_joint_distribution_chi_square(models, name):
    sampling = next(c for c in CASES if c[0] == name)[4]
    result = run_case(models, name)
    tokens = np.asarray(result.tokens)
    assert tokens.shape == (ROWS, 3)
    assert len({tuple(t) for t in tokens}) > 5, "rows share their random draws"
    counts = np.zeros((V, V, V))
    np.add.at(counts, tuple(tokens.T), 1)
    probs = exact_probs(models["target"], models["params"], sampling)
    stat, df, threshold = chi_square_test(counts, probs, min_expected=20.0)
    assert df >= 5
    assert stat < threshold, f"{name}: chi2 {stat:.1f} >= {threshold:.1f} (df {df})"
    if result.verify_width > 1:
        assert result.accept_hist[:, 2:].sum() > 0, "no draft was ever accepted"


def test_rejection_accepts_at_least_as_often_as_match(models):
    match = run_case(models, "dflash_match_sampled")
    rejection = run_case(models, "dflash_rejection_sampled")
    assert rejection.tau >= match.tau - 0.02, (rejection.tau, match.tau)
    assert match.tau > 1.05                     # drafts do get accepted
