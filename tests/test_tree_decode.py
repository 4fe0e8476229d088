"""Tree methods end to end (DDTree, DominoTree): lossless greedy and sampled decoding,
forced acceptance through the tree, budget 1 as a one-token chain, and the KV gather.

CPU, float32 (decode_helpers sets matmul precision "highest").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_helpers import (chi_square_test, draft_config, exact_joint_probs, fixture_models,
                            perm_domino_params, perm_target, permutation, reference_greedy,
                            tiny_draft, tiny_target)

from domino_jax.decode import loop
from domino_jax.decode import speculative
from domino_jax.decode.methods import make_drafter, method_options
from domino_jax.decode.sampling import SamplingConfig
from domino_jax.decode.speculative import DecodeConfig, generate
from domino_jax.decode.tree_drafters import DominoTreeOptions, TreeOptions
from domino_jax.decode.verify import walk_tree
from domino_jax.models.qwen3 import new_cache

RAGGED = [[3, 4, 5], [7, 1, 2, 9, 10, 6], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]
PI = permutation(32, seed=0)
MAX_NEW = 16


def tree_drafter(cfg, target, method, budget, node_topk=4, topm=16):
    options = (TreeOptions(budget=budget) if method == "ddtree"
               else DominoTreeOptions(budget=budget, node_topk=node_topk, topm=topm))
    return make_drafter(cfg, target, method, options)


def run_tree(target, params, prompts, method, cfg, dparams, budget=8, topm=16, **kw):
    drafter = tree_drafter(cfg, target, method, budget, topm=topm)
    return generate(target, params, prompts, DecodeConfig(method=method, **kw),
                    drafter=drafter, draft_params=dparams)


@pytest.mark.parametrize("name", ["domino_shift", "dflash"])
def test_fixture_trees_greedy_equal_ar(name):
    target, params, cfg, dparams, outputs = fixture_models(name)
    prompts = [outputs["prompt"][0].tolist(), [5, 6, 7], list(range(20, 29))]
    ref = reference_greedy(target, params, prompts, 24)
    assert ref[0] == outputs["reference_spec_greedy_ids"][0, 11:].tolist()
    methods = ["ddtree", "dominotree"] if cfg.has_domino_head else ["ddtree"]
    for method in methods:
        result = run_tree(target, params, prompts, method, cfg, dparams, budget=12,
                          max_new_tokens=24)
        assert result.tokens == ref, method
        assert result.verify_width == 13


@pytest.mark.parametrize("method", ["dominotree", "ddtree"])
def test_forced_acceptance_through_the_tree(method):
    """Permutation target + a Domino head that drafts pi(last): DominoTree follows the path
    (tau = K + 1). The base logits are flat, so the top-M pool would not contain pi(last):
    use the full-vocabulary correction (topm=0). DDTree sees only the flat base logits, so it
    accepts little; both stay lossless, and with context leaking in (partial acceptance)."""
    cfg = draft_config(32, block=4, shift=True, prefix=0, gru=32, emb=32)
    k = cfg.k_draft
    dparams = perm_domino_params(cfg, PI)
    target, params = perm_target(PI, attn_scale=0.0, seed=1)
    ref = reference_greedy(target, params, RAGGED, MAX_NEW)
    result = run_tree(target, params, RAGGED, method, cfg, dparams, budget=8, topm=0,
                      max_new_tokens=MAX_NEW)
    assert result.tokens == ref
    if method == "dominotree":
        full_rounds = (MAX_NEW - 1) // (k + 1)
        assert (result.accept_hist[:, k + 1] == full_rounds).all(), result.accept_hist
        assert result.tau == k + 1
    target, params = perm_target(PI, attn_scale=0.3, seed=1)
    ref = reference_greedy(target, params, RAGGED, MAX_NEW)
    result = run_tree(target, params, RAGGED, method, cfg, dparams, budget=8, topm=0,
                      max_new_tokens=MAX_NEW)
    assert result.tokens == ref
    if method == "dominotree":
        assert result.tau > 1.5


def test_budget_one_is_a_one_token_chain():
    """Budget 1: the tree is the best first-depth token; at most 2 tokens per round."""
    cfg = draft_config(32, block=4, shift=True, prefix=0, gru=32, emb=32)
    dparams = perm_domino_params(cfg, PI)
    target, params = perm_target(PI, attn_scale=0.0, seed=1)
    ref = reference_greedy(target, params, RAGGED, MAX_NEW)
    for method in ("ddtree", "dominotree"):
        result = run_tree(target, params, RAGGED, method, cfg, dparams, budget=1, topm=0,
                          max_new_tokens=MAX_NEW)
        assert result.tokens == ref
        assert result.verify_width == 2 and result.accept_hist.shape[1] == 3
    # DominoTree's single node is pi(root): accepted every round (2 tokens per round)
    assert result.accept_hist[:, :2].sum() == 0 and result.tau == 2.0


def test_walk_follows_matching_children():
    # tree: node0 (a=5, root child), node1 (b=6, root child), node2 (c=7, child of node1)
    tokens = jnp.array([5, 6, 7], jnp.int32)
    parents = jnp.array([-1, -1, 1], jnp.int32)
    valid = jnp.array([True, True, True])
    samples = jnp.array([6, 9, 7, 3], jnp.int32)       # root->6 (node1), node1->7 (node2)
    path, accepted, last = walk_tree(tokens, parents, valid, samples, 3)
    assert int(accepted) == 2 and int(last) == 3
    assert np.asarray(path).tolist() == [0, 2, 3, 0]
    samples = jnp.array([4, 9, 7, 3], jnp.int32)       # root->4: nothing accepted
    path, accepted, last = walk_tree(tokens, parents, valid, samples, 3)
    assert int(accepted) == 0 and int(last) == 0


def test_tree_commit_cache_equals_sequential_decoding():
    """After several tree rounds (with acceptance), the target cache up to each row's
    length equals the cache of a plain forward over the committed tokens. (The compiled
    programs of test_forced_acceptance_through_the_tree[dominotree]: same models, config and
    shapes.)"""
    from conftest import forward

    cfg = draft_config(32, block=4, shift=True, prefix=0, gru=32, emb=32)
    dparams = perm_domino_params(cfg, PI)
    target, params = perm_target(PI, attn_scale=0.3, seed=1)
    drafter = tree_drafter(cfg, target, "dominotree", 8, topm=0)
    config = DecodeConfig(method="dominotree", max_new_tokens=MAX_NEW)
    prep = speculative._prepare(target, params, RAGGED, config, drafter, dparams, seed=0)
    capacity = prep.capacity
    state = prep.prefill_fn(params, dparams, prep.prompt, prep.prompt_len, prep.key)
    policy = loop.init_policy(config, prep.drafter, prep.widths, len(RAGGED))
    state, _ = prep.rounds_fn(params, dparams, state, policy, jnp.int32(3))
    assert int(np.asarray(state.accept_hist)[:, 3:].sum()) > 0     # multi-token rounds
    lengths = np.asarray(state.target_cache.lengths)
    out = np.asarray(state.out_tokens)
    # one plain forward over every row's committed tokens (causal: what follows a row's
    # committed tokens changes nothing before it)
    seqs = np.zeros((len(RAGGED), capacity), np.int32)
    for b, p in enumerate(RAGGED):
        n = int(lengths[b])
        seqs[b, :n] = (list(p) + out[b].tolist())[:n]      # committed tokens in the cache
    fresh = new_cache(target.config, len(RAGGED), capacity, target.dtype)
    ref = forward(target, params, seqs, np.tile(np.arange(capacity), (len(RAGGED), 1)),
                  cache=fresh)
    for b in range(len(RAGGED)):
        n = int(lengths[b])
        np.testing.assert_allclose(np.asarray(state.target_cache.keys[:, b, :n]),
                                   np.asarray(ref.cache.keys[:, b, :n]), atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(state.target_cache.values[:, b, :n]),
                                   np.asarray(ref.cache.values[:, b, :n]), atol=2e-5, rtol=1e-5)


V = 8
PROMPT = [1, 2, 3, 4]
ROWS = 3000


def exact_probs(target, params, sampling):
    """``[V, V, V]`` probability of (t1, t2, t3) after PROMPT under ``sampling``."""
    return exact_joint_probs(target, params, PROMPT, V, sampling)


@functools.cache
def _sampling_case():
    """The models, sampling and exact joint probabilities both tree methods are checked
    against (made once)."""
    target, params = tiny_target(seed=11, vocab=V, lm_scale=2.5)
    sampling = SamplingConfig(1.0, top_p=0.9)
    return target, params, sampling, exact_probs(target, params, sampling)


@pytest.mark.parametrize("method", ["dominotree", "ddtree"])
def test_tree_sampling_follows_the_target(method):
    target, params, sampling, probs = _sampling_case()
    cfg = draft_config(V, block=4, shift=True, prefix=1)
    dparams = tiny_draft(cfg, seed=14, head_scale=3.0)
    drafter = tree_drafter(cfg, target, method, 6, node_topk=3, topm=4)
    result = generate(target, params, [PROMPT] * ROWS,
                      DecodeConfig(method=method, max_new_tokens=3, sampling=sampling),
                      drafter=drafter, draft_params=dparams, seed=7)
    tokens = np.asarray(result.tokens)
    assert tokens.shape == (ROWS, 3)
    counts = np.zeros((V, V, V))
    np.add.at(counts, tuple(tokens.T), 1)
    stat, df, threshold = chi_square_test(counts, probs, min_expected=20.0)
    assert df >= 5 and stat < threshold, (stat, threshold, df)
    assert result.accept_hist[:, 2:].sum() > 0, "no tree node was ever accepted"


def test_tree_options_are_checked():
    target, params = tiny_target(seed=1, vocab=V)
    dflash_cfg = draft_config(V, method="dflash")
    with pytest.raises(ValueError, match="'dominotree' needs a Domino checkpoint"):
        make_drafter(dflash_cfg, target, "dominotree")
    with pytest.raises(ValueError, match="budget"):
        TreeOptions(budget=0)
    with pytest.raises(ValueError, match="node_topk"):
        DominoTreeOptions(node_topk=0)
    with pytest.raises(ValueError, match="'ddtree' has no option node_topk"):
        method_options("ddtree", node_topk=4)
    with pytest.raises(ValueError, match="match"):
        DecodeConfig(method="ddtree", verify="rejection")
