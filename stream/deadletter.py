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

A dead letter must fit what the client and the broker accept (the smaller of
the producer's ``max_message_bytes`` and the topic's ``max.message.bytes``).
When the original would not, its value is cut to fit and three more headers
say so; the whole original stays in the source topic at the coordinates above:

=============================  =============================================
``gnnstream.truncated``        ``1``
``gnnstream.original.size``    the original value's size in bytes, decimal
``gnnstream.original.sha256``  the original value's SHA-256, hex
=============================  =============================================

If even the cut record is refused, or the dead-letter topic refuses records
for another permanent reason (:mod:`gnnstream.stream.errors`), the letter is skipped:
counted by kind in :attr:`DeadLetterWriter.skipped` and logged once a minute
at most; the events behind it go on.

Headers of the original message are kept after these (left out as well when
they alone would not fit). Kafka clients cannot
send a message with neither key nor value, so such a message is published
with an empty value and the header ``gnnstream.null_value: 1``;
:meth:`DeadLetter.from_record` turns it back into ``None``. The writer only queues
records; the caller flushes the producer (and must do so before it stores the
consumed offsets past the bad message, or a crash could lose it).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable

from gnnstream.stream.clients import MAX_MESSAGE_BYTES, ConsumerClient, ProducerClient, Record
from gnnstream.stream.errors import Limited, classify
from gnnstream.stream.events import InvalidEvent
from gnnstream.stream.partitioning import partition_for

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
    "TRUNCATED_HEADER",
    "ORIGINAL_SIZE_HEADER",
    "ORIGINAL_SHA256_HEADER",
    "letter_partition",
    "GroupLetters",
]

logger = logging.getLogger(__name__)

REASON_HEADER = "gnnstream.reason"
DETAIL_HEADER = "gnnstream.detail"
SOURCE_TOPIC_HEADER = "gnnstream.source.topic"
SOURCE_PARTITION_HEADER = "gnnstream.source.partition"
SOURCE_OFFSET_HEADER = "gnnstream.source.offset"
NULL_VALUE_HEADER = "gnnstream.null_value"
TRUNCATED_HEADER = "gnnstream.truncated"
ORIGINAL_SIZE_HEADER = "gnnstream.original.size"
ORIGINAL_SHA256_HEADER = "gnnstream.original.sha256"
_REQUIRED_HEADERS = frozenset({REASON_HEADER, DETAIL_HEADER, SOURCE_TOPIC_HEADER,
                               SOURCE_PARTITION_HEADER, SOURCE_OFFSET_HEADER})
_OWN_HEADERS = _REQUIRED_HEADERS | {NULL_VALUE_HEADER, TRUNCATED_HEADER, ORIGINAL_SIZE_HEADER,
                                    ORIGINAL_SHA256_HEADER}
MAX_DETAIL_BYTES = 1024
RECORD_OVERHEAD = 1024
"""Bytes a fitted dead letter leaves below the limit for the framing a client adds (record and batch
headers, varints, the CRC): more than either client adds to one record."""


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
        key, value: the original bytes, unchanged (read back from a
            truncated dead letter: the bytes it kept).
        headers: the original message's headers.
        original_size: read back from a truncated dead letter: the size of
            the original value (None when it was not truncated).
        original_sha256: likewise, the original value's SHA-256 (hex).
    """

    reason: str
    detail: str
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()
    original_size: int | None = None
    original_sha256: str | None = None

    @property
    def source(self) -> tuple[str, int, int]:
        """``(topic, partition, offset)`` of the rejected message: what tells dead letters apart."""
        return self.topic, self.partition, self.offset

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
        truncated = found.get(TRUNCATED_HEADER) == b"1"
        return cls(found[REASON_HEADER].decode("utf-8", "replace"),
                   found[DETAIL_HEADER].decode("utf-8", "replace"),
                   found[SOURCE_TOPIC_HEADER].decode("utf-8", "replace"), partition, offset,
                   record.key, None if found.get(NULL_VALUE_HEADER) == b"1" else record.value,
                   tuple((k, v) for k, v in record.headers if k not in _OWN_HEADERS),
                   int(found[ORIGINAL_SIZE_HEADER]) if truncated else None,
                   found[ORIGINAL_SHA256_HEADER].decode("ascii") if truncated else None)

    def to_json(self) -> dict:
        """A JSON-ready form (bytes in base64), read back by :meth:`from_json`."""
        b64 = (lambda b: None if b is None else base64.b64encode(b).decode("ascii"))
        return {"reason": self.reason, "detail": self.detail, "topic": self.topic, "partition": self.partition,
                "offset": self.offset, "key": b64(self.key), "value": b64(self.value),
                "headers": [[k, b64(v)] for k, v in self.headers]}

    @classmethod
    def from_json(cls, obj: dict) -> DeadLetter:
        """The letter :meth:`to_json` made."""
        raw = (lambda s: None if s is None else base64.b64decode(s))
        return cls(obj["reason"], obj["detail"], obj["topic"], int(obj["partition"]), int(obj["offset"]),
                   raw(obj["key"]), raw(obj["value"]), tuple((k, raw(v)) for k, v in obj["headers"]))

    def message_headers(self) -> list[tuple[str, bytes]]:
        """Headers to publish: the ``gnnstream.*`` ones, then the original ones."""
        own = dead_letter_headers(self.reason, self.detail, self.topic, self.partition, self.offset)
        if self.key is None and self.value is None:
            own.append((NULL_VALUE_HEADER, b"1"))
        return own + [(k, v) for k, v in self.headers if k not in _OWN_HEADERS]

    def message_value(self) -> bytes | None:
        """Value to publish: the original bytes (``b""`` if neither key nor value)."""
        return b"" if self.key is None and self.value is None else self.value

    def fitted(self, max_bytes: int) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]], bool]:
        """``(key, value, headers, truncated)`` to publish within ``max_bytes`` (less
        :data:`RECORD_OVERHEAD`): the value cut to what fits, with the truncation headers, when the whole
        message would not fit; the original headers left out too when they alone would not."""
        value, headers = self.message_value(), self.message_headers()
        room = max_bytes - RECORD_OVERHEAD - len(self.key or b"")
        if _size(value, headers) <= room:
            return self.key, value, headers, False
        original = self.value or b""
        own = dead_letter_headers(self.reason, self.detail, self.topic, self.partition, self.offset) + [
            (TRUNCATED_HEADER, b"1"), (ORIGINAL_SIZE_HEADER, str(len(original)).encode("ascii")),
            (ORIGINAL_SHA256_HEADER, hashlib.sha256(original).hexdigest().encode("ascii"))]
        kept = [(k, v) for k, v in self.headers if k not in _OWN_HEADERS]
        if _size(b"", own + kept) > room:
            kept = []
        headers = own + kept
        return self.key, original[:max(0, room - _size(b"", headers))], headers, True


def letter_partition(topic: str, partition: int, partitions: int) -> int:
    """The output partition whose owner in a group writes the dead letters of source partition
    ``topic[partition]`` (docs/scaling.md): Kafka's key partitioner over ``topic/partition``."""
    return partition_for(f"{topic}/{int(partition)}".encode("utf-8"), partitions)


def _size(value: bytes | None, headers: list[tuple[str, bytes]]) -> int:
    return len(value or b"") + sum(len(k.encode("utf-8")) + len(v) for k, v in headers)


class DeadLetterWriter:
    """Sends dead letters that fit, and counts them by reason.

    Args:
        producer: the producer to send with (used by this writer alone: its
            flushes are the writer's).
        topic: the dead-letter topic.
        max_bytes: the largest record the topic accepts (the producer's own
            ``max_message_bytes`` applies too, when smaller).
        on_skip: called with the error kind of each letter skipped.
    """

    def __init__(self, producer: ProducerClient, topic: str = "graph-events-dlq",
                 max_bytes: int = MAX_MESSAGE_BYTES, on_skip: Callable[[str], None] | None = None):
        self.producer = producer
        self.topic = topic
        self.max_bytes = max_bytes
        self.on_skip = on_skip
        self.counts: Counter[str] = Counter()
        self.truncated = 0
        self.skipped: Counter[str] = Counter()
        self._limited = Limited(logger)

    def write(self, letter: DeadLetter, max_bytes: int | None = None) -> bool:
        """Queue one dead letter, cut to fit ``max_bytes`` (default :attr:`max_bytes`); whether it was cut.

        Raises:
            DeliveryError: the producer refused to queue it.
        """
        limit = min(self.max_bytes if max_bytes is None else max_bytes,
                    getattr(self.producer, "max_message_bytes", self.max_bytes))
        key, value, headers, cut = letter.fitted(limit)
        self.producer.send(self.topic, key, value, headers)
        logger.debug("dead letter %s from %s[%d]@%d: %s", letter.reason, letter.topic,
                     letter.partition, letter.offset, letter.detail)
        return cut

    def deliver(self, letters: list[DeadLetter], timeout_s: float = 30.0) -> None:
        """Send and flush ``letters``, each removed from the list once written or skipped.

        All of them are sent and flushed together; after a permanent error
        (:mod:`gnnstream.stream.errors`) each not known to be written is sent again
        alone: cut to fit, then with an empty value, then skipped.

        Raises:
            DeliveryError: a transient error (broker away, timeout): the
                letters still in the list are not written yet; call again.
        """
        while letters:
            queued = cut = 0
            try:
                for letter in letters:
                    cut += self.write(letter)
                    queued += 1
                self.producer.flush(timeout_s)
            except Exception as exc:
                if not classify(exc).permanent:
                    raise
                self._after_refusal(letters, queued, timeout_s)
                continue
            self._done(letters, queued, cut)

    def _after_refusal(self, letters: list[DeadLetter], queued: int, timeout_s: float) -> None:
        """A permanent error while sending ``letters`` (``queued`` of them queued before it)."""
        if queued == len(letters) or queued == 0:  # the flush failed (which one is not known), or the first
            self._alone(letters, timeout_s)  # send: the first alone (the others in the next round)
            return
        try:  # sending letters[queued] failed: those before it may be fine
            self.producer.flush(timeout_s)
        except Exception as exc:
            if not classify(exc).permanent:
                raise
            self._alone(letters, timeout_s)
            return
        self._done(letters, queued, 0)

    def _alone(self, letters: list[DeadLetter], timeout_s: float) -> None:
        """Write ``letters[0]`` alone: cut to fit, else with an empty value, else skip it."""
        letter, kind = letters[0], None
        for limit in (self.max_bytes, 0):
            try:
                cut = self.write(letter, limit)
                self.producer.flush(timeout_s)
            except Exception as exc:
                found = classify(exc)
                if not found.permanent:
                    raise
                kind = found.kind
                if kind != "record_too_large":
                    break
                continue
            self._done(letters, 1, int(cut))
            return
        letters.pop(0)
        self.skipped[kind or "record_too_large"] += 1
        if self.on_skip is not None:
            self.on_skip(kind or "record_too_large")
        self._limited.warning(f"skip:{kind}", "dead letter of %s[%d]@%d (%s) skipped: topic %r refuses it (%s); "
                              "the original stays in the source topic", letter.topic, letter.partition,
                              letter.offset, letter.reason, self.topic, kind)

    def _done(self, letters: list[DeadLetter], count: int, cut: int) -> None:
        for letter in letters[:count]:
            self.counts[letter.reason] += 1
        del letters[:count]
        self.truncated += cut


class GroupLetters:
    """The dead letters of one worker of a group: those it writes, and those it holds for another owner
    (docs/scaling.md, "Dead letters in a group").

    The caller says which letters it owns now (``owns``); the others are
    held until the dead-letter topic shows them (:attr:`reader`, read as the
    worker goes) or the worker owns them. The held letters are stored with
    the offsets past them (:meth:`stored`) and given back at start (``held``).

    Args:
        held: the letters held when the worker stopped.
    """

    def __init__(self, held: Iterable[DeadLetter] = ()):
        self.reader: ConsumerClient | None = None  # the dead-letter topic, every partition
        self.held: dict[tuple[str, int, int], DeadLetter] = {letter.source: letter for letter in held}
        self._changed = False  # held differs from the stored copy
        self._written: dict[tuple[str, int], int] = {}  # highest source offset the topic shows, per source
        self._limited = Limited(logger)

    def read(self, to_end_s: float = 0.0) -> None:
        """Note the source offsets of what the dead-letter topic received since the last call (with
        ``to_end_s``, reading on to its end, for at most that long)."""
        reader = self.reader
        if reader is None:
            return
        deadline = time.monotonic() + to_end_s
        while True:
            try:
                records = reader.poll_batch(10_000, 0.1 if to_end_s else 0.0)
                lag = reader.lag() if to_end_s else {}
            except Exception as exc:  # the next call tries again; until then a letter may be written twice
                self._limited.warning("read", "reading the dead-letter topic failed (%s): %r",
                                      classify(exc).kind, exc)
                return
            for r in records:
                try:
                    letter = DeadLetter.from_record(r)
                except ValueError:  # not one of ours
                    continue
                if letter.offset > self._written.get((letter.topic, letter.partition), -1):
                    self._written[(letter.topic, letter.partition)] = letter.offset
            if time.monotonic() >= deadline or (lag.keys() >= reader.assignment() and not any(lag.values())):
                return

    def _unwritten(self, letter: DeadLetter) -> bool:
        return letter.offset > self._written.get((letter.topic, letter.partition), -1)

    def sort(self, letters: Iterable[DeadLetter], owns: Callable[[DeadLetter], bool]) -> list[DeadLetter]:
        """The letters of a batch this worker writes now; the others it does not see in the topic yet are
        held."""
        self.read()
        mine = []
        for letter in filter(self._unwritten, letters):
            if owns(letter):
                mine.append(letter)
            else:
                self.held[letter.source] = letter
                self._changed = True
        return mine

    def due(self, owns: Callable[[DeadLetter], bool], to_end_s: float = 0.0) -> list[DeadLetter]:
        """Forget the held letters the topic shows; the held ones this worker owns now, in source order
        (still held until :meth:`written`)."""
        self.read(to_end_s)
        gone = [source for source, letter in self.held.items() if not self._unwritten(letter)]
        for source in gone:
            del self.held[source]
        self._changed |= bool(gone)
        return sorted((letter for letter in self.held.values() if owns(letter)), key=lambda letter: letter.source)

    def written(self, letters: Iterable[DeadLetter]) -> None:
        """Held letters that were written (or skipped)."""
        for letter in letters:
            if self.held.pop(letter.source, None) is not None:
                self._changed = True

    def stored(self) -> list[dict] | None:
        """The held letters in JSON form when they changed since the last call (to store with the offsets),
        else None."""
        if not self._changed:
            return None
        self._changed = False
        return [letter.to_json() for letter in self.held.values()]
