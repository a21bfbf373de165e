"""Dead letters: bad input kept, explained, and out of the way.

A message that is not a valid event is re-published to the dead-letter topic
(``graph-events-dlq`` by default) unchanged: same key, same value bytes (a
tombstone stays ``None``). Why and where it came from travel in headers:

=============================  =============================================
``gnnstream.reason``           stable reason code (``not_json``, ``bad_id`` ...)
``gnnstream.detail``           human-readable explanation (UTF-8, <= 1 KiB)
``gnnstream.source.topic``     topic it was read from
``gnnstream.source.partition`` partition, decimal ASCII
``gnnstream.source.offset``    offset, decimal ASCII
=============================  =============================================

Headers of the original message are kept after these. Kafka clients cannot
send a message with neither key nor value, so such a message is published
with an empty value and the header ``gnnstream.null_value: 1``;
:meth:`DeadLetter.from_record` turns it back into ``None``. The writer only queues
records; the caller flushes the producer (and must do so before it stores the
consumed offsets past the bad message, or a crash could lose it).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

from gnnstream.stream.events import InvalidEvent
from gnnstream.stream.clients import ProducerClient, Record

__all__ = [
    "DeadLetter",
    "DeadLetterWriter",
    "dead_letter_headers",
    "REASON_HEADER",
    "DETAIL_HEADER",
    "SOURCE_TOPIC_HEADER",
    "SOURCE_PARTITION_HEADER",
    "SOURCE_OFFSET_HEADER",
    "NULL_VALUE_HEADER",
]

logger = logging.getLogger(__name__)

REASON_HEADER = "gnnstream.reason"
DETAIL_HEADER = "gnnstream.detail"
SOURCE_TOPIC_HEADER = "gnnstream.source.topic"
SOURCE_PARTITION_HEADER = "gnnstream.source.partition"
SOURCE_OFFSET_HEADER = "gnnstream.source.offset"
NULL_VALUE_HEADER = "gnnstream.null_value"
_REQUIRED_HEADERS = frozenset({REASON_HEADER, DETAIL_HEADER, SOURCE_TOPIC_HEADER,
                               SOURCE_PARTITION_HEADER, SOURCE_OFFSET_HEADER})
_OWN_HEADERS = _REQUIRED_HEADERS | {NULL_VALUE_HEADER}
MAX_DETAIL_BYTES = 1024


def _truncate(text: str, limit: int = MAX_DETAIL_BYTES) -> bytes:
    data = text.encode("utf-8", "replace")
    return data if len(data) <= limit else data[:limit].decode("utf-8", "ignore").encode("utf-8")


def dead_letter_headers(reason: str, detail: str, topic: str, partition: int,
                        offset: int) -> list[tuple[str, bytes]]:
    """The ``gnnstream.*`` headers of a dead letter (see the module docstring)."""
    return [
        (REASON_HEADER, reason.encode("utf-8")),
        (DETAIL_HEADER, _truncate(detail)),
        (SOURCE_TOPIC_HEADER, topic.encode("utf-8")),
        (SOURCE_PARTITION_HEADER, str(int(partition)).encode("ascii")),
        (SOURCE_OFFSET_HEADER, str(int(offset)).encode("ascii")),
    ]


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A rejected message and why it was rejected.

    Attributes:
        reason: stable reason code.
        detail: explanation.
        topic, partition, offset: where the message was read.
        key, value: the original bytes, unchanged.
        headers: the original message's headers.
    """

    reason: str
    detail: str
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()

    @classmethod
    def for_record(cls, record: Record, reason: str, detail: str) -> DeadLetter:
        """The dead letter of a consumed record."""
        return cls(reason, detail, record.topic, record.partition, record.offset,
                   record.key, record.value, record.headers)

    @classmethod
    def for_error(cls, record: Record, error: InvalidEvent) -> DeadLetter:
        """The dead letter of a record that failed event decoding."""
        return cls.for_record(record, error.reason, error.detail)

    @classmethod
    def from_record(cls, record: Record) -> DeadLetter:
        """Read back a dead letter consumed from the dead-letter topic.

        Raises:
            ValueError: the record lacks the ``gnnstream.*`` headers.
        """
        found = {k: v for k, v in record.headers if k in _OWN_HEADERS}
        missing = _REQUIRED_HEADERS - found.keys()
        if missing:
            raise ValueError(f"Expected dead-letter headers {sorted(missing)} on "
                             f"{record.topic}[{record.partition}]@{record.offset}")
        try:
            partition = int(found[SOURCE_PARTITION_HEADER])
            offset = int(found[SOURCE_OFFSET_HEADER])
        except ValueError:
            raise ValueError(f"Expected decimal source partition/offset headers on "
                             f"{record.topic}[{record.partition}]@{record.offset}") from None
        return cls(found[REASON_HEADER].decode("utf-8", "replace"),
                   found[DETAIL_HEADER].decode("utf-8", "replace"),
                   found[SOURCE_TOPIC_HEADER].decode("utf-8", "replace"), partition, offset,
                   record.key, None if found.get(NULL_VALUE_HEADER) == b"1" else record.value,
                   tuple((k, v) for k, v in record.headers if k not in _OWN_HEADERS))

    def message_headers(self) -> list[tuple[str, bytes]]:
        """Headers to publish: the ``gnnstream.*`` ones, then the original ones."""
        own = dead_letter_headers(self.reason, self.detail, self.topic, self.partition, self.offset)
        if self.key is None and self.value is None:
            own.append((NULL_VALUE_HEADER, b"1"))
        return own + [(k, v) for k, v in self.headers if k not in _OWN_HEADERS]

    def message_value(self) -> bytes | None:
        """Value to publish: the original bytes (``b""`` if neither key nor value)."""
        return b"" if self.key is None and self.value is None else self.value


class DeadLetterWriter:
    """Queues dead letters on a producer and counts them by reason.

    Args:
        producer: the producer to send with (its flush is the caller's).
        topic: the dead-letter topic.
    """

    def __init__(self, producer: ProducerClient, topic: str = "graph-events-dlq"):
        self.producer = producer
        self.topic = topic
        self.counts: Counter[str] = Counter()

    def write(self, letter: DeadLetter) -> None:
        """Queue one dead letter (key and value unchanged)."""
        self.producer.send(self.topic, letter.key, letter.message_value(), letter.message_headers())
        self.counts[letter.reason] += 1
        logger.debug("dead letter %s from %s[%d]@%d: %s", letter.reason, letter.topic,
                     letter.partition, letter.offset, letter.detail)

    def reject(self, record: Record, reason: str, detail: str) -> DeadLetter:
        """Build and queue the dead letter of ``record``; returns it."""
        letter = DeadLetter.for_record(record, reason, detail)
        self.write(letter)
        return letter
