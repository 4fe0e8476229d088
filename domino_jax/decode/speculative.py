"""Host-side orchestration of decoding: one ``generate`` call for every method.

    result = generate(target, target_params, prompts, DecodeConfig(method="domino"),
                      drafter, draft_params)

What runs on the device is :mod:`domino_jax.decode.loop` (prefill, then a
``lax.while_loop`` of draft -> verify -> commit rounds, :mod:`domino_jax.decode.round`,
under the run's policy, until every row is done or a round limit is reached, so the CLI can
stream chunks without a host sync per round). This module
does what happens around it: validation, prompt padding into length buckets (one compiled
program per bucket), the cache capacity, the compile cache (programs compiled ahead of
time, per models, config and shapes; :func:`precompile` fills it without running anything,
thread-safe), chunked streaming and trimming the outputs at stops and ``max_new_tokens``.

Methods (:mod:`domino_jax.decode.methods`): ``ar`` (no drafter: the chain with zero
drafts), ``ngram`` (prompt lookup, no model), ``dflash`` and ``domino`` (chains), ``ddtree``
and ``dominotree`` (trees).
Float32 targets run their matmuls at full float32 precision (:func:`matmul_precision`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout

from domino_jax.decode import loop
from domino_jax.decode.config import DecodeConfig
from domino_jax.decode.cost_model import CostModel, cost_key
from domino_jax.decode.contract import DecodeState, Drafter
from domino_jax.decode.methods import METHODS, drafter_class, make_drafter
from domino_jax.decode.prefill import check_context_length
from domino_jax.kv_cache import align_slots
from domino_jax.models.qwen3 import TargetLM
from domino_jax.program_cache import FreshJit, ProgramCache, fresh_function

__all__ = ["DecodeConfig", "GenerateResult", "METHODS", "clear_compiled", "generate",
           "precompile", "matmul_precision", "pad_prompts", "prompt_bucket", "required_capacity"]


class CommitStats:
    """``new_tokens`` and ``tau`` of a result with ``tokens`` (per row or request) and
    ``accept_hist`` ``[rows, W + 1]``."""

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tau(self) -> float:
        """Mean tokens committed per round (accepted drafts + bonus), over all rows."""
        hist = self.accept_hist.sum(0)
        return float((hist * np.arange(len(hist))).sum() / max(hist.sum(), 1))


@dataclasses.dataclass
class GenerateResult(CommitStats):
    tokens: list[list[int]]      # generated tokens per row (stop inclusive, <= max_new)
    rounds: np.ndarray           # [B]
    accept_hist: np.ndarray      # [B, W + 1]; index n = rounds that committed n tokens
    prefill_seconds: float
    decode_seconds: float
    verify_width: int               # verify rows per round (adaptive: the widest arm's)
    compile_seconds: float = 0.0    # AOT compile time of this call (0 when cached)
    verify_widths: dict = dataclasses.field(default_factory=dict)   # {verify rows: rounds}
    calibration_seconds: float = 0.0   # adaptive: the cost model's calibration (0: table)
    cost_source: str = ""              # adaptive: where the per-arm costs came from
    arm_rounds: dict = dataclasses.field(default_factory=dict)  # adaptive: {arm name: rounds}
    arm_costs: list = dataclasses.field(default_factory=list)   # adaptive: ms per round per arm

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: tokens after the first one, over the round loop's time."""
        return max(self.new_tokens - len(self.tokens), 0) / max(self.decode_seconds, 1e-9)


def matmul_precision(target: TargetLM) -> str | None:
    """The matmul precision the decode programs are traced with: ``"highest"`` for a float32
    target (by default XLA runs float32 matmuls on GPUs in TF32, which is not float32:
    greedy outputs then differ from exact AR on some prompts), else ``None`` (the default
    precision; bf16 matmuls are unaffected)."""
    return "highest" if jnp.dtype(target.dtype) == jnp.float32 else None


def precision_scope(target: TargetLM):
    """A context manager tracing under :func:`matmul_precision` (no-op for bf16 targets)."""
    precision = matmul_precision(target)
    return (jax.default_matmul_precision(precision) if precision
            else contextlib.nullcontext())


# a fresh jax.jit per compiled program, so that jax's caches let a program go once
# _PROGRAMS drops it (domino_jax/program_cache.py)
_prefill_jit = FreshJit(loop.prefill, static_argnums=(0, 1, 2, 8))
_rounds_jit = FreshJit(loop.rounds, static_argnums=(0, 1, 2), donate_argnums=(5,))
# the same loop with the state's layouts left to XLA, in and out (loop_state_layouts)
_AUTO = Format(Layout.AUTO)
_rounds_jit_auto = FreshJit(loop.rounds, static_argnums=(0, 1, 2), donate_argnums=(5,),
                            in_shardings=(None, None, _AUTO, None, None, None),
                            out_shardings=(_AUTO, None))


def prompt_bucket(length: int) -> int:
    """Padded prompt width for ``length`` tokens, so prompts of similar length share one
    compiled program: the next power of two up to 256 (at least 16), then multiples of 256."""
    if length <= 256:
        return max(16, 1 << (max(length, 1) - 1).bit_length())
    return -(-length // 256) * 256


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0, bucket: bool = True,
                width: int | None = None):
    """Right-pad token lists to ``[B, T]`` (``T`` bucketed, see :func:`prompt_bucket`, or
    ``width`` when given: at least the longest prompt); returns (array, lengths). Padding is
    never attended to: each row's cache length is its own prompt length."""
    lengths = [len(p) for p in prompts]
    for i, n in enumerate(lengths):
        if n == 0:
            raise ValueError(f"prompt {i} is empty: give at least one token (e.g. BOS or a "
                             "chat template)")
    longest = max(lengths)
    if width is None:
        width = prompt_bucket(longest) if bucket else longest
    elif width < longest:
        raise ValueError(f"pad width {width} is shorter than the longest prompt ({longest})")
    array = np.full((len(prompts), width), pad_id, np.int32)
    for i, p in enumerate(prompts):
        array[i, :len(p)] = p
    return jnp.asarray(array), jnp.asarray(lengths, jnp.int32)


def required_capacity(prompt_len: int, config: DecodeConfig, num_drafts: int) -> int:
    """Target-cache slots needed: prompt + generation + one verify block of overrun."""
    return prompt_len + config.max_new_tokens + num_drafts + 1


class _Prepared(NamedTuple):
    """What :func:`generate` runs: padded inputs, their key, and the compiled programs."""

    prompt: jax.Array             # [B, T] right-padded prompts (T bucketed)
    prompt_len: jax.Array         # [B] int32 prompt lengths
    key: jax.Array                # PRNGKey(seed)
    num_drafts: int               # verify rows per round - 1 (0 for AR; adaptive: the widest)
    prefill_fn: Any               # (target_params, draft_params, prompt, prompt_len, key) -> state
    rounds_fn: Any                # (target_params, draft_params, state, policy, max_rounds)
    #                               -> (state, policy): a RoundsProgram
    compile_seconds: float        # see :func:`precompile`
    drafter: Any                  # the loop drafter the programs run (loop.loop_arms)
    capacity: int                 # target cache slots
    widths: tuple[int, ...]       # the loop's arms (a fixed width: one)


def _resolve_drafter(target: TargetLM, config: DecodeConfig, drafter) -> Drafter:
    """The drafter ``generate`` runs: the given one (checked against ``config.method``), or
    the method's default when it needs no checkpoint (``ar``)."""
    cls = drafter_class(config.method)
    if drafter is None:
        if cls.needs_checkpoint:
            raise ValueError(f"method {config.method!r} needs a drafter (--draft DIR)")
        return make_drafter(None, target, config.method)
    if not cls.needs_checkpoint and not isinstance(drafter, cls):
        raise ValueError(f"method {config.method!r} takes no drafter")
    if drafter.method != config.method:
        raise ValueError(f"method {config.method!r} does not match the drafter's method "
                         f"{drafter.method!r}")
    return drafter


class _Plan(NamedTuple):
    """What :func:`_plan` decides: the programs' shapes, before any compile."""

    drafter: Any                  # the loop drafter (loop.loop_arms)
    widths: tuple[int, ...]       # the loop's arms
    prompt: jax.Array             # [B, T] right-padded prompts
    prompt_len: jax.Array         # [B] int32
    num_drafts: int               # verify rows per round - 1
    capacity: int                 # target cache slots


def _plan(target: TargetLM, prompts: Sequence[Sequence[int]], config: DecodeConfig, drafter,
          width: int | None = None) -> _Plan:
    """Validate, pad (to ``width`` when given) and size the cache: the shapes of the
    programs a :func:`generate` of ``prompts`` runs, nothing compiled."""
    drafter, widths = loop.loop_arms(config, _resolve_drafter(target, config, drafter))
    check_context_length(target.config, [len(p) for p in prompts], config.max_new_tokens)
    prompt, prompt_len = pad_prompts(prompts, width=width)
    num_drafts = drafter.verify_width - 1                                 # verify rows - root
    needed = required_capacity(int(prompt_len.max()), config, num_drafts)
    # Default capacity from the bucketed width (one compiled program per bucket), aligned to
    # whole chunks of the attention kernel.
    capacity = config.capacity or align_slots(max(
        needed, required_capacity(prompt.shape[1], config, num_drafts)))
    if needed > capacity:
        raise ValueError(f"prompt of {int(prompt_len.max())} tokens + max_new_tokens "
                         f"{config.max_new_tokens} (+{num_drafts + 1} verify slack) needs "
                         f"{needed} cache slots, but the capacity is {capacity}")
    return _Plan(drafter, widths, prompt, prompt_len, num_drafts, capacity)


def _prepare(target: TargetLM, target_params, prompts: Sequence[Sequence[int]],
             config: DecodeConfig, drafter, draft_params, seed: int,
             width: int | None = None, many_calls: bool = False) -> _Prepared:
    """:func:`_plan`, then fetch (or compile) the programs: everything :func:`generate`
    does before running anything (shared with :func:`precompile` and
    :func:`~domino_jax.decode.serving.serve`, which calls the round loop many times:
    ``many_calls``, see :func:`rounds_compiler_options`)."""
    plan = _plan(target, prompts, config, drafter, width)
    key = jax.random.PRNGKey(seed)
    prefill_fn, rounds_fn, compile_seconds = _compiled(
        target, plan.drafter, config, target_params, draft_params, plan.prompt,
        plan.prompt_len, key, plan.capacity, many_calls)
    return _Prepared(plan.prompt, plan.prompt_len, key, plan.num_drafts, prefill_fn,
                     rounds_fn, compile_seconds, plan.drafter, plan.capacity, plan.widths)


def precompile(target: TargetLM, target_params, prompts: Sequence[Sequence[int]],
               config: DecodeConfig, drafter=None, draft_params=None, seed: int = 0) -> float:
    """Compile (AOT) the programs a :func:`generate` call with the same arguments would run,
    without running them; returns the seconds spent (0.0 when already cached).

    Takes exactly :func:`generate`'s model/prompt/config arguments and performs the same
    validation (same ``ValueError`` messages). Programs are cached per (target, drafter,
    config, padded prompt shape ``[B, T]``, cache capacity, parameter shapes/dtypes), so any
    later ``generate`` whose prompts pad to the same ``[B, T]`` (same batch size, same
    :func:`prompt_bucket`) reuses them and reports ``compile_seconds == 0``. ``seed`` and the
    token values do not affect the program (only its inputs).

    Thread-safe: several threads may precompile (or generate) at once, each distinct
    program compiling concurrently (XLA releases the GIL while compiling). A thread asking
    for a program another thread is already compiling waits for it instead of compiling it
    again; its return value is then the seconds it waited.
    """
    return _prepare(target, target_params, prompts, config, drafter, draft_params,
                    seed).compile_seconds


def generate(target: TargetLM, target_params, prompts: Sequence[Sequence[int]],
             config: DecodeConfig, drafter=None, draft_params=None, seed: int = 0,
             chunk_rounds: int | None = None, on_chunk=None,
             cost_model: CostModel | None = None) -> GenerateResult:
    """Generate for a batch of token-id prompts (lists may differ in length).

    ``on_chunk(tokens_so_far: list[list[int]])`` is called after each chunk of
    ``chunk_rounds`` rounds when streaming (one host sync per chunk, not per round).
    Raises ``ValueError`` before any compute if prompt + generation exceeds the target's
    context (:func:`~domino_jax.decode.prefill.check_context_length`) or the capacity.
    Prompts padded to more than ``config.prefill.chunk`` tokens are prefilled in chunks
    (:mod:`domino_jax.decode.prefill`: memory linear in the prompt).
    The programs are compiled on first use (``compile_seconds`` of the result) or taken from
    the cache that :func:`precompile` fills. With ``config.adaptive``, ``cost_model`` says
    where the per-arm round costs come from (default: the cached table, calibrated on first
    use, :mod:`domino_jax.decode.cost_model`); the calibration's time is reported apart
    (``calibration_seconds``, not in ``decode_seconds``).
    """
    prep = _prepare(target, target_params, prompts, config, drafter, draft_params, seed)
    prompt, prompt_len, key = prep.prompt, prep.prompt_len, prep.key
    t0 = time.perf_counter()
    state = prep.prefill_fn(target_params, draft_params, prompt, prompt_len, key)
    jax.block_until_ready(state)
    prefill_seconds = time.perf_counter() - t0
    policy, calibration_seconds, cost_source = start_policy(
        prep, target, config, target_params, draft_params, state, cost_model)
    t1 = time.perf_counter()
    limit = chunk_rounds or (config.max_new_tokens + 1)
    while True:
        state, policy = prep.rounds_fn(target_params, draft_params, state, policy,
                                       np.int32(limit))
        done = bool(jnp.all(state.done))      # one host sync per chunk
        if on_chunk is not None:
            on_chunk(_trim(state, config))
        if done:
            break
    t2 = time.perf_counter()
    rounds = np.asarray(state.rounds)
    widths, arms, costs = loop.width_report(config, prep.widths, policy,
                                            int(rounds.max(initial=0)))
    return GenerateResult(_trim(state, config), rounds, np.asarray(state.accept_hist),
                          prefill_seconds, t2 - t1, prep.num_drafts + 1, prep.compile_seconds,
                          widths, calibration_seconds, cost_source, arms, costs)


def start_policy(prep: _Prepared, target, config: DecodeConfig, target_params, draft_params,
                 state: DecodeState, cost_model: CostModel | None):
    """The loop's first policy state (:func:`~domino_jax.decode.loop.init_policy`); adaptive:
    with the per-arm costs from ``cost_model`` (a calibration on copies of the post-prefill
    ``state`` when needed). Returns ``(policy, calibration seconds, cost source)`` (a fixed
    width: no costs, ``0.0`` and ``""``)."""
    batch = state.root.shape[0]

    def make(costs, force=-1):
        return loop.init_policy(config, prep.drafter, prep.widths, batch, costs, force)

    if config.adaptive is None:
        return make(None), 0.0, ""

    def run_forced(arm: int, rounds: int):
        copy = prep.rounds_fn.adopt(jax.tree_util.tree_map(jnp.copy, state))
        policy = make([1.0] * len(prep.widths), arm)
        jax.block_until_ready((copy, policy))
        t0 = time.perf_counter()
        _, policy = prep.rounds_fn(target_params, draft_params, copy, policy, jnp.int32(rounds))
        ran = int(policy.arm_rounds.sum())                 # waits for the loop
        return time.perf_counter() - t0, ran

    key = cost_key(target, prep.drafter, config, prep.widths, batch, prep.capacity)
    costs, seconds, source = (cost_model or CostModel()).resolve(key, prep.widths, run_forced)
    return make(costs), seconds, source


class RoundsProgram:
    """A compiled round loop (:func:`~domino_jax.decode.loop.rounds`): ``(target_params,
    draft_params, state, policy, max_rounds)`` -> ``(state, policy)``; the keyword
    ``done_limit`` (default: the whole batch) returns once that many rows are done
    (:func:`~domino_jax.decode.round.keep_running`: what continuous batching refills)."""

    def __init__(self, compiled, batch: int, state_layouts: bool = False):
        self.compiled, self.batch = compiled, batch
        # the state's formats (layout + device) the loop takes and returns, when compiled
        # with layouts of its own choosing (loop_state_layouts); None: the defaults
        self.state_formats = compiled.input_formats[0][2] if state_layouts else None
        self._kept = {}
        # the leaves whose chosen layout is not the row-major default (only they can need a
        # relayout; checking a leaf's format costs host time on every call)
        formats = jax.tree_util.tree_leaves(self.state_formats)
        self._relaid = [i for i, f in enumerate(formats)
                        if f.layout.major_to_minor != tuple(range(len(f.layout.major_to_minor)))
                        or f.layout.tiling]

    def adopt(self, state):
        """``state`` in the loop's :attr:`state_formats`: each leaf whose chosen layout
        is not the default and that is not in it yet is copied into it (a relayout, e.g. of a
        fresh prefill's caches); the rest as they are. The compiled loop relayouts such
        inputs itself; this does it ahead, outside a timed call."""
        if not self._relaid:
            return state
        leaves, tree = jax.tree_util.tree_flatten(state)
        formats = jax.tree_util.tree_leaves(self.state_formats)
        for i in self._relaid:
            if getattr(leaves[i], "format", None) != formats[i]:
                leaves[i] = jax.device_put(leaves[i], formats[i])
        return jax.tree_util.tree_unflatten(tree, leaves)

    def keeping_layouts(self, fn, static_argnums: tuple = ()):
        """``fn(state, *rest) -> state`` jitted (``state`` donated) so that the state stays
        in :attr:`state_formats` (a default jit would relayout the whole state to the default
        layouts and the next loop call back: the per-call cost this avoids); cached per
        ``fn``."""
        if fn not in self._kept:
            kw = {}
            if self.state_formats is not None:
                n = fn.__code__.co_argcount - len(static_argnums)
                kw = dict(in_shardings=(self.state_formats,) + (None,) * (n - 1),
                          out_shardings=self.state_formats)
            # a fresh function: jax's caches of it go with this program
            self._kept[fn] = jax.jit(fresh_function(fn), static_argnums=static_argnums,
                                     donate_argnums=(0,), **kw)
        return self._kept[fn]

    def __call__(self, *args, done_limit: int | None = None):
        limit = self.batch if done_limit is None else done_limit
        # a NumPy scalar: travels with the call's arguments; jnp.int32 would dispatch a
        # program of its own first, a host cost on every call (docs/design.md §18)
        return self.compiled(*args, np.int32(limit))

    def as_text(self) -> str:
        return self.compiled.as_text()


# compiled programs and their compile seconds per cache key, dropped least recently used
# first when the process nears its memory-mapping cap (domino_jax/program_cache.py)
_PROGRAMS = ProgramCache()


def _cached(cache_key, build):
    """``(value, seconds)``: ``build()``'s value cached in :data:`_PROGRAMS` under
    ``cache_key``; seconds = this call's build time, or the time it waited for another
    thread building the same key, or 0.0 on a cache hit (each key built once at a time)."""
    return _PROGRAMS.get(cache_key, build)


def clear_compiled() -> None:
    """Drop every program :func:`generate` and :func:`precompile` compiled and cached (their
    memory and, on a CPU, their memory mappings are freed unless still referenced)."""
    _PROGRAMS.clear()


def _program_key(target, drafter, config, target_params, draft_params, shape, capacity):
    # multi-device shardings too: tensor-parallel params (decode/tensor_parallel.py) compile
    # other programs; host arrays and one-device arrays share one
    spread = lambda x: x.sharding if len(getattr(x, "sharding", None) and
                                         x.sharding.device_set or ()) > 1 else None
    spec = lambda tree: jax.tree_util.tree_map(
        lambda x: (jax.ShapeDtypeStruct(x.shape, x.dtype), spread(x)), tree)
    return (target, drafter, config, tuple(shape), capacity, matmul_precision(target),
            jax.tree_util.tree_structure(target_params), str(spec(target_params)),
            str(spec(draft_params)))


def compiled_prefill(target, drafter, config, target_params, draft_params, prompt,
                     prompt_len, key, capacity):
    """``(prefill_fn, seconds)``: the AOT-compiled prefill alone for prompts shaped like
    ``prompt [B, T]`` (continuous batching refills a few slots with it), cached as
    :func:`_compiled`'s."""
    def build():
        with precision_scope(target):
            return _prefill_jit.lower(target, drafter, config, target_params, draft_params,
                                     prompt, prompt_len, key, capacity).compile()

    return _cached(("prefill",) + _program_key(target, drafter, config, target_params,
                                                draft_params, prompt.shape, capacity), build)


def rounds_compiler_options(drafter, many_calls: bool) -> dict:
    """XLA options of a round loop's compile. A speculative loop called many times
    (continuous batching returns to the host at every refill) on a GPU is compiled without
    command buffers (CUDA graphs): with them each call of the adaptive loop cost several
    rounds' time beyond its rounds (re-recorded per call, it seems), without them a fraction
    of a round, for slightly slower rounds; AR's loop pays little per call either way and
    keeps them (``docs/design.md`` §18). Static batches (one call per generation) keep
    XLA's defaults."""
    if many_calls and drafter.num_drafts > 0 and jax.default_backend() == "gpu":
        return {"xla_gpu_enable_command_buffer": ""}
    return {}


def loop_state_layouts(drafter, many_calls: bool, target_params, draft_params) -> bool:
    """Whether a round loop is compiled with its state's layouts chosen by XLA (in and out,
    ``jax.experimental.layout.Layout.AUTO``) instead of the defaults: for a speculative loop
    called many times (continuous batching), its parameters on one device. Inside a
    speculative loop XLA lays the KV caches out with the sequence axis minor (the verify's
    attention products read them so); with default layouts at the program's boundary, every
    call transposed the target and draft caches in and back out (``docs/design.md`` §18).
    With the loop's own layouts the state stays in them between calls
    (:meth:`RoundsProgram.adopt`, :meth:`RoundsProgram.keeping_layouts`). One device only:
    tensor-parallel parameters keep the default program (their shardings would need stating
    here). On a CPU XLA keeps the default layouts, so this changes nothing there."""
    if not many_calls or drafter.num_drafts == 0:
        return False
    devices = set()
    for leaf in jax.tree_util.tree_leaves((target_params, draft_params)):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            devices |= set(sharding.device_set)
    return len(devices) <= 1


def _compiled(target, drafter, config, target_params, draft_params, prompt, prompt_len, key,
              capacity, many_calls: bool = False):
    """AOT-compiled prefill and round loop (a :class:`RoundsProgram`), cached per (models,
    config, shapes), traced under :func:`matmul_precision`.

    Returns ``(prefill_fn, rounds_fn, seconds)``: seconds = this call's compile time, or
    the time it waited for another thread compiling the same key, or 0.0 on a cache hit
    (thread-safe, each key compiled once: :func:`_cached`).
    """
    t0 = time.perf_counter()
    prefill_fn, prefill_seconds = compiled_prefill(target, drafter, config, target_params,
                                                   draft_params, prompt, prompt_len, key,
                                                   capacity)

    def build():
        limit = jnp.int32(0)
        options = rounds_compiler_options(drafter, many_calls)
        layouts = loop_state_layouts(drafter, many_calls, target_params, draft_params)
        _, widths = loop.loop_arms(config, drafter)
        with precision_scope(target):
            state_spec = jax.eval_shape(
                lambda tp, dp, p, pl, k: loop.prefill(target, drafter, config, tp, dp, p, pl,
                                                      k, capacity),
                target_params, draft_params, prompt, prompt_len, key)
            policy_spec = jax.eval_shape(
                lambda: loop.init_policy(config, drafter, widths, prompt.shape[0]))
            compiled = (_rounds_jit_auto if layouts else _rounds_jit).lower(
                target, drafter, config, target_params, draft_params, state_spec,
                policy_spec, limit, limit).compile(compiler_options=options)
        return RoundsProgram(compiled, prompt.shape[0], layouts)

    options_key = (tuple(sorted(rounds_compiler_options(drafter, many_calls).items())),
                   loop_state_layouts(drafter, many_calls, target_params, draft_params))
    rounds_fn, seconds = _cached(("rounds", options_key) + _program_key(
        target, drafter, config, target_params, draft_params, prompt.shape, capacity), build)
    return prefill_fn, rounds_fn, ((time.perf_counter() - t0) if prefill_seconds or seconds
                                   else 0.0)


def trim_row(tokens: np.ndarray, count: int, config: DecodeConfig) -> list[int]:
    """One row's output: its first ``count`` tokens (at most ``max_new_tokens``), cut after
    the first stop token."""
    row = tokens[:min(int(count), config.max_new_tokens)].tolist()
    for i, t in enumerate(row):
        if t in config.stop_token_ids:
            return row[:i + 1]
    return row


def _trim(state: DecodeState, config: DecodeConfig) -> list[list[int]]:
    tokens, counts = np.asarray(state.out_tokens), np.asarray(state.num_out)
    return [trim_row(row, n, config) for row, n in zip(tokens, counts)]
