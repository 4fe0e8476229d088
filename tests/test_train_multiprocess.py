"""Multi-process training without a cluster: local CPU processes joined by jax.distributed.

Each process is a fresh interpreter (``XLA_FLAGS`` and ``jax.distributed`` must precede
any backend) with 2 simulated CPU devices; the mesh ``(data 1, fsdp 2, tensor 2)`` puts
``fsdp`` across the 2 processes (drafter params and optimizer state fsdp-sharded across
processes, the batch split by process) and ``tensor`` inside each. The reference is the same
run (the same global batches) in one process on one device: the test's own process.

* two processes: per-step losses equal the one-process run's (float32), each process
  built only its rows;
* a fault: process 1 dies (SIGKILL) after step 3; process 0 exits non-zero with jax's
  "another task died" / collective error within a bounded time (no hang);
* the relaunched pair resumes from the last complete checkpoint (step 2) and ends with
  the steps 1..4 once each, losses again equal to the one-process run's;
* resuming that run with one process fails naming both process counts (checked in the
  test's own process: the refusal comes before any device is used).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, CHECKPOINT_EVERY, DIE_AFTER = 4, 2, 3
FAULT_BOUND_S = 60          # the survivor must be gone within this after the kill


def child(out: str, num_processes: int, process_id: int, port: int, resume: bool,
          die_after: int, mesh: tuple[int, int, int] = (1, 2, 2)) -> None:
    """One training process (run via ``python -c``): tiny target + DFlash drafter on
    ``mesh`` (data, fsdp, tensor)."""
    from domino_jax.train.distributed import DistributedConfig, initialize

    if num_processes > 1:
        initialize(DistributedConfig("on", f"localhost:{port}", num_processes, process_id,
                                     heartbeat_timeout_seconds=5,
                                     initialization_timeout_seconds=60))
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    from domino_jax.models.qwen3 import TargetLM
    from domino_jax.train import loop
    from domino_jax.train.config import TrainConfig
    from tests.test_train import SMALL, TARGET, random_target_params, synthetic_examples

    cfg = TrainConfig(drafter="dflash", steps=STEPS, batch_size=8, micro_batches=2,
                      max_length=48, num_anchors=8, compute_dtype="float32",
                      checkpoint_every=CHECKPOINT_EVERY, log_every=1, mesh_data=mesh[0],
                      mesh_fsdp=mesh[1], mesh_tensor=mesh[2], shard_drafter=True)
    if die_after:         # a crash as the batch of step die_after + 1 is built: no goodbye
        build = loop.step_batch

        def step_batch(examples, step, *rest):
            if step == die_after:
                os.kill(os.getpid(), signal.SIGKILL)
            return build(examples, step, *rest)
        loop.step_batch = step_batch
    target_params = random_target_params()                # nothing compiled
    result = loop.train(cfg, None, None, out, **SMALL, mask_token_id=63, resume=resume,
                        examples=synthetic_examples(24), target=TargetLM(TARGET),
                        target_params=target_params, export=False, progress=False)
    print("FINAL_STEP", int(result.state.step), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(out, num_processes: int, resume: bool = False, die: dict | None = None,
           devices: int = 2) -> list[subprocess.Popen]:
    """Start the processes of one run (``die``: ``{process_id: step}`` to crash after)."""
    # the simulated devices, and this process's XLA flags (tests/conftest.py's cheap compile)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, XLA_FLAGS=" ".join((
        f"--xla_force_host_platform_device_count={devices}", os.environ.get("XLA_FLAGS", ""))))
    port = free_port()
    procs = []
    for pid in range(num_processes):
        code = (f"import tests.test_train_multiprocess as t; t.child({str(out)!r}, "
                f"{num_processes}, {pid}, {port}, {resume}, {(die or {}).get(pid, 0)})")
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


def finish(procs, timeout: float = 240) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
            raise AssertionError(f"process timed out:\n{text[-3000:]}")
        out.append((p.returncode, text))
    return out


def losses(run_dir) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), f"steps repeated or out of order: {steps}"
    return {r["step"]: r["loss"] for r in rows}


@pytest.mark.slow
def test_two_processes_equal_one_survive_a_crash_and_resume(tmp_path):
    t0 = time.perf_counter()
    pair = launch(tmp_path / "pair", 2, die={1: DIE_AFTER})
    child(str(tmp_path / "single"), 1, 0, 0, False, 0, mesh=(1, 1, 1))   # meanwhile, here
    reference = losses(tmp_path / "single")
    assert sorted(reference) == list(range(1, STEPS + 1))

    # the crash: process 1 is gone after step 3; process 0 must not hang
    killed_at = None
    deadline = time.perf_counter() + 240
    while pair[1].poll() is None and time.perf_counter() < deadline:
        time.sleep(0.2)
    killed_at = time.perf_counter()
    (rc0, text0), (rc1, _) = finish(pair, timeout=FAULT_BOUND_S)
    waited = time.perf_counter() - killed_at
    assert rc1 == -signal.SIGKILL
    assert rc0 != 0 and "FINAL_STEP" not in text0, text0[-3000:]
    assert waited < FAULT_BOUND_S
    assert any(s in text0 for s in ("another task died", "Gloo", "unhealthy",
                                    "heartbeat")), text0[-3000:]
    before = losses(tmp_path / "pair")
    assert set(before) >= {1, 2}
    for step, loss in before.items():
        assert loss == pytest.approx(reference[step], rel=1e-5, abs=1e-6), (step, before)

    # the relaunch resumes from the last complete checkpoint (step 2), nothing lost or redone
    results = finish(launch(tmp_path / "pair", 2, resume=True))
    for rc, text in results:
        assert rc == 0 and f"FINAL_STEP {STEPS}" in text, text[-3000:]
    after = losses(tmp_path / "pair")
    assert sorted(after) == list(range(1, STEPS + 1))
    for step in after:
        assert after[step] == pytest.approx(reference[step], rel=1e-5, abs=1e-6), (step, after)
    with open(tmp_path / "pair" / "train_config.json") as f:
        assert json.load(f)["num_processes"] == 2

    # one process cannot resume a two-process run: the same child, in this process (one
    # process; the refusal comes before the mesh is built, so one device is enough)
    from domino_jax.train.checkpoints import RunError

    with pytest.raises(RunError, match=r"written by 2 process\(es\), this run has 1"):
        child(str(tmp_path / "pair"), 1, 0, 0, True, 0)
    print(f"multi-process test: {time.perf_counter() - t0:.1f} s")


def test_when_jax_distributed_starts():
    from domino_jax.train.distributed import (DistributedConfig, launched_multiprocess,
                                              wants_initialize)

    assert not launched_multiprocess({})
    assert not launched_multiprocess({"SLURM_NTASKS": "1", "TPU_WORKER_HOSTNAMES": "a"})
    for env in ({"JAX_COORDINATOR_ADDRESS": "h:1"}, {"SLURM_NTASKS": "4"},
                {"OMPI_COMM_WORLD_SIZE": "2"}, {"TPU_WORKER_HOSTNAMES": "a,b"}):
        assert launched_multiprocess(env), env
        assert wants_initialize(DistributedConfig(), env)
        assert not wants_initialize(DistributedConfig("off"), env)
    assert not wants_initialize(DistributedConfig(), {})
    assert wants_initialize(DistributedConfig("on"), {})
    assert wants_initialize(DistributedConfig(process_id=0), {})
    with pytest.raises(ValueError, match="--distributed off excludes"):
        wants_initialize(DistributedConfig("off", num_processes=2), {})


def test_cli_rejects_bad_distributed_flags(capsys, tmp_path):
    from domino_jax.train.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--data", str(tmp_path), "--out", str(tmp_path / "o"), "--num-processes", "2",
              "--process-id", "2"])
    assert e.value.code == 2
    assert "--process-id 2 must be in [0, --num-processes 2)" in capsys.readouterr().err


def test_batch_rows_are_a_slice_of_the_global_batch():
    from domino_jax.train import data as data_lib
    from tests.test_train import synthetic_examples

    examples = synthetic_examples(10)
    whole = data_lib.batch_for_step(examples, 3, 8, 2, 48, seed=1)
    for rows in ((0, 2), (2, 4), (1, 3)):
        part = data_lib.batch_for_step(examples, 3, 8, 2, 48, seed=1, rows=rows)
        for key in whole:
            assert (part[key] == whole[key][:, rows[0]:rows[1]]).all()
