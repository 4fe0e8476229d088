"""The first screen (issue 22): no stray notices on stderr, progress lines, the summary.

The subprocess runs use a tiny saved pair (the reference fixtures + a word-level
tokenizer), leave ``JAX_PLATFORMS`` unset (so jax probes for a TPU as on a user's machine)
and make torch unimportable (as in the ``./dev demo`` venv, where transformers then prints
its "PyTorch was not found" advice). A ``-v`` control run shows both notices, so the quiet
run's assertion is not vacuous.
"""

import io
import json
import logging
import os
import shutil
import subprocess
import sys

import pytest

from domino_jax.console import setup_logging, step
from domino_jax.decode.report import summary_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures", "reference", "domino_shift")
TPU_PROBE = "Unable to initialize backend 'tpu'"
TORCH_NOTICE = "PyTorch was not found"

# Runs the decode CLI with torch hidden from importlib (find_spec and import).
NO_TORCH_RUNNER = r"""
import importlib.util, runpy, sys
_find_spec = importlib.util.find_spec
def find_spec(name, package=None):
    return None if name.split(".")[0] == "torch" else _find_spec(name, package)
importlib.util.find_spec = find_spec
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, NoTorch())
sys.argv = ["domino_jax.decode"] + sys.argv[1:]
runpy.run_module("domino_jax.decode", run_name="__main__")
"""


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """The domino_shift fixture target (vocab 256) with a word-level tokenizer, + drafter."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    target = tmp_path_factory.mktemp("target")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(FIX, "target", name), target / name)
    words = ["<unk>", "</s>"] + [f"w{i}" for i in range(200)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()          # joins with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                            eos_token="</s>").save_pretrained(str(target))
    return str(target), os.path.join(FIX, "draft")


def _run_cli(args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "CI")}
    env.update(PYTHONPATH=ROOT, TRANSFORMERS_NO_ADVISORY_WARNINGS="")
    return subprocess.run([sys.executable, "-c", NO_TORCH_RUNNER, *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.slow
def test_cli_stderr_is_quiet_and_ends_with_the_summary(tiny_pair):
    target, draft = tiny_pair
    common = ["--target", target, "--draft", draft, "--method", "domino", "--no-chat",
              "--prompt", "w1 w2 w3 w4 w5 w6", "--max-new-tokens", "12"]
    run = _run_cli(common + ["--compare-ar"])
    assert run.returncode == 0, run.stderr
    err = run.stderr
    assert TPU_PROBE not in err and TORCH_NOTICE not in err, err
    assert "compiling domino (prefill + round loop, batch 1" in err
    assert "compiling ar (prefill + round loop" in err
    lines = err.strip().splitlines()
    assert lines[-3].split() == ["method", "tokens", "rounds", "tau", "tok/s", "speedup",
                                 "verify", "widths", "output"], err
    assert lines[-2].startswith("domino") and lines[-2].endswith("identical to AR"), err
    assert lines[-1].startswith("ar") and lines[-1].endswith("reference"), err
    assert "warning" not in err.lower(), err          # nothing else slipped through

    # one prompt with --json: nothing but the record on stdout (no streamed text); the AR
    # comparison in JSON is test_cli_slots_serve_a_queue's. With -v, the control of the
    # quiet run above: both notices are shown (the probe and the torch advice happen here)
    as_json = _run_cli(common + ["--json", "--draft-length", "4", "-v"])  # quicker to compile
    assert as_json.returncode == 0, as_json.stderr
    assert TPU_PROBE in as_json.stderr and TORCH_NOTICE in as_json.stderr, as_json.stderr
    record = json.loads(as_json.stdout)
    domino, = record["methods"]
    assert domino["method"] == "domino"
    assert record["outputs"][0]["tokens"] and len(record["outputs"][0]["tokens"]) <= 12
    assert domino["new_tokens"] == len(record["outputs"][0]["tokens"])


@pytest.mark.slow
def test_cli_slots_serve_a_queue(tiny_pair):
    """``--slots 2`` with three prompts: continuous batching, each output AR's (a fixed draft
    length: the adaptive policy's serving is tests/test_serving.py's, in process)."""
    target, draft = tiny_pair
    prompts = ["w1 w2 w3 w4 w5 w6", "w7 w8 w9", "w10 w11 w12 w13"]
    args = ["--target", target, "--draft", draft, "--method", "domino", "--no-chat",
            "--max-new-tokens", "10", "--draft-length", "4", "--slots", "2", "--compare-ar",
            "--json"]
    for text in prompts:
        args += ["--prompt", text]
    run = _run_cli(args)
    assert run.returncode == 0, run.stderr
    record = json.loads(run.stdout)
    assert [o["prompt"] for o in record["outputs"]] == prompts
    domino, ar = record["methods"]
    assert (domino["method"], ar["method"]) == ("domino", "ar")
    assert domino["identical_to_ar"] is True and domino["speedup_over_ar"] > 0
    assert "serving domino (3 prompts through 2 slots" in run.stderr
    bad = _run_cli(args[:-4] + ["--slots", "0"])
    assert bad.returncode == 2 and "--slots must be >= 1, got 0" in bad.stderr


def _emit(name: str, message: str) -> str:
    """What a record on logger ``name`` writes to a stderr handler on the root."""
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logging.root.addHandler(handler)
    try:
        logger = logging.getLogger(name)
        propagate, logger.propagate = logger.propagate, True
        logger.warning(message)
        logger.propagate = propagate
    finally:
        logging.root.removeHandler(handler)
    return buf.getvalue()


def test_setup_logging_drops_only_the_two_notices():
    try:
        setup_logging(0)
        assert _emit("transformers", TORCH_NOTICE + ". Models won't be available") == ""
        assert _emit("jax._src.xla_bridge", TPU_PROBE + ": INTERNAL: libtpu.so") == ""
        # real warnings of the same loggers and of ours still show
        assert "slow tokenizer" in _emit("transformers", "slow tokenizer")
        assert "CUDA-enabled jaxlib" in _emit("jax._src.xla_bridge", "CUDA-enabled jaxlib")
        assert logging.getLogger("domino_jax.decode").isEnabledFor(logging.INFO)
        setup_logging(1)                                   # -v: nothing dropped
        assert TORCH_NOTICE in _emit("transformers", TORCH_NOTICE)
        assert TPU_PROBE in _emit("jax._src.xla_bridge", TPU_PROBE)
    finally:
        setup_logging(1)
        logging.getLogger("transformers").setLevel(logging.WARNING)


def test_step_line_and_summary_table():
    buf = io.StringIO()
    with step("compiling", "domino", stream=buf) as note:
        note("cached")
    assert buf.getvalue().startswith("compiling domino ... ") and \
        buf.getvalue().endswith(" s, cached\n")
    buf = io.StringIO()
    with pytest.raises(RuntimeError), step("loading", stream=buf):
        raise RuntimeError("x")
    assert buf.getvalue() == "loading ... failed\n"
    rows = [dict(method="domino", new_tokens=32, rounds=10, tau=3.2, tokens_per_second=120.0,
                 speedup_over_ar=2.5, identical_to_ar=False),
            dict(method="ar", new_tokens=32, rounds=32, tau=1.0, tokens_per_second=48.0)]
    table = summary_table(rows, temperature=1.0).splitlines()
    assert table[1].split()[:6] == ["domino", "32", "10", "3.20", "120.0", "2.50x"]
    assert table[1].endswith("differs from AR (expected at T > 0)")
    assert table[2].split() == ["ar", "32", "32", "1.00", "48.0", "1.00x", "-", "reference"]
    plain = summary_table(rows[1:]).splitlines()
    assert plain[0].split() == ["method", "tokens", "rounds", "tau", "tok/s", "verify", "widths"]
    rows[0]["verify_widths"] = {"1": 7, "3": 3}                # an adaptive run's histogram
    assert summary_table(rows).splitlines()[1].split()[6:8] == ["1:7", "3:3"]


def test_train_bar_postfix():
    from domino_jax.console import train_postfix

    m = dict(loss=2.34567, acc_mean=0.41234, acc=[None, 0.6, 0.3], tokens_per_second=1234.4,
             **{"lambda": 0.5})
    assert train_postfix(m) == dict(loss="2.346", acc="0.412", acc1="0.600", tok_s="1234",
                                    lam="0.50")
    assert train_postfix(dict(m, acc=[1.0]), heldout_tau=3.14159)["tau"] == "3.14"
    assert "acc1" not in train_postfix(dict(m, acc=[1.0]))
