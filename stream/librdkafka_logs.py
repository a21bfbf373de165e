"""librdkafka's log lines and global errors, logged a bounded number of times.

They go to the ``gnnstream.stream.confluent`` logger (the client's) through
:data:`_repeats`: the first of each kind is logged, repeats only at DEBUG,
and a line ``... [repeated N times in the last 60 s]`` once a minute while
they go on, so an outage of any length logs a bounded number of lines. They
wait in a client's queue until something serves it: a consumer's polls, and
for producers a shared daemon thread (:class:`_Pump`) that serves each one
every second, so they appear when they happen, not at the next send or at
close.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import weakref
from typing import Any, Callable

from confluent_kafka import KafkaError

__all__ = ["librdkafka_log", "librdkafka_error", "serve_idle_queues"]

logger = logging.getLogger("gnnstream.stream.confluent")  # the client's lines, under the client's name

_REPEAT_EVERY_S = 60.0  # a librdkafka message logged before is summarised at most this often
_PUMP_EVERY_S = 1.0  # how often the pump serves idle producers' queued logs
_MAX_KINDS = 256  # kinds of librdkafka messages remembered (the oldest are forgotten first)


_THREAD = re.compile(r"^\[thrd:[^\]]*\]: ")  # which librdkafka thread wrote the line
_VARYING = (  # the parts of a librdkafka message that change between repeats of it
    (re.compile(r", \d+ identical error\(s\) suppressed"), ""),
    (re.compile(r"\b\d+(?:\.\d+)?\s*(?:ms|s|secs?|seconds?)\b"), "#ms"),
    (re.compile(r"\b\d+/\d+ brokers\b"), "#/# brokers"),
    (re.compile(r"(?<=\s)\d+(?=\s)"), "#"),
)


def _kind(text: str) -> str:
    """What makes librdkafka messages repeats of each other: their text without the thread that wrote it,
    durations and counts (``after 0ms``, ``3 identical error(s) suppressed``, ``1/1 brokers are down``)."""
    for pattern, replacement in _VARYING:
        text = pattern.sub(replacement, text)
    return text


class _Repeats:
    """Rate limit on librdkafka's messages, per kind (:func:`_kind`), across the clients of this process.

    The first message of a kind is logged at its level; repeats within
    ``every_s`` of the last line logged for that kind only at DEBUG. When that
    time has passed (checked at each message and every second by
    :class:`_Pump`), a kind that repeated is logged once more with
    ``[repeated N times in the last T s]`` and a new window starts; a kind
    that did not is forgotten, so its next occurrence is a first again.

    librdkafka reports a failed connection twice, as a log line and as an
    error with the same text: only messages from the ``source`` of a kind's
    first one count as its repeats (the other report goes to DEBUG alone).
    Thread-safe: librdkafka's callbacks come from any thread that serves a
    client's queue.
    """

    def __init__(self, log: logging.Logger, every_s: float = _REPEAT_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self.log, self.every_s, self.clock = log, every_s, clock
        self._lock = threading.Lock()
        self._kinds: dict[str, list] = {}  # kind -> [window start, repeats, highest level, first line, source]

    def note(self, level: int, line: str, text: str, source: str = "log") -> None:
        """One message: ``line`` as logged, ``text`` the part that tells its kind, ``source`` what reported
        it (``"log"`` or ``"error"``)."""
        key = _kind(text)
        with self._lock:
            now = self.clock()
            due = self._due(now)
            seen = self._kinds.get(key)
            if seen is None:
                if len(self._kinds) >= _MAX_KINDS:
                    del self._kinds[next(iter(self._kinds))]
                self._kinds[key] = [now, 0, 0, line, source]
            elif seen[4] == source:
                seen[1] += 1
                seen[2] = max(seen[2], level)
        self._emit(due)
        if seen is None:
            self.log.log(level, "%s", line)
        else:
            self.log.debug("%s (a repeat)", line)

    def expire(self) -> None:
        """Log the summaries of the windows that ended."""
        with self._lock:
            due = self._due(self.clock())
        self._emit(due)

    def pending(self) -> bool:
        """Whether a kind is still remembered (a summary may be due later)."""
        return bool(self._kinds)

    def _due(self, now: float) -> list[tuple[int, str, int, float]]:
        due = []
        for key, seen in list(self._kinds.items()):
            start, count, level, line, source = seen
            if now - start < self.every_s:
                continue
            if count:
                due.append((level, line, count, now - start))
                self._kinds[key] = [now, 0, 0, line, source]
            else:
                del self._kinds[key]
        return due

    def _emit(self, due: list[tuple[int, str, int, float]]) -> None:
        for level, line, count, elapsed in due:
            self.log.log(level, "%s [repeated %d times in the last %.0f s]", line, count, elapsed)


_repeats = _Repeats(logger)


class _LibrdkafkaLog:
    """What librdkafka's ``logger`` setting gets: its log lines, through :data:`_repeats`."""

    def log(self, level: int, fmt: str, facility: str, client: str, text: str) -> None:
        if level < logging.INFO:
            logger.log(level, "librdkafka %s [%s]: %s", facility, client, text)
            return
        text = _THREAD.sub("", text)
        _repeats.note(level, f"librdkafka {facility} [{client}]: {text}", text)


librdkafka_log = _LibrdkafkaLog()
"""What librdkafka's ``logger`` setting of every client gets."""


def librdkafka_error(error: KafkaError) -> None:
    """librdkafka's global errors (broker down, ...): it retries by itself.

    Through :data:`_repeats` like its log lines (a failed connection is both
    a log line and an error, with the same text: one of the two is logged).
    Fatal errors are always logged.
    """
    if error.fatal():
        logger.error("librdkafka: fatal: %s (%s)", error.str(), error.name())
        return
    _repeats.note(logging.WARNING, f"librdkafka: {error.str()} ({error.name()})", error.str(), "error")


class _Pump:
    """A daemon thread that serves, every second, the queues of producers nobody else serves.

    librdkafka hands log lines and errors to Python only from a client's
    queue, which a producer serves in its ``poll`` and ``flush``: a producer
    waiting for work (the worker waiting for Kafka, a dead-letter producer
    with nothing to send) would hold them until its next send or its close,
    and then log them all at once. The thread also ends the windows of
    :data:`_repeats`. It runs while there are clients and stops by itself.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: weakref.WeakSet[Any] = weakref.WeakSet()
        self._thread: threading.Thread | None = None

    def add(self, client: Any) -> None:
        with self._lock:
            self._clients.add(client)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gnnstream-librdkafka-logs", daemon=True)
                self._thread.start()

    def discard(self, client: Any) -> None:
        with self._lock:
            self._clients.discard(client)

    def _run(self) -> None:
        while self._serve():
            time.sleep(_PUMP_EVERY_S)

    def _serve(self) -> bool:
        """Serve every client once; False when the thread should stop (its references end with the call:
        a client nobody else holds goes away)."""
        with self._lock:
            clients = list(self._clients)
            if not clients and not _repeats.pending():
                self._thread = None
                return False
        for client in clients:
            client._serve_idle()
        _repeats.expire()
        return True


serve_idle_queues = _Pump()
"""Serves the queues of the clients added to it every second (see :class:`_Pump`)."""
