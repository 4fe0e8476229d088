"""Live continuous batching: requests that arrive at any time, through a fixed number of slots.

    engine = Engine(target, target_params, drafter, draft_params, config, slots=8)
    engine.start()                       # compiles, then engine.ready is set
    engine.submit(Request(prompt_ids, SamplingConfig(), max_tokens=64, on_event=callback))

:func:`~domino_jax.decode.serving.serve` runs a queue that is known up front; this runs one
that grows while it decodes, on the same compiled programs and helpers (the round loop of
:mod:`~domino_jax.decode.speculative` with ``done_limit``, :func:`~.serving.insert_rows`,
:func:`~.serving.refill_plan`, :func:`~.serving.reset_policy_rows`). One engine thread owns
the device state and repeats:

1. **harvest**: read each slot's committed tokens; send each request the tokens it has not
   seen (``on_event(Tokens)``); finish a request at a stop token (the config's or its own
   ``stop_ids``), at its ``max_tokens`` or when it is cancelled (``on_event(Finished)``),
   and retire its row (``done`` set, so the loop skips it) when the loop had not;
2. **refill**: free slots take the oldest waiting requests of the batch's sampling setting,
   prefilled together (a power-of-two batch, :func:`~.serving.refill_plan`; prompts padded
   to the bucket of the longest, :func:`~.speculative.prompt_bucket`) and written into the
   free rows;
3. **rounds**: one call of the round loop, at most ``rounds_per_call`` rounds (and no more
   than the nearest ``max_tokens`` needs), returning early once a row is done while
   requests wait.

Sampling settings (temperature, top-k, top-p) are static in the compiled programs: a batch
runs one setting. A request with another setting waits until the batch has drained and the
engine switches to its setting (its programs compiled in the background if they are not
yet: meanwhile requests of the running setting are still admitted; once they are compiled
the running batch takes no new requests). Everything else of a request is host-side data
and shares the batch: its prompt, ``max_tokens`` (at most the compiled
``config.max_new_tokens``), its stop ids. The settings listed in ``warm`` (default: the
config's) are compiled by :meth:`Engine.start` before :attr:`Engine.ready` is set: every
prefill program (each refill batch size and prompt bucket), the round loop, the row helpers,
and for adaptive widths the arms' costs (:mod:`~domino_jax.decode.cost_model`).

At T = 0 a request's tokens are exactly those of :func:`~.speculative.generate` on its
prompt alone with the same config (rows never read each other); a request cut by its own
``max_tokens`` gets that output's first ``max_tokens``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from domino_jax.decode import adaptive as adaptive_lib
from domino_jax.decode import loop, serving, speculative
from domino_jax.decode.config import DecodeConfig
from domino_jax.decode.cost_model import CostModel
from domino_jax.decode.prefill import context_limit
from domino_jax.decode.sampling import SamplingConfig
from domino_jax.decode.tensor_parallel import mesh_context
from domino_jax.kv_cache import align_slots

log = logging.getLogger("domino_jax.serve")

FINISH_REASONS = ("stop", "length", "cancelled", "error")


class Tokens(NamedTuple):
    """Tokens a request has not seen yet (in order)."""

    ids: list[int]


class Finished(NamedTuple):
    """The request's end: ``reason`` one of :data:`FINISH_REASONS`; ``tokens`` its output
    (stop token included); ``message`` says what went wrong for ``"error"``."""

    reason: str
    tokens: list[int]
    message: str = ""


class QueueFull(RuntimeError):
    """The waiting queue holds ``max_queue`` requests already."""


class Unavailable(RuntimeError):
    """The engine takes no requests: still compiling, draining or stopped."""


@dataclasses.dataclass(eq=False)
class Request:
    """One generation. ``on_event`` is called on the engine thread with :class:`Tokens` and
    then exactly one :class:`Finished`; it must not block."""

    prompt: Sequence[int]
    sampling: SamplingConfig
    max_tokens: int
    on_event: Callable
    stop_ids: frozenset = frozenset()
    cancelled: str | None = None     # set by Engine.cancel (any thread): the finish reason
    keep: int | None = None          # with it: the tokens the request keeps
    tokens: list = dataclasses.field(default_factory=list)   # sent so far (engine thread)
    finished: bool = False


class _Group:
    """The compiled programs of one sampling setting (see :meth:`Engine._build`)."""

    def __init__(self, config, prep, axes, prefills, costs):
        self.config, self.prep, self.axes = config, prep, axes
        self.prefills = prefills          # {(batch, width): compiled prefill}
        self.costs = costs                # adaptive: ms per round per arm, else None
        self.insert = prep.rounds_fn.keeping_layouts(serving.insert_rows, static_argnums=(3,))
        self.retire = prep.rounds_fn.keeping_layouts(_retire)

    def policy(self, batch: int):
        return loop.init_policy(self.config, self.prep.drafter, self.prep.widths, batch,
                                self.costs)


def _retire(state, rows):
    """``state`` with the rows where ``rows`` (bool ``[B]``) is set marked done."""
    return state.replace(done=state.done | rows)


def prompt_widths(max_prompt_tokens: int) -> list[int]:
    """The prompt buckets (:func:`~.speculative.prompt_bucket`) up to the one of
    ``max_prompt_tokens``: one prefill program per bucket and refill size."""
    widths = [speculative.prompt_bucket(1)]
    while widths[-1] < speculative.prompt_bucket(max_prompt_tokens):
        widths.append(speculative.prompt_bucket(widths[-1] + 1))
    return widths


class Engine:
    """The live scheduler (see the module doc). ``config``: the decode settings every batch
    shares (method, widths, stop ids, ``max_new_tokens`` = the most a request may ask for);
    its ``sampling`` is the setting compiled first. ``slots``: rows of the batch;
    ``max_queue``: requests that may wait for a slot (more: :class:`QueueFull`);
    ``max_prompt_tokens``: the longest prompt (with ``max_new_tokens`` it sizes the cache,
    checked against the target's context here: ``ValueError``). ``metrics``: an object with
    the :class:`~domino_jax.serve.metrics.Metrics` hooks, or ``None``."""

    def __init__(self, target, target_params, drafter, draft_params, config: DecodeConfig,
                 slots: int = 8, max_queue: int = 256, max_prompt_tokens: int = 512,
                 rounds_per_call: int = 8, seed: int = 0, cost_model: CostModel | None = None,
                 warm: Sequence[SamplingConfig] | None = None, mesh=None, metrics=None):
        for name, value in (("slots", slots), ("max_queue", max_queue),
                            ("max_prompt_tokens", max_prompt_tokens),
                            ("rounds_per_call", rounds_per_call)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        limit = context_limit(target.config)
        if max_prompt_tokens + config.max_new_tokens > limit:
            raise ValueError(f"max_prompt_tokens {max_prompt_tokens} + max_new_tokens "
                             f"{config.max_new_tokens} (--max-prompt-tokens, "
                             f"--max-new-tokens) are {max_prompt_tokens + config.max_new_tokens}"
                             f" positions, more than the target supports: {limit} "
                             "(max_position_embeddings in its config.json)")
        self.target, self.target_params = target, target_params
        self.drafter, self.draft_params = drafter, draft_params
        self.slots, self.max_queue = int(slots), int(max_queue)
        self.max_prompt_tokens, self.rounds_per_call = int(max_prompt_tokens), int(rounds_per_call)
        self.widths = prompt_widths(self.max_prompt_tokens)
        self.sizes = sorted({serving.refill_size(n, self.slots) for n in range(1, self.slots + 1)})
        resolved, _ = loop.loop_arms(config, speculative._resolve_drafter(target, config,
                                                                          drafter))
        # one cache capacity for every prompt bucket: the loop's state has one shape
        capacity = align_slots(speculative.required_capacity(
            self.widths[-1], config, resolved.verify_width - 1))
        self.config = dataclasses.replace(config, capacity=capacity)
        self.max_new_tokens = config.max_new_tokens
        self.key = jax.random.PRNGKey(seed)
        self.cost_model = cost_model or CostModel()
        self.warm = list(warm) if warm else [config.sampling]
        self.mesh, self.metrics = mesh, metrics
        self.ready = threading.Event()
        self.error: str | None = None     # why the warm-up failed
        self._cond = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._accepting = False
        self._stopping = False
        self._groups: dict[SamplingConfig, concurrent.futures.Future] = {}
        self._compiler = concurrent.futures.ThreadPoolExecutor(1, "domino-compile")
        self._thread = threading.Thread(target=self._main, name="domino-engine", daemon=True)
        # engine-thread state
        self._group: _Group | None = None
        self._state = self._policy = None
        self._arm_seen = None
        self._owner: list[Request | None] = [None] * self.slots
        self._prefills = 0

    # ---- any thread ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread: compile the ``warm`` settings, then take requests."""
        self._thread.start()

    def submit(self, request: Request) -> None:
        """Queue ``request`` (``ValueError`` naming the field for a prompt or ``max_tokens``
        that does not fit; :class:`QueueFull`, :class:`Unavailable`)."""
        if not request.prompt:
            raise ValueError("prompt: empty (give at least one token)")
        if len(request.prompt) > self.max_prompt_tokens:
            raise ValueError(f"prompt: {len(request.prompt)} tokens, more than the server's "
                             f"limit of {self.max_prompt_tokens} (--max-prompt-tokens)")
        if not 1 <= request.max_tokens <= self.max_new_tokens:
            raise ValueError(f"max_tokens: {request.max_tokens} is not in [1, "
                             f"{self.max_new_tokens}] (the server's --max-new-tokens)")
        with self._cond:
            if not self._accepting:
                raise Unavailable("the server is still compiling" if not self.ready.is_set()
                                  else "the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (--max-queue "
                                f"{self.max_queue})")
            self._waiting.append(request)
            self._cond.notify()

    def cancel(self, request: Request, reason: str = "cancelled",
               keep: int | None = None) -> None:
        """Stop ``request``: its slot is freed at the next step and, unless it had finished,
        it gets ``Finished(reason)`` with its first ``keep`` tokens (default: those sent;
        a stop string found by the caller ends a request as ``"stop"``)."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"reason: {reason!r} is not one of {FINISH_REASONS}")
        request.keep = keep
        request.cancelled = reason
        with self._cond:
            self._cond.notify()

    def drain(self) -> None:
        """Take no new requests (:class:`Unavailable`); those queued and live go on."""
        with self._cond:
            self._accepting = False

    def stop(self, timeout: float | None = None) -> None:
        """Cancel everything left and end the engine thread."""
        with self._cond:
            self._accepting, self._stopping = False, True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._compiler.shutdown(wait=False, cancel_futures=True)

    @property
    def running(self) -> bool:
        """Whether the engine thread is alive (after :meth:`stop`: still inside a compile,
        which cannot be interrupted)."""
        return self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        """Whether :meth:`submit` takes requests (compiled, not draining or stopped)."""
        return self._accepting

    @property
    def queue_length(self) -> int:
        return len(self._waiting)

    @property
    def live_slots(self) -> int:
        return sum(r is not None for r in self._owner)

    # ---- the engine thread ---------------------------------------------------------------

    def _main(self) -> None:
        with mesh_context(self.mesh):
            try:
                t0 = time.perf_counter()
                for sampling in self.warm:
                    if self._stopping:
                        return
                    self._group_future(sampling, self.cost_model).result()
                log.info("[serve] compiled %d sampling setting(s) in %.1f s; ready",
                         len(self.warm), time.perf_counter() - t0)
            except Exception as e:                 # noqa: BLE001  (reported, then fatal)
                log.exception("[serve] warm-up failed")
                self.error = f"{type(e).__name__}: {e}"
                self.ready.set()
                return
            with self._cond:
                self._accepting = not self._stopping
            self.ready.set()
            while True:
                with self._cond:
                    while not (self._stopping or self._waiting or self.live_slots):
                        self._cond.wait()
                    if self._stopping:
                        break
                try:
                    self._step()
                except Exception as e:             # noqa: BLE001  (the requests are told)
                    log.exception("[serve] decode step failed")
                    self._fail_all(f"{type(e).__name__}: {e}")
            self._fail_all("the server shut down", reason="cancelled")

    def _fail_all(self, message: str, reason: str = "error") -> None:
        with self._cond:
            requests = [r for r in self._owner if r is not None] + list(self._waiting)
            self._waiting.clear()
        for r in requests:
            self._finish(r, reason, message)
        self._owner = [None] * self.slots
        self._state = self._policy = self._group = None

    def _finish(self, request: Request, reason: str, message: str = "") -> None:
        if request.finished:
            return
        request.finished = True
        if request.keep is not None:
            del request.tokens[request.keep:]
        if self.metrics is not None:
            self.metrics.on_finish(reason, len(request.tokens))
        request.on_event(Finished(reason, list(request.tokens), message))

    def _step(self) -> None:
        with self._cond:                            # cancelled before they started
            for r in [r for r in self._waiting if r.cancelled]:
                self._waiting.remove(r)
                self._finish(r, r.cancelled)
        if self._state is not None:
            self._harvest()
        if self.metrics is not None:
            self.metrics.set_load(len(self._waiting), self.live_slots, self.slots)
        if self._switch_group() or self._refill():
            return                                  # harvest again: a row may be done
        if self.live_slots:
            self._rounds()

    def _harvest(self) -> None:
        """Step 1 of the module doc."""
        done, num, out = (np.asarray(x) for x in (self._state.done, self._state.num_out,
                                                  self._state.out_tokens))
        stops = set(self.config.stop_token_ids)
        retire = np.zeros(self.slots, bool)
        ended = []
        for s, r in enumerate(self._owner):
            if r is None:
                continue
            reason = r.cancelled
            if reason is None:
                new = out[s, len(r.tokens):min(int(num[s]), r.max_tokens)].tolist()
                for i, t in enumerate(new):
                    if t in stops or t in r.stop_ids:
                        new, reason = new[:i + 1], "stop"
                        break
                if new:
                    r.tokens.extend(new)
                    r.on_event(Tokens(new))
                if reason is None and (len(r.tokens) >= r.max_tokens or done[s]):
                    reason = "length"         # a device-done row without a stop: max_new
            if reason is not None:
                ended.append((s, r, reason))
                retire[s] = not done[s]
        if not ended:
            return
        if self.metrics is not None:
            rounds, hist = np.asarray(self._state.rounds), np.asarray(self._state.accept_hist)
            for s, _, _ in ended:
                self.metrics.on_rounds(int(rounds[s]),
                                       int((hist[s] * np.arange(hist.shape[1])).sum()))
        for s, r, reason in ended:
            self._owner[s] = None
            self._finish(r, reason)
        if retire.any():
            self._state = self._group.retire(self._state, jnp.asarray(retire))

    def _head(self) -> Request | None:
        with self._cond:
            return self._waiting[0] if self._waiting else None

    def _switch_group(self) -> bool:
        """With no live row, move the batch to the oldest waiting request's setting once its
        programs are compiled (start compiling them otherwise). True when it switched."""
        head = self._head()
        if head is None or (self._group is not None
                            and head.sampling == self._group.config.sampling):
            return False
        future = self._group_future(head.sampling)
        if self.live_slots or not future.done():
            if not self.live_slots:             # nothing to run meanwhile
                concurrent.futures.wait([future], timeout=0.5)
            return False
        try:
            group = future.result()
        except Exception as e:                  # noqa: BLE001  (told to the requests)
            del self._groups[head.sampling]
            with self._cond:
                failed = [r for r in self._waiting if r.sampling == head.sampling]
                for r in failed:
                    self._waiting.remove(r)
            for r in failed:
                self._finish(r, "error", f"compiling its programs failed: {e}")
            return True
        self._group = group
        self._state, self._policy = self._empty_state(group)
        self._arm_seen = None
        return True

    def _admissible(self) -> list[Request]:
        """Waiting requests that may join the running batch: those of its setting, unless
        the oldest waiting request has another setting whose programs are compiled (then
        the batch drains for it)."""
        with self._cond:
            waiting = list(self._waiting)
        if not waiting or self._group is None:
            return []
        sampling = self._group.config.sampling
        head = waiting[0]
        if head.sampling != sampling and self._group_future(head.sampling).done():
            return []
        return [r for r in waiting if r.sampling == sampling and not r.cancelled]

    def _refill(self) -> bool:
        """Step 2 of the module doc. True when it started requests."""
        free = [s for s, r in enumerate(self._owner) if r is None]
        if not free:
            return False
        candidates = self._admissible()
        count, size = serving.refill_plan(len(free), len(candidates), self.slots)
        if not count:
            return False
        group, new = self._group, candidates[:count]
        with self._cond:
            for r in new:
                self._waiting.remove(r)
        t0 = time.perf_counter()
        batch = [list(r.prompt) for r in new] + [list(new[0].prompt)] * (size - count)
        width = speculative.prompt_bucket(max(len(p) for p in batch))
        prompt, prompt_len = speculative.pad_prompts(batch, width=width)
        part = group.prefills[size, width](
            self.target_params, self.draft_params, prompt, prompt_len,
            jax.random.fold_in(self.key, self._prefills))
        self._prefills += 1
        rows = jnp.asarray(free[:count] + [self.slots] * (size - count), jnp.int32)
        self._state = group.insert(group.prep.rounds_fn.adopt(self._state), part, rows,
                                   group.axes)
        self._policy = serving._reset_jit(self._policy, rows)
        jax.block_until_ready((self._state, self._policy))
        for s, r in zip(free, new):
            self._owner[s] = r
        if self.metrics is not None:
            self.metrics.on_prefill(time.perf_counter() - t0, count,
                                    sum(len(r.prompt) for r in new))
        return True

    def _rounds(self) -> None:
        """Step 3 of the module doc."""
        state, group = self._state, self._group
        num = np.asarray(state.num_out)
        live = [s for s, r in enumerate(self._owner) if r is not None]
        # each round commits a token at least: stop where the nearest max_tokens may be hit
        nearest = min(self._owner[s].max_tokens - int(num[s]) for s in live)
        max_rounds = np.int32(max(1, min(self.rounds_per_call, nearest)))
        done_count = int(np.asarray(state.done).sum())
        done_limit = done_count + 1 if self._waiting else self.slots
        rounds_before = np.asarray(state.rounds)
        t0 = time.perf_counter()
        self._state, self._policy = group.prep.rounds_fn(
            self.target_params, self.draft_params, state, self._policy, max_rounds,
            done_limit=done_limit)
        ran = int((np.asarray(self._state.rounds) - rounds_before).max(initial=0))
        if self.metrics is not None:
            self.metrics.on_loop(time.perf_counter() - t0, ran)
            if group.config.adaptive is not None:
                arms = np.asarray(self._policy.arm_rounds)
                seen = self._arm_seen if self._arm_seen is not None else np.zeros_like(arms)
                self.metrics.on_arms(adaptive_lib.arm_histogram(group.prep.widths,
                                                                arms - seen))
                self._arm_seen = arms

    # ---- programs ------------------------------------------------------------------------

    def _group_future(self, sampling: SamplingConfig, cost_model: CostModel | None = None):
        """The (future) programs of ``sampling``, compiling in the background on first ask.
        Settings compiled after the warm ones take the arm costs of the first (a
        calibration would time its rounds against the running batch's)."""
        future = self._groups.get(sampling)
        if future is None:
            if cost_model is None:
                first = self._groups.get(self.warm[0])
                costs = (first.result().costs if first is not None and first.done()
                         and first.exception() is None else None)
                cost_model = self.cost_model if costs is None else CostModel(costs=costs)
            future = self._compiler.submit(self._build, sampling, cost_model)
            self._groups[sampling] = future
        return future

    def _build(self, sampling: SamplingConfig, cost_model: CostModel) -> _Group:
        """Compile every program of one sampling setting and run each once."""
        with mesh_context(self.mesh):
            return self._compile(sampling, cost_model)

    def _compile(self, sampling: SamplingConfig, cost_model: CostModel) -> _Group:
        t0 = time.perf_counter()
        target, tp, dp = self.target, self.target_params, self.draft_params
        config = dataclasses.replace(self.config, sampling=sampling)
        width = self.widths[0]
        prep = speculative._prepare(target, tp, [[0]] * self.slots, config, self.drafter, dp,
                                    0, width=width, many_calls=True)
        axes = serving.state_batch_axes(target, prep.drafter, config, tp, dp, width,
                                        prep.capacity)
        self._check_state_shapes(prep, config)
        jobs = {}
        workers = max(1, min(8, (os.cpu_count() or 2) // 2))
        with concurrent.futures.ThreadPoolExecutor(workers, "domino-prefill") as pool:
            for size in self.sizes:
                for w in self.widths:
                    jobs[size, w] = pool.submit(
                        speculative.compiled_prefill, target, prep.drafter, config, tp, dp,
                        jnp.zeros((size, w), jnp.int32), jnp.ones((size,), jnp.int32),
                        prep.key, prep.capacity)
            prefills = {k: f.result()[0] for k, f in jobs.items()}
        costs = None
        state = prep.prefill_fn(tp, dp, prep.prompt, prep.prompt_len, prep.key)
        if config.adaptive is not None:
            policy, _, source = speculative.start_policy(prep, target, config, tp, dp, state,
                                                         cost_model)
            costs = [float(c) for c in np.asarray(policy.costs)]
            log.info("[serve] T=%s: arm costs from %s", sampling.temperature, source)
        group = _Group(config, prep, axes, prefills, costs)
        state, policy = self._empty_state(group)
        for size in self.sizes:                 # the row helpers compile on first use
            part = prefills[size, width](tp, dp, jnp.zeros((size, width), jnp.int32),
                                         jnp.ones((size,), jnp.int32), prep.key)
            rows = jnp.full((size,), self.slots, jnp.int32)      # all dropped
            state = group.insert(state, part, rows, axes)
            policy = serving._reset_jit(policy, rows)
        jax.block_until_ready((prep.rounds_fn(tp, dp, state, policy, np.int32(1)),
                               jax.random.fold_in(self.key, 0)))
        log.info("[serve] T=%s top_k=%s top_p=%s: %d prefill programs + the round loop "
                 "compiled in %.1f s", sampling.temperature, sampling.top_k, sampling.top_p,
                 len(prefills), time.perf_counter() - t0)
        if self.metrics is not None:
            self.metrics.on_compile(time.perf_counter() - t0)
        return group

    def _check_state_shapes(self, prep, config) -> None:
        """Every prompt bucket's prefill gives the loop's state shapes (the caches are sized
        by the capacity, not the prompt), so any refill fits the running state."""
        def shapes(width):
            return [x.shape for x in jax.tree_util.tree_leaves(jax.eval_shape(
                lambda tp, dp, p, pl: loop.prefill(
                    self.target, prep.drafter, config, tp, dp, p, pl, prep.key,
                    prep.capacity),
                self.target_params, self.draft_params,
                jax.ShapeDtypeStruct((1, width), jnp.int32),
                jax.ShapeDtypeStruct((1,), jnp.int32)))]

        base = shapes(self.widths[0])
        for w in self.widths[1:]:
            if shapes(w) != base:
                raise ValueError(f"the loop state of prompt bucket {w} differs from bucket "
                                 f"{self.widths[0]}'s: cannot refill across buckets")

    def _empty_state(self, group: _Group):
        """A state of ``slots`` rows, every one done (free), and a fresh policy."""
        prep = group.prep
        state = prep.prefill_fn(self.target_params, self.draft_params, prep.prompt,
                                prep.prompt_len, prep.key)
        state = group.retire(prep.rounds_fn.adopt(state), jnp.ones((self.slots,), bool))
        return state, group.policy(self.slots)
