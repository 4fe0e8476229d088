"""Tensor-parallel decoding on 4 simulated CPU devices: greedy float32 AR and Domino output
equals the single-device output token for token; bad ``--tensor-parallel`` values fail.

The device part runs in a subprocess (``XLA_FLAGS`` must be set before jax starts).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child() -> None:
    import dataclasses

    import jax
    import numpy as np

    from decode_helpers import F32, _set, draft_config, tiny_draft
    from domino_jax.config import TargetConfig
    from domino_jax.decode.methods import make_drafter
    from domino_jax.decode.speculative import DecodeConfig, generate
    from domino_jax.decode.tensor_parallel import (check_tensor_parallel, mesh_context,
                                                   shard_for_decode, tensor_mesh)
    from domino_jax.models import qwen3
    from domino_jax.models.qwen3 import TargetLM

    assert jax.device_count() == 4
    vocab = 64
    tcfg = TargetConfig("qwen3", vocab, 32, 2, 4, 4, 8, 64, rope_theta=10000.0)
    tparams = qwen3.init_params(tcfg, jax.random.PRNGKey(0))
    tparams = _set(tparams, "lm_head/kernel", tparams["lm_head"]["kernel"] * 4.0)
    target = TargetLM(tcfg, **F32)
    dcfg = draft_config(vocab, block=4)
    dcfg = dataclasses.replace(dcfg, num_kv_heads=4)
    dparams = tiny_draft(dcfg, 1, head_scale=3.0)
    drafter = make_drafter(dcfg, target, "domino")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, vocab, n).tolist() for n in (5, 11, 3)]

    def run(method, tp, dp, mesh=None):
        with mesh_context(mesh):
            return generate(target, tp, prompts, DecodeConfig(method=method, max_new_tokens=20),
                            drafter=None if method == "ar" else drafter,
                            draft_params=None if method == "ar" else dp)

    single = {m: run(m, tparams, dparams) for m in ("ar", "domino")}
    assert single["ar"].tokens == single["domino"].tokens
    assert single["domino"].rounds.sum() < single["ar"].rounds.sum()    # drafts accepted
    for n in (4,):
        check_tensor_parallel(n, tcfg, dcfg)
        mesh = tensor_mesh(n)
        tp, dp = shard_for_decode(mesh, tcfg, tparams, dparams, dcfg)
        for tree in (tp, dp):
            assert any(len(x.sharding.device_set) == n and not x.sharding.is_fully_replicated
                       for x in jax.tree_util.tree_leaves(tree)), "nothing split over tensor"
        for method in ("ar", "domino"):
            got = run(method, tp, dp, mesh)
            assert got.tokens == single[method].tokens, (n, method, got, single[method])
            # the same drafts too: the same rounds and acceptance lengths
            np.testing.assert_array_equal(got.rounds, single[method].rounds)
            np.testing.assert_array_equal(got.accept_hist, single[method].accept_hist)
        print(f"TP{n}_OK")
    # the CLI: 4 does not divide the fixture drafter's 2 kv heads (before any weights load)
    import contextlib
    import io

    from domino_jax.decode.__main__ import main

    fixture = os.path.join(ROOT, "tests", "fixtures", "reference", "domino_shift")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["--target", os.path.join(fixture, "target"), "--draft",
                     os.path.join(fixture, "draft"), "--tensor-parallel", "4"])
    assert code == 2 and "--tensor-parallel 4 does not divide the target's num_kv_heads 2" \
        in err.getvalue(), err.getvalue()
    print("TENSOR_PARALLEL_OK")


def test_tensor_parallel_decode_equals_single_device():
    env = dict(os.environ, XLA_FLAGS=" ".join((
        "--xla_force_host_platform_device_count=4", os.environ.get("XLA_FLAGS", ""))),
               JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    code = "import tests.test_decode_tensor_parallel as t; t.child()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "TENSOR_PARALLEL_OK" in proc.stdout, \
        proc.stdout[-3000:] + proc.stderr[-5000:]


def test_tensor_parallel_errors():
    from decode_helpers import tiny_target_config
    from domino_jax.decode.tensor_parallel import check_tensor_parallel

    cfg = tiny_target_config()                    # 4 heads, 2 kv heads
    check_tensor_parallel(2, cfg, num_devices=4)
    with pytest.raises(ValueError, match="--tensor-parallel 4 does not divide the target's "
                                         "num_kv_heads 2"):
        check_tensor_parallel(4, cfg, num_devices=4)
    with pytest.raises(ValueError, match="--tensor-parallel 8 exceeds the 4 available"):
        check_tensor_parallel(8, cfg, num_devices=4)
    with pytest.raises(ValueError, match="must be >= 1"):
        check_tensor_parallel(0, cfg, num_devices=4)
