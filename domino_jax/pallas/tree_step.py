"""DominoTree's depth step (the frontier builder's loop body) as fused Pallas kernels.

The frontier builder (``decode/tree_frontier.py``) keeps ``W = budget`` lanes per depth.
One depth step ``d`` takes the lanes of depth ``d - 1`` (GRU states and their products
``h = s W_hh``, ``u = silu(z_d + s W1_s)``, as in :mod:`domino_jax.pallas.head_step`) and:

1. scores every lane's children (algorithms.md §5.3): ``c = bc[d] + u W2c[d]ᵀ`` over the
   depth's ``M`` base candidates, ``log_softmax`` over them, the lane's top ``node_topk``
   (depths ``d < P``: the depth's top base tokens, the same for every lane);
2. keeps the ``W`` best of the ``W x node_topk`` candidates ``lane_score + log_prob`` (ties:
   the lower lane-major index, ``lax.top_k``'s rule);
3. advances: each kept child's state is one GRU step from its parent lane's state on the
   child's token (a row of the ``[V, 3G]`` gate table), then ``[W_hh | W1_s]`` products
   for the next depth.

Triton (GPU): one launch per depth. Every program of :func:`~domino_jax.pallas.head_step.
advance_triton`'s column grid first does steps 1-2 itself (``W x M`` scores and ``W +
node_topk`` small reductions: a few microseconds, repeated per program instead of a second
launch), then its block of step 3. TPU (Mosaic): two launches, the selection kernel and
:func:`~domino_jax.pallas.head_step.advance_tpu` (the row gathers need the chosen tokens
and parents as scalars, i.e. scalar-prefetch operands of a second call).

Selection is :func:`select_children` (plain ``jnp`` on loaded values, traced inside both
kernels and in the plain-JAX twin :func:`tree_step_reference`), written with Triton's
constraints: power-of-two shapes (``M``, ``node_topk`` and the lanes padded), unrolled
max/min reductions instead of sorts, no dynamic indexing of values. The float32 scores take
XLA's matmul precision (:func:`~domino_jax.pallas.head_step.matmul_precision`), as the XLA
scorer does.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from domino_jax.pallas.head_step import (BIG_INDEX, KernelTuning, StepPlan, _pow2_at_least,
                                         advance_grid, advance_reference, advance_tpu,
                                         advance_triton, dot, plan_step, products_of,
                                         supported)


class TreePlan(NamedTuple):
    """Static blocking of one depth step."""

    step: StepPlan       # the advance (its ``batch`` = the W lanes, ``rows`` = R)
    width: int           # W lanes (the tree budget)
    ntop: int            # children per lane (node_topk)
    ntop_pad: int        # power of two >= ntop
    topm: int            # M candidates per depth
    topm_pad: int        # power of two >= M


def tree_supported(variant: str, width: int, vocab: int, emb_dim: int, gru_dim: int,
                   node_topk: int, topm: int) -> str | None:
    """``None`` if :func:`plan_tree_step` takes these, else the reason."""
    if topm <= 0:
        return "the full-vocabulary correction (topm = 0) has no kernel"
    if topm < node_topk:
        return f"topm {topm} < node_topk {node_topk}"
    if topm > 1024 or width > 64 or node_topk > 64:
        return f"topm {topm} > 1024, lanes {width} > 64 or node_topk {node_topk} > 64"
    if variant == "triton" and emb_dim & (emb_dim - 1):
        return f"E = {emb_dim} is not a power of two (Triton loads)"
    return supported(variant, width, vocab, emb_dim, gru_dim)


def plan_tree_step(variant: str, width: int, vocab: int, emb_dim: int, gru_dim: int,
                   node_topk: int, topm: int, tuning: KernelTuning | None = None) -> TreePlan:
    """The :class:`TreePlan` (``ValueError`` with the reason where :func:`tree_supported`
    or the ``tuning`` rejects it); the advance takes ``tuning``'s kernel-B fields
    (``block_n``, ``gru_chunk``, ``num_warps_b``, ``num_stages_b``)."""
    reason = tree_supported(variant, width, vocab, emb_dim, gru_dim, node_topk, topm)
    if reason is not None:
        raise ValueError(f"DominoTree depth-step kernel ({variant}): {reason}")
    step = plan_step(variant, width, vocab, emb_dim, gru_dim, tuning=tuning)
    return TreePlan(step, width, node_topk, _pow2_at_least(node_topk), topm,
                    _pow2_at_least(topm, 16))


class DepthInputs(NamedTuple):
    """The per-round tables every depth step reads (made once per round, :func:`prepare`)."""

    cand: jax.Array      # [K, Mp] int32 top-M base candidates per depth (pad: 0)
    cand_logits: jax.Array   # [K, Mp] float32 their base logits (pad: -inf)
    cand_w2: jax.Array   # [K, Mp, E] float32 their W2 columns (pad: 0)
    base_tok: jax.Array  # [K, Np] int32 top node_topk base tokens (pad: 0)
    base_lp: jax.Array   # [K, Np] float32 their full-vocab log-probs (pad: -inf)
    z: jax.Array         # [K, 1, 3G + E] float32 z_proj with 3G leading zeros


def prepare(plan: TreePlan, cand, cand_logits, cand_w2, base_tok, base_lp, z_proj) -> DepthInputs:
    """Pad the scorer's per-depth tables (``[K, M]``, ``[K, M]``, ``[K, M, E]``, ``[K,
    ntop]`` x2, ``z_proj [K, E]``) to the kernel's power-of-two shapes."""
    m_pad, n_pad = plan.topm_pad - plan.topm, plan.ntop_pad - plan.ntop
    gru_dim = plan.step.gru_dim
    return DepthInputs(
        jnp.pad(cand.astype(jnp.int32), ((0, 0), (0, m_pad))),
        jnp.pad(cand_logits.astype(jnp.float32), ((0, 0), (0, m_pad)),
                constant_values=-jnp.inf),
        jnp.pad(cand_w2.astype(jnp.float32), ((0, 0), (0, m_pad), (0, 0))),
        jnp.pad(base_tok.astype(jnp.int32), ((0, 0), (0, n_pad))),
        jnp.pad(base_lp.astype(jnp.float32), ((0, 0), (0, n_pad)), constant_values=-jnp.inf),
        jnp.pad(z_proj.astype(jnp.float32), ((0, 0), (3 * gru_dim, 0)))[:, None])


def select_children(u, lane_score, cand, cand_logits, cand_w2, base_tok, base_lp, *,
                    plan: TreePlan, from_base: bool):
    """Steps 1-2 of the module doc on values: ``u [R, E]`` float32, ``lane_score [R, 1]``,
    one depth's ``cand, cand_logits [1, Mp]``, ``cand_w2 [Mp, E]``, ``base_tok, base_lp
    [1, Np]``. Returns ``best [R, 1]`` float32, ``token [R, 1]`` and ``lane [R, 1]``
    int32 for the ``W`` kept children in descending order (rows past ``W``: 0)."""
    rows, width, ntop, n_pad = plan.step.rows, plan.width, plan.ntop, plan.ntop_pad
    kcol = lax.broadcasted_iota(jnp.int32, (rows, n_pad), 1)
    row = lax.broadcasted_iota(jnp.int32, (rows, n_pad), 0)
    if from_base:
        top_lp = jnp.broadcast_to(base_lp, (rows, n_pad))
        top_tok = jnp.broadcast_to(base_tok, (rows, n_pad))
    else:
        scores = cand_logits + dot(u, cand_w2, contract_b=1)                  # [R, Mp]
        shifted = scores - jnp.max(scores, axis=1, keepdims=True)
        log_probs = shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=1, keepdims=True))
        mcol = lax.broadcasted_iota(jnp.int32, log_probs.shape, 1)
        alive = mcol < plan.topm
        top_lp = jnp.full((rows, n_pad), -jnp.inf, jnp.float32)
        top_tok = jnp.zeros((rows, n_pad), jnp.int32)
        for t in range(ntop):                       # the lane's top node_topk, in order
            value = jnp.max(jnp.where(alive, log_probs, -jnp.inf), axis=1, keepdims=True)
            pick = jnp.min(jnp.where(alive & (log_probs == value), mcol, BIG_INDEX), axis=1,
                           keepdims=True)                                    # [R, 1]
            alive = alive & (mcol != pick)
            token = jnp.sum(jnp.where(mcol == pick, cand, 0), axis=1, keepdims=True)
            top_lp = jnp.where(kcol == t, value, top_lp)
            top_tok = jnp.where(kcol == t, token, top_tok)
    flat = row * n_pad + kcol
    candidate = lane_score + top_lp                                           # [R, Np]
    alive = (row < width) & (kcol < ntop)
    out_row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    best = jnp.zeros((rows, 1), jnp.float32)
    token = jnp.zeros((rows, 1), jnp.int32)
    lane = jnp.zeros((rows, 1), jnp.int32)
    for t in range(width):                          # the W best candidates, in order
        value = jnp.max(jnp.max(jnp.where(alive, candidate, -jnp.inf), axis=1, keepdims=True),
                        axis=0, keepdims=True)                               # [1, 1]
        hit = jnp.where(alive & (candidate == value), flat, BIG_INDEX)
        pick = jnp.min(jnp.min(hit, axis=1, keepdims=True), axis=0, keepdims=True)
        alive = alive & (flat != pick)
        chosen = jnp.sum(jnp.sum(jnp.where(flat == pick, top_tok, 0), axis=1, keepdims=True),
                         axis=0, keepdims=True)
        best = jnp.where(out_row == t, value, best)
        token = jnp.where(out_row == t, chosen, token)
        lane = jnp.where(out_row == t, jnp.right_shift(pick, n_pad.bit_length() - 1), lane)
    return best, token, lane


def _tree_step_triton(score_ref, cand_ref, logit_ref, w2c_ref, btok_ref, blp_ref, table_ref,
                      state_ref, prod_ref, z_ref, proj_ref, best_out, token_out, lane_out,
                      *state_outs, plan: TreePlan, depth: int, from_base: bool,
                      advance: bool):
    """Refs: ``lane_score [R]``, the :class:`DepthInputs` arrays, ``table`` flat ``[V *
    3G]``, ``state`` flat ``[R * G]``, ``products`` flat ``[R * (3G + E)]``, ``z``,
    ``state_proj``; outputs ``best, token, lane [R]`` and (``advance``) the new lanes'
    ``state [R, G]``, ``products [R, 3G + E]`` (not with ``split_advance``)."""
    step = plan.step
    rows, width = step.rows, 3 * step.gru_dim + step.emb_dim
    pid = pl.program_id(0)
    row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    lane_col = lax.broadcasted_iota(jnp.int32, (1, step.emb_dim), 1)
    u = prod_ref[row * width + 3 * step.gru_dim + lane_col]                 # [R, E]
    best, token, lane = select_children(
        u, score_ref[...][:, None], cand_ref[pl.ds(depth, 1), :],
        logit_ref[pl.ds(depth, 1), :], w2c_ref[depth], btok_ref[pl.ds(depth, 1), :],
        blp_ref[pl.ds(depth, 1), :], plan=plan, from_base=from_base)
    if advance:
        state_out, *prod_out = state_outs
        advance_triton(pid, token[:, 0], lane[:, 0], table_ref, state_ref, prod_ref, z_ref,
                       proj_ref, state_out, prod_out[0] if prod_out else None, plan=step,
                       z_row=depth + 1)

    @pl.when(pid == 0)
    def _write_choice():
        best_out[...] = best[:, 0]
        token_out[...] = token[:, 0]
        lane_out[...] = lane[:, 0]


def _tree_select_tpu(score_ref, cand_ref, logit_ref, w2c_ref, btok_ref, blp_ref, prod_ref,
                     best_out, token_out, lane_out, *, plan: TreePlan, depth: int,
                     from_base: bool):
    """Whole-array VMEM refs: ``lane_score [W, 1]``, the :class:`DepthInputs` arrays but
    ``z``, ``products [W, 3G + E]``; outputs ``best, token, lane [W, 1]``."""
    gru_dim = plan.step.gru_dim
    best, token, lane = select_children(
        prod_ref[:, 3 * gru_dim:], score_ref[...], cand_ref[depth:depth + 1, :],
        logit_ref[depth:depth + 1, :], w2c_ref[depth], btok_ref[depth:depth + 1, :],
        blp_ref[depth:depth + 1, :], plan=plan, from_base=from_base)
    best_out[...] = best
    token_out[...] = token
    lane_out[...] = lane


@functools.partial(jax.jit, static_argnames=("plan", "depth", "from_base", "advance",
                                             "interpret"))
def tree_step(lane_score: jax.Array, state: jax.Array, products: jax.Array,
              inputs: DepthInputs, table: jax.Array, state_proj: jax.Array, *,
              plan: TreePlan, depth: int, from_base: bool, advance: bool = True,
              interpret=False):
    """One depth step (module doc) for one tree.

    Args:
      lane_score: ``[R]`` float32 cumulative scores of the lanes (``-inf``: no node; rows
        past ``W`` are ignored). state: ``[R, G]`` lane GRU states (activation dtype);
        products: ``[R, 3G + E]`` float32, ``u`` made with ``z[depth]``.
      inputs: :func:`prepare`'s tables. table: ``[V, 3G]`` float32 gate table. state_proj:
        ``[G, 3G + E]`` = ``[W_hh | W1_s]``.
      depth: ``d`` (static); from_base: ``d < P`` (children from the base logits).
      advance: also make the kept children's states (``False`` at the last depth).
    Returns ``(best [W] float32, token [W] int32, lane [W] int32, new state [R, G] | None,
    new products [R, 3G + E] | None)``.
    """
    step = plan.step
    rows, width = step.rows, plan.width
    if step.variant == "triton":
        from jax.experimental.pallas import triton as plgpu

        kernel = functools.partial(_tree_step_triton, plan=plan, depth=depth,
                                   from_base=from_base, advance=advance)
        out_shape = [jax.ShapeDtypeStruct((rows,), jnp.float32),
                     jax.ShapeDtypeStruct((rows,), jnp.int32),
                     jax.ShapeDtypeStruct((rows,), jnp.int32)]
        if advance:
            out_shape.append(jax.ShapeDtypeStruct(state.shape, state.dtype))
            if not step.split_advance:
                out_shape.append(jax.ShapeDtypeStruct(products.shape, jnp.float32))
        outs = pl.pallas_call(
            kernel, grid=(advance_grid(step) if advance else 1,), out_shape=out_shape,
            compiler_params=plgpu.CompilerParams(num_warps=step.num_warps_b,
                                                 num_stages=step.num_stages_b),
            interpret=interpret, name="dominotree_depth_step",
        )(lane_score, inputs.cand, inputs.cand_logits, inputs.cand_w2, inputs.base_tok,
          inputs.base_lp, table.reshape(-1), state.reshape(-1), products.reshape(-1),
          inputs.z, state_proj)
        best, token, lane = (x[:width] for x in outs[:3])
        if not advance:
            return best, token, lane, None, None
        if step.split_advance:            # the products in XLA (head_step.products_of)
            return best, token, lane, outs[3], products_of(outs[3], state_proj,
                                                           inputs.z[depth + 1], step.gru_dim)
        return best, token, lane, outs[3], outs[4]
    kernel = functools.partial(_tree_select_tpu, plan=plan, depth=depth, from_base=from_base)
    col = jax.ShapeDtypeStruct((width, 1), jnp.float32)
    best, token, lane = pl.pallas_call(
        kernel, out_shape=[col, col.update(dtype=jnp.int32), col.update(dtype=jnp.int32)],
        interpret=interpret, name="dominotree_select",
    )(lane_score[:, None], inputs.cand, inputs.cand_logits, inputs.cand_w2, inputs.base_tok,
      inputs.base_lp, products)
    best, token, lane = best[:, 0], token[:, 0], lane[:, 0]
    if not advance:
        return best, token, lane, None, None
    new_state, new_products = advance_tpu(token, lane, table, state, products, inputs.z,
                                          state_proj, plan=step, row_stride=0,
                                          z_row=depth + 1, interpret=interpret)
    return best, token, lane, new_state, new_products


def tree_step_reference(lane_score: jax.Array, state: jax.Array, products: jax.Array,
                        inputs: DepthInputs, table: jax.Array, state_proj: jax.Array, *,
                        plan: TreePlan, depth: int, from_base: bool, advance: bool = True):
    """:func:`tree_step` in plain JAX (the same :func:`select_children`)."""
    step, width = plan.step, plan.width
    best, token, lane = select_children(
        products[:, 3 * step.gru_dim:], lane_score[:, None], inputs.cand[depth:depth + 1],
        inputs.cand_logits[depth:depth + 1], inputs.cand_w2[depth],
        inputs.base_tok[depth:depth + 1], inputs.base_lp[depth:depth + 1], plan=plan,
        from_base=from_base)
    best, token, lane = best[:width, 0], token[:width, 0], lane[:width, 0]
    if not advance:
        return best, token, lane, None, None
    new_state, new_products = advance_reference(
        token, lane, table, state, products, inputs.z, state_proj, plan=step, z_row=depth + 1)
    return best, token, lane, new_state, new_products
