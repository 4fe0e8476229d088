"""Per-row losses over the vocabulary without materialising ``[rows, V]`` logits
(docs/design.md §23).

The drafter's objective needs, for every trained block slot (a *row*), the divergence of its
base logits ``lm_head(z)`` from the label and, for a Domino drafter, of its final logits
``lm_head(z) + features @ W2``. Materialised whole, each is a ``[rows, V]`` float32 array
(rows = batch x anchors x block: 65,536 x 49,152 x 4 bytes = 12.9 GB at the SmolLM2
recipe), written and read several times forward and backward. :func:`row_losses` computes
them ``chunk_rows`` rows at a time inside a ``lax.map`` whose body is rematerialised
(``jax.checkpoint``): the backward pass recomputes a chunk's logits instead of keeping them,
so the loss's memory is a few chunks of logits whatever the batch. ``chunk_rows = 0`` runs
all rows as one chunk without rematerialisation (the materialised computation, same maths).

    out = row_losses(RowInputs(hidden, labels, features, corrected, target_hidden),
                     lm_head, w2, soft_weight=0.0, chunk_rows=4096)
    loss = (weights * out.final).sum() / weights.sum()
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

LMHead = Callable[[jax.Array], jax.Array]     # hidden [c, H] -> float32 logits [c, V]


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """``logsumexp(logits) - logits[label]`` per row (float32)."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


def kl_to_target(target_logp: jax.Array, logits: jax.Array) -> jax.Array:
    """``KL(target || draft)`` per row: ``sum_v p_t (log p_t - log_softmax(logits))``."""
    draft_logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.exp(target_logp) * (target_logp - draft_logp), axis=-1)


def slot_divergence(logits: jax.Array, labels: jax.Array, target_logp: jax.Array | None,
                    soft_weight: float) -> jax.Array:
    """Per-slot loss ``[...]``: ``(1 - w) CE(logits, labels) + w KL(target || softmax(logits))``
    with ``w = soft_weight`` (static: 0 = hard labels, 1 = soft labels, else a mix)."""
    out = 0.0
    if soft_weight < 1.0:
        out = (1.0 - soft_weight) * cross_entropy(logits, labels)
    if soft_weight > 0.0:
        out = out + soft_weight * kl_to_target(target_logp, logits)
    return out


@jax.custom_vjp
def joint_logits(hidden: jax.Array, features: jax.Array, lm_kernel: jax.Array,
                 w2: jax.Array) -> jax.Array:
    """The Domino final logits ``hidden @ lm_kernel + features @ w2`` as one matmul over the
    joined inputs ``[R, H + E] @ [H + E, V]`` (float32 accumulation and output; inputs in
    ``hidden.dtype``), so neither product is written as its own ``[R, V]`` array and added
    (docs/design.md §30). The head ``lm_kernel [H, V]`` is frozen: the backward pass gives it
    no gradient (and spends no matmul on one); ``hidden`` and ``features`` get theirs from one
    matmul, ``w2`` from ``features^T @ g``."""
    return _joint_forward(hidden, features, lm_kernel, w2)[0]


def _joined(hidden, features, lm_kernel, w2):
    dtype = hidden.dtype
    return (jnp.concatenate([hidden, features.astype(dtype)], axis=-1),
            jnp.concatenate([lm_kernel.astype(dtype), w2.astype(dtype)], axis=0))


def _joint_forward(hidden, features, lm_kernel, w2):
    x, w = _joined(hidden, features, lm_kernel, w2)
    out = jnp.einsum("rk,kv->rv", x, w, preferred_element_type=jnp.float32)
    return out, (hidden, features, lm_kernel, w2)


def _joint_backward(saved, g):
    hidden, features, lm_kernel, w2 = saved
    x, w = _joined(hidden, features, lm_kernel, w2)
    size = hidden.shape[-1]
    g = g.astype(x.dtype)
    dx = jnp.einsum("rv,kv->rk", g, w, preferred_element_type=jnp.float32)
    dw2 = jnp.einsum("re,rv->ev", x[:, size:], g, preferred_element_type=jnp.float32)
    return (dx[:, :size].astype(hidden.dtype), dx[:, size:].astype(features.dtype),
            None, dw2.astype(w2.dtype))


joint_logits.defvjp(_joint_forward, _joint_backward)


class RowInputs(NamedTuple):
    """What the loss needs of each row (``R`` rows, block-major order)."""

    hidden: jax.Array                   # [R, H] the draft's final-normed hidden
    labels: jax.Array                   # [R] int32 data tokens
    features: jax.Array | None = None   # [R, E] Domino correction features (None: DFlash)
    corrected: jax.Array | None = None  # [R] bool: the final logits add the correction
    target_hidden: jax.Array | None = None  # [R, H] target hidden giving the soft label


class RowOutputs(NamedTuple):
    """Per-row results, each ``[R]``."""

    base: jax.Array                     # float32 divergence of the base logits
    final: jax.Array                    # float32 divergence of the final logits (= base: DFlash)
    guess: jax.Array                    # int32 argmax of the final logits
    target_guess: jax.Array | None      # int32 argmax of the soft label (soft/mix only)


def _chunk(lm_head: LMHead, w2: jax.Array | None, soft_weight: float,
           lm_kernel: jax.Array | None, rows: RowInputs) -> RowOutputs:
    base = lm_head(rows.hidden)
    target_logp = None
    if soft_weight > 0.0:
        target_logp = jax.lax.stop_gradient(
            jax.nn.log_softmax(lm_head(rows.target_hidden).astype(jnp.float32), axis=-1))
    d_base = slot_divergence(base, rows.labels, target_logp, soft_weight)
    final, d_final = base, d_base
    if rows.features is not None:
        if lm_kernel is not None:            # one matmul, rows not corrected read no feature
            features = jnp.where(rows.corrected[:, None], rows.features, 0)
            final = joint_logits(rows.hidden, features, lm_kernel, w2)
        else:
            delta = jnp.einsum("re,ev->rv", rows.features, w2.astype(rows.features.dtype),
                               preferred_element_type=jnp.float32)
            final = jnp.where(rows.corrected[:, None], base + delta, base)
        d_final = slot_divergence(final, rows.labels, target_logp, soft_weight)
    guess = jnp.argmax(jax.lax.stop_gradient(final), axis=-1).astype(jnp.int32)
    target_guess = None
    if target_logp is not None:
        target_guess = jnp.argmax(target_logp, axis=-1).astype(jnp.int32)
    return RowOutputs(d_base, d_final, guess, target_guess)


def row_losses(rows: RowInputs, lm_head: LMHead, w2: jax.Array | None = None,
               soft_weight: float = 0.0, chunk_rows: int = 4096,
               lm_kernel: jax.Array | None = None) -> RowOutputs:
    """Per-row divergences (:func:`slot_divergence`) of the base and final logits and the
    final logits' argmax, ``chunk_rows`` rows at a time (see the module doc).

    ``lm_head`` maps ``[c, H]`` hidden to float32 ``[c, V]`` logits (the frozen target's
    head); ``w2 [E, V]``: the Domino correction's output projection (with
    ``rows.features``). ``soft_weight`` (static) as in :func:`slot_divergence`; its target
    distribution is ``log_softmax(lm_head(rows.target_hidden))``. Gradients flow to
    ``rows.hidden``, ``rows.features`` and ``w2``; the values and gradients equal the
    unchunked computation's up to float32 summation order. ``lm_kernel [H, V]`` (the head
    ``lm_head`` applies, as a matrix): the final logits come from :func:`joint_logits`, one
    matmul, instead of the base logits plus a correction product (the same values up to
    summation order, and the base logits' rounding to the compute dtype)."""
    if rows.features is not None and (w2 is None or rows.corrected is None):
        raise ValueError("row_losses: features need w2 and the corrected mask")
    if soft_weight > 0.0 and rows.target_hidden is None:
        raise ValueError("row_losses: soft labels need target_hidden")
    body = lambda r: _chunk(lm_head, w2, soft_weight, lm_kernel, r)
    total = rows.labels.shape[0]
    if chunk_rows <= 0 or chunk_rows >= total:
        return body(rows)
    num = -(-total // chunk_rows)
    pad = num * chunk_rows - total

    def split(x):
        if x is None:
            return None
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape((num, chunk_rows) + x.shape[1:])

    chunks = RowInputs(*(split(x) for x in rows))
    out = jax.lax.map(jax.checkpoint(body), chunks)
    return RowOutputs(*(None if x is None else x.reshape((num * chunk_rows,) + x.shape[2:])[:total]
                        for x in out))
