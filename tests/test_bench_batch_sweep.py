"""benchmarks/bench_batch_sweep.py: the method names (the ``ngram`` floor line, adaptive with
the lookup arms) and a tiny forced-mode sweep on the CPU (a subprocess: the script sets up
its own imports)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from bench_batch_sweep import fixed_width, split_method  # noqa: E402


def test_method_names():
    assert split_method("ngram") == ("ngram", False, False)
    assert split_method("domino-auto") == ("domino", True, False)
    assert split_method("dflash-auto+lookup") == ("dflash", True, True)
    assert split_method("ddtree") == ("ddtree", False, False)
    for bad in ("ddtree-auto+lookup", "ngram-auto", "medusa"):
        with pytest.raises(ValueError, match="unknown method"):
            split_method(bad)


def test_fixed_width_names():
    assert fixed_width("domino@4") == ("domino", 4)
    assert fixed_width("dflash@16") == ("dflash", 16)
    assert fixed_width("domino-auto") == ("domino-auto", 0)
    for bad in ("ddtree@4", "domino@0", "domino@x", "domino-auto@4"):
        with pytest.raises(ValueError, match="bad fixed width"):
            fixed_width(bad)


def test_fixed_width_reaches_the_drafter():
    """``domino@2``: the drafter proposes 2 drafts a round; the label stays ``domino@2``."""
    from bench_batch_sweep import Models, parse_args, task_config

    args = parse_args(["--mode", "forced", "--shape", "tiny", "--methods", "ar,domino@2"])
    assert args.methods == ["ar", "domino@2"]
    config, drafter, _ = task_config(Models(args), "domino@2", 3.0)
    assert drafter.options.draft_length == 2 and config.adaptive is None
    with pytest.raises(SystemExit):
        parse_args(["--methods", "ar,domino@0"])


def _tiny_sweep(tmp_path, methods: str, *extra: str):
    """Run the sweep at the tiny forced shape (batch 2, tau 3); its JSON path and rows."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "bench_batch_sweep.py"),
         "--mode", "forced", "--shape", "tiny", "--batches", "2", "--taus", "3",
         "--methods", methods, "--new-tokens", "8", "--prompt-len", "16", "--reps", "1",
         "--cost-rounds", "1", "--cost-reps", "1", "--out", str(tmp_path), *extra],
        env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = glob.glob(str(tmp_path / "batch_sweep_2*.json"))
    return path, json.load(open(path))["rows"]


@pytest.mark.slow
def test_tiny_sweep_with_the_lookup_line(tmp_path):
    path, rows = _tiny_sweep(tmp_path, "ar,ngram,domino-auto+lookup")
    assert [r["method"] for r in rows] == ["ar", "ngram", "domino-auto+lookup"]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert rows[1]["forced_tau"] is None and list(rows[1]["width_hist"]) == ["5"]
    assert rows[2]["forced_tau"] == 3.0
    assert sum(rows[2]["arms"].values()) > 0
    assert "| ngram |" in open(path[:-5] + ".md").read()


@pytest.mark.slow
def test_tiny_continuous_batching_sweep(tmp_path):
    path, rows = _tiny_sweep(tmp_path, "ar,domino-auto", "--serve", "3")
    assert [r["method"] for r in rows] == ["ar", "domino-auto"]
    assert all(r["tokens_per_s"] > 0 and r["runs"][0]["refills"] >= 1 for r in rows)
    assert "Continuous batching: 3 requests per slot" in open(path[:-5] + ".md").read()


def test_trim_block_reaches_the_chain_drafters_only():
    """``--trim-block``: the chain methods' drafters trim their block (the arms the adaptive
    loop derives keep the option); the tree methods and AR are untouched."""
    from bench_batch_sweep import Models, markdown, parse_args, task_config

    args = parse_args(["--mode", "forced", "--shape", "tiny", "--trim-block",
                       "--methods", "ar,domino-auto,dflash,ddtree"])
    models = Models(args)
    _, none, _ = task_config(models, "ar", 3.0)
    assert none is None
    for method in ("domino-auto", "dflash"):
        _, drafter, _ = task_config(models, method, 3.0)
        assert drafter.options.trim_block
    _, tree, _ = task_config(models, "ddtree", 3.0)
    assert not getattr(tree.options, "trim_block", False)
    args_off = parse_args(["--mode", "forced", "--shape", "tiny"])
    assert not args_off.trim_block
    meta = dict(date="d", device="cpu", mode="forced", shape="tiny", new_tokens=8,
                git_commit="x", reps=1, load_start=[0], serve=0, trim_block=True)
    assert "trimmed blocks" in markdown(meta, [])
