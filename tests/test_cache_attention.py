"""The split-K Pallas cache-attention kernel (``domino_jax/pallas/cache_attention.py``), run in
the Pallas interpreter on the CPU, against ``layers.attend_reference`` and the kernel's
plain-JAX twin ``cache_attention_reference``; the ``attend(implementation=)`` switch; and whole
greedy decodes with the kernel in the target and the drafter.

``./dev test`` runs this file in its own pytest process: after these interpreter runs, jaxlib
0.11.2's CPU compiler segfaulted compiling a later tree-decode loop in the same process (see
``dev``).

Float32 tolerance: ``max |kernel - attend_reference| <= ATOL = 1e-5`` (outputs are averages of
N(0, 1) values, |out| <~ 3; the two differ in summation order only). bf16: ``2e-2`` absolute
(probabilities are rounded before normalisation in the kernel, after it in the reference).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from domino_jax.kv_cache import align_slots, key_visibility
from domino_jax.models.layers import attend, attend_cache_layer, attend_reference
from domino_jax.pallas import ATTENTION_IMPLEMENTATIONS
from domino_jax.pallas import cache_attention as ca

ATOL = 1e-5

# (batch, queries T, keys S, query heads nH, kv heads nKV, head dim D)
SHAPES = [
    (1, 1, 128, 8, 2, 32),     # AR step, group 4, 2 chunks of 64
    (2, 1, 96, 4, 4, 16),      # MHA, chunks of 32, ragged lengths
    (2, 5, 80, 4, 2, 16),      # short verify, chunks of 16
    (1, 17, 256, 8, 2, 32),    # Domino verify rows (17 x 4 = 68 -> 128-row tile)
    (1, 16, 1024, 16, 2, 16),  # many chunks: several per run
]
IDS = [f"B{b}-T{t}-S{s}-nH{h}-nKV{k}-D{d}" for b, t, s, h, k, d in SHAPES]


def _inputs(shape, dtype, seed, tree=False):
    """q/k/v and ``visible`` as the decode builds it: committed prefix + causal (or a random
    tree mask over) the new rows, ragged committed lengths per batch row."""
    b, t, s, nh, nkv, d = shape
    rng = np.random.default_rng(seed)
    cast = lambda x: jnp.asarray(x, dtype)
    q, k, v = (cast(rng.normal(size=sz)) for sz in
               ((b, t, nh, d), (b, s, nkv, d), (b, s, nkv, d)))
    lengths = jnp.asarray(rng.integers(0, s - t + 1, size=b), jnp.int32)
    block_mask = None
    if tree:
        lower = np.tril(rng.random((b, t, t)) < 0.5)
        block_mask = jnp.asarray(lower | np.eye(t, dtype=bool)[None])
    return q, k, v, key_visibility(lengths, t, s, block_mask)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_kernel_matches_reference_float32(shape, tree):
    q, k, v, visible = _inputs(shape, jnp.float32, seed=sum(shape), tree=tree)
    ref = attend_reference(q, k, v, visible)
    ours = ca.cache_attention(q, k, v, visible, interpret=True)
    twin = jax.jit(ca.cache_attention_reference)(q, k, v, visible)
    assert ours.shape == q.shape and ours.dtype == jnp.float32
    for name, out in (("kernel", ours), ("cache_attention_reference", twin)):
        diff = float(jnp.max(jnp.abs(out - ref)))
        assert diff <= ATOL, f"max |{name} - attend_reference| = {diff:.3e}"


def test_kernel_bfloat16_close_to_reference():
    q, k, v, visible = _inputs((1, 17, 256, 8, 2, 32), jnp.bfloat16, seed=3)
    ours = ca.cache_attention(q, k, v, visible, interpret=True)
    ref = attend_reference(q, k, v, visible)
    assert ours.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2, rtol=1e-2)


def test_slots_past_the_last_visible_chunk_are_never_read():
    """NaN keys *and* values from the first chunk past every row's ``key_end``: the reference
    (which reads them) turns NaN, the kernel (which skips them) does not."""
    shape = (2, 1, 256, 8, 2, 32)
    q, k, v, _ = _inputs(shape, jnp.float32, seed=5)
    lengths = jnp.asarray([40, 100], jnp.int32)
    visible = key_visibility(lengths, 1, 256)
    clean = attend_reference(q, k, v, visible)
    poison = (jnp.arange(256) >= 128)[None, :, None, None]     # chunks of 64: 2 and 3
    k_bad, v_bad = jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v)
    assert bool(jnp.any(jnp.isnan(attend_reference(q, k_bad, v_bad, visible))))
    ours = ca.cache_attention(q, k_bad, v_bad, visible, interpret=True)
    np.testing.assert_allclose(ours, clean, atol=ATOL)


def test_split_plan_and_key_end():
    assert ca.pick_block_k(768) == 64 and ca.pick_block_k(80) == 16 and ca.pick_block_k(40) is None
    splits, per = ca.plan_splits(2304, 64, 1, 8)        # 36 chunks, 8 heads -> 32 wanted
    assert splits * per >= 36 and (splits - 1) * per < 36 and 8 * splits >= 128
    assert ca.plan_splits(64, 64, 1, 8) == (1, 1)
    assert ca.query_rows(1, 4) == 16 and ca.query_rows(17, 4) == 128
    visible = key_visibility(jnp.asarray([5, 0], jnp.int32), 3, 20)
    np.testing.assert_array_equal(ca.key_end(visible), [8, 3])
    assert align_slots(785) == 832 and align_slots(768) == 768


def test_unsupported_shapes_name_the_reason():
    assert "multiple of 16" in ca.supported((1, 1, 8, 32), (1, 100, 2, 32))
    assert "power of two" in ca.supported((1, 1, 8, 24), (1, 128, 2, 24))
    assert "exceed" in ca.supported((1, 512, 8, 32), (1, 1024, 2, 32))
    assert ca.supported((1, 17, 32, 128), (1, 2304, 8, 128)) is None
    q, k, v, visible = _inputs((1, 1, 128, 8, 2, 32), jnp.float32, seed=1)
    with pytest.raises(ValueError, match="multiple of 16"):
        ca.cache_attention(q, k[:, :100], v[:, :100], visible[..., :100], interpret=True)


def test_attend_switch():
    q, k, v, visible = _inputs((1, 2, 64, 4, 2, 16), jnp.float32, seed=2)
    xla = attend(q, k, v, visible)
    assert set(ATTENTION_IMPLEMENTATIONS) == {"auto", "xla", "reference", "pallas",
                                              "pallas_interpret", "blockwise", "cudnn"}
    np.testing.assert_array_equal(attend(q, k, v, visible, "auto"), xla)   # CPU: XLA path
    np.testing.assert_allclose(attend(q, k, v, visible, "reference"), xla, atol=ATOL)
    np.testing.assert_allclose(attend(q, k, v, visible, "pallas_interpret"), xla, atol=ATOL)
    with pytest.raises(ValueError, match="needs a GPU"):
        attend(q, k, v, visible, "pallas")
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'"):
        attend(q, k, v, visible, "flash")
    with pytest.raises(ValueError, match="multiple of 16"):
        attend(q, k[:, :40], v[:, :40], visible[..., :40], "pallas_interpret")


def test_stacked_cache_read_in_place_equals_the_layer_slice():
    """``layer=``: the kernel indexes the stacked ``[L, B, S, nKV, D]`` cache itself (no slice
    for XLA to copy out) and gives exactly what it gives on the slice;
    ``attend_cache_layer`` routes every implementation to the same numbers."""
    q, k, v, visible = _inputs((2, 3, 128, 8, 2, 32), jnp.float32, seed=9)
    rng = np.random.default_rng(10)
    keys = jnp.asarray(rng.normal(size=(3,) + k.shape), jnp.float32).at[1].set(k)
    values = jnp.asarray(rng.normal(size=(3,) + v.shape), jnp.float32).at[1].set(v)
    sliced = ca.cache_attention(q, k, v, visible, interpret=True)
    stacked = ca.cache_attention(q, keys, values, visible, layer=1, interpret=True)
    np.testing.assert_array_equal(stacked, sliced)
    ref = attend_reference(q, k, v, visible)
    for impl in ("xla", "reference", "pallas_interpret", "auto"):
        out = attend_cache_layer(q, keys, values, 1, visible, impl)
        np.testing.assert_allclose(out, ref, atol=ATOL, err_msg=impl)
    with pytest.raises(ValueError, match="layer 3 out of range for a cache of 3 layers"):
        ca.cache_attention(q, keys, values, visible, layer=3, interpret=True)


# ------------------------------------------------------------------ whole decodes, CPU


def test_fixture_greedy_with_kernel_in_target_and_drafter():
    """The golden Domino fixture decoded with every cache attention in the kernel (target
    verify/AR steps, prefill, DFlash drafter): the reference's tokens, token for token."""
    from decode_helpers import fixture_models, reference_greedy
    from domino_jax.decode.methods import make_drafter
    from domino_jax.decode.speculative import DecodeConfig, generate
    from domino_jax.models.qwen3 import TargetLM

    target, params, dcfg, dparams, outputs = fixture_models("domino_shift")
    prompt = outputs["prompt"][0].tolist()
    expected = outputs["reference_spec_greedy_ids"][0, len(prompt):].tolist()
    kernel_target = TargetLM(target.config, dtype=target.dtype, param_dtype=target.param_dtype,
                             attention_impl="pallas_interpret")
    prompts = [prompt, [5, 6, 7]]
    ref = reference_greedy(target, params, prompts, 12)
    assert ref[0] == expected[:12]
    for method in ("ar", "domino"):
        drafter = None if method == "ar" else make_drafter(dcfg, kernel_target, method)
        assert drafter is None or drafter.backbone.attention_impl == "pallas_interpret"
        result = generate(kernel_target, params, prompts,
                          DecodeConfig(method=method, max_new_tokens=12), drafter=drafter,
                          draft_params=dparams)
        assert result.tokens == ref, method
