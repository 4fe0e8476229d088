"""Attention of a few query rows over the KV cache: the TPU (Mosaic) variant of
:mod:`domino_jax.pallas.cache_attention`.

Same contract and maths as :func:`~domino_jax.pallas.cache_attention.cache_attention` (the
``[B, nKV, R, D]`` query tile per KV head, the int8 ``[B, R, S]`` mask, the online softmax
over key chunks, probabilities rounded to the value dtype before normalisation, chunks at or
past the last visible slot never read), laid out for a TPU:

* The cache ``[.., S, nKV, D]`` is read as ``[.., S, nKV * D]`` (a free reshape): one block of
  ``block_k`` slots holds every KV head (TPU blocks keep their last two dimensions whole or
  in (8, 128) tiles, so a single head's ``[S, D]`` slab of this layout is not a block);
  head ``h`` is the lane slice ``[h D, (h + 1) D)`` (lane-aligned when ``D`` is a multiple
  of 128).
* The grid is ``(B, chunks)``, run in order; the running max, sum and accumulator of every
  head live in VMEM scratch and the last chunk writes the normalised output, so there are
  no split partials to merge (a TPU core runs the grid sequentially; the Triton kernel
  splits to fill 132 SMs).
* ``kv_end [B]`` (one past the last visible slot) is a scalar-prefetch operand: chunks past
  it are skipped (``pl.when``) and their block index is clamped to the last visible chunk,
  so no DMA is issued for them either.

Tested in the Pallas interpreter against ``layers.attend_reference``
(``tests/test_head_kernels.py``) and lowered for ``tpu`` on the CPU
(``tests/test_kernel_lowering.py``); not run on a TPU yet.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from domino_jax.pallas.cache_attention import (MASK_VALUE, _from_rows, _mask_rows, _to_rows,
                                               key_end, supported)

BLOCK_K = 512          # key slots per chunk (a multiple of 128)


def tpu_block_k(num_keys: int, largest: int = BLOCK_K) -> int | None:
    """The largest multiple of 128 up to ``largest`` dividing ``num_keys`` (``None``: none)."""
    for block in range(largest - largest % 128, 0, -128):
        if num_keys % block == 0:
            return block
    return None


def tpu_supported(q_shape, k_shape) -> str | None:
    """``None`` if the TPU kernel takes ``q [B, T, nH, D]`` over ``k [B, S, nKV, D]``."""
    reason = supported(q_shape, k_shape)
    if reason is None and tpu_block_k(k_shape[1]) is None:
        reason = f"{k_shape[1]} key slots are not a multiple of 128"
    return reason


def _kernel(kv_end_ref, q_ref, k_ref, v_ref, mask_ref, out_ref, m_ref, l_ref, acc_ref, *,
            num_kv: int, head_dim: int, block_k: int, scale: float):
    """Grid step ``(b, c)``: blocks ``q [nKV, R, D]``, ``k, v [bk, nKV * D]``, ``mask [R,
    bk]`` int8; output ``[nKV, R, D]``; scratch ``m, l [nKV, R, 128]`` (lane-replicated),
    ``acc [nKV, R, D]`` float32."""
    b, c = pl.program_id(0), pl.program_id(1)

    @pl.when(c == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(c * block_k < kv_end_ref[b])
    def _chunk():
        visible = mask_ref[...] != 0                                         # [R, bk]
        for h in range(num_kv):
            lanes = slice(h * head_dim, (h + 1) * head_dim)
            q, k, v = q_ref[h], k_ref[:, lanes], v_ref[:, lanes]
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale  # [R, bk]
            s = jnp.where(visible, s, MASK_VALUE)
            m_prev = m_ref[h][:, :1]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_new)
            p = jnp.exp(s - m_new)
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)        # [R, D]
            acc_ref[h] = acc_ref[h] * alpha + pv
            l_new = l_ref[h][:, :1] * alpha + jnp.sum(p, axis=1, keepdims=True)
            m_ref[h] = jnp.broadcast_to(m_new, m_ref.shape[1:])
            l_ref[h] = jnp.broadcast_to(l_new, l_ref.shape[1:])

    @pl.when(c == pl.num_programs(1) - 1)
    def _out():
        out_ref[...] = (acc_ref[...] / l_ref[...][:, :, :1]).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("layer", "interpret", "block_k"))
def cache_attention_tpu(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array,
                        layer: int | None = None, interpret=False,
                        block_k: int = BLOCK_K) -> jax.Array:
    """Grouped-query attention over a cache with the Mosaic TPU kernel (module doc).

    Same arguments and result as :func:`domino_jax.pallas.cache_attention.cache_attention`
    (``k, v``: one layer ``[B, S, nKV, D]`` or, with ``layer``, the stacked ``[L, B, S, nKV,
    D]`` cache read in place). Raises ``ValueError`` when :func:`tpu_supported` rejects the
    shapes.
    """
    from jax.experimental.pallas import tpu as pltpu

    stacked = layer is not None
    layer_shape = k.shape[1:] if stacked else k.shape
    if stacked and not 0 <= layer < k.shape[0]:
        raise ValueError(f"cache_attention_tpu: layer {layer} out of range for a cache of "
                         f"{k.shape[0]} layers")
    reason = tpu_supported(q.shape, layer_shape)
    if reason is not None:
        raise ValueError(f"cache_attention_tpu: {reason}")
    batch, t_len, num_heads, head_dim = q.shape
    num_keys, num_kv = layer_shape[1], layer_shape[2]
    group = num_heads // num_kv
    rows = -(-t_len * group // 16) * 16                   # bf16 sublane tiles of 16 rows
    block_k = tpu_block_k(num_keys, block_k)
    chunks = num_keys // block_k
    flat = k.shape[:-2] + (num_kv * head_dim,)
    k, v = k.reshape(flat), v.reshape(flat)                # [.., S, nKV * D]: free

    def visible_chunk(b, c, kv_end):    # chunks past kv_end re-use the last visible block
        return jnp.minimum(c, lax.div(jnp.maximum(kv_end[b] - 1, 0), block_k))

    def kv_block(b, c, kv_end):
        chunk = visible_chunk(b, c, kv_end)
        return (layer, b, chunk, 0) if stacked else (b, chunk, 0)

    kv_shape = (None, None, block_k, num_kv * head_dim) if stacked else \
        (None, block_k, num_kv * head_dim)

    def mask_block(b, c, kv_end):
        return (b, 0, visible_chunk(b, c, kv_end))

    kernel = functools.partial(_kernel, num_kv=num_kv, head_dim=head_dim, block_k=block_k,
                               scale=float(head_dim) ** -0.5)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(batch, chunks),
        in_specs=[pl.BlockSpec((None, num_kv, rows, head_dim), lambda b, c, e: (b, 0, 0, 0)),
                  pl.BlockSpec(kv_shape, kv_block),
                  pl.BlockSpec(kv_shape, kv_block),
                  pl.BlockSpec((None, rows, block_k), mask_block)],
        out_specs=pl.BlockSpec((None, num_kv, rows, head_dim), lambda b, c, e: (b, 0, 0, 0)),
        scratch_shapes=[pltpu.VMEM((num_kv, rows, 128), jnp.float32),
                        pltpu.VMEM((num_kv, rows, 128), jnp.float32),
                        pltpu.VMEM((num_kv, rows, head_dim), jnp.float32)])
    out = pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((batch, num_kv, rows, head_dim), v.dtype),
        compiler_params=pltpu.CompilerParams(),       # grid axes in order ("arbitrary")
        interpret=interpret, name="cache_attention_tpu",
    )(key_end(visible), _to_rows(q, num_kv, rows), k, v, _mask_rows(visible, group, rows))
    return _from_rows(out, t_len, num_heads)
