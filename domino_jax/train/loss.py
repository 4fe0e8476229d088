"""The DFlash / Domino training objective (docs/algorithms.md §2.5, §3.2, §3.4, §9.10-9.12).

Per sequence ``x [S]`` with ``loss_mask [S]`` (response tokens):

* anchors: ``a`` valid iff ``loss_mask[a] & loss_mask[a+1]`` (``a <= S-2``); ``N`` sampled
  without replacement (random scores + ``top_k``), sorted, padded slots (``keep=False``)
  at the end with anchor 0;
* blocks ``[x_a, MASK x (B-1)]`` at positions ``a .. a+B-1``; the draft reads the frozen
  target's taps of all ``S`` positions as context, block ``j`` sees context keys
  ``t < a_j`` (strictly) and its own block (bidirectional); padded blocks see nothing;
* labels / weights per the ``shift_label`` table (§3.2) (``position_weights``: the paper's
  ``exp(-k/gamma)`` decay, or uniform); DFlash's loss on the base logits, Domino
  ``L = (1 - lambda) L_final + lambda L_base`` with teacher-forced final logits, both
  normalised by the same ``sum(w) + 1e-6``;
* the per-slot loss: hard labels (CE on the data's token), soft labels (``KL(target ||
  draft)`` with the frozen target's own next-token distribution at the predicted position,
  from the same target forward that gives the taps: no generation needed, so plain text with
  ``loss_mask`` all ones works) or a weighted mix (:func:`slot_divergence`).

The frozen target (embedding, mask row, taps, LM head) runs inside the same jitted step
under ``stop_gradient``. The drafter params are ``{"backbone", ["head"], ["mask_embedding"]}``
(``mask_embedding [H]``: an opt-in learned mask token, ``--learned-mask``; by default the
mask is the target's frozen embedding row ``mask_token_id``, as the reference code assumes,
§9.15). ``init_draft_params`` can seed the draft layers from target layers.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import flax.traverse_util
import jax
import jax.numpy as jnp

from domino_jax.config import DraftConfig
from domino_jax.models import dflash, domino_head
from domino_jax.models.qwen3 import TargetLM
from domino_jax.train.config import POSITION_WEIGHTS
from domino_jax.train.vocab_loss import RowInputs, row_losses, slot_divergence  # noqa: F401


def lambda_schedule(step, total_steps, lambda_start: float = 1.0,
                    decay_ratio: float = 1.0):
    """``clip(lambda_start * (1 - min(step / decay_steps, 1)), 0, 1)`` with
    ``decay_steps = max(1, floor(total_steps * decay_ratio))`` (§3.4). ``step`` is the global
    optimizer step counted from 1; both work as Python numbers and traced arrays."""
    decay_steps = jnp.maximum(1.0, jnp.floor(jnp.asarray(total_steps, jnp.float32)
                                             * decay_ratio))
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
        if any(w is not None for w, _ in self.layer_windows()):
            raise ValueError("training drafters with sliding-window layers (layer_types "
                             "'sliding_attention' or a context_window) is not supported")
        batch, seq_len, _ = context_features.shape
        ctx = self.hidden_norm(self.fc(context_features.astype(self.dtype)))
        ctx_positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
        x = block_embeds.astype(self.dtype)
        for i, layer in enumerate(self.layers):
            x, _ = layer(x, ctx, ctx_positions, block_positions, visible, None, i)
        return self.norm(x)


def label_positions(config: DraftConfig, anchors: jax.Array) -> jax.Array:
    """Sequence position ``[B, N, Bk]`` int32 of the token each block slot predicts:
    ``a + 1 + k`` (``shift_label``) or ``a + k`` (otherwise; slot 0 is not trained). The
    frozen target's distribution over that token is its logits row ``position - 1``."""
    shift = 1 if config.shift_label else 0
    k = jnp.arange(config.block_size, dtype=jnp.int32)
    return anchors[:, :, None].astype(jnp.int32) + shift + k[None, None, :]


def labels_and_weights(config: DraftConfig, input_ids: jax.Array, loss_mask: jax.Array,
                       anchors: jax.Array, keep: jax.Array, gamma: float,
                       position_weights: str = "decay") -> tuple[jax.Array, jax.Array]:
    """Labels ``[B, N, Bk]`` int32 and weights ``[B, N, Bk]`` float32 (§3.2 table).

    ``shift_label``: slot k predicts ``x_{a+1+k}``, weight ``exp(-k/gamma)``; otherwise slot k
    predicts ``x_{a+k}``, slot 0 excluded, weight ``exp(-(k-1)/gamma)``.
    ``position_weights="uniform"`` replaces the decay by 1 (same slots counted). Weights also
    carry ``keep``, ``[label position < S]`` and ``loss_mask`` at the label position.
    """
    if position_weights not in POSITION_WEIGHTS:
        raise ValueError(f"position_weights {position_weights!r}; choose one of "
                         f"{POSITION_WEIGHTS}")
    seq_len = input_ids.shape[1]
    k = jnp.arange(config.block_size)
    pos = label_positions(config, anchors)                              # [B, N, Bk]
    inside = pos < seq_len
    safe = jnp.minimum(pos, seq_len - 1)
    gather = jax.vmap(lambda row, idx: row[idx])
    labels = gather(input_ids, safe)
    mask_at = gather(loss_mask, safe) > 0
    first = 0 if config.shift_label else 1                              # first trained slot
    decay = jnp.exp(-(k - first) / gamma) if position_weights == "decay" else jnp.ones(k.shape)
    decay = jnp.where(k >= first, decay, 0.0)
    weights = (keep[:, :, None] & inside & mask_at) * decay[None, None, :]
    return labels.astype(jnp.int32), weights.astype(jnp.float32)


def target_forward(target: TargetLM, target_params, config: DraftConfig,
                   input_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Frozen target over ``input_ids [B, S]`` -> ``(context features [B, S, n*H], final-normed
    hidden [B, S, H])`` (the hidden feeds the soft labels; unused, XLA drops what it needs)."""
    batch, seq_len = input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
    out = target.apply({"params": target_params}, input_ids, positions,
                       tap_ids=dflash.target_tap_ids(config), compute_logits=False)
    features = dflash.context_features(config, out.taps, out.hidden)
    return jax.lax.stop_gradient(features), jax.lax.stop_gradient(out.hidden)


def target_context(target: TargetLM, target_params, config: DraftConfig,
                   input_ids: jax.Array) -> jax.Array:
    """Frozen target over ``input_ids [B, S]`` -> context features ``[B, S, n*H]``."""
    return target_forward(target, target_params, config, input_ids)[0]


class BlockFeatures(NamedTuple):
    """What the loss reads for one micro-batch, before any ``[.., V]`` product (rows
    ``B * N`` blocks, ``Bk`` slots)."""

    hidden: jax.Array                # [B*N, Bk, H] draft hidden (compute dtype)
    features: jax.Array | None       # [B*N, Bk, E] Domino correction features (None: DFlash)
    labels: jax.Array                # [B*N, Bk] int32 data tokens
    weights: jax.Array               # [B*N, Bk] float32
    target_hidden: jax.Array | None  # [B*N, Bk, H] the soft labels' target rows (soft/mix)


class BlockOutputs(NamedTuple):
    """The materialised logits of one micro-batch (rows ``B * N`` blocks, ``Bk`` slots)."""

    base: jax.Array                  # [B*N, Bk, V] float32 draft logits (target LM head)
    final: jax.Array | None          # [B*N, Bk, V] float32 Domino logits (teacher forced)
    labels: jax.Array                # [B*N, Bk] int32 data tokens
    weights: jax.Array               # [B*N, Bk] float32
    target_logp: jax.Array | None    # [B*N, Bk, V] float32 soft labels (soft/mix only)


def block_features(params: Any, target_params: Any, input_ids: jax.Array,
                   loss_mask: jax.Array, anchors: jax.Array, keep: jax.Array, *,
                   target: TargetLM, config: DraftConfig, gamma: float,
                   position_weights: str = "decay", soft: bool = False,
                   compute_dtype=jnp.bfloat16) -> BlockFeatures:
    """The drafter's hidden states (and Domino correction features) on all blocks of
    ``input_ids [B, S]`` at the given anchors ``[B, N]`` (``params`` already in
    ``compute_dtype``), with labels, weights and (``soft``) the target rows whose
    distribution is each slot's soft label, all from one frozen-target forward."""
    bsz, seq_len = input_ids.shape
    bk = config.block_size
    features, target_hidden = target_forward(target, target_params, config, input_ids)
    n = anchors.shape[1]
    offsets = jnp.arange(bk, dtype=jnp.int32)
    block_pos = (anchors[:, :, None] + offsets[None, None, :]).reshape(bsz, n * bk)
    anchor_tok = jnp.take_along_axis(input_ids, anchors, axis=1)        # [B, N]
    block_tok = jnp.where(offsets[None, None, :] == 0, anchor_tok[:, :, None],
                          config.mask_token_id).reshape(bsz, n * bk)
    embed = lambda t: target.apply({"params": target_params}, t, method=TargetLM.embed)
    block_embeds = embed(block_tok)
    if "mask_embedding" in params:                 # opt-in learned mask (--learned-mask)
        is_mask = jnp.tile(offsets, n)[None, :, None] > 0
        block_embeds = jnp.where(is_mask, params["mask_embedding"].astype(block_embeds.dtype),
                                 block_embeds)
    visible = block_visibility(anchors, keep, seq_len, bk)
    backbone = TrainBackbone(config, dtype=compute_dtype, param_dtype=compute_dtype)
    hidden = backbone.apply({"params": params["backbone"]}, features, block_embeds, block_pos,
                            visible, method=TrainBackbone.train_hidden)
    hidden = hidden.reshape(bsz * n, bk, -1)
    head_features = None
    if "head" in params:
        prev_pos = jnp.minimum(anchors[:, :, None] + offsets[None, None, :], seq_len - 1)
        prev_tok = jax.vmap(lambda row, idx: row[idx])(input_ids, prev_pos)
        prev_embeds = embed(prev_tok.reshape(bsz * n, bk))
        head_features = domino_head.teacher_forced_features(params["head"], config, hidden,
                                                            prev_embeds)
    labels, weights = labels_and_weights(config, input_ids, loss_mask, anchors, keep, gamma,
                                         position_weights)
    soft_rows = None
    if soft:          # slot k's soft label: the target's distribution from row p - 1
        rows = jnp.clip(label_positions(config, anchors) - 1, 0, seq_len - 1)
        soft_rows = jnp.take_along_axis(target_hidden, rows.reshape(bsz, n * bk)[:, :, None],
                                        axis=1)
        soft_rows = jax.lax.stop_gradient(soft_rows.reshape(bsz * n, bk, -1))
    return BlockFeatures(hidden, head_features, labels.reshape(bsz * n, bk),
                         weights.reshape(bsz * n, bk), soft_rows)


def block_outputs(params: Any, target_params: Any, input_ids: jax.Array, loss_mask: jax.Array,
                  anchors: jax.Array, keep: jax.Array, *, target: TargetLM,
                  config: DraftConfig, gamma: float, position_weights: str = "decay",
                  soft: bool = False, compute_dtype=jnp.bfloat16) -> BlockOutputs:
    """:func:`block_features` with the whole ``[B*N, Bk, V]`` logits materialised (the
    readable reference of what :func:`draft_loss` computes in row chunks)."""
    feats = block_features(params, target_params, input_ids, loss_mask, anchors, keep,
                           target=target, config=config, gamma=gamma,
                           position_weights=position_weights, soft=soft,
                           compute_dtype=compute_dtype)
    logits = lambda h: target.apply({"params": target_params}, h, method=TargetLM.logits)
    base = logits(feats.hidden)
    final = None
    if feats.features is not None:
        delta = jnp.einsum("nke,ev->nkv", feats.features,
                           params["head"]["embed_proj_2"]["kernel"].astype(feats.features.dtype),
                           preferred_element_type=jnp.float32)
        slots = jnp.arange(config.block_size)[None, :, None]
        final = jnp.where(slots >= config.suffix_start, base + delta, base)
    target_logp = None
    if soft:
        target_logp = jax.lax.stop_gradient(
            jax.nn.log_softmax(logits(feats.target_hidden).astype(jnp.float32), axis=-1))
    return BlockOutputs(base.astype(jnp.float32), final, feats.labels, feats.weights,
                        target_logp)


def draft_loss(draft_params: Any, target_params: Any, batch: dict, key: jax.Array,
               lam: jax.Array, *, target: TargetLM, config: DraftConfig, num_anchors: int,
               gamma: float, compute_dtype=jnp.bfloat16, soft_weight: float = 0.0,
               position_weights: str = "decay", chunk_rows: int = 4096,
               joint_final: bool = True) -> tuple[jax.Array, dict]:
    """Loss and metrics on one micro-batch ``{"input_ids", "loss_mask"} [B, S]``.

    ``draft_params`` are cast to ``compute_dtype`` here (float32 masters outside).
    ``lam`` is the Domino curriculum weight (ignored for plain DFlash): ``L = (1 - lam)
    L_final + lam L_base``. Each term is ``sum(w * d) / (sum(w) + 1e-6)`` with the per-slot
    ``d`` of :func:`slot_divergence` (``soft_weight`` 0: CE on the data's tokens; 1: KL from
    the target's own next-token distribution; between: the mix). The ``[rows, V]`` logits
    are computed ``chunk_rows`` block slots at a time and never stored whole
    (:func:`domino_jax.train.vocab_loss.row_losses`; 0 = one piece); ``joint_final``: a
    Domino drafter's final logits in one matmul with the head (docs/design.md §30; ``False``:
    base logits plus the correction, the reference).
    Metrics: ``loss``, ``loss_base``, ``loss_final``, ``weight_sum``, per block slot
    ``correct [Bk]`` / ``count [Bk]`` (argmax == data token, unweighted, slots with a nonzero
    weight), ``tokens``; with soft labels also ``acc_target`` (argmax == the target's argmax,
    what greedy verification accepts).
    """
    input_ids = batch["input_ids"].astype(jnp.int32)
    loss_mask = batch["loss_mask"]
    target_params = jax.lax.stop_gradient(target_params)
    params = jax.tree_util.tree_map(lambda x: x.astype(compute_dtype), draft_params)
    anchors, keep = sample_anchors(key, loss_mask, num_anchors)
    feats = block_features(params, target_params, input_ids, loss_mask, anchors, keep,
                           target=target, config=config, gamma=gamma,
                           position_weights=position_weights, soft=soft_weight > 0.0,
                           compute_dtype=compute_dtype)
    blocks, bk = feats.labels.shape
    flat = lambda x: None if x is None else x.reshape((blocks * bk,) + x.shape[2:])
    w2, corrected = None, None
    if feats.features is not None:
        w2 = params["head"]["embed_proj_2"]["kernel"]
        corrected = jnp.tile(jnp.arange(bk) >= config.suffix_start, blocks)
    lm_head = lambda h: target.apply({"params": target_params}, h, method=TargetLM.logits)
    out = row_losses(RowInputs(flat(feats.hidden), flat(feats.labels), flat(feats.features),
                               corrected, flat(feats.target_hidden)),
                     lm_head, w2, soft_weight, chunk_rows,
                     lm_kernel=head_kernel(target, target_params) if joint_final else None)
    weights = feats.weights
    denom = weights.sum() + 1e-6
    term = lambda d: (weights * d.reshape(blocks, bk)).sum() / denom
    loss_base = term(out.base)
    if feats.features is not None:
        loss_final = term(out.final)
        loss = (1.0 - lam) * loss_final + lam * loss_base
    else:
        loss_final = loss_base
        loss = loss_base
    counted = weights > 0
    correct = (out.guess.reshape(blocks, bk) == feats.labels) & counted
    metrics = {"loss": loss, "loss_base": loss_base, "loss_final": loss_final,
               "weight_sum": weights.sum(), "correct": correct.sum(0).astype(jnp.float32),
               "count": counted.sum(0).astype(jnp.float32),
               "tokens": (loss_mask > 0).sum().astype(jnp.float32)}
    if out.target_guess is not None:
        agree = (out.guess == out.target_guess).reshape(blocks, bk) & counted
        metrics["acc_target"] = agree.sum() / jnp.maximum(counted.sum(), 1)
    return loss, metrics


def head_kernel(target: TargetLM, target_params: Any) -> jax.Array:
    """The target's LM head as a matrix ``[H, V]`` (the tied embedding transposed, or the
    untied ``lm_head`` kernel): what :meth:`TargetLM.logits` multiplies by."""
    if target.config.tie_word_embeddings:
        return target_params["embed_tokens"]["embedding"].T
    return target_params["lm_head"]["kernel"]


INIT_FROM_TARGET_RULES = ("last", "spread")


def target_layers_for_init(num_target_layers: int, num_draft_layers: int, rule: str
                           ) -> tuple[int, ...]:
    """Which target decoder layers seed the draft layers (``--init-draft-from-target``).

    ``"last"``: the last ``L`` layers in order (``n-L .. n-1``): the draft's output feeds the
    target's final norm and LM head, as the target's last layers do. ``"spread"``: ``L``
    layers evenly spaced over the whole depth, first and last included
    (``round(i * (n - 1) / (L - 1))``; ``L = 1``: the last layer).
    """
    n, count = num_target_layers, num_draft_layers
    if count > n:
        raise ValueError(f"cannot seed {count} draft layers from a {n}-layer target")
    if rule == "last":
        return tuple(range(n - count, n))
    if rule == "spread":
        if count == 1:
            return (n - 1,)
        return tuple(int(round(i * (n - 1) / (count - 1))) for i in range(count))
    raise ValueError(f"init from target rule {rule!r}; choose one of {INIT_FROM_TARGET_RULES}")


def copy_target_layers(backbone: dict, target_params: Any, layer_ids: Sequence[int]) -> dict:
    """``backbone`` with draft layer ``i`` = target layer ``layer_ids[i]`` (every weight of the
    same name and shape: norms, q/k/v/o, MLP; a Llama target has no q/k norm, those stay at
    their init) and the final ``norm`` = the target's final norm. ``fc`` and ``hidden_norm``
    keep their init. Float32 copies; a shape mismatch (e.g. another intermediate size) is an
    error naming the leaf."""
    out = dict(backbone)
    for i, t in enumerate(layer_ids):
        source = flax.traverse_util.flatten_dict(target_params[f"layers_{t}"])
        layer = flax.traverse_util.flatten_dict(backbone[f"layers_{i}"])
        for name, value in layer.items():
            if name not in source:
                continue
            if tuple(source[name].shape) != tuple(value.shape):
                raise ValueError(f"draft layer {i} {'/'.join(name)} has shape {value.shape}, "
                                 f"target layer {t} has {source[name].shape}")
            layer[name] = jnp.asarray(source[name], jnp.float32)
        out[f"layers_{i}"] = flax.traverse_util.unflatten_dict(layer)
    out["norm"] = {"weight": jnp.asarray(target_params["norm"]["weight"], jnp.float32)}
    return out


def init_draft_params(config: DraftConfig, rng: jax.Array, learn_mask_embedding: bool,
                      target_params: Any = None, init_from_target: str = "none") -> dict:
    """Float32 drafter params ``{"backbone", ["head"], ["mask_embedding"]}``.

    ``init_from_target``: ``"none"`` (random), or a rule of :func:`target_layers_for_init`
    to copy target layers into the backbone (needs ``target_params``).
    ``mask_embedding`` (``learn_mask_embedding``, opt-in) starts at the mean of the target's
    embedding rows (when ``target_params`` is given, else zeros).
    """
    k_backbone, k_head = jax.random.split(rng)
    params = {"backbone": dflash.init_params(config, k_backbone, jnp.float32)}
    if init_from_target != "none":
        if target_params is None:
            raise ValueError("init_from_target needs the target's params")
        ids = target_layers_for_init(config.num_target_layers, config.num_layers,
                                     init_from_target)
        params["backbone"] = copy_target_layers(params["backbone"], target_params, ids)
    if config.has_domino_head:
        params["head"] = domino_head.init_head_params(config, k_head, jnp.float32)
    if learn_mask_embedding:
        if target_params is not None:
            table = target_params["embed_tokens"]["embedding"]
            params["mask_embedding"] = jnp.mean(table.astype(jnp.float32), axis=0)
        else:
            params["mask_embedding"] = jnp.zeros((config.hidden_size,), jnp.float32)
    return params
