"""Hand-written kernels, each beside its plain-JAX reference, chosen by an ``implementation=``
switch; asking for an unavailable kernel fails fast.

* :mod:`domino_jax.pallas.cache_attention`: split-K attention of a few query rows over the
  KV cache (Pallas Triton backend), picked by ``models.layers.attend(implementation=...)``.

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


def check_attention_implementation(name: str) -> None:
    """Raise ``ValueError`` naming ``name`` and the choices unless it is one of
    :data:`ATTENTION_IMPLEMENTATIONS`."""
    if name not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {name!r}; choose one of "
                         f"{ATTENTION_IMPLEMENTATIONS}")
