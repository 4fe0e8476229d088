"""Tree methods: DDTree and DominoTree drafters (docs/algorithms.md §4, §5), and the
prompt-lookup hybrids.

Per round, for each row: the block drafter's forward gives the ``K`` draft positions'
hidden states and base logits (:meth:`~domino_jax.decode.drafters.BlockDrafter.draft_block`,
shared with the chains); a best-first tree of ``budget`` nodes is built on the device
(:mod:`domino_jax.decode.tree`) and proposed. The round then verifies ``[root, nodes...]``
in one forward with the tree attention mask, walks the target's samples down the tree
(``match`` only: best-first trees define no draft distribution per node) and gathers the
accepted path's K/V into place (:mod:`domino_jax.decode.round`).

Hybrids with the prompt lookup (:mod:`domino_jax.decode.ngram`; ``docs/design.md`` §14): with
``lookup_branch = G > 0`` a tree's last ``G`` nodes are the lookup's budget: on rounds
where the lookup matches, its ``G``-token continuation is grafted in as one more path
(sharing the prefix the tree already has; :func:`~domino_jax.decode.ngram.graft_branch`),
otherwise the tree keeps all ``budget`` nodes; the verify width stays ``budget + 1``.
:class:`DominoLookupDrafter` (``dominolookup``) is the Domino chain plus the lookup block
as a two-branch tree (verify width ``K + G + 1``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax

from domino_jax.decode import tree as tree_lib
from domino_jax.decode.contract import Proposal
from domino_jax.decode.drafters import (AUTO, BlockDrafter, BlockOptions, DominoDrafter,
                                        DominoOptions)
from domino_jax.decode.ngram import chain_tree, graft_lookup
from domino_jax.models import domino_head
from domino_jax.pallas import HEAD_IMPLEMENTATIONS, check_implementation, head_kernels


@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeOptions(BlockOptions):
    """``budget``: tree nodes, root excluded (the verify width is ``budget + 1``);
    ``"auto"`` (:data:`~domino_jax.decode.drafters.AUTO`, the CLI's default): chosen per
    round by the adaptive policy when the decode config has one, else
    :data:`AUTO_BUDGET`. ``lookup_branch``: ``G > 0`` reserves the tree's last ``G`` nodes
    for the prompt lookup's ``G``-token continuation when it matches (module doc); 0 = off."""

    budget: int | str = 16
    lookup_branch: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.budget != AUTO and (isinstance(self.budget, str) or self.budget < 1):
            raise ValueError(f"tree budget must be 'auto' or >= 1, got {self.budget!r}")
        if not 0 <= self.lookup_branch <= self.fixed_budget:
            raise ValueError(f"lookup branch (--lookup-branch) must be 0 (off) .. the tree "
                             f"budget {self.fixed_budget}, got {self.lookup_branch}")

    @property
    def adaptive(self) -> bool:
        return self.budget == AUTO

    @property
    def fixed_budget(self) -> int:
        """``budget`` as a fixed width: ``auto`` is the widest arm, :data:`AUTO_BUDGET`."""
        return AUTO_BUDGET if self.budget == AUTO else self.budget

    def fixed(self):
        return dataclasses.replace(super().fixed(), budget=self.fixed_budget)


AUTO_BUDGET = 16     # --budget auto: the widest tree (and the budget of a fixed run)


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
        return self.options.fixed_budget

    @property
    def reads_history(self) -> bool:
        """The lookup branch searches the loop's context buffer."""
        return self.options.lookup_branch > 0 or self.keep_history

    @property
    def max_commit(self) -> int:
        depth = max(self.num_positions, self.options.lookup_branch)   # the branch may be deeper
        return min(self.options.fixed_budget, depth) + 1

    def propose(self, target_params, draft_params, state, key, config) -> Proposal:
        del key                                          # best-first trees are deterministic
        hidden, base, draft_cache = self.draft_block(target_params, draft_params, state)
        tree = self.build_tree(target_params, draft_params, state.root, hidden, base)
        if self.options.lookup_branch:
            tree = graft_lookup(tree, state.history, state.target_cache.lengths,
                                self.options.lookup_branch)
        return Proposal(tree.tokens, draft_cache, tree=tree)


@dataclasses.dataclass(frozen=True)
class DDTreeDrafter(_TreeDrafter):
    """DDTree: the best-first tree over the block's factorised marginals (base logits);
    any DFlash or Domino checkpoint."""

    method: ClassVar[str] = "ddtree"

    def build_tree(self, target_params, draft_params, root, hidden, base):
        """Batched trees ``[B, N]`` from the base logits ``[B, K, V]``."""
        return jax.vmap(lambda b: tree_lib.build_ddtree(b, self.options.fixed_budget))(base)


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
        kernels = head_kernels.tree_kernels(opts.head_kernels, head, opts.fixed_budget,
                                            base.shape[-1], opts.node_topk, opts.topm)
        build = lambda h, b, s: tree_lib.build_dominotree(  # noqa: E731
            head, self.config, h, b, s, embed_table, opts.fixed_budget, node_topk=opts.node_topk,
            topm=opts.topm, kernels=kernels)
        return jax.vmap(build)(hidden, base, root_state)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DominoLookupOptions(DominoOptions):
    """``lookup_branch``: ``G`` tokens of the prompt lookup proposed beside the chain."""

    lookup_branch: int = 4

    def __post_init__(self):
        super().__post_init__()
        if self.lookup_branch < 1:
            raise ValueError(f"lookup branch (--lookup-branch) of dominolookup must be >= 1, "
                             f"got {self.lookup_branch}")


@dataclasses.dataclass(frozen=True)
class DominoLookupDrafter(DominoDrafter):
    """``dominolookup``: the Domino chain of ``K`` drafts plus the prompt lookup's ``G``
    tokens as a second branch of a tree of ``K + G`` nodes (it shares the chain's prefix
    where they agree; no match: the ``G`` slots are invalid). Verified as a tree
    (``match``); needs a Domino checkpoint."""

    method: ClassVar[str] = "dominolookup"
    Options: ClassVar[type] = DominoLookupOptions
    proposes_trees: ClassVar[bool] = True
    reads_history: ClassVar[bool] = True
    options: DominoLookupOptions = DominoLookupOptions()

    @property
    def num_drafts(self) -> int:
        return self.num_positions + self.options.lookup_branch

    @property
    def max_commit(self) -> int:
        return max(self.num_positions, self.options.lookup_branch) + 1

    def propose(self, target_params, draft_params, state, key, config) -> Proposal:
        hidden, base, draft_cache = self.draft_block(target_params, draft_params, state)
        drafts, _ = self.rollout(target_params, draft_params, hidden, base, state.root, key,
                                 config)
        g = self.options.lookup_branch
        tree = graft_lookup(chain_tree(drafts, g), state.history, state.target_cache.lengths, g)
        return Proposal(tree.tokens, draft_cache, tree=tree)
