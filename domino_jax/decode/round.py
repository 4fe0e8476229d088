"""The on-device stages of decoding: prefill and one round (draft -> verify -> commit).

The contract between the loop and the drafters is in :mod:`domino_jax.decode.contract`.
Per round, for each row (ragged acceptance is carried as lengths, never as shapes):

1. :func:`draft`: the drafter's :class:`~domino_jax.decode.contract.Proposal` of ``N``
   tokens after the root (a chain or a tree);
2. :func:`verify`: the target reads ``[root, tokens...]`` in one forward at positions
   ``start + [0, 1 + depth...]`` (the tree mask for a tree), writing their K/V after the
   committed prefix, and the config's verification rule gives ``accepted``, the bonus and,
   for a tree, the accepted path;
3. :func:`commit`: the accepted drafts and the bonus go to the output (stops and
   ``max_new_tokens`` applied); the target cache advances by ``accepted + 1`` (root +
   accepted drafts; a tree's path is gathered into place first; rejected slots are left
   stale and masked); the drafter's features of those rows become its next context; the
   bonus is the next root.

Each stage runs under a ``jax.named_scope`` (``draft``, ``verify``, ``commit``), so
profiles attribute every kernel to its stage, and each is a public function that
benchmarks can jit alone; :mod:`domino_jax.decode.loop` runs the rounds. Stops: a row is
done at its first stop token (inclusive) or at ``max_new_tokens``; the host trims whatever
a block overran.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from domino_jax.decode.contract import NO_DRAFTER, DecodeState, Drafter, Proposal
from domino_jax.decode.prefill import prefill_prompt
from domino_jax.decode.sampling import choose, greedy_tokens, target_log_probs
from domino_jax.decode.verify import Verdict
from domino_jax.models.qwen3 import TargetLM, TargetOutput


def _drafter(drafter: Drafter | None) -> Drafter:
    return NO_DRAFTER if drafter is None else drafter


def first_stop(tokens: jax.Array, count: jax.Array, stop_ids: tuple[int, ...]) -> jax.Array:
    """Index of the first stop token among the first ``count`` of ``tokens [B, n]`` (n if none)."""
    n = tokens.shape[1]
    if not stop_ids:
        return jnp.full(tokens.shape[:1], n, jnp.int32)
    is_stop = jnp.isin(tokens, jnp.asarray(stop_ids, jnp.int32))
    is_stop &= jnp.arange(n)[None, :] < count[:, None]
    return jnp.where(is_stop.any(1), jnp.argmax(is_stop, axis=1), n).astype(jnp.int32)


def _write_rows(buffer: jax.Array, start: jax.Array, values: jax.Array) -> jax.Array:
    """``buffer[b, start[b] + j] = values[b, j]`` (out-of-range writes dropped)."""
    rows = jnp.arange(buffer.shape[0])[:, None]
    cols = start[:, None] + jnp.arange(values.shape[1])[None, :]
    return buffer.at[rows, cols].set(values, mode="drop")


def prefill(target: TargetLM, drafter: Drafter | None, config, target_params, draft_params,
            prompt: jax.Array, prompt_len: jax.Array, key: jax.Array,
            capacity: int) -> DecodeState:
    """The prompt's prefill (:func:`~domino_jax.decode.prefill.prefill_prompt`: the target's
    cache and the drafter's state, chunked for long prompts), the first token, the loop's
    state."""
    drafter = _drafter(drafter)
    batch = prompt.shape[0]
    width = drafter.max_commit                                  # tokens per round, max
    filled = prefill_prompt(target, drafter, target_params, draft_params, prompt, prompt_len,
                            capacity, config.prefill)
    key, first_key = jax.random.split(key)
    first = choose(first_key, filled.logits, config.sampling)   # at T: docs/algorithms.md §9.13
    out_tokens = jnp.zeros((batch, config.max_new_tokens + width), jnp.int32).at[:, 0].set(first)
    num_out = jnp.ones((batch,), jnp.int32)
    done = (first_stop(first[:, None], num_out, config.stop_token_ids) == 0)
    done |= config.max_new_tokens <= 1
    context = jnp.zeros((batch, width, drafter.feature_dim), target.dtype)
    history = None
    if drafter.reads_history:              # prompt + first token by position
        history = jnp.zeros((batch, capacity), jnp.int32).at[:, :prompt.shape[1]].set(prompt)
        history = _write_rows(history, filled.cache.lengths, first[:, None])
    return DecodeState(out_tokens, num_out, done, first, filled.cache, filled.draft_cache,
                       context,
                       jnp.zeros((batch,), jnp.int32), key, jnp.zeros((batch,), jnp.int32),
                       jnp.zeros((batch, width + 1), jnp.int32), history)


class Verified(NamedTuple):
    """:func:`verify`'s result: the verdict and the verify forward it came from."""

    verdict: Verdict
    proposal: Proposal
    out: TargetOutput            # logits [B, N+1, V], taps, cache with the verify K/V written


def draft(drafter: Drafter, config, target_params, draft_params, state: DecodeState,
          key: jax.Array) -> Proposal:
    """Stage 1: the drafter's proposal for this round."""
    with jax.named_scope("draft"):
        return drafter.propose(target_params, draft_params, state, key, config)


def verify_forward(target: TargetLM, drafter: Drafter, target_params, state: DecodeState,
                   proposal: Proposal) -> TargetOutput:
    """The target's forward over ``[root, tokens...]`` with the KV cache (causal for a
    chain, the tree mask for a tree)."""
    tokens = jnp.concatenate([state.root[:, None], proposal.tokens], axis=1)   # [B, N+1]
    positions = proposal.positions(state.target_cache.lengths)
    return target.apply({"params": target_params}, tokens, positions,
                        cache=state.target_cache, block_mask=proposal.attention_mask(),
                        tap_ids=drafter.tap_ids)


def has_greedy_path(rule) -> bool:
    """Whether a verification rule's ``accept_greedy`` speaks for its ``accept``: it has one,
    defined by the class that defines ``accept`` or by a subclass of it. A subclass that
    overrides only ``accept`` gets the general path at T = 0 too, not its parent's greedy
    shortcut (which would ignore the override)."""
    def owner(name):
        return next((c for c in type(rule).__mro__ if name in vars(c)), None)

    greedy, general = owner("accept_greedy"), owner("accept")
    return greedy is not None and general is not None and issubclass(greedy, general)


def accept(drafter: Drafter, config, proposal: Proposal, out: TargetOutput,
           key: jax.Array) -> Verdict:
    """The config's verification rule on the verify forward's logits (processed by the
    config's sampling settings). Greedy: the rule's ``accept_greedy`` on the argmax tokens
    where it has one (the same verdict; sampling ``V`` Gumbels per verify row from a one-hot
    distribution was most of an AR step's non-matmul time on the CPU)."""
    if config.sampling.greedy and has_greedy_path(config.verify):
        return config.verify.accept_greedy(key, proposal, greedy_tokens(out.logits),
                                           drafter.max_commit)
    log_p = target_log_probs(out.logits, config.sampling)
    return config.verify.accept(key, proposal, log_p, drafter.max_commit)


def verify(target: TargetLM, drafter: Drafter, config, target_params, state: DecodeState,
           proposal: Proposal, key: jax.Array) -> Verified:
    """Stage 2: :func:`verify_forward`, then :func:`accept`."""
    with jax.named_scope("verify"):
        out = verify_forward(target, drafter, target_params, state, proposal)
        return Verified(accept(drafter, config, proposal, out, key), proposal, out)


def commit(drafter: Drafter, config, state: DecodeState, verified: Verified,
           key: jax.Array) -> DecodeState:
    """Stage 3: write the committed tokens, apply stops/limits, commit the target cache
    (advance, or gather a tree path into place) and hand the accepted rows' features to the
    drafter; ``key`` is the state's next RNG key."""
    with jax.named_scope("commit"):
        verdict, proposal, out = verified
        accepted, bonus, path = verdict
        batch = state.root.shape[0]
        drafts = proposal.tokens
        if path is not None:                    # the accepted path's tokens, root dropped
            verify_tokens = jnp.concatenate([state.root[:, None], drafts], axis=1)
            drafts = jnp.take_along_axis(verify_tokens, path, axis=1)[:, 1:]
        committed = jnp.concatenate([drafts, jnp.zeros((batch, 1), jnp.int32)], axis=1)
        slot = jnp.arange(committed.shape[1])[None, :]
        committed = jnp.where(slot == accepted[:, None], bonus[:, None], committed)
        count = accepted + 1
        stop_at = first_stop(committed, count, config.stop_token_ids)
        hit_stop = stop_at < count
        count = jnp.where(hit_stop, stop_at + 1, count)
        live = ~state.done
        out_tokens = jnp.where(live[:, None],
                               _write_rows(state.out_tokens, state.num_out, committed),
                               state.out_tokens)
        num_out = state.num_out + jnp.where(live, count, 0)
        done = state.done | (live & (hit_stop | (num_out >= config.max_new_tokens)))
        cache_rows = jnp.where(live, accepted + 1, 0)
        if path is None:
            target_cache = out.cache.advance(cache_rows)
        else:
            target_cache = out.cache.gather_path(path, cache_rows)
        features = drafter.context_features(out)
        if features is None:
            context, context_len = state.context, state.context_len
        else:
            if path is not None:
                features = jnp.take_along_axis(features, path[:, :, None], axis=1)
            context, context_len = features.astype(state.context.dtype), cache_rows
        hist = state.accept_hist + jax.nn.one_hot(count, state.accept_hist.shape[1],
                                                  dtype=jnp.int32) * live[:, None]
        history = state.history
        if history is not None:            # committed tokens follow the root's position
            history = jnp.where(live[:, None], _write_rows(
                history, state.target_cache.lengths + 1, committed), history)
        return DecodeState(out_tokens, num_out, done, jnp.where(live, bonus, state.root),
                           target_cache, proposal.draft_cache, context, context_len, key,
                           state.rounds + live.astype(jnp.int32), hist, history)


def run_round(target: TargetLM, drafter: Drafter | None, config, target_params, draft_params,
              state: DecodeState, propose=None) -> DecodeState:
    """One round, draft -> verify -> commit: the one composition of the stages that the loop
    (:func:`domino_jax.decode.loop.rounds`) runs for a fixed width and for each adaptive arm
    (:mod:`~domino_jax.decode.adaptive`, its lookup arms). ``propose(state, key) ->
    Proposal`` stands in for :func:`draft` where an arm drafts its own way (on a narrowed
    context buffer, from a lookup already made, or nothing: the AR step)."""
    drafter = _drafter(drafter)
    key, draft_key, verify_key = jax.random.split(state.key, 3)
    if propose is None:
        proposal = draft(drafter, config, target_params, draft_params, state, draft_key)
    else:
        proposal = propose(state, draft_key)
    verified = verify(target, drafter, config, target_params, state, proposal, verify_key)
    return commit(drafter, config, state, verified, key)


def keep_running(state: DecodeState, rounds: jax.Array, max_rounds: jax.Array,
                 done_limit: jax.Array | None) -> jax.Array:
    """The round loops' condition: fewer than ``max_rounds`` rounds run and fewer than
    ``done_limit`` rows done (``None``: not every row done). A continuous-batching
    scheduler (:mod:`domino_jax.decode.serving`) passes its done rows + ``refill_rows``, so
    the loop returns as soon as that many slots can be refilled."""
    if done_limit is None:
        running = ~jnp.all(state.done)
    else:
        running = jnp.sum(state.done.astype(jnp.int32)) < done_limit
    return running & (rounds < max_rounds)
