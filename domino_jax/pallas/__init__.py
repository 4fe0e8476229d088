"""Hand-written kernels, each beside its plain-JAX reference, chosen by an ``implementation=``
switch; asking for an unavailable kernel fails fast.

* :mod:`domino_jax.pallas.cache_attention`: split-K attention of a few query rows over the
  KV cache (Pallas Triton backend), picked by ``models.layers.attend(implementation=...)``;
  :mod:`~domino_jax.pallas.cache_attention_tpu`, its Mosaic TPU variant.
* :mod:`domino_jax.pallas.head_step`: the Domino head's rollout step as two fused kernels
  (Triton and Mosaic TPU), blocked per :mod:`~domino_jax.pallas.step_plan`; :mod:`~domino_jax.pallas.tree_step`: DominoTree's frontier depth
  step; :mod:`~domino_jax.pallas.head_kernels`: the rollout and the depth step through them,
  and the switch (``load_pair(head_kernels=)``, the CLI's ``--head-kernels``).
* :mod:`domino_jax.pallas.lowering`: lowering any of them for a GPU or a TPU on the CPU.

This package's ``__init__`` imports no jax (the CLI builds its parser from it).
"""

# Values of ``models.layers.attend(implementation=)``, ``load_pair(attention=)`` and the CLI's
# ``--attention``.
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "reference", "pallas", "pallas_interpret",
                             "blockwise", "cudnn")
# The ones a long prefill's chunks may use (``PrefillConfig.attention``, ``--prefill-attention``):
# ``blockwise`` (flash-style in XLA, the default), ``xla`` (one score matrix per chunk),
# ``cudnn`` (cuDNN flash attention through ``jax.nn.dot_product_attention``; GPU, bf16/fp16).
PREFILL_ATTENTION_IMPLEMENTATIONS = ("blockwise", "xla", "cudnn")
# Prompts padded to more than this many tokens are prefilled in chunks (``PrefillConfig.chunk``,
# ``--prefill-chunk``); SGLang's chunked-prefill size on large GPUs.
DEFAULT_PREFILL_CHUNK = 2048
# Values of the Domino head / DominoTree kernel switch: ``load_pair(head_kernels=)``, the
# CLI's ``--head-kernels`` (``pallas.head_kernels.resolve_head_kernels``).
HEAD_IMPLEMENTATIONS = ("auto", "xla", "reference", "pallas", "pallas_interpret")


def check_implementation(what: str, name: str, choices: tuple[str, ...]) -> None:
    """Raise ``ValueError`` naming ``name``, ``what`` it was for and the ``choices`` unless it
    is one of them."""
    if name not in choices:
        raise ValueError(f"unknown {what} implementation {name!r}; choose one of {choices}")


def check_attention_implementation(name: str) -> None:
    """:func:`check_implementation` for the cache attention."""
    check_implementation("attention", name, ATTENTION_IMPLEMENTATIONS)
