"""Orbax checkpoints of a training run: the last K, the best by held-out tau, exact resume.

A run folder holds ``checkpoints/`` (orbax, a step every ``checkpoint_every`` steps and at
the end, the last ``keep`` kept) and, with ``keep_best``, ``best/`` (one checkpoint: the step
whose held-out tau was highest so far, see :func:`evaluate.best_metric`). Each checkpoint
step holds two items: ``state`` (the :class:`~domino_jax.train.step.TrainState`: step,
float32 params, optimizer state) and ``meta`` (JSON: ``tokens_seen``, ``wall_seconds``, ...:
what the loop's bookkeeping needs to continue exactly where it stopped).

Resuming reads the latest step of ``RUN/checkpoints`` (``--resume``) or of any folder given
to ``--resume-from``: a run folder, its ``checkpoints/`` folder or ``best/``, e.g. one
restored by ``python -m domino_jax.train.parts join`` on another machine. The resumed
settings must equal the saved ``train_config.json`` (except logging / checkpoint cadence):
batches and anchor keys are pure functions of the step, so the continued run is bitwise the
uninterrupted one (``tests/test_train_longrun.py``).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax

log = logging.getLogger(__name__)

STATE, META = "state", "meta"
CHECKPOINTS, BEST = "checkpoints", "best"
TRAIN_CONFIG = "train_config.json"
# settings a resumed run may change without changing what it computes (init_draft: the
# initial weights, which the checkpoint replaces)
RESUMABLE_CHANGES = frozenset({"log_every", "checkpoint_every", "peak_flops", "init_draft",
                               "loss_chunk_rows"})


class RunError(ValueError):
    """A run folder / resume request the user can fix (the CLI exits 2 on it)."""


def checkpoint_manager(directory: str, keep: int | None = 2):
    """An orbax manager keeping the last ``keep`` steps of ``directory`` (None: all)."""
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(os.path.abspath(directory),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=keep))


def save_checkpoint(manager, state, meta: dict | None = None) -> None:
    """Save ``state`` (and the JSON ``meta``) at step ``state.step``, replacing a checkpoint
    of that step already there; waits for the write."""
    import orbax.checkpoint as ocp

    step = int(state.step)
    if step in manager.all_steps():        # a step re-reached after a resume: same content
        manager.delete(step)
    manager.save(step, args=ocp.args.Composite(
        **{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(dict(meta or {}))}))
    manager.wait_until_finished()


def restore_checkpoint(manager, abstract_state, step: int | None = None
                       ) -> tuple[Any, dict] | None:
    """``(state, meta)`` of ``step`` (default: the latest) restored with ``abstract_state``'s
    shapes, dtypes and shardings, or ``None`` when the manager holds no step. Checkpoints
    written before ``meta`` existed (one unnamed item) restore with ``meta = {}``."""
    import orbax.checkpoint as ocp

    step = manager.latest_step() if step is None else step
    if step is None:
        return None
    spec = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), abstract_state)
    if not os.path.isdir(os.path.join(str(manager.directory), str(step), STATE)):
        return manager.restore(step, args=ocp.args.StandardRestore(spec)), {}
    restored = manager.restore(step, args=ocp.args.Composite(
        **{STATE: ocp.args.StandardRestore(spec), META: ocp.args.JsonRestore()}))
    return restored[STATE], dict(restored[META] or {})


def has_checkpoint(path: str) -> bool:
    """Whether the orbax folder ``path`` holds a step (numbered folder)."""
    return os.path.isdir(path) and any(name.isdigit() and os.path.isdir(os.path.join(path, name))
                                       for name in os.listdir(path))


def resolve_checkpoint_dir(path: str) -> tuple[str, str | None]:
    """``(orbax checkpoint folder, run folder or None)`` for a ``--resume-from`` path: a run
    folder (``checkpoints/`` inside), or a checkpoint folder itself (numbered steps inside;
    its parent is the run folder when it holds ``train_config.json``)."""
    if not os.path.isdir(path):
        raise RunError(f"--resume-from {path!r} is not a directory")
    inner = os.path.join(path, CHECKPOINTS)
    if os.path.isdir(inner) and has_checkpoint(inner):
        return inner, path
    if has_checkpoint(path):
        parent = os.path.dirname(os.path.abspath(path))
        return path, parent if os.path.isfile(os.path.join(parent, TRAIN_CONFIG)) else None
    raise RunError(f"--resume-from {path!r} holds no orbax checkpoint (expected numbered step "
                   f"folders in it or in {CHECKPOINTS}/)")


def check_resume_settings(run_dir: str | None, settings: dict, examples: int | None = None
                          ) -> None:
    """Raise :class:`RunError` naming every setting that differs from ``run_dir``'s saved
    ``train_config.json`` (``{"train": ..., "draft": ...}``); nothing to check without one.
    A different number of (filtered) ``examples`` is allowed (data appended on purpose) but
    logged: the batches from the resumed step on then differ from the uninterrupted run's."""
    if run_dir is None or not os.path.isfile(os.path.join(run_dir, TRAIN_CONFIG)):
        return
    path = os.path.join(run_dir, TRAIN_CONFIG)
    with open(path) as f:
        saved = json.load(f)
    diffs = []
    for section in ("train", "draft"):
        old, new = saved.get(section, {}), settings.get(section, {})
        for key in sorted(set(old) | set(new)):
            if key in RESUMABLE_CHANGES:
                continue
            if json.dumps(old.get(key)) != json.dumps(new.get(key)):
                diffs.append(f"{section}.{key}: saved {old.get(key)!r}, now {new.get(key)!r}")
    if examples is not None and saved.get("examples") not in (None, examples):
        log.warning("resuming with %d training examples where %s had %d: batches from here "
                    "on differ from the uninterrupted run's", examples, path, saved["examples"])
    if diffs:
        raise RunError(f"cannot resume: settings differ from {path} (an exact resume needs "
                       "the same ones): " + "; ".join(diffs))


def read_jsonl_until(path: str, last_step: int) -> list[dict]:
    """The records of a ``metrics.jsonl`` whose ``step`` is at most ``last_step`` (what a
    run resumed at ``last_step`` keeps; later lines were written after that checkpoint)."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if int(r.get("step", 0)) <= last_step]
