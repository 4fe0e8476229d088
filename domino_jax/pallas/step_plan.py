"""The static blocking of the Domino head step kernels (:mod:`domino_jax.pallas.head_step`)
and of DominoTree's depth step: :class:`StepPlan` from :func:`plan_step`, with
:class:`KernelTuning` overrides (``docs/design.md`` §6 says what each knob trades).

Imports no Pallas: a plan is plain static data (hashable, a ``jax.jit`` static argument).
"""

from __future__ import annotations

from typing import NamedTuple

VARIANTS = ("triton", "mosaic_tpu")


def _pow2_at_least(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


def _largest_pow2_divisor(n: int, largest: int) -> int:
    block = largest
    while block > 1 and n % block:
        block //= 2
    return block


def padded_rows(variant: str, batch: int) -> int:
    """Rows ``R`` of the carried state for ``batch`` rows (module doc)."""
    return _pow2_at_least(batch, 16) if variant == "triton" else batch


class KernelTuning(NamedTuple):
    """Overrides of a :class:`StepPlan`'s blocking (static, hashable; ``None`` = the plan's
    default, so ``KernelTuning()`` is the default plan). What each knob trades:
    ``docs/design.md`` §6.

    Kernel A (the ``W2`` product and the choice): ``block_v`` vocabulary columns per program
    (power of two on Triton, a multiple of 128 on TPU), ``emb_chunk`` the ``E``-chunk of its
    accumulation loop (power of two >= 16 dividing ``E``), ``num_warps`` / ``num_stages``
    its Triton launch (warps per program, software-pipelining stages of the loop).
    Kernel B and DominoTree's depth step (the advance): ``block_n`` ``state_proj`` columns
    per program, ``gru_chunk`` the ``G``-chunk of its loop (power of two >= 16 dividing
    ``G``), ``num_warps_b`` / ``num_stages_b`` their Triton launch, ``row_gru = 1``: at
    batch 1 the GRU runs on the one live row (``[1, gru_chunk]`` tiles broadcast into the
    dot's ``R`` rows) instead of all ``R`` padded rows (other batches: ignored);
    ``split_advance = 1``: the advance's programs each make one ``gru_chunk`` of the new
    state (no program repeats the GRU) and XLA makes its ``[W_hh | W1_s]`` products after
    the kernel (:func:`products_of`; one more launch). The Mosaic TPU variant takes
    ``block_v`` and ``block_n`` only; the other fields are Triton's.
    """

    block_v: int | None = None
    emb_chunk: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    block_n: int | None = None
    gru_chunk: int | None = None
    num_warps_b: int | None = None
    num_stages_b: int | None = None
    row_gru: int | None = None
    split_advance: int | None = None


def _is_pow2(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def check_tuning(tuning: KernelTuning) -> None:
    """``ValueError`` naming the field and value of ``tuning`` that no plan could take
    (the shape-dependent checks are :func:`plan_step`'s)."""
    if not isinstance(tuning, KernelTuning):
        raise ValueError(f"kernel tuning must be a KernelTuning, got {tuning!r}")
    for name, value in tuning._asdict().items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"kernel tuning {name}={value!r}: must be a positive int")
        if name.startswith("num_warps") and value not in (1, 2, 4, 8, 16):
            raise ValueError(f"kernel tuning {name}={value}: must be 1, 2, 4, 8 or 16")
        if name.startswith("num_stages") and value > 8:
            raise ValueError(f"kernel tuning {name}={value}: must be 1-8")
        if name in ("row_gru", "split_advance") and value != 1:
            raise ValueError(f"kernel tuning {name}={value}: must be 1 (or unset)")


class StepPlan(NamedTuple):
    """Static blocking of one head step (:func:`plan_step`; :class:`KernelTuning` says what
    each knob trades)."""

    variant: str
    batch: int
    rows: int           # R
    vocab: int          # V (columns of W2 and of the base logits)
    emb_dim: int        # E
    gru_dim: int        # G
    block_v: int        # vocabulary columns per kernel-A program / block
    num_blocks: int     # ceil(V / block_v)
    part_rows: int      # rows of the partials arrays (>= num_blocks; Triton: a power of two)
    emb_chunk: int      # E-chunk of kernel A's accumulation loop (Triton)
    block_n: int        # state_proj columns per kernel-B program / block
    num_col_blocks: int  # ceil((3G + E) / block_n)
    gru_chunk: int      # G-chunk of kernel B's loop (Triton)
    num_warps: int      # kernel A's Triton launch
    num_stages: int = 2
    num_warps_b: int = 4     # kernel B's and the depth step's Triton launch
    num_stages_b: int = 2
    row_gru: bool = False    # batch 1: kernel B's GRU on the live row only (Triton)
    split_advance: bool = False  # the advance's GRU in the kernel, its products in XLA


def supported(variant: str, batch: int, vocab: int, emb_dim: int, gru_dim: int) -> str | None:
    """``None`` if :func:`plan_step` takes these shapes, else the reason it does not."""
    if variant not in VARIANTS:
        return f"unknown kernel variant {variant!r} (one of {VARIANTS})"
    width = emb_dim + 3 * gru_dim
    if vocab * 3 * gru_dim >= 2 ** 31:
        return f"gate table of {vocab} x {3 * gru_dim} exceeds int32 offsets"
    if variant == "triton":
        if emb_dim % 16 or gru_dim % 16:
            return f"E = {emb_dim} and G = {gru_dim} must be multiples of 16 (Triton dot)"
        if width % 16:
            return f"E + 3G = {width} is not a multiple of 16"
        if batch > 64:
            return f"batch {batch} > 64 rows"
    else:
        if gru_dim % 128:
            return f"G = {gru_dim} is not a multiple of 128 (TPU lanes)"
        if vocab < 128:
            return f"vocabulary {vocab} < 128"
    return None


def _chunk(name: str, value: int | None, dim_name: str, dim: int, default: int) -> int:
    """A Triton loop chunk: ``value`` (a power of two >= 16 dividing ``dim``) or the largest
    power of two <= ``default`` dividing ``dim``."""
    if value is None:
        return _largest_pow2_divisor(dim, default)
    if not _is_pow2(value) or value < 16 or dim % value:
        raise ValueError(f"kernel tuning {name}={value}: must be a power of two >= 16 "
                         f"dividing {dim_name} = {dim}")
    return value


def plan_step(variant: str, batch: int, vocab: int, emb_dim: int, gru_dim: int,
              block_v: int | None = None, block_n: int | None = None,
              num_warps: int | None = None,
              tuning: KernelTuning | None = None) -> StepPlan:
    """The :class:`StepPlan` for these shapes; ``ValueError`` naming the reason when
    :func:`supported` rejects them or a given block does not fit. ``tuning`` overrides
    the defaults (its ``block_v`` / ``block_n`` / ``num_warps`` win over the arguments)."""
    reason = supported(variant, batch, vocab, emb_dim, gru_dim)
    if reason is not None:
        raise ValueError(f"Domino head step kernel ({variant}): {reason}")
    tuning = KernelTuning() if tuning is None else tuning
    check_tuning(tuning)
    block_v = tuning.block_v or block_v
    block_n = tuning.block_n or block_n
    width = emb_dim + 3 * gru_dim
    rows = padded_rows(variant, batch)
    if variant == "triton":
        block_v = block_v or 512
        block_n = block_n or _largest_pow2_divisor(width, 32)
        if not _is_pow2(block_v) or not _is_pow2(block_n) or block_n < 16:
            raise ValueError(f"Triton blocks must be powers of two (block_n >= 16): "
                             f"block_v {block_v}, block_n {block_n}")
        if width % block_n:
            raise ValueError(f"block_n {block_n} does not divide E + 3G = {width}")
        num_blocks = -(-vocab // block_v)
        part_rows = _pow2_at_least(num_blocks)
        emb_chunk = _chunk("emb_chunk", tuning.emb_chunk, "E", emb_dim, 64)
        gru_chunk = _chunk("gru_chunk", tuning.gru_chunk, "G", gru_dim, 128)
    else:
        block_v = block_v or 2048
        if block_n is None:              # two blocks of whole 128-lane groups
            lane_groups = -(-width // 128)
            block_n = 128 * -(-lane_groups // 2)
        if block_v % 128 or block_n % 128:
            raise ValueError(f"TPU blocks must be multiples of 128 lanes: block_v {block_v}, "
                             f"block_n {block_n}")
        block_v = min(block_v, -(-vocab // 128) * 128)
        num_blocks = -(-vocab // block_v)
        part_rows = 1
        emb_chunk, gru_chunk = emb_dim, gru_dim
    return StepPlan(variant, batch, rows, vocab, emb_dim, gru_dim, block_v, num_blocks,
                    part_rows, emb_chunk, block_n, -(-width // block_n), gru_chunk,
                    tuning.num_warps or num_warps or 4, tuning.num_stages or 2,
                    tuning.num_warps_b or 4, tuning.num_stages_b or 2, bool(tuning.row_gru),
                    bool(tuning.split_advance))
