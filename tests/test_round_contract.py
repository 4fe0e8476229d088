"""The round contract (domino_jax/decode/contract.py): a new drafter is one small class, and
it goes through the same draft -> verify -> commit as every method; float32 programs run at
full matmul precision.

* A toy chain drafter (propose the root K times) registered as a method: greedy output equal
  to AR, and the stage functions of the round called one by one equal the loop.
* The decode programs of a float32 target are traced with ``jax_default_matmul_precision``
  ``"highest"`` (on GPUs the default would run float32 matmuls in TF32), those of a bf16
  target with the default; the lowered float32 program carries HIGHEST on its dots.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode_helpers import perm_target, reference_greedy, tiny_target
from domino_jax.decode import loop, methods, round as round_lib, speculative
from domino_jax.decode.contract import Drafter, Proposal
from domino_jax.decode.speculative import DecodeConfig, generate
from domino_jax.program_cache import ProgramCache

PROMPTS = [[3, 4, 5], [7, 1, 2, 9, 10, 6]]


@dataclasses.dataclass(frozen=True)
class RepeatOptions:
    repeats: int = 3


@dataclasses.dataclass(frozen=True)
class RepeatDrafter(Drafter):
    """Drafts the root ``repeats`` times: the whole drafter is this class."""

    method: ClassVar[str] = "repeat"
    Options: ClassVar[type] = RepeatOptions
    needs_checkpoint: ClassVar[bool] = False
    options: RepeatOptions = RepeatOptions()

    @property
    def num_drafts(self) -> int:
        return self.options.repeats

    def propose(self, target_params, draft_params, state, key, config) -> Proposal:
        return Proposal(jnp.repeat(state.root[:, None], self.num_drafts, axis=1))


@pytest.fixture
def repeat_method(monkeypatch):
    monkeypatch.setitem(methods.METHODS, "repeat", RepeatDrafter)
    return RepeatDrafter


def test_a_new_drafter_is_one_class(repeat_method):
    """On a target whose greedy next token is its current token every draft is accepted
    (4 tokens per round); on a random target few are; both equal AR."""
    target, params = perm_target(np.arange(16), attn_scale=0.0, seed=1)
    ref = reference_greedy(target, params, PROMPTS, 13)
    assert ref == [[p[-1]] * 13 for p in PROMPTS]
    config = DecodeConfig(method="repeat", max_new_tokens=13)
    result = generate(target, params, PROMPTS, config)       # no checkpoint: built by the method
    assert result.tokens == ref and result.verify_width == 4
    assert result.tau == 4.0 and (result.rounds == 3).all()
    target, params = tiny_target(seed=3, vocab=16)
    result = generate(target, params, PROMPTS, config)
    assert result.tokens == reference_greedy(target, params, PROMPTS, 13)
    with pytest.raises(ValueError, match="'repeat' has no option budget"):
        methods.method_options("repeat", budget=3)
    with pytest.raises(ValueError, match="already registered"):
        methods.register_method(dataclasses.make_dataclass(
            "Other", [], bases=(RepeatDrafter,), frozen=True))


def test_stage_functions_equal_the_loop(repeat_method):
    """draft -> verify -> commit called one by one (as benchmarks do) give the loop's state."""
    target, params = tiny_target(seed=3, vocab=16, lm_scale=1.0)
    drafter = methods.make_drafter(None, target, "repeat")
    config = DecodeConfig(method="repeat", max_new_tokens=8)
    prompt, prompt_len = speculative.pad_prompts(PROMPTS)
    state = round_lib.prefill(target, drafter, config, params, None, prompt, prompt_len,
                              jax.random.PRNGKey(0), 64)
    policy = loop.init_policy(config, drafter, loop.loop_arms(config, drafter)[1],
                              len(PROMPTS))
    looped, policy = jax.jit(lambda s, p: loop.rounds(target, drafter, config, params, None,
                                                      s, p, jnp.int32(2)))(state, policy)
    assert np.asarray(policy.arm_rounds).tolist() == [2]     # the one arm counts its rounds

    @jax.jit
    def by_stages(state):
        for _ in range(2):
            key, draft_key, verify_key = jax.random.split(state.key, 3)
            proposal = round_lib.draft(drafter, config, params, None, state, draft_key)
            verified = round_lib.verify(target, drafter, config, params, state, proposal,
                                        verify_key)
            state = round_lib.commit(drafter, config, state, verified, key)
        return state

    staged = by_stages(state)
    assert int(staged.num_out.min()) > 1
    for a, b in zip(jax.tree_util.tree_leaves(staged), jax.tree_util.tree_leaves(looped)):
        a, b = np.asarray(a), np.asarray(b)
        if np.issubdtype(a.dtype, np.floating):    # the cache: fused differently in a loop
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(a, b)


def test_float32_programs_use_full_precision(monkeypatch):
    """The AOT lowering of a float32 target's programs happens under "highest", a bf16
    target's under the default; the float32 round loop's dots say HIGHEST."""
    from domino_jax.models.qwen3 import TargetLM

    seen = []

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def lower(self, *args, **kwargs):
            seen.append(jax.config.jax_default_matmul_precision)
            lowered = self.inner.lower(*args, **kwargs)
            seen.append(lowered.as_text())
            return lowered

    monkeypatch.setattr(speculative, "_PROGRAMS", ProgramCache(budget=None))
    monkeypatch.setattr(speculative, "_rounds_jit", Spy(speculative._rounds_jit))
    target, params = tiny_target(seed=3, vocab=16)
    bf16 = TargetLM(target.config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    assert speculative.matmul_precision(target) == "highest"
    assert speculative.matmul_precision(bf16) is None
    config = DecodeConfig(max_new_tokens=2)
    with jax.default_matmul_precision("default"):           # as outside the test suite
        speculative.precompile(target, params, PROMPTS, config)
        speculative.precompile(bf16, params, PROMPTS, config)
    (f32_precision, f32_text), (bf16_precision, bf16_text) = seen[:2], seen[2:]
    assert f32_precision == "highest" and bf16_precision == "default"
    assert "HIGHEST" in f32_text and "HIGHEST" not in bf16_text


def test_greedy_path_belongs_to_the_class_that_defines_accept():
    """T = 0 takes a rule's ``accept_greedy`` only when it speaks for its ``accept``: a
    subclass that overrides ``accept`` alone gets the general path (its override), not the
    parent's greedy shortcut."""
    from domino_jax.decode.verify import Match, Rejection

    class OverridesAccept(Match):
        def accept(self, key, proposal, target_log_probs, max_commit):
            return super().accept(key, proposal, target_log_probs, max_commit)

    class OverridesBoth(OverridesAccept):
        def accept_greedy(self, key, proposal, targets, max_commit):
            return Match().accept_greedy(key, proposal, targets, max_commit)

    class OverridesGreedyOnly(Match):
        def accept_greedy(self, key, proposal, targets, max_commit):
            return Match().accept_greedy(key, proposal, targets, max_commit)

    class AcceptOnly:
        def accept(self, key, proposal, target_log_probs, max_commit):
            raise NotImplementedError

    assert round_lib.has_greedy_path(Match()) and round_lib.has_greedy_path(Rejection())
    assert not round_lib.has_greedy_path(OverridesAccept())
    assert round_lib.has_greedy_path(OverridesBoth())
    assert round_lib.has_greedy_path(OverridesGreedyOnly())
    assert not round_lib.has_greedy_path(AcceptOnly())
