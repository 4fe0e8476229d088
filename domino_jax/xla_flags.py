"""XLA flags domino_jax turns on by default, set in ``XLA_FLAGS`` when the package is first
imported (XLA reads the variable once, when jax's backend starts: import ``domino_jax``
before the first jax computation, as ``python -m domino_jax.decode`` and the benchmarks do).

* ``--xla_cpu_copy_insertion_use_region_analysis=true`` and its GPU twin: XLA's copy
  insertion analyses the branches of a conditional one by one. Without it, XLA CPU copies
  the whole target KV cache twice per layer-pair at the end of every branch of the adaptive
  loop's ``lax.switch`` that writes the draft cache (4 copies of ``[L, B, C, Hkv, D]`` a
  round), which made a drafting arm in the switch dearer than the same round in a fixed
  loop; with the flag they cost the same (``docs/design.md`` §8). Greedy outputs are
  unchanged (it only decides where buffers are copied).

A flag the user already gives in ``XLA_FLAGS`` (either value) is left as it is;
``DOMINO_JAX_XLA_DEFAULTS=0`` turns the defaults off.
"""

from __future__ import annotations

import os
from typing import Mapping, MutableMapping

DEFAULT_XLA_FLAGS: Mapping[str, str] = {
    "xla_cpu_copy_insertion_use_region_analysis": "true",
    "xla_gpu_copy_insertion_use_region_analysis": "true",
}
OPT_OUT = "DOMINO_JAX_XLA_DEFAULTS"


def merged_xla_flags(current: str, defaults: Mapping[str, str] = DEFAULT_XLA_FLAGS) -> str:
    """``current`` (an ``XLA_FLAGS`` value) with each default flag appended unless a flag of
    that name is already there."""
    given = {part.lstrip("-").split("=", 1)[0] for part in current.split()}
    extra = [f"--{name}={value}" for name, value in defaults.items() if name not in given]
    return " ".join([current.strip()] + extra).strip()


def apply_default_xla_flags(environ: MutableMapping[str, str] = os.environ) -> str:
    """Set :data:`DEFAULT_XLA_FLAGS` in ``environ["XLA_FLAGS"]`` (unless ``OPT_OUT`` is
    ``0``); returns the value set (or left)."""
    current = environ.get("XLA_FLAGS", "")
    if environ.get(OPT_OUT, "1") == "0":
        return current
    environ["XLA_FLAGS"] = merged_xla_flags(current)
    return environ["XLA_FLAGS"]
