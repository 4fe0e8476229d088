"""Drafting over the most frequent tokens only (``--draft-vocab N``,
``BlockOptions.draft_vocab``; docs/design.md §32).

* the ranking: response tokens counted from shards, every id ranked, coverage;
* the drafter's LM head over the ranked tokens equals the full head on them (float32) and
  puts every other token below any logit, for tied and untied targets;
* decoding stays lossless (greedy == AR) for dflash, domino and dominotree, and the
  restriction bites: on a permutation target every draft is accepted with the whole
  vocabulary and fewer are when the path's tokens are left out;
* ``load_pair(..., draft_vocab=N)`` reads the folder's ``draft_vocab.npy``; bad files and
  sizes fail naming the file.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode_helpers import (FIXTURES, draft_config, fused_fixture_models, perm_domino_params,
                            perm_target, permutation, reference_greedy)
from domino_jax.decode.drafters import OUTSIDE_DRAFT_VOCAB, BlockOptions
from domino_jax.decode.loading import (DRAFT_VOCAB_FILE, draft_vocab_params, load_pair,
                                       read_draft_vocab)
from domino_jax.decode.methods import make_drafter, method_options
from domino_jax.decode.speculative import DecodeConfig, generate
from domino_jax.train import draft_vocab
from test_shards import write_examples

jax.config.update("jax_default_matmul_precision", "highest")

RAGGED_PROMPTS = [[3, 4, 5], [7, 1, 2, 9, 10, 6], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


def test_ranking_from_shards(tmp_path, capsys):
    examples = [{"input_ids": np.array(ids, np.int32), "loss_mask": np.array(mask, np.int32)}
                for ids, mask in (([9, 9, 5, 5, 5, 3], [0, 0, 1, 1, 1, 1]),
                                  ([3, 7, 7], [1, 1, 1]))]
    write_examples(tmp_path / "shards", examples)
    counts = draft_vocab.token_counts([str(tmp_path / "shards")], 12)
    assert counts.tolist() == [0, 0, 0, 2, 0, 3, 0, 2, 0, 0, 0, 0]     # responses only
    ranking = draft_vocab.rank_tokens(counts)
    assert ranking[:3].tolist() == [5, 3, 7] and sorted(ranking) == list(range(12))
    assert draft_vocab.coverage(counts, ranking, (1, 3)) == {1: round(3 / 7, 4), 3: 1.0}
    with pytest.raises(ValueError, match="a response has a token id outside"):
        draft_vocab.token_counts([str(tmp_path / "shards")], 6)

    folder = tmp_path / "draft"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(draft_config(12).to_hf_dict()))
    assert draft_vocab.main([str(tmp_path / "shards"), "--draft", str(folder)]) == 0
    np.testing.assert_array_equal(np.load(folder / DRAFT_VOCAB_FILE), ranking)
    assert json.loads(capsys.readouterr().out)["response_tokens"] == 7
    np.testing.assert_array_equal(read_draft_vocab(str(folder), 2, 12), [3, 5])   # sorted
    with pytest.raises(SystemExit):
        draft_vocab.main([str(tmp_path), "--draft", str(folder)])      # not a shards dir


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_over_the_ranked_tokens(tied):
    target, params, dcfg, _ = fused_fixture_models("domino_shift")
    if tied:
        import dataclasses

        from domino_jax.models.qwen3 import TargetLM
        target = TargetLM(dataclasses.replace(target.config, tie_word_embeddings=True),
                          dtype=jnp.float32, param_dtype=jnp.float32)
        params = {k: v for k, v in params.items() if k != "lm_head"}
    vocab = target.config.vocab_size
    ids = np.sort(np.random.default_rng(0).permutation(vocab)[:vocab // 3]).astype(np.int32)
    full = make_drafter(dcfg, target, "dflash", method_options("dflash"))
    part = make_drafter(dcfg, target, "dflash", method_options("dflash", draft_vocab=len(ids)))
    hidden = jax.random.normal(jax.random.PRNGKey(1), (2, 3, dcfg.hidden_size))
    expected = np.asarray(full.lm_head(params, hidden))
    got = np.asarray(part.lm_head(params, hidden, {"vocab": draft_vocab_params(
        target.config, params, ids)}))
    np.testing.assert_allclose(got[..., ids], expected[..., ids], rtol=1e-5, atol=1e-5)
    outside = np.setdiff1d(np.arange(vocab), ids)
    assert (got[..., outside] == OUTSIDE_DRAFT_VOCAB).all()
    assert np.isin(got.argmax(-1), ids).all()
    with pytest.raises(ValueError, match="no 'vocab' entry"):
        part.lm_head(params, hidden, {})
    with pytest.raises(ValueError, match="--draft-vocab"):
        BlockOptions(draft_vocab=-1)


@pytest.mark.parametrize("method", ["dflash", "domino", "dominotree"])
def test_greedy_with_a_draft_vocabulary_equals_ar(method):
    target, params, dcfg, dparams = fused_fixture_models(
        "dflash" if method == "dflash" else "domino_shift")
    vocab = target.config.vocab_size
    ids = np.sort(np.random.default_rng(1).permutation(vocab)[:vocab // 2]).astype(np.int32)
    options = method_options(method, draft_vocab=len(ids),
                             **({"budget": 6} if "tree" in method else {}))
    drafter = make_drafter(dcfg, target, method, options)
    result = generate(target, params, RAGGED_PROMPTS, DecodeConfig(method=method,
                                                                    max_new_tokens=16),
                      drafter=drafter, draft_params=dict(dparams, vocab=draft_vocab_params(
                          target.config, params, ids)))
    assert result.tokens == reference_greedy(target, params, RAGGED_PROMPTS, 16)


def test_the_restriction_bites_on_a_permutation_target():
    """The target's next token is ``pi(current)`` and the head drafts ``pi(last)``: the whole
    vocabulary accepts every draft; leaving out tokens of the path stops drafts there."""
    pi = permutation(32, seed=0)
    cfg = draft_config(32, block=4, gru=32, emb=32)
    target, params = perm_target(pi, attn_scale=0.0, seed=1)
    ref = reference_greedy(target, params, RAGGED_PROMPTS, 16)
    taus = {}
    for size in (32, 24):
        ids = np.sort(permutation(32, seed=3)[:size]).astype(np.int32)
        drafter = make_drafter(cfg, target, "domino", method_options("domino",
                                                                      draft_vocab=size))
        dparams = dict(perm_domino_params(cfg, pi),
                       vocab=draft_vocab_params(target.config, params, ids))
        result = generate(target, params, RAGGED_PROMPTS,
                          DecodeConfig(method="domino", max_new_tokens=16), drafter=drafter,
                          draft_params=dparams)
        assert result.tokens == ref, size
        taus[size] = result.tau
    assert taus[32] == cfg.k_draft + 1 and taus[24] < taus[32], taus


def test_load_pair_reads_the_folders_ranking(tmp_path, monkeypatch):
    folder = os.path.join(FIXTURES, "domino_shift")
    draft = tmp_path / "draft"
    shutil.copytree(os.path.join(folder, "draft"), draft)
    vocab = json.loads((draft / "config.json").read_text())["vocab_size"]
    with pytest.raises(FileNotFoundError, match=DRAFT_VOCAB_FILE):
        load_pair(os.path.join(folder, "target"), str(draft), "domino", jnp.float32,
                  draft_vocab=8)
    for bad, match in ((np.zeros((2, 2), np.int32), "1-D"), (np.array([1, 1]), "distinct"),
                       (np.array([0, vocab]), "distinct")):
        np.save(draft / DRAFT_VOCAB_FILE, bad)
        with pytest.raises(ValueError, match=match):
            read_draft_vocab(str(draft), 1, vocab)
    np.save(draft / DRAFT_VOCAB_FILE, np.arange(vocab)[::-1].astype(np.int32))
    with pytest.raises(ValueError, match=f"ranks {vocab} tokens"):
        read_draft_vocab(str(draft), vocab + 1, vocab)
    # "auto": the whole vocabulary unless the ranking holds more than CPU_DRAFT_VOCAB tokens
    # (on a CPU; off on other devices)
    from domino_jax.decode import loading

    assert loading.auto_draft_vocab(str(draft)) == 0               # vocab <= 8192 tokens
    _, _, drafter, dparams = load_pair(os.path.join(folder, "target"), str(draft), "domino",
                                       jnp.float32, draft_vocab="auto")
    assert drafter.options.draft_vocab == 0 and "vocab" not in dparams
    monkeypatch.setattr(loading, "CPU_DRAFT_VOCAB", 8)
    _, _, drafter, dparams = load_pair(os.path.join(folder, "target"), str(draft), "domino",
                                       jnp.float32, draft_vocab="auto")
    assert drafter.options.draft_vocab == 8 and len(dparams["vocab"]["ids"]) == 8
    with pytest.raises(ValueError, match="chosen when the pair is loaded"):
        make_drafter(drafter.config, drafter.target, "domino",
                     method_options("domino", draft_vocab="auto")).lm_head(None, None)
    target, params, drafter, dparams = load_pair(os.path.join(folder, "target"), str(draft),
                                                 "domino", jnp.float32, draft_vocab=8)
    assert drafter.options.draft_vocab == 8
    np.testing.assert_array_equal(dparams["vocab"]["ids"], np.arange(vocab - 8, vocab))
    result = generate(target, params, RAGGED_PROMPTS, DecodeConfig(method="domino",
                                                                    max_new_tokens=12),
                      drafter=drafter, draft_params=dparams)
    assert result.tokens == reference_greedy(target, params, RAGGED_PROMPTS, 12)


def test_heldout_evaluator_drafts_over_the_vocabulary_it_is_given():
    """``HeldoutEvaluator(draft_vocab=ids)`` (``tau_heldout.py --draft-vocab``): every
    token id gives the whole vocabulary's taus; few ids give lower ones."""
    from domino_jax.train.evaluate import HeldoutEvaluator

    pi = permutation(32, seed=0)
    dcfg = draft_config(32, block=4, gru=32, emb=32)
    target, params = perm_target(pi, attn_scale=0.0, seed=1)
    dparams = perm_domino_params(dcfg, pi)
    prompts = {"a": RAGGED_PROMPTS[:2], "b": RAGGED_PROMPTS[2:]}
    vocab = target.config.vocab_size

    def taus(ids):
        return HeldoutEvaluator(target, params, dcfg, prompts, ("domino",), 12,
                                draft_vocab=ids)(dparams)

    whole = taus(None)
    assert taus(np.arange(vocab, dtype=np.int32)) == whole
    few = taus(np.arange(4, dtype=np.int32))
    assert whole["domino"]["all"] > 3 and few["domino"]["all"] < whole["domino"]["all"]
