"""The prompt-lookup hybrids (issue 18): the lookup's continuation grafted into the DDTree /
DominoTree trees (``lookup_branch``) and the Domino chain + lookup block as a two-branch
tree (``dominolookup``). The grafted trees against a plain-Python reference (structure,
the branch only when the lookup matches, the budget), greedy identity with AR, the T > 0
joint distribution (CPU, float32, tiny models)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode_helpers import (chi_square_test, draft_config, exact_joint_probs, fixture_models,
                            perm_target, permutation, reference_greedy, tiny_draft,
                            tiny_target, zero_backbone_params)
from domino_jax.decode.methods import make_drafter, method_options
from domino_jax.decode.ngram import (NGRAM_DEFAULTS, chain_tree, graft_branch, graft_lookup,
                                     reference_lookup)
from domino_jax.decode.sampling import SamplingConfig
from domino_jax.decode.speculative import DecodeConfig, generate
from domino_jax.decode.tree import build_ddtree

jax.config.update("jax_default_matmul_precision", "highest")


def _drafter(cfg, target, method, **options):
    return make_drafter(cfg, target, method, method_options(method, **options))


@jax.jit
def _vmapped_chain_graft(tree, branches, found):
    return jax.vmap(lambda t, b, f: graft_branch(t, b, f, 2))(tree, branches, found)


# ``build_ddtree`` over a batch of rows, jitted (eager dispatch of its loop is slow)
_build_trees = jax.jit(lambda logits, budget: jax.vmap(lambda x: build_ddtree(x, budget))(
    logits), static_argnums=1)


# ------------------------------------------------------------------ the grafted trees


def _reference_graft(tokens, parents, depths, valid, branch, found, reserve):
    """Plain-Python graft (same contract as ``graft_branch``) over lists."""
    n = len(tokens)
    tokens, parents, depths, valid = (list(map(int, tokens)), list(map(int, parents)),
                                      list(map(int, depths)), list(map(bool, valid)))
    if not found:
        return tokens, parents, depths, valid
    attach, shared = -1, 0
    for tok in branch:
        kids = [i for i in range(n - reserve) if valid[i] and parents[i] == attach
                and tokens[i] == tok]
        if not kids:
            break
        attach, shared = kids[0], shared + 1
    for j in range(reserve):
        slot = n - reserve + j
        if j < len(branch) - shared:
            tokens[slot], valid[slot] = int(branch[shared + j]), True
            parents[slot] = attach if j == 0 else slot - 1
            depths[slot] = shared + j
        else:
            tokens[slot], parents[slot], depths[slot], valid[slot] = 0, -1, 0, False
    return tokens, parents, depths, valid


def _paths(tokens, parents, valid):
    """Set of root-to-node token paths of the valid nodes."""
    out = set()
    for i in range(len(tokens)):
        if not valid[i]:
            continue
        path, node = [], i
        while node >= 0:
            path.append(int(tokens[node]))
            node = int(parents[node])
        out.add(tuple(reversed(path)))
    return out


def test_graft_branch_equals_reference():
    rng = np.random.default_rng(4)
    budget, reserve, length, vocab = 12, 5, 4, 6
    graft = jax.jit(jax.vmap(lambda t, b, f: graft_branch(t, b, f, reserve)))
    logits = jnp.asarray(rng.normal(size=(16, 5, vocab)) * 2, jnp.float32)
    trees = _build_trees(logits, budget)
    branches = rng.integers(0, vocab, (16, length))
    for i in range(0, 16, 2):          # half the branches start along an existing path
        top = [int(t) for t, p, v in zip(trees.tokens[i], trees.parents[i], trees.valid[i])
               if v and p == -1][:1]
        branches[i, :len(top)] = top
    found = rng.random(16) < 0.8
    out = graft(trees, jnp.asarray(branches, jnp.int32), jnp.asarray(found))
    shared_seen = set()
    for i in range(16):
        want = _reference_graft(trees.tokens[i], trees.parents[i], trees.depths[i],
                                trees.valid[i], branches[i], found[i], reserve)
        have = [np.asarray(x[i]).tolist() for x in (out.tokens, out.parents, out.depths,
                                                    out.valid)]
        assert have == [list(w) for w in want], i
        paths = _paths(*(np.asarray(x[i]) for x in (out.tokens, out.parents, out.valid)))
        kept = _paths(trees.tokens[i][:budget - reserve], trees.parents[i][:budget - reserve],
                      trees.valid[i][:budget - reserve])
        assert kept <= paths                                  # the kept tree is intact
        if found[i]:
            assert tuple(branches[i]) in paths                # the whole branch is a path
            shared_seen.add(len(branches[i]) - int(np.asarray(out.valid[i][-reserve:]).sum()))
    assert 0 in shared_seen and max(shared_seen) >= 1


def _histories(rng, rows, width):
    """Context buffers ``[B, width]`` (stale garbage past each row's root) whose rows are
    periodic (the lookup matches), random over a small vocabulary (chance matches) or
    without any repeat (no match)."""
    contexts = []
    for i in range(rows):
        n = int(rng.integers(3, width - 2))
        if i % 3 == 0:
            base = rng.integers(0, 6, int(rng.integers(1, 5))).tolist()
            contexts.append([base[j % len(base)] for j in range(n)])
        elif i % 3 == 1:
            contexts.append(rng.integers(0, 4, n).tolist())
        else:
            contexts.append(list(range(20, 20 + n)))
    buffer = rng.integers(0, 6, (rows, width)).astype(np.int32)
    for i, c in enumerate(contexts):
        buffer[i, :len(c)] = c
    return contexts, buffer, np.array([len(c) - 1 for c in contexts], np.int32)


def _as_lists(tree, i):
    return [np.asarray(x[i]).tolist() for x in (tree.tokens, tree.parents, tree.depths,
                                                tree.valid)]


@pytest.mark.parametrize("branch", [1, 3, 5])
def test_graft_lookup_equals_reference(branch):
    """``graft_lookup`` = the plain-Python lookup + graft per row: the branch is appended
    only on rows whose lookup matches (the others keep their tree exactly), in the last
    ``G`` of the ``N`` nodes (the budget), as a root-to-leaf path; parents precede
    children and depths are the parents' + 1."""
    rng = np.random.default_rng(7)
    rows, budget, vocab = 18, 8, 6
    contexts, history, root = _histories(rng, rows, 24)
    logits = jnp.asarray(rng.normal(size=(rows, 4, vocab)) * 2, jnp.float32)
    trees = _build_trees(logits, budget)
    out = jax.jit(lambda t, h, r: graft_lookup(t, h, r, branch))(
        trees, jnp.asarray(history), jnp.asarray(root))
    matched = 0
    for i, context in enumerate(contexts):
        o = NGRAM_DEFAULTS
        drafts, n, _ = reference_lookup(context, max_ngram=o.max_ngram, min_ngram=o.min_ngram,
                                        num_tokens=branch, occurrence=o.occurrence, wrap=o.wrap)
        want = _reference_graft(trees.tokens[i], trees.parents[i], trees.depths[i],
                                trees.valid[i], drafts, n > 0, branch)
        have = _as_lists(out, i)
        assert have == [list(w) for w in want], i
        tokens, parents, depths, valid = have
        assert len(tokens) == budget                                   # the budget
        for j in range(budget):
            if valid[j]:
                assert parents[j] < j
                assert depths[j] == (0 if parents[j] < 0 else depths[parents[j]] + 1)
        if n > 0:
            matched += 1
            assert tuple(drafts) in _paths(tokens, parents, valid)
        else:
            assert have == _as_lists(trees, i)                         # no match: unchanged
    assert 0 < matched < rows


def test_chain_tree_two_branches():
    """``dominolookup``'s tree: the chain (node i under node i-1) and the lookup's block
    as a second branch sharing the chain's prefix where they agree; no match: the chain
    and ``G`` invalid slots."""
    chain = jnp.asarray([[5, 6, 7], [5, 6, 7], [5, 6, 7]], jnp.int32)
    tree = chain_tree(chain, 2)
    assert _as_lists(tree, 0) == [[5, 6, 7, 0, 0], [-1, 0, 1, -1, -1], [0, 1, 2, 0, 0],
                                  [True, True, True, False, False]]
    branches = jnp.asarray([[5, 9], [8, 9], [5, 6]], jnp.int32)
    out = _vmapped_chain_graft(tree, branches, jnp.asarray([True, True, False]))
    assert _as_lists(out, 0) == [[5, 6, 7, 9, 0], [-1, 0, 1, 0, -1], [0, 1, 2, 1, 0],
                                 [True, True, True, True, False]]    # shares "5"
    assert _as_lists(out, 1) == [[5, 6, 7, 8, 9], [-1, 0, 1, -1, 3], [0, 1, 2, 0, 1],
                                 [True] * 5]                          # a second root child
    assert _as_lists(out, 2) == _as_lists(tree, 2)                    # no match


# ---------------------------------------------------------------------- in the decode loop


@pytest.mark.parametrize("method,options", [
    ("ddtree", dict(budget=12, lookup_branch=5)),
    ("dominotree", dict(budget=12, lookup_branch=5, node_topk=4, topm=16)),
    ("dominolookup", dict(lookup_branch=6)),
])
def test_hybrids_greedy_equal_ar(method, options):
    target, params, cfg, dparams, outputs = fixture_models("domino_shift")
    prompt = outputs["prompt"][0].tolist()
    prompts = [prompt + prompt[:6], [5, 6, 7, 5, 6], list(range(20, 29))]
    ref = reference_greedy(target, params, prompts, 24)
    drafter = _drafter(cfg, target, method, **options)
    result = generate(target, params, prompts, DecodeConfig(method=method, max_new_tokens=24),
                      drafter=drafter, draft_params=dparams)
    assert result.tokens == ref
    k, g = cfg.k_draft, options["lookup_branch"]
    width = options.get("budget", k + g) + 1
    assert result.verify_width == width and drafter.max_commit == min(width - 1, max(k, g)) + 1
    assert drafter.reads_history


PI = permutation(32, seed=0)


def _cycle_prompt(start: int, n: int) -> list[int]:
    out = [start]
    for _ in range(n - 1):
        out.append(int(PI[out[-1]]))
    return out


def test_lookup_branch_carries_the_tree():
    """A flat drafter (DDTree's nodes are guesses) and a target that cycles through pi,
    prompts holding the cycle: without the branch almost nothing is accepted; with a
    4-token branch every round accepts it whole (tau 5: deeper than the drafter's K = 3)."""
    target, params = perm_target(PI, attn_scale=0.0, seed=1)
    cfg = draft_config(32, block=4, method="dflash")
    dparams = zero_backbone_params(cfg)
    prompts = [_cycle_prompt(3, 33), _cycle_prompt(9, 40)]
    ref = reference_greedy(target, params, prompts, 21, width=80)
    taus = {}
    for branch in (0, 4):
        drafter = _drafter(cfg, target, "ddtree", budget=8, lookup_branch=branch)
        assert drafter.reads_history == (branch > 0)
        result = generate(target, params, prompts, DecodeConfig(method="ddtree",
                                                                max_new_tokens=21),
                          drafter=drafter, draft_params=dparams)
        assert result.tokens == ref, branch
        taus[branch] = result.tau
    assert taus[4] == 5.0 and taus[0] < 1.5, taus


def test_option_errors():
    cfg = draft_config(32, block=4, method="domino")
    with pytest.raises(ValueError, match="lookup branch"):
        method_options("ddtree", budget=4, lookup_branch=5)
    with pytest.raises(ValueError, match="lookup branch"):
        method_options("dominolookup", lookup_branch=0)
    with pytest.raises(ValueError, match="no option lookup_branch"):
        method_options("domino", lookup_branch=4)
    with pytest.raises(ValueError, match="match"):
        DecodeConfig(method="dominolookup", verify="rejection")
    from domino_jax.decode.__main__ import _adaptive_widths, _given_options, build_parser
    from domino_jax.decode.methods import drafter_class

    args = build_parser().parse_args(["--method", "domino", "--lookup-branch", "4"])
    with pytest.raises(ValueError, match="--lookup-branch is not an option"):
        _given_options(args, drafter_class("domino").Options)
    for argv, want, auto, budget in ((["--method", "ddtree"], 0, True, 16),
                                     (["--method", "ddtree", "--lookup-branch", "4"], 4, False, 16),
                                     (["--method", "ddtree", "--budget", "8"], 0, False, 8),
                                     (["--method", "dominolookup"], 4, False, None)):
        args = build_parser().parse_args(argv)
        before = vars(args).copy()
        cls = drafter_class(argv[1])
        options = method_options(argv[1], **_given_options(args, cls.Options))
        assert _adaptive_widths(args, cls, options) == auto, argv   # not the hybrids
        assert options.lookup_branch == want
        assert vars(args) == before, argv              # the parsed arguments stay as parsed
        if budget is not None:                          # auto: the widest fixed budget
            assert options.fixed_budget == budget and options.fixed_draft_length == 0
    for argv, length, auto in ((["--method", "domino"], "auto", True),
                               (["--method", "domino", "--draft-length", "4"], 4, False)):
        args = build_parser().parse_args(argv)
        options = method_options("domino", **_given_options(args, drafter_class("domino").Options))
        assert options.draft_length == length and _adaptive_widths(args, drafter_class("domino"),
                                                                   options) == auto
        assert options.fixed_draft_length == (0 if auto else 4)
    with pytest.raises(ValueError, match="draft length"):
        method_options("domino", draft_length="wide")
    with pytest.raises(ValueError, match="tree budget"):
        method_options("ddtree", budget="wide")
    del cfg


# ------------------------------------------------------------- T > 0: joint distribution

V = 8
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]        # the lookup always has a continuation to propose
ROWS = 3000


@pytest.mark.parametrize("method,options", [
    ("ddtree", dict(budget=6, lookup_branch=3)),
    ("dominolookup", dict(lookup_branch=3)),
])
def test_hybrid_joint_distribution(method, options):
    target, params = tiny_target(seed=21, vocab=V, lm_scale=2.5)
    cfg = draft_config(V, block=4, method="domino" if method == "dominolookup" else "dflash")
    sampling = SamplingConfig(1.0)
    result = generate(target, params, [PROMPT] * ROWS,
                      DecodeConfig(method=method, max_new_tokens=3, sampling=sampling),
                      drafter=_drafter(cfg, target, method, **options),
                      draft_params=tiny_draft(cfg, seed=12), seed=9)
    counts = np.zeros((V, V, V))
    np.add.at(counts, tuple(np.asarray(result.tokens).T), 1)
    probs = exact_joint_probs(target, params, PROMPT, V, sampling)
    stat, df, threshold = chi_square_test(counts, probs, min_expected=20.0)
    assert df >= 5 and stat < threshold, f"chi2 {stat:.1f} >= {threshold:.1f} (df {df})"
    assert result.accept_hist[:, 2:].sum() > 0.05 * ROWS, "drafts were rarely accepted"
