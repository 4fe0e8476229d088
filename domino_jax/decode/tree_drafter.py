"""Tree methods for the generate loop: DDTree and DominoTree (algorithms.md §4, §5).

Per round, for each row: one drafter forward gives the K draft positions' hidden states
and base logits; a best-first tree of ``budget`` nodes is built on the device
(:mod:`domino_jax.decode.tree`); the target verifies ``[root, nodes...]`` in ONE forward
with the tree attention mask (each node sees the committed prefix, the root, its
ancestors and itself) at positions ``start + [0, 1 + depth...]``; the walk follows the
target's own tokens (argmax at T = 0, samples at T > 0: the references' lossless
sample-and-walk rule) from the root down matching children; the accepted path's KV
entries are gathered into place (``KVCache.gather_path``) and its hidden features become
the drafter's next context.

Verification rule: only ``match`` (sample-and-walk). ``rejection`` needs a draft
distribution per node, which deterministic best-first trees do not define.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from domino_jax.decode import tree as tree_lib
from domino_jax.decode import tree_frontier
from domino_jax.decode.drafters import ChainDrafter, check_context_window
from domino_jax.decode.sampling import target_log_probs
from domino_jax.models import domino_head


def walk_tree(tree_tokens, tree_parents, tree_valid, samples, max_depth: int):
    """Follow the target's tokens down the tree (one row).

    Args:
      tree_tokens, tree_parents, tree_valid: ``[N]`` (parents index the node list, -1 = root).
      samples: ``[N + 1]`` the target's token at every verify row ``[root, nodes...]``.
    Returns:
      ``path [max_depth + 1]`` verify-row indices ``[0, n_1 + 1, ...]`` (zeros past the
      accepted length), ``accepted`` (nodes accepted) and ``last`` (verify row of the
      last accepted node; its sample is the bonus token).
    """
    row_parent = tree_parents + 1                        # verify row of each node's parent

    def step(i, carry):
        path, accepted, current, alive = carry
        wanted = samples[current]
        match = tree_valid & (row_parent == current) & (tree_tokens == wanted)
        found = alive & jnp.any(match)
        nxt = jnp.argmax(match).astype(jnp.int32) + 1
        current = jnp.where(found, nxt, current)
        path = path.at[i + 1].set(jnp.where(found, nxt, 0))
        return path, accepted + found.astype(jnp.int32), current, found

    init = (jnp.zeros((max_depth + 1,), jnp.int32), jnp.int32(0), jnp.int32(0), jnp.bool_(True))
    path, accepted, current, _ = jax.lax.fori_loop(0, max_depth, step, init)
    return path, accepted, current


@dataclasses.dataclass(frozen=True)
class TreeDrafter(ChainDrafter):
    """``method``: ``"ddtree"`` (factorised, any DFlash/Domino checkpoint) or
    ``"dominotree"`` (path-dependent Domino corrections; needs the head)."""

    budget: int = 16          # tree nodes, root excluded (verify width budget + 1)
    node_topk: int = 8        # DominoTree: children per expansion
    topm: int = 64            # DominoTree: candidate pool per depth (0 = full vocabulary)
    builder: str = "frontier"  # "frontier" (K batched depth steps) | "heap" (N sequential pops)

    is_tree = True
    BUILDERS = {"frontier": (tree_frontier.frontier_ddtree, tree_frontier.frontier_dominotree),
                "heap": (tree_lib.build_ddtree, tree_lib.build_dominotree)}

    def __post_init__(self):
        if self.method not in ("ddtree", "dominotree"):
            raise ValueError(f"unknown tree method {self.method!r}")
        if self.method == "dominotree" and not self.config.has_domino_head:
            raise ValueError("method 'dominotree' needs a Domino checkpoint (prefix_gru / "
                             "embed_proj tensors); use 'ddtree' with a plain DFlash drafter")
        check_context_window(self.context_window)
        if self.budget < 1:
            raise ValueError(f"tree budget must be >= 1, got {self.budget}")
        if self.builder not in self.BUILDERS:
            raise ValueError(f"unknown tree builder {self.builder!r}; choose one of "
                             f"{sorted(self.BUILDERS)}")
        if self.node_topk < 1 or self.topm < 0:
            raise ValueError(f"node_topk must be >= 1 and topm >= 0 (got {self.node_topk}, "
                             f"{self.topm})")

    @property
    def verify_width(self) -> int:
        return self.budget + 1

    @property
    def max_commit(self) -> int:
        return min(self.budget, self.num_drafts) + 1

    def build(self, target_params, draft_params, root, hidden, base):
        """Batched trees ``[B, N]`` from the draft positions' hidden states / base logits.
        Both builders give the same tree up to exact score ties (tests/test_tree_builders.py)."""
        build_ddtree, build_dominotree = self.BUILDERS[self.builder]
        if self.method == "ddtree":
            return jax.vmap(lambda b: build_ddtree(b, self.budget))(base)
        head = draft_params["head"]
        embed_table = target_params["embed_tokens"]["embedding"]
        root_embed = self._embed(target_params, root).astype(hidden.dtype)
        root_state = domino_head.root_gru_state(head, root_embed)         # after [root]
        build = lambda h, b, s: build_dominotree(
            head, self.config, h, b, s, embed_table, self.budget, node_topk=self.node_topk,
            topm=self.topm)
        return jax.vmap(build)(hidden, base, root_state)

    def tree_outcome(self, target, config, target_params, draft_params, state, draft_key,
                     verify_key):
        from domino_jax.decode.speculative import RoundOutcome

        del draft_key                                  # trees are deterministic
        if config.verify != "match":
            raise ValueError("tree methods verify with 'match' (sample-and-walk) only")
        start = state.target_cache.lengths
        hidden, base, draft_cache = self.draft_block(
            target_params, draft_params, state.root, start, state.context, state.context_len,
            state.draft_cache)
        tree = self.build(target_params, draft_params, state.root, hidden, base)
        verify_tokens = jnp.concatenate([state.root[:, None], tree.tokens], axis=1)  # [B, N+1]
        offsets = jnp.concatenate([jnp.zeros_like(tree.depths[:, :1]), tree.depths + 1], axis=1)
        positions = start[:, None] + offsets
        block_mask = jax.vmap(tree_lib.tree_attention_mask)(tree)
        out = target.apply({"params": target_params}, verify_tokens, positions,
                           cache=state.target_cache, block_mask=block_mask, tap_ids=self.tap_ids)
        log_p = target_log_probs(out.logits, config.sampling)
        samples = jax.random.categorical(verify_key, log_p, axis=-1).astype(jnp.int32)
        depth = self.max_commit - 1
        path, accepted, last = jax.vmap(
            lambda t, p, v, s: walk_tree(t, p, v, s, depth))(
            tree.tokens, tree.parents, tree.valid, samples)
        bonus = jnp.take_along_axis(samples, last[:, None], axis=1)[:, 0]
        path_tokens = jnp.take_along_axis(verify_tokens, path, axis=1)     # [B, P], root first
        committed = jnp.concatenate([path_tokens[:, 1:], jnp.zeros_like(path_tokens[:, :1])], 1)
        slot = jnp.arange(committed.shape[1])[None, :]
        committed = jnp.where(slot == accepted[:, None], bonus[:, None], committed)
        features = self.context_features(out)                             # [B, N+1, F]
        context = jnp.take_along_axis(features, path[:, :, None], axis=1)
        return RoundOutcome(committed, accepted, bonus, out.cache, path, context, draft_cache)
