"""domino_jax/xla_flags.py: the default XLA flags, merged into XLA_FLAGS, and what they are
for: the adaptive loop's ``lax.switch`` branches update the KV caches in place (XLA CPU
copied the whole target cache at the end of each drafting branch without them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from domino_jax.xla_flags import DEFAULT_XLA_FLAGS, OPT_OUT, apply_default_xla_flags, merged_xla_flags

HERE = os.path.dirname(os.path.abspath(__file__))

CPU_FLAG = "xla_cpu_copy_insertion_use_region_analysis"


def test_merge_keeps_the_users_flags():
    assert merged_xla_flags("") == " ".join(f"--{k}={v}" for k, v in DEFAULT_XLA_FLAGS.items())
    mine = f"--xla_force_host_platform_device_count=8 --{CPU_FLAG}=false"
    merged = merged_xla_flags(mine)
    assert merged.startswith(mine) and f"--{CPU_FLAG}=true" not in merged
    assert "--xla_gpu_copy_insertion_use_region_analysis=true" in merged
    assert merged_xla_flags(merged) == merged                       # idempotent
    env = {"XLA_FLAGS": "--a=1"}
    assert apply_default_xla_flags(env) == merged_xla_flags("--a=1") == env["XLA_FLAGS"]
    off = {"XLA_FLAGS": "--a=1", OPT_OUT: "0"}
    assert apply_default_xla_flags(off) == "--a=1" == off["XLA_FLAGS"]
    assert CPU_FLAG in os.environ["XLA_FLAGS"]                      # set by importing domino_jax


# Compiles the adaptive DFlash loop of the tiny fixture pair and prints how many ``copy``
# instructions of the whole target KV cache's shape its optimized HLO has.
_COUNT = r"""
import re, sys
sys.path.insert(0, sys.argv[1])
import jax
jax.config.update("jax_platforms", "cpu")
from decode_helpers import fixture_models
from domino_jax.decode import speculative
from domino_jax.decode.adaptive import AdaptiveConfig
from domino_jax.decode.methods import make_drafter
from domino_jax.decode.speculative import DecodeConfig
target, params, dcfg, dparams, _ = fixture_models("dflash")
config = DecodeConfig(method="dflash", max_new_tokens=24, adaptive=AdaptiveConfig())
prep = speculative._prepare(target, params, [[3, 4, 5], [6, 7, 8, 9]], config,
                            make_drafter(dcfg, target, "dflash"), dparams, 0)
state = prep.prefill_fn(params, dparams, prep.prompt, prep.prompt_len, prep.key)
dims = ",".join(str(d) for d in state.target_cache.keys.shape)
text = prep.rounds_fn.as_text()
print("CACHE_COPIES", len(re.findall(r"= f32\[" + dims + r"\][^=]*\bcopy\(", text)))
"""


def _cache_copies(env) -> int:
    out = subprocess.run([sys.executable, "-c", _COUNT, HERE], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return int(re.search(r"CACHE_COPIES (\d+)", out.stdout).group(1))


def test_switch_branches_update_the_target_cache_in_place():
    # domino_jax's own flags come from importing it in the child; the suite's cheap backend
    # flags (tests/conftest.py) stay: copy insertion is an HLO pass, before the backend
    env = dict(os.environ, XLA_FLAGS=" ".join(
        f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] not in
        {f"--{k}" for k in DEFAULT_XLA_FLAGS}))
    assert _cache_copies(env) == 0
    assert _cache_copies(dict(env, **{OPT_OUT: "0"})) > 0          # what the flag removes
