"""domino_jax/compile_cache.py: the CLI's persistent compilation cache (``--compile-cache``).

* ``off`` leaves JAX's cache off; a folder is created and configured; a path that is a file
  is a clear error naming it (also through the CLI: exit 2 before any model is loaded);
* a cache the process already configured is kept whatever the flag says;
* the default folder follows ``$DOMINO_JAX_COMPILE_CACHE``, then ``$DOMINO_JAX_CACHE``;
* with the cache on, a compile writes an entry and the same program compiled again in a fresh
  jit loads it (the entry count does not grow) and computes the same values.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import compilation_cache

from domino_jax.compile_cache import default_compile_cache_dir, enable_compile_cache
from domino_jax.decode.__main__ import main


@pytest.fixture
def no_cache_configured():
    """Each test starts with no persistent cache configured; the process's setting (and
    JAX's cache object) are put back afterwards."""
    saved = (jax.config.jax_compilation_cache_dir,
             jax.config.jax_persistent_cache_min_compile_time_secs,
             jax.config.jax_persistent_cache_min_entry_size_bytes)
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", saved[2])
    compilation_cache.reset_cache()


def test_off_a_folder_and_a_file(no_cache_configured, tmp_path):
    assert enable_compile_cache("off") is None
    assert jax.config.jax_compilation_cache_dir is None
    not_a_folder = tmp_path / "a_file"
    not_a_folder.write_text("x")
    with pytest.raises(ValueError, match="a_file.*not a folder"):
        enable_compile_cache(str(not_a_folder))
    assert jax.config.jax_compilation_cache_dir is None
    folder = tmp_path / "nested" / "xla"
    assert enable_compile_cache(str(folder)) == str(folder)
    assert folder.is_dir() and jax.config.jax_compilation_cache_dir == str(folder)
    # configured now: a later call keeps it, whatever it is asked
    assert enable_compile_cache("off") == str(folder)
    assert enable_compile_cache(str(tmp_path / "other")) == str(folder)
    assert not (tmp_path / "other").exists()


def test_default_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("DOMINO_JAX_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("DOMINO_JAX_CACHE", str(tmp_path / "root"))
    assert default_compile_cache_dir() == str(tmp_path / "root" / "xla")
    monkeypatch.setenv("DOMINO_JAX_COMPILE_CACHE", str(tmp_path / "mine"))
    assert default_compile_cache_dir() == str(tmp_path / "mine")
    monkeypatch.delenv("DOMINO_JAX_CACHE")
    monkeypatch.delenv("DOMINO_JAX_COMPILE_CACHE")
    assert default_compile_cache_dir() == os.path.join(
        os.path.expanduser("~"), ".cache", "domino_jax", "xla")


def test_cli_rejects_a_file_as_the_cache(no_cache_configured, tmp_path, capsys):
    not_a_folder = tmp_path / "cache_file"
    not_a_folder.write_text("x")
    assert main(["--compile-cache", str(not_a_folder), "--target", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "--compile-cache" in err and "cache_file" in err


def test_a_second_compile_loads_the_entry(no_cache_configured, tmp_path):
    folder = tmp_path / "xla"
    enable_compile_cache(str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    hits = []

    def listen(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            hits.append(event)

    def program(x):           # a program no other test compiles
        return jnp.cumsum(jnp.sin(x) * 3.25 + 0.125, axis=1) @ x.T

    x = jnp.arange(24, dtype=jnp.float32).reshape(4, 6) / 7.0
    jax.monitoring.register_event_listener(listen)
    try:
        first = np.asarray(jax.jit(program)(x))
        entries = sorted(os.listdir(folder))
        assert entries and not hits, (entries, hits)
        jax.clear_caches()                     # no in-memory executable: it must come from disk
        again = np.asarray(jax.jit(program)(x))
    finally:
        jax.monitoring.unregister_event_listener(listen)
    assert hits, "the second compile did not load the cached program"
    assert sorted(os.listdir(folder)) == entries
    np.testing.assert_array_equal(first, again)
