"""Readable heap builders of the best-first draft trees: the references the library's
depth-synchronous builder (domino_jax/decode/tree.py) is tested against.

They follow the references' algorithms step by step (docs/algorithms.md §4.2, §5.3-5.4):
a ``lax.fori_loop`` of exactly ``N`` pops, each taking the best *valid* entry of a
fixed-size candidate pool; when the pool is empty the remaining nodes are marked invalid.
Written for one tree (one batch row), jit-compatible, with the same output
(:class:`~domino_jax.decode.tree.DraftTree`, nodes in pop order).

Tie-breaks (the references compare heap tuples; only exact float ties are affected):

* DDTree: equal scores fall back to the lexicographic ``ranks`` tuple (the per-depth rank of
  every token on the root-to-node path, a shorter tuple that is a prefix of a longer one comes
  first), exactly as the reference's ``(-logw, ranks, ...)`` heap key.
* DominoTree: equal scores fall back to the insertion counter (earlier pushed wins), exactly
  as the reference's ``(-cum, tie, ...)`` heap key. The pool is append-only and slot
  ``j`` is filled by the ``j``-th push, so the counter is the slot index and the pop is
  "first slot holding the maximum score".

DominoTree child GRU states are computed lazily: the reference computes every pushed child's
state at push time; here a node's state is computed when it is popped (one GRU step from the
parent's stored state on the node's token embedding): the same value, ``node_topk`` times
fewer GRU steps.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from domino_jax.config import DraftConfig
from domino_jax.decode.tree import DraftTree
from domino_jax.models.domino_head import child_state, tree_children
from domino_jax.topk import top_k


def _empty_tree(budget: int) -> DraftTree:
    return DraftTree(tokens=jnp.zeros((budget,), jnp.int32),
                     depths=jnp.zeros((budget,), jnp.int32),
                     parents=jnp.full((budget,), -1, jnp.int32),
                     scores=jnp.full((budget,), -jnp.inf, jnp.float32),
                     valid=jnp.zeros((budget,), bool))


def _record(tree: DraftTree, i, ok, token, depth, parent, score) -> DraftTree:
    """Write node ``i`` if ``ok`` (else leave the invalid filler)."""
    def put(arr, value):
        return arr.at[i].set(jnp.where(ok, value, arr[i]))
    return DraftTree(tokens=put(tree.tokens, token), depths=put(tree.depths, depth),
                     parents=put(tree.parents, parent), scores=put(tree.scores, score),
                     valid=tree.valid.at[i].set(ok))


def _pick(valid: jax.Array, score: jax.Array):
    """Index of the first slot holding the maximum score among valid ones, and whether any
    slot is valid."""
    key = jnp.where(valid, score, -jnp.inf)
    best = jnp.max(key)
    cand = valid & (key == best)
    return jnp.argmax(cand), jnp.any(valid)


# ----------------------------------------------------------------------------------------
# DDTree (docs/algorithms.md §4.2)


def heap_ddtree(draft_logits: jax.Array, budget: int) -> DraftTree:
    """DDTree best-first tree over factorized per-depth marginals (docs/algorithms.md §4.2).

    Args:
      draft_logits: ``[K, V]`` draft logits, one row per draft depth (DFlash: block slots
        ``1..B-1``). Depth limit = ``K``.
      budget: ``N`` nodes to pop (root excluded), static.
    Per depth only the top ``min(budget, V)`` tokens of ``log_softmax(float32(logits))`` are
    candidates. Lazy expansion: popping (parent, depth, rank) pushes its next sibling
    ``rank + 1`` (score ``logw − lp[d, rank] + lp[d, rank+1]``, subtract-then-add) and its first
    child ``(depth + 1, rank 0)``. Ties: lexicographic ranks tuple (see module docstring).
    Pool: append-only, ``2N + 1`` slots (root's first child, then per pop sibling + child).
    """
    k_depth, vocab = draft_logits.shape
    topk = min(budget, vocab)
    logp = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    lp, tok = top_k(logp, topk)                                           # [K, topk] int32
    size = 2 * budget + 1
    pool = dict(score=jnp.full((size,), -jnp.inf, jnp.float32).at[0].set(lp[0, 0]),
                parent=jnp.full((size,), -1, jnp.int32),
                depth=jnp.zeros((size,), jnp.int32),          # 0-based depth
                rank=jnp.zeros((size,), jnp.int32),
                ranks=jnp.full((size, k_depth), -1, jnp.int32).at[0, 0].set(0),
                valid=jnp.zeros((size,), bool).at[0].set(True))

    def pick(pool):
        key = jnp.where(pool["valid"], pool["score"], -jnp.inf)
        cand = pool["valid"] & (key == jnp.max(key))
        big = jnp.iinfo(jnp.int32).max
        for col in range(k_depth):                         # lexicographic ranks tuple
            r = jnp.where(cand, pool["ranks"][:, col], big)
            cand = cand & (r == jnp.min(r))
        return jnp.argmax(cand), jnp.any(pool["valid"])

    def body(i, carry):
        pool, tree = carry
        s, ok = pick(pool)
        score, depth, rank, parent = (pool["score"][s], pool["depth"][s], pool["rank"][s],
                                      pool["parent"][s])
        ranks = pool["ranks"][s]
        tree = _record(tree, i, ok, tok[depth, rank], depth, parent, score)
        valid = pool["valid"].at[s].set(False)
        # next sibling
        sib_ok = ok & (rank + 1 < topk)
        sib_rank = jnp.minimum(rank + 1, topk - 1)
        sib_score = score - lp[depth, rank] + lp[depth, sib_rank]
        sib_ranks = ranks.at[depth].set(sib_rank)
        # first child
        child_ok = ok & (depth + 1 < k_depth)
        child_depth = jnp.minimum(depth + 1, k_depth - 1)
        child_score = score + lp[child_depth, 0]
        child_ranks = jnp.where(jnp.arange(k_depth) == depth + 1, 0, ranks)
        a, b = 1 + 2 * i, 2 + 2 * i
        pool = dict(score=pool["score"].at[a].set(sib_score).at[b].set(child_score),
                    parent=pool["parent"].at[a].set(parent).at[b].set(i),
                    depth=pool["depth"].at[a].set(depth).at[b].set(child_depth),
                    rank=pool["rank"].at[a].set(sib_rank).at[b].set(0),
                    ranks=pool["ranks"].at[a].set(sib_ranks).at[b].set(child_ranks),
                    valid=valid.at[a].set(sib_ok).at[b].set(child_ok))
        return pool, tree

    _, tree = jax.lax.fori_loop(0, budget, body, (pool, _empty_tree(budget)))
    return tree


# ----------------------------------------------------------------------------------------
# DominoTree (docs/algorithms.md §5.3-5.4)


def heap_dominotree(head_params: dict[str, Any], draft_config: DraftConfig,
                     draft_hidden: jax.Array, base_logits: jax.Array, root_state: jax.Array,
                     embed_table: jax.Array, budget: int, node_topk: int = 8, topm: int = 64,
                     marginal: bool = False) -> DraftTree:
    """DominoTree best-first tree (docs/algorithms.md §5.3 children_fn, §5.4 builder), one row.

    Args:
      head_params: Domino head params (models/domino_head.py layout).
      draft_config: uses ``pure_draft_prefix_len`` (P) only.
      draft_hidden: ``[K, H]`` draft hidden states in draft-index order (the caller drops block
        slot 0 when ``shift_label`` is false). Depth limit = ``K``.
      base_logits: ``[K, V]`` target LM head on ``draft_hidden``.
      root_state: ``[G]`` GRU state after the root token (see :func:`domino_jax.models.domino_head.root_gru_state`).
      embed_table: ``[V, H]`` target embedding table (GRU inputs of draft tokens).
      budget: ``N`` nodes (root excluded), static. node_topk: children per expansion.
      topm: ``M`` > 0: correction on the top-M base candidates of each depth, renormalised
        over them; 0: full-vocabulary correction.
      marginal: the path-independent control: every depth uses the top-``node_topk`` of the
        full-vocab ``log_softmax(base[d])`` (no head, no GRU).
    Children scoring: :func:`domino_jax.models.domino_head.tree_children`. Eager expansion (all children pushed on pop,
    if depth+1 < K); ties: insertion counter. Pool: append-only, ``node_topk * (N + 1)`` slots.
    """
    k_depth = base_logits.shape[0]
    children, ntop = tree_children(head_params, draft_config, draft_hidden, base_logits,
                                   node_topk, topm, marginal)
    g = root_state.shape[-1]
    size = ntop * (budget + 1)
    tok0, lp0 = children(root_state, 0)
    pool = dict(score=jnp.full((size,), -jnp.inf, jnp.float32).at[:ntop].set(lp0),
                token=jnp.zeros((size,), jnp.int32).at[:ntop].set(tok0),
                parent=jnp.full((size,), -1, jnp.int32),
                depth=jnp.zeros((size,), jnp.int32),
                valid=jnp.zeros((size,), bool).at[:ntop].set(k_depth > 0))
    states = jnp.zeros((budget, g), root_state.dtype)

    def body(i, carry):
        pool, states, tree = carry
        s, ok = _pick(pool["valid"], pool["score"])
        score, token, depth, parent = (pool["score"][s], pool["token"][s], pool["depth"][s],
                                       pool["parent"][s])
        tree = _record(tree, i, ok, token, depth, parent, score)
        if marginal:
            state = root_state
        else:
            parent_state = jnp.where(parent >= 0, states[jnp.maximum(parent, 0)], root_state)
            state = child_state(head_params, embed_table, parent_state, token)
            states = states.at[i].set(state)
        ctok, clp = children(state, depth + 1)
        push_ok = ok & (depth + 1 < k_depth)
        start = ntop * (i + 1)
        upd = lambda arr, val: jax.lax.dynamic_update_slice(arr, val, (start,))
        pool = dict(score=upd(pool["score"], score + clp),
                    token=upd(pool["token"], ctok),
                    parent=upd(pool["parent"], jnp.full((ntop,), i, jnp.int32)),
                    depth=upd(pool["depth"], jnp.full((ntop,), depth + 1, jnp.int32)),
                    valid=upd(pool["valid"].at[s].set(False),
                              jnp.full((ntop,), push_ok)))
        return pool, states, tree

    _, _, tree = jax.lax.fori_loop(0, budget, body, (pool, states, _empty_tree(budget)))
    return tree

