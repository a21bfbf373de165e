"""Dead letters: headers, read-back, and a round trip through Kafka."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable

import pytest

from gnnstream.stream.broker import EmbeddedBroker
from gnnstream.stream.deadletter import DeadLetter, DeadLetterWriter, GroupLetters, dead_letter_headers
from gnnstream.stream.events import InvalidEvent, decode_event_json
from gnnstream.stream.exceptions import DeliveryError
from gnnstream.stream.kafka import EventConsumer, Producer, Record, ensure_topics


def test_headers_are_named_and_encoded() -> None:
    assert dead_letter_headers("not_json", "Expecting value", "graph-events", 3, 12345) == [
        ("gnnstream.reason", b"not_json"),
        ("gnnstream.detail", b"Expecting value"),
        ("gnnstream.source.topic", b"graph-events"),
        ("gnnstream.source.partition", b"3"),
        ("gnnstream.source.offset", b"12345"),
    ]
    long = dead_letter_headers("x", "\u00e9" * 2000, "t", 0, 0)[1][1]
    assert len(long) <= 1024 and long.decode("utf-8") == "\u00e9" * 512


def test_read_back_without_kafka() -> None:
    source = Record("graph-events", 2, 41, b"a1", b"{oops", 1, (("trace", b"abc"),))
    letter = DeadLetter.for_record(source, "not_json", "bad")
    published = Record("graph-events-dlq", 0, 0, letter.key, letter.value, 2, tuple(letter.message_headers()))
    assert published.headers[-1] == ("trace", b"abc")
    assert DeadLetter.from_record(published) == letter
    with pytest.raises(ValueError, match="dead-letter headers"):
        DeadLetter.from_record(source)


def test_message_without_key_and_value() -> None:
    letter = DeadLetter.for_record(Record("in", 1, 5, None, None, 0), "empty", "tombstone")
    producer = ListProducer()
    DeadLetterWriter(producer, "dlq").deliver([letter])  # type: ignore[arg-type]
    topic, key, value, headers = producer.sent[0]
    assert (topic, key, value) == ("dlq", None, b"")
    assert ("gnnstream.null_value", b"1") in headers
    assert DeadLetter.from_record(Record("dlq", 0, 0, key, value, 0, tuple(headers))) == letter


class ListProducer:
    """A stand-in producer that records what is delivered; ``refuse(size)`` says which error (if any) the
    "broker" answers to a record of that many bytes at the flush."""

    def __init__(self, refuse: Callable[[int], BaseException | None] = lambda size: None) -> None:
        self.sent: list[tuple] = []
        self.queued: list[tuple] = []
        self.refuse = refuse

    def send(self, topic, key, value, headers=None) -> None:
        self.queued.append((topic, key, value, headers))

    def flush(self, timeout_s: float = 30.0) -> int:
        queued, self.queued = self.queued, []
        errors = [e for e in (self.refuse(_record_size(*q[1:])) for q in queued) if e is not None]
        if errors:
            raise DeliveryError(f"{len(errors)} failed", failed=len(errors), cause=errors[0])
        self.sent.extend(queued)
        return len(queued)


def _record_size(key, value, headers) -> int:
    return len(key or b"") + len(value or b"") + sum(len(k) + len(v) for k, v in headers or ())


def test_writer_counts_by_reason() -> None:
    producer = ListProducer()
    writer = DeadLetterWriter(producer, "dlq")  # type: ignore[arg-type]
    letters = []
    for i, value in enumerate([b"{", b"[]", b"{"]):
        try:
            decode_event_json(value)
        except InvalidEvent as exc:
            letters.append(DeadLetter.for_error(Record("in", 0, i, b"k", value, 0), exc))
    writer.deliver(letters)
    assert letters == []  # each removed once written
    assert writer.counts == {"not_json": 2, "not_object": 1}
    assert [(t, k, v) for t, k, v, _ in producer.sent] == [("dlq", b"k", b"{"), ("dlq", b"k", b"[]"),
                                                         ("dlq", b"k", b"{")]


@pytest.mark.broker
def test_dead_letters_round_trip_through_kafka(broker: EmbeddedBroker, unique_name: Callable[[str], str]) -> None:
    source, dlq = unique_name("events"), unique_name("dlq")
    ensure_topics(broker.bootstrap, {source: 1, dlq: 1})
    bad = [(b"a1", b"\xff\xfe"), (b"b2", b'{"op":"nope"}'), (b"d4", None), (b"c3", b"x" * 100)]
    with Producer(broker.bootstrap) as producer:
        for key, value in bad:
            producer.send(source, key, value, headers={"origin": b"test"})
        producer.flush(10)

        writer = DeadLetterWriter(producer, dlq)
        letters = []
        with EventConsumer(broker.bootstrap, source, unique_name("g")) as consumer:
            records: list[Record] = []
            deadline = time.monotonic() + 20
            while len(records) < len(bad) and time.monotonic() < deadline:
                records.extend(consumer.poll_batch(timeout_s=0.5))
        for record in records:
            try:
                decode_event_json(record.value, max_bytes=64)
            except InvalidEvent as exc:
                letters.append(DeadLetter.for_error(record, exc))
        writer.deliver(list(letters), 10)
    assert writer.counts == {"not_utf8": 1, "unknown_op": 1, "empty": 1, "oversize": 1}

    with EventConsumer(broker.bootstrap, dlq, unique_name("g")) as consumer:
        back: list[Record] = []
        deadline = time.monotonic() + 20
        while len(back) < len(bad) and time.monotonic() < deadline:
            back.extend(consumer.poll_batch(timeout_s=0.5))
    read = [DeadLetter.from_record(r) for r in back]
    assert read == letters
    assert [(d.key, d.value) for d in read] == bad  # original bytes, tombstone included
    assert [(d.topic, d.partition, d.offset) for d in read] == [(source, 0, i) for i in range(4)]
    assert all(d.headers == (("origin", b"test"),) for d in read)
    assert back[0].header("gnnstream.reason") == b"not_utf8"
    assert back[0].header("gnnstream.source.offset") == b"0"


def _too_large(client: str) -> BaseException:
    """The error each client reports for a record the broker (or the client) finds too large."""
    if client == "confluent":
        from confluent_kafka import KafkaError, KafkaException
        return KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
    from kafka.errors import MessageSizeTooLargeError
    return MessageSizeTooLargeError("too large")


def _unknown_topic(client: str) -> BaseException:
    if client == "confluent":
        from confluent_kafka import KafkaError, KafkaException
        return KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))
    from kafka.errors import UnknownTopicOrPartitionError
    return UnknownTopicOrPartitionError("unknown")


def _letter(offset: int, size: int) -> DeadLetter:
    return DeadLetter.for_record(Record("graph-events", 3, offset, b"k", b"v" * size, 0, (("trace", b"t"),)),
                                 "oversize", "too big")


def test_a_letter_over_the_limit_is_cut_to_fit_and_says_so() -> None:
    producer = ListProducer()
    writer = DeadLetterWriter(producer, "dlq", max_bytes=100_000)  # type: ignore[arg-type]
    original = _letter(7, 1_000_060)
    writer.deliver([original, _letter(8, 10)])
    (_, key, value, headers), (_, _, small, small_headers) = producer.sent
    assert _record_size(key, value, headers) <= 100_000 - 1024
    assert value == original.value[:len(value)] and len(value) > 90_000
    back = DeadLetter.from_record(Record("dlq", 0, 0, key, value, 0, tuple(headers)))
    assert back.original_size == 1_000_060
    assert back.original_sha256 == hashlib.sha256(original.value).hexdigest()
    assert back.source == ("graph-events", 3, 7) and back.reason == "oversize" and back.headers == (("trace", b"t"),)
    assert dict(headers)["gnnstream.truncated"] == b"1"
    assert small == b"v" * 10 and "gnnstream.truncated" not in dict(small_headers)
    assert writer.truncated == 1 and writer.counts == {"oversize": 2}


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_a_letter_the_broker_finds_too_large_is_cut_to_nothing(client: str) -> None:
    """The broker's limit (50 kB here) is below what the writer was told: the flush fails with a permanent
    error, each letter is sent alone, and the one refused is sent again with an empty value."""
    producer = ListProducer(lambda size: _too_large(client) if size > 50_000 else None)
    writer = DeadLetterWriter(producer, "dlq", max_bytes=1_000_000)  # type: ignore[arg-type]
    letters = [_letter(1, 10), _letter(2, 200_000), _letter(3, 20)]
    writer.deliver(letters)
    assert letters == []
    sources = [DeadLetter.from_record(Record("dlq", 0, 0, k, v, 0, tuple(h))) for _, k, v, h in producer.sent]
    assert [(d.offset, len(d.value or b""), d.original_size) for d in sources] == [(1, 10, None), (2, 0, 200_000),
                                                                                   (3, 20, None)]
    assert writer.truncated == 1 and not writer.skipped


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
@pytest.mark.parametrize("error", [_too_large, _unknown_topic])
def test_a_letter_refused_even_cut_is_skipped_and_counted(client: str, error: Callable[[str], BaseException],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    kinds: list[str] = []
    producer = ListProducer(lambda size: error(client) if size > 10_000 or error is _unknown_topic else None)
    writer = DeadLetterWriter(producer, "dlq", on_skip=kinds.append)  # type: ignore[arg-type]
    letters = [_letter(1, 10), _letter(2, 20_000), _letter(3, 30_000)]
    if error is _too_large:  # headers alone over the "broker's" limit: nothing can be written
        producer.refuse = lambda size: error(client) if size > 10 else None
    with caplog.at_level("WARNING", logger="gnnstream.stream.deadletter"):
        writer.deliver(letters)
    expected = "record_too_large" if error is _too_large else "unknown_topic"
    assert letters == [] and producer.sent == []
    assert kinds == [expected] * 3 and writer.skipped == {expected: 3}
    skipped = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1  # logged once, the repeats counted


def test_a_transient_error_keeps_the_letters_for_the_next_try() -> None:
    from kafka.errors import KafkaTimeoutError
    producer = ListProducer(lambda size: KafkaTimeoutError("no answer"))
    writer = DeadLetterWriter(producer, "dlq")  # type: ignore[arg-type]
    letters = [_letter(1, 10), _letter(2, 10)]
    with pytest.raises(DeliveryError):
        writer.deliver(letters)
    assert len(letters) == 2 and not writer.skipped
    producer.refuse = lambda size: None
    writer.deliver(letters)
    assert letters == [] and len(producer.sent) == 2


def test_json_form_round_trips() -> None:
    letter = DeadLetter.for_record(Record("in", 1, 5, None, b"\xff", 0, (("h", b"\x00"),)), "not_utf8", "bad")
    assert DeadLetter.from_json(json.loads(json.dumps(letter.to_json()))) == letter


@pytest.mark.broker
@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_a_letter_over_the_clients_limit_reaches_kafka_cut(broker: EmbeddedBroker, unique_name: Callable[[str], str],
                                                           client: str) -> None:
    """The producer refuses a record over its own limit before sending it; the writer sends it cut."""
    from gnnstream.stream.backends import open_producer, read_to_end
    dlq = unique_name("dlq")
    ensure_topics(broker.bootstrap, {dlq: 1})
    original = _letter(4, 1_000_060)
    with open_producer(client, broker.bootstrap, max_message_bytes=200_000) as producer:
        DeadLetterWriter(producer, dlq).deliver([_letter(3, 5), original])
        # told a larger limit than the client's own: the client refuses, the letter goes out with no value
        writer = DeadLetterWriter(_Unlimited(producer), dlq, max_bytes=10_000_000)  # type: ignore[arg-type]
        writer.deliver([original])
    back = [DeadLetter.from_record(r) for r in read_to_end(client, broker.bootstrap, dlq)]
    assert [d.offset for d in back] == [3, 4, 4]
    assert back[1].original_size == 1_000_060 and 150_000 < len(back[1].value) < 200_000
    assert back[1].value == original.value[:len(back[1].value)]
    assert back[2].original_size == 1_000_060 and back[2].value == b""
    assert back[1].original_sha256 == hashlib.sha256(original.value).hexdigest()
    assert writer.truncated == 1


class _Unlimited:
    """A producer that does not say its limit."""

    def __init__(self, producer) -> None:
        self.send, self.flush = producer.send, producer.flush


class ListReader:
    """A stand-in for the dead-letter topic's consumer: returns what was appended since the last poll."""

    def __init__(self) -> None:
        self.records: list[Record] = []

    def append(self, letter: DeadLetter) -> None:
        self.records.append(Record("dlq", 0, len(self.records), letter.key, letter.message_value(), 0,
                                   tuple(letter.message_headers())))

    def poll_batch(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        out, self.records = self.records, []
        return out

    def lag(self) -> dict:
        return {("dlq", 0): 0}

    def assignment(self) -> set:
        return {("dlq", 0)}


def test_a_group_member_writes_its_own_letters_and_holds_the_others() -> None:
    mine_partition = 1
    owned = {mine_partition}
    owns = (lambda letter: letter.partition in owned)
    group = GroupLetters()
    group.reader = ListReader()  # type: ignore[assignment]
    letters = [DeadLetter.for_record(Record("graph-events", p, o, b"k", b"v", 0), "not_json", "bad")
               for p, o in [(1, 10), (2, 11), (2, 12), (3, 13)]]
    assert [(d.partition, d.offset) for d in group.sort(letters, owns)] == [(1, 10)]
    assert sorted(group.held) == [("graph-events", 2, 11), ("graph-events", 2, 12), ("graph-events", 3, 13)]
    stored = group.stored()
    assert [DeadLetter.from_json(o).source for o in stored] == sorted(group.held) and group.stored() is None
    # the owner of partition 2's letters wrote the one at offset 11: forgotten here; 12 is still held
    group.reader.append(letters[1])  # type: ignore[attr-defined]
    assert group.due(owns) == [] and sorted(group.held) == [("graph-events", 2, 12), ("graph-events", 3, 13)]
    assert group.stored() is not None
    # partition 3 handed to this worker: its held letter is due, and gone once written
    owned.add(3)
    due = group.due(owns, to_end_s=1.0)
    assert [d.source for d in due] == [("graph-events", 3, 13)]
    group.written(due)
    assert sorted(group.held) == [("graph-events", 2, 12)]
    # a letter the topic already shows is not written again, by its owner either
    owned.add(2)
    group.reader.append(letters[2])  # type: ignore[attr-defined]
    assert group.sort([letters[2]], owns) == [] and group.due(owns) == [] and not group.held
    restarted = GroupLetters(DeadLetter.from_json(o) for o in stored)
    assert sorted(restarted.held) == [("graph-events", 2, 11), ("graph-events", 2, 12), ("graph-events", 3, 13)]
