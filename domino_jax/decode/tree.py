"""Best-first draft trees built on the device: DDTree and DominoTree (docs/algorithms.md §4,
§5), one tree builder for both, and the tree helpers the round needs.

:class:`DraftTree` (one tree, or ``[B, N]`` batched by ``vmap``; nodes in descending score
order, so parents precede children)::

    tokens  [N] int32     draft token of each node
    depths  [N] int32     0-based: depth 0 = first draft position (child of the root)
    parents [N] int32     index into the node list; -1 = child of the root
    scores  [N] float32   cumulative log-probability of the root-to-node path
    valid   [N] bool      False only for the tail left when candidates ran out

Invalid nodes carry ``token 0, depth 0, parent -1, score -inf``; they are never parents.

The builder (:func:`best_first_tree`) is depth-synchronous: ``K`` batched steps (one per
draft depth) instead of ``N`` sequential pops of a heap, after the reference's SGLang
frontier builder (docs/algorithms.md §5.6; our own code). Why it gives the heap's tree:
a child's score is its parent's plus a log-probability (``<= 0``), so scores never
increase along a path, and a best-first tree of ``N`` nodes is exactly the ``N``
highest-scoring nodes of the (implicit, unbounded) candidate tree, a set closed under
taking parents. At most ``N`` of them lie at any one depth, and each is among the ``N``
best nodes of its depth whose parents are among the ``N`` best of the depth above. So per
depth it suffices to keep ``W = N`` "lanes": expand every lane of depth ``d - 1`` (its
``c`` best children), keep the top ``W`` of the ``W * c`` candidates as the lanes of depth
``d``, and record them in a ledger of ``K * W`` entries. The tree is the top ``N`` of the
ledger by score, ordered by score (the heap's pop order).

Ties: equal scores are resolved by ledger order (depth first, then lane order; ``lax.top_k``
prefers the lower index), which keeps parents before children even when a child's
log-probability is exactly 0. The references' heaps break such ties by insertion counter
(DominoTree) or ranks tuple (DDTree), so the trees agree on every input without exact score
ties (docs/algorithms.md §9.7). Nodes whose score is ``-inf`` are never selected; they come
out invalid. Scores are ``parent + log_prob`` in float32 (the reference forms DDTree's
sibling scores as ``score - lp[rank] + lp[rank + 1]``, so scores may differ from it by
float32 rounding, ~1e-7 relative). The readable heap builders that tests compare against
live in ``tests/heap_tree_builders.py``.

Shapes are static; the ``K`` depth steps are unrolled (K <= 16 in practice), so there is no
loop-carried round trip on GPUs.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp

from domino_jax.config import DraftConfig
from domino_jax.models import domino_head
from domino_jax.pallas import head_kernels
from domino_jax.topk import top_k

ChildrenFn = Callable[[Any, int], tuple[jax.Array, jax.Array]]   # (states [W,..], d) -> [W, c] x2
AdvanceFn = Callable[[Any, jax.Array], Any]                       # (parent states, tokens [W])


@flax.struct.dataclass
class DraftTree:
    tokens: jax.Array    # [N] int32
    depths: jax.Array    # [N] int32, 0-based
    parents: jax.Array   # [N] int32, -1 = child of the root
    scores: jax.Array    # [N] float32, cumulative log-prob
    valid: jax.Array     # [N] bool


# ----------------------------------------------------------------------------------------
# Tree helpers


def tree_attention_mask(tree: DraftTree) -> jax.Array:
    """``bool [N+1, N+1]`` over ``[root, nodes...]``: ``mask[q, k]`` = query ``q`` may attend
    to key ``k``. Row 0 (root) = {0}; valid node ``i`` (row ``i+1``) = {0, its ancestors,
    itself} (= row(parent) ∪ {itself}); an invalid node sees only itself and no row sees it
    (harmless: a finite softmax row, never on an accepted path). Batched trees ``[B, N]``
    give ``[B, N+1, N+1]``."""
    if tree.tokens.ndim > 1:
        return jax.vmap(tree_attention_mask)(tree)
    n = tree.tokens.shape[0]
    eye = jnp.eye(n + 1, dtype=bool)
    vis0 = eye

    def body(i, vis):
        row = i + 1
        inherited = jnp.where(tree.valid[i], vis[tree.parents[i] + 1], False)
        return vis.at[row].set(inherited | eye[row])

    return jax.lax.fori_loop(0, n, body, vis0)


def tree_positions(tree: DraftTree, start) -> jax.Array:
    """Position ids over ``[root, nodes...]``: ``start + [0, 1 + depth...]`` (invalid nodes:
    ``start + 1``). ``start`` is a scalar for one tree, ``[B]`` for batched trees ``[B, N]``
    (-> ``[B, N + 1]``)."""
    start = jnp.asarray(start, jnp.int32)
    offsets = jnp.concatenate([jnp.zeros_like(tree.depths[..., :1]), tree.depths + 1], axis=-1)
    return start[..., None] + offsets


# ----------------------------------------------------------------------------------------
# The builder


def best_first_tree(children: ChildrenFn, advance: AdvanceFn | None, root_state: Any,
                    k_depth: int, budget: int) -> DraftTree:
    """Best-first tree of ``budget`` nodes over ``k_depth`` depths, one row (module doc).

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

    def depth_step(lanes, d, advance_lanes):
        states, lane_score = lanes
        ctok, clp = children(states, d)                                  # [W, c]
        c = ctok.shape[-1]
        cand = (lane_score[:, None] + clp).reshape(-1)                   # -inf stays -inf
        best, idx = jax.lax.top_k(cand, width)                           # W * c >= W
        lane = idx // c
        token = ctok.reshape(-1)[idx].astype(jnp.int32)
        if not advance_lanes:
            return best, token, lane, None
        if advance is not None:
            parent_states = jax.tree_util.tree_map(lambda x: x[lane], states)
            states = advance(parent_states, token)
        return best, token, lane, (states, best)

    return frontier_tree(depth_step, (states, lane_score), k_depth, budget)


DepthStep = Callable[[Any, int, bool], tuple[jax.Array, jax.Array, jax.Array, Any]]


def frontier_tree(depth_step: DepthStep, lanes: Any, k_depth: int, budget: int) -> DraftTree:
    """The ledger around ``K`` depth steps (module doc): ``depth_step(lanes, d, advance)``
    keeps the ``W = budget`` best children at depth ``d`` of the lanes of depth ``d - 1``
    (``lanes``: the root's at ``d = 0``) and returns ``(best [W] float32, token [W] int32,
    lane [W] int32 (each child's parent lane), the lanes of depth d | None)`` (the lanes
    only when ``advance``: not at the last depth). :func:`best_first_tree`'s step is plain
    JAX; ``pallas.head_kernels.fused_depth_step`` is the fused kernel's."""
    width = budget
    lane_entry = jnp.full((width,), -1, jnp.int32)       # ledger index of each lane's node
    scores, tokens, parents = [], [], []
    for d in range(k_depth):
        best, token, lane, next_lanes = depth_step(lanes, d, d + 1 < k_depth)
        scores.append(best)
        tokens.append(token)
        parents.append(lane_entry[lane])
        if d + 1 < k_depth:
            lanes = next_lanes
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


def build_ddtree(draft_logits: jax.Array, budget: int) -> DraftTree:
    """DDTree (docs/algorithms.md §4.2): the best-first tree over factorised per-depth
    marginals, one row. ``draft_logits [K, V]`` (one row per draft depth; depth limit
    ``K``); the children of any node at depth ``d`` are the top ``min(budget, V)`` tokens
    of ``log_softmax(float32(logits[d]))``. ``budget``: ``N`` nodes (root excluded), static."""
    k_depth, vocab = draft_logits.shape
    logp = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    lp, tok = top_k(logp, min(budget, vocab))                             # [K, topk]

    def children(states, d):
        shape = (states.shape[0], lp.shape[-1])
        return jnp.broadcast_to(tok[d], shape), jnp.broadcast_to(lp[d], shape)

    return best_first_tree(children, None, jnp.zeros((), jnp.int32), k_depth, budget)


def build_dominotree(head: domino_head.Head, draft_config: DraftConfig,
                     draft_hidden: jax.Array, base_logits: jax.Array, root_state: jax.Array,
                     embed_table: jax.Array, budget: int, node_topk: int = 8, topm: int = 64,
                     marginal: bool = False, kernels=None) -> DraftTree:
    """DominoTree (docs/algorithms.md §5.3-5.4): the best-first tree with path-dependent
    Domino corrections, one row.

    Args:
      head: the Domino head, plain or a :class:`~domino_jax.models.domino_head.DecodeHead`.
      draft_config: uses ``pure_draft_prefix_len`` (P) only.
      draft_hidden: ``[K, H]`` draft hidden states in draft-index order (the caller drops
        block slot 0 when ``shift_label`` is false). Depth limit = ``K``.
      base_logits: ``[K, V]`` target LM head on ``draft_hidden``.
      root_state: ``[G]`` GRU state after the root token
        (:func:`~domino_jax.models.domino_head.root_gru_state`).
      embed_table: ``[V, H]`` target embedding table (GRU inputs of draft tokens).
      budget: ``N`` nodes (root excluded), static. node_topk: children per expansion.
      topm: ``M > 0``: correction on the top-M base candidates of each depth, renormalised
        over them; 0: full-vocabulary correction.
      marginal: the path-independent control: every depth uses the top-``node_topk`` of the
        full-vocab ``log_softmax(base[d])`` (no head, no GRU).
      kernels: a :class:`~domino_jax.pallas.head_kernels.HeadKernels` (from
        ``head_kernels.tree_kernels``): each depth step through the fused Pallas kernel (or
        its twin) instead of the plain JAX below; ``None``: plain JAX.

    Per depth: one batched correction over the ``W`` lanes' GRU states
    (:func:`~domino_jax.models.domino_head.tree_children`), then one batched GRU step for
    the ``W`` kept children. With a ``DecodeHead`` a lane carries its state's products with
    ``[W_hh | W1_s]`` (:func:`~domino_jax.models.domino_head.state_products`), made once
    when the state is made: the depth step then has one state product instead of two.
    """
    k_depth = base_logits.shape[0]
    if kernels is not None:
        step, lanes = head_kernels.fused_tree_steps(
            kernels, head, draft_config, draft_hidden, base_logits, root_state, budget,
            node_topk, topm)
        return frontier_tree(step, lanes, k_depth, budget)
    children, _ = domino_head.tree_children(head, draft_config, draft_hidden, base_logits,
                                            node_topk, topm, marginal)
    if marginal:
        return best_first_tree(children, None, root_state, k_depth, budget)
    if not isinstance(head, domino_head.DecodeHead):
        advance = lambda parent_states, tokens: domino_head.child_state(  # noqa: E731
            head, embed_table, parent_states, tokens)
        return best_first_tree(children, advance, root_state, k_depth, budget)
    lane = lambda state: (state, domino_head.state_products(head, state))   # noqa: E731

    def children_of_lanes(lanes, d):
        state, (state_w1, _) = lanes
        return children(state, d, state_w1)

    def advance_lanes(parent_lanes, tokens):
        state, (_, state_hh) = parent_lanes
        gates = domino_head.token_input_gates(head, embed_table, tokens, state.dtype)
        return lane(domino_head.gru_update(gates, state_hh, state))

    return best_first_tree(children_of_lanes, advance_lanes, lane(root_state), k_depth, budget)
