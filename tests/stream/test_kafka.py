"""Kafka I/O against the embedded broker: topics, round trips, seeks, lag, delivery failures."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from stream.broker import EmbeddedBroker
from stream.exceptions import DeliveryError, StreamError, TopicSetupError
from stream.kafka import EventConsumer, Producer, Record, ensure_topics

pytestmark = pytest.mark.broker


def consume(consumer: EventConsumer, n: int, timeout_s: float = 20.0) -> list[Record]:
    """Poll until ``n`` records arrived (or fail after ``timeout_s``)."""
    records: list[Record] = []
    deadline = time.monotonic() + timeout_s
    while len(records) < n and time.monotonic() < deadline:
        records.extend(consumer.poll_batch(max_records=500, timeout_s=0.5))
    assert len(records) == n, f"got {len(records)} of {n} records"
    return records


def produce(bootstrap: str, topic: str, items: list[tuple[int, bytes]]) -> None:
    with Producer(bootstrap) as producer:
        for i, value in items:
            producer.send(topic, f"k{i}".encode(), value)
        assert producer.flush(10) == len(items)


def test_ensure_topics_is_idempotent(broker: EmbeddedBroker, unique_name: Callable[[str], str]) -> None:
    a, b = unique_name("a"), unique_name("b")
    assert ensure_topics(broker.bootstrap, {a: 3, b: 1}) == sorted([a, b])
    assert ensure_topics(broker.bootstrap, {a: 3, b: 1}) == []
    with pytest.raises(ValueError, match="partition count"):
        ensure_topics(broker.bootstrap, {a: 0})


def test_ensure_topics_unreachable_broker() -> None:
    from stream.broker import free_port

    with pytest.raises(TopicSetupError, match="cannot reach Kafka"):
        ensure_topics(f"127.0.0.1:{free_port()}", {"x": 1}, timeout_s=1)


def test_round_trip_keys_headers_tombstones_and_lag(broker: EmbeddedBroker,
                                                    unique_name: Callable[[str], str]) -> None:
    topic = unique_name("rt")
    ensure_topics(broker.bootstrap, {topic: 2})
    with Producer(broker.bootstrap) as producer:
        for i in range(50):
            producer.send(topic, f"key-{i % 5}".encode(), f"v{i}".encode(),
                          headers={"h.index": str(i).encode(), "h.empty": b""})
        producer.send(topic, b"key-0", None)  # tombstone
        producer.send(topic, None, b"no key", headers=[("dup", b"1"), ("dup", b"2")])
        assert producer.pending == 52
        assert producer.flush(10) == 52
        assert producer.pending == 0

    with EventConsumer(broker.bootstrap, topic, unique_name("g")) as consumer:
        records = consume(consumer, 52)
        by_partition: dict[int, list[Record]] = {}
        for r in records:
            by_partition.setdefault(r.partition, []).append(r)
        for part in by_partition.values():  # per partition: offsets 0.., no gaps
            assert [r.offset for r in part] == list(range(len(part)))
        keyed = [r for r in records if r.key is not None and r.value is not None]
        assert sorted(int(r.header("h.index")) for r in keyed) == list(range(50))
        for r in keyed:
            assert r.value == b"v" + r.header("h.index")
            assert r.key == f"key-{int(r.header('h.index')) % 5}".encode()
            assert r.header("h.empty") == b""
            assert r.timestamp_ms > 0
        # one key, one partition, in send order
        key0 = [r for r in records if r.key == b"key-0"]
        assert len({r.partition for r in key0}) == 1
        assert [r.value for r in key0] == [f"v{i}".encode() for i in range(0, 50, 5)] + [None]
        odd = next(r for r in records if r.key is None)
        assert odd.value == b"no key" and odd.headers == (("dup", b"1"), ("dup", b"2"))
        assert odd.header("dup") == b"2" and odd.header("missing") is None
        assert consumer.assignment() == {(topic, 0), (topic, 1)}
        assert consumer.poll_batch(timeout_s=0.3) == []
        lag = consumer.lag()
        assert set(lag) == {(topic, 0), (topic, 1)} and sum(lag.values()) == 0

        produce(broker.bootstrap, topic, [(i, b"more") for i in range(6)])
        more = consume(consumer, 6)
        assert all(r.value == b"more" for r in more)
        assert consumer.commit() is True
    consumer.close()  # closing twice is harmless
    with pytest.raises(StreamError, match="closed"):
        consumer.poll_batch()


def test_seek_to_stored_offsets_resumes_exactly_there(broker: EmbeddedBroker,
                                                      unique_name: Callable[[str], str]) -> None:
    topic = unique_name("seek")
    ensure_topics(broker.bootstrap, {topic: 3})
    produce(broker.bootstrap, topic, [(i, f"v{i}".encode()) for i in range(60)])

    # What the worker stored: partition 0 at 4, partition 1 at its very end,
    # partition 2 unknown (starts at the earliest offset).
    with EventConsumer(broker.bootstrap, topic, unique_name("g")) as probe:
        full = consume(probe, 60)
    ends = {p: 1 + max(r.offset for r in full if r.partition == p) for p in range(3)}
    stored = {(topic, 0): 4, (topic, 1): ends[1]}

    group = unique_name("g")
    with EventConsumer(broker.bootstrap, topic, group) as consumer:
        consumer.seek_to(stored)
        expected = ends[0] - 4 + ends[2]
        records = consume(consumer, expected)
        firsts = {p: min(r.offset for r in records if r.partition == p) for p in {0, 2}}
        assert firsts == {0: 4, 2: 0}
        assert not [r for r in records if r.partition == 1]
        assert len({(r.partition, r.offset) for r in records}) == expected  # no duplicates
        assert consumer.poll_batch(timeout_s=0.3) == []
        # seek_to on an assigned partition applies at once (a replay)
        consumer.seek_to({(topic, 1): ends[1] - 2})
        replay = consume(consumer, 2)
        assert [(r.partition, r.offset) for r in replay] == [(1, ends[1] - 2), (1, ends[1] - 1)]


def test_on_assign_hook_supplies_offsets(broker: EmbeddedBroker, unique_name: Callable[[str], str]) -> None:
    topic = unique_name("hook")
    ensure_topics(broker.bootstrap, {topic: 1})
    produce(broker.bootstrap, topic, [(i, f"v{i}".encode()) for i in range(10)])
    calls: list[list[tuple[str, int]]] = []

    def on_assign(partitions: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        calls.append(sorted(partitions))
        return {(topic, 0): 7}

    with EventConsumer(broker.bootstrap, topic, unique_name("g"), on_assign=on_assign) as consumer:
        consumer.seek_to({(topic, 0): 2})  # the hook's answer wins
        first: list[Record] = []
        deadline = time.monotonic() + 20
        while not first and time.monotonic() < deadline:
            first = consumer.poll_batch(max_records=1, timeout_s=0.5)
        assert [(r.offset, r.value) for r in first] == [(7, b"v7")]
        assert consumer.lag() == {(topic, 0): 2}  # high watermark 10, next offset 8
        rest = consume(consumer, 2)
        assert [(r.offset, r.value) for r in rest] == [(8, b"v8"), (9, b"v9")]
        assert consumer.lag() == {(topic, 0): 0}
        assert calls == [[(topic, 0)]]


def test_failing_assign_hook_surfaces(broker: EmbeddedBroker, unique_name: Callable[[str], str]) -> None:
    topic = unique_name("badhook")
    ensure_topics(broker.bootstrap, {topic: 1})

    def on_assign(partitions: list[tuple[str, int]]) -> None:
        raise RuntimeError("store unavailable")

    with EventConsumer(broker.bootstrap, topic, unique_name("g"), on_assign=on_assign) as consumer:
        deadline = time.monotonic() + 20
        with pytest.raises(StreamError, match="store unavailable"):
            while time.monotonic() < deadline:
                consumer.poll_batch(timeout_s=0.5)


@pytest.fixture
def private_broker() -> EmbeddedBroker:
    """A broker of its own, for tests that stall or stop it."""
    with EmbeddedBroker() as b:
        yield b


def test_flush_fails_loudly_when_broker_stalls_then_recovers(private_broker: EmbeddedBroker,
                                                             unique_name: Callable[[str], str]) -> None:
    topic = unique_name("stall")
    ensure_topics(private_broker.bootstrap, {topic: 1})
    producer = Producer(private_broker.bootstrap)
    try:
        producer.send(topic, b"k", b"before")
        assert producer.flush(10) == 1
        private_broker.pause()
        try:
            outbox = [f"o{i}".encode() for i in range(5)]
            for value in outbox:
                producer.send(topic, b"k", value)
            with pytest.raises(DeliveryError) as info:
                producer.flush(1.0)
            assert info.value.failed + info.value.pending == 5
            assert producer.pending == 0
        finally:
            private_broker.resume()
        # the caller kept its outbox: send it again, now it is delivered
        for value in outbox:
            producer.send(topic, b"k", value)
        assert producer.flush(15) == 5
    finally:
        producer.close()
    with EventConsumer(private_broker.bootstrap, topic, unique_name("g")) as consumer:
        deadline = time.monotonic() + 20
        seen: list[bytes] = []
        while not set(outbox) <= set(seen) and time.monotonic() < deadline:
            seen.extend(r.value for r in consumer.poll_batch(timeout_s=0.5))
    assert seen[0] == b"before"
    assert set(outbox) <= set(seen)  # nothing lost (duplicates are allowed)


def test_flush_fails_when_broker_is_gone(unique_name: Callable[[str], str]) -> None:
    with EmbeddedBroker() as gone:
        topic = unique_name("gone")
        ensure_topics(gone.bootstrap, {topic: 1})
        producer = Producer(gone.bootstrap)
        producer.send(topic, b"k", b"v")
        assert producer.flush(10) == 1
    try:
        producer.send(topic, b"k", b"lost?")
        t0 = time.monotonic()
        with pytest.raises(DeliveryError, match="keep them and send again"):
            producer.flush(1.0)
        assert time.monotonic() - t0 < 5
    finally:
        producer.close(timeout_s=0.5)
    with pytest.raises(StreamError, match="closed"):
        producer.send(topic, b"k", b"v")


def test_restart_in_same_group_resumes_from_the_callers_store(broker: EmbeddedBroker,
                                                              unique_name: Callable[[str], str]) -> None:
    """A worker that stops and comes back resumes from its own offsets, not Kafka's."""
    topic, group = unique_name("restart"), unique_name("g")
    ensure_topics(broker.bootstrap, {topic: 2})
    produce(broker.bootstrap, topic, [(i, f"v{i}".encode()) for i in range(40)])
    store: dict[tuple[str, int], int] = {}  # what the worker persisted
    seen: list[tuple[int, int]] = []

    with EventConsumer(broker.bootstrap, topic, group, on_assign=lambda parts: store) as first:
        for r in consume(first, 40)[:25]:  # "applies" only 25 of them before it stops
            seen.append((r.partition, r.offset))
            store[(r.topic, r.partition)] = r.offset + 1
        assert first.commit({k: v + 100 for k, v in store.items()})  # Kafka's offsets are ignored

    with EventConsumer(broker.bootstrap, topic, group, on_assign=lambda parts: store) as second:
        for r in consume(second, 15):
            seen.append((r.partition, r.offset))
    assert len(seen) == len(set(seen)) == 40  # every record once: no loss, no repeat


def test_latest_starts_at_the_end_without_list_offsets(broker: EmbeddedBroker,
                                                       unique_name: Callable[[str], str]) -> None:
    """``auto_offset_reset="latest"`` finds the end from the high watermark."""
    topic = unique_name("latest")
    ensure_topics(broker.bootstrap, {topic: 2})
    produce(broker.bootstrap, topic, [(i, b"old") for i in range(20)])
    with EventConsumer(broker.bootstrap, topic, unique_name("g"), auto_offset_reset="latest",
                       on_assign=lambda parts: {(topic, 1): 0}) as consumer:  # p1 stored, p0 not
        records: list[Record] = []
        deadline = time.monotonic() + 20
        while (topic, 0) not in consumer.lag() and time.monotonic() < deadline:
            records.extend(consumer.poll_batch(timeout_s=0.3))
        assert consumer.lag()[(topic, 0)] == 0
        produce(broker.bootstrap, topic, [(i, b"new") for i in range(20, 30)])
        while sum(r.value == b"new" for r in records) < 10 and time.monotonic() < deadline:
            records.extend(consumer.poll_batch(timeout_s=0.3))
    p0 = [r for r in records if r.partition == 0]
    p1_old = [r for r in records if r.partition == 1 and r.value == b"old"]
    assert p0 and all(r.value == b"new" for r in p0)  # partition 0 skipped its old records
    assert [r.offset for r in p0] == list(range(p0[0].offset, p0[0].offset + len(p0)))
    assert [r.offset for r in p1_old] == list(range(len(p1_old)))  # partition 1 read from 0
    assert p0[0].offset + len(p1_old) == 20  # p0 started exactly at its old end
    assert sum(r.value == b"new" for r in records) == 10
