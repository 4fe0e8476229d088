"""End-to-end smoke test of benchmarks/bench_decode.py: tiny shapes on the CPU, HF included.

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
        [sys.executable, SCRIPT, "--tiny", "--prompt-lens", "16", "--methods", "ar,domino",
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

    # the Hugging Face worker (hf_generate_worker.py, a child process), on the CPU
    hf = res["hf"]["16"]
    assert hf.get("done") and not hf.get("error"), hf
    for mode in ("dynamic", "static"):
        assert hf[mode]["ms_per_token"] > 0 and hf[mode]["hf_over_ours_generate"] > 0, mode
    with open(files[0][:-5] + ".md") as f:
        assert "HF generate static cache" in f.read()

    pr = res["prompts"]["16"]
    for method in ("ar", "domino"):      # (dflash's loop and stages run the same code)
        loop = pr["loops"][method]
        for key in ("round_ms", "rounds", "decode_ms_per_token", "generate_ms_per_token",
                    "floor_ms", "pct_of_floor", "compile_s", "verify_width"):
            assert key in loop, (method, key)
        assert loop["round_ms"] > 0 and loop["floor_ms"] > 0
    for method in ("domino",):
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
    # the head's decode layout against the plain head, same process, same drafts
    plain = pr["stages"]["domino"]["head_plain_layout"]
    assert plain["ms"] > 0 and "floor_ms" in plain and plain["same_drafts"] is True


def test_bench_tree_build_tiny(tmp_path):
    """The tree build and the kernel sweep (XLA against the kernels' twins under two
    blockings, the head rollout too, each traced), tiny shapes on the CPU; then the trace
    folder summarised offline."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    script = os.path.join(REPO, "benchmarks", "bench_tree_build.py")
    trace = tmp_path / "trace"
    proc = subprocess.run([sys.executable, script, "--tiny", "--budgets", "8", "--reps", "3",
                           "--head-kernels", "xla,reference",
                           "--tunings", "default,narrow:block_v=128+gru_chunk=16",
                           "--head-rollout", "--trace", str(trace), "--trace-reps", "1",
                           "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = glob.glob(str(tmp_path / "tree_build_*.json"))
    assert len(files) == 1 and os.path.exists(files[0][:-5] + ".md"), os.listdir(tmp_path)
    with open(files[0]) as f:
        result = json.load(f)
    row = result["rows"][0]
    for key in ("dominotree_decode_head_ms", "dominotree_plain_head_ms", "ddtree_ms",
                "dominotree_decode_head_reference_ms",
                "dominotree_decode_head_reference[narrow]_ms"):
        assert row[key] > 0, key
    assert result["meta"]["hbm_bytes_per_s"] == 4.3e12          # the fallback (a CPU)
    for section in (result["rollout"], row["variants"]):
        assert [(e["impl"], e["tuning"]) for e in section] == [
            ("xla", "-"), ("reference", "default"), ("reference", "narrow")]
        for e in section:
            assert e["ms"] > 0 and e["floor_ms"] > 0 and e["compile_s"] > 0
            assert e["trace"]["kernels_per_call"] > 0 and os.path.isdir(e["trace_dir"])
    assert all(e["same_drafts"] == 1.0 for e in result["rollout"])
    assert all(e["same_tree"] for e in row["variants"])
    proc = subprocess.run([sys.executable, script, "--summarise-trace", str(trace),
                           "--trace-reps", "1"], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("### ") == 6 and "rollout_reference_narrow" in proc.stdout
