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
        [sys.executable, SCRIPT, "--tiny", "--prompt-lens", "16",
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
    # the head's decode layout against the plain head, same process, same drafts
    plain = pr["stages"]["domino"]["head_plain_layout"]
    assert plain["ms"] > 0 and "floor_ms" in plain and plain["same_drafts"] is True


def _run_tiny(script: str, out) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", script), "--tiny",
                           "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = glob.glob(str(out / "*.json"))
    assert len(files) == 1 and os.path.exists(files[0][:-5] + ".md"), os.listdir(out)
    with open(files[0]) as f:
        return json.load(f)


def test_bench_gemv_tiny(tmp_path):
    rows = _run_tiny("bench_gemv.py", tmp_path)["rows"]
    assert [r["variant"] for r in rows] == ["separate", "fused", "fused_t"]
    assert rows[0]["bytes"] == rows[1]["bytes"] == rows[2]["bytes"]   # same weights, regrouped
    assert [r["products_per_layer"] for r in rows] == [7, 4, 4]
    assert all(r["ms_per_step"] > 0 for r in rows)


def test_bench_attention_tiny(tmp_path):
    """Every formulation the GPU run compares computes the same attention (cuDNN is absent on
    the CPU and reported as an error row, not raised; the Pallas variants run in the
    interpreter)."""
    rows = _run_tiny("bench_attention.py", tmp_path)["rows"]
    for row in rows:
        if row["variant"] == "dpa_cudnn":
            continue
        assert "error" not in row, row
        assert row["us_per_layer"] > 0 and row["max_abs_diff_vs_ours"] < 2e-2, row
    assert {r["queries"] for r in rows} == {1, 17}
    assert {"pallas", "pallas_stacked"} <= {r["variant"] for r in rows}


def test_bench_tree_build_tiny(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_tree_build.py"),
                           "--tiny", "--budgets", "8", "--reps", "3", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = glob.glob(str(tmp_path / "tree_build_*.json"))
    assert len(files) == 1 and os.path.exists(files[0][:-5] + ".md"), os.listdir(tmp_path)
    with open(files[0]) as f:
        row = json.load(f)["rows"][0]
    for key in ("dominotree_decode_head_ms", "dominotree_plain_head_ms", "ddtree_ms"):
        assert row[key] > 0, key


@pytest.mark.slow
def test_round_stages_tiny(tmp_path):
    """benchmarks/round_stages.py on the tiny random pair: every stage timed, JSON and
    Markdown written, the whole round positive and the stages named; the trimmed block's
    row (``--trim-block``) and a trace summary per row (``--profile``)."""
    out = tmp_path / "stages.json"
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_llvm_disable_expensive_passes=true")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip())
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "round_stages.py"), "--mode",
         "forced", "--shape", "tiny", "--batch", "2", "--widths", "2", "--reps", "2",
         "--rounds", "2", "--prompt-len", "16", "--trim-block", "--profile",
         str(tmp_path / "prof"), "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    stages = report["stages"]["2"]
    for name in ("backbone", "lm_head", "rollout", "draft", "verify_forward", "accept",
                 "commit", "round"):
        assert stages[name] > 0, name
    assert report["meta"]["ar_ms"] > 0 and report["meta"]["batch"] == 2
    # the run's XLA_FLAGS are recorded as the process ran with them (a flag sweep runs one
    # process per value; importing domino_jax appends its copy-insertion flags, NOTES 21)
    assert report["meta"]["xla_flags"].startswith(env["XLA_FLAGS"])
    assert report["meta"]["xla_flags"] in (tmp_path / "stages.md").read_text()
    # 2 of the tiny block's 8 slots in the last layer: fewer flops than the whole block
    assert 0 < stages["backbone_gflop"] < stages["backbone_gflop_all_slots"]
    # trimmed: the backbone runs over [root, MASK x 2], 3 of the 8 slots, in every layer
    trimmed = report["stages"]["2t"]
    assert trimmed["round"] > 0
    assert trimmed["backbone_gflop_all_slots"] < stages["backbone_gflop_all_slots"]
    for row in (stages, trimmed):        # the CPU has no device kernels: host events
        for kind in ("profile", "profile_backbone"):
            assert row[kind]["source"] == "host" and row[kind]["kernels"] > 0, row[kind]
            assert row[kind]["per"] == 2 and row[kind]["classes"] == {}
    md = (tmp_path / "stages.md").read_text()
    assert "| 2 |" in md and "| 2t |" in md and "| profile" not in md
    again = tmp_path / "again.json"          # --from-traces: the same folders, summarised again
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "round_stages.py"), "--from-traces",
         str(tmp_path / "prof"), "--rounds", "2", "--out", str(again)],
        env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(json.loads(again.read_text())) == ["2", "2t"]


def test_kernel_classes_of_a_synthetic_trace():
    """profile_decode.kernel_classes: device events only, per-layer kernels by count, products
    by name, memcpy apart, all per round."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from profile_decode import kernel_classes

    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    def x(pid, name, dur, n):
        return [{"ph": "X", "pid": pid, "name": name, "ts": i, "dur": dur} for i in range(n)]
    events = (meta + x(1, "nvjet_gemm_a", 10.0, 72) + x(1, "fusion_7", 2.0, 60)
              + x(1, "gemm_fusion_dot_3", 5.0, 4) + x(1, "loop_add_fusion", 1.0, 6)
              + x(1, "MemcpyD2D", 3.0, 8) + x(2, "nvjet_host_side", 100.0, 90))
    got = kernel_classes({"traceEvents": events}, per=2)
    assert got == {"memcpy": 12.0, "other_fusions": 3.0, "other_products": 10.0,
                   "per_layer_other": 60.0, "per_layer_products": 360.0}
