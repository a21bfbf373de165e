"""The streaming worker: graph events in, exact embeddings out.

One loop iteration is a micro-batch, in numbered steps:

1. poll up to the current batch target of records (waiting at most
   ``batch_wait_ms``); the target starts at ``batch_size``, doubles while
   polls come back full (a backlog) up to ``max_batch_size`` and halves back
   while they come back less than half full (light load, small batches);
2. decode and validate; invalid records are queued to the dead-letter topic
   and the producer is flushed before anything else happens (a bad record is
   never lost, and never holds up the good ones behind it);
3. apply the good events and the next offset of every partition seen in one
   RocksDB WriteBatch (the store is the source of truth: after a crash the
   worker resumes from these offsets, so nothing is lost or applied twice);
4. recompute the dirty embeddings; they and their outbox entries are written
   in one WriteBatch;
5. resolve the new outbox records (each node's state as stored now, read in
   this thread right after the recompute) and hand them to the publisher
   thread, which has the delivery process (:mod:`stream.delivery`) encode,
   send and flush them in order while this thread goes on with the next
   batch; the outbox records of a batch are deleted (by this
   thread) only after the publisher reported its flush succeeded
   (at-least-once: consumers keep the highest version per node). While
   the publisher is busy, new outbox records wait in the store and this
   thread goes on; the publisher's next batch takes all of them, each node
   once, so under a backlog delivery coalesces the updates of many batches;
6. commit Kafka offsets, for lag tools only.

If Kafka is unavailable the loop keeps its state and retries: the publisher
retries the same batch (later ones wait behind it, so each node's versions go
out in order) and an unpublished outbox stays in RocksDB until a flush
succeeds. After a crash the next start publishes every outbox record left,
each node at its newest stored version.

Starting: the ``/healthz`` endpoint comes up first and answers 503 with a
``reason`` (opening the state, running a backfill, waiting for Kafka, joining
the group) until the worker consumes, 200 after. A broker that is not up yet
is waited for with capped backoff, for ever unless ``broker_wait_s`` is set.

Offsets: before the records of a poll are applied, every assigned partition's
stored offset is compared with its end (the high watermark of the last
fetch). A stored offset past the end means the topic or the broker was
replaced; the worker stops with :class:`OffsetResetError` unless
``on_offset_reset`` says to resume from the partition's start or end.

Stopping: SIGTERM/SIGINT finish the current batch, then spend at most
``drain_timeout_s`` finishing deferred hub work (:meth:`Engine.drain`) and
publish it; what is left stays recorded as durable dirty marks for the next
start. A second signal skips the drain, and so does a publisher that is
failing (nothing could be published). Waiting for the publisher to deliver
what it holds takes at most ``_STOP_DELIVERY_S`` (less after a second
signal), while the consumer leaves its group on a thread of its own; then
each client gets ``_STOP_CLOSE_S`` to close. Undelivered outbox records stay
in RocksDB for the next start, so the worker exits within about ten seconds
even when the broker is gone.
"""

from __future__ import annotations

import logging
import operator
import os
import signal
import socket
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np

from gnnstream.graph_state.transaction import Transaction
from gnnstream.graph_state.store import GraphStore
from gnnstream.stream.backends import open_consumer, open_producer
from gnnstream.stream.clients import ConsumerClient, PartitionKey, ProducerClient, Record
from gnnstream.stream.deadletter import RECORD_OVERHEAD, DeadLetter, DeadLetterWriter, GroupLetters, letter_partition
from gnnstream.stream.delivery import WORKER_HEADER, Delivery, DeliveryProcess, UpdateColumns
from gnnstream.stream.errors import Limited, backoff_s, classify
from gnnstream.stream.events import InvalidEvent, check_features, decode_event_json
from gnnstream.stream.exceptions import NoPartitionsError, StreamError, TopicSetupError
from gnnstream.stream.kafka import ensure_topics, topic_max_message_bytes
from gnnstream.stream.updates import largest_update_bytes
from gnnstream.stream.rollout import CONTROL_KEY, Marker, marker_of, marker_rank, stamp_headers, version_topic
from gnnstream.workers.heap import freeze_warm_heap
from gnnstream.workers.metrics import MetricsServer, WorkerMetrics
from gnnstream.workers.ownership import Ownership
from gnnstream.workers.rollout import record_rollout, stored_rollout, worker_report
from gnnstream.workers.settings import WorkerSettings

if TYPE_CHECKING:  # torch-backed modules are imported by Worker.run, after /healthz is up
    from gnnstream.workers.engine import Engine

__all__ = ["Worker", "OutboxPublisher", "Outgoing", "OffsetResetError", "default_worker_id"]

logger = logging.getLogger(__name__)

_BACKOFF_FIRST_S = 0.5  # waits between attempts to reach Kafka at start: 0.5, 1, 2, 4, 5, 5 ... s
_BACKOFF_MAX_S = 5.0
_SETUP_TIMEOUT_S = 10.0  # one topic-setup attempt against a broker that accepts connections
_PROBE_TIMEOUT_S = 2.0
_WAIT_LOG_EVERY_S = 60.0  # while waiting for Kafka, a warning at the first failure and then this often
_POLL_STALE_S = 60.0  # /healthz turns 503 when the loop has not polled for this long
_MAX_IN_FLIGHT = 1  # batches handed to the publisher thread and not delivered; more records wait in the outbox
_FLUSH_TIMEOUT_S = 5.0  # one flush of the publisher thread; a failed one is retried
_STOP_DELIVERY_S = 4.0  # on stop, the longest wait for the publisher to deliver what it holds
_STOP_CLOSE_S = 1.0  # on stop, then the longest wait for each client to close (they close side by side)
_TOPIC_CHECK_S = 30.0  # how often the loop looks for partitions added to the events topic
_PUBLISH_LIMIT = 250_000  # distinct nodes per encoded batch (a batch holds whole outbox records)
_REPORT_EVERY_S = 5.0  # how often the worker records its progress in the rollout topic
_UNHEALTHY_AFTER_S = 30.0  # /healthz turns 503 when a transient error has gone on for this long
_LETTERS_META = "dead_letters"  # the dead letters this worker holds for other owners (stored with the offsets)
_MARKER_WAIT_LOG_S = 60.0  # a warning when partitions wait this long at a rollout marker for the others
_op = operator.attrgetter("op")


def default_worker_id(state: str) -> str:
    """A worker's name when none is given: the host's and the state directory's."""
    return f"{socket.gethostname()}-{os.path.basename(os.path.abspath(state))}"


class OffsetResetError(StreamError):
    """A stored offset is past the end of its partition: the topic or the broker was replaced.

    Nothing of that partition was applied. Attributes: ``partitions``,
    ``{(topic, partition): (stored offset, end offset)}``.
    """

    def __init__(self, message: str, partitions: dict[PartitionKey, tuple[int, int]]):
        super().__init__(message)
        self.partitions = partitions


@dataclass(eq=False)
class Outgoing:
    """The updates of some outbox records, ready to send.

    ``keys`` are the outbox records they come from (deleted once the flush
    confirmed delivery); ``columns`` the nodes' stored state, read when the
    batch was prepared, encoded and sent by the delivery process.
    ``event_ts`` is the event time of each published node, for the
    freshness histogram; ``suppressed`` the updates of those records left
    out by ``min_change`` (confirmed with the rest, never sent). Not changed
    once handed to the publisher thread.
    """

    keys: list[bytes]
    columns: list[UpdateColumns]
    event_ts: np.ndarray
    oldest_record_s: float | None = None  # Kafka time of the oldest record of the batch that made it
    suppressed: int = 0
    count: int = 0  # messages (the nodes of ``columns``)
    headers: list[tuple[str, bytes]] | None = None  # on every message: the serving version and marker number

    def __len__(self) -> int:
        return self.count


class OutboxPublisher:
    """Sends outbox entries to Kafka and deletes them once the flush succeeded.

    :meth:`prepare` reads the outbox records not taken yet and resolves each
    node to its state stored now (one :meth:`Engine.outbox_columns` call per
    record); :meth:`deliver` has ``delivery`` encode, send and flush them
    (:class:`stream.delivery.DeliveryProcess` in the worker: another
    process, beside the worker's next batch); :meth:`confirm` deletes the
    records.

    Output volume control (``min_change`` > 0): the publisher keeps, per
    node, the row it last handed over for sending (a dense array indexed by
    the node's interned id, ``ids x dim x 4`` bytes, and its mode code). An
    update is published when the node has no such row in this process, its
    mode changed, it is withdrawn (tombstone; the node is then forgotten) or
    ``||new - last||_2 > min_change * ||last||_2`` (a non-finite row is never
    held back: the encoder refuses it as without the option); the others
    are left out of the batch, counted in :attr:`Outgoing.suppressed`, and
    their outbox records are deleted with the batch's once it was
    delivered. The kept rows are only ones handed to the publisher thread,
    which delivers batches in order and retries a failed one before any
    later one, so what a consumer ends up holding is always within
    ``min_change`` of the stored embedding. The comparison is
    one vectorised pass per outbox record. With ``min_change`` 0 nothing is
    kept and the output is the same as without the option.

    Args:
        delivery: encodes and sends columns (:class:`stream.delivery.Delivery`
            or :class:`~stream.delivery.DeliveryProcess`).
        resolve: ``(iids, computed_at) -> UpdateColumns``, the stored state of
            the nodes an outbox record names (:meth:`Engine.outbox_columns`;
            with ``min_change`` it must fill ``iids`` and ``mode_codes``).
        min_change: relative L2 change below which (inclusive) an update is not
            published (0 = publish every update).
    """

    def __init__(self, store: GraphStore, delivery: Delivery | DeliveryProcess,
                 resolve: Callable[[np.ndarray, float], UpdateColumns], min_change: float = 0.0):
        if not 0 <= min_change < np.inf:
            raise ValueError(f"min_change must be a finite number >= 0 (got {min_change!r})")
        self.store = store
        self.delivery = delivery
        self.resolve = resolve
        self.min_change = float(min_change)
        self._taken: bytes | None = None  # the last outbox key prepare() took and confirm() has not deleted
        self._stamp: list[tuple[str, bytes]] | None = None  # headers of what prepare() takes (stream.rollout)
        self._seen = np.zeros(0, dtype=bool)  # by iid, scratch of prepare()
        self.forget_sent()

    def pending(self) -> int:
        return sum(1 for _ in self.store.column("outbox").keys())

    def prepare(self, limit: int = 50_000) -> Outgoing:
        """The outbox records after the last one taken, up to about ``limit`` distinct nodes, as one batch.

        Records are taken whole, in order, until they name ``limit``
        distinct nodes. A node named by several of them goes out once, with
        the computation time of the last one, in its state stored now (which
        is that record's or a newer one): when delivery falls behind, the
        records waiting for it coalesce.
        """
        from gnnstream.graph_state.codecs import decode_outbox
        taken = self._taken
        out = Outgoing([], [], np.zeros(0, dtype=np.float64), headers=self._stamp)
        records: list[tuple[float, np.ndarray]] = []
        distinct = 0
        for key, raw in self.store.column("outbox").items(from_key=taken):
            if key == taken:
                continue
            computed_at, iids = decode_outbox(raw)
            seen = self._seen_map(iids)
            distinct += len(iids) - int(np.count_nonzero(seen[iids]))
            seen[iids] = True
            out.keys.append(key)
            records.append((computed_at, iids))
            if distinct >= limit:
                break
        if not records:
            return out
        self._taken = out.keys[-1]
        seen = self._seen
        for _, iids in records:
            seen[iids] = False
        latest = []  # each record's nodes that no later record of the batch names
        for computed_at, iids in reversed(records):
            latest.append((computed_at, iids[~seen[iids]]))
            seen[iids] = True
        for _, iids in records:
            seen[iids] = False
        times = []
        for computed_at, iids in reversed(latest):
            if not len(iids):
                continue
            cols = self.resolve(iids, computed_at)
            if len(cols) and self.min_change > 0:
                cols, skipped = self._changed(cols)
                out.suppressed += skipped
            if len(cols):
                out.columns.append(cols)
                out.count += len(cols)
                times.append(cols.event_ts)
        if times:
            out.event_ts = np.concatenate(times)
        return out

    def _seen_map(self, iids: np.ndarray) -> np.ndarray:
        """A false-filled flag per interned id, covering ``iids`` (prepare() leaves it all false)."""
        need = int(iids.max()) + 1 if len(iids) else 0
        if need > len(self._seen):
            grown = np.zeros(max(need, len(self._seen) * 3 // 2, 1024), dtype=bool)
            grown[:len(self._seen)] = self._seen
            self._seen = grown
        return self._seen

    def _changed(self, cols: UpdateColumns) -> tuple[UpdateColumns, int]:
        """``cols`` less the updates ``min_change`` leaves out, and how many those are; remembers the rest."""
        iids, codes = cols.iids, cols.mode_codes
        if iids is None or codes is None:
            raise ValueError("min_change needs outbox columns with iids and mode_codes (Engine.outbox_columns)")
        rows, deleted = cols.rows, cols.deleted
        self._reserve(int(iids.max()) + 1, rows.shape[1])
        last_mode = self._sent_mode[iids]
        last = self._sent_rows[iids]
        diff = rows - last
        moved = np.einsum("ij,ij->i", diff, diff, dtype=np.float64)  # squared L2 distances
        scale = np.einsum("ij,ij->i", last, last, dtype=np.float64)
        within = moved <= (self.min_change ** 2) * scale  # NaN compares False: a non-finite row goes out
        send = deleted | (last_mode < 0) | (last_mode != codes) | ~within
        live = send & ~deleted
        self._sent_rows[iids[live]] = rows[live]
        self._sent_mode[iids[live]] = codes[live]
        self._sent_mode[iids[deleted]] = -1  # withdrawn: the next update of the node goes out whatever it is
        skipped = len(send) - int(np.count_nonzero(send))
        if not skipped:
            return cols, 0
        keep = np.flatnonzero(send)
        taken = np.asarray(cols.names, dtype=object)[keep].tolist()
        modes = np.asarray(cols.modes, dtype=object)[keep].tolist()
        return replace(cols, names=taken, versions=cols.versions[keep], event_ts=cols.event_ts[keep], modes=modes,
                       rows=rows[keep], deleted=deleted[keep], iids=iids[keep], mode_codes=codes[keep]), skipped

    def _reserve(self, size: int, dim: int) -> None:
        """Make room in the sent-rows map for ids below ``size`` (grown by half at least)."""
        have = len(self._sent_mode)
        if size <= have and self._sent_rows.shape[1] == dim:
            return
        size = max(size, have + have // 2, 1024)
        rows = np.zeros((size, dim), dtype=np.float32)
        mode = np.full(size, -1, dtype=np.int16)
        if self._sent_rows.shape[1] == dim:
            rows[:have] = self._sent_rows
            mode[:have] = self._sent_mode
        self._sent_rows, self._sent_mode = rows, mode

    def stamp(self, serving: str, rollout: int) -> None:
        """What the batches prepared from now on were computed under: the serving version and the number of
        the last marker passed (headers, :func:`stream.rollout.stamp_headers`)."""
        self._stamp = stamp_headers(serving, rollout)

    def forget_sent(self) -> None:
        """Forget every row kept for ``min_change``: each node's next update is published."""
        self._sent_rows = np.zeros((0, 0), dtype=np.float32)  # by iid: the row last handed over for sending
        self._sent_mode = np.zeros(0, dtype=np.int16)  # by iid: its mode code, -1 = none

    def deliver(self, out: Outgoing, flush_timeout_s: float = 30.0) -> None:
        """Encode, send and flush ``out`` (raises on delivery failure: then all of it counts as unsent;
        ValueError when it cannot be encoded)."""
        self.delivery.deliver(out.columns, flush_timeout_s, out.headers)

    def confirm(self, out: Outgoing) -> None:
        """Delete the outbox records of a delivered ``out``."""
        if out.keys:
            tx = Transaction()
            tx.remove_outbox(out.keys)
            self.store.commit(tx)

    def retake(self) -> None:
        """Forget what :meth:`prepare` took and was not confirmed: the next prepare reads it again.

        The rows kept for ``min_change`` are forgotten too (they may name
        batches that were never delivered), so every node is published again
        at its next update.
        """
        self._taken = None
        self.forget_sent()


class _Sender:
    """The publisher thread: sends and flushes encoded batches, one at a time, in the order submitted.

    A batch whose flush fails is sent again (and again) before any later
    one, so each node's versions go out in order. Delivered batches wait in
    :meth:`delivered` for the worker's thread, which deletes their outbox
    records; this thread never touches the store.
    """

    def __init__(self, worker: Worker, publisher: OutboxPublisher):
        self.worker, self.publisher = worker, publisher
        self._cond = threading.Condition()
        self._queue: deque[Outgoing] = deque()  # submitted, not delivered; the first is being sent
        self._done: list[Outgoing] = []  # delivered, not yet confirmed
        self._closing = False
        self._closed = threading.Event()  # set by close(): a pause between retries ends at once
        self.failure: BaseException | None = None  # a batch could not be encoded: the worker raises it
        self.thread = threading.Thread(target=self._run, name="publisher", daemon=True)
        self.thread.start()

    def submit(self, out: Outgoing) -> None:
        with self._cond:
            self._queue.append(out)
            self._cond.notify_all()

    def in_flight(self) -> int:
        """Batches submitted and not delivered yet."""
        return len(self._queue)

    def delivered(self) -> list[Outgoing]:
        """The batches delivered since the last call, oldest first."""
        with self._cond:
            done, self._done = self._done, []
        return done

    def wait(self, timeout_s: float) -> None:
        """Wait until a batch was delivered or nothing is in flight (at most ``timeout_s``)."""
        with self._cond:
            if self._queue and not self._done and self.failure is None:
                self._cond.wait(timeout_s)

    def close(self, timeout_s: float) -> None:
        """Stop after the batch being sent (waiting at most ``timeout_s`` for it); the rest stays unsent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._closed.set()
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            logger.warning("the publisher thread is still flushing after %g s; leaving it (its outbox records "
                           "stay stored for the next start)", timeout_s)

    def _run(self) -> None:
        worker = self.worker
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                out = self._queue[0]
            t0 = time.perf_counter()
            try:
                self.publisher.deliver(out, _FLUSH_TIMEOUT_S)
            except ValueError as exc:  # the batch cannot be encoded: no retry cures that
                with self._cond:
                    self.failure = exc
                    self._cond.notify_all()
                return
            except Exception as exc:
                found = classify(exc)
                if found.permanent:  # the topic refuses the updates: sending them again cannot help
                    with self._cond:
                        self.failure = StreamError(
                            f"topic {worker.output_topic!r} refuses the embedding updates ({found.kind}): {exc}; "
                            f"check that it exists, that the worker may write to it and that its max.message.bytes "
                            f"is at least --max-message-bytes, then restart (the updates stay in the outbox)")
                        self._cond.notify_all()
                    return
                # broker down: send the same batch again after a pause
                self._closed.wait(worker._recoverable("publish", exc, pause=False))
                continue
            worker._cleared("publish")
            worker._delivered(out, time.perf_counter() - t0)
            with self._cond:
                self._queue.popleft()
                self._done.append(out)
                self._cond.notify_all()


@dataclass
class _Health:
    """What ``/healthz`` reports. ``status`` is one of starting, backfill, recovering,
    waiting_for_kafka, joining, consuming, draining, stopped, failed; ``reason`` says
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


def _in_background(call: Callable[[], Any], name: str) -> threading.Thread:
    """Run ``call`` on a daemon thread (started); errors are logged, not raised."""
    def run() -> None:
        try:
            call()
        except Exception as exc:
            logger.warning("%s failed: %r", name, exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def _probe(bootstrap: str, timeout_s: float = _PROBE_TIMEOUT_S) -> None:
    """Raise :class:`TopicSetupError` unless some bootstrap address accepts a TCP connection.

    Cheaper and quieter than a Kafka client, whose own bootstrap backs off
    for seconds and logs every refused connection.
    """
    errors = []
    for address in (a.strip() for a in bootstrap.split(",") if a.strip()):
        host, sep, port = address.rpartition(":")
        if not sep:
            host, port = address, "9092"
        try:
            with socket.create_connection((host.strip("[]") or "localhost", int(port)), timeout=timeout_s):
                return
        except (OSError, ValueError) as exc:
            errors.append(f"{address}: {getattr(exc, 'strerror', None) or exc}")
    raise TopicSetupError(f"cannot reach Kafka at {bootstrap} ({'; '.join(errors) or 'no address'}); "
                          "is the broker running and is --bootstrap right?")


class Worker:
    """A gnnstream worker bound to one state directory and one model.

    Args:
        settings: see :class:`workers.settings.WorkerSettings`.
    """

    def __init__(self, settings: WorkerSettings):
        self.settings = settings
        self.metrics = WorkerMetrics()
        self._stop = threading.Event()
        self._hurry = threading.Event()  # a second stop signal: skip the drain
        self.health = _Health(started=time.time())
        self.store: GraphStore | None = None
        self.engine: Engine | None = None
        # (publish time, publish time - oldest Kafka record time of the batch), newest last
        self.latency_timeline: deque[tuple[float, float]] = deque(maxlen=100_000)
        self._errors: dict[str, str] = {}  # unresolved errors by kind, the newest last
        self._failing: dict[str, tuple[float, int]] = {}  # kind -> (when it began failing, attempts so far)
        self._limited = Limited(logger)
        self._letters = GroupLetters()  # the dead letters this worker writes, and those it holds for others
        self._catch_up = False  # took over output partitions: read the dead-letter topic to its end first
        self._expected: dict[PartitionKey, int] = {}  # the stored next offset of each partition read
        self._deferred_keys = np.zeros(0, dtype=np.int64)  # deferred hub marks after the last recompute
        self._oldest_record_s: float | None = None
        self._sender: _Sender | None = None
        self._idle = False  # the last poll brought nothing: _publish waits for delivery (nothing to overlap)
        self._batch_target = settings.batch_size  # records asked of the next poll (dynamic micro-batching)
        self._query: Any = None  # the query API process (gnnstream.workers.query.server.QueryProcess), told of every commit
        self.worker_id = settings.worker_id or default_worker_id(settings.state)
        self._ownership: Ownership | None = None
        self._owned: set[int] = set()  # output partitions whose nodes this worker publishes
        self._kept: set[int] = set()  # output partitions whose nodes' final rows it keeps current (owned ones, and
        # revoked ones until the next assignment)
        self._rebalancing = False  # partitions were revoked and the next assignment has not come
        self._output_partitions = 0
        self.output_topic = settings.output_topic  # the model's version topic unless set (resolved at start)
        self.serving: str | None = None  # the version serving as of the last marker passed (stream.rollout)
        self.rollout = 0  # the number of the last rollout marker passed
        self.retired: Marker | None = None  # the marker that retired this worker's version
        self._held: dict[PartitionKey, tuple[int, Marker]] = {}  # partitions held at a marker: its offset, itself
        self._held_since: float | None = None
        self._skipped: dict[PartitionKey, int] = {}  # past markers passed before, stored with the next batch
        self._last_report = 0.0

    # ------------------------------------------------------------------ lifecycle
    def stop(self, *_: Any) -> None:
        """Ask the loop to finish its current batch and exit (a second call skips the drain)."""
        if self._stop.is_set():
            self._hurry.set()
        elif self.health.status not in ("stopped", "failed"):
            logger.info("stop requested: finishing the current batch")
        self._stop.set()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)

    def health_info(self) -> dict[str, Any]:
        """The ``/healthz`` JSON: ``ok`` only while consuming and polling; ``reason`` says why not."""
        h = self.health
        now = time.time()
        ok, reason = False, h.reason
        if h.status == "consuming":
            if self._stop.is_set():
                reason = "stopping"
            elif h.last_poll and now - h.last_poll >= _POLL_STALE_S:
                reason = f"no poll for {now - h.last_poll:.0f} s (a long batch, or stuck)"
            else:
                ok, reason = True, None
                failing = [(since, kind) for kind, (since, _) in list(self._failing.items())
                           if time.monotonic() - since >= _UNHEALTHY_AFTER_S]
                if failing:
                    since, kind = min(failing)
                    ok, reason = False, (f"{kind} failing for {time.monotonic() - since:.0f} s, retrying: "
                                         f"{self._errors.get(kind, kind)}")
        return {"ok": ok, "status": h.status, "reason": reason, "batches": h.batches, "applied": h.applied,
                "invalid": h.invalid, "published": h.published, "polls": h.polls,
                "kafka_attempts": h.kafka_attempts, "last_error": h.last_error,
                "pending_marks": h.pending_marks, "pending_outbox": h.pending_outbox,
                "position": sum(self._expected.values()), "worker": self.worker_id,
                "owned_partitions": sorted(self._owned), "serving": self.serving, "rollout": self.rollout,
                "held_at_marker": sorted(p for _, p in self._held),
                "final_recomputed": h.final_recomputed, "takeovers": h.takeovers,
                "seconds": {k: round(v, 3) for k, v in h.seconds.items()}, "changed": h.changed,
                "uptime_s": round(now - h.started, 3)}

    def _set_status(self, status: str, reason: str | None) -> None:
        self.health.status, self.health.reason = status, reason
        if reason and status not in ("consuming", "stopped"):
            logger.info("%s", reason)

    def run(self, max_idle_s: float | None = None) -> dict[str, Any]:
        """Run until :meth:`stop` (or ``max_idle_s`` without records); return a summary.

        Raises:
            OffsetResetError: a stored offset is past the end of its partition
                and ``on_offset_reset`` is ``fail``.
            TopicSetupError: Kafka was not reachable within ``broker_wait_s``
                (when set).
        """
        s = self.settings
        model = s.model or "(the state's)"
        self._set_status("starting", f"opening state {s.state} and model {model}")
        server = MetricsServer(self.metrics, s.metrics_port, self.health_info, host=s.metrics_host) \
            if s.metrics_port else None
        try:
            from gnnstream.workers.state import open_store  # imports torch: after /healthz is up
            # a new state takes the model's sampling seed; an existing one must have been created with it
            self.store = store = open_store(s.state, create=True, model_dir=s.model)
            try:
                self._run(store, max_idle_s)
            finally:
                store.close()
                self.store = None
        except BaseException as exc:
            self._set_status("failed", f"{type(exc).__name__}: {exc}".splitlines()[0])
            raise
        finally:
            if server:
                server.close()
        if self.retired is not None:
            self._set_status("retired", f"{self.retired.retire} was retired at rollout marker {self.retired.rollout}")
        else:
            self._set_status("stopped", "stopped")
        return self.health_info()

    def _run(self, store: GraphStore, max_idle_s: float | None) -> None:
        from gnnstream.workers.state import open_engine
        s = self.settings
        engine = self.engine = open_engine(store, s.model, hub_bound=s.hub_bound,
                                           max_deferred_age=s.max_staleness_s)
        self.output_topic = s.output_topic or version_topic(engine.model_tag)
        self.serving, self.rollout = stored_rollout(store, engine.model_tag)
        # nothing is published before the group's assignment (_sync_ownership); the final rows the state holds
        # current are kept current meanwhile (every node's when it records no partitions: a state not yet
        # sharded)
        stored = engine.kept_partitions()
        if stored is not None:
            self._kept = stored[1]
            engine.own(self._kept, set(), stored[0])
        self._deferred_keys = self._deferred_marks(store)
        if engine.needs_backfill():
            self._set_status("backfill", f"running backfill of model {engine.model_tag} over state {s.state}")
            engine.backfill(publish=False)
        if engine.pending():
            self._set_status("recovering", f"recomputing {engine.pending()} dirty marks the last run left")
            self._recompute(engine, None, None, publish=False)  # what a crash left dirty
        if s.query_port:
            from gnnstream.workers.query.server import QueryProcess
            self._query = QueryProcess(s.state, str(engine.model.path), s.query_host, s.query_port)
        try:
            self._stream(store, engine, max_idle_s)
        finally:
            if self._query is not None:
                self._query.close()
                self._query = None

    def _stream(self, store: GraphStore, engine: Engine, max_idle_s: float | None) -> None:
        s = self.settings
        freeze_warm_heap()
        self._check_fits(engine, s.max_message_bytes, "--max-message-bytes (GNNSTREAM_MAX_MESSAGE_BYTES)")
        # the updates go out through a process of their own; the dead letters through this thread's producer
        delivery = DeliveryProcess(s.kafka_client, s.bootstrap, self.output_topic, engine.model_tag,
                                   s.output_format, worker=self.worker_id, max_message_bytes=s.max_message_bytes)
        dlq_producer = open_producer(s.kafka_client, s.bootstrap, max_message_bytes=s.max_message_bytes)
        publisher = OutboxPublisher(store, delivery, engine.outbox_columns, min_change=s.min_change)
        publisher.stamp(self.serving, self.rollout)
        dlq = DeadLetterWriter(dlq_producer, s.dlq_topic, s.max_message_bytes, on_skip=self._skipped_letter)
        self._letters = GroupLetters(map(DeadLetter.from_json, store.meta(_LETTERS_META) or ()))
        sender: _Sender | None = None
        try:
            if not self._setup_kafka():  # stopped while waiting: nothing can be published
                self._drain_on_stop(engine, None)
                return
            limit = topic_max_message_bytes(s.bootstrap, self.output_topic)
            if limit is not None:
                self._check_fits(engine, limit, f"max.message.bytes of topic {self.output_topic!r}")
            dlq.max_bytes = min(s.max_message_bytes, topic_max_message_bytes(s.bootstrap, s.dlq_topic) or 2**62)
            sender = self._sender = _Sender(self, publisher)
            self._publish(publisher)
            consumer = self._open_consumer()
            if consumer is None:
                self._drain_on_stop(engine, publisher)
                return
            clean = False
            try:
                self._output_partitions = self._partition_count(consumer, self.output_topic)
                if not self._output_partitions:  # stopped meanwhile
                    self._drain_on_stop(engine, publisher)
                    return
                if not self._join(engine):
                    self._drain_on_stop(engine, publisher)
                    return
                self._loop(consumer, dlq_producer, publisher, dlq, engine, max_idle_s)
                clean = True
            finally:
                # leaving the group may block on an unreachable broker: it goes on while the rest stops
                closing = _in_background(consumer.close, "consumer-close")
                if self._letters.reader is not None:
                    reader, self._letters.reader = self._letters.reader, None
                    _in_background(reader.close, "dead-letter-reader-close")
                if clean:
                    self._drain_on_stop(engine, publisher)
                self._finish_delivery(publisher)
                closing.join(_STOP_CLOSE_S)
                if closing.is_alive():
                    logger.warning("the consumer did not leave its group within %g s (broker unreachable?); "
                                   "exiting without waiting for it", _STOP_CLOSE_S)
        finally:
            if self._ownership is not None:  # leave the group: the other workers take this one's partitions
                self._ownership.close(_STOP_CLOSE_S + 1.0)
                self._ownership = None
            if sender is not None:
                sender.close(_STOP_CLOSE_S)
            self._sender = None
            closers = [_in_background(lambda c=c: c.close(_STOP_CLOSE_S), "producer-close")
                       for c in (delivery, dlq_producer)]
            for closer in closers:
                closer.join(_STOP_CLOSE_S + 0.5)

    # ------------------------------------------------------------------ start-up
    def _setup_kafka(self) -> bool:
        """Create the topics, waiting for the broker with capped backoff; False if stopped meanwhile.

        Raises:
            TopicSetupError: not reachable within ``broker_wait_s`` (when not 0).
        """
        s = self.settings
        topics = {s.events_topic: s.partitions, self.output_topic: s.partitions, s.dlq_topic: 1,
                  **({s.control_topic: 1} if s.control_topic else {})}
        self._set_status("waiting_for_kafka", f"waiting for Kafka at {s.bootstrap}")
        t0 = time.monotonic()
        delay = _BACKOFF_FIRST_S
        last_warning = None
        while not self._stop.is_set():
            self.health.kafka_attempts += 1
            try:
                _probe(s.bootstrap)
                ensure_topics(s.bootstrap, topics, timeout_s=_SETUP_TIMEOUT_S)
            except TopicSetupError as exc:
                waited = time.monotonic() - t0
                self.metrics.errors.labels("kafka_setup").inc()
                self._set_error("kafka_setup", f"kafka_setup: {exc}")
                if s.broker_wait_s and waited >= s.broker_wait_s:
                    raise TopicSetupError(f"gave up after {waited:.0f} s (--broker-wait-s {s.broker_wait_s:g}): "
                                          f"{exc}") from exc
                if last_warning is None or time.monotonic() - last_warning >= _WAIT_LOG_EVERY_S:
                    last_warning = time.monotonic()
                    logger.warning("waiting for Kafka (%.0f s so far, retrying every %g s at most): %s",
                                   waited, _BACKOFF_MAX_S, exc)
                pause = delay if not s.broker_wait_s else max(0.0, min(delay, s.broker_wait_s - waited))
                self._stop.wait(pause)
                delay = min(2 * delay, _BACKOFF_MAX_S)
                continue
            if self.health.kafka_attempts > 1:
                logger.warning("Kafka at %s is reachable after %.0f s", s.bootstrap, time.monotonic() - t0)
            self._cleared("kafka_setup")
            return True
        return False

    def _open_consumer(self) -> ConsumerClient | None:
        """Read every partition of the events topic (retrying while Kafka is unavailable); None if stopped
        meanwhile. Offsets are committed, for lag tools only, under the group ``<group>.<worker id>``."""
        s = self.settings
        self._set_status("joining", f"assigning every partition of topic {s.events_topic}")
        while not self._stop.is_set():
            try:
                consumer = open_consumer(s.kafka_client, s.bootstrap, s.events_topic, f"{s.group}.{self.worker_id}",
                                         session_timeout_ms=s.session_timeout_ms, on_assign=self._stored_offsets,
                                         assign_all=True)
            except NoPartitionsError as exc:  # metadata late: retry
                self._recoverable("consumer", exc)
                continue
            except StreamError:
                raise
            except Exception as exc:  # Kafka went away again: retry
                self._recoverable("consumer", exc)
                continue
            try:  # what the group wrote to the dead-letter topic (docs/scaling.md)
                self._letters.reader = open_consumer(s.kafka_client, s.bootstrap, s.dlq_topic,
                                                 f"{s.group}.{self.worker_id}.dead-letters", assign_all=True)
            except Exception as exc:
                consumer.close()
                self._recoverable("consumer", exc)
                continue
            self._cleared("consumer")
            return consumer
        return None

    def _stored_offsets(self, partitions: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int]:
        assert self.store is not None
        stored = self.store.offsets()
        offsets = {tp: stored[tp] for tp in partitions if tp in stored}
        self._expected.update(offsets)
        return offsets

    # ------------------------------------------------------------------ the loop
    def _loop(self, consumer: ConsumerClient, producer: ProducerClient, publisher: OutboxPublisher,
              dlq: DeadLetterWriter, engine: Engine, max_idle_s: float | None) -> None:
        s = self.settings
        idle_since = time.monotonic()
        last_lag = 0.0
        last_topic_check = time.monotonic()
        while not self._stop.is_set():
            self._sync_ownership(engine, publisher)
            if (self._letters.held or self._catch_up) and not self._rebalancing:
                self._held_letters(dlq)
            if self._rebalancing:  # no events until the group has assigned the partitions again
                self._publish(publisher)
                self._stop.wait(0.05)
                continue
            try:
                records = consumer.poll_batch(self._batch_target, s.batch_wait_ms / 1000)
            except StreamError:
                raise
            except Exception as exc:  # Kafka unavailable: keep state, retry
                self._recoverable("poll", exc)
                continue
            self._cleared("poll")
            self.health.last_poll = time.time()
            self.health.polls += 1
            self._resize(len(records))
            records = self._check_offsets(consumer, records)
            if records and (self._held or any(r.key == CONTROL_KEY for r in records)):
                records = self._hold_at_markers(consumer, records)
                if self._skipped and not records:  # nothing of the poll to apply: store the offsets past them
                    self._store_offsets(dict(self._skipped))
            if records or not consumer.assignment():  # idle time counts once partitions are assigned
                idle_since = time.monotonic()
            if records:
                self._process(records, producer, dlq, engine)
            elif engine.pending():
                self._recompute(engine, None, None)
            if self._held:
                self._pass_markers(consumer, publisher, engine)
            self._sync_ownership(engine, publisher)
            self._idle = not records
            self._publish(publisher)
            if records and not self._stop.is_set():  # for lag tools only: not worth a stall when stopping
                consumer.commit()
            if time.monotonic() - last_lag > 1.0:
                last_lag = time.monotonic()
                self._report_lag(consumer)
            if s.control_topic and time.monotonic() - self._last_report > _REPORT_EVERY_S:
                self._last_report = time.monotonic()
                self._report_progress(producer, consumer)
            if time.monotonic() - last_topic_check > _TOPIC_CHECK_S:
                last_topic_check = time.monotonic()
                self._check_partitions(consumer)
            if max_idle_s is not None and not records and time.monotonic() - idle_since > max_idle_s \
                    and not engine.pending() and not publisher.pending() and self._settled():
                break
        if s.control_topic:  # the last word: how it stopped
            self._report_progress(producer, consumer, final=True)

    def _partition_count(self, consumer: ConsumerClient, topic: str) -> int:
        """How many partitions ``topic`` has (retrying while Kafka does not say); 0 if stopped meanwhile."""
        while not self._stop.is_set():
            try:
                return len(consumer.partitions_of(topic))
            except Exception as exc:  # metadata late, Kafka away: retry
                self._recoverable("consumer", exc)
        return 0

    # ------------------------------------------------------------------ rollout markers
    def _hold_at_markers(self, consumer: ConsumerClient, records: list[Record]) -> list[Record]:
        """The records of a poll that precede the rollout markers (stream.rollout) of their partitions.

        A partition that reaches a new marker is held there: its records from
        the marker on are left out of every poll and it is sought back to the
        marker whenever a poll brought any, until :meth:`_pass_markers` moves
        past it. A marker this worker passed before (a repeated command) is
        left out; a record with the marker key that does not decode as one
        goes on to the dead letters like any invalid event.
        """
        held, seek, out = self._held, {}, []
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

    def _pass_markers(self, consumer: ConsumerClient, publisher: OutboxPublisher, engine: Engine) -> None:
        """Once every partition is held at a marker: finish and publish everything computed before them, then
        record the serving version and the offsets past them in one write (or stop, when the marker retires
        this worker's version). Markers of an earlier number than another partition's (a command that did
        not reach every partition) are passed over."""
        assigned = set(consumer.assignment())
        if not assigned or not assigned <= set(self._held):
            if self._held_since is not None and time.monotonic() - self._held_since > _MARKER_WAIT_LOG_S:
                self._held_since = time.monotonic()
                logger.warning("partitions %s wait at rollout marker %d for partitions %s, which have not reached "
                               "it; if a `gnnstream rollout` command failed, run it again",
                               sorted(self._held), max(m.rollout for _, m in self._held.values()),
                               sorted(assigned - set(self._held)))
            return
        top = max(m.rollout for _, m in self._held.values())
        orphans = {tp: offset + 1 for tp, (offset, m) in self._held.items() if m.rollout < top}
        if orphans:
            logger.warning("passing over rollout markers in %s: other partitions' next marker is %d (an earlier "
                           "command did not reach every partition)", sorted(orphans), top)
            for tp in orphans:
                del self._held[tp]
            consumer.seek_to(orphans)
            return
        chosen = {m for _, m in self._held.values()}
        marker = max(chosen, key=marker_rank)  # two commands raced for one number: every worker picks the same
        if len(chosen) > 1:
            logger.warning("partitions reached different rollout markers numbered %d (two commands at once); "
                           "following the latest, %s serves", top, marker.serving)
        if not self._publish_all(engine, publisher):
            return  # stopped meanwhile: the next start reads the markers again
        if marker.retire == engine.model_tag:
            self.retired = marker
            self._set_status("retired", f"{marker.retire} was retired at rollout marker {marker.rollout}")
            logger.warning("%s is retired by rollout marker %d: stopping (its state stays as it is at the marker; "
                           "a restart stops there again)", engine.model_tag, marker.rollout)
            self._stop.set()
            return
        past = {tp: offset + 1 for tp, (offset, _) in self._held.items()}
        self._store_offsets(past, marker)
        consumer.seek_to(past)
        self._held.clear()
        self._held_since = None
        self.serving, self.rollout = marker.serving, marker.rollout
        publisher.stamp(self.serving, self.rollout)
        publisher.forget_sent()  # --min-change: what the old serving version was sent is no basis any more
        logger.warning("passed rollout marker %d: %s serves from here on (this worker computes %s)",
                       marker.rollout, marker.serving, engine.model_tag)

    def _store_offsets(self, offsets: dict[PartitionKey, int], marker: Marker | None = None) -> None:
        """Store next offsets past markers (with the record of having passed ``marker``, in one write); the
        stored skips are done. A stored offset never moves back."""
        assert self.store is not None
        offsets = {tp: max(o, self._expected.get(tp, 0)) for tp, o in offsets.items()}
        tx = Transaction()
        tx.set_offsets(offsets)
        if marker is not None:
            record_rollout(tx, marker)
        self.store.commit(tx)
        self._expected.update(offsets)
        for tp in offsets:
            self._skipped.pop(tp, None)

    def _publish_all(self, engine: Engine, publisher: OutboxPublisher) -> bool:
        """Finish deferred hub work and deliver the whole outbox; False if stopped first."""
        while engine.pending() and not self._stop.is_set():
            self._recompute(engine, None, None, drain=True)
        sender = self._sender
        while not self._stop.is_set() and sender is not None:
            self._publish(publisher)
            if not sender.in_flight() and not publisher.pending():
                return True
            sender.wait(0.2)
        return False

    def _report_progress(self, producer: ProducerClient, consumer: ConsumerClient, final: bool = False) -> None:
        """Record this worker's progress in the rollout topic (what `gnnstream rollout status` shows; ``final``:
        the worker stops)."""
        s = self.settings
        try:
            lag = sum(consumer.lag().values())
        except Exception:
            lag = None
        key, value = worker_report(self, lag, final)
        try:  # flushed at once: a failure here must not surface in the next dead letters' flush
            producer.send(s.control_topic, key, value)
            producer.flush(2.0)
        except Exception as exc:  # best effort: the next report (every few seconds) says the same, newer
            self._limited.warning("progress", "could not record progress in %s (%s): %r", s.control_topic,
                                  classify(exc).kind, exc)

    # ------------------------------------------------------------------ ownership
    def _join(self, engine: Engine) -> bool:
        """Join the group that shares out the output topic; wait for the first assignment (False if stopped
        meanwhile). The events are read only from then on: what they change in the assigned partitions is
        published as it is applied."""
        s = self.settings
        # one group per version: a version's workers joining or leaving never move another version's partitions
        group = version_topic(engine.model_tag, s.group)
        self._set_status("joining", f"joining group {group} for the partitions of topic {self.output_topic}")
        count = self._output_partitions
        stored = engine.kept_partitions()
        # a revocation waits for this loop at most half a session: longer, kafka-python would miss heartbeats
        self._ownership = own = Ownership(s.kafka_client, s.bootstrap, self.output_topic, group,
                                          session_timeout_ms=s.session_timeout_ms, floor=engine.highest_epoch(),
                                          revoke_wait_s=s.session_timeout_ms / 2000)
        if stored is None:  # every node's final row is current
            self._kept = set(range(count))
        elif stored[0] != count:  # the output topic has other partitions now: nodes map elsewhere
            self._kept = set()
        engine.own(self._kept, set(), count)
        while not own.joined.wait(0.1):
            if self._stop.is_set():
                return False
        self._set_status("consuming", None)
        return True

    def _settled(self) -> bool:
        """The group has assigned this worker its partitions (and it took them over)."""
        own = self._ownership
        return own is not None and own.joined.is_set() and not self._rebalancing

    def _sync_ownership(self, engine: Engine, publisher: OutboxPublisher | None = None) -> None:
        """Act on the group's changes, between two batches.

        A revoked partition stops being published at once (the group hands
        it on only after that); its final rows are still computed until the
        next assignment says where it went, so that getting it back costs no
        recompute. Events are not read between a revocation and the next
        assignment (a rebalance). Assigned partitions are taken over at once,
        at the epoch claimed for them (docs/scaling.md).
        """
        own = self._ownership
        if own is None:
            return
        revoked, assignment, ticket = own.take()
        count = self._output_partitions
        if revoked:
            self._owned -= revoked
            engine.own(self._kept, self._owned, count)
            self._rebalancing = True
            own.done(ticket)
        if assignment is None:
            return
        assignment, epoch = assignment
        beyond = sorted(p for p in assignment if p >= count)
        if beyond:
            raise StreamError(f"topic {self.output_topic!r} has more partitions than the {count} this worker "
                              f"started with (it was assigned {beyond}): nodes map to other partitions now; restart "
                              f"every worker of group {self.settings.group!r}")
        self._rebalancing = False
        self._owned &= assignment  # an eager assignment is whole
        parts = assignment - self._owned
        computed = parts & self._kept
        self._kept = (self._kept & assignment) | parts
        self._owned |= parts
        engine.own(self._kept, self._owned, count, epoch=epoch)
        self.metrics.owned.set(len(self._owned))
        if not parts:
            return
        self._catch_up = True  # their dead letters: what the previous owner wrote, then what it did not
        if publisher is not None:  # every node of them goes out, whatever --min-change remembers of it
            publisher.forget_sent()
        t0 = time.perf_counter()
        stats = engine.take_over(parts, computed)
        self._spent("takeover", time.perf_counter() - t0)
        self.health.takeovers += 1
        self.health.final_recomputed += stats.recomputed[-1] if stats.recomputed else 0
        logger.info("took over output partitions %s: %d final rows computed, %d embeddings to publish, %.2f s",
                    sorted(parts), stats.recomputed[-1] if stats.recomputed else 0, stats.published,
                    time.perf_counter() - t0)
        if self._query is not None:
            self._query.notify()

    def _check_offsets(self, consumer: ConsumerClient, records: list[Record]) -> list[Record]:
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
            stored = self._expected.get(tp)
            if stored is not None and end < stored:
                resets[tp] = (stored, end)
        if resets:
            self._offset_reset(consumer, resets)
        expected = self._expected
        if not resets and all(r.offset >= expected.get((r.topic, r.partition), 0) for r in records):
            return records
        kept = [r for r in records
                if (r.topic, r.partition) not in resets and r.offset >= expected.get((r.topic, r.partition), 0)]
        stale = sum(1 for r in records if (r.topic, r.partition) not in resets) - len(kept)
        if stale:
            self._limited.warning("stale", "dropped %d records before their partition's stored offset (applied "
                                  "already)", stale)
        return kept

    def _offset_reset(self, consumer: ConsumerClient, resets: dict[PartitionKey, tuple[int, int]]) -> None:
        """Stop with :class:`OffsetResetError`, or move the reset partitions per ``on_offset_reset``."""
        s = self.settings
        assert self.store is not None
        self.metrics.errors.labels("offset_reset").inc(len(resets))
        if s.on_offset_reset == "fail":
            (topic, partition), (stored, end) = min(resets.items())
            more = f" (and {len(resets) - 1} more partitions)" if len(resets) > 1 else ""
            message = (f"topic {topic!r} partition {partition}: stored offset {stored} is past the partition's end "
                       f"offset {end}{more}, so the topic or the broker was replaced; nothing was read from it. "
                       f"To go on, start again with --on-offset-reset earliest (read it from its start) or latest "
                       f"(skip to its end), or GNNSTREAM_ON_OFFSET_RESET")
            self._set_error("offset_reset", f"offset_reset: {message}")
            raise OffsetResetError(message, resets)
        moved = {tp: 0 if s.on_offset_reset == "earliest" else end for tp, (_, end) in resets.items()}
        for tp, (stored, end) in sorted(resets.items()):
            logger.warning("topic %r partition %d: stored offset %d is past the partition's end offset %d (the "
                           "topic or the broker was replaced); resuming at its %s offset %d (--on-offset-reset %s)",
                           tp[0], tp[1], stored, end, s.on_offset_reset, moved[tp], s.on_offset_reset)
        # the one deliberate move back of a stored offset (GraphStore.apply refuses it)
        tx = Transaction()
        tx.set_offsets(moved)
        self.store.commit(tx)
        self._expected.update(moved)
        consumer.seek_to(moved)

    def _process(self, records: list, producer: ProducerClient, dlq: DeadLetterWriter, engine: Engine) -> None:
        s = self.settings
        in_dim = engine.model.config.in_dim
        good = []
        letters: list[DeadLetter] = []
        offsets: dict[tuple[str, int], int] = {}
        oldest_ms = min(r.timestamp_ms for r in records)
        for tp, offset in self._skipped.items():  # markers passed before, read again (a repeated command)
            offsets[tp] = offset
        self._skipped = {}
        for r in records:
            offsets[(r.topic, r.partition)] = max(offsets.get((r.topic, r.partition), 0), r.offset + 1)
            try:
                ev = decode_event_json(r.value, max_bytes=s.max_event_bytes)
                check_features(ev, in_dim)
            except InvalidEvent as exc:
                letters.append(DeadLetter.for_error(r, exc))
                continue
            good.append(ev)
        if letters:
            for letter in letters:
                self.metrics.invalid.labels(letter.reason).inc()
            self.health.invalid += len(letters)
            # written before the offsets past them are stored; held ones stored with those offsets
            self._deliver_letters(self._letters.sort(letters, self._owns_letter), dlq)
        t0 = time.perf_counter()
        assert self.store is not None
        held = self._letters.stored()
        result = self.store.apply(good, offsets, None if held is None else {_LETTERS_META: held})
        self._expected.update(offsets)
        self._spent("apply", time.perf_counter() - t0)
        self.metrics.apply_seconds.observe(time.perf_counter() - t0)
        if self._sender is not None:  # the publisher may be idle: hand it what waits before the recompute
            self._publish(self._sender.publisher)
        for op, count in Counter(map(_op, good)).items():
            self.metrics.events.labels(op).inc(count)
        self.health.applied += len(good)
        self.health.batches += 1
        self.metrics.batches.inc()
        self._recompute(engine, result.max_ts if good else None, oldest_ms / 1000.0)

    # ------------------------------------------------------------------ dead letters
    def _owns_letter(self, letter: DeadLetter) -> bool:
        """Whether this worker writes ``letter``: it owns the output partition of its source partition."""
        return letter_partition(letter.topic, letter.partition, self._output_partitions) in self._owned

    def _held_letters(self, dlq: DeadLetterWriter) -> None:
        """Write the held dead letters whose partition this worker owns now (after a takeover, once it read
        what the previous owner wrote)."""
        due = self._letters.due(self._owns_letter, 5.0 if self._catch_up else 0.0)
        self._catch_up = False
        if due:
            logger.info("writing %d dead letters held for output partitions this worker owns now", len(due))
            self._deliver_letters(list(due), dlq)
            self._letters.written(due)

    def _deliver_letters(self, letters: list[DeadLetter], dlq: DeadLetterWriter) -> None:
        """Write ``letters`` (transient errors retried with backoff, for ever; permanent ones: each letter
        cut to fit, else skipped, :meth:`DeadLetterWriter.deliver`)."""
        while letters:
            truncated = dlq.truncated
            try:
                dlq.deliver(letters, 30.0)
            except Exception as exc:
                self._recoverable("dead_letter", exc)
                if self._stop.is_set():
                    raise
                continue
            finally:
                self.metrics.truncated.inc(dlq.truncated - truncated)
            self._cleared("dead_letter")

    def _skipped_letter(self, kind: str) -> None:
        """A dead letter the topic refused even cut to fit (:class:`DeadLetterWriter` logged it)."""
        self.metrics.errors.labels(f"dead_letter_{kind}").inc()

    def _check_fits(self, engine: Engine, limit: int, what: str) -> None:
        """Refuse to start when an embedding update of this model could exceed ``limit`` bytes."""
        s = self.settings
        size = largest_update_bytes(engine.model.config.out_dim, engine.model_tag, s.output_format)
        headers = len(WORKER_HEADER) + len(self.worker_id.encode()) + 256  # worker, serving version, marker
        if size + headers + RECORD_OVERHEAD > limit:
            raise StreamError(f"an embedding update of model {engine.model_tag} ({engine.model.config.out_dim} "
                              f"values, --output-format {s.output_format}) may take {size + headers} bytes, more "
                              f"than the {limit} that {what} allows: raise it to at least "
                              f"{size + headers + RECORD_OVERHEAD}" + (" or use --output-format binary"
                                                                      if s.output_format == "json" else ""))

    def _recompute(self, engine: Engine, event_ts: float | None, oldest_record_s: float | None,
                   drain: bool = False, publish: bool = True) -> None:
        t0 = time.perf_counter()
        had_deferred = len(self._deferred_keys) > 0
        stats = engine.recompute(event_ts=event_ts, publish=publish, drain=drain)
        self.metrics.recompute_seconds.observe(time.perf_counter() - t0)
        write = stats.phases.get("outputs", 0.0) + stats.phases.get("write", 0.0)
        self._spent("final", stats.final_seconds)
        self._spent("write", write)
        self._spent("layers", time.perf_counter() - t0 - stats.final_seconds - write)
        for layer, n in enumerate(stats.recomputed, 1):
            self.metrics.dirty.labels(str(layer)).set(n)
        if len(stats.recomputed) == engine.num_layers:
            self.health.final_recomputed += stats.recomputed[-1]
            changed = self.health.changed or [0] * engine.num_layers
            self.health.changed = [a + b for a, b in zip(changed, stats.changed)]
        self.metrics.sampled.observe(stats.sampled_neighbours)
        self.metrics.subgraph_edges.observe(stats.sampled_neighbours + sum(stats.recomputed))
        self.metrics.fanout_capped.inc(stats.fanout_capped)
        self.metrics.deferred.set(stats.deferred)
        # count each (layer, hub) propagation once when it becomes deferred, not again at every recompute
        # that carries it: the deferred marks now, less those carried over (all were caught up when the
        # engine took them this time, which restarts its deferral clock)
        now = self._deferred_marks(engine.store) if stats.deferred else np.zeros(0, dtype=np.int64)
        taken = drain or (had_deferred and engine.deferred_age() == 0.0)
        new = now if taken else np.setdiff1d(now, self._deferred_keys, assume_unique=True)
        self._deferred_keys = now
        self.metrics.deferred_total.inc(len(new))
        self.metrics.staleness.set(engine.deferred_age())
        if oldest_record_s is not None and (self._oldest_record_s is None
                                            or oldest_record_s < self._oldest_record_s):
            self._oldest_record_s = oldest_record_s  # the oldest record not handed to the publisher yet
        if self._query is not None:
            self._query.notify()

    @staticmethod
    def _deferred_marks(store: GraphStore) -> np.ndarray:
        """The deferred hub marks in the store, as sorted ``tag << 32 | iid`` keys."""
        from gnnstream.workers.engine import DEFERRED_TAG
        tags, iids, _ = store.dirty_mark_arrays()
        sel = tags >= DEFERRED_TAG
        return np.unique((tags[sel] << 32) | iids[sel])

    def _drain_on_stop(self, engine: Engine, publisher: OutboxPublisher | None) -> None:
        """On a requested stop, finish deferred hub work within ``drain_timeout_s`` and publish it."""
        s = self.settings
        pending = engine.pending()
        if pending and "publish" in self._errors:
            logger.warning("stopping without draining: publishing fails (%s)", self._errors["publish"])
        elif pending and self._stop.is_set() and s.drain_timeout_s > 0 and not self._hurry.is_set():
            self._set_status("draining", f"stopping: finishing {pending} dirty marks (deferred hub work) within "
                                         f"{s.drain_timeout_s:g} s")
            deadline = time.monotonic() + s.drain_timeout_s
            while engine.pending() and time.monotonic() < deadline and not self._hurry.is_set():
                self._recompute(engine, None, None, drain=True)
                if publisher is not None:
                    self._publish(publisher)
        left = self.health.pending_marks = engine.pending()
        if left:
            logger.warning("stopping with %d dirty marks pending (deferred hub work); they are stored and the "
                           "next start recomputes them (--drain-timeout-s %g)", left, s.drain_timeout_s)

    def _resize(self, polled: int) -> None:
        """Dynamic micro-batching: double the next poll's size after a full poll (a backlog), up to
        ``max_batch_size``; halve it after a poll less than half full, down to ``batch_size``."""
        s = self.settings
        target = self._batch_target
        if polled >= target:
            target = min(2 * target, max(s.max_batch_size, s.batch_size))
        elif polled < target // 2:
            target = max(target // 2, s.batch_size)
        self._batch_target = target
        if polled:
            self.metrics.batch_size.observe(polled)

    def _publish(self, publisher: OutboxPublisher) -> None:
        """Delete the outbox records of delivered batches and hand new ones to the publisher thread.

        At most ``_MAX_IN_FLIGHT`` batches wait for delivery. While that
        many do, the new outbox records stay stored and the loop goes on with
        the next events; the records waiting then go out together, each node
        once (:meth:`OutboxPublisher.prepare`). While delivery fails, the loop
        waits for it instead (for ever unless stopping). When the last poll
        was empty, it waits for what is in flight (up to ``batch_wait_ms``:
        there is nothing to overlap it with).
        """
        sender = self._sender
        if sender is None:  # not started (stopped while waiting for Kafka)
            return
        while True:
            if sender.failure is not None:
                raise sender.failure
            self._confirm(publisher)
            if sender.in_flight() < _MAX_IN_FLIGHT:
                out = publisher.prepare(_PUBLISH_LIMIT)
                if not out.keys:
                    break
                out.oldest_record_s, self._oldest_record_s = self._oldest_record_s, None
                sender.submit(out)
            elif "publish" in self._errors and not self._stop.is_set():
                sender.wait(0.5)
            else:
                break
        if self._idle and sender.in_flight():
            sender.wait(self.settings.batch_wait_ms / 1000)
            self._confirm(publisher)

    def _confirm(self, publisher: OutboxPublisher) -> None:
        for out in self._sender.delivered() if self._sender is not None else ():
            publisher.confirm(out)

    def _finish_delivery(self, publisher: OutboxPublisher) -> None:
        """On leaving the loop: hand over what is left and wait (bounded) for its delivery."""
        sender = self._sender
        if sender is None:
            return
        deadline = time.monotonic() + _STOP_DELIVERY_S
        self._publish(publisher)
        while sender.in_flight() and time.monotonic() < deadline and not self._hurry.is_set():
            sender.wait(0.2)
            self._confirm(publisher)
            if not self._stop.is_set() or sender.in_flight() < _MAX_IN_FLIGHT:
                self._publish(publisher)
        self._confirm(publisher)
        left = self.health.pending_outbox = publisher.pending()
        if left:
            logger.warning("stopping with %d outbox records not delivered; they are stored and the next start "
                           "publishes them", left)

    def _delivered(self, out: Outgoing, seconds: float) -> None:
        """Metrics of a delivered batch (the publisher thread): per batch, freshness one array at a time."""
        now = time.time()
        self.metrics.publish_seconds.observe(seconds)
        self.metrics.published.inc(len(out))
        if out.suppressed:  # left out by --min-change: confirmed with the batch, never sent
            self.metrics.suppressed.inc(out.suppressed)
        self.health.published += len(out)
        self.metrics.freshness.observe_many(np.maximum(0.0, now - out.event_ts))
        if out.oldest_record_s is not None:
            latency = max(0.0, now - out.oldest_record_s)
            self.metrics.pipeline.observe(latency)
            self.latency_timeline.append((now, latency))

    def _check_partitions(self, consumer: ConsumerClient) -> None:
        """Stop, with the reason, when the events topic gained partitions: this worker reads those it found
        when it started (a restart reads them all, new ones from their start)."""
        topic = self.settings.events_topic
        try:
            found = consumer.partitions_of(topic, timeout_s=2.0)
        except StreamError:  # metadata late: the next check
            return
        reading = {p for t, p in consumer.assignment() if t == topic}
        if found - reading:
            raise StreamError(f"topic {topic!r} has {len(found)} partitions now, this worker reads {len(reading)}: "
                              f"restart it to read partitions {sorted(found - reading)} too")

    def _report_lag(self, consumer: ConsumerClient) -> None:
        try:
            for (topic, partition), lag in consumer.lag().items():
                self.metrics.lag.labels(str(partition)).set(lag)
        except Exception as exc:
            logger.debug("lag unavailable: %r", exc)

    def _spent(self, phase: str, seconds: float) -> None:
        """Add to the cumulative seconds of ``phase`` (``/healthz`` ``seconds``)."""
        self.health.seconds[phase] = self.health.seconds.get(phase, 0.0) + seconds

    # ------------------------------------------------------------------ errors
    def _set_error(self, kind: str, text: str) -> None:
        self._errors.pop(kind, None)
        self._errors[kind] = text
        self.health.last_error = text

    def _cleared(self, kind: str) -> None:
        """An operation of ``kind`` succeeded: its error is over (``last_error`` shows any other left)."""
        self._failing.pop(kind, None)
        if self._errors.pop(kind, None) is not None:
            self._limited.forget(kind)
            logger.info("%s works again", kind)
            self.health.last_error = next(reversed(self._errors.values()), None)

    def _recoverable(self, kind: str, exc: BaseException, pause: bool = True) -> float:
        """Count and report an error of ``kind`` that a retry may cure (:mod:`stream.errors`: transient);
        pause with backoff (unless stopping, or not ``pause``); the pause, in seconds.

        The first failure is logged, repeats once a minute (counted); ``/healthz`` turns 503 when the errors
        of a kind have gone on for ``_UNHEALTHY_AFTER_S``.
        """
        self.metrics.errors.labels(kind).inc()
        self._set_error(kind, f"{kind}: {exc!r}")
        since, attempts = self._failing.get(kind, (time.monotonic(), 0))
        self._failing[kind] = (since, attempts + 1)
        delay = backoff_s(attempts + 1)
        self._limited.warning(kind, "%s failed (%s), retrying with backoff: %r", kind, classify(exc).kind, exc)
        if pause:
            self._stop.wait(delay)
        return delay
