"""Chain verification: how many drafted tokens the target accepts, and the bonus token.

Both rules are lossless: every committed token follows the processed target distribution
given the committed prefix (algorithms.md §2.4 and §9.3).

* ``match`` (the references' rule): sample the target at every verified position and
  accept drafts while they equal the target's own samples; the bonus is the target's
  sample at the first mismatch (or after the last draft).
* ``rejection`` (Leviathan et al. speculative sampling): accept draft ``d_i`` with
  probability ``min(1, p_i(d_i) / q_i(d_i))`` where ``q_i`` is the distribution the draft
  was drawn from; at the first rejection sample from ``normalise(max(p_i - q_i, 0))``;
  if all drafts are accepted, the bonus comes from ``p_K``. With sampled drafts it accepts
  with probability ``1 - TV(p, q)``, never less than ``match``.

Shapes: ``drafts [B, K]``, ``target_log_probs [B, K + 1, V]`` (processed target
distribution at the K+1 verified positions: root, d_1..d_K), ``draft_log_probs [B, K, V]``.
Returns ``(accepted [B] int32 in 0..K, bonus [B] int32)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _leading_true(flags: jax.Array) -> jax.Array:
    """Number of leading ``True`` per row of ``flags [B, K]``."""
    return jnp.sum(jnp.cumprod(flags.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def verify_match(key: jax.Array, drafts: jax.Array, target_log_probs: jax.Array):
    """Sample the target at every position; accept while the drafts equal the samples."""
    samples = jax.random.categorical(key, target_log_probs, axis=-1).astype(jnp.int32)  # [B, K+1]
    accepted = _leading_true(drafts == samples[:, :-1])
    bonus = jnp.take_along_axis(samples, accepted[:, None], axis=1)[:, 0]
    return accepted, bonus


def verify_rejection(key: jax.Array, drafts: jax.Array, target_log_probs: jax.Array,
                     draft_log_probs: jax.Array):
    """Speculative (rejection) sampling against the draft's own distribution."""
    batch, num_drafts = drafts.shape
    accept_key, residual_key = jax.random.split(key)
    p = jnp.exp(target_log_probs)                                       # [B, K+1, V]
    q = jnp.exp(draft_log_probs)                                        # [B, K, V]
    p_draft = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    uniform = jax.random.uniform(accept_key, (batch, num_drafts))
    accept = uniform * q_draft < p_draft                                # u < p/q, no division
    accepted = _leading_true(accept)
    q_padded = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)   # index K: residual = p_K
    p_at = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]
    q_at = jnp.take_along_axis(q_padded, accepted[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_at - q_at, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 0, residual, p_at)                      # p == q: fall back to p
    bonus = jax.random.categorical(residual_key, jnp.log(residual), axis=-1).astype(jnp.int32)
    return accepted, bonus
