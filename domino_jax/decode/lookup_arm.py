"""The prompt-lookup arms of adaptive speculation (``docs/design.md`` §12).

With ``AdaptiveConfig.lookup = (k, ...)`` the adaptive loop of a chain method
(:mod:`domino_jax.decode.adaptive`) has, besides the AR step and the drafter's chain arms,
one arm per ``k``: **lookup k** proposes the ``k`` tokens that the prompt lookup
(:func:`domino_jax.decode.ngram.lookup_drafts`, on the loop's token history) continues the
context with, and the target verifies ``k + 1`` rows. No drafter forward: the round costs a
verify of ``k + 1`` rows plus the feature bookkeeping an AR round does (the committed rows'
context features are appended to the loop's context buffer, for the drafter's next round).
Verifying and committing is the same lossless round as every chain (the drafts are
deterministic: ``rejection`` falls back to ``match``, as for ``--method ngram``).

Arm codes: in the adaptive loop's arm tuple (``resolve_widths``) a lookup arm of ``k``
tokens is the code ``-k`` (drafter arms are widths ``>= 0``), after the drafter's arms.

Statistics: a row's expected tokens under a lookup arm are ``1`` when its lookup finds no
match (it proposes fillers), else ``1 + sum_j prod_{i <= j} rate_i`` from acceptance
statistics of its own, one group per matched suffix length ``n`` (``1..max_ngram``: a
4-token match is a much better predictor than a 1-token one), observed only on rows that
matched.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from domino_jax.decode import round as round_lib
from domino_jax.decode.contract import Drafter, Proposal
from domino_jax.decode.ngram import NgramOptions, lookup_drafts


DEFAULT_LOOKUP_ARMS = (4,)   # --adaptive-lookup on: the lookup's default K (ngram.NGRAM_DEFAULTS)


def parse_lookup_arms(text: str) -> tuple[int, ...]:
    """``--adaptive-lookup``: ``off`` -> ``()``, ``on`` -> :data:`DEFAULT_LOOKUP_ARMS`, or
    a comma list of token counts ``K[,K...]`` (sorted); ``ValueError`` naming the text."""
    if text == "off":
        return ()
    if text == "on":
        return DEFAULT_LOOKUP_ARMS
    try:
        arms = tuple(sorted({int(k) for k in text.split(",")}))
    except ValueError:
        raise ValueError(f"--adaptive-lookup takes on, off or token counts K[,K...], got "
                         f"{text!r}") from None
    if not arms or arms[0] < 1:
        raise ValueError(f"--adaptive-lookup token counts must be >= 1, got {text!r}")
    return arms


def is_lookup(code: int) -> bool:
    """Whether an arm code is a lookup arm (``-k``)."""
    return code < 0


def lookup_name(code: int) -> str:
    """A lookup arm's name in stats, tables and logs: ``lookupK`` (code ``-K``)."""
    return f"lookup{-code}"


def lookup_codes(lookup, top: int) -> tuple[int, ...]:
    """The arm codes ``(-k, ...)`` of ``AdaptiveConfig.lookup`` for a drafter whose widest
    chain has ``top`` drafts (a lookup round commits at most ``k + 1 <= top + 1`` rows: the
    loop's buffers are sized by the widest arm)."""
    for k in lookup:
        if not 1 <= k <= top:
            raise ValueError(f"adaptive lookup arm of {k} tokens: must be in 1..{top} (the "
                             f"drafter's draft positions)")
    return tuple(-k for k in lookup)


def round_lookup(options: NgramOptions, state, num_tokens: int):
    """This round's prompt lookup for every row, once for all lookup arms:
    :class:`~domino_jax.decode.ngram.Lookup` with ``drafts [B, num_tokens]`` (the widest
    arm's; a ``k``-token arm proposes the first ``k``: the match does not depend on how many
    tokens are read after it) and ``match_len [B]`` (0 = no match)."""
    return lookup_drafts(state.history, state.target_cache.lengths + 1,
                         max_ngram=options.max_ngram, min_ngram=options.min_ngram,
                         num_tokens=num_tokens, occurrence=options.occurrence,
                         wrap=options.wrap)


@dataclasses.dataclass(frozen=True)
class LookupArm(Drafter):
    """The drafter of a lookup arm: ``num_tokens`` lookup drafts from ``state.history``,
    the draft cache passed through; the target's taps and context features are the
    ``base`` drafter's (the buffer of context rows is the base drafter's)."""

    method: ClassVar[str] = "lookup-arm"
    needs_checkpoint: ClassVar[bool] = False
    reads_history: ClassVar[bool] = True
    base: Any = None
    num_tokens: int = 4
    options: NgramOptions = NgramOptions()

    @property
    def num_drafts(self) -> int:
        return self.num_tokens

    @property
    def tap_ids(self) -> tuple[int, ...]:
        return self.base.tap_ids

    @property
    def feature_dim(self) -> int:
        return self.base.feature_dim

    def context_features(self, out):
        return self.base.context_features(out)

    def propose(self, target_params, draft_params, state, key, config) -> Proposal:
        o = self.options
        lookup = lookup_drafts(state.history, state.target_cache.lengths + 1,
                               max_ngram=o.max_ngram, min_ngram=o.min_ngram,
                               num_tokens=self.num_tokens, occurrence=o.occurrence,
                               wrap=o.wrap)
        return Proposal(lookup.drafts, state.draft_cache)


def append_rows(buffer: jax.Array, buffer_len: jax.Array, rows: jax.Array,
                rows_len: jax.Array) -> jax.Array:
    """``buffer [B, W, F]`` with ``rows[b, :rows_len[b]]`` (``rows [B, n, F]``) written at
    ``buffer_len[b]`` (the caller makes sure they fit)."""
    slot = jnp.arange(buffer.shape[1], dtype=jnp.int32)[None, :]
    src = slot - buffer_len[:, None]                                        # [B, W]
    take = (src >= 0) & (src < rows_len[:, None])
    gathered = jnp.take_along_axis(rows, jnp.clip(src, 0, rows.shape[1] - 1)[:, :, None],
                                   axis=1)
    return jnp.where(take[:, :, None], gathered.astype(buffer.dtype), buffer)


def lookup_round(target, base, num_tokens: int, config, target_params, draft_params, state,
                 flush_fn, drafts=None):
    """One round of the lookup arm of ``num_tokens`` on the adaptive loop's state
    (``base``: the loop's base drafter). When a live row's buffer cannot take ``k + 1``
    more rows, ``flush_fn(state)`` first commits the buffer to the draft cache (the
    adaptive loop's flush); then draft (lookup) -> verify -> commit, and the committed
    rows' features are appended to the buffer. ``drafts [B, >= num_tokens]``: this round's
    lookup already made (:func:`round_lookup`; the flush leaves the token history as it
    is), else :meth:`LookupArm.propose` runs it."""
    buffer = state.context.shape[1]
    live = ~state.done
    full = jnp.any(live & (state.context_len + num_tokens + 1 > buffer))
    state = jax.lax.cond(full, flush_fn, lambda s: s, state)
    arm = LookupArm(base=base, num_tokens=num_tokens, options=config.adaptive.lookup_ngram)
    given = None if drafts is None else (
        lambda s, k: Proposal(drafts[:, :num_tokens], s.draft_cache))
    new = round_lib.run_round(target, arm, config, target_params, draft_params, state, given)
    context = append_rows(state.context, state.context_len, new.context, new.context_len)
    return new.replace(context=context, context_len=state.context_len + new.context_len)
