"""The training loop: data -> sharded jitted steps -> orbax checkpoints -> HF export.

    result = train(TrainConfig(drafter="domino", steps=1000), target_dir, "data.npz", "out/",
                   draft_layers=2, block_size=16, gru_hidden_dim=256, emb_dim=64)

Writes under ``out``: ``checkpoints/`` (orbax, every ``checkpoint_every`` steps and at the
end; ``resume=True`` continues from the latest one with the same batches and anchor keys,
so the loss curve is the same), ``metrics.jsonl`` (one JSON object per logged step),
``train_config.json`` and ``draft/`` (the trained drafter in the HF ``DFlashDraftModel``
format; plus a ``mask_embedding [H]`` tensor, with a warning, when the drafter learned its
own mask token (``TrainConfig.learned_mask``), see :func:`load_trained_draft`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from domino_jax.config import DraftConfig
from domino_jax.console import train_postfix
from domino_jax.models.qwen3 import TargetLM
from domino_jax.train import data as data_lib
from domino_jax.train.config import TrainConfig, make_draft_config, resolve_mask_token_id
from domino_jax.train.loss import init_draft_params
from domino_jax.train.step import (init_state, make_train_mesh, make_train_step, model_flops,
                                   place, shard_batch, compile_step)

log = logging.getLogger(__name__)
MASK_EMBEDDING = "mask_embedding"


# ----------------------------------------------------------------------------- export

def export_trained_draft(config: DraftConfig, params: dict, path: str) -> None:
    """HF export via ``converters.hf_draft.export_draft`` (bf16), plus our ``mask_embedding``
    tensor (algorithms.md §9.15 extension) appended to ``model.safetensors``."""
    from safetensors.numpy import load_file, save_file

    from converters.hf_draft import export_draft

    os.makedirs(path, exist_ok=True)
    plain = {k: v for k, v in params.items() if k != MASK_EMBEDDING}
    export_draft(config, jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), plain), path)
    if MASK_EMBEDDING in params:
        file = os.path.join(path, "model.safetensors")
        log.warning("%s carries a learned %s: the reference DFlash/Domino inference code "
                    "ignores it and drafts from the target's embedding row mask_token_id=%d "
                    "instead, so this drafter drafts differently (worse) there. Only "
                    "domino_jax reads it; train without --learned-mask for interop.",
                    file, MASK_EMBEDDING, config.mask_token_id)
        tensors = load_file(file)
        tensors[MASK_EMBEDDING] = np.asarray(params[MASK_EMBEDDING], np.float32)
        save_file(tensors, file, metadata={"format": "pt"})
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        raw["dflash_config"]["learned_mask_embedding"] = True
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(raw, f, indent=2)


def load_trained_draft(path: str, dtype=jnp.bfloat16) -> tuple[DraftConfig, dict]:
    """``converters.hf_draft.load_draft`` (which also reads our ``mask_embedding``)."""
    from converters.hf_draft import load_draft

    return load_draft(path, dtype)


def load_init_draft(path: str, target_config, drafter: str) -> tuple[DraftConfig, dict]:
    """A drafter to fine-tune (``TrainConfig.init_draft``): its config and float32 params
    (``{"backbone", ["head"], ["mask_embedding"]}``), checked against the target and the
    drafter kind being trained; a mismatch names the folder and the field."""
    config, params = load_trained_draft(path, jnp.float32)
    is_domino = config.has_domino_head
    if is_domino != (drafter == "domino"):
        raise ValueError(f"--init-draft {path!r} is a {'Domino' if is_domino else 'DFlash'} "
                         f"drafter but --drafter is {drafter!r}")
    for field, want in (("vocab_size", target_config.vocab_size),
                        ("hidden_size", target_config.hidden_size),
                        ("num_target_layers", target_config.num_layers)):
        if getattr(config, field) != want:
            raise ValueError(f"--init-draft {path!r}: {field} {getattr(config, field)} does "
                             f"not fit the target ({want})")
    if MASK_EMBEDDING in params:
        log.warning("--init-draft %s carries a learned %s: fine-tuning keeps it (the "
                    "reference inference code ignores it; see --learned-mask)", path,
                    MASK_EMBEDDING)
    return config, jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), params)


# ----------------------------------------------------------------------------- checkpoints

def _manager(directory: str, keep: int = 2):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(os.path.abspath(directory),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=keep))


def save_checkpoint(manager, state) -> None:
    import orbax.checkpoint as ocp

    manager.save(int(state.step), args=ocp.args.StandardSave(state))
    manager.wait_until_finished()


def restore_checkpoint(manager, abstract_state):
    """The latest checkpoint restored with ``abstract_state``'s shapes and shardings, or
    ``None`` when there is none."""
    import orbax.checkpoint as ocp

    latest = manager.latest_step()
    if latest is None:
        return None
    spec = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), abstract_state)
    return manager.restore(latest, args=ocp.args.StandardRestore(spec))


# ----------------------------------------------------------------------------- loop

_COMPILED: dict = {}


@dataclasses.dataclass
class TrainResult:
    draft_config: DraftConfig
    params: Any                      # float32 drafter params (host)
    history: list[dict]              # logged metrics
    export_dir: str | None
    seconds: float


def summarise(metrics: dict) -> dict:
    """Host-side metrics: floats, ``acc`` per block slot (slots with no count are null)."""
    out = {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}
    correct, count = np.asarray(metrics["correct"]), np.asarray(metrics["count"])
    out["acc"] = [round(float(c / n), 4) if n > 0 else None for c, n in zip(correct, count)]
    seen = count.sum()
    out["acc_mean"] = float(correct.sum() / seen) if seen > 0 else 0.0
    return out


def train(cfg: TrainConfig, target_dir: str | None, data_path: str | None, out_dir: str,
          draft_layers: int = 2, block_size: int = 16, gru_hidden_dim: int = 256,
          emb_dim: int = 64, mask_token_id: int | None = None, resume: bool = False,
          examples: list[dict] | None = None, target: TargetLM | None = None,
          target_params: Any = None, export: bool = True, progress: bool = True,
          stop_after: int | None = None) -> TrainResult:
    """Train a drafter against a frozen target (loaded from ``target_dir`` unless
    ``target``/``target_params`` are given) on ``data_path`` (or ``examples``).
    ``stop_after``: leave the loop after that global step (as if interrupted; tests)."""
    from tqdm.auto import tqdm

    compute = jnp.dtype(cfg.compute_dtype)
    if target is None:
        from converters.hf_target import load_target

        log.info("loading the target %s (%s)", target_dir, compute.name)
        target_config, target_params = load_target(target_dir, compute)
        target = TargetLM(target_config, dtype=compute, param_dtype=compute)
    else:
        target = TargetLM(target.config, dtype=compute, param_dtype=compute)
        target_params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, compute), target_params)
    if mask_token_id is None and cfg.init_draft is None:   # a row of the target's vocabulary
        mask_token_id = resolve_mask_token_id(target.config, target_dir)
    if cfg.init_draft is not None:      # fine-tune: geometry, weights and mask from there
        config, init_params = load_init_draft(cfg.init_draft, target.config, cfg.drafter)
        block_size = config.block_size
    else:
        config = make_draft_config(target.config, cfg.drafter, draft_layers, block_size,
                                   gru_hidden_dim, emb_dim, mask_token_id)
    if examples is None:
        examples = data_lib.load_dataset(data_path)
    examples = data_lib.filter_examples(examples, 2 * block_size, cfg.max_length)
    if not examples:
        raise ValueError(f"no example in {data_path!r} has >= {2 * block_size} response "
                         f"tokens within max_length {cfg.max_length}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "train_config.json"), "w") as f:
        json.dump({"train": dataclasses.asdict(cfg), "draft": config.to_hf_dict(),
                   "examples": len(examples)}, f, indent=2)

    if cfg.init_draft is not None:
        params = init_params
    else:
        params = init_draft_params(config, jax.random.PRNGKey(cfg.seed), cfg.learned_mask,
                                   target_params, cfg.init_from_target)
    mesh = make_train_mesh(cfg)
    state, target_params, s_shard, t_shard = place(cfg, mesh, init_state(cfg, params),
                                                   target_params, target.config)
    manager = _manager(os.path.join(out_dir, "checkpoints"))
    if resume:
        restored = restore_checkpoint(manager, state)
        if restored is not None:
            state = restored
            log.info("resumed from step %d", int(state.step))
    start = int(state.step)
    seq_len = cfg.max_length
    flops_model = model_flops(cfg, config, target.config, seq_len)
    n_dev = mesh.devices.size
    metrics_file = open(os.path.join(out_dir, "metrics.jsonl"), "a" if resume else "w")
    history: list[dict] = []
    t_start = time.perf_counter()
    first = data_lib.batch_for_step(examples, start, cfg.batch_size, cfg.micro_batches,
                                    cfg.max_length, cfg.seed)
    t0 = time.perf_counter()
    cache_key = (cfg, config, target, tuple(d.id for d in mesh.devices.flat),
                 str(jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), target_params)))
    if cache_key not in _COMPILED:      # same run settings in one process: compile once
        log.info("compiling the %s train step (batch %d x %d tokens) ...", cfg.drafter,
                 cfg.batch_size, cfg.max_length)
        step_fn = make_train_step(cfg, config, target, mesh, s_shard, t_shard)
        _COMPILED[cache_key] = compile_step(step_fn, state, shard_batch(first, mesh),
                                            target_params)
        log.info("compiled the train step in %.1f s", time.perf_counter() - t0)
    step_fn, flops_xla = _COMPILED[cache_key]
    compile_seconds = time.perf_counter() - t0
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not progress,
               desc=f"train {cfg.drafter}")
    window_t, window_tokens, window_steps = time.perf_counter(), 0.0, 0
    for i in bar:
        batch = first if i == start else data_lib.batch_for_step(
            examples, i, cfg.batch_size, cfg.micro_batches, cfg.max_length, cfg.seed)
        state, metrics = step_fn(state, shard_batch(batch, mesh), target_params)
        window_steps += 1
        window_tokens += float(np.sum(batch["loss_mask"] > 0) + 0)
        step = i + 1
        last = step == cfg.steps
        if step % cfg.log_every == 0 or last or step == start + 1:
            m = summarise(jax.device_get(metrics))
            elapsed = time.perf_counter() - window_t
            step_time = elapsed / max(window_steps, 1)
            m.update(step=step, step_time=step_time,
                     tokens_per_second=window_tokens / max(elapsed, 1e-9),
                     model_flops_per_step=flops_model, xla_flops_per_step=flops_xla,
                     mfu=flops_model / max(step_time, 1e-9) / (cfg.peak_flops * n_dev),
                     compile_seconds=compile_seconds)
            history.append(m)
            metrics_file.write(json.dumps(m) + "\n")
            metrics_file.flush()
            bar.set_postfix(train_postfix(m))
            window_t, window_tokens, window_steps = time.perf_counter(), 0.0, 0
        if step % cfg.checkpoint_every == 0 or last:
            save_checkpoint(manager, state)
        if stop_after is not None and step >= stop_after:
            break
    metrics_file.close()
    host_params = jax.device_get(state.params)
    export_dir = None
    if export:
        export_dir = os.path.join(out_dir, "draft")
        export_trained_draft(config, host_params, export_dir)
    return TrainResult(config, host_params, history, export_dir, time.perf_counter() - t_start)
