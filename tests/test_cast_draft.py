"""``converters.hf_draft.cast_draft``: a float32 drafter export shipped as bf16."""

from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from converters.hf_draft import _main, cast_draft, load_draft
from converters.table import read_tensors, write_tensors

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "reference")


def float32_copy(src, dst):
    write_tensors({k: np.asarray(v, np.float32) for k, v in read_tensors(src).items()}, dst)
    shutil.copy(os.path.join(src, "config.json"), os.path.join(dst, "config.json"))


def test_cast_to_bf16_keeps_names_and_rounds_values(tmp_path):
    src, dst = str(tmp_path / "f32"), str(tmp_path / "bf16")
    float32_copy(os.path.join(FIXTURES, "domino_shift", "draft"), src)
    cast_draft(src, dst, "bfloat16")
    before, after = read_tensors(src), read_tensors(dst)
    assert sorted(before) == sorted(after)
    for key, value in before.items():
        assert after[key].dtype == ml_dtypes.bfloat16, key
        assert after[key].shape == value.shape, key
        np.testing.assert_array_equal(np.asarray(after[key], np.float32),
                                      np.asarray(value.astype(ml_dtypes.bfloat16), np.float32))
    with open(os.path.join(dst, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    cfg_src, _ = load_draft(src, jnp.float32)
    cfg_dst, params = load_draft(dst, jnp.float32)
    assert cfg_src == cfg_dst and params["backbone"] and params["head"]


def test_cast_errors_name_the_problem(tmp_path, capsys):
    with pytest.raises(ValueError, match="float16"):
        cast_draft(os.path.join(FIXTURES, "dflash", "draft"), str(tmp_path / "x"), "float16")
    assert _main(["cast", str(tmp_path / "missing"), str(tmp_path / "y")]) == 2
    assert "missing" in capsys.readouterr().out
