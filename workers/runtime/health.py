"""What ``/healthz`` reports, and the worker's book of errors a retry may cure.

``/healthz`` answers 200 only while the worker consumes and has polled within
``POLL_STALE_S``, and no kind of operation has been failing for
``UNHEALTHY_AFTER_S``; otherwise 503 with a ``reason`` in words.
:class:`Errors` keeps each kind's unresolved error (``last_error`` shows the
newest), counts it in ``gnnstream_errors_total`` and paces retries with
backoff (:func:`gnnstream.stream.errors.backoff_s`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from gnnstream.stream.errors import Limited, backoff_s, classify
from gnnstream.workers.runtime.metrics import WorkerMetrics

__all__ = ["Health", "Errors", "verdict"]

logger = logging.getLogger(__name__)

POLL_STALE_S = 60.0  # /healthz turns 503 when the loop has not polled for this long
UNHEALTHY_AFTER_S = 30.0  # /healthz turns 503 when a transient error has gone on for this long


@dataclass
class Health:
    """What ``/healthz`` reports. ``status`` is one of starting, backfill, recovering,
    waiting_for_kafka, joining, consuming, draining, stopped, retired, failed; ``reason`` says
    in words what the worker waits for (None while consuming)."""

    started: float
    status: str = "starting"
    reason: str | None = "starting"
    last_poll: float = 0.0
    polls: int = 0
    batches: int = 0
    applied: int = 0
    invalid: int = 0
    published: int = 0
    kafka_attempts: int = 0
    last_error: str | None = None
    pending_marks: int | None = None  # dirty marks left when the worker stopped
    pending_outbox: int | None = None  # outbox records left undelivered when the worker stopped
    final_recomputed: int = 0  # final-layer rows computed (this worker's share of the group's)
    seconds: dict[str, float] = field(default_factory=dict)  # cumulative: apply, layers, final, write, takeover
    changed: list[int] = field(default_factory=list)  # cumulative, by layer from 1: rows whose value moved
    takeovers: int = 0  # times it took over newly assigned output partitions

    def set_status(self, status: str, reason: str | None) -> None:
        """Enter ``status`` (logged, with its reason, unless consuming or stopped)."""
        self.status, self.reason = status, reason
        if reason and status not in ("consuming", "stopped"):
            logger.info("%s", reason)

    def spent(self, phase: str, seconds: float) -> None:
        """Add to the cumulative seconds of ``phase`` (``/healthz`` ``seconds``)."""
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


class Errors:
    """The unresolved errors of each kind of operation (poll, publish, dead_letter, consumer, ...).

    Args:
        health: its ``last_error`` shows the newest unresolved error.
        metrics: ``gnnstream_errors_total`` counts every error by kind.
        stop: the worker's stop request: ends a backoff pause at once.
    """

    def __init__(self, health: Health, metrics: WorkerMetrics, stop: threading.Event):
        self.health, self.metrics, self._stop = health, metrics, stop
        self._errors: dict[str, str] = {}  # unresolved errors by kind, the newest last
        self.failing: dict[str, tuple[float, int]] = {}  # kind -> (monotonic time it began failing, attempts)
        self.limited = Limited(logger)

    def __contains__(self, kind: str) -> bool:
        return kind in self._errors

    def text(self, kind: str) -> str:
        """The unresolved error of ``kind`` (``kind`` itself when there is none)."""
        return self._errors.get(kind, kind)

    def set(self, kind: str, text: str) -> None:
        """Record ``text`` as the unresolved error of ``kind`` (the newest)."""
        self._errors.pop(kind, None)
        self._errors[kind] = text
        self.health.last_error = text

    def cleared(self, kind: str) -> None:
        """An operation of ``kind`` succeeded: its error is over (``last_error`` shows any other left)."""
        self.failing.pop(kind, None)
        if self._errors.pop(kind, None) is not None:
            self.limited.forget(kind)
            logger.info("%s works again", kind)
            self.health.last_error = next(reversed(self._errors.values()), None)

    def recoverable(self, kind: str, exc: BaseException, pause: bool = True) -> float:
        """Count and report an error of ``kind`` that a retry may cure (:mod:`gnnstream.stream.errors`: transient);
        pause with backoff (unless stopping, or not ``pause``); the pause, in seconds.

        The first failure is logged, repeats once a minute (counted); ``/healthz`` turns 503 when the errors
        of a kind have gone on for ``UNHEALTHY_AFTER_S``.
        """
        self.metrics.errors.labels(kind).inc()
        self.set(kind, f"{kind}: {exc!r}")
        since, attempts = self.failing.get(kind, (time.monotonic(), 0))
        self.failing[kind] = (since, attempts + 1)
        delay = backoff_s(attempts + 1)
        self.limited.warning(kind, "%s failed (%s), retrying with backoff: %r", kind, classify(exc).kind, exc)
        if pause:
            self._stop.wait(delay)
        return delay

    def longest_failing(self) -> tuple[str, float] | None:
        """``(kind, seconds)`` of the kind failing longest, if for ``UNHEALTHY_AFTER_S`` at least."""
        now = time.monotonic()
        failing = [(since, kind) for kind, (since, _) in list(self.failing.items())
                   if now - since >= UNHEALTHY_AFTER_S]
        if not failing:
            return None
        since, kind = min(failing)
        return kind, now - since


def verdict(health: Health, errors: Errors, stopping: bool) -> tuple[bool, str | None]:
    """``(ok, reason)`` of ``/healthz``: ok only while consuming, polling and not failing for long."""
    if health.status != "consuming":
        return False, health.reason
    if stopping:
        return False, "stopping"
    now = time.time()
    if health.last_poll and now - health.last_poll >= POLL_STALE_S:
        return False, f"no poll for {now - health.last_poll:.0f} s (a long batch, or stuck)"
    failing = errors.longest_failing()
    if failing:
        kind, seconds = failing
        return False, f"{kind} failing for {seconds:.0f} s, retrying: {errors.text(kind)}"
    return True, None
