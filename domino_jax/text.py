"""Text in and out of the models, one home for decoding, training data and benchmarks: the
tokenizer loader, the prompt encoder and the stop-token rule.

Thinking mode (Qwen3 chat templates read ``enable_thinking``): **off** everywhere, the
default of :func:`encode_prompt`. The reference DFlash / Domino drafters for Qwen3 were
trained on answers without thinking traces and every reference benchmark encodes with
``enable_thinking=False``; a drafter must be trained on the template it decodes with, so
training data (``domino_jax.train.data``), the decode CLI and the benchmarks all encode
through this one function. Templates without the variable (SmolLM2, Llama) ignore it.
"""

from __future__ import annotations

import os
from typing import Iterable

# files that hold a tokenizer's vocabulary (fast, sentencepiece, BPE, WordPiece)
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def load_tokenizer(folder: str):
    """The tokenizer (with its chat template) of a checkpoint folder, via transformers.

    Raises ``FileNotFoundError`` naming the folder and the expected files when it holds no
    vocabulary (transformers would otherwise build an empty tokenizer from ``config.json``
    alone, and every prompt would encode to nothing), or when transformers cannot load it.
    """
    from transformers import AutoTokenizer

    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder!r} is not a folder (expected a checkpoint folder "
                                "with its tokenizer files)")
    if not any(os.path.exists(os.path.join(folder, f)) for f in VOCAB_FILES):
        raise FileNotFoundError(f"{folder}: no tokenizer (none of {', '.join(VOCAB_FILES)}); "
                                "copy the model's tokenizer files into the folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError) as e:
        raise FileNotFoundError(f"{folder}: no usable tokenizer: {e}") from e
    if len(tokenizer) < 2:
        raise FileNotFoundError(f"{folder}: the tokenizer has an empty vocabulary "
                                f"({len(tokenizer)} tokens)")
    return tokenizer


def encode_prompt(tokenizer, text: str, chat: bool = True, thinking: bool = False) -> list[int]:
    """Token ids of one user prompt.

    ``chat`` (default) and a tokenizer with a chat template: the template over one user
    message with the generation prompt added and ``enable_thinking=thinking`` (off by
    default, see the module doc); else the raw text (special tokens as the tokenizer adds
    them).
    """
    if chat and getattr(tokenizer, "chat_template", None):
        return encode_chat(tokenizer, [{"role": "user", "content": text}], thinking)
    return [int(t) for t in tokenizer.encode(text)]


def encode_chat(tokenizer, messages: list[dict], thinking: bool = False) -> list[int]:
    """Token ids of a conversation (``[{"role": ..., "content": ...}, ...]``) through the
    tokenizer's chat template, with the generation prompt added and
    ``enable_thinking=thinking``. ``ValueError`` when the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        enable_thinking=thinking)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def stop_token_ids(tokenizer, target_config=None, extra: Iterable[int] = ()) -> tuple[int, ...]:
    """The stop tokens: the target config's ``eos_token_id`` (all of them), the
    tokenizer's eos token and ``extra`` (e.g. the CLI's ``--stop-id``), sorted."""
    ids = set(getattr(target_config, "eos_token_ids", ()) or ())
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    ids.update(int(i) for i in extra)
    return tuple(sorted(ids))
