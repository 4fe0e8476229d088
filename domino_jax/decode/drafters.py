"""Block drafters: a DFlash backbone drafts a block of ``K`` positions in one forward; the
chain methods choose one token per position (DFlash: argmax/sample of the base logits;
Domino: the head's causal rollout), the tree methods (:mod:`domino_jax.decode.tree_drafters`)
build a best-first tree over them. All are siblings on :class:`BlockDrafter`, which holds
the shared block drafting:

* :meth:`BlockDrafter.context_features` on a target forward's output -> ``[B, T, n*H]``;
* :meth:`BlockDrafter.ingest_context` on each prefill chunk (draft cache <- prompt context);
* :meth:`BlockDrafter.draft_block` each round -> ``(draft_hidden [B, K, H], base_logits
  [B, K, V] f32, draft_cache)``: the backbone over ``[root, MASK...]`` with the last
  commit's context rows (committed to the draft cache; the block is not).

Indexing (docs/algorithms.md §3.2): both draft ``K = k_draft`` positions: all ``B`` block
slots with ``shift_label`` (released Domino checkpoints), slots ``1..B-1`` without (DFlash,
``K = B-1``). ``dflash`` on a Domino checkpoint drafts the argmax of its base logits.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from domino_jax.config import DraftConfig
from domino_jax.decode.contract import Drafter, PromptChunk, Proposal
from domino_jax.kv_cache import align_slots
from domino_jax.models import dflash, domino_head
from domino_jax.models.qwen3 import TargetLM, TargetOutput
from domino_jax.pallas import HEAD_IMPLEMENTATIONS, check_implementation, head_kernels

AUTO = "auto"    # a width option's adaptive value (--draft-length auto, --budget auto)
# the base logit of a token outside the draft vocabulary: finite, so that sums and
# differences of logits stay numbers, and below any logit a model computes
OUTSIDE_DRAFT_VOCAB = -1e30


def one_hot_log_probs(tokens: jax.Array, vocab: int) -> jax.Array:
    return jnp.where(jax.nn.one_hot(tokens, vocab, dtype=bool), 0.0, -jnp.inf)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockOptions:
    """Options of every block drafter. ``context_window``: the draft layers read at most the
    last ``W`` context positions (a sliding window, ``--draft-window``: draft cost stops
    growing with the context; drafts change only once the context exceeds ``W``); ``None``:
    the checkpoint's layout (full attention unless it declares sliding layers).
    ``draft_length``: draft positions used per round, ``1..K`` (``--draft-length N``; the
    first ``N`` of the block: the LM head and the Domino head run over ``N`` rows); ``0``:
    all ``K``; ``"auto"`` (:data:`AUTO`, the CLI's default): chosen per round by the
    adaptive policy when the decode config has one (``DecodeConfig.adaptive``,
    :mod:`domino_jax.decode.adaptive`), else all ``K``.
    ``trim_block``: the backbone runs over only the block slots the ``draft_length`` drafts
    read (``[root, MASK x k]``; ``k`` slots with ``shift_label``) instead of the whole block:
    the layers' cost falls with ``k``, but the block attends non-causally, so the drafts
    change (still verified: lossless either way); off = the reference's drafts.
    ``draft_vocab``: the drafter's LM head over only the ``N`` most frequent tokens of its
    checkpoint's ranking (``draft_vocab.npy``, :mod:`domino_jax.train.draft_vocab`; the
    params' ``vocab`` entry, :func:`~domino_jax.decode.loading.load_pair`): a draft is never
    another token, so the drafts change where the target's token is rare (verified:
    lossless); 0 = the whole vocabulary, the reference's drafts; ``"auto"`` (the CLI's
    default): chosen by :func:`~domino_jax.decode.loading.load_pair` for the device and the
    folder (docs/design.md §32)."""

    context_window: int | None = None
    draft_length: int | str = 0
    trim_block: bool = False
    draft_vocab: int | str = 0

    def __post_init__(self):
        if self.context_window is not None and self.context_window < 1:
            raise ValueError(f"draft context window (--draft-window) must be >= 1 position, "
                             f"got {self.context_window}")
        if self.draft_length != AUTO and (isinstance(self.draft_length, str)
                                          or self.draft_length < 0):
            raise ValueError(f"draft length (--draft-length) must be 'auto' or >= 1 (0 = the "
                             f"whole block), got {self.draft_length!r}")
        if self.draft_vocab != AUTO and (isinstance(self.draft_vocab, str)
                                         or self.draft_vocab < 0):
            raise ValueError(f"draft vocabulary (--draft-vocab) must be 'auto' or >= 1 tokens "
                             f"(0 = the whole vocabulary), got {self.draft_vocab!r}")

    @property
    def adaptive(self) -> bool:
        """Whether the width is ``auto`` (for a chain, ``draft_length``; trees: ``budget``)."""
        return self.draft_length == AUTO

    @property
    def fixed_draft_length(self) -> int:
        """``draft_length`` as a fixed width: ``auto`` is the widest, the whole block (0)."""
        return 0 if self.draft_length == AUTO else self.draft_length

    def fixed(self):
        """These options with ``auto`` widths as the widest fixed ones: what a round
        without an adaptive policy runs."""
        return dataclasses.replace(self, draft_length=self.fixed_draft_length)


@dataclasses.dataclass(frozen=True)
class BlockDrafter(Drafter):
    """A DFlash block backbone over the target's hidden taps (``config``: the checkpoint's
    :class:`~domino_jax.config.DraftConfig`; ``target``: the target it drafts for, whose
    embedding and LM head it borrows)."""

    Options: ClassVar[type] = BlockOptions
    config: DraftConfig
    target: TargetLM
    options: BlockOptions = BlockOptions()
    context_slack: int = 0        # extra context rows (the adaptive loop's AR rounds append)
    keep_history: bool = False    # the loop keeps state.history (the adaptive lookup arms)

    def __post_init__(self):
        if self.options.fixed_draft_length > self.config.k_draft:
            raise ValueError(f"draft length must be in 1..{self.config.k_draft} (the "
                             f"checkpoint's draft positions per block), got "
                             f"{self.options.draft_length}")
        if self.needs_head and not self.config.has_domino_head:
            raise ValueError(f"method {self.method!r} needs a Domino checkpoint (projector_type "
                             "'domino' with prefix_gru/embed_proj tensors); this drafter is "
                             "plain DFlash: use a method without the head (dflash, ddtree)")

    @classmethod
    def build(cls, draft_config, target, options) -> "BlockDrafter":
        return cls(draft_config, target, options)

    @property
    def reads_history(self) -> bool:
        """Whether the loop keeps ``state.history``: for the adaptive loop's lookup arms
        (:mod:`domino_jax.decode.lookup_arm`)."""
        return self.keep_history

    @property
    def backbone(self) -> dflash.DFlashBackbone:
        return dflash.DFlashBackbone(self.config, dtype=self.target.dtype,
                                     param_dtype=self.target.param_dtype,
                                     attention_impl=self.target.attention_impl,
                                     context_window=self.options.context_window)

    @property
    def num_positions(self) -> int:
        """``K`` draft positions per block: all B slots with ``shift_label``, else 1..B-1
        (the first ``options.draft_length`` of them when set)."""
        return self.options.fixed_draft_length or self.config.k_draft

    @property
    def num_drafts(self) -> int:
        return self.num_positions

    @property
    def block_len(self) -> int:
        """Block slots the backbone runs over: the checkpoint's ``block_size``, or with
        ``options.trim_block`` just those the ``num_positions`` drafts read."""
        if not self.options.trim_block:
            return self.config.block_size
        return min(self.config.block_size,
                   self.num_positions + (0 if self.config.shift_label else 1))

    @property
    def tap_ids(self) -> tuple[int, ...]:
        return dflash.target_tap_ids(self.config)

    @property
    def feature_dim(self) -> int:
        return self.config.num_taps * self.config.hidden_size

    def context_features(self, out: TargetOutput) -> jax.Array:
        return dflash.context_features(self.config, out.taps, out.hidden)

    def new_context_cache(self, batch: int, capacity: int):
        """An empty draft cache for a target cache of ``capacity`` slots: the prompt
        context and one round of (context rows + block) scratch."""
        slots = align_slots(capacity + self.max_commit + self.context_slack
                            + self.config.block_size)
        return dflash.new_draft_cache(self.config, batch, slots, self.target.dtype)

    def embed(self, target_params, tokens):
        """The target's embeddings of ``tokens [...]`` -> ``[..., H]``."""
        return self.target.apply({"params": target_params}, tokens, method=TargetLM.embed)

    def lm_head(self, target_params, hidden, draft_params=None):
        """The target's LM head on ``hidden [..., H]`` -> float32 ``[..., V]``; with
        ``options.draft_vocab``, over the ranking's tokens only (``draft_params["vocab"]``:
        ``ids [N]`` and their LM-head rows ``[N, H]``), every other logit
        :data:`OUTSIDE_DRAFT_VOCAB`."""
        if self.options.draft_vocab == AUTO:
            raise ValueError("draft_vocab 'auto' is chosen when the pair is loaded "
                             "(load_pair); give a number here")
        if not self.options.draft_vocab:
            return self.target.apply({"params": target_params}, hidden, method=TargetLM.logits)
        if draft_params is None or "vocab" not in draft_params:
            raise ValueError("draft_vocab is set but the drafter's params have no 'vocab' "
                             "entry (load the pair with load_pair(..., draft_vocab=N))")
        ids, rows = draft_params["vocab"]["ids"], draft_params["vocab"]["lm_rows"]
        sub = jnp.einsum("...h,nh->...n", hidden.astype(rows.dtype), rows,
                         preferred_element_type=jnp.float32)
        full = jnp.full(hidden.shape[:-1] + (self.target.config.vocab_size,),
                        OUTSIDE_DRAFT_VOCAB, jnp.float32)
        return full.at[..., ids].set(sub, indices_are_sorted=True, unique_indices=True)

    def block_inputs(self, target_params, root, start, draft_params=None,
                     slots: int | None = None):
        """Embeddings ``[B, Bk, H]`` and positions ``[B, Bk]`` of the block ``[root, MASK...]``
        whose root sits at ``start [B]``; ``Bk`` = ``slots`` or :attr:`block_len`."""
        batch, block = root.shape[0], slots or self.block_len
        tokens = jnp.full((batch, block), self.config.mask_token_id, jnp.int32)
        tokens = tokens.at[:, 0].set(root)
        positions = start[:, None] + jnp.arange(block, dtype=jnp.int32)[None, :]
        embeds = self.embed(target_params, tokens)
        if draft_params is not None and "mask_embedding" in draft_params:
            # our learned mask token (docs/algorithms.md §9.15) replaces the target's mask row
            slot = jnp.arange(block)[None, :, None]
            embeds = jnp.where(slot > 0, draft_params["mask_embedding"].astype(embeds.dtype),
                               embeds)
        return embeds, positions

    def ingest_context(self, target_params, draft_params, chunk: PromptChunk, draft_cache):
        """Commit the chunk's first ``chunk.lengths[b]`` rows of context features (at
        ``chunk.positions``, contiguous from the cache's length) to the draft cache: one
        backbone forward with a dummy block after them. The context K/V of a row depend on
        that row alone, so chunks commit what one call over the whole prompt would."""
        return self.ingest_features(target_params, draft_params,
                                    self.context_features(chunk.out), chunk.positions,
                                    chunk.lengths, draft_cache)

    def ingest_features(self, target_params, draft_params, features, positions, lengths,
                        draft_cache):
        """Commit the first ``lengths[b]`` rows of context ``features [B, T, F]`` (at
        ``positions [B, T]``, contiguous from the cache's length) to the draft cache (also
        the adaptive loop's flush of the rows its AR rounds buffered). The backbone runs with
        a one-slot dummy block: the context K/V come from the shared ``ctx`` projection alone,
        so the block's size does not change them, and 16 dummy slots would cost the layers'
        attention and MLP over 16 rows per sequence for nothing (at the SmolLM2 pair's
        shape, 2 draft layers x 16 rows: about the layer work of an AR step, 30 x 1)."""
        embeds, block_pos = self.block_inputs(target_params, jnp.zeros_like(lengths),
                                              positions[:, 0] + lengths, draft_params, slots=1)
        _, draft_cache = self.backbone.apply({"params": draft_params["backbone"]}, features,
                                             positions, lengths, embeds, block_pos,
                                             draft_cache)
        return draft_cache

    def block_hidden(self, target_params, draft_params, root, start, context, context_len,
                     draft_cache):
        """The backbone over the block after ``root`` (at position ``start [B]``) with the
        new ``context [B, W, F]`` rows (``context_len [B]`` valid): ``(draft_hidden [B, K, H],
        draft_cache)``; the context is committed to the draft cache, the block is not."""
        width = context.shape[1]
        context_pos = (start - context_len)[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
        embeds, block_pos = self.block_inputs(target_params, root, start, draft_params)
        # the last layer's rows: the slots the drafts read (exact: every slot still makes
        # keys and values; 16 -> k + 1 rows of its MLP for a k-draft round)
        rows = self.num_positions + (0 if self.config.shift_label else 1)
        hidden, draft_cache = self.backbone.apply(
            {"params": draft_params["backbone"]}, context, context_pos, context_len, embeds,
            block_pos, draft_cache, output_rows=rows)
        if not self.config.shift_label:
            hidden = hidden[:, 1:]                    # slot 0 (the root) predicts nothing
        return hidden[:, :self.num_positions], draft_cache

    def draft_block(self, target_params, draft_params, state):
        """This round's block: ``(draft_hidden [B, K, H], base_logits [B, K, V] f32,
        draft_cache)`` (:meth:`block_hidden` and the target's LM head)."""
        hidden, draft_cache = self.block_hidden(
            target_params, draft_params, state.root, state.target_cache.lengths, state.context,
            state.context_len, state.draft_cache)
        return hidden, self.lm_head(target_params, hidden, draft_params), draft_cache


def _chooser(config):
    """``(logits [B, n] f32, key) -> [B] int32`` for the config's draft policy."""
    sample = config.draft_policy == "sample"
    temp = config.draft_temperature

    def choose_fn(logits, k):
        if sample:
            return jax.random.categorical(k, logits / temp, axis=-1).astype(jnp.int32)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    return choose_fn


def _draft_log_probs(drafts, logits, config, vocab: int):
    """``q [B, K, V]``: the distribution each draft was chosen from (greedy drafts: one-hot;
    ``logits`` is only read for sampled ones)."""
    if config.draft_policy == "sample":
        return jax.nn.log_softmax(logits / config.draft_temperature, axis=-1)
    return one_hot_log_probs(drafts, vocab)


@dataclasses.dataclass(frozen=True)
class DFlashDrafter(BlockDrafter):
    """DFlash: each position's token from the backbone's base logits (argmax, or sampled
    under ``--draft-policy sample``); any DFlash or Domino checkpoint."""

    method: ClassVar[str] = "dflash"

    def propose(self, target_params, draft_params, state, key, config) -> Proposal:
        _, base, draft_cache = self.draft_block(target_params, draft_params, state)
        keys = jax.random.split(key, self.num_drafts)
        drafts = jax.vmap(_chooser(config), in_axes=(1, 0), out_axes=1)(base, keys)
        q = _draft_log_probs(drafts, base, config, base.shape[-1])
        return Proposal(drafts, draft_cache, q)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DominoOptions(BlockOptions):
    """``head_topm``: corrected drafts choose among the top-M base tokens of their position
    (a candidate pool, as SGLang's Domino rollout; much faster head); 0 = the full
    vocabulary, the reference's drafts. ``head_kernels``: how the rollout's steps run
    (:mod:`domino_jax.pallas.head_kernels`: ``auto`` (default) / ``xla`` / ``pallas`` /
    ``reference`` / ``pallas_interpret``; same drafts up to float32 accumulation order)."""

    head_topm: int = 0
    head_kernels: str = "auto"

    def __post_init__(self):
        super().__post_init__()
        if self.head_topm < 0:
            raise ValueError(f"head_topm must be >= 0 (0 = full vocabulary), got "
                             f"{self.head_topm}")
        check_implementation("head kernel", self.head_kernels, HEAD_IMPLEMENTATIONS)


@dataclasses.dataclass(frozen=True)
class DominoDrafter(BlockDrafter):
    """Domino: the backbone's block, then the head's causal rollout (each corrected position
    sees the GRU state of the drafts before it); needs a Domino checkpoint."""

    method: ClassVar[str] = "domino"
    Options: ClassVar[type] = DominoOptions
    needs_head: ClassVar[bool] = True
    options: DominoOptions = DominoOptions()

    def propose(self, target_params, draft_params, state, key, config) -> Proposal:
        hidden, base, draft_cache = self.draft_block(target_params, draft_params, state)
        drafts, logits = self.rollout(target_params, draft_params, hidden, base, state.root,
                                      key, config)
        q = _draft_log_probs(drafts, logits, config, base.shape[-1])
        return Proposal(drafts, draft_cache, q)

    def rollout(self, target_params, draft_params, hidden, base, root, key, config):
        """The head's drafts ``[B, K]`` and the logits ``[B, K, V]`` they were chosen from
        (:func:`~domino_jax.models.domino_head.rollout`, or its steps through the Pallas
        kernels per ``options.head_kernels``; then the logits are ``None`` for greedy
        drafts, which need none)."""
        head, topm = draft_params["head"], self.options.head_topm
        root_embed = self.embed(target_params, root)
        batch, _, vocab = base.shape
        kernels = head_kernels.rollout_kernels(self.options.head_kernels, head, batch, vocab)
        if kernels is not None:
            sample = config.draft_policy == "sample"
            return head_kernels.fused_rollout(
                head, self.config, hidden, base, root_embed, kernels,
                config.draft_temperature if sample else None, key, candidate_topm=topm,
                need_logits=sample)
        embed_table = target_params["embed_tokens"]["embedding"]
        return domino_head.rollout(head, self.config, hidden, base, root_embed, embed_table,
                                   _chooser(config), key, candidate_topm=topm)
