"""Sharding rules, and the target forward on 8 simulated CPU devices (tensor-parallel)
equals the single-device forward.

The multi-device part runs in a subprocess: ``XLA_FLAGS`` must be set before jax starts,
which in a pytest session has already happened.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from domino_jax.config import TargetConfig
from domino_jax.sharding import (LOGICAL_AXIS_RULES, logical_to_mesh, make_mesh,
                                 target_param_axes)

# 8 heads / 4 kv heads / intermediate 128 split 4 ways; vocab 130 is *not* divisible by 4.
CONFIG = TargetConfig("qwen3", vocab_size=130, hidden_size=64, num_layers=2, num_heads=8,
                      num_kv_heads=4, head_dim=16, intermediate_size=128, rope_theta=10000.0)


def test_logical_to_mesh_without_mesh():
    assert logical_to_mesh(("embed", "heads")) == P("fsdp", "tensor")
    assert logical_to_mesh(("batch", "length", None)) == P(("data", "fsdp"), None, None)
    with pytest.raises(KeyError, match="nonsense"):
        logical_to_mesh(("nonsense",))
    assert set(LOGICAL_AXIS_RULES) >= {"batch", "embed", "heads", "kv_heads", "mlp", "vocab",
                                       "layers"}


def test_single_device_mesh_replicates_everything():
    mesh = make_mesh(devices=jax.devices()[:1])
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert logical_to_mesh(("embed", "heads"), mesh=mesh, shape=(64, 128)) == P(None, None)
    with pytest.raises(ValueError, match="devices"):
        make_mesh(tensor=3, devices=jax.devices()[:1])


def test_param_axes_cover_every_target_param():
    from domino_jax.models.qwen3 import param_shapes

    import dataclasses

    qwen2 = TargetConfig("qwen2", 128, 64, 1, 4, 2, 16, 96, tie_word_embeddings=True,
                         qk_norm=False, qkv_bias=True)
    # the fused decode layout too: its output axis is replicated (models/fused_layout.py)
    for config in (CONFIG, qwen2, dataclasses.replace(CONFIG, fused_projections=True),
                   dataclasses.replace(qwen2, fused_projections=True)):
        axes = target_param_axes(param_shapes(config))
        if config.fused_projections:
            layer = axes["layers_0"]
            assert layer["self_attn"]["qkv_proj"]["kernel"] == ("embed", None)
            assert layer["mlp"]["gate_up_proj"]["kernel"] == ("embed", None)
            assert layer["self_attn"]["qkv_proj"].get("bias", (None,)) == (None,)
        flat = {jax.tree_util.keystr(k): v for k, v in
                jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda x: isinstance(x, tuple))[0]}
        assert all(isinstance(v, tuple) for v in flat.values())


def child_main() -> None:
    """Runs with 8 simulated CPU devices (see the test below)."""
    jax.config.update("jax_default_matmul_precision", "highest")
    from domino_jax.models.qwen3 import TargetLM, init_params, new_cache
    from domino_jax.sharding import kv_cache_sharding, logical_sharding, shard_target_params

    assert len(jax.devices()) == 8, jax.devices()
    model = TargetLM(CONFIG, dtype=jnp.float32, param_dtype=jnp.float32)
    params = init_params(CONFIG, jax.random.PRNGKey(0), jnp.float32)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 9), 0, CONFIG.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
    apply = jax.jit(lambda p, t, pos: model.apply({"params": p}, t, pos).logits)
    ref = np.asarray(apply(params, tokens, positions))

    for data, tensor in ((2, 4), (1, 8)):
        mesh = make_mesh(data=data, tensor=tensor)
        sharded = shard_target_params(params, mesh, CONFIG)
        specs = jax.tree_util.tree_map(lambda x: x.sharding.spec, sharded)
        layer = specs["layers_0"]
        assert layer["self_attn"]["q_proj"]["kernel"] == P(None, "tensor")
        assert layer["mlp"]["gate_proj"]["kernel"] == P(None, "tensor")
        assert layer["mlp"]["down_proj"]["kernel"] == P("tensor", None)
        assert layer["self_attn"]["o_proj"]["kernel"] == P("tensor", None)
        assert layer["input_layernorm"]["weight"] == P(None)
        # vocab 130 is not divisible by 4 or 8: replicated.
        assert specs["embed_tokens"]["embedding"] == P(None, None)
        kv_spec = layer["self_attn"]["k_proj"]["kernel"]
        # 4 kv heads split 4 ways; with tensor=8 the kv heads would be cut: replicated.
        assert kv_spec == (P(None, "tensor") if tensor == 4 else P(None, None)), kv_spec
        batch_sharding = logical_sharding(mesh, ("batch", "length"), tokens.shape)
        out = apply(sharded, jax.device_put(tokens, batch_sharding),
                    jax.device_put(positions, batch_sharding))
        err = float(np.max(np.abs(np.asarray(out) - ref)))
        assert err <= 1e-5, (data, tensor, err)
        print(f"mesh data={data} tensor={tensor}: max |logits diff| {err:.2e}")

    # Cached decode with a sharded cache also matches.
    mesh = make_mesh(data=2, tensor=4)
    sharded = shard_target_params(params, mesh, CONFIG)
    cache = new_cache(CONFIG, 2, 16, jnp.float32)
    cache = jax.device_put(cache, kv_cache_sharding(cache, mesh, CONFIG))
    step = jax.jit(lambda p, t, pos, c: model.apply({"params": p}, t, pos, cache=c))
    out = step(sharded, tokens[:, :6], positions[:, :6], cache)
    out = step(sharded, tokens[:, 6:], positions[:, 6:], out.cache.advance(6))
    err = float(np.max(np.abs(np.asarray(out.logits) - ref[:, 6:])))
    assert err <= 1e-5, ("cached", err)
    print(f"sharded cached decode: max |logits diff| {err:.2e}")
    print("CHILD OK")


def test_sharded_forward_on_8_cpu_devices():
    env = dict(os.environ, XLA_FLAGS=" ".join((
        "--xla_force_host_platform_device_count=8", os.environ.get("XLA_FLAGS", ""))),
               JAX_PLATFORMS="cpu")
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {here!r}); "
            "import test_sharding; test_sharding.child_main()")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=300, cwd=os.path.dirname(here))
    assert result.returncode == 0 and "CHILD OK" in result.stdout, \
        f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-4000:]}"
    print(result.stdout)
