"""On-device draft-tree builders vs the references: the library's depth-synchronous builder
(domino_jax/decode/tree.py) and the readable heap builders (tests/heap_tree_builders.py)
must give the references' trees.

* Golden fixtures (tests/fixtures/reference): DominoTree top-16 / full-vocab / marginal trees
  for ``domino_shift`` and ``domino_noshift``, DDTree tree + visibility for ``dflash``.
* Random tie-free inputs: the jitted builders equal readable host builders written from the
  pseudo-code of docs/algorithms.md §4.2 (DDTree) and §5.3-5.4 (DominoTree): Python ``heapq``,
  float64 score sums of float32 log-probs, the references' heap keys and tie-breaks.
* Budget 1, exhausted candidate pools, jit + vmap over a batch.
"""

from __future__ import annotations

import heapq
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from converters.hf_draft import load_draft
from converters.hf_target import load_target
from domino_jax.config import DraftConfig
from domino_jax.decode.tree import (DraftTree, build_ddtree, build_dominotree,
                                    tree_attention_mask, tree_positions)
from domino_jax.models.domino_head import correction, decode_head, root_gru_state
from heap_tree_builders import heap_ddtree, heap_dominotree

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "reference")
SCORE_TOL = 1e-5


# ----------------------------------------------------------------------------------------
# Host references (plain Python / numpy float32 kernels, float64 heap scores)


def _log_softmax32(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    top = x.max(-1, keepdims=True)
    return (x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))).astype(np.float32)


def _topk(x: np.ndarray, k: int):
    order = np.argsort(-x, kind="stable")[:k]
    return x[order], order


def host_ddtree(logits: np.ndarray, budget: int):
    """docs/algorithms.md §4.2 verbatim (1-based depths, root index 0). Returns nodes
    (token, depth0, parent, logw) with 0-based depth / -1 root parent, and the smallest gap
    between a popped score and the best score left in the heap (to reject near-tie
    inputs)."""
    k_depth, vocab = logits.shape
    topk = min(budget, vocab)
    logp = _log_softmax32(logits)
    lp = np.zeros((k_depth, topk), np.float32)
    tok = np.zeros((k_depth, topk), np.int64)
    for d in range(k_depth):
        lp[d], tok[d] = _topk(logp[d], topk)
    heap = [(-float(lp[0, 0]), (0,), 0, 1, 0, float(lp[0, 0]))]
    nodes, gap = [], np.inf
    while heap and len(nodes) < budget:
        _, ranks, parent, depth, rank, logw = heapq.heappop(heap)
        if heap:
            gap = min(gap, logw - (-heap[0][0]))
        nodes.append((int(tok[depth - 1, rank]), depth - 1, parent - 1, logw))
        index = len(nodes)
        if rank + 1 < topk:
            w = logw - float(lp[depth - 1, rank]) + float(lp[depth - 1, rank + 1])
            heapq.heappush(heap, (-w, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, w))
        if depth < k_depth:
            w = logw + float(lp[depth, 0])
            heapq.heappush(heap, (-w, ranks + (0,), index, depth + 1, 0, w))
    return nodes, gap


def _sigmoid(x):
    return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)


def _host_gru(head, x, h):
    w_ih = np.asarray(head["prefix_gru"]["weight_ih"], np.float32)
    w_hh = np.asarray(head["prefix_gru"]["weight_hh"], np.float32)
    gi, gh = x @ w_ih, h @ w_hh
    g = h.shape[-1]
    r = _sigmoid(gi[:g] + gh[:g])
    z = _sigmoid(gi[g:2 * g] + gh[g:2 * g])
    n = np.tanh(gi[2 * g:] + r * gh[2 * g:])
    return ((1 - z) * n + z * h).astype(np.float32)


def host_dominotree(head, prefix_len, hid, base, root_state, embed, budget, node_topk, topm,
                    marginal=False):
    """docs/algorithms.md §5.3 children_fn + §5.4 build_best_first_tree verbatim (numpy
    float32 kernels, float64 heap scores, eager child states). Returns nodes (token, depth,
    parent, cum) and the smallest popped-vs-rest score gap."""
    hid, base, embed = (np.asarray(a, np.float32) for a in (hid, base, embed))
    k_depth, vocab = base.shape
    h = hid.shape[-1]
    w1 = np.asarray(head["embed_proj_0"]["kernel"], np.float32)
    w2 = np.asarray(head["embed_proj_2"]["kernel"], np.float32).T           # [V, E]
    m = min(topm, vocab)
    cand = [np.argsort(-base[d], kind="stable")[:m] for d in range(k_depth)]

    def children_fn(state, d):
        if d >= k_depth:
            return []
        if marginal or d < prefix_len:
            lp, tok = _topk(_log_softmax32(base[d]), node_topk)
        else:
            pre = hid[d] @ w1[:h] + state @ w1[h:]
            u = (pre / (1 + np.exp(-pre))).astype(np.float32)
            if m > 0:
                c = base[d][cand[d]] + w2[cand[d]] @ u
                lp, j = _topk(_log_softmax32(c), node_topk)
                tok = cand[d][j]
            else:
                lp, tok = _topk(_log_softmax32(base[d] + w2 @ u), node_topk)
        return [(int(t), float(l), _host_gru(head, embed[t], state)) for t, l in zip(tok, lp)]

    heap, nodes, tie, gap = [], [], 0, np.inf
    for t, l, s in children_fn(np.asarray(root_state, np.float32), 0):
        heapq.heappush(heap, (-l, tie, t, 0, -1, s))
        tie += 1
    while heap and len(nodes) < budget:
        negc, _, t, d, par, s = heapq.heappop(heap)
        if heap:
            gap = min(gap, heap[0][0] - negc)
        idx = len(nodes)
        nodes.append((t, d, par, -negc))
        if d + 1 < k_depth:
            for ct, cl, cs in children_fn(s, d + 1):
                heapq.heappush(heap, (negc - cl, tie, ct, d + 1, idx, cs))
                tie += 1
    return nodes, gap


def host_visibility(parents, n_valid, budget):
    vis = np.eye(budget + 1, dtype=bool)
    for i in range(n_valid):
        vis[i + 1] |= vis[parents[i] + 1]
    return vis


def assert_tree_equals(tree: DraftTree, nodes, budget):
    n = len(nodes)
    tokens, depths, parents = (np.asarray(a) for a in (tree.tokens, tree.depths, tree.parents))
    valid, scores = np.asarray(tree.valid), np.asarray(tree.scores)
    assert valid.tolist() == [True] * n + [False] * (budget - n)
    assert tokens[:n].tolist() == [x[0] for x in nodes]
    assert depths[:n].tolist() == [x[1] for x in nodes]
    assert parents[:n].tolist() == [x[2] for x in nodes]
    np.testing.assert_allclose(scores[:n], [x[3] for x in nodes], rtol=0, atol=SCORE_TOL)
    assert np.all(scores[n:] == -np.inf) and np.all(parents[n:] == -1)
    mask = np.asarray(tree_attention_mask(tree))
    assert np.array_equal(mask, host_visibility(parents, n, budget))


# ----------------------------------------------------------------------------------------
# Golden fixtures


def _fixture(name):
    return np.load(os.path.join(FIXTURES, name, "outputs.npz"))


# (ddtree builder, dominotree builder): the library's and the heap reference; every test
# below runs on both (the random-input tests run the reference on a few seeds only)
BUILDERS = {"heap": (heap_ddtree, heap_dominotree),
            "library": (build_ddtree, build_dominotree)}
_JITTED = {name: (jax.jit(dd, static_argnums=1), jax.jit(dom, static_argnums=(1, 6, 7, 8, 9)))
           for name, (dd, dom) in BUILDERS.items()}


def _with_decode_head(build):
    """``build`` on the head in its decode layout (``[W_hh | W1_s]`` and the GRU input table,
    what ``load_pair`` gives): the library builder then carries each lane's state product."""
    def wrapped(head, config, hid, base, root_state, embed, *args):
        return build(decode_head(head, embed), config, hid, base, root_state, embed, *args)
    return wrapped


for _name, (_, _dom) in BUILDERS.items():
    _JITTED[f"{_name}_decode_head"] = (None, jax.jit(_with_decode_head(_dom),
                                                      static_argnums=(1, 6, 7, 8, 9)))
DOMINOTREE_BUILDERS = list(_JITTED)          # both builders, both head layouts
# random inputs: every seed on the library builder, the first few on the heap reference;
# the library builder on the decode head layout: seeds 0-11, every combination of the
# seed-driven options (node_topk, topm kind, prefix_len, marginal repeat with period 12)
RANDOM_CASES = [(b, s) for b in BUILDERS for s in range(24) if b != "heap" or s < 6]
DOMINOTREE_RANDOM_CASES = [(b, s) for b in DOMINOTREE_BUILDERS for s in range(24)
                           if (s < 6 if b.startswith("heap") else
                               s < 12 if b.endswith("decode_head") else True)]


@pytest.mark.parametrize("builder", BUILDERS)
def test_ddtree_fixture(builder):
    z = _fixture("dflash")
    budget = int(z["tree_budget"])
    tree = _JITTED[builder][0](jnp.asarray(z["base_logits"][0, 1:]), budget)
    assert np.asarray(tree.valid).all()
    assert np.asarray(tree.tokens).tolist() == z["tree_ddtree_tokens"].tolist()
    assert (np.asarray(tree.depths) + 1).tolist() == z["tree_ddtree_depths"].tolist()
    # fixture parents are over [root, nodes...] with root = -1
    assert z["tree_ddtree_parents"][0] == -1
    assert (np.asarray(tree.parents) + 1).tolist() == z["tree_ddtree_parents"][1:].tolist()
    assert np.array_equal(np.asarray(tree_attention_mask(tree)), z["tree_ddtree_visibility"])
    nodes, _ = host_ddtree(z["base_logits"][0, 1:], budget)
    assert_tree_equals(tree, nodes, budget)


@pytest.mark.parametrize("builder", DOMINOTREE_BUILDERS)
@pytest.mark.parametrize("name", ["domino_shift", "domino_noshift"])
def test_dominotree_fixture(name, builder):
    z = _fixture(name)
    config, params = load_draft(os.path.join(FIXTURES, name, "draft"), dtype=jnp.float32)
    _, target = load_target(os.path.join(FIXTURES, name, "target"), dtype=jnp.float32)
    embed = target["embed_tokens"]["embedding"]
    head = params["head"]
    assert z["tree_k_draft"] == config.k_draft == z["tree_draft_hidden"].shape[0]
    # root state = one GRU step from zeros on the root token's target embedding (§5.2)
    root_state = root_gru_state(head, embed[int(z["block_ids"][0, 0])])
    budget, node_topk = int(z["tree_budget"]), int(z["tree_node_topk"])
    hid, base = jnp.asarray(z["tree_draft_hidden"]), jnp.asarray(z["tree_base_logits"])
    build = _JITTED[builder][1]
    for prefix, topm, marginal in (("tree_dominotree_m16", 16, False),
                                   ("tree_dominotree_full", 0, False),
                                   ("tree_marginal", 16, True)):
        tree = build(head, config, hid, base, root_state, embed, budget, node_topk, topm,
                     marginal)
        assert np.asarray(tree.valid).all(), prefix
        for field in ("tokens", "depths", "parents"):
            assert np.asarray(getattr(tree, field)).tolist() == \
                z[f"{prefix}_{field}"].tolist(), (prefix, field)
        np.testing.assert_allclose(np.asarray(tree.scores), z[f"{prefix}_cum_logprob"],
                                   rtol=0, atol=SCORE_TOL, err_msg=prefix)
        nodes, _ = host_dominotree(head, config.pure_draft_prefix_len, hid, base, root_state,
                                   embed, budget, node_topk, topm, marginal)
        assert_tree_equals(tree, nodes, budget)
        positions = np.asarray(tree_positions(tree, 40))
        assert positions.tolist() == [40] + (41 + z[f"{prefix}_depths"]).tolist()


# ----------------------------------------------------------------------------------------
# Random tie-free inputs vs the host references

H, G, E = 8, 6, 5


def _random_head(rng, vocab):
    def u(*shape, scale=1.0):
        return jnp.asarray(rng.uniform(-scale, scale, shape).astype(np.float32))
    return {"prefix_gru": {"weight_ih": u(H, 3 * G), "weight_hh": u(G, 3 * G)},
            "embed_proj_0": {"kernel": u(H + G, E)},
            "embed_proj_2": {"kernel": u(E, vocab, scale=2.0)}}


def _draft_config(vocab, prefix_len):
    return DraftConfig(vocab_size=vocab, hidden_size=H, num_layers=1, num_heads=1,
                       num_kv_heads=1, head_dim=H, intermediate_size=H, block_size=4,
                       num_target_layers=2, mask_token_id=vocab - 1, target_layer_ids=(0,),
                       projector_type="domino", pure_draft_prefix_len=prefix_len,
                       shift_label=True, emb_dim=E, gru_hidden_dim=G)


def _tie_free(make, seed, min_gap=1e-4):
    """Draw inputs until the host builder's popped-vs-rest score gaps all exceed min_gap."""
    for attempt in range(50):
        rng = np.random.default_rng(1000 * seed + attempt)
        case = make(rng)
        if case[-1] > min_gap:
            return case
    raise AssertionError("no tie-free draw")


@pytest.mark.parametrize("builder,seed", RANDOM_CASES)
def test_ddtree_random_matches_host(seed, builder):
    budget = 1 + seed % 20
    def make(rng):
        k_depth, vocab = int(rng.integers(1, 6)), int(rng.integers(2, 24))
        logits = (rng.standard_normal((k_depth, vocab)) * 2.5).astype(np.float32)
        nodes, gap = host_ddtree(logits, budget)
        return logits, nodes, gap
    logits, nodes, _ = _tie_free(make, seed)
    tree = _JITTED[builder][0](jnp.asarray(logits), budget)
    assert_tree_equals(tree, nodes, budget)


@pytest.mark.parametrize("builder,seed", DOMINOTREE_RANDOM_CASES)
def test_dominotree_random_matches_host(seed, builder):
    budget = 1 + (7 * seed) % 20
    node_topk = 1 + seed % 4
    prefix_len = seed % 3
    marginal = seed % 6 == 5
    def make(rng):
        k_depth, vocab = int(rng.integers(1, 6)), int(rng.integers(node_topk + 1, 24))
        topm = (0, node_topk, vocab // 2 + 1, vocab + 3)[seed % 4]
        head = _random_head(rng, vocab)
        hid = rng.standard_normal((k_depth, H)).astype(np.float32)
        base = (rng.standard_normal((k_depth, vocab)) * 2.0).astype(np.float32)
        embed = rng.standard_normal((vocab, H)).astype(np.float32)
        root = rng.uniform(-1, 1, G).astype(np.float32)
        nodes, gap = host_dominotree(head, prefix_len, hid, base, root, embed, budget,
                                     node_topk, topm, marginal)
        return head, hid, base, embed, root, topm, nodes, gap
    head, hid, base, embed, root, topm, nodes, _ = _tie_free(make, seed)
    tree = _JITTED[builder][1](head, _draft_config(base.shape[1], prefix_len), jnp.asarray(hid),
                       jnp.asarray(base), jnp.asarray(root), jnp.asarray(embed), budget,
                       node_topk, topm, marginal)
    assert_tree_equals(tree, nodes, budget)


# ----------------------------------------------------------------------------------------
# Budget 1, exhaustion, jit + vmap


@pytest.mark.parametrize("builder", BUILDERS)
def test_budget_one_is_best_first_token(builder):
    _jit_ddtree, _jit_domino = _JITTED[builder]
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((4, 30)).astype(np.float32)
    tree = _jit_ddtree(jnp.asarray(logits), 1)
    assert tree.tokens.tolist() == [int(np.argmax(logits[0]))]
    assert tree.depths.tolist() == [0] and tree.parents.tolist() == [-1]
    assert tree.valid.tolist() == [True]
    np.testing.assert_allclose(tree.scores, [_log_softmax32(logits[0]).max()], atol=1e-6)
    assert np.asarray(tree_attention_mask(tree)).tolist() == [[True, False], [True, True]]

    head = _random_head(rng, 30)
    hid = jnp.asarray(rng.standard_normal((4, H)).astype(np.float32))
    embed = jnp.asarray(rng.standard_normal((30, H)).astype(np.float32))
    root = root_gru_state(head, embed[3])
    for prefix_len in (0, 1):
        cfg = _draft_config(30, prefix_len)
        for topm in (0, 30):
            tree = _jit_domino(head, cfg, hid, jnp.asarray(logits), root, embed, 1, 3, topm,
                               False)
            first = logits[0]
            if prefix_len == 0:                  # depth 0 corrected with the root state
                first = first + np.asarray(correction(head, hid[0], root))
            assert tree.tokens.tolist() == [int(np.argmax(first))]
            assert tree.depths.tolist() == [0] and tree.parents.tolist() == [-1]


@pytest.mark.parametrize("builder", BUILDERS)
def test_exhausted_pool_marks_tail_invalid(builder):
    _jit_ddtree = _JITTED[builder][0]
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.standard_normal((2, 3)).astype(np.float32))
    tree = _jit_ddtree(logits, 20)              # at most 3 + 3*3 = 12 nodes
    assert int(tree.valid.sum()) == 12 and not bool(tree.valid[12:].any())
    mask = np.asarray(tree_attention_mask(tree))
    assert np.array_equal(mask[13:], np.eye(21, dtype=bool)[13:])   # invalid: only itself
    assert not mask[:13, 13:].any()                 # and no valid row sees them
    pos = np.asarray(tree_positions(tree, 5))
    assert pos[0] == 5 and np.all(pos[13:] == 6)


def test_jit_vmap_batch():
    """The library builders under ``vmap`` (as the tree drafters call them) equal one tree
    at a time; the mask and positions of a batch of trees equal each tree's."""
    _jit_ddtree, _jit_domino = _JITTED["library"]
    rng = np.random.default_rng(11)
    batch, k_depth, vocab, budget = 3, 4, 20, 9
    logits = jnp.asarray(rng.standard_normal((batch, k_depth, vocab)).astype(np.float32))
    trees = jax.jit(jax.vmap(lambda x: build_ddtree(x, budget)))(logits)
    assert trees.tokens.shape == (batch, budget)
    masks = jax.jit(tree_attention_mask)(trees)
    assert masks.shape == (batch, budget + 1, budget + 1)
    positions = tree_positions(trees, jnp.asarray([3, 7, 9]))
    for b in range(batch):
        one = _jit_ddtree(logits[b], budget)
        for field in ("tokens", "depths", "parents", "valid"):
            assert np.array_equal(getattr(trees, field)[b], getattr(one, field))
        assert np.array_equal(masks[b], tree_attention_mask(one))
        assert np.array_equal(positions[b], tree_positions(one, [3, 7, 9][b]))

    head = _random_head(rng, vocab)
    cfg = _draft_config(vocab, 1)
    hid = jnp.asarray(rng.standard_normal((batch, k_depth, H)).astype(np.float32))
    embed = jnp.asarray(rng.standard_normal((vocab, H)).astype(np.float32))
    roots = root_gru_state(head, embed[jnp.asarray([1, 2, 3])])
    build = jax.jit(lambda hd, h, b, r, e: jax.vmap(
        lambda h1, b1, r1: build_dominotree(hd, cfg, h1, b1, r1, e, budget, 3, 8))(h, b, r))
    trees = build(head, hid, logits, roots, embed)
    assert trees.tokens.shape == (batch, budget)
    for b in range(batch):
        one = _jit_domino(head, cfg, hid[b], logits[b], roots[b], embed, budget, 3, 8, False)
        for field in ("tokens", "depths", "parents", "valid"):
            assert np.array_equal(getattr(trees, field)[b], getattr(one, field))
        np.testing.assert_allclose(trees.scores[b], one.scores, atol=1e-6)


@pytest.mark.parametrize("builder", BUILDERS)
def test_large_vocab_uses_two_stage_top_k_and_matches_host(builder):
    """V = 9000 with top-M 32 and a DDTree budget of 24: the builders' candidate top-k take
    the two-stage path of domino_jax/topk.py; trees still equal the host references."""
    vocab, budget, k_depth = 9000, 24, 4
    def make_dd(rng):
        logits = (rng.standard_normal((k_depth, vocab)) * 3.0).astype(np.float32)
        nodes, gap = host_ddtree(logits, budget)
        return logits, nodes, gap
    logits, nodes, _ = _tie_free(make_dd, 99)
    assert_tree_equals(_JITTED[builder][0](jnp.asarray(logits), budget), nodes, budget)

    def make_dom(rng):
        head = _random_head(rng, vocab)
        hid = rng.standard_normal((k_depth, H)).astype(np.float32)
        base = (rng.standard_normal((k_depth, vocab)) * 3.0).astype(np.float32)
        embed = rng.standard_normal((vocab, H)).astype(np.float32)
        root = rng.uniform(-1, 1, G).astype(np.float32)
        nodes, gap = host_dominotree(head, 1, hid, base, root, embed, budget, 4, 32, False)
        return head, hid, base, embed, root, nodes, gap
    head, hid, base, embed, root, nodes, _ = _tie_free(make_dom, 98)
    tree = _JITTED[builder][1](head, _draft_config(vocab, 1), jnp.asarray(hid), jnp.asarray(base),
                               jnp.asarray(root), jnp.asarray(embed), budget, 4, 32, False)
    assert_tree_equals(tree, nodes, budget)
