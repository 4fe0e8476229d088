"""The DFlash / Domino training objective (algorithms.md §2.5, §3.2, §3.4, §9.10-9.12).

Per sequence ``x [S]`` with ``loss_mask [S]`` (response tokens):

* anchors: ``a`` valid iff ``loss_mask[a] & loss_mask[a+1]`` (``a <= S-2``); ``N`` sampled
  without replacement (random scores + ``top_k``), sorted, padded slots (``keep=False``)
  at the end with anchor 0;
* blocks ``[x_a, MASK x (B-1)]`` at positions ``a .. a+B-1``; the draft reads the frozen
  target's taps of all ``S`` positions as context, block ``j`` sees context keys
  ``t < a_j`` (strictly) and its own block (bidirectional); padded blocks see nothing;
* labels / weights per the ``shift_label`` table (§3.2); DFlash CE on the base logits,
  Domino ``L = (1 - lambda) L_final + lambda L_base`` with teacher-forced final logits,
  both normalised by the same ``sum(w) + 1e-6``.

The frozen target (embedding, mask row, taps, LM head) runs inside the same jitted step
under ``stop_gradient``. The drafter params are ``{"backbone", ["head"], ["mask_embedding"]}``
(``mask_embedding [H]``: our learned mask token for targets without a spare row, §9.15).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from domino_jax.config import DraftConfig
from domino_jax.models import dflash, domino_head
from domino_jax.models.qwen3 import TargetLM


def lambda_schedule(step, total_steps: int, lambda_start: float = 1.0,
                    decay_ratio: float = 1.0):
    """``clip(lambda_start * (1 - min(step / decay_steps, 1)), 0, 1)`` with
    ``decay_steps = max(1, int(total_steps * decay_ratio))`` (§3.4). ``step`` is the global
    optimizer step counted from 1; works on Python numbers and traced arrays."""
    decay_steps = max(1, int(total_steps * decay_ratio))
    frac = jnp.minimum(jnp.asarray(step, jnp.float32) / decay_steps, 1.0)
    return jnp.clip(lambda_start * (1.0 - frac), 0.0, 1.0)


def sample_anchors(key: jax.Array, loss_mask: jax.Array, num_anchors: int
                   ) -> tuple[jax.Array, jax.Array]:
    """Anchors ``[B, N]`` int32 (sorted, padded slots 0 at the end) and ``keep [B, N]`` bool.

    ``N = min(num_anchors, S - 1)`` (static). A row with ``v < N`` valid positions keeps all
    ``v``; otherwise ``N`` distinct valid positions chosen uniformly without replacement.
    """
    batch, seq_len = loss_mask.shape
    n = max(1, min(num_anchors, seq_len - 1))
    mask = loss_mask > 0
    valid = jnp.zeros_like(mask).at[:, :-1].set(mask[:, :-1] & mask[:, 1:])
    scores = jnp.where(valid, jax.random.uniform(key, (batch, seq_len)), -1.0)
    top_scores, top_idx = jax.lax.top_k(scores, n)                      # [B, N]
    keep = top_scores >= 0.0
    order_key = jnp.where(keep, top_idx, seq_len + jnp.arange(n)[None, :])
    order = jnp.argsort(order_key, axis=1)
    anchors = jnp.take_along_axis(jnp.where(keep, top_idx, 0), order, axis=1)
    keep = jnp.take_along_axis(keep, order, axis=1)
    return anchors.astype(jnp.int32), keep


def block_visibility(anchors: jax.Array, keep: jax.Array, seq_len: int, block_size: int
                     ) -> jax.Array:
    """Training attention mask, bool ``[B, N*Bk, S + N*Bk]``.

    Query rows are the ``N`` blocks' slots (block-major); key columns are the ``S`` context
    positions then the ``N*Bk`` block slots. Block ``j`` sees context ``t < a_j`` and its own
    block; a padded block (``keep=False``) sees nothing.
    """
    batch, n = anchors.shape
    block_of_query = jnp.repeat(jnp.arange(n), block_size)              # [N*Bk]
    query_anchor = anchors[:, block_of_query]                           # [B, N*Bk]
    query_keep = keep[:, block_of_query]
    ctx = jnp.arange(seq_len)[None, None, :] < query_anchor[:, :, None]
    same = block_of_query[:, None] == block_of_query[None, :]
    draft = jnp.broadcast_to(same[None], (batch, n * block_size, n * block_size))
    return jnp.concatenate([ctx, draft], axis=-1) & query_keep[:, :, None]


class TrainBackbone(dflash.DFlashBackbone):
    """:class:`~domino_jax.models.dflash.DFlashBackbone` (same parameter tree) with a
    training forward over all blocks of a sequence at once."""

    def train_hidden(self, context_features: jax.Array, block_embeds: jax.Array,
                     block_positions: jax.Array, visible: jax.Array) -> jax.Array:
        """``context_features [B, S, n*H]`` (positions ``0..S-1``), ``block_embeds
        [B, N*Bk, H]`` at ``block_positions [B, N*Bk]``, ``visible`` from
        :func:`block_visibility` -> final-normed ``draft_hidden [B, N*Bk, H]``."""
        batch, seq_len, _ = context_features.shape
        ctx = self.hidden_norm(self.fc(context_features.astype(self.dtype)))
        ctx_positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
        x = block_embeds.astype(self.dtype)
        for i, layer in enumerate(self.layers):
            x, _ = layer(x, ctx, ctx_positions, block_positions, visible, None, i)
        return self.norm(x)


def labels_and_weights(config: DraftConfig, input_ids: jax.Array, loss_mask: jax.Array,
                       anchors: jax.Array, keep: jax.Array, gamma: float
                       ) -> tuple[jax.Array, jax.Array]:
    """Labels ``[B, N, Bk]`` int32 and weights ``[B, N, Bk]`` float32 (§3.2 table).

    ``shift_label``: slot k predicts ``x_{a+1+k}``, weight ``exp(-k/gamma)``; otherwise slot k
    predicts ``x_{a+k}``, slot 0 excluded, weight ``exp(-(k-1)/gamma)``. Weights also carry
    ``keep``, ``[label position < S]`` and ``loss_mask`` at the label position.
    """
    seq_len = input_ids.shape[1]
    k = jnp.arange(config.block_size)
    shift = 1 if config.shift_label else 0
    pos = anchors[:, :, None] + shift + k[None, None, :]                # [B, N, Bk]
    inside = pos < seq_len
    safe = jnp.minimum(pos, seq_len - 1)
    gather = jax.vmap(lambda row, idx: row[idx])
    labels = gather(input_ids, safe)
    mask_at = gather(loss_mask, safe) > 0
    if config.shift_label:
        decay = jnp.exp(-k / gamma)
    else:
        decay = jnp.where(k >= 1, jnp.exp(-(k - 1) / gamma), 0.0)
    weights = (keep[:, :, None] & inside & mask_at) * decay[None, None, :]
    return labels.astype(jnp.int32), weights.astype(jnp.float32)


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


def target_context(target: TargetLM, target_params, config: DraftConfig,
                   input_ids: jax.Array) -> jax.Array:
    """Frozen target over ``input_ids [B, S]`` -> context features ``[B, S, n*H]``."""
    batch, seq_len = input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
    out = target.apply({"params": target_params}, input_ids, positions,
                       tap_ids=dflash.target_tap_ids(config), compute_logits=False)
    return jax.lax.stop_gradient(dflash.context_features(config, out.taps, out.hidden))


def draft_loss(draft_params: Any, target_params: Any, batch: dict, key: jax.Array,
               lam: jax.Array, *, target: TargetLM, config: DraftConfig, num_anchors: int,
               gamma: float, compute_dtype=jnp.bfloat16) -> tuple[jax.Array, dict]:
    """Loss and metrics on one micro-batch ``{"input_ids", "loss_mask"} [B, S]``.

    ``draft_params`` are cast to ``compute_dtype`` here (float32 masters outside).
    ``lam`` is the Domino curriculum weight (ignored for plain DFlash).
    Metrics: ``loss``, ``loss_base``, ``loss_final``, ``weight_sum``, per block slot
    ``correct [Bk]`` / ``count [Bk]`` (unweighted, slots with a nonzero weight).
    """
    input_ids = batch["input_ids"].astype(jnp.int32)
    loss_mask = batch["loss_mask"]
    bsz, seq_len = input_ids.shape
    bk = config.block_size
    target_params = jax.lax.stop_gradient(target_params)
    params = jax.tree_util.tree_map(lambda x: x.astype(compute_dtype), draft_params)

    features = target_context(target, target_params, config, input_ids)
    anchors, keep = sample_anchors(key, loss_mask, num_anchors)
    n = anchors.shape[1]
    offsets = jnp.arange(bk, dtype=jnp.int32)
    block_pos = (anchors[:, :, None] + offsets[None, None, :]).reshape(bsz, n * bk)
    anchor_tok = jnp.take_along_axis(input_ids, anchors, axis=1)        # [B, N]
    block_tok = jnp.where(offsets[None, None, :] == 0, anchor_tok[:, :, None],
                          config.mask_token_id).reshape(bsz, n * bk)
    embed = lambda t: target.apply({"params": target_params}, t, method=TargetLM.embed)
    block_embeds = embed(block_tok)
    if "mask_embedding" in params:
        is_mask = jnp.tile(offsets, n)[None, :, None] > 0
        block_embeds = jnp.where(is_mask, params["mask_embedding"].astype(block_embeds.dtype),
                                 block_embeds)
    visible = block_visibility(anchors, keep, seq_len, bk)
    backbone = TrainBackbone(config, dtype=compute_dtype, param_dtype=compute_dtype)
    hidden = backbone.apply({"params": params["backbone"]}, features, block_embeds, block_pos,
                            visible, method=TrainBackbone.train_hidden)
    hidden = hidden.reshape(bsz * n, bk, -1)
    base = target.apply({"params": target_params}, hidden, method=TargetLM.logits)

    labels, weights = labels_and_weights(config, input_ids, loss_mask, anchors, keep, gamma)
    labels, weights = labels.reshape(bsz * n, bk), weights.reshape(bsz * n, bk)
    denom = weights.sum() + 1e-6
    loss_base = (weights * _cross_entropy(base, labels)).sum() / denom
    if "head" in params:
        prev_pos = jnp.minimum(anchors[:, :, None] + offsets[None, None, :], seq_len - 1)
        prev_tok = jax.vmap(lambda row, idx: row[idx])(input_ids, prev_pos)
        prev_embeds = embed(prev_tok.reshape(bsz * n, bk))
        final = domino_head.teacher_forced_logits(params["head"], config, hidden, base,
                                                  prev_embeds)
        loss_final = (weights * _cross_entropy(final, labels)).sum() / denom
        loss = (1.0 - lam) * loss_final + lam * loss_base
        scored = final
    else:
        loss_final = loss_base
        loss = loss_base
        scored = base
    counted = weights > 0
    correct = (jnp.argmax(scored, axis=-1) == labels) & counted
    metrics = {"loss": loss, "loss_base": loss_base, "loss_final": loss_final,
               "weight_sum": weights.sum(), "correct": correct.sum(0).astype(jnp.float32),
               "count": counted.sum(0).astype(jnp.float32),
               "tokens": (loss_mask > 0).sum().astype(jnp.float32)}
    return loss, metrics


def init_draft_params(config: DraftConfig, rng: jax.Array, learn_mask_embedding: bool,
                      target_params: Any = None) -> dict:
    """Float32 drafter params ``{"backbone", ["head"], ["mask_embedding"]}``.

    ``mask_embedding`` starts at the mean of the target's embedding rows (when
    ``target_params`` is given, else zeros).
    """
    k_backbone, k_head = jax.random.split(rng)
    params = {"backbone": dflash.init_params(config, k_backbone, jnp.float32)}
    if config.has_domino_head:
        params["head"] = domino_head.init_head_params(config, k_head, jnp.float32)
    if learn_mask_embedding:
        if target_params is not None:
            table = target_params["embed_tokens"]["embedding"]
            params["mask_embedding"] = jnp.mean(table.astype(jnp.float32), axis=0)
        else:
            params["mask_embedding"] = jnp.zeros((config.hidden_size,), jnp.float32)
    return params
