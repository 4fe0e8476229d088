"""domino_jax: Domino / DominoTree speculative decoding and drafter training in JAX."""

from domino_jax.xla_flags import apply_default_xla_flags

apply_default_xla_flags()    # before jax's backend starts (domino_jax/xla_flags.py says why)
