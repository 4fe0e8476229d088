"""benchmarks/recipe_sweep.py: every variant's flags are real trainer flags, a stopped run
resumes, and the report reads run folders (synthetic ones: no training here)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import pytest

from domino_jax.train.__main__ import parse_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location(
    "recipe_sweep", os.path.join(REPO, "benchmarks", "recipe_sweep.py"))
sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sweep)


def _args(tmp_path, **kw):
    base = dict(data="shards", heldout="heldout.jsonl", out=str(tmp_path), steps=400,
                batch_size=64, max_length=448, micro_batches=2, checkpoint_every=100,
                eval_num_prompts=8, eval_max_new_tokens=64, eval_methods="dflash,domino,ngram",
                seed=0)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("name", sorted(sweep.VARIANTS))
def test_every_variant_parses_as_trainer_flags(tmp_path, name):
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(json.dumps({"prompt": "hi", "kind": "chat"}) + "\n")
    cmd = sweep.trainer_command(_args(tmp_path, heldout=str(heldout)), name)
    assert cmd[1:3] == ["-m", "domino_jax.train"] and "--resume" not in cmd
    args = parse_args(cmd[3:])
    assert args.steps == 400 and args.micro_batches == 2
    flags = sweep.VARIANTS[name][1]
    for flag, value in zip(flags[::2], flags[1::2]):
        parsed = getattr(args, flag[2:].replace("-", "_"))
        assert parsed == type(parsed)(value), (flag, value, parsed)


def test_a_started_run_resumes_and_a_finished_one_is_skipped(tmp_path):
    run = tmp_path / "base"
    (run / "checkpoints" / "100").mkdir(parents=True)
    assert "--resume" in sweep.trainer_command(_args(tmp_path), "base")
    assert not sweep.finished(str(run))
    (run / "draft").mkdir()
    (run / "draft" / "config.json").write_text("{}")
    assert sweep.finished(str(run))


def _fake_run(root, name, step, planned, domino):
    run = root / name
    run.mkdir()
    tau = {"domino": {"chat": domino, "all": domino}, "dflash": {"all": domino - 0.1},
           "ngram": {"all": 1.5}}
    (run / "curve.json").write_text(json.dumps({"points": [
        {"step": 0, "tokens_seen": 0, "loss": None, "acc": None, "tau": tau},
        {"step": step, "tokens_seen": 10, "loss": 3.0, "acc": 0.3, "tau": tau}]}))
    (run / "train_config.json").write_text(json.dumps({"train": {"steps": planned}}))
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 3.5, "acc_mean": 0.3, "step_time": t}) + "\n"
        for s, t in ((1, 20.0), (10, 0.2), (20, 0.4))))


def test_report_orders_by_domino_tau_and_marks_cut_runs(tmp_path, capsys):
    _fake_run(tmp_path, "base", 400, 400, 1.56)
    _fake_run(tmp_path, "layers5", 200, 400, 1.65)
    (tmp_path / "not_a_variant").mkdir()
    out = tmp_path / "table"
    assert sweep.report(argparse.Namespace(sweep=str(tmp_path), out=str(out))) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[2].startswith("| layers5 |") and "200 (cut)" in lines[2]
    assert lines[3].startswith("| base |") and "| 0.30 |" in lines[3]   # median without row 0
    rows = json.loads((tmp_path / "table.json").read_text())
    assert rows["base"]["finished"] and not rows["layers5"]["finished"]
    assert rows["base"]["median_step_seconds"] == pytest.approx(0.3)


def test_unknown_variant_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="unknown variant.*nope"):
        sweep.run(argparse.Namespace(variants="base,nope", out=str(tmp_path)))
