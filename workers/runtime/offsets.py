"""The stored offsets of the events topic, and the check that a partition was not reset under them.

The state is the source of truth for where the worker reads: the next offset
of every partition is stored with the events applied from it (one RocksDB
WriteBatch), and a consumer is started at the stored offsets. Before the
records of a poll are applied, every assigned partition's stored offset is
compared with its end (the high watermark of the last fetch). A stored
offset past the end means the topic or the broker was replaced; the worker
stops with :class:`OffsetResetError` unless ``on_offset_reset`` says to
resume from the partition's start or end.
"""

from __future__ import annotations

import logging
from typing import Iterable

from gnnstream.graph_state.store import GraphStore
from gnnstream.graph_state.transaction import Transaction
from gnnstream.stream.clients import ConsumerClient, PartitionKey, Record
from gnnstream.stream.errors import Limited
from gnnstream.stream.exceptions import StreamError
from gnnstream.stream.rollout import Marker
from gnnstream.workers.rollout.records import record_rollout
from gnnstream.workers.runtime.health import Errors

__all__ = ["OffsetResetError", "Offsets"]

logger = logging.getLogger(__name__)


class OffsetResetError(StreamError):
    """A stored offset is past the end of its partition: the topic or the broker was replaced.

    Nothing of that partition was applied. Attributes: ``partitions``,
    ``{(topic, partition): (stored offset, end offset)}``.
    """

    def __init__(self, message: str, partitions: dict[PartitionKey, tuple[int, int]]):
        super().__init__(message)
        self.partitions = partitions


class Offsets:
    """The next offset of each partition read, as stored in the state.

    Args:
        store: the state.
        on_offset_reset: ``fail``, ``earliest`` or ``latest`` (see the module doc).
        errors: where an offset reset is counted and reported.
    """

    def __init__(self, store: GraphStore, on_offset_reset: str, errors: Errors):
        self.store, self.on_offset_reset, self.errors = store, on_offset_reset, errors
        self.expected: dict[PartitionKey, int] = {}  # the stored next offset of each partition read
        self._limited = Limited(logger)

    def position(self) -> int:
        """The sum of the next offsets (``/healthz`` ``position``)."""
        return sum(self.expected.values())

    def stored(self, partitions: Iterable[PartitionKey]) -> dict[PartitionKey, int]:
        """The stored next offsets of ``partitions`` (a consumer's start; those without one are left out)."""
        stored = self.store.offsets()
        offsets = {tp: stored[tp] for tp in partitions if tp in stored}
        self.expected.update(offsets)
        return offsets

    def applied(self, offsets: dict[PartitionKey, int]) -> None:
        """``offsets`` were stored with the events applied before them."""
        self.expected.update(offsets)

    def store_past(self, offsets: dict[PartitionKey, int], marker: Marker | None = None) -> dict[PartitionKey, int]:
        """Store next offsets past rollout markers (with the record of having passed ``marker``, in one write);
        a stored offset never moves back. The offsets stored."""
        offsets = {tp: max(o, self.expected.get(tp, 0)) for tp, o in offsets.items()}
        tx = Transaction()
        tx.set_offsets(offsets)
        if marker is not None:
            record_rollout(tx, marker)
        self.store.commit(tx)
        self.expected.update(offsets)
        return offsets

    def check(self, consumer: ConsumerClient, records: list[Record]) -> list[Record]:
        """The records of a poll that may be applied, after checking every assigned partition's end.

        A partition that now ends before its stored offset was reset (the
        topic or the broker was replaced; kafka-python may already have moved
        its position back per ``auto_offset_reset``): per ``on_offset_reset``
        this raises :class:`OffsetResetError` before anything of the poll is
        applied, or moves the partition to its start or end (stored at once)
        and drops its records of this poll. Records before a partition's
        stored offset (a position that went back) were applied already and
        are dropped too.
        """
        resets: dict[PartitionKey, tuple[int, int]] = {}
        for tp, end in consumer.high_watermarks().items():
            stored = self.expected.get(tp)
            if stored is not None and end < stored:
                resets[tp] = (stored, end)
        if resets:
            self._reset(consumer, resets)
        expected = self.expected
        if not resets and all(r.offset >= expected.get((r.topic, r.partition), 0) for r in records):
            return records
        kept = [r for r in records
                if (r.topic, r.partition) not in resets and r.offset >= expected.get((r.topic, r.partition), 0)]
        stale = sum(1 for r in records if (r.topic, r.partition) not in resets) - len(kept)
        if stale:
            self._limited.warning("stale", "dropped %d records before their partition's stored offset (applied "
                                  "already)", stale)
        return kept

    def _reset(self, consumer: ConsumerClient, resets: dict[PartitionKey, tuple[int, int]]) -> None:
        """Stop with :class:`OffsetResetError`, or move the reset partitions per ``on_offset_reset``."""
        policy = self.on_offset_reset
        self.errors.metrics.errors.labels("offset_reset").inc(len(resets))
        if policy == "fail":
            (topic, partition), (stored, end) = min(resets.items())
            more = f" (and {len(resets) - 1} more partitions)" if len(resets) > 1 else ""
            message = (f"topic {topic!r} partition {partition}: stored offset {stored} is past the partition's end "
                       f"offset {end}{more}, so the topic or the broker was replaced; nothing was read from it. "
                       f"To go on, start again with --on-offset-reset earliest (read it from its start) or latest "
                       f"(skip to its end), or GNNSTREAM_ON_OFFSET_RESET")
            self.errors.set("offset_reset", f"offset_reset: {message}")
            raise OffsetResetError(message, resets)
        moved = {tp: 0 if policy == "earliest" else end for tp, (_, end) in resets.items()}
        for tp, (stored, end) in sorted(resets.items()):
            logger.warning("topic %r partition %d: stored offset %d is past the partition's end offset %d (the "
                           "topic or the broker was replaced); resuming at its %s offset %d (--on-offset-reset %s)",
                           tp[0], tp[1], stored, end, policy, moved[tp], policy)
        # the one deliberate move back of a stored offset (GraphStore.apply refuses it)
        tx = Transaction()
        tx.set_offsets(moved)
        self.store.commit(tx)
        self.expected.update(moved)
        consumer.seek_to(moved)
