"""The Domino head's rollout and DominoTree's depth steps through the fused kernels, and the
``implementation=`` switch that picks them.

:func:`resolve_head_kernels` turns an implementation name (``auto`` / ``xla`` / ``reference``
/ ``pallas`` / ``pallas_interpret``, as for the cache attention) into :class:`HeadKernels` or
``None`` (the XLA path, i.e. the plain-JAX code in ``models/domino_head.py`` and
``decode/tree.py``):

* ``xla``: ``None``.
* ``reference``: the kernels' plain-JAX twins (:mod:`~domino_jax.pallas.head_step`,
  :mod:`~domino_jax.pallas.tree_step`), on any backend: the blocked algorithm without Pallas.
* ``pallas``: the kernels compiled for this backend, Triton on a CUDA GPU, Mosaic on a TPU.
  Fails fast (``ValueError`` with the reason) on another backend, for shapes the kernels do
  not take, or without the head's decode layout (the ``[V, 3G]`` GRU input table).
* ``pallas_interpret``: the kernels in the Pallas interpreter (any backend; the Triton
  variant unless the backend is a TPU).
* ``auto`` (the default): the kernel where :data:`MEASURED_FASTER` lists this device kind
  for it -- a measurement in ``benchmarks/results/`` said the kernel is faster end to end --
  else XLA (with a warning when a listed device falls back for its shapes). Nothing is
  listed yet, so ``auto`` is XLA everywhere until the GPU benchmark run.

:func:`fused_rollout` is ``domino_head.rollout`` (same arguments, same drafts up to float32
accumulation order) as a loop of kernel steps; :func:`fused_depth_step` is one frontier depth
step of DominoTree.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from domino_jax.pallas import HEAD_IMPLEMENTATIONS, check_implementation
from domino_jax.pallas import head_step as hs
from domino_jax.pallas import tree_step as ts
from domino_jax.topk import top_k

# kernel -> device kinds (jax.devices()[0].device_kind) on which a measurement in
# benchmarks/results/ found the kernel faster end to end; "auto" picks it only there.
MEASURED_FASTER: dict[str, tuple[str, ...]] = {"head": (), "tree": ()}


class HeadKernels(NamedTuple):
    """How the head's steps run (static): ``twin`` (the plain-JAX twins) or the Pallas
    kernels of ``variant`` (``"triton"`` / ``"mosaic_tpu"``), in the interpreter when
    ``interpret`` is set (``True`` or a ``pltpu.InterpretParams``)."""

    variant: str
    twin: bool = False
    interpret: Any = False


def backend_variant() -> str | None:
    """The kernel variant this backend compiles: ``"triton"`` on CUDA, ``"mosaic_tpu"`` on a
    TPU, else ``None``."""
    device = jax.devices()[0]
    if device.platform == "gpu" and "NVIDIA" in device.device_kind:
        return "triton"
    return "mosaic_tpu" if device.platform == "tpu" else None


def interpret_mode(variant: str):
    """The interpreter a variant runs in on the CPU (the TPU one models DMAs and SMEM)."""
    if variant == "mosaic_tpu":
        from jax.experimental.pallas import tpu as pltpu
        return pltpu.InterpretParams()
    return True


def resolve_head_kernels(implementation: str, kernel: str,
                         unsupported: str | None) -> HeadKernels | None:
    """:class:`HeadKernels` for ``implementation`` (module doc), or ``None`` for XLA.

    ``kernel``: ``"head"`` (the chain rollout) or ``"tree"`` (DominoTree's depth step);
    ``unsupported``: why the kernels cannot take this call (shapes, layout), or ``None``.
    Raises ``ValueError`` for an unknown name or an explicit request it cannot serve.
    """
    check_implementation("head kernel", implementation, HEAD_IMPLEMENTATIONS)
    if implementation == "xla":
        return None
    variant = backend_variant()
    what = "Domino head" if kernel == "head" else "DominoTree depth-step"
    if implementation == "auto":
        kind = jax.devices()[0].device_kind
        if variant is None or kind not in MEASURED_FASTER[kernel]:
            return None
        if unsupported is not None:
            warnings.warn(f"{what} kernels: {unsupported}; using the XLA path", stacklevel=3)
            return None
        return HeadKernels(variant)
    if implementation == "pallas" and variant is None:
        unsupported = (f"the Pallas kernels need a CUDA GPU (Triton) or a TPU (Mosaic); "
                       f"backend: {jax.default_backend()}")
    if unsupported is not None:
        raise ValueError(f"{what} implementation {implementation!r}: {unsupported}")
    if implementation == "reference":
        return HeadKernels(variant or "triton", twin=True)
    if implementation == "pallas_interpret":
        variant = variant if variant == "mosaic_tpu" else "triton"
        return HeadKernels(variant, interpret=interpret_mode(variant))
    return HeadKernels(variant)


def head_unsupported(variant: str | None, batch: int, vocab: int, emb_dim: int, gru_dim: int,
                     has_input_table: bool) -> str | None:
    """Why the head kernels cannot run this rollout (``None``: they can)."""
    if not has_input_table:
        return ("the head has no [V, 3G] GRU input table (decode layout; "
                "head_input_table=False / --no-head-input-table)")
    return hs.supported(variant or "triton", batch, vocab, emb_dim, gru_dim)


def _rows(x: jax.Array, rows: int) -> jax.Array:
    return jnp.pad(x, ((0, rows - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))


def lane_products(state: jax.Array, state_proj: jax.Array, z: jax.Array, row: int,
                  gru_dim: int) -> jax.Array:
    """The carried products ``[R, 3G + E]`` of ``state [R, G]`` (``h``, then ``u`` with
    ``z[row]``), in XLA: the loop's first step, which no kernel made."""
    acc = hs.dot(state, state_proj.astype(state.dtype))
    col = jnp.arange(acc.shape[1])[None]
    return jnp.where(col >= 3 * gru_dim, jax.nn.silu(z[row] + acc), acc)


def fused_rollout(kernels: HeadKernels, *, z_proj: jax.Array, base_logits: jax.Array,
                  root_state: jax.Array, w2: jax.Array, state_proj: jax.Array,
                  input_table: jax.Array, prefix_len: int, candidate_topm: int,
                  temperature: float | None, rng_key: jax.Array,
                  need_logits: bool) -> tuple[jax.Array, jax.Array | None]:
    """``domino_head.rollout`` through the step kernels (module doc of ``head_step``).

    Args:
      z_proj: ``[B, K, E]`` float32 ``draft_hidden @ W1_z``; base_logits: ``[B, K, V]``.
      root_state: ``[B, G]`` GRU state after the root (activation dtype, the dtype of the
        products' operands).
      w2: ``[E, V]``; state_proj: ``[G, 3G + E]`` = ``[W_hh | W1_s]``; input_table: ``[V,
        3G]`` float32.
      prefix_len: ``P`` (uncorrected positions); candidate_topm: ``M`` (0: full vocabulary).
      temperature: ``None``: argmax drafts; else drafts drawn as
        ``jax.random.categorical(key_i, logits / temperature)`` (Gumbel-max in kernel A).
      rng_key: split into one key per position, as ``rollout`` does.
      need_logits: also return the ``[B, K, V]`` logits each token was chosen from
        (``rollout``'s second output; ``-inf`` outside a position's pool); else ``None`` and
        kernel A writes no logits.
    """
    batch, num_drafts, vocab = base_logits.shape
    gru_dim, emb_dim = state_proj.shape[0], z_proj.shape[-1]
    act_dtype = root_state.dtype
    plan = hs.plan_step(kernels.variant, batch, vocab, emb_dim, gru_dim)
    rows = plan.rows
    step_a = hs.logits_argmax_reference if kernels.twin else hs.logits_argmax
    step_b = hs.state_step_reference if kernels.twin else hs.state_step
    run = {} if kernels.twin else {"interpret": kernels.interpret}
    z = hs.pad_z(z_proj, gru_dim, rows)                                     # [K, R, 3G + E]
    state = _rows(root_state, rows)
    products = lane_products(state, state_proj, z, 0, gru_dim)
    base = base_logits.astype(jnp.float32)
    keys = jax.random.split(rng_key, num_drafts)
    m = min(candidate_topm, vocab)
    if m > 0:                                          # per-position pools, made once
        cand_logits, cand = top_k(base, m)                                  # [B, K, M]
        w2_cand = jnp.moveaxis(w2[:, cand], 0, -1)                          # [B, K, M, E]
        pool_gates = input_table[jnp.swapaxes(cand, 0, 1)].reshape(num_drafts, batch * m, -1)

    def choose(logits, key):
        if temperature is None:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)

    tokens, logits, pooled = [], [], []
    for i in range(num_drafts):
        table, stride = input_table, 0
        if i < prefix_len:                             # uncorrected: the base logits
            index = choose(base[:, i], keys[i])
            parts = hs.given_choice(index, rows)
            logits.append(base[:, i])
        elif m > 0:                                    # the pool: M dot products in XLA
            u = products[:batch, 3 * gru_dim:].astype(act_dtype)
            pool_logits = cand_logits[:, i] + jnp.einsum(
                "bme,be->bm", w2_cand[:, i], u, preferred_element_type=jnp.float32)
            index = choose(pool_logits, keys[i])
            parts = hs.given_choice(index, rows)
            table, stride = pool_gates[i], m
            pooled.append(pool_logits)
        else:                                          # kernel A over the vocabulary
            noise = None
            if temperature is not None:
                noise = jax.random.gumbel(keys[i], (batch, vocab), jnp.float32)
            parts, logits_i = step_a(products, w2, base, plan=plan, step=i,
                                     act_dtype=act_dtype, noise=noise,
                                     temperature=temperature or 1.0,
                                     write_logits=need_logits, **run)
            index = hs.finish_choice(parts, batch)
            if need_logits:
                logits.append(logits_i)
        if i + 1 < num_drafts:                         # kernel B: the next state
            index, state, products = step_b(parts, table, state, products, z, state_proj,
                                            plan=plan, row_stride=stride, z_row=i + 1, **run)
        token = index
        if stride:                                     # a pool index -> its token
            token = jnp.take_along_axis(cand[:, i], index[:, None], axis=1)[:, 0]
        tokens.append(token)
    tokens = jnp.stack(tokens, axis=1)
    if not need_logits:
        return tokens, None
    logits = (jnp.stack(logits, axis=1) if logits
              else jnp.zeros((batch, 0, vocab), jnp.float32))
    if pooled:             # one scatter after the loop: -inf outside each position's pool
        b_idx = jnp.arange(batch)[:, None, None]
        slots = jnp.arange(len(pooled))[None, :, None]
        full = jnp.full((batch, len(pooled), vocab), -jnp.inf, jnp.float32).at[
            b_idx, slots, cand[:, prefix_len:]].set(jnp.stack(pooled, axis=1))
        logits = jnp.concatenate([logits, full], axis=1)
    return tokens, logits


# ----------------------------------------------------------------------- DominoTree depth step

def tree_unsupported(variant: str | None, budget: int, vocab: int, emb_dim: int, gru_dim: int,
                     node_topk: int, topm: int, has_input_table: bool,
                     marginal: bool) -> str | None:
    """Why the depth-step kernel cannot build this tree (``None``: it can)."""
    if marginal:
        return "the marginal control has no GRU (nothing to fuse)"
    if not has_input_table:
        return ("the head has no [V, 3G] GRU input table (decode layout; "
                "head_input_table=False / --no-head-input-table)")
    return ts.tree_supported(variant or "triton", budget, vocab, emb_dim, gru_dim, node_topk,
                             topm)


class Lanes(NamedTuple):
    """The frontier's lanes between depth steps: ``score [R]`` float32 (``-inf``: no node),
    ``state [R, G]``, ``products [R, 3G + E]`` (``u`` made for the next depth)."""

    score: jax.Array
    state: jax.Array
    products: jax.Array


def root_lanes(plan: ts.TreePlan, root_state: jax.Array, state_proj: jax.Array,
               z: jax.Array) -> Lanes:
    """Depth-0 lanes: lane 0 holds the root (score 0), the others nothing."""
    rows = plan.step.rows
    state = jnp.broadcast_to(root_state, (rows,) + root_state.shape)
    score = jnp.full((rows,), -jnp.inf, jnp.float32).at[0].set(0.0)
    return Lanes(score, state, lane_products(state, state_proj, z, 0, plan.step.gru_dim))


def fused_depth_step(kernels: HeadKernels, plan: ts.TreePlan, inputs: ts.DepthInputs,
                     table: jax.Array, state_proj: jax.Array, prefix_len: int):
    """The frontier's depth step through :func:`~domino_jax.pallas.tree_step.tree_step`:
    ``step(lanes, d, advance) -> (best [W], token [W], lane [W], next lanes | None)``."""
    run = ts.tree_step_reference if kernels.twin else ts.tree_step
    extra = {} if kernels.twin else {"interpret": kernels.interpret}
    rows = plan.step.rows

    def step(lanes: Lanes, d: int, advance: bool):
        best, token, lane, state, products = run(
            lanes.score, lanes.state, lanes.products, inputs, table, state_proj, plan=plan,
            depth=d, from_base=d < prefix_len, advance=advance, **extra)
        if not advance:
            return best, token, lane, None
        score = jnp.pad(best, (0, rows - plan.width), constant_values=-jnp.inf)
        return best, token, lane, Lanes(score, state, products)

    return step
