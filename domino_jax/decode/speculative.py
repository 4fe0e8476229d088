"""One generate function for every chain method, running entirely on the device.

    result = generate(target, drafter, prompts, DecodeConfig(method="domino", ...))

Methods: ``ar`` (no drafter: the chain with zero drafts), ``ngram`` (prompt lookup:
:class:`~domino_jax.decode.ngram.NgramDrafter` proposes K tokens from the row's own context,
no model), ``dflash`` and ``domino`` (a
:class:`~domino_jax.decode.drafters.Drafter` proposes K tokens per round). Two jitted
calls: :func:`prefill` (target over the prompt, first token, draft context) and
:func:`decode_rounds` (a ``lax.while_loop`` of rounds until every row is done or a round
limit is reached, so the CLI can stream chunks without a host sync per round). Both are
compiled ahead of time and cached per (models, config, shapes); :func:`precompile` fills
that cache without running anything (thread-safe: benchmarks compile many tasks at once).

Per round, for each row (ragged acceptance is carried as lengths, never as shapes):
  1. the drafter proposes ``drafts [B, K]`` after the root (the last committed token,
     not yet in the target cache) and the draft distribution ``q`` if needed;
  2. the target verifies ``[root, d_1..d_K]`` at positions ``start..start+K`` in one
     forward, writing their K/V after the committed prefix;
  3. ``verify_match`` / ``verify_rejection`` give ``accepted`` and the bonus token;
  4. commit: ``d_1..d_accepted, bonus`` go to the output; the target cache advances by
     ``accepted + 1`` (root + accepted drafts; rejected slots are left stale and masked);
     the hidden taps of those rows become the drafter's next context; the bonus is the
     next root.
Stops: a row is done at its first stop token (inclusive) or at ``max_new_tokens``; the
host trims whatever a block overran.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, NamedTuple, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from domino_jax.decode.prefill import PrefillConfig, check_context_length, prefill_prompt
from domino_jax.decode.sampling import SamplingConfig, choose, target_log_probs
from domino_jax.decode.verify import verify_match, verify_rejection
from domino_jax.kv_cache import KVCache, align_slots
from domino_jax.models.qwen3 import TargetLM

METHODS = ("ar", "ngram", "dflash", "domino", "ddtree", "dominotree")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static decoding settings (hashable: part of the jit cache key)."""

    method: str = "ar"
    max_new_tokens: int = 128
    sampling: SamplingConfig = SamplingConfig()
    draft_policy: str = "greedy"       # "greedy" | "sample"
    draft_temperature: float = 1.0
    verify: str = "match"              # "match" | "rejection"
    stop_token_ids: tuple[int, ...] = ()
    capacity: int | None = None        # target cache slots; None = just enough
    prefill: PrefillConfig = PrefillConfig()   # chunked above prefill.chunk prompt tokens

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {METHODS}")
        if self.draft_policy not in ("greedy", "sample"):
            raise ValueError(f"unknown draft policy {self.draft_policy!r}; 'greedy' or 'sample'")
        if self.verify not in ("match", "rejection"):
            raise ValueError(f"unknown verification rule {self.verify!r}; 'match' or 'rejection'")
        if self.method in ("ddtree", "dominotree") and self.verify != "match":
            raise ValueError(f"method {self.method!r} verifies with 'match' (sample-and-walk) "
                             "only: best-first trees define no draft distribution for "
                             "'rejection'")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.method == "ngram" and self.draft_policy != "greedy":
            raise ValueError("method 'ngram' drafts deterministically (prompt lookup): "
                             "draft_policy must be 'greedy'")
        if self.draft_policy == "sample" and self.draft_temperature <= 0:
            raise ValueError("draft_policy='sample' needs draft_temperature > 0")


@flax.struct.dataclass
class DecodeState:
    out_tokens: jax.Array        # [B, max_new + W] generated tokens (prompt excluded)
    num_out: jax.Array           # [B] committed generated tokens
    done: jax.Array              # [B] bool
    root: jax.Array              # [B] last committed token, not yet in the target cache
    target_cache: KVCache
    draft_cache: Any             # drafter's cache (None for AR)
    context: jax.Array           # [B, W, F] drafter context features of the last commit
    context_len: jax.Array       # [B] valid rows of ``context``
    key: jax.Array
    rounds: jax.Array            # [B] rounds run while the row was live
    accept_hist: jax.Array       # [B, W + 1] histogram of tokens committed per round
    history: jax.Array | None = None  # [B, C] prompt + committed tokens by position, the root
    #   at target_cache.lengths (valid through it); only for drafters that read it (ngram)


@dataclasses.dataclass
class GenerateResult:
    tokens: list[list[int]]      # generated tokens per row (stop inclusive, <= max_new)
    rounds: np.ndarray           # [B]
    accept_hist: np.ndarray      # [B, W + 1]; index n = rounds that committed n tokens
    prefill_seconds: float
    decode_seconds: float
    verify_width: int
    compile_seconds: float = 0.0    # AOT compile time of this call (0 when cached)

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tau(self) -> float:
        """Mean tokens committed per round (accepted drafts + bonus), over all rows."""
        hist = self.accept_hist.sum(0)
        return float((hist * np.arange(len(hist))).sum() / max(hist.sum(), 1))

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: tokens after the first one, over the round loop's time."""
        return max(self.new_tokens - len(self.tokens), 0) / max(self.decode_seconds, 1e-9)


def _first_stop(tokens: jax.Array, count: jax.Array, stop_ids: tuple[int, ...]) -> jax.Array:
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


def prefill(target: TargetLM, drafter, config: DecodeConfig, target_params, draft_params,
            prompt: jax.Array, prompt_len: jax.Array, key: jax.Array, capacity: int) -> DecodeState:
    """Target forward over the right-padded ``prompt [B, T]``; first token; draft context."""
    batch, prompt_width = prompt.shape
    width = drafter.max_commit if drafter is not None else 1      # tokens per round, max
    filled = prefill_prompt(target, drafter, target_params, draft_params, prompt, prompt_len,
                            capacity, config.prefill)             # chunked for long prompts
    cache, draft_cache = filled.cache, filled.draft_cache
    key, first_key = jax.random.split(key)
    first = choose(first_key, filled.logits, config.sampling)            # §9.13: sampled at T
    out_tokens = jnp.zeros((batch, config.max_new_tokens + width), jnp.int32).at[:, 0].set(first)
    num_out = jnp.ones((batch,), jnp.int32)
    done = (_first_stop(first[:, None], num_out, config.stop_token_ids) == 0)
    done |= config.max_new_tokens <= 1
    context = jnp.zeros((batch, width, filled.feature_dim), target.dtype)
    history = None
    if getattr(drafter, "reads_history", False):
        history = jnp.zeros((batch, capacity), jnp.int32).at[:, :prompt_width].set(prompt)
        history = _write_rows(history, cache.lengths, first[:, None])
    return DecodeState(out_tokens, num_out, done, first, cache, draft_cache, context,
                       jnp.zeros((batch,), jnp.int32), key, jnp.zeros((batch,), jnp.int32),
                       jnp.zeros((batch, width + 1), jnp.int32), history)


class RoundOutcome(NamedTuple):
    """What one round's verification decided, before the commit (shapes ``P`` = max tokens
    a round can commit: accepted drafts + the bonus)."""

    committed: jax.Array          # [B, P] accepted drafts, then the bonus at index ``accepted``
    accepted: jax.Array           # [B] accepted drafts (0..P-1)
    bonus: jax.Array              # [B] the target's token after the accepted path
    target_cache: KVCache         # verify K/V written after the committed prefix
    path: jax.Array | None        # [B, P] verify-row offsets to keep (trees); None = prefix
    context: jax.Array | None     # [B, P, F] drafter features of [root, accepted...]
    draft_cache: Any


def _chain_outcome(target: TargetLM, drafter, config: DecodeConfig, target_params,
                   draft_params, state: DecodeState, draft_key, verify_key) -> RoundOutcome:
    """Draft a chain of K tokens, verify ``[root, d_1..d_K]`` causally in one forward."""
    batch = state.root.shape[0]
    start = state.target_cache.lengths                                   # position of the root
    if drafter is not None:
        history = dict(history=state.history) if state.history is not None else {}
        drafts, draft_log_probs, draft_cache = drafter.propose(
            target_params, draft_params, state.root, start, state.context, state.context_len,
            state.draft_cache, draft_key, config, **history)
        tap_ids = drafter.tap_ids
    else:
        drafts = jnp.zeros((batch, 0), jnp.int32)
        draft_log_probs, draft_cache, tap_ids = None, None, ()
    num_drafts = drafts.shape[1]
    verify_tokens = jnp.concatenate([state.root[:, None], drafts], axis=1)   # [B, K+1]
    positions = start[:, None] + jnp.arange(num_drafts + 1, dtype=jnp.int32)[None, :]
    out = target.apply({"params": target_params}, verify_tokens, positions,
                       cache=state.target_cache, tap_ids=tap_ids)
    log_p = target_log_probs(out.logits, config.sampling)
    if config.verify == "rejection" and draft_log_probs is not None:
        accepted, bonus = verify_rejection(verify_key, drafts, log_p, draft_log_probs)
    else:
        accepted, bonus = verify_match(verify_key, drafts, log_p)
    committed = jnp.concatenate([drafts, jnp.zeros((batch, 1), jnp.int32)], axis=1)
    slot = jnp.arange(num_drafts + 1)[None, :]
    committed = jnp.where(slot == accepted[:, None], bonus[:, None], committed)
    context = drafter.context_features(out) if drafter is not None else None
    return RoundOutcome(committed, accepted, bonus, out.cache, None, context, draft_cache)


def _round(target: TargetLM, drafter, config: DecodeConfig, target_params, draft_params,
           state: DecodeState) -> DecodeState:
    key, draft_key, verify_key = jax.random.split(state.key, 3)
    if getattr(drafter, "is_tree", False):
        outcome = drafter.tree_outcome(target, config, target_params, draft_params, state,
                                       draft_key, verify_key)
    else:
        outcome = _chain_outcome(target, drafter, config, target_params, draft_params, state,
                                 draft_key, verify_key)
    return _commit(config, state, outcome, key)


def _commit(config: DecodeConfig, state: DecodeState, outcome: RoundOutcome,
            key: jax.Array) -> DecodeState:
    """Write the committed tokens, apply stops/limits, commit the target cache (advance, or
    gather a tree path into place) and hand the accepted rows' features to the drafter."""
    committed, accepted = outcome.committed, outcome.accepted
    count = accepted + 1
    stop_at = _first_stop(committed, count, config.stop_token_ids)
    hit_stop = stop_at < count
    count = jnp.where(hit_stop, stop_at + 1, count)
    live = ~state.done
    out_tokens = jnp.where(live[:, None], _write_rows(state.out_tokens, state.num_out, committed),
                           state.out_tokens)
    num_out = state.num_out + jnp.where(live, count, 0)
    done = state.done | (live & (hit_stop | (num_out >= config.max_new_tokens)))
    cache_rows = jnp.where(live, accepted + 1, 0)
    if outcome.path is None:
        target_cache = outcome.target_cache.advance(cache_rows)
    else:
        target_cache = outcome.target_cache.gather_path(outcome.path, cache_rows)
    if outcome.context is not None:
        context, context_len = outcome.context.astype(state.context.dtype), cache_rows
    else:
        context, context_len = state.context, state.context_len
    hist = state.accept_hist + jax.nn.one_hot(count, state.accept_hist.shape[1],
                                              dtype=jnp.int32) * live[:, None]
    history = state.history
    if history is not None:                  # committed tokens follow the root's position
        history = jnp.where(live[:, None], _write_rows(
            history, state.target_cache.lengths + 1, committed), history)
    return DecodeState(out_tokens, num_out, done, jnp.where(live, outcome.bonus, state.root),
                       target_cache, outcome.draft_cache, context, context_len, key,
                       state.rounds + live.astype(jnp.int32), hist, history)


def decode_rounds(target: TargetLM, drafter, config: DecodeConfig, target_params, draft_params,
                  state: DecodeState, max_rounds: jax.Array) -> DecodeState:
    """Run rounds until every row is done or ``max_rounds`` rounds have run."""

    def cond(carry):
        state, n = carry
        return (~jnp.all(state.done)) & (n < max_rounds)

    def body(carry):
        state, n = carry
        return _round(target, drafter, config, target_params, draft_params, state), n + 1

    state, _ = jax.lax.while_loop(cond, body, (state, jnp.int32(0)))
    return state


_prefill_jit = jax.jit(prefill, static_argnums=(0, 1, 2, 8))
_rounds_jit = jax.jit(decode_rounds, static_argnums=(0, 1, 2), donate_argnums=(5,))


def prompt_bucket(length: int) -> int:
    """Padded prompt width for ``length`` tokens, so prompts of similar length share one
    compiled program: the next power of two up to 256 (at least 16), then multiples of 256."""
    if length <= 256:
        return max(16, 1 << (max(length, 1) - 1).bit_length())
    return -(-length // 256) * 256


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0, bucket: bool = True):
    """Right-pad token lists to ``[B, T]`` (``T`` bucketed, see :func:`prompt_bucket`);
    returns (array, lengths). Padding is never attended to: each row's cache length is its
    own prompt length."""
    lengths = [len(p) for p in prompts]
    for i, n in enumerate(lengths):
        if n == 0:
            raise ValueError(f"prompt {i} is empty: give at least one token (e.g. BOS or a "
                             "chat template)")
    width = prompt_bucket(max(lengths)) if bucket else max(lengths)
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
    num_drafts: int               # verify rows per round - 1 (0 for AR)
    prefill_fn: Any               # (target_params, draft_params, prompt, prompt_len, key) -> state
    rounds_fn: Any                # (target_params, draft_params, state, max_rounds) -> state
    compile_seconds: float        # see :func:`precompile`


def _prepare(target: TargetLM, target_params, prompts: Sequence[Sequence[int]],
             config: DecodeConfig, drafter, draft_params, seed: int) -> _Prepared:
    """Validate, pad, size the cache and fetch (or compile) the programs: everything
    :func:`generate` does before running anything (shared with :func:`precompile`)."""
    if (config.method == "ar") != (drafter is None):
        raise ValueError(f"method {config.method!r} " + ("takes no drafter" if drafter is not None
                                                          else "needs a drafter (--draft DIR)"))
    if drafter is not None and getattr(drafter, "method", config.method) != config.method:
        raise ValueError(f"method {config.method!r} does not match the drafter's method "
                         f"{drafter.method!r}")
    check_context_length(target.config, [len(p) for p in prompts], config.max_new_tokens)
    prompt, prompt_len = pad_prompts(prompts)
    num_drafts = drafter.verify_width - 1 if drafter is not None else 0   # verify rows - root
    needed = required_capacity(int(prompt_len.max()), config, num_drafts)
    # Default capacity from the bucketed width (one compiled program per bucket), aligned to
    # whole chunks of the attention kernel.
    capacity = config.capacity or align_slots(max(
        needed, required_capacity(prompt.shape[1], config, num_drafts)))
    if needed > capacity:
        raise ValueError(f"prompt of {int(prompt_len.max())} tokens + max_new_tokens "
                         f"{config.max_new_tokens} (+{num_drafts + 1} verify slack) needs "
                         f"{needed} cache slots, but the capacity is {capacity}")
    if drafter is not None and needed > drafter.max_capacity(capacity):
        raise ValueError(f"the drafter's cache cannot hold {needed} positions")
    key = jax.random.PRNGKey(seed)
    prefill_fn, rounds_fn, compile_seconds = _compiled(
        target, drafter, config, target_params, draft_params, prompt, prompt_len, key, capacity)
    return _Prepared(prompt, prompt_len, key, num_drafts, prefill_fn, rounds_fn,
                     compile_seconds)


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
             chunk_rounds: int | None = None, on_chunk=None) -> GenerateResult:
    """Generate for a batch of token-id prompts (lists may differ in length).

    ``on_chunk(tokens_so_far: list[list[int]])`` is called after each chunk of
    ``chunk_rounds`` rounds when streaming (one host sync per chunk, not per round).
    Raises ``ValueError`` before any compute if prompt + generation exceeds the target's
    context (:func:`~domino_jax.decode.prefill.check_context_length`) or the capacity.
    Prompts padded to more than ``config.prefill.chunk`` tokens are prefilled in chunks
    (:mod:`domino_jax.decode.prefill`: memory linear in the prompt).
    The programs are compiled on first use (``compile_seconds`` of the result) or taken from
    the cache that :func:`precompile` fills.
    """
    prep = _prepare(target, target_params, prompts, config, drafter, draft_params, seed)
    prompt, prompt_len, key = prep.prompt, prep.prompt_len, prep.key
    t0 = time.perf_counter()
    state = prep.prefill_fn(target_params, draft_params, prompt, prompt_len, key)
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    limit = chunk_rounds or (config.max_new_tokens + 1)
    while True:
        state = prep.rounds_fn(target_params, draft_params, state, jnp.int32(limit))
        done = bool(jnp.all(state.done))      # one host sync per chunk
        if on_chunk is not None:
            on_chunk(_trim(state, config))
        if done:
            break
    t2 = time.perf_counter()
    return GenerateResult(_trim(state, config), np.asarray(state.rounds),
                          np.asarray(state.accept_hist), t1 - t0, t2 - t1, prep.num_drafts + 1,
                          prep.compile_seconds)


# (prefill_fn, rounds_fn, compile seconds) per cache key; _PENDING holds an Event per key
# some thread is compiling right now. _LOCK guards both dicts, never a compile.
_COMPILED: dict = {}
_PENDING: dict = {}
_LOCK = threading.Lock()


def _compiled(target, drafter, config, target_params, draft_params, prompt, prompt_len, key,
              capacity):
    """AOT-compiled prefill and round loop, cached per (models, config, shapes).

    Returns ``(prefill_fn, rounds_fn, seconds)``: seconds = this call's compile time, or
    the time it waited for another thread compiling the same key, or 0.0 on a cache hit.
    Thread-safe; each key is compiled once (if that compile raises, the error propagates in
    the compiling thread and a waiting thread retries the compile itself).
    """
    # multi-device shardings too: tensor-parallel params (decode/tensor_parallel.py) compile
    # other programs; host arrays and one-device arrays share one
    spread = lambda x: x.sharding if len(getattr(x, "sharding", None) and
                                         x.sharding.device_set or ()) > 1 else None
    spec = lambda tree: jax.tree_util.tree_map(
        lambda x: (jax.ShapeDtypeStruct(x.shape, x.dtype), spread(x)), tree)
    cache_key = (target, drafter, config, prompt.shape, capacity,
                 jax.tree_util.tree_structure(target_params), str(spec(target_params)),
                 str(spec(draft_params)))
    t0 = time.perf_counter()
    waited = False
    while True:
        with _LOCK:
            if cache_key in _COMPILED:
                prefill_fn, rounds_fn, _ = _COMPILED[cache_key]
                return prefill_fn, rounds_fn, (time.perf_counter() - t0) if waited else 0.0
            event = _PENDING.get(cache_key)
            if event is None:                       # ours to compile
                event = _PENDING[cache_key] = threading.Event()
                break
        event.wait()                                # another thread is compiling it
        waited = True
    try:
        prefill_fn = _prefill_jit.lower(target, drafter, config, target_params, draft_params,
                                        prompt, prompt_len, key, capacity).compile()
        state_spec = jax.eval_shape(
            lambda tp, dp, p, pl, k: prefill(target, drafter, config, tp, dp, p, pl, k, capacity),
            target_params, draft_params, prompt, prompt_len, key)
        rounds_fn = _rounds_jit.lower(target, drafter, config, target_params, draft_params,
                                      state_spec, jnp.int32(0)).compile()
        seconds = time.perf_counter() - t0
        with _LOCK:
            _COMPILED[cache_key] = (prefill_fn, rounds_fn, seconds)
    finally:
        with _LOCK:
            del _PENDING[cache_key]
        event.set()
    return prefill_fn, rounds_fn, seconds


def _trim(state: DecodeState, config: DecodeConfig) -> list[list[int]]:
    tokens = np.asarray(state.out_tokens)
    counts = np.minimum(np.asarray(state.num_out), config.max_new_tokens)
    result = []
    for row, n in zip(tokens, counts):
        row = row[:n].tolist()
        for i, t in enumerate(row):
            if t in config.stop_token_ids:
                row = row[:i + 1]
                break
        result.append(row)
    return result
