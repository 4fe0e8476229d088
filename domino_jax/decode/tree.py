"""On-device best-first draft trees: DDTree (algorithms.md §4.2), DominoTree (§5.3-5.4).

Everything runs inside ``jit`` with static shapes: a fixed node budget ``N`` (non-root nodes),
a fixed-size candidate pool, and a ``lax.fori_loop`` of exactly ``N`` pops. A pop takes the
best *valid* pool entry; when the pool is empty the remaining nodes are marked invalid.
Builders are written for one tree (one batch row); ``*_batched`` versions ``vmap`` them.

Common output, :class:`DraftTree` (nodes in pop order, so parents precede children)::

    tokens  [N] int32     draft token of each node
    depths  [N] int32     0-based: depth 0 = first draft position (child of the root)
    parents [N] int32     index into the node list; -1 = child of the root
    scores  [N] float32   cumulative log-probability of the root-to-node path
    valid   [N] bool      False only for the tail left when candidates ran out

Invalid nodes carry ``token 0, depth 0, parent -1, score -inf``; they are never parents.

Tie-breaks (the references compare heap tuples; only exact float ties are affected):

* DDTree: equal scores fall back to the lexicographic ``ranks`` tuple (the per-depth rank of
  every token on the root-to-node path, a shorter tuple that is a prefix of a longer one comes
  first), exactly as the reference's ``(−logw, ranks, ...)`` heap key.
* DominoTree: equal scores fall back to the insertion counter (earlier pushed wins), exactly
  as the reference's ``(−cum, tie, ...)`` heap key. The pool is append-only and slot
  ``j`` is filled by the ``j``-th push, so the counter is the slot index and the pop is
  "first slot holding the maximum score".

Scores accumulate in float32 on the device (the references use Python float64 sums of
float32 log-probs), so trees equal the references' unless two candidate scores fall within
float32 rounding of each other (algorithms.md §9.7: tie-free inputs).

DominoTree child GRU states are computed lazily: the reference computes every pushed child's
state at push time; we compute a node's state when it is popped (one GRU step from the
parent's stored state on the node's token embedding) — the same value, ``node_topk`` times
fewer GRU steps.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from domino_jax.config import DraftConfig
from domino_jax.models.domino_head import (_matmul, _split_w1, gru_step_from_gates,
                                           token_input_gates)
from domino_jax.topk import top_k


@flax.struct.dataclass
class DraftTree:
    tokens: jax.Array    # [N] int32
    depths: jax.Array    # [N] int32, 0-based
    parents: jax.Array   # [N] int32, -1 = child of the root
    scores: jax.Array    # [N] float32, cumulative log-prob
    valid: jax.Array     # [N] bool

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[-1]


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


# ----------------------------------------------------------------------------------------
# Tree helpers


def tree_attention_mask(tree: DraftTree) -> jax.Array:
    """``bool [N+1, N+1]`` over ``[root, nodes...]``: ``mask[q, k]`` = query ``q`` may attend
    to key ``k``. Row 0 (root) = {0}; valid node ``i`` (row ``i+1``) = {0, its ancestors,
    itself} (= row(parent) ∪ {itself}, §4.2); an invalid node sees only itself and no row
    sees it (harmless: a finite softmax row, never on an accepted path). Works under vmap
    (leading batch dims via ``jax.vmap``)."""
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
    """Position ids ``[N+1]`` over ``[root, nodes...]``: ``[start, start + 1 + depth...]``
    (invalid nodes: ``start + 1``). ``start`` is a scalar (or ``[batch]`` for batched trees)."""
    start = jnp.asarray(start, jnp.int32)
    depth_pos = start[..., None] + 1 + tree.depths
    return jnp.concatenate([start[..., None], depth_pos], axis=-1)


def _pick(valid: jax.Array, score: jax.Array):
    """Index of the first slot holding the maximum score among valid ones, and whether any
    slot is valid."""
    key = jnp.where(valid, score, -jnp.inf)
    best = jnp.max(key)
    cand = valid & (key == best)
    return jnp.argmax(cand), jnp.any(valid)


# ----------------------------------------------------------------------------------------
# DDTree (§4.2)


def build_ddtree(draft_logits: jax.Array, budget: int) -> DraftTree:
    """DDTree best-first tree over factorized per-depth marginals (algorithms.md §4.2).

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


def build_ddtree_batched(draft_logits: jax.Array, budget: int) -> DraftTree:
    """:func:`build_ddtree` over ``draft_logits [B, K, V]`` -> a ``DraftTree`` of ``[B, N]``."""
    return jax.vmap(lambda x: build_ddtree(x, budget))(draft_logits)


# ----------------------------------------------------------------------------------------
# DominoTree (§5.3-5.4)


def dominotree_scorer(head_params: dict[str, Any], draft_config: DraftConfig,
                      draft_hidden: jax.Array, base_logits: jax.Array, node_topk: int = 8,
                      topm: int = 64, marginal: bool = False):
    """The per-round part of §5.3 ``children_fn``, shared by both DominoTree builders.

    Precomputes once per round (per depth ``d``): ``z_proj[d] = W1_z · hid[d]``, the top-M
    base candidates ``cand[d]``, their base logits and their float32 ``W2`` rows. Returns
    ``(children, ntop)`` where ``children(states [..., G], d) -> (tokens [..., ntop] int32,
    log_probs [..., ntop] float32)`` gives the top-``ntop`` children at depth ``d`` (clamped
    to ``K - 1``; static or traced) of nodes whose GRU states are ``states``
    (``children(states, d, state_w1)`` takes ``states @ W1_s [..., E]`` float32 precomputed):

    * ``d < P`` (``pure_draft_prefix_len``) or ``marginal``: top of the full-vocab
      ``log_softmax(base[d])``, the same for every state;
    * ``topm = M > 0``: ``c = base[d][cand] + W2c[d] · silu(W1 · [hid[d]; state])``,
      normalised over the ``M`` candidates only (the reference's mixed normalisation);
    * ``topm = 0``: the full-vocabulary correction.
    """
    k_depth, vocab = base_logits.shape
    hidden_size = draft_hidden.shape[-1]
    prefix = draft_config.pure_draft_prefix_len
    ntop = min(node_topk, vocab)
    act = draft_hidden.dtype
    base = base_logits.astype(jnp.float32)
    # log_softmax(base) = (base - max) - log(sum(exp(base - max))), jax.nn.log_softmax's formula
    shift = jnp.max(base, axis=-1, keepdims=True)
    log_norm = jnp.log(jnp.sum(jnp.exp(base - shift), axis=-1, keepdims=True))   # [K, 1]
    m = 0 if marginal else min(topm, vocab)
    # one vocabulary-wide top-k (descending): its first ntop entries are the uncorrected
    # children, its first M the path-independent candidates
    top_vals, top_ids = top_k(base, max(ntop, m))                      # [K, max(ntop, M)]
    base_tok = top_ids[:, :ntop]
    base_lp = (top_vals[:, :ntop] - shift) - log_norm                  # log_softmax at the top
    if not marginal:
        w1_z, w1_s = _split_w1(head_params, hidden_size)
        w2 = head_params["embed_proj_2"]["kernel"]                     # [E, V]
        z_proj = _matmul(draft_hidden, w1_z)                           # [K, E] f32
        if m > 0:
            bc, cand = top_vals[:, :m], top_ids[:, :m]                 # [K, M]
            w2c = jnp.moveaxis(w2[:, cand], 0, -1).astype(jnp.float32)  # [K, M, E]

    def children(states, d, state_w1=None):
        d = jnp.minimum(d, k_depth - 1)
        batch = states.shape[:-1]
        from_base = (jnp.broadcast_to(base_tok[d], batch + (ntop,)),
                     jnp.broadcast_to(base_lp[d], batch + (ntop,)))
        if marginal:
            return from_base
        if state_w1 is None:
            state_w1 = _matmul(states.astype(act), w1_s)
        pre = z_proj[d] + state_w1
        u = jax.nn.silu(pre).astype(jnp.float32)                      # [..., E]
        if m > 0:
            c = bc[d] + jnp.einsum("me,...e->...m", w2c[d], u)
            lp_c, j = jax.lax.top_k(jax.nn.log_softmax(c), ntop)
            tok_c = cand[d][j]
        else:
            c = base[d] + _matmul(u.astype(act), w2)
            lp_c, tok_c = jax.lax.top_k(jax.nn.log_softmax(c), ntop)
            tok_c = tok_c.astype(jnp.int32)
        use_base = d < prefix
        return (jnp.where(use_base, from_base[0], tok_c), jnp.where(use_base, from_base[1], lp_c))

    return children, ntop


def dominotree_child_state(head_params: dict[str, Any], embed_table: jax.Array,
                           parent_states: jax.Array, tokens: jax.Array) -> jax.Array:
    """GRU state of a node from its parent's state and its own token: ``parent_states
    [..., G]``, ``tokens [...]`` -> ``[..., G]`` (one GRU step on the token's embedding; its
    input gates are a row gather when the head is in the decode layout)."""
    gates = token_input_gates(head_params, embed_table, tokens, parent_states.dtype)
    return gru_step_from_gates(head_params, gates, parent_states)


def build_dominotree(head_params: dict[str, Any], draft_config: DraftConfig,
                     draft_hidden: jax.Array, base_logits: jax.Array, root_state: jax.Array,
                     embed_table: jax.Array, budget: int, node_topk: int = 8, topm: int = 64,
                     marginal: bool = False) -> DraftTree:
    """DominoTree best-first tree (algorithms.md §5.3 children_fn, §5.4 builder), one row.

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
    Children scoring: :func:`dominotree_scorer`. Eager expansion (all children pushed on pop,
    if depth+1 < K); ties: insertion counter. Pool: append-only, ``node_topk * (N + 1)`` slots.
    """
    k_depth = base_logits.shape[0]
    children, ntop = dominotree_scorer(head_params, draft_config, draft_hidden, base_logits,
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
            state = dominotree_child_state(head_params, embed_table, parent_state, token)
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


def build_dominotree_batched(head_params, draft_config: DraftConfig, draft_hidden: jax.Array,
                             base_logits: jax.Array, root_state: jax.Array,
                             embed_table: jax.Array, budget: int, node_topk: int = 8,
                             topm: int = 64, marginal: bool = False) -> DraftTree:
    """:func:`build_dominotree` over a batch: ``draft_hidden [B, K, H]``, ``base_logits
    [B, K, V]``, ``root_state [B, G]`` (params and embedding table shared)."""
    fn = lambda h, b, r: build_dominotree(head_params, draft_config, h, b, r, embed_table,
                                          budget, node_topk, topm, marginal)
    return jax.vmap(fn)(draft_hidden, base_logits, root_state)
