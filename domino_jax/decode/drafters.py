"""Chain drafters for the generate loop: DFlash (backbone only) and Domino (backbone + head).

A drafter is a static, hashable description (configs and modules, no arrays); parameters
travel as pytrees through the jitted functions. The loop calls:

* ``num_drafts`` (K) and ``tap_ids`` (the target hidden taps it needs);
* :meth:`ChainDrafter.context_features` on a target forward's output -> ``[B, T, n*H]``;
* :meth:`ChainDrafter.ingest_prompt` once after prefill (draft cache <- prompt context);
* :meth:`ChainDrafter.propose` each round -> ``drafts [B, K]``, the draft distribution's
  log-probs ``[B, K, V]`` (one-hot for greedy drafts; what ``rejection`` verification uses
  as ``q``) and the updated draft cache (context committed, block dropped).

Indexing (algorithms.md §3.2): both draft K = ``k_draft`` positions: all B slots with
``shift_label`` (released Domino checkpoints), slots 1..B-1 without (DFlash, K = B-1).
``method="dflash"`` on a Domino checkpoint drafts the argmax of its base logits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from domino_jax.config import DraftConfig
from domino_jax.kv_cache import align_slots
from domino_jax.models import dflash, domino_head
from domino_jax.models.qwen3 import TargetLM, TargetOutput


def check_context_window(window: int | None) -> None:
    """``ValueError`` unless ``window`` (``--draft-window``) is ``None`` or >= 1."""
    if window is not None and window < 1:
        raise ValueError(f"draft context window (--draft-window) must be >= 1 position, got "
                         f"{window}")


def one_hot_log_probs(tokens: jax.Array, vocab: int) -> jax.Array:
    return jnp.where(jax.nn.one_hot(tokens, vocab, dtype=bool), 0.0, -jnp.inf)


@dataclasses.dataclass(frozen=True)
class ChainDrafter:
    config: DraftConfig
    target: TargetLM
    method: str = "domino"            # "dflash" | "domino"
    head_topm: int = 0                # Domino: candidate pool per position (0 = full vocab)
    context_window: int | None = None  # draft layers read at most the last W positions

    def __post_init__(self):
        if self.method not in ("dflash", "domino"):
            raise ValueError(f"unknown drafter method {self.method!r}")
        if self.method == "domino" and not self.config.has_domino_head:
            raise ValueError("method 'domino' needs a Domino checkpoint (projector_type "
                             "'domino' with prefix_gru/embed_proj tensors); this drafter is "
                             "plain DFlash: use --method dflash")
        if self.head_topm < 0:
            raise ValueError(f"head_topm must be >= 0 (0 = full vocabulary), got "
                             f"{self.head_topm}")
        check_context_window(self.context_window)

    @property
    def backbone(self) -> dflash.DFlashBackbone:
        return dflash.DFlashBackbone(self.config, dtype=self.target.dtype,
                                     param_dtype=self.target.param_dtype,
                                     attention_impl=self.target.attention_impl,
                                     context_window=self.context_window)

    is_tree = False

    @property
    def num_drafts(self) -> int:
        """K draft positions per block: all B slots with ``shift_label``, else slots 1..B-1."""
        return self.config.k_draft

    @property
    def verify_width(self) -> int:
        """Tokens the target verifies per round (root + drafts)."""
        return self.num_drafts + 1

    @property
    def max_commit(self) -> int:
        """Most tokens one round can commit (accepted drafts + bonus)."""
        return self.num_drafts + 1

    @property
    def tap_ids(self) -> tuple[int, ...]:
        return dflash.target_tap_ids(self.config)

    def context_features(self, out: TargetOutput) -> jax.Array:
        return dflash.context_features(self.config, out.taps, out.hidden)

    def max_capacity(self, capacity: int) -> int:
        return capacity

    def _cache(self, batch: int, capacity: int):
        # prompt context + one round of (context rows + block) scratch
        slots = align_slots(capacity + self.max_commit + self.config.block_size)
        return dflash.new_draft_cache(self.config, batch, slots, self.target.dtype)

    def _embed(self, target_params, tokens):
        return self.target.apply({"params": target_params}, tokens, method=TargetLM.embed)

    def _lm_head(self, target_params, hidden):
        return self.target.apply({"params": target_params}, hidden, method=TargetLM.logits)

    def _block(self, target_params, root, start, draft_params=None):
        batch, block = root.shape[0], self.config.block_size
        tokens = jnp.full((batch, block), self.config.mask_token_id, jnp.int32)
        tokens = tokens.at[:, 0].set(root)
        positions = start[:, None] + jnp.arange(block, dtype=jnp.int32)[None, :]
        embeds = self._embed(target_params, tokens)
        if draft_params is not None and "mask_embedding" in draft_params:
            # our learned mask token (algorithms.md §9.15) replaces the target's mask row
            slot = jnp.arange(block)[None, :, None]
            embeds = jnp.where(slot > 0, draft_params["mask_embedding"].astype(embeds.dtype),
                               embeds)
        return embeds, positions

    def ingest_prompt(self, target_params, draft_params, features, positions, prompt_len,
                      capacity: int):
        """Fill an empty draft cache with the prompt context (the block is a dummy)."""
        return self.ingest_context(target_params, draft_params, features, positions,
                                   prompt_len, self.new_context_cache(features.shape[0],
                                                                      capacity))

    def new_context_cache(self, batch: int, capacity: int):
        """An empty draft cache for a target cache of ``capacity`` slots."""
        return self._cache(batch, capacity)

    def ingest_context(self, target_params, draft_params, features, positions, lengths,
                       cache):
        """Commit the first ``lengths[b]`` rows of ``features [B, T, F]`` (at ``positions
        [B, T]``, contiguous from the cache's length) to the draft cache: one backbone
        forward with a dummy block after them. A chunked prefill calls it once per chunk;
        the context K/V of a row depend on that row alone, so chunks commit what one call
        over the whole prompt would."""
        embeds, block_pos = self._block(target_params, jnp.zeros_like(lengths),
                                        positions[:, 0] + lengths, draft_params)
        _, cache = self.backbone.apply({"params": draft_params["backbone"]}, features, positions,
                                       lengths, embeds, block_pos, cache)
        return cache

    def draft_block(self, target_params, draft_params, root, start, context, context_len,
                    draft_cache):
        """One backbone forward: ``(draft_hidden [B, K, H], base_logits [B, K, V] f32,
        draft_cache)`` for the K draft positions after ``root`` (at position ``start [B]``);
        the new ``context`` rows are committed to the draft cache, the block is not."""
        width = context.shape[1]
        context_pos = (start - context_len)[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
        embeds, block_pos = self._block(target_params, root, start, draft_params)
        hidden, draft_cache = self.backbone.apply(
            {"params": draft_params["backbone"]}, context, context_pos, context_len, embeds,
            block_pos, draft_cache)
        if not self.config.shift_label:
            hidden = hidden[:, 1:]                    # slot 0 (the root) predicts nothing
        hidden = hidden[:, :self.num_drafts]
        return hidden, self._lm_head(target_params, hidden), draft_cache

    def propose(self, target_params, draft_params, root, start, context, context_len,
                draft_cache, key, decode_config):
        """Draft K tokens after ``root`` (at absolute position ``start [B]``)."""
        hidden, base, draft_cache = self.draft_block(target_params, draft_params, root, start,
                                                     context, context_len, draft_cache)
        sample = decode_config.draft_policy == "sample"
        temp = decode_config.draft_temperature

        def choose_fn(logits, k):
            if sample:
                return jax.random.categorical(k, logits / temp, axis=-1).astype(jnp.int32)
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)

        if self.method == "dflash":
            keys = jax.random.split(key, self.num_drafts)
            drafts = jax.vmap(choose_fn, in_axes=(1, 0), out_axes=1)(base, keys)
            logits = base
        else:
            embed_table = target_params["embed_tokens"]["embedding"]
            root_embed = self._embed(target_params, root)
            drafts, logits = domino_head.rollout(
                draft_params["head"], self.config, hidden, base, root_embed, embed_table,
                choose_fn, key, candidate_topm=self.head_topm)
        if sample:
            log_q = jax.nn.log_softmax(logits / temp, axis=-1)
        else:
            log_q = one_hot_log_probs(drafts, logits.shape[-1])
        return drafts, log_q, draft_cache
