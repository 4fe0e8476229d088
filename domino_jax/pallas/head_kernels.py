"""The Domino head's rollout and DominoTree's depth steps through the fused kernels, and the
``implementation=`` switch that picks them (``DominoOptions.head_kernels`` /
``DominoTreeOptions.head_kernels``, the CLI's ``--head-kernels``).

:func:`resolve_head_kernels` turns an implementation name (``auto`` / ``xla`` / ``reference``
/ ``pallas`` / ``pallas_interpret``, as for the cache attention) into :class:`HeadKernels` or
``None`` (the XLA path: the plain JAX of ``models/domino_head.py`` and ``decode/tree.py``):

* ``xla``: ``None``.
* ``reference``: the kernels' plain-JAX twins (:mod:`~domino_jax.pallas.head_step`,
  :mod:`~domino_jax.pallas.tree_step`), on any backend: the blocked algorithm without Pallas.
* ``pallas``: the kernels compiled for this backend, Triton on a CUDA GPU, Mosaic on a TPU.
  Fails fast (``ValueError`` with the reason) on another backend, for shapes the kernels do
  not take, or without the head's decode layout with its ``[V, 3G]`` GRU input table.
* ``pallas_interpret``: the kernels in the Pallas interpreter (any backend; the Triton
  variant unless the backend is a TPU).
* ``auto`` (the default): the kernel where :data:`MEASURED_FASTER` lists this device kind
  for it -- a measurement found the kernel faster end to end (``docs/design.md`` §6) --
  else XLA (with a warning when a listed device falls back for its shapes). What is listed,
  and the measurements behind it: ``docs/design.md`` §6.

:func:`fused_rollout` is ``domino_head.rollout`` (same drafts up to float32 accumulation
order) as a loop of kernel steps; :func:`fused_tree_steps` gives ``decode.tree``'s
frontier its depth step through the DominoTree kernel.

Blocking: every path takes a :class:`~domino_jax.pallas.head_step.KernelTuning`
(``HeadKernels.tuning``; ``rollout_kernels`` / ``tree_kernels(..., tuning=)``;
:func:`parse_tuning` reads one from ``"block_v=1024,num_warps=8"``), the default blocking
when empty; the benchmarks sweep it (``benchmarks/bench_tree_build.py --tunings``).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from domino_jax.config import DraftConfig
from domino_jax.models import domino_head
from domino_jax.pallas import HEAD_IMPLEMENTATIONS, check_implementation
from domino_jax.pallas import head_step as hs
from domino_jax.pallas import tree_step as ts
from domino_jax.pallas.head_step import KernelTuning, check_tuning
from domino_jax.topk import top_k

# kernel -> device kinds (jax.devices()[0].device_kind) on which a measurement found the
# kernel faster end to end (docs/design.md §6); "auto" picks it only there.
MEASURED_FASTER: dict[str, tuple[str, ...]] = {"head": ("NVIDIA H100 80GB HBM3",), "tree": ()}

# kernel -> device kind -> the blocking a sweep of `benchmarks/bench_tree_build.py
# --tunings` measured fastest there (docs/design.md §6); a call that names no tuning gets
# it on that device, the default blocking elsewhere.
DEVICE_TUNINGS: dict[str, dict[str, KernelTuning]] = {
    "head": {"NVIDIA H100 80GB HBM3": KernelTuning(split_advance=1)},
    "tree": {"NVIDIA H100 80GB HBM3": KernelTuning(gru_chunk=32, split_advance=1)},
}


def device_tuning(kernel: str, tuning: KernelTuning | None,
                  problem: Callable[[str, KernelTuning], str | None]) -> KernelTuning:
    """``tuning`` when given; else :data:`DEVICE_TUNINGS`' entry for ``kernel`` (``"head"``
    / ``"tree"``) on this process's first device where ``problem(variant, tuning)`` (why the
    variant's plan cannot take a tuning for the call's shapes, or ``None``) finds none; else
    the default blocking."""
    if tuning is not None:
        return tuning
    tuned = DEVICE_TUNINGS[kernel].get(jax.devices()[0].device_kind)
    variant = backend_variant()
    if tuned is None or variant is None or problem(variant, tuned) is not None:
        return KernelTuning()
    return tuned


class HeadKernels(NamedTuple):
    """How the head's steps run (static): the Pallas kernels of ``variant`` (``"triton"`` /
    ``"mosaic_tpu"``), in the interpreter when ``interpret`` is set (``True`` or a
    ``pltpu.InterpretParams``), or their plain-JAX twins (``twin``), blocked per ``tuning``
    (empty: the default blocking)."""

    variant: str
    twin: bool = False
    interpret: Any = False
    tuning: KernelTuning = KernelTuning()


def parse_tuning(spec: str) -> KernelTuning:
    """A :class:`~domino_jax.pallas.head_step.KernelTuning` from ``"field=int,..."``
    (``""`` or ``"default"``: the default blocking), e.g. ``"block_v=1024,num_warps=8"``.
    ``ValueError`` naming an unknown field or a bad value."""
    spec = spec.strip()
    if spec in ("", "default"):
        return KernelTuning()
    values = {}
    for item in spec.split(","):
        name, sep, value = item.strip().partition("=")
        name = name.strip()
        if not sep or name not in KernelTuning._fields:
            raise ValueError(f"kernel tuning {item.strip()!r}: expected field=int with a field "
                             f"of {KernelTuning._fields}")
        if name in values:
            raise ValueError(f"kernel tuning {spec!r}: {name} given twice")
        try:
            values[name] = int(value)
        except ValueError:
            raise ValueError(f"kernel tuning {name}={value.strip()!r}: not an int") from None
    tuning = KernelTuning(**values)
    check_tuning(tuning)
    return tuning


def backend_variant() -> str | None:
    """The kernel variant this backend compiles: ``"triton"`` on CUDA, ``"mosaic_tpu"`` on a
    TPU, else ``None``."""
    device = jax.devices()[0]
    if device.platform == "gpu" and "NVIDIA" in device.device_kind:
        return "triton"
    return "mosaic_tpu" if device.platform == "tpu" else None


def interpret_mode(variant: str):
    """The interpreter a variant runs in off its device (the TPU one models DMAs and SMEM)."""
    if variant == "mosaic_tpu":
        from jax.experimental.pallas import tpu as pltpu
        return pltpu.InterpretParams()
    return True


def resolve_head_kernels(implementation: str, kernel: str,
                         unsupported: Callable[[str], str | None],
                         tuning: KernelTuning | None = None) -> HeadKernels | None:
    """:class:`HeadKernels` for ``implementation`` (module doc), or ``None`` for XLA.

    ``kernel``: ``"head"`` (the chain rollout) or ``"tree"`` (DominoTree's depth step);
    ``unsupported(variant)``: why that variant's kernels cannot take this call, or ``None``
    (it also checks ``tuning`` against the shapes); ``tuning``: the blocking (``None``: the
    default). Raises ``ValueError`` for an unknown name or an explicit request it cannot serve.
    """
    check_implementation("head kernel", implementation, HEAD_IMPLEMENTATIONS)
    tuning = KernelTuning() if tuning is None else tuning
    check_tuning(tuning)
    if implementation == "xla":
        return None
    variant = backend_variant()
    what = "Domino head" if kernel == "head" else "DominoTree depth-step"
    if implementation == "auto":
        if variant is None or jax.devices()[0].device_kind not in MEASURED_FASTER[kernel]:
            return None
        reason = unsupported(variant)
        if reason is not None:
            warnings.warn(f"{what} kernels: {reason}; using the XLA path", stacklevel=3)
            return None
        return HeadKernels(variant, tuning=tuning)
    if implementation == "pallas" and variant is None:
        raise ValueError(f"{what} implementation 'pallas': the Pallas kernels need a CUDA GPU "
                         f"(Triton) or a TPU (Mosaic); backend: {jax.default_backend()}")
    if implementation != "pallas":
        variant = "mosaic_tpu" if variant == "mosaic_tpu" else "triton"
    reason = unsupported(variant)
    if reason is not None:
        raise ValueError(f"{what} implementation {implementation!r}: {reason}")
    if implementation == "reference":
        return HeadKernels(variant, twin=True, tuning=tuning)
    if implementation == "pallas_interpret":
        return HeadKernels(variant, interpret=interpret_mode(variant), tuning=tuning)
    return HeadKernels(variant, tuning=tuning)


def check_request(implementation: str, input_table: bool) -> None:
    """Fail fast, before any weights are read, on a request that cannot be served whatever
    the shapes: ``pallas`` without a CUDA GPU or TPU, or any kernel path without the head's
    ``[V, 3G]`` input table (``input_table``: the head will have one)."""
    check_implementation("head kernel", implementation, HEAD_IMPLEMENTATIONS)
    if implementation in ("auto", "xla"):
        return
    if implementation == "pallas" and backend_variant() is None:
        raise ValueError(f"--head-kernels pallas: the Pallas kernels need a CUDA GPU (Triton) "
                         f"or a TPU (Mosaic); backend: {jax.default_backend()}")
    if not input_table:
        raise ValueError(f"--head-kernels {implementation}: the kernels gather GRU gates from "
                         "the head's [V, 3G] input table; drop --no-head-input-table "
                         "(load_pair(head_input_table=True, fused=True))")


def _no_table(head) -> str | None:
    if isinstance(head, domino_head.DecodeHead) and head.input_table is not None:
        return None
    return ("the head is not in its decode layout with the [V, 3G] GRU input table "
            "(load_pair(fused=True, head_input_table=True), the CLI's default)")


def _dims(head) -> tuple[int, int]:
    """``(E, G)`` of a head."""
    params = domino_head.plain_params(head)
    return params["embed_proj_0"]["kernel"].shape[1], params["prefix_gru"]["weight_hh"].shape[0]


def _plan_problem(make_plan: Callable[[], Any]) -> str | None:
    """Why ``make_plan()`` (a ``plan_step`` / ``plan_tree_step`` call, which checks the
    shapes and the tuning) raises, or ``None``."""
    try:
        make_plan()
    except ValueError as e:
        return str(e)
    return None


def rollout_kernels(implementation: str, head, batch: int, vocab: int,
                    tuning: KernelTuning | None = None) -> HeadKernels | None:
    """:func:`resolve_head_kernels` for the chain rollout of ``batch`` rows (``tuning``
    ``None``: :func:`device_tuning`'s)."""
    emb_dim, gru_dim = _dims(head)

    def problem(variant, tuning):
        return _no_table(head) or _plan_problem(
            lambda: hs.plan_step(variant, batch, vocab, emb_dim, gru_dim, tuning=tuning))

    tuning = device_tuning("head", tuning, problem)
    return resolve_head_kernels(implementation, "head", lambda v: problem(v, tuning), tuning)


def tree_kernels(implementation: str, head, budget: int, vocab: int, node_topk: int,
                 topm: int, marginal: bool = False,
                 tuning: KernelTuning | None = None) -> HeadKernels | None:
    """:func:`resolve_head_kernels` for DominoTree's depth step (``tuning`` ``None``:
    :func:`device_tuning`'s)."""
    emb_dim, gru_dim = _dims(head)

    def problem(variant, tuning):
        if marginal:
            return "the marginal control has no GRU (nothing to fuse)"
        return _no_table(head) or _plan_problem(      # the plan checks the shapes too
            lambda: ts.plan_tree_step(variant, budget, vocab, emb_dim, gru_dim,
                                      min(node_topk, vocab), min(topm, vocab), tuning))

    tuning = device_tuning("tree", tuning, problem)
    return resolve_head_kernels(implementation, "tree", lambda v: problem(v, tuning), tuning)


def _rows(x: jax.Array, rows: int) -> jax.Array:
    return jnp.pad(x, ((0, rows - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))


def lane_products(state: jax.Array, state_proj: jax.Array, z: jax.Array, row: int,
                  gru_dim: int) -> jax.Array:
    """The carried products ``[R, 3G + E]`` of ``state [R, G]`` (``h``, then ``u`` with
    ``z[row]``), in XLA: the loop's first step, which no kernel made."""
    return hs.products_of(state, state_proj, z[row], gru_dim)


def fused_rollout(head: domino_head.DecodeHead, config: DraftConfig, draft_hidden: jax.Array,
                  base_logits: jax.Array, root_embed: jax.Array, kernels: HeadKernels,
                  temperature: float | None, rng_key: jax.Array, candidate_topm: int = 0,
                  need_logits: bool = True) -> tuple[jax.Array, jax.Array | None]:
    """``domino_head.rollout`` through the step kernels (``head_step``'s module doc).

    Same arguments as ``rollout`` but the draw: ``temperature`` ``None`` = argmax drafts,
    else ``jax.random.categorical(key_i, logits / temperature)`` draws (the full-vocabulary
    ones as a Gumbel-max inside kernel A), with the same per-position keys. ``need_logits``:
    also return ``rollout``'s ``[B, K, V]`` logits; ``False``: ``None``, and kernel A
    writes no logits (greedy drafts need none).
    """
    batch, num_drafts, hidden_size = draft_hidden.shape
    vocab = base_logits.shape[-1]
    prefix_len = min(config.pure_draft_prefix_len, num_drafts)
    act_dtype = draft_hidden.dtype
    params = domino_head.plain_params(head)
    emb_dim, gru_dim = _dims(head)
    w2, table, state_proj = params["embed_proj_2"]["kernel"], head.input_table, head.state_proj
    plan = hs.plan_step(kernels.variant, batch, vocab, emb_dim, gru_dim, tuning=kernels.tuning)
    rows = plan.rows
    step_a = hs.logits_argmax_reference if kernels.twin else hs.logits_argmax
    step_b = hs.state_step_reference if kernels.twin else hs.state_step
    run = {} if kernels.twin else {"interpret": kernels.interpret}
    w1_z = params["embed_proj_0"]["kernel"][:hidden_size]
    z = hs.pad_z(domino_head._matmul(draft_hidden, w1_z), gru_dim, rows)   # [K, R, 3G + E]
    state = _rows(domino_head.root_gru_state(head, root_embed.astype(act_dtype)), rows)
    products = lane_products(state, state_proj, z, 0, gru_dim)
    base = base_logits.astype(jnp.float32)
    keys = jax.random.split(rng_key, num_drafts)
    m = min(candidate_topm, vocab)
    cand = None
    if m > 0:                                          # per-position pools, made once
        cand_logits, cand = top_k(base, m)                                  # [B, K, M]
        w2_cand = jnp.moveaxis(w2[:, cand], 0, -1)                          # [B, K, M, E]
        pool_gates = table[jnp.swapaxes(cand, 0, 1)].reshape(num_drafts, batch * m, -1)

    def choose(logits, key):
        if temperature is None:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)

    tokens, logits, pooled = [], [], []
    for i in range(num_drafts):
        gates, stride = table, 0
        if i < prefix_len:                             # uncorrected: the base logits
            parts = hs.given_choice(choose(base[:, i], keys[i]), rows)
            logits.append(base[:, i])
        elif m > 0:                                    # the pool: M dot products in XLA
            u = products[:batch, 3 * gru_dim:].astype(act_dtype)
            pool_logits = cand_logits[:, i] + jnp.einsum(
                "bme,be->bm", w2_cand[:, i], u, preferred_element_type=jnp.float32)
            parts = hs.given_choice(choose(pool_logits, keys[i]), rows)
            gates, stride = pool_gates[i], m
            pooled.append(pool_logits)
        else:                                          # kernel A over the vocabulary
            noise = None
            if temperature is not None:
                noise = jax.random.gumbel(keys[i], (batch, vocab), jnp.float32)
            parts, logits_i = step_a(products, w2, base, plan=plan, step=i,
                                     act_dtype=act_dtype, noise=noise,
                                     temperature=temperature or 1.0,
                                     write_logits=need_logits, **run)
            if need_logits:
                logits.append(logits_i)
        if i + 1 < num_drafts:                         # kernel B: the next state
            index, state, products = step_b(parts, gates, state, products, z, state_proj,
                                            plan=plan, row_stride=stride, z_row=i + 1, **run)
        else:
            index = hs.finish_choice(parts, batch)
        if stride:                                     # a pool index -> its token
            index = jnp.take_along_axis(cand[:, i], index[:, None], axis=1)[:, 0]
        tokens.append(index)
    tokens = jnp.stack(tokens, axis=1)
    if not need_logits:
        return tokens, None
    return tokens, domino_head.rollout_logits(logits, pooled, cand, prefix_len, batch, vocab)


# ----------------------------------------------------------------------- DominoTree depth step

class Lanes(NamedTuple):
    """The frontier's lanes between depth steps: ``score [R]`` float32 (``-inf``: no node),
    ``state [R, G]``, ``products [R, 3G + E]`` (``u`` made for the next depth)."""

    score: jax.Array
    state: jax.Array
    products: jax.Array


def fused_tree_steps(kernels: HeadKernels, head: domino_head.DecodeHead,
                     config: DraftConfig, draft_hidden: jax.Array, base_logits: jax.Array,
                     root_state: jax.Array, budget: int, node_topk: int = 8, topm: int = 64):
    """``(depth_step, root lanes)`` for ``decode.tree.frontier_tree``: DominoTree (one tree;
    ``build_dominotree``'s arguments) with every depth step through
    :func:`~domino_jax.pallas.tree_step.tree_step` (or its twin)."""
    vocab = base_logits.shape[-1]
    emb_dim, gru_dim = _dims(head)
    plan = ts.plan_tree_step(kernels.variant, budget, vocab, emb_dim, gru_dim,
                             min(node_topk, vocab), min(topm, vocab), kernels.tuning)
    tables = domino_head.tree_tables(head, draft_hidden, base_logits, node_topk, topm)
    inputs = ts.prepare(plan, tables.cand, tables.cand_logits, tables.cand_w2,
                        tables.base_tok, tables.base_lp, tables.z_proj)
    rows = plan.step.rows
    state = jnp.broadcast_to(root_state, (rows,) + root_state.shape)
    lanes = Lanes(jnp.full((rows,), -jnp.inf, jnp.float32).at[0].set(0.0), state,
                  lane_products(state, head.state_proj, inputs.z, 0, gru_dim))
    run = ts.tree_step_reference if kernels.twin else ts.tree_step
    extra = {} if kernels.twin else {"interpret": kernels.interpret}

    def depth_step(lanes: Lanes, d: int, advance: bool):
        best, token, lane, state, products = run(
            lanes.score, lanes.state, lanes.products, inputs, head.input_table,
            head.state_proj, plan=plan, depth=d,
            from_base=d < config.pure_draft_prefix_len, advance=advance, **extra)
        if not advance:
            return best, token, lane, None
        score = jnp.pad(best, (0, rows - budget), constant_values=-jnp.inf)
        return best, token, lane, Lanes(score, state, products)

    return depth_step, lanes
