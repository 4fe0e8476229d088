"""domino_jax/train/grow.py: a grown drafter computes what the trained one did (float32,
the teacher-forced base and Domino logits of the training path), every new weight gets a
gradient, and bad sizes are refused naming the field. Tiny random models, CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from domino_jax.train.config import make_draft_config
from domino_jax.train.grow import grow_draft, grown_config
from domino_jax.train.loss import block_outputs, draft_loss, init_draft_params, sample_anchors
from test_train_recipe import F32, TARGET6, target6  # noqa: F401  (the fixture)


def _perturbed(params, seed):
    """A 'trained' drafter: the random init with every leaf moved, so no piece is at its
    init value (a zero or one the grown copy could match by accident)."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_unflatten(treedef, [
        np.asarray(x) + 0.05 * rng.standard_normal(np.shape(x)).astype(np.float32)
        for x in leaves])


@pytest.fixture(scope="module")
def trained():
    config = make_draft_config(TARGET6, "domino", 2, 4, 16, 8, mask_token_id=5)
    params = _perturbed(jax.jit(lambda k: init_draft_params(config, k, False))(
        jax.random.PRNGKey(3)), 0)
    return config, params


def _outputs(target6, config, params, ids, mask):  # noqa: F811
    target, tparams = target6
    anchors, keep = sample_anchors(jax.random.PRNGKey(7), mask, 6)
    out = jax.jit(lambda p: block_outputs(p, tparams, ids, mask, anchors, keep, target=target,
                                          config=config, gamma=3.0,
                                          compute_dtype=jnp.float32))(params)
    return np.asarray(out.base), np.asarray(out.final)


@pytest.mark.parametrize("sizes", [dict(gru_hidden_dim=24),
                                   dict(num_layers=4, gru_hidden_dim=32, emb_dim=12)])
def test_grown_drafter_computes_the_same_logits(target6, trained, sizes):  # noqa: F811
    config, params = trained
    grown, grown_params = grow_draft(config, params, jax.random.PRNGKey(9), **sizes)
    for field, size in sizes.items():
        assert getattr(grown, field) == size
    assert grown.target_layer_ids == config.target_layer_ids
    shapes = jax.tree_util.tree_map(lambda x: x.shape,
                                    init_draft_params(grown, jax.random.PRNGKey(0), False))
    assert jax.tree_util.tree_map(lambda x: x.shape, grown_params) == shapes
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(0, 64, (2, 32)), jnp.int32)
    mask = jnp.ones((2, 32), jnp.int32)
    base0, final0 = _outputs(target6, config, params, ids, mask)
    base1, final1 = _outputs(target6, grown, grown_params, ids, mask)
    np.testing.assert_allclose(base1, base0, rtol=0, atol=1e-5)
    np.testing.assert_allclose(final1, final0, rtol=0, atol=1e-5)
    # and the growth is not a no-op: the grown drafter has new weights
    assert sum(x.size for x in jax.tree_util.tree_leaves(grown_params)) > sum(
        np.size(x) for x in jax.tree_util.tree_leaves(params))


def test_every_new_weight_gets_a_gradient(target6, trained):  # noqa: F811
    """The zeroed pieces multiply nonzero activations: one step's gradient reaches them, and
    the new layer's output projections, the new GRU rows of W1 and the new W2 rows."""
    target, tparams = target6
    config, params = trained
    grown, grown_params = grow_draft(config, params, jax.random.PRNGKey(9), num_layers=3,
                                     gru_hidden_dim=24, emb_dim=12)
    rng = np.random.default_rng(2)
    batch = {"input_ids": jnp.asarray(rng.integers(0, 64, (2, 32)), jnp.int32),
             "loss_mask": jnp.ones((2, 32), jnp.int32)}
    grads = jax.jit(jax.grad(lambda p: draft_loss(
        p, tparams, batch, jax.random.PRNGKey(4), jnp.float32(0.5), target=target,
        config=grown, num_anchors=6, gamma=3.0, compute_dtype=jnp.float32)[0]))(grown_params)
    layer = grads["backbone"]["layers_2"]
    for g in (layer["self_attn"]["o_proj"]["kernel"], layer["mlp"]["down_proj"]["kernel"]):
        assert float(jnp.abs(g).max()) > 0
    h, g_old, e_old = config.hidden_size, config.gru_hidden_dim, config.emb_dim
    head = grads["head"]
    assert float(jnp.abs(head["embed_proj_0"]["kernel"][h + g_old:, :e_old]).max()) > 0
    assert float(jnp.abs(head["embed_proj_2"]["kernel"][e_old:]).max()) > 0


def test_bad_growth_is_refused(trained):
    config, _ = trained
    assert grown_config(config) == config                 # no size given: unchanged
    with pytest.raises(ValueError, match="grow num_layers: 1 is below the drafter's 2"):
        grown_config(config, num_layers=1)
    dflash = make_draft_config(TARGET6, "dflash", 2, 4, 16, 8)
    with pytest.raises(ValueError, match="grow gru_hidden_dim: a DFlash drafter"):
        grown_config(dflash, gru_hidden_dim=32)
