"""Dead letters: headers, read-back, and a round trip through Kafka."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from gnnstream.stream.broker import EmbeddedBroker
from gnnstream.stream.deadletter import DeadLetter, DeadLetterWriter, dead_letter_headers
from gnnstream.stream.events import InvalidEvent, decode_event_json
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
    DeadLetterWriter(producer, "dlq").write(letter)  # type: ignore[arg-type]
    topic, key, value, headers = producer.sent[0]
    assert (topic, key, value) == ("dlq", None, b"")
    assert ("gnnstream.null_value", b"1") in headers
    assert DeadLetter.from_record(Record("dlq", 0, 0, key, value, 0, tuple(headers))) == letter


class ListProducer:
    """A stand-in producer that records what is sent."""

    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def send(self, topic, key, value, headers=None) -> None:
        self.sent.append((topic, key, value, headers))


def test_writer_counts_by_reason() -> None:
    producer = ListProducer()
    writer = DeadLetterWriter(producer, "dlq")  # type: ignore[arg-type]
    for i, value in enumerate([b"{", b"[]", b"{"]):
        try:
            decode_event_json(value)
        except InvalidEvent as exc:
            writer.write(DeadLetter.for_error(Record("in", 0, i, b"k", value, 0), exc))
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
                letters.append(writer.reject(record, exc.reason, exc.detail))
        assert producer.flush(10) == len(bad)
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
