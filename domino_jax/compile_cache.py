"""JAX's persistent compilation cache for the command-line tools.

A run of ``python -m domino_jax.decode`` spends much of its time compiling the prefill and
the round loop. XLA's persistent cache keeps each compiled program on disk, keyed by the
whole program, the compile options and the jax/jaxlib versions, so the next run with the
same shapes loads it instead (what that saves on the demo: ``docs/design.md`` §20; the
rest of a "compiling" step is tracing and lowering). A hit runs exactly what a compile
would have built.

``--compile-cache DIR|off`` picks the folder; the default is ``$DOMINO_JAX_COMPILE_CACHE``,
else ``$DOMINO_JAX_CACHE/xla`` (``~/.cache/domino_jax/xla``). A cache the process already
configured (``JAX_COMPILATION_CACHE_DIR``, or a program embedding the CLI) is left as it is.
Only programs that took >= 1 s to compile are stored (JAX's default), so the folder stays
small (a few MB for the demo).
"""

from __future__ import annotations

import os

ENV = "DOMINO_JAX_COMPILE_CACHE"
OFF = "off"


def default_compile_cache_dir() -> str:
    """``$DOMINO_JAX_COMPILE_CACHE``, else ``$DOMINO_JAX_CACHE/xla`` (``~/.cache/domino_jax/xla``)."""
    if os.environ.get(ENV):
        return os.environ[ENV]
    root = os.environ.get("DOMINO_JAX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "domino_jax")
    return os.path.join(root, "xla")


def enable_compile_cache(choice: str | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache in ``choice`` (a folder; ``None`` = the
    default above; ``"off"`` = none). Returns the folder in use (the one already configured
    if the process set one), or ``None`` when off.

    Raises ``ValueError`` naming the path when it exists and is not a folder, or cannot be
    created."""
    import jax

    configured = jax.config.jax_compilation_cache_dir
    if configured:                       # JAX_COMPILATION_CACHE_DIR or an embedding program
        return configured
    folder = default_compile_cache_dir() if choice is None else choice
    if folder == OFF:
        return None
    folder = os.path.expanduser(folder)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"--compile-cache {folder!r} exists and is not a folder "
                         f"(give a folder, or 'off')")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--compile-cache {folder!r} cannot be created: {e.strerror}") from e
    jax.config.update("jax_compilation_cache_dir", folder)
    return folder
