"""Attention of a few query rows over the KV cache: a split-K Pallas kernel (decode/verify).

Backend: **Pallas Triton** (``jax.experimental.pallas.triton``), jax pinned at 0.11.2. jax 0.11
deprecates that backend in favour of Mosaic GPU; it still lowers and runs on CUDA GPUs there.
Moving to Mosaic GPU (or ``jax_triton``) is the upgrade path when the pin moves.

What it computes: exactly :func:`domino_jax.models.layers.attend_reference` (grouped-query
attention, scores and softmax in float32, masked scores set to the finite ``MASK_VALUE``) for
every query row with at least one visible key, in the flash form:

* The query rows of one KV head, ``T`` positions x ``G = nH / nKV`` heads, are one ``[R, D]``
  tile (``R``: ``T * G`` padded to a power of two, at least 16, what Triton's ``dot`` needs).
* The keys ``[0, S)`` are cut into ``num_splits`` runs of whole ``block_k`` chunks; one program
  per (batch row, KV head, run) streams its chunks with an online softmax and writes a
  float32 partial (running max ``m``, sum ``l``, unnormalised ``acc``). Grid
  ``B x nKV x num_splits``: about :data:`TARGET_PROGRAMS` programs, so a one-token decode at
  batch 1 still fills the GPU (one program per head would use 8 of 132 SMs).
* Chunks at or past ``kv_end[b]`` (the last visible slot + 1 of row ``b``, from ``visible``)
  are never read: the unused capacity of the cache costs nothing.
* With ``layer=`` the kernel reads one layer of the stacked ``[L, B, S, nKV, D]`` cache in
  place (a layer slice given to a custom call is first copied out by XLA).
* :func:`combine_partials` (plain XLA: a few small fusions) merges the runs.

Status: opt-in; why, and what remains to measure: ``docs/design.md`` §4.

Differences from the reference, all in the last bits: probabilities are rounded to the value
dtype before normalisation (the reference rounds after), and the sum over keys runs in chunk
order. A row with *no* visible key gets the average over the keys the kernel read (the
reference: over all ``S``); no caller builds such a row (every query sees itself).

Plain-JAX reference: :func:`cache_attention_reference` (the same blocked online softmax as a
``lax.scan``, any backend) and ``models.layers.attend_reference`` (the maths). The switch that
picks this kernel is ``models.layers.attend(..., implementation=)``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from domino_jax.kv_cache import MASK_VALUE
TARGET_PROGRAMS = 512     # programs per call the splits aim for (a GPU of ~100-150 SMs)


def query_rows(num_queries: int, group: int) -> int:
    """Rows of the query tile: ``T * G`` rounded up to a power of two, at least 16."""
    return max(16, 1 << (num_queries * group - 1).bit_length())


def pick_block_k(num_keys: int, largest: int = 64) -> int | None:
    """The key chunk: the largest power of two from ``largest`` down to 16 dividing
    ``num_keys`` (``None``: none does)."""
    block = largest
    while block >= 16:
        if num_keys % block == 0:
            return block
        block //= 2
    return None


def plan_splits(num_keys: int, block_k: int, batch: int, num_kv_heads: int,
                target_programs: int = TARGET_PROGRAMS) -> tuple[int, int]:
    """``(num_splits, chunks_per_split)`` for ``num_keys / block_k`` chunks.

    Aims at ``target_programs`` programs over ``batch * num_kv_heads * num_splits``; the
    last run may hold fewer chunks.
    """
    chunks = num_keys // block_k
    wanted = max(1, min(chunks, -(-target_programs // (batch * num_kv_heads))))
    per_split = -(-chunks // wanted)
    return -(-chunks // per_split), per_split


MAX_ROWS = 256            # query rows per KV head the kernel takes (decode, verify, draft block)


def too_many_rows(q_shape, k_shape) -> bool:
    """Whether ``T * G`` query rows exceed :data:`MAX_ROWS` (a prefill: not this kernel's job)."""
    return q_shape[1] * (q_shape[2] // max(1, k_shape[2])) > MAX_ROWS


def supported(q_shape, k_shape) -> str | None:
    """``None`` if the kernel takes these shapes, else the reason it does not."""
    _, t_len, num_heads, head_dim = q_shape
    _, num_keys, num_kv, _ = k_shape
    if num_heads % num_kv:
        return f"{num_heads} query heads are not a multiple of {num_kv} KV heads"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head dim {head_dim} is not a power of two >= 16"
    if pick_block_k(num_keys) is None:
        return f"{num_keys} key slots are not a multiple of 16"
    if too_many_rows(q_shape, k_shape):
        return (f"{t_len} queries x {num_heads // num_kv} heads per KV head exceed "
                f"{MAX_ROWS} rows")
    return None


def key_end(visible: jax.Array) -> jax.Array:
    """``[B]`` int32: one past the last key slot any query of row ``b`` may read."""
    num_keys = visible.shape[-1]
    seen = jnp.any(visible, axis=1)                                          # [B, S]
    return jnp.max(jnp.where(seen, jnp.arange(1, num_keys + 1), 0), axis=-1).astype(jnp.int32)


class Plan(NamedTuple):
    """How one call is cut up (static, from the shapes)."""

    batch: int
    t_len: int
    num_heads: int
    head_dim: int
    num_keys: int
    num_kv: int
    group: int          # query heads per KV head
    rows: int           # query tile rows R
    block_k: int        # key chunk
    num_splits: int     # runs of chunks per (batch row, KV head)
    per_split: int      # chunks per run (the last run may hold fewer)


def make_plan(who: str, q_shape, k_shape, target_programs: int = TARGET_PROGRAMS,
              block_k: int = 64) -> Plan:
    """The :class:`Plan` for ``q [B, T, nH, D]`` over ``k [B, S, nKV, D]``; raises
    ``ValueError`` (prefixed with ``who``) when :func:`supported` rejects the shapes."""
    reason = supported(q_shape, k_shape)
    if reason is not None:
        raise ValueError(f"{who}: {reason}")
    batch, t_len, num_heads, head_dim = q_shape
    num_keys, num_kv = k_shape[1], k_shape[2]
    group = num_heads // num_kv
    block_k = pick_block_k(num_keys, block_k)
    num_splits, per_split = plan_splits(num_keys, block_k, batch, num_kv, target_programs)
    return Plan(batch, t_len, num_heads, head_dim, num_keys, num_kv, group,
                query_rows(t_len, group), block_k, num_splits, per_split)


def _to_rows(q: jax.Array, num_kv: int, rows: int) -> jax.Array:
    """``q [B, T, nH, D]`` -> ``[B, nKV, R, D]``: row ``t * G + g`` is query t, head g of the group."""
    batch, t_len, num_heads, head_dim = q.shape
    group = num_heads // num_kv
    q = q.reshape(batch, t_len, num_kv, group, head_dim).transpose(0, 2, 1, 3, 4)
    q = q.reshape(batch, num_kv, t_len * group, head_dim)
    return jnp.pad(q, ((0, 0), (0, 0), (0, rows - t_len * group), (0, 0)))


def _mask_rows(visible: jax.Array, group: int, rows: int) -> jax.Array:
    """``visible [B, T, S]`` -> int8 ``[B, R, S]`` in the row order of :func:`_to_rows`."""
    mask = jnp.repeat(visible.astype(jnp.int8), group, axis=1)
    return jnp.pad(mask, ((0, 0), (0, rows - mask.shape[1]), (0, 0)))


def _from_rows(out: jax.Array, t_len: int, num_heads: int) -> jax.Array:
    """``[B, nKV, R, D]`` -> ``[B, T, nH, D]`` (inverse of :func:`_to_rows`)."""
    batch, num_kv, _, head_dim = out.shape
    group = num_heads // num_kv
    out = out[:, :, :t_len * group].reshape(batch, num_kv, t_len, group, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(batch, t_len, num_heads, head_dim)


def combine_partials(acc: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Merge split partials: ``acc [..., N, R, D]``, ``m, l [..., N, R]`` -> ``[..., R, D]`` f32.

    Runs that read no chunk carry ``m = -inf, l = 0`` and get weight 0.
    """
    m_all = jnp.max(m, axis=-2, keepdims=True)
    weight = jnp.exp(m - m_all)                                    # [..., N, R]
    total = jnp.sum(l * weight, axis=-2)                           # [..., R]
    out = jnp.sum(acc * weight[..., None], axis=-3)                # [..., R, D]
    return out / total[..., None]


def _kernel(kv_end_ref, q_ref, k_ref, v_ref, mask_ref, acc_ref, m_ref, l_ref, *,
            block_k: int, chunks: int, per_split: int, scale: float):
    """One (batch row, KV head, run): refs ``q [R, D]``, ``k, v [S, D]``, ``mask [R, S]``."""
    split = pl.program_id(2)
    first = split * per_split
    in_run = jnp.minimum(per_split, chunks - first)
    visible_chunks = (kv_end_ref[()] + block_k - 1) // block_k - first
    count = jnp.clip(visible_chunks, 0, in_run)
    q = q_ref[...]
    rows, head_dim = q.shape

    def body(i, carry):
        acc, m, l = carry
        keys = pl.ds((first + i) * block_k, block_k)
        k, v, visible = k_ref[keys, :], v_ref[keys, :], mask_ref[:, keys]   # loads in flight
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * scale      # [R, bk]
        s = jnp.where(visible != 0, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)           # [R, D]
        return acc * alpha[:, None] + pv, m_new, l * alpha + jnp.sum(p, axis=1)

    init = (jnp.zeros((rows, head_dim), jnp.float32),
            jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32))
    acc, m, l = lax.fori_loop(0, count, body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l



@functools.partial(jax.jit, static_argnames=("layer", "interpret", "target_programs",
                                             "block_k", "num_warps"))
def cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array,
                    layer: int | None = None, interpret: bool = False,
                    target_programs: int = TARGET_PROGRAMS, block_k: int = 64,
                    num_warps: int = 4) -> jax.Array:
    """Grouped-query attention over a cache with the Pallas kernel (see module doc).

    Args:
      q: ``[B, T, nH, D]`` rotated queries; ``visible``: bool ``[B, T, S]``.
      k, v: ``[B, S, nKV, D]``, or with ``layer`` the whole stacked cache ``[L, B, S, nKV,
        D]`` (``KVCache.keys``), of which the kernel reads layer ``layer`` in place. Prefer
        the stacked form: a layer slice handed to a custom call is first copied out by XLA
        (two copies per layer, seen in a profile: ``docs/design.md`` §4).
      layer: static index into the stacked cache (``None``: ``k, v`` are one layer).
      interpret: run the kernel in the Pallas interpreter (any backend; tests on the CPU).
      target_programs, block_k, num_warps: tuning (``docs/design.md`` §4);
        ``block_k`` is the largest chunk tried, smaller powers of two are used when it does
        not divide ``S``.
    Returns ``[B, T, nH, D]`` in ``v.dtype``. Raises ``ValueError`` with the reason when
    :func:`supported` rejects the shapes.
    """
    layer_shape = k.shape if layer is None else k.shape[1:]
    if layer is not None and not 0 <= layer < k.shape[0]:
        raise ValueError(f"cache_attention: layer {layer} out of range for a cache of "
                         f"{k.shape[0]} layers")
    plan = make_plan("cache_attention", q.shape, layer_shape, target_programs, block_k)
    from jax.experimental.pallas import triton as plgpu

    batch, t_len, num_heads, head_dim, num_keys, num_kv, group, rows, block_k, num_splits, \
        per_split = plan
    kernel = functools.partial(_kernel, block_k=block_k, chunks=num_keys // block_k,
                               per_split=per_split, scale=float(head_dim) ** -0.5)
    part = (batch, num_kv, num_splits, rows)
    if layer is None:          # one layer [B, S, nKV, D]: the (b, h) slab of every slot
        kv_spec = pl.BlockSpec((None, num_keys, None, head_dim), lambda b, h, s: (b, 0, h, 0))
    else:                      # stacked [L, B, S, nKV, D]: the same slab of layer ``layer``
        kv_spec = pl.BlockSpec((None, None, num_keys, None, head_dim),
                               lambda b, h, s: (layer, b, 0, h, 0))
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(batch, num_kv, num_splits),
        in_specs=[
            pl.BlockSpec((None,), lambda b, h, s: (b,)),
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
            kv_spec,
            kv_spec,
            pl.BlockSpec((None, rows, num_keys), lambda b, h, s: (b, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct(part + (head_dim,), jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="cache_attention",
    )(key_end(visible), _to_rows(q, num_kv, rows), k, v, _mask_rows(visible, group, rows))
    out = combine_partials(acc, m, l)
    return _from_rows(out, t_len, num_heads).astype(v.dtype)


def cache_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array,
                              visible: jax.Array) -> jax.Array:
    """The kernel's algorithm in plain JAX (``lax.scan`` over the chunks of every split).

    Same contract and the same blocked online softmax, split plan and rounding points as
    :func:`cache_attention`, so the two agree to float rounding on any backend; it reads
    every chunk (no ``kv_end`` skip: skipped chunks are fully masked and weigh 0 either way
    for rows with a visible key).
    """
    plan = make_plan("cache_attention_reference", q.shape, k.shape)
    batch, t_len, num_heads, head_dim, num_keys, num_kv, group, rows, block_k, num_splits, \
        per_split = plan
    qr = _to_rows(q, num_kv, rows)                                         # [B, nKV, R, D]
    mask = _mask_rows(visible, group, rows)                                # [B, R, S]
    chunks = num_keys // block_k
    pad = num_splits * per_split - chunks                                  # empty tail chunks
    kc = jnp.pad(k.reshape(batch, chunks, block_k, num_kv, head_dim),
                 ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
    vc = jnp.pad(v.reshape(batch, chunks, block_k, num_kv, head_dim),
                 ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
    mc = jnp.pad(mask.reshape(batch, rows, chunks, block_k), ((0, 0), (0, 0), (0, pad), (0, 0)))
    real = jnp.arange(num_splits * per_split) < chunks                     # [N * P]

    def step(carry, xs):
        acc, m, l = carry                                  # [B, nKV, N, R, D], [B, nKV, N, R]
        kb, vb, mb, ok = xs                                # [B, N, bk, nKV, D], [B, R, N, bk], [N]
        s = jnp.einsum("bhrd,bnkhd->bhnrk", qr, kb, preferred_element_type=jnp.float32)
        s = jnp.where(mb.transpose(0, 2, 1, 3)[:, None] != 0, s * float(head_dim) ** -0.5,
                      MASK_VALUE)
        m_new = jnp.where(ok[None, None, :, None], jnp.maximum(m, jnp.max(s, -1)), m)
        alpha = jnp.where(ok[None, None, :, None], jnp.exp(m - m_new), 1.0)
        p = jnp.where(ok[None, None, :, None, None], jnp.exp(s - m_new[..., None]), 0.0)
        pv = jnp.einsum("bhnrk,bnkhd->bhnrd", p.astype(v.dtype), vb,
                        preferred_element_type=jnp.float32)
        return (acc * alpha[..., None] + pv, m_new, l * alpha + jnp.sum(p, -1)), None

    # scan over the chunk index within a run; all runs advance together
    kc = kc.reshape(batch, num_splits, per_split, block_k, num_kv, head_dim).transpose(2, 0, 1, 3, 4, 5)
    vc = vc.reshape(batch, num_splits, per_split, block_k, num_kv, head_dim).transpose(2, 0, 1, 3, 4, 5)
    mc = mc.reshape(batch, rows, num_splits, per_split, block_k).transpose(3, 0, 1, 2, 4)
    ok = real.reshape(num_splits, per_split).T
    part = (batch, num_kv, num_splits, rows)
    init = (jnp.zeros(part + (head_dim,), jnp.float32), jnp.full(part, -jnp.inf, jnp.float32),
            jnp.zeros(part, jnp.float32))
    (acc, m, l), _ = lax.scan(step, init, (kc, vc, mc, ok))
    out = combine_partials(acc, m, l)
    return _from_rows(out, t_len, num_heads).astype(v.dtype)

