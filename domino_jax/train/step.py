"""One jitted optimizer step: gradient accumulation over micro-batches, AdamW, sharding.

    state = init_state(train_config, draft_params)
    step_fn = make_train_step(train_config, draft_config, target, mesh, state, target_params)
    state, metrics = step_fn(state, batch, target_params, horizon)   # batch: [micro, b, S]

* ``TrainState(step, params, opt_state)``: float32 master params; the loss casts them to
  ``compute_dtype``. ``step`` counts optimizer steps already taken; the step being
  computed is ``step + 1`` (the lambda schedule counts from 1, docs/algorithms.md §9.11).
* Randomness (anchor sampling) is ``fold_in(PRNGKey(seed), step + 1)`` split per
  micro-batch: a pure function of the step, so a resumed run repeats it exactly.
* ``horizon`` (int32 scalar, an argument, not a compile-time constant): the step at which
  the schedules end: the learning rate's cosine reaches 0 and the Domino lambda its decay.
  ``cfg.steps`` unless a run on a deadline fits its schedule to the steps that fit
  (:func:`domino_jax.train.loop.train`'s ``max_seconds``, docs/design.md §26); changing it
  recompiles nothing.
* Sharding: the frozen target by ``sharding.target_param_shardings`` (tensor/fsdp), the
  drafter replicated or fsdp-sharded (largest divisible dim), batches over
  ``("data", "fsdp")`` on their batch axis.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from domino_jax.config import DraftConfig
from domino_jax.models.qwen3 import TargetLM
from domino_jax.sharding import target_param_shardings
from domino_jax.train.config import TrainConfig, default_gamma
from domino_jax.train.cost import step_flops
from domino_jax.train.loss import draft_loss, lambda_schedule


@flax.struct.dataclass
class TrainState:
    step: jax.Array          # int32 scalar: optimizer steps taken
    params: Any              # float32 drafter params
    opt_state: Any


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Grad clipping + AdamW at unit learning rate: :func:`train_step` scales the update by
    :func:`learning_rate` (its horizon is a runtime value). The unit rate is a schedule, so
    the state keeps AdamW-with-schedule's structure (a step count) and older checkpoints
    restore."""
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                       optax.adamw(lambda count: 1.0, b1=0.9, b2=0.95,
                                   weight_decay=cfg.weight_decay))


def learning_rate(cfg: TrainConfig, count, horizon=None):
    """Linear warmup from 0 to ``cfg.lr`` over ``max(1, floor(horizon * warmup_ratio))``
    steps, then a cosine to 0 at step ``horizon`` (default ``cfg.steps``); ``count`` is the
    optimizer steps taken (optax's convention). Works on Python numbers and traced arrays;
    with the default horizon it is ``optax.warmup_cosine_decay_schedule(0, lr, warmup,
    steps, 0)``."""
    horizon = jnp.asarray(cfg.steps if horizon is None else horizon, jnp.float32)
    warmup = jnp.maximum(1.0, jnp.floor(horizon * cfg.warmup_ratio))
    count = jnp.asarray(count, jnp.float32)
    decay = jnp.maximum(horizon, warmup + 1.0) - warmup
    frac = jnp.clip((count - warmup) / decay, 0.0, 1.0)
    return jnp.where(count < warmup, cfg.lr * count / warmup,
                     0.5 * cfg.lr * (1.0 + jnp.cos(jnp.pi * frac)))


def init_state(cfg: TrainConfig, params: Any) -> TrainState:
    # a fresh copy: the step donates the state, the caller's arrays must stay alive
    params = jax.tree_util.tree_map(lambda x: jnp.array(x, jnp.float32, copy=True), params)
    return TrainState(jnp.zeros((), jnp.int32), params, make_optimizer(cfg).init(params))


def _compute_dtype(cfg: TrainConfig):
    return jnp.dtype(cfg.compute_dtype)


def train_step(state: TrainState, batch: dict, target_params: Any, horizon=None, *,
               cfg: TrainConfig, config: DraftConfig, target: TargetLM
               ) -> tuple[TrainState, dict]:
    """One optimizer step on ``batch {"input_ids", "loss_mask"}: [micro, b, S]``; the
    schedules end at step ``horizon`` (default ``cfg.steps``)."""
    horizon = cfg.steps if horizon is None else horizon
    step = state.step + 1
    lam = lambda_schedule(step, horizon, cfg.lambda_start, cfg.decay_ratio)
    if not config.has_domino_head:
        lam = jnp.float32(1.0)
    gamma = cfg.gamma or default_gamma(config.block_size)
    micro = batch["input_ids"].shape[0]
    keys = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(cfg.seed), step), micro)
    loss_fn = functools.partial(draft_loss, target=target, config=config,
                                num_anchors=cfg.num_anchors, gamma=gamma,
                                compute_dtype=_compute_dtype(cfg),
                                soft_weight=cfg.soft_label_weight,
                                position_weights=cfg.position_weights,
                                chunk_rows=cfg.loss_chunk_rows,
                                joint_final=cfg.final_logits is None)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def accumulate(grads_sum, xs):
        micro_batch, key = xs
        (_, metrics), grads = grad_fn(state.params, target_params, micro_batch, key, lam)
        return jax.tree_util.tree_map(jnp.add, grads_sum, grads), metrics

    zeros = jax.tree_util.tree_map(jnp.zeros_like, state.params)
    grads, metrics = jax.lax.scan(accumulate, zeros, (batch, keys))
    grads = jax.tree_util.tree_map(lambda g: g / micro, grads)
    optimizer = make_optimizer(cfg)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    lr = learning_rate(cfg, state.step, horizon)
    updates = jax.tree_util.tree_map(lambda u: (lr * u).astype(u.dtype), updates)
    params = optax.apply_updates(state.params, updates)
    summed = ("correct", "count", "tokens", "weight_sum")
    out = {k: (v.sum(0) if k in summed else v.mean(0)) for k, v in metrics.items()}
    out["lambda"] = lam
    out["grad_norm"] = optax.tree.norm(grads)
    out["lr"] = lr
    return TrainState(step, params, opt_state), out


# ----------------------------------------------------------------------------- sharding

def make_train_mesh(cfg: TrainConfig) -> Mesh:
    from domino_jax.sharding import make_mesh

    size = cfg.mesh_data * cfg.mesh_fsdp * cfg.mesh_tensor
    return make_mesh(cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_tensor,
                     devices=jax.devices()[:size])


def _fsdp_spec(shape, fsdp: int) -> P:
    """Shard the largest dim divisible by ``fsdp`` over the fsdp axis (else replicate)."""
    if fsdp > 1:
        for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
            if shape[dim] % fsdp == 0 and shape[dim] >= fsdp:
                spec = [None] * len(shape)
                spec[dim] = "fsdp"
                return P(*spec)
    return P()


def state_shardings(state: TrainState, mesh: Mesh, shard_drafter: bool) -> TrainState:
    fsdp = mesh.shape["fsdp"] if shard_drafter else 1
    leaf = lambda x: NamedSharding(mesh, _fsdp_spec(np.shape(x), fsdp))
    return jax.tree_util.tree_map(leaf, state)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """``[micro, b, S]`` arrays: the per-micro-batch rows over ``data`` x ``fsdp``."""
    return NamedSharding(mesh, P(None, ("data", "fsdp"), None))


def shard_batch(batch: dict, mesh: Mesh) -> dict:
    sharding = batch_sharding(mesh)
    return {k: jax.device_put(np.asarray(v), sharding) for k, v in batch.items()}


def place(cfg: TrainConfig, mesh: Mesh, state: TrainState, target_params: Any, target_config
          ) -> tuple[TrainState, Any, TrainState, Any]:
    """Put state and target params on ``mesh``; returns them and their shardings."""
    s_shard = state_shardings(state, mesh, cfg.shard_drafter)
    t_shard = target_param_shardings(target_params, mesh, target_config)
    return jax.device_put(state, s_shard), jax.device_put(target_params, t_shard), s_shard, t_shard


def make_train_step(cfg: TrainConfig, config: DraftConfig, target: TargetLM, mesh: Mesh,
                    state_sharding: TrainState, target_sharding: Any):
    """The jitted step ``(state, batch, target_params, horizon) -> (state, metrics)`` (state
    donated; ``horizon`` an int32 scalar, see :func:`horizon_array`)."""
    fn = functools.partial(train_step, cfg=cfg, config=config, target=target)
    replicated = NamedSharding(mesh, P())
    return jax.jit(fn, in_shardings=(state_sharding, batch_sharding(mesh), target_sharding,
                                     replicated),
                   out_shardings=(state_sharding, replicated), donate_argnums=(0,))


def horizon_array(horizon: int) -> jax.Array:
    """The jitted step's ``horizon`` argument."""
    return jnp.asarray(horizon, jnp.int32)


def compile_step(step_fn, state, batch, target_params, horizon: int):
    """AOT-compile the step for these shapes/shardings: ``(compiled, xla_flops)`` (the FLOP
    count from XLA's cost analysis, 0.0 when the backend does not report it)."""
    compiled = step_fn.lower(state, batch, target_params, horizon_array(horizon)).compile()
    try:
        analysis = compiled.cost_analysis()
        if isinstance(analysis, (list, tuple)):
            analysis = analysis[0] if analysis else {}
        flops = float(analysis.get("flops", 0.0))
    except Exception:  # noqa: BLE001  (cost analysis is best effort)
        flops = 0.0
    return compiled, flops


def model_flops(cfg: TrainConfig, config: DraftConfig, target_config, seq_len: int) -> float:
    """Matmul FLOPs of one step as executed (the MFU numerator): the frozen target's forward,
    the drafter's forward + backward, the target LM head on the draft rows (+ Domino head,
    + the soft labels' target logits). Parts and bytes: :func:`domino_jax.train.cost.step_cost`."""
    return step_flops(cfg, config, target_config, seq_len)
