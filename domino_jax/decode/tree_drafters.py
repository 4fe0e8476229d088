"""Tree methods: DDTree and DominoTree drafters (docs/algorithms.md §4, §5).

Per round, for each row: the block drafter's forward gives the ``K`` draft positions'
hidden states and base logits (:meth:`~domino_jax.decode.drafters.BlockDrafter.draft_block`,
shared with the chains); a best-first tree of ``budget`` nodes is built on the device
(:mod:`domino_jax.decode.tree`) and proposed. The round then verifies ``[root, nodes...]``
in one forward with the tree attention mask, walks the target's samples down the tree
(``match`` only: best-first trees define no draft distribution per node) and gathers the
accepted path's K/V into place (:mod:`domino_jax.decode.round`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax

from domino_jax.decode import tree as tree_lib
from domino_jax.decode.contract import Proposal
from domino_jax.decode.drafters import BlockDrafter, BlockOptions
from domino_jax.models import domino_head
from domino_jax.pallas import HEAD_IMPLEMENTATIONS, check_implementation, head_kernels


@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeOptions(BlockOptions):
    """``budget``: tree nodes, root excluded (the verify width is ``budget + 1``)."""

    budget: int = 16

    def __post_init__(self):
        super().__post_init__()
        if self.budget < 1:
            raise ValueError(f"tree budget must be >= 1, got {self.budget}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DominoTreeOptions(TreeOptions):
    """``node_topk``: children scored per expanded node; ``topm``: candidate tokens per depth
    for the correction (0 = the full vocabulary). ``head_kernels``: how the depth steps run
    (:mod:`domino_jax.pallas.head_kernels`; same trees up to float32 accumulation order)."""

    node_topk: int = 8
    topm: int = 64
    head_kernels: str = "auto"

    def __post_init__(self):
        super().__post_init__()
        if self.node_topk < 1 or self.topm < 0:
            raise ValueError(f"node_topk must be >= 1 and topm >= 0 (got {self.node_topk}, "
                             f"{self.topm})")
        check_implementation("head kernel", self.head_kernels, HEAD_IMPLEMENTATIONS)


@dataclasses.dataclass(frozen=True)
class _TreeDrafter(BlockDrafter):
    """What both tree drafters share: ``budget`` nodes, paths at most ``K`` deep."""

    proposes_trees: ClassVar[bool] = True
    Options: ClassVar[type] = TreeOptions
    options: TreeOptions = TreeOptions()

    @property
    def num_drafts(self) -> int:
        return self.options.budget

    @property
    def max_commit(self) -> int:
        return min(self.options.budget, self.num_positions) + 1

    def propose(self, target_params, draft_params, state, key, config) -> Proposal:
        del key                                          # best-first trees are deterministic
        hidden, base, draft_cache = self.draft_block(target_params, draft_params, state)
        tree = self.build_tree(target_params, draft_params, state.root, hidden, base)
        return Proposal(tree.tokens, draft_cache, tree=tree)


@dataclasses.dataclass(frozen=True)
class DDTreeDrafter(_TreeDrafter):
    """DDTree: the best-first tree over the block's factorised marginals (base logits);
    any DFlash or Domino checkpoint."""

    method: ClassVar[str] = "ddtree"

    def build_tree(self, target_params, draft_params, root, hidden, base):
        """Batched trees ``[B, N]`` from the base logits ``[B, K, V]``."""
        return jax.vmap(lambda b: tree_lib.build_ddtree(b, self.options.budget))(base)


@dataclasses.dataclass(frozen=True)
class DominoTreeDrafter(_TreeDrafter):
    """DominoTree: the best-first tree with the head's path-dependent corrections; needs a
    Domino checkpoint."""

    method: ClassVar[str] = "dominotree"
    Options: ClassVar[type] = DominoTreeOptions
    needs_head: ClassVar[bool] = True
    options: DominoTreeOptions = DominoTreeOptions()

    def build_tree(self, target_params, draft_params, root, hidden, base):
        """Batched trees ``[B, N]`` from the draft positions' hidden states ``[B, K, H]`` and
        base logits ``[B, K, V]``."""
        head = draft_params["head"]
        embed_table = target_params["embed_tokens"]["embedding"]
        root_state = domino_head.root_gru_state(
            head, self.embed(target_params, root).astype(hidden.dtype))     # after [root]
        opts = self.options
        kernels = head_kernels.tree_kernels(opts.head_kernels, head, opts.budget,
                                            base.shape[-1], opts.node_topk, opts.topm)
        build = lambda h, b, s: tree_lib.build_dominotree(  # noqa: E731
            head, self.config, h, b, s, embed_table, opts.budget, node_topk=opts.node_topk,
            topm=opts.topm, kernels=kernels)
        return jax.vmap(build)(hidden, base, root_state)
