"""The Domino head as one unit: its parameters, its decode layout and every operation the
chain rollout, the trees and training need.

The maths (docs/algorithms.md §3.1-§3.3). For draft hidden ``z_i`` (the backbone's
final-normed state, the same tensor that feeds the target LM head) and GRU state ``s``::

    final_i = base_i + W2 · silu(W1 · [z_i ; s])       base_i = lm_head(z_i)

GRU (PyTorch semantics, gate order r, z, n; zero initial state; no biases)::

    gi = x W_ih ; gh = h W_hh                         # [3G] = [r | z | n]
    r = σ(gi_r + gh_r); z = σ(gi_z + gh_z); n = tanh(gi_n + r ⊙ gh_n)
    h' = (1 − z) ⊙ n + z ⊙ h

Parameters, the checkpoint layout (:data:`HeadParams`, a plain dict in Flax ``[in, out]``
layout, the transpose of torch's; training, the converters and the teacher-forced path
use it)::

    prefix_gru/weight_ih   [H, 3G]   (torch prefix_gru.weight_ih_l0 [3G, H])
    prefix_gru/weight_hh   [G, 3G]   (torch prefix_gru.weight_hh_l0 [3G, G])
    embed_proj_0/kernel    [H+G, E]  (torch embed_proj.0.weight [E, H+G]); rows [:H] act on z
    embed_proj_2/kernel    [E, V]    (torch embed_proj.2.weight [V, E])

The decode layout, :class:`DecodeHead` (made once at load time by :func:`decode_head`):
the plain parameters plus ``state_proj = [W_hh | W1_s]`` (the two products of a GRU state
become one) and, optionally, the float32 ``[V, 3G]`` GRU input table ``embed @ W_ih`` (a
step's input gates become a row gather). Every operation below takes either layout and
gives the same values up to float32 accumulation order.

Operations: :func:`root_gru_state`, :func:`child_state`, :func:`state_products`,
:func:`token_input_gates` (GRU steps); :func:`correction` and
:func:`teacher_forced_logits` (training, *block-slot* indexing); :func:`rollout` (the
chain's drafts, *draft-index* indexing); :func:`tree_children` (DominoTree's children of
a node). Matmuls run in the activations' dtype with float32 accumulation; gates and the
logit add are float32 (docs/algorithms.md §9.4).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Union

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from domino_jax.config import DraftConfig
from domino_jax.topk import top_k

HeadParams = dict[str, Any]     # the checkpoint layout (see the module doc)
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


def head_param_count(config: DraftConfig) -> int:
    """Number of head parameters: ``3G(H+G) + E(H+G) + V E``."""
    h, g, e, v = config.hidden_size, config.gru_hidden_dim, config.emb_dim, config.vocab_size
    return 3 * g * (h + g) + e * (h + g) + v * e


# --------------------------------------------------------------------------- decode layout


@flax.struct.dataclass
class DecodeHead:
    """The head in its decode layout (a pytree; see the module doc).

    ``params``: the plain :data:`HeadParams`. ``state_proj``: ``[G, 3G + E]`` =
    ``[W_hh | W1_s]`` (``W_hh`` first: the Pallas kernels' lane-aligned order,
    ``domino_jax/pallas/head_step.py``). ``input_table``: ``[V, 3G]`` float32 ``embed_table
    @ W_ih``, or ``None`` (then a step's input gates are ``embed_table[t] @ W_ih``). Made
    by :func:`decode_head`.
    """

    params: HeadParams
    state_proj: jax.Array
    input_table: jax.Array | None = None


Head = Union[HeadParams, DecodeHead]     # what every operation below accepts


def plain_params(head: Head) -> HeadParams:
    """The checkpoint-layout parameters of either layout."""
    return head.params if isinstance(head, DecodeHead) else head


def _concat(arrays):
    if all(isinstance(a, np.ndarray) for a in arrays):
        return np.concatenate(arrays, axis=-1)
    return jnp.concatenate(arrays, axis=-1)


def decode_head(head_params: HeadParams, embed_table: Any, input_table: bool = True) -> DecodeHead:
    """The head in its decode layout, made once at load time.

    At decode the rollout's steps are sequential and each is a few one-row products, so
    every product saved per step is a kernel launch saved ``K`` times per round:
    ``state_proj = [W_hh | W1_s]`` makes the state's two products one, and the GRU input
    table (``12 V G`` bytes: 1.87 GB for Qwen3's vocabulary and ``G = 1024``; float32 so
    the gates equal the plain path's, where the reference fast paths keep a bf16 table)
    makes a step's input gates a row gather instead of an ``[H, 3G]`` product.

    ``embed_table [V, H]``: the target's embedding table (the GRU's inputs are its rows).
    ``input_table=False`` makes only ``state_proj``. Raises ``ValueError`` when the head is
    already a :class:`DecodeHead` or the shapes disagree.
    """
    if isinstance(head_params, DecodeHead):
        raise ValueError("head params already in the decode layout (a DecodeHead)")
    w_ih = head_params["prefix_gru"]["weight_ih"]
    if tuple(embed_table.shape[1:]) != (w_ih.shape[0],):
        raise ValueError(f"embed_table {tuple(embed_table.shape)} does not fit the head's "
                         f"prefix_gru/weight_ih {tuple(w_ih.shape)} (hidden size)")
    table = None
    if input_table:
        table = jax.jit(gru_input_table)(head_params,
                                         jnp.asarray(embed_table).astype(w_ih.dtype))
    w1_s, w_hh = state_kernels(head_params)
    return DecodeHead(params=head_params, state_proj=_concat([w_hh, w1_s]), input_table=table)


# --------------------------------------------------------------------------- GRU steps


def _matmul(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``x [..., in] @ kernel [in, out]`` in ``x.dtype`` with float32 accumulation -> float32."""
    return jnp.einsum("...i,io->...o", x, kernel.astype(x.dtype),
                      preferred_element_type=jnp.float32)


def gru_input_gates(head: Head, x: jax.Array) -> jax.Array:
    """Input half of a GRU step: ``x [..., H] -> gi [..., 3G]`` float32."""
    return _matmul(x, plain_params(head)["prefix_gru"]["weight_ih"])


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


def gru_step_from_gates(head: Head, input_gates: jax.Array, state: jax.Array) -> jax.Array:
    """One GRU step given ``gi [..., 3G]`` (float32) and ``state [..., G]`` -> new state
    (``state.dtype``)."""
    hidden_gates = _matmul(state, plain_params(head)["prefix_gru"]["weight_hh"])
    return gru_update(input_gates, hidden_gates, state)


def token_input_gates(head: Head, embed_table: jax.Array, tokens: jax.Array,
                      dtype) -> jax.Array:
    """GRU input gates of ``tokens [...]`` -> float32 ``[..., 3G]``.

    A row gather from the input table of a :class:`DecodeHead` that has one, else
    ``embed_table[tokens]`` (cast to ``dtype``) times ``W_ih``. The two agree up to float32
    accumulation order.
    """
    if isinstance(head, DecodeHead) and head.input_table is not None:
        return head.input_table[tokens].astype(jnp.float32)
    return gru_input_gates(head, embed_table[tokens].astype(dtype))


def state_kernels(head: Head) -> tuple[jax.Array, jax.Array]:
    """The two kernels the GRU state multiplies: ``(W1_s [G, E], W_hh [G, 3G])``."""
    params = plain_params(head)
    hidden_size = params["prefix_gru"]["weight_ih"].shape[0]
    return _split_w1(params, hidden_size)[1], params["prefix_gru"]["weight_hh"]


def state_products(head: Head, state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(state W1_s [..., E], state W_hh [..., 3G])``, float32, for ``state [..., G]``.

    Both products read the same state: with a :class:`DecodeHead` (``state_proj [G, 3G + E]``
    = ``[W_hh | W1_s]``) they are one product, one kernel launch instead of two per step.
    """
    if isinstance(head, DecodeHead):
        both = _matmul(state, head.state_proj)
        gates = 3 * head.params["prefix_gru"]["weight_hh"].shape[0]
        return both[..., gates:], both[..., :gates]
    w1_s, w_hh = state_kernels(head)
    return _matmul(state, w1_s), _matmul(state, w_hh)


def root_gru_state(head: Head, root_embed: jax.Array) -> jax.Array:
    """GRU state after the root token only: one step from the zero state (whose hidden gates
    are zero, so no ``W_hh`` product). ``root_embed [..., H]`` -> ``[..., G]`` (its dtype)."""
    g = plain_params(head)["prefix_gru"]["weight_hh"].shape[0]
    batch = root_embed.shape[:-1]
    return gru_update(gru_input_gates(head, root_embed),
                      jnp.zeros(batch + (3 * g,), jnp.float32),
                      jnp.zeros(batch + (g,), root_embed.dtype))


def child_state(head: Head, embed_table: jax.Array, parent_states: jax.Array,
                tokens: jax.Array) -> jax.Array:
    """GRU state of a tree node from its parent's state and its own token: ``parent_states
    [..., G]``, ``tokens [...]`` -> ``[..., G]`` (one GRU step on the token's embedding; its
    input gates are a row gather when the head has an input table)."""
    gates = token_input_gates(head, embed_table, tokens, parent_states.dtype)
    return gru_step_from_gates(head, gates, parent_states)


def gru_cell(head: Head, x: jax.Array, state: jax.Array) -> jax.Array:
    """``torch.nn.GRUCell(bias=False)``: ``x [..., H]``, ``state [..., G]`` -> ``[..., G]``."""
    return gru_step_from_gates(head, gru_input_gates(head, x), state)


def gru_states(head: Head, inputs: jax.Array) -> jax.Array:
    """GRU from a zero state over ``inputs [N, T, H]``: all states ``[N, T, G]`` (state ``t``
    has consumed inputs ``0..t``), as a ``lax.scan`` over time."""
    gates = gru_input_gates(head, inputs)                               # [N, T, 3G]
    g = plain_params(head)["prefix_gru"]["weight_hh"].shape[0]
    state0 = jnp.zeros((inputs.shape[0], g), inputs.dtype)

    def step(state, gi):
        state = gru_step_from_gates(head, gi, state)
        return state, state

    _, states = jax.lax.scan(step, state0, jnp.swapaxes(gates, 0, 1))
    return jnp.swapaxes(states, 0, 1)


def _split_w1(params: HeadParams, hidden_size: int):
    w1 = params["embed_proj_0"]["kernel"]
    return w1[:hidden_size], w1[hidden_size:]


# --------------------------------------------------------------------------- correction


def correction_features(head: Head, draft_hidden: jax.Array, gru_state: jax.Array) -> jax.Array:
    """``silu(W1 · [z ; s])``: ``draft_hidden [..., H]``, ``gru_state [..., G]`` -> ``[..., E]``
    in ``draft_hidden.dtype`` (the input of the correction's ``[E, V]`` projection)."""
    params = plain_params(head)
    w1_z, w1_s = _split_w1(params, draft_hidden.shape[-1])
    pre = _matmul(draft_hidden, w1_z) + _matmul(gru_state.astype(draft_hidden.dtype), w1_s)
    return jax.nn.silu(pre).astype(draft_hidden.dtype)


def correction(head: Head, draft_hidden: jax.Array, gru_state: jax.Array) -> jax.Array:
    """``Δ = W2 · silu(W1 · [z ; s])``: ``draft_hidden [..., H]``, ``gru_state [..., G]`` ->
    float32 ``[..., V]``."""
    act = correction_features(head, draft_hidden, gru_state)
    return _matmul(act, plain_params(head)["embed_proj_2"]["kernel"])


def teacher_forced_features(head: Head, config: DraftConfig, draft_hidden: jax.Array,
                            prev_token_embeds: jax.Array) -> jax.Array:
    """The teacher-forced correction features ``[N, Bk, E]`` (block-slot indexing; see
    :func:`teacher_forced_logits`): slot ``k``'s ``silu(W1 · [z_k ; g])`` with ``g`` the GRU
    state after ``x_a..x_{a+k}`` (``shift_label``) or after ``x_a..x_{a+k-1}`` (otherwise).
    Its correction is ``features @ embed_proj_2`` on slots ``>= suffix_start``."""
    states = gru_states(head, prev_token_embeds.astype(draft_hidden.dtype))  # [N, Bk, G]
    if not config.shift_label:                # slot k uses the state before input k
        states = jnp.concatenate([jnp.zeros_like(states[:, :1]), states[:, :-1]], axis=1)
    return correction_features(head, draft_hidden, states)


def teacher_forced_logits(head: Head, config: DraftConfig,
                          draft_hidden: jax.Array, base_logits: jax.Array,
                          prev_token_embeds: jax.Array) -> jax.Array:
    """Training path (docs/algorithms.md §3.2, §3.4), in block-slot indexing.

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
    act = teacher_forced_features(head, config, draft_hidden, prev_token_embeds)
    delta = _matmul(act, plain_params(head)["embed_proj_2"]["kernel"])
    slots = jnp.arange(base_logits.shape[1])[None, :, None]
    base = base_logits.astype(jnp.float32)
    return jnp.where(slots >= config.suffix_start, base + delta, base)


def gru_input_table(head: Head, embed_table: jax.Array) -> jax.Array:
    """``[V, 3G]`` float32 table ``embed_table @ W_ih``: a GRU input step on token ``t`` becomes
    the row gather ``table[t]`` (docs/algorithms.md §3.1). Made once, at load time, by
    :func:`decode_head`."""
    return gru_input_gates(head, embed_table)


# --------------------------------------------------------------------------- chain rollout


def rollout(head: Head, config: DraftConfig, draft_hidden: jax.Array,
            base_logits: jax.Array, root_embed: jax.Array, embed_table: jax.Array,
            choose_fn: ChooseFn, rng_key: jax.Array,
            candidate_topm: int = 0) -> tuple[jax.Array, jax.Array]:
    """Inference rollout of one block (docs/algorithms.md §3.3), in draft-index indexing.

    Args:
      head: the head's parameters, plain or a :class:`DecodeHead` (same drafts either way,
        up to float32 accumulation order).
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
        DominoTree's ``corr_topm``, docs/algorithms.md §3.3 / §5.3). The correction is then
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
    w1_z, _ = _split_w1(plain_params(head), hidden_size)
    w2 = plain_params(head)["embed_proj_2"]["kernel"]
    z_proj = _matmul(draft_hidden, w1_z)                                   # [B, K, E] hoisted
    base = base_logits.astype(jnp.float32)
    m = min(candidate_topm, vocab)
    if m > 0:                                          # per-position pools, made once
        cand_logits, cand = top_k(base, m)                                # [B, K, M] int32
        w2_cand = jnp.moveaxis(w2[:, cand], 0, -1)                        # [B, K, M, E]
        cand_gates = token_input_gates(head, embed_table, cand, act_dtype)
    state = root_gru_state(head, root_embed.astype(act_dtype))           # after [root]
    keys = jax.random.split(rng_key, num_drafts)
    tokens, logits, pooled = [], [], []
    for i in range(num_drafts):
        corrected = i >= prefix_len
        state_w1, state_hh = state_products(head, state)               # one product, decode
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
            gates = token_input_gates(head, embed_table, token, act_dtype)
            logits.append(logits_i)
        if i + 1 < num_drafts:
            state = gru_update(gates, state_hh, state)
        tokens.append(token)
    return jnp.stack(tokens, axis=1), rollout_logits(logits, pooled, cand if m > 0 else None,
                                                     prefix_len, batch, vocab)


def rollout_logits(logits: list, pooled: list, cand: jax.Array | None, prefix_len: int,
                   batch: int, vocab: int) -> jax.Array:
    """``rollout``'s second output from its per-position rows: ``logits`` (full-vocabulary
    ``[B, V]`` rows, positions first), then ``pooled`` (``[B, M]`` candidate-pool rows of
    positions ``P..``, with ``cand [B, K, M]``) scattered into ``-inf`` rows: ``[B, K, V]``."""
    logits = (jnp.stack(logits, axis=1) if logits                          # [B, K or P, V]
              else jnp.zeros((batch, 0, vocab), jnp.float32))
    if pooled:             # one scatter after the loop: -inf outside each position's pool
        rows = jnp.arange(batch)[:, None, None]
        slots = jnp.arange(len(pooled))[None, :, None]
        full = jnp.full((batch, len(pooled), vocab), -jnp.inf, jnp.float32).at[
            rows, slots, cand[:, prefix_len:]].set(jnp.stack(pooled, axis=1))
        logits = jnp.concatenate([logits, full], axis=1)
    return logits


# --------------------------------------------------------------------------- tree children


class TreeTables(NamedTuple):
    """What DominoTree's children read, made once per round (one tree): per depth ``d`` the
    uncorrected children ``base_tok, base_lp [K, ntop]`` (the top of the full-vocabulary
    ``log_softmax(base[d])``) and, unless ``marginal``, ``z_proj [K, E]`` float32 and, with
    ``topm = M > 0``, the top-M base candidates ``cand [K, M]``, their base logits
    ``cand_logits [K, M]`` and float32 ``W2`` rows ``cand_w2 [K, M, E]``."""

    base_tok: jax.Array
    base_lp: jax.Array
    z_proj: jax.Array | None
    cand: jax.Array | None
    cand_logits: jax.Array | None
    cand_w2: jax.Array | None


def tree_tables(head: Head, draft_hidden: jax.Array, base_logits: jax.Array,
                node_topk: int = 8, topm: int = 64, marginal: bool = False) -> TreeTables:
    """:class:`TreeTables` of one tree: ``draft_hidden [K, H]``, ``base_logits [K, V]``."""
    vocab = base_logits.shape[-1]
    ntop = min(node_topk, vocab)
    base = base_logits.astype(jnp.float32)
    # log_softmax(base) = (base - max) - log(sum(exp(base - max))), jax.nn.log_softmax's formula
    shift = jnp.max(base, axis=-1, keepdims=True)
    log_norm = jnp.log(jnp.sum(jnp.exp(base - shift), axis=-1, keepdims=True))   # [K, 1]
    m = 0 if marginal else min(topm, vocab)
    # one vocabulary-wide top-k (descending): its first ntop entries are the uncorrected
    # children, its first M the path-independent candidates
    top_vals, top_ids = top_k(base, max(ntop, m))                      # [K, max(ntop, M)]
    base_lp = (top_vals[:, :ntop] - shift) - log_norm                  # log_softmax at the top
    z_proj = cand = cand_logits = cand_w2 = None
    if not marginal:
        params = plain_params(head)
        w1_z, _ = _split_w1(params, draft_hidden.shape[-1])
        z_proj = _matmul(draft_hidden, w1_z)                           # [K, E] f32
        if m > 0:
            cand_logits, cand = top_vals[:, :m], top_ids[:, :m]        # [K, M]
            w2 = params["embed_proj_2"]["kernel"]                      # [E, V]
            cand_w2 = jnp.moveaxis(w2[:, cand], 0, -1).astype(jnp.float32)  # [K, M, E]
    return TreeTables(top_ids[:, :ntop], base_lp, z_proj, cand, cand_logits, cand_w2)


def tree_children(head: Head, draft_config: DraftConfig, draft_hidden: jax.Array,
                  base_logits: jax.Array, node_topk: int = 8, topm: int = 64,
                  marginal: bool = False):
    """DominoTree's children of a node (docs/algorithms.md §5.3), one tree (one batch row).

    Reads :func:`tree_tables` (made once per round). Returns ``(children, ntop)`` where
    ``children(states [..., G], d) -> (tokens [..., ntop] int32, log_probs [..., ntop]
    float32)`` gives the top-``ntop`` children at depth ``d`` (clamped to ``K - 1``; static
    or traced) of nodes whose GRU states are ``states`` (``children(states, d, state_w1)``
    takes ``states @ W1_s [..., E]`` float32 precomputed, e.g. by :func:`state_products`):

    * ``d < P`` (``pure_draft_prefix_len``) or ``marginal``: top of the full-vocab
      ``log_softmax(base[d])``, the same for every state;
    * ``topm = M > 0``: ``c = base[d][cand] + W2c[d] · silu(W1 · [hid[d]; state])``,
      normalised over the ``M`` candidates only (the reference's mixed normalisation);
    * ``topm = 0``: the full-vocabulary correction.

    ``draft_hidden [K, H]``, ``base_logits [K, V]``: the round's draft positions.
    """
    k_depth = base_logits.shape[0]
    prefix = draft_config.pure_draft_prefix_len
    act = draft_hidden.dtype
    tables = tree_tables(head, draft_hidden, base_logits, node_topk, topm, marginal)
    base_tok, base_lp, z_proj, cand, bc, w2c = tables
    ntop = base_tok.shape[-1]
    if not marginal:
        params = plain_params(head)
        _, w1_s = _split_w1(params, draft_hidden.shape[-1])
        w2 = params["embed_proj_2"]["kernel"]                          # [E, V]
        base = base_logits.astype(jnp.float32)

    def children(states, d, state_w1=None):
        d = jnp.minimum(d, k_depth - 1)
        batch = states.shape[:-1]
        from_base = (jnp.broadcast_to(base_tok[d], batch + (ntop,)),
                     jnp.broadcast_to(base_lp[d], batch + (ntop,)))
        if marginal:
            return from_base
        if state_w1 is None:
            state_w1 = _matmul(states.astype(act), w1_s)
        pre = z_proj[d] + state_w1
        u = jax.nn.silu(pre).astype(jnp.float32)                      # [..., E]
        if cand is not None:
            c = bc[d] + jnp.einsum("me,...e->...m", w2c[d], u)
            lp_c, j = jax.lax.top_k(jax.nn.log_softmax(c), ntop)
            tok_c = cand[d][j]
        else:
            c = base[d] + _matmul(u.astype(act), w2)
            lp_c, tok_c = jax.lax.top_k(jax.nn.log_softmax(c), ntop)
            tok_c = tok_c.astype(jnp.int32)
        use_base = d < prefix
        return (jnp.where(use_base, from_base[0], tok_c), jnp.where(use_base, from_base[1], lp_c))

    return children, ntop
