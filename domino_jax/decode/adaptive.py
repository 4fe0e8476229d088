"""Adaptive speculation: the verify width chosen per round, inside the jitted loop.

A policy and a switch around the round. Each round the loop picks one **arm** from a small
static set and runs that arm's round (``lax.switch`` over one branch per arm, each compiled
once with static shapes; the loop is :func:`domino_jax.decode.loop.rounds`):

* arm width ``0``: a plain AR step (the target reads the root alone), which keeps the
  drafter's context features of the committed token for later;
* a chain arm ``k``: the drafter proposes ``k`` drafts (the first ``k`` positions of its
  block: same backbone forward, the LM head and the Domino head over ``k`` rows only) and
  the target verifies ``k + 1`` rows;
* a tree arm ``b``: a best-first tree of budget ``b`` (drafted over ``min(b, K)`` positions,
  which holds every node a budget-``b`` tree can have).

Verifying fewer drafts, or none, never changes what is committed: every round is the same
lossless draft -> verify -> commit, only its width differs (tests: greedy equality with AR,
the T > 0 chi-square tests with ``auto``).

**The policy** maximises expected committed tokens per second of the whole batch:

    value(arm) = sum over live rows of E_row[tokens | arm]  /  cost(arm)

(the AR step's value is raised by ``margin``, 10%: a speculative arm must promise that much
more, since the measured costs are the fastest of a few timings and load on a shared
machine slows the wide arms more than the AR step).

``cost`` (ms per round of each arm at this batch and shape) is the cost model, an input of
the program (measured by :mod:`domino_jax.decode.cost_model` on first use, or loaded from a
table). ``E_row`` comes from a running, per-row estimate of the acceptance rate at each draft
depth ``i`` (the probability that draft ``i`` is accepted given drafts ``1..i-1`` were):
decayed counts of accepted / observed drafts (``decay`` per observation), shrunk towards
``depth_discount`` times the estimate of depth ``i - 1`` (depth 1 towards ``prior_rate``) with
weight ``prior_weight``, so depths never verified get geometrically lower rates than the
deepest observed one (pessimistic: after a good 2-draft probe the policy widens step by step,
as the deeper depths are seen, instead of jumping to 16 drafts on rates it never measured). Chain arms share one set of statistics (a
``k``-draft chain is the first ``k`` drafts of the full one); each tree budget has its own.
Then ``E_row = 1 + sum_j prod_{i <= j} rate_i`` over the arm's depths.

When AR wins, no drafts are observed, so the policy **probes**: after ``probe_interval * e``
AR rounds in a row, ``e`` the probe's extra cost over an AR step in AR steps (so probes cost
at most ``1 / probe_interval`` of the AR time, however wide the batch makes the arms), it
runs the best speculative arm once; each probe that does not convince doubles the interval
(``probe_min`` .. ``probe_max``); a drafter round the policy chooses on its own resets
it. A chosen lookup arm observes no drafts either: then the probe runs the best drafter
arm, on the same clock (rounds since the drafter last ran). The first round the policy would
give to AR is a probe when the probe costs at most two AR steps (a good drafter is seen at
once).

A chain arm of ``k`` drafts never verifies depths beyond ``k``, so their discounted estimates
alone could keep the policy at ``k`` for good (``docs/design.md`` §11). So the
policy also **widens by probing**: when the next wider chain arm would beat the chosen one with its unseen depths at the deepest observed rate (no discount), it
runs once after ``widen_interval * e`` rounds, ``e`` its extra cost over the chosen arm's as
a fraction (so widening probes cost at most ``1 / widen_interval`` extra); each that commits
no draft past the narrower arm's width doubles the interval (``probe_min`` .. ``probe_max``).
The real rates it sees then decide.

The drafter reads the target's features of every committed token. AR rounds append theirs
to the loop's context buffer (``buffer_slack`` rows beyond one round's commit,
``BlockDrafter.context_slack``); a speculative round feeds the whole buffer to the drafter.
When an AR round would overflow the buffer, that round first commits the buffer to the
draft cache without drafting (``BlockDrafter.ingest_features``: the backbone over the
context rows and a dummy block, as a chunked prefill commits each chunk; a "flush", not
counted as an arm).

``PolicyState.force >= 0`` runs that arm every round (cost calibration).

**Lookup arms** (chain methods, ``AdaptiveConfig.lookup``): the prompt lookup's ``k``
tokens verified as a chain, no drafter forward (:mod:`domino_jax.decode.lookup_arm`: arm
code ``-k``, statistics per matched suffix length, expected tokens 1 on rows without a
match).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp

from domino_jax.decode import lookup_arm
from domino_jax.decode import round as round_lib
from domino_jax.decode.contract import Proposal
from domino_jax.decode.ngram import NGRAM_DEFAULTS, NgramOptions

DEFAULT_CHAIN_WIDTHS = (0, 2, 4, 8, 16)
DEFAULT_TREE_BUDGETS = (0, 4, 8, 16)


@dataclasses.dataclass(frozen=True)
class AdaptiveConfig:
    """Static settings of adaptive speculation (hashable: part of the jit cache key).

    ``widths``: the arms, sorted, starting with ``0`` (the AR step): draft lengths for chain
    methods, tree budgets for tree methods; widths above the drafter's maximum are dropped
    by :func:`resolve_widths`. ``lookup``: token counts of the prompt-lookup arms (chain
    methods; :mod:`domino_jax.decode.lookup_arm`), ``()`` = none; ``lookup_ngram``: their
    matcher's settings (its ``num_tokens`` is not used).
    """

    widths: tuple[int, ...] | None = None     # None: DEFAULT_CHAIN_WIDTHS / _TREE_BUDGETS
    decay: float = 0.9
    prior_rate: float = 0.4
    prior_weight: float = 1.0
    depth_discount: float = 0.8
    probe_min: int = 32      # probes cost <= 1/32 of the AR time, then 1/64, ...
    probe_max: int = 256
    buffer_slack: int = 16
    lookup: tuple[int, ...] = ()
    lookup_ngram: NgramOptions = NGRAM_DEFAULTS
    margin: float = 0.1
    widen: bool = True       # widening probes (see the module docstring)
    # optimism in the choice: each depth's rate + explore / sqrt(observed + prior_weight)
    # (0 = off; simulated, not measured on a device: docs/design.md §11)
    explore: float = 0.0

    def __post_init__(self):
        if list(self.lookup) != sorted(set(self.lookup)) or any(k < 1 for k in self.lookup):
            raise ValueError(f"adaptive lookup arms must be sorted, distinct token counts "
                             f">= 1, got {self.lookup}")
        if self.widths is not None:
            if list(self.widths) != sorted(set(self.widths)) or not self.widths \
                    or self.widths[0] != 0:
                raise ValueError(f"adaptive widths must be sorted, distinct and start with 0 "
                                 f"(the AR step), got {self.widths}")
            if len(self.widths) < 2:
                raise ValueError("adaptive widths need at least one speculative width")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if not 0.0 <= self.prior_rate <= 1.0 or self.prior_weight <= 0:
            raise ValueError("prior_rate must be in [0, 1] and prior_weight > 0")
        if not 0.0 < self.depth_discount <= 1.0:
            raise ValueError(f"depth_discount must be in (0, 1], got {self.depth_discount}")
        if not 1 <= self.probe_min <= self.probe_max:
            raise ValueError(f"need 1 <= probe_min <= probe_max, got {self.probe_min}, "
                             f"{self.probe_max}")
        if self.explore < 0.0:
            raise ValueError(f"explore must be >= 0, got {self.explore}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")
        if self.buffer_slack < 1:
            raise ValueError(f"buffer_slack must be >= 1, got {self.buffer_slack}")


def _is_tree(drafter) -> bool:
    return drafter.proposes_trees


def resolve_widths(adaptive: AdaptiveConfig, drafter) -> tuple[int, ...]:
    """The arm widths for ``drafter`` (chain: draft lengths <= its ``num_drafts``; tree:
    budgets <= its budget, which is always one of them), then the lookup arms' codes
    ``-k`` (:mod:`domino_jax.decode.lookup_arm`)."""
    if adaptive.lookup and _is_tree(drafter):
        raise ValueError(f"adaptive lookup arms take a chain method (dflash, domino), not "
                         f"{drafter.method!r} (its hybrid is --lookup-branch)")
    top = drafter.options.fixed_budget if _is_tree(drafter) else drafter.num_drafts
    widths = adaptive.widths or (DEFAULT_TREE_BUDGETS if _is_tree(drafter)
                                 else DEFAULT_CHAIN_WIDTHS)
    widths = tuple(w for w in widths if w <= top)
    if top not in widths:
        widths = widths + (top,)
    if len(widths) < 2:
        raise ValueError(f"no speculative width <= {top} among {adaptive.widths}")
    return widths + lookup_arm.lookup_codes(adaptive.lookup, top)


def base_drafter(drafter, adaptive: AdaptiveConfig):
    """The drafter that sizes the loop's state: the widest arm (``drafter`` itself), with
    the context buffer's slack for AR rounds."""
    return dataclasses.replace(drafter, context_slack=adaptive.buffer_slack,
                               keep_history=bool(adaptive.lookup))


def buffer_rows(base) -> int:
    """Rows of the adaptive loop's context buffer: one widest round's commit + the slack."""
    return base.max_commit + base.context_slack


def arm_drafter(base, width: int):
    """The drafter of one arm (``None`` for the AR step): ``width`` drafts of the same
    block (chains), or a tree of budget ``width`` over ``min(width, K)`` positions."""
    if width == 0:
        return None
    if _is_tree(base):
        options = dataclasses.replace(base.options, budget=width,
                                      draft_length=min(width, base.num_positions))
    else:
        options = dataclasses.replace(base.options, draft_length=width)
    return dataclasses.replace(base, options=options)


def arm_groups(base, widths: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """``(group, depth)`` per arm: the acceptance statistics it reads and its longest draft
    path (AR: group -1, depth 0). Chains share group 0; each tree budget its own group;
    lookup arms (code ``-k``) the groups after those, one per matched suffix length: the
    first of them here (a row's own is that + its match length - 1)."""
    out, group = [], 0
    lookup_group = 1 if not _is_tree(base) else sum(1 for w in widths if w > 0)
    for w in widths:
        if lookup_arm.is_lookup(w):
            out.append((lookup_group, -w))
        elif w == 0:
            out.append((-1, 0))
        elif _is_tree(base):
            out.append((group, min(w, base.num_positions)))
            group += 1
        else:
            out.append((0, w))
    return tuple(out)


@flax.struct.dataclass
class PolicyState:
    """The policy's carry (shapes: ``B`` rows, ``G`` statistic groups, ``D`` draft depths,
    ``A`` arms)."""

    accepted: jax.Array        # [B, G, D] float32 decayed accepted drafts per depth
    observed: jax.Array        # [B, G, D] float32 decayed verified drafts per depth
    costs: jax.Array           # [A] float32 ms per round of each arm (the cost model)
    force: jax.Array           # int32 scalar: -1 = the policy chooses, else this arm
    since_spec: jax.Array      # int32 rounds since the last drafter round (AR, lookup)
    probe_interval: jax.Array  # int32 AR rounds before the next probe
    arm_rounds: jax.Array      # [A] int32 rounds run per arm
    since_widen: jax.Array     # int32 rounds since the last widening probe
    widen_interval: jax.Array  # int32 scales the rounds before the next widening probe


def _num_groups(adaptive: AdaptiveConfig, base, widths) -> int:
    groups = arm_groups(base, widths)
    lookups = [g for (g, _), w in zip(groups, widths) if lookup_arm.is_lookup(w)]
    if lookups:
        return lookups[0] + adaptive.lookup_ngram.max_ngram
    return max(g for g, _ in groups) + 1


def _num_drafter_arms(widths) -> int:
    return sum(1 for w in widths if not lookup_arm.is_lookup(w))


def _row_groups(adaptive: AdaptiveConfig, base, widths, arm, matched, batch: int):
    """``([B] group, [B] bool counts)`` of each row's statistics under ``arm`` (traced):
    the arm's group, for a lookup arm offset by the row's match length; rows without a
    match do not count under a lookup arm."""
    groups = arm_groups(base, widths)
    group = jnp.asarray([max(g, 0) for g, _ in groups], jnp.int32)[arm]
    group = jnp.broadcast_to(group, (batch,))
    if matched is None:
        return group, jnp.ones((batch,), bool)
    is_lookup = arm >= _num_drafter_arms(widths)
    row = jnp.where(is_lookup, group + jnp.maximum(matched, 1) - 1, group)
    return row, ~is_lookup | (matched > 0)


def init_policy(adaptive: AdaptiveConfig, base, widths: Sequence[int], batch: int,
                costs, force: int = -1) -> PolicyState:
    groups = arm_groups(base, widths)
    num_groups = _num_groups(adaptive, base, widths)
    depth = max(d for _, d in groups)
    costs = jnp.asarray(costs, jnp.float32)
    if costs.shape != (len(widths),):
        raise ValueError(f"cost model has {costs.shape} entries for {len(widths)} arms "
                         f"{tuple(widths)}")
    zeros = jnp.zeros((batch, num_groups, depth), jnp.float32)
    # since_spec = probe_min: the first round the policy would give to AR is a probe, so a
    # good drafter is seen at once (not after probe_min AR rounds)
    return PolicyState(zeros, zeros, costs, jnp.int32(force), jnp.int32(adaptive.probe_min),
                       jnp.int32(adaptive.probe_min), jnp.zeros((len(widths),), jnp.int32),
                       jnp.int32(0), jnp.int32(adaptive.probe_min))


def acceptance_rates(adaptive: AdaptiveConfig, policy: PolicyState) -> jax.Array:
    """``[B, G, D]`` estimated acceptance rate of draft ``i`` given drafts ``1..i-1``: the
    decayed counts shrunk towards ``prior_rate`` (depth 1) or ``depth_discount`` times the
    estimate of depth ``i - 1``; plus ``explore / sqrt(observed + prior_weight)`` (capped at
    1; not passed down the depths)."""
    prior = jnp.full(policy.accepted.shape[:2], adaptive.prior_rate, jnp.float32)
    rates = []
    for i in range(policy.accepted.shape[2]):
        rate = ((policy.accepted[:, :, i] + adaptive.prior_weight * prior)
                / (policy.observed[:, :, i] + adaptive.prior_weight))
        bonus = adaptive.explore / jnp.sqrt(policy.observed[:, :, i] + adaptive.prior_weight)
        rates.append(jnp.minimum(rate + bonus, 1.0))
        prior = adaptive.depth_discount * rate
    return jnp.stack(rates, axis=2)


def expected_tokens(adaptive: AdaptiveConfig, base, widths, policy: PolicyState,
                    matched=None) -> jax.Array:
    """``[B, A]`` expected tokens committed by each arm for each row; ``matched [B]``: the
    rows' lookup match lengths this round (:func:`~domino_jax.decode.lookup_arm.round_lookup`;
    needed with lookup arms: a row without a match expects 1 token from them)."""
    survive = jnp.cumsum(jnp.cumprod(acceptance_rates(adaptive, policy), axis=2), axis=2)
    ones = jnp.ones(survive.shape[:1], jnp.float32)
    cols = []
    for (group, depth), w in zip(arm_groups(base, widths), widths):
        if lookup_arm.is_lookup(w):
            if matched is None:
                raise ValueError("expected_tokens: lookup arms need the rows' match lengths")
            rows = group + jnp.maximum(matched, 1) - 1
            tokens = 1.0 + jnp.take_along_axis(survive[:, :, depth - 1], rows[:, None],
                                               axis=1)[:, 0]
            cols.append(jnp.where(matched > 0, tokens, ones))
        else:
            cols.append(ones if depth == 0 else 1.0 + survive[:, group, depth - 1])
    return jnp.stack(cols, axis=1)


NO_PROBE, AR_PROBE, WIDEN_PROBE = 0, 1, 2


def _next_wider(base, widths) -> tuple[int, ...]:
    """Per arm, the next wider chain drafter arm (itself for the AR step, the widest chain
    arm, lookup arms and every tree arm: each tree budget has its own statistics)."""
    drafter_arms = _num_drafter_arms(widths)
    return tuple(a + 1 if (not _is_tree(base) and 0 < a and a + 1 < drafter_arms) else a
                 for a in range(len(widths)))


def choose_arm(adaptive: AdaptiveConfig, base, widths, policy: PolicyState, state,
               matched=None, max_new: int | None = None):
    """``(arm, probe, flush)``: the arm of this round (int32), which probe overrode the
    policy's choice (``NO_PROBE``, ``AR_PROBE``: a speculative arm instead of AR,
    ``WIDEN_PROBE``: the next wider chain arm instead of the chosen one), and whether this
    AR round must flush the context buffer first (``matched``: see :func:`expected_tokens`;
    ``max_new``: the run's ``max_new_tokens``, which bounds the tokens left to repay a probe
    with ``state.num_out``; ``None``: unbounded)."""
    live = ~state.done

    def values(config):
        expected = expected_tokens(config, base, widths, policy, matched)
        tokens = jnp.sum(jnp.where(live[:, None], expected, 0.0), axis=0)     # [A]
        return tokens / jnp.maximum(policy.costs, 1e-6)

    def repaid(wait):             # enough of the run left for a better arm to repay a probe
        if max_new is None:
            return jnp.bool_(True)
        return jnp.max(jnp.where(live, max_new - state.num_out, 0)) >= 2.0 * wait

    value = values(adaptive)
    # speculation must beat AR by ``margin``: the calibrated costs are fastest-of timings
    # and a shared machine's load slows wide arms more than the AR step
    best = jnp.argmax(value.at[0].multiply(1.0 + adaptive.margin)).astype(jnp.int32)
    best_spec = (jnp.argmax(value[1:]) + 1).astype(jnp.int32)
    rows_after_ar = jnp.where(live, state.context_len + 1, 0)
    buffer_full = jnp.any(rows_after_ar > state.context.shape[1])
    chosen = jnp.where(policy.force >= 0, policy.force, best)
    # a probe's extra cost over the AR step, in AR steps, scales the rounds between probes:
    # probing costs at most 1 / probe_interval of the AR time whatever the arms cost
    # with lookup arms, a chosen lookup arm observes no drafts either: the probe then runs
    # the best drafter arm (a lookup arm with a calibrated cost at or under the AR step's
    # could otherwise hold every round and the drafter would never be seen again)
    drafters = _num_drafter_arms(widths)          # arms 0..drafters-1; lookup arms after
    best_drafter = (jnp.argmax(value[1:drafters]) + 1).astype(jnp.int32)
    target = jnp.where(chosen == 0, best_spec, best_drafter)
    undrafted = (chosen == 0) | (chosen >= drafters)
    extra = policy.costs[target] / jnp.maximum(policy.costs[chosen], 1e-6) - 1.0
    wait = policy.probe_interval * jnp.maximum(extra, 0.0)
    probe = undrafted & (policy.force < 0) & (policy.since_spec >= wait) & repaid(wait)
    # widening: a chain arm's depths beyond the chosen width are never verified, so their
    # discounted estimates could keep the policy narrow for good; when the next wider arm
    # would win with those depths at the deepest observed rate (no discount), it runs once,
    # at most 1 / widen_interval of the time extra, as for the AR probes
    wider = jnp.asarray(_next_wider(base, widths), jnp.int32)[chosen]
    widen = jnp.bool_(False)
    if adaptive.widen:
        optimistic = values(dataclasses.replace(adaptive, depth_discount=1.0))
        extra_w = policy.costs[wider] / jnp.maximum(policy.costs[chosen], 1e-6) - 1.0
        wait_w = policy.widen_interval * jnp.maximum(extra_w, 0.0)
        widen = ((wider != chosen) & (policy.force < 0) & (optimistic[wider] > value[chosen])
                 & (policy.since_widen >= wait_w) & repaid(wait_w))
    arm = jnp.where(probe, target, jnp.where(widen, wider, chosen))
    kind = jnp.where(probe, AR_PROBE, jnp.where(widen, WIDEN_PROBE, NO_PROBE)).astype(jnp.int32)
    return arm, kind, (arm == 0) & buffer_full


def observe(adaptive: AdaptiveConfig, base, widths, policy: PolicyState, arm, probe,
            before, after, matched=None) -> PolicyState:
    """Fold one round's outcome into the statistics: per live row, drafts ``1..accepted``
    were accepted and draft ``accepted + 1`` (if the arm verified it) was rejected (a
    lookup arm: in the row's match-length group, rows that matched only). ``probe``: the
    kind :func:`choose_arm` returned; a probe that did not pay for itself doubles its own
    interval (up to ``probe_max``); a drafter round the policy chose, or a probe that
    paid, resets the probes' interval to ``probe_min`` and the probe clock
    (``since_spec``: rounds since the drafter last ran; lookup rounds keep it counting)."""
    groups = arm_groups(base, widths)
    depth_of = jnp.asarray([d for _, d in groups], jnp.int32)[arm]
    row_group, counts = _row_groups(adaptive, base, widths, arm, matched,
                                    before.done.shape[0])
    live = ~before.done & counts
    accepted = after.target_cache.lengths - before.target_cache.lengths - 1        # [B]
    depth = jnp.arange(1, policy.accepted.shape[2] + 1)[None, :]                   # [1, D]
    seen = live[:, None] & (depth <= depth_of) & (depth <= accepted[:, None] + 1)  # [B, D]
    hit = seen & (depth <= accepted[:, None])
    in_group = (jnp.arange(policy.accepted.shape[1])[None, :]
                == row_group[:, None])[:, :, None]                               # [B, G, 1]
    seen3 = seen[:, None, :] & in_group
    acc = jnp.where(seen3, adaptive.decay * policy.accepted + hit[:, None, :], policy.accepted)
    obs = jnp.where(seen3, adaptive.decay * policy.observed + 1.0, policy.observed)
    # the probe clock counts rounds since the drafter last ran (lookup rounds observe no
    # drafts); with no lookup arms that is every speculative round
    drafted = (arm > 0) & (arm < _num_drafter_arms(widths))
    probed, widened = probe == AR_PROBE, probe == WIDEN_PROBE
    # an AR probe that committed as many tokens per row as its cost in AR steps, plus the
    # margin the choice asks of speculation, paid for itself (the estimates were too low):
    # the interval goes back to probe_min, as after a round the policy chose to speculate;
    # one that did not doubles it (a break-even probe, e.g. 2 drafts at batch 32 on a CPU
    # where they cost 1.9 AR steps and commit 1.9 tokens, would otherwise keep recurring)
    tokens = jnp.sum(jnp.where(live, accepted + 1, 0)) / jnp.maximum(jnp.sum(live), 1)
    probe_paid = tokens * policy.costs[0] >= policy.costs[arm] * (1.0 + adaptive.margin)
    interval = jnp.where(probed & ~probe_paid,
                         jnp.minimum(2 * policy.probe_interval, adaptive.probe_max),
                         jnp.where(drafted | probed, adaptive.probe_min,
                                   policy.probe_interval))
    # a widening probe that committed drafts past the narrower arm's width found what it
    # looked for: the interval stays; one that did not doubles it
    narrower = jnp.asarray([abs(w) for w in widths], jnp.int32)[jnp.maximum(arm - 1, 0)]
    widen_paid = jnp.any(live & (accepted > narrower))
    widen_interval = jnp.where(widened & ~widen_paid,
                               jnp.minimum(2 * policy.widen_interval, adaptive.probe_max),
                               policy.widen_interval)
    return PolicyState(acc, obs, policy.costs, policy.force,
                       jnp.where(drafted | probed, 0, policy.since_spec + 1), interval,
                       policy.arm_rounds.at[arm].add(1),
                       jnp.where(widened, 0, policy.since_widen + 1), widen_interval)


def fit_context(context: jax.Array, width: int) -> jax.Array:
    """Zero-pad ``context [B, n, F]`` to ``[B, width, F]``."""
    return jnp.pad(context, ((0, 0), (0, width - context.shape[1]), (0, 0)))


def flush_buffer(base, target_params, draft_params, state):
    """Commit the context buffer to the draft cache (no drafting) and empty it."""
    buffer = state.context.shape[1]   # the buffered rows sit just before the root's position
    positions = ((state.target_cache.lengths - state.context_len)[:, None]
                 + jnp.arange(buffer, dtype=jnp.int32)[None, :])
    draft_cache = base.ingest_features(target_params, draft_params, state.context,
                                       positions, state.context_len, state.draft_cache)
    return state.replace(draft_cache=draft_cache, context_len=jnp.zeros_like(state.context_len))


NARROW_MIN_ROWS = 8


def narrow_rows(base, drafter) -> int:
    """Context rows a drafter arm's narrow program reads: its own commit's rows (a round
    of this arm leaves that many), at least :data:`NARROW_MIN_ROWS` (a few AR rounds after
    it still fit), at most the whole buffer."""
    return min(buffer_rows(base), max(NARROW_MIN_ROWS, drafter.max_commit))


def draft_narrow(drafter, rows: int, config, target_params, draft_params, state, key):
    """:func:`domino_jax.decode.round.draft` on the buffer's first ``rows`` rows when
    every live row's buffered context fits in them, else on the whole buffer (``lax.cond``).

    The backbone's cost grows with the context rows it reads: a narrow arm fed the whole
    buffer (16 drafts' commit + the AR slack) cost more than the plain fixed-width loop,
    reading its first rows the same (``docs/design.md`` §16). The rows past ``context_len`` are masked either way, so both programs propose the
    same drafts (done rows, whose context no longer matters, are clipped to ``rows``)."""
    if rows >= state.context.shape[1]:
        return round_lib.draft(drafter, config, target_params, draft_params, state, key)

    def narrow(s):
        s = s.replace(context=s.context[:, :rows], context_len=jnp.minimum(s.context_len, rows))
        return round_lib.draft(drafter, config, target_params, draft_params, s, key)

    def full(s):
        return round_lib.draft(drafter, config, target_params, draft_params, s, key)

    fits = jnp.all(state.done | (state.context_len <= rows))
    return jax.lax.cond(fits, narrow, full, state)


def arm_round(target, base, width: int, config, target_params, draft_params, state,
              flush: bool = False, lookup_drafts=None):
    """One round of the arm of ``width`` (0 = the AR step) on the round contract's stages
    (:mod:`domino_jax.decode.round`), on the loop's state shapes; ``flush``: commit the
    context buffer to the draft cache before the AR step; ``lookup_drafts``: this round's
    prompt lookup (:func:`~domino_jax.decode.lookup_arm.round_lookup`), read by lookup arms."""
    buffer = state.context.shape[1]
    if lookup_arm.is_lookup(width):
        return lookup_arm.lookup_round(
            target, base, -width, config, target_params, draft_params, state,
            lambda s: flush_buffer(base, target_params, draft_params, s), lookup_drafts)
    drafter = arm_drafter(base, width)
    if drafter is not None:
        rows = narrow_rows(base, drafter)
        new = round_lib.run_round(
            target, drafter, config, target_params, draft_params, state,
            lambda s, k: draft_narrow(drafter, rows, config, target_params, draft_params, s, k))
        return new.replace(context=fit_context(new.context, buffer))
    if flush:
        state = flush_buffer(base, target_params, draft_params, state)
    # the AR step: the root alone, verified and committed by the base drafter (its taps),
    # its features appended to the buffer
    new = round_lib.run_round(
        target, base, config, target_params, draft_params, state,
        lambda s, k: Proposal(jnp.zeros((s.root.shape[0], 0), jnp.int32), s.draft_cache))
    rows = jnp.arange(buffer)[None, :, None]
    append = (rows == state.context_len[:, None, None]) & (new.context_len[:, None, None] > 0)
    context = jnp.where(append, new.context[:, :1], state.context)
    return new.replace(context=context, context_len=state.context_len + new.context_len)


def width_histogram(widths: Sequence[int], arm_rounds) -> dict[int, int]:
    """``{verify width: rounds}`` (verify width = drafts + 1; trees: budget + 1; a lookup
    arm's rounds count under its width too)."""
    out: dict[int, int] = {}
    for w, n in zip(widths, arm_rounds):
        if int(n) > 0:
            out[abs(int(w)) + 1] = out.get(abs(int(w)) + 1, 0) + int(n)
    return dict(sorted(out.items()))


def arm_name(width: int) -> str:
    """``"ar"``, ``"draft{w}"`` (a drafter arm: chain length or tree budget) or
    ``"lookup{k}"``."""
    if lookup_arm.is_lookup(width):
        return lookup_arm.lookup_name(width)
    return "ar" if width == 0 else f"draft{width}"


def arm_histogram(widths: Sequence[int], arm_rounds) -> dict[str, int]:
    """``{arm name: rounds}`` (:func:`arm_name`) of the arms that ran."""
    return {arm_name(int(w)): int(n) for w, n in zip(widths, arm_rounds) if int(n) > 0}
