"""Prompt-lookup (n-gram) drafting: propose the tokens that followed the last n-gram the
last time it (or the first time it) occurred in the row's own context. No drafter model.

The rule is the one Hugging Face transformers ships as ``prompt_lookup_num_tokens``, vLLM
as ``ngram`` and SGLang as NGRAM: take the last ``n`` tokens of the context (prompt and
committed tokens, the round's root included), for ``n`` from ``max_ngram`` down to
``min_ngram``; the first ``n`` with an earlier occurrence that has at least one token after
it wins; the drafts are the ``K`` tokens that follow that occurrence. Which occurrence:

* ``"first"``: the earliest one (transformers' ``PromptLookupCandidateGenerator``);
* ``"latest"``: the most recent one (vLLM's rule: the nearest repetition).

Static shapes need exactly ``K`` drafts per row. When the continuation reaches the end of
the context after ``p < K`` tokens (the occurrence overlaps the suffix, as in a repeating
pattern), ``wrap=True`` continues it with period ``p``: draft ``j`` is
``context[start + j mod p]``, which is what the lookup itself would predict if its first
``p`` drafts were accepted. ``wrap=False`` (and a row without any match) fills with the
last context token; verification rejects fillers like any wrong draft, so every choice is
lossless.

:func:`lookup_drafts` is the on-device matcher (vectorised over rows and positions, no
loop over ``n``: one ``[B, L, max_ngram]`` comparison), :func:`reference_lookup` a plain
Python/numpy version of the same rule for the tests and the offline measurement
(``benchmarks/ngram_smollm2.py``), and :class:`NgramDrafter` the chain drafter the decode
loop runs (``--method ngram``; the whole drafter is the class: the round contract of
:mod:`domino_jax.decode.contract`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from domino_jax.decode.contract import Drafter, Proposal
from domino_jax.decode.tree import DraftTree

OCCURRENCES = ("first", "latest")


class Lookup(NamedTuple):
    """The matcher's answer per row (``B`` rows, ``K`` drafts)."""

    drafts: jax.Array      # [B, K] int32 proposed tokens after the context
    match_len: jax.Array   # [B] int32 length n of the matched suffix; 0 = no match (fillers)
    start: jax.Array       # [B] int32 context index of the first continuation token; -1 = none


def check_lookup_options(max_ngram: int, min_ngram: int, num_tokens: int,
                         occurrence: str) -> None:
    """``ValueError`` naming the option when the lookup settings make no sense."""
    if min_ngram < 1:
        raise ValueError(f"ngram min must be >= 1, got {min_ngram}")
    if max_ngram < min_ngram:
        raise ValueError(f"ngram max ({max_ngram}) must be >= ngram min ({min_ngram})")
    if num_tokens < 1:
        raise ValueError(f"ngram tokens (drafts per round) must be >= 1, got {num_tokens}")
    if occurrence not in OCCURRENCES:
        raise ValueError(f"unknown ngram occurrence {occurrence!r}; choose one of "
                         f"{', '.join(OCCURRENCES)}")


def lookup_drafts(tokens: jax.Array, length: jax.Array, *, max_ngram: int, min_ngram: int,
                  num_tokens: int, occurrence: str = "latest", wrap: bool = True) -> Lookup:
    """Prompt-lookup drafts for every row of a context buffer, on the device.

    Args:
      tokens: ``[B, L]`` int32 context buffer; row ``b``'s context is ``tokens[b, :length[b]]``
        (entries past it are ignored: they may be stale).
      length: ``[B]`` int32 valid tokens per row (``>= 1``; the last one is the token the
        drafts follow).
      max_ngram, min_ngram: suffix lengths tried, longest first (static).
      num_tokens: ``K`` drafts per row (static).
      occurrence: ``"first"`` or ``"latest"`` occurrence of the matched suffix.
      wrap: continue a continuation that hits the end of the context periodically.
    Returns: :class:`Lookup`.

    How: ``run[b, e]`` = the number (capped at ``max_ngram``) of tokens ending at ``e`` that
    equal the context's last tokens (``tokens[e - k] == tokens[length - 1 - k]`` for
    ``k = 0, 1, ...``). An occurrence of the ``n``-token suffix with a continuation ends at
    some ``e < length - 1`` with ``run >= n``, so the longest usable ``n`` is the maximum
    of ``run`` over those ``e``, and its occurrences are the ``e`` reaching it.
    """
    check_lookup_options(max_ngram, min_ngram, num_tokens, occurrence)
    tokens = jnp.asarray(tokens, jnp.int32)
    length = jnp.asarray(length, jnp.int32)
    batch, width = tokens.shape
    position = jnp.arange(width, dtype=jnp.int32)[None, :]                   # [1, L]
    back = jnp.arange(max_ngram, dtype=jnp.int32)                            # k
    suffix_index = length[:, None] - 1 - back[None, :]                       # [B, N]
    suffix = jnp.take_along_axis(tokens, jnp.maximum(suffix_index, 0), axis=1)
    equal = []
    for k in range(max_ngram):                                               # static, small
        shifted = jnp.pad(tokens[:, :width - k], ((0, 0), (k, 0)))           # tokens[e - k]
        equal.append((shifted == suffix[:, k:k + 1]) & (position >= k)
                     & (suffix_index[:, k:k + 1] >= 0))
    equal = jnp.stack(equal, axis=-1)                                        # [B, L, N]
    run = jnp.sum(jnp.cumprod(equal.astype(jnp.int32), axis=-1), axis=-1)    # [B, L]
    has_next = position < (length[:, None] - 1)                              # e + 1 in context
    run = jnp.where(has_next, run, 0)
    match_len = jnp.max(run, axis=1)                                         # [B]
    found = match_len >= min_ngram
    hits = has_next & (run >= jnp.maximum(match_len, 1)[:, None])            # [B, L]
    if occurrence == "first":
        end = jnp.argmax(hits, axis=1)
    else:
        end = width - 1 - jnp.argmax(hits[:, ::-1], axis=1)
    start = (end + 1).astype(jnp.int32)
    offset = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]                # j
    period = jnp.maximum(length - start, 1)[:, None]                         # p
    index = start[:, None] + (offset % period if wrap else offset)
    inside = index < length[:, None]
    filler = jnp.take_along_axis(tokens, (length - 1)[:, None], axis=1)      # last token
    drafts = jnp.take_along_axis(tokens, jnp.clip(index, 0, width - 1), axis=1)
    drafts = jnp.where(found[:, None] & inside, drafts, filler)
    return Lookup(drafts.astype(jnp.int32), jnp.where(found, match_len, 0).astype(jnp.int32),
                  jnp.where(found, start, -1))


def reference_lookup(context: Sequence[int], *, max_ngram: int, min_ngram: int,
                     num_tokens: int, occurrence: str = "latest",
                     wrap: bool = True) -> tuple[list[int], int, int]:
    """The same rule for one row, written as the loops transformers' prompt lookup runs:
    ``(drafts [K], match_len (0 = none), start (-1 = none))`` for the token list
    ``context``."""
    check_lookup_options(max_ngram, min_ngram, num_tokens, occurrence)
    context = [int(t) for t in context]
    length = len(context)
    filler = [context[-1]] * num_tokens
    for n in range(min(max_ngram, length), min_ngram - 1, -1):
        suffix = context[length - n:]
        starts = [i + n for i in range(length - n + 1)
                  if context[i:i + n] == suffix and i + n < length]
        if not starts:
            continue
        start = starts[0] if occurrence == "first" else starts[-1]
        period = length - start
        drafts = []
        for j in range(num_tokens):
            if wrap:
                drafts.append(context[start + j % period])
            else:
                drafts.append(context[start + j] if start + j < length else context[-1])
        return drafts, n, start
    return filler, 0, -1


def graft_branch(tree, branch: jax.Array, found: jax.Array, reserve: int):
    """Graft a lookup continuation into a best-first draft tree as one more path (one row;
    ``jax.vmap`` it over a batch).

    Args:
      tree: a :class:`~domino_jax.decode.tree.DraftTree` of ``N`` nodes whose node order puts
        parents before children (both tree builders' order), so any prefix of the node list
        is a tree.
      branch: ``[G]`` int32 the lookup's drafts (``G <= reserve``).
      found: scalar bool, whether the lookup matched (if not, the tree is returned as is).
      reserve: ``R``, static: the last ``R`` nodes are the branch's budget.
    Returns: a ``DraftTree`` of ``N`` nodes. The branch's first ``r`` tokens that already
    form a path from the root among the first ``N - R`` nodes are shared; its other
    ``G - r`` tokens become a chain under that path's end in slots ``N - R ..``; the
    remaining reserved slots are invalid. Grafted nodes have score 0 (scores rank nothing
    after the build).
    """
    num_nodes, length = tree.tokens.shape[0], branch.shape[0]
    if not 1 <= length <= reserve <= num_nodes:
        raise ValueError(f"graft: need 1 <= branch length ({length}) <= reserve ({reserve}) "
                         f"<= tree nodes ({num_nodes})")
    kept = jnp.arange(num_nodes) < num_nodes - reserve
    usable = tree.valid & kept

    def follow(i, carry):                 # walk the kept tree along the branch's tokens
        attach, shared, alive = carry
        child = usable & (tree.parents == attach) & (tree.tokens == branch[i])
        alive = alive & jnp.any(child)
        attach = jnp.where(alive, jnp.argmax(child).astype(jnp.int32), attach)
        return attach, shared + alive.astype(jnp.int32), alive

    attach, shared, _ = jax.lax.fori_loop(0, length, follow,
                                          (jnp.int32(-1), jnp.int32(0), jnp.bool_(True)))
    slot = jnp.arange(num_nodes, dtype=jnp.int32)
    j = slot - (num_nodes - reserve)                           # index within the branch slots
    new = found & (j >= 0) & (j < length - shared)
    take = jnp.clip(shared + j, 0, length - 1)
    depth_of_attach = jnp.where(attach >= 0, tree.depths[jnp.maximum(attach, 0)], -1)
    tokens = jnp.where(new, branch[take], tree.tokens)
    parents = jnp.where(new, jnp.where(j == 0, attach, slot - 1), tree.parents)
    depths = jnp.where(new, depth_of_attach + 1 + j, tree.depths)
    scores = jnp.where(new, 0.0, tree.scores)
    valid = jnp.where(found & (j >= 0), new, tree.valid)
    invalid = ~valid
    return DraftTree(tokens=jnp.where(invalid, 0, tokens), depths=jnp.where(invalid, 0, depths),
                     parents=jnp.where(invalid, -1, parents),
                     scores=jnp.where(invalid, -jnp.inf, scores).astype(jnp.float32),
                     valid=valid)


def chain_tree(tokens: jax.Array, extra: int) -> DraftTree:
    """A chain ``tokens [B, K]`` as batched trees ``[B, K + extra]``: node ``i``'s parent is
    ``i - 1``, at depth ``i``; the last ``extra`` nodes invalid (room for a graft)."""
    batch, k = tokens.shape
    n = k + extra
    node = jnp.arange(n, dtype=jnp.int32)
    valid = jnp.broadcast_to(node < k, (batch, n))
    pad = lambda x, fill: jnp.where(valid, x, fill)              # noqa: E731
    return DraftTree(tokens=pad(jnp.pad(tokens.astype(jnp.int32), ((0, 0), (0, extra))), 0),
                     depths=pad(jnp.broadcast_to(node, (batch, n)), 0),
                     parents=pad(jnp.broadcast_to(node - 1, (batch, n)), -1),
                     scores=pad(jnp.zeros((batch, n), jnp.float32), -jnp.inf),
                     valid=valid)


def graft_lookup(tree: DraftTree, history: jax.Array, root_position: jax.Array,
                 branch: int, options: "NgramOptions | None" = None) -> DraftTree:
    """The hybrid drafts: :func:`graft_branch` of the lookup's ``branch`` drafts into the
    batched trees ``tree [B, N]`` (their last ``branch`` nodes are the graft's budget).

    ``history [B, C]``: the loop's context buffer (``DecodeState.history``), the root at
    ``root_position [B]`` (``target_cache.lengths``); ``options``: the matcher's settings
    (``num_tokens`` is replaced by ``branch``; default :data:`NGRAM_DEFAULTS`). Rows whose
    lookup finds no match keep their tree unchanged."""
    o = options or NGRAM_DEFAULTS
    lookup = lookup_drafts(history, root_position + 1, max_ngram=o.max_ngram,
                           min_ngram=o.min_ngram, num_tokens=branch, occurrence=o.occurrence,
                           wrap=o.wrap)
    return jax.vmap(lambda t, b, f: graft_branch(t, b, f, branch))(
        tree, lookup.drafts, lookup.match_len > 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NgramOptions:
    """``--method ngram``'s options (defaults: ``docs/design.md`` §13): the
    suffix lengths tried (``max_ngram`` down to ``min_ngram``), ``num_tokens`` drafts per
    round, which ``occurrence`` continues, ``wrap`` (see :func:`lookup_drafts`)."""

    max_ngram: int = 4
    min_ngram: int = 1
    num_tokens: int = 4
    occurrence: str = "latest"
    wrap: bool = True

    def __post_init__(self):
        check_lookup_options(self.max_ngram, self.min_ngram, self.num_tokens, self.occurrence)


@dataclasses.dataclass(frozen=True)
class NgramDrafter(Drafter):
    """``--method ngram``: a chain drafter with no model. Each round it reads the loop's
    context buffer (``reads_history``: prompt and committed tokens by position, the root at
    ``target_cache.lengths``) and proposes :func:`lookup_drafts`' K tokens; the target
    verifies them as any chain. Drafts are deterministic (no ``q``: ``rejection``
    verification falls back to ``match``, the same acceptance a one-hot ``q`` gives)."""

    method: ClassVar[str] = "ngram"
    Options: ClassVar[type] = NgramOptions
    needs_checkpoint: ClassVar[bool] = False
    reads_history: ClassVar[bool] = True
    draft_policies: ClassVar[tuple[str, ...]] = ("greedy",)
    options: NgramOptions = NgramOptions()

    @property
    def num_drafts(self) -> int:
        return self.options.num_tokens

    def propose(self, target_params, draft_params, state, key, config) -> Proposal:
        """``[B, K]`` drafts from ``state.history``, whose first ``lengths + 1`` tokens are
        the row's context (the root last)."""
        o = self.options
        lookup = lookup_drafts(state.history, state.target_cache.lengths + 1,
                               max_ngram=o.max_ngram, min_ngram=o.min_ngram,
                               num_tokens=o.num_tokens, occurrence=o.occurrence, wrap=o.wrap)
        return Proposal(lookup.drafts)


NGRAM_DEFAULTS = NgramOptions()      # the CLI's defaults (docs/design.md §13)
