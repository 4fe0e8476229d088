"""One prompt encoder, one stop-token rule, one tokenizer loader (domino_jax/text.py), used by
the decode CLI, the training data and the benchmarks; the thinking-mode decision for Qwen3
chat templates (off everywhere); clear errors for a folder without a tokenizer.

The tokenizer is built inside the test (a word-level ``tokenizers`` model with a chat template
that reads ``enable_thinking`` exactly as Qwen3's does); nothing is downloaded.
"""

from __future__ import annotations

import os

import pytest

from domino_jax.text import encode_prompt, load_tokenizer, stop_token_ids

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "reference")

# The lines of Qwen3's chat template that matter here: the generation prompt, and the empty
# thinking block it adds when enable_thinking is false.
QWEN3_LIKE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
SPECIAL = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def save_tokenizer(folder) -> str:
    """A tiny word-level tokenizer with the Qwen3-like template, saved to ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "user", "assistant", "hello", "world", "why", "is", "the", "sky", "blue"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                                   eos_token="<|im_end|>", additional_special_tokens=SPECIAL[2:],
                                   chat_template=QWEN3_LIKE_TEMPLATE)
    fast.add_special_tokens({"additional_special_tokens": SPECIAL})
    fast.save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(save_tokenizer(tmp_path_factory.mktemp("tok")))


def test_thinking_is_off_by_default(tokenizer):
    """Qwen3 templates: the prompt ends in the empty thinking block (what the drafters are
    trained on); ``thinking=True`` leaves it out; raw text has no template at all."""
    think, end_think = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    start, assistant = tokenizer.convert_tokens_to_ids(["<|im_start|>", "assistant"])
    off = encode_prompt(tokenizer, "why is the sky blue")
    on = encode_prompt(tokenizer, "why is the sky blue", thinking=True)
    assert off[-2:] == [think, end_think] and off[:-2] == on
    assert on[-2:] == [start, assistant]
    assert encode_prompt(tokenizer, "hello world", chat=False) == \
        tokenizer.convert_tokens_to_ids(["hello", "world"])


def test_one_function_everywhere():
    """The training data (``train.data.chat_ids``: also bench_smollm2, tau_smollm2,
    train_smollm2, the shards generator) and the decode CLI (``decode.loading``) use this
    very function (tests/test_shards.py runs the CLI through it)."""
    import domino_jax.decode.loading as loading
    from domino_jax.train import data as data_lib

    assert data_lib.chat_ids is encode_prompt and loading.encode_prompt is encode_prompt
    assert loading.load_tokenizer is load_tokenizer


def test_stop_tokens_one_rule(tokenizer):
    """Every eos id of the target config, the tokenizer's eos and the extra ids."""
    from domino_jax.config import TargetConfig
    from domino_jax.train import data as data_lib

    config = TargetConfig("qwen3", 32, 8, 1, 1, 1, 8, 8, eos_token_ids=(7, 3))
    eos = tokenizer.eos_token_id
    assert stop_token_ids(tokenizer, config) == tuple(sorted({3, 7, eos}))
    assert stop_token_ids(tokenizer, config, extra=[30]) == tuple(sorted({3, 7, eos, 30}))
    assert data_lib.stop_ids_of is stop_token_ids
    assert stop_token_ids(None, None) == ()


def test_folder_without_tokenizer_is_named(tmp_path, capsys):
    """A target folder with config and weights but no tokenizer files: a clear error (the
    library and the CLI, exit 2), not an empty prompt further on."""
    folder = os.path.join(FIX, "dflash", "target")
    with pytest.raises(FileNotFoundError, match="no tokenizer") as err:
        load_tokenizer(folder)
    assert folder in str(err.value)
    with pytest.raises(FileNotFoundError, match="not a folder"):
        load_tokenizer(str(tmp_path / "missing"))
    from domino_jax.decode.__main__ import main

    assert main(["--target", folder]) == 2
    message = capsys.readouterr().err
    assert "no tokenizer" in message and folder in message and "empty" not in message
