"""Bad inputs a user can make end in a clear error naming the file or option (CLI: exit 2):
a truncated or corrupt ``model.safetensors`` (target or drafter), non-finite sampling
options."""

from __future__ import annotations

import math
import os
import shutil

import jax.numpy as jnp
import pytest

from converters.hf_draft import load_draft
from converters.hf_target import load_target
from converters.table import CheckpointError
from domino_jax.decode.__main__ import main
from domino_jax.decode.sampling import SamplingConfig
from domino_jax.decode.speculative import DecodeConfig

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "reference", "domino_shift")


def _copy(tmp_path, which: str, damage: str) -> str:
    """A copy of the fixture's ``which`` folder with its weights truncated or garbled."""
    folder = str(tmp_path / which)
    shutil.copytree(os.path.join(FIX, which), folder)
    weights = os.path.join(folder, "model.safetensors")
    data = open(weights, "rb").read()
    with open(weights, "wb") as f:
        f.write(data[:len(data) // 2] if damage == "truncated" else b"\x13" * len(data))
    return folder


@pytest.mark.parametrize("damage", ["truncated", "garbled"])
def test_damaged_safetensors_named(tmp_path, damage):
    target = _copy(tmp_path, "target", damage)
    with pytest.raises(CheckpointError, match="not a readable safetensors file") as err:
        load_target(target, jnp.float32)
    assert os.path.join(target, "model.safetensors") in str(err.value)
    draft = _copy(tmp_path, "draft", damage)
    with pytest.raises(CheckpointError, match="truncated or corrupt") as err:
        load_draft(draft, jnp.float32)
    assert os.path.join(draft, "model.safetensors") in str(err.value)


def test_damaged_drafter_cli_exit_2(tmp_path, capsys, monkeypatch):
    """The CLI names the file and exits 2 (the fixture target has no tokenizer: a stand-in)."""
    import domino_jax.decode.loading as loading

    class Tokenizer:
        chat_template, eos_token_id = None, None

        def encode(self, text):
            return [1, 2, 3]

    monkeypatch.setattr(loading, "load_tokenizer", lambda folder: Tokenizer())
    draft = _copy(tmp_path, "draft", "truncated")
    code = main(["--target", os.path.join(FIX, "target"), "--draft", draft, "--method", "domino",
                 "--max-new-tokens", "2"])
    assert code == 2
    assert os.path.join(draft, "model.safetensors") in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--temperature", "nan"), ("--temperature", "inf"),
                                        ("--top-p", "nan"), ("--draft-temperature", "nan")])
def test_non_finite_sampling_options(flag, value, capsys):
    code = main(["--target", os.path.join(FIX, "target"), flag, value])
    assert code == 2
    err = capsys.readouterr().err
    assert value in err and ("finite" in err or "top_p" in err), err


def test_non_finite_sampling_in_the_library():
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            SamplingConfig(temperature=bad)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(1.0, top_p=math.nan)
    with pytest.raises(ValueError, match="draft_temperature must be finite"):
        DecodeConfig(method="domino", draft_policy="sample", draft_temperature=math.nan)
