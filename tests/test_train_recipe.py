"""Training recipe options (issue 15 items 4 and 6): soft / mix labels against an
independent torch + numpy computation, position weights, the base-anchored curriculum,
draft layers seeded from target layers, every drafter size of the GPU sweep, the mask-token
default (no learned mask) and the export warning. Tiny random models, CPU, float32."""

from __future__ import annotations

import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from domino_jax.config import TargetConfig
from domino_jax.models.qwen3 import TargetLM, init_params
from domino_jax.train.config import TrainConfig, default_mask_token_id, make_draft_config
from domino_jax.train.loss import (block_outputs, copy_target_layers, draft_loss,
                                   init_draft_params, labels_and_weights, lambda_schedule,
                                   sample_anchors, target_layers_for_init)
from test_train import random_target_params

TARGET6 = TargetConfig("qwen3", vocab_size=64, hidden_size=32, num_layers=6, num_heads=4,
                       num_kv_heads=2, head_dim=8, intermediate_size=64, rope_theta=10000.0)
F32 = dict(dtype=jnp.float32, param_dtype=jnp.float32)


@pytest.fixture(scope="module")
def target6():
    return TargetLM(TARGET6, **F32), random_target_params(TARGET6)


def text_examples(num: int, length: int, seed: int = 0, vocab: int = 64) -> list[dict]:
    """Plain 'text' (loss_mask all ones): a repeating pattern a soft-label drafter can learn."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        start = rng.integers(0, vocab)
        ids = ((start + 3 * np.arange(length)) % vocab).astype(np.int32)
        out.append({"input_ids": ids, "loss_mask": np.ones(length, np.int32)})
    return out


def jit_init(config, learned_mask=False, tparams=None, rule="none"):
    """:func:`init_draft_params` under jit (the same values as eagerly, much faster)."""
    return jax.jit(lambda t: init_draft_params(config, jax.random.PRNGKey(1), learned_mask, t,
                                               rule))(tparams)


@pytest.fixture(scope="module")
def plain_text_run(target6, tmp_path_factory):
    """One short Domino run with soft labels on plain text (loss_mask all ones), the
    curriculum at lambda_start 0.8 / decay_ratio 0.5, uniform position weights and the
    default mask (the target folder has no tokenizer here: vocab_size - 1); exported."""
    from domino_jax.train.loop import train

    target, tparams = target6
    cfg = TrainConfig(drafter="domino", steps=16, batch_size=8, max_length=32, num_anchors=8,
                      lr=3e-2, warmup_ratio=0.05, compute_dtype="float32", log_every=1,
                      checkpoint_every=1000, labels="soft", lambda_start=0.8, decay_ratio=0.5,
                      position_weights="uniform")
    handler = _Collect()
    logging.getLogger().addHandler(handler)
    try:
        result = train(cfg, None, None, str(tmp_path_factory.mktemp("plain")),
                       examples=text_examples(32, 32), target=target, target_params=tparams,
                       progress=False, draft_layers=1, block_size=4, gru_hidden_dim=16,
                       emb_dim=8)
    finally:
        logging.getLogger().removeHandler(handler)
    return result, handler.records


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


# ----------------------------------------------------------------------------- soft labels

@pytest.fixture(scope="module")
def hf_tiny(hf_checkpoints, float32_target):
    model, folder = hf_checkpoints("qwen3", False)
    config, params, target = float32_target(folder)
    return model, config, params, target


# no-shift slots (DFlash) with pure soft labels; shifted Domino slots with a mix (no-shift
# Domino: the alignment test below)
CASES = [("dflash", False, 1.0), ("domino", True, 0.25)]
SOFT_SEQ = 20


@pytest.fixture(scope="module")
def soft_label_cases(hf_tiny):
    """Two rows ``ids`` (0: a prompt and the target's greedy continuation in torch, the
    prompt masked; 1: random text, padded), torch's log-probs of them, and per case of
    :data:`CASES` the anchors, :func:`block_outputs` (soft labels) and :func:`draft_loss`
    metrics (lambda 0.4) of a fresh drafter: every case in one program (one compile; the
    target forward they share computed once)."""
    import torch

    from tests.conftest import hf_forward

    model, tconfig, tparams, target = hf_tiny
    rng = np.random.default_rng(2)
    seq = SOFT_SEQ
    with torch.no_grad():                             # row 0: prompt + greedy response
        greedy = model.generate(torch.as_tensor(rng.integers(0, 128, (1, 5))),
                                max_new_tokens=seq - 5, min_new_tokens=seq - 5,
                                do_sample=False, pad_token_id=0).numpy()
    ids = np.concatenate([greedy, rng.integers(0, 128, (1, seq))]).astype(np.int32)
    mask = np.ones((2, seq), np.int32)
    mask[0, :5] = 0                                   # the prompt
    mask[1, 15:] = 0                                  # row 1: random text, padded
    configs = {case: make_draft_config(tconfig, case[0], 1, 4, 16, 8, shift_label=case[1])
               for case in CASES}

    def run(init_key, tparams, ids, mask, key):
        out = {}
        for case, config in configs.items():
            static = dict(target=target, config=config, gamma=3.0, compute_dtype=jnp.float32)
            params = init_draft_params(config, init_key, False)
            anchors, keep = sample_anchors(key, mask, 6)
            blocks = block_outputs(params, tparams, ids, mask, anchors, keep, soft=True,
                                   **static)
            _, metrics = draft_loss(params, tparams, {"input_ids": ids, "loss_mask": mask},
                                    key, jnp.float32(0.4), num_anchors=6,
                                    soft_weight=case[2], **static)
            out[case] = (anchors, blocks, metrics)
        return out

    outs = jax.jit(run)(jax.random.PRNGKey(1), tparams, jnp.asarray(ids), jnp.asarray(mask),
                        jax.random.PRNGKey(7))
    return ids, _log_softmax(hf_forward(model, ids)[0]), outs


@pytest.mark.parametrize("drafter,shift,soft_weight", CASES)
def test_soft_labels_match_torch(soft_label_cases, drafter, shift, soft_weight):
    """The soft label of every trained block slot is torch's next-token distribution from
    the row before the slot's label position; on the target's own greedy continuation its
    argmax is the data token (a one-row shift would break this); loss_base / loss_final
    equal the numpy KL (soft, ``soft_weight`` 1) and (1-w) CE + w KL (mix) of the drafter's
    logits, and loss = (1 - lambda) loss_final + lambda loss_base."""
    ids, torch_logp, outs = soft_label_cases                   # torch_logp [2, S, V]
    anchors, out, m = outs[drafter, shift, soft_weight]
    seq = SOFT_SEQ
    anchors, weights = np.asarray(anchors), np.asarray(out.weights).reshape(2, -1, 4)
    got = np.asarray(out.target_logp).reshape(2, anchors.shape[1], 4, -1)
    want = np.zeros_like(got, np.float64)
    checked = 0
    for b in range(2):
        for j, a in enumerate(anchors[b]):
            for k in range(4):
                label_pos = a + k + (1 if shift else 0)
                want[b, j, k] = torch_logp[b, min(max(label_pos - 1, 0), seq - 1)]
                if weights[b, j, k] > 0:
                    np.testing.assert_allclose(got[b, j, k], want[b, j, k], rtol=1e-5, atol=1e-5)
                    assert int(out.labels.reshape(2, -1, 4)[b, j, k]) == ids[b, label_pos]
                    if b == 0:
                        assert int(np.argmax(got[b, j, k])) == ids[b, label_pos]
                    checked += 1
    assert checked >= 20
    if not shift:
        assert not weights[:, :, 0].any()             # slot 0 is never trained

    w = weights.reshape(-1, 4).astype(np.float64)
    p_target = np.exp(want.reshape(-1, 4, want.shape[-1]))
    labels = np.asarray(out.labels)

    def expected(logits, soft_weight):
        logp = _log_softmax(np.asarray(logits))
        kl = (p_target * (np.log(np.maximum(p_target, 1e-300)) - logp)).sum(-1)
        ce = -np.take_along_axis(logp, labels[..., None], -1)[..., 0]
        return (w * ((1 - soft_weight) * ce + soft_weight * kl)).sum() / (w.sum() + 1e-6)

    assert float(m["loss_base"]) == pytest.approx(expected(out.base, soft_weight), rel=1e-5)
    if out.final is not None:
        assert float(m["loss_final"]) == pytest.approx(expected(out.final, soft_weight),
                                                       rel=1e-5)
        assert float(m["loss"]) == pytest.approx(
            0.6 * float(m["loss_final"]) + 0.4 * float(m["loss_base"]), rel=1e-6)
    assert 0.0 <= float(m["acc_target"]) <= 1.0


def test_soft_labels_train_on_plain_text_with_the_curriculum(plain_text_run):
    """Soft labels learn from plain text (no generation); the base-anchored curriculum of
    §3.4: the logged lambda is 0.8 (1 - min(t / 8, 1)) (lambda_start 0.8, decay_ratio 0.5,
    16 steps, t from 1) and every step's loss is (1 - lambda) L_final + lambda L_base."""
    result, _ = plain_text_run
    losses = [h["loss"] for h in result.history]
    assert np.mean(losses[-3:]) < 0.7 * np.mean(losses[:3]), losses
    assert all("acc_target" in h for h in result.history)
    lams = {h["step"]: h["lambda"] for h in result.history}
    assert lams == pytest.approx({t: 0.8 * (1 - min(t / 8, 1.0)) for t in range(1, 17)})
    for h in result.history:
        assert h["loss"] == pytest.approx((1 - h["lambda"]) * h["loss_final"]
                                          + h["lambda"] * h["loss_base"], rel=1e-5)
    assert result.history[-1]["loss_final"] != result.history[-1]["loss_base"]


def test_label_mode_config():
    assert TrainConfig(labels="mix", soft_weight=0.3).soft_label_weight == 0.3
    assert TrainConfig(labels="hard", soft_weight=0.3).soft_label_weight == 0.0
    assert TrainConfig(labels="soft").soft_label_weight == 1.0
    with pytest.raises(ValueError, match="labels"):
        TrainConfig(labels="kl")
    with pytest.raises(ValueError, match="soft_weight"):
        TrainConfig(labels="mix", soft_weight=1.5)


# ----------------------------------------------------------------------------- weights

@pytest.mark.parametrize("drafter", ["dflash", "domino"])
def test_uniform_position_weights(drafter):
    config = make_draft_config(TARGET6, drafter, 1, 4, 16, 8)
    ids = jnp.arange(12, dtype=jnp.int32)[None]
    mask = jnp.asarray([[0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]], jnp.int32)
    anchors, keep = jnp.asarray([[1, 6, 0]]), jnp.asarray([[True, True, False]])
    table = jax.jit(labels_and_weights, static_argnums=(0, 5, 6))    # one program a setting
    _, decay = table(config, ids, mask, anchors, keep, 2.0, "decay")
    labels, uniform = table(config, ids, mask, anchors, keep, 2.0, "uniform")
    decay, uniform = np.asarray(decay), np.asarray(uniform)
    np.testing.assert_array_equal(uniform > 0, decay > 0)           # same slots trained
    assert set(np.unique(uniform)) <= {0.0, 1.0}
    first = 0 if config.shift_label else 1
    assert decay[0, 0, first] == pytest.approx(1.0)
    assert decay[0, 0, first + 1] == pytest.approx(np.exp(-1 / 2.0))
    with pytest.raises(ValueError, match="position_weights"):
        labels_and_weights(config, ids, mask, anchors, keep, 2.0, "linear")
    with pytest.raises(ValueError, match="position_weights"):
        TrainConfig(position_weights="linear")


# ----------------------------------------------------------------------------- curriculum

def test_lambda_schedule_follows_algorithms_md():
    """§3.4: decay_steps = max(1, int(T * r)); lambda = clip(l0 (1 - min(t / d, 1)), 0, 1)."""
    for total, l0, ratio in ((10, 1.0, 1.0), (10, 0.8, 0.5), (7, 1.5, 0.3), (1, 1.0, 0.0)):
        d = max(1, int(total * ratio))
        for t in range(0, total + 2):
            want = min(max(l0 * (1 - min(t / d, 1.0)), 0.0), 1.0)
            assert float(lambda_schedule(t, total, l0, ratio)) == pytest.approx(want, abs=1e-7)


# ----------------------------------------------------------------------------- init

def test_target_layers_for_init_rules():
    assert target_layers_for_init(30, 2, "last") == (28, 29)
    assert target_layers_for_init(30, 2, "spread") == (0, 29)
    assert target_layers_for_init(30, 5, "spread") == (0, 7, 14, 22, 29)
    assert target_layers_for_init(36, 1, "spread") == (35,)
    assert target_layers_for_init(36, 5, "last") == (31, 32, 33, 34, 35)
    with pytest.raises(ValueError, match="7 draft layers"):
        target_layers_for_init(6, 7, "last")
    with pytest.raises(ValueError, match="rule"):
        target_layers_for_init(6, 2, "first")


def test_init_draft_from_target_copies_layers(target6):
    _, tparams = target6
    config = make_draft_config(TARGET6, "domino", 3, 4, 16, 8)
    last = jit_init(config, False, tparams, "last")             # through init_draft_params
    spread = {"backbone": copy_target_layers(last["backbone"], tparams,
                                             target_layers_for_init(6, 3, "spread"))}
    for rule, params in (("last", last), ("spread", spread)):
        for i, t in enumerate(target_layers_for_init(6, 3, rule)):
            jax.tree_util.tree_map(np.testing.assert_array_equal,
                                   params["backbone"][f"layers_{i}"], tparams[f"layers_{t}"])
        np.testing.assert_array_equal(params["backbone"]["norm"]["weight"],
                                      tparams["norm"]["weight"])
    # not target weights: their own init (random fc, unit hidden_norm), and the head
    assert float(jnp.std(last["backbone"]["fc"]["kernel"])) > 0
    np.testing.assert_array_equal(last["backbone"]["hidden_norm"]["weight"], np.ones(32))
    assert set(last) == {"backbone", "head"}


def test_init_draft_from_target_llama_and_errors(target6):
    """A Llama target has no q/k norms: the draft keeps its own (ones); mismatched shapes and
    a missing target are errors that say so."""
    _, qwen = target6
    llama = TargetConfig("llama", vocab_size=64, hidden_size=32, num_layers=6, num_heads=4,
                         num_kv_heads=2, head_dim=8, intermediate_size=64, qk_norm=False)
    tparams = {k: v for k, v in qwen.items()}
    for i in range(6):                                  # the Llama parameter tree
        attn = {k: v for k, v in qwen[f"layers_{i}"]["self_attn"].items()
                if k not in ("q_norm", "k_norm")}
        tparams[f"layers_{i}"] = dict(qwen[f"layers_{i}"], self_attn=attn)
    config = make_draft_config(llama, "dflash", 2, 4)
    backbone = jax.eval_shape(lambda: init_draft_params(config, jax.random.PRNGKey(1), False))
    backbone = jax.tree_util.tree_map(lambda x: np.full(x.shape, 7.0, x.dtype),
                                      backbone["backbone"])
    seeded = copy_target_layers(backbone, tparams, target_layers_for_init(6, 2, "last"))
    np.testing.assert_array_equal(seeded["layers_1"]["self_attn"]["q_proj"]["kernel"],
                                  tparams["layers_5"]["self_attn"]["q_proj"]["kernel"])
    np.testing.assert_array_equal(seeded["layers_0"]["self_attn"]["q_norm"]["weight"],
                                  np.full(8, 7.0))            # not in the target: kept
    narrow = make_draft_config(llama, "dflash", 2, 4, intermediate_size=48)
    with pytest.raises(ValueError, match="draft layer 0 mlp/.* has shape"):
        jax.eval_shape(lambda t: init_draft_params(narrow, jax.random.PRNGKey(1), False, t,
                                                   "last"), tparams)
    with pytest.raises(ValueError, match="target's params"):      # traced, not compiled
        jax.eval_shape(lambda: init_draft_params(config, jax.random.PRNGKey(1), False, None,
                                                 "last"))


# ----------------------------------------------------------------------------- sizes

# Every value of the GPU sweep (layers 1-5, block 8/10/16, G 128-1024, E 32-256) at least
# once for Domino; DFlash (no G/E) once.
SIZES = [("domino", 1, 8, 128, 32), ("domino", 2, 10, 256, 64), ("domino", 3, 16, 512, 128),
         ("domino", 4, 10, 1024, 256), ("domino", 5, 16, 1024, 256), ("dflash", 5, 10, 0, 0)]
TARGET8 = TargetConfig("qwen3", vocab_size=96, hidden_size=32, num_layers=8, num_heads=4,
                       num_kv_heads=2, head_dim=8, intermediate_size=64, rope_theta=10000.0)


def test_drafter_sizes_of_the_sweep(tmp_path):
    """Shapes of a whole train step (eval_shape: traced, not compiled) and the HF export
    round trip for every size of the sweep; soft labels on for half of them."""
    from domino_jax.train.loop import export_trained_draft, load_trained_draft
    from domino_jax.train.step import init_state, train_step

    target = TargetLM(TARGET8, **F32)
    tparams = jax.eval_shape(lambda: init_params(TARGET8, jax.random.PRNGKey(0)))
    for i, (drafter, layers, block, g, e) in enumerate(SIZES):
        config = make_draft_config(TARGET8, drafter, layers, block, g, e)
        cfg = TrainConfig(drafter=drafter, steps=10, batch_size=2, max_length=48, num_anchors=4,
                          compute_dtype="float32", labels=("hard", "mix")[i % 2])
        params = jax.eval_shape(lambda: init_draft_params(config, jax.random.PRNGKey(1), False))
        state = jax.eval_shape(lambda p: init_state(cfg, p), params)
        batch = {k: jax.ShapeDtypeStruct((1, 2, 48), jnp.int32)
                 for k in ("input_ids", "loss_mask")}
        new_state, metrics = jax.eval_shape(
            lambda s, b, t: train_step(s, b, t, cfg=cfg, config=config, target=target),
            state, batch, tparams)
        shapes = lambda tree: jax.tree_util.tree_map(lambda x: x.shape, tree)
        assert shapes(new_state.params) == shapes(params)
        assert metrics["correct"].shape == (block,)
        assert len(params["backbone"]) == layers + 3             # layers, fc, 2 norms
        if drafter == "domino":
            assert params["head"]["prefix_gru"]["weight_hh"].shape == (g, 3 * g)
            assert params["head"]["embed_proj_2"]["kernel"].shape == (e, TARGET8.vocab_size)
        real = jax.tree_util.tree_map(lambda x: np.zeros(x.shape, x.dtype), params)
        folder = str(tmp_path / f"{drafter}_{i}")
        export_trained_draft(config, real, folder)
        assert load_trained_draft(folder, jnp.float32)[0] == config


@pytest.mark.slow
def test_largest_sweep_drafter_trains_and_drafts(tmp_path):
    """The largest sweep size really runs: two train steps, export, a Domino decode."""
    from decode_helpers import reference_greedy
    from domino_jax.decode.speculative import DecodeConfig, generate
    from domino_jax.decode.methods import make_drafter
    from domino_jax.train.loop import load_trained_draft, train

    target = TargetLM(TARGET8, **F32)
    tparams = random_target_params(TARGET8)
    cfg = TrainConfig(drafter="domino", steps=2, batch_size=2, max_length=40, num_anchors=4,
                      compute_dtype="float32", log_every=1, checkpoint_every=1000,
                      init_from_target="spread")
    result = train(cfg, None, None, str(tmp_path), examples=text_examples(4, 40, vocab=96),
                   target=target, target_params=tparams, progress=False, draft_layers=5,
                   block_size=10, gru_hidden_dim=1024, emb_dim=256)
    assert np.isfinite(result.history[-1]["loss"])
    config, dparams = load_trained_draft(result.export_dir, jnp.float32)
    assert (config.num_layers, config.block_size, config.gru_hidden_dim) == (5, 10, 1024)
    drafter = make_drafter(config, target, "domino")
    out = generate(target, tparams, [[1, 2, 3, 4]], DecodeConfig(method="domino",
                                                                 max_new_tokens=12),
                   drafter, dparams)
    # the independent greedy reference (one cache-free forward program, not AR's decode
    # programs)
    assert out.tokens == reference_greedy(target, tparams, [[1, 2, 3, 4]], 12)


# ----------------------------------------------------------------------------- mask token

def _tokenizer(tokens, specials, mask=None, unk="<unk>", chat=True, bos="<s>", eos="</s>"):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(tokens)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token=unk, bos_token=bos,
                                  eos_token=eos, mask_token=mask,
                                  additional_special_tokens=list(specials))
    if chat:
        tok.chat_template = ("{% for m in messages %}<|im_start|> {{ m['content'] }} "
                             "<|im_end|> {% endfor %}")
    return tok


BASE = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
WORDS = ["a", "b", "s", "u", "v"]


def test_default_mask_token_rule():
    chat = ["<|im_start|>", "<|im_end|>"]
    vocab = len(BASE) + 3 + len(WORDS)
    reserved = _tokenizer(BASE + ["<tool>", "<|reserved_0|>", "<|reserved_1|>"] + WORDS,
                          chat + ["<tool>", "<|reserved_0|>", "<|reserved_1|>"])
    assert default_mask_token_id(vocab, reserved)[0] == 6            # lowest reserved
    plain = _tokenizer(BASE + ["<tool>", "<img>", "x"] + WORDS, chat + ["<tool>", "<img>"])
    assert default_mask_token_id(vocab, plain)[0] == 6               # highest unused special
    assert default_mask_token_id(vocab + 8, plain)[0] == vocab       # a spare row comes first
    masked = _tokenizer(BASE + ["<mask>", "x", "y"] + WORDS, chat + ["<mask>"], mask="<mask>")
    assert default_mask_token_id(vocab + 8, masked)[0] == 5          # the mask token first
    only_unk = _tokenizer(BASE + ["x", "y", "z"] + WORDS, chat)
    assert default_mask_token_id(vocab, only_unk)[0] == 0            # chat uses 3, 4
    none = _tokenizer(BASE + ["x", "y", "z"] + WORDS, chat, unk="</s>", eos="</s>")
    assert default_mask_token_id(vocab, none)[0] == vocab - 1
    assert default_mask_token_id(64, None) == (63, "no tokenizer: vocab_size - 1")


def test_default_mask_token_of_the_demo_target():
    from domino_jax.demo_model import demo_target_dir

    folder = demo_target_dir()
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        pytest.skip("demo target not converted here")
    from domino_jax.decode.loading import load_tokenizer

    tok = load_tokenizer(folder)
    mask, why = default_mask_token_id(49152, tok)
    assert (mask, tok.convert_ids_to_tokens(mask)) == (16, "<empty_output>"), why
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi there"}],
                                  add_generation_prompt=True, tokenize=True)
    assert mask not in (ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_mask_default_in_training_and_export_warning(plain_text_run, target6, tmp_path,
                                                     caplog):
    """Default: the target's own row (from its tokenizer when the folder has one), no
    learned mask, no warning. A learned mask (--learned-mask) is exported with a loud
    warning naming the file."""
    from safetensors.numpy import load_file

    from domino_jax.train.config import resolve_mask_token_id
    from domino_jax.train.loop import export_trained_draft

    result, warnings_seen = plain_text_run
    assert not [r for r in warnings_seen if "mask_embedding" in r.getMessage()]
    tensors = load_file(os.path.join(result.export_dir, "model.safetensors"))
    assert "mask_embedding" not in tensors and "mask_embedding" not in result.params
    with open(os.path.join(result.export_dir, "config.json")) as f:
        raw = json.load(f)
    assert raw["dflash_config"]["mask_token_id"] == TARGET6.vocab_size - 1
    assert "learned_mask_embedding" not in raw["dflash_config"]

    _, tparams = target6
    config = make_draft_config(TARGET6, "dflash", 1, 4)
    with caplog.at_level(logging.WARNING):
        export_trained_draft(config, jit_init(config, True, tparams), str(tmp_path / "learned"))
    file = os.path.join(str(tmp_path / "learned"), "model.safetensors")
    warned = [r for r in caplog.records if r.levelno == logging.WARNING
              and "mask_embedding" in r.getMessage()]
    assert warned and file in warned[0].getMessage()
    assert "mask_embedding" in load_file(file)

    folder = tmp_path / "target_with_tokenizer"
    _tokenizer(BASE + ["<tool>", "<img>", "x"] + WORDS,
               ["<|im_start|>", "<|im_end|>", "<tool>", "<img>"]).save_pretrained(str(folder))
    assert resolve_mask_token_id(TargetConfig("qwen3", 13, 32, 2, 4, 2, 8, 64),
                                 str(folder)) == 6
    assert resolve_mask_token_id(TARGET6, str(tmp_path / "no_tokenizer_here")) == 63


# ----------------------------------------------------------------------------- CLI

def test_cli_recipe_flags(capsys):
    from domino_jax.train.__main__ import parse_args, with_recipe_options

    base = ["--data", "d.npz", "--out", "o"]
    cfg = with_recipe_options(TrainConfig(), parse_args(base))
    assert (cfg.labels, cfg.position_weights, cfg.init_from_target, cfg.learned_mask) == \
        ("hard", "decay", "none", False)
    args = parse_args(base + ["--labels", "mix", "--soft-weight", "0.3", "--position-weights",
                              "uniform", "--init-draft-from-target", "--learned-mask"])
    cfg = with_recipe_options(TrainConfig(), args)
    assert (cfg.labels, cfg.soft_label_weight, cfg.position_weights, cfg.init_from_target,
            cfg.learned_mask) == ("mix", 0.3, "uniform", "last", True)
    args = parse_args(base + ["--init-draft-from-target", "spread"])
    assert with_recipe_options(TrainConfig(), args).init_from_target == "spread"
    for bad, needle in ((["--labels", "soft", "--soft-weight", "0.2"], "--soft-weight"),
                        (["--labels", "mix", "--soft-weight", "2"], "--soft-weight")):
        with pytest.raises(SystemExit) as e:
            with_recipe_options(TrainConfig(), parse_args(base + bad))
        assert e.value.code == 2 and needle in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        parse_args(base + ["--labels", "kl"])
    assert e.value.code == 2
