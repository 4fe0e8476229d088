"""domino_jax/program_cache.py: compiled programs in a long-lived process stay within its
memory-mapping cap (``vm.max_map_count``; ``docs/design.md §24``).

* ``ProgramCache`` drops its least recently used programs while the process holds more
  mappings than its budget, and warns once when nothing is left to drop (fake counters);
* ``FreshJit``: a program compiled through it and dropped gives its mappings back (jax's own
  caches do not keep it);
* a long process: with all but a few thousand of its mappings taken (standing in for the
  programs a server or a training run accumulates), a child process compiles and runs many
  distinct decode programs. Before the cache was bounded it died in the compiler
  (segmentation fault) once the mappings ran out; now it drops old programs, survives, and a
  dropped program compiled again decodes the same tokens.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import pytest

from domino_jax import program_cache
from domino_jax.program_cache import FreshJit, ProgramCache, max_map_count, memory_map_count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
linux_only = pytest.mark.skipif(memory_map_count() is None or max_map_count() is None,
                                reason="needs /proc/self/maps and vm.max_map_count")


def fake_process(monkeypatch, cache: ProgramCache, base: int, per_entry: int, cap: int):
    """Mapping counts of a pretend process: ``base`` plus ``per_entry`` per cached program."""
    monkeypatch.setattr(program_cache, "max_map_count", lambda: cap)
    monkeypatch.setattr(program_cache, "memory_map_count",
                        lambda: base + per_entry * len(cache._values))


def test_drops_least_recently_used_past_the_budget(monkeypatch):
    cache = ProgramCache(budget=0.5)
    fake_process(monkeypatch, cache, base=100, per_entry=100, cap=1000)   # limit 500
    built = []
    build = lambda key: (lambda: built.append(key) or f"program {key}")
    for key in range(5):                   # 100 + 4 x 100 = 500: nothing dropped yet
        assert cache.get(key, build(key))[0] == f"program {key}"
    assert len(cache) == 5 and cache.evicted == 0
    assert cache.get(0, build(0)) == ("program 0", 0.0)      # a hit: 0 is now the newest
    cache.get(5, build(5))                 # 600 > 500 before the build: drop the oldest (1)
    assert 1 not in cache and 0 in cache and len(cache) == 5 and cache.evicted == 1
    cache.get(1, build(1))                 # dropped, so built again
    assert built == [0, 1, 2, 3, 4, 5, 1] and cache.builds == 7
    assert 2 not in cache                  # the next oldest made room


def test_warns_once_when_nothing_is_left_to_drop(monkeypatch):
    cache = ProgramCache(budget=0.5)
    fake_process(monkeypatch, cache, base=600, per_entry=100, cap=1000)   # over by itself
    with pytest.warns(RuntimeWarning, match="vm.max_map_count"):
        cache.get("a", lambda: 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.get("b", lambda: 2)[0] == 2
    assert len(cache) == 1 and "b" in cache and cache.evicted == 1


def test_no_budget_never_drops(monkeypatch):
    cache = ProgramCache(budget=None)
    fake_process(monkeypatch, cache, base=10_000, per_entry=100, cap=1000)
    for key in range(4):
        cache.get(key, lambda: key)
    assert len(cache) == 4 and cache.evicted == 0


def _loop(i, x, w):
    def body(c):
        k, h = c
        return k + 1, jnp.tanh(h @ w + i) * jax.nn.softmax(h, -1)
    return jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1].sum()


@linux_only
def test_fresh_jit_programs_give_their_mappings_back():
    jit = FreshJit(_loop, static_argnums=0)
    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
    jit.lower(0, x, w).compile()           # one-time mappings (the backend's, jax's own)
    gc.collect()
    before = memory_map_count()
    programs = [jit.lower(i, x, w).compile() for i in range(1, 9)]
    held = memory_map_count() - before
    assert held >= 8 * 3, held             # each program holds mappings of its own
    assert float(programs[0](x, w)) == float(_loop(1, x, w))
    del programs
    gc.collect()
    assert memory_map_count() - before < held // 4, (memory_map_count() - before, held)


CHILD = r"""
import json, mmap, sys
sys.path.insert(0, sys.argv[1])
from decode_helpers import tiny_target
from domino_jax.decode import speculative
from domino_jax.decode.speculative import DecodeConfig, generate
from domino_jax.program_cache import max_map_count, memory_map_count

headroom, budget_room, programs = (int(a) for a in sys.argv[2:5])
target, params = tiny_target(seed=3, vocab=32)
drafter = dparams = None                     # AR: the cache is the same for every method
config = DecodeConfig(method="ar", max_new_tokens=8)
prompt = lambda rows: [[3 + r, 4, 5, 6][: 1 + r % 4] for r in range(rows)]
first = generate(target, params, prompt(1), config, drafter, dparams).tokens
cap = max_map_count()
# all but `headroom` of the cap taken (4 KiB shared anonymous maps never merge)
ballast = [mmap.mmap(-1, 4096) for _ in range(cap - headroom - memory_map_count())]
speculative._PROGRAMS.budget = (cap - headroom + budget_room) / cap
peak = 0
for rows in range(2, 2 + programs):          # a distinct program (prefill + loop) per batch
    generate(target, params, prompt(rows), config, drafter, dparams)
    peak = max(peak, memory_map_count())
again = generate(target, params, prompt(1), config, drafter, dparams)
print(json.dumps(dict(cap=cap, peak=peak, evicted=speculative._PROGRAMS.evicted,
                      recompiled=again.compile_seconds > 0, same=again.tokens == first)))
"""


@linux_only
@pytest.mark.slow
def test_long_process_survives_many_programs_near_the_cap():
    cap = max_map_count()
    if cap > 4_000_000:
        pytest.skip(f"vm.max_map_count {cap}: too many mappings to take")
    # 1000 mappings left; the cache drops programs past 400 of them; 6 distinct AR programs
    # (~290 mappings each on a CPU) need more than the 1000 if all are kept
    proc = subprocess.run([sys.executable, "-c", CHILD, os.path.dirname(__file__), "1000",
                           "400", "6"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["evicted"] > 0 and out["recompiled"] and out["same"], out
    assert out["peak"] < out["cap"], out
