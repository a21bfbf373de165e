"""Kafka I/O with kafka-python: topic setup, a consumer that resumes from
offsets the caller stores itself, and a producer whose flush tells delivery
failures apart.

:class:`EventConsumer` and :class:`Producer` implement the interfaces of
:mod:`gnnstream.stream.clients` (re-exported here with :class:`Record`), which is all
the rest of the project should depend on.

Clients are not thread-safe: one thread polls, one thread sends and flushes.

kafka-python's own log lines (``kafka.*`` loggers) pass through a filter,
:class:`_Repeats`: while a broker cannot be reached it logs the same
connection failures every few seconds, so a line repeated within a minute is
logged at DEBUG only, and the next one after that minute says how many were
held back. Distinct messages always get through.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from kafka import ConsumerRebalanceListener, KafkaConsumer, KafkaProducer, OffsetAndMetadata, TopicPartition
from kafka.admin import KafkaAdminClient
from kafka.errors import KafkaError, KafkaTimeoutError

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
    wait_for_partitions,
)
from gnnstream.stream.errors import Limited
from gnnstream.stream.exceptions import DeliveryError, StreamError, TopicSetupError

__all__ = [
    "Record",
    "PartitionKey",
    "Headers",
    "ConsumerClient",
    "ProducerClient",
    "EventConsumer",
    "Producer",
    "ensure_topics",
    "topic_names",
    "topic_max_message_bytes",
]

logger = logging.getLogger(__name__)

_TOPIC_ALREADY_EXISTS = 36
_PRUNE_AT = 100_000
_REPEAT_EVERY_S = 60.0  # a kafka-python line logged before is logged again at most this often
_MAX_KINDS = 256  # kinds of lines remembered (the oldest are forgotten first)
_VARYING = (  # the parts of a kafka-python line that change between repeats of it
    (re.compile(r"\b\d+(?:\.\d+)?\s*(?:ms|s|secs?|seconds?)\b"), "# s"),
    (re.compile(r"(?<=\s)\d+\.\d+(?=\s)"), "#"),
)


class _Repeats(logging.Filter):
    """Rate limit on kafka-python's log lines, per logger and kind of line (durations and backoffs aside).

    The first line of a kind passes; repeats within ``every_s`` of the last
    one that passed are logged again at DEBUG only (so a DEBUG log still holds
    every one); the first repeat after that passes with ``[repeated N times
    in the last T s]`` when some were held back. Lines below INFO always pass.
    """

    def __init__(self, every_s: float = _REPEAT_EVERY_S, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.every_s, self.clock = every_s, clock
        self._lock = threading.Lock()
        self._kinds: dict[tuple[str, str], list] = {}  # (logger, kind) -> [window start, repeats held back]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.INFO:
            return True
        text = record.getMessage()
        kind = text
        for pattern, replacement in _VARYING:
            kind = pattern.sub(replacement, kind)
        key = (record.name, kind)
        with self._lock:
            now = self.clock()
            seen = self._kinds.pop(key, None)
            passes = seen is None or now - seen[0] >= self.every_s
            if passes:
                if len(self._kinds) >= _MAX_KINDS:
                    del self._kinds[next(iter(self._kinds))]
                self._kinds[key] = [now, 0]
            else:
                seen[1] += 1
                self._kinds[key] = seen
        if not passes:
            logging.getLogger(record.name).debug("%s (a repeat)", text)
            return False
        if seen is not None and seen[1]:
            record.msg, record.args = "%s [repeated %d times in the last %.0f s]", (text, seen[1], now - seen[0])
        return True


_repeats = _Repeats()
_limited = Limited(logger)  # this module's own repeated warnings (failed commits)


def _limit_repeats() -> None:
    """Put :data:`_repeats` on every ``kafka.*`` logger (all exist once the client modules are imported)."""
    names = [name for name in logging.root.manager.loggerDict if name == "kafka" or name.startswith("kafka.")]
    for name in names:
        log = logging.getLogger(name)
        if _repeats not in log.filters:
            log.addFilter(_repeats)


_limit_repeats()


def _admin(bootstrap: str, timeout_s: float) -> KafkaAdminClient:
    timeout_ms = int(timeout_s * 1000)
    try:
        return KafkaAdminClient(bootstrap_servers=bootstrap, client_id="gnnstream-admin",
                                request_timeout_ms=timeout_ms, bootstrap_timeout_ms=timeout_ms)
    except KafkaError as exc:
        raise TopicSetupError(f"cannot reach Kafka at {bootstrap} ({exc}); is the broker running "
                              "and is --bootstrap right?") from exc


def topic_names(bootstrap: str, timeout_s: float = 30.0) -> set[str]:
    """The topics that exist (asked with an admin client: a consumer of a missing topic can make the broker
    create it).

    Raises:
        TopicSetupError: the broker cannot be reached.
    """
    admin = _admin(bootstrap, timeout_s)
    try:
        return set(admin.list_topics())
    except KafkaError as exc:
        raise TopicSetupError(f"listing the topics on {bootstrap} failed: {exc}") from exc
    finally:
        admin.close()


class _Quiet(logging.Filter):
    """Drops every line: kafka-python logs a broker that closes the connection on a request it does not
    know (the embedded one on DescribeConfigs) as errors, and the caller reports the outcome itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return False


def topic_max_message_bytes(bootstrap: str, topic: str, timeout_s: float = 10.0) -> int | None:
    """The largest record ``topic`` accepts (its ``max.message.bytes``), None when the broker does not say."""
    from kafka.admin import ConfigResource, ConfigResourceType
    quiet = _Quiet()
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)
               if n == "kafka" or n.startswith("kafka.")]
    for log in loggers:
        log.addFilter(quiet)
    try:
        admin = _admin(bootstrap, timeout_s)
    except TopicSetupError:
        for log in loggers:
            log.removeFilter(quiet)
        return None
    try:
        found = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic, ["max.message.bytes"])])
        for response in found:
            for resource in response.resources:
                for entry in resource[4]:
                    if entry[0] == "max.message.bytes" and entry[1]:
                        return int(entry[1])
    except Exception as exc:  # an old or embedded broker without DescribeConfigs: no limit known
        logger.debug("max.message.bytes of %r unknown: %r", topic, exc)
    finally:
        admin.close()
        for log in loggers:
            log.removeFilter(quiet)
    return None


def ensure_topics(bootstrap: str, topics: Mapping[str, int], *, replication_factor: int = 1,
                  timeout_s: float = 30.0) -> list[str]:
    """Create the topics that do not exist yet (idempotent).

    Existing topics are left as they are, whatever their partition count.

    Args:
        bootstrap: ``host:port[,host:port...]``.
        topics: ``{name: partitions}``.
        replication_factor: replicas of each new topic.
        timeout_s: how long to wait for the broker.

    Returns:
        The names of the topics this call created.

    Raises:
        TopicSetupError: the broker cannot be reached or refused a topic.
    """
    for name, partitions in topics.items():
        if not name or isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
            raise ValueError(f"Expected a topic name and a partition count >= 1 (got {name!r}: {partitions!r})")
    timeout_ms = int(timeout_s * 1000)
    admin = _admin(bootstrap, timeout_s)
    try:
        existing = set(admin.list_topics())
        missing = {name: n for name, n in topics.items() if name not in existing}
        if not missing:
            return []
        request = {name: {"num_partitions": n, "replication_factor": replication_factor}
                   for name, n in missing.items()}
        response = admin.create_topics(request, timeout_ms=timeout_ms, raise_errors=False)
        created = []
        for result in response["topics"]:
            code = result["error_code"]
            if code == 0:
                created.append(result["name"])
            elif code != _TOPIC_ALREADY_EXISTS:  # lost a race with another creator: fine
                raise TopicSetupError(f"Kafka at {bootstrap} refused to create topic {result['name']!r}: "
                                      f"error {code} {result.get('error_message')}")
        if created:
            admin.wait_for_topics(created)
            logger.info("created topics %s on %s", {t: missing[t] for t in created}, bootstrap)
        return sorted(created)
    except KafkaError as exc:
        raise TopicSetupError(f"topic setup on {bootstrap} failed: {exc}") from exc
    finally:
        admin.close()


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, owner: EventConsumer):
        self.owner = owner

    def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        self.owner._revoked([(tp.topic, tp.partition) for tp in revoked])

    def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        self.owner._assigned([(tp.topic, tp.partition) for tp in assigned])


class EventConsumer(ConsumerClient):
    """A consumer-group member that starts each partition where the caller says.

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
        on_revoke: called with partitions about to be taken away.
        assign_all: read every partition of the topics without joining the
            group (manual assignment; the group id only names the committed
            offsets for lag tools): ``on_assign`` is called once, here.
        paused: hold every assigned partition paused (a member that wants the
            group's assignment, not the records).
        **config: other ``KafkaConsumer`` settings. ``auto_offset_reset=
            "latest"`` makes partitions without a stored offset start at their
            end instead of the earliest offset; the end is taken from the
            high watermark of the first fetch (ListOffsets LATEST is wrong on
            the embedded broker), and the records before it are skipped.
    """

    def __init__(self, bootstrap: str, topic: str | Sequence[str], group_id: str, *,
                 session_timeout_ms: int = 6000, heartbeat_interval_ms: int | None = None,
                 on_assign: AssignHook | None = None,
                 on_revoke: Callable[[list[PartitionKey]], None] | None = None, assign_all: bool = False,
                 paused: bool = False, **config: Any):
        self.topics = [topic] if isinstance(topic, str) else list(topic)
        self._on_assign, self._on_revoke = on_assign, on_revoke
        self._paused = paused
        self._settled = False  # assigned, and not revoked since
        self._next: dict[PartitionKey, int] = {}
        self._hook_error: BaseException | None = None
        self._start_at_end = config.pop("auto_offset_reset", "earliest") == "latest"
        self._to_end: set[PartitionKey] = set()  # start at end: waiting for the high watermark
        settings: dict[str, Any] = dict(
            bootstrap_servers=bootstrap, group_id=group_id, enable_auto_commit=False,
            auto_offset_reset="earliest", session_timeout_ms=session_timeout_ms, fetch_max_wait_ms=FETCH_WAIT_MS,
            heartbeat_interval_ms=heartbeat_interval_ms or max(session_timeout_ms // 3, 100),
            client_id=f"gnnstream-{group_id}")
        settings.update(config)
        self._consumer: KafkaConsumer | None = KafkaConsumer(**settings)
        if not assign_all:
            self._consumer.subscribe(self.topics, listener=_Rebalance(self))
            return
        try:
            keys = [(t, p) for t in self.topics for p in sorted(self.partitions_of(t))]
        except StreamError:
            self.close()
            raise
        self._consumer.assign([TopicPartition(*k) for k in keys])
        self._assigned(keys)
        if self._hook_error is not None:
            error, self._hook_error = self._hook_error, None
            self.close()
            raise StreamError(f"partition assignment hook failed for {self.topics}: {error!r}") from error

    def partitions_of(self, topic: str, timeout_s: float = 10.0) -> set[int]:
        """The partition numbers of ``topic``; StreamError if none are known within ``timeout_s``."""
        return wait_for_partitions(lambda: self._client.partitions_for_topic(topic), topic, timeout_s)

    @property
    def _client(self) -> KafkaConsumer:
        if self._consumer is None:
            raise StreamError(f"consumer of {self.topics} is closed")
        return self._consumer

    def _assigned(self, partitions: list[PartitionKey]) -> None:
        self._settled = True
        try:
            stored = dict(self._on_assign(partitions) or {}) if self._on_assign else {}
            for key in partitions:
                offset = stored.get(key, self._next.get(key))
                tp = TopicPartition(*key)
                if offset is None:
                    self._client.seek_to_beginning(tp)
                    if self._start_at_end:
                        self._to_end.add(key)
                else:
                    self._client.seek(tp, offset)
                    self._next[key] = offset
            if self._paused:
                self._client.pause(*[TopicPartition(*k) for k in partitions])
            start = "latest" if self._start_at_end else "earliest"
            logger.info("assigned %s; resuming at %s", sorted(partitions),
                        {k: self._next.get(k, start) for k in sorted(partitions)})
        except BaseException as exc:  # kafka-python would swallow it: re-raised by poll_batch
            self._hook_error = exc

    def _revoked(self, partitions: list[PartitionKey]) -> None:
        self._settled = False
        self._to_end.difference_update(partitions)
        if partitions:
            logger.info("revoked %s", sorted(partitions))
        if self._on_revoke is not None:
            try:
                self._on_revoke(partitions)
            except BaseException as exc:
                self._hook_error = exc

    def seek_to(self, offsets: Mapping[PartitionKey, int]) -> None:
        """Set the next offset to read per ``(topic, partition)``."""
        assigned = self.assignment()
        for key, offset in offsets.items():
            if offset < 0:
                raise ValueError(f"Expected an offset >= 0 for {key} (got {offset})")
            self._next[key] = offset
            self._to_end.discard(key)
            if key in assigned:
                self._client.seek(TopicPartition(*key), offset)

    def poll_batch(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        """Up to ``max_records`` records, waiting at most ``timeout_s`` (joins included).

        A ``paused`` member that holds its assignment sleeps ``timeout_s``,
        then polls without waiting: it reads no records, kafka-python sends
        its heartbeats from an I/O thread of its own, and its poll goes
        round without pause while a heartbeat is overdue (a broker that
        takes connections and does not answer), which would hold a core for
        as long as the broker stays that way. From a revocation to the next
        assignment it polls for the whole ``timeout_s``: kafka-python sends
        a join again when the one in flight ended while no poll waited for it.

        Raises:
            StreamError: the ``on_assign``/``on_revoke`` hook failed; the
                records of that poll are not returned.
        """
        if self._paused and self._settled:
            time.sleep(timeout_s)
            batches = self._client.poll(timeout_ms=0, max_records=max_records)
        else:
            batches = self._client.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        if self._hook_error is not None:
            error, self._hook_error = self._hook_error, None
            raise StreamError(f"partition assignment hook failed for {self.topics}: {error!r}") from error
        records: list[Record] = []
        skip = self._find_ends() if self._to_end else {}
        for tp, messages in batches.items():
            end = skip.get((tp.topic, tp.partition))
            if end is not None:
                messages = [m for m in messages if m.offset >= end]
            for m in messages:
                records.append(Record(m.topic, m.partition, m.offset, m.key, m.value, m.timestamp,
                                      tuple((k, v) for k, v in (m.headers or ()))))
            if messages:
                self._next[(tp.topic, tp.partition)] = messages[-1].offset + 1
        return records

    def _find_ends(self) -> dict[PartitionKey, int]:
        """Move "start at end" partitions whose high watermark is now known to it."""
        ends: dict[PartitionKey, int] = {}
        for key in list(self._to_end):
            tp = TopicPartition(*key)
            high = self._client.highwater(tp)
            if high is None:
                ends[key] = 2**63 - 1  # nothing known yet: skip whatever came
                continue
            self._client.seek(tp, high)
            self._next[key] = ends[key] = high
            self._to_end.discard(key)
        return ends

    def commit(self, offsets: Mapping[PartitionKey, int] | None = None, wait: bool = False) -> bool:
        """Commit next offsets (default: after the last delivered record); best effort, always waited for."""
        if offsets is None:
            offsets = {k: v for k, v in self._next.items() if k in self.assignment()}
        if not offsets:
            return True
        try:
            self._client.commit({TopicPartition(*k): OffsetAndMetadata(v, "", -1) for k, v in offsets.items()},
                                timeout_ms=5000)
            return True
        except Exception as exc:  # lag reporting must never stop the worker
            _limited.warning("commit", "offset commit for lag tools failed (ignored): %r", exc)
            return False

    def committed(self, partitions: Sequence[PartitionKey], timeout_s: float = 10.0) -> dict[PartitionKey, int | None]:
        try:
            timeout_ms = int(timeout_s * 1000)
            return {key: self._client.committed(TopicPartition(*key), timeout_ms=timeout_ms) for key in partitions}
        except KafkaError as exc:
            raise StreamError(f"committed offsets of {sorted(partitions)} unavailable: {exc!r}") from exc

    def lag(self) -> dict[PartitionKey, int]:
        """``high watermark - position`` per assigned partition whose watermark is known.

        Uses the high watermark of the last fetch (not ListOffsets, which the
        embedded broker gets wrong); partitions not fetched yet are absent.
        """
        result: dict[PartitionKey, int] = {}
        for tp in self._client.assignment():
            key = (tp.topic, tp.partition)
            if key in self._to_end:  # end not known yet
                continue
            high = self._client.highwater(tp)
            position = self._next.get(key)
            if position is None:
                try:
                    position = self._client.position(tp, timeout_ms=1000)
                except KafkaError:
                    position = None
            if high is not None and position is not None:
                result[key] = max(high - position, 0)
        return result

    def high_watermarks(self) -> dict[PartitionKey, int]:
        """The high watermark of each assigned partition as known from the last fetch.

        Partitions not fetched yet are absent. Taken from fetch responses, not
        ListOffsets (wrong on the embedded broker). A fetch beyond the end
        still reports the end (the embedded broker answers it with no records;
        Kafka with OFFSET_OUT_OF_RANGE, after which kafka-python resets the
        position per ``auto_offset_reset`` and the next fetch reports it).
        """
        result: dict[PartitionKey, int] = {}
        for tp in self._client.assignment():
            high = self._client.highwater(tp)
            if high is not None:
                result[(tp.topic, tp.partition)] = high
        return result

    def assignment(self) -> set[PartitionKey]:
        return {(tp.topic, tp.partition) for tp in self._client.assignment()}

    def close(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            consumer.close(autocommit=False)


class Producer(ProducerClient):
    """Batched, idempotent (``acks=all``) producer with a strict :meth:`flush`.

    After a failed flush the underlying kafka-python producer is discarded
    and a fresh one is created by the next :meth:`send`: its idempotent state
    does not recover from expired batches (it stops delivering).

    Args:
        bootstrap: ``host:port[,host:port...]``.
        linger_ms: how long a batch waits for more records.
        batch_size: bytes per partition batch.
        max_block_ms: how long :meth:`send` may block (the first connection of a
            fresh kafka-python producer, metadata, full buffer).
        max_message_bytes: the largest record it sends (``max_request_size``).
        **config: other ``KafkaProducer`` settings.
    """

    def __init__(self, bootstrap: str, *, linger_ms: int = 5, batch_size: int = 256 * 1024,
                 max_block_ms: int = 10_000, max_message_bytes: int = MAX_MESSAGE_BYTES, **config: Any):
        self._settings: dict[str, Any] = dict(bootstrap_servers=bootstrap, linger_ms=linger_ms,
                                              batch_size=batch_size, max_block_ms=max_block_ms,
                                              bootstrap_timeout_ms=max_block_ms,
                                              acks="all", client_id="gnnstream-producer",
                                              max_request_size=max_message_bytes)
        self._settings.update(config)
        self.max_message_bytes = int(self._settings["max_request_size"])
        self._producer: KafkaProducer | None = None
        self._pending: list[Any] = []  # futures not known to be delivered
        self._sent = 0  # records sent since the last flush
        self._prune_at = _PRUNE_AT
        self._closed = False

    @property
    def pending(self) -> int:
        """Records sent since the last flush."""
        return self._sent

    def _client(self) -> KafkaProducer:
        if self._closed:
            raise StreamError("producer is closed")
        if self._producer is None:
            self._producer = KafkaProducer(**self._settings)
        return self._producer

    def send(self, topic: str, key: bytes | None, value: bytes | None, headers: Headers = None,
             partition: int | None = None) -> None:
        """Queue one record.

        Raises:
            DeliveryError: the record could not even be queued (no metadata
                within ``max_block_ms``, record too large, ...).
        """
        try:
            future = self._client().send(topic, key=key, value=value, headers=header_list(headers),
                                         partition=partition)
        except KafkaError as exc:
            raise DeliveryError(f"could not queue a record for {topic!r}: {exc}", failed=1, cause=exc) from exc
        self._pending.append(future)
        self._sent += 1
        if len(self._pending) >= self._prune_at:  # long stretch without flush: forget delivered ones
            self._pending = [f for f in self._pending if not f.is_done or f.failed()]
            self._prune_at = max(_PRUNE_AT, 2 * len(self._pending))

    def flush(self, timeout_s: float = 30.0) -> int:
        pending, self._pending = self._pending, []
        sent, self._sent = self._sent, 0
        if self._producer is None:
            return 0
        timed_out = None
        try:
            self._producer.flush(timeout=timeout_s)
        except KafkaTimeoutError as exc:
            timed_out = exc
        failed = [f for f in pending if f.is_done and f.failed()]
        unanswered = sum(1 for f in pending if not f.is_done)
        if not failed and not unanswered and timed_out is None:
            return sent
        cause = failed[0].exception if failed else timed_out
        self._discard()
        raise DeliveryError(f"{len(failed)} of {sent} records failed and {unanswered} got no answer "
                            f"within {timeout_s}s (bootstrap {self._settings['bootstrap_servers']}): "
                            f"{cause!r}; keep them and send again", failed=len(failed),
                            pending=unanswered, cause=cause)

    def _discard(self) -> None:
        """Stop the underlying producer now, failing whatever it still holds.

        kafka-python's ``close()`` flushes first and, when that times out,
        raises before stopping its I/O thread; so the thread is force-closed
        first (it then fails the remaining futures) and ``close()`` after.
        """
        producer, self._producer = self._producer, None
        if producer is None:
            return
        sender = getattr(producer, "_sender", None)
        if sender is not None:
            sender.force_close()
            sender.join(2.0)
        try:
            producer.close(timeout=1.0)
        except KafkaError as exc:
            logger.warning("discarding a stuck producer: %r", exc)

    def close(self, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        producer, self._producer = self._producer, None
        if producer is None:
            return
        try:
            producer.close(timeout=timeout_s)
        except KafkaError as exc:
            logger.warning("producer closed with undelivered records after %ss: %r", timeout_s, exc)
            self._producer = producer
            self._discard()
