"""Every Pallas kernel of the library lowers for CUDA (abstract A100 and H200 devices: the
Pallas-to-Triton lowering) and for TPU (the Pallas-to-Mosaic lowering), on the CPU, at the
Qwen3-8B and the SmolLM2 demo shapes, bf16 (``domino_jax/pallas/lowering.py`` says what
this checks and what only the device can).

Each case exports one jitted call and counts its kernel calls; nothing runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from domino_jax.pallas import cache_attention, cache_attention_tpu, head_step, tree_step
from domino_jax.pallas.lowering import TARGETS, export_for, kernel_calls

S = jax.ShapeDtypeStruct
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32

# name: (vocab V, emb_dim E, gru G, query heads, kv heads, head dim, K drafts)
SHAPES = {"qwen3_8b": (151936, 256, 1024, 32, 8, 128, 16),
          "smollm2": (49152, 64, 256, 9, 3, 64, 16)}
GPU = [t for t in TARGETS if t.platform == "cuda"]
ALL = [(shape, t) for shape in SHAPES for t in TARGETS]
IDS = [f"{shape}-{t.name}" for shape, t in ALL]


def _variant(target):
    return "triton" if target.platform == "cuda" else "mosaic_tpu"


def _lowers(fn, args, target, calls: int):
    exported = export_for(fn, args, target)
    assert kernel_calls(exported, target) == calls


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("shape,target", ALL, ids=IDS)
def test_head_step_kernels_lower(shape, target, batch):
    vocab, emb, gru, *_, k_draft = SHAPES[shape]
    plan = head_step.plan_step(_variant(target), batch, vocab, emb, gru)
    rows, width = plan.rows, 3 * gru + emb
    prod, state = S((rows, width), F32), S((rows, gru), BF16)
    w2, base = S((emb, vocab), BF16), S((batch, k_draft, vocab), F32)
    greedy = lambda p, w, b: head_step.logits_argmax(  # noqa: E731
        p, w, b, plan=plan, step=3, act_dtype=BF16)[0]
    _lowers(greedy, [prod, w2, base], target, 1)
    drawn = lambda p, w, b, n: head_step.logits_argmax(  # noqa: E731
        p, w, b, plan=plan, step=3, act_dtype=BF16, noise=n, temperature=0.7,
        write_logits=True)
    _lowers(drawn, [prod, w2, base, S((batch, vocab), F32)], target, 1)
    parts = head_step.Partials(S((plan.part_rows, rows), F32), S((plan.part_rows, rows), I32),
                               plan.num_blocks)
    z, proj = S((k_draft, rows, width), F32), S((gru, width), BF16)
    for table_rows, stride in ((vocab, 0), (batch * 64, 64)):        # full table, pool
        step = lambda p, t, s, pr, zz, sp, r=stride: head_step.state_step(  # noqa: E731
            p, t, s, pr, zz, sp, plan=plan, row_stride=r, z_row=4)
        _lowers(step, [parts, S((table_rows, 3 * gru), F32), state, prod, z, proj], target, 1)


@pytest.mark.parametrize("shape,target", ALL, ids=IDS)
def test_tree_step_kernel_lowers(shape, target):
    vocab, emb, gru, *_, k_draft = SHAPES[shape]
    plan = tree_step.plan_tree_step(_variant(target), 16, vocab, emb, gru, 8, 64)
    rows, width, m, n = plan.step.rows, 3 * gru + emb, plan.topm_pad, plan.ntop_pad
    inputs = tree_step.DepthInputs(S((k_draft, m), I32), S((k_draft, m), F32),
                                   S((k_draft, m, emb), F32), S((k_draft, n), I32),
                                   S((k_draft, n), F32), S((k_draft, 1, width), F32))
    args = [S((rows,), F32), S((rows, gru), BF16), S((rows, width), F32), inputs,
            S((vocab, 3 * gru), F32), S((gru, width), BF16)]
    per_depth = 1 if target.platform == "cuda" else 2
    for depth, from_base, advance in ((0, True, True), (5, False, True), (15, False, False)):
        fn = lambda *a, d=depth, f=from_base, adv=advance: tree_step.tree_step(  # noqa: E731
            *a, plan=plan, depth=d, from_base=f, advance=adv)
        _lowers(fn, args, target, per_depth if advance else 1)


# non-default blockings (docs/design.md §6): the knobs benchmarks/bench_tree_build.py
# --tunings sweeps, at their extremes
TUNINGS = {"wide": head_step.KernelTuning(block_v=2048, emb_chunk=128, num_warps=8,
                                          num_stages=3, block_n=64, gru_chunk=32,
                                          num_warps_b=8, num_stages_b=3),
           "narrow": head_step.KernelTuning(block_v=256, emb_chunk=32, num_stages=4,
                                            block_n=16, gru_chunk=16, num_warps_b=2),
           "split": head_step.KernelTuning(row_gru=1, split_advance=1, gru_chunk=32)}


@pytest.mark.parametrize("tuning", sorted(TUNINGS))
@pytest.mark.parametrize("target", GPU, ids=[t.name for t in GPU])
def test_tuned_kernels_lower_for_cuda(target, tuning):
    """Kernel A, kernel B and the depth step under each tuning, Qwen3-8B shape, batch 1
    (``split``: the advance's GRU in the kernel, its products in XLA: still one kernel)."""
    vocab, emb, gru, *_, k_draft = SHAPES["qwen3_8b"]
    plan = head_step.plan_step("triton", 1, vocab, emb, gru, tuning=TUNINGS[tuning])
    rows, width = plan.rows, 3 * gru + emb
    prod, state, table = S((rows, width), F32), S((rows, gru), BF16), S((vocab, 3 * gru), F32)
    greedy = lambda p, w, b: head_step.logits_argmax(  # noqa: E731
        p, w, b, plan=plan, step=3, act_dtype=BF16)[0]
    _lowers(greedy, [prod, S((emb, vocab), BF16), S((1, k_draft, vocab), F32)], target, 1)
    parts = head_step.Partials(S((plan.part_rows, rows), F32), S((plan.part_rows, rows), I32),
                               plan.num_blocks)
    step = lambda *a: head_step.state_step(*a, plan=plan, z_row=4)      # noqa: E731
    _lowers(step, [parts, table, state, prod, S((k_draft, rows, width), F32),
                   S((gru, width), BF16)], target, 1)
    tplan = tree_step.plan_tree_step("triton", 16, vocab, emb, gru, 8, 64, TUNINGS[tuning])
    inputs = tree_step.DepthInputs(S((k_draft, 64), I32), S((k_draft, 64), F32),
                                   S((k_draft, 64, emb), F32), S((k_draft, 8), I32),
                                   S((k_draft, 8), F32), S((k_draft, 1, width), F32))
    depth = lambda *a: tree_step.tree_step(  # noqa: E731
        *a, plan=tplan, depth=5, from_base=False, advance=True)
    _lowers(depth, [S((rows,), F32), state, prod, inputs, table, S((gru, width), BF16)],
            target, 1)


@pytest.mark.parametrize("t_len", [1, 17])
@pytest.mark.parametrize("shape,target", ALL, ids=IDS)
def test_cache_attention_lowers(shape, target, t_len):
    *_, num_heads, num_kv, head_dim, _ = SHAPES[shape]
    q = S((1, t_len, num_heads, head_dim), BF16)
    cache = S((4, 1, 2304, num_kv, head_dim), BF16)
    visible = S((1, t_len, 2304), jnp.bool_)
    attention = (cache_attention.cache_attention if target.platform == "cuda"
                 else cache_attention_tpu.cache_attention_tpu)
    fn = lambda q, k, v, m: attention(q, k, v, m, layer=2)              # noqa: E731
    _lowers(fn, [q, cache, cache, visible], target, 1)


def test_triton_lowering_rejects_what_triton_cannot_take():
    """The check has teeth: a block that is not a power of two fails for CUDA."""
    vocab, emb, gru, *_ = SHAPES["qwen3_8b"]
    plan = head_step.plan_step("triton", 1, vocab, emb, gru)._replace(block_v=100)
    fn = lambda p, w, b: head_step.logits_argmax(  # noqa: E731
        p, w, b, plan=plan, step=0, act_dtype=BF16)[0]
    args = [S((16, 3 * gru + emb), F32), S((emb, vocab), BF16), S((1, 16, vocab), F32)]
    with pytest.raises(Exception, match="power of 2"):
        export_for(fn, args, GPU[0])


@pytest.mark.parametrize("method", ["ar", "domino", "dominotree"])
def test_default_decode_programs_export_for_tpu(method):
    """The decode programs ``generate`` compiles (prefill and the round loop) for the golden
    fixture pair as ``load_pair`` gives it by default (bf16, fused layout, the head's decode
    layout, XLA attention and head) lower for a TPU."""
    import os

    from domino_jax.decode import loop
    from domino_jax.decode import speculative
    from domino_jax.decode.loading import load_pair
    from domino_jax.kv_cache import align_slots

    folder = os.path.join(os.path.dirname(__file__), "fixtures", "reference", "domino_shift")
    draft = None if method == "ar" else os.path.join(folder, "draft")
    target, tparams, drafter, dparams = load_pair(os.path.join(folder, "target"), draft, method)
    config = speculative.DecodeConfig(method=method, max_new_tokens=8)
    prompt, prompt_len = speculative.pad_prompts([[1, 2, 3, 4, 5]])
    capacity = align_slots(speculative.required_capacity(prompt.shape[1], config,
                                                         drafter.verify_width - 1))
    spec = lambda tree: jax.tree.map(lambda x: S(x.shape, x.dtype), tree)  # noqa: E731
    params = [spec(tparams), spec(dparams)]
    tpu = next(t for t in TARGETS if t.platform == "tpu")

    def prefill(tp, dp, p, n, key):
        return loop.prefill(target, drafter, config, tp, dp, p, n, key, capacity)

    inputs = params + [spec(prompt), spec(prompt_len), spec(jax.random.PRNGKey(0))]
    _lowers(prefill, inputs, tpu, 0)
    state = jax.eval_shape(prefill, *inputs)

    policy = jax.eval_shape(
        lambda: loop.init_policy(config, drafter, loop.loop_arms(config, drafter)[1], 1))

    def rounds(tp, dp, st, pol, limit):
        return loop.rounds(target, drafter, config, tp, dp, st, pol, limit)

    _lowers(rounds, params + [state, policy, S((), I32)], tpu, 0)
