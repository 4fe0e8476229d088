"""Table-driven conversion between Hugging Face tensor dicts and domino_jax parameter trees.

A converter is a list of :class:`Rule` s, one per tensor kind, e.g.::

    Rule("model.layers.{i}.self_attn.q_proj.weight", "layers_{i}/self_attn/q_proj/kernel", "T")

``{i}`` matches a layer index. ``transform`` is ``"T"`` (transpose a 2-D torch ``[out, in]``
weight into a Flax ``[in, out]`` kernel) or ``""`` (copy). The same table drives import
(:func:`hf_to_params`) and export (:func:`params_to_hf`), so a round trip is exact.

Import checks every tensor against the expected parameter shapes (from ``jax.eval_shape``
of the model) and reports *all* problems at once in one :class:`CheckpointError`:
missing tensors, unexpected tensors, two tensors mapped to the same parameter, wrong shapes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Iterable, Mapping

import numpy as np


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message lists every problem found."""


@dataclasses.dataclass(frozen=True)
class Rule:
    hf: str              # HF key pattern, "{i}" = layer index
    path: str            # "/"-joined param path pattern
    transform: str = ""  # "T" = transpose a 2-D weight; "" = copy

    def _regex(self, pattern: str) -> re.Pattern:
        return re.compile("^" + re.escape(pattern).replace(r"\{i\}", r"(\d+)") + "$")

    def match_hf(self, key: str) -> str | None:
        m = self._regex(self.hf).match(key)
        if m is None:
            return None
        return self.path.replace("{i}", m.group(1)) if m.groups() else self.path

    def match_path(self, path: str) -> str | None:
        m = self._regex(self.path).match(path)
        if m is None:
            return None
        return self.hf.replace("{i}", m.group(1)) if m.groups() else self.hf

    def apply(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array.T) if self.transform == "T" else array


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": x}}`` -> ``{"a/b": x}``."""
    out = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten(value, path))
        else:
            out[path] = value
    return out


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def _fmt(items: Iterable[str], limit: int = 12) -> str:
    items = sorted(items)
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def hf_to_params(tensors: Mapping[str, np.ndarray], rules: list[Rule],
                 expected: Mapping[str, Any], where: str,
                 ignore: Iterable[str] = (), dtype: Any = None) -> dict[str, Any]:
    """Map HF ``tensors`` to a nested param dict shaped like ``expected``.

    Args:
      tensors: HF key -> array.
      rules: the architecture's table.
      expected: nested tree of ``ShapeDtypeStruct`` (or arrays) the result must match.
      where: the checkpoint path, for messages.
      ignore: regexes of HF keys to drop silently (e.g. rotary ``inv_freq`` buffers).
      dtype: cast every tensor to this numpy dtype (``None``: keep the stored dtype).
    """
    expected_flat = flatten(expected)
    ignore_res = [re.compile(p) for p in ignore]
    out: dict[str, np.ndarray] = {}
    source: dict[str, str] = {}
    unexpected, doubles, shapes = [], [], []
    reported: set[str] = set()   # paths with a shape error: not also reported missing
    for key, array in tensors.items():
        if any(r.search(key) for r in ignore_res):
            continue
        path = next((p for p in (r.match_hf(key) for r in rules) if p is not None), None)
        rule = next((r for r in rules if r.match_hf(key) is not None), None)
        if path is None or path not in expected_flat:
            unexpected.append(key)
            continue
        if path in out:
            doubles.append(f"{source[path]} and {key} -> {path}")
            continue
        value = rule.apply(np.asarray(array))
        want = tuple(expected_flat[path].shape)
        if tuple(value.shape) != want:
            reported.add(path)
            shapes.append(f"{key}: shape {tuple(np.asarray(array).shape)}, expected "
                          f"{want[::-1] if rule.transform == 'T' else want}")
            continue
        out[path] = value.astype(dtype) if dtype is not None else value
        source[path] = key
    missing = [next(k for k in (r.match_path(path) for r in rules + [Rule(path, path)]) if k)
               for path in expected_flat if path not in out and path not in reported]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_fmt(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_fmt(unexpected)}")
    if doubles:
        problems.append(f"tensors mapped twice: {_fmt(doubles)}")
    if shapes:
        problems.append(f"wrong shapes: {_fmt(shapes)}")
    if problems:
        raise CheckpointError(f"{where}: checkpoint does not fit the model config:\n  - "
                              + "\n  - ".join(problems))
    return unflatten(out)


def params_to_hf(params: Mapping[str, Any], rules: list[Rule]) -> dict[str, np.ndarray]:
    """Inverse of :func:`hf_to_params` (torch ``[out, in]`` layout, same dtypes)."""
    out = {}
    for path, value in flatten(params).items():
        rule = next((r for r in rules if r.match_path(path) is not None), None)
        if rule is None:
            raise CheckpointError(f"no HF name for parameter {path!r}")
        array = np.asarray(value)
        out[rule.match_path(path)] = rule.apply(array) if rule.transform == "T" else array
    return out


# --------------------------------------------------------------------------- file access


def _load_file(file: str) -> dict[str, np.ndarray]:
    """One ``.safetensors`` file; :class:`CheckpointError` naming it when it cannot be read."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return dict(load_file(file))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e}); it may be "
                              "truncated or corrupt: copy or convert it again") from e


def read_tensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of an HF checkpoint folder (or a single ``.safetensors`` file).

    Accepts ``model.safetensors``, a sharded ``model.safetensors.index.json``, any single
    ``*.safetensors``, and ``pytorch_model.bin`` only when torch is installed. Read with
    numpy (bf16 via ml_dtypes); no torch needed for safetensors. A truncated or corrupt
    file raises :class:`CheckpointError` naming it.
    """
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint path {path!r} does not exist")
    if os.path.isfile(path):
        return _load_file(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        tensors = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = os.path.join(path, shard)
            if not os.path.exists(shard_path):
                raise CheckpointError(f"{index} names shard {shard!r}, which is missing")
            tensors.update(_load_file(shard_path))
        return tensors
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return _load_file(single)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if len(files) == 1:
        return _load_file(os.path.join(path, files[0]))
    bin_file = os.path.join(path, "pytorch_model.bin")
    if os.path.exists(bin_file):
        try:
            import torch
        except ImportError as e:
            raise CheckpointError(f"{bin_file}: torch .bin checkpoints need torch installed "
                                  "(or convert it to safetensors)") from e
        state = torch.load(bin_file, map_location="cpu", weights_only=True)
        return {k: v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
                for k, v in state.items()}
    raise CheckpointError(f"{path!r}: no model.safetensors, sharded index, or "
                          "pytorch_model.bin found")


def write_tensors(tensors: Mapping[str, np.ndarray], path: str) -> None:
    """Write one ``model.safetensors`` into folder ``path``."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"))
