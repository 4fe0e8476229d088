"""Continuous batching: a queue of requests through a fixed number of slots.

    result = serve(target, target_params, requests, DecodeConfig(method="domino", ...),
                   drafter, draft_params, slots=32)

:func:`~domino_jax.decode.speculative.generate` runs a static batch: the loop runs until its
slowest row is done, and the rows that finish first idle through the tail. With speculation
rows finish at different rounds (each accepts at its own rate), so a static batch pays for
its slowest row: the adaptive policy's wider rounds can pay on average over the rows but
not for the last one (``docs/design.md`` §9, §18). Serving
engines (vLLM, SGLang) refill a slot as soon as its request is done; this does the same
around the same compiled programs:

1. the first ``slots`` requests are prefilled as one batch (every prompt padded to one
   width, the bucket of the longest request, so one program serves the whole queue);
2. the round loop (:class:`~domino_jax.decode.speculative.RoundsProgram`) runs until
   ``refill_rows`` more rows are done (``done_limit``; default a slot in 8,
   :func:`default_refill_rows`): one host sync per refill, not per round;
3. each done slot's output is taken, and the next requests are prefilled together (one
   program per batch size, powers of two: :func:`refill_plan`) and written into free
   slots (:func:`insert_rows`; the adaptive policy's per-row acceptance statistics of
   those slots go back to the prior, :func:`reset_policy_rows`);
4. until the queue is empty and every slot is done.

Each request's tokens are exactly what a batch of its own would give at T = 0 (rows never
read each other; tests: greedy equality with AR per request). At T > 0 a request's random
stream depends on its slot and the rounds it shares with others (as in any batched
sampler), not its distribution. ``seconds`` is the wall time of the whole queue, prefills
included, so AR and speculation are compared on the same work (compile and the adaptive
cost calibration excluded).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from domino_jax.decode import loop, speculative
from domino_jax.decode.adaptive import PolicyState
from domino_jax.decode.config import DecodeConfig
from domino_jax.decode.cost_model import CostModel


@dataclasses.dataclass
class ServeResult(speculative.CommitStats):
    tokens: list[list[int]]      # generated tokens per request, in request order
    rounds: np.ndarray           # [R] rounds each request was live
    accept_hist: np.ndarray      # [R, W + 1]; index n = rounds that committed n tokens
    slots: int
    seconds: float               # wall time of the queue: prefills + round loops
    prefill_seconds: float       # of which prefills (the first fill and the refills)
    refills: int                 # refill prefills run
    verify_width: int
    compile_seconds: float = 0.0
    calibration_seconds: float = 0.0
    cost_source: str = ""
    verify_widths: dict = dataclasses.field(default_factory=dict)
    arm_rounds: dict = dataclasses.field(default_factory=dict)
    arm_costs: list = dataclasses.field(default_factory=list)
    # where the queue's time went: seconds in the round loops, the refills' prefills and
    # their row insertion; calls: (rounds, seconds) of each round-loop call (a host sync)
    timings: dict = dataclasses.field(default_factory=dict)
    calls: list = dataclasses.field(default_factory=list)

    @property
    def loop_rounds(self) -> int:
        """Rounds of the slots' loop (a round serves every slot)."""
        return sum(n for n, _ in self.calls)

    @property
    def loop_calls(self) -> int:
        return len(self.calls)

    @property
    def tokens_per_second(self) -> float:
        """Output throughput: every generated token over the queue's wall time."""
        return self.new_tokens / max(self.seconds, 1e-9)

    @property
    def decode_seconds(self) -> float:
        """The queue's time outside the prefills."""
        return self.seconds - self.prefill_seconds

    @property
    def decode_tokens_per_second(self) -> float:
        """The round loops' throughput: tokens after each request's first (which its
        prefill makes) over the time outside the prefills (what
        :attr:`~domino_jax.decode.speculative.GenerateResult.tokens_per_second` is for a
        static batch)."""
        return (max(self.new_tokens - len(self.tokens), 0)
                / max(self.seconds - self.prefill_seconds, 1e-9))


def call_split(calls) -> tuple[float, float] | None:
    """``(ms per round, ms per call)``: the least-squares split of round-loop calls'
    ``(rounds, seconds)`` (:attr:`ServeResult.calls`) into a per-round and a per-call part
    (what a return to the host costs beyond its rounds); ``None`` with fewer than 3 calls
    or one round count only."""
    calls = np.asarray(calls, np.float64).reshape(-1, 2)
    if len(calls) < 3 or len(set(calls[:, 0])) < 2:
        return None
    design = np.stack([calls[:, 0], np.ones(len(calls))], 1)
    per_round, per_call = np.linalg.lstsq(design, calls[:, 1], rcond=None)[0] * 1e3
    return float(per_round), float(per_call)


def batch_axes(small, large) -> list:
    """Per leaf of two pytrees of one structure whose batch sizes differ, the axis where
    their shapes differ (the batch axis), or ``None`` for a leaf without one (the state's
    RNG key)."""
    axes = []
    for a, b in zip(jax.tree_util.tree_leaves(small), jax.tree_util.tree_leaves(large)):
        diff = [i for i, (m, n) in enumerate(zip(a.shape, b.shape)) if m != n]
        if len(diff) > 1:
            raise ValueError(f"leaf shapes {a.shape} and {b.shape} differ in more than one axis")
        axes.append(diff[0] if diff else None)
    return axes


def state_batch_axes(target, drafter, config, target_params, draft_params, width: int,
                     capacity: int) -> tuple:
    """:func:`batch_axes` of the loop's state (``drafter``: the programs' drafter, adaptive:
    its base drafter) for prompts padded to ``width`` and ``capacity`` cache slots, from
    the prefill's abstract states at batch 1 and 2 (nothing runs)."""
    def shape(batch):
        return jax.eval_shape(
            lambda tp, dp, p, pl: loop.prefill(target, drafter, config, tp, dp, p, pl,
                                               jax.random.PRNGKey(0), capacity),
            target_params, draft_params, jax.ShapeDtypeStruct((batch, width), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32))

    return tuple(batch_axes(shape(1), shape(2)))


def insert_rows(full, part, rows: jax.Array, axes: Sequence[int | None]):
    """``full`` with batch row ``rows[j]`` of each leaf replaced by row ``j`` of ``part``
    (``rows [P]`` int32, ``P`` = ``part``'s batch; an index ``>= B`` drops that row); leaves
    without a batch axis (``axes[i] is None``) keep ``full``'s value."""
    leaves, tree = jax.tree_util.tree_flatten(full)
    out = []
    for leaf, new, axis in zip(leaves, jax.tree_util.tree_leaves(part), axes):
        if axis is None:
            out.append(leaf)
            continue
        index = (slice(None),) * axis + (rows,)
        out.append(leaf.at[index].set(new.astype(leaf.dtype), mode="drop"))
    return jax.tree_util.tree_unflatten(tree, out)


def reset_policy_rows(policy: PolicyState, rows: jax.Array):
    """The policy with the acceptance statistics of batch rows ``rows`` back at the
    prior (a new request in those slots; indices ``>= B`` are ignored)."""
    return policy.replace(accepted=policy.accepted.at[rows].set(0.0, mode="drop"),
                          observed=policy.observed.at[rows].set(0.0, mode="drop"))


_reset_jit = jax.jit(reset_policy_rows)   # small; init_policy shares one zeros buffer


REFILL_FRACTION = 8


def default_refill_rows(slots: int) -> int:
    """Rows to wait for before a refill: ``slots / 8`` (at least 1). A return to the host
    and a small prefill each cost about half a round or more, so waiting for a few rows
    leaves them idle for about a round per refill and saves calls and weight reads
    (``docs/design.md`` §18)."""
    return max(1, slots // REFILL_FRACTION)


def refill_size(count: int, slots: int) -> int:
    """The prefill batch for ``count`` new requests: the next power of two, at most
    ``slots`` (one compiled prefill per size)."""
    return min(1 << max(count - 1, 0).bit_length(), slots)


def refill_plan(free: int, waiting: int, slots: int) -> tuple[int, int]:
    """``(requests to start now, prefill batch)`` for ``free`` free slots and ``waiting``
    queued requests. While more requests wait than slots are free, the largest power of
    two that fits (no padding rows: a prefill is compute-bound at a few rows of a long
    prompt, so a padded row costs as much as a real one; the other free slots wait for the
    next refill); the queue's last requests all at once, padded to :func:`refill_size`."""
    count = min(free, waiting)
    if count <= 0:
        return 0, 0
    if waiting > free:
        size = 1 << (count.bit_length() - 1)
        return size, size
    return count, refill_size(count, slots)


def refill_program(target, drafter, config: DecodeConfig, target_params, draft_params,
                   batch: int, width: int, capacity: int):
    """``(prefill_fn, seconds)``: the refill prefill of ``batch`` prompts padded to
    ``width`` into caches of ``capacity`` slots, compiled on first use (cached as
    :func:`~domino_jax.decode.speculative.compiled_prefill`'s)."""
    return speculative.compiled_prefill(
        target, drafter, config, target_params, draft_params,
        jnp.zeros((batch, width), jnp.int32), jnp.ones((batch,), jnp.int32),
        jax.random.PRNGKey(0), capacity)


def compile_jobs(target, target_params, config: DecodeConfig, width: int, slots: int,
                 drafter=None, draft_params=None,
                 refill_rows: int | None = None) -> list[Callable[[], float]]:
    """Thunks, each returning its seconds, that compile what a :func:`serve` of requests
    padded to ``width`` through ``slots`` rows runs first: the first prefill and the round
    loop (one thunk), and the refill prefills of the queue's middle (one thunk each: the
    powers of two from ``refill_rows``' down to ``slots / 2``, :func:`refill_plan`; the
    queue's last refill, of any size, compiles when it comes). Run them on threads and they
    compile concurrently (the program cache is thread-safe; a :func:`serve` that needs a
    program being compiled waits for it), e.g. while another width's batch decodes
    (``docs/design.md`` §26)."""
    slots = int(slots)
    refill_rows = default_refill_rows(slots) if refill_rows is None else int(refill_rows)
    rows = [[0] * width] * slots
    plan = speculative._plan(target, rows, config, drafter, width=width)

    def first():
        return speculative._prepare(target, target_params, rows, config, drafter,
                                    draft_params, 0, width=width,
                                    many_calls=True).compile_seconds

    def refill(batch):
        return lambda: refill_program(target, plan.drafter, config, target_params,
                                      draft_params, batch, width, plan.capacity)[1]

    smallest = 1 << (max(refill_rows, 1).bit_length() - 1)
    return [first] + [refill(b) for b in (1 << i for i in range(slots.bit_length()))
                      if smallest <= b < slots]


def serve(target, target_params, requests: Sequence[Sequence[int]], config: DecodeConfig,
          drafter=None, draft_params=None, slots: int | None = None, seed: int = 0,
          cost_model: CostModel | None = None, refill_rows: int | None = None) -> ServeResult:
    """Decode every request of the queue ``requests`` (token-id prompts) through ``slots``
    rows (default: all at once, a static batch), refilling slots when their requests are
    done (see the module doc): the loop returns once ``refill_rows`` more rows are done
    (default :func:`default_refill_rows`; 1 refills each slot at once), and those are
    prefilled together. Validates like :func:`~domino_jax.decode.speculative.generate`
    (same ``ValueError`` messages) before any compute."""
    if not requests:
        raise ValueError("serve needs at least one request")
    slots = len(requests) if slots is None else int(slots)
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    slots = min(slots, len(requests))
    refill_rows = default_refill_rows(slots) if refill_rows is None else int(refill_rows)
    if refill_rows < 1:
        raise ValueError(f"refill_rows must be >= 1, got {refill_rows}")
    for i, request in enumerate(requests):          # the whole queue, before any compute
        if len(request) == 0:
            raise ValueError(f"request {i} is empty: give at least one token (e.g. BOS or a "
                             "chat template)")
    width = speculative.prompt_bucket(max(len(r) for r in requests))
    speculative.check_context_length(target.config, [len(r) for r in requests],
                                     config.max_new_tokens)
    prep = speculative._prepare(target, target_params, requests[:slots], config, drafter,
                                draft_params, seed, width=width, many_calls=True)
    axes = state_batch_axes(target, prep.drafter, config, target_params, draft_params, width,
                            prep.capacity)
    insert = prep.rounds_fn.keeping_layouts(insert_rows, static_argnums=(3,))

    refill_compile = 0.0                 # refill prefills compiled inside the clock
    prefill_fns = {slots: prep.prefill_fn}

    def prefill_fn(batch):               # compiled on first use, its seconds kept apart
        nonlocal refill_compile
        if batch not in prefill_fns:
            prefill_fns[batch], seconds = refill_program(
                target, prep.drafter, config, target_params, draft_params, batch, width,
                prep.capacity)
            refill_compile += seconds
        return prefill_fns[batch]

    t0 = time.perf_counter()
    state = prep.prefill_fn(target_params, draft_params, prep.prompt, prep.prompt_len, prep.key)
    jax.block_until_ready(state)
    first_prefill = time.perf_counter() - t0
    policy, calibration_seconds, cost_source = speculative.start_policy(
        prep, target, config, target_params, draft_params, state, cost_model)

    results: list = [None] * len(requests)
    rounds = np.zeros(len(requests), np.int64)
    hist = np.zeros((len(requests), state.accept_hist.shape[1]), np.int64)
    owner: list = list(range(slots))     # request in each slot (None: idle)
    queue = slots                        # next request to start
    refills = 0
    refill_seconds = insert_seconds = 0.0
    calls = []
    limit = np.int32(config.max_new_tokens + 1)
    t1 = time.perf_counter()
    while True:
        done, live_rounds = np.asarray(state.done), np.asarray(state.rounds)
        finished = [s for s in range(slots) if done[s] and owner[s] is not None]
        if finished:                     # take the finished requests' outputs
            out, num, acc = (np.asarray(x) for x in (state.out_tokens, state.num_out,
                                                     state.accept_hist))
            for s in finished:
                results[owner[s]] = speculative.trim_row(out[s], num[s], config)
                rounds[owner[s]], hist[owner[s]] = live_rounds[s], acc[s]
                owner[s] = None
        free = [s for s in range(slots) if owner[s] is None]
        waiting = len(requests) - queue
        count, size = refill_plan(len(free), waiting, slots)
        if count and (len(free) >= refill_rows or count == waiting or len(free) == slots):
            new = list(range(queue, queue + count))     # the next requests, free slots
            t2 = time.perf_counter()
            batch = [requests[r] for r in new] + [requests[new[0]]] * (size - len(new))
            prompt, prompt_len = speculative.pad_prompts(batch, width=width)
            fn = prefill_fn(size)
            part = fn(target_params, draft_params, prompt, prompt_len,
                      jax.random.fold_in(prep.key, queue))
            jax.block_until_ready(part)
            t3 = time.perf_counter()
            rows = jnp.asarray(free[:len(new)] + [slots] * (size - len(new)), jnp.int32)
            state = insert(prep.rounds_fn.adopt(state), part, rows, axes)
            policy = _reset_jit(policy, rows)
            jax.block_until_ready((state, policy))
            refill_seconds += time.perf_counter() - t2
            insert_seconds += time.perf_counter() - t3
            for s, r in zip(free, new):
                owner[s] = r
            queue += len(new)
            refills += 1
            continue                     # a new row may be done at once (a stop first)
        if all(o is None for o in owner):
            break
        # until refill_rows slots are free (counting those already free); with the queue
        # empty, until every row is done
        idle = sum(o is None for o in owner)
        wait = max(refill_rows - idle, 1) if queue < len(requests) else slots
        done_limit = min(int(done.sum()) + wait, slots)
        t4 = time.perf_counter()
        state, policy = prep.rounds_fn(target_params, draft_params, state, policy, limit,
                                       done_limit=done_limit)
        ran = int((np.asarray(state.rounds) - live_rounds)[~done].max(initial=0))
        calls.append((ran, time.perf_counter() - t4))   # a live row counts every round
    seconds = time.perf_counter() - t1 - refill_compile + first_prefill
    prefill_seconds = first_prefill + refill_seconds - refill_compile
    widths, arms, costs = loop.width_report(config, prep.widths, policy,
                                            sum(n for n, _ in calls))
    return ServeResult(
        results, rounds, hist, slots, seconds, prefill_seconds, refills, prep.num_drafts + 1,
        compile_seconds=prep.compile_seconds + refill_compile,
        calibration_seconds=calibration_seconds, cost_source=cost_source, verify_widths=widths,
        arm_rounds=arms, arm_costs=costs,
        timings=dict(loop=sum(t for _, t in calls),
                     refill_prefill=prefill_seconds - insert_seconds, insert=insert_seconds),
        calls=calls)

