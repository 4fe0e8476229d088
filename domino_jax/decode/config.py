"""``DecodeConfig``: the static settings of one generation (hashable: part of the jit key)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from domino_jax.decode.adaptive import AdaptiveConfig
from domino_jax.decode.drafters import BlockDrafter
from domino_jax.decode.methods import drafter_class
from domino_jax.decode.prefill import PrefillConfig
from domino_jax.decode.sampling import SamplingConfig
from domino_jax.decode.verify import verify_rule

DRAFT_POLICIES = ("greedy", "sample")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static decoding settings.

    ``method``: a name of :data:`domino_jax.decode.methods.METHODS`. ``verify``: the
    verification rule, a strategy of :mod:`domino_jax.decode.verify` or its name
    (``"match"``, ``"rejection"``; stored as the strategy). ``draft_policy``: how chain
    drafts are chosen (``"greedy"`` or ``"sample"`` at ``draft_temperature``).
    ``capacity``: target cache slots (``None``: just enough, aligned). ``prefill``: how
    prompts are prefilled (chunked above ``prefill.chunk`` tokens,
    :mod:`domino_jax.decode.prefill`). ``adaptive``: the verify width chosen per round
    (draft length / tree budget, down to a plain AR step) by a cost model and the observed
    acceptance (:mod:`domino_jax.decode.adaptive`; block drafters only); ``None``: every
    round verifies the drafter's full width.
    """

    method: str = "ar"
    max_new_tokens: int = 128
    sampling: SamplingConfig = SamplingConfig()
    draft_policy: str = "greedy"       # "greedy" | "sample"
    draft_temperature: float = 1.0
    verify: Any = "match"              # a verify strategy, or "match" | "rejection"
    stop_token_ids: tuple[int, ...] = ()
    capacity: int | None = None        # target cache slots; None = just enough
    prefill: PrefillConfig = PrefillConfig()   # chunked above prefill.chunk prompt tokens
    adaptive: AdaptiveConfig | None = None     # per-round verify width (decode/adaptive.py)

    def __post_init__(self):
        drafter = drafter_class(self.method)
        if self.draft_policy not in DRAFT_POLICIES:
            raise ValueError(f"unknown draft policy {self.draft_policy!r}; 'greedy' or 'sample'")
        if self.draft_policy not in drafter.draft_policies:
            raise ValueError(f"method {self.method!r} takes draft_policy "
                             f"{' or '.join(map(repr, drafter.draft_policies))} only (got "
                             f"{self.draft_policy!r})")
        object.__setattr__(self, "verify", verify_rule(self.verify))
        if self.adaptive is not None and not issubclass(drafter, BlockDrafter):
            raise ValueError(f"adaptive widths (--draft-length/--budget auto) take a block "
                             f"drafter method (dflash, domino, ddtree, dominotree), not "
                             f"{self.method!r}")
        if drafter.proposes_trees and not getattr(self.verify, "verifies_trees", False):
            raise ValueError(f"method {self.method!r} verifies with 'match' (sample-and-walk) "
                             "only: best-first trees define no draft distribution for "
                             f"{getattr(self.verify, 'name', self.verify)!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not math.isfinite(self.draft_temperature):
            raise ValueError(f"draft_temperature must be finite, got {self.draft_temperature}")
        if self.draft_policy == "sample" and self.draft_temperature <= 0:
            raise ValueError("draft_policy='sample' needs draft_temperature > 0")
