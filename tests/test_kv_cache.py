"""KVCache contract: rollback + rewrite == never written; tree gather_path == sequential writes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, forward, positions_for, random_tokens
from domino_jax.config import TargetConfig
from domino_jax.kv_cache import KVCache, key_visibility
from domino_jax.models.qwen3 import TargetLM, init_params, new_cache

CONFIG = TargetConfig("qwen3", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate_size=96, rope_theta=10000.0)
CAPACITY = 24


@pytest.fixture(scope="module")
def target():
    params = jax.jit(init_params, static_argnums=(0, 2))(CONFIG, jax.random.PRNGKey(0),
                                                         jnp.float32)
    # Non-trivial norm weights so q/k norms matter.
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * (1.0 + 0.1 * jnp.arange(x.shape[-1]) / x.shape[-1])
        if "norm" in jax.tree_util.keystr(path) else x, params)
    return TargetLM(CONFIG, dtype=jnp.float32, param_dtype=jnp.float32), params


def _committed(cache: KVCache, upto: np.ndarray):
    """Per-row committed K/V slices (list over rows of ``[L, len, nKV, D]`` pairs)."""
    return [(np.asarray(cache.keys[:, b, :n]), np.asarray(cache.values[:, b, :n]))
            for b, n in enumerate(upto)]


def _prefill(model, params, tokens):
    batch, length = tokens.shape
    cache = new_cache(CONFIG, batch, CAPACITY, jnp.float32)
    out = forward(model, params, tokens, positions_for(batch, length), cache=cache)
    return out.cache.advance(length)


def test_rollback_then_rewrite_equals_never_written(target):
    model, params = target
    batch, prefill = 2, 6
    tokens = random_tokens(10, (batch, prefill + 2))
    wrong = random_tokens(11, (batch, 4))
    base = _prefill(model, params, tokens[:, :prefill])

    # Reference: the correct 2 tokens written right after the prefix.
    ref = forward(model, params, tokens[:, prefill:], positions_for(batch, 2, prefill), cache=base)
    ref_cache = ref.cache.advance(2)

    # Write 4 wrong tokens, commit them, roll back per row (row 0 fully, row 1 too), rewrite.
    bad = forward(model, params, wrong, positions_for(batch, 4, prefill), cache=base)
    bad_cache = bad.cache.advance(4)
    rolled = bad_cache.rollback(jnp.full((batch,), prefill, jnp.int32))
    np.testing.assert_array_equal(np.asarray(rolled.lengths), [prefill] * batch)
    out = forward(model, params, tokens[:, prefill:], positions_for(batch, 2, prefill), cache=rolled)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), rtol=0, atol=1e-6)
    new_cache_ = out.cache.advance(2)
    for (k, v), (rk, rv) in zip(_committed(new_cache_, [prefill + 2] * batch),
                                _committed(ref_cache, [prefill + 2] * batch)):
        np.testing.assert_allclose(k, rk, atol=1e-6)
        np.testing.assert_allclose(v, rv, atol=1e-6)
    # A further decode step sees no trace of the rolled-back tokens.
    nxt = random_tokens(12, (batch, 1))
    a = forward(model, params, nxt, positions_for(batch, 1, prefill + 2), cache=new_cache_)
    b = forward(model, params, nxt, positions_for(batch, 1, prefill + 2), cache=ref_cache)
    assert_close(a.logits, b.logits, tol=1e-6, what="decode after rollback")


def test_rollback_never_increases_lengths():
    cache = KVCache.create(1, 2, 8, 1, 4, jnp.float32).advance(jnp.array([5, 3]))
    np.testing.assert_array_equal(np.asarray(cache.rollback(jnp.array([4, 6])).lengths), [4, 3])


# A small tree (node -> parent), node 0 is the root (the last committed, unverified token).
PARENTS = [-1, 0, 0, 1, 2, 3, 3]


def _tree_mask(parents):
    n = len(parents)
    mask = np.zeros((n, n), bool)
    depth = np.zeros(n, np.int32)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
        depth[i] = mask[i].sum() - 1
    return mask, depth


def test_key_visibility_tree_mask():
    mask, _ = _tree_mask(PARENTS)
    vis = np.asarray(key_visibility(jnp.array([2]), len(PARENTS), 12, jnp.asarray(mask[None])))
    assert vis[0, :, :2].all()                       # committed prefix visible to every node
    np.testing.assert_array_equal(vis[0, :, 2:2 + len(PARENTS)], mask)
    assert not vis[0, :, 2 + len(PARENTS):].any()    # stale slots past the block


def test_gather_path_equals_sequential_writes(target):
    """Verify a tree block, pick a different accepted path per row, gather: the committed
    buffers equal writing the path's tokens one by one, and the next step's logits agree."""
    model, params = target
    batch, prefill = 2, 5
    prompt = random_tokens(20, (batch, prefill))
    tree_tokens = random_tokens(21, (batch, len(PARENTS)))
    mask, depth = _tree_mask(PARENTS)
    paths = np.array([[0, 1, 3, 5], [0, 2, 4, 0]], np.int32)   # row 1: path of length 3
    path_len = np.array([4, 3], np.int32)

    base = _prefill(model, params, prompt)
    positions = prefill + jnp.asarray(np.broadcast_to(depth, (batch, len(PARENTS))))
    tree = forward(model, params, tree_tokens, positions, cache=base,
                   block_mask=np.broadcast_to(mask, (batch,) + mask.shape))
    gathered = tree.cache.gather_path(jnp.asarray(paths), jnp.asarray(path_len))
    np.testing.assert_array_equal(np.asarray(gathered.lengths), prefill + path_len)

    for b in range(batch):
        n = int(path_len[b])
        path_tokens = tree_tokens[b, paths[b, :n]]
        # Sequential reference: write the accepted tokens one at a time (row b alone).
        seq = _prefill(model, params, prompt[b:b + 1])
        for i, tok in enumerate(path_tokens):
            out = forward(model, params, np.array([[tok]], np.int32),
                          positions_for(1, 1, prefill + i), cache=seq)
            # tree-verify logits of the path node equal the sequential logits
            assert_close(tree.logits[b, paths[b, i]], out.logits[0, 0], tol=1e-5,
                         what=f"row {b} node {paths[b, i]} logits")
            seq = out.cache.advance(1)
        upto = prefill + n
        # Same math, different batching: equal up to float32 rounding.
        assert_close(gathered.keys[:, b, :upto], seq.keys[:, 0, :upto], tol=1e-6,
                     what=f"row {b} keys")
        assert_close(gathered.values[:, b, :upto], seq.values[:, 0, :upto], tol=1e-6,
                     what=f"row {b} values")
        # The prefix itself is untouched (bit-identical to the prefill).
        np.testing.assert_array_equal(np.asarray(gathered.keys[:, b, :prefill]),
                                      np.asarray(base.keys[:, b, :prefill]))


def test_gather_path_moves_slots_exactly():
    """Pure data movement: slot ``len + i`` receives slot ``len + path[i]``; nothing else moves."""
    layers, batch, cap = 2, 2, 10
    keys = jnp.arange(layers * batch * cap, dtype=jnp.float32).reshape(layers, batch, cap, 1, 1)
    cache = KVCache(keys, -keys, jnp.array([2, 3], jnp.int32))
    out = cache.gather_path(jnp.array([[0, 2, 5], [1, 3, 0]]), jnp.array([3, 2]))
    expect = np.array(keys)
    expect[:, 0, 2:5] = np.array(keys)[:, 0, [2, 4, 7]]
    expect[:, 1, 3:5] = np.array(keys)[:, 1, [4, 6]]
    np.testing.assert_array_equal(np.asarray(out.keys), expect)
    np.testing.assert_array_equal(np.asarray(out.values), -expect)
    np.testing.assert_array_equal(np.asarray(out.lengths), [5, 5])
