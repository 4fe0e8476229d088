"""Exact top-k over a vocabulary-sized last axis, in two stages.

``jax.lax.top_k`` on a ``[..., V]`` array with ``V`` ~ 150k and ``k`` beyond the small-k
fast path is a sort of every row on GPUs. The builders and the candidate-pool head need the
top 8-64 tokens of 16 rows of ``V = 151936`` logits per round, and on GPUs those top-k
calls were the largest fixed cost of a tree build (docs/design.md §7).

Two stages, exact:

1. split each row into ``C`` chunks of ``S`` values (padded with ``-inf``) and take each
   chunk's maximum (one read of the row);
2. keep the ``k`` chunks with the largest maxima, re-sorted by chunk index, gather their
   ``k * S`` values and take the top ``k`` of those.

Why it is exact: the ``k`` chosen chunks each hold a value ``>= t`` (the ``k``-th largest
chunk maximum), so at least ``k`` values are ``>= t`` and every value of the true top ``k`` is
``>= t``; a chunk whose maximum is below ``t`` holds none of them. Gathering the chosen
chunks in ascending chunk order keeps ``lax.top_k``'s tie rule (equal values: lower index
first) except when chunk maxima tie exactly at the threshold ``t``.

:func:`top_k` picks the two-stage path only where it saves work (``k <= C``, ``V`` large);
otherwise it is ``jax.lax.top_k``. Both return ``(values, indices)`` like ``lax.top_k``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 128            # values per chunk (stage 1)
MIN_VOCAB = 8192       # below this, one lax.top_k is cheap enough
SMALL_K = 4            # k up to here: lax.top_k (two stages measured faster from k = 8
                       # on, k <= 4 not measured: docs/design.md §7)


def two_stage_top_k(x: jax.Array, k: int, chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """Exact top-``k`` of ``x [..., V]`` along the last axis via chunk maxima (module doc).
    Returns ``values [..., k]`` (dtype of ``x``) and ``indices [..., k]`` int32."""
    vocab = x.shape[-1]
    n_chunks = -(-vocab // chunk)
    if k > n_chunks:
        raise ValueError(f"two_stage_top_k needs k <= number of chunks ({n_chunks}), got {k}")
    pad = n_chunks * chunk - vocab
    if pad:
        fill = jnp.full(x.shape[:-1] + (pad,), -jnp.inf, x.dtype)
        x = jnp.concatenate([x, fill], axis=-1)
    chunks = x.reshape(x.shape[:-1] + (n_chunks, chunk))               # [..., C, S]
    _, best_chunks = jax.lax.top_k(jnp.max(chunks, axis=-1), k)         # [..., k]
    best_chunks = jnp.sort(best_chunks, axis=-1)                        # ascending index
    picked = jnp.take_along_axis(chunks, best_chunks[..., None], axis=-2)   # [..., k, S]
    values, flat = jax.lax.top_k(picked.reshape(picked.shape[:-2] + (k * chunk,)), k)
    chunk_of = jnp.take_along_axis(best_chunks, flat // chunk, axis=-1)
    return values, (chunk_of * chunk + flat % chunk).astype(jnp.int32)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k`` semantics (indices int32); two stages for large ``V`` and ``k``."""
    vocab = x.shape[-1]
    if vocab >= MIN_VOCAB and SMALL_K < k <= vocab // CHUNK:
        return two_stage_top_k(x, k)
    values, indices = jax.lax.top_k(x, k)
    return values, indices.astype(jnp.int32)
