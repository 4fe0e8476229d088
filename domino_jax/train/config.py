"""Training settings (:class:`TrainConfig`) and the drafter geometry we train for a target.

Kept apart from ``domino_jax/config.py`` (checkpoint configs) because these are run
settings, not checkpoint fields.
"""

from __future__ import annotations

import dataclasses

from domino_jax.config import DraftConfig, TargetConfig, build_target_layer_ids

DRAFTERS = ("dflash", "domino")


def default_gamma(block_size: int) -> float:
    """Loss-decay gamma: 7 for block 16, 5 for 10, 4 for 8 (algorithms.md §2.5), else
    ``block_size * 7 / 16`` (at least 1)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size * 7.0 / 16.0))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run (hashable: closed over by the jitted step).

    ``batch_size`` sequences per optimizer step, split into ``micro_batches`` equal
    micro-batches whose gradients are averaged (a ``lax.scan``); each micro-batch's loss is
    normalised by its own sum of decayed weights (algorithms.md §9.12).
    """

    drafter: str = "domino"              # "dflash" | "domino"
    steps: int = 1000
    batch_size: int = 8
    micro_batches: int = 1
    max_length: int = 512
    num_anchors: int = 64
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
    peak_flops: float = 989e12           # per device, for MFU (H200 dense bf16)

    def __post_init__(self):
        if self.drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {self.drafter!r}; choose one of {DRAFTERS}")
        if self.batch_size % self.micro_batches:
            raise ValueError(f"batch_size {self.batch_size} is not divisible by "
                             f"micro_batches {self.micro_batches}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.micro_batches


def make_draft_config(target: TargetConfig, drafter: str = "domino", num_layers: int = 2,
                      block_size: int = 16, gru_hidden_dim: int = 256, emb_dim: int = 64,
                      mask_token_id: int | None = None, intermediate_size: int | None = None,
                      shift_label: bool | None = None, pure_draft_prefix_len: int = 1
                      ) -> DraftConfig:
    """A fresh drafter for ``target``: Qwen3 layers of the target's width and head layout,
    ``target_layer_ids`` from the reference rule (§2.2).

    DFlash trains with ``shift_label=False`` (slot k predicts ``x_{a+k}``, what the DFlash
    decode path assumes); Domino with the released ``shift_label=True``, ``P=1`` (§9.1).
    ``mask_token_id=None`` means the target has no spare row: we record ``vocab_size - 1``
    (any in-vocab id) and the drafter learns its own ``mask_embedding`` (§9.15).
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
