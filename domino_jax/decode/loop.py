"""The decode loop: one prefill and one round loop for every method and width setting.

A run's **arms** are the verify widths its rounds may take. A fixed width is a policy with
one arm: every round is the drafter's own :func:`~domino_jax.decode.round.run_round`. With
``config.adaptive`` (``--draft-length/--budget auto``) the arms are the adaptive widths
(:mod:`domino_jax.decode.adaptive`: the AR step, narrower drafts, lookup arms) and a policy
chooses one per round. Either way the host runs the same two programs:

* :func:`prefill` ``(target_params, draft_params, prompt, prompt_len, key) -> state``;
* :func:`rounds` ``(target_params, draft_params, state, policy, max_rounds) ->
  (state, policy)``,

with the policy's carry from :func:`init_policy`. :func:`loop_arms` is the one place that
says which drafter sizes the loop's state and which arms it has.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from domino_jax.decode import adaptive as adaptive_lib
from domino_jax.decode import lookup_arm
from domino_jax.decode import round as round_lib
from domino_jax.decode.adaptive import PolicyState
from domino_jax.decode.contract import DecodeState


def loop_arms(config, drafter) -> tuple:
    """``(loop drafter, widths)``: the drafter whose shapes the loop's state takes and the
    arms' widths. A fixed width: the drafter itself and one arm, its verify rows - 1 (draft
    length, tree budget; 0 for AR). Adaptive: the base drafter (its context buffer with
    the AR rounds' slack) and :func:`~domino_jax.decode.adaptive.resolve_widths`."""
    if config.adaptive is None:
        return drafter, (drafter.verify_width - 1,)
    widths = adaptive_lib.resolve_widths(config.adaptive, drafter)
    return adaptive_lib.base_drafter(drafter, config.adaptive), widths


def prefill(target, drafter, config, target_params, draft_params, prompt: jax.Array,
            prompt_len: jax.Array, key: jax.Array, capacity: int) -> DecodeState:
    """:func:`~domino_jax.decode.round.prefill` (``drafter``: the loop drafter of
    :func:`loop_arms`); adaptive: with the context buffer widened to
    :func:`~domino_jax.decode.adaptive.buffer_rows`."""
    state = round_lib.prefill(target, drafter, config, target_params, draft_params, prompt,
                              prompt_len, key, capacity)
    if config.adaptive is None:
        return state
    return state.replace(context=adaptive_lib.fit_context(state.context,
                                                          adaptive_lib.buffer_rows(drafter)))


def init_policy(config, drafter, widths: Sequence[int], batch: int, costs=None,
                force: int = -1) -> PolicyState:
    """The policy's first carry for ``batch`` rows. ``costs``: ms per round of each arm (the
    cost model; ``None``: all 1, e.g. a fixed width, which never reads them); ``force >= 0``
    runs that arm every round."""
    if costs is None:
        costs = [1.0] * len(widths)
    if config.adaptive is None:
        if len(widths) != 1:
            raise ValueError(f"a fixed width has one arm, got {tuple(widths)}")
        empty = jnp.zeros((batch, 0, 0), jnp.float32)     # no acceptance statistics
        zero = jnp.int32(0)
        return PolicyState(empty, empty, jnp.asarray(costs, jnp.float32), jnp.int32(force),
                           zero, zero, jnp.zeros((1,), jnp.int32), zero, zero)
    return adaptive_lib.init_policy(config.adaptive, drafter, widths, batch, costs, force)


def _adaptive_step(target, drafter, config, target_params, draft_params):
    """``(state, policy) -> (state, policy)``: one adaptive round: the policy's choice of arm
    (and flush), that arm's round (``lax.switch``), its outcome folded into the policy."""
    adaptive = config.adaptive
    widths = adaptive_lib.resolve_widths(adaptive, drafter)
    branches = [lambda s, d, w=w: adaptive_lib.arm_round(
        target, drafter, w, config, target_params, draft_params, s, lookup_drafts=d)
        for w in widths]
    branches.append(lambda s, d: adaptive_lib.arm_round(
        target, drafter, 0, config, target_params, draft_params, s, flush=True))

    def step(state, policy):
        matched = drafts = None
        if adaptive.lookup:           # one lookup for the policy and every lookup arm
            lookup = lookup_arm.round_lookup(adaptive.lookup_ngram, state, max(adaptive.lookup))
            matched, drafts = lookup.match_len, lookup.drafts
        arm, probe, flush = adaptive_lib.choose_arm(adaptive, drafter, widths, policy, state,
                                                    matched, config.max_new_tokens)
        new = jax.lax.switch(jnp.where(flush, len(widths), arm), branches, state, drafts)
        policy = adaptive_lib.observe(adaptive, drafter, widths, policy, arm, probe, state, new,
                                      matched)
        return new, policy

    return step


def rounds(target, drafter, config, target_params, draft_params, state: DecodeState,
           policy: PolicyState, max_rounds: jax.Array, done_limit: jax.Array | None = None):
    """Run rounds until every row is done (or ``done_limit`` rows are:
    :func:`~domino_jax.decode.round.keep_running`) or ``max_rounds`` rounds have run;
    ``drafter``: the loop drafter of :func:`loop_arms`. Returns ``(state, policy)``; the
    policy counts the rounds of each arm (``arm_rounds``)."""
    if config.adaptive is None:       # one arm: the drafter's own round, every round
        def step(state, policy):
            new = round_lib.run_round(target, drafter, config, target_params, draft_params,
                                      state)
            return new, policy.replace(arm_rounds=policy.arm_rounds + 1)
    else:
        step = _adaptive_step(target, drafter, config, target_params, draft_params)

    def cond(carry):
        state, _, n = carry
        return round_lib.keep_running(state, n, max_rounds, done_limit)

    def body(carry):
        state, policy, n = carry
        state, policy = step(state, policy)
        return state, policy, n + 1

    state, policy, _ = jax.lax.while_loop(cond, body, (state, policy, jnp.int32(0)))
    return state, policy


def width_report(config, widths: Sequence[int], policy: PolicyState, loop_rounds: int):
    """``(verify widths, arm rounds, arm costs)`` of a run: ``{verify rows: rounds}`` (a
    fixed width: all ``loop_rounds``), and for an adaptive run ``{arm name: rounds}`` and the
    policy's ms per round of each arm."""
    if config.adaptive is None:
        return {widths[0] + 1: loop_rounds}, {}, []
    arm_rounds = jax.device_get(policy.arm_rounds)
    return (adaptive_lib.width_histogram(widths, arm_rounds),
            adaptive_lib.arm_histogram(widths, arm_rounds),
            [float(c) for c in jax.device_get(policy.costs)])
