"""Loading what the decode CLI needs: target + drafter (checked to fit), tokenizer, defaults.

The embedded default is the converted SmolLM2-135M-Instruct target (``demo_model``) and,
when it ships with the package, our trained Domino drafter for it in
``domino_jax/assets/smollm2-domino/`` (HF ``DFlashDraftModel`` format).
"""

from __future__ import annotations

import os

import jax.numpy as jnp

from domino_jax.config import ConfigError, DraftConfig, TargetConfig, check_draft_fits_target

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
DEMO_DRAFT_DIR = os.path.join(ASSETS, "smollm2-domino")


def default_models(target: str | None, draft: str | None) -> tuple[str, str | None]:
    """``(target_dir, draft_dir)``: the demo pair when no target is given."""
    if target is None:
        from domino_jax.demo_model import demo_target_dir

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
              **drafter_options):
    """``(target_module, target_params, drafter | None, draft_params | None)``.

    ``drafter_options`` are fields of the drafter: ``head_topm`` (Domino chain candidate pool),
    ``budget``, ``node_topk``, ``topm``, ``builder`` (tree methods), ``max_ngram``,
    ``min_ngram``, ``num_tokens``, ``occurrence`` (``ngram``: no checkpoint; ``draft_dir`` must
    be ``None``).

    ``fused`` (default): both models in the decode layout (q/k/v and gate/up kernels
    concatenated, :mod:`domino_jax.models.fused_layout`); ``False`` keeps the checkpoint's
    layout (the same outputs, slower one-row products). With ``fused``, a Domino head (methods
    ``domino``, ``dominotree``) also
    gets its decode leaves (:func:`~domino_jax.models.fused_layout.head_decode_params`):
    ``[W1_s | W_hh]`` in one kernel and, unless ``head_input_table=False``, the ``[V, 3G]``
    float32 GRU input table (``12 V G`` bytes: 1.87 GB for a Qwen3-8B Domino head, 151 MB for
    the SmolLM2 demo drafter).

    ``attention``: how both models attend over their KV caches
    (:func:`domino_jax.models.layers.attend`; ``"pallas"`` / ``"auto"``: the split-K Pallas
    kernel on a GPU, measured in ``benchmarks/NOTES.md`` entry 15; not the default).

    The drafter is checked against the target (hidden size, vocab, layer ids, mask id)
    before any weights are read.
    """
    from converters.hf_draft import load_draft
    from converters.hf_target import load_target
    from domino_jax.models.fused_layout import fuse_model
    from domino_jax.pallas import check_attention_implementation
    from domino_jax.models.qwen3 import TargetLM

    check_attention_implementation(attention)
    if method == "ngram" and draft_dir is not None:
        raise ValueError(f"method 'ngram' (prompt lookup) uses no drafter; got draft "
                         f"{draft_dir!r}")
    target_config = TargetConfig.from_path(target_dir)
    drafter = draft_params = None
    if draft_dir is not None:
        draft_config = DraftConfig.from_path(draft_dir)
        try:
            check_draft_fits_target(draft_config, target_config)
        except ConfigError as e:
            raise ConfigError(f"{draft_dir} vs {target_dir}: {e}") from e
    target_config, target_params = load_target(target_dir, dtype)
    if fused:
        target_config, target_params = fuse_model(target_config, target_params)
    target = TargetLM(target_config, dtype=dtype, param_dtype=dtype, attention_impl=attention)
    if draft_dir is not None:
        draft_config, draft_params = load_draft(draft_dir, dtype)
        draft_config, draft_params = draft_decode_layout(
            draft_config, draft_params, target_params, method, fused, head_input_table)
        drafter = make_drafter(draft_config, target, method, **drafter_options)
    elif method == "ngram":
        from domino_jax.decode.ngram import NgramDrafter

        drafter = NgramDrafter(**drafter_options)
    return target, target_params, drafter, draft_params


def draft_decode_layout(draft_config: DraftConfig, draft_params, target_params, method: str,
                        fused: bool = True, head_input_table: bool = True):
    """``(draft_config, draft_params)`` as :func:`load_pair` decodes with them: fused
    projections and, for ``domino`` / ``dominotree`` on a Domino checkpoint, the head's
    decode leaves (``target_params`` in the layout the target decodes with; only its
    embedding table is read). ``fused=False`` returns the inputs unchanged. Also what the
    training loop's held-out evaluation builds from the current params."""
    from domino_jax.models.fused_layout import fuse_model, head_decode_params

    if not fused:
        return draft_config, draft_params
    draft_config, draft_params = fuse_model(draft_config, draft_params)
    if "head" in draft_params and method in ("domino", "dominotree"):
        draft_params = dict(draft_params, head=head_decode_params(
            draft_params["head"], target_params["embed_tokens"]["embedding"],
            input_table=head_input_table))
    return draft_config, draft_params


def make_drafter(draft_config: DraftConfig, target, method: str, **drafter_options):
    """The drafter for ``method`` on a loaded checkpoint: ``TreeDrafter`` for ``ddtree`` /
    ``dominotree``, else ``ChainDrafter`` (``drafter_options`` as in :func:`load_pair`)."""
    from domino_jax.decode.drafters import ChainDrafter
    from domino_jax.decode.tree_drafter import TreeDrafter

    cls = TreeDrafter if method in ("ddtree", "dominotree") else ChainDrafter
    return cls(draft_config, target, method, **drafter_options)


def load_tokenizer(target_dir: str):
    """The target folder's tokenizer (with its chat template), via transformers."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(target_dir)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"{target_dir}: no usable tokenizer (tokenizer.json / "
                                f"tokenizer_config.json): {e}") from e


def encode_prompt(tokenizer, text: str, chat: bool = True) -> list[int]:
    """The token ids of one user prompt, as every part of domino_jax encodes it (decode CLI,
    self-distillation data, benchmarks): with ``chat`` and a tokenizer that has a chat
    template, the one-turn conversation ``[{"role": "user", "content": text}]`` with the
    generation prompt added and **thinking off** (``enable_thinking=False``: a Qwen3
    template then writes the empty ``<think></think>`` block; templates without the variable
    ignore it); otherwise the raw text (``tokenizer.encode``)."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True,
                                            enable_thinking=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer.encode(text)]


def stop_token_ids(tokenizer, target_config=None, extra=()) -> tuple[int, ...]:
    """Sorted stop ids: the target config's ``eos_token_ids``, the tokenizer's eos, ``extra``."""
    ids = {int(t) for t in extra} | set(getattr(target_config, "eos_token_ids", ()) or ())
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))
