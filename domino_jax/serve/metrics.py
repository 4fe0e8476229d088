"""The server's ``GET /metrics``: Prometheus counters and gauges (``prometheus_client``).

Every name starts with ``domino_``. The engine (:mod:`domino_jax.serve.engine`) calls the
hooks below from its thread; the HTTP layer counts rejected requests. What each means:

* ``domino_requests_total{reason}``: requests finished, by finish reason (``stop``,
  ``length``, ``cancelled``: a client that went away or a shutdown, ``error``);
  ``domino_requests_rejected_total{status}``: refused before decoding (400, 429, 503);
* ``domino_prompt_tokens_total``, ``domino_generation_tokens_total``: tokens in and out;
* ``domino_tokens_per_second``: generated tokens over the seconds the engine was busy
  (prefills and round loops), since start;
* ``domino_queue_length`` (requests waiting for a slot), ``domino_live_slots``,
  ``domino_slots``;
* ``domino_mean_accepted_tokens_per_round``: tokens committed per round (accepted drafts +
  the bonus token) over every finished request's rounds; from its counters
  ``domino_committed_tokens_total`` and ``domino_row_rounds_total``;
* ``domino_adaptive_arm_rounds_total{arm}``: loop rounds run by each adaptive arm
  (``ar``, ``draft4``, ``lookup4``, ...; absent without adaptive widths);
* ``domino_prefill_seconds_total``, ``domino_decode_seconds_total`` (round loops),
  ``domino_loop_rounds_total``, ``domino_compile_seconds_total``.
"""

from __future__ import annotations

import threading

from prometheus_client import (CollectorRegistry, Counter, Gauge, disable_created_metrics,
                               generate_latest)
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)


class Metrics:
    """The server's metrics in a registry of their own (several servers in one process do
    not share them)."""

    def __init__(self):
        disable_created_metrics()          # no *_created series: counters and gauges only
        self.registry = r = CollectorRegistry()
        self.requests = Counter("domino_requests", "Requests finished, by finish reason",
                                ["reason"], registry=r)
        self.rejected = Counter("domino_requests_rejected", "Requests refused before "
                                "decoding, by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("domino_prompt_tokens", "Prompt tokens prefilled",
                                     registry=r)
        self.generation_tokens = Counter("domino_generation_tokens", "Tokens generated",
                                         registry=r)
        self.committed = Counter("domino_committed_tokens", "Tokens committed by the rounds "
                                 "of finished requests", registry=r)
        self.row_rounds = Counter("domino_row_rounds", "Rounds finished requests were live",
                                  registry=r)
        self.arm_rounds = Counter("domino_adaptive_arm_rounds", "Loop rounds per adaptive arm",
                                  ["arm"], registry=r)
        self.prefill_seconds = Counter("domino_prefill_seconds", "Seconds in prefills",
                                       registry=r)
        self.decode_seconds = Counter("domino_decode_seconds", "Seconds in round loops",
                                      registry=r)
        self.loop_rounds = Counter("domino_loop_rounds", "Rounds of the slots' loop",
                                   registry=r)
        self.compile_seconds = Counter("domino_compile_seconds", "Seconds compiling programs",
                                       registry=r)
        self.queue_length = Gauge("domino_queue_length", "Requests waiting for a slot",
                                  registry=r)
        self.live_slots = Gauge("domino_live_slots", "Slots decoding a request", registry=r)
        self.slots = Gauge("domino_slots", "Slots of the batch", registry=r)
        self.tokens_per_second = Gauge("domino_tokens_per_second", "Generated tokens per "
                                       "busy second (prefills + round loops), since start",
                                       registry=r)
        self.tau = Gauge("domino_mean_accepted_tokens_per_round", "Tokens committed per "
                         "round over finished requests", registry=r)
        self._lock = threading.Lock()
        self._busy = self._tokens = self._committed = self._rounds = 0.0

    # ---- engine hooks --------------------------------------------------------------------

    def on_prefill(self, seconds: float, requests: int, prompt_tokens: int) -> None:
        self.prefill_seconds.inc(seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self._busy_for(seconds)

    def on_loop(self, seconds: float, rounds: int) -> None:
        self.decode_seconds.inc(seconds)
        self.loop_rounds.inc(rounds)
        self._busy_for(seconds)

    def on_arms(self, arm_rounds: dict) -> None:
        for arm, n in arm_rounds.items():
            if n > 0:
                self.arm_rounds.labels(arm=arm).inc(n)

    def on_rounds(self, rounds: int, committed: int) -> None:
        """One finished request: the rounds it was live and the tokens they committed."""
        self.row_rounds.inc(rounds)
        self.committed.inc(committed)
        with self._lock:
            self._rounds += rounds
            self._committed += committed
            if self._rounds:
                self.tau.set(self._committed / self._rounds)

    def on_finish(self, reason: str, tokens: int) -> None:
        self.requests.labels(reason=reason).inc()
        self.generation_tokens.inc(tokens)
        with self._lock:
            self._tokens += tokens
            self._rate()

    def on_compile(self, seconds: float) -> None:
        self.compile_seconds.inc(seconds)

    def set_load(self, waiting: int, live: int, slots: int) -> None:
        self.queue_length.set(waiting)
        self.live_slots.set(live)
        self.slots.set(slots)

    # ---- the HTTP layer ------------------------------------------------------------------

    def on_rejected(self, status: int) -> None:
        self.rejected.labels(status=str(status)).inc()

    def text(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def _busy_for(self, seconds: float) -> None:
        with self._lock:
            self._busy += seconds
            self._rate()

    def _rate(self) -> None:
        if self._busy > 0:
            self.tokens_per_second.set(self._tokens / self._busy)
