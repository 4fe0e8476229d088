"""Continuous batching (decode/serving.py): a queue of requests through fewer slots gives
every request exactly what AR gives it alone (greedy: fixed widths, adaptive, trees, stops
that end rows at different rounds), the first three tokens follow the target at T > 0, the
row insertion helpers, and the errors. Tiny float32 models."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode_helpers import (assert_first_three_follow_target, draft_config,
                            perm_domino_params, perm_target, reference_greedy, tiny_draft)
from test_decode_adaptive import AD, MIXED
from test_decode_greedy import MAX_NEW, PI, RAGGED  # MAX_NEW: generate's programs shared
from test_decode_sampling import PROMPT, V, models  # noqa: F401  (the T > 0 tiny pair)
from domino_jax.decode import serving, speculative
from domino_jax.decode.adaptive import AdaptiveConfig, PolicyState
from domino_jax.decode.cost_model import CostModel
from domino_jax.decode.methods import make_drafter, method_options
from domino_jax.decode.sampling import SamplingConfig
from domino_jax.decode.speculative import DecodeConfig, generate

jax.config.update("jax_default_matmul_precision", "highest")

REQUESTS = RAGGED + [[5, 6], [9, 9, 9, 1], [2, 3, 4, 5, 6, 7, 8], [30], [17, 18, 19]]


def _pair(head="forced"):
    cfg = draft_config(32, block=4, shift=True, prefix=0, gru=32, emb=32)
    target, params = perm_target(PI, attn_scale=0.3, seed=1)      # partial acceptance
    dparams = perm_domino_params(cfg, PI) if head == "forced" else tiny_draft(cfg, seed=5)
    return cfg, target, params, dparams


def _cut(tokens, stops):
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[:i + 1]
    return tokens


@pytest.mark.parametrize("method,auto,refill_rows", [
    ("ar", False, 1), ("domino", False, 1), ("domino", True, 1), ("domino", True, 2),
    ("dominotree", False, 1)])
def test_every_request_gets_its_greedy_ar_tokens(method, auto, refill_rows):
    cfg, target, params, dparams = _pair()
    ref = reference_greedy(target, params, REQUESTS, MAX_NEW)
    stops = (ref[1][3], ref[4][6])          # some rows stop early, at different rounds
    expected = [_cut(r, stops) for r in ref]
    drafter = None if method == "ar" else make_drafter(
        cfg, target, method, method_options(method, budget=6) if method == "dominotree"
        else None)
    config = DecodeConfig(method=method, max_new_tokens=MAX_NEW, stop_token_ids=stops,
                          adaptive=AD if auto else None)
    result = serving.serve(target, params, REQUESTS, config, drafter,
                           None if method == "ar" else dparams, slots=3,
                           cost_model=MIXED if auto else None, refill_rows=refill_rows)
    assert result.tokens == expected
    assert result.refills >= (3 if refill_rows == 1 else 2) and result.loop_calls >= 2
    assert 0 < result.tokens_per_second < result.decode_tokens_per_second
    assert result.accept_hist.sum() == result.rounds.sum()
    per_request = (result.accept_hist * np.arange(result.accept_hist.shape[1])).sum(1)
    assert all(n >= len(t) - 1 for n, t in zip(per_request, expected))   # blocks overrun
    assert 0 < result.prefill_seconds < result.seconds
    assert result.loop_rounds >= int(result.rounds.max())
    if auto:
        assert sum(result.verify_widths.values()) == result.loop_rounds


def test_compile_jobs_compile_what_serve_runs():
    """:func:`serving.compile_jobs`, run on threads, compile every program a queue of
    ``slots`` rows refilled one row at a time runs (sizes 1 and 2, the first fill's 4):
    the serve after them compiles nothing, and its tokens are AR's."""
    from concurrent.futures import ThreadPoolExecutor

    _, target, params, _ = _pair()
    config = DecodeConfig(method="ar", max_new_tokens=MAX_NEW + 1)   # programs of its own
    width = speculative.prompt_bucket(max(len(r) for r in REQUESTS))
    jobs = serving.compile_jobs(target, params, config, width, 4, refill_rows=1)
    assert len(jobs) == 3
    with ThreadPoolExecutor(3) as pool:
        seconds = list(pool.map(lambda job: job(), jobs))
    assert all(s > 0 for s in seconds), seconds
    result = serving.serve(target, params, REQUESTS, config, slots=4, refill_rows=1)
    assert result.compile_seconds == 0.0 and result.refills >= 2
    assert result.tokens == reference_greedy(target, params, REQUESTS, MAX_NEW + 1)


def test_static_batch_equals_generate():
    cfg, target, params, dparams = _pair("random")
    drafter = make_drafter(cfg, target, "domino")
    config = DecodeConfig(method="domino", max_new_tokens=MAX_NEW)
    static = generate(target, params, RAGGED, config, drafter, dparams)
    served = serving.serve(target, params, RAGGED, config, drafter, dparams)
    assert served.tokens == static.tokens and served.refills == 0
    np.testing.assert_array_equal(served.accept_hist, static.accept_hist)
    one = serving.serve(target, params, RAGGED, config, drafter, dparams, slots=1)
    assert one.tokens == static.tokens and one.refills == len(RAGGED) - 1


def test_adaptive_statistics_of_a_refilled_slot_start_at_the_prior():
    policy = PolicyState(
        jnp.ones((3, 1, 2)), jnp.ones((3, 1, 2)) * 2, jnp.ones(2), jnp.int32(-1), jnp.int32(4),
        jnp.int32(8), jnp.zeros(2, jnp.int32), jnp.int32(0), jnp.int32(2))
    reset = serving.reset_policy_rows(policy, jnp.asarray([2, 3], jnp.int32))   # 3: dropped
    np.testing.assert_array_equal(np.asarray(reset.accepted)[:, 0, 0], [1, 1, 0])
    np.testing.assert_array_equal(np.asarray(reset.observed)[:, 0, 0], [2, 2, 0])
    assert int(reset.since_spec) == 4 and int(reset.probe_interval) == 8   # shared, kept


def test_insert_rows_by_batch_axis():
    full = {"a": jnp.zeros((2, 4, 3)), "b": jnp.zeros((4,)), "key": jnp.arange(2)}
    part = {"a": jnp.ones((2, 2, 3)), "b": jnp.asarray([7.0, 8.0]), "key": jnp.arange(2) + 5}
    axes = serving.batch_axes(part, full)
    assert axes == [1, 0, None]
    out = serving.insert_rows(full, part, jnp.asarray([3, 4], jnp.int32), axes)   # 4: dropped
    np.testing.assert_array_equal(np.asarray(out["b"]), [0, 0, 0, 7])
    np.testing.assert_array_equal(np.asarray(out["a"])[0, :, 0], [0, 0, 0, 1])
    np.testing.assert_array_equal(np.asarray(out["key"]), [0, 1])
    assert [serving.refill_size(n, 6) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]


def test_refill_plan_pads_only_the_queue_end():
    # more waiting than free: the largest power of two, no padding rows
    assert [serving.refill_plan(f, 100, 32) for f in (1, 3, 5, 8, 31)] == [
        (1, 1), (2, 2), (4, 4), (8, 8), (16, 16)]
    assert serving.refill_plan(5, 3, 32) == (3, 4)      # the last three, padded to 4
    assert serving.refill_plan(5, 5, 6) == (5, 6)       # capped at the slots
    assert serving.refill_plan(0, 7, 8) == (0, 0) and serving.refill_plan(4, 0, 8) == (0, 0)


def test_a_loop_with_its_own_state_layouts_keeps_them_through_insertions():
    # a stand-in loop whose state leaf "a" is laid out column-major (as XLA lays a
    # speculative loop's caches out on a GPU); the CPU keeps default layouts for AUTO
    from jax.experimental.layout import Format, Layout
    from domino_jax.decode.speculative import RoundsProgram

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    column = Format(Layout(major_to_minor=(1, 0)), device)
    formats = {"a": column, "b": Format(Layout(major_to_minor=(0,)), device)}
    loop = jax.jit(lambda tp, dp, state, n, limit: {"a": state["a"] + tp, "b": state["b"] + 1},
                   in_shardings=(None, None, formats, None, None), out_shardings=formats,
                   donate_argnums=(2,))
    state = {"a": jnp.zeros((4, 3)), "b": jnp.zeros(4, jnp.int32)}
    program = RoundsProgram(loop.lower(1.0, None, state, 0, 0).compile(), 4, state_layouts=True)
    assert program._relaid == [0]                   # only the non-default leaf is checked
    state = program.adopt(state)
    assert state["a"].format == program.state_formats["a"]
    assert state["a"].format.layout.major_to_minor == (1, 0)
    state = program(1.0, None, state, jnp.int32(1))
    insert = program.keeping_layouts(serving.insert_rows, static_argnums=(3,))
    part = {"a": jnp.full((1, 3), 7.0), "b": jnp.asarray([9], jnp.int32)}
    state = insert(state, part, jnp.asarray([2], jnp.int32), (0, 0))
    assert state["a"].format == program.state_formats["a"]
    assert state["b"].format == program.state_formats["b"]
    np.testing.assert_array_equal(np.asarray(state["a"])[:, 0], [1, 1, 7, 1])
    np.testing.assert_array_equal(np.asarray(state["b"]), [1, 1, 9, 1])
    assert program.keeping_layouts(serving.insert_rows, static_argnums=(3,)) is insert
    plain = RoundsProgram(loop.lower(1.0, None, state, 0, 0).compile(), 4)
    assert plain.state_formats is None and plain.adopt(state) is state


def test_served_speculative_loops_choose_their_state_layouts():
    from domino_jax.decode.speculative import loop_state_layouts
    cfg, target, params, dparams = _pair()
    domino, ar = make_drafter(cfg, target, "domino"), make_drafter(None, target, "ar")
    assert loop_state_layouts(domino, True, params, dparams)
    assert not loop_state_layouts(domino, False, params, dparams)   # generate: defaults
    assert not loop_state_layouts(ar, True, params, None)          # AR: no per-call cost


def test_call_split_recovers_per_round_and_per_call_costs():
    calls = [(n, 0.010 * n + 0.004) for n in (1, 2, 3, 5)]          # 10 ms a round, 4 a call
    per_round, per_call = serving.call_split(calls)
    assert abs(per_round - 10.0) < 1e-9 and abs(per_call - 4.0) < 1e-9
    assert serving.call_split(calls[:2]) is None and serving.call_split([(2, 1.0)] * 4) is None


def test_serve_errors():
    cfg, target, params, dparams = _pair()
    config = DecodeConfig(method="ar", max_new_tokens=4)
    with pytest.raises(ValueError, match="at least one request"):
        serving.serve(target, params, [], config)
    with pytest.raises(ValueError, match="slots must be >= 1, got 0"):
        serving.serve(target, params, RAGGED, config, slots=0)
    with pytest.raises(ValueError, match="refill_rows must be >= 1, got 0"):
        serving.serve(target, params, RAGGED, config, slots=2, refill_rows=0)
    assert serving.default_refill_rows(1) == 1 and serving.default_refill_rows(32) == 4
    with pytest.raises(ValueError, match="request 1 is empty"):
        serving.serve(target, params, [[1], []], config, slots=1)
    with pytest.raises(ValueError, match="needs a drafter"):
        serving.serve(target, params, RAGGED, DecodeConfig(method="domino"), slots=2)


@pytest.mark.slow
def test_served_joint_distribution_chi_square(models):
    """T = 1, ``auto`` over a queue twice the slots: refilled rows sample the target's
    distribution (first three tokens, chi-square at 0.999)."""
    cfg, dparams = models["domino"]
    target, params = models["target"], models["params"]
    sampling = SamplingConfig(1.0)
    config = DecodeConfig(method="domino", max_new_tokens=3, sampling=sampling,
                          verify="rejection", draft_policy="sample",
                          adaptive=AdaptiveConfig(widths=(0, 2, cfg.k_draft), probe_min=1,
                                                  probe_max=2))
    drafter = make_drafter(cfg, target, "domino")
    result = serving.serve(target, params, [PROMPT] * 1500, config, drafter, dparams,
                           slots=500, seed=7, cost_model=CostModel(costs=[1.0, 1.3, 1.6]))
    assert result.refills >= 2 and len(result.verify_widths) >= 2, result.verify_widths
    assert_first_three_follow_target(target, params, PROMPT, V, result.tokens, sampling)


def test_command_buffers_off_only_for_a_served_speculative_loop_on_a_gpu(monkeypatch):
    from domino_jax.decode import speculative

    cfg, target, _, _ = _pair()
    domino = make_drafter(cfg, target, "domino")
    ar = speculative._resolve_drafter(target, DecodeConfig(method="ar"), None)
    assert speculative.rounds_compiler_options(domino, True) == {}          # the CPU
    monkeypatch.setattr(speculative.jax, "default_backend", lambda: "gpu")
    assert speculative.rounds_compiler_options(domino, True) == {
        "xla_gpu_enable_command_buffer": ""}
    assert speculative.rounds_compiler_options(domino, False) == {}
    assert speculative.rounds_compiler_options(ar, True) == {}
