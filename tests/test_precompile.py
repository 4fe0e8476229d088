"""``speculative.precompile``: fills ``generate``'s compile cache, also from several threads
at once (CPU, float32, tiny random models).

* precompile, then generate: the generate call compiles nothing (``compile_seconds == 0``)
  and gives the same tokens / acceptance as a generate that compiled for itself;
* two threads precompiling the same program: it is compiled once, both get it;
* two threads precompiling different programs: both are compiled and cached;
* a compile that raises leaves no stale "in progress" entry: the next call compiles.

Each test starts from an empty cache (``monkeypatch`` swaps ``speculative._PROGRAMS``).
"""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

from decode_helpers import draft_config, tiny_draft, tiny_target
from domino_jax.decode import speculative
from domino_jax.decode.methods import make_drafter
from domino_jax.decode.sampling import SamplingConfig
from domino_jax.decode.speculative import DecodeConfig, generate, precompile
from domino_jax.program_cache import ProgramCache

jax.config.update("jax_default_matmul_precision", "highest")

PROMPTS = [[3, 4, 5], [7, 1, 2, 9, 10, 6]]
OTHER_PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8]]          # same [2, 16] bucket, other tokens


def models(method: str):
    target, params = tiny_target(seed=3, vocab=32)
    if method == "ar":
        return target, params, None, None
    cfg = draft_config(32, block=4, gru=16, emb=16)
    return target, params, make_drafter(cfg, target, method), tiny_draft(cfg, 5)


class CountingJit:
    """Wraps a jitted function and counts ``lower`` calls (optionally failing the first)."""

    def __init__(self, inner, fail_first: bool = False):
        self.inner, self.fail_first, self.count = inner, fail_first, 0
        self.lock = threading.Lock()

    def lower(self, *args, **kwargs):
        with self.lock:
            self.count += 1
            fail = self.fail_first and self.count == 1
        if fail:
            raise RuntimeError("injected compile failure")
        return self.inner.lower(*args, **kwargs)


@pytest.fixture
def fresh_cache(monkeypatch):
    # never dropping programs for mappings (tests/test_program_cache.py tests that): what
    # these tests count does not depend on how many mappings the process holds
    monkeypatch.setattr(speculative, "_PROGRAMS", ProgramCache(budget=None))


@pytest.mark.parametrize("method,temperature", [("ar", 0.0), ("domino", 0.0),
                                                ("domino", 1.0)])
def test_precompile_then_generate(fresh_cache, monkeypatch, method, temperature):
    target, params, drafter, dparams = models(method)
    config = DecodeConfig(method=method, max_new_tokens=12,
                          sampling=SamplingConfig(temperature))
    # seed and token values are inputs, not part of the program
    seconds = precompile(target, params, OTHER_PROMPTS, config, drafter, dparams, seed=0)
    assert seconds > 0
    assert precompile(target, params, OTHER_PROMPTS, config, drafter, dparams) == 0.0
    warm = generate(target, params, PROMPTS, config, drafter, dparams, seed=4)
    assert warm.compile_seconds == 0.0
    monkeypatch.setattr(speculative, "_PROGRAMS", ProgramCache(budget=None))
    cold = generate(target, params, PROMPTS, config, drafter, dparams, seed=4)
    assert cold.compile_seconds > 0
    assert warm.tokens == cold.tokens
    np.testing.assert_array_equal(warm.accept_hist, cold.accept_hist)
    np.testing.assert_array_equal(warm.rounds, cold.rounds)


def test_precompile_validates_like_generate(fresh_cache):
    target, params, drafter, dparams = models("domino")
    with pytest.raises(ValueError, match="needs a drafter"):
        precompile(target, params, PROMPTS, DecodeConfig(method="domino"))
    with pytest.raises(ValueError, match="cache slots"):
        precompile(target, params, PROMPTS,
                   DecodeConfig(method="domino", max_new_tokens=10, capacity=12),
                   drafter, dparams)
    assert len(speculative._PROGRAMS) == 0


def _in_threads(calls):
    """Run the zero-argument ``calls`` in threads started together; their results."""
    barrier = threading.Barrier(len(calls))
    results, errors = [None] * len(calls), []

    def worker(i):
        barrier.wait()
        try:
            results[i] = calls[i]()
        except BaseException as e:     # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_same_program_from_two_threads(fresh_cache, monkeypatch):
    target, params, drafter, dparams = models("domino")
    config = DecodeConfig(method="domino", max_new_tokens=12)
    prefill_jit = CountingJit(speculative._prefill_jit)
    rounds_jit = CountingJit(speculative._rounds_jit)
    monkeypatch.setattr(speculative, "_prefill_jit", prefill_jit)
    monkeypatch.setattr(speculative, "_rounds_jit", rounds_jit)
    call = lambda: precompile(target, params, PROMPTS, config, drafter, dparams)
    seconds = _in_threads([call, call])
    assert prefill_jit.count == 1 and rounds_jit.count == 1        # compiled once
    assert max(seconds) > 0                 # one compiled (the other waited, or hit the cache)
    # prefill, rounds
    assert len(speculative._PROGRAMS) == 2 and not speculative._PROGRAMS.pending
    result = generate(target, params, PROMPTS, config, drafter, dparams)
    assert result.compile_seconds == 0.0
    assert prefill_jit.count == 1


def test_different_programs_from_two_threads(fresh_cache):
    ar_models, domino_models = models("ar"), models("domino")
    ar_config = DecodeConfig(method="ar", max_new_tokens=12)
    domino_config = DecodeConfig(method="domino", max_new_tokens=12)
    seconds = _in_threads([
        lambda: precompile(ar_models[0], ar_models[1], PROMPTS, ar_config),
        lambda: precompile(*domino_models[:2], PROMPTS, domino_config, *domino_models[2:])])
    assert all(s > 0 for s in seconds)
    # 2 x (prefill, rounds)
    assert len(speculative._PROGRAMS) == 4 and not speculative._PROGRAMS.pending
    assert generate(*ar_models[:2], PROMPTS, ar_config).compile_seconds == 0.0
    assert generate(*domino_models[:2], PROMPTS, domino_config,
                    *domino_models[2:]).compile_seconds == 0.0


def test_failed_compile_leaves_no_pending_entry(fresh_cache, monkeypatch):
    target, params, _, _ = models("ar")
    config = DecodeConfig(method="ar", max_new_tokens=12)
    monkeypatch.setattr(speculative, "_prefill_jit",
                        CountingJit(speculative._prefill_jit, fail_first=True))
    with pytest.raises(RuntimeError, match="injected"):
        precompile(target, params, PROMPTS, config)
    assert len(speculative._PROGRAMS) == 0 and not speculative._PROGRAMS.pending
    assert precompile(target, params, PROMPTS, config) > 0
    assert generate(target, params, PROMPTS, config).compile_seconds == 0.0
