"""The prompt's prefill, with memory linear in the prompt; the context-length check.

:func:`prefill_prompt` runs the target over the right-padded prompts ``[B, W]`` (writing
their K/V into a new cache), returns the logits at each row's last prompt token and hands
the prompt to the drafter (:meth:`~domino_jax.decode.contract.Drafter.new_context_cache`,
then :meth:`~domino_jax.decode.contract.Drafter.ingest_context` per chunk). Two ways, chosen
by :class:`PrefillConfig`:

* **one forward** when ``W <= chunk`` (or ``chunk == 0``): the whole prompt at once,
  attention through the target's own ``attention_impl`` (``"xla"``: one ``[T, S]`` score
  matrix per layer). This is the decode loop's original prefill, unchanged;
* **chunked** when ``W > chunk``: a ``lax.scan`` over ``n = ceil(W / chunk)`` equal chunks
  of at most ``chunk`` tokens. Chunk ``i`` starts at ``s_i``; its queries attend to the
  cache written so far plus themselves (causal: key slot ``<= s_i + t``) with
  ``PrefillConfig.attention`` (default ``"blockwise"``: flash-style, one key block of
  scores at a time, :mod:`domino_jax.models.blockwise_attention`). Only the chunk's hidden
  states and taps exist at a time: the drafter ingests the chunk at once
  (``ingest_context``: a block drafter writes its context features into its cache), the
  hidden state at each row's last
  prompt token is kept, and the LM head runs once on those rows at the end. Peak memory:
  the caches plus ``O(chunk * (hidden + intermediate + taps) + heads * chunk * key_block)``,
  independent of ``W`` (``tests/test_long_prompts.py`` pins it with
  ``compiled.memory_analysis()``).

Both ways compute the same function (float32: equal to rounding; greedy decodes identical).
Ragged rows need no special care: every row runs every chunk at the same positions; a row's
padding tokens (positions ``>= prompt_len``) are invisible to its real tokens (causal) and
its cache length is set to ``prompt_len`` at the end, as in the one-forward prefill.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from domino_jax.config import TargetConfig
from domino_jax.decode.contract import NO_DRAFTER, Drafter, PromptChunk
from domino_jax.kv_cache import KVCache
from domino_jax.models.qwen3 import TargetLM, new_cache
from domino_jax.pallas import DEFAULT_PREFILL_CHUNK, PREFILL_ATTENTION_IMPLEMENTATIONS
from domino_jax.program_cache import FreshJit


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """How prompts are prefilled (hashable: part of the compiled program's key).

    ``chunk``: the most prompt tokens per target forward; prompts padded to more than this
    are prefilled in chunks (``0``: always one forward, memory quadratic in the prompt).
    ``attention``: the chunks' attention, one of
    :data:`~domino_jax.pallas.PREFILL_ATTENTION_IMPLEMENTATIONS` (``"blockwise"``: flash-
    style in XLA, memory independent of the cache length; ``"xla"``: one ``[chunk, S]``
    score matrix per layer; ``"cudnn"``: cuDNN flash attention, GPU and bf16/fp16 only).
    """

    chunk: int = DEFAULT_PREFILL_CHUNK
    attention: str = "blockwise"

    def __post_init__(self):
        if self.chunk < 0:
            raise ValueError(f"prefill chunk must be >= 0 (0 = never chunk), got {self.chunk}")
        if self.attention not in PREFILL_ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"unknown prefill attention {self.attention!r}; choose one of "
                             f"{PREFILL_ATTENTION_IMPLEMENTATIONS}")


def context_limit(config: TargetConfig) -> int:
    """Positions the target supports: its ``max_position_embeddings`` (only the default
    RoPE is implemented, so no rope scaling extends it: configs declaring one are refused
    when loaded)."""
    return int(config.max_position_embeddings)


def check_context_length(config: TargetConfig, prompt_lengths: Sequence[int],
                         max_new_tokens: int) -> None:
    """Raise ``ValueError`` unless every prompt plus ``max_new_tokens`` fits the target's
    :func:`context_limit`; the message names the prompt, its length, the limit and the
    options to change (``max_new_tokens`` / ``--max-new-tokens``, or a shorter prompt).
    Cheap: call it before anything is allocated."""
    limit = context_limit(config)
    lengths = [int(n) for n in prompt_lengths]
    if not lengths:
        return
    index = max(range(len(lengths)), key=lengths.__getitem__)
    longest = lengths[index]
    if longest + max_new_tokens <= limit:
        return
    which = f"prompt {index} has" if len(lengths) > 1 else "the prompt has"
    if longest >= limit:
        advice = f"shorten the prompt to at most {limit - max_new_tokens} tokens"
    else:
        advice = (f"shorten the prompt to at most {limit - max_new_tokens} tokens or lower "
                  f"max_new_tokens (--max-new-tokens) to at most {limit - longest}")
    raise ValueError(
        f"{which} {longest} tokens; with max_new_tokens {max_new_tokens} that is "
        f"{longest + max_new_tokens} positions, more than the target supports: {limit} "
        f"(max_position_embeddings in its config.json); {advice}")


def chunk_plan(width: int, chunk: int) -> tuple[int, int]:
    """``(num_chunks, chunk_len)`` for a padded prompt of ``width`` tokens: one forward when
    ``chunk == 0`` or ``width <= chunk``, else ``n = ceil(width / chunk)`` chunks of
    ``ceil(width / n)`` tokens rounded up to a multiple of 8 (at most ``chunk``), so little
    padding is added (``n * chunk_len >= width``)."""
    if chunk == 0 or width <= chunk:
        return 1, width
    num_chunks = -(-width // chunk)
    per_chunk = -(-width // num_chunks)
    return num_chunks, min(chunk, -(-per_chunk // 8) * 8)


class PrefillOutput(NamedTuple):
    cache: KVCache                 # the prompt's K/V, lengths = prompt_len
    logits: jax.Array              # [B, V] float32 at each row's last prompt token
    draft_cache: object            # the drafter's state after the prompt (None for AR)


def prefill_prompt(target: TargetLM, drafter: Drafter | None, target_params, draft_params,
                   prompt: jax.Array, prompt_len: jax.Array, capacity: int,
                   config: PrefillConfig = PrefillConfig()) -> PrefillOutput:
    """Prefill the right-padded ``prompt [B, W]`` (``prompt_len [B]`` real tokens) into a
    new target cache of ``capacity`` slots and the drafter's state (``None``: AR).

    Runs inside jit (``target``, ``drafter``, ``capacity`` and ``config`` static)."""
    drafter = NO_DRAFTER if drafter is None else drafter
    batch, width = prompt.shape
    num_chunks, _ = chunk_plan(width, config.chunk)
    prompt_len = prompt_len.astype(jnp.int32)
    if num_chunks == 1:
        return _prefill_whole(target, drafter, target_params, draft_params, prompt,
                              prompt_len, capacity)
    return _prefill_chunked(target, drafter, target_params, draft_params, prompt, prompt_len,
                            capacity, config)


def _prefill_whole(target, drafter, target_params, draft_params, prompt, prompt_len,
                   capacity) -> PrefillOutput:
    """One forward over the whole prompt."""
    batch, width = prompt.shape
    cache = new_cache(target.config, batch, capacity, target.dtype)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    out = target.apply({"params": target_params}, prompt, positions, cache=cache,
                       tap_ids=drafter.tap_ids, logits_indices=(prompt_len - 1)[:, None])
    cache = out.cache.replace(lengths=prompt_len)
    draft_cache = drafter.ingest_context(target_params, draft_params,
                                         PromptChunk(out, prompt, positions, prompt_len),
                                         drafter.new_context_cache(batch, capacity))
    return PrefillOutput(cache, out.logits[:, 0], draft_cache)


def _prefill_chunked(target, drafter, target_params, draft_params, prompt, prompt_len,
                     capacity, config: PrefillConfig) -> PrefillOutput:
    """A ``lax.scan`` over equal chunks, each attending to the cache written so far."""
    batch, width = prompt.shape
    num_chunks, chunk_len = chunk_plan(width, config.chunk)
    padded = jnp.pad(prompt, ((0, 0), (0, num_chunks * chunk_len - width)))
    chunks = padded.reshape(batch, num_chunks, chunk_len).transpose(1, 0, 2)   # [n, B, C]
    chunk_target = target.clone(attention_impl=config.attention)
    draft_cache = drafter.new_context_cache(batch, capacity)

    def one_chunk(carry, xs):
        cache, draft_cache, last_hidden = carry
        tokens, index = xs
        start = index * chunk_len
        positions = start + jnp.broadcast_to(jnp.arange(chunk_len, dtype=jnp.int32),
                                             (batch, chunk_len))
        out = chunk_target.apply({"params": target_params}, tokens, positions,
                                 cache=cache.replace(lengths=jnp.full((batch,), start,
                                                                      jnp.int32)),
                                 tap_ids=drafter.tap_ids, compute_logits=False)
        offset = prompt_len - 1 - start                       # the last prompt token's row
        here = (offset >= 0) & (offset < chunk_len)
        row = jnp.clip(offset, 0, chunk_len - 1)[:, None, None]
        picked = jnp.take_along_axis(out.hidden, row, axis=1)[:, 0]
        last_hidden = jnp.where(here[:, None], picked, last_hidden)
        rows = jnp.clip(prompt_len - start, 0, chunk_len)        # real rows of this chunk
        draft_cache = drafter.ingest_context(target_params, draft_params,
                                             PromptChunk(out, tokens, positions, rows),
                                             draft_cache)
        return (out.cache, draft_cache, last_hidden), None

    cache = new_cache(target.config, batch, capacity, target.dtype)
    last_hidden = jnp.zeros((batch, target.config.hidden_size), target.dtype)
    (cache, draft_cache, last_hidden), _ = jax.lax.scan(
        one_chunk, (cache, draft_cache, last_hidden),
        (chunks, jnp.arange(num_chunks, dtype=jnp.int32)))
    logits = target.apply({"params": target_params}, last_hidden[:, None],
                          method=TargetLM.logits)[:, 0]
    return PrefillOutput(cache.replace(lengths=prompt_len), logits, draft_cache)


# a fresh jax.jit per compile: jax's caches let each program go with its caller's reference
# (domino_jax/program_cache.py)
_prefill_prompt_jit = FreshJit(prefill_prompt, static_argnums=(0, 1, 6, 7))


def compiled_prefill(target: TargetLM, drafter, target_params, draft_params, batch: int,
                     width: int, capacity: int, config: PrefillConfig = PrefillConfig()):
    """The compiled (not run) :func:`prefill_prompt` for prompts ``[batch, width]``.

    Parameters may be ``jax.ShapeDtypeStruct`` trees (``qwen3.param_shapes``): nothing is
    allocated. ``.memory_analysis()`` of the result gives XLA's byte counts (arguments,
    outputs, ``temp_size_in_bytes`` = the largest live set of intermediates), which is how
    the tests and ``benchmarks/bench_long_context.py`` check that memory grows linearly."""
    spec = lambda tree: jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    prompt = jax.ShapeDtypeStruct((batch, width), jnp.int32)
    prompt_len = jax.ShapeDtypeStruct((batch,), jnp.int32)
    return _prefill_prompt_jit.lower(target, drafter, spec(target_params), spec(draft_params),
                                     prompt, prompt_len, capacity, config).compile()
