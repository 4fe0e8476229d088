"""Long prompts: blockwise attention, chunked prefill, memory linear in the prompt, the
context-length check (library ``ValueError``, CLI exit 2 before any weight is loaded).

Tiny float32 models (decode_helpers), prompts longer than a chunk (chunks of 16 tokens):
* ``attend_blockwise`` equals the einsum reference (fully masked rows, a cache length that
  is not a multiple of the key block, the stacked cache read in place, bf16);
* the chunked prefill equals the one-forward prefill: first-token logits, target cache and
  draft cache to float32 rounding; greedy decodes of every method equal a cache-free greedy
  AR reference on a ragged batch;
* ``compiled.memory_analysis()`` of the prefill: the one-forward temp bytes grow ~4x when
  the prompt doubles, the chunked ones stay nearly flat (the test fails if a chunk ever
  materialises a score matrix over the whole prompt).
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from decode_helpers import draft_config, reference_greedy, tiny_draft, tiny_target

from domino_jax.decode import speculative
from domino_jax.decode.__main__ import main
from domino_jax.decode.methods import make_drafter, method_options
from domino_jax.decode.prefill import (PrefillConfig, check_context_length, chunk_plan,
                                       compiled_prefill, prefill_prompt)
from domino_jax.decode.speculative import DecodeConfig, generate, pad_prompts
from domino_jax.models.blockwise_attention import attend_blockwise
from domino_jax.models.layers import MASK_VALUE, attend, attend_cache_layer, attend_reference

CHUNK = 16
RNG = np.random.default_rng(0)
LONG = [RNG.integers(0, 63, n).tolist() for n in (70, 33, 51)]      # ragged, > one chunk


def _qkv(seed, batch, q_len, num_keys, heads=4, kv_heads=2, head_dim=8, dtype=jnp.float32):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(keys[0], (batch, q_len, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, num_keys, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, num_keys, kv_heads, head_dim), dtype)
    return q, k, v


@pytest.mark.parametrize("key_block", [7, 16, 64, 512])
def test_blockwise_equals_reference(key_block):
    """Random masks (row 3 fully masked: the average of all values), S = 150 not a
    multiple of the block; causal masks where late blocks are never visited."""
    q, k, v = _qkv(0, 2, 37, 150)
    random_mask = jax.random.bernoulli(jax.random.PRNGKey(3), 0.3, (2, 37, 150))
    random_mask = random_mask.at[0, 3].set(False)
    causal = jnp.arange(150)[None, None] <= (40 + jnp.arange(37))[None, :, None]
    for visible in (random_mask, jnp.broadcast_to(causal, (2, 37, 150))):
        ours = jax.jit(lambda *a: attend_blockwise(*a, MASK_VALUE, key_block=key_block))(
            q, k, v, visible)
        assert_close(ours, attend_reference(q, k, v, visible), 2e-6, "blockwise vs einsum")


def test_blockwise_stacked_cache_and_dispatch():
    """``attend(implementation="blockwise")`` and the stacked-cache path read the same
    values; bf16 stays close; ``cudnn`` fails fast on the CPU naming the reason."""
    q, k, v = _qkv(1, 1, 20, 100)
    visible = jax.random.bernoulli(jax.random.PRNGKey(4), 0.5, (1, 20, 100))
    ref = attend_reference(q, k, v, visible)
    assert_close(attend(q, k, v, visible, "blockwise"), ref, 2e-6, "attend blockwise")
    keys, values = jnp.stack([-k, k]), jnp.stack([v * 3.0, v])
    assert_close(attend_cache_layer(q, keys, values, 1, visible, "blockwise"), ref, 2e-6,
                 "stacked blockwise")
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    assert_close(attend(qb, kb, vb, visible, "blockwise"), ref, 3e-2, "bf16 blockwise")
    with pytest.raises(ValueError, match="'cudnn' needs a GPU"):
        attend(qb, kb, vb, visible, "cudnn")
    with pytest.raises(ValueError, match="unknown prefill attention 'flash'"):
        PrefillConfig(attention="flash")
    with pytest.raises(ValueError, match="prefill chunk must be >= 0"):
        PrefillConfig(chunk=-1)


def test_chunk_plan():
    assert chunk_plan(128, 0) == (1, 128) and chunk_plan(128, 128) == (1, 128)
    assert chunk_plan(8192, 2048) == (4, 2048)
    assert chunk_plan(3072, 2048) == (2, 1536)          # two equal chunks, no padding
    assert chunk_plan(2304, 2048) == (2, 1152)
    for width, chunk in ((129, 16), (1000, 96), (70, 24)):
        n, size = chunk_plan(width, chunk)
        assert size <= chunk and n * size >= width and (n - 1) * size < width


def _models():
    target, params = tiny_target(3, vocab=64)
    cfg = draft_config(64, block=4)
    return target, params, cfg, tiny_draft(cfg, 5)


def test_chunked_prefill_equals_one_forward():
    target, params, cfg, dparams = _models()
    drafter = make_drafter(cfg, target, "domino")
    prompt, prompt_len = pad_prompts(LONG)                   # [3, 128]
    capacity = 192
    run = jax.jit(lambda c: prefill_prompt(target, drafter, params, dparams, prompt,
                                           prompt_len, capacity, c), static_argnums=0)
    whole, chunked = run(PrefillConfig(chunk=0)), run(PrefillConfig(chunk=CHUNK))
    assert chunk_plan(prompt.shape[1], CHUNK) == (8, 16)
    assert_close(chunked.logits, whole.logits, 1e-5, "chunked prefill logits")
    assert drafter.feature_dim == 2 * 32
    for name, (a, b) in dict(target=(chunked.cache, whole.cache),
                             draft=(chunked.draft_cache, whole.draft_cache)).items():
        np.testing.assert_array_equal(a.lengths, prompt_len)
        np.testing.assert_array_equal(b.lengths, prompt_len)
        for row, n in enumerate(LONG):                       # committed slots only
            for buf in ("keys", "values"):
                assert_close(getattr(a, buf)[:, row, :len(n)], getattr(b, buf)[:, row, :len(n)],
                             1e-5, f"chunked {name} cache {buf}")
    xla = run(PrefillConfig(chunk=CHUNK, attention="xla"))
    assert_close(xla.logits, whole.logits, 1e-5, "chunked prefill logits, xla attention")


def _drafter(method, cfg, target):
    options = {"ddtree": dict(budget=6), "dominotree": dict(budget=6, node_topk=3, topm=8)}
    return None if method == "ar" else make_drafter(
        cfg, target, method, method_options(method, **options.get(method, {})))


_REFERENCE: dict = {}


@pytest.mark.parametrize("method", ["ar", "domino", "dominotree",
                                    pytest.param("dflash", marks=pytest.mark.slow),
                                    pytest.param("ddtree", marks=pytest.mark.slow)])
def test_long_prompt_greedy_lossless(method):
    """Prompts of 33-70 tokens in chunks of 16: each method equals an independent
    cache-free greedy AR, and the speculative methods accept drafts."""
    target, params, cfg, dparams = _models()
    if "ref" not in _REFERENCE:
        _REFERENCE["ref"] = reference_greedy(target, params, LONG, 12, width=96)
    config = DecodeConfig(method=method, max_new_tokens=12, prefill=PrefillConfig(chunk=CHUNK))
    result = generate(target, params, LONG, config, _drafter(method, cfg, target), dparams)
    assert result.tokens == _REFERENCE["ref"], method
    assert method == "ar" or result.tau > 1.0, method


def test_prefill_memory_is_linear_in_the_prompt():
    """XLA's temp bytes of the compiled prefill (nothing runs): one forward over 2048
    tokens holds [heads, T, S] float32 scores (> 100 MB); chunks of 128 hold one chunk's
    worth, so quadrupling the prompt (512 -> 2048 tokens) adds less than half again."""
    target, params, cfg, dparams = _models()
    drafter = make_drafter(cfg, target, "domino")

    def temp_bytes(width, chunk):
        compiled = compiled_prefill(target, drafter, params, dparams, 1, width, width + 64,
                                    PrefillConfig(chunk=chunk))
        return compiled.memory_analysis().temp_size_in_bytes

    whole = temp_bytes(2048, 0)
    short, long = temp_bytes(512, 128), temp_bytes(2048, 128)
    assert whole > 4 * 2048 * 2048 * 4 * 0.9, whole          # the score matrix is there
    assert long < 1.5 * short, (short, long)
    assert long < whole / 20, (long, whole)


# ------------------------------------------------------------------ context-length check


def test_context_limit_error_names_length_limit_and_option(monkeypatch):
    """Prompt + max_new_tokens over max_position_embeddings: a ValueError before anything
    is compiled or allocated (``_compiled`` must not be reached)."""
    import dataclasses

    target, params = tiny_target(3, vocab=64)
    short_target = target.clone(config=dataclasses.replace(target.config,
                                                           max_position_embeddings=64))

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled before the context check")

    monkeypatch.setattr(speculative, "_compiled", no_compile)
    with pytest.raises(ValueError) as info:
        generate(short_target, params, [[1] * 60, [2] * 10], DecodeConfig(max_new_tokens=8))
    message = str(info.value)
    for part in ("prompt 0 has 60 tokens", "68 positions", "supports: 64",
                 "max_position_embeddings", "--max-new-tokens", "at most 4"):
        assert part in message, (part, message)
    with pytest.raises(ValueError, match="the prompt has 70 tokens.*shorten the prompt to at "
                                         "most 56 tokens$"):
        generate(short_target, params, [[1] * 70], DecodeConfig(max_new_tokens=8))
    check_context_length(short_target.config, [56], 8)        # exactly the limit: fine


# ------------------------------------------------------------------------------ the CLI

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "reference")


@pytest.fixture(scope="module")
def worded_target(tmp_path_factory):
    """The golden ``dflash`` fixture target (vocab 256, 512 positions) with a word-level
    tokenizer (``w0`` .. ``w255``, whitespace-split) so the CLI can encode text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("worded_target")
    source = os.path.join(FIX, "dflash", "target")
    for name in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(source, name), folder / name)
    vocab = {f"w{i}": i for i in range(256)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(str(folder))
    return str(folder)


def _prompt_file(tmp_path, words: int) -> str:
    path = tmp_path / f"prompt_{words}.txt"
    path.write_text(" ".join(f"w{(7 * i) % 250 + 1}" for i in range(words)) + "\n")
    return str(path)


def test_cli_prompt_longer_than_the_target_exits_2(worded_target, tmp_path, capsys,
                                                   monkeypatch):
    """600 words on a 512-position target: exit 2 naming length, limit and option, and
    nothing is compiled (the check runs before the prefill)."""
    def no_compile(*args, **kwargs):
        raise AssertionError("compiled before the context check")

    monkeypatch.setattr(speculative, "_compiled", no_compile)
    code = main(["--target", worded_target, "--no-chat", "--prompt-file",
                 _prompt_file(tmp_path, 600), "--max-new-tokens", "8"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "the prompt has 600 tokens" in err and "supports: 512" in err, err
    assert "max_position_embeddings" in err and "shorten the prompt to at most 504" in err


def test_cli_long_prompt_runs_chunked(worded_target, tmp_path, capsys):
    """A 300-token prompt in chunks of 64 decodes (AR) and exits 0."""
    code = main(["--target", worded_target, "--no-chat", "--prompt-file",
                 _prompt_file(tmp_path, 300), "--max-new-tokens", "4", "--prefill-chunk", "64",
                 "--stream-rounds", "0"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert re.search(r"^\[?ar\]?\s+4\b", captured.err, re.M), captured.err   # 4 new tokens


@pytest.mark.slow
def test_bench_long_context_smoke(tmp_path):
    """``benchmarks/bench_long_context.py`` on the tiny shape: prefill memory analysis of
    both modes (children processes) and the draft timing, reports written, no error rows."""
    import json
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks",
                          "bench_long_context.py")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for args in (["prefill", "--lengths", "3000", "--modes", "whole,chunked", "--compile-only"],
                 ["draft", "--contexts", "512", "--windows", "0,64", "--reps", "1"]):
        subprocess.run([sys.executable, script, *args, "--shape", "tiny", "--out",
                        str(tmp_path)], check=True, env=env, capture_output=True, timeout=600)
    rows = {p.name.split("_")[1]: json.loads(p.read_text())["rows"]
            for p in tmp_path.glob("long_*.json")}
    assert [r["mode"] for r in rows["prefill"]] == ["whole", "chunked"]
    assert rows["prefill"][1]["chunks"] == [2, 1536]
    assert rows["prefill"][1]["temp_bytes"] < rows["prefill"][0]["temp_bytes"]
    assert [r["window"] for r in rows["draft"]] == [0, 64]
    assert all("error" not in r for rs in rows.values() for r in rs)
