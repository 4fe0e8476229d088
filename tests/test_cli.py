"""The decode CLI's error handling: clear messages naming the bad path, pair or method."""

import os

import pytest

from domino_jax.decode.__main__ import main

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "reference")


class _Tokenizer:
    """A stand-in tokenizer: the fixture folders have none."""

    chat_template = None
    eos_token_id = None

    def encode(self, text):
        return [1, 2, 3]


@pytest.fixture
def stand_in_tokenizer(monkeypatch):
    import domino_jax.decode.loading as loading

    monkeypatch.setattr(loading, "load_tokenizer", lambda folder: _Tokenizer())


def test_wrong_target_path(capsys, tmp_path):
    missing = str(tmp_path / "nope")
    assert main(["--target", missing]) == 2
    assert missing in capsys.readouterr().err


def test_unknown_method(capsys):
    target = os.path.join(FIX, "dflash", "target")
    assert main(["--target", target, "--method", "medusa"]) == 2
    assert "unknown method 'medusa'" in capsys.readouterr().err


def test_method_needs_a_drafter(capsys):
    target = os.path.join(FIX, "dflash", "target")
    assert main(["--target", target, "--method", "domino"]) == 2
    assert "needs a drafter" in capsys.readouterr().err


def test_draft_that_does_not_fit_the_target(capsys, stand_in_tokenizer):
    target = os.path.join(FIX, "dflash", "target")          # 5 target layers
    draft = os.path.join(FIX, "domino_shift", "draft")      # trained for a 4-layer target
    assert main(["--target", target, "--draft", draft, "--method", "domino"]) == 2
    err = capsys.readouterr().err
    assert "num_target_layers 4" in err and draft in err


def _spy_load_pair(monkeypatch, option: str) -> list:
    """Replace ``load_pair`` by a stub that records ``kwargs[option]`` and stops the CLI."""
    import domino_jax.decode.loading as loading

    seen = []

    def fake_load_pair(*args, **kwargs):
        seen.append(kwargs.get(option))
        raise FileNotFoundError("stop here")

    monkeypatch.setattr(loading, "load_pair", fake_load_pair)
    return seen


def test_no_head_input_table_reaches_load_pair(monkeypatch, stand_in_tokenizer):
    """``--no-head-input-table`` is passed to ``load_pair`` (default: the table is made)."""
    seen = _spy_load_pair(monkeypatch, "head_input_table")
    target = os.path.join(FIX, "domino_shift", "target")
    draft = os.path.join(FIX, "domino_shift", "draft")
    for extra, expected in (([], True), (["--no-head-input-table"], False)):
        assert main(["--target", target, "--draft", draft, "--method", "domino"] + extra) == 2
        assert seen[-1] is expected


def test_attention_flag_reaches_load_pair(monkeypatch, capsys, stand_in_tokenizer):
    """``--attention`` is passed to ``load_pair`` (default ``xla``); a bad value is refused
    by the parser, naming the choices."""
    seen = _spy_load_pair(monkeypatch, "attention")
    target = os.path.join(FIX, "domino_shift", "target")
    for extra, expected in (([], "xla"), (["--attention", "pallas"], "pallas")):
        assert main(["--target", target] + extra) == 2
        assert seen[-1] == expected
    with pytest.raises(SystemExit) as stop:
        main(["--target", target, "--attention", "flash"])
    assert stop.value.code == 2
    assert "invalid choice: 'flash'" in capsys.readouterr().err


def test_draft_vocab_flag(monkeypatch, capsys, stand_in_tokenizer):
    """``--draft-vocab``: ``auto`` (default; ``load_pair`` chooses, tests/test_draft_vocab.py)
    or a number reaches the block drafters' options; a method without a drafter refuses a
    number, and a word that is not ``auto`` is refused by the parser."""
    seen = _spy_load_pair(monkeypatch, "options")
    target = os.path.join(FIX, "domino_shift", "target")
    pair = ["--target", target, "--draft", os.path.join(FIX, "domino_shift", "draft")]
    for method, extra, expected in (("domino", [], "auto"),
                                    ("dflash", ["--draft-vocab", "7"], 7),
                                    ("dominotree", ["--draft-vocab", "0"], 0)):
        assert main(pair + ["--method", method] + extra) == 2
        assert seen[-1].draft_vocab == expected, (method, extra)
    assert main(["--target", target, "--method", "ar", "--draft-vocab", "5"]) == 2
    assert "--draft-vocab is not an option of --method ar" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(pair + ["--draft-vocab", "most"])
    assert "expected auto or a number" in capsys.readouterr().err


def test_tensor_parallel_beyond_the_devices(capsys):
    import jax

    target = os.path.join(FIX, "dflash", "target")
    n = jax.device_count() + 1
    assert main(["--target", target, "--tensor-parallel", str(n)]) == 2
    assert f"--tensor-parallel {n} exceeds the {n - 1} available" in capsys.readouterr().err


def test_head_kernels_flag(monkeypatch, capsys, stand_in_tokenizer):
    """``--head-kernels`` reaches the method's options (default ``auto``); a method without
    the head refuses it; on the CPU ``pallas`` fails before any weights are read."""
    seen = _spy_load_pair(monkeypatch, "options")
    target = os.path.join(FIX, "domino_shift", "target")
    draft = os.path.join(FIX, "domino_shift", "draft")
    pair = ["--target", target, "--draft", draft]
    for method, extra, expected in (("domino", [], "auto"),
                                    ("dominotree", ["--head-kernels", "reference"], "reference")):
        assert main(pair + ["--method", method] + extra) == 2
        assert seen[-1].head_kernels == expected
    assert main(pair + ["--method", "dflash", "--head-kernels", "pallas"]) == 2
    assert "--head-kernels is not an option of --method dflash" in capsys.readouterr().err
    monkeypatch.undo()
    import domino_jax.decode.loading as loading

    monkeypatch.setattr(loading, "load_tokenizer", lambda folder: _Tokenizer())
    monkeypatch.setattr(loading, "load_target", lambda *a, **k: pytest.fail("weights read"))
    assert main(pair + ["--method", "domino", "--head-kernels", "pallas"]) == 2
    assert "need a CUDA GPU (Triton) or a TPU" in capsys.readouterr().err
