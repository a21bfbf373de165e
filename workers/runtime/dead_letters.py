"""Decoding a poll's records, and the dead letters of those that are not valid events.

An invalid record goes to the dead-letter topic before the offsets past it
are stored, so a bad record is never lost and never holds up the good ones
behind it. In a group, the worker that owns the output partition of a
record's source partition writes its letter; the others hold it (stored with
the offsets) until the dead-letter topic shows it or they own it
(:class:`gnnstream.stream.deadletter.GroupLetters`, docs/scaling.md).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from gnnstream.graph_state.store import GraphStore
from gnnstream.stream.clients import ProducerClient, Record
from gnnstream.stream.deadletter import DeadLetter, DeadLetterWriter, GroupLetters, letter_partition
from gnnstream.stream.events import InvalidEvent
from gnnstream.workers.runtime.health import Errors, Health

__all__ = ["decode", "DeadLetters"]

logger = logging.getLogger(__name__)

LETTERS_META = "dead_letters"  # the dead letters this worker holds for other owners (stored with the offsets)


def decode(records: list[Record], read: Callable[[Any, int], list[Any]],
           max_bytes: int) -> tuple[list[Any], list[DeadLetter]]:
    """``(events, letters)``: the events of the valid ``records`` in order, and a dead letter for each other one.

    ``read(value, max_bytes)`` turns a record's value into the events the store applies (:meth:`Engine.read_event`)
    or raises :class:`InvalidEvent`.
    """
    good, letters = [], []
    for r in records:
        try:
            events = read(r.value, max_bytes)
        except InvalidEvent as exc:
            letters.append(DeadLetter.for_error(r, exc))
            continue
        good += events
    return good, letters


class DeadLetters:
    """The dead letters this worker writes, and those it holds for other workers.

    Args:
        producer: writes to the dead-letter topic.
        topic: the dead-letter topic.
        max_bytes: the largest letter the topic takes (:attr:`writer` ``.max_bytes`` may lower it later).
        store: where the held letters were stored.
        owns: whether this worker owns an output partition (:meth:`Group.owns`).
        partitions: ``() -> int``, the output topic's partitions.
        health: counts the invalid records.
        errors: transient failures to write are reported and retried there.
        stop: the worker's stop request (a write failing while stopping raises).
    """

    def __init__(self, producer: ProducerClient, topic: str, max_bytes: int, store: GraphStore,
                 owns: Callable[[int], bool], partitions: Callable[[], int], health: Health, errors: Errors,
                 stop: threading.Event):
        self.owns, self.partitions = owns, partitions
        self.health, self.errors, self._stop = health, errors, stop
        self.metrics = errors.metrics
        self.writer = DeadLetterWriter(producer, topic, max_bytes, on_skip=self._skipped)
        self.group = GroupLetters(map(DeadLetter.from_json, store.meta(LETTERS_META) or ()))
        self.catch_up = False  # took over output partitions: read the dead-letter topic to its end first

    def stored(self) -> dict[str, Any] | None:
        """The meta to store with the next offsets (the letters held), None when unchanged."""
        held = self.group.stored()
        return None if held is None else {LETTERS_META: held}

    def queue(self, letters: list[DeadLetter]) -> None:
        """Count ``letters`` and write those this worker writes (the others are held)."""
        for letter in letters:
            self.metrics.invalid.labels(letter.reason).inc()
        self.health.invalid += len(letters)
        self._deliver(self.group.sort(letters, self._owns_letter))

    def due(self) -> bool:
        """Some held letters may be this worker's to write now."""
        return bool(self.group.held) or self.catch_up

    def write_held(self) -> None:
        """Write the held dead letters whose partition this worker owns now (after a takeover, once it read
        what the previous owner wrote)."""
        due = self.group.due(self._owns_letter, 5.0 if self.catch_up else 0.0)
        self.catch_up = False
        if due:
            logger.info("writing %d dead letters held for output partitions this worker owns now", len(due))
            self._deliver(list(due))
            self.group.written(due)

    def _skipped(self, kind: str) -> None:
        """A dead letter the topic refused even cut to fit (:class:`DeadLetterWriter` logged it)."""
        self.metrics.errors.labels(f"dead_letter_{kind}").inc()

    def _owns_letter(self, letter: DeadLetter) -> bool:
        """Whether this worker writes ``letter``: it owns the output partition of its source partition."""
        return self.owns(letter_partition(letter.topic, letter.partition, self.partitions()))

    def _deliver(self, letters: list[DeadLetter]) -> None:
        """Write ``letters`` (transient errors retried with backoff, for ever; permanent ones: each letter
        cut to fit, else skipped, :meth:`DeadLetterWriter.deliver`)."""
        while letters:
            truncated = self.writer.truncated
            try:
                self.writer.deliver(letters, 30.0)
            except Exception as exc:
                self.errors.recoverable("dead_letter", exc)
                if self._stop.is_set():
                    raise
                continue
            finally:
                self.metrics.truncated.inc(self.writer.truncated - truncated)
            self.errors.cleared("dead_letter")
