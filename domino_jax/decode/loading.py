"""Loading what decoding needs: target + drafter (checked to fit, each config read once),
in the decode layouts, and the embedded defaults.

The embedded default is the converted SmolLM2-135M-Instruct target (``demo_model``) and,
when it ships with the package, our trained Domino drafter for it in
``domino_jax/assets/smollm2-domino/`` (HF ``DFlashDraftModel`` format). The tokenizer,
prompt encoding and stop tokens live in :mod:`domino_jax.text`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from converters.hf_draft import load_draft
from converters.hf_target import load_target
from domino_jax.config import ConfigError, DraftConfig, TargetConfig, check_draft_fits_target
from domino_jax.decode.methods import drafter_class, make_drafter, method_options
from domino_jax.demo_model import demo_target_dir
from domino_jax.models.domino_head import decode_head
from domino_jax.models.fused_layout import fuse_model
from domino_jax.models.qwen3 import TargetLM
from domino_jax.pallas import check_attention_implementation, head_kernels
# the text functions decoding uses (their home: domino_jax.text), re-exported
from domino_jax.text import encode_prompt, load_tokenizer, stop_token_ids  # noqa: F401

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
DEMO_DRAFT_DIR = os.path.join(ASSETS, "smollm2-domino")


def default_models(target: str | None, draft: str | None) -> tuple[str, str | None]:
    """``(target_dir, draft_dir)``: the demo pair when no target is given."""
    if target is None:
        target = demo_target_dir()
        if draft is None and os.path.exists(os.path.join(DEMO_DRAFT_DIR, "config.json")):
            draft = DEMO_DRAFT_DIR
    for name, path in (("--target", target), ("--draft", draft)):
        if path is not None and not os.path.isdir(path):
            raise FileNotFoundError(f"{name} {path!r} is not a folder (expected an HF "
                                    "checkpoint folder with config.json)")
    return target, draft


def load_pair(target_dir: str, draft_dir: str | None, method: str, dtype=jnp.bfloat16,
              fused: bool = True, head_input_table: bool = True, attention: str = "xla",
              options: Any = None, **option_values):
    """``(target_module, target_params, drafter, draft_params | None)`` for ``method``.

    ``options``: the method's options dataclass (:mod:`domino_jax.decode.methods`; e.g.
    ``DominoOptions(head_topm=64)``, ``DominoTreeOptions(budget=8)``), or give its fields
    as keywords (``head_topm=64``, ``budget=8``); an option the method does not take raises
    ``ValueError``. Methods that need no checkpoint (``ar``, ``ngram``) take no
    ``draft_dir`` (``ValueError``); for them the drafter returned is built from the options
    alone.

    ``fused`` (default): both models in the decode layout (q/k/v and gate/up kernels
    concatenated, :mod:`domino_jax.models.fused_layout`); ``False`` keeps the checkpoint's
    layout (the same outputs, slower one-row products). With ``fused``, a method with a
    Domino head (``domino``, ``dominotree``) gets the head as a
    :class:`~domino_jax.models.domino_head.DecodeHead`: ``[W_hh | W1_s]`` in one kernel and,
    unless ``head_input_table=False``, the ``[V, 3G]`` float32 GRU input table (``12 V G``
    bytes: 1.87 GB for a Qwen3-8B Domino head, 151 MB for the SmolLM2 demo drafter).

    ``attention``: how both models attend over their KV caches
    (:func:`domino_jax.models.layers.attend`; ``"pallas"`` / ``"auto"``: the split-K Pallas
    kernel on a GPU; not the default). The Domino head's steps and DominoTree's depth steps
    have their own switch, the option ``head_kernels`` (``head_kernels="pallas"``: the fused
    Pallas kernels, :mod:`domino_jax.pallas.head_kernels`; they need the input table).

    Each ``config.json`` is read once; the drafter is checked against the target (hidden
    size, vocab, layer ids, mask id) before any weights are read.
    """
    cls = drafter_class(method)
    options = method_options(method, options, **option_values)
    check_attention_implementation(attention)
    if cls.needs_head:
        head_kernels.check_request(options.head_kernels, fused and head_input_table)
    if not cls.needs_checkpoint and draft_dir is not None:
        raise ValueError(f"method {method!r} uses no drafter checkpoint; got draft "
                         f"{draft_dir!r}")
    if cls.needs_checkpoint and draft_dir is None:
        raise ValueError(f"method {method!r} needs a drafter: pass --draft DIR")
    target_config = TargetConfig.from_path(target_dir)
    draft_config = None
    if draft_dir is not None:
        draft_config = DraftConfig.from_path(draft_dir)
        try:
            check_draft_fits_target(draft_config, target_config)
        except ConfigError as e:
            raise ConfigError(f"{draft_dir} vs {target_dir}: {e}") from e
    target_config, target_params = load_target(target_dir, dtype, config=target_config)
    if fused:
        target_config, target_params = fuse_model(target_config, target_params)
    target = TargetLM(target_config, dtype=dtype, param_dtype=dtype, attention_impl=attention)
    draft_params = None
    if draft_dir is not None:
        draft_config, draft_params = load_draft(draft_dir, dtype, config=draft_config)
        draft_config, draft_params = draft_decode_layout(
            draft_config, draft_params, target_params, method, fused, head_input_table)
    draft_vocab = getattr(options, "draft_vocab", 0)
    if draft_vocab == "auto":
        draft_vocab = auto_draft_vocab(draft_dir)
        options = dataclasses.replace(options, draft_vocab=draft_vocab)
    if draft_vocab:
        draft_params = dict(draft_params, vocab=draft_vocab_params(
            target_config, target_params, read_draft_vocab(draft_dir, draft_vocab,
                                                           target_config.vocab_size)))
    drafter = make_drafter(draft_config, target, method, options)
    return target, target_params, drafter, draft_params


DRAFT_VOCAB_FILE = "draft_vocab.npy"
CPU_DRAFT_VOCAB = 8192       # draft_vocab "auto" on a CPU (docs/design.md §32)


def auto_draft_vocab(draft_dir: str) -> int:
    """``draft_vocab="auto"``: :data:`CPU_DRAFT_VOCAB` tokens on a CPU when ``draft_dir`` has
    a ranking of more tokens than that, else 0 (the whole vocabulary)."""
    import jax

    path = os.path.join(draft_dir, DRAFT_VOCAB_FILE)
    if jax.default_backend() != "cpu" or not os.path.isfile(path):
        return 0
    return CPU_DRAFT_VOCAB if len(np.load(path, mmap_mode="r")) > CPU_DRAFT_VOCAB else 0


def read_draft_vocab(draft_dir: str, size: int, vocab_size: int) -> np.ndarray:
    """The ``size`` most frequent tokens of ``draft_dir``'s ranking (``draft_vocab.npy``:
    token ids, most frequent first; :mod:`domino_jax.train.draft_vocab`), sorted: int32
    ``[size]``. Raises ``FileNotFoundError`` / ``ValueError`` naming the file."""
    path = os.path.join(draft_dir, DRAFT_VOCAB_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--draft-vocab {size}: {path} is missing (rank the tokens "
                                "with python -m domino_jax.train.draft_vocab)")
    ranking = np.load(path)
    if ranking.ndim != 1 or not np.issubdtype(ranking.dtype, np.integer):
        raise ValueError(f"{path}: expected a 1-D array of token ids, got {ranking.dtype} "
                         f"{ranking.shape}")
    if len(np.unique(ranking)) != len(ranking) or ranking.min() < 0 or (
            ranking.max() >= vocab_size):
        raise ValueError(f"{path}: token ids must be distinct and in [0, {vocab_size})")
    if not 1 <= size <= len(ranking):
        raise ValueError(f"--draft-vocab {size}: {path} ranks {len(ranking)} tokens")
    return np.sort(ranking[:size]).astype(np.int32)


def draft_vocab_params(target_config, target_params, ids: np.ndarray) -> dict:
    """The params' ``vocab`` entry for ``BlockOptions.draft_vocab``: ``ids [N]`` and the
    target's LM-head rows of those tokens ``[N, H]`` (its embedding rows when tied)."""
    ids = jnp.asarray(ids, jnp.int32)
    if target_config.tie_word_embeddings:
        rows = target_params["embed_tokens"]["embedding"][ids]
    else:
        rows = target_params["lm_head"]["kernel"][:, ids].T
    return {"ids": ids, "lm_rows": rows}


def draft_decode_layout(draft_config: DraftConfig, draft_params, target_params, method: str,
                        fused: bool = True, head_input_table: bool = True):
    """``(draft_config, draft_params)`` as :func:`load_pair` decodes with them: fused
    projections and, for a method with a Domino head on a Domino checkpoint, the head as a
    :class:`~domino_jax.models.domino_head.DecodeHead` (``target_params`` in the layout the
    target decodes with; only its embedding table is read). ``fused=False`` returns the
    inputs unchanged. Also what the training loop's held-out evaluation builds from the
    current params."""
    if not fused:
        return draft_config, draft_params
    draft_config, draft_params = fuse_model(draft_config, draft_params)
    if "head" in draft_params and drafter_class(method).needs_head:
        draft_params = dict(draft_params, head=decode_head(
            draft_params["head"], target_params["embed_tokens"]["embedding"],
            input_table=head_input_table))
    return draft_config, draft_params
