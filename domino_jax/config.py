"""Frozen, typed configs built from a checkpoint's raw ``config.json``.

We never depend on transformers' config classes (their fields move between versions, e.g.
``rope_theta`` moved under ``rope_parameters`` in v5). Every field that changes the math is
read here; a feature we do not implement raises :class:`ConfigError` naming the field.

* :class:`TargetConfig`: Qwen3 (q/k RMSNorm), Llama family incl. SmolLM2 (no q/k norm),
  Qwen2 (q/k/v bias).
* :class:`DraftConfig`: DFlash backbone + optional Domino head (see ``models/dflash.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any


class ConfigError(ValueError):
    """A checkpoint config we cannot honour; the message names the file and field."""


# architectures -> (qk_norm, qkv_bias)
_TARGET_ARCHS = {
    "Qwen3ForCausalLM": ("qwen3", True, False),
    "LlamaForCausalLM": ("llama", False, False),
    "Qwen2ForCausalLM": ("qwen2", False, True),
}
_MODEL_TYPES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def read_config_json(path: str) -> dict[str, Any]:
    """Read ``config.json`` from a checkpoint folder (or the file itself)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise ConfigError(f"no config.json at {file!r} (is {path!r} a checkpoint folder?)")
    with open(file) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file}: not valid JSON ({e})") from e


def _rope_theta(raw: dict[str, Any], where: str) -> float:
    """RoPE base from the v4 (``rope_theta``/``rope_scaling``) or v5 (``rope_parameters``) layout."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    theta = raw.get("rope_theta")
    if isinstance(params, dict):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ("default", None):
            raise ConfigError(f"{where}: rope_parameters.rope_type={rope_type!r} is not supported "
                              "(only the default RoPE is implemented)")
        theta = params.get("rope_theta", theta)
    if isinstance(scaling, dict):
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ("default", None):
            raise ConfigError(f"{where}: rope_scaling.rope_type={rope_type!r} is not supported "
                              "(only the default RoPE is implemented)")
    if theta is None:
        theta = 10000.0
    return float(theta)


def _require(raw: dict[str, Any], key: str, where: str):
    if key not in raw or raw[key] is None:
        raise ConfigError(f"{where}: missing required field {key!r}")
    return raw[key]


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """The target LM's geometry. ``layers`` are decoder layers; taps are HF-indexed."""

    architecture: str            # "qwen3" | "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    tie_word_embeddings: bool = False
    qk_norm: bool = True
    qkv_bias: bool = False
    max_position_embeddings: int = 40960
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], where: str = "config.json") -> "TargetConfig":
        archs = raw.get("architectures") or []
        arch_name = next((a for a in archs if a in _TARGET_ARCHS), None)
        if arch_name is None:
            arch_name = _MODEL_TYPES.get(raw.get("model_type", ""))
        if arch_name is None:
            raise ConfigError(
                f"{where}: unknown architecture {archs or raw.get('model_type')!r}; supported: "
                f"{sorted(_TARGET_ARCHS)}")
        arch, qk_norm, qkv_bias = _TARGET_ARCHS[arch_name]
        if raw.get("attention_bias") and arch != "qwen2":
            raise ConfigError(f"{where}: attention_bias=true is not supported for {arch_name}")
        for moe_key in ("num_experts", "num_local_experts", "moe_intermediate_size"):
            if raw.get(moe_key):
                raise ConfigError(f"{where}: {moe_key}={raw[moe_key]!r}: mixture-of-experts "
                                  "targets are not supported")
        if raw.get("use_sliding_window") or (raw.get("sliding_window") and arch == "llama"):
            raise ConfigError(f"{where}: sliding_window={raw.get('sliding_window')!r} "
                              "(use_sliding_window) is not supported on the target")
        layer_types = raw.get("layer_types")
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise ConfigError(f"{where}: layer_types contains {sorted(set(layer_types))}: only "
                              "'full_attention' layers are supported")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{where}: hidden_act={act!r} is not supported (only 'silu')")
        if raw.get("mlp_bias"):
            raise ConfigError(f"{where}: mlp_bias=true is not supported")
        hidden = int(_require(raw, "hidden_size", where))
        heads = int(_require(raw, "num_attention_heads", where))
        head_dim = raw.get("head_dim") or hidden // heads
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=int(_require(raw, "vocab_size", where)),
            hidden_size=hidden,
            num_layers=int(_require(raw, "num_hidden_layers", where)),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            intermediate_size=int(_require(raw, "intermediate_size", where)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw, where),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qk_norm=qk_norm,
            qkv_bias=qkv_bias,
            max_position_embeddings=int(raw.get("max_position_embeddings", 40960)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_path(cls, path: str) -> "TargetConfig":
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        return cls.from_hf_dict(read_config_json(path), where=file)

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` that transformers (and :meth:`from_hf_dict`) load back."""
        arch_name = {v[0]: k for k, v in _TARGET_ARCHS.items()}[self.architecture]
        raw = {
            "architectures": [arch_name],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
        }
        if self.bos_token_id is not None:
            raw["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            raw["eos_token_id"] = (list(self.eos_token_ids) if len(self.eos_token_ids) > 1
                                   else self.eos_token_ids[0])
        return raw


# Public Qwen3 geometries (algorithms.md §1.1) for eval_shape tests and benchmarks.
QWEN3_8B = TargetConfig("qwen3", 151936, 4096, 36, 32, 8, 128, 12288, 1e-6, 1e6,
                        tie_word_embeddings=False, eos_token_ids=(151645,), bos_token_id=151643)
QWEN3_4B = TargetConfig("qwen3", 151936, 2560, 36, 32, 8, 128, 9728, 1e-6, 1e6,
                        tie_word_embeddings=True, eos_token_ids=(151645,), bos_token_id=151643)
