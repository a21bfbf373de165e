"""Which nodes this worker publishes: its share of the output topic, handed out by a consumer group.

Every worker of a group keeps the whole graph and every layer but the last
(:mod:`workers.worker` reads every partition of the events topic itself).
The final layer and the publishing are sharded by the partitions of the
output topic: a node belongs to the partition its id maps to under Kafka's
default partitioner (:mod:`stream.partitioning`), which is also the
partition its messages land in. :class:`Ownership` is a member of the Kafka
consumer group ``group`` subscribed to the output topic. It reads no
records (its partitions stay paused); the group protocol hands out the
partitions, and moves them on join, leave and failure.

Epochs: a worker that is assigned partitions reads the group's committed
offsets of every partition of the topic (and the highest epoch its state
recorded), adds one to the largest, and commits that to the partitions it
was assigned before it publishes anything of them. That number is its
*epoch* as their owner, and every version it publishes for their nodes is
at least ``epoch << 32`` (:meth:`workers.engine.Engine.own`). One owner at
a time holds a partition, so each owner's epoch exceeds every earlier one's,
and a consumer that keeps the highest version per node ends with the newest
owner's values.

A member polls from a thread of its own, so that the worker's long batches
never delay a heartbeat or a rebalance. The worker takes the changes
between two batches (:meth:`Ownership.take`). A revocation waits, at most
``revoke_wait_s``, until the worker has stopped publishing the revoked
partitions (:meth:`Ownership.done`): only then may the group hand them to
another worker. docs/scaling.md states what a consumer sees meanwhile.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from gnnstream.stream.backends import open_consumer
from gnnstream.stream.clients import PartitionKey
from gnnstream.stream.errors import Limited, classify

__all__ = ["Ownership"]

logger = logging.getLogger(__name__)
_limited = Limited(logger)  # the same failure while Kafka is away: once, then once a minute

_POLL_S = 0.2  # one member poll: rebalance callbacks run inside it
_RETRY_S = 1.0  # after a failed poll or a failed join


class Ownership:
    """This worker's membership in the group that shares out the output topic's partitions.

    Args:
        client: Kafka client (see :mod:`stream.backends`).
        bootstrap: ``host:port[,host:port...]``.
        topic: the output topic.
        group: the consumer group of the workers that share the output.
        session_timeout_ms: the member's session timeout (a dead worker's
            partitions move after about this long).
        revoke_wait_s: the longest a revocation waits for :meth:`done`.
        floor: the highest epoch this worker's state has held a partition
            at: a claim goes above it even if the group's committed offsets
            were lost (a group left empty longer than the broker's
            ``offsets.retention.minutes``).
    """

    def __init__(self, client: str, bootstrap: str, topic: str, group: str, *, session_timeout_ms: int = 6000,
                 revoke_wait_s: float = 3.0, floor: int = 0, **config: Any):
        self.topic, self.group = topic, group
        self._open = lambda: open_consumer(client, bootstrap, topic, group, session_timeout_ms=session_timeout_ms,
                                           on_assign=self._assigned, on_revoke=self._revoked, paused=True, **config)
        self._revoke_wait_s = revoke_wait_s
        self._floor = floor
        self._cond = threading.Condition()
        self._assignment: tuple[set[int], int] | None = None  # the newest assignment not yet taken, and its epoch
        self._claiming: set[int] | None = None  # assigned, epochs not yet committed (the member's thread)
        self._removed: set[int] = set()  # revoked since the last take()
        self._asked = 0  # revocations made
        self._done = 0  # revocations the worker has acted on
        self._closing = threading.Event()
        self.joined = threading.Event()  # set at the first assignment (even of no partitions)
        self._thread = threading.Thread(target=self._run, name="ownership", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the member's thread
    def _run(self) -> None:
        consumer = None
        while not self._closing.is_set():
            try:
                if consumer is None:
                    consumer = self._open()
                consumer.poll_batch(1, _POLL_S)
                if self._claiming is not None:
                    self._claim(consumer)
            except Exception as exc:  # Kafka unavailable: the group moves our partitions; rejoin when it is back
                _limited.warning("retry", "ownership group %s: %s %r; retrying", self.group, classify(exc).kind, exc)
                self._closing.wait(_RETRY_S)
        if consumer is not None:
            try:
                consumer.close()
            except Exception as exc:
                logger.warning("ownership group %s: leaving failed: %r", self.group, exc)

    def _assigned(self, partitions: list[PartitionKey]) -> dict:
        self._claiming = {p for t, p in partitions if t == self.topic}
        return {}

    def _claim(self, consumer: Any) -> None:
        """Commit the next epoch to the newly assigned partitions, then hand the assignment to the worker."""
        mine = self._claiming or set()
        if mine:  # one epoch above every partition's: it still exceeds them if the topic gains partitions
            every = [(self.topic, p) for p in sorted(consumer.partitions_of(self.topic) | mine)]
            epoch = max([offset or 0 for offset in consumer.committed(every).values()] + [self._floor]) + 1
            if not consumer.commit({(self.topic, p): epoch for p in mine}, wait=True):
                raise RuntimeError(f"could not commit the epochs of partitions {sorted(mine)}")
            self._floor = epoch
            logger.info("group %s: now owns %s of %s (epoch %d)", self.group, sorted(mine), self.topic, epoch)
        self._claiming = None
        with self._cond:
            self._assignment = (mine, self._floor)
        self.joined.set()

    def _revoked(self, partitions: list[PartitionKey]) -> None:
        self._claiming = None
        mine = {p for t, p in partitions if t == self.topic}
        if not mine:
            return
        with self._cond:
            self._assignment = None  # one not taken yet is over: the next one replaces it
            self._removed |= mine
            self._asked += 1
            asked = self._asked
            if self._closing.is_set():
                return
            if not self._cond.wait_for(lambda: self._done >= asked or self._closing.is_set(), self._revoke_wait_s):
                logger.warning("group %s: the worker did not release %s within %g s; handing them over anyway",
                               self.group, sorted(mine), self._revoke_wait_s)
        logger.info("group %s: released %s of %s", self.group, sorted(mine), self.topic)

    # ------------------------------------------------------------------ the worker's side
    def take(self) -> tuple[set[int], tuple[set[int], int] | None, int]:
        """``(revoked, assignment, ticket)``: the partitions revoked since the last call, the newest whole
        assignment made since and the epoch claimed for it (``(partitions, epoch)``, None if none), and the
        ticket to pass to :meth:`done` once the revoked partitions are no longer published. Revocations come
        before the assignment that follows them."""
        with self._cond:
            removed, assignment = self._removed, self._assignment
            self._removed, self._assignment = set(), None
            return removed, assignment, self._asked

    def done(self, ticket: int) -> None:
        """The revocations up to ``ticket`` are acted on: the group may hand those partitions on."""
        with self._cond:
            self._done = max(self._done, ticket)
            self._cond.notify_all()

    def close(self, timeout_s: float = 5.0) -> None:
        """Leave the group (its partitions move to the other workers)."""
        self._closing.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout_s)
