"""The cost model of adaptive speculation: milliseconds per round of each arm, per device and
shape (:mod:`domino_jax.decode.adaptive`).

On first use at a (device, models, method, batch, cache capacity, arms) key, a short
calibration runs every arm's round on copies of the real post-prefill state (the same
compiled adaptive loop with the arm forced), ``reps`` times interleaved, and takes the fastest
ms per round; the result is cached in a JSON table (default
``~/.cache/domino_jax/cost_model.json``; the ``DOMINO_JAX_COST_TABLE`` environment variable
or ``CostModel(path=...)`` names another file). A table written elsewhere (e.g. by
``benchmarks/bench_batch_sweep.py`` on a GPU) is read the same way; fixed costs
(``CostModel(costs=...)``) skip the table (tests, forced experiments).

Table format: ``{"version": 2, "entries": {key: {"widths": [...], "ms": [...], "date": ...,
"rounds": n, "reps": r, "spread": [...]}}}``.
``widths`` are the adaptive loop's arm codes (:func:`domino_jax.decode.adaptive.resolve_widths`):
drafter arms ``>= 0``, prompt-lookup arms ``-k`` (:mod:`domino_jax.decode.lookup_arm`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import tempfile
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from domino_jax.decode.lookup_arm import is_lookup, lookup_name

log = logging.getLogger("domino_jax.decode")
TABLE_VERSION = 2   # 2: timings less the call's fixed cost (calibrate)


def default_table_path() -> str:
    return os.environ.get("DOMINO_JAX_COST_TABLE") or os.path.join(
        os.path.expanduser("~"), ".cache", "domino_jax", "cost_model.json")


def cost_key(target, drafter, config, widths: Sequence[int], batch: int, capacity: int) -> str:
    """What a round's cost depends on: the device, both models' shapes and dtypes, the
    method and its options, sampling (greedy or not) and the verification rule, the batch,
    the cache capacity and the arm widths."""
    device = jax.devices()[0]
    t, d = target.config, drafter.config
    fixed = getattr(drafter.options, "fixed", None)     # auto widths key as the widest
    drafter_options = fixed() if fixed is not None else drafter.options
    options = [f"{f.name}={getattr(drafter_options, f.name)}"
               for f in dataclasses.fields(drafter_options)]
    return "|".join([
        f"{device.platform}:{device.device_kind}",
        f"target={t.architecture}:{t.num_layers}x{t.hidden_size}:{t.intermediate_size}:"
        f"{t.num_heads}/{t.num_kv_heads}:{t.vocab_size}:{jnp.dtype(target.dtype).name}",
        f"draft={d.num_layers}x{d.hidden_size}:block{d.block_size}:gru{d.gru_hidden_dim}",
        f"{drafter.method}:" + ",".join(options),
        f"T={'0' if config.sampling.greedy else '>0'}:"
        f"{getattr(config.verify, 'name', config.verify)}",
        f"B={batch}", f"C={capacity}", "widths=" + ",".join(map(str, widths))])


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            table = json.load(f)
    except FileNotFoundError:
        return {"version": TABLE_VERSION, "entries": {}}
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cost table {path}: not a readable JSON file ({e})") from e
    if not isinstance(table, dict) or not isinstance(table.get("entries"), dict):
        raise ValueError(f"cost table {path}: expected an object with an 'entries' object")
    if table.get("version") != TABLE_VERSION:   # measured another way: calibrate again
        log.info("cost table %s has version %s, not %s: its entries are recalibrated", path,
                 table.get("version"), TABLE_VERSION)
        return {"version": TABLE_VERSION, "entries": {}}
    return table


def _save(path: str, key: str, entry: dict) -> None:
    """Merge ``entry`` into the table at ``path`` (atomic replace; failures only logged)."""
    try:
        table = _load(path)
        table["entries"][key] = entry
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except (OSError, ValueError) as e:
        log.warning("could not write the cost table %s: %s", path, e)


def calibrate(run_forced: Callable[[int, int], tuple[float, int]], num_arms: int,
              rounds: int, reps: int,
              kinds: Sequence[int] | None = None) -> tuple[list[float], list[list[float]]]:
    """The fastest of ``reps`` timings (ms per round) of each arm (arms sorted by width
    within each kind: ``kinds[a]``, e.g. drafter arms 0 and lookup arms 1; default one kind),
    made non-decreasing with the width within each kind and never below arm 0's (the AR
    step; :func:`floor_at_ar`). ``run_forced(arm, rounds) -> (seconds, rounds run)`` runs
    the loop with ``arm`` forced on a fresh copy of the state; arms are interleaved rep by rep (a shared machine's load drifts), after one untimed
    warm-up call. Returns ``(costs, samples)``.

    Each timing first loses the call's fixed cost (launch, host sync), the fastest of
    ``reps`` calls that run no round (``run_forced(0, 0)``): divided over a few rounds it
    would lift every arm by the same milliseconds and squeeze their ratios
    (``docs/design.md`` §10)."""
    run_forced(0, 1)
    overhead = min(run_forced(0, 0)[0] for _ in range(max(reps, 1)))
    samples: list[list[float]] = [[] for _ in range(num_arms)]
    for _ in range(reps):
        for arm in range(num_arms):
            seconds, ran = run_forced(arm, rounds)
            if ran > 0:      # (never below a tenth of the raw time: the overhead is noisy)
                samples[arm].append(1e3 * max(seconds - overhead, 0.1 * seconds) / ran)
    # the fastest timing of each arm: a busy machine only ever slows a run down
    fastest = [min(s) if s else float("nan") for s in samples]
    if any(m != m for m in fastest):     # an arm never ran (rows finished): rows-linear guess
        fastest = [float(a + 1) for a in range(num_arms)]
    # A wider arm does all a narrower one does and more: a lower time is load noise, which
    # must not make a wide arm look cheap. Costs never fall with the width.
    kinds = list(kinds) if kinds is not None else [0] * num_arms
    monotone = [max(f for f, k in zip(fastest[:i + 1], kinds) if k == kinds[i])
                for i in range(num_arms)]
    return floor_at_ar(monotone), samples


def floor_at_ar(costs: Sequence[float]) -> list[float]:
    """Every arm is an AR step's verify and bookkeeping plus more rows, so none costs less
    than arm 0: a lower calibrated time is load noise, and an arm that looks free can hold
    the policy away from the drafter (``docs/design.md`` §10). Applied to calibrations and
    to stored tables."""
    return [float(costs[0])] + [max(float(c), float(costs[0])) for c in costs[1:]]


@dataclasses.dataclass
class CostModel:
    """Where the per-arm round costs come from (see the module doc).

    ``costs``: fixed ms per round per arm (no table, no calibration). Otherwise the table
    at ``path`` (default :func:`default_table_path`) is read; a missing key (or
    ``recalibrate``) runs :func:`calibrate` with ``rounds`` rounds per timing and ``reps``
    repetitions and stores the result.
    """

    path: str | None = None
    costs: Sequence[float] | None = None
    recalibrate: bool = False
    rounds: int = 4
    reps: int = 3

    def resolve(self, key: str, widths: Sequence[int],
                run_forced: Callable[[int, int], tuple[float, int]]):
        """``(costs [A], seconds spent calibrating, source)`` for the arms ``widths``."""
        if self.costs is not None:
            costs = [float(c) for c in self.costs]
            if len(costs) != len(widths) or not all(c > 0 for c in costs):
                raise ValueError(f"cost model: need one positive cost (ms per round) per arm "
                                 f"{tuple(widths)}, got {costs}")
            return costs, 0.0, "given"
        path = self.path or default_table_path()
        if not self.recalibrate:
            entry = _load(path)["entries"].get(key)
            if entry is not None and list(entry.get("widths", [])) == list(widths):
                return floor_at_ar(entry["ms"]), 0.0, f"table {path}"
        t0 = time.perf_counter()
        # lookup arms (codes < 0, decode/lookup_arm.py) are not wider drafter arms
        costs, samples = calibrate(run_forced, len(widths), self.rounds, self.reps,
                                   kinds=[int(w < 0) for w in widths])
        seconds = time.perf_counter() - t0
        _save(path, key, {"widths": list(widths), "ms": costs,
                          "spread": [[min(s), max(s)] if s else None for s in samples],
                          "rounds": self.rounds, "reps": self.reps,
                          "date": datetime.datetime.now().isoformat(timespec="seconds")})
        log.info("%s", calibration_line(widths, costs, seconds))
        log.debug("[cost model] key %s, stored in %s", key, path)
        return costs, seconds, "calibrated"


def calibration_line(widths: Sequence[int], costs: Sequence[float], seconds: float) -> str:
    """The one line a calibration prints, e.g. ``[cost model] calibrated widths 0/2/4/8/16
    on cpu in 19.8 s (ms per round: 212 225 260 317 429)`` (the table key, which names the
    models and shapes, goes to the debug log). A lookup arm (code ``-K``) reads ``lookupK``."""
    names = [lookup_name(w) if is_lookup(w) else str(w) for w in widths]
    return (f"[cost model] calibrated widths {'/'.join(names)} on "
            f"{jax.devices()[0].platform} in {seconds:.1f} s (ms per round: "
            + " ".join(f"{c:.0f}" for c in costs) + ")")
