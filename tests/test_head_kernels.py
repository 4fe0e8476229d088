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

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from domino_jax.kv_cache import key_visibility
from domino_jax.models.domino_head import gru_update
from domino_jax.models.layers import attend_reference
from domino_jax.pallas import head_kernels as hk
from domino_jax.pallas import head_step as hs
from domino_jax.pallas import tree_step as ts
from domino_jax.pallas.cache_attention_tpu import cache_attention_tpu

VARIANTS = ["triton", "mosaic_tpu"]
INTERPRET = {"triton": True, "mosaic_tpu": pltpu.InterpretParams()}
B, K, V, E, G = 2, 4, 300, 32, 128          # 300 = 2 blocks of 128 + a partial one
RTOL = 1e-5


def _jit(fn, *args, **static):
    """``fn(*args, **static)`` under ``jit`` (``static``: the plan, flags, interpret
    settings), as the decode loop runs the kernels (op by op takes longer on the CPU)."""
    return jax.jit(functools.partial(fn, **static))(*args)


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
    parts, logits = _jit(hs.logits_argmax, *args, **kw, interpret=INTERPRET[variant])
    twin_parts, twin_logits = _jit(hs.logits_argmax_reference, *args, **kw)
    u = x["products"][:B, 3 * G:]
    plain = x["base"][:, 2] + jnp.dot(u, x["w2"], precision="highest")
    np.testing.assert_allclose(logits, plain, rtol=RTOL, atol=RTOL)
    np.testing.assert_allclose(twin_logits, plain, rtol=RTOL, atol=RTOL)
    tokens = hs.finish_choice(parts, B)
    np.testing.assert_array_equal(tokens, jnp.argmax(plain, axis=-1))
    np.testing.assert_array_equal(tokens, hs.finish_choice(twin_parts, B))
    greedy, none = _jit(hs.logits_argmax, *args, plan=plan, step=2, act_dtype=jnp.float32,
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
    token, state, products = _jit(hs.state_step, *args, **kw, interpret=INTERPRET[variant])
    twin = _jit(hs.state_step_reference, *args, **kw)
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


@pytest.mark.parametrize("split", [None, 1])
def test_row_gru_state_step_matches_twin(split):
    """Kernel B at batch 1 with ``row_gru`` (the GRU on the live row, broadcast into the
    dot's rows), also with ``split_advance`` (the products in XLA): the twin's token, state
    and products, pad rows included (a zero state)."""
    _, x = _head_inputs("triton", seed=5)
    plan = hs.plan_step("triton", 1, V, E, G, block_v=128,
                        tuning=hs.KernelTuning(row_gru=1, gru_chunk=32, split_advance=split))
    assert plan.row_gru and plan.split_advance == bool(split)
    state, products = x["state"].at[1:].set(0), x["products"].at[1:].set(0)
    parts, _ = hs.logits_argmax_reference(products, x["w2"], x["base"][:1], plan=plan,
                                          step=1, act_dtype=jnp.float32)
    args = (parts, x["table"], state, products, x["z"], x["proj"])
    ours = _jit(hs.state_step, *args, plan=plan, z_row=2, interpret=True)
    twin = _jit(hs.state_step_reference, *args, plan=plan, z_row=2)
    np.testing.assert_array_equal(ours[0], twin[0])
    for a, b in zip(ours[1:], twin[1:]):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL)
    np.testing.assert_array_equal(ours[1][1:], jnp.zeros_like(ours[1][1:]))


@pytest.mark.parametrize("variant", VARIANTS)
def test_bfloat16_step_close_to_twin(variant):
    plan, x = _head_inputs(variant, seed=3, dtype=jnp.bfloat16)
    interpret = INTERPRET[variant]
    kw = dict(plan=plan, step=1, act_dtype=jnp.bfloat16, write_logits=True)
    parts, logits = _jit(hs.logits_argmax, x["products"], x["w2"], x["base"], **kw,
                         interpret=interpret)
    twin_parts, twin_logits = _jit(hs.logits_argmax_reference, x["products"], x["w2"],
                                   x["base"], **kw)
    np.testing.assert_allclose(logits, twin_logits, rtol=1e-5, atol=1e-4)
    args = (parts, x["table"], x["state"], x["products"], x["z"], x["proj"])
    out = _jit(hs.state_step, *args, plan=plan, z_row=2, interpret=interpret)
    twin = _jit(hs.state_step_reference, *args, plan=plan, z_row=2)
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
    results = {}
    for from_base, advance in ((False, True), (True, False)):
        kw = dict(plan=plan, depth=1, from_base=from_base, advance=advance)
        ours = results[from_base] = jax.jit(functools.partial(
            ts.tree_step, **kw, interpret=INTERPRET[variant]))(*args)
        twin = jax.jit(functools.partial(ts.tree_step_reference, **kw))(*args)
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
    ours = results[False]
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

    def fn(x):
        return ts.tree_step(x["lane_score"], x["state"], x["products"], x["inputs"],
                            x["table"], x["state_proj"], plan=plan, depth=2, from_base=False,
                            interpret=True)

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


# ---------------------------------------------------------------- through the head and tree

def _small_head(seed=0):
    """A random Domino head (E 32, G 128: the TPU variant's lane tiles) in its decode layout,
    with draft inputs for a batch of 2 rows and K = 5 positions over V = 300."""
    from domino_jax.config import DraftConfig
    from domino_jax.models import domino_head as dh

    cfg = DraftConfig(vocab_size=V, hidden_size=48, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=16, intermediate_size=64, block_size=5, num_target_layers=2,
                      mask_token_id=V - 1, target_layer_ids=(0,), projector_type="domino",
                      pure_draft_prefix_len=1, shift_label=True, emb_dim=E, gru_hidden_dim=G)
    rng = np.random.default_rng(seed)
    embed = _normal(rng, V, 48, scale=0.5)
    head = dh.decode_head(dh.init_head_params(cfg, jax.random.PRNGKey(seed), jnp.float32),
                          embed)
    return cfg, head, embed, dict(hidden=_normal(rng, B, 5, 48),
                                  base=_normal(rng, B, 5, V, scale=2.0),
                                  root_embed=embed[jnp.asarray([3, 7])])


# a blocking unlike the default at every knob (the interpreter ignores warps and stages;
# row_gru acts at batch 1 only)
TUNED = hs.KernelTuning(block_v=64, emb_chunk=16, num_warps=8, num_stages=3, block_n=16,
                        gru_chunk=32, num_warps_b=2, num_stages_b=1, row_gru=1)
KERNEL_PATHS = {"twin": hk.HeadKernels("triton", twin=True),
                "triton": hk.HeadKernels("triton", interpret=True),
                "mosaic_tpu": hk.HeadKernels("mosaic_tpu", interpret=INTERPRET["mosaic_tpu"])}


@functools.cache
def _plain_rollout(temperature, topm):
    """``domino_head.rollout``'s drafts and logits on :func:`_small_head` (made once per
    setting: several kernel paths compare with it)."""
    from domino_jax.models import domino_head as dh

    cfg, head, embed, x = _small_head()

    def choose(logits, k):
        if temperature is None:
            return jnp.argmax(logits, -1).astype(jnp.int32)
        return jax.random.categorical(k, logits / temperature, axis=-1).astype(jnp.int32)

    return jax.jit(lambda *a: dh.rollout(*a, candidate_topm=topm), static_argnums=(1, 6))(
        head, cfg, x["hidden"], x["base"], x["root_embed"], embed, choose,
        jax.random.PRNGKey(5))


def _fused_rollout(kernels, temperature, batch=B, **kw):
    """``hk.fused_rollout`` on :func:`_small_head`'s first ``batch`` rows under ``jit`` (as the
    decode loop runs it; op by op the interpreter's kernels take twice as long on the CPU)."""
    cfg, head, _, x = _small_head()
    return jax.jit(lambda h, hid, base, root, key: hk.fused_rollout(
        h, cfg, hid, base, root, kernels, temperature, key, **kw))(
        head, x["hidden"][:batch], x["base"][:batch], x["root_embed"][:batch],
        jax.random.PRNGKey(5))


def _build_dominotree(args, **kw):
    """``tree.build_dominotree(*args, node_topk=3, topm=10, **kw)`` under ``jit``."""
    from domino_jax.decode import tree as tree_lib

    head, cfg, hidden, base, root_state, embed, budget = args
    return jax.jit(lambda hd, h, b, r, e: tree_lib.build_dominotree(
        hd, cfg, h, b, r, e, budget, node_topk=3, topm=10, **kw))(head, hidden, base,
                                                                   root_state, embed)


@pytest.mark.parametrize("path,temperature,topm", [
    ("twin", None, 0), ("twin", 0.8, 0), ("twin", 0.8, 7), ("triton", None, 0),
    ("triton", None, 7), ("mosaic_tpu", None, 0), ("mosaic_tpu", 0.8, 0)])
def test_fused_rollout_equals_rollout(path, temperature, topm):
    """The rollout through the step kernels (or their twins) drafts what
    ``domino_head.rollout`` drafts (argmax, Gumbel-max draws, the candidate pool) from the
    same logits."""
    tokens, logits = _plain_rollout(temperature, topm)
    ours, our_logits = _fused_rollout(KERNEL_PATHS[path], temperature, candidate_topm=topm)
    np.testing.assert_array_equal(ours, tokens)
    finite = jnp.isfinite(logits)
    np.testing.assert_array_equal(jnp.isfinite(our_logits), finite)
    np.testing.assert_allclose(jnp.where(finite, our_logits, 0), jnp.where(finite, logits, 0),
                               rtol=RTOL, atol=RTOL)


@functools.cache
def _plain_tree():
    """The plain-JAX builder's tree on :func:`_small_head` (seed 1, budget 6, node_topk 3,
    topm 10) and the arguments it was built from (made once)."""
    from domino_jax.models import domino_head as dh

    cfg, head, embed, x = _small_head(seed=1)
    root_state = dh.root_gru_state(head, x["root_embed"][0])
    args = (head, cfg, x["hidden"][0], x["base"][0], root_state, embed, 6)
    return args, _build_dominotree(args)


@pytest.mark.parametrize("path", ["twin", "mosaic_tpu"])   # Triton: the fixture decode below
def test_dominotree_through_the_kernel_equals_plain(path):
    """``build_dominotree`` with every depth step through the fused kernel gives the tree of
    the plain-JAX builder (tokens, depths, parents, validity exact; scores to 1e-5)."""
    args, plain = _plain_tree()
    fused = _build_dominotree(args, kernels=KERNEL_PATHS[path])
    for name in ("tokens", "depths", "parents", "valid"):
        np.testing.assert_array_equal(getattr(fused, name), getattr(plain, name), err_msg=name)
    np.testing.assert_allclose(fused.scores, plain.scores, rtol=RTOL, atol=RTOL)


def test_fixture_greedy_decodes_through_the_kernels():
    """The golden Domino fixture (its drafter has G = 32: the Triton variant) decoded with the
    head's steps and DominoTree's depth steps in the kernels (interpreter): the reference's
    tokens, token for token. (The twins are checked against ``rollout`` and the plain builder
    above; here only the kernels, to keep the file fast.)"""
    from decode_helpers import fixture_models, reference_greedy
    from domino_jax.decode.methods import make_drafter, method_options
    from domino_jax.decode.speculative import DecodeConfig, generate
    from domino_jax.models.domino_head import decode_head

    target, params, dcfg, dparams, outputs = fixture_models("domino_shift")
    dparams = dict(dparams, head=decode_head(dparams["head"],
                                             params["embed_tokens"]["embedding"]))
    prompt = outputs["prompt"][0].tolist()
    prompts = [prompt, [5, 6, 7]]
    ref = reference_greedy(target, params, prompts, 10)
    assert ref[0] == outputs["reference_spec_greedy_ids"][0, len(prompt):][:10].tolist()
    # (the candidate pool through the kernels: test_fused_rollout_equals_rollout)
    for method, options in (("domino", {}),
                            ("dominotree", {"budget": 6, "node_topk": 3, "topm": 12})):
        opts = method_options(method, head_kernels="pallas_interpret", **options)
        drafter = make_drafter(dcfg, target, method, opts)
        result = generate(target, params, prompts,
                          DecodeConfig(method=method, max_new_tokens=10), drafter=drafter,
                          draft_params=dparams)
        assert result.tokens == ref, (method, options)


def test_tuned_triton_kernels_equal_plain():
    """A non-default blocking (:data:`TUNED`: more, smaller blocks and chunks) drafts what
    ``domino_head.rollout`` drafts (at batch 2, and at batch 1 where ``row_gru`` acts), and
    with ``split_advance`` (the advance's products in XLA) builds the plain builder's tree,
    Triton kernels in the interpreter."""
    kernels = hk.HeadKernels("triton", interpret=True, tuning=TUNED)
    tokens, _ = _plain_rollout(None, 0)
    for batch in (2, 1):                         # rows are independent: row 0 alone too
        ours, none = _fused_rollout(kernels, None, batch, need_logits=False)
        assert none is None
        np.testing.assert_array_equal(ours, tokens[:batch])
    args, plain = _plain_tree()
    split = kernels._replace(tuning=TUNED._replace(split_advance=1))
    fused = _build_dominotree(args, kernels=split)
    for name in ("tokens", "depths", "parents", "valid"):
        np.testing.assert_array_equal(getattr(fused, name), getattr(plain, name), err_msg=name)


def test_kernel_tuning_parsed_and_checked():
    """``parse_tuning`` reads ``field=int`` lists; bad fields and values are named, and a
    tuning the shapes cannot take makes an explicit request fail fast with the reason."""
    assert hk.parse_tuning("default") == hk.parse_tuning("") == hs.KernelTuning()
    assert hk.parse_tuning("block_v=1024, num_warps=8") == hs.KernelTuning(block_v=1024,
                                                                          num_warps=8)
    for spec, match in (("blockv=4", "'blockv=4'"), ("num_warps=3", "num_warps=3"),
                        ("split_advance=2", "split_advance=2: must be 1"),
                        ("gru_chunk=x", "gru_chunk='x'"), ("block_n=0", "block_n=0"),
                        ("num_stages=2,num_stages=3", "num_stages given twice")):
        with pytest.raises(ValueError, match=match):
            hk.parse_tuning(spec)
    plan = hs.plan_step("triton", B, V, E, G, tuning=TUNED)
    assert (plan.block_v, plan.emb_chunk, plan.block_n, plan.gru_chunk) == (64, 16, 16, 32)
    assert (plan.num_warps, plan.num_stages, plan.num_warps_b, plan.num_stages_b) == (8, 3, 2, 1)
    _, head, _, _ = _small_head()
    with pytest.raises(ValueError, match="gru_chunk=48: must be a power of two >= 16 "
                                         "dividing G = 128"):
        hk.rollout_kernels("reference", head, B, V, tuning=hs.KernelTuning(gru_chunk=48))
    with pytest.raises(ValueError, match="block_n 256 does not divide"):
        hk.tree_kernels("pallas_interpret", head, 6, V, 3, 10,
                        tuning=hs.KernelTuning(block_n=256))
    assert hk.rollout_kernels("xla", head, B, V, tuning=TUNED) is None


def test_head_kernel_switch():
    """Explicit requests fail fast with the reason; ``auto`` is XLA on a CPU (no device kind
    measured faster); an unknown name is named."""
    cfg, head, embed, _ = _small_head()
    plain = head.params
    assert hk.rollout_kernels("auto", head, B, V) is None          # a CPU: never listed
    assert hk.rollout_kernels("xla", head, B, V) is None
    assert hk.rollout_kernels("reference", head, B, V) == hk.HeadKernels("triton", twin=True)
    assert hk.rollout_kernels("pallas_interpret", head, B, V).interpret is True
    with pytest.raises(ValueError, match="need a CUDA GPU"):
        hk.rollout_kernels("pallas", head, B, V)
    with pytest.raises(ValueError, match="decode layout"):
        hk.rollout_kernels("pallas_interpret", plain, B, V)
    with pytest.raises(ValueError, match="topm = 0"):
        hk.tree_kernels("reference", head, 6, V, 3, 0)
    with pytest.raises(ValueError, match="unknown head kernel implementation 'triton'"):
        hk.rollout_kernels("triton", head, B, V)
    with pytest.raises(ValueError, match="need a CUDA GPU"):
        hk.check_request("pallas", True)
    with pytest.raises(ValueError, match="input table"):
        hk.check_request("reference", False)


def test_device_tunings_apply_where_the_plan_takes_them(monkeypatch):
    """A call naming no tuning gets its device kind's measured blocking (DEVICE_TUNINGS)
    when the plan takes it for the call's shapes, else the default; a named tuning wins."""
    _, head, _, _ = _small_head()
    for kernel, by_device in hk.DEVICE_TUNINGS.items():
        for tuning in by_device.values():
            hk.check_tuning(tuning)
    kind = "NVIDIA test GPU"

    class Device:
        device_kind = kind
    monkeypatch.setattr(hk.jax, "devices", lambda *a: [Device()])
    monkeypatch.setattr(hk, "backend_variant", lambda: "triton")
    fits, too_wide = hk.KernelTuning(gru_chunk=32), hk.KernelTuning(gru_chunk=2 * G)
    named = hk.KernelTuning(emb_chunk=16)
    monkeypatch.setattr(hk, "DEVICE_TUNINGS", {"head": {kind: fits}, "tree": {kind: fits}})
    assert hk.rollout_kernels("pallas", head, B, V).tuning == fits
    assert hk.tree_kernels("pallas", head, 6, V, 3, 8).tuning == fits
    assert hk.rollout_kernels("pallas", head, B, V, tuning=named).tuning == named
    assert hk.rollout_kernels("auto", head, B, V) is None            # not in MEASURED_FASTER
    monkeypatch.setattr(hk, "MEASURED_FASTER", {"head": (kind,), "tree": ()})
    assert hk.rollout_kernels("auto", head, B, V).tuning == fits      # listed: the kernel
    assert hk.tree_kernels("auto", head, 6, V, 3, 8) is None          # listed for the head only
    monkeypatch.setattr(hk, "DEVICE_TUNINGS", {"head": {kind: too_wide}, "tree": {}})
    assert hk.rollout_kernels("pallas", head, B, V).tuning == hk.KernelTuning()
    assert hk.tree_kernels("pallas", head, 6, V, 3, 8).tuning == hk.KernelTuning()
