"""benchmarks/bench_train.py: the step-cost model (counts checked against the parameter
shapes), the roofline prediction, and a reduced-size CPU run that prints MFU beside the
prediction and writes its results."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from domino_jax.config import QWEN3_8B, QWEN3_8B_DOMINO_DRAFT
from domino_jax.train.config import TrainConfig
from domino_jax.train.cost import CostPart, predict_step, step_cost

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _kernel_size(tree) -> int:
    """Parameters of the 2-D kernels (matmul weights) of a shape tree."""
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(tree) if len(x.shape) == 2))


def test_predict_step_roofline():
    parts = [CostPart("compute bound", 2e12, 1e9), CostPart("memory bound", 1e11, 4.8e12)]
    pred = predict_step(parts, peak_flops=1e12, bandwidth=4.8e12)
    assert pred["step_s"] == pytest.approx(2.0 + 1.0)
    assert pred["mfu"] == pytest.approx(2.1e12 / (3.0 * 1e12))
    assert [p["bound"] for p in pred["parts"]] == ["compute", "memory"]
    assert pred["flops"] == 2.1e12 and pred["bytes"] == pytest.approx(4.801e12)


def test_step_cost_counts_match_the_parameter_shapes():
    """The matmul FLOPs of the reference Qwen3-8B Domino step are 2x (target), 6x (drafter
    layers, Domino head) and 4x (frozen LM head) the parameter counts XLA would build."""
    from domino_jax.models import dflash, domino_head, qwen3

    cfg = TrainConfig(batch_size=2, max_length=2048, num_anchors=256)
    parts = {p.name: p for p in step_cost(cfg, QWEN3_8B_DOMINO_DRAFT, QWEN3_8B, 2048)}
    target = qwen3.param_shapes(QWEN3_8B)
    layers = {k: v for k, v in target.items() if k.startswith("layers_")}
    tokens, rows = 2 * 2048, 2 * 256 * 16
    assert parts["target matmuls"].flops == 2 * tokens * _kernel_size(layers)
    draft = dflash.param_shapes(QWEN3_8B_DOMINO_DRAFT)
    draft_layers = {k: v for k, v in draft.items() if k.startswith("layers_")}
    assert parts["draft matmuls"].flops == 6 * rows * _kernel_size(draft_layers)
    assert parts["LM head (draft rows)"].flops == 4 * rows * _kernel_size(target["lm_head"])
    head = domino_head.head_param_shapes(QWEN3_8B_DOMINO_DRAFT)
    assert parts["Domino head"].flops == 6 * rows * _kernel_size(head)
    optimizer_params = parts["optimizer"].bytes / 48
    total = _kernel_size(draft) + _kernel_size(head)
    assert optimizer_params == pytest.approx(total, rel=1e-3)       # ~1.1B drafter params
    soft = step_cost(TrainConfig(batch_size=2, max_length=2048, num_anchors=256, labels="soft"),
                     QWEN3_8B_DOMINO_DRAFT, QWEN3_8B, 2048)
    assert {p.name for p in soft} - set(parts) == {"soft labels (target logits)"}


@pytest.mark.slow
def test_bench_train_tiny_prints_mfu_beside_the_prediction(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_train.py"), "--tiny",
           "--shapes", "smollm2", "--seq-len", "32", "--steps", "2", "--warmup", "1",
           "--trace-steps", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = re.search(r"^smollm2 \(loss chunk 4096 rows, final logits joint\): step [\d.]+ ms, [\d,]+ tokens/s .*"
                     r"MFU ([\d.]+)% "
                     r"\(predicted ([\d.]+)%: roofline step ([\d.]+) ms", proc.stdout, re.M)
    assert line, proc.stdout
    assert float(line.group(1)) > 0 and float(line.group(2)) > 0
    files = glob.glob(str(tmp_path / "train_speed_cpu_*.json"))
    assert len(files) == 1 and os.path.isfile(files[0][:-5] + ".md")
    with open(files[0]) as f:
        result = json.load(f)
    assert result["commit"] and result["versions"]["jax"] and result["device"] == "cpu"
    (entry,) = result["shapes"]
    assert entry["tokens_per_second"] > 0 and 0 < entry["mfu"] and entry["predicted_mfu"] > 0
    # the traced step's kernels (host events on the CPU), listed in the report
    trace = entry["trace"]
    assert trace["calls"] == 1 and trace["top"] and trace["busy_us_per_call"] > 0, trace
    with open(files[0][:-5] + ".md") as f:
        assert "kernels per step" in f.read()
    assert 0.6 < entry["xla_flops_per_step"] / entry["model_flops_per_step"] < 1.4
    with open(files[0][:-5] + ".md") as f:
        assert "predicted MFU" in f.read()
