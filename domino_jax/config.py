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
    partial = raw.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"{where}: partial_rotary_factor={partial!r} is not supported "
                          "(RoPE is applied to the whole head dimension)")
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
    # parameter layout, not architecture: q/k/v and gate/up kernels concatenated (set only
    # by models.fused_layout.fuse_projections; checkpoints on disk are never fused)
    fused_projections: bool = False

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


# Public Qwen3 geometries (docs/algorithms.md §1.1) for eval_shape tests and benchmarks.
QWEN3_8B = TargetConfig("qwen3", 151936, 4096, 36, 32, 8, 128, 12288, 1e-6, 1e6,
                        tie_word_embeddings=False, eos_token_ids=(151645,), bos_token_id=151643)
QWEN3_4B = TargetConfig("qwen3", 151936, 2560, 36, 32, 8, 128, 9728, 1e-6, 1e6,
                        tie_word_embeddings=True, eos_token_ids=(151645,), bos_token_id=151643)


# --------------------------------------------------------------------------- draft config

_PROJECTOR_ALIASES = {"causal_v5": "domino", "domino": "domino"}


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Reference rule for the tapped target layers (docs/algorithms.md §2.2).

    ``[n_target // 2]`` for one draft layer, else ``round(1 + i * (n_target - 4) / (n - 1))``
    (Python's banker's rounding, as the reference). ``(36, 5) -> (1, 9, 17, 25, 33)``.
    """
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = (num_target_layers - 4) / (num_draft_layers - 1)
    return tuple(int(round(1 + i * span)) for i in range(num_draft_layers))


FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


def _draft_layer_types(raw: dict[str, Any], num_layers: int, where: str
                       ) -> tuple[tuple[str, ...], int | None]:
    """``(layer_types, sliding_window)`` of a draft config, read as transformers' Qwen3Config
    and SpecForge's DFlash read them: ``sliding_window`` counts only with
    ``use_sliding_window``; without ``layer_types`` the layers from ``max_window_layers`` on
    slide. All-full layouts come back as ``()`` (the default)."""
    use_window = bool(raw.get("use_sliding_window", False))
    window = raw.get("sliding_window") if use_window else None
    layer_types = raw.get("layer_types")
    if layer_types is None:
        first = int(raw.get("max_window_layers", 28))
        layer_types = [SLIDING_ATTENTION if window is not None and i >= first
                       else FULL_ATTENTION for i in range(num_layers)]
    layer_types = tuple(layer_types)
    if len(layer_types) != num_layers:
        raise ConfigError(f"{where}: layer_types has {len(layer_types)} entries for "
                          f"num_hidden_layers={num_layers}")
    unknown = sorted(set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown:
        raise ConfigError(f"{where}: layer_types contains {unknown}: only 'full_attention' "
                          "and 'sliding_attention' draft layers are supported")
    if SLIDING_ATTENTION not in layer_types:
        return (), None
    if window is None or int(window) <= 0:
        raise ConfigError(f"{where}: 'sliding_attention' layers need use_sliding_window=true "
                          f"and a positive sliding_window (got use_sliding_window="
                          f"{raw.get('use_sliding_window')!r}, sliding_window="
                          f"{raw.get('sliding_window')!r})")
    return layer_types, int(window)


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """A DFlash drafter (block backbone) with an optional Domino head (GRU + correction).

    The backbone's decoder layers are Qwen3 layers (q/k RMSNorm, no biases). The drafter
    borrows the target's embedding and LM head; ``vocab_size`` must equal the target's.
    Domino fields (``emb_dim``, ``gru_hidden_dim``, ``shift_label``, ``pure_draft_prefix_len``)
    only matter when ``projector_type == "domino"``.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960
    projector_type: str | None = None   # None: plain DFlash; "domino": GRU head
    pure_draft_prefix_len: int = 1      # P
    shift_label: bool = False           # released Domino: True; DFlash: False
    emb_dim: int = 0                    # E (Domino only)
    gru_hidden_dim: int = 0             # G (Domino only)
    fused_projections: bool = False     # parameter layout (see TargetConfig)
    # SpecForge's sliding-window draft layers: () = every layer "full_attention"; else one
    # "full_attention" / "sliding_attention" per layer, the sliding ones reading the last
    # ``sliding_window`` positions (causal inside the block, see models.dflash)
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of draft layer ``layer`` (``None``: full attention)."""
        if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @property
    def has_domino_head(self) -> bool:
        return self.projector_type == "domino"

    @property
    def k_draft(self) -> int:
        """Number of draft positions per block: ``B`` (shift_label) or ``B - 1``."""
        return self.block_size if self.shift_label else self.block_size - 1

    @property
    def suffix_start(self) -> int:
        """First *block slot* whose logits the head corrects: ``P`` or ``1 + P``."""
        return self.pure_draft_prefix_len if self.shift_label else 1 + self.pure_draft_prefix_len

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], where: str = "config.json") -> "DraftConfig":
        """Parse a released DFlash / Domino draft ``config.json`` (docs/algorithms.md §2.1,
        §3.1)."""
        dflash = dict(raw.get("dflash_config") or {})
        if raw.get("attention_bias"):
            raise ConfigError(f"{where}: attention_bias=true is not supported for the drafter")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{where}: hidden_act={act!r} is not supported (only 'silu')")
        block_size = raw.get("block_size", dflash.get("block_size"))
        if block_size is None:
            raise ConfigError(f"{where}: missing required field 'block_size' (top level or "
                              "dflash_config.block_size)")
        block_size = int(block_size)
        if block_size < 2:
            raise ConfigError(f"{where}: block_size={block_size} must be at least 2")
        num_layers = int(_require(raw, "num_hidden_layers", where))
        layer_types, sliding_window = _draft_layer_types(raw, num_layers, where)
        num_target_layers = int(_require(raw, "num_target_layers", where))
        mask_token_id = dflash.get("mask_token_id", raw.get("mask_token_id"))
        if mask_token_id is None:
            raise ConfigError(f"{where}: missing required field 'dflash_config.mask_token_id'")
        ids = dflash.get("target_layer_ids")
        ids = (tuple(int(i) for i in ids) if ids is not None
               else build_target_layer_ids(num_target_layers, num_layers))
        if not ids:
            raise ConfigError(f"{where}: dflash_config.target_layer_ids is empty")
        projector = dflash.get("projector_type", raw.get("projector_type"))
        if projector in (None, "", "none", "dflash"):
            projector = "domino" if "DominoDraftModel" in (raw.get("architectures") or []) else None
        elif projector in _PROJECTOR_ALIASES:
            projector = _PROJECTOR_ALIASES[projector]
        else:
            raise ConfigError(f"{where}: dflash_config.projector_type={projector!r} is not "
                              f"supported (known: 'domino', legacy alias 'causal_v5')")
        for key in ("emb_dim", "gru_hidden_dim"):      # top-level copies (official loader)
            if dflash.get(key) is None and raw.get(key) is not None:
                dflash[key] = raw[key]
        emb_dim = int(dflash.get("emb_dim") or 0)
        gru_dim = int(dflash.get("gru_hidden_dim") or emb_dim)
        for key in ("bias_gate", "bias_norm"):
            if dflash.get(key):
                raise ConfigError(f"{where}: dflash_config.{key}=true is not supported "
                                  "(absent from the released model class)")
        prefix_len = int(dflash.get("pure_draft_prefix_len", 1))
        shift_label = bool(dflash.get("shift_label", projector == "domino"))
        if projector == "domino":
            if emb_dim <= 0:
                raise ConfigError(f"{where}: Domino head needs dflash_config.emb_dim (or a "
                                  "top-level emb_dim)")
            if prefix_len < 0:
                raise ConfigError(f"{where}: pure_draft_prefix_len={prefix_len} must be >= 0")
        hidden = int(_require(raw, "hidden_size", where))
        heads = int(_require(raw, "num_attention_heads", where))
        cfg = cls(
            vocab_size=int(_require(raw, "vocab_size", where)),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(_require(raw, "intermediate_size", where)),
            block_size=block_size,
            num_target_layers=num_target_layers,
            mask_token_id=int(mask_token_id),
            target_layer_ids=ids,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw, where),
            max_position_embeddings=int(raw.get("max_position_embeddings", 40960)),
            projector_type=projector,
            pure_draft_prefix_len=prefix_len,
            shift_label=shift_label,
            emb_dim=emb_dim if projector else 0,
            gru_hidden_dim=gru_dim if projector else 0,
            layer_types=layer_types,
            sliding_window=sliding_window,
        )
        if cfg.has_domino_head and cfg.k_draft <= cfg.pure_draft_prefix_len:
            raise ConfigError(f"{where}: pure_draft_prefix_len={prefix_len} leaves no corrected "
                              f"position in a block of {cfg.k_draft} drafts")
        return cfg

    @classmethod
    def from_path(cls, path: str) -> "DraftConfig":
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        return cls.from_hf_dict(read_config_json(path), where=file)

    def to_hf_dict(self) -> dict[str, Any]:
        """``config.json`` in the released format (``DFlashDraftModel``, block_size top level)."""
        dflash: dict[str, Any] = {"mask_token_id": self.mask_token_id,
                                  "target_layer_ids": list(self.target_layer_ids)}
        if self.has_domino_head:
            dflash.update(projector_type="domino", pure_draft_prefix_len=self.pure_draft_prefix_len,
                          shift_label=self.shift_label, emb_dim=self.emb_dim,
                          gru_hidden_dim=self.gru_hidden_dim)
        elif self.shift_label:
            dflash["shift_label"] = True
        raw: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"],
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "model_type": "qwen3",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": dflash,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "layer_types": list(self.layer_types) or [FULL_ATTENTION] * self.num_layers,
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "hidden_act": "silu",
        }
        if self.has_domino_head:
            raw["emb_dim"] = self.emb_dim
        return raw


def check_draft_fits_target(draft: DraftConfig, target: TargetConfig) -> None:
    """Raise :class:`ConfigError` naming the first mismatch between a drafter and a target."""
    problems = []
    if draft.hidden_size != target.hidden_size:
        problems.append(f"draft hidden_size {draft.hidden_size} != target hidden_size "
                        f"{target.hidden_size}")
    if draft.vocab_size != target.vocab_size:
        problems.append(f"draft vocab_size {draft.vocab_size} != target vocab_size "
                        f"{target.vocab_size}")
    if draft.num_target_layers != target.num_layers:
        problems.append(f"draft num_target_layers {draft.num_target_layers} != target "
                        f"num_hidden_layers {target.num_layers}")
    bad_ids = [i for i in draft.target_layer_ids if not 0 <= i < target.num_layers]
    if bad_ids:
        problems.append(f"target_layer_ids {list(draft.target_layer_ids)}: {bad_ids} past the "
                        f"last target layer {target.num_layers - 1}")
    if not 0 <= draft.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {draft.mask_token_id} outside the target embedding "
                        f"(vocab_size {target.vocab_size})")
    if problems:
        raise ConfigError("draft does not fit the target: " + "; ".join(problems))


# Public drafter geometries (docs/algorithms.md §2.1, §3.1).
QWEN3_8B_DOMINO_DRAFT = DraftConfig(
    vocab_size=151936, hidden_size=4096, num_layers=5, num_heads=32, num_kv_heads=8,
    head_dim=128, intermediate_size=12288, block_size=16, num_target_layers=36,
    mask_token_id=151669, target_layer_ids=(1, 9, 17, 25, 33), projector_type="domino",
    pure_draft_prefix_len=1, shift_label=True, emb_dim=256, gru_hidden_dim=1024)
