"""Training: lambda schedule, anchors, block mask, labels, loss decrease, sharded step,
resume, export round trip (tiny random target, CPU, float32)."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from domino_jax.config import TargetConfig
from domino_jax.models.qwen3 import TargetLM, param_shapes
from domino_jax.train import data as data_lib
from domino_jax.train.config import TrainConfig, make_draft_config
from domino_jax.train.loss import (block_visibility, labels_and_weights, lambda_schedule,
                                   sample_anchors)

TARGET = TargetConfig("qwen3", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, intermediate_size=64, rope_theta=10000.0)
SMALL = dict(draft_layers=1, block_size=4, gru_hidden_dim=16, emb_dim=8)


def random_target_params(config: TargetConfig = TARGET, seed: int = 0):
    """Random float32 params of a target, made with numpy: nothing is compiled (the
    model's own init, :func:`~domino_jax.models.qwen3.init_params`, is a program of its own
    for each geometry). The scales of that init: the embedding N(0, 1/hidden), every kernel
    N(0, 1/fan_in); norm weights 1 + N(0, 0.1) (not all ones: a copied norm differs from a
    fresh one)."""
    rng = np.random.default_rng(seed)

    def leaf(path, shape):
        if len(shape.shape) == 1:
            return 1.0 + 0.1 * rng.standard_normal(shape.shape)
        fan_in = shape.shape[-1] if "embedding" in jax.tree_util.keystr(path) else shape.shape[0]
        return rng.standard_normal(shape.shape) / np.sqrt(fan_in)

    shapes = param_shapes(config, jnp.float32)
    return jax.device_put(jax.tree_util.tree_map_with_path(
        lambda path, shape: leaf(path, shape).astype(np.float32), shapes))


@pytest.fixture(scope="module")
def target_params():
    return random_target_params()


def synthetic_examples(num: int = 32, seed: int = 0, prompt_len: int = 8, resp_len: int = 40):
    """Prompt of random tokens, response = one token repeated (trivial to draft)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        resp = np.full(resp_len, rng.integers(0, 64))
        ids = np.concatenate([rng.integers(0, 64, prompt_len), resp]).astype(np.int32)
        mask = np.r_[np.zeros(prompt_len), np.ones(resp_len)].astype(np.int32)
        out.append({"input_ids": ids, "loss_mask": mask})
    return out


def test_lambda_schedule():
    assert float(lambda_schedule(0, 10, 1.0, 0.5)) == pytest.approx(1.0)
    assert float(lambda_schedule(5, 10, 1.0, 0.5)) == pytest.approx(0.0)
    assert float(lambda_schedule(10, 10, 1.0, 0.5)) == pytest.approx(0.0)
    assert float(lambda_schedule(1, 10)) == pytest.approx(0.9)          # ratio 1.0, step from 1
    assert float(lambda_schedule(10, 10)) == pytest.approx(0.0)
    assert float(lambda_schedule(3, 0, 1.0, 0.0)) == pytest.approx(0.0)  # decay_steps >= 1


def test_learning_rate_is_optaxs_warmup_cosine_at_the_default_horizon():
    import optax

    from domino_jax.train.step import learning_rate

    for steps, ratio in ((200, 0.04), (30, 0.05), (10, 0.0)):
        cfg = TrainConfig(steps=steps, lr=3e-4, warmup_ratio=ratio)
        ref = optax.warmup_cosine_decay_schedule(0.0, 3e-4, max(1, int(steps * ratio)), steps,
                                                 end_value=0.0)
        counts = np.arange(steps + 2)
        np.testing.assert_allclose(learning_rate(cfg, counts), ref(counts), rtol=1e-5,
                                   atol=1e-10)
    cfg = TrainConfig(steps=1000, lr=1.0, warmup_ratio=0.1)
    assert float(learning_rate(cfg, 50, horizon=100)) == pytest.approx(0.5 * (1 + np.cos(
        np.pi * 40 / 90)), rel=1e-5)        # warmup 10 of a 100-step horizon, then cosine
    assert float(learning_rate(cfg, 100, horizon=100)) == 0.0


def test_fitted_horizon():
    from domino_jax.train.loop import fitted_horizon

    assert fitted_horizon(10, 5.0, 0, 0.0, 1000) == 1000           # nothing timed yet
    assert fitted_horizon(10, 5.0, 9, 0.9, 1000) == 60              # 0.1 s a step, 50 more
    assert fitted_horizon(10, 500.0, 9, 0.9, 1000) == 1000          # at most the steps
    assert fitted_horizon(10, 0.05, 9, 0.9, 1000) == 10             # no step fits: ends
    assert fitted_horizon(10, -1.0, 9, 0.9, 1000) == 10


def test_deadline_run_fits_its_schedule(target_params, tmp_path):
    """A run on a deadline with far more steps than fit ends with its schedules run out: the
    learning rate near 0, the Domino lambda at 0 (the horizon fitted at every step)."""
    result = tiny_task_run("domino", target_params, tmp_path, cfg=dict(steps=100_000),
                           max_seconds=1.5)
    last = result.history[-1]
    assert 5 < last["step"] < 100_000
    assert last["horizon"] - last["step"] <= 2, last
    assert last["lr"] < 0.02 * TINY_TASK["lr"] and last["lambda"] < 0.05, last
    peak = max(h["lr"] for h in result.history)
    assert peak > 0.5 * TINY_TASK["lr"]                             # it warmed up first


def test_anchor_sampler_validity():
    rng = np.random.default_rng(1)
    seq_len, n = 24, 6
    mask = (rng.random((16, seq_len)) < 0.6).astype(np.int32)
    mask[0] = 0                                   # no valid anchor at all
    mask[1] = 0
    mask[1, 5:8] = 1                              # exactly two valid anchors: 5, 6
    anchors, keep = jax.jit(sample_anchors, static_argnums=2)(jax.random.PRNGKey(3),
                                                              jnp.asarray(mask), n)
    anchors, keep = np.asarray(anchors), np.asarray(keep)
    assert anchors.shape == keep.shape == (16, n)
    for b in range(16):
        valid = {a for a in range(seq_len - 1) if mask[b, a] and mask[b, a + 1]}
        kept = anchors[b][keep[b]]
        assert all(a in valid for a in kept)
        assert list(kept) == sorted(set(kept))                          # sorted, distinct
        assert len(kept) == min(n, len(valid))
        assert not keep[b][len(kept):].any()                            # padding at the end
        assert (anchors[b][~keep[b]] == 0).all()
    assert list(anchors[1][keep[1]]) == [5, 6]


def test_block_mask_matches_brute_force():
    anchors = np.asarray([[2, 5, 0], [0, 3, 7]], np.int32)          # numpy: the brute force
    keep = np.asarray([[True, True, False], [True, True, True]])     # indexes them cheaply
    seq_len, bk = 10, 3
    got = np.asarray(jax.jit(block_visibility, static_argnums=(2, 3))(anchors, keep, seq_len,
                                                                         bk))
    want = np.zeros((2, 3 * bk, seq_len + 3 * bk), bool)
    for b in range(2):
        for j in range(3):
            if not keep[b, j]:
                continue
            for o in range(bk):
                q = j * bk + o
                for t in range(seq_len):
                    want[b, q, t] = t < int(anchors[b, j])
                for j2 in range(3):
                    for o2 in range(bk):
                        want[b, q, seq_len + j2 * bk + o2] = j2 == j
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("drafter", ["dflash", "domino"])
def test_labels_and_weights_table(drafter):
    config = make_draft_config(TARGET, drafter, 1, 4, 16, 8)
    ids = np.arange(10, dtype=np.int32)[None] + 100
    mask = np.asarray([[0, 0, 1, 1, 1, 1, 1, 1, 0, 0]], np.int32)
    anchors, keep = np.asarray([[2, 6]]), np.asarray([[True, True]])
    gamma = 2.0
    labels, weights = jax.device_get(jax.jit(labels_and_weights, static_argnums=(0, 5))(
        config, ids, mask, anchors, keep, gamma))
    for j, a in enumerate([2, 6]):
        for k in range(4):
            pos = a + k + (1 if config.shift_label else 0)
            if config.shift_label:
                w = np.exp(-k / gamma)
            else:
                w = 0.0 if k == 0 else np.exp(-(k - 1) / gamma)
            w *= float(pos < 10 and mask[0, min(pos, 9)] > 0)
            assert float(weights[0, j, k]) == pytest.approx(w, rel=1e-6)
            if w > 0:
                assert int(labels[0, j, k]) == 100 + pos


# the tiny task's run: 30 steps of two micro-batches, a learned mask token; the resume test
# reruns the Domino one interrupted, the sharded test the DFlash one's first steps (the
# checkpoint cadence is not part of the compiled step: all of a drafter's runs share one)
TINY_TASK = dict(steps=30, batch_size=8, micro_batches=2, max_length=48, num_anchors=16,
                 lr=3e-2, warmup_ratio=0.05, learned_mask=True, compute_dtype="float32",
                 log_every=1, checkpoint_every=1000)


def tiny_task_run(drafter: str, target_params, out, **kw):
    from domino_jax.train.loop import train

    cfg = TrainConfig(drafter=drafter, **dict(TINY_TASK, **kw.pop("cfg", {})))
    return train(cfg, None, None, str(out), examples=synthetic_examples(),
                 target=TargetLM(TARGET), target_params=target_params, export=False,
                 progress=False, **SMALL, **kw)


@pytest.fixture(scope="module")
def tiny_task_runs(target_params, tmp_path_factory):
    """``drafter -> TrainResult`` of the uninterrupted tiny-task run, each trained once."""
    runs: dict = {}

    def get(drafter: str):
        if drafter not in runs:
            runs[drafter] = tiny_task_run(drafter, target_params,
                                          tmp_path_factory.mktemp(f"tiny_{drafter}"))
        return runs[drafter]

    return get


@pytest.mark.parametrize("drafter", ["dflash", "domino"])
def test_loss_falls_on_tiny_task(drafter, tiny_task_runs):
    result = tiny_task_runs(drafter)
    losses = [h["loss"] for h in result.history]
    first, last = np.mean(losses[:3]), np.mean(losses[-3:])
    assert last < 0.7 * first, (first, last)
    if drafter == "domino":
        lams = [h["lambda"] for h in result.history]
        assert lams[0] == pytest.approx(1 - 1 / 30) and lams[-1] == pytest.approx(0.0)


def test_resume_gives_identical_steps(tiny_task_runs, target_params, tmp_path):
    """The Domino tiny-task run interrupted after step 20 (checkpoints every 10 steps) and
    resumed: steps 21..30 and the final params equal the uninterrupted run's."""
    full = tiny_task_runs("domino")
    cut = dict(cfg=dict(checkpoint_every=10))
    tiny_task_run("domino", target_params, tmp_path, stop_after=20, **cut)
    resumed = tiny_task_run("domino", target_params, tmp_path, resume=True, **cut)
    by_step = {h["step"]: h["loss"] for h in full.history}
    assert [h["step"] for h in resumed.history] == list(range(21, 31))
    for h in resumed.history:
        assert h["loss"] == pytest.approx(by_step[h["step"]], rel=1e-6, abs=1e-7)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                           full.params, resumed.params)


def test_export_load_identical_logits(target_params, tmp_path):
    from domino_jax.models import dflash
    from domino_jax.train.loop import export_trained_draft, load_trained_draft
    from domino_jax.train.loss import init_draft_params

    config = make_draft_config(TARGET, "domino", 1, 4, 16, 8)
    params = jax.jit(lambda t: init_draft_params(config, jax.random.PRNGKey(5), True, t))(
        target_params)
    export_trained_draft(config, params, str(tmp_path))
    loaded_config, loaded = load_trained_draft(str(tmp_path), jnp.float32)
    assert loaded_config == config
    assert set(loaded) == {"backbone", "head", "mask_embedding"}
    np.testing.assert_array_equal(loaded["mask_embedding"], params["mask_embedding"])
    model = dflash.DFlashBackbone(config, dtype=jnp.float32, param_dtype=jnp.float32)
    rng = np.random.default_rng(0)
    feats = jnp.asarray(rng.normal(size=(2, 5, config.num_taps * 32)), jnp.float32)
    blk = jnp.asarray(rng.normal(size=(2, 4, 32)), jnp.float32)
    ctx_pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    blk_pos = 5 + jnp.broadcast_to(jnp.arange(4), (2, 4))
    lens = jnp.asarray([5, 3])
    run = jax.jit(lambda p: model.apply({"params": p["backbone"]}, feats, ctx_pos, lens, blk,
                                        blk_pos)[0])           # one program for both trees
    np.testing.assert_array_equal(np.asarray(run(params)), np.asarray(run(loaded)))


def test_mask_embedding_used_by_chain_drafter(target_params):
    """Inference puts the learned mask embedding in block slots 1..B-1 (as training does)."""
    from domino_jax.decode.methods import make_drafter

    config = make_draft_config(TARGET, "dflash", 1, 4)
    drafter = make_drafter(config, TargetLM(TARGET, dtype=jnp.float32,
                                            param_dtype=jnp.float32), "dflash")
    mask = jnp.arange(32, dtype=jnp.float32)
    embeds, _ = drafter.block_inputs(target_params, jnp.asarray([3]), jnp.asarray([7]),
                                     {"mask_embedding": mask})
    np.testing.assert_array_equal(embeds[0, 1:], np.broadcast_to(mask, (3, 32)))
    np.testing.assert_array_equal(embeds[0, 0], target_params["embed_tokens"]["embedding"][3])


def test_batches_are_deterministic_and_cover_epochs():
    ex = synthetic_examples(10)
    a = data_lib.batch_for_step(ex, 3, 4, 2, 32, seed=1)
    b = data_lib.batch_for_step(ex, 3, 4, 2, 32, seed=1)
    assert a["input_ids"].shape == (2, 2, 32)
    np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
    it = data_lib.batches(ex, 5, 1, 48, seed=0, num_steps=2)        # one epoch = 2 steps
    rows = np.concatenate([bt["input_ids"][0] for bt in it])
    assert len({r.tobytes() for r in rows}) == 10


def test_prompts_split_and_storage(tmp_path):
    prompts = data_lib.build_prompts(300, seed=0)
    assert len(prompts) == len(set(prompts)) == 300
    assert any("step by step" in p for p in prompts) and any("```python" in p for p in prompts)
    train, held = data_lib.split_prompts(prompts, 0.1)
    assert set(train).isdisjoint(held) and len(train) + len(held) == 300 and held
    assert data_lib.split_prompts(prompts, 0.1) == (train, held)
    ex = synthetic_examples(3)
    for name in ("d.npz", "d.jsonl"):
        data_lib.save_dataset(str(tmp_path / name), ex)
        back = data_lib.load_dataset(str(tmp_path / name))
        for x, y in zip(ex, back):
            np.testing.assert_array_equal(x["input_ids"], y["input_ids"])
            np.testing.assert_array_equal(x["loss_mask"], y["loss_mask"])


def test_generate_dataset_masks_response(target_params):
    target = TargetLM(TARGET, dtype=jnp.float32, param_dtype=jnp.float32)
    encode = lambda p: [1 + (ord(c) % 60) for c in p]
    ex = data_lib.generate_dataset(target, target_params, encode, ["ab", "hello", "xyz!"],
                                   max_new_tokens=5, batch_size=3, stop_token_ids=())
    assert len(ex) == 3
    for p, e in zip(["ab", "hello", "xyz!"], ex):
        assert list(e["input_ids"][:len(p)]) == encode(p)
        assert list(e["loss_mask"]) == [0] * len(p) + [1] * 5


def sharded_child(out: str) -> None:
    """8 simulated CPU devices: the tiny-task DFlash run's first 2 steps on a (2, 2, 2) mesh,
    the drafter fsdp-sharded -> ``out/sharded.npz`` (the step-2 loss and the params)."""
    import flax.traverse_util

    jax.config.update("jax_default_matmul_precision", "highest")
    assert len(jax.devices()) == 8
    mesh = dict(mesh_data=2, mesh_fsdp=2, mesh_tensor=2, shard_drafter=True)
    result = tiny_task_run("dflash", random_target_params(), os.path.join(out, "run"),
                           stop_after=2, cfg=mesh)
    np.savez(os.path.join(out, "sharded.npz"), loss=result.history[-1]["loss"],
             **flax.traverse_util.flatten_dict(result.params, sep="/"))


def test_sharded_step_equals_single_device(target_params, tmp_path):
    """Two steps of the tiny-task DFlash run (two micro-batches, a learned mask token) on a
    (2, 2, 2) mesh of 8 simulated devices (a subprocess: the device count is fixed when jax
    starts) equal the same steps on one device (here: the tiny-task run's compiled step)."""
    import flax.traverse_util

    one = tiny_task_run("dflash", target_params, tmp_path / "one", stop_after=2)
    # the simulated devices, and this process's XLA flags (tests/conftest.py's cheap compile)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join((
        "--xla_force_host_platform_device_count=8", os.environ.get("XLA_FLAGS", ""))))
    code = f"import tests.test_train as t; t.sharded_child({str(tmp_path)!r})"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sharded = np.load(tmp_path / "sharded.npz")
    assert [h["step"] for h in one.history] == [1, 2]
    l1, l8 = one.history[-1]["loss"], float(sharded["loss"])
    assert abs(l1 - l8) <= 1e-5 * abs(l1), (l1, l8)
    p1 = flax.traverse_util.flatten_dict(one.params, sep="/")
    assert set(p1) == set(sharded.files) - {"loss"} and "mask_embedding" in p1
    for name, value in p1.items():
        np.testing.assert_allclose(value, sharded[name], rtol=1e-4, atol=1e-5, err_msg=name)
