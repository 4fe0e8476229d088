"""Drafters: DFlash backbone, Domino head and the HF draft converter.

* Golden fixtures (tests/fixtures/reference, computed by the reference SpecForge classes):
  context features, draft hidden, base logits, teacher-forced logits, greedy rollout.
* A small torch reference written from docs/algorithms.md §2.3 / §3.2 / §3.3 for what the
  fixtures do not cover: a populated draft cache with ragged batches, both shift_label
  settings with P in {0, 1, 2}, the GRU vs torch.nn.GRU, argmax rollout vs a python loop.
* Shapes of the real Qwen3-8B Domino drafter (jax.eval_shape) and clear error messages.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from converters.hf_draft import DRAFT_RULES, export_draft, load_draft
from converters.hf_target import load_target
from converters.table import CheckpointError, params_to_hf, read_tensors, write_tensors
from domino_jax.config import (QWEN3_8B, QWEN3_8B_DOMINO_DRAFT, ConfigError, DraftConfig,
                               check_draft_fits_target)
from domino_jax.models import dflash, domino_head
from domino_jax.models.qwen3 import TargetLM
from domino_jax.models.fused_layout import fuse_model

jax.config.update("jax_default_matmul_precision", "highest")

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "reference")
FIXTURE_NAMES = ["dflash", "domino_noshift", "domino_shift"]
RTOL = 1e-5


def head_layouts(head, embed_table):
    """The head's plain params and both decode layouts (``[W_hh | W1_s]`` with and without
    the GRU input table): every rollout check runs on all three."""
    head = domino_head.plain_params(head)
    return [head, domino_head.decode_head(head, embed_table),
            domino_head.decode_head(head, embed_table, input_table=False)]


def rel_err(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30))


def argmax_choose(logits, key):
    del key
    return jnp.argmax(logits, axis=-1)


# --------------------------------------------------------------------------- golden fixtures


@pytest.fixture(scope="module", params=[(name, fused) for name in FIXTURE_NAMES
                                        for fused in (False, True)],
                ids=lambda p: p[0] + ("-fused" if p[1] else ""))
def golden(request):
    """The reference's outputs against our models, in the checkpoint layout and in the fused
    decode layout (models/fused_layout.py)."""
    name, fused = request.param
    folder = os.path.join(FIXTURES, name)
    target_cfg, target_params = load_target(os.path.join(folder, "target"), dtype=jnp.float32)
    draft_cfg, draft_params = load_draft(os.path.join(folder, "draft"), dtype=jnp.float32)
    if fused:
        target_cfg, target_params = fuse_model(target_cfg, target_params)
        draft_cfg, draft_params = fuse_model(draft_cfg, draft_params)
        if "head" in draft_params:            # and the head's decode leaves, as load_pair does
            draft_params = dict(draft_params, head=domino_head.decode_head(
                draft_params["head"], target_params["embed_tokens"]["embedding"]))
    check_draft_fits_target(draft_cfg, target_cfg)
    outputs = dict(np.load(os.path.join(folder, "outputs.npz")))
    target = TargetLM(target_cfg, dtype=jnp.float32, param_dtype=jnp.float32)
    prompt = jnp.asarray(outputs["prompt"])
    prompt_len = prompt.shape[1]
    tap_ids = dflash.target_tap_ids(draft_cfg)
    out = jax.jit(lambda p, t: target.apply({"params": p}, t, jnp.arange(prompt_len)[None],
                                            tap_ids=tap_ids))(target_params, prompt)
    features = dflash.context_features(draft_cfg, out.taps, out.hidden)
    block_ids = jnp.asarray(outputs["block_ids"])
    block_len = block_ids.shape[1]
    block_embeds = target.apply({"params": target_params}, block_ids, method=TargetLM.embed)
    backbone = dflash.DFlashBackbone(draft_cfg, dtype=jnp.float32, param_dtype=jnp.float32)
    cache = dflash.new_draft_cache(draft_cfg, 1, 32, jnp.float32)
    draft_hidden, new_cache = jax.jit(backbone.apply)(
        {"params": draft_params["backbone"]}, features, jnp.arange(prompt_len)[None],
        jnp.array([prompt_len], jnp.int32), block_embeds,
        (prompt_len + jnp.arange(block_len))[None], cache)
    base = jax.jit(lambda p, h: target.apply({"params": p}, h, method=TargetLM.logits))(
        target_params, draft_hidden)
    return dict(name=name, outputs=outputs, target=target, target_params=target_params,
                draft_cfg=draft_cfg, draft_params=draft_params, features=features,
                block_embeds=block_embeds, draft_hidden=draft_hidden, base=base,
                new_cache=new_cache, prompt_len=prompt_len)


def test_fixture_context_features(golden):
    assert rel_err(golden["features"], golden["outputs"]["draft_context_features"]) < RTOL


def test_fixture_draft_hidden_and_base_logits(golden):
    assert rel_err(golden["draft_hidden"], golden["outputs"]["draft_hidden"]) < RTOL
    assert rel_err(golden["base"], golden["outputs"]["base_logits"]) < RTOL
    assert golden["new_cache"].lengths.tolist() == [golden["prompt_len"]]


def test_fixture_teacher_forced_logits(golden):
    cfg = golden["draft_cfg"]
    if not cfg.has_domino_head:
        pytest.skip("plain DFlash fixture has no head")
    outputs = golden["outputs"]
    prev_embeds = golden["target"].apply({"params": golden["target_params"]},
                                         jnp.asarray(outputs["teacher_prev_ids"]),
                                         method=TargetLM.embed)
    final = jax.jit(domino_head.teacher_forced_logits, static_argnums=1)(
        golden["draft_params"]["head"], cfg, golden["draft_hidden"], golden["base"], prev_embeds)
    assert rel_err(final, outputs["teacher_final_logits"]) < RTOL


def test_fixture_greedy_rollout(golden):
    cfg, outputs = golden["draft_cfg"], golden["outputs"]
    expected = outputs["greedy_draft_tokens"]           # block slots 1..B-1 (B-1 tokens)
    hidden, base = golden["draft_hidden"], golden["base"]
    if not cfg.has_domino_head:
        tokens = jnp.argmax(base[:, 1:], axis=-1)
    else:
        if not cfg.shift_label:
            hidden, base = hidden[:, 1:], base[:, 1:]
        embed_table = golden["target_params"]["embed_tokens"]["embedding"]
        rollout = jax.jit(lambda *a: domino_head.rollout(
            *a, argmax_choose, jax.random.PRNGKey(0)), static_argnums=1)
        for head in head_layouts(golden["draft_params"]["head"], embed_table):
            tokens, _ = rollout(head, cfg, hidden, base, golden["block_embeds"][:, 0],
                                embed_table)
            assert tokens.shape == (1, cfg.k_draft)
            np.testing.assert_array_equal(np.asarray(tokens)[:, :expected.shape[1]], expected)
        return
    np.testing.assert_array_equal(np.asarray(tokens), expected)


def test_draft_checkpoint_round_trip(tmp_path):
    for name in ("domino_shift", "dflash"):
        src = os.path.join(FIXTURES, name, "draft")
        cfg, params = load_draft(src, dtype=jnp.float32)
        export_draft(cfg, params, str(tmp_path / name))
        cfg2, params2 = load_draft(str(tmp_path / name), dtype=jnp.float32)
        assert cfg2 == cfg
        original = read_tensors(src)
        exported = read_tensors(str(tmp_path / name))
        assert sorted(original) == sorted(exported)
        for key in original:
            np.testing.assert_array_equal(original[key], exported[key])
        with open(tmp_path / name / "config.json") as f:
            raw = json.load(f)
        assert raw["architectures"] == ["DFlashDraftModel"] and "block_size" in raw


def test_model_prefix_accepted(tmp_path):
    src = os.path.join(FIXTURES, "domino_noshift", "draft")
    tensors = {"model." + k: v for k, v in read_tensors(src).items()}
    write_tensors(tensors, str(tmp_path))
    shutil.copy(os.path.join(src, "config.json"), tmp_path / "config.json")
    _, params = load_draft(str(tmp_path), dtype=jnp.float32)
    _, reference = load_draft(src, dtype=jnp.float32)
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, reference)


# --------------------------------------------------------------------------- torch reference


def _t(x):
    return torch.from_numpy(np.array(x, dtype=np.float64))


def torch_rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def torch_rope(x, positions, theta):
    """``x [T, heads, D]`` rotated at integer ``positions [T]`` (half split)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.as_tensor(positions, dtype=torch.float64)[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def torch_draft_forward(sd, cfg: DraftConfig, features, ctx_pos, block_embeds, block_pos,
                        cached, layer_masks=None):
    """docs/algorithms.md §2.3 for one row. ``cached``: per layer (k, v) ``[S, nKV, D]`` of earlier
    context. ``layer_masks``: per layer ``None`` (every key) or bool ``[Bk, S + Tc + Bk]``
    over ``[cached, new context, block]`` keys. Returns (draft_hidden [Bk, H], cache with the
    new context appended)."""
    eps, nh, nkv, d = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ctx = torch_rms(features @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)
    x = block_embeds
    new_cache = []
    for i in range(cfg.num_layers):
        p = lambda n: sd[f"layers.{i}.{n}"]
        h = torch_rms(x, p("input_layernorm.weight"), eps)
        q = torch_rms((h @ p("self_attn.q_proj.weight").T).reshape(-1, nh, d),
                      p("self_attn.q_norm.weight"), eps)
        both = torch.cat([ctx, h], 0)
        k = torch_rms((both @ p("self_attn.k_proj.weight").T).reshape(-1, nkv, d),
                      p("self_attn.k_norm.weight"), eps)
        v = (both @ p("self_attn.v_proj.weight").T).reshape(-1, nkv, d)
        q = torch_rope(q, block_pos, cfg.rope_theta)
        k = torch_rope(k, np.concatenate([ctx_pos, block_pos]), cfg.rope_theta)
        k = torch.cat([cached[i][0], k], 0)
        v = torch.cat([cached[i][1], v], 0)
        n_keep = cached[i][0].shape[0] + ctx.shape[0]
        new_cache.append((k[:n_keep], v[:n_keep]))            # crop: keep context only
        kk = k.repeat_interleave(nh // nkv, dim=1)
        vv = v.repeat_interleave(nh // nkv, dim=1)
        scores = torch.einsum("thd,shd->hts", q, kk) / d ** 0.5
        if layer_masks is not None and layer_masks[i] is not None:
            scores = scores.masked_fill(~torch.as_tensor(layer_masks[i])[None], -torch.inf)
        attn = torch.einsum("hts,shd->thd", scores.softmax(-1), vv).reshape(x.shape[0], -1)
        x = x + attn @ p("self_attn.o_proj.weight").T
        h = torch_rms(x, p("post_attention_layernorm.weight"), eps)
        gate = h @ p("mlp.gate_proj.weight").T
        x = x + (torch.nn.functional.silu(gate) * (h @ p("mlp.up_proj.weight").T)) \
            @ p("mlp.down_proj.weight").T
    return torch_rms(x, sd["norm.weight"], eps), new_cache


SMALL = DraftConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, intermediate_size=48, block_size=5, num_target_layers=6,
                    mask_token_id=96, target_layer_ids=(1, 4), rope_theta=10000.0,
                    projector_type="domino", pure_draft_prefix_len=1, shift_label=True,
                    emb_dim=12, gru_hidden_dim=16)


@functools.lru_cache(maxsize=None)
def _random_draft(cfg: DraftConfig, w2_scale: float = 1.0):
    """Random backbone + head params for ``cfg`` and the same tensors as a torch state dict.

    ``w2_scale`` scales ``embed_proj.2`` so corrections are large enough to flip argmaxes.
    """
    if w2_scale != 1.0:
        params, _ = _random_draft(cfg)
        head = dict(params["head"], embed_proj_2={
            "kernel": params["head"]["embed_proj_2"]["kernel"] * w2_scale})
        params = {"backbone": params["backbone"], "head": head}
    else:
        rng = jax.random.PRNGKey(0)
        noise = np.random.default_rng(0)   # norm weights are ones at init: perturb them
        backbone = jax.tree_util.tree_map_with_path(
            lambda path, x: x + 0.3 * noise.standard_normal(x.shape).astype(np.float32)
            if "norm" in jax.tree_util.keystr(path) else x, dflash.init_params(cfg, rng))
        params = {"backbone": backbone,
                  "head": domino_head.init_head_params(cfg, jax.random.fold_in(rng, 1))}
    sd = {k: _t(v) for k, v in params_to_hf(jax.tree_util.tree_map(np.asarray, params),
                                             DRAFT_RULES).items()}
    return params, sd


def draft_rounds_vs_torch(apply, sd, cfg: DraftConfig, cache, rounds, rng, layer_masks=None):
    """Successive backbone forwards ``apply(features, ctx_pos, ctx_lens, embeds, blk_pos,
    cache)`` over random inputs, one per ``(ctx_lens, rows)`` of ``rounds`` (ragged: rows
    past ``ctx_lens[b]`` are padding), each row's draft hidden asserted equal to
    :func:`torch_draft_forward`. ``layer_masks(committed_b, n)``: the reference's per-layer
    masks for a row with ``committed_b`` earlier and ``n`` new context rows. Yields
    ``(cache, torch_caches, committed)`` after each round."""
    batch = cache.batch
    n_h, bk = cfg.num_taps * cfg.hidden_size, cfg.block_size
    empty = torch.zeros(0, cfg.num_kv_heads, cfg.head_dim, dtype=torch.float64)
    torch_caches = [[(empty, empty)] * cfg.num_layers for _ in range(batch)]
    committed = np.zeros(batch, np.int64)
    for ctx_lens, rows in rounds:
        features = rng.standard_normal((batch, rows, n_h)).astype(np.float32)
        embeds = rng.standard_normal((batch, bk, cfg.hidden_size)).astype(np.float32)
        ctx_pos = committed[:, None] + np.arange(rows)[None]
        blk_pos = committed[:, None] + np.array(ctx_lens)[:, None] + np.arange(bk)[None]
        hidden, cache = apply(jnp.asarray(features), jnp.asarray(ctx_pos, jnp.int32),
                              jnp.asarray(ctx_lens, jnp.int32), jnp.asarray(embeds),
                              jnp.asarray(blk_pos, jnp.int32), cache)
        for b in range(batch):
            n = ctx_lens[b]
            masks = None if layer_masks is None else layer_masks(committed[b], n)
            ref_hidden, torch_caches[b] = torch_draft_forward(
                sd, cfg, _t(features[b, :n]), ctx_pos[b, :n], _t(embeds[b]), blk_pos[b],
                torch_caches[b], layer_masks=masks)
            assert rel_err(hidden[b], ref_hidden.numpy()) < RTOL, (ctx_lens, b)
        committed += np.array(ctx_lens)
        yield cache, torch_caches, committed


def test_backbone_with_populated_cache_matches_torch():
    """Two successive forwards, ragged context per row; hidden states and cache contents."""
    cfg = SMALL
    params, sd = _random_draft(SMALL)
    backbone = dflash.DFlashBackbone(cfg, dtype=jnp.float32, param_dtype=jnp.float32)
    apply = jax.jit(lambda *a: backbone.apply({"params": params["backbone"]}, *a))
    cache = dflash.new_draft_cache(cfg, 2, 24, jnp.float32)
    rounds = (([7, 4], 7), ([2, 3], 7))                      # padded rows beyond ctx_lens
    for cache, torch_caches, committed in draft_rounds_vs_torch(
            apply, sd, cfg, cache, rounds, np.random.default_rng(0)):
        assert cache.lengths.tolist() == committed.tolist()
        for b in range(cache.batch):                         # cache holds exactly the context
            for layer in range(cfg.num_layers):
                k_ref, v_ref = torch_caches[b][layer]
                assert k_ref.shape[0] == committed[b]
                n = committed[b]
                assert rel_err(cache.keys[layer, b, :n], k_ref.numpy()) < RTOL
                assert rel_err(cache.values[layer, b, :n], v_ref.numpy()) < RTOL


def test_backbone_without_cache_equals_empty_cache():
    cfg = SMALL
    params, _ = _random_draft(SMALL)
    backbone = dflash.DFlashBackbone(cfg, dtype=jnp.float32, param_dtype=jnp.float32)
    rng = np.random.default_rng(1)
    features = jnp.asarray(rng.standard_normal((1, 6, 2 * cfg.hidden_size)), jnp.float32)
    embeds = jnp.asarray(rng.standard_normal((1, cfg.block_size, cfg.hidden_size)), jnp.float32)
    args = (features, jnp.arange(6)[None], jnp.array([6]), embeds,
            (6 + jnp.arange(cfg.block_size))[None])
    apply = jax.jit(backbone.apply)
    with_cache, _ = apply({"params": params["backbone"]}, *args,
                          dflash.new_draft_cache(cfg, 1, 16, jnp.float32))
    without, none_cache = apply({"params": params["backbone"]}, *args, None)
    assert none_cache is None
    assert rel_err(without, with_cache) < RTOL


def test_backbone_output_rows_are_the_first_rows_of_the_full_block():
    """``output_rows=n``: the last layer queries only the first ``n`` slots; every slot still
    makes keys/values, so the ``n`` hidden states and the committed cache equal the full
    forward's (float32; with a populated cache and without one)."""
    cfg = SMALL
    params, _ = _random_draft(SMALL)
    backbone = dflash.DFlashBackbone(cfg, dtype=jnp.float32, param_dtype=jnp.float32)
    rng = np.random.default_rng(3)
    features = jnp.asarray(rng.standard_normal((2, 6, 2 * cfg.hidden_size)), jnp.float32)
    embeds = jnp.asarray(rng.standard_normal((2, cfg.block_size, cfg.hidden_size)),
                         jnp.float32)
    args = (features, jnp.tile(jnp.arange(6)[None], (2, 1)), jnp.array([6, 4]), embeds,
            jnp.stack([6 + jnp.arange(cfg.block_size), 4 + jnp.arange(cfg.block_size)]))
    apply = jax.jit(backbone.apply, static_argnames="output_rows")
    for cache in (None, dflash.new_draft_cache(cfg, 2, 32, jnp.float32)):
        full, full_cache = apply({"params": params["backbone"]}, *args, cache)
        for n in (1, 3, cfg.block_size):
            part, part_cache = apply({"params": params["backbone"]}, *args, cache,
                                     output_rows=n)
            assert part.shape == (2, n, cfg.hidden_size)
            assert rel_err(part, full[:, :n]) < 1e-5, n
            if cache is not None:
                assert part_cache.lengths.tolist() == full_cache.lengths.tolist()
                for b, committed in enumerate(full_cache.lengths.tolist()):
                    assert rel_err(part_cache.keys[:, b, :committed],
                                   full_cache.keys[:, b, :committed]) < 1e-6


def torch_gru(sd, inputs):
    """torch.nn.GRU(bias=False) over ``inputs [N, T, H]`` from zeros -> states [N, T, G]."""
    g = sd["prefix_gru.weight_hh_l0"].shape[1]
    gru = torch.nn.GRU(inputs.shape[-1], g, bias=False, batch_first=True).double()
    with torch.no_grad():
        gru.weight_ih_l0.copy_(sd["prefix_gru.weight_ih_l0"])
        gru.weight_hh_l0.copy_(sd["prefix_gru.weight_hh_l0"])
        return gru(inputs)[0]


def torch_correction(sd, z, s):
    pre = torch.cat([z, s], -1) @ sd["embed_proj.0.weight"].T
    return torch.nn.functional.silu(pre) @ sd["embed_proj.2.weight"].T


def test_gru_matches_torch():
    params, sd = _random_draft(SMALL)
    rng = np.random.default_rng(2)
    inputs = rng.standard_normal((3, 6, SMALL.hidden_size)).astype(np.float32)
    states = jax.jit(domino_head.gru_states)(params["head"], jnp.asarray(inputs))
    ref = torch_gru(sd, _t(inputs)).numpy()
    assert rel_err(states, ref) < RTOL
    state0 = rng.standard_normal((3, SMALL.gru_hidden_dim)).astype(np.float32)
    cell = torch.nn.GRUCell(SMALL.hidden_size, SMALL.gru_hidden_dim, bias=False).double()
    with torch.no_grad():
        cell.weight_ih.copy_(sd["prefix_gru.weight_ih_l0"])
        cell.weight_hh.copy_(sd["prefix_gru.weight_hh_l0"])
        ref_cell = cell(_t(inputs[:, 0]), _t(state0)).numpy()
    ours = jax.jit(domino_head.gru_cell)(params["head"], jnp.asarray(inputs[:, 0]),
                                         jnp.asarray(state0))
    assert rel_err(ours, ref_cell) < RTOL


@pytest.mark.parametrize("shift_label", [True, False])
@pytest.mark.parametrize("prefix_len", [0, 1, 2])
def test_teacher_forced_logits_match_torch(shift_label, prefix_len):
    cfg = dataclasses.replace(SMALL, shift_label=shift_label, pure_draft_prefix_len=prefix_len)
    params, sd = _random_draft(SMALL)
    rng = np.random.default_rng(3)
    n, bk = 3, cfg.block_size
    hidden = rng.standard_normal((n, bk, cfg.hidden_size)).astype(np.float32)
    base = rng.standard_normal((n, bk, cfg.vocab_size)).astype(np.float32)
    prev = rng.standard_normal((n, bk, cfg.hidden_size)).astype(np.float32)
    final = jax.jit(domino_head.teacher_forced_logits, static_argnums=1)(
        params["head"], cfg, jnp.asarray(hidden), jnp.asarray(base), jnp.asarray(prev))
    g = torch_gru(sd, _t(prev))                      # g[:, k] = state after prev_0..prev_k
    ref = _t(base).clone()
    start = prefix_len if shift_label else 1 + prefix_len
    assert start == cfg.suffix_start
    for k in range(start, bk):
        state = g[:, k] if shift_label else g[:, k - 1]
        ref[:, k] = ref[:, k] + torch_correction(sd, _t(hidden[:, k]), state)
    assert rel_err(final, ref.numpy()) < RTOL
    np.testing.assert_array_equal(np.asarray(final)[:, :start], base[:, :start])


@pytest.mark.parametrize("topm", [0, 3, 97])
@pytest.mark.parametrize("prefix_len", [0, 1, 2])
def test_argmax_rollout_matches_python_loop(prefix_len, topm):
    """``topm = 0``: full vocabulary (the reference). ``topm = M``: corrected positions choose
    among the top-M base tokens of their own position (the candidate pool); logits outside
    the pool are -inf. ``97 = V`` covers the whole vocabulary, so it equals the full path."""
    cfg = dataclasses.replace(SMALL, pure_draft_prefix_len=prefix_len)
    params, sd = _random_draft(SMALL, w2_scale=20.0)    # corrections flip argmaxes
    rng = np.random.default_rng(4)
    batch, k_draft, v = 3, cfg.k_draft, cfg.vocab_size
    assert v == 97
    hidden = rng.standard_normal((batch, k_draft, cfg.hidden_size)).astype(np.float32)
    base = rng.standard_normal((batch, k_draft, v)).astype(np.float32)
    table = rng.standard_normal((v, cfg.hidden_size)).astype(np.float32)
    root = rng.integers(0, v, batch)
    ref_tokens = np.zeros((batch, k_draft), np.int64)
    ref_logits = np.zeros((batch, k_draft, v))
    for b in range(batch):                           # docs/algorithms.md §3.3, one row at a time
        verify = [int(root[b])]
        for i in range(prefix_len):
            ref_logits[b, i] = base[b, i]
            verify.append(int(np.argmax(base[b, i])))
        state = torch_gru(sd, _t(table[verify])[None])[0, -1]
        for i in range(prefix_len, k_draft):
            logits = (_t(base[b, i]) + torch_correction(sd, _t(hidden[b, i]), state)).numpy()
            if topm:
                pool = np.argsort(-base[b, i], kind="stable")[:topm]
                logits = np.where(np.isin(np.arange(v), pool), logits, -np.inf)
            ref_logits[b, i] = logits
            verify.append(int(np.argmax(logits)))
            if i + 1 < k_draft:
                state = torch_gru(sd, _t(table[verify])[None])[0, -1]
        ref_tokens[b] = verify[1:]
    assert (ref_tokens != base.argmax(-1)).any(), "test needs corrections that change argmaxes"
    # op by op: the 9 settings x 3 layouts share the small ops' programs (half the time of
    # a jit each; the decode tests run the rollout inside the loop's jit)
    fn = lambda hp, h, bl, r, t: domino_head.rollout(                   # noqa: E731
        hp, cfg, h, bl, r, t, argmax_choose, jax.random.PRNGKey(0), candidate_topm=topm)
    for head in head_layouts(params["head"], table):
        tokens, logits = fn(head, jnp.asarray(hidden), jnp.asarray(base),
                            jnp.asarray(table[root]), jnp.asarray(table))
        assert tokens.dtype == jnp.int32 and logits.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(tokens), ref_tokens)
        finite = np.isfinite(ref_logits)
        np.testing.assert_array_equal(np.isfinite(np.asarray(logits)), finite)
        assert rel_err(np.asarray(logits)[finite], ref_logits[finite]) < RTOL


def test_sampled_rollout_uses_keys():
    params, _ = _random_draft(SMALL)
    rng = np.random.default_rng(5)
    hidden = jnp.asarray(rng.standard_normal((2, SMALL.k_draft, SMALL.hidden_size)), jnp.float32)
    base = jnp.zeros((2, SMALL.k_draft, SMALL.vocab_size), jnp.float32)
    table = jnp.asarray(rng.standard_normal((SMALL.vocab_size, SMALL.hidden_size)), jnp.float32)
    sample = lambda logits, key: jax.random.categorical(key, logits, axis=-1)
    rollout = lambda head, key: domino_head.rollout(head, SMALL, hidden, base,  # noqa: E731
                                                    table[:2], table, sample, key)[0]
    first, again, other = (rollout(params["head"], jax.random.PRNGKey(s)) for s in (0, 0, 1))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    for head in head_layouts(params["head"], table)[1:]:   # the decode layouts sample alike
        np.testing.assert_array_equal(rollout(head, jax.random.PRNGKey(0)), first)


# --------------------------------------------------------------------------- real shapes


def test_qwen3_8b_domino_drafter_shapes():
    cfg = QWEN3_8B_DOMINO_DRAFT
    check_draft_fits_target(cfg, QWEN3_8B)
    backbone = dflash.param_shapes(cfg)
    head = domino_head.head_param_shapes(cfg)
    count = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))
    assert backbone["fc"]["kernel"].shape == (20480, 4096)
    assert head["embed_proj_2"]["kernel"].shape == (256, 151936)
    assert abs(count(head) / 55.9e6 - 1) < 0.01
    assert count(head) == domino_head.head_param_count(cfg)
    assert abs(count(backbone) / 1.05e9 - 1) < 0.01
    # One draft forward over the real geometry, shapes only.
    model = dflash.DFlashBackbone(cfg)
    cache = jax.eval_shape(lambda: dflash.new_draft_cache(cfg, 2, 128))
    out = jax.eval_shape(
        lambda p, c: model.apply({"params": p}, jnp.zeros((2, 9, 20480), jnp.bfloat16),
                                 jnp.zeros((2, 9), jnp.int32), jnp.full((2,), 9, jnp.int32),
                                 jnp.zeros((2, 16, 4096), jnp.bfloat16),
                                 jnp.zeros((2, 16), jnp.int32), c), backbone, cache)
    assert out[0].shape == (2, 16, 4096) and out[1].keys.shape == (5, 2, 128, 8, 128)


# --------------------------------------------------------------------------- bad inputs


def test_draft_hidden_size_mismatch_is_named():
    bad = dataclasses.replace(QWEN3_8B_DOMINO_DRAFT, hidden_size=2560)
    with pytest.raises(ConfigError, match="hidden_size 2560 != target hidden_size 4096"):
        check_draft_fits_target(bad, QWEN3_8B)


def test_target_layer_id_past_last_layer_is_named():
    bad = dataclasses.replace(QWEN3_8B_DOMINO_DRAFT, target_layer_ids=(1, 9, 17, 25, 36))
    with pytest.raises(ConfigError, match=r"\[36\] past the last target layer 35"):
        check_draft_fits_target(bad, QWEN3_8B)


def test_mask_id_and_layer_count_mismatch_are_named():
    bad = dataclasses.replace(QWEN3_8B_DOMINO_DRAFT, mask_token_id=151936, num_target_layers=28)
    with pytest.raises(ConfigError, match="mask_token_id 151936 outside") as err:
        check_draft_fits_target(bad, QWEN3_8B)
    assert "num_target_layers 28" in str(err.value)


def test_domino_checkpoint_missing_embed_proj_is_named(tmp_path):
    src = os.path.join(FIXTURES, "domino_shift", "draft")
    tensors = read_tensors(src)
    del tensors["embed_proj.2.weight"]
    write_tensors(tensors, str(tmp_path))
    shutil.copy(os.path.join(src, "config.json"), tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=r"missing tensors: embed_proj\.2\.weight"):
        load_draft(str(tmp_path))


def test_misshaped_tensor_is_named(tmp_path):
    src = os.path.join(FIXTURES, "dflash", "draft")
    tensors = read_tensors(src)
    tensors["fc.weight"] = tensors["fc.weight"][:, :64]
    write_tensors(tensors, str(tmp_path))
    shutil.copy(os.path.join(src, "config.json"), tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=r"fc\.weight: shape \(64, 64\)"):
        load_draft(str(tmp_path))
