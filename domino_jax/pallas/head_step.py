"""One step of the Domino head's rollout as two fused Pallas kernels (GPU: Triton; TPU: Mosaic).

A corrected rollout step ``i`` (:func:`domino_jax.models.domino_head.rollout`) is, for GRU state
``s`` and its products ``u = silu(z_i + s W1_s)``, ``h = s W_hh``::

    logits_i = base_i + u W2                 # [B, V]: the 78 MB W2 product (Qwen3-8B shape)
    token_i  = argmax(logits_i)              # or a Gumbel-max draw at temperature T
    s'       = GRU(table[token_i], h, s)     # gates: a row of the [V, 3G] input table
    h', u'   = s' W_hh, silu(z_{i+1} + s' W1_s)     # one [G, 3G + E] product

XLA runs that as a handful of kernels per step. Here it is two launches:

* :func:`logits_argmax` (kernel A): the ``W2`` product, the base add and the choice, one
  program per block of ``block_v`` vocabulary columns, each writing its block's best
  ``(value, index)`` -- the *partials* ``[P, R]`` -- and, only when asked, its logits.
  On TPU the grid runs in order, so the blocks fold into one running best in VMEM and the
  partials are one row per core split.
* :func:`state_step` (kernel B): finishes the choice from the partials, gathers the chosen
  rows of the gate table, runs the GRU update and multiplies the new state by
  ``state_proj = [W_hh | W1_s]`` (programs over its column blocks; each recomputes the small
  elementwise GRU for all ``G`` columns, so no program waits for another), and applies
  ``silu(z + .)`` to the ``W1_s`` columns. On TPU the token is finished in XLA (a
  ``[P, B]`` argmax) and passed as a scalar-prefetch operand, which drives one row DMA per
  batch row from the table in HBM.

Carried between steps (the rollout's loop state): ``state [R, G]`` in the activation dtype
and ``products [R, 3G + E]`` float32: ``h`` in the first ``3G`` columns, then ``u`` (before
the cast to the activation dtype, which kernel A applies). ``h`` first keeps every slice
lane-aligned on TPU (``G`` is a multiple of 128, ``E`` need not be). ``R``: the batch padded
to a power of two >= 16 on Triton (what ``dot`` needs; pad rows are computed and ignored),
the batch itself on TPU. ``z`` comes in padded to ``3G + E`` columns with leading zeros
(:func:`pad_z`), so every column block applies one ``where(col >= 3G, silu(z + acc), acc)``.

The choice: partials hold the largest ``key`` and the *lowest* index attaining it within
each block, and the finish takes the lowest index among the blocks attaining the overall
maximum, i.e. ``jnp.argmax``'s first-index rule. ``key = logits`` for argmax; with
``noise`` (``jax.random.gumbel(key, [B, V])``) and ``temperature`` T it is ``logits / T +
noise``, which is exactly how ``jax.random.categorical(key, logits / T)`` draws.

Numerics: the ``W2`` and state products take the activation dtype with float32
accumulation (float32 operands at XLA's precision, :func:`matmul_precision`), gates and
logits float32, the
new state rounded to the activation dtype: the rounding points of ``rollout``. Differences
from it are float32 summation order only (accumulation over ``E`` / ``G`` in chunks).

Blocking (:mod:`domino_jax.pallas.step_plan`, re-exported here): :func:`plan_step` picks the
blocks, chunks and launch parameters; a :class:`KernelTuning` overrides any of them (static, per call: ``HeadKernels.tuning``), for
the sweeps of ``docs/design.md`` §6. Its ``row_gru`` (Triton, batch 1) computes kernel B's
GRU on the one live row instead of the ``R`` padded rows and broadcasts it into the dot.

Plain-JAX twins: :func:`logits_argmax_reference` and :func:`state_step_reference` (the same
blocks and partials, any backend).
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from domino_jax.pallas.step_plan import (VARIANTS, KernelTuning, StepPlan,  # noqa: F401
                                         _pow2_at_least, check_tuning, padded_rows,
                                         plan_step, supported)

BIG_INDEX = 2 ** 30            # "no index" in the argmax reductions (above any vocabulary)


@flax.struct.dataclass
class Partials:
    """Per-block best of a choice: ``value [P, R]`` float32 and ``index [P, R]`` int32
    (rows past the ``num`` blocks that hold data may follow; ``num`` is static)."""

    value: jax.Array
    index: jax.Array
    num: int = flax.struct.field(pytree_node=False)


def pad_z(z_proj: jax.Array, gru_dim: int, rows: int) -> jax.Array:
    """``z_proj [B, K, E]`` (float32) -> ``[K, R, 3G + E]``: rows padded to ``R``, the
    first ``3G`` columns zero (made once per round; kernel B reads row ``i + 1``)."""
    batch = z_proj.shape[0]
    z = jnp.pad(z_proj.astype(jnp.float32), ((0, rows - batch), (0, 0), (3 * gru_dim, 0)))
    return jnp.swapaxes(z, 0, 1)


def matmul_precision():
    """The precision of float32 products: the one XLA's products take
    (``jax_default_matmul_precision``; unset = the backend's default, TF32 on a GPU), so a
    kernel rounds like the XLA path it replaces."""
    name = str(jax.config.jax_default_matmul_precision or "default").lower()
    if name in ("highest", "float32"):
        return lax.Precision.HIGHEST
    return lax.Precision.HIGH if name in ("high", "tensorfloat32") else None


def dot(a, b, contract_b: int = 0):
    """``a [m, k] @ b`` (``b [k, n]``, or ``[n, k]`` with ``contract_b = 1``) -> float32
    (:func:`matmul_precision` for float32 operands)."""
    precision = matmul_precision() if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def gru_from_gates(gates, hidden, state):
    """The GRU update on split gates: ``gates, hidden = (r, z, n)`` float32 parts, ``state``
    float32 -> new state float32 (the maths of ``domino_head.gru_update``)."""
    reset = jax.nn.sigmoid(gates[0] + hidden[0])
    update = jax.nn.sigmoid(gates[1] + hidden[1])
    candidate = jnp.tanh(gates[2] + reset * hidden[2])
    return (1.0 - update) * candidate + update * state


def _choice_key(logits, noise, temperature):
    return logits if noise is None else logits / temperature + noise


def _block_best(key, col):
    """Best ``(value, lowest index)`` per row of ``key [r, c]`` with indices ``col``."""
    best = jnp.max(key, axis=1, keepdims=True)
    index = jnp.min(jnp.where(key == best, col, BIG_INDEX), axis=1, keepdims=True)
    return best, index


def finish_choice(partials: Partials, batch: int) -> jax.Array:
    """``[B]`` int32: the lowest index attaining the best value over the partials' blocks."""
    value = partials.value[:partials.num, :batch]
    index = partials.index[:partials.num, :batch]
    best = jnp.max(value, axis=0, keepdims=True)
    return jnp.min(jnp.where(value == best, index, BIG_INDEX), axis=0).astype(jnp.int32)


def given_choice(tokens: jax.Array, rows: int) -> Partials:
    """Partials for a choice already made (``tokens [B]``): one block, the token itself."""
    pad = rows - tokens.shape[0]
    index = jnp.pad(tokens.astype(jnp.int32), (0, pad))[None]
    return Partials(jnp.zeros(index.shape, jnp.float32), index, 1)


# ---------------------------------------------------------------------------- kernel A

def _logits_argmax_triton(u_ref, w2_ref, base_ref, *refs, plan: StepPlan, step: int,
                          num_drafts: int, act_dtype, has_noise: bool, temperature: float,
                          write_logits: bool):
    """One block of ``block_v`` columns: refs ``u = products [R, 3G + E]``, ``w2 [E, V]``,
    ``base`` flat ``[B * K * V]``, ``noise`` flat ``[B * V]``; outputs ``value, index
    [part_rows, R]`` (row = this block), ``logits`` flat ``[R * V]``."""
    from jax.experimental.pallas import triton as plgpu

    refs = list(refs)
    noise_ref = refs.pop(0) if has_noise else None
    value_ref, index_ref = refs[:2]
    logits_ref = refs[2] if write_logits else None
    rows, vocab, block_v, chunk = plan.rows, plan.vocab, plan.block_v, plan.emb_chunk
    u0 = 3 * plan.gru_dim
    j = pl.program_id(0)
    col = j * block_v + lax.broadcasted_iota(jnp.int32, (1, block_v), 1)   # [1, bv]
    row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)                    # [R, 1]
    in_vocab = col < vocab
    live = (row < plan.batch) & in_vocab                                    # [R, bv]

    def body(c, acc):
        e = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        u = u_ref[:, pl.ds(u0 + c * chunk, chunk)].astype(act_dtype)       # [R, ec]
        w = plgpu.load(w2_ref.at[e, pl.ds(j * block_v, block_v)], mask=in_vocab, other=0)
        return acc + dot(u, w.astype(act_dtype))

    acc = lax.fori_loop(0, plan.emb_dim // chunk, body,
                        jnp.zeros((rows, block_v), jnp.float32))
    safe_row = jnp.minimum(row, plan.batch - 1)
    base_at = (safe_row * num_drafts + step) * vocab + col                 # [R, bv]
    base = plgpu.load(base_ref.at[base_at], mask=live, other=0).astype(jnp.float32)
    logits = jnp.where(live, base + acc, -jnp.inf)
    if write_logits:                   # [R * V]: pad rows store nothing, at their own offsets
        plgpu.store(logits_ref.at[row * vocab + col], logits, mask=live)
    noise = None
    if has_noise:
        noise = plgpu.load(noise_ref.at[safe_row * vocab + col], mask=live, other=0)
    best, index = _block_best(_choice_key(logits, noise, temperature), col)
    value_ref[pl.ds(j, 1), :] = best.reshape(1, rows)
    index_ref[pl.ds(j, 1), :] = index.reshape(1, rows)


def _logits_argmax_tpu(u_ref, w2_ref, base_ref, *refs, plan: StepPlan, act_dtype,
                       has_noise: bool, temperature: float, write_logits: bool):
    """Grid step ``j`` over vocabulary blocks (in order): blocks ``u = products [B, 3G + E]``,
    ``w2 [E, bv]``, ``base [B, bv]`` (row ``step`` of the ``[K, B, V]`` view), ``noise [B,
    bv]``; outputs ``value, index [1, B, 128]`` (lane-replicated) and ``logits [B, bv]``;
    scratch: the running best."""
    refs = list(refs)
    noise_ref = refs.pop(0) if has_noise else None
    value_ref, index_ref = refs[:2]
    logits_ref = refs[2] if write_logits else None
    best_ref, arg_ref = refs[-2:]
    j = pl.program_id(0)
    batch, block_v = plan.batch, plan.block_v

    @pl.when(j == 0)
    def _init():
        best_ref[...] = jnp.full(best_ref.shape, -jnp.inf, jnp.float32)
        arg_ref[...] = jnp.zeros(arg_ref.shape, jnp.int32)

    u = u_ref[:, 3 * plan.gru_dim:].astype(act_dtype)
    acc = dot(u, w2_ref[...].astype(act_dtype))                            # [B, bv]
    col = j * block_v + lax.broadcasted_iota(jnp.int32, (batch, block_v), 1)
    logits = jnp.where(col < plan.vocab, base_ref[...].astype(jnp.float32) + acc, -jnp.inf)
    if write_logits:
        logits_ref[...] = logits
    key = logits
    if has_noise:                     # the overhang of the last block holds no noise either
        key = jnp.where(col < plan.vocab, _choice_key(logits, noise_ref[...], temperature),
                        -jnp.inf)
    best, index = _block_best(key, col)                                       # [B, 1]
    better = best > best_ref[:, :1]                 # strict: an earlier block keeps a tie
    best_ref[...] = jnp.broadcast_to(jnp.where(better, best, best_ref[:, :1]), best_ref.shape)
    arg_ref[...] = jnp.broadcast_to(jnp.where(better, index, arg_ref[:, :1]), arg_ref.shape)

    @pl.when(j == plan.num_blocks - 1)
    def _out():
        value_ref[...] = best_ref[...][None]
        index_ref[...] = arg_ref[...][None]


@functools.partial(jax.jit, static_argnames=("plan", "step", "act_dtype", "temperature",
                                             "write_logits", "interpret"))
def logits_argmax(products: jax.Array, w2: jax.Array, base: jax.Array, *, plan: StepPlan,
                  step: int, act_dtype, noise: jax.Array | None = None,
                  temperature: float = 1.0, write_logits: bool = False,
                  interpret=False) -> tuple[Partials, jax.Array | None]:
    """Kernel A: partials of the choice over ``base[:, step] + u W2`` (module doc).

    Args:
      products: ``[R, 3G + E]`` float32 (``u`` = its last ``E`` columns).
      w2: ``[E, V]`` (``embed_proj_2/kernel``). base: ``[B, K, V]`` base logits (any float).
      step: the draft position ``i`` (static). act_dtype: dtype of the product operands.
      noise: ``[B, V]`` float32 Gumbel noise for a draw at ``temperature`` (``None``: argmax).
      write_logits: also return the float32 logits ``[B, V]`` (else ``None``).
      interpret: run in the Pallas interpreter (``True``; TPU kernels may also take a
        ``pltpu.InterpretParams``).
    """
    batch, num_drafts, vocab = base.shape
    has_noise = noise is not None
    if plan.variant == "triton":
        from jax.experimental.pallas import triton as plgpu

        kernel = functools.partial(
            _logits_argmax_triton, plan=plan, step=step, num_drafts=num_drafts,
            act_dtype=act_dtype, has_noise=has_noise, temperature=temperature,
            write_logits=write_logits)
        part = (plan.part_rows, plan.rows)
        out_shape = [jax.ShapeDtypeStruct(part, jnp.float32),
                     jax.ShapeDtypeStruct(part, jnp.int32)]
        if write_logits:
            out_shape.append(jax.ShapeDtypeStruct((plan.rows * vocab,), jnp.float32))
        inputs = [products, w2, base.reshape(-1)] + ([noise.reshape(-1)] if has_noise else [])
        outs = pl.pallas_call(
            kernel, grid=(plan.num_blocks,), out_shape=out_shape, interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps,
                                                 num_stages=plan.num_stages),
            name="domino_head_logits_argmax")(*inputs)
        partials = Partials(outs[0], outs[1], plan.num_blocks)
        logits = outs[2].reshape(plan.rows, vocab)[:batch] if write_logits else None
        return partials, logits
    from jax.experimental.pallas import tpu as pltpu

    kernel = functools.partial(_logits_argmax_tpu, plan=plan, act_dtype=act_dtype,
                               has_noise=has_noise, temperature=temperature,
                               write_logits=write_logits)
    block_v, emb_dim, width = plan.block_v, plan.emb_dim, products.shape[1]
    in_specs = [pl.BlockSpec((batch, width), lambda j: (0, 0)),
                pl.BlockSpec((emb_dim, block_v), lambda j: (0, j)),
                pl.BlockSpec((None, batch, block_v), lambda j: (step, 0, j))]
    inputs = [products, w2, jnp.swapaxes(base, 0, 1)]       # [K, B, V]: free at B = 1
    if has_noise:
        in_specs.append(pl.BlockSpec((batch, block_v), lambda j: (0, j)))
        inputs.append(noise)
    part = (1, batch, 128)
    out_specs = [pl.BlockSpec(part, lambda j: (0, 0, 0))] * 2
    out_shape = [jax.ShapeDtypeStruct(part, jnp.float32), jax.ShapeDtypeStruct(part, jnp.int32)]
    if write_logits:
        out_specs.append(pl.BlockSpec((batch, block_v), lambda j: (0, j)))
        out_shape.append(jax.ShapeDtypeStruct((batch, vocab), jnp.float32))
    outs = pl.pallas_call(
        kernel, grid=(plan.num_blocks,), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((batch, 128), jnp.float32),
                        pltpu.VMEM((batch, 128), jnp.int32)],
        compiler_params=pltpu.CompilerParams(),       # grid axes in order ("arbitrary")
        interpret=interpret, name="domino_head_logits_argmax")(*inputs)
    partials = Partials(outs[0][:, :, 0], outs[1][:, :, 0], 1)
    return partials, (outs[2] if write_logits else None)


def logits_argmax_reference(products: jax.Array, w2: jax.Array, base: jax.Array, *,
                            plan: StepPlan, step: int, act_dtype,
                            noise: jax.Array | None = None, temperature: float = 1.0,
                            write_logits: bool = False) -> tuple[Partials, jax.Array | None]:
    """Kernel A in plain JAX: the same blocks of ``block_v`` columns and partials."""
    batch, _, vocab = base.shape
    u = products[:batch, 3 * plan.gru_dim:].astype(act_dtype)
    logits = base[:, step].astype(jnp.float32) + dot(u, w2.astype(act_dtype))   # [B, V]
    key = _choice_key(logits, noise, temperature)
    pad = plan.num_blocks * plan.block_v - vocab
    key = jnp.pad(key, ((0, plan.rows - batch), (0, pad)), constant_values=-jnp.inf)
    blocks = key.reshape(plan.rows, plan.num_blocks, plan.block_v)
    col = jnp.arange(plan.num_blocks * plan.block_v).reshape(plan.num_blocks, plan.block_v)
    best = jnp.max(blocks, axis=2)                                          # [R, nb]
    index = jnp.min(jnp.where(blocks == best[..., None], col, BIG_INDEX), axis=2)
    partials = Partials(best.T, index.T.astype(jnp.int32), plan.num_blocks)
    return partials, (logits if write_logits else None)


# ---------------------------------------------------------------------------- kernel B

def advance_triton(pid, gate_row, parent_row, table_ref, state_ref, prod_ref, z_ref,
                   proj_ref, state_out, prod_out, *, plan: StepPlan, z_row: int):
    """Kernel B's body after the choice (Triton; shared with the tree step): row ``r`` of the
    new state is ``GRU(table[gate_row[r]], h[parent_row[r]], state[parent_row[r]])``, then
    program ``pid`` writes its ``block_n`` columns of the new products (and program 0 the
    new state). Refs: ``table`` flat ``[N * 3G]`` float32, ``state`` flat ``[R * G]``,
    ``products`` flat ``[R * (3G + E)]``, ``z [K, 1 or R, 3G + E]``, ``state_proj [G, 3G +
    E]``; ``gate_row, parent_row [R]`` int32 (valid rows)."""
    from jax.experimental.pallas import triton as plgpu

    rows, gru_dim, chunk, block_n = plan.rows, plan.gru_dim, plan.gru_chunk, plan.block_n
    width = 3 * gru_dim + plan.emb_dim
    live = (lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < plan.batch)     # pad rows: 0
    one_row = plan.row_gru and plan.batch == 1
    if one_row:       # the GRU on the live row alone, broadcast into the dot's R rows
        first = lax.broadcasted_iota(jnp.int32, (rows,), 0) == 0
        pick = lambda x: jnp.sum(jnp.where(first, x, 0))                    # noqa: E731
        gate_row, parent_row = pick(gate_row), pick(parent_row)             # scalars
        load = lambda ref, at: plgpu.load(ref.at[at])                       # noqa: E731
    else:
        gate_row, parent_row = gate_row[:, None], parent_row[:, None]       # [R, 1]
        load = lambda ref, at: plgpu.load(ref.at[at], mask=live, other=0)   # noqa: E731
    gate_at = gate_row * (3 * gru_dim)
    state_at = parent_row * gru_dim
    hidden_at = parent_row * width
    cols = pl.multiple_of(pid * block_n, block_n)

    def gru_chunk(g0):
        lane = g0 + lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
        gates = [load(table_ref, gate_at + k * gru_dim + lane) for k in range(3)]
        hidden = [load(prod_ref, hidden_at + k * gru_dim + lane) for k in range(3)]
        state = load(state_ref, state_at + lane)
        new = gru_from_gates(gates, hidden, state.astype(jnp.float32)).astype(state.dtype)
        if one_row:                                           # [1, chunk] -> [R, chunk]
            new = jnp.where(live, jnp.broadcast_to(new, (rows, chunk)), 0).astype(state.dtype)
        return new

    if plan.split_advance:               # program pid: chunk pid of the state, no products
        g0 = pl.multiple_of(pid * chunk, chunk)
        state_out[:, pl.ds(g0, chunk)] = gru_chunk(g0)
        return

    def body(c, acc):
        g0 = pl.multiple_of(c * chunk, chunk)
        new = gru_chunk(g0)

        @pl.when(pid == 0)
        def _write_state():
            state_out[:, pl.ds(g0, chunk)] = new

        w = proj_ref[pl.ds(g0, chunk), pl.ds(cols, block_n)]
        return acc + dot(new, w.astype(new.dtype))

    acc = lax.fori_loop(0, gru_dim // chunk, body, jnp.zeros((rows, block_n), jnp.float32))
    col = cols + lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    z = z_ref[z_row, :, pl.ds(cols, block_n)]
    prod_out[:, pl.ds(cols, block_n)] = jnp.where(col >= 3 * gru_dim, jax.nn.silu(z + acc),
                                                  acc)


def advance_grid(plan: StepPlan) -> int:
    """Programs of an advance launch: one per ``state_proj`` column block, or with
    ``split_advance`` one per ``gru_chunk`` of the state."""
    return plan.gru_dim // plan.gru_chunk if plan.split_advance else plan.num_col_blocks


def products_of(new_state: jax.Array, state_proj: jax.Array, z_row: jax.Array,
                gru_dim: int) -> jax.Array:
    """``[R, 3G + E]`` float32 products of ``new_state [R, G]`` with ``state_proj``: ``h``
    in the first ``3G`` columns, then ``silu(z_row + .)`` (``z_row [R or 1, 3G + E]``), in
    XLA (the twins' advance, the rollout's first step and ``split_advance``)."""
    acc = dot(new_state, state_proj.astype(new_state.dtype))
    col = jnp.arange(acc.shape[1])[None]
    return jnp.where(col >= 3 * gru_dim, jax.nn.silu(z_row + acc), acc)


def _state_step_triton(value_ref, index_ref, table_ref, state_ref, prod_ref, z_ref,
                       proj_ref, token_ref, state_out, *prod_out, plan: StepPlan,
                       num_parts: int, part_rows: int, table_rows: int, row_stride: int,
                       z_row: int):
    """Finish the choice from ``value, index [P, R]``, then :func:`advance_triton` (rows keep
    their own state; ``prod_out`` absent with ``split_advance``); also writes ``token [R]``
    int32."""
    from jax.experimental.pallas import triton as plgpu

    pid = pl.program_id(0)
    part = lax.broadcasted_iota(jnp.int32, (part_rows, 1), 0)
    held = part < num_parts
    value = plgpu.load(value_ref, mask=held, other=-jnp.inf)                 # [P, R]
    index = plgpu.load(index_ref, mask=held, other=BIG_INDEX)
    best = jnp.max(value, axis=0, keepdims=True)
    token = jnp.min(jnp.where(value == best, index, BIG_INDEX), axis=0)       # [R]
    row = lax.broadcasted_iota(jnp.int32, (plan.rows,), 0)
    token = jnp.where(row < plan.batch, jnp.clip(token, 0, table_rows - 1), 0)
    gate_row = token + jnp.minimum(row, plan.batch - 1) * row_stride
    advance_triton(pid, gate_row, row, table_ref, state_ref, prod_ref, z_ref, proj_ref,
                   state_out, prod_out[0] if prod_out else None, plan=plan, z_row=z_row)

    @pl.when(pid == 0)
    def _write_token():
        token_ref[...] = token


def _state_step_tpu(token_ref, parent_ref, table_hbm, state_ref, prod_ref, z_ref, proj_ref,
                    state_out, prod_out, gates_ref, hidden_ref, sem, *, plan: StepPlan,
                    row_stride: int, has_parents: bool):
    """Grid step ``j`` over ``state_proj`` column blocks (in order): ``token, parent [B]`` in
    SMEM (scalar prefetch), ``table [N, 3G]`` in HBM, blocks ``state [B, G]``, ``products
    [B, 3G + E]``, ``z [1 or B, bn]``, ``state_proj [G, bn]`` (the last block may overhang:
    its extra lanes are never stored); outputs ``state [B, G]`` (made at ``j = 0``, then
    read back from VMEM) and ``products [B, bn]``; scratch: the gathered gates (and parent
    rows)."""
    from jax.experimental.pallas import tpu as pltpu

    j = pl.program_id(0)
    gru_dim, batch = plan.gru_dim, plan.batch

    @pl.when(j == 0)
    def _gru():
        copies = [pltpu.make_async_copy(
            table_hbm.at[pl.ds(token_ref[b] + b * row_stride, 1)],
            gates_ref.at[pl.ds(b, 1)], sem) for b in range(batch)]
        for copy in copies:
            copy.start()
        if has_parents:                   # parent rows of the state and of h, by scalar index
            for b in range(batch):
                parent = parent_ref[b]
                hidden_ref[pl.ds(b, 1), :] = prod_ref[pl.ds(parent, 1), :3 * gru_dim]
                state_out[pl.ds(b, 1), :] = state_ref[pl.ds(parent, 1), :]
            hidden, state = hidden_ref[...], state_out[...]
        else:
            hidden, state = prod_ref[:, :3 * gru_dim], state_ref[...]
        for copy in copies:
            copy.wait()
        gates = gates_ref[...]
        split = lambda x: [x[:, k * gru_dim:(k + 1) * gru_dim] for k in range(3)]  # noqa: E731
        new = gru_from_gates(split(gates), split(hidden), state.astype(jnp.float32))
        state_out[...] = new.astype(state_out.dtype)

    new = state_out[...]
    acc = dot(new, proj_ref[...].astype(new.dtype))                         # [B, bn]
    col = j * plan.block_n + lax.broadcasted_iota(jnp.int32, acc.shape, 1)
    prod_out[...] = jnp.where(col >= 3 * gru_dim, jax.nn.silu(z_ref[...] + acc), acc)


def advance_tpu(token: jax.Array, parent: jax.Array | None, table: jax.Array,
                state: jax.Array, products: jax.Array, z: jax.Array, state_proj: jax.Array, *,
                plan: StepPlan, row_stride: int, z_row: int, interpret):
    """Kernel B on TPU for choices already made: ``token [B]`` (clipped to the table),
    ``parent [B]`` (row ``b`` continues row ``parent[b]`` of ``state`` / ``products``;
    ``None``: row ``b``). Returns ``(new state [B, G], new products [B, 3G + E])``."""
    from jax.experimental.pallas import tpu as pltpu

    batch, gru_dim, block_n = plan.batch, plan.gru_dim, plan.block_n
    width, z_rows = products.shape[1], z.shape[1]
    has_parents = parent is not None
    kernel = functools.partial(_state_step_tpu, plan=plan, row_stride=row_stride,
                               has_parents=has_parents)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(plan.num_col_blocks,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec((batch, gru_dim), lambda j, t, p: (0, 0)),
                  pl.BlockSpec((batch, width), lambda j, t, p: (0, 0)),
                  pl.BlockSpec((None, z_rows, block_n), lambda j, t, p: (z_row, 0, j)),
                  pl.BlockSpec((gru_dim, block_n), lambda j, t, p: (0, j))],
        out_specs=[pl.BlockSpec((batch, gru_dim), lambda j, t, p: (0, 0)),
                   pl.BlockSpec((batch, block_n), lambda j, t, p: (0, j))],
        scratch_shapes=[pltpu.VMEM((batch, 3 * gru_dim), jnp.float32),
                        pltpu.VMEM((batch, 3 * gru_dim) if has_parents else (8, 128),
                                   jnp.float32),
                        pltpu.SemaphoreType.DMA(())])
    parent = jnp.arange(batch, dtype=jnp.int32) if parent is None else parent
    return pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(state.shape, state.dtype),
                   jax.ShapeDtypeStruct(products.shape, jnp.float32)],
        compiler_params=pltpu.CompilerParams(),       # grid axes in order ("arbitrary")
        interpret=interpret, name="domino_head_state_step",
    )(token.astype(jnp.int32), parent.astype(jnp.int32), table, state, products, z, state_proj)


@functools.partial(jax.jit, static_argnames=("plan", "row_stride", "z_row", "interpret"))
def state_step(partials: Partials, table: jax.Array, state: jax.Array, products: jax.Array,
               z: jax.Array, state_proj: jax.Array, *, plan: StepPlan, row_stride: int = 0,
               z_row: int, interpret=False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Kernel B: finish the choice, gather gates, GRU update, state products (module doc).

    Args:
      partials: kernel A's (or :func:`given_choice`'s) partials.
      table: the GRU input gates per choice index, float32: ``[N, 3G]`` shared by every row
        (the head's ``gru_input_table``, ``N = V``), or ``[B * N, 3G]`` with ``row_stride =
        N`` (row ``b`` reads row ``b * N + index``: a candidate pool's gates).
      state: ``[R, G]`` GRU state (activation dtype); products: ``[R, 3G + E]`` float32
        of that state. z: :func:`pad_z`'s ``[K, R, 3G + E]`` (or ``[K, 1, 3G + E]``, one
        row for all); ``z_row``: the next position.
      state_proj: ``[G, 3G + E]`` = ``[W_hh | W1_s]``.
    Returns ``(index [B] int32, new state [R, G], new products [R, 3G + E])``.
    """
    rows = plan.rows
    table_rows = table.shape[0] if row_stride == 0 else row_stride
    if plan.variant == "triton":
        from jax.experimental.pallas import triton as plgpu

        kernel = functools.partial(
            _state_step_triton, plan=plan, num_parts=partials.num,
            part_rows=partials.value.shape[0], table_rows=table_rows,
            row_stride=row_stride, z_row=z_row)
        out_shape = [jax.ShapeDtypeStruct((rows,), jnp.int32),
                     jax.ShapeDtypeStruct(state.shape, state.dtype)]
        if not plan.split_advance:
            out_shape.append(jax.ShapeDtypeStruct(products.shape, jnp.float32))
        token, new_state, *new_products = pl.pallas_call(
            kernel, grid=(advance_grid(plan),), out_shape=out_shape,
            compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps_b,
                                                 num_stages=plan.num_stages_b),
            interpret=interpret, name="domino_head_state_step",
        )(partials.value, partials.index, table.reshape(-1), state.reshape(-1),
          products.reshape(-1), z, state_proj)
        if plan.split_advance:
            new_products = [products_of(new_state, state_proj, z[z_row], plan.gru_dim)]
        return token[:plan.batch], new_state, new_products[0]
    token = jnp.clip(finish_choice(partials, plan.batch), 0, table_rows - 1)
    new_state, new_products = advance_tpu(token, None, table, state, products, z, state_proj,
                                          plan=plan, row_stride=row_stride, z_row=z_row,
                                          interpret=interpret)
    return token, new_state, new_products


def advance_reference(token: jax.Array, parent: jax.Array | None, table: jax.Array,
                      state: jax.Array, products: jax.Array, z: jax.Array,
                      state_proj: jax.Array, *, plan: StepPlan, row_stride: int = 0,
                      z_row: int) -> tuple[jax.Array, jax.Array]:
    """Kernel B after the choice, plain JAX: ``token [B]``, ``parent [B]`` (``None``: row
    ``b``) -> ``(new state [R, G], new products [R, 3G + E])``."""
    batch, rows, gru_dim = plan.batch, plan.rows, plan.gru_dim
    pad = lambda x: jnp.pad(x, ((0, rows - batch), (0, 0)))                # noqa: E731
    gates = pad(table[token + jnp.arange(batch) * row_stride])             # [R, 3G]
    hidden, state_in = products[:, :3 * gru_dim], state
    if parent is not None:
        hidden, state_in = pad(hidden[parent]), pad(state[parent])
    split = lambda x: [x[:, k * gru_dim:(k + 1) * gru_dim] for k in range(3)]  # noqa: E731
    new = gru_from_gates(split(gates), split(hidden),
                         state_in.astype(jnp.float32)).astype(state.dtype)
    return new, products_of(new, state_proj, z[z_row], gru_dim)


def state_step_reference(partials: Partials, table: jax.Array, state: jax.Array,
                         products: jax.Array, z: jax.Array, state_proj: jax.Array, *,
                         plan: StepPlan, row_stride: int = 0,
                         z_row: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Kernel B in plain JAX (same contract as :func:`state_step`)."""
    table_rows = table.shape[0] if row_stride == 0 else row_stride
    token = jnp.clip(finish_choice(partials, plan.batch), 0, table_rows - 1)
    new, new_products = advance_reference(token, None, table, state, products, z, state_proj,
                                          plan=plan, row_stride=row_stride, z_row=z_row)
    return token, new, new_products
