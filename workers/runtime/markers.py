"""The rollout-marker barrier: each partition is held at a marker until every partition has reached one.

``gnnstream rollout promote|rollback|retire`` appends a marker to every
partition of the events topic (:mod:`gnnstream.stream.rollout`). A partition that
reaches a new marker is held there: its records from the marker on are left
out of every poll and it is sought back to the marker whenever a poll brought
any. Once every assigned partition is held, :meth:`MarkerBarrier.reached`
names the marker; the worker publishes everything computed before it and
stores the offsets past the markers with the record of having passed it
(:meth:`MarkerBarrier.passed`), so every version switches at the same point
of the stream.
"""

from __future__ import annotations

import logging
import time

from gnnstream.stream.clients import ConsumerClient, PartitionKey, Record
from gnnstream.stream.rollout import CONTROL_KEY, Marker, marker_of, marker_rank

__all__ = ["MarkerBarrier"]

logger = logging.getLogger(__name__)

_WAIT_LOG_S = 60.0  # a warning when partitions wait this long at a rollout marker for the others


class MarkerBarrier:
    """Which partitions wait at which rollout marker.

    Args:
        rollout: the number of the last marker this state passed (one at or below it is a command run again,
            passed over).
    """

    def __init__(self, rollout: int = 0):
        self.rollout = rollout
        self.held: dict[PartitionKey, tuple[int, Marker]] = {}  # partitions held at a marker: its offset, itself
        self._held_since: float | None = None
        self._skipped: dict[PartitionKey, int] = {}  # next offsets past markers passed before, not stored yet

    def holding(self) -> bool:
        """Some partition is held at a marker."""
        return bool(self.held)

    def hold(self, consumer: ConsumerClient, records: list[Record]) -> list[Record]:
        """The records of a poll that precede the rollout markers of their partitions.

        A marker this worker passed before (a repeated command) is left out
        (:meth:`take_skipped`); a record with the marker key that does not
        decode as one goes on to the dead letters like any invalid event.
        """
        if not self.held and not any(r.key == CONTROL_KEY for r in records):
            return records
        held, seek, out = self.held, {}, []
        for r in records:
            tp = (r.topic, r.partition)
            if tp in held and r.offset >= held[tp][0]:
                seek[tp] = held[tp][0]
                continue
            marker = None
            if r.key == CONTROL_KEY:
                try:
                    marker = marker_of(r.key, r.value, r.headers)
                except ValueError:
                    marker = None
                if marker is not None and marker.rollout <= self.rollout:  # a command run again
                    self._skipped[tp] = max(self._skipped.get(tp, 0), r.offset + 1)
                    continue
            if marker is None:
                out.append(r)
                continue
            if tp in held:  # a second new marker in one poll: the first holds the partition
                continue
            held[tp] = (r.offset, marker)
            seek[tp] = r.offset
            if self._held_since is None:
                self._held_since = time.monotonic()
                logger.info("rollout marker %d (%s serves%s) reached in %s; holding it until every partition has "
                            "reached it", marker.rollout, marker.serving,
                            f", {marker.retire} retires" if marker.retire else "", sorted(held))
        if seek:
            consumer.seek_to(seek)
        return out

    def skipped(self) -> dict[PartitionKey, int]:
        """The next offsets past markers passed before (stored with the next batch, or on their own)."""
        return dict(self._skipped)

    def stored(self, offsets: dict[PartitionKey, int]) -> None:
        """``offsets`` were stored: the skips of their partitions are done."""
        for tp in offsets:
            self._skipped.pop(tp, None)

    def reached(self, consumer: ConsumerClient) -> Marker | None:
        """The marker every assigned partition is held at, or None while some have not reached one.

        Markers of an earlier number than another partition's (a command
        that did not reach every partition) are passed over: those
        partitions are sought past them. Two markers of one number (two
        commands at once): every worker picks the same one.
        """
        if not self.held:
            return None
        assigned = set(consumer.assignment())
        if not assigned or not assigned <= set(self.held):
            if self._held_since is not None and time.monotonic() - self._held_since > _WAIT_LOG_S:
                self._held_since = time.monotonic()
                logger.warning("partitions %s wait at rollout marker %d for partitions %s, which have not reached "
                               "it; if a `gnnstream rollout` command failed, run it again",
                               sorted(self.held), max(m.rollout for _, m in self.held.values()),
                               sorted(assigned - set(self.held)))
            return None
        top = max(m.rollout for _, m in self.held.values())
        orphans = {tp: offset + 1 for tp, (offset, m) in self.held.items() if m.rollout < top}
        if orphans:
            logger.warning("passing over rollout markers in %s: other partitions' next marker is %d (an earlier "
                           "command did not reach every partition)", sorted(orphans), top)
            for tp in orphans:
                del self.held[tp]
            consumer.seek_to(orphans)
            return None
        chosen = {m for _, m in self.held.values()}
        marker = max(chosen, key=marker_rank)
        if len(chosen) > 1:
            logger.warning("partitions reached different rollout markers numbered %d (two commands at once); "
                           "following the latest, %s serves", top, marker.serving)
        return marker

    def passed(self, marker: Marker) -> dict[PartitionKey, int]:
        """Release every partition past ``marker`` (reached); the next offsets past the markers, to store and
        seek to."""
        past = {tp: offset + 1 for tp, (offset, _) in self.held.items()}
        self.held.clear()
        self._held_since = None
        self.rollout = marker.rollout
        return past
