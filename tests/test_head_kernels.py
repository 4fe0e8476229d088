"""The Domino head step, DominoTree depth step and TPU cache-attention kernels
(``domino_jax/pallas/``), both variants (Triton, Mosaic TPU) run in the Pallas interpreter on
the CPU, against their plain-JAX twins and against independent maths (``lax.top_k``,
``jax.random.categorical``, ``domino_head.gru_update``, ``layers.attend_reference``).

``./dev test`` runs this file in the separate process of the Pallas-interpreter tests (see
``dev``). Shapes are tiny but keep every edge: a vocabulary that is not a multiple of the
block (a partial last block), padded rows, ``-inf`` lanes.

Float32 tolerance: ``1e-5`` relative (the kernels and the twins differ in summation order
only); bf16: the activation-dtype rounding of the state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from domino_jax.kv_cache import key_visibility
from domino_jax.models.domino_head import gru_update
from domino_jax.models.layers import attend_reference
from domino_jax.pallas import head_step as hs
from domino_jax.pallas import tree_step as ts
from domino_jax.pallas.cache_attention_tpu import cache_attention_tpu

VARIANTS = ["triton", "mosaic_tpu"]
INTERPRET = {"triton": True, "mosaic_tpu": pltpu.InterpretParams()}
B, K, V, E, G = 2, 4, 300, 32, 128          # 300 = 2 blocks of 128 + a partial one
RTOL = 1e-5


def _normal(rng, *shape, scale=1.0):
    return jnp.asarray(scale * rng.normal(size=shape), jnp.float32)


def _head_inputs(variant, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    plan = hs.plan_step(variant, B, V, E, G, block_v=128)
    rows = plan.rows
    pad = lambda x: jnp.pad(x, ((0, rows - B), (0, 0)))                 # noqa: E731
    return plan, dict(
        w2=_normal(rng, E, V, scale=0.3).astype(dtype), base=_normal(rng, B, K, V),
        table=_normal(rng, V, 3 * G), proj=_normal(rng, G, 3 * G + E, scale=0.1).astype(dtype),
        state=pad(_normal(rng, B, G)).astype(dtype), products=pad(_normal(rng, B, 3 * G + E)),
        z=hs.pad_z(_normal(rng, B, K, E), G, rows))


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_argmax_matches_twin_and_argmax(variant):
    plan, x = _head_inputs(variant)
    args = (x["products"], x["w2"], x["base"])
    kw = dict(plan=plan, step=2, act_dtype=jnp.float32, write_logits=True)
    parts, logits = hs.logits_argmax(*args, **kw, interpret=INTERPRET[variant])
    twin_parts, twin_logits = hs.logits_argmax_reference(*args, **kw)
    u = x["products"][:B, 3 * G:]
    plain = x["base"][:, 2] + jnp.dot(u, x["w2"], precision="highest")
    np.testing.assert_allclose(logits, plain, rtol=RTOL, atol=RTOL)
    np.testing.assert_allclose(twin_logits, plain, rtol=RTOL, atol=RTOL)
    tokens = hs.finish_choice(parts, B)
    np.testing.assert_array_equal(tokens, jnp.argmax(plain, axis=-1))
    np.testing.assert_array_equal(tokens, hs.finish_choice(twin_parts, B))
    greedy, none = hs.logits_argmax(*args, plan=plan, step=2, act_dtype=jnp.float32,
                                    interpret=INTERPRET[variant])
    assert none is None
    np.testing.assert_array_equal(hs.finish_choice(greedy, B), tokens)


@pytest.mark.parametrize("variant", VARIANTS)
def test_gumbel_draw_is_jax_random_categorical(variant):
    """``noise = gumbel(key)`` and ``temperature`` T: the kernel's choice is the token
    ``jax.random.categorical(key, logits / T)`` draws."""
    plan, x = _head_inputs(variant, seed=1)
    plan = hs.plan_step(variant, B, V, E, G)      # one block wider than V: its overhang
    key, temperature = jax.random.PRNGKey(7), 0.6
    noise = jax.random.gumbel(key, (B, V), jnp.float32)
    parts, logits = hs.logits_argmax(x["products"], x["w2"], x["base"], plan=plan, step=1,
                                     act_dtype=jnp.float32, noise=noise,
                                     temperature=temperature, write_logits=True,
                                     interpret=INTERPRET[variant])
    drawn = jax.random.categorical(key, logits / temperature, axis=-1)
    np.testing.assert_array_equal(hs.finish_choice(parts, B), drawn)


@pytest.mark.parametrize("pool", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
def test_state_step_matches_twin_and_gru(variant, pool):
    """Kernel B: the finished choice, the gathered gates (a shared ``[V, 3G]`` table or a
    per-row pool of 5 candidates), ``gru_update`` and the ``[W_hh | W1_s]`` products."""
    plan, x = _head_inputs(variant, seed=2)
    parts, _ = hs.logits_argmax_reference(x["products"], x["w2"], x["base"], plan=plan,
                                          step=0, act_dtype=jnp.float32)
    table, stride = x["table"], 0
    if pool:                                      # rows b * 5 + j; indices j < 5
        parts = hs.given_choice(jnp.asarray([3, 1], jnp.int32), plan.rows)
        table, stride = x["table"][:B * 5], 5
    args = (parts, table, x["state"], x["products"], x["z"], x["proj"])
    kw = dict(plan=plan, row_stride=stride, z_row=3)
    token, state, products = hs.state_step(*args, **kw, interpret=INTERPRET[variant])
    twin = hs.state_step_reference(*args, **kw)
    np.testing.assert_array_equal(token, twin[0])
    np.testing.assert_allclose(state[:B], twin[1][:B], rtol=RTOL, atol=RTOL)
    np.testing.assert_allclose(products[:B], twin[2][:B], rtol=RTOL, atol=RTOL)
    gates = table[token + jnp.arange(B) * stride]
    expected = gru_update(gates, x["products"][:B, :3 * G], x["state"][:B])
    np.testing.assert_allclose(state[:B], expected, rtol=RTOL, atol=RTOL)
    acc = jnp.dot(expected, x["proj"], precision="highest")
    np.testing.assert_allclose(products[:B, :3 * G], acc[:, :3 * G], rtol=RTOL, atol=RTOL)
    np.testing.assert_allclose(products[:B, 3 * G:],
                               jax.nn.silu(x["z"][3, :B, 3 * G:] + acc[:, 3 * G:]),
                               rtol=RTOL, atol=RTOL)


@pytest.mark.parametrize("variant", VARIANTS)
def test_bfloat16_step_close_to_twin(variant):
    plan, x = _head_inputs(variant, seed=3, dtype=jnp.bfloat16)
    interpret = INTERPRET[variant]
    kw = dict(plan=plan, step=1, act_dtype=jnp.bfloat16, write_logits=True)
    parts, logits = hs.logits_argmax(x["products"], x["w2"], x["base"], **kw,
                                     interpret=interpret)
    twin_parts, twin_logits = hs.logits_argmax_reference(x["products"], x["w2"], x["base"], **kw)
    np.testing.assert_allclose(logits, twin_logits, rtol=1e-5, atol=1e-4)
    args = (parts, x["table"], x["state"], x["products"], x["z"], x["proj"])
    out = hs.state_step(*args, plan=plan, z_row=2, interpret=interpret)
    twin = hs.state_step_reference(*args, plan=plan, z_row=2)
    assert out[1].dtype == jnp.bfloat16
    np.testing.assert_array_equal(out[0], twin[0])
    for ours, theirs in zip(out[1:], twin[1:]):
        np.testing.assert_allclose(np.asarray(ours[:B], np.float32),
                                   np.asarray(theirs[:B], np.float32), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------- DominoTree depth step

W, M, NT = 6, 24, 5                       # lanes, candidates per depth, children per lane


def _tree_inputs(variant, seed=4):
    rng = np.random.default_rng(seed)
    plan = ts.plan_tree_step(variant, W, V, E, G, NT, M)
    rows = plan.step.rows
    top_logits, top_ids = jax.lax.top_k(_normal(rng, K, V, scale=3.0), M)
    base_lp = jax.nn.log_softmax(_normal(rng, K, V))[:, :NT]
    raw = (top_ids, top_logits, _normal(rng, K, M, E, scale=0.3), top_ids[:, :NT], base_lp,
           _normal(rng, K, E))
    score = -jnp.abs(_normal(rng, W)).at[W - 1].set(-jnp.inf)      # one lane holds no node
    pad = lambda x: jnp.pad(x, ((0, rows - W), (0, 0)))                 # noqa: E731
    return plan, raw, dict(
        lane_score=jnp.pad(score, (0, rows - W), constant_values=-jnp.inf),
        state=pad(_normal(rng, W, G)), products=pad(_normal(rng, W, 3 * G + E)),
        inputs=ts.prepare(plan, *raw), table=_normal(rng, V, 3 * G),
        state_proj=_normal(rng, G, 3 * G + E, scale=0.1))


@pytest.mark.parametrize("variant", VARIANTS)
def test_tree_step_matches_twin_and_top_k(variant):
    plan, raw, x = _tree_inputs(variant)
    args = (x["lane_score"], x["state"], x["products"], x["inputs"], x["table"],
            x["state_proj"])
    for from_base, advance in ((False, True), (True, False)):
        kw = dict(plan=plan, depth=1, from_base=from_base, advance=advance)
        ours = ts.tree_step(*args, **kw, interpret=INTERPRET[variant])
        twin = ts.tree_step_reference(*args, **kw)
        for a, b in zip(ours[:3], twin[:3]):
            np.testing.assert_array_equal(a, b)
        if advance:
            for a, b in zip(ours[3:], twin[3:]):
                np.testing.assert_allclose(a[:W], b[:W], rtol=RTOL, atol=RTOL)
        else:
            assert ours[3] is None and ours[4] is None
    # the selection, independently: lax.top_k over the lanes' top-NT children
    cand, cand_logits, cand_w2 = raw[0][1], raw[1][1], raw[2][1]
    u = x["products"][:W, 3 * G:]
    lp, j = jax.lax.top_k(jax.nn.log_softmax(cand_logits + u @ cand_w2.T), NT)
    best, idx = jax.lax.top_k((x["lane_score"][:W, None] + lp).reshape(-1), W)
    ours = ts.tree_step(*args, plan=plan, depth=1, from_base=False, advance=True,
                        interpret=INTERPRET[variant])
    np.testing.assert_allclose(ours[0], best, rtol=RTOL, atol=RTOL)
    np.testing.assert_array_equal(ours[1], cand[j.reshape(-1)[idx]])
    np.testing.assert_array_equal(ours[2], idx // NT)
    lane, token = idx // NT, ours[1]
    expected = gru_update(x["table"][token], x["products"][lane, :3 * G], x["state"][lane])
    np.testing.assert_allclose(ours[3][:W], expected, rtol=RTOL, atol=RTOL)


def test_tree_step_under_vmap_equals_per_tree():
    """``TreeDrafter`` builds one tree per batch row under ``vmap``: the batched kernel
    (Pallas adds a grid axis) equals the kernel per row."""
    trees = [_tree_inputs("triton", seed=s) for s in (5, 6)]
    plan = trees[0][0]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[t[2] for t in trees])
    fn = lambda x: ts.tree_step(x["lane_score"], x["state"], x["products"], x["inputs"],  # noqa: E731
                                x["table"], x["state_proj"], plan=plan, depth=2,
                                from_base=False, interpret=True)
    batched = jax.vmap(fn)(stacked)
    for row, (_, _, x) in enumerate(trees):
        for a, b in zip(batched, fn(x)):
            np.testing.assert_array_equal(a[row], b)


# ---------------------------------------------------------------- TPU cache attention

@pytest.mark.parametrize("shape", [(2, 1, 256, 8, 2, 32), (1, 17, 384, 4, 2, 16)],
                         ids=["decode", "verify17"])
def test_tpu_cache_attention_matches_reference(shape):
    """Also the stacked cache read in place, and chunks past every row's last visible slot
    never read (NaN there changes nothing)."""
    b, t, s, nh, nkv, d = shape
    rng = np.random.default_rng(sum(shape))
    q, k, v = (_normal(rng, *sz) for sz in ((b, t, nh, d), (b, s, nkv, d), (b, s, nkv, d)))
    lengths = jnp.asarray(rng.integers(0, 100, size=b), jnp.int32)
    visible = key_visibility(lengths, t, s)
    ref = attend_reference(q, k, v, visible)
    poison = (jnp.arange(s) >= 128)[None, :, None, None]              # chunks 1.. of 128
    k, v = jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v)
    keys, values = jnp.stack([k + 1.0, k]), jnp.stack([v + 1.0, v])
    out = cache_attention_tpu(q, keys, values, visible, layer=1, block_k=128,
                              interpret=INTERPRET["mosaic_tpu"])
    np.testing.assert_allclose(out, ref, rtol=RTOL, atol=RTOL)
