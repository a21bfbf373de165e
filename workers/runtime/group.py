"""Which nodes this worker publishes: its share of the output topic, handed out by a consumer group.

Every worker of a group keeps the whole graph and every layer but the last
(:mod:`gnnstream.workers.runtime.worker` reads every partition of the events topic
itself).
The final layer and the publishing are sharded by the partitions of the
output topic: a node belongs to the partition its id maps to under Kafka's
default partitioner (:mod:`gnnstream.stream.partitioning`), which is also the
partition its messages land in. :class:`Ownership` is a member of the Kafka
consumer group ``group`` subscribed to the output topic. It reads no
records (its partitions stay paused); the group protocol hands out the
partitions, and moves them on join, leave and failure.

Epochs: a worker that is assigned partitions reads the group's committed
offsets of every partition of the topic (and the highest epoch its state
recorded), adds one to the largest, and commits that to the partitions it
was assigned before it publishes anything of them. That number is its
*epoch* as their owner, and every version it publishes for their nodes is
at least ``epoch << 32`` (:meth:`gnnstream.workers.engine.Engine.own`). One owner at
a time holds a partition, so each owner's epoch exceeds every earlier one's,
and a consumer that keeps the highest version per node ends with the newest
owner's values.

A member polls from a thread of its own, so that the worker's long batches
never delay a heartbeat or a rebalance. The worker takes the changes
between two batches (:meth:`Ownership.take`). A revocation waits, at most
``revoke_wait_s``, until the worker has stopped publishing the revoked
partitions (:meth:`Ownership.done`): only then may the group hand them to
another worker. docs/scaling.md states what a consumer sees meanwhile.
:class:`Group` is the worker's side: the partitions it owns and keeps, and
the changes acted on between two batches (:meth:`Group.sync`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gnnstream.stream.backends import open_consumer
from gnnstream.stream.clients import PartitionKey
from gnnstream.stream.errors import Limited, classify
from gnnstream.stream.exceptions import StreamError
from gnnstream.stream.rollout import version_topic
from gnnstream.workers.runtime.metrics import WorkerMetrics

if TYPE_CHECKING:
    from gnnstream.workers.engine import Engine

__all__ = ["Ownership", "Group", "Takeover"]

logger = logging.getLogger(__name__)
_limited = Limited(logger)  # the same failure while Kafka is away: once, then once a minute

_POLL_S = 0.2  # one member poll: rebalance callbacks run inside it
_RETRY_S = 1.0  # after a failed poll or a failed join


class Ownership:
    """This worker's membership in the group that shares out the output topic's partitions.

    Args:
        client: Kafka client (see :mod:`gnnstream.stream.backends`).
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


@dataclass(frozen=True)
class Takeover:
    """Output partitions this worker took over: which, the final rows computed for them, the embeddings to
    publish, and the seconds it took."""

    partitions: frozenset[int]
    recomputed: int
    published: int
    seconds: float


class Group:
    """This worker's share of the output topic: the partitions it publishes and those it keeps current.

    A worker publishes the nodes of the partitions it *owns*; it keeps the
    final rows of the nodes of the partitions it *keeps* current (the owned
    ones, and revoked ones until the next assignment, so that getting one
    back costs no recompute).

    Args:
        client: Kafka client (see :mod:`gnnstream.stream.backends`).
        bootstrap: ``host:port[,host:port...]``.
        group: the worker group's name (``--group``); the consumer group that shares the output is one per
            model version (:meth:`member_group`).
        session_timeout_ms: the member's session timeout.
        metrics: ``gnnstream_owned_partitions`` follows the owned partitions.
    """

    def __init__(self, client: str, bootstrap: str, group: str, session_timeout_ms: int, metrics: WorkerMetrics):
        self.client, self.bootstrap, self.group = client, bootstrap, group
        self.session_timeout_ms = session_timeout_ms
        self.metrics = metrics
        self.ownership: Ownership | None = None
        self.topic = ""  # the output topic (set by join)
        self.partitions = 0  # the output topic's partitions when the worker started
        self.owned: set[int] = set()  # output partitions whose nodes this worker publishes
        self.kept: set[int] = set()  # output partitions whose nodes' final rows it keeps current
        self.rebalancing = False  # partitions were revoked and the next assignment has not come

    def restore(self, engine: Engine) -> None:
        """Keep current the final rows the state holds current (every node's when it records no partitions: a
        state not yet sharded); nothing is published before the group's assignment."""
        stored = engine.kept_partitions()
        if stored is not None:
            self.kept = stored[1]
            engine.own(self.kept, set(), stored[0])

    def member_group(self, model_tag: str) -> str:
        """The consumer group of the version ``model_tag``: a version's workers joining or leaving never move
        another version's partitions."""
        return version_topic(model_tag, self.group)

    def join(self, engine: Engine, topic: str, partitions: int, stop: threading.Event) -> bool:
        """Join the group that shares out ``topic`` (``partitions`` of them); wait for the first assignment
        (False if ``stop`` was set meanwhile)."""
        self.topic, self.partitions = topic, partitions
        stored = engine.kept_partitions()
        # a revocation waits for the worker at most half a session: longer, kafka-python would miss heartbeats
        self.ownership = own = Ownership(self.client, self.bootstrap, topic, self.member_group(engine.model_tag),
                                         session_timeout_ms=self.session_timeout_ms, floor=engine.highest_epoch(),
                                         revoke_wait_s=self.session_timeout_ms / 2000)
        if stored is None:  # every node's final row is current
            self.kept = set(range(partitions))
        elif stored[0] != partitions:  # the output topic has other partitions now: nodes map elsewhere
            self.kept = set()
        engine.own(self.kept, set(), partitions)
        while not own.joined.wait(0.1):
            if stop.is_set():
                return False
        return True

    def settled(self) -> bool:
        """The group has assigned this worker its partitions (and it took them over)."""
        own = self.ownership
        return own is not None and own.joined.is_set() and not self.rebalancing

    def owns(self, partition: int) -> bool:
        """Whether this worker publishes output partition ``partition``."""
        return partition in self.owned

    def sync(self, engine: Engine) -> Takeover | None:
        """Act on the group's changes, between two batches; the partitions taken over, if any.

        A revoked partition stops being published at once (the group hands
        it on only after that); its final rows are still computed until the
        next assignment says where it went. Events are not to be read
        between a revocation and the next assignment (:attr:`rebalancing`).
        Assigned partitions are taken over at once, at the epoch claimed for
        them (docs/scaling.md).

        Raises:
            StreamError: the output topic has more partitions than when the worker started.
        """
        own = self.ownership
        if own is None:
            return None
        revoked, assignment, ticket = own.take()
        count = self.partitions
        if revoked:
            self.owned -= revoked
            engine.own(self.kept, self.owned, count)
            self.rebalancing = True
            own.done(ticket)
        if assignment is None:
            return None
        assignment, epoch = assignment
        beyond = sorted(p for p in assignment if p >= count)
        if beyond:
            raise StreamError(f"topic {self.topic!r} has more partitions than the {count} this worker started "
                              f"with (it was assigned {beyond}): nodes map to other partitions now; restart every "
                              f"worker of group {self.group!r}")
        self.rebalancing = False
        self.owned &= assignment  # an eager assignment is whole
        parts = assignment - self.owned
        computed = parts & self.kept
        self.kept = (self.kept & assignment) | parts
        self.owned |= parts
        engine.own(self.kept, self.owned, count, epoch=epoch)
        self.metrics.owned.set(len(self.owned))
        if not parts:
            return None
        t0 = time.perf_counter()
        stats = engine.take_over(parts, computed)
        recomputed = stats.recomputed[-1] if stats.recomputed else 0
        return Takeover(frozenset(parts), recomputed, stats.published, time.perf_counter() - t0)

    def close(self, timeout_s: float) -> None:
        """Leave the group: the other workers take this one's partitions."""
        if self.ownership is not None:
            self.ownership.close(timeout_s)
            self.ownership = None
