"""Mesh construction and the one table of logical-axis -> mesh-axis rules.

Mesh axes: ``data`` (batch replicas), ``fsdp`` (batch + parameter sharding, ZeRO-3 style),
``tensor`` (Megatron-style model parallelism inside a layer). The same code runs on one
device (every axis of size 1), on 8 simulated CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``) and on a pod.

Arrays are annotated with *logical* axis names (``("embed", "heads")`` for a q kernel) and
:func:`logical_to_mesh` turns them into a :class:`PartitionSpec` through
:data:`LOGICAL_AXIS_RULES`. A dimension whose size is not divisible by the mesh axes it
maps to is replicated instead (so odd vocab sizes or few kv heads never fail).

Target parameters (``models/qwen3.py`` tree):

==============================  ======================  ============================
param                           shape                   logical axes
==============================  ======================  ============================
``embed_tokens/embedding``      ``[V, H]``              ``("vocab", "embed")``
``lm_head/kernel``              ``[H, V]``              ``("embed", "vocab")``
``*/q_proj/kernel``             ``[H, nH*D]``           ``("embed", "heads")``
``*/{k,v}_proj/kernel``         ``[H, nKV*D]``          ``("embed", "kv_heads")``
``*/o_proj/kernel``             ``[nH*D, H]``           ``("heads", "embed")``
``*/q_proj/bias``               ``[nH*D]``              ``("heads",)``
``*/{k,v}_proj/bias``           ``[nKV*D]``             ``("kv_heads",)``
``*/{gate,up}_proj/kernel``     ``[H, I]``              ``("embed", "mlp")``
``*/down_proj/kernel``          ``[I, H]``              ``("mlp", "embed")``
norms (``*/weight``)            ``[H]`` or ``[D]``      replicated
``*/qkv_proj/kernel``           ``[H, (nH+2nKV)*D]``    ``("embed", None)``
``*/gate_up_proj/kernel``       ``[H, 2I]``             ``("embed", None)``
==============================  ======================  ============================

The last two are the fused decode layout (``models/fused_layout.py``), meant for one device.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated).
LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "length": None,
    "embed": "fsdp",        # the hidden dim of weights: FSDP-sharded (size 1 = replicated)
    "activation_embed": None,
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "vocab": "tensor",
    "layers": None,
    "cache_length": None,
    "norm": None,
}

# (param path regex, logical axes); first match wins. Paths are "/"-joined.
TARGET_PARAM_AXES: list[tuple[str, tuple[str | None, ...]]] = [
    (r"embed_tokens/embedding$", ("vocab", "embed")),
    (r"lm_head/kernel$", ("embed", "vocab")),
    (r"self_attn/q_proj/kernel$", ("embed", "heads")),
    (r"self_attn/(k|v)_proj/kernel$", ("embed", "kv_heads")),
    (r"self_attn/o_proj/kernel$", ("heads", "embed")),
    (r"self_attn/q_proj/bias$", ("heads",)),
    (r"self_attn/(k|v)_proj/bias$", ("kv_heads",)),
    (r"mlp/(gate|up)_proj/kernel$", ("embed", "mlp")),
    (r"mlp/down_proj/kernel$", ("mlp", "embed")),
    # the fused decode layout (models/fused_layout.py) is a single-device layout: cutting
    # [q | k | v] or [gate | up] across devices would not cut at head / gate boundaries, so
    # its output axis stays whole (tensor parallelism uses the unfused layout)
    (r"self_attn/qkv_proj/kernel$", ("embed", None)),
    (r"self_attn/qkv_proj/bias$", (None,)),
    (r"mlp/gate_up_proj/kernel$", ("embed", None)),
    (r"(norm|layernorm)/weight$", ("norm",)),
]

# KV cache buffers [layers, batch, capacity, kv_heads, head_dim] and lengths [batch].
KV_CACHE_AXES = ("layers", "batch", "cache_length", "kv_heads", "head_dim")


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh over ``devices`` (default: all of ``jax.devices()``,
    which must number exactly ``data * fsdp * tensor``)."""
    devices = list(jax.devices() if devices is None else devices)
    size = data * fsdp * tensor
    if size != len(devices):
        raise ValueError(f"mesh data={data} x fsdp={fsdp} x tensor={tensor} = {size} devices, "
                         f"but {len(devices)} were given")
    grid = np.array(devices, dtype=object).reshape(data, fsdp, tensor)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _mesh_size(mesh: Mesh, axes) -> int:
    if axes is None:
        return 1
    axes = (axes,) if isinstance(axes, str) else axes
    return int(np.prod([mesh.shape[a] for a in axes]))


def logical_to_mesh(logical_axes: Sequence[str | None],
                    rules: Mapping[str, Any] = LOGICAL_AXIS_RULES,
                    shape: Sequence[int] | None = None, mesh: Mesh | None = None,
                    units: Mapping[str, int] | None = None) -> PartitionSpec:
    """Logical axis names -> :class:`PartitionSpec`.

    Args:
      logical_axes: one name (or ``None``) per array dimension; unknown names raise.
      rules: logical -> mesh axis table (default :data:`LOGICAL_AXIS_RULES`).
      shape, mesh: when both are given, a dimension not divisible by its mesh axes' size
        is replicated instead; a mesh axis already used by an earlier dimension is not
        reused.
      units: optional ``{logical name: number of indivisible units}`` (e.g. ``{"heads":
        32}``): such a dim is split only if the unit count divides too, so a head is never
        cut across devices.
    """
    spec, used = [], set()
    for dim, name in enumerate(logical_axes):
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise KeyError(f"logical axis {name!r} has no rule (known: {sorted(rules)})")
        axes = rules[name]
        if axes is not None:
            axes_tuple = (axes,) if isinstance(axes, str) else tuple(axes)
            if mesh is not None:
                axes_tuple = tuple(a for a in axes_tuple if a not in used and mesh.shape[a] > 1)
                size = _mesh_size(mesh, axes_tuple)
                if shape is not None and (shape[dim] % size or
                                          (units and name in units and units[name] % size)):
                    axes_tuple = ()
            used.update(axes_tuple)
            axes = None if not axes_tuple else (axes_tuple[0] if len(axes_tuple) == 1
                                                else axes_tuple)
        spec.append(axes)
    return PartitionSpec(*spec)


def logical_sharding(mesh: Mesh, logical_axes: Sequence[str | None],
                     shape: Sequence[int] | None = None,
                     rules: Mapping[str, Any] = LOGICAL_AXIS_RULES,
                     units: Mapping[str, int] | None = None) -> NamedSharding:
    """:class:`NamedSharding` for an array with these logical axes (see :func:`logical_to_mesh`)."""
    return NamedSharding(mesh, logical_to_mesh(logical_axes, rules, shape, mesh, units))


def _path_str(path) -> str:
    parts = []
    for key in path:
        parts.append(str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))))
    return "/".join(parts)


def target_param_axes(params: Any) -> Any:
    """The logical axes of every target parameter (same tree structure as ``params``)."""
    def axes_of(path, leaf):
        name = _path_str(path)
        for pattern, axes in TARGET_PARAM_AXES:
            if re.search(pattern, name):
                if len(axes) != np.ndim(leaf):
                    raise ValueError(f"parameter {name!r} has rank {np.ndim(leaf)}, rule "
                                     f"{pattern!r} expects {len(axes)}")
                return axes
        raise KeyError(f"no sharding rule for parameter {name!r}")
    return jax.tree_util.tree_map_with_path(axes_of, params)


def target_param_shardings(params: Any, mesh: Mesh, config=None,
                           rules: Mapping[str, Any] = LOGICAL_AXIS_RULES) -> Any:
    """NamedSharding per target parameter (``params`` may be arrays or ShapeDtypeStructs).

    With ``config`` (a :class:`~domino_jax.config.TargetConfig`), head dims are split only
    when the head counts divide the mesh axis (no head is cut across devices).
    """
    units = None if config is None else {"heads": config.num_heads,
                                         "kv_heads": config.num_kv_heads}
    axes = target_param_axes(params)
    return jax.tree_util.tree_map(
        lambda leaf, ax: logical_sharding(mesh, ax, np.shape(leaf), rules, units),
        params, axes, is_leaf=lambda x: isinstance(x, tuple))


def shard_target_params(params: Any, mesh: Mesh, config=None,
                        rules: Mapping[str, Any] = LOGICAL_AXIS_RULES) -> Any:
    """Place the target params on ``mesh`` (``jax.device_put`` with per-path shardings)."""
    return jax.device_put(params, target_param_shardings(params, mesh, config, rules))


def kv_cache_sharding(cache: Any, mesh: Mesh, config=None) -> Any:
    """Shardings for a :class:`~domino_jax.kv_cache.KVCache` (batch over data/fsdp, kv heads
    over tensor when divisible)."""
    units = None if config is None else {"kv_heads": config.num_kv_heads}
    buf = lambda x: logical_sharding(mesh, KV_CACHE_AXES, x.shape, units=units)
    return type(cache)(buf(cache.keys), buf(cache.values),
                       logical_sharding(mesh, ("batch",), cache.lengths.shape))
