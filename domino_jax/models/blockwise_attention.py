"""Flash-style (blockwise, online-softmax) grouped-query attention in plain XLA ops.

:func:`attend_blockwise` is what a long prefill chunk attends with
(``attend(implementation="blockwise")``): it walks the keys in blocks of ``key_block``
slots, keeping a running maximum, normaliser and weighted sum per query row, so the largest
intermediate is one block's scores ``[B, nKV, nH / nKV, T, key_block]`` (float32) instead
of the whole ``[B, nH, T, S]`` score matrix. Key blocks past the last slot any row can see
are never visited (a ``lax.fori_loop`` with a traced trip count), so a causal chunk over a
mostly empty cache costs what its visible keys cost.

Same contract and maths as :func:`domino_jax.models.layers.attend_reference` (scores and
softmax statistics in float32, scale ``D ** -0.5`` after the product, masked scores at the
finite :data:`~domino_jax.models.layers.MASK_VALUE`, a row with no visible key gets the
uniform average of all ``S`` values); only the summation order differs (float32 outputs
agree to rounding, ``tests/test_long_prompts.py``). The unnormalised probabilities are cast
to the value dtype before their product with the values, as the reference casts the
normalised ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KEY_BLOCK = 512   # key slots per step (a multiple of the cache's 64-slot alignment)


def attend_blockwise(q: jax.Array, keys: jax.Array, values: jax.Array, visible: jax.Array,
                     mask_value: float, layer: int | None = None,
                     key_block: int = KEY_BLOCK) -> jax.Array:
    """Grouped-query attention over key blocks with an online softmax.

    Args:
      q: ``[B, T, nH, D]`` queries (rotated).
      keys, values: ``[B, S, nKV, D]``, or a stacked cache ``[L, B, S, nKV, D]`` with
        ``layer`` naming the layer to read (sliced per key block, never copied whole).
      visible: bool ``[B, T, S]``, ``True`` where query t may read key s.
      mask_value: the finite score of a masked key (``layers.MASK_VALUE``).
      key_block: key slots per step (clipped to ``S``). When ``S`` is not a multiple, the
        last block starts at ``S - key_block`` and its slots already visited are skipped.
    Returns:
      ``[B, T, nH, D]`` in ``values.dtype``.
    """
    stacked = layer is not None
    batch, q_len, num_heads, head_dim = q.shape
    num_keys, num_kv = keys.shape[-3], keys.shape[-2]
    group = num_heads // num_kv
    block = min(key_block, num_keys)
    max_blocks = -(-num_keys // block)
    # Visit blocks up to the last slot any row sees; a row that sees nothing needs every
    # block (its output is the average of all S values, as in the reference).
    slot = jnp.arange(num_keys, dtype=jnp.int32)
    last_seen = jnp.max(jnp.where(jnp.any(visible, axis=(0, 1)), slot, -1))
    last_seen = jnp.where(jnp.all(jnp.any(visible, axis=2)), last_seen, num_keys - 1)
    num_blocks = jnp.clip(last_seen // block + 1, 1, max_blocks)

    qg = jnp.transpose(q.reshape(batch, q_len, num_kv, group, head_dim), (0, 2, 3, 1, 4))
    scale = head_dim ** -0.5

    def key_slice(cache, start):
        if stacked:
            return jax.lax.dynamic_slice_in_dim(cache[layer], start, block, axis=1)
        return jax.lax.dynamic_slice_in_dim(cache, start, block, axis=1)

    def step(j, carry):
        run_max, run_sum, acc = carry
        start = jnp.minimum(j * block, num_keys - block)
        k_blk, v_blk = key_slice(keys, start), key_slice(values, start)   # [B, Kb, nKV, D]
        vis = jax.lax.dynamic_slice_in_dim(visible, start, block, axis=2)  # [B, T, Kb]
        fresh = start + jnp.arange(block) >= j * block       # not visited by an earlier block
        scores = jnp.einsum("bkgtd,bskd->bkgts", qg, k_blk,
                            preferred_element_type=jnp.float32) * scale
        scores = jnp.where(vis[:, None, None], scores, mask_value)
        scores = jnp.where(fresh, scores, -jnp.inf)
        new_max = jnp.maximum(run_max, scores.max(axis=-1))
        correction = jnp.exp(run_max - new_max)
        probs = jnp.exp(scores - new_max[..., None])
        run_sum = run_sum * correction + probs.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum(
            "bkgts,bskd->bkgtd", probs.astype(v_blk.dtype), v_blk,
            preferred_element_type=jnp.float32)
        return new_max, run_sum, acc

    stats = (batch, num_kv, group, q_len)
    init = (jnp.full(stats, mask_value, jnp.float32), jnp.zeros(stats, jnp.float32),
            jnp.zeros(stats + (head_dim,), jnp.float32))
    _, run_sum, acc = jax.lax.fori_loop(0, num_blocks, step, init)
    out = acc / run_sum[..., None]                                     # [B, nKV, G, T, D]
    out = jnp.moveaxis(out, 3, 1).reshape(batch, q_len, num_heads, head_dim)
    return out.astype(values.dtype)
