"""Verification: how many drafted tokens the target accepts, and the bonus token.

The rules are strategies, frozen dataclasses on the config (``DecodeConfig(verify=...)``,
also given by name): :class:`Match` and :class:`Rejection`. Both are lossless: every
committed token follows the processed target distribution given the committed prefix
(docs/algorithms.md §2.4 and §9.3).

* ``match`` (the references' rule): sample the target at every verified position and
  accept drafts while they equal the target's own samples; the bonus is the target's
  sample at the first mismatch (or after the last draft).
* ``rejection`` (Leviathan et al. speculative sampling): accept draft ``d_i`` with
  probability ``min(1, p_i(d_i) / q_i(d_i))`` where ``q_i`` is the distribution the draft
  was drawn from; at the first rejection sample from ``normalise(max(p_i - q_i, 0))``;
  if all drafts are accepted, the bonus comes from ``p_K``. With sampled drafts it accepts
  with probability ``1 - TV(p, q)``, never less than ``match``.

* trees (``match`` only): sample the target at every verified row and walk from the root
  down the children whose token equals the sample of their parent's row
  (sample-and-walk); the bonus is the sample at the last accepted node. Best-first trees
  define no draft distribution per node, so ``rejection`` does not apply to them.

Shapes of the chain functions: ``drafts [B, K]``, ``target_log_probs [B, K + 1, V]``
(processed target distribution at the K+1 verified positions: root, d_1..d_K),
``draft_log_probs [B, K, V]``. They return ``(accepted [B] int32 in 0..K, bonus [B] int32)``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from domino_jax.decode.contract import Proposal


def _leading_true(flags: jax.Array) -> jax.Array:
    """Number of leading ``True`` per row of ``flags [B, K]``."""
    return jnp.sum(jnp.cumprod(flags.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def verify_match(key: jax.Array, drafts: jax.Array, target_log_probs: jax.Array):
    """Sample the target at every position; accept while the drafts equal the samples."""
    samples = jax.random.categorical(key, target_log_probs, axis=-1).astype(jnp.int32)  # [B, K+1]
    return match_samples(drafts, samples)


def match_samples(drafts: jax.Array, samples: jax.Array):
    """``(accepted, bonus)`` of drafts ``[B, K]`` against the target's samples ``[B, K+1]``:
    the leading run of equal tokens, then the sample after it."""
    accepted = _leading_true(drafts == samples[:, :-1])
    bonus = jnp.take_along_axis(samples, accepted[:, None], axis=1)[:, 0]
    return accepted, bonus


def verify_rejection(key: jax.Array, drafts: jax.Array, target_log_probs: jax.Array,
                     draft_log_probs: jax.Array):
    """Speculative (rejection) sampling against the draft's own distribution."""
    batch, num_drafts = drafts.shape
    accept_key, residual_key = jax.random.split(key)
    p = jnp.exp(target_log_probs)                                       # [B, K+1, V]
    q = jnp.exp(draft_log_probs)                                        # [B, K, V]
    p_draft = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    uniform = jax.random.uniform(accept_key, (batch, num_drafts))
    accept = uniform * q_draft < p_draft                                # u < p/q, no division
    accepted = _leading_true(accept)
    q_padded = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)   # index K: residual = p_K
    p_at = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]
    q_at = jnp.take_along_axis(q_padded, accepted[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_at - q_at, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 0, residual, p_at)                      # p == q: fall back to p
    bonus = jax.random.categorical(residual_key, jnp.log(residual), axis=-1).astype(jnp.int32)
    return accepted, bonus


def walk_tree(tree_tokens, tree_parents, tree_valid, samples, max_depth: int):
    """Follow the target's samples down a tree (one row).

    Args:
      tree_tokens, tree_parents, tree_valid: ``[N]`` (parents index the node list, -1 = root).
      samples: ``[N + 1]`` the target's token at every verify row ``[root, nodes...]``.
    Returns:
      ``path [max_depth + 1]`` verify-row indices ``[0, n_1 + 1, ...]`` (zeros past the
      accepted length), ``accepted`` (nodes accepted) and ``last`` (verify row of the
      last accepted node; its sample is the bonus token).
    """
    row_parent = tree_parents + 1                        # verify row of each node's parent

    def step(i, carry):
        path, accepted, current, alive = carry
        wanted = samples[current]
        match = tree_valid & (row_parent == current) & (tree_tokens == wanted)
        found = alive & jnp.any(match)
        nxt = jnp.argmax(match).astype(jnp.int32) + 1
        current = jnp.where(found, nxt, current)
        path = path.at[i + 1].set(jnp.where(found, nxt, 0))
        return path, accepted + found.astype(jnp.int32), current, found

    init = (jnp.zeros((max_depth + 1,), jnp.int32), jnp.int32(0), jnp.int32(0), jnp.bool_(True))
    path, accepted, current, _ = jax.lax.fori_loop(0, max_depth, step, init)
    return path, accepted, current


def forced_walk(tree_parents: jax.Array, tree_valid: jax.Array, count: jax.Array,
                max_depth: int):
    """:class:`ForcedAcceptance` on a tree (one row): ``count`` steps from the root, each to
    the first valid child of the current node (the best-first order), fewer if the tree is
    shallower. Returns ``(path, accepted, last)`` as :func:`walk_tree` does."""
    row_parent = tree_parents + 1

    def step(i, carry):
        path, accepted, current = carry
        children = tree_valid & (row_parent == current)
        found = jnp.any(children) & (i < count)
        nxt = jnp.argmax(children).astype(jnp.int32) + 1
        current = jnp.where(found, nxt, current)
        path = path.at[i + 1].set(jnp.where(found, nxt, 0))
        return path, accepted + found.astype(jnp.int32), current

    init = (jnp.zeros((max_depth + 1,), jnp.int32), jnp.int32(0), jnp.int32(0))
    return jax.lax.fori_loop(0, max_depth, step, init)


# ----------------------------------------------------------------------------- strategies


class Verdict(NamedTuple):
    """What verification decided for one round."""

    accepted: jax.Array           # [B] int32 accepted drafts
    bonus: jax.Array              # [B] int32 the target's token after the accepted path
    path: jax.Array | None        # [B, P] verify rows [root, accepted...] (trees); None:
    #                               the accepted drafts are the chain's first ``accepted``


@dataclasses.dataclass(frozen=True)
class Match:
    """Sample the target at every verified row; accept drafts equal to the samples (chains:
    the leading run; trees: the walk from the root)."""

    name = "match"
    verifies_trees = True

    def accept(self, key: jax.Array, proposal: Proposal, target_log_probs: jax.Array,
               max_commit: int) -> Verdict:
        """``target_log_probs [B, N + 1, V]`` at ``[root, tokens...]``; ``max_commit``: the
        drafter's longest path + 1 (trees: the walk's depth)."""
        samples = jax.random.categorical(key, target_log_probs, axis=-1).astype(jnp.int32)
        return self.accept_greedy(key, proposal, samples, max_commit)

    def accept_greedy(self, key: jax.Array, proposal: Proposal, targets: jax.Array,
                      max_commit: int) -> Verdict:
        """The rule at temperature 0, from the target's argmax tokens ``targets [B, N + 1]``
        (a one-hot distribution's only sample: the same verdict as :meth:`accept` on it,
        without ``V`` random draws per verify row). Also the rule on any samples."""
        if proposal.tree is None:
            return Verdict(*match_samples(proposal.tokens, targets), None)
        tree, samples = proposal.tree, targets
        path, accepted, last = jax.vmap(
            lambda t, p, v, s: walk_tree(t, p, v, s, max_commit - 1))(
            tree.tokens, tree.parents, tree.valid, samples)
        bonus = jnp.take_along_axis(samples, last[:, None], axis=1)[:, 0]
        return Verdict(accepted, bonus, path)


@dataclasses.dataclass(frozen=True)
class Rejection:
    """Speculative (rejection) sampling against the draft distribution ``q`` of a chain;
    falls back to :class:`Match` when nothing was drafted (AR)."""

    name = "rejection"
    verifies_trees = False

    def accept(self, key: jax.Array, proposal: Proposal, target_log_probs: jax.Array,
               max_commit: int) -> Verdict:
        if proposal.tree is not None:
            raise ValueError("'rejection' verifies chains only: best-first trees define no "
                             "draft distribution; use 'match'")
        if proposal.log_q is None:
            return Match().accept(key, proposal, target_log_probs, max_commit)
        return Verdict(*verify_rejection(key, proposal.tokens, target_log_probs,
                                         proposal.log_q), None)

    def accept_greedy(self, key: jax.Array, proposal: Proposal, targets: jax.Array,
                      max_commit: int) -> Verdict:
        """At temperature 0 ``p`` is one-hot on the target's argmax: a draft is accepted iff
        it is the argmax (``u q < p`` holds for ``p = 1``, never for ``p = 0``) and the
        residual ``max(p - q, 0)`` sits on the argmax alone: :class:`Match`'s verdict."""
        if proposal.tree is not None:
            raise ValueError("'rejection' verifies chains only: best-first trees define no "
                             "draft distribution; use 'match'")
        return Match().accept_greedy(key, proposal, targets, max_commit)


def _rate_for_tau(tau: float, width: int) -> float:
    """The conditional acceptance rate ``a`` per draft with ``(1 - a^(w+1)) / (1 - a) = tau``:
    the mean tokens per round of ``w`` drafts each accepted with probability ``a`` given the
    previous ones were."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        tokens = width + 1.0 if mid >= 1.0 else (1 - mid ** (width + 1)) / (1 - mid)
        lo, hi = (mid, hi) if tokens < tau else (lo, mid)
    return lo


@dataclasses.dataclass(frozen=True)
class ForcedAcceptance:
    """**Timing only** (benchmarks with random weights, which accept nothing): rounds accept
    drafts at a set rate whatever the target says, so what is committed does NOT follow the
    target's distribution. A verification strategy (``DecodeConfig(verify=ForcedAcceptance(
    ...))``), not reachable from the CLI; trees walk the first child of each node.

    Row ``r`` of a batch of ``B`` has a mean of ``tau_r`` tokens per round at ``width``
    drafts: ``tau_r = tau * (1 + spread * (r / (B - 1) - 1/2))`` (rows differ, the batch
    mean stays ``tau``). ``constant``: every round accepts ``round(tau_r) - 1`` drafts
    (capped by the drafts verified); otherwise draft ``i`` is accepted with the probability
    ``a_r`` given drafts ``1..i-1`` were (``(1 - a_r^(width+1)) / (1 - a_r) = tau_r``), so a
    round of ``k`` drafts commits ``(1 - a_r^(k+1)) / (1 - a_r)`` tokens on average: what
    the adaptive policy's model of acceptance assumes. The bonus is the target's argmax
    after the accepted drafts.
    """

    tau: float
    width: int = 16
    spread: float = 0.0
    constant: bool = False

    def __post_init__(self):
        if not 1.0 <= self.tau <= self.width + 1:
            raise ValueError(f"forced tau must be in [1, width + 1 = {self.width + 1}], got "
                             f"{self.tau}")
        if not 0.0 <= self.spread < 2.0:
            raise ValueError(f"spread must be in [0, 2), got {self.spread}")

    def row_taus(self, batch: int) -> np.ndarray:
        offsets = (np.arange(batch) / max(batch - 1, 1) - 0.5) if batch > 1 else np.zeros(1)
        return np.clip(self.tau * (1 + self.spread * offsets), 1.0, self.width + 1.0)

    def accepted(self, key: jax.Array, batch: int, num_drafts: int) -> jax.Array:
        """``[B]`` int32 drafts accepted this round, out of ``num_drafts``."""
        taus = self.row_taus(batch)
        if self.constant:
            fixed = np.minimum(np.round(taus).astype(np.int32) - 1, num_drafts)
            return jnp.asarray(fixed, jnp.int32)
        rates = jnp.asarray([_rate_for_tau(t, self.width) for t in taus], jnp.float32)
        uniform = jax.random.uniform(key, (batch, num_drafts))
        return _leading_true(uniform < rates[:, None])

    name = "forced"
    verifies_trees = True

    def accept(self, key: jax.Array, proposal: Proposal, target_log_probs: jax.Array,
               max_commit: int) -> Verdict:
        argmax = jnp.argmax(target_log_probs, axis=-1).astype(jnp.int32)      # [B, N + 1]
        return self.accept_greedy(key, proposal, argmax, max_commit)

    def accept_greedy(self, key: jax.Array, proposal: Proposal, argmax: jax.Array,
                      max_commit: int) -> Verdict:
        """:meth:`accept` from the target's argmax tokens ``[B, N + 1]``."""
        batch, num_drafts = proposal.tokens.shape
        if proposal.tree is None:
            accepted = self.accepted(key, batch, num_drafts)
            bonus = jnp.take_along_axis(argmax, accepted[:, None], axis=1)[:, 0]
            return Verdict(accepted, bonus, None)
        depth = max_commit - 1
        count = self.accepted(key, batch, depth)
        tree = proposal.tree
        path, accepted, last = jax.vmap(lambda p, v, c: forced_walk(p, v, c, depth))(
            tree.parents, tree.valid, count)
        bonus = jnp.take_along_axis(argmax, last[:, None], axis=1)[:, 0]
        return Verdict(accepted, bonus, path)


VERIFY_RULES = {rule.name: rule for rule in (Match(), Rejection())}


def verify_rule(rule) -> Match | Rejection:
    """A rule given by name (``"match"``, ``"rejection"``) or as a strategy instance
    (anything with ``accept(key, proposal, target_log_probs, max_commit) -> Verdict``;
    optionally ``accept_greedy(key, proposal, targets, max_commit)``, the verdict at
    temperature 0 from the target's argmax tokens ``[B, N + 1]``, which greedy decoding
    then calls instead: no one-hot ``[B, N + 1, V]`` distribution, no sampling; only when
    the class that defines ``accept`` or a subclass of it defines it too:
    :func:`domino_jax.decode.round.has_greedy_path`)."""
    if isinstance(rule, str):
        if rule not in VERIFY_RULES:
            raise ValueError(f"unknown verification rule {rule!r}; choose one of "
                             f"{sorted(VERIFY_RULES)}")
        return VERIFY_RULES[rule]
    if not callable(getattr(rule, "accept", None)):
        raise ValueError(f"verification rule {rule!r} has no accept(key, proposal, "
                         "target_log_probs, max_commit) method")
    return rule
