"""Fine-tuning an existing drafter (``TrainConfig.init_draft`` / ``--init-draft DIR``):
geometry, weights and mask come from the folder; mismatches are clear errors."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from domino_jax.models.qwen3 import TargetLM
from domino_jax.train.config import TrainConfig, make_draft_config
from tests.test_train import SMALL, TARGET, random_target_params, synthetic_examples

# one fine-tuning run's settings: the tests' runs share its compiled step
FINETUNE = TrainConfig(drafter="domino", steps=6, batch_size=4, max_length=48, num_anchors=8,
                       lr=3e-2, warmup_ratio=0.0, compute_dtype="float32", log_every=1)


@pytest.fixture(scope="module")
def target_params():
    return random_target_params()


@pytest.fixture(scope="module")
def exported(target_params, tmp_path_factory):
    """A Domino drafter (1 layer, block 4) exported in the HF format."""
    from domino_jax.train.loop import export_trained_draft
    from domino_jax.train.loss import init_draft_params

    config = make_draft_config(TARGET, "domino", 1, 4, 16, 8, mask_token_id=3)
    params = jax.jit(lambda t: init_draft_params(config, jax.random.PRNGKey(7), False, t))(
        target_params)                              # one program, not op by op
    path = str(tmp_path_factory.mktemp("init_draft"))
    export_trained_draft(config, params, path)
    return path


def run(cfg, target_params, out, **kw):
    from domino_jax.train.loop import train

    args = dict(SMALL, draft_layers=2, block_size=8)   # ignored under init_draft
    return train(cfg, None, None, str(out), examples=synthetic_examples(16),
                 target=TargetLM(TARGET), target_params=target_params, export=False,
                 progress=False, **args, **kw)


def test_starts_from_the_folder(exported, target_params, tmp_path):
    """One step of the fine-tuning run: its learning rate is 0 (the warmup starts at 0), so
    the params after it are the folder's."""
    from domino_jax.train.loop import load_trained_draft

    cfg = dataclasses.replace(FINETUNE, init_draft=exported)
    result = run(cfg, target_params, tmp_path, stop_after=1)
    assert [h["lr"] for h in result.history] == [0.0]
    config, loaded = load_trained_draft(exported, jnp.float32)
    assert result.draft_config == config                # 1 layer, block 4, mask 3: the folder's
    assert result.draft_config.num_layers == 1 and result.draft_config.block_size == 4
    assert "mask_embedding" not in result.params
    jax.tree_util.tree_map(np.testing.assert_array_equal, result.params, loaded)


def test_learns_from_the_folder(exported, target_params, tmp_path):
    result = run(dataclasses.replace(FINETUNE, init_draft=exported), target_params, tmp_path)
    losses = [h["loss"] for h in result.history]
    assert losses[-1] < losses[0], losses


def test_grows_the_folder(exported, target_params, tmp_path, capsys):
    """``grow_layers`` / ``grow_gru_hidden_dim``: the run starts from the folder's drafter
    grown (train/grow.py), so its first step, at learning rate 0, returns the grown params."""
    from domino_jax.train.grow import grow_draft
    from domino_jax.train.loop import load_trained_draft

    cfg = dataclasses.replace(FINETUNE, init_draft=exported, grow_layers=2,
                              grow_gru_hidden_dim=24)
    result = run(cfg, target_params, tmp_path, stop_after=1)
    assert result.draft_config.num_layers == 2 and result.draft_config.gru_hidden_dim == 24
    config, loaded = load_trained_draft(exported, jnp.float32)
    _, grown = grow_draft(config, loaded, jax.random.PRNGKey(cfg.seed), 2, 24)
    jax.tree_util.tree_map(np.testing.assert_array_equal, result.params, grown)
    with pytest.raises(ValueError, match="grow_layers: growing needs a trained drafter"):
        TrainConfig(grow_layers=3)
    from domino_jax.train.__main__ import parse_args, with_recipe_options

    args = parse_args(["--data", "x.jsonl", "--out", str(tmp_path / "o"), "--grow-layers", "3"])
    with pytest.raises(SystemExit) as e:
        with_recipe_options(TrainConfig(), args)
    assert e.value.code == 2
    assert "--grow-layers grows a trained drafter" in capsys.readouterr().err


def test_mismatches_are_named(exported, target_params, tmp_path):
    cfg = TrainConfig(drafter="dflash", steps=1, batch_size=4, max_length=48, num_anchors=8,
                      compute_dtype="float32", init_draft=exported)
    with pytest.raises(ValueError, match="is a Domino drafter but --drafter is 'dflash'"):
        run(cfg, target_params, tmp_path)
    with pytest.raises(ValueError, match="excludes init_from_target and learned_mask"):
        TrainConfig(init_draft=exported, learned_mask=True)


def test_cli_rejects_bad_init_draft(tmp_path, capsys):
    """``python -m domino_jax.train`` exits 2 naming the problem (the second case through
    the same ``main`` in this process)."""
    from domino_jax.train.__main__ import main

    args = ["--data", "x.npz", "--out", str(tmp_path), "--init-draft"]
    proc = subprocess.run([sys.executable, "-m", "domino_jax.train"] + args
                          + [str(tmp_path / "missing")], capture_output=True, text=True)
    assert proc.returncode == 2 and "no config.json there" in proc.stderr, proc.stderr
    with pytest.raises(SystemExit) as e:
        main(args + [str(tmp_path), "--learned-mask"])
    assert e.value.code == 2 and "excludes --init-draft-from-target" in capsys.readouterr().err
