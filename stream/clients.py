"""The Kafka client seam: records and the two client interfaces.

The rest of the project talks to Kafka only through :class:`ConsumerClient`
and :class:`ProducerClient`. :mod:`gnnstream.stream.kafka` implements them with
kafka-python; another backend (confluent-kafka) or an in-memory fake for
tests would implement the same two classes. This module imports no Kafka
library.

Offsets: the worker's store is the source of truth. On every assignment a
consumer seeks each partition to the offset the caller stored (``on_assign``
callback or :meth:`ConsumerClient.seek_to`) or, when none is known, to the
earliest offset; Kafka's committed offsets are written only for lag tools.
A caller that stores offsets compares them with :meth:`ConsumerClient.high_watermarks`
to notice a partition that now ends before its stored offset (a topic reset).
"""

from __future__ import annotations

import time
from collections import abc
from abc import ABC, abstractmethod
from types import TracebackType
from typing import Callable, Iterable, Mapping, NamedTuple, Optional, Sequence, Union

__all__ = ["FETCH_WAIT_MS", "MAX_MESSAGE_BYTES", "Record", "PartitionKey", "Headers", "AssignHook", "ConsumerClient", "ProducerClient",
           "header_list", "joined_headers", "wait_for_partitions"]

FETCH_WAIT_MS = 100
"""The longest a consumer's fetch waits at the broker for records (both backends; 500 ms by default in
both clients). A broker answers a waiting fetch as soon as records arrive, unless it only answers when the
wait is over, as the embedded broker does: then this bound is added to the latency of every event that
arrives at a caught-up worker."""

MAX_MESSAGE_BYTES = 1_000_000
"""The largest record a producer sends unless told otherwise (both backends: librdkafka's
``message.max.bytes`` default; kafka-python's ``max_request_size`` is set to it). A larger one is refused
before it is sent, a permanent error (:mod:`gnnstream.stream.errors`)."""

PartitionKey = tuple[str, int]
"""``(topic, partition)``."""
Headers = Optional[Union[Mapping[str, bytes], Sequence[tuple[str, bytes]]]]
AssignHook = Callable[[list[PartitionKey]], Optional[Mapping[PartitionKey, int]]]


class Record(NamedTuple):
    """One consumed Kafka message (a named tuple: a consumer builds one per message, and a tuple is built
    several times faster than a frozen dataclass)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int
    headers: tuple[tuple[str, bytes], ...] = ()

    def header(self, name: str) -> bytes | None:
        """The value of the last header called ``name``, ``None`` if absent."""
        for key, value in reversed(self.headers):
            if key == name:
                return value
        return None


def header_list(headers: Headers) -> list[tuple[str, bytes]] | None:
    """Headers as the ``[(name, bytes)]`` list Kafka clients take (``None`` if empty)."""
    if not headers:
        return None
    pairs = headers.items() if isinstance(headers, abc.Mapping) else headers
    return [(str(k), bytes(v)) for k, v in pairs]


def joined_headers(own: Headers, common: Headers) -> Headers:
    """A record's own headers followed by the ones every record of a batch carries."""
    if not own:
        return common
    if not common:
        return own
    return [*(header_list(own) or ()), *(header_list(common) or ())]


def wait_for_partitions(find: Callable[[], "Iterable[int] | None"], topic: str, timeout_s: float) -> set[int]:
    """The partitions ``find()`` reports for ``topic``, asked again every 0.1 s until it reports some.

    Raises:
        NoPartitionsError: none within ``timeout_s`` (the topic does not exist).
    """
    from gnnstream.stream.exceptions import NoPartitionsError
    deadline = time.monotonic() + timeout_s
    while True:
        found = find()
        if found:
            return set(found)
        if time.monotonic() > deadline:
            raise NoPartitionsError(f"topic {topic!r} has no partitions after {timeout_s:g} s (does it exist?)")
        time.sleep(0.1)


class ConsumerClient(ABC):
    """Reads records of a consumer group, resuming where the caller says."""

    @abstractmethod
    def seek_to(self, offsets: Mapping[PartitionKey, int]) -> None:
        """Set the next offset to read per partition (applied now if assigned,
        else when the partition is assigned)."""

    @abstractmethod
    def poll_batch(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        """Up to ``max_records`` records, in offset order per partition."""

    @abstractmethod
    def commit(self, offsets: Mapping[PartitionKey, int] | None = None, wait: bool = False) -> bool:
        """Best-effort commit of next offsets for lag tools; False on failure (``wait``: known to be
        stored when True is returned)."""

    @abstractmethod
    def committed(self, partitions: Sequence[PartitionKey], timeout_s: float = 10.0) -> dict[PartitionKey, int | None]:
        """The group's committed offset of each partition (None where there is none).

        Raises:
            StreamError: the group coordinator did not answer within ``timeout_s``.
        """

    @abstractmethod
    def lag(self) -> dict[PartitionKey, int]:
        """Records not yet delivered per assigned partition whose end is known."""

    @abstractmethod
    def high_watermarks(self) -> dict[PartitionKey, int]:
        """The high watermark of each assigned partition as known from the last fetch; partitions whose end
        is not known yet are absent."""

    @abstractmethod
    def partitions_of(self, topic: str, timeout_s: float = 10.0) -> set[int]:
        """The partition numbers of ``topic`` from the cluster's metadata.

        Raises:
            StreamError: none known within ``timeout_s`` (the topic does not exist).
        """

    @abstractmethod
    def assignment(self) -> set[PartitionKey]:
        """The partitions assigned to this member now."""

    @abstractmethod
    def close(self) -> None:
        """Leave the group and release connections (idempotent)."""

    def __enter__(self) -> ConsumerClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class ProducerClient(ABC):
    """Sends records; :meth:`flush` is the delivery guarantee."""

    max_message_bytes: int = MAX_MESSAGE_BYTES
    """The largest record this producer sends (key, value, headers and framing); larger ones are refused."""

    @abstractmethod
    def send(self, topic: str, key: bytes | None, value: bytes | None, headers: Headers = None,
             partition: int | None = None) -> None:
        """Queue one record (``value=None`` is a tombstone), to ``partition`` or the key's partition."""

    def send_many(self, topic: str, messages: Iterable[tuple[bytes | None, bytes | None, Headers]],
                  headers: Headers = None) -> int:
        """Queue ``(key, value, own headers)`` records to their keys' partitions, each with ``headers`` after its
        own; how many. As :meth:`send` for each (a backend may do it with less work per record)."""
        count = 0
        for key, value, own in messages:
            self.send(topic, key, value, joined_headers(own, headers))
            count += 1
        return count

    @abstractmethod
    def flush(self, timeout_s: float = 30.0) -> int:
        """Wait for every record sent since the last flush; return how many.

        Raises:
            DeliveryError: some were not acknowledged; treat all as unsent.
        """

    @abstractmethod
    def close(self, timeout_s: float = 5.0) -> None:
        """Try to deliver what is queued, then release connections."""

    def __enter__(self) -> ProducerClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
