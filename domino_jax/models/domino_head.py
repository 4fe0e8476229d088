"""The Domino head: a bias-free GRU over the in-block prefix + a low-rank logit correction.

algorithms.md §3.1-§3.3. For draft hidden ``z_i`` (the backbone's final-normed state, the
same tensor that feeds the target LM head) and GRU state ``s``::

    final_i = base_i + W2 · silu(W1 · [z_i ; s])       base_i = lm_head(z_i)

GRU (PyTorch semantics, gate order r, z, n; zero initial state; no biases)::

    gi = x W_ih ; gh = h W_hh                         # [3G] = [r | z | n]
    r = σ(gi_r + gh_r); z = σ(gi_z + gh_z); n = tanh(gi_n + r ⊙ gh_n)
    h' = (1 − z) ⊙ n + z ⊙ h

Parameters (plain dict, Flax ``[in, out]`` layout, i.e. the transpose of torch's)::

    prefix_gru/weight_ih   [H, 3G]   (torch prefix_gru.weight_ih_l0 [3G, H])
    prefix_gru/weight_hh   [G, 3G]   (torch prefix_gru.weight_hh_l0 [3G, G])
    embed_proj_0/kernel    [H+G, E]  (torch embed_proj.0.weight [E, H+G]); rows [:H] act on z
    embed_proj_2/kernel    [E, V]    (torch embed_proj.2.weight [V, E])

Two pure entry points over the same params: :func:`teacher_forced_logits` (training, the
§3.2 table in *block-slot* indexing) and :func:`rollout` (inference, *draft-index*
indexing, one token at a time as a ``lax.scan``). Matmuls run in the activations' dtype
with float32 accumulation; gates and the logit add are float32 (algorithms.md §9.4).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from domino_jax.config import DraftConfig
from domino_jax.topk import top_k

HeadParams = dict[str, Any]
ChooseFn = Callable[[jax.Array, jax.Array], jax.Array]   # (logits [B, V] f32, key) -> [B]


def head_param_shapes(config: DraftConfig, dtype=jnp.bfloat16) -> HeadParams:
    """``ShapeDtypeStruct`` tree of the head's parameters."""
    h, g, e, v = config.hidden_size, config.gru_hidden_dim, config.emb_dim, config.vocab_size
    s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
    return {"prefix_gru": {"weight_ih": s(h, 3 * g), "weight_hh": s(g, 3 * g)},
            "embed_proj_0": {"kernel": s(h + g, e)},
            "embed_proj_2": {"kernel": s(e, v)}}


def init_head_params(config: DraftConfig, rng: jax.Array, dtype=jnp.float32) -> HeadParams:
    """Random head parameters, uniform ``±1/sqrt(fan_in)`` like torch's defaults."""
    return _init_head_params(config, rng, dtype)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_head_params(config: DraftConfig, rng: jax.Array, dtype) -> HeadParams:
    shapes = head_param_shapes(config, dtype)
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    keys = jax.random.split(rng, len(leaves))
    gru_fan = config.gru_hidden_dim

    def init(key, leaf, path):
        fan_in = gru_fan if "prefix_gru" in path else leaf.shape[0]
        bound = fan_in ** -0.5
        return jax.random.uniform(key, leaf.shape, jnp.float32, -bound, bound).astype(dtype)

    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]]
    return jax.tree_util.tree_unflatten(
        treedef, [init(k, leaf, p) for k, leaf, p in zip(keys, leaves, paths)])


def _matmul(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``x [..., in] @ kernel [in, out]`` in ``x.dtype`` with float32 accumulation -> float32."""
    return jnp.einsum("...i,io->...o", x, kernel.astype(x.dtype),
                      preferred_element_type=jnp.float32)


def gru_input_gates(head_params: HeadParams, x: jax.Array) -> jax.Array:
    """Input half of a GRU step: ``x [..., H] -> gi [..., 3G]`` float32."""
    return _matmul(x, head_params["prefix_gru"]["weight_ih"])


def gru_update(input_gates: jax.Array, hidden_gates: jax.Array, state: jax.Array) -> jax.Array:
    """The gate arithmetic of one GRU step: ``gi, gh [..., 3G]`` (float32; ``[r | z | n]``) and
    ``state [..., G]`` -> new state (``state.dtype``)."""
    gi_r, gi_z, gi_n = jnp.split(input_gates.astype(jnp.float32), 3, axis=-1)
    gh_r, gh_z, gh_n = jnp.split(hidden_gates.astype(jnp.float32), 3, axis=-1)
    reset = jax.nn.sigmoid(gi_r + gh_r)
    update = jax.nn.sigmoid(gi_z + gh_z)
    candidate = jnp.tanh(gi_n + reset * gh_n)
    new_state = (1.0 - update) * candidate + update * state.astype(jnp.float32)
    return new_state.astype(state.dtype)


def gru_step_from_gates(head_params: HeadParams, input_gates: jax.Array,
                        state: jax.Array) -> jax.Array:
    """One GRU step given ``gi [..., 3G]`` (float32) and ``state [..., G]`` -> new state
    (``state.dtype``)."""
    hidden_gates = _matmul(state, head_params["prefix_gru"]["weight_hh"])
    return gru_update(input_gates, hidden_gates, state)


def token_input_gates(head_params: HeadParams, embed_table: jax.Array, tokens: jax.Array,
                      dtype) -> jax.Array:
    """GRU input gates of ``tokens [...]`` -> float32 ``[..., 3G]``.

    A row gather from ``head_params["gru_input_table"]`` when the head is in the decode layout
    (:func:`domino_jax.models.fused_layout.head_decode_params`), else ``embed_table[tokens]``
    (cast to ``dtype``) times ``W_ih``. The two agree up to float32 accumulation order.
    """
    if "gru_input_table" in head_params:
        return head_params["gru_input_table"][tokens].astype(jnp.float32)
    return gru_input_gates(head_params, embed_table[tokens].astype(dtype))


def state_kernels(head_params: HeadParams) -> tuple[jax.Array, jax.Array]:
    """The two kernels the GRU state multiplies: ``(W1_s [G, E], W_hh [G, 3G])``."""
    hidden_size = head_params["prefix_gru"]["weight_ih"].shape[0]
    return _split_w1(head_params, hidden_size)[1], head_params["prefix_gru"]["weight_hh"]


def state_products(head_params: HeadParams, state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(state W1_s [..., E], state W_hh [..., 3G])``, float32, for ``state [..., G]``.

    Both products read the same state: in the decode layout (``state_proj/kernel [G, E + 3G]``
    = ``[W1_s | W_hh]``) they are one product, one kernel launch instead of two per step.
    """
    if "state_proj" in head_params:
        both = _matmul(state, head_params["state_proj"]["kernel"])
        emb_dim = head_params["embed_proj_0"]["kernel"].shape[1]
        return both[..., :emb_dim], both[..., emb_dim:]
    w1_s, w_hh = state_kernels(head_params)
    return _matmul(state, w1_s), _matmul(state, w_hh)


def root_gru_state(head_params: HeadParams, root_embed: jax.Array) -> jax.Array:
    """GRU state after the root token only: one step from the zero state (whose hidden gates
    are zero, so no ``W_hh`` product). ``root_embed [..., H]`` -> ``[..., G]`` (its dtype)."""
    g = head_params["prefix_gru"]["weight_hh"].shape[0]
    batch = root_embed.shape[:-1]
    return gru_update(gru_input_gates(head_params, root_embed),
                      jnp.zeros(batch + (3 * g,), jnp.float32),
                      jnp.zeros(batch + (g,), root_embed.dtype))


def gru_cell(head_params: HeadParams, x: jax.Array, state: jax.Array) -> jax.Array:
    """``torch.nn.GRUCell(bias=False)``: ``x [..., H]``, ``state [..., G]`` -> ``[..., G]``."""
    return gru_step_from_gates(head_params, gru_input_gates(head_params, x), state)


def gru_states(head_params: HeadParams, inputs: jax.Array) -> jax.Array:
    """GRU from a zero state over ``inputs [N, T, H]``: all states ``[N, T, G]`` (state ``t``
    has consumed inputs ``0..t``), as a ``lax.scan`` over time."""
    gates = gru_input_gates(head_params, inputs)                        # [N, T, 3G]
    g = head_params["prefix_gru"]["weight_hh"].shape[0]
    state0 = jnp.zeros((inputs.shape[0], g), inputs.dtype)

    def step(state, gi):
        state = gru_step_from_gates(head_params, gi, state)
        return state, state

    _, states = jax.lax.scan(step, state0, jnp.swapaxes(gates, 0, 1))
    return jnp.swapaxes(states, 0, 1)


def _split_w1(head_params: HeadParams, hidden_size: int):
    w1 = head_params["embed_proj_0"]["kernel"]
    return w1[:hidden_size], w1[hidden_size:]


def correction(head_params: HeadParams, draft_hidden: jax.Array,
               gru_state: jax.Array) -> jax.Array:
    """``Δ = W2 · silu(W1 · [z ; s])``: ``draft_hidden [..., H]``, ``gru_state [..., G]`` ->
    float32 ``[..., V]``."""
    w1_z, w1_s = _split_w1(head_params, draft_hidden.shape[-1])
    pre = _matmul(draft_hidden, w1_z) + _matmul(gru_state.astype(draft_hidden.dtype), w1_s)
    act = jax.nn.silu(pre).astype(draft_hidden.dtype)
    return _matmul(act, head_params["embed_proj_2"]["kernel"])


def teacher_forced_logits(head_params: HeadParams, config: DraftConfig,
                          draft_hidden: jax.Array, base_logits: jax.Array,
                          prev_token_embeds: jax.Array) -> jax.Array:
    """Training path (algorithms.md §3.2, §3.4), in block-slot indexing.

    Args:
      draft_hidden: ``[N, Bk, H]`` backbone output for every block slot.
      base_logits: ``[N, Bk, V]`` target LM head on ``draft_hidden``.
      prev_token_embeds: ``[N, Bk, H]`` target embeddings of the ground-truth block
        ``x_a .. x_{a+Bk-1}`` (slot 0 = the anchor / root).
    Returns:
      float32 ``[N, Bk, V]``: ``base`` for slots ``< suffix_start``; from ``suffix_start`` on,
      ``base + Δ(z_k, g)`` with ``g`` = GRU state after ``x_a..x_{a+k}`` (``shift_label``) or
      after ``x_a..x_{a+k-1}`` (otherwise).
    """
    states = gru_states(head_params, prev_token_embeds.astype(draft_hidden.dtype))  # [N, Bk, G]
    if not config.shift_label:                # slot k uses the state before input k
        states = jnp.concatenate([jnp.zeros_like(states[:, :1]), states[:, :-1]], axis=1)
    delta = correction(head_params, draft_hidden, states)
    slots = jnp.arange(base_logits.shape[1])[None, :, None]
    base = base_logits.astype(jnp.float32)
    return jnp.where(slots >= config.suffix_start, base + delta, base)


def gru_input_table(head_params: HeadParams, embed_table: jax.Array) -> jax.Array:
    """``[V, 3G]`` float32 table ``embed_table @ W_ih``: a GRU input step on token ``t`` becomes
    the row gather ``table[t]`` (algorithms.md §3.1's fast-path table). Made once, at load
    time, by :func:`domino_jax.models.fused_layout.head_decode_params`."""
    return gru_input_gates(head_params, embed_table)


def rollout(head_params: HeadParams, config: DraftConfig, draft_hidden: jax.Array,
            base_logits: jax.Array, root_embed: jax.Array, embed_table: jax.Array,
            choose_fn: ChooseFn, rng_key: jax.Array,
            candidate_topm: int = 0) -> tuple[jax.Array, jax.Array]:
    """Inference rollout of one block (algorithms.md §3.3), in draft-index indexing.

    Args:
      head_params: the head's parameters, plain or in the decode layout
        (:func:`domino_jax.models.fused_layout.head_decode_params`: a ``[V, 3G]`` GRU input
        table makes a step's input gates a row gather instead of an ``[H, 3G]`` product, and
        ``[W1_s | W_hh]`` makes the two products of the state one). Same drafts either way,
        up to float32 accumulation order.
      draft_hidden: ``[B, K, H]`` the ``K = k_draft`` draft positions (the caller drops block
        slot 0 when ``shift_label`` is false).
      base_logits: ``[B, K, V]`` target LM head on ``draft_hidden``.
      root_embed: ``[B, H]`` target embedding of the block's root token.
      embed_table: ``[V, H]`` the target's embedding table (to embed the chosen drafts).
      choose_fn: ``(logits [B, n] float32, key) -> index [B] int32`` (argmax or sampling; ``n``
        is ``V``, or ``M`` with a candidate pool).
      rng_key: split into one key per position.
      candidate_topm: ``M > 0``: corrected positions choose among the top-``M`` tokens of
        their own base logits only (the candidate pool of SGLang's Domino rollout and of
        DominoTree's ``corr_topm``, algorithms.md §3.3 / §5.3). The correction is then
        ``M`` dot products instead of a ``[E, V]`` product, and the candidates' GRU input
        gates are gathered once per block, so a step reads kilobytes instead of ~100 MB.
        Drafts equal the full-vocab ones whenever the full-vocab choice lies in the
        pool; either way verification keeps decoding lossless. ``0``: full vocabulary
        (the reference's graph runner).
    Returns:
      ``tokens [B, K]`` int32 and the float32 ``logits [B, K, V]`` each token was chosen
      from: ``base`` for positions ``< P``; ``base + Δ(z_i, s_i)`` from ``P`` on, where
      ``s_i`` = GRU over embeds of ``[root, d_0 .. d_{i-1}]`` from zeros (with a pool:
      ``-inf`` outside it). The ``K`` steps are unrolled (no loop round trip per step).
    """
    batch, num_drafts, hidden_size = draft_hidden.shape
    vocab = base_logits.shape[-1]
    prefix_len = min(config.pure_draft_prefix_len, num_drafts)
    act_dtype = draft_hidden.dtype
    w1_z, _ = _split_w1(head_params, hidden_size)
    w2 = head_params["embed_proj_2"]["kernel"]
    z_proj = _matmul(draft_hidden, w1_z)                                   # [B, K, E] hoisted
    base = base_logits.astype(jnp.float32)
    m = min(candidate_topm, vocab)
    if m > 0:                                          # per-position pools, made once
        cand_logits, cand = top_k(base, m)                                # [B, K, M] int32
        w2_cand = jnp.moveaxis(w2[:, cand], 0, -1)                        # [B, K, M, E]
        cand_gates = token_input_gates(head_params, embed_table, cand, act_dtype)
    state = root_gru_state(head_params, root_embed.astype(act_dtype))    # after [root]
    keys = jax.random.split(rng_key, num_drafts)
    tokens, logits, pooled = [], [], []
    for i in range(num_drafts):
        corrected = i >= prefix_len
        state_w1, state_hh = state_products(head_params, state)        # one product, decode
        if corrected:
            u = jax.nn.silu(z_proj[:, i] + state_w1).astype(act_dtype)
        if corrected and m > 0:
            pool_logits = cand_logits[:, i] + jnp.einsum(
                "bme,be->bm", w2_cand[:, i], u, preferred_element_type=jnp.float32)
            j = choose_fn(pool_logits, keys[i]).astype(jnp.int32)[:, None]
            token = jnp.take_along_axis(cand[:, i], j, axis=1)[:, 0]
            gates = jnp.take_along_axis(cand_gates[:, i], j[:, :, None], axis=1)[:, 0]
            pooled.append(pool_logits)
        else:
            logits_i = base[:, i] + _matmul(u, w2) if corrected else base[:, i]
            token = choose_fn(logits_i, keys[i]).astype(jnp.int32)
            gates = token_input_gates(head_params, embed_table, token, act_dtype)
            logits.append(logits_i)
        if i + 1 < num_drafts:
            state = gru_update(gates, state_hh, state)
        tokens.append(token)
    logits = (jnp.stack(logits, axis=1) if logits                          # [B, K or P, V]
              else jnp.zeros((batch, 0, vocab), jnp.float32))
    if pooled:             # one scatter after the loop: -inf outside each position's pool
        rows = jnp.arange(batch)[:, None, None]
        slots = jnp.arange(len(pooled))[None, :, None]
        full = jnp.full((batch, len(pooled), vocab), -jnp.inf, jnp.float32).at[
            rows, slots, cand[:, prefix_len:]].set(jnp.stack(pooled, axis=1))
        logits = jnp.concatenate([logits, full], axis=1)
    return jnp.stack(tokens, axis=1), logits


def head_param_count(config: DraftConfig) -> int:
    """Number of head parameters: ``3G(H+G) + E(H+G) + V E``."""
    h, g, e, v = config.hidden_size, config.gru_hidden_dim, config.emb_dim, config.vocab_size
    return 3 * g * (h + g) + e * (h + g) + v * e
