"""What one training step costs: matmul FLOPs and HBM bytes per part, and the step time and
MFU they predict on a device (a roofline: each part takes ``max(flops / peak, bytes / bw)``).

    parts = step_cost(train_config, draft_config, target_config, seq_len)
    pred = predict_step(parts, peak_flops=989e12, bandwidth=4.8e12)   # peak bf16 FLOP/s, HBM bytes/s
    pred["step_s"], pred["mfu"], pred["parts"]

Counts are for the whole step (``batch_size`` sequences of ``seq_len`` tokens, all
micro-batches), as this implementation executes it:

* FLOPs are the matmuls as run, 2 per multiply-add: the frozen target's forward (2x),
  trained drafter weights forward + backward (6x), frozen weights that need only the
  input gradient (the target's LM head on the draft rows: 4x), weights whose input needs no
  gradient (``fc`` on the frozen taps: 4x). Attention is dense (every query against all
  ``S + N*Bk`` keys, masked; the target's causal ``S x S``), since that is what runs. These
  FLOPs are the MFU numerator (``model_flops`` in :mod:`domino_jax.train.step`).
* Bytes are an estimate of HBM traffic with the assumptions in :data:`BYTES` (XLA fuses
  elementwise chains into the producing or consuming kernel; attention scores and the
  ``[rows, V]`` logits are materialised in float32; the drafter's float32 masters, gradients
  and AdamW moments stream through once per step).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from domino_jax.config import DraftConfig, TargetConfig

# Assumed HBM bytes per element (see the module docstring); ``act`` is the compute dtype.
BYTES = {
    "layer_act_fwd": (16, 5),   # per token and layer: 16*H + 5*I activations read/written
    "score_fwd": 12,            # per attention score: f32 write + read, probs write + read
    "score_fwd_bwd": 28,        # the same plus the backward (dP, dS, two products)
    "logits_fwd_bwd": 16,       # per [rows, V] logit of the base LM head, fwd + bwd + argmax
    "domino_logits": 32,        # the correction and final logits ([rows, V]) fwd + bwd
    "soft_logits": 12,          # target logits + log-softmax per soft-label element
    "soft_per_term": 8,         # each KL term re-reads the target log-probs and draft logits
    "param_train": 14,          # f32 master -> bf16 cast, fwd + bwd reads, f32 grad write
    "optimizer": 48,            # grad accumulate, clip, AdamW read p,g,m,v write p,m,v (f32)
}


@dataclasses.dataclass(frozen=True)
class CostPart:
    name: str
    flops: float     # matmul FLOPs
    bytes: float     # estimated HBM bytes


def _layer_params(hidden: int, q_width: int, kv_width: int, intermediate: int) -> int:
    return hidden * (q_width + 2 * kv_width) + q_width * hidden + 3 * hidden * intermediate


def step_cost(cfg, config: DraftConfig, target: TargetConfig, seq_len: int) -> list[CostPart]:
    """The parts of one optimizer step for ``cfg`` (a :class:`TrainConfig`)."""
    act = jnp.dtype(cfg.compute_dtype).itemsize
    b, s = cfg.batch_size, seq_len
    n = max(1, min(cfg.num_anchors, s - 1))
    bk = config.block_size
    rows = b * n * bk                               # draft query rows
    keys = s + n * bk                               # keys per draft query (dense)
    h, v = config.hidden_size, config.vocab_size
    ah, ai = BYTES["layer_act_fwd"]
    parts = []

    # frozen target forward over all b*s tokens
    t_layer = _layer_params(target.hidden_size, target.num_heads * target.head_dim,
                            target.num_kv_heads * target.head_dim, target.intermediate_size)
    t_tokens = b * s
    parts.append(CostPart(
        "target matmuls", 2.0 * t_tokens * t_layer * target.num_layers,
        act * (t_layer * target.num_layers + t_tokens * target.hidden_size
               + t_tokens * target.num_layers * (ah * target.hidden_size
                                                  + ai * target.intermediate_size))))
    t_scores = b * target.num_heads * s * s * target.num_layers
    parts.append(CostPart("target attention", 4.0 * t_scores * target.head_dim,
                          BYTES["score_fwd"] * t_scores))

    # drafter backbone: fc over the taps, context K/V per layer, the block rows
    fc_params = config.num_taps * h * h
    ctx_kv = 2 * h * config.kv_width
    parts.append(CostPart(
        "context fc + K/V", 4.0 * t_tokens * fc_params + 6.0 * t_tokens * ctx_kv * config.num_layers,
        BYTES["param_train"] * fc_params + act * t_tokens * config.num_taps * h
        + 3 * act * t_tokens * h * (1 + 2 * config.num_layers)))
    d_layer = _layer_params(h, config.q_width, config.kv_width, config.intermediate_size)
    parts.append(CostPart(
        "draft matmuls", 6.0 * rows * d_layer * config.num_layers,
        BYTES["param_train"] * d_layer * config.num_layers
        + 3 * act * rows * config.num_layers * (ah * h + ai * config.intermediate_size)))
    d_scores = rows * config.num_heads * keys * config.num_layers
    parts.append(CostPart("draft attention", 12.0 * d_scores * config.head_dim,
                          BYTES["score_fwd_bwd"] * d_scores + 2 * rows * keys * config.num_layers))

    # target LM head on the draft rows (frozen: forward + input gradient)
    parts.append(CostPart("LM head (draft rows)", 4.0 * rows * h * v,
                          2 * act * h * v + BYTES["logits_fwd_bwd"] * rows * v))
    head_params = 0
    if config.has_domino_head:
        g, e = config.gru_hidden_dim, config.emb_dim
        head_params = 3 * g * (h + g) + e * (h + g) + e * v
        parts.append(CostPart("Domino head", 6.0 * rows * head_params,
                              BYTES["param_train"] * head_params
                              + BYTES["domino_logits"] * rows * v))
    if cfg.soft_label_weight > 0.0:
        terms = 2 if config.has_domino_head else 1
        parts.append(CostPart("soft labels (target logits)", 2.0 * rows * h * v,
                              act * h * v + (BYTES["soft_logits"]
                                             + terms * BYTES["soft_per_term"]) * rows * v))
    draft_params = fc_params + config.num_layers * (d_layer + 2 * h) + 2 * h + head_params
    parts.append(CostPart("optimizer", 0.0,
                          (BYTES["optimizer"] + 16 * (cfg.micro_batches - 1)) * draft_params))
    return parts


def step_flops(cfg, config: DraftConfig, target: TargetConfig, seq_len: int) -> float:
    """Matmul FLOPs of one step (the MFU numerator)."""
    return float(sum(p.flops for p in step_cost(cfg, config, target, seq_len)))


def predict_step(parts: list[CostPart], peak_flops: float, bandwidth: float) -> dict:
    """Roofline prediction: each part takes ``max(flops / peak_flops, bytes / bandwidth)``,
    parts run one after another. Returns ``step_s``, ``mfu`` (= total FLOPs / (step_s *
    peak)), totals, and per part its times and which bound it hits. A lower bound on the
    step time (an upper bound on MFU): kernels reach a fraction of either peak."""
    out_parts, total = [], 0.0
    for p in parts:
        t_c, t_m = p.flops / peak_flops, p.bytes / bandwidth
        t = max(t_c, t_m)
        total += t
        out_parts.append({"name": p.name, "flops": p.flops, "bytes": p.bytes,
                          "compute_s": t_c, "memory_s": t_m, "time_s": t,
                          "bound": "compute" if t_c >= t_m else "memory"})
    flops = sum(p.flops for p in parts)
    return {"step_s": total, "flops": flops, "bytes": sum(p.bytes for p in parts),
            "mfu": flops / (total * peak_flops) if total > 0 else 0.0,
            "peak_flops": peak_flops, "bandwidth": bandwidth, "parts": out_parts}
