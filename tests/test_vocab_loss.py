"""The training loss in row chunks (domino_jax/train/vocab_loss.py): the same loss, metrics
and gradients as the whole-logits computation, for every drafter and label mode, and a
temporary-memory footprint that no longer grows with the rows. Tiny random models, CPU,
float32."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from domino_jax.config import TargetConfig
from domino_jax.models.qwen3 import TargetLM
from domino_jax.train.config import make_draft_config
from domino_jax.train.loss import draft_loss, init_draft_params
from domino_jax.train.vocab_loss import RowInputs, joint_logits, row_losses, slot_divergence
from test_train import random_target_params

TARGET = TargetConfig("qwen3", vocab_size=96, hidden_size=32, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=8, intermediate_size=64, rope_theta=10000.0)


@pytest.fixture(scope="module")
def target():
    model = TargetLM(TARGET, dtype=jnp.float32, param_dtype=jnp.float32)
    return model, random_target_params(TARGET)


def _batch(seed=0, batch=2, seq=24):
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int32)
    mask[:, :5] = 0
    mask[1, 19:] = 0
    return {"input_ids": jnp.asarray(rng.integers(0, TARGET.vocab_size, (batch, seq)), jnp.int32),
            "loss_mask": jnp.asarray(mask)}


CASES = [("domino", 0.0), ("domino", 1.0), ("domino", 0.5), ("dflash", 0.0)]


@pytest.fixture(scope="module")
def losses(target):
    """``(drafter, soft_weight) -> (whole, chunked, reference)``, each ``(loss, metrics,
    grads)`` of :data:`CASES`: whole logits, in chunks of 5 rows (48 rows: the last chunk is
    padded), and whole logits with the final logits as base plus correction (no
    ``joint_logits``). Every case in one program with the drafters' init: one compile, and XLA
    computes what the cases share (the target forward, a drafter's forward) once."""
    model, tparams = target

    def case(drafter, soft_weight, key, tparams, batch, anchor_key, lam):
        config = make_draft_config(TARGET, drafter, 1, 4, 16, 8)
        params = init_draft_params(config, key, False)
        out = []
        for chunk_rows, joint in ((0, True), (5, True), (0, False)):
            fn = functools.partial(draft_loss, target=model, config=config, num_anchors=6,
                                   gamma=3.0, compute_dtype=jnp.float32,
                                   soft_weight=soft_weight, chunk_rows=chunk_rows,
                                   joint_final=joint)
            (loss, metrics), grads = jax.value_and_grad(fn, has_aux=True)(
                params, tparams, batch, anchor_key, lam)
            out.append((loss, metrics, grads))
        return out

    run = jax.jit(lambda *args: [case(d, w, *args) for d, w in CASES])
    out = run(jax.random.PRNGKey(1), tparams, _batch(), jax.random.PRNGKey(3), jnp.float32(0.4))
    return dict(zip(CASES, out))


@pytest.mark.parametrize("drafter,soft_weight", CASES)
@pytest.mark.parametrize("against", ["chunked", "reference"])
def test_chunked_loss_equals_whole_logits(losses, drafter, soft_weight, against):
    """Chunks, and the joint final logits (``reference``: base plus correction), change
    nothing but float32 summation order."""
    whole, chunked, reference = losses[drafter, soft_weight]
    chunked = chunked if against == "chunked" else reference
    np.testing.assert_allclose(chunked[0], whole[0], rtol=1e-5)
    assert set(chunked[1]) == set(whole[1])
    for k in whole[1]:
        np.testing.assert_allclose(chunked[1][k], whole[1][k], rtol=1e-5, atol=1e-6, err_msg=k)
    flat_w, _ = jax.tree_util.tree_flatten_with_path(whole[2])
    flat_c = jax.tree_util.tree_leaves(chunked[2])
    moved = 0
    for (path, w), c in zip(flat_w, flat_c):
        np.testing.assert_allclose(c, w, rtol=2e-4, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))
        moved += bool(np.abs(np.asarray(w)).max() > 0)
    assert moved >= len(flat_c) - 1      # every trained leaf has a gradient (not a vacuous check)


def test_row_losses_match_a_direct_computation():
    rng = np.random.default_rng(0)
    rows, hidden, vocab, emb = 11, 8, 40, 4
    w_lm = jnp.asarray(rng.normal(size=(hidden, vocab)), jnp.float32)
    w2 = jnp.asarray(rng.normal(size=(emb, vocab)), jnp.float32)
    inputs = RowInputs(jnp.asarray(rng.normal(size=(rows, hidden)), jnp.float32),
                       jnp.asarray(rng.integers(0, vocab, rows), jnp.int32),
                       jnp.asarray(rng.normal(size=(rows, emb)), jnp.float32),
                       jnp.asarray(np.arange(rows) % 3 != 0))
    out = jax.jit(lambda x: row_losses(x, lambda h: h @ w_lm, w2, 0.0, chunk_rows=4))(inputs)
    joint = jax.jit(lambda x: row_losses(x, lambda h: h @ w_lm, w2, 0.0, chunk_rows=4,
                                         lm_kernel=w_lm))(inputs)
    base = np.asarray(inputs.hidden) @ np.asarray(w_lm)
    final = base + np.where(np.asarray(inputs.corrected)[:, None],
                            np.asarray(inputs.features) @ np.asarray(w2), 0.0)

    def ce(logits):
        m = logits.max(-1, keepdims=True)
        lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
        return lse - logits[np.arange(rows), np.asarray(inputs.labels)]

    np.testing.assert_allclose(out.base, ce(base), rtol=1e-5)
    np.testing.assert_allclose(out.final, ce(final), rtol=1e-5)
    np.testing.assert_array_equal(out.guess, final.argmax(-1))
    np.testing.assert_allclose(joint.final, ce(final), rtol=1e-5)
    np.testing.assert_array_equal(joint.guess, final.argmax(-1))
    np.testing.assert_allclose(slot_divergence(jnp.asarray(base), inputs.labels, None, 0.0),
                               ce(base), rtol=1e-5)


def test_chunked_loss_memory_does_not_hold_all_logits():
    """The compiled gradient's temporary memory: the whole-logits loss holds several
    ``[rows, V]`` float32 arrays; in chunks it holds a few chunks' worth."""
    rng = np.random.default_rng(0)
    rows, hidden, vocab, emb = 4096, 16, 4096, 8       # [rows, V] f32 = 64 MiB
    w_lm = jnp.asarray(rng.normal(size=(hidden, vocab)) * 0.1, jnp.float32)

    def loss(hidden_rows, features, w2, chunk_rows):
        inputs = RowInputs(hidden_rows, jnp.zeros((rows,), jnp.int32), features,
                           jnp.ones((rows,), bool))
        out = row_losses(inputs, lambda h: h @ w_lm, w2, 0.0, chunk_rows)
        return out.base.sum() + out.final.sum()

    args = (jax.ShapeDtypeStruct((rows, hidden), jnp.float32),
            jax.ShapeDtypeStruct((rows, emb), jnp.float32),
            jax.ShapeDtypeStruct((emb, vocab), jnp.float32))
    temp = {}
    for chunk in (0, 256):
        grad = jax.jit(jax.grad(functools.partial(loss, chunk_rows=chunk), argnums=(0, 1, 2)))
        temp[chunk] = grad.lower(*args).compile().memory_analysis().temp_size_in_bytes
    logits_bytes = rows * vocab * 4
    assert temp[0] >= logits_bytes                      # the whole logits, at least once
    assert temp[256] < min(logits_bytes / 3, temp[0] / 8), temp


def test_joint_logits_values_and_gradients():
    """One matmul over ``[hidden ; features]``: the values and the gradients of hidden,
    features and w2 of ``hidden @ w_lm + features @ w2``; none for the frozen head."""
    rng = np.random.default_rng(1)
    rows, hidden, vocab, emb = 7, 8, 30, 4
    args = [jnp.asarray(rng.normal(size=shape), jnp.float32)
            for shape in ((rows, hidden), (rows, emb), (hidden, vocab), (emb, vocab))]
    weights = jnp.asarray(rng.normal(size=(rows, vocab)), jnp.float32)
    plain = lambda h, f, w, w2: h @ w + f @ w2
    np.testing.assert_allclose(joint_logits(*args), plain(*args), rtol=1e-5, atol=1e-6)
    grad = lambda fn: jax.grad(lambda *a: jnp.sum(weights * fn(*a)), argnums=(0, 1, 2, 3))(*args)
    got, want = grad(joint_logits), grad(plain)
    for g, w in zip(got[:2] + got[3:], want[:2] + want[3:]):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert not np.asarray(got[2]).any()          # the head is frozen: a zero cotangent


@pytest.mark.parametrize("tied", [False, True])
def test_head_kernel_is_what_the_logits_multiply_by(tied):
    import dataclasses

    from domino_jax.train.loss import head_kernel

    config = dataclasses.replace(TARGET, tie_word_embeddings=tied)
    model = TargetLM(config, dtype=jnp.float32, param_dtype=jnp.float32)
    params = random_target_params(config)
    hidden = jnp.asarray(np.random.default_rng(2).normal(size=(3, TARGET.hidden_size)),
                         jnp.float32)
    logits = model.apply({"params": params}, hidden, method=TargetLM.logits)
    np.testing.assert_allclose(hidden @ head_kernel(model, params), logits, rtol=1e-5,
                               atol=1e-6)
