"""Depth-synchronous ("frontier") builders for the best-first draft trees.

The heap builders in :mod:`domino_jax.decode.tree` pop one node per loop step: ``N``
sequential steps, each a small top-k over the candidate pool. These builders produce the
same trees with ``K`` (draft depths) batched steps instead, following the idea of the
reference's SGLang frontier builder (algorithms.md §5.6; our own code).

Why it is the same tree. Child scores are the parent's score plus a log-probability
(``<= 0``), so scores never increase along a path. A best-first tree of ``N`` nodes is
then exactly the ``N`` highest-scoring nodes of the (implicit, unbounded) candidate tree,
and that set is closed under taking parents. Among them at most ``N`` lie at any one depth,
and each is among the ``N`` best nodes of its depth whose parents are among the ``N``
best of the depth above. So per depth it suffices to keep ``W = N`` "lanes": expand every
lane of depth ``d - 1`` (its ``c`` best children), keep the top ``W`` of the ``W * c``
candidates as the lanes of depth ``d``, and record them in a ledger of ``K * W`` entries.
The tree is the top ``N`` of the ledger by score, ordered by score (the heap's pop order).

Ties: equal scores are resolved by ledger order (depth first, then lane order; ``lax.top_k``
prefers the lower index), which keeps parents before children even when a child's
log-probability is exactly 0. The heap builders break such ties by insertion counter
(DominoTree) or ranks tuple (DDTree), so the two agree on every input without exact score
ties (algorithms.md §9.7). Nodes whose score is ``-inf`` are never selected (the heap
builders could pop them once everything finite is gone); they come out invalid.

Scores: ``parent + log_prob`` in float32. DDTree's heap builder forms sibling scores as
``score - lp[rank] + lp[rank + 1]`` (as the reference does), so DDTree scores here may differ
from it by float32 rounding (~1e-7 relative).

Output: the :class:`~domino_jax.decode.tree.DraftTree` of the heap builders (nodes in
descending score order, parents before children, invalid tail with token 0, depth 0,
parent -1, score -inf). Shapes are static; the ``K`` depth steps are unrolled (K <= 16 in
practice), so there is no loop-carried round trip on GPUs.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from domino_jax.config import DraftConfig
from domino_jax.decode.tree import DraftTree, dominotree_child_state, dominotree_scorer
from domino_jax.models.domino_head import gru_update, state_products, token_input_gates
from domino_jax.topk import top_k

ChildrenFn = Callable[[Any, int], tuple[jax.Array, jax.Array]]   # (states [W,..], d) -> [W, c] x2
AdvanceFn = Callable[[Any, jax.Array], Any]                       # (parent states, tokens [W])


def frontier_tree(children: ChildrenFn, advance: AdvanceFn | None, root_state: Any,
                  k_depth: int, budget: int) -> DraftTree:
    """Best-first tree of ``budget`` nodes over ``k_depth`` depths, one row.

    Args:
      children: ``children(states, d)`` -> ``(tokens [W, c] int32, log_probs [W, c] f32)``,
        the ``c`` best children at depth ``d`` (static int) of nodes with ``states``
        (a pytree with leading dim ``W``); ``log_probs <= 0`` (``-inf`` = no child).
      advance: ``advance(parent_states, tokens [W])`` -> the states of those children;
        ``None`` when children do not depend on the path (DDTree, the marginal control).
      root_state: the root's state (a pytree without the lane dim).
      k_depth: depth limit (draft positions), static. budget: ``N``, static.
    """
    width = budget
    states = jax.tree_util.tree_map(
        lambda x: jnp.broadcast_to(x, (width,) + jnp.shape(x)), root_state)
    lane_score = jnp.full((width,), -jnp.inf, jnp.float32).at[0].set(0.0)    # lane 0 = root
    lane_entry = jnp.full((width,), -1, jnp.int32)       # ledger index of each lane's node
    scores, tokens, parents = [], [], []
    for d in range(k_depth):
        ctok, clp = children(states, d)                                  # [W, c]
        c = ctok.shape[-1]
        cand = (lane_score[:, None] + clp).reshape(-1)                   # -inf stays -inf
        best, idx = jax.lax.top_k(cand, width)                           # W * c >= W
        lane = idx // c
        token = ctok.reshape(-1)[idx].astype(jnp.int32)
        scores.append(best)
        tokens.append(token)
        parents.append(lane_entry[lane])
        if d + 1 < k_depth:
            if advance is not None:
                parent_states = jax.tree_util.tree_map(lambda x: x[lane], states)
                states = advance(parent_states, token)
            lane_score = best
            lane_entry = d * width + jnp.arange(width, dtype=jnp.int32)
    ledger_score = jnp.concatenate(scores)                               # [K * W]
    ledger_token = jnp.concatenate(tokens)
    ledger_parent = jnp.concatenate(parents)
    score, pick = jax.lax.top_k(ledger_score, budget)                    # K * W >= N
    valid = score > -jnp.inf
    position = jnp.full(ledger_score.shape, -1, jnp.int32).at[pick].set(
        jnp.where(valid, jnp.arange(budget, dtype=jnp.int32), -1))
    parent_entry = ledger_parent[pick]
    parent = jnp.where(parent_entry >= 0, position[jnp.maximum(parent_entry, 0)], -1)
    return DraftTree(tokens=jnp.where(valid, ledger_token[pick], 0),
                     depths=jnp.where(valid, (pick // width).astype(jnp.int32), 0),
                     parents=jnp.where(valid, parent, -1),
                     scores=score, valid=valid)


def frontier_ddtree(draft_logits: jax.Array, budget: int) -> DraftTree:
    """DDTree (algorithms.md §4.2) with the frontier builder; same contract as
    :func:`domino_jax.decode.tree.build_ddtree`: ``draft_logits [K, V]``, children of any node
    at depth ``d`` = the top ``min(budget, V)`` tokens of ``log_softmax(float32(logits[d]))``."""
    k_depth, vocab = draft_logits.shape
    logp = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    lp, tok = top_k(logp, min(budget, vocab))                             # [K, topk]

    def children(states, d):
        shape = (states.shape[0], lp.shape[-1])
        return jnp.broadcast_to(tok[d], shape), jnp.broadcast_to(lp[d], shape)

    return frontier_tree(children, None, jnp.zeros((), jnp.int32), k_depth, budget)


def frontier_dominotree(head_params: dict[str, Any], draft_config: DraftConfig,
                        draft_hidden: jax.Array, base_logits: jax.Array,
                        root_state: jax.Array, embed_table: jax.Array, budget: int,
                        node_topk: int = 8, topm: int = 64,
                        marginal: bool = False) -> DraftTree:
    """DominoTree (algorithms.md §5.3-5.4) with the frontier builder; same arguments and
    contract as :func:`domino_jax.decode.tree.build_dominotree`. Per depth: one batched
    correction over the ``W`` lanes' GRU states (``[W, M]`` scores), then one batched GRU
    step for the ``W`` kept children.

    With the head in its decode layout (``state_proj``, ``[W1_s | W_hh]``), a lane carries its
    state's products with that kernel (:func:`~domino_jax.models.domino_head.state_products`),
    made once when the state is made: the depth step then has one state product (``[W, G] x
    [G, E + 3G]``) instead of two (``W1_s`` for scoring the lane's children, ``W_hh`` for
    their states)."""
    k_depth = base_logits.shape[0]
    children, _ = dominotree_scorer(head_params, draft_config, draft_hidden, base_logits,
                                    node_topk, topm, marginal)
    if marginal:
        return frontier_tree(children, None, root_state, k_depth, budget)
    if "state_proj" not in head_params:
        advance = lambda parent_states, tokens: dominotree_child_state(  # noqa: E731
            head_params, embed_table, parent_states, tokens)
        return frontier_tree(children, advance, root_state, k_depth, budget)
    lane = lambda state: (state, state_products(head_params, state))   # noqa: E731

    def children_of_lanes(lanes, d):
        state, (state_w1, _) = lanes
        return children(state, d, state_w1)

    def advance_lanes(parent_lanes, tokens):
        state, (_, state_hh) = parent_lanes
        gates = token_input_gates(head_params, embed_table, tokens, state.dtype)
        return lane(gru_update(gates, state_hh, state))

    return frontier_tree(children_of_lanes, advance_lanes, lane(root_state), k_depth, budget)
