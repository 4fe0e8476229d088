"""``layers.attend`` (``jax.nn.dot_product_attention``, XLA) against ``layers.attend_reference``
(the plain einsum formulation it replaced).

Float32 parity tolerance: ``max |attend - attend_reference| <= ATOL = 1e-5`` elementwise
(outputs are averages of N(0, 1) values, so ``|out| <~ 3``; the two differ only in summation
order), and the suite's relative ``REL_TOL`` (``max |diff| / max |ref| <= 1e-5``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close
from domino_jax.models.layers import MASK_VALUE, attend, attend_reference

ATOL = 1e-5  # float32, absolute

# (batch, queries T, keys S, query heads nH, kv heads nKV, head dim D): GQA groups 1, 2, 4,
# single-query decode (T = 1) and multi-query verify / prefill (T > 1).
SHAPES = [
    (2, 1, 37, 4, 4, 16),     # group 1 (MHA), AR step
    (2, 1, 50, 8, 2, 32),     # group 4, AR step
    (3, 5, 23, 4, 2, 16),     # group 2, short verify
    (1, 9, 9, 6, 3, 8),       # group 2, square causal prefill
    (2, 17, 769, 32, 8, 128), # group 4, Qwen3-8B verify shape
]
IDS = [f"B{b}-T{t}-S{s}-nH{h}-nKV{k}-D{d}" for b, t, s, h, k, d in SHAPES]


def _inputs(shape, dtype, seed, pattern="cache"):
    """Random q/k/v and a ragged bool ``visible [B, T, S]`` with row (0, T-1) fully masked.

    ``cache``: batch row ``b`` has a random committed length ``L_b``; query ``t`` sees keys
    ``s <= L_b + t`` (causal over the new rows), then a random third of the non-diagonal
    visible keys is dropped (tree-style masks). ``random``: independent Bernoulli(0.5).
    """
    b, t, s, nh, nkv, d = shape
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, nh, d))
    k = rng.normal(size=(b, s, nkv, d))
    v = rng.normal(size=(b, s, nkv, d))
    if pattern == "cache":
        lengths = rng.integers(0, s - t + 1, size=b)
        key = np.arange(s)[None, None, :]
        last = lengths[:, None, None] + np.arange(t)[None, :, None]
        visible = (key <= last) & ((rng.random((b, t, s)) > 1 / 3) | (key == last))
    else:
        visible = rng.random((b, t, s)) < 0.5
    visible[0, t - 1] = False
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(q), cast(k), cast(v), jnp.asarray(visible)


def _uniform_average(v, num_heads):
    """Output of a fully masked row: the plain mean over all S values, per query head."""
    mean = jnp.mean(v.astype(jnp.float32), axis=1)                  # [B, nKV, D]
    return jnp.repeat(mean, num_heads // v.shape[2], axis=1)        # [B, nH, D]


@pytest.mark.parametrize("pattern", ["cache", "random"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_attend_matches_reference_float32(shape, pattern):
    q, k, v, visible = _inputs(shape, jnp.float32, seed=sum(shape), pattern=pattern)
    ours = jax.jit(attend)(q, k, v, visible)
    ref = jax.jit(attend_reference)(q, k, v, visible)
    assert ours.shape == q.shape and ours.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(ours)))
    diff = float(jnp.max(jnp.abs(ours - ref)))
    assert diff <= ATOL, f"max |attend - attend_reference| = {diff:.3e} > {ATOL:.0e}"
    assert_close(ours, ref, what="attend vs attend_reference")  # also relative
    # The fully masked row (0, T-1): every score is MASK_VALUE -> uniform average, no NaN.
    np.testing.assert_allclose(ours[0, -1], _uniform_average(v, q.shape[2])[0], atol=ATOL)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fully_masked_rows_are_finite(dtype):
    """All rows of all batches masked (a padded training block sees nothing)."""
    q, k, v, _ = _inputs((2, 4, 12, 4, 2, 16), dtype, seed=3)
    visible = jnp.zeros((2, 4, 12), bool)
    for fn in (attend, attend_reference):
        out = jax.jit(fn)(q, k, v, visible)
        assert out.dtype == dtype and bool(jnp.all(jnp.isfinite(out)))
        expect = jnp.broadcast_to(_uniform_average(v, 4)[:, None], out.shape)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expect),
                                   atol=1e-5 if dtype == jnp.float32 else 1e-2)


def test_gradients_match_reference_with_masked_rows():
    """Training differentiates through ``attend``; fully masked rows must not give NaN."""
    q, k, v, visible = _inputs((2, 5, 23, 4, 2, 16), jnp.float32, seed=7)
    weights = jax.random.normal(jax.random.PRNGKey(0), q.shape)
    loss = lambda fn: lambda q, k, v: jnp.sum(weights * fn(q, k, v, visible))
    ours = jax.jit(jax.grad(loss(attend), argnums=(0, 1, 2)))(q, k, v)
    ref = jax.jit(jax.grad(loss(attend_reference), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(ours, ref):
        assert bool(jnp.all(jnp.isfinite(a)))
        np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_attend_bfloat16_close_to_reference(shape):
    """bf16 (the decode dtype): same dtype out; equal up to bf16 rounding (on the CPU and on
    the H200 benchmark the two agree exactly)."""
    q, k, v, visible = _inputs(shape, jnp.bfloat16, seed=sum(shape))
    ours = jax.jit(attend)(q, k, v, visible)
    ref = jax.jit(attend_reference)(q, k, v, visible)
    assert ours.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2, rtol=1e-2)


def test_mixed_dtypes_fall_back_to_reference():
    """``dot_product_attention`` needs one dtype; float32 queries over a bf16 cache still work
    (promoted as before) and come out in ``v.dtype``."""
    q, _, _, visible = _inputs((1, 3, 10, 4, 2, 16), jnp.float32, seed=11)
    _, k, v, _ = _inputs((1, 3, 10, 4, 2, 16), jnp.bfloat16, seed=12)
    out = jax.jit(attend)(q, k, v, visible)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(attend_reference(q, k, v, visible), np.float32))


def test_attend_uses_dot_product_attention_xla(monkeypatch):
    calls = []
    original = jax.nn.dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("implementation"))
        return original(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    q, k, v, visible = _inputs((1, 2, 8, 4, 2, 16), jnp.float32, seed=5)
    attend(q, k, v, visible)
    assert calls == ["xla"]


def test_scale_and_mask_value_match_the_library():
    """What ``jax/_src/nn/functions.py`` uses: ``float32(1 / np.sqrt(D))`` (ours:
    ``D ** -0.5``) and ``-0.7 * finfo(float32).max`` for masked scores (ours: MASK_VALUE)."""
    for d in range(1, 2049):
        assert np.float32(1.0 / np.sqrt(d)) == np.float32(d ** -0.5), d
    from jax._src.nn.functions import _get_large_negative
    assert float(_get_large_negative(jnp.float32)) == np.float32(MASK_VALUE)
