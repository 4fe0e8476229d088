"""End-to-end smoke test of benchmarks/bench_decode.py: tiny shapes on the CPU, no HF.

Runs the script in a subprocess (it configures XLA before importing jax) and checks that the
JSON result has every section the GPU run fills: loops, stages with floors, c, projected
speedups and the forced-acceptance loop.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "bench_decode.py")


@pytest.mark.slow
def test_bench_decode_tiny(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--tiny", "--skip-hf", "--prompt-lens", "16",
         "--new-tokens", "8", "--forced-taus", "3", "--out", str(tmp_path),
         "--time-budget-s", "900"],
        env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = glob.glob(str(tmp_path / "decode_*.json"))
    assert len(files) == 1, os.listdir(tmp_path)
    assert os.path.exists(files[0][:-5] + ".md")
    with open(files[0]) as f:
        res = json.load(f)

    for key in ("date", "git_commit", "device", "versions", "xla_flags", "bytes", "prompts",
                "hf", "skipped", "errors", "complete"):
        assert key in res, key
    assert res["complete"] and not res["errors"] and not res["skipped"], (res["errors"],
                                                                           res["skipped"])
    for name in ("jax", "flax"):
        assert res["versions"][name]
    assert res["bytes"]["target_streamed"] < res["bytes"]["target_params_total"]

    pr = res["prompts"]["16"]
    for method in ("ar", "dflash", "domino"):
        loop = pr["loops"][method]
        for key in ("round_ms", "rounds", "decode_ms_per_token", "generate_ms_per_token",
                    "floor_ms", "pct_of_floor", "compile_s", "verify_width"):
            assert key in loop, (method, key)
        assert loop["round_ms"] > 0 and loop["floor_ms"] > 0
    for method in ("dflash", "domino"):
        loop = pr["loops"][method]
        assert loop["c"] > 0 and loop["c_floor"] > 1.0
        assert set(loop["projected_speedup"]) == {"4", "6", "8"}
        stages = pr["stages"][method]
        for stage in ("backbone", "lm_head", "head", "draft_total", "verify", "commit"):
            assert stages[stage]["ms"] > 0 and "floor_ms" in stages[stage], (method, stage)
        forced = pr["forced"][f"{method}_tau3"]
        assert forced["tau_observed"] == pytest.approx(3.0, abs=0.6)
        assert forced["speedup_vs_ar"] > 0
    assert pr["stages"]["ar"]["ar_step"]["ms"] > 0
