"""Multi-process (multi-host) training: ``jax.distributed`` start-up, per-process batches.

One process per host (a TPU pod slice's workers, one per GPU node, or local CPU processes in
the tests). Every process runs the same program over one global mesh
(``jax.devices()``: all processes' devices, process 0's first, so the innermost mesh axis,
``tensor``, stays inside a host):

* :func:`initialize` starts ``jax.distributed`` before anything touches a backend: from
  explicit settings (``--coordinator-address``, ``--num-processes``, ``--process-id``), or
  from the environment jax detects itself (Cloud TPU pod slices, SLURM, Open MPI,
  Kubernetes, ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``).
* :func:`global_batch`: each process builds only the rows of the global batch that its own
  devices hold (:func:`local_rows`) and ``jax.make_array_from_process_local_data``
  assembles the global array. The global batch of a step is the single-process run's
  (:func:`~domino_jax.train.data.batch_for_step` of ``(seed, step)``), so losses, resume
  and checkpoints do not depend on the process count; a process reads (memory-maps) only
  the examples of its rows.
* Only process 0 (:func:`is_primary`) writes metrics, curves, the config and the export
  and shows progress; all processes save and restore the orbax checkpoints together.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding

log = logging.getLogger(__name__)

DISTRIBUTED_MODES = ("auto", "on", "off")
DEFAULT_HEARTBEAT_SECONDS = 100          # jax's default: a silent process is dead after it


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How to start ``jax.distributed`` (``None`` fields: jax reads its environment).

    ``mode``: ``"off"`` one process; ``"on"`` always initialise; ``"auto"`` initialise when
    any of the three settings is given or the environment is a multi-process launch
    (:func:`launched_multiprocess`)."""

    mode: str = "auto"
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout_seconds: int = DEFAULT_HEARTBEAT_SECONDS
    initialization_timeout_seconds: int = 300


def launched_multiprocess(environ=os.environ) -> bool:
    """Whether the environment looks like a multi-process launch that jax can join: the
    ``JAX_COORDINATOR_ADDRESS`` variable, a SLURM step or Open MPI job of more than one task,
    or a Cloud TPU slice with several workers (``TPU_WORKER_HOSTNAMES`` lists > 1 host)."""
    count = lambda name: int(environ.get(name, "1") or "1")
    return bool(environ.get("JAX_COORDINATOR_ADDRESS")
                or count("SLURM_STEP_NUM_TASKS") > 1 or count("SLURM_NTASKS") > 1
                or count("OMPI_COMM_WORLD_SIZE") > 1
                or len([h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1)


def wants_initialize(cfg: DistributedConfig, environ=os.environ) -> bool:
    if cfg.mode not in DISTRIBUTED_MODES:
        raise ValueError(f"--distributed {cfg.mode!r}: choose one of {DISTRIBUTED_MODES}")
    if cfg.mode == "off":
        if cfg.coordinator_address or cfg.num_processes or cfg.process_id is not None:
            raise ValueError("--distributed off excludes --coordinator-address, "
                             "--num-processes and --process-id")
        return False
    explicit = (cfg.coordinator_address is not None or cfg.num_processes is not None
                or cfg.process_id is not None)
    return cfg.mode == "on" or explicit or launched_multiprocess(environ)


def initialize(cfg: DistributedConfig) -> bool:
    """Start ``jax.distributed`` when :func:`wants_initialize` says so (before any other jax
    call that picks a backend); returns whether it did. A process that stops sending
    heartbeats for ``heartbeat_timeout_seconds`` makes the others exit with jax's "another
    task died" error (no hang)."""
    if not wants_initialize(cfg):
        return False
    if cfg.num_processes is not None and cfg.num_processes < 1:
        raise ValueError(f"--num-processes {cfg.num_processes} must be >= 1")
    if (cfg.process_id is not None and cfg.num_processes is not None
            and not 0 <= cfg.process_id < cfg.num_processes):
        raise ValueError(f"--process-id {cfg.process_id} must be in [0, --num-processes "
                         f"{cfg.num_processes})")
    jax.distributed.initialize(
        coordinator_address=cfg.coordinator_address, num_processes=cfg.num_processes,
        process_id=cfg.process_id, heartbeat_timeout_seconds=cfg.heartbeat_timeout_seconds,
        initialization_timeout=cfg.initialization_timeout_seconds)
    log.info("jax.distributed: process %d of %d, %d local / %d global devices",
             jax.process_index(), jax.process_count(), jax.local_device_count(),
             jax.device_count())
    return True


def is_primary() -> bool:
    """Process 0: the one that writes files other than checkpoints and logs progress."""
    return jax.process_index() == 0


def local_rows(sharding: NamedSharding, global_shape: tuple[int, ...], axis: int
               ) -> tuple[int, int]:
    """``(start, stop)`` of the rows along ``axis`` that this process's devices hold under
    ``sharding`` (one contiguous range; the whole axis when it is not sharded)."""
    spans = {(idx[axis].start or 0, global_shape[axis] if idx[axis].stop is None
              else idx[axis].stop)
             for idx in sharding.addressable_devices_indices_map(global_shape).values()}
    start, stop = min(s for s, _ in spans), max(e for _, e in spans)
    covered = sum(e - s for s, e in sorted(spans))
    if covered < stop - start and len(spans) > 1:
        # gaps between this process's shards: the mesh interleaves processes on the axis
        raise ValueError(f"this process holds rows {sorted(spans)} of a {global_shape[axis]}"
                         "-row batch: not one contiguous range (order the mesh's devices by "
                         "process)")
    return start, stop


def global_batch(make_rows: Callable[[int, int], dict], sharding: NamedSharding,
                 global_shape: tuple[int, ...], axis: int = 1) -> dict:
    """The global batch ``{name: [global_shape] array}`` on ``sharding``, each process
    building only its rows: ``make_rows(start, stop) -> {name: array}`` with ``stop -
    start`` rows along ``axis``."""
    start, stop = local_rows(sharding, global_shape, axis)
    local = make_rows(start, stop)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v), global_shape)
            for k, v in local.items()}


def to_host(tree: Any) -> Any:
    """Numpy copies of a tree of (possibly multi-process sharded) arrays on every process
    (one all-gather for arrays that are not fully addressable here)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    def leaf(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)
    return jax.tree_util.tree_map(leaf, tree)


def check_process_count(saved: int | None, path: str) -> None:
    """Raise :class:`~domino_jax.train.checkpoints.RunError` when the checkpoint in
    ``path`` was written by a different number of processes than this run has."""
    from domino_jax.train.checkpoints import RunError

    now = jax.process_count()
    if saved is not None and int(saved) != now:
        raise RunError(f"cannot resume from {path}: it was written by {int(saved)} "
                       f"process(es), this run has {now} (resume with the same process "
                       "count and mesh)")


def step_batch(examples, step: int, cfg, mesh) -> tuple[dict, int]:
    """``(global batch of optimizer step step on mesh, loss tokens in this process's rows)``:
    :func:`~domino_jax.train.data.batch_for_step` of the run's settings (``cfg``: a
    :class:`~domino_jax.train.config.TrainConfig`), each process building only its rows."""
    from domino_jax.train.data import batch_for_step
    from domino_jax.train.step import batch_sharding

    shape = (cfg.micro_batches, cfg.batch_size // cfg.micro_batches, cfg.max_length)
    local_tokens = []

    def rows(start: int, stop: int) -> dict:
        part = batch_for_step(examples, step, cfg.batch_size, cfg.micro_batches,
                              cfg.max_length, cfg.seed, rows=(start, stop))
        local_tokens.append(int(np.count_nonzero(part["loss_mask"])))
        return part
    return global_batch(rows, batch_sharding(mesh), shape), local_tokens[0]
