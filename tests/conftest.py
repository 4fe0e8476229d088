"""Shared test setup: float32 CPU numerics and tiny random Hugging Face target models.

Every test runs in float32 with ``jax_default_matmul_precision="highest"`` so parity with
transformers (float32, eager attention) holds to ~1e-6. Models are built inside the tests
(never downloaded): vocab 128, hidden 64, 3 layers, 4 heads, 2 kv heads, intermediate 96.
"""

from __future__ import annotations

import os
import re
import tempfile
import zlib

# The tests' programs are tiny, so XLA's CPU compile (LLVM optimisation) is most of their time:
# compile without the expensive LLVM passes (~30% less time for the suite; the numerics are
# XLA's own either way: fast-math stays off). DOMINO_TEST_XLA_OPT=1 keeps XLA's defaults.
# Set before jax is imported, so every test process and its subprocesses (the CLI tests) use it.
if os.environ.get("DOMINO_TEST_XLA_OPT", "0") != "1":
    os.environ["XLA_FLAGS"] = " ".join(filter(None, (
        "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
        os.environ.get("XLA_FLAGS", ""))))

import jax

# DOMINO_TEST_COMPILE_CACHE=DIR: JAX's persistent compilation cache in DIR, shared by the test
# processes (``./dev test`` gives its processes one fresh folder: the same tiny programs are
# compiled in many test files). Keyed by the whole program and the compile options, so a hit
# runs exactly what a compile would have built. Unset: no persistent cache.
# The CLI's own persistent cache (domino_jax/compile_cache.py) stays off in the tests and the
# CLI subprocesses they start: nothing is written under ~/.cache.
os.environ.setdefault("DOMINO_JAX_COMPILE_CACHE", "off")
# The same folder goes to the subprocesses the tests start (the CLI, the server, training
# processes) through JAX's own environment variables: a program one of them compiled before
# (the CLI run twice, a relaunched training pair) is loaded instead of compiled again.
if os.environ.get("DOMINO_TEST_COMPILE_CACHE"):
    os.environ.update(JAX_COMPILATION_CACHE_DIR=os.environ["DOMINO_TEST_COMPILE_CACHE"],
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    jax.config.update("jax_compilation_cache_dir", os.environ["DOMINO_TEST_COMPILE_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Tolerance for parity checks: max |ours - reference| / max |reference|.
REL_TOL = 1e-5

# name -> (architecture, extra HF config kwargs). "wide" = heads*head_dim != hidden (Qwen3-4B).
TINY_GEOMETRY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=96, rms_norm_eps=1e-6,
                     max_position_embeddings=256)
VARIANTS = {
    "qwen3": ("qwen3", dict(head_dim=16, rope_theta=10000.0)),
    "qwen3_wide": ("qwen3", dict(head_dim=32, rope_theta=1e6)),
    "llama": ("llama", dict(head_dim=16, rope_theta=500000.0)),
    "llama_wide": ("llama", dict(head_dim=32, rope_theta=10000.0)),
    "qwen2": ("qwen2", dict(rope_theta=1e6)),
}


def rel_err(ours, ref) -> float:
    """``max |ours - ref| / max |ref|`` over all elements (float64)."""
    ours = np.asarray(ours, np.float64)
    ref = np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.max(np.abs(ours - ref)) / max(np.max(np.abs(ref)), 1e-30))


# Worst relative error seen per check (``what`` with digits as "#"), printed in
# pytest's terminal summary so a run states the max errors reached.
MAX_REL_ERRORS: dict[str, float] = {}


def assert_close(ours, ref, tol: float = REL_TOL, what: str = ""):
    err = rel_err(ours, ref)
    kind = re.sub(r"\d+", "#", what) or "unnamed"
    MAX_REL_ERRORS[kind] = max(MAX_REL_ERRORS.get(kind, 0.0), err)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"
    return err


def hf_config(variant: str, tied: bool):
    """A transformers config object for one of :data:`VARIANTS`."""
    import transformers

    arch, extra = VARIANTS[variant]
    cls = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig,
           "qwen2": transformers.Qwen2Config}[arch]
    kwargs = dict(TINY_GEOMETRY, **extra, tie_word_embeddings=tied)
    config = cls(**kwargs)
    config._attn_implementation = "eager"
    return config


def build_hf_model(variant: str, tied: bool, seed: int = 0):
    """A tiny random float32 transformers model with *all* weights randomised (norm weights
    around 1, biases non-zero), in eval mode with eager attention."""
    import torch
    import transformers

    torch.manual_seed(seed)
    arch = VARIANTS[variant][0]
    cls = {"qwen3": transformers.Qwen3ForCausalLM, "llama": transformers.LlamaForCausalLM,
           "qwen2": transformers.Qwen2ForCausalLM}[arch]
    model = cls(hf_config(variant, tied)).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            elif "embed_tokens" in name or "lm_head" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def hf_forward(model, tokens, attention_mask=None):
    """Run transformers: ``(logits [B,T,V], hidden_states list, layer_outputs list)``.

    ``layer_outputs[i]`` is captured with a forward hook on decoder layer ``i`` (the raw
    layer output, independent of how ``output_hidden_states`` treats the last entry).
    """
    import torch

    captured = {}

    def hook(index):
        def fn(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            captured[index] = out.detach().numpy().copy()
        return fn

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            out = model(input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long),
                        attention_mask=None if attention_mask is None else
                        torch.as_tensor(np.asarray(attention_mask), dtype=torch.long),
                        output_hidden_states=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    hidden = [h.detach().numpy() for h in out.hidden_states]
    layers = [captured[i] for i in range(len(model.model.layers))]
    return out.logits.detach().numpy(), hidden, layers


def save_hf(model, path, **kwargs) -> str:
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    return str(path)


def random_tokens(seed: int, shape, vocab: int = 128) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=shape).astype(np.int32)


_JITTED: dict = {}


def forward(model, params, tokens, positions, cache=None, block_mask=None, tap_ids=()):
    """``model.apply`` jitted once per (model, tap_ids): op-by-op dispatch is slow on CPU."""
    key = (id(model), tuple(tap_ids))
    if key not in _JITTED:
        _JITTED[key] = (model, jax.jit(lambda p, t, pos, c, m: model.apply(
            {"params": p}, t, pos, cache=c, block_mask=m, tap_ids=tuple(tap_ids))))
    return _JITTED[key][1](params, jnp.asarray(tokens), jnp.asarray(positions), cache,
                           None if block_mask is None else jnp.asarray(block_mask))


def positions_for(batch: int, length: int, start=0) -> jnp.ndarray:
    start = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (batch,))
    return start[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """Lazily built ``(variant, tied) -> (hf_model, folder)``; each saved once per session."""
    cache: dict = {}

    def get(variant: str, tied: bool):
        key = (variant, tied)
        if key not in cache:
            model = build_hf_model(variant, tied, seed=zlib.crc32(f"{variant}/{tied}".encode()) % 1000)
            folder = save_hf(model, tmp_path_factory.mktemp(f"{variant}_{'tied' if tied else 'untied'}"))
            cache[key] = (model, folder)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def float32_target():
    """``(folder) -> (config, params, model)`` with the TargetLM in float32."""
    from converters.hf_target import load_target
    from domino_jax.models.qwen3 import TargetLM

    cache: dict = {}

    def get(folder: str):
        if folder not in cache:
            config, params = load_target(folder, dtype=jnp.float32)
            cache[folder] = (config, params, TargetLM(config, dtype=jnp.float32,
                                                      param_dtype=jnp.float32))
        return cache[folder]

    return get


@pytest.fixture(scope="module", autouse=True)
def _programs_die_with_their_module():
    """After each test module, jax's caches are cleared: the programs compiled through the
    modules' own ``jax.jit`` functions (module-level ones live as long as the process) would
    otherwise pile up in one long pytest process until XLA's CPU compiler runs out of memory
    mappings and kills it (docs/design.md §24). The library's cache of decode programs is
    kept: it bounds itself."""
    yield
    jax.clear_caches()


# The most memory mappings the process held after a test, and that test: XLA's CPU programs
# hold mappings, and a compile past vm.max_map_count kills the process (docs/design.md §24).
PEAK_MAPS = [0, ""]
# ... and the decode programs built and dropped (summed over pytest-xdist's workers)
PROGRAMS = {"builds": 0, "evicted": 0}

# Under pytest-xdist (./dev test) whole files go to workers in collection order: the longest
# files go first, so that the run does not end on one of them while the other workers idle.
SLOW_FILES_FIRST = (     # by their tests' summed durations (`--durations=0`), longest first
    "test_decode_greedy.py", "test_decode_adaptive.py", "test_tree_builders.py",
    "test_head_kernels.py", "test_decode_sampling.py", "test_serve_http.py",
    "test_serving.py", "test_train_recipe.py", "test_tree_decode.py",
    "test_decode_adaptive_lookup.py", "test_console.py", "test_decode_hybrid.py",
    "test_long_prompts.py", "test_gguf_demo.py", "test_corpus.py",
    "test_bench_batch_sweep.py", "test_shards.py", "test_campaign.py", "test_train.py",
    "test_decode_ngram.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: file order kept


XDIST_CONTROLLER = [False]     # this process only hands files to pytest-xdist's workers


def pytest_configure(config):
    XDIST_CONTROLLER[0] = bool(getattr(config.option, "numprocesses", None)) and not hasattr(
        config, "workerinput")


def pytest_runtest_logfinish(nodeid, location):
    from domino_jax.program_cache import memory_map_count

    if XDIST_CONTROLLER[0]:
        return

    count = memory_map_count() or 0
    if count > PEAK_MAPS[0]:
        PEAK_MAPS[:] = [count, nodeid]


def _this_process_summary() -> dict:
    from domino_jax.decode import speculative

    return {"peak_maps": list(PEAK_MAPS), "max_rel_errors": dict(MAX_REL_ERRORS),
            "programs": {"builds": speculative._PROGRAMS.builds,
                         "evicted": speculative._PROGRAMS.evicted}}


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):          # a pytest-xdist worker: report back
        session.config.workeroutput["domino_summary"] = _this_process_summary()


@pytest.hookimpl(optionalhook=True)          # a pytest-xdist hook: absent without it
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: fold each worker's summary into this process's."""
    summary = getattr(node, "workeroutput", {}).get("domino_summary")
    if summary:
        if summary["peak_maps"][0] > PEAK_MAPS[0]:
            PEAK_MAPS[:] = summary["peak_maps"]
        for kind, err in summary["max_rel_errors"].items():
            MAX_REL_ERRORS[kind] = max(MAX_REL_ERRORS.get(kind, 0.0), err)
        for key in PROGRAMS:
            PROGRAMS[key] += summary["programs"][key]


def pytest_terminal_summary(terminalreporter):
    if not XDIST_CONTROLLER[0]:
        own = _this_process_summary()["programs"]                 # this process ran the tests
        for key in PROGRAMS:
            PROGRAMS[key] += own[key]
    if PEAK_MAPS[0]:
        from domino_jax.program_cache import max_map_count

        terminalreporter.write_sep("-", "memory mappings")
        terminalreporter.write_line(
            f"peak {PEAK_MAPS[0]} of vm.max_map_count {max_map_count()} (after {PEAK_MAPS[1]});"
            f" decode programs compiled {PROGRAMS['builds']}, dropped for mappings "
            f"{PROGRAMS['evicted']}")
    if MAX_REL_ERRORS:
        terminalreporter.write_sep("-", "max relative errors (parity checks)")
        for kind, err in sorted(MAX_REL_ERRORS.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{err:.2e}  {kind}")


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# adaptive decoding's cost table (decode/cost_model.py): never the user's ~/.cache in tests
# (inherited by the CLI subprocesses)
os.environ["DOMINO_JAX_COST_TABLE"] = os.path.join(tempfile.mkdtemp(prefix="domino_costs_"),
                                                   "cost_model.json")
