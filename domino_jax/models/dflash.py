"""The DFlash block backbone (docs/algorithms.md §2.3), shared by DFlash and Domino drafters.

Used as a pure function::

    backbone = DFlashBackbone(draft_config)             # dtype bf16 by default
    draft_hidden, draft_cache = backbone.apply(
        {"params": params["backbone"]}, context_features, context_positions, context_lengths,
        block_embeds, block_positions, draft_cache)

* ``context_features [B, Tc, n*H]``: concatenation of the target's hidden taps
  ``hs[id + 1]`` for ``id`` in ``target_layer_ids`` of the *new* context tokens (the tokens
  committed since the previous draft call); only the first ``context_lengths[b]`` rows of
  row ``b`` are real, the rest is padding (invisible, never committed).
* ``block_embeds [B, Bk, H]``: the *target's* embeddings of the block ``[root, MASK, ...]``.
  The drafter has no embedding and no LM head of its own: the caller borrows the target's.
* ``ctx = RMSNorm(fc(context_features), hidden_norm)`` is shared by every layer: each layer
  projects it with its own ``k_proj``/``v_proj`` (+ ``k_norm``, RoPE at the context
  positions) and prepends it to the block's keys/values.
* Block queries attend **non-causally** to every committed cache slot, the real new context
  rows and the whole block.
* The draft cache keeps only context: per layer the K/V of the ``Tc`` new context rows are
  written at slots ``lengths .. lengths + Tc - 1`` and the block's K/V after them (slots
  ``lengths + Tc ..``, scratch); the returned cache has ``lengths += context_lengths``, so the
  block and the padding rows are beyond the committed length (invisible, overwritten later).
  Capacity must hold ``committed + Tc + Bk`` slots (writes past it are dropped).

Parameter tree (mirrors HF names, no ``model.`` prefix): ``fc/kernel [n*H, H]``,
``hidden_norm/weight [H]``, ``layers_{i}/{input_layernorm,post_attention_layernorm}/weight``,
``layers_{i}/self_attn/{q,k,v,o}_proj/kernel``, ``layers_{i}/self_attn/{q,k}_norm/weight``,
``layers_{i}/mlp/{gate,up,down}_proj/kernel``, ``norm/weight``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from domino_jax.config import DraftConfig
from domino_jax.kv_cache import KVCache
from domino_jax.models.layers import DecoderLayerBase, RMSNorm

Dtype = Any


def draft_key_visibility(committed_lengths: jax.Array, context_lengths: jax.Array,
                         context_rows: int, block_len: int, num_keys: int,
                         window: int | None = None, block_causal: bool = False,
                         key_slots: jax.Array | None = None) -> jax.Array:
    """Which key slots the block queries read: bool ``[B, block_len, num_keys]`` (or
    ``[B, block_len, L]`` over ``key_slots [B, L]``, the slots a windowed layer gathers).

    New keys sit at slots ``committed + u`` for ``u`` in ``0 .. context_rows + block_len - 1``
    (context rows first, then the block). Visible: every committed slot, the first
    ``context_lengths[b]`` context rows, and the whole block (non-causal). Every block query
    sees the same keys.

    ``window`` W (SpecForge's ``sliding_attention`` draft layers): block query ``j`` (at
    position ``p_j = start + j``) reads only the context within ``W`` positions of itself,
    ``p >= p_j - (W - 1)``, and the block keys ``j' >= j - (W - 1)``; ``block_causal``: block
    keys ``j' <= j`` only (SpecForge's and SGLang's default for sliding layers). The
    context is contiguous and ends right before the block, so positions follow from slots.
    """
    if key_slots is None:
        key_slots = jnp.arange(num_keys)[None, :]
    rel = key_slots - committed_lengths[:, None]                              # [B, S]
    is_context = (rel < 0) | ((rel >= 0) & (rel < context_lengths[:, None]))
    block_offset = rel - context_rows
    is_block = (block_offset >= 0) & (block_offset < block_len)
    batch = committed_lengths.shape[0]
    if window is None and not block_causal:
        visible = is_context | is_block
        return jnp.broadcast_to(visible[:, None, :], (batch, block_len, visible.shape[1]))
    query = jnp.arange(block_len)[None, :, None]                              # j
    context_visible = is_context[:, None, :]
    block_visible = is_block[:, None, :]
    if window is not None:
        # context position p_j - p = (context_len - rel) + j must be < W
        context_visible &= (rel - context_lengths[:, None])[:, None, :] >= query - (window - 1)
        block_visible &= block_offset[:, None, :] >= query - (window - 1)
    if block_causal:
        block_visible &= block_offset[:, None, :] <= query
    return context_visible | block_visible


class DraftLayer(DecoderLayerBase):
    """One Qwen3 decoder layer whose keys/values also include the shared context ``ctx``."""

    def __call__(self, x, ctx, context_positions, block_positions, visible,
                 cache: KVCache | None, layer_index: int, key_slots: jax.Array | None = None,
                 query_rows: int | None = None):
        """``x [B, Bk, H]`` block stream, ``ctx [B, Tc, H]`` shared context -> ``(x', cache')``.
        ``key_slots [B, L]``: attend over these cache slots only (a sliding window).
        ``query_rows``: only the first ``n`` block slots query (``x' [B, n, H]``); the keys
        and values are still every slot's (the last layer: see ``DFlashBackbone``)."""
        h = self.input_layernorm(x)
        rows = jnp.concatenate([ctx, h], axis=1)                          # [B, Tc + Bk, H]
        positions = jnp.concatenate([context_positions, block_positions], axis=1)
        # keys/values of context and block in one product, queries of the block only
        q, k, v = self.self_attn.qkv(rows, positions, q_from=ctx.shape[1])
        if query_rows is not None and query_rows < x.shape[1]:
            x, q, visible = x[:, :query_rows], q[:, :query_rows], visible[:, :query_rows]
        return self.finish(x, q, k, v, visible, cache, layer_index, key_slots)


class DFlashBackbone(nn.Module):
    """DFlash backbone: ``fc`` + ``hidden_norm`` over the taps, Qwen3 layers, final ``norm``.

    ``context_window`` (an inference option, not a checkpoint field): every layer reads at
    most the last ``W`` positions (a sliding window, :func:`draft_key_visibility`; the
    checkpoint's own sliding layers keep the smaller of the two windows). A windowed layer
    with a cache gathers only its ``W - 1 + Tc + Bk`` slots, so its attention cost stops
    growing with the context. When the whole context fits in the window the drafts equal
    the full-window drafts (``tests/test_draft_window.py``).
    """

    config: DraftConfig
    dtype: Dtype = jnp.bfloat16
    param_dtype: Dtype = jnp.bfloat16
    attention_impl: str = "xla"     # attention over the KV cache: models.layers.attend
    context_window: int | None = None

    def layer_windows(self) -> tuple[tuple[int | None, bool], ...]:
        """``(window, block_causal)`` of each layer: the checkpoint's sliding layers
        (window ``sliding_window``, causal in the block), capped by ``context_window``."""
        c = self.config
        views = []
        for i in range(c.num_layers):
            window = c.layer_window(i)
            if self.context_window is not None:
                window = self.context_window if window is None else min(window,
                                                                        self.context_window)
            views.append((window, c.layer_window(i) is not None))
        return tuple(views)

    def setup(self):
        c = self.config
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        self.fc = nn.Dense(c.hidden_size, use_bias=False, **kw)
        self.hidden_norm = RMSNorm(c.rms_norm_eps, **kw)
        self.layers = [DraftLayer(c, attention_impl=self.attention_impl, **kw)
                       for _ in range(c.num_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, **kw)

    def __call__(self, context_features: jax.Array, context_positions: jax.Array,
                 context_lengths: jax.Array, block_embeds: jax.Array,
                 block_positions: jax.Array, cache: KVCache | None = None,
                 output_rows: int | None = None) -> tuple[jax.Array, KVCache | None]:
        """One draft forward over a block.

        Args:
          context_features: ``[B, Tc, n*H]`` taps of the new context tokens (``Tc`` may be 0).
          context_positions: ``[B, Tc]`` int32 absolute positions of those tokens.
          context_lengths: ``[B]`` int32, real rows among the ``Tc`` (rest is padding).
          block_embeds: ``[B, Bk, H]`` target embeddings of ``[root, MASK, ...]``.
          block_positions: ``[B, Bk]`` int32 absolute positions of the block slots.
          cache: the draft cache of earlier context (``None``: no earlier context, nothing
            is stored).
          output_rows: static ``n <= Bk``: the hidden states of the first ``n`` block slots
            only. Every slot still feeds every layer's keys and values (the block attends
            non-causally), so these ``n`` equal the first ``n`` of the full output; the last
            layer's queries, ``o_proj`` and MLP run over ``n`` rows instead of ``Bk`` (a
            ``k``-draft round reads ``k`` of the 16 slots). ``None``: all ``Bk``.
        Returns:
          ``draft_hidden [B, n or Bk, H]`` (final-normed, ``dtype``; feed it to the target's
          LM head) and the cache with the new context committed (``lengths +=
          context_lengths``).
        """
        batch, context_rows, _ = context_features.shape
        block_len = block_embeds.shape[1]
        context_lengths = jnp.asarray(context_lengths, jnp.int32)
        ctx = self.hidden_norm(self.fc(context_features.astype(self.dtype)))   # [B, Tc, H]
        if cache is None:
            committed = jnp.zeros((batch,), jnp.int32)
            num_keys = context_rows + block_len
        else:
            committed = cache.lengths
            num_keys = cache.capacity
        views = {}                       # (window, block_causal) -> (visible, key_slots)
        for view in dict.fromkeys(self.layer_windows()):
            window, block_causal = view
            key_slots = None
            span = None if window is None else window - 1 + context_rows + block_len
            if cache is not None and span is not None and span < cache.capacity:
                low = jnp.maximum(committed + context_lengths - (window - 1), 0)
                key_slots = low[:, None] + jnp.arange(span, dtype=jnp.int32)[None, :]
            visible = draft_key_visibility(committed, context_lengths, context_rows,
                                           block_len, num_keys, window, block_causal,
                                           key_slots)
            if key_slots is not None:                     # slots past the capacity
                visible &= (key_slots < cache.capacity)[:, None, :]
            views[view] = (visible, key_slots)
        x = block_embeds.astype(self.dtype)
        last = len(self.layers) - 1
        for i, (layer, view) in enumerate(zip(self.layers, self.layer_windows())):
            visible, key_slots = views[view]
            x, cache = layer(x, ctx, context_positions, block_positions, visible, cache, i,
                             key_slots, output_rows if i == last else None)
        draft_hidden = self.norm(x)
        if cache is not None:
            cache = cache.advance(context_lengths)
        return draft_hidden, cache


def target_tap_ids(config: DraftConfig) -> tuple[int, ...]:
    """HF hidden-state indices the drafter reads: ``id + 1`` for each target layer id."""
    return tuple(i + 1 for i in config.target_layer_ids)


def context_features(config: DraftConfig, taps, final_hidden: jax.Array) -> jax.Array:
    """Concatenate target taps into the drafter's ``[B, T, n*H]`` context features.

    Args:
      taps: one ``[B, T, H]`` per entry of :func:`target_tap_ids`, pre-final-norm (as
        ``TargetLM(..., tap_ids=target_tap_ids(cfg))`` returns them).
      final_hidden: ``[B, T, H]`` the target's final-normed hidden states.
    HF ``output_hidden_states`` (which the reference drafters were trained on) replaces its
    *last* entry ``hs[num_layers]`` by the final-normed state, so a tap of the last target
    layer (``id == num_target_layers - 1``) reads ``final_hidden`` here.
    """
    chosen = [final_hidden if tap == config.num_target_layers else tap_value
              for tap, tap_value in zip(target_tap_ids(config), taps)]
    return jnp.concatenate(chosen, axis=-1)


def new_draft_cache(config: DraftConfig, batch: int, capacity: int,
                    dtype=jnp.bfloat16) -> KVCache:
    """Empty draft cache ``[layers, batch, capacity, kv_heads, head_dim]``.

    ``capacity`` must cover the longest context plus one round's ``Tc + block_size`` scratch.
    """
    return KVCache.create(config.num_layers, batch, capacity, config.num_kv_heads,
                          config.head_dim, dtype)


def _dummy_inputs(config: DraftConfig, make):
    n_h = config.num_taps * config.hidden_size
    return (make((1, 1, n_h), jnp.float32), make((1, 1), jnp.int32), make((1,), jnp.int32),
            make((1, 2, config.hidden_size), jnp.float32), make((1, 2), jnp.int32))


def init_params(config: DraftConfig, rng: jax.Array, dtype=jnp.float32) -> Any:
    """Random backbone parameters (tests and fresh training runs)."""
    model = DFlashBackbone(config, dtype=dtype, param_dtype=dtype)
    return jax.jit(model.init)(rng, *_dummy_inputs(config, jnp.zeros))["params"]


def param_shapes(config: DraftConfig, dtype=jnp.bfloat16) -> Any:
    """Backbone parameter ``ShapeDtypeStruct`` tree without allocating."""
    model = DFlashBackbone(config, dtype=dtype, param_dtype=dtype)
    inputs = _dummy_inputs(config, jax.ShapeDtypeStruct)
    return jax.eval_shape(lambda *a: model.init(jax.random.PRNGKey(0), *a), *inputs)["params"]
