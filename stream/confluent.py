"""Kafka I/O with confluent-kafka (librdkafka): the same consumer and producer
as :mod:`gnnstream.stream.kafka`, several times faster per message.

:class:`ConfluentConsumer` and :class:`ConfluentProducer` implement the
interfaces of :mod:`gnnstream.stream.clients` with the semantics of
:class:`gnnstream.stream.kafka.EventConsumer` and :class:`gnnstream.stream.kafka.Producer`:

- the consumer is a group member that, on every assignment, starts each
  partition at the offset the ``on_assign`` hook returns (the caller's store
  is the source of truth), else at the :meth:`~ConfluentConsumer.seek_to` or
  last delivered offset, else at the earliest offset; Kafka's committed
  offsets are written only for lag tools;
- the producer is idempotent (``acks=all``), batches with ``linger.ms``, and
  its :meth:`~ConfluentProducer.flush` raises
  :class:`~gnnstream.stream.exceptions.DeliveryError` when any record sent since the
  previous flush was not acknowledged.

Topic setup stays :func:`gnnstream.stream.kafka.ensure_topics` (one admin path for both
backends). :func:`gnnstream.stream.backends.open_consumer` and
:func:`gnnstream.stream.backends.open_producer` choose a backend by name.

Settings: keyword arguments other than the named ones are librdkafka
properties, given either dotted (``**{"fetch.wait.max.ms": 100}``) or with
underscores (``fetch_wait_max_ms=100``); a few kafka-python names that differ
are translated (``max_request_size``, ``fetch_max_wait_ms``).

Clients are not thread-safe: one thread polls, one thread sends and flushes.

librdkafka's own log lines and global errors go through
:mod:`gnnstream.stream.librdkafka_logs`, which bounds how often each kind is logged.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka import Producer as _RdProducer

from gnnstream.stream.clients import (
    FETCH_WAIT_MS,
    MAX_MESSAGE_BYTES,
    AssignHook,
    ConsumerClient,
    Headers,
    PartitionKey,
    ProducerClient,
    Record,
    header_list,
    joined_headers,
    wait_for_partitions,
)
from gnnstream.stream.errors import Limited
from gnnstream.stream.librdkafka_logs import librdkafka_error, librdkafka_log, serve_idle_queues
from gnnstream.stream.exceptions import DeliveryError, StreamError

__all__ = ["ConfluentConsumer", "ConfluentProducer", "librdkafka_settings"]

logger = logging.getLogger(__name__)
_limited = Limited(logger)  # this module's own repeated warnings (consumer errors, failed commits)

_ALIASES = {  # kafka-python names whose librdkafka name is not the dotted one
    "max_request_size": "message.max.bytes",
    "max_message_bytes": "message.max.bytes",
    "fetch_max_wait_ms": "fetch.wait.max.ms",
}
_SERVE_EVERY = 4096  # send() serves delivery reports and logs every this many records


def librdkafka_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """librdkafka properties from keyword-style names (``linger_ms`` -> ``linger.ms``).

    Names that contain a dot are taken as they are.
    """
    out: dict[str, Any] = {}
    for name, value in config.items():
        if "." not in name:
            name = _ALIASES.get(name, name.replace("_", "."))
        out[name] = value
    return out


def _create(kind: Callable[[dict[str, Any]], Any], settings: dict[str, Any], what: str) -> Any:
    try:
        return kind(settings)
    except KafkaException as exc:  # an unknown or invalid property
        shown = {k: v for k, v in settings.items() if not callable(v) and k != "logger"}
        raise ValueError(f"invalid confluent-kafka {what} settings {shown}: {exc.args[0]}") from exc




class ConfluentConsumer(ConsumerClient):
    """A consumer-group member that starts each partition where the caller says.

    Records are read in batches with ``Consumer.consume``; :meth:`poll_batch`
    returns as soon as any record is there (it does not wait to fill a
    batch), like the kafka-python backend.

    Args:
        bootstrap: ``host:port[,host:port...]``.
        topic: a topic name or several.
        group_id: the consumer group.
        session_timeout_ms: group session timeout; 6000 suits both the
            embedded broker (joins take about half of it) and Kafka's minimum.
        heartbeat_interval_ms: defaults to a third of the session timeout.
        on_assign: called with the newly assigned partitions; returns the next
            offset to read for those it has stored (others start at the
            stored :meth:`seek_to` offset, the last delivered one, or earliest).
            When it raises, the partitions are assigned paused (nothing is
            read from a position the caller did not choose) and the error is
            raised by the next :meth:`poll_batch`.
        on_revoke: called with partitions about to be taken away (or lost).
        assign_all: read every partition of the topics without joining the
            group (manual assignment; the group id only names the committed
            offsets for lag tools): ``on_assign`` is called once, here.
        paused: hold every assigned partition paused (a member that wants the
            group's assignment, not the records).
        close_timeout_s: how long :meth:`close` waits for librdkafka to leave
            the group; with a stalled broker and a commit in flight it would
            wait for minutes, so it is abandoned after this (and logged).
        **config: other librdkafka consumer properties (see the module
            docstring). ``auto_offset_reset="latest"`` makes partitions
            without a stored offset start at their end instead of the
            earliest offset; the end is the high watermark of the first fetch
            (ListOffsets LATEST is wrong on the embedded broker), and the
            records before it are skipped.

    Raises:
        ValueError: a setting librdkafka does not accept.
    """

    def __init__(self, bootstrap: str, topic: str | Sequence[str], group_id: str, *,
                 session_timeout_ms: int = 6000, heartbeat_interval_ms: int | None = None,
                 on_assign: AssignHook | None = None,
                 on_revoke: Callable[[list[PartitionKey]], None] | None = None,
                 close_timeout_s: float = 5.0, assign_all: bool = False, paused: bool = False, **config: Any):
        self.topics = [topic] if isinstance(topic, str) else list(topic)
        self._on_assign, self._on_revoke = on_assign, on_revoke
        self._paused = paused
        self._close_timeout_s = close_timeout_s
        self._next: dict[PartitionKey, int] = {}
        self._hook_error: BaseException | None = None
        self._commit_error: KafkaError | None = None
        self._start_at_end = config.pop("auto_offset_reset", "earliest") == "latest"
        self._to_end: set[PartitionKey] = set()  # start at end: waiting for the high watermark
        self._held: set[PartitionKey] = set()  # paused after a failed on_assign hook
        settings: dict[str, Any] = {
            "bootstrap.servers": bootstrap, "group.id": group_id, "client.id": f"gnnstream-{group_id}",
            "enable.auto.commit": False, "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest", "isolation.level": "read_uncommitted",  # as kafka-python
            "session.timeout.ms": session_timeout_ms, "fetch.wait.max.ms": FETCH_WAIT_MS,
            "heartbeat.interval.ms": heartbeat_interval_ms or max(session_timeout_ms // 3, 100),
            "logger": librdkafka_log, "error_cb": librdkafka_error, "on_commit": self._committed,
        }
        settings.update(librdkafka_settings(config))
        self._consumer: Consumer | None = _create(Consumer, settings, "consumer")
        serve_idle_queues.add(self)
        if not assign_all:
            self._consumer.subscribe(self.topics, on_assign=self._assigned, on_revoke=self._revoked,
                                     on_lost=self._revoked)
            return
        try:
            partitions = [TopicPartition(t, p) for t in self.topics for p in sorted(self.partitions_of(t))]
        except StreamError:
            self.close()
            raise
        self._assigned(self._consumer, partitions)
        if self._hook_error is not None:
            error, self._hook_error = self._hook_error, None
            self.close()
            raise StreamError(f"partition assignment hook failed for {self.topics}: {error!r}") from error

    def partitions_of(self, topic: str, timeout_s: float = 10.0) -> set[int]:
        """The partition numbers of ``topic``; StreamError if none are known within ``timeout_s``."""
        def find() -> set[int] | None:
            try:
                found = self._client.list_topics(topic, timeout=1.0).topics.get(topic)
            except KafkaException:
                return None
            return set(found.partitions) if found is not None and found.error is None else None
        return wait_for_partitions(find, topic, timeout_s)

    def _serve_idle(self) -> None:
        """Nothing: a consumer's queue also holds its records, so only its own polls serve it (they come
        often: the worker polls all the time)."""

    @property
    def _client(self) -> Consumer:
        if self._consumer is None:
            raise StreamError(f"consumer of {self.topics} is closed")
        return self._consumer

    # ------------------------------------------------------------ rebalance callbacks (inside consume)
    def _assigned(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        keys = [(tp.topic, tp.partition) for tp in partitions]
        try:
            stored = dict(self._on_assign(keys) or {}) if self._on_assign else {}
            for tp, key in zip(partitions, keys):
                offset = stored.get(key, self._next.get(key))
                if offset is None:
                    tp.offset = OFFSET_BEGINNING
                    if self._start_at_end:
                        self._to_end.add(key)
                else:
                    tp.offset = offset
                    self._next[key] = offset
                    self._to_end.discard(key)
            consumer.assign(partitions)
            if self._paused:
                consumer.pause(partitions)
            elif self._held:  # held after an earlier failed hook: read again
                consumer.resume(partitions)
                self._held.difference_update(keys)
            start = "latest" if self._start_at_end else "earliest"
            logger.info("assigned %s; resuming at %s", sorted(keys),
                        {k: self._next.get(k, start) for k in sorted(keys)})
        except BaseException as exc:  # re-raised by poll_batch as StreamError
            self._hook_error = exc
            try:
                for tp in partitions:
                    tp.offset = OFFSET_BEGINNING
                consumer.assign(partitions)
                consumer.pause(partitions)
                self._held.update(keys)
            except KafkaException as again:
                logger.warning("could not hold %s after a failed assignment hook: %r", sorted(keys), again)

    def _revoked(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        keys = [(tp.topic, tp.partition) for tp in partitions]
        self._to_end.difference_update(keys)
        if keys:
            logger.info("revoked %s", sorted(keys))
        try:
            if self._on_revoke is not None:
                self._on_revoke(keys)
        except BaseException as exc:
            self._hook_error = exc
        finally:
            try:
                consumer.unassign()
            except KafkaException as exc:
                logger.warning("unassign of %s failed: %r", sorted(keys), exc)

    def _committed(self, error: KafkaError | None, partitions: list[TopicPartition]) -> None:
        failed = [tp for tp in partitions if tp.error is not None]
        if error is None and failed:
            error = failed[0].error
        if error is not None and error.code() != KafkaError._NO_OFFSET:
            self._commit_error = error
            _limited.warning("commit", "offset commit for lag tools failed (ignored): %s", error)

    # ------------------------------------------------------------ ConsumerClient
    def seek_to(self, offsets: Mapping[PartitionKey, int]) -> None:
        """Set the next offset to read per ``(topic, partition)``.

        Raises:
            ValueError: a negative offset.
            StreamError: librdkafka refused to seek an assigned partition.
        """
        assigned = self.assignment()
        for key, offset in offsets.items():
            if offset < 0:
                raise ValueError(f"Expected an offset >= 0 for {key} (got {offset})")
            self._next[key] = offset
            self._to_end.discard(key)
            if key in assigned:
                try:
                    self._client.seek(TopicPartition(key[0], key[1], offset))
                except KafkaException as exc:
                    raise StreamError(f"cannot seek {key} to offset {offset}: {exc.args[0]}") from exc

    def poll_batch(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        """Up to ``max_records`` records, waiting at most ``timeout_s`` (joins included).

        Raises:
            StreamError: the ``on_assign``/``on_revoke`` hook failed (the
                records of that poll are not returned), or librdkafka reported
                a fatal error.
        """
        client = self._client
        messages = client.consume(max_records, 0)
        if not messages and timeout_s > 0:
            first = client.poll(timeout_s)  # returns at the first message, unlike consume()
            if first is not None:
                messages = [first]
                if max_records > 1:
                    messages += client.consume(max_records - 1, 0)
        if self._hook_error is not None:
            error, self._hook_error = self._hook_error, None
            raise StreamError(f"partition assignment hook failed for {self.topics}: {error!r}") from error
        if not messages and not self._to_end:
            return []
        records = [Record(m.topic(), m.partition(), m.offset(), m.key(), m.value(), m.timestamp()[1],
                          tuple(m.headers() or ()))
                   for m in messages if m.error() is None]
        if len(records) != len(messages):
            self._errors(messages)
        if self._to_end:
            records = self._skip_to_end(records)
        if records:
            self._next.update({(r.topic, r.partition): r.offset + 1 for r in records})
        return records

    def _errors(self, messages: list[Message]) -> None:
        for m in messages:
            error = m.error()
            if error is None:
                continue
            if error.fatal():
                raise StreamError(f"consumer of {self.topics} failed: {error}")
            _limited.warning(f"consume:{error.code()}:{m.topic()}", "consumer of %s: %s (%s[%s])", self.topics, error,
                             m.topic(), m.partition())

    def _skip_to_end(self, records: list[Record]) -> list[Record]:
        """Move "start at end" partitions whose high watermark is now known to it.

        The records of those partitions in this batch are all below the
        watermark (it is read after them), so they are dropped; so are those
        of partitions whose watermark is not known yet.
        """
        client = self._client
        ends: dict[PartitionKey, int] = {}
        for key in list(self._to_end):
            ends[key] = 2**63 - 1  # nothing known yet (or cannot move yet): skip whatever came
            tp = TopicPartition(*key)
            high = client.get_watermark_offsets(tp, cached=True)[1]
            if high < 0:
                continue
            tp.offset = high
            try:
                client.seek(tp)
            except KafkaException as exc:
                _limited.warning(f"to_end:{key}", "cannot move %s to its end %d yet: %r", key, high, exc)
                continue
            self._next[key] = ends[key] = high
            self._to_end.discard(key)
            logger.info("%s starts at its end, offset %d", key, high)
        return [r for r in records if r.offset >= ends.get((r.topic, r.partition), -1)]

    def commit(self, offsets: Mapping[PartitionKey, int] | None = None, wait: bool = False) -> bool:
        """Commit next offsets (default: after the last delivered record); best effort.

        The commit is asynchronous unless ``wait`` (a synchronous one costs a
        round trip per batch and blocks without bound on a stalled broker).
        Returns False when it could not be queued, when the previous commit
        failed, or (``wait``) when this one failed.
        """
        if offsets is None:
            assigned = self.assignment()
            offsets = {k: v for k, v in self._next.items() if k in assigned}
        if not offsets:
            return True
        previous, self._commit_error = self._commit_error, None
        try:
            done = self._client.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()],
                                       asynchronous=not wait)
        except KafkaException as exc:  # lag reporting must never stop the worker
            _limited.warning("commit", "offset commit failed: %r", exc)
            return False
        if wait:  # a synchronous commit reports each partition's own error in its result
            failed = [tp for tp in done or () if tp.error is not None]
            if failed:
                _limited.warning("commit", "offset commit failed for %s: %s",
                                 [(tp.topic, tp.partition) for tp in failed], failed[0].error)
            return not failed
        return previous is None

    def committed(self, partitions: Sequence[PartitionKey], timeout_s: float = 10.0) -> dict[PartitionKey, int | None]:
        try:
            found = self._client.committed([TopicPartition(*key) for key in partitions], timeout=timeout_s)
        except KafkaException as exc:
            raise StreamError(f"committed offsets of {sorted(partitions)} unavailable: {exc.args[0]}") from exc
        for tp in found:
            if tp.error is not None:
                raise StreamError(f"committed offset of {tp.topic}[{tp.partition}] unavailable: {tp.error}")
        return {(tp.topic, tp.partition): tp.offset if tp.offset >= 0 else None for tp in found}

    def high_watermarks(self) -> dict[PartitionKey, int]:
        """The high watermark of each assigned partition as known from the last fetch.

        Partitions not fetched yet are absent.
        """
        client = self._client
        result: dict[PartitionKey, int] = {}
        for tp in client.assignment():
            high = client.get_watermark_offsets(tp, cached=True)[1]
            if high >= 0:
                result[(tp.topic, tp.partition)] = high
        return result

    def lag(self) -> dict[PartitionKey, int]:
        """``high watermark - position`` per assigned partition whose watermark is known.

        Uses the high watermark of the last fetch (not ListOffsets, which the
        embedded broker gets wrong); partitions not fetched yet are absent. A
        partition started at the earliest offset with nothing delivered yet
        is at its low watermark.
        """
        client = self._client
        result: dict[PartitionKey, int] = {}
        for tp in client.assignment():
            key = (tp.topic, tp.partition)
            if key in self._to_end:  # end not known yet
                continue
            low, high = client.get_watermark_offsets(tp, cached=True)
            position = self._next.get(key, low)
            if high >= 0 and position >= 0:
                result[key] = max(high - position, 0)
        return result

    def assignment(self) -> set[PartitionKey]:
        return {(tp.topic, tp.partition) for tp in self._client.assignment()}

    def close(self) -> None:
        """Leave the group and release connections (idempotent).

        Waits at most ``close_timeout_s``; after that librdkafka finishes
        closing in a daemon thread.
        """
        consumer, self._consumer = self._consumer, None
        if consumer is None:
            return
        serve_idle_queues.discard(self)
        closer = threading.Thread(target=consumer.close, name="gnnstream-consumer-close", daemon=True)
        closer.start()
        closer.join(self._close_timeout_s)
        if closer.is_alive():
            logger.warning("consumer of %s did not leave its group within %ss (broker unreachable?); "
                           "closing it in the background", self.topics, self._close_timeout_s)


class _Window:
    """Delivery failures of one librdkafka producer (it only reports errors)."""

    __slots__ = ("failed", "first", "_lock")

    def __init__(self) -> None:
        self.failed = 0
        self.first: KafkaError | None = None
        self._lock = threading.Lock()  # reports are served by the sending thread and by the pump's

    def report(self, error: KafkaError | None, message: Message) -> None:
        if error is not None:
            with self._lock:
                self.failed += 1
                if self.first is None:
                    self.first = error


class ConfluentProducer(ProducerClient):
    """Batched, idempotent (``acks=all``) producer with a strict :meth:`flush`.

    librdkafka reports only failed deliveries to Python
    (``delivery.report.only.error``), so a delivered record costs no Python
    work after :meth:`send`; the records still queued when :meth:`flush`
    times out are the unanswered ones. After a failed flush the librdkafka
    producer is discarded (what it still holds is purged) and the next
    :meth:`send` makes a fresh one, so late answers never count for a later
    flush.

    Args:
        bootstrap: ``host:port[,host:port...]``.
        linger_ms: how long a batch waits for more records.
        batch_size: bytes per partition batch (librdkafka ``batch.size``).
        max_block_ms: how long :meth:`send` may wait for room in a full local
            queue (it serves delivery reports meanwhile).
        **config: other librdkafka producer properties (see the module
            docstring), e.g. ``queue_buffering_max_messages``.

    Raises:
        ValueError: a setting librdkafka does not accept.
    """

    def __init__(self, bootstrap: str, *, linger_ms: int = 5, batch_size: int = 1_000_000,
                 max_block_ms: int = 10_000, **config: Any):
        self._settings: dict[str, Any] = {
            "bootstrap.servers": bootstrap, "client.id": "gnnstream-producer",
            "enable.idempotence": True, "acks": "all", "linger.ms": linger_ms, "batch.size": batch_size,
            "partitioner": "murmur2_random",  # Kafka's default (Java, kafka-python), which places a node with its owner
            "delivery.report.only.error": True, "logger": librdkafka_log, "error_cb": librdkafka_error,
            "message.max.bytes": MAX_MESSAGE_BYTES,
        }
        self._settings.update(librdkafka_settings(config))
        self.max_message_bytes = int(self._settings["message.max.bytes"])
        self._max_block_s = max_block_ms / 1000
        self._producer: _RdProducer | None = None
        self._window = _Window()
        self._sent = 0  # records sent since the last flush
        self._closed = False
        self._closing = threading.Lock()  # held by the pump while it serves, and to close a client
        self._client()  # settings errors surface here
        serve_idle_queues.add(self)

    @property
    def pending(self) -> int:
        """Records sent since the last flush."""
        return self._sent

    def _client(self) -> _RdProducer:
        if self._closed:
            raise StreamError("producer is closed")
        if self._producer is None:
            self._window = window = _Window()
            self._producer = _create(_RdProducer, {**self._settings, "on_delivery": window.report}, "producer")
        return self._producer

    def send(self, topic: str, key: bytes | None, value: bytes | None, headers: Headers = None,
             partition: int | None = None) -> None:
        """Queue one record.

        Raises:
            DeliveryError: the record could not be queued (local queue full
                for ``max_block_ms``, record too large, ...).
        """
        producer = self._producer if self._producer is not None else self._client()
        try:
            if partition is not None:  # packed frames, rollout markers
                producer.produce(topic, value, key, partition=partition, headers=header_list(headers))
            elif headers:
                producer.produce(topic, value, key, headers=header_list(headers))
            else:
                producer.produce(topic, value, key)
        except BufferError:
            self._send_when_room(producer, topic, key, value, headers, -1 if partition is None else partition)
        except KafkaException as exc:
            raise DeliveryError(f"could not queue a record for {topic!r}: {exc.args[0]}", failed=1,
                                cause=exc) from exc
        self._sent += 1
        if not self._sent % _SERVE_EVERY:
            producer.poll(0)

    def send_many(self, topic: str, messages: Iterable[tuple[bytes | None, bytes | None, Headers]],
                  headers: Headers = None) -> int:
        """As :meth:`send` for each record, in one loop: ``headers`` are converted once, and reports are
        served once at the end."""
        producer = self._producer if self._producer is not None else self._client()
        produce, common = producer.produce, header_list(headers)
        count = 0
        try:
            for key, value, own in messages:
                extra = joined_headers(own, common) if own else common
                try:  # positional: parsing keywords costs a quarter of the call (confluent-kafka 2.16)
                    produce(topic, value, key, -1, None, None, 0, extra)
                except BufferError:
                    self._send_when_room(producer, topic, key, value, extra)
                count += 1
        except KafkaException as exc:
            raise DeliveryError(f"could not queue a record for {topic!r}: {exc.args[0]}", failed=1,
                                cause=exc) from exc
        finally:
            self._sent += count
        producer.poll(0)
        return count

    def _send_when_room(self, producer: _RdProducer, topic: str, key: bytes | None, value: bytes | None,
                        headers: Headers, partition: int = -1) -> None:
        deadline = time.monotonic() + self._max_block_s
        while True:
            producer.poll(0.005)  # serves reports; librdkafka frees queue space as batches are acknowledged
            try:
                producer.produce(topic, value, key, partition=partition, headers=header_list(headers))
                return
            except BufferError as exc:
                if time.monotonic() >= deadline:
                    raise DeliveryError(f"could not queue a record for {topic!r}: local queue still full "
                                        f"after {self._max_block_s}s ({len(producer)} records waiting for "
                                        f"{self._settings['bootstrap.servers']})", failed=1, cause=exc) from exc
            except KafkaException as exc:
                raise DeliveryError(f"could not queue a record for {topic!r}: {exc.args[0]}", failed=1,
                                    cause=exc) from exc

    def flush(self, timeout_s: float = 30.0) -> int:
        sent, self._sent = self._sent, 0
        producer = self._producer
        if producer is None:
            return 0
        unanswered = producer.flush(timeout_s)
        window = self._window
        if not window.failed and not unanswered:
            return sent
        failed, cause = window.failed, window.first
        self._discard()
        exc = KafkaException(cause) if cause is not None else None
        raise DeliveryError(f"{failed} of {sent} records failed and {unanswered} got no answer "
                            f"within {timeout_s}s (bootstrap {self._settings['bootstrap.servers']}): "
                            f"{cause or 'timed out'}; keep them and send again", failed=failed,
                            pending=unanswered, cause=exc)

    def _serve_idle(self) -> None:
        """Serve the client's queue (its log lines and errors; reports too) if no close is under way."""
        if not self._closing.acquire(blocking=False):
            return
        try:
            if self._producer is not None:
                self._producer.poll(0)
        except Exception as exc:  # a callback raised: nothing to do here, the owner's own calls report it
            logger.debug("serving an idle producer failed: %r", exc)
        finally:
            self._closing.release()

    def _discard(self) -> None:
        """Drop the librdkafka producer now, purging whatever it still holds."""
        with self._closing:
            producer, self._producer = self._producer, None
            if producer is None:
                return
            producer.purge(in_queue=True, in_flight=True, blocking=False)
            producer.poll(0)  # the purged records' reports go to the discarded window
            producer.close()

    def close(self, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        serve_idle_queues.discard(self)
        producer = self._producer
        if producer is None:
            return
        left = producer.flush(timeout_s)
        if left or self._window.failed:
            logger.warning("producer closed with %d undelivered and %d failed records after %ss",
                           left, self._window.failed, timeout_s)
        self._discard()
