"""Simulate the adaptive policy (``decode/adaptive.py``) against every fixed width, from a
cost table and a forced acceptance, without running a model: what speedup over AR the
policy's choices would give, and which fixed width would have been best.

A batch of ``B`` rows generates ``--new-tokens`` each; row ``r`` accepts each draft with the
conditional rate of :class:`~domino_jax.decode.verify.ForcedAcceptance` (``--tau`` at 16
drafts, ``--spread`` across rows), sampled here with numpy. Each round the library's own
:func:`~domino_jax.decode.adaptive.choose_arm` picks an arm from the costs and the
statistics, :func:`~domino_jax.decode.adaptive.observe` folds the outcome in; the run lasts
until the slowest row is done (the static batch of ``bench_batch_sweep.py``: a finished row
still occupies its slot). Time = the sum of the chosen arms' costs; AR time = ``new_tokens``
AR steps. What it leaves out: the loop's own overhead beyond the calibrated round costs
(on the H200 at batch 32, 4-7%: ms per round in the sweep against the table), the
context-buffer flushes.

    python benchmarks/simulate_policy.py --costs 5.65,9.25,9.72,12.68,20.07 --batch 32 \\
        --taus 2,4,6,8        # the H200 table of results/batch_sweep_2026-12-03_145920
"""

from __future__ import annotations

import argparse
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax                                   # noqa: E402
import jax.numpy as jnp                      # noqa: E402
import numpy as np                           # noqa: E402

from domino_jax.decode import adaptive      # noqa: E402
from domino_jax.decode.adaptive import AdaptiveConfig  # noqa: E402
from domino_jax.decode.verify import ForcedAcceptance, _rate_for_tau  # noqa: E402

WIDTHS = (0, 2, 4, 8, 16)


def row_rates(tau: float, batch: int, spread: float, decline: float = 1.0) -> np.ndarray:
    """``[B, 16]`` conditional acceptance rate of each row's draft at each depth: the
    forced rate of the row's tau (at depth 1), times ``decline`` per depth deeper (1: the
    benchmark's constant rates; real drafters' fall with the depth)."""
    first = np.asarray([_rate_for_tau(t, 16) for t in
                        ForcedAcceptance(tau, 16, spread).row_taus(batch)])
    return first[:, None] * decline ** np.arange(16)[None, :]


def accepted(rng, rates: np.ndarray, k: int) -> np.ndarray:
    """``[B]`` drafts accepted out of ``k``: the leading run of per-draft successes."""
    if k == 0:
        return np.zeros(len(rates), int)
    hits = rng.random((len(rates), k)) < rates[:, :k]
    return np.where(hits.all(1), k, np.argmin(hits, 1))


BASE = types.SimpleNamespace(proposes_trees=False, num_positions=16)   # a chain drafter


def policy_steps(ad: AdaptiveConfig, batch: int, new_tokens: int):
    """Jitted ``(choose, observe)`` of the library's policy on the few state fields they
    read (compiled once per setting, shared by every run)."""
    ns = types.SimpleNamespace
    choose = jax.jit(lambda p, done, num_out: adaptive.choose_arm(
        ad, BASE, WIDTHS, p, ns(done=done, context_len=jnp.ones(batch, jnp.int32),
                                context=jnp.zeros((batch, 2, 1)), num_out=num_out),
        None, new_tokens))
    observe = jax.jit(lambda p, arm, probe, done, acc: adaptive.observe(
        ad, BASE, WIDTHS, p, arm, probe,
        ns(done=done, target_cache=ns(lengths=jnp.zeros(batch, jnp.int32))),
        ns(target_cache=ns(lengths=acc + 1))))
    return choose, observe


def simulate_adaptive(costs, rates, ad: AdaptiveConfig, steps, new_tokens: int, rng):
    """``(time, arm_rounds [A])`` of one run under the policy (``steps``: :func:`policy_steps`)."""
    batch = len(rates)
    choose, observe = steps
    policy = adaptive.init_policy(ad, BASE, WIDTHS, batch, costs)
    out, time = np.zeros(batch, int), 0.0
    while (out < new_tokens).any():
        done = jnp.asarray(out >= new_tokens)
        arm, probe, _ = choose(policy, done, jnp.asarray(out, jnp.int32))
        acc = accepted(rng, rates, WIDTHS[int(arm)])
        policy = observe(policy, arm, probe, done, jnp.asarray(acc, jnp.int32))
        out = np.where(out >= new_tokens, out, out + acc + 1)
        time += costs[int(arm)]
    return time, np.asarray(policy.arm_rounds)


def simulate_fixed(costs, rates, k: int, new_tokens: int, rng) -> float:
    out, rounds = np.zeros(len(rates), int), 0
    while (out < new_tokens).any():
        out, rounds = out + accepted(rng, rates, k) + 1, rounds + 1
    return rounds * costs[WIDTHS.index(k)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--costs", required=True, help="ms per round of arms 0,2,4,8,16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--taus", default="2,4,6,8")
    p.add_argument("--spread", type=float, default=0.5)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=16)
    p.add_argument("--decline", type=float, default=1.0,
                   help="acceptance rate factor per draft depth (1: constant, as forced)")
    p.add_argument("--depth-discount", type=float, default=AdaptiveConfig.depth_discount)
    p.add_argument("--explore", type=float, default=AdaptiveConfig.explore)
    p.add_argument("--prior-weight", type=float, default=AdaptiveConfig.prior_weight)
    p.add_argument("--no-widen", action="store_true",
                   help="without widening probes (the policy before 2026-12-03)")
    args = p.parse_args(argv)
    costs = [float(c) for c in args.costs.split(",")]
    if len(costs) != len(WIDTHS):
        p.error(f"--costs needs {len(WIDTHS)} entries (arms {WIDTHS}), got {len(costs)}")
    ad = AdaptiveConfig(depth_discount=args.depth_discount, widen=not args.no_widen,
                        explore=args.explore, prior_weight=args.prior_weight)
    ar_time = args.new_tokens * costs[0]
    steps = policy_steps(ad, args.batch, args.new_tokens)
    print(f"batch {args.batch}, costs {costs} ms, {args.new_tokens} new tokens, "
          f"medians of {args.runs} runs; speedup over AR")
    print("| tau | auto | " + " | ".join(f"fixed {k}" for k in WIDTHS[1:]) + " | auto arms |")
    print("|---|---|" + "---|" * (len(WIDTHS) - 1) + "---|")
    for tau in (float(t) for t in args.taus.split(",")):
        rates = row_rates(tau, args.batch, args.spread, args.decline)
        rng = np.random.default_rng(0)
        runs = [simulate_adaptive(costs, rates, ad, steps, args.new_tokens, rng)
                for _ in range(args.runs)]
        auto = ar_time / np.median([t for t, _ in runs])
        arms = np.mean([a for _, a in runs], axis=0)
        fixed = [ar_time / np.median([simulate_fixed(costs, rates, k, args.new_tokens, rng)
                                      for _ in range(args.runs)]) for k in WIDTHS[1:]]
        print(f"| {tau:g} | {auto:.2f}x | " + " | ".join(f"{f:.2f}x" for f in fixed)
              + " | " + " ".join(f"{w}:{a:.1f}" for w, a in zip(WIDTHS, arms) if a) + " |")


if __name__ == "__main__":
    main()
