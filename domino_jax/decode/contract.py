"""The round contract: what a drafter gives the decode loop, and the loop's state.

Every method runs the same round (:mod:`domino_jax.decode.round`), on the device:

1. **draft**: ``proposal = drafter.propose(target_params, draft_params, state, key, config)``
   -> a :class:`Proposal`: ``N`` draft tokens after the root (the last committed token, not
   yet in the target cache), as a chain or a tree;
2. **verify**: the target reads ``[root, tokens...]`` in one forward at positions
   ``start + [0, 1 + depth...]`` (causal for a chain, the tree attention mask for a tree),
   writing their K/V after the committed prefix; the verification rule on the config
   (:mod:`domino_jax.decode.verify`) decides how many drafts are accepted and the bonus
   token;
3. **commit**: the accepted drafts and the bonus go to the output, the target cache keeps
   the root and the accepted drafts (a tree's path is gathered into place), and the
   drafter's context features of those rows (``drafter.context_features``) become
   ``state.context`` for the next round; the bonus is the next root.

How to add a drafter (a new method is one small class and one line in
:data:`domino_jax.decode.methods.METHODS`):

* subclass :class:`Drafter` as a frozen dataclass (it is a static argument of the jitted
  loop, so it must be hashable; its fields are its settings). Set ``method`` (the name),
  ``Options`` (a frozen dataclass of its user options, built by the CLI and ``load_pair``
  from ``--flags`` / keywords of the same names), ``needs_checkpoint`` (a ``--draft``
  folder) and ``needs_head`` (a Domino head in it); a drafter built from a checkpoint
  overrides :meth:`Drafter.build`;
* implement ``num_drafts`` (``N``, the proposal's tokens; static) and :meth:`Drafter.propose`.
  A chain returns ``Proposal(tokens, draft_cache, log_q)``; a tree returns
  ``Proposal(tree.tokens, draft_cache, tree=tree)`` (:class:`~domino_jax.decode.tree.DraftTree`,
  batched ``[B, N]``) and sets ``max_commit`` (longest path + 1) and
  ``proposes_trees = True``;
* optional: the prompt's ingestion, :meth:`Drafter.new_context_cache` (an empty draft
  cache) and :meth:`Drafter.ingest_context` (called on each prefill chunk, or once on the
  whole prompt: :mod:`domino_jax.decode.prefill`), and the target features it reads,
  ``tap_ids``, :meth:`Drafter.context_features` and ``feature_dim``. ``state`` gives
  :meth:`Drafter.propose` everything committed so far: ``out_tokens`` / ``num_out`` (the
  generated tokens), ``root``, ``target_cache.lengths`` (the root's position), its own
  ``draft_cache`` and ``context`` (the features of the last commit's rows) and, with
  ``reads_history = True``, ``history`` (prompt and committed tokens by position, kept by
  the loop: what a prompt-lookup drafter searches); ``draft_policies`` lists the
  ``DecodeConfig.draft_policy`` values it supports.

:class:`~domino_jax.decode.ngram.NgramDrafter` (prompt lookup, no model) and
:class:`~domino_jax.decode.drafters.DFlashDrafter` (a checkpoint) are small examples;
:class:`NoDrafter` (AR) the smallest of all.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from domino_jax.decode.tree import DraftTree, tree_attention_mask, tree_positions
from domino_jax.kv_cache import KVCache
from domino_jax.models.qwen3 import TargetOutput


@flax.struct.dataclass
class DecodeState:
    """The loop's carry (a pytree; shapes fixed for the whole generation; ``W`` = the
    drafter's ``max_commit``)."""

    out_tokens: jax.Array        # [B, max_new + W] generated tokens (prompt excluded)
    num_out: jax.Array           # [B] committed generated tokens
    done: jax.Array              # [B] bool
    root: jax.Array              # [B] last committed token, not yet in the target cache
    target_cache: KVCache        # lengths [B] = committed positions = the root's position
    draft_cache: Any             # the drafter's own state (None for AR)
    context: jax.Array           # [B, W, F] drafter context features of the last commit
    context_len: jax.Array       # [B] valid rows of ``context``
    key: jax.Array
    rounds: jax.Array            # [B] rounds run while the row was live
    accept_hist: jax.Array       # [B, W + 1] histogram of tokens committed per round
    history: jax.Array | None = None  # [B, C] prompt + committed tokens by position, the root
    #   at target_cache.lengths (valid through it); kept only for drafters with reads_history


@flax.struct.dataclass
class Proposal:
    """One round's drafts (batch-major), in verify order after the root.

    ``tokens [B, N]`` int32. ``tree``: ``None`` for a chain (token ``i``'s parent is token
    ``i - 1``, at depth ``i``), else a batched :class:`~domino_jax.decode.tree.DraftTree`
    ``[B, N]`` (its parents, depths and validity). ``log_q [B, N, V]`` float32: the draft
    distribution each chain token was drawn from (what ``rejection`` verification needs;
    ``None`` when not defined). ``draft_cache``: the drafter's state after this round.
    """

    tokens: jax.Array
    draft_cache: Any = None
    log_q: jax.Array | None = None
    tree: DraftTree | None = None

    def positions(self, start: jax.Array) -> jax.Array:
        """Position ids ``[B, N + 1]`` of ``[root, tokens...]``; ``start [B]`` = the root's."""
        if self.tree is None:
            return start[:, None] + jnp.arange(self.tokens.shape[1] + 1,
                                               dtype=jnp.int32)[None, :]
        return tree_positions(self.tree, start)

    def attention_mask(self) -> jax.Array | None:
        """``bool [B, N + 1, N + 1]`` over ``[root, tokens...]`` for a tree, ``None`` (causal)
        for a chain."""
        return None if self.tree is None else jax.vmap(tree_attention_mask)(self.tree)


class PromptChunk(NamedTuple):
    """What :meth:`Drafter.ingest_context` sees of one prefill chunk (or the whole prompt)."""

    out: TargetOutput             # the target's forward over the chunk (taps: tap_ids)
    tokens: jax.Array             # [B, C] prompt tokens of the chunk
    positions: jax.Array          # [B, C] their positions, contiguous from the chunk's start
    lengths: jax.Array            # [B] real prompt rows in the chunk (the rest is padding)


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """A method without user options."""


class Drafter:
    """Base of every drafter (see the module doc for the contract). Subclasses are frozen
    dataclasses."""

    method: ClassVar[str]
    Options: ClassVar[type] = NoOptions      # frozen dataclass of the user options
    needs_checkpoint: ClassVar[bool] = True  # built from a --draft checkpoint
    needs_head: ClassVar[bool] = False       # the checkpoint must have a Domino head
    proposes_trees: ClassVar[bool] = False   # tree proposals (verified by 'match' only)
    reads_history: ClassVar[bool] = False    # the loop keeps state.history for it
    draft_policies: ClassVar[tuple[str, ...]] = ("greedy", "sample")   # DecodeConfig's choices
    tap_ids: tuple[int, ...] = ()            # target hidden taps the drafter reads

    @classmethod
    def build(cls, draft_config, target, options) -> "Drafter":
        """The drafter for a loaded checkpoint (``draft_config`` may be ``None`` when
        ``needs_checkpoint`` is false)."""
        return cls(options=options)

    @property
    def num_drafts(self) -> int:
        """``N``: tokens per proposal (static)."""
        raise NotImplementedError

    @property
    def verify_width(self) -> int:
        """Tokens the target verifies per round: the root and ``N`` drafts."""
        return self.num_drafts + 1

    @property
    def max_commit(self) -> int:
        """Most tokens one round can commit: the longest draft path and the bonus."""
        return self.num_drafts + 1

    @property
    def feature_dim(self) -> int:
        """``F``: the width of :meth:`context_features` (0: the drafter reads none)."""
        return 0

    def new_context_cache(self, batch: int, capacity: int) -> Any:
        """The drafter's empty state before the prompt (``capacity``: target cache slots).
        Default: none."""
        return None

    def ingest_context(self, target_params, draft_params, chunk: PromptChunk,
                       draft_cache) -> Any:
        """The drafter's state after one more prompt chunk. Default: unchanged."""
        return draft_cache

    def context_features(self, out: TargetOutput) -> jax.Array | None:
        """Features ``[B, T, F]`` of a verify forward the drafter reads next round (the
        loop keeps the accepted rows); ``None``: the drafter reads none."""
        return None

    def propose(self, target_params, draft_params, state: DecodeState, key: jax.Array,
                config) -> Proposal:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class NoDrafter(Drafter):
    """Plain autoregressive decoding (``ar``): the chain of zero drafts."""

    method: ClassVar[str] = "ar"
    needs_checkpoint: ClassVar[bool] = False
    options: NoOptions = NoOptions()

    @property
    def num_drafts(self) -> int:
        return 0

    def propose(self, target_params, draft_params, state, key, config) -> Proposal:
        return Proposal(jnp.zeros((state.root.shape[0], 0), jnp.int32))


NO_DRAFTER = NoDrafter()
