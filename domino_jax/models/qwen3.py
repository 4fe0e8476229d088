"""The target LM: Qwen3 (q/k RMSNorm), Llama family incl. SmolLM2, and Qwen2 (q/k/v bias).

Used as a pure function::

    model = TargetLM(config)                       # dtype bf16 by default
    out = model.apply({"params": params}, tokens, positions, cache=cache, tap_ids=(1, 9))
    out.logits [B, T, V] float32, out.taps (tap arrays [B, T, H]), out.cache (K/V written)

Parameter tree (mirrors HF names minus the ``model.`` prefix; layers are unrolled, one
subtree per layer, because a scan over stacked weights made the decode loop much slower on
GPUs): ``embed_tokens/embedding [V, H]``, ``layers_{i}/self_attn/
{q,k,v,o}_proj/kernel``, ``layers_{i}/self_attn/{q,k}_norm/weight``, ``layers_{i}/
{input,post_attention}_layernorm/weight``, ``layers_{i}/mlp/{gate,up,down}_proj/kernel``,
``norm/weight``, ``lm_head/kernel [H, V]`` (untied only).

Hidden-state taps follow HF ``output_hidden_states``: tap 0 is the embedding output, tap
``i + 1`` the output of decoder layer ``i`` (before the final norm).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from domino_jax.config import TargetConfig
from domino_jax.kv_cache import KVCache, key_visibility
from domino_jax.models.layers import DecoderLayerBase, RMSNorm

Dtype = Any


class TargetOutput(NamedTuple):
    logits: jax.Array | None      # [B, T or n, V] float32
    taps: tuple[jax.Array, ...]   # one [B, T, H] per requested tap id, in request order
    cache: KVCache | None         # K/V of the new tokens written; lengths unchanged
    hidden: jax.Array             # [B, T, H] final-normed hidden states


class DecoderLayer(DecoderLayerBase):
    """One target decoder layer (causal or tree-masked self-attention via ``visible``)."""

    def __call__(self, x, positions, visible, cache: KVCache | None, layer_index: int):
        """``x [B, T, H]`` -> ``(x', cache')``; K/V of the new tokens go into ``cache``."""
        h = self.input_layernorm(x)
        q, k, v = self.self_attn.qkv(h, positions)
        return self.finish(x, q, k, v, visible, cache, layer_index)


class TargetLM(nn.Module):
    config: TargetConfig
    dtype: Dtype = jnp.bfloat16
    param_dtype: Dtype = jnp.bfloat16
    attention_impl: str = "xla"     # attention over the KV cache: models.layers.attend

    def setup(self):
        c = self.config
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, **kw)
        self.layers = [DecoderLayer(c, attention_impl=self.attention_impl, **kw)
                       for _ in range(c.num_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, **kw)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Dense(c.vocab_size, use_bias=False, **kw)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Token embeddings ``[..., H]`` (no scaling)."""
        return self.embed_tokens(tokens)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """LM head on final-normed ``hidden [..., H]`` -> float32 logits ``[..., V]``."""
        if self.config.tie_word_embeddings:
            out = self.embed_tokens.attend(hidden.astype(self.dtype))
        else:
            out = self.lm_head(hidden.astype(self.dtype))
        return out.astype(jnp.float32)

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: KVCache | None = None,
                 block_mask: jax.Array | None = None, tap_ids: Sequence[int] = (),
                 logits_indices: jax.Array | None = None, compute_logits: bool = True
                 ) -> TargetOutput:
        """One forward over ``tokens [B, T]`` at ``positions [B, T]``.

        Args:
          cache: K/V of the committed prefix; the new tokens' K/V are written after it and
            ``cache.lengths`` is left unchanged (commit with ``cache.advance``). ``None``:
            no prefix, attention only among the new tokens.
          block_mask: bool ``[B, T, T]`` visibility among the new tokens (tree verify);
            ``None`` = causal.
          tap_ids: HF hidden-state indices to return (static).
          logits_indices: ``[B, n]`` token indices whose logits to compute (``None``: all).
          compute_logits: skip the LM head entirely when ``False``.
        """
        batch, length = tokens.shape
        x = self.embed(tokens)
        wanted = {int(t) for t in tap_ids}
        for t in wanted:
            if not 0 <= t <= self.config.num_layers:
                raise ValueError(f"tap id {t} out of range 0..{self.config.num_layers}")
        taps = {0: x} if 0 in wanted else {}
        if cache is None:
            visible = key_visibility(jnp.zeros((batch,), jnp.int32), length, length, block_mask)
        else:
            visible = key_visibility(cache.lengths, length, cache.capacity, block_mask)
        for i, layer in enumerate(self.layers):
            x, cache = layer(x, positions, visible, cache, i)
            if i + 1 in wanted:
                taps[i + 1] = x
        hidden = self.norm(x)
        logits = None
        if compute_logits:
            picked = hidden if logits_indices is None else jnp.take_along_axis(
                hidden, logits_indices[:, :, None], axis=1)
            logits = self.logits(picked)
        return TargetOutput(logits, tuple(taps[int(t)] for t in tap_ids), cache, hidden)


def init_params(config: TargetConfig, rng: jax.Array, dtype=jnp.float32) -> Any:
    """Random parameters (tests and benchmarks); real ones come from the converters."""
    model = TargetLM(config, dtype=dtype, param_dtype=dtype)
    tokens = jnp.zeros((1, 2), jnp.int32)
    return model.init(rng, tokens, jnp.zeros((1, 2), jnp.int32))["params"]


def param_shapes(config: TargetConfig, dtype=jnp.bfloat16) -> Any:
    """Parameter ``ShapeDtypeStruct`` tree without allocating (``jax.eval_shape``)."""
    model = TargetLM(config, dtype=dtype, param_dtype=dtype)
    tokens = jax.ShapeDtypeStruct((1, 2), jnp.int32)
    return jax.eval_shape(lambda t: model.init(jax.random.PRNGKey(0), t, t), tokens)["params"]


def new_cache(config: TargetConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> KVCache:
    return KVCache.create(config.num_layers, batch, capacity, config.num_kv_heads,
                          config.head_dim, dtype)
