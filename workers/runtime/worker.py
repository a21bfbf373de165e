"""The streaming worker: graph events in, exact embeddings out.

:class:`Worker` wires the parts of the runtime together (:mod:`.connect`,
:mod:`.offsets`, :mod:`.markers`, :mod:`.dead_letters`, :mod:`.group`,
:mod:`.publisher`, :mod:`.health`, :mod:`.metrics`). One loop iteration is
a micro-batch, in numbered steps:

1. poll up to the current batch target of records (waiting at most
   ``batch_wait_ms`` for the first); the target starts at ``batch_size``,
   doubles while polls come back full (a backlog) up to ``max_batch_size``
   and as far as ``max_latency_ms`` allows, and halves back while they come
   back less than half full (light load, small batches) or rounds are
   delivered late; a poll that came back light waits for more records as
   long as ``max_latency_ms`` allows (:mod:`.batching`);
2. check the stored offsets against the partitions' ends (:mod:`.offsets`)
   and hold partitions at rollout markers (:mod:`.markers`);
3. decode and validate; invalid records are queued to the dead-letter topic
   and the producer is flushed before anything else happens (a bad record is
   never lost, and never holds up the good ones behind it; :mod:`.dead_letters`);
4. apply the good events and the next offset of every partition seen in one
   RocksDB WriteBatch (the store is the source of truth: after a crash the
   worker resumes from these offsets, so nothing is lost or applied twice);
5. recompute the dirty embeddings; they and their outbox entries are written
   in one WriteBatch;
6. resolve the new outbox records (each node's state as stored now, read in
   this thread right after the recompute) and hand them to the publisher
   thread (:mod:`.publisher`), which has the delivery process (:mod:`gnnstream.stream.delivery`) encode,
   send and flush them in order while this thread goes on with the next
   batch; the outbox records of a batch are deleted (by this
   thread) only after the publisher reported its flush succeeded
   (at-least-once: consumers keep the highest version per node). While
   the publisher is busy, new outbox records wait in the store and this
   thread goes on; the publisher's next batch takes all of them, each node
   once, so under a backlog delivery coalesces the updates of many batches;
7. commit Kafka offsets, for lag tools only, and report progress to the
   rollout topic.

If Kafka is unavailable the loop keeps its state and retries: the publisher
retries the same batch (later ones wait behind it, so each node's versions go
out in order) and an unpublished outbox stays in RocksDB until a flush
succeeds. After a crash the next start publishes every outbox record left,
each node at its newest stored version.

Starting: the ``/healthz`` endpoint comes up first and answers 503 with a
``reason`` (opening the state, running a backfill, waiting for Kafka, joining
the group) until the worker consumes, 200 after. A broker that is not up yet
is waited for with capped backoff, for ever unless ``broker_wait_s`` is set.

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
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from gnnstream.graph_state.store import GraphStore
from gnnstream.stream.backends import open_producer
from gnnstream.stream.clients import ConsumerClient, PartitionKey, ProducerClient, Record
from gnnstream.stream.delivery import Delivery, DeliveryProcess
from gnnstream.stream.errors import classify
from gnnstream.stream.exceptions import DeliveryError, StreamError
from gnnstream.stream.kafka import topic_max_message_bytes
from gnnstream.stream.rollout import Marker, version_topic
from gnnstream.workers.engine.typed import graph_edges
from gnnstream.workers.heap import freeze_warm_heap
from gnnstream.workers.rollout.records import WorkerProgress, stored_rollout, worker_report
from gnnstream.workers.runtime.batching import BatchSizer
from gnnstream.workers.runtime.connect import (check_fits, check_partitions, open_consumers, partition_count,
                                                wait_for_kafka)
from gnnstream.workers.runtime.dead_letters import DeadLetters, decode
from gnnstream.workers.runtime.transactions import TransactionScores
from gnnstream.workers.runtime.group import Group
from gnnstream.workers.runtime.health import Errors, Health, verdict
from gnnstream.workers.runtime.markers import MarkerBarrier
from gnnstream.workers.runtime.metrics import MetricsServer, WorkerMetrics
from gnnstream.workers.runtime.offsets import Offsets
from gnnstream.workers.runtime.publisher import OutboxReader, Outgoing, Publisher
from gnnstream.workers.settings import WorkerSettings

if TYPE_CHECKING:  # torch-backed modules are imported by Worker.run, after /healthz is up
    from gnnstream.workers.engine import Engine

__all__ = ["Worker", "default_worker_id"]

logger = logging.getLogger(__name__)

_STOP_DELIVERY_S = 4.0  # on stop, the longest wait for the publisher to deliver what it holds
_STOP_CLOSE_S = 1.0  # on stop, then the longest wait for each client to close (they close side by side)
_TOPIC_CHECK_S = 30.0  # how often the loop looks for partitions added to the events topic
_REPORT_EVERY_S = 5.0  # how often the worker records its progress in the rollout topic
_op = operator.attrgetter("op")
_timestamp_ms = operator.attrgetter("timestamp_ms")


def default_worker_id(state: str) -> str:
    """A worker's name when none is given: the host's and the state directory's."""
    return f"{socket.gethostname()}-{os.path.basename(os.path.abspath(state))}"


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


class Worker:
    """A gnnstream worker bound to one state directory and one model.

    Args:
        settings: see :class:`gnnstream.workers.settings.WorkerSettings`.
    """

    def __init__(self, settings: WorkerSettings):
        self.settings = s = settings
        self.metrics = WorkerMetrics()
        self._stop = threading.Event()
        self._hurry = threading.Event()  # a second stop signal: skip the drain
        self.health = Health(started=time.time())
        self.errors = Errors(self.health, self.metrics, self._stop)
        self.store: GraphStore | None = None
        self.engine: Engine | None = None
        # (publish time, publish time - oldest Kafka record time of the batch), newest last
        self.latency_timeline: deque[tuple[float, float]] = deque(maxlen=100_000)
        self.worker_id = s.worker_id or default_worker_id(s.state)
        self.output_topic = s.output_topic  # the model's version topic unless set (resolved at start)
        self.group = Group(s.kafka_client, s.bootstrap, s.group, s.session_timeout_ms, self.metrics)
        self.markers = MarkerBarrier()
        self.serving: str | None = None  # the version serving as of the last marker passed (stream.rollout)
        self.retired: Marker | None = None  # the marker that retired this worker's version
        self.offsets: Offsets | None = None  # set once the state is open
        self.publisher: Publisher | None = None  # set once Kafka is reachable
        self._outbox: OutboxReader | None = None
        self._letters: DeadLetters | None = None
        self._transactions: TransactionScores | None = None  # a typed model's transaction scores
        self._query: Any = None  # the query API process (query.server.QueryProcess), told of every commit
        self._idle = False  # the last poll brought nothing: publishing waits for delivery (nothing to overlap)
        self.batching = BatchSizer(s.batch_size, s.max_batch_size, s.max_latency_ms / 1000)  # the polls' size
        self._last_report = 0.0

    @property
    def rollout(self) -> int:
        """The number of the last rollout marker passed."""
        return self.markers.rollout

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
        ok, reason = verdict(h, self.errors, self._stop.is_set())
        return {"ok": ok, "status": h.status, "reason": reason, "batches": h.batches, "applied": h.applied,
                "invalid": h.invalid, "published": h.published, "polls": h.polls,
                "kafka_attempts": h.kafka_attempts, "last_error": h.last_error,
                "pending_marks": h.pending_marks, "pending_outbox": h.pending_outbox,
                "position": self.offsets.position() if self.offsets is not None else 0, "worker": self.worker_id,
                "owned_partitions": sorted(self.group.owned), "serving": self.serving, "rollout": self.rollout,
                "held_at_marker": sorted(p for _, p in self.markers.held),
                "final_recomputed": h.final_recomputed, "takeovers": h.takeovers,
                "seconds": {k: round(v, 3) for k, v in h.seconds.items()}, "changed": h.changed,
                "uptime_s": round(time.time() - h.started, 3)}

    def progress(self, final: bool = False) -> WorkerProgress:
        """What this worker reports to the rollout topic (``final``: it stops)."""
        h = self.health
        stopping = (final or self._stop.is_set()) and h.status == "consuming"
        return WorkerProgress(self.engine.model_tag if self.engine is not None else None, self.worker_id,
                              self.output_topic, "stopped" if stopping else h.status, self.serving, self.rollout,
                              h.applied, h.published, self.markers.holding(), list(self.latency_timeline))

    def run(self, max_idle_s: float | None = None) -> dict[str, Any]:
        """Run until :meth:`stop` (or ``max_idle_s`` without records); return a summary.

        Raises:
            workers.runtime.offsets.OffsetResetError: a stored offset is past the end of its partition
                and ``on_offset_reset`` is ``fail``.
            TopicSetupError: Kafka was not reachable within ``broker_wait_s``
                (when set).
        """
        s = self.settings
        model = s.model or "(the state's)"
        self.health.set_status("starting", f"opening state {s.state} and model {model}")
        server = MetricsServer(self.metrics, s.metrics_port, self.health_info, host=s.metrics_host) \
            if s.metrics_port else None
        try:
            from gnnstream.workers.state import open_store  # imports torch: after /healthz is up
            # a new state takes the model's sampling seed; an existing one must have been created with it
            self.store = store = open_store(s.state, create=True, model_dir=s.model, edge_ttl=s.edge_ttl)
            try:
                self._run(store, max_idle_s)
            finally:
                store.close()
                self.store = None
        except BaseException as exc:
            self.health.set_status("failed", f"{type(exc).__name__}: {exc}".splitlines()[0])
            raise
        finally:
            if server:
                server.close()
        if self.retired is not None:
            self.health.set_status("retired", f"{self.retired.retire} was retired at rollout marker "
                                              f"{self.retired.rollout}")
        else:
            self.health.set_status("stopped", "stopped")
        return self.health_info()

    def _run(self, store: GraphStore, max_idle_s: float | None) -> None:
        from gnnstream.workers.state import open_engine
        s = self.settings
        engine = self.engine = open_engine(store, s.model, hub_bound=s.hub_bound,
                                           max_deferred_age=s.max_staleness_s)
        self.output_topic = s.output_topic or version_topic(engine.model_tag)
        self.serving, rollout = stored_rollout(store, engine.model_tag)
        self.markers = MarkerBarrier(rollout)
        self.offsets = Offsets(store, s.on_offset_reset, self.errors)
        self.group.restore(engine)  # nothing is published before the group's assignment
        if engine.needs_backfill():
            self.health.set_status("backfill", f"running backfill of model {engine.model_tag} over state {s.state}")
            engine.backfill(publish=False)
        if engine.pending():
            self.health.set_status("recovering", f"recomputing {engine.pending()} dirty marks the last run left")
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
        check_fits(engine, s, self.worker_id, s.max_message_bytes, "--max-message-bytes (GNNSTREAM_MAX_MESSAGE_BYTES)")
        # the updates go out through a process of their own; the dead letters through this thread's producer
        delivery = DeliveryProcess(s.kafka_client, s.bootstrap, self.output_topic, engine.model_tag,
                                   s.output_format, worker=self.worker_id, max_message_bytes=s.max_message_bytes)
        dlq_producer = open_producer(s.kafka_client, s.bootstrap, max_message_bytes=s.max_message_bytes)
        outbox = self._outbox = OutboxReader(store, engine.outbox_columns, min_change=s.min_change)
        outbox.stamp(self.serving, self.rollout)
        letters = self._letters = DeadLetters(dlq_producer, s.dlq_topic, s.max_message_bytes, store, self.group.owns,
                                              lambda: self.group.partitions, self.health, self.errors, self._stop)
        self._transactions = TransactionScores.of(engine, dlq_producer, s.transaction_topic, store)
        publisher: Publisher | None = None
        try:
            self.health.set_status("waiting_for_kafka", f"waiting for Kafka at {s.bootstrap}")
            topics = {s.events_topic: s.partitions, self.output_topic: s.partitions, s.dlq_topic: 1,
                      **({s.control_topic: 1} if s.control_topic else {}),
                      **({s.transaction_topic: s.partitions} if self._transactions else {})}
            if not wait_for_kafka(s, topics, self.errors, self._stop):  # stopped meanwhile: nothing can be published
                self._drain_on_stop(engine)
                return
            limit = topic_max_message_bytes(s.bootstrap, self.output_topic)
            if limit is not None:
                check_fits(engine, s, self.worker_id, limit, f"max.message.bytes of topic {self.output_topic!r}")
            letters.writer.max_bytes = min(s.max_message_bytes,
                                           topic_max_message_bytes(s.bootstrap, s.dlq_topic) or 2**62)
            publisher = self.publisher = self._new_publisher(outbox, delivery)
            self._publish(publisher)
            self.health.set_status("joining", f"assigning every partition of topic {s.events_topic}")
            consumers = open_consumers(s, self.worker_id, self.offsets.stored, self.errors, self._stop)
            if consumers is None:
                self._drain_on_stop(engine)
                return
            consumer, letters.group.reader = consumers
            clean = False
            try:
                if not self._join(consumer, engine):  # stopped meanwhile
                    self._drain_on_stop(engine)
                    return
                self._publish_transactions()  # those of a batch applied before a crash
                self._loop(consumer, dlq_producer, publisher, engine, max_idle_s)
                clean = True
            finally:
                # leaving the group may block on an unreachable broker: it goes on while the rest stops
                closing = _in_background(consumer.close, "consumer-close")
                if letters.group.reader is not None:
                    reader, letters.group.reader = letters.group.reader, None
                    _in_background(reader.close, "dead-letter-reader-close")
                if clean:
                    self._drain_on_stop(engine)
                self._finish_delivery(publisher)
                closing.join(_STOP_CLOSE_S)
                if closing.is_alive():
                    logger.warning("the consumer did not leave its group within %g s (broker unreachable?); "
                                   "exiting without waiting for it", _STOP_CLOSE_S)
        finally:
            self.group.close(_STOP_CLOSE_S + 1.0)  # the other workers take this one's partitions
            if publisher is not None:
                publisher.close(_STOP_CLOSE_S)
            self.publisher = None
            closers = [_in_background(lambda c=c: c.close(_STOP_CLOSE_S), "producer-close")
                       for c in (delivery, dlq_producer)]
            for closer in closers:
                closer.join(_STOP_CLOSE_S + 0.5)

    def _join(self, consumer: ConsumerClient, engine: Engine) -> bool:
        """Join the group that shares out the output topic; wait for the first assignment (False if stopped
        meanwhile). The events are read only from then on: what they change in the assigned partitions is
        published as it is applied."""
        count = partition_count(consumer, self.output_topic, self.errors, self._stop)
        if not count:
            return False
        self.health.set_status("joining", f"joining group {self.group.member_group(engine.model_tag)} for the "
                                          f"partitions of topic {self.output_topic}")
        if not self.group.join(engine, self.output_topic, count, self._stop):
            return False
        self.health.set_status("consuming", None)
        return True

    # ------------------------------------------------------------------ the loop
    def _loop(self, consumer: ConsumerClient, producer: ProducerClient, publisher: Publisher, engine: Engine,
              max_idle_s: float | None) -> None:
        s = self.settings
        letters, markers, offsets = self._letters, self.markers, self.offsets
        assert letters is not None and offsets is not None
        idle_since = time.monotonic()
        last_lag = 0.0
        last_topic_check = time.monotonic()
        while not self._stop.is_set():
            self._sync_ownership(engine)
            if letters.due() and not self.group.rebalancing:
                letters.write_held()
            if self.group.rebalancing:  # no events until the group has assigned the partitions again
                self._publish(publisher)
                self._stop.wait(0.05)
                continue
            # 1. poll
            try:
                records = self._poll(consumer)
            except StreamError:
                raise
            except Exception as exc:  # Kafka unavailable: keep state, retry
                self.errors.recoverable("poll", exc)
                continue
            polled, polled_at = len(records), time.perf_counter()
            self.errors.cleared("poll")
            self.health.last_poll = time.time()
            self.health.polls += 1
            # 2. offsets and rollout markers
            records = offsets.check(consumer, records)
            if records:
                records = markers.hold(consumer, records)
                skipped = markers.skipped()
                if skipped and not records:  # nothing of the poll to apply: store the offsets past them
                    self._store_offsets(skipped)
            if records or not consumer.assignment():  # idle time counts once partitions are assigned
                idle_since = time.monotonic()
            # 3-5. decode, apply, recompute
            if records:
                self._process(records, producer, engine)
            elif engine.pending():
                self._recompute(engine, None, None)
            if markers.holding():
                self._pass_markers(consumer, publisher, engine)
            self._sync_ownership(engine)
            # 6. publish
            self._idle = not records
            self._publish(publisher)
            self.batching.processed(polled, time.perf_counter() - polled_at)
            # 7. commit, report
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
                check_partitions(consumer, s.events_topic)
            if max_idle_s is not None and not records and time.monotonic() - idle_since > max_idle_s \
                    and not engine.pending() and not publisher.pending() and self.group.settled():
                break
        if s.control_topic:  # the last word: how it stopped
            self._report_progress(producer, consumer, final=True)

    def _process(self, records: list[Record], producer: ProducerClient, engine: Engine) -> None:
        """Steps 3 to 5 of a batch: decode (invalid records to the dead letters), apply, recompute."""
        s = self.settings
        assert self.store is not None and self.offsets is not None and self._letters is not None
        good, letters = decode(records, engine.read_event, s.max_event_bytes)
        offsets = self.markers.skipped()  # markers passed before, read again (a repeated command)
        for r in records:
            offsets[(r.topic, r.partition)] = max(offsets.get((r.topic, r.partition), 0), r.offset + 1)
        if letters:  # written before the offsets past them are stored; held ones stored with those offsets
            self._letters.queue(letters)
        t0 = time.perf_counter()
        meta = {**(self._letters.stored() or {}), **(self._transactions.take() if self._transactions else {})}
        result = self.store.apply(good, offsets, meta or None)
        self._applied(result, engine.typed)
        self.offsets.applied(offsets)
        self.markers.stored(offsets)
        self.health.spent("apply", time.perf_counter() - t0)
        self.metrics.apply_seconds.observe(time.perf_counter() - t0)
        if self.publisher is not None:  # the publisher may be idle: hand it what waits before the recompute
            self._publish(self.publisher)
        for op, count in Counter(map(_op, good)).items():
            self.metrics.events.labels(op).inc(count)
        self.health.applied += len(records) - len(letters)  # valid events as produced (a typed one is several)
        self.health.batches += 1
        self.metrics.batches.inc()
        self._recompute(engine, result.max_ts if good else None, min(r.timestamp_ms for r in records) / 1000.0)
        self._publish_transactions()

    def _publish_transactions(self) -> None:
        """Publish the pending transaction scores; a transient failure keeps them for the next batch, a
        permanent one (:func:`classify`) drops them once, logged and counted. While another version serves (a
        rollout's candidate, or the version rolled back from), the serving version's workers publish them."""
        if self._transactions is None:
            return
        if self.serving not in (None, self.engine.model_tag):
            self._transactions.pending = []
            return
        scores = self._transactions
        before = scores.published, scores.unscored
        try:
            scores.publish()
            self.metrics.transaction_scores.inc(scores.published - before[0])
            self.metrics.transactions_unscored.inc(scores.unscored - before[1])
            self.errors.cleared("transaction_scores")
        except DeliveryError as exc:
            if classify(exc).permanent:  # a topic missing or refused, a record refused: retrying cannot cure it
                dropped = len(self._transactions.pending)
                self._transactions.pending = []
                self.metrics.errors.labels("transaction_scores").inc()
                logger.error("%d transaction scores not published to %r and dropped: %r", dropped,
                             self.settings.transaction_topic, exc)
            else:
                self.errors.recoverable("transaction_scores", exc, pause=False)

    def _applied(self, result: Any, typed: Any = None) -> None:
        """The event-time metrics of an applied batch (``GraphStore.apply``'s result; ``typed``: the typed
        graph's layout, whose edges are counted)."""
        self.metrics.late_events.inc(graph_edges(typed, result.late_events, result.late_loops))
        self.metrics.edges_expired.inc(graph_edges(typed, result.expired_edges, result.expired_loops))
        if result.stream_time is not None:
            self.metrics.stream_time.set(result.stream_time)

    def _recompute(self, engine: Engine, event_ts: float | None, oldest_record_s: float | None,
                   drain: bool = False, publish: bool = True) -> None:
        t0 = time.perf_counter()
        stats = engine.recompute(event_ts=event_ts, publish=publish, drain=drain)
        self.metrics.recompute_seconds.observe(time.perf_counter() - t0)
        write = stats.phases.get("outputs", 0.0) + stats.phases.get("write", 0.0)
        self.health.spent("final", stats.final_seconds)
        self.health.spent("write", write)
        self.health.spent("layers", time.perf_counter() - t0 - stats.final_seconds - write)
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
        self.metrics.deferred_total.inc(stats.newly_deferred)  # each propagation once, when it is deferred
        for stage, count in stats.stage_changes.items():
            self.metrics.stage_changes.labels(stage).inc(count)
        if stats.stream_time is not None:
            self.metrics.stream_time.set(stats.stream_time)
        self.metrics.staleness.set(engine.deferred_age())
        if self.publisher is not None:
            self.publisher.made_from(oldest_record_s)
        if self._query is not None:
            self._query.notify()

    def _new_publisher(self, outbox: OutboxReader, delivery: Delivery | DeliveryProcess) -> Publisher:
        """A publisher (its thread started) that reports to this worker's metrics, ``/healthz`` and errors."""
        return Publisher(outbox, delivery, self.output_topic, self._stop, on_delivered=self._delivered,
                         on_retry=lambda exc: self.errors.recoverable("publish", exc, pause=False),
                         on_ok=lambda: self.errors.cleared("publish"))

    def _publish(self, publisher: Publisher) -> None:
        """Step 6: confirm what was delivered, hand over what the outbox holds (:meth:`Publisher.publish`)."""
        publisher.publish(self.settings.batch_wait_ms / 1000 if self._idle else 0.0)

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
            self.batching.delivered(latency)
            self.latency_timeline.append((now, latency))

    def _poll(self, consumer: ConsumerClient) -> list[Record]:
        """Step 1: poll up to the batch target, a light poll waiting for more while the bound allows
        (:class:`BatchSizer`), and tell it what came back."""
        target = self.batching.target()
        self.metrics.batch_target.set(target)
        records = consumer.poll_batch(target, self.settings.batch_wait_ms / 1000)
        first = len(records)
        records = self.batching.fill(records, lambda n: consumer.poll_batch(n, 0.0), self._stop.wait)
        self.batching.polled(len(records), max(map(_timestamp_ms, records)) / 1000 if records else None, first)
        if records:
            self.metrics.batch_size.observe(len(records))
        return records

    # ------------------------------------------------------------------ rollout markers
    def _pass_markers(self, consumer: ConsumerClient, publisher: Publisher, engine: Engine) -> None:
        """Once every partition is held at a marker: finish and publish everything computed before them, then
        record the serving version and the offsets past them in one write (or stop, when the marker retires
        this worker's version)."""
        marker = self.markers.reached(consumer)
        if marker is None:
            return
        while engine.pending() and not self._stop.is_set():  # deferred hub work, then the whole outbox
            self._recompute(engine, None, None, drain=True)
        if self._stop.is_set() or not publisher.publish_all():
            return  # stopped meanwhile: the next start reads the markers again
        if marker.retire == engine.model_tag:
            self.retired = marker
            self.health.set_status("retired", f"{marker.retire} was retired at rollout marker {marker.rollout}")
            logger.warning("%s is retired by rollout marker %d: stopping (its state stays as it is at the marker; "
                           "a restart stops there again)", engine.model_tag, marker.rollout)
            self._stop.set()
            return
        past = self._store_offsets(self.markers.passed(marker), marker)
        consumer.seek_to(past)
        self.serving = marker.serving
        publisher.outbox.stamp(self.serving, self.rollout)
        publisher.outbox.forget_sent()  # --min-change: what the old serving version was sent is no basis any more
        logger.warning("passed rollout marker %d: %s serves from here on (this worker computes %s)",
                       marker.rollout, marker.serving, engine.model_tag)

    def _store_offsets(self, offsets: dict[PartitionKey, int], marker: Marker | None = None) -> dict[PartitionKey, int]:
        """Store next offsets past markers (with the record of having passed ``marker``, in one write)."""
        assert self.offsets is not None
        stored = self.offsets.store_past(offsets, marker)
        self.markers.stored(stored)
        return stored

    def _report_progress(self, producer: ProducerClient, consumer: ConsumerClient, final: bool = False) -> None:
        """Record this worker's progress in the rollout topic (what `gnnstream rollout status` shows; ``final``:
        the worker stops)."""
        s = self.settings
        try:
            lag = sum(consumer.lag().values())
        except Exception:
            lag = None
        key, value = worker_report(self.progress(final), lag)
        try:  # flushed at once: a failure here must not surface in the next dead letters' flush
            producer.send(s.control_topic, key, value)
            producer.flush(2.0)
        except Exception as exc:  # best effort: the next report (every few seconds) says the same, newer
            self.errors.limited.warning("progress", "could not record progress in %s (%s): %r", s.control_topic,
                                        classify(exc).kind, exc)

    # ------------------------------------------------------------------ ownership
    def _sync_ownership(self, engine: Engine) -> None:
        """Act on the group's changes (:meth:`Group.sync`); after a takeover, publish every node of the new
        partitions and write their dead letters."""
        taken = self.group.sync(engine)
        if taken is None:
            return
        if self._letters is not None:  # their dead letters: what the previous owner wrote, then what it did not
            self._letters.catch_up = True
        if self._outbox is not None:  # every node of them goes out, whatever --min-change remembers of it
            self._outbox.forget_sent()
        self.health.spent("takeover", taken.seconds)
        self.health.takeovers += 1
        self.health.final_recomputed += taken.recomputed
        logger.info("took over output partitions %s: %d final rows computed, %d embeddings to publish, %.2f s",
                    sorted(taken.partitions), taken.recomputed, taken.published, taken.seconds)
        if self._query is not None:
            self._query.notify()

    # ------------------------------------------------------------------ lag
    def _report_lag(self, consumer: ConsumerClient) -> None:
        try:
            for (topic, partition), lag in consumer.lag().items():
                self.metrics.lag.labels(str(partition)).set(lag)
        except Exception as exc:
            logger.debug("lag unavailable: %r", exc)

    # ------------------------------------------------------------------ stopping
    def _drain_on_stop(self, engine: Engine) -> None:
        """On a requested stop, finish deferred hub work within ``drain_timeout_s`` and publish it."""
        s = self.settings
        publisher = self.publisher
        pending = engine.pending()
        if pending and publisher is not None and publisher.failing:
            logger.warning("stopping without draining: publishing fails (%s)", self.errors.text("publish"))
        elif pending and self._stop.is_set() and s.drain_timeout_s > 0 and not self._hurry.is_set():
            self.health.set_status("draining", f"stopping: finishing {pending} dirty marks (deferred hub work) "
                                               f"within {s.drain_timeout_s:g} s")
            deadline = time.monotonic() + s.drain_timeout_s
            while engine.pending() and time.monotonic() < deadline and not self._hurry.is_set():
                self._recompute(engine, None, None, drain=True)
                if publisher is not None:
                    self._publish(publisher)
        left = self.health.pending_marks = engine.pending()
        if left:
            logger.warning("stopping with %d dirty marks pending (deferred hub work); they are stored and the "
                           "next start recomputes them (--drain-timeout-s %g)", left, s.drain_timeout_s)

    def _finish_delivery(self, publisher: Publisher) -> None:
        """On leaving the loop: hand over what is left and wait (bounded) for its delivery."""
        left = self.health.pending_outbox = publisher.finish(_STOP_DELIVERY_S, self._hurry)
        if left:
            logger.warning("stopping with %d outbox records not delivered; they are stored and the next start "
                           "publishes them", left)
