"""Check that a program with Pallas kernels lowers for a GPU or a TPU, on a machine without one.

``jax.export`` lowers for any platform on the CPU:

* ``tpu``: inside ``use_abstract_mesh`` with an abstract TPU of a given generation (some
  lowering rules depend on it), ``export(platforms=["tpu"])`` runs the Pallas-to-Mosaic
  lowering (block shapes, memory spaces, the Mosaic ops of every primitive); the module
  carries a ``tpu_custom_call``. Mosaic's own compiler passes (vector layouts) run only on
  a TPU.
* ``cuda``: inside ``use_abstract_mesh`` with an abstract device of the GPU's kind (which
  gives the Triton lowering its compute capability), ``export(platforms=["cuda"])`` runs the
  Pallas-to-Triton lowering, which rejects what Triton cannot take (e.g. a block whose size
  is not a power of two). The Triton-to-PTX compile runs only on a GPU.

Only the speed and those last compiler steps need the device.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax


class Target(NamedTuple):
    """Where a program is lowered for: ``platform`` ``"cuda"`` or ``"tpu"``, and the device
    kind and core count of an abstract device of that platform (SMs of a GPU, TensorCores
    of a TPU chip)."""

    name: str
    platform: str
    device_kind: str
    num_cores: int


TARGETS = (Target("a100", "cuda", "NVIDIA A100-SXM4-80GB", 108),
           Target("h200", "cuda", "NVIDIA H200", 132),
           Target("tpu_v5e", "tpu", "TPU v5 lite", 1),
           Target("tpu_v5p", "tpu", "TPU v5", 2))


def custom_call_marker(target: Target) -> str:
    """The text a lowered module holds once per Pallas kernel call."""
    return "tpu_custom_call" if target.platform == "tpu" else "__gpu$xla.gpu.triton"


def export_for(fn: Callable, args, target: Target) -> jax.export.Exported:
    """``jax.export`` of ``jax.jit(fn)`` at the shapes ``args`` (``ShapeDtypeStruct`` trees)
    for ``target``; raises whatever the lowering rejects."""
    from jax._src.mesh import AbstractDevice   # no public spelling in jax 0.11.2

    device = AbstractDevice(device_kind=target.device_kind, num_cores=target.num_cores,
                            platform=target.platform)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    checks = []
    if target.platform == "cuda":        # Triton calls are not on export's stable list
        checks = [jax.export.DisabledSafetyCheck.custom_call(custom_call_marker(target))]
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.export.export(jax.jit(fn), platforms=[target.platform],
                                 disabled_checks=checks)(*args)


def kernel_calls(exported: jax.export.Exported, target: Target) -> int:
    """How many Pallas kernel calls the lowered module holds."""
    return exported.mlir_module().count(custom_call_marker(target))
