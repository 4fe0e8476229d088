"""Shared builders for the decode tests (tests/test_decode_*.py).

* :func:`fixture_models`: the golden reference checkpoints (tests/fixtures/reference) in
  float32; :func:`fused_fixture_models`: the same in the fused decode layout.
* :func:`perm_target` / :func:`perm_domino_params`: hand-built models where the target's
  greedy next token is (mostly) a fixed permutation ``pi`` of the current token and a Domino
  head drafts ``sigma(last)``, so acceptance is forced (``sigma == pi``) or partial.
* :func:`tiny_target` / :func:`tiny_draft`: small random models (vocab <= 64, hidden 32).
* :func:`reference_greedy`: an independent greedy AR reference (full recompute, no cache).
* :func:`chi_square_test`: Pearson chi-square against exact cell probabilities.
* :func:`prefill_state`: the state after ``generate``'s prefill, compiling the prefill alone.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from converters.hf_draft import load_draft
from converters.hf_target import load_target
from domino_jax.config import DraftConfig, TargetConfig
from domino_jax.models import dflash, domino_head, qwen3
from domino_jax.models.qwen3 import TargetLM

jax.config.update("jax_default_matmul_precision", "highest")

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "reference")
FIXTURE_NAMES = ("domino_shift", "domino_noshift", "dflash")
F32 = dict(dtype=jnp.float32, param_dtype=jnp.float32)


@functools.lru_cache(maxsize=None)
def fixture_models(name: str):
    """``(target, target_params, draft_config, draft_params, outputs)`` in float32."""
    folder = os.path.join(FIXTURES, name)
    target_cfg, target_params = load_target(os.path.join(folder, "target"), dtype=jnp.float32)
    draft_cfg, draft_params = load_draft(os.path.join(folder, "draft"), dtype=jnp.float32)
    outputs = dict(np.load(os.path.join(folder, "outputs.npz")))
    return TargetLM(target_cfg, **F32), target_params, draft_cfg, draft_params, outputs


@functools.lru_cache(maxsize=None)
def fused_fixture_models(name: str):
    """:func:`fixture_models` in the fused decode layout that ``load_pair`` serves (q/k/v and
    gate/up concatenated, the Domino head in its decode layout): ``(target, target_params,
    draft_config, draft_params)``."""
    from domino_jax.models.fused_layout import fuse_model

    target, params, dcfg, dparams, _ = fixture_models(name)
    tcfg, fparams = fuse_model(target.config, params)
    fcfg, fdparams = fuse_model(dcfg, dparams)
    if dcfg.has_domino_head:
        fdparams = dict(fdparams, head=domino_head.decode_head(
            fdparams["head"], fparams["embed_tokens"]["embedding"]))
    return TargetLM(tcfg, **F32), fparams, fcfg, fdparams


def _set(tree, path: str, value):
    """Functional update of ``tree['a']['b']...`` (path 'a/b/...')."""
    keys = path.split("/")
    tree = dict(tree)
    if len(keys) == 1:
        tree[keys[0]] = jnp.asarray(value, jnp.float32)
        return tree
    tree[keys[0]] = _set(tree[keys[0]], "/".join(keys[1:]), value)
    return tree


def tiny_target_config(vocab: int = 32, hidden: int = 32, layers: int = 2,
                       tie: bool = False) -> TargetConfig:
    return TargetConfig("qwen3", vocab, hidden, layers, 4, 2, 8, 64, rope_theta=10000.0,
                        tie_word_embeddings=tie)


@functools.lru_cache(maxsize=None)
def _target_init(config: TargetConfig, seed: int):
    return jax.jit(qwen3.init_params, static_argnums=0)(config, jax.random.PRNGKey(seed))


@functools.lru_cache(maxsize=None)
def _backbone_init(config: DraftConfig, seed: int):
    return jax.jit(dflash.init_params, static_argnums=0)(config, jax.random.PRNGKey(seed))


def tiny_target(seed: int, vocab: int = 64, lm_scale: float = 4.0, layers: int = 2):
    """Random target with a peaked (scaled) untied LM head."""
    config = tiny_target_config(vocab, 32, layers)
    params = _target_init(config, seed)
    params = _set(params, "embed_tokens/embedding",
                  jax.random.normal(jax.random.PRNGKey(seed + 100), (vocab, 32)))
    params = _set(params, "lm_head/kernel", params["lm_head"]["kernel"] * lm_scale)
    return TargetLM(config, **F32), params


def draft_config(vocab: int, *, block: int = 4, method: str = "domino", shift: bool = True,
                 prefix: int = 0, mask: int | None = None, hidden: int = 32,
                 gru: int = 16, emb: int = 16, target_layers: int = 2) -> DraftConfig:
    domino = method == "domino"
    return DraftConfig(
        vocab_size=vocab, hidden_size=hidden, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=8, intermediate_size=64, block_size=block, num_target_layers=target_layers,
        mask_token_id=vocab - 1 if mask is None else mask, target_layer_ids=(0, target_layers - 1),
        rope_theta=10000.0, projector_type="domino" if domino else None,
        pure_draft_prefix_len=prefix if domino else 1, shift_label=shift if domino else False,
        emb_dim=emb if domino else 0, gru_hidden_dim=gru if domino else 0)


def tiny_draft(config: DraftConfig, seed: int, head_scale: float = 1.0):
    """Random backbone (+ head) params for ``config``."""
    params = {"backbone": _backbone_init(config, seed)}
    if config.has_domino_head:
        head = domino_head.init_head_params(config, jax.random.PRNGKey(seed + 1))
        head = _set(head, "embed_proj_2/kernel", head["embed_proj_2"]["kernel"] * head_scale)
        params["head"] = head
    return params


# ----------------------------------------------------------------- forced-acceptance models

def permutation(n: int, seed: int) -> np.ndarray:
    """A single n-cycle (so pi^k(x) != x for 0 < k < n)."""
    order = np.random.default_rng(seed).permutation(n)
    perm = np.empty(n, np.int64)
    perm[order] = np.roll(order, -1)
    return perm


def perm_matrix(perm: np.ndarray) -> np.ndarray:
    m = np.zeros((len(perm), len(perm)), np.float32)
    m[np.arange(len(perm)), perm] = 1.0
    return m


def perm_target(perm: np.ndarray, attn_scale: float = 0.0, seed: int = 0,
                lm_scale: float = 10.0, final_norm: float = 1.0):
    """V = H target whose hidden is (mostly) its own one-hot embedding and whose LM head maps
    one-hot(i) to a peak at ``perm[i]``. ``attn_scale`` scales the (random) o_proj/down_proj
    kernels: 0 -> greedy next token is exactly ``perm[current]``; > 0 -> context leaks in.
    ``final_norm=0`` gives all-equal logits (greedy token 0 everywhere)."""
    vocab = len(perm)
    config = tiny_target_config(vocab, vocab, 2)
    params = _target_init(config, seed)
    params = _set(params, "embed_tokens/embedding", np.eye(vocab, dtype=np.float32))
    params = _set(params, "lm_head/kernel", lm_scale * perm_matrix(perm))
    params = _set(params, "norm/weight", np.full((vocab,), final_norm, np.float32))
    for i in range(config.num_layers):
        layer = f"layers_{i}"
        params = _set(params, f"{layer}/self_attn/o_proj/kernel",
                      params[layer]["self_attn"]["o_proj"]["kernel"] * attn_scale)
        params = _set(params, f"{layer}/mlp/down_proj/kernel",
                      params[layer]["mlp"]["down_proj"]["kernel"] * attn_scale)
    return TargetLM(config, **F32), params


def perm_domino_params(config: DraftConfig, sigma: np.ndarray, seed: int = 0,
                       big: float = 20.0):
    """Domino drafter whose backbone output is 0 (base logits 0) and whose head drafts
    ``sigma[last token]`` at every corrected position (GRU state = one-hot of the last token).
    Needs V = H = G = E and a one-hot target embedding."""
    v = config.vocab_size
    assert config.hidden_size == v and config.gru_hidden_dim == v and config.emb_dim == v
    params = tiny_draft(config, seed)
    backbone = _set(params["backbone"], "norm/weight", np.zeros((v,), np.float32))
    eye = np.eye(v, dtype=np.float32)
    w_ih = np.concatenate([np.zeros((v, v), np.float32), np.full((v, v), -big, np.float32),
                           big * eye], axis=1)                          # gates r | z | n
    head = {"prefix_gru": {"weight_ih": jnp.asarray(w_ih),
                           "weight_hh": jnp.zeros((v, 3 * v), jnp.float32)},
            "embed_proj_0": {"kernel": jnp.asarray(np.concatenate([0 * eye, eye], axis=0))},
            "embed_proj_2": {"kernel": jnp.asarray(big * perm_matrix(sigma))}}
    return {"backbone": backbone, "head": head}


def zero_backbone_params(config: DraftConfig, seed: int = 0):
    """DFlash drafter whose hidden is 0: all base logits equal, greedy drafts are token 0."""
    params = tiny_draft(config, seed)
    params["backbone"] = _set(params["backbone"], "norm/weight",
                              np.zeros((config.hidden_size,), np.float32))
    return params


# ----------------------------------------------------------------------- references

_FORWARD: dict = {}


def full_logits(target: TargetLM, params, tokens: np.ndarray) -> np.ndarray:
    """Cache-free causal forward over ``tokens [B, T]`` -> float32 logits ``[B, T, V]``."""
    if target not in _FORWARD:
        _FORWARD[target] = jax.jit(lambda p, t: target.apply(
            {"params": p}, t, jnp.broadcast_to(jnp.arange(t.shape[1]), t.shape)).logits)
    return np.asarray(_FORWARD[target](params, jnp.asarray(tokens, jnp.int32)))


def reference_greedy(target: TargetLM, params, prompts, max_new: int,
                     width: int = 64) -> list[list[int]]:
    """Independent greedy AR (full recompute each step; trailing padding is causal-invisible)."""
    lengths = [len(p) for p in prompts]
    assert max(lengths) + max_new <= width
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    out = [[] for _ in prompts]
    for step in range(max_new):
        logits = full_logits(target, params, tokens)
        for i, n in enumerate(lengths):
            tok = int(np.argmax(logits[i, n + step - 1]))
            out[i].append(tok)
            tokens[i, n + step] = tok
    return out


# ----------------------------------------------------------------------- statistics

def chi2_quantile(df: int, z: float = 3.090232) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: 0.999)."""
    df = max(df, 1)
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi_square_test(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0):
    """Pearson chi-square of ``counts`` against ``probs`` (same shape, flattened).

    Cells with probability 0 must be empty (asserted). Cells with expected count below
    ``min_expected`` are pooled (smallest first) into one cell. Returns (stat, df, threshold).
    """
    counts = np.asarray(counts, np.float64).ravel()
    probs = np.asarray(probs, np.float64).ravel()
    n = counts.sum()
    assert abs(probs.sum() - 1.0) < 1e-4, probs.sum()
    zero = probs <= 1e-12
    assert counts[zero].sum() == 0, f"{int(counts[zero].sum())} samples in zero-probability cells"
    counts, expected = counts[~zero], probs[~zero] * n
    order = np.argsort(expected)
    counts, expected = counts[order], expected[order]
    cells_c, cells_e, pool_c, pool_e = [], [], 0.0, 0.0
    for c, e in zip(counts, expected):
        if pool_e < min_expected and e < min_expected:
            pool_c, pool_e = pool_c + c, pool_e + e
        else:
            cells_c.append(c)
            cells_e.append(e)
    if pool_e > 0:
        if pool_e < min_expected and cells_e:        # fold a too-small pool into the next cell
            cells_c[0] += pool_c
            cells_e[0] += pool_e
        else:
            cells_c.append(pool_c)
            cells_e.append(pool_e)
    cells_c, cells_e = np.asarray(cells_c), np.asarray(cells_e)
    stat = float(((cells_c - cells_e) ** 2 / cells_e).sum())
    df = len(cells_c) - 1
    return stat, df, chi2_quantile(df)


def exact_joint_probs(target: TargetLM, params, prompt: list[int], vocab: int,
                      sampling) -> np.ndarray:
    """``[V, V, V]`` exact probability of the first three generated tokens after ``prompt``
    under the processed target distribution ``sampling`` (enumerates all V*V prefixes)."""
    import itertools

    from domino_jax.decode.sampling import target_log_probs

    seqs = np.array([list(prompt) + [a, b] for a, b in itertools.product(range(vocab), repeat=2)],
                    np.int32)
    logits = full_logits(target, params, seqs)                       # [V*V, L+2, V]
    n = len(prompt)
    logp = np.asarray(target_log_probs(jnp.asarray(logits[:, n - 1:n + 2]), sampling),
                      np.float64)
    p = np.exp(logp).reshape(vocab, vocab, 3, vocab)
    return p[0, 0, 0][:, None, None] * p[:, 0, 1][:, :, None] * p[:, :, 2]


def assert_first_three_follow_target(target: TargetLM, params, prompt: list[int], vocab: int,
                                     tokens, sampling) -> None:
    """Chi-square test of generated rows' first three tokens ``tokens [N, 3]`` against
    :func:`exact_joint_probs` (cells with < 20 expected pooled; at least 5 degrees of
    freedom)."""
    tokens = np.asarray(tokens)
    counts = np.zeros((vocab, vocab, vocab))
    np.add.at(counts, tuple(tokens.T), 1)
    probs = exact_joint_probs(target, params, prompt, vocab, sampling)
    stat, df, threshold = chi_square_test(counts, probs, min_expected=20.0)
    assert df >= 5
    assert stat < threshold, f"chi2 {stat:.1f} >= {threshold:.1f} (df {df})"


def prefill_state(target, params, prompts, config, drafter, draft_params, seed=0):
    """The decode state right after the prefill ``generate`` would run (as
    ``speculative._prepare``: bucketed prompt width, aligned capacity), compiling the prefill
    program alone: the tests that only inspect the prefilled state need no round loop."""
    from domino_jax.decode import speculative
    from domino_jax.kv_cache import align_slots

    prompt, prompt_len = speculative.pad_prompts(prompts)
    num_drafts = drafter.verify_width - 1
    capacity = align_slots(speculative.required_capacity(prompt.shape[1], config, num_drafts))
    key = jax.random.PRNGKey(seed)
    prefill_fn, _ = speculative.compiled_prefill(target, drafter, config, params, draft_params,
                                                 prompt, prompt_len, key, capacity)
    return prefill_fn(params, draft_params, prompt, prompt_len, key)
