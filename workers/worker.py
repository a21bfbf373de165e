"""The streaming worker: graph events in, exact embeddings out.

One loop iteration is a micro-batch, in numbered steps:

1. poll up to ``batch_size`` records (waiting at most ``batch_wait_ms``);
2. decode and validate; invalid records are queued to the dead-letter topic
   and the producer is flushed before anything else happens (a bad record is
   never lost, and never holds up the good ones behind it);
3. apply the good events and the next offset of every partition seen in one
   RocksDB WriteBatch (the store is the source of truth: after a crash the
   worker resumes from these offsets, so nothing is lost or applied twice);
4. recompute the dirty embeddings; they and their outbox entries are written
   in one WriteBatch;
5. publish the outbox; entries are removed only after the producer's flush
   succeeded (at-least-once: consumers keep the highest version per node);
6. commit Kafka offsets, for lag tools only.

If Kafka is unavailable the loop keeps its state and retries: an unpublished
outbox stays in RocksDB until a flush succeeds.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from graph_state import keys
from graph_state.store import GraphStore
from stream.deadletter import DeadLetter, DeadLetterWriter
from stream.events import InvalidEvent, NodeUpsert, decode_event_json
from stream.exceptions import StreamError
from stream.kafka import EventConsumer, Producer, ensure_topics
from stream.updates import EmbeddingUpdate, encode_update, tombstone
from workers.engine import Engine
from workers.heap import freeze_warm_heap
from workers.metrics import MetricsServer, WorkerMetrics
from workers.offline import open_engine
from workers.settings import WorkerSettings
from workers.tables import OutboxEntry, decode_outbox

__all__ = ["Worker", "OutboxPublisher"]

logger = logging.getLogger(__name__)


class OutboxPublisher:
    """Sends outbox entries to Kafka and deletes them once the flush succeeded.

    Args:
        resolve: ``(iids, computed_at) -> entries``, the stored state of the
            nodes an outbox record names (:meth:`Engine.outbox_entries`).
    """

    def __init__(self, store: GraphStore, producer: Producer, topic: str, model_tag: str,
                 resolve: Callable[[np.ndarray, float], list[OutboxEntry]], fmt: str = "json"):
        self.store = store
        self.producer = producer
        self.topic = topic
        self.model_tag = model_tag
        self.resolve = resolve
        self.fmt = fmt

    def pending(self) -> int:
        return sum(1 for _ in self.store.column("outbox").keys())

    def publish(self, limit: int = 50_000, flush_timeout_s: float = 30.0) -> list[OutboxEntry]:
        """Publish up to about ``limit`` entries; returns them (raises on delivery failure)."""
        sent_keys: list[bytes] = []
        entries: list[OutboxEntry] = []
        for key, raw in self.store.column("outbox").items():
            computed_at, iids = decode_outbox(raw)
            entries.extend(self.resolve(iids, computed_at))
            sent_keys.append(key)
            if len(entries) >= limit:
                break
        if not sent_keys:
            return []
        for entry in entries:
            if entry.embedding is None:
                k, v, headers = tombstone(entry.node, entry.version)
                self.producer.send(self.topic, k, v, headers)
            else:
                update = EmbeddingUpdate(entry.node, self.model_tag, entry.version, entry.embedding,
                                         entry.event_ts, entry.computed_at, entry.mode)
                self.producer.send(self.topic, entry.node.encode(), encode_update(update, self.fmt))
        self.producer.flush(flush_timeout_s)
        self.store.write(("outbox", key, None) for key in sent_keys)
        return entries


@dataclass
class _Health:
    started: float
    last_poll: float = 0.0
    batches: int = 0
    applied: int = 0
    invalid: int = 0
    published: int = 0
    last_error: str | None = None


class Worker:
    """A gnnstream worker bound to one state directory and one model.

    Args:
        settings: see :class:`workers.settings.WorkerSettings`.
    """

    def __init__(self, settings: WorkerSettings):
        self.settings = settings
        self.metrics = WorkerMetrics()
        self._stop = threading.Event()
        self.health = _Health(started=time.time())
        self.store: GraphStore | None = None
        self.engine: Engine | None = None
        # (publish time, publish time - oldest Kafka record time of the batch), newest last
        self.latency_timeline: deque[tuple[float, float]] = deque(maxlen=100_000)

    # ------------------------------------------------------------------ lifecycle
    def stop(self, *_: Any) -> None:
        """Ask the loop to finish its current batch and exit."""
        self._stop.set()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)

    def health_info(self) -> dict[str, Any]:
        h = self.health
        alive = not self._stop.is_set() and (time.time() - h.last_poll < 60 if h.last_poll else True)
        return {"ok": alive, "batches": h.batches, "applied": h.applied, "invalid": h.invalid,
                "published": h.published, "last_error": h.last_error, "uptime_s": round(time.time() - h.started, 3)}

    def run(self, max_idle_s: float | None = None) -> dict[str, Any]:
        """Run until :meth:`stop` (or ``max_idle_s`` without records); return a summary."""
        s = self.settings
        ensure_topics(s.bootstrap, {s.events_topic: s.partitions, s.output_topic: s.partitions, s.dlq_topic: 1})
        server = MetricsServer(self.metrics, s.metrics_port, self.health_info) if s.metrics_port else None
        self.store = store = GraphStore(s.state)
        try:
            engine = self.engine = open_engine(store, s.model, hub_bound=s.hub_bound,
                                               max_deferred_age=s.max_staleness_s)
            if engine.needs_backfill():
                logger.info("state %s: first use of model %s, running backfill", s.state, engine.model_tag)
                engine.backfill(publish=True)
            producer = Producer(s.bootstrap)
            publisher = OutboxPublisher(store, producer, s.output_topic, engine.model_tag, engine.outbox_entries,
                                        s.output_format)
            dlq = DeadLetterWriter(producer, s.dlq_topic)
            stats = engine.recompute(publish=True)  # what a crash left dirty
            self._publish(publisher)
            freeze_warm_heap()
            consumer = EventConsumer(s.bootstrap, s.events_topic, s.group, session_timeout_ms=s.session_timeout_ms,
                                     on_assign=self._stored_offsets)
            try:
                self._loop(consumer, producer, publisher, dlq, engine, max_idle_s)
            finally:
                consumer.close()
                try:
                    self._publish(publisher)
                finally:
                    producer.close()
        finally:
            if server:
                server.close()
            store.close()
            self.store = None
        return self.health_info()

    def _stored_offsets(self, partitions: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int]:
        assert self.store is not None
        stored = self.store.offsets()
        return {tp: stored[tp] for tp in partitions if tp in stored}

    # ------------------------------------------------------------------ the loop
    def _loop(self, consumer: EventConsumer, producer: Producer, publisher: OutboxPublisher,
              dlq: DeadLetterWriter, engine: Engine, max_idle_s: float | None) -> None:
        s = self.settings
        idle_since = time.monotonic()
        last_lag = 0.0
        while not self._stop.is_set():
            try:
                records = consumer.poll_batch(s.batch_size, s.batch_wait_ms / 1000)
            except StreamError:
                raise
            except Exception as exc:  # Kafka unavailable: keep state, retry
                self._recoverable("poll", exc)
                continue
            self.health.last_poll = time.time()
            if records or not consumer.assignment():  # idle time counts once partitions are assigned
                idle_since = time.monotonic()
            if records:
                self._process(records, producer, dlq, engine)
            elif engine.pending():
                self._recompute(engine, None, None)
            self._publish(publisher)
            if records:
                consumer.commit()
            if time.monotonic() - last_lag > 1.0:
                last_lag = time.monotonic()
                self._report_lag(consumer)
            if max_idle_s is not None and not records and time.monotonic() - idle_since > max_idle_s \
                    and not engine.pending() and not publisher.pending():
                break

    def _process(self, records: list, producer: Producer, dlq: DeadLetterWriter, engine: Engine) -> None:
        s = self.settings
        in_dim = engine.model.config.in_dim
        good = []
        letters: list[DeadLetter] = []
        offsets: dict[tuple[str, int], int] = {}
        oldest_ms = min(r.timestamp_ms for r in records)
        for r in records:
            offsets[(r.topic, r.partition)] = max(offsets.get((r.topic, r.partition), 0), r.offset + 1)
            try:
                ev = decode_event_json(r.value, max_bytes=s.max_event_bytes)
                if isinstance(ev, NodeUpsert) and len(ev.features) != in_dim:
                    raise InvalidEvent("wrong_feature_length",
                                       f"node {ev.id!r} has {len(ev.features)} features, the model expects {in_dim}")
            except InvalidEvent as exc:
                letters.append(DeadLetter.for_error(r, exc))
                continue
            good.append(ev)
        while letters:
            try:
                for letter in letters:
                    dlq.write(letter)
                producer.flush(30.0)
                for letter in letters:
                    self.metrics.invalid.labels(letter.reason).inc()
                self.health.invalid += len(letters)
                letters = []
            except Exception as exc:
                self._recoverable("dead_letter", exc)
                if self._stop.is_set():
                    raise
        t0 = time.perf_counter()
        assert self.store is not None
        result = self.store.apply(good, offsets)
        self.metrics.apply_seconds.observe(time.perf_counter() - t0)
        for ev in good:
            self.metrics.events.labels(ev.op).inc()
        self.health.applied += len(good)
        self.health.batches += 1
        self.metrics.batches.inc()
        self._recompute(engine, result.max_ts if good else None, oldest_ms / 1000.0)

    def _recompute(self, engine: Engine, event_ts: float | None, oldest_record_s: float | None) -> None:
        t0 = time.perf_counter()
        stats = engine.recompute(event_ts=event_ts, publish=True)
        self.metrics.recompute_seconds.observe(time.perf_counter() - t0)
        for layer, n in enumerate(stats.recomputed, 1):
            self.metrics.dirty.labels(str(layer)).set(n)
        self.metrics.sampled.observe(stats.sampled_neighbours)
        self.metrics.subgraph_edges.observe(stats.sampled_neighbours + sum(stats.recomputed))
        self.metrics.fanout_capped.inc(stats.fanout_capped)
        self.metrics.deferred.set(stats.deferred)
        self.metrics.deferred_total.inc(stats.deferred)
        self.metrics.staleness.set(engine.deferred_age())
        self._oldest_record_s = oldest_record_s

    def _publish(self, publisher: OutboxPublisher) -> None:
        while True:
            t0 = time.perf_counter()
            try:
                entries = publisher.publish()
            except Exception as exc:  # broker down: entries stay in the outbox
                self._recoverable("publish", exc)
                return
            if not entries:
                return
            now = time.time()
            self.metrics.publish_seconds.observe(time.perf_counter() - t0)
            self.metrics.published.inc(len(entries))
            self.health.published += len(entries)
            for entry in entries:
                self.metrics.freshness.observe(max(0.0, now - entry.event_ts))
            oldest = getattr(self, "_oldest_record_s", None)
            if oldest is not None:
                self.metrics.pipeline.observe(max(0.0, now - oldest))
                self.latency_timeline.append((now, max(0.0, now - oldest)))
                self._oldest_record_s = None

    def _report_lag(self, consumer: EventConsumer) -> None:
        try:
            for (topic, partition), lag in consumer.lag().items():
                self.metrics.lag.labels(str(partition)).set(lag)
        except Exception as exc:
            logger.debug("lag unavailable: %r", exc)

    def _recoverable(self, kind: str, exc: BaseException) -> None:
        self.metrics.errors.labels(kind).inc()
        self.health.last_error = f"{kind}: {exc!r}"
        logger.warning("%s failed, retrying: %r", kind, exc)
        self._stop.wait(1.0)
