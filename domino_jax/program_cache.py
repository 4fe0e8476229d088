"""Compiled programs kept for reuse in a long-lived process, without exhausting its memory
mappings (``docs/design.md §24``).

XLA's CPU backend loads each compiled program's machine code into memory mappings of its own
(about three per compiled kernel: code, read-only data, data; a tiny decode loop holds 300 to
600 of them) and keeps them until the executable is freed. Linux caps a process's mappings
at ``vm.max_map_count`` (65530 by default); a compile that needs a mapping past the cap does
not raise, the process dies (segmentation fault or abort inside the compiler). So a process
that compiles distinct programs (new shapes, configs, models) and keeps every one of them
dies after ~100 to 200 programs. Two things here keep that from happening:

* :class:`ProgramCache`: a build-once, thread-safe cache that, before each build, drops its
  least recently used programs while the process holds more than :data:`MAP_BUDGET` of the
  cap (a dropped program is compiled again if asked for);
* :class:`FreshJit`: ``jax.jit`` made anew for each program. jax's own trace and compile
  caches are keyed (weakly) on the jitted function and hold their programs' executables:
  with one module-level ``jax.jit`` they kept up to 2048 programs alive after this cache had
  dropped them; keyed on a function that lives only as long as its program, they let it go.
"""

from __future__ import annotations

import collections
import functools
import gc
import threading
import time
import warnings
from typing import Any, Callable, Hashable

import jax

# Share of vm.max_map_count a process may hold before a ProgramCache drops programs: the
# rest is headroom for the next compile and for programs held elsewhere (jax.jit caches).
MAP_BUDGET = 0.5


def memory_map_count() -> int | None:
    """The mappings this process holds (lines of ``/proc/self/maps``); None off Linux."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def max_map_count() -> int | None:
    """The kernel's per-process mapping cap (``vm.max_map_count``); None off Linux."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


class ProgramCache:
    """``get(key, build) -> (value, seconds)``: ``build()``'s value cached under ``key``.

    Seconds = this call's build time, or the time it waited for another thread building the
    same key, or 0.0 on a hit. Thread-safe; each key is built once at a time (if a build
    raises, the error propagates in the building thread and a waiting thread retries the
    build itself). Before a build, least recently used entries are dropped while the
    process holds more than ``budget`` (a share of :func:`max_map_count`) mappings;
    ``budget=None`` never drops any."""

    def __init__(self, budget: float | None = MAP_BUDGET):
        self.budget = budget
        self._values: collections.OrderedDict = collections.OrderedDict()
        self._pending: dict = {}          # key -> Event, for keys some thread is building
        self._lock = threading.Lock()     # guards both dicts, never a build
        self._warned = False
        self.builds = 0                   # builds completed so far
        self.evicted = 0                  # entries dropped for mappings so far

    def __len__(self) -> int:
        with self._lock:
            return len(self._values)

    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._values

    @property
    def pending(self) -> int:
        """Builds in progress."""
        with self._lock:
            return len(self._pending)

    def clear(self) -> None:
        """Drop every entry (a program still referenced elsewhere stays alive there)."""
        with self._lock:
            self._values.clear()

    def get(self, key: Hashable, build: Callable[[], Any]) -> tuple[Any, float]:
        t0 = time.perf_counter()
        waited = False
        while True:
            with self._lock:
                if key in self._values:
                    self._values.move_to_end(key)
                    return self._values[key], (time.perf_counter() - t0) if waited else 0.0
                event = self._pending.get(key)
                if event is None:                     # ours to build
                    event = self._pending[key] = threading.Event()
                    break
            event.wait()                              # another thread is building it
            waited = True
        try:
            self.make_room()
            value = build()
            seconds = time.perf_counter() - t0
            with self._lock:
                self._values[key] = value
                self.builds += 1
        finally:
            with self._lock:
                del self._pending[key]
            event.set()
        return value, seconds

    def make_room(self) -> None:
        """Drop least recently used entries while the process holds more mappings than the
        budget allows; warn (once) if it still does with none left."""
        cap = max_map_count()
        count = memory_map_count()
        if self.budget is None or cap is None or count is None:
            return
        limit = int(self.budget * cap)
        collected = False
        while count > limit:
            with self._lock:
                if not self._values:
                    break
                self._values.popitem(last=False)
                self.evicted += 1
            count = memory_map_count()
            if count > limit and not collected:      # executables caught in cycles
                gc.collect()
                collected, count = True, memory_map_count()
        if count > limit and not self._warned:
            self._warned = True
            warnings.warn(
                f"this process holds {count} memory mappings (the kernel allows "
                f"{cap}, vm.max_map_count) with none of this cache's programs left to drop: "
                "compiled XLA CPU programs hold ~3 mappings per kernel, and a compile past "
                "the cap kills the process. Free programs held elsewhere (other domino_jax "
                "caches: speculative.clear_compiled(); jax.jit's: jax.clear_caches()) or "
                "raise vm.max_map_count.", RuntimeWarning,
                stacklevel=3)


def fresh_function(fun: Callable) -> Callable:
    """A new function object calling ``fun`` (same name and signature): ``jax.jit`` of it
    starts with empty caches that die with it."""
    return functools.wraps(fun)(lambda *args, **kwargs: fun(*args, **kwargs))


class FreshJit:
    """``jax.jit(fun, **options)`` whose ``lower`` jits a :func:`fresh_function` of ``fun``
    each call, so that jax's caches for the lowered program live only as long as the
    program itself (the module docstring says why)."""

    def __init__(self, fun: Callable, **options):
        self.fun, self.options = fun, options

    def lower(self, *args, **kwargs):
        return jax.jit(fresh_function(self.fun), **self.options).lower(*args, **kwargs)
