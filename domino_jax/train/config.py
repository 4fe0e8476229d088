"""Training settings (:class:`TrainConfig`) and the drafter geometry we train for a target.

Kept apart from ``domino_jax/config.py`` (checkpoint configs) because these are run
settings, not checkpoint fields.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from domino_jax.config import DraftConfig, TargetConfig, build_target_layer_ids

log = logging.getLogger(__name__)

DRAFTERS = ("dflash", "domino")
LABEL_MODES = ("hard", "soft", "mix")        # CE on data tokens / KL to the target / both
POSITION_WEIGHTS = ("decay", "uniform")      # exp(-k/gamma) (paper, §2.5) / all 1
INIT_FROM_TARGET = ("none", "last", "spread")  # see loss.target_layers_for_init


def default_gamma(block_size: int) -> float:
    """Loss-decay gamma: 7 for block 16, 5 for 10, 4 for 8 (docs/algorithms.md §2.5), else
    ``block_size * 7 / 16`` (at least 1)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size * 7.0 / 16.0))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run (hashable: closed over by the jitted step).

    ``batch_size`` sequences per optimizer step, split into ``micro_batches`` equal
    micro-batches whose gradients are averaged (a ``lax.scan``); each micro-batch's loss is
    normalised by its own sum of decayed weights (docs/algorithms.md §9.12).
    """

    drafter: str = "domino"              # "dflash" | "domino"
    steps: int = 1000
    batch_size: int = 8
    micro_batches: int = 1
    max_length: int = 512
    num_anchors: int = 64
    loss_chunk_rows: int = 4096          # block slots per vocabulary chunk of the loss (0: one)
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float | None = None           # None: default_gamma(block_size)
    lambda_start: float = 1.0            # Domino curriculum (§3.4, §9.11)
    decay_ratio: float = 1.0
    seed: int = 0
    compute_dtype: str = "bfloat16"      # params are float32 masters, cast inside the loss
    checkpoint_every: int = 500
    log_every: int = 10
    mesh_data: int = 1
    mesh_fsdp: int = 1
    mesh_tensor: int = 1
    shard_drafter: bool = False          # fsdp-shard drafter params (else replicated)
    peak_flops: float = 989e12           # per device, for MFU (a dense bf16 peak)
    # recipe options (domino_jax/train/README.md "Recipe options")
    labels: str = "hard"                 # "hard" | "soft" | "mix"
    soft_weight: float = 0.5             # weight of the KL term for labels="mix"
    position_weights: str = "decay"      # "decay" (gamma) | "uniform"
    init_from_target: str = "none"       # "none" (random) | "last" | "spread"
    learned_mask: bool = False           # learn a mask_embedding (not interoperable, §9.15)
    init_draft: str | None = None        # fine-tune: start from this drafter folder (HF format)
    final_logits: str | None = None      # None: one joint matmul; "sum": base + correction
    grow_layers: int | None = None       # grow init_draft to this many layers (train/grow.py)
    grow_gru_hidden_dim: int | None = None   # ... to this GRU width
    grow_emb_dim: int | None = None      # ... to this many correction features

    def __post_init__(self):
        if self.drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {self.drafter!r}; choose one of {DRAFTERS}")
        for name, value, choices in (("labels", self.labels, LABEL_MODES),
                                     ("position_weights", self.position_weights,
                                      POSITION_WEIGHTS),
                                     ("init_from_target", self.init_from_target,
                                      INIT_FROM_TARGET)):
            if value not in choices:
                raise ValueError(f"{name}={value!r}; choose one of {choices}")
        if self.init_draft is not None and (self.init_from_target != "none"
                                            or self.learned_mask):
            raise ValueError(f"init_draft={self.init_draft!r} takes the drafter's geometry, "
                             "weights and mask from that folder: it excludes init_from_target "
                             "and learned_mask")
        grow = {"grow_layers": self.grow_layers, "grow_gru_hidden_dim": self.grow_gru_hidden_dim,
                "grow_emb_dim": self.grow_emb_dim}
        if self.init_draft is None and any(v is not None for v in grow.values()):
            raise ValueError(f"{', '.join(k for k, v in grow.items() if v is not None)}: "
                             "growing needs a trained drafter to grow (init_draft)")
        if self.final_logits not in (None, "sum"):
            raise ValueError(f"final_logits={self.final_logits!r}: None (one joint matmul, "
                             "docs/design.md §30) or 'sum' (base logits plus the correction)")
        if not 0.0 <= self.soft_weight <= 1.0:
            raise ValueError(f"soft_weight={self.soft_weight} must be in [0, 1]")
        if self.batch_size % self.micro_batches:
            raise ValueError(f"batch_size {self.batch_size} is not divisible by "
                             f"micro_batches {self.micro_batches}")
        if self.loss_chunk_rows < 0:
            raise ValueError(f"loss_chunk_rows must be >= 0, got {self.loss_chunk_rows}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.micro_batches

    @property
    def soft_label_weight(self) -> float:
        """Weight of the KL term in the per-slot loss: 0 (hard), 1 (soft), ``soft_weight``
        (mix)."""
        return {"hard": 0.0, "soft": 1.0, "mix": float(self.soft_weight)}[self.labels]


def make_draft_config(target: TargetConfig, drafter: str = "domino", num_layers: int = 2,
                      block_size: int = 16, gru_hidden_dim: int = 256, emb_dim: int = 64,
                      mask_token_id: int | None = None, intermediate_size: int | None = None,
                      shift_label: bool | None = None, pure_draft_prefix_len: int = 1
                      ) -> DraftConfig:
    """A fresh drafter for ``target``: Qwen3 layers of the target's width and head layout,
    ``target_layer_ids`` from the reference rule (§2.2).

    DFlash trains with ``shift_label=False`` (slot k predicts ``x_{a+k}``, what the DFlash
    decode path assumes); Domino with the released ``shift_label=True``, ``P=1`` (§9.1).
    ``mask_token_id=None``: ``vocab_size - 1`` (the tokenizer-free end of
    :func:`default_mask_token_id`; the training loop passes that rule's choice).
    """
    if drafter not in DRAFTERS:
        raise ValueError(f"unknown drafter {drafter!r}; choose one of {DRAFTERS}")
    domino = drafter == "domino"
    return DraftConfig(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size, num_layers=num_layers,
        num_heads=target.num_heads, num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
        intermediate_size=intermediate_size or target.intermediate_size, block_size=block_size,
        num_target_layers=target.num_layers,
        mask_token_id=target.vocab_size - 1 if mask_token_id is None else mask_token_id,
        target_layer_ids=build_target_layer_ids(target.num_layers, num_layers),
        rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
        max_position_embeddings=target.max_position_embeddings,
        projector_type="domino" if domino else None,
        pure_draft_prefix_len=pure_draft_prefix_len,
        shift_label=domino if shift_label is None else shift_label,
        emb_dim=emb_dim if domino else 0, gru_hidden_dim=gru_hidden_dim if domino else 0)


# ----------------------------------------------------------------------------- mask token

_UNUSED_MARKERS = ("reserved", "unused")


def _chat_template_ids(tokenizer) -> set[int]:
    """Token ids a probe conversation renders to with the chat template (empty without one)."""
    if not getattr(tokenizer, "chat_template", None):
        return set()
    probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
             {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
    try:
        ids = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=True)
    except Exception:  # noqa: BLE001  (templates that reject a system turn, etc.)
        ids = tokenizer.apply_chat_template(probe[1:], add_generation_prompt=True,
                                            tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return {int(t) for t in ids}


def default_mask_token_id(vocab_size: int, tokenizer: Any = None) -> tuple[int, str]:
    """The mask token a drafter we train uses by default, and why (docs/algorithms.md §9.15).

    The mask is the target's frozen embedding row ``mask_token_id``, exactly what the
    reference inference code reads, so an exported drafter drafts the same there. First
    match wins:

    1. the tokenizer's ``mask_token`` (if inside the embedding);
    2. the first embedding row past the tokenizer's last id (``len(tokenizer) <
       vocab_size``: a padded vocabulary; for Qwen3 this is 151669, the reference's id);
    3. a special token that chat text never uses: not bos/eos/pad/unk, not produced by the
       chat template on a probe conversation; one named ``reserved``/``unused`` first (lowest
       id), else the highest id (SmolLM2: ``<empty_output>``, 16);
    4. the ``unk`` token, if it is none of bos/eos/pad;
    5. ``vocab_size - 1`` (also the choice without a tokenizer).
    """
    if tokenizer is None:
        return vocab_size - 1, "no tokenizer: vocab_size - 1"
    mask = getattr(tokenizer, "mask_token_id", None)
    if mask is not None and 0 <= int(mask) < vocab_size:
        return int(mask), f"the tokenizer's mask token {tokenizer.mask_token!r}"
    if len(tokenizer) < vocab_size:
        return len(tokenizer), (f"the first embedding row past the tokenizer's {len(tokenizer)} "
                                "tokens")
    roles = {getattr(tokenizer, f"{r}_token_id", None) for r in ("bos", "eos", "pad", "unk")}
    roles = {int(r) for r in roles if r is not None}
    used = _chat_template_ids(tokenizer) | roles
    special = {int(i): str(t) for i, t in
               getattr(tokenizer, "added_tokens_decoder", {}).items()
               if getattr(t, "special", True) and int(i) < vocab_size and int(i) not in used}
    marked = [i for i, t in sorted(special.items())
              if any(m in t.lower() for m in _UNUSED_MARKERS)]
    if marked:
        return marked[0], f"the reserved special token {special[marked[0]]!r}"
    if special:
        top = max(special)
        return top, f"the special token {special[top]!r}, unused by the chat template"
    unk = getattr(tokenizer, "unk_token_id", None)
    others = {getattr(tokenizer, f"{r}_token_id", None) for r in ("bos", "eos", "pad")}
    if unk is not None and unk not in others and 0 <= int(unk) < vocab_size:
        return int(unk), f"the unk token {tokenizer.unk_token!r}"
    return vocab_size - 1, "no spare or unused special token: vocab_size - 1"


def resolve_mask_token_id(target_config: TargetConfig, target_dir: str | None) -> int:
    """:func:`default_mask_token_id` with the tokenizer of ``target_dir`` (when it has one),
    logged with its reason."""
    tokenizer = None
    if target_dir is not None and any(os.path.isfile(os.path.join(target_dir, f)) for f in
                                      ("tokenizer.json", "tokenizer_config.json")):
        from domino_jax.decode.loading import load_tokenizer

        tokenizer = load_tokenizer(target_dir)
    mask, why = default_mask_token_id(target_config.vocab_size, tokenizer)
    log.info("mask_token_id %d: %s", mask, why)
    return mask
