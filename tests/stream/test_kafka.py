"""Kafka I/O against the embedded broker: topics, round trips, seeks, lag, delivery failures.

Every consumer and producer test runs against both backends of
:mod:`gnnstream.stream.backends` (the ``kafka_client`` fixture); a few at the end test
what only the confluent-kafka backend has (its settings, its full local queue,
its bounded close).
"""

from __future__ import annotations

import logging
import threading
import time
import types
from collections.abc import Callable

import pytest

from gnnstream.stream.backends import KAFKA_CLIENTS, open_consumer, open_producer
from gnnstream.stream.broker import EmbeddedBroker
from gnnstream.stream.clients import ConsumerClient, Record
from gnnstream.stream.exceptions import DeliveryError, StreamError, TopicSetupError
from gnnstream.stream.kafka import ensure_topics
from tests.support import closed_port

pytestmark = pytest.mark.broker


@pytest.fixture(params=KAFKA_CLIENTS)
def kafka_client(request: pytest.FixtureRequest) -> str:
    """The backend under test: each test that takes it runs once per client."""
    return request.param


def consume(consumer: ConsumerClient, n: int, timeout_s: float = 20.0) -> list[Record]:
    """Poll until ``n`` records arrived (or fail after ``timeout_s``)."""
    records: list[Record] = []
    deadline = time.monotonic() + timeout_s
    while len(records) < n and time.monotonic() < deadline:
        records.extend(consumer.poll_batch(max_records=500, timeout_s=0.5))
    assert len(records) == n, f"got {len(records)} of {n} records"
    return records


def _in_thread(call: Callable[[], object], deadline_s: float = 60.0) -> BaseException | None:
    """Run ``call`` on a thread; what it raised (None when it returned). Fails only when it is still running
    after ``deadline_s``: a call that blocks for good, not one that is slow."""
    raised: list[BaseException | None] = []

    def target() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the caller
            raised.append(exc)
        else:
            raised.append(None)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(deadline_s)
    assert not thread.is_alive(), f"still blocked after {deadline_s} s"
    return raised[0]


def produce(client: str, bootstrap: str, topic: str, items: list[tuple[int, bytes]]) -> None:
    with open_producer(client, bootstrap) as producer:
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
    with closed_port() as port, pytest.raises(TopicSetupError, match="cannot reach Kafka"):
        ensure_topics(f"127.0.0.1:{port}", {"x": 1}, timeout_s=1)


def test_round_trip_keys_headers_tombstones_and_lag(kafka_client: str, broker: EmbeddedBroker,
                                                    unique_name: Callable[[str], str]) -> None:
    topic = unique_name("rt")
    ensure_topics(broker.bootstrap, {topic: 2})
    with open_producer(kafka_client, broker.bootstrap) as producer:
        for i in range(50):
            producer.send(topic, f"key-{i % 5}".encode(), f"v{i}".encode(),
                          headers={"h.index": str(i).encode(), "h.empty": b""})
        producer.send(topic, b"key-0", None)  # tombstone
        producer.send(topic, None, b"no key", headers=[("dup", b"1"), ("dup", b"2")])
        assert producer.pending == 52
        assert producer.flush(10) == 52
        assert producer.pending == 0

    with open_consumer(kafka_client, broker.bootstrap, topic, unique_name("g")) as consumer:
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

        produce(kafka_client, broker.bootstrap, topic, [(i, b"more") for i in range(6)])
        more = consume(consumer, 6)
        assert all(r.value == b"more" for r in more)
        assert consumer.commit() is True
    consumer.close()  # closing twice is harmless
    with pytest.raises(StreamError, match="closed"):
        consumer.poll_batch()


def test_seek_to_stored_offsets_resumes_exactly_there(kafka_client: str, broker: EmbeddedBroker,
                                                      unique_name: Callable[[str], str]) -> None:
    topic = unique_name("seek")
    ensure_topics(broker.bootstrap, {topic: 3})
    produce(kafka_client, broker.bootstrap, topic, [(i, f"v{i}".encode()) for i in range(60)])

    # What the worker stored: partition 0 at 4, partition 1 at its very end,
    # partition 2 unknown (starts at the earliest offset).
    with open_consumer(kafka_client, broker.bootstrap, topic, unique_name("g")) as probe:
        full = consume(probe, 60)
    ends = {p: 1 + max(r.offset for r in full if r.partition == p) for p in range(3)}
    stored = {(topic, 0): 4, (topic, 1): ends[1]}

    group = unique_name("g")
    with open_consumer(kafka_client, broker.bootstrap, topic, group) as consumer:
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


def test_on_assign_hook_supplies_offsets(kafka_client: str, broker: EmbeddedBroker,
                                         unique_name: Callable[[str], str]) -> None:
    topic = unique_name("hook")
    ensure_topics(broker.bootstrap, {topic: 1})
    produce(kafka_client, broker.bootstrap, topic, [(i, f"v{i}".encode()) for i in range(10)])
    calls: list[list[tuple[str, int]]] = []

    def on_assign(partitions: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        calls.append(sorted(partitions))
        return {(topic, 0): 7}

    with open_consumer(kafka_client, broker.bootstrap, topic, unique_name("g"), on_assign=on_assign) as consumer:
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


def test_failing_assign_hook_surfaces(kafka_client: str, broker: EmbeddedBroker,
                                      unique_name: Callable[[str], str]) -> None:
    topic = unique_name("badhook")
    ensure_topics(broker.bootstrap, {topic: 1})

    def on_assign(partitions: list[tuple[str, int]]) -> None:
        raise RuntimeError("store unavailable")

    with open_consumer(kafka_client, broker.bootstrap, topic, unique_name("g"), on_assign=on_assign) as consumer:
        deadline = time.monotonic() + 20
        with pytest.raises(StreamError, match="store unavailable"):
            while time.monotonic() < deadline:
                consumer.poll_batch(timeout_s=0.5)


@pytest.fixture
def private_broker() -> EmbeddedBroker:
    """A broker of its own, for tests that stall or stop it."""
    with EmbeddedBroker() as b:
        yield b


def test_flush_fails_loudly_when_broker_stalls_then_recovers(kafka_client: str, private_broker: EmbeddedBroker,
                                                             unique_name: Callable[[str], str]) -> None:
    topic = unique_name("stall")
    ensure_topics(private_broker.bootstrap, {topic: 1})
    producer = open_producer(kafka_client, private_broker.bootstrap)
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
    with open_consumer(kafka_client, private_broker.bootstrap, topic, unique_name("g")) as consumer:
        deadline = time.monotonic() + 20
        seen: list[bytes] = []
        while not set(outbox) <= set(seen) and time.monotonic() < deadline:
            seen.extend(r.value for r in consumer.poll_batch(timeout_s=0.5))
    assert seen[0] == b"before"
    assert set(outbox) <= set(seen)  # nothing lost (duplicates are allowed)


def test_flush_fails_when_broker_is_gone(kafka_client: str, unique_name: Callable[[str], str]) -> None:
    with EmbeddedBroker() as gone:
        topic = unique_name("gone")
        ensure_topics(gone.bootstrap, {topic: 1})
        producer = open_producer(kafka_client, gone.bootstrap)
        producer.send(topic, b"k", b"v")
        assert producer.flush(10) == 1
    try:
        producer.send(topic, b"k", b"lost?")
        # flush(1.0) gives up on its own: the thread ends (the deadline only stops a test that hangs)
        raised = _in_thread(lambda: producer.flush(1.0))
        assert isinstance(raised, DeliveryError) and "keep them and send again" in str(raised), raised
        assert raised.failed + raised.pending == 1
    finally:
        producer.close(timeout_s=0.5)
    with pytest.raises(StreamError, match="closed"):
        producer.send(topic, b"k", b"v")


def test_restart_in_same_group_resumes_from_the_callers_store(kafka_client: str, broker: EmbeddedBroker,
                                                              unique_name: Callable[[str], str]) -> None:
    """A worker that stops and comes back resumes from its own offsets, not Kafka's."""
    topic, group = unique_name("restart"), unique_name("g")
    ensure_topics(broker.bootstrap, {topic: 2})
    produce(kafka_client, broker.bootstrap, topic, [(i, f"v{i}".encode()) for i in range(40)])
    store: dict[tuple[str, int], int] = {}  # what the worker persisted
    seen: list[tuple[int, int]] = []

    with open_consumer(kafka_client, broker.bootstrap, topic, group, on_assign=lambda parts: store) as first:
        for r in consume(first, 40)[:25]:  # "applies" only 25 of them before it stops
            seen.append((r.partition, r.offset))
            store[(r.topic, r.partition)] = r.offset + 1
        assert first.commit({k: v + 100 for k, v in store.items()})  # Kafka's offsets are ignored

    with open_consumer(kafka_client, broker.bootstrap, topic, group, on_assign=lambda parts: store) as second:
        for r in consume(second, 15):
            seen.append((r.partition, r.offset))
    assert len(seen) == len(set(seen)) == 40  # every record once: no loss, no repeat


def test_latest_starts_at_the_end_without_list_offsets(kafka_client: str, broker: EmbeddedBroker,
                                                       unique_name: Callable[[str], str]) -> None:
    """``auto_offset_reset="latest"`` finds the end from the high watermark."""
    topic = unique_name("latest")
    ensure_topics(broker.bootstrap, {topic: 2})
    produce(kafka_client, broker.bootstrap, topic, [(i, b"old") for i in range(20)])
    with open_consumer(kafka_client, broker.bootstrap, topic, unique_name("g"), auto_offset_reset="latest",
                       on_assign=lambda parts: {(topic, 1): 0}) as consumer:  # p1 stored, p0 not
        records: list[Record] = []
        deadline = time.monotonic() + 20
        while (topic, 0) not in consumer.lag() and time.monotonic() < deadline:
            records.extend(consumer.poll_batch(timeout_s=0.3))
        assert consumer.lag()[(topic, 0)] == 0
        produce(kafka_client, broker.bootstrap, topic, [(i, b"new") for i in range(20, 30)])
        while sum(r.value == b"new" for r in records) < 10 and time.monotonic() < deadline:
            records.extend(consumer.poll_batch(timeout_s=0.3))
    p0 = [r for r in records if r.partition == 0]
    p1_old = [r for r in records if r.partition == 1 and r.value == b"old"]
    assert p0 and all(r.value == b"new" for r in p0)  # partition 0 skipped its old records
    assert [r.offset for r in p0] == list(range(p0[0].offset, p0[0].offset + len(p0)))
    assert [r.offset for r in p1_old] == list(range(len(p1_old)))  # partition 1 read from 0
    assert p0[0].offset + len(p1_old) == 20  # p0 started exactly at its old end
    assert sum(r.value == b"new" for r in records) == 10


def test_high_watermarks_come_from_fetches(kafka_client: str, broker: EmbeddedBroker,
                                           unique_name: Callable[[str], str]) -> None:
    """The end of each partition as the last fetch saw it, also when the stored offset is past it."""
    topic = unique_name("hw")
    ensure_topics(broker.bootstrap, {topic: 1})
    produce(kafka_client, broker.bootstrap, topic, [(i, f"v{i}".encode()) for i in range(5)])
    with open_consumer(kafka_client, broker.bootstrap, topic, unique_name("g")) as consumer:
        assert consumer.high_watermarks() == {}  # nothing assigned, nothing fetched
        assert [r.offset for r in consume(consumer, 5)] == list(range(5))
        assert consumer.high_watermarks() == {(topic, 0): 5}
        produce(kafka_client, broker.bootstrap, topic, [(i, b"more") for i in range(3)])
        assert [r.offset for r in consume(consumer, 3)] == [5, 6, 7]
        assert consumer.high_watermarks() == {(topic, 0): 8}
        assert consumer.lag() == {(topic, 0): 0}

    # a store from before a topic reset: its offset is past the end
    with open_consumer(kafka_client, broker.bootstrap, topic, unique_name("g"),
                       on_assign=lambda parts: {(topic, 0): 100}) as consumer:
        deadline = time.monotonic() + 20
        while not consumer.high_watermarks() and time.monotonic() < deadline:
            consumer.poll_batch(timeout_s=0.3)
        assert consumer.high_watermarks() == {(topic, 0): 8}


def test_read_to_end_reads_every_partition_without_a_group(kafka_client: str, broker: EmbeddedBroker,
                                                          unique_name: Callable[[str], str]) -> None:
    """Every record of every partition, in order per partition; an empty topic is []; a missing one is refused."""
    from gnnstream.stream.backends import read_to_end
    from gnnstream.stream.exceptions import NoPartitionsError
    topic, empty = unique_name("all"), unique_name("empty")
    ensure_topics(broker.bootstrap, {topic: 3, empty: 2})
    produce(kafka_client, broker.bootstrap, topic, [(i, f"v{i}".encode()) for i in range(40)])
    records = read_to_end(kafka_client, broker.bootstrap, topic)
    assert sorted(r.value for r in records) == sorted(f"v{i}".encode() for i in range(40))
    assert len({r.partition for r in records}) > 1
    for p in {r.partition for r in records}:
        offsets = [r.offset for r in records if r.partition == p]
        assert offsets == list(range(len(offsets)))
    again = read_to_end(kafka_client, broker.bootstrap, topic)  # no offsets kept between reads
    by_place = lambda r: (r.partition, r.offset)  # noqa: E731
    assert sorted(again, key=by_place) == sorted(records, key=by_place)
    assert read_to_end(kafka_client, broker.bootstrap, empty) == []
    with pytest.raises(NoPartitionsError):
        read_to_end(kafka_client, broker.bootstrap, unique_name("missing"), timeout_s=5)


def test_unknown_client_name_is_refused() -> None:
    with pytest.raises(ValueError, match="kafka-python, confluent"):
        open_consumer("librdkafka", "127.0.0.1:9", "t", "g")
    with pytest.raises(ValueError, match=r"got 'kafka'"):
        open_producer("kafka", "127.0.0.1:9")


def test_delivery_error_when_no_broker_ever_answered(kafka_client: str) -> None:
    # kafka-python's send waits bootstrap_timeout_ms (30 s by default) for a first broker, whatever max_block_ms
    own = {"kafka-python": {"bootstrap_timeout_ms": 1000}}.get(kafka_client, {})
    with closed_port() as port:
        producer = open_producer(kafka_client, f"127.0.0.1:{port}", max_block_ms=1000, **own)
        try:
            with pytest.raises(DeliveryError) as info:  # kafka-python: in send (no metadata); confluent: in flush
                producer.send("nowhere", b"k", b"v", headers={"h": b"1"})
                producer.flush(1.0)
            assert info.value.failed + info.value.pending == 1
            assert producer.pending == 0
        finally:
            producer.close(timeout_s=0.5)


def test_commit_writes_the_groups_offsets_for_lag_tools(kafka_client: str, broker: EmbeddedBroker,
                                                        unique_name: Callable[[str], str]) -> None:
    from kafka import KafkaConsumer, TopicPartition

    topic, group = unique_name("commit"), unique_name("g")
    ensure_topics(broker.bootstrap, {topic: 1})
    produce(kafka_client, broker.bootstrap, topic, [(i, b"v") for i in range(10)])
    reader = KafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=group, enable_auto_commit=False)

    def committed_becomes(expected: int) -> int | None:
        deadline = time.monotonic() + 10
        value = None
        while value != expected and time.monotonic() < deadline:
            consumer.poll_batch(timeout_s=0.1)  # confluent commits asynchronously: serve its answer
            value = reader.committed(TopicPartition(topic, 0))
        return value

    try:
        with open_consumer(kafka_client, broker.bootstrap, topic, group) as consumer:
            consume(consumer, 10)
            assert consumer.commit() is True  # after the last delivered record
            assert committed_becomes(10) == 10
            assert consumer.commit({(topic, 0): 4}) is True
            assert committed_becomes(4) == 4
    finally:
        reader.close()


# confluent only: with kafka-python the dev broker's handover sometimes does not settle within a minute (the
# second member stays without partitions; seen in 2 of about 8 suite runs), which would fail CI at random.
# kafka-python's resume at stored offsets in one group is covered by
# test_restart_in_same_group_resumes_from_the_callers_store.
@pytest.mark.parametrize("kafka_client", ["confluent"])
def test_rebalance_hands_partitions_over_at_the_stored_offsets(kafka_client: str, broker: EmbeddedBroker,
                                                               unique_name: Callable[[str], str]) -> None:
    """A second member takes a partition over and resumes where the first one's store says."""
    topic, group = unique_name("rebalance"), unique_name("g")
    ensure_topics(broker.bootstrap, {topic: 2})
    produce(kafka_client, broker.bootstrap, topic, [(i, b"old") for i in range(40)])
    store: dict[tuple[str, int], int] = {}  # shared by both members, as a worker's state would be
    revoked: list[list[tuple[str, int]]] = []
    seen: list[tuple[int, int]] = []

    def keep(records: list[Record]) -> None:
        for r in records:
            seen.append((r.partition, r.offset))
            store[(r.topic, r.partition)] = r.offset + 1

    with open_consumer(kafka_client, broker.bootstrap, topic, group, on_assign=lambda parts: store,
                       on_revoke=lambda parts: revoked.append(sorted(parts))) as first:
        keep(consume(first, 40))
        with open_consumer(kafka_client, broker.bootstrap, topic, group, on_assign=lambda parts: store) as second:
            deadline = time.monotonic() + 60

            def settled() -> bool:  # one partition each (for a while both can hold one: the first is late)
                mine, theirs = first.assignment(), second.assignment()
                return len(mine) == len(theirs) == 1 and mine | theirs == {(topic, 0), (topic, 1)}

            while not settled() and time.monotonic() < deadline:
                keep(first.poll_batch(timeout_s=0.2))
                keep(second.poll_batch(timeout_s=0.2))
            assert settled(), (first.assignment(), second.assignment())
            assert [(topic, 0), (topic, 1)] in revoked  # the first member gave both up to rebalance
            produce(kafka_client, broker.bootstrap, topic, [(i, b"new") for i in range(20)])
            deadline = time.monotonic() + 30
            while len(seen) < 60 and time.monotonic() < deadline:
                keep(first.poll_batch(timeout_s=0.2))
                keep(second.poll_batch(timeout_s=0.2))
    assert len(seen) == len(set(seen)) == 60  # every record once: nothing re-read after the hand-over


def test_assigned_paused_kafka_python_member_sleeps_then_polls_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A paused member that holds its assignment asks kafka-python's poll for no wait (which goes round
    without pause while a heartbeat is overdue) and sleeps instead; from a revocation to the next assignment
    it waits inside the poll, where kafka-python finishes a join."""
    import gnnstream.stream.kafka as kafka_backend
    calls: list[tuple[str, float]] = []
    events: list[str] = ["assign", "", "revoke", "", "assign"]  # what the group does inside each poll

    class FakeConsumer:
        def __init__(self, **config: object) -> None:
            self.listener = None

        def subscribe(self, topics: list[str], listener: object) -> None:
            self.listener = listener

        def poll(self, timeout_ms: int, max_records: int) -> dict:
            calls.append(("poll", timeout_ms))
            tps = [kafka_backend.TopicPartition("out", 0)]
            event = events.pop(0)
            if event == "assign":
                self.listener.on_partitions_assigned(tps)
            elif event == "revoke":
                self.listener.on_partitions_revoked(tps)
            return {}

        def seek_to_beginning(self, *tps: object) -> None:
            pass

        def pause(self, *tps: object) -> None:
            pass

    monkeypatch.setattr(kafka_backend, "KafkaConsumer", FakeConsumer)
    clock = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
    clock.sleep = lambda s: calls.append(("sleep", s))
    monkeypatch.setattr(kafka_backend, "time", clock)  # the backend's sleeps only, not every thread's
    member = kafka_backend.EventConsumer("127.0.0.1:9", "out", "g", paused=True)
    for _ in range(5):
        assert member.poll_batch(1, 0.2) == []
    assert calls == [("poll", 200), ("sleep", 0.2), ("poll", 0), ("sleep", 0.2), ("poll", 0), ("poll", 200),
                     ("poll", 200)]


# ---------------------------------------------------------------- confluent-kafka only


def test_confluent_settings_are_checked() -> None:
    from gnnstream.stream.confluent import ConfluentConsumer, ConfluentProducer, librdkafka_settings

    assert librdkafka_settings({"linger_ms": 1, "max_request_size": 2, "fetch.wait.max.ms": 3}) == {
        "linger.ms": 1, "message.max.bytes": 2, "fetch.wait.max.ms": 3}
    with pytest.raises(ValueError, match="invalid confluent-kafka producer settings.*no.such.setting"):
        ConfluentProducer("127.0.0.1:9", no_such_setting=1)
    with pytest.raises(ValueError, match="invalid confluent-kafka consumer settings"):
        ConfluentConsumer("127.0.0.1:9", "t", "g", fetch_max_wait_ms="soon")


def test_confluent_full_local_queue_waits_for_room(broker: EmbeddedBroker, unique_name: Callable[[str], str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from gnnstream.stream.confluent import ConfluentProducer

    waits = []
    wait = ConfluentProducer._send_when_room
    monkeypatch.setattr(ConfluentProducer, "_send_when_room",
                        lambda self, *args: (waits.append(1), wait(self, *args))[1])
    topic = unique_name("full")
    ensure_topics(broker.bootstrap, {topic: 1})
    with ConfluentProducer(broker.bootstrap, queue_buffering_max_messages=20) as producer:
        for i in range(1000):
            producer.send(topic, b"k", str(i).encode(), headers={"i": str(i).encode()} if i % 2 else None)
        assert producer.flush(20) == 1000
    assert waits  # the queue was full and send waited instead of losing records
    with open_consumer("confluent", broker.bootstrap, topic, unique_name("g")) as consumer:
        records = consume(consumer, 1000)
    assert [(r.offset, r.value) for r in records] == [(i, str(i).encode()) for i in range(1000)]
    assert [r.header("i") for r in records[:3]] == [None, b"1", None]


def test_confluent_full_local_queue_without_broker_fails_the_send() -> None:
    from gnnstream.stream.confluent import ConfluentProducer

    with closed_port() as port:
        producer = ConfluentProducer(f"127.0.0.1:{port}", queue_buffering_max_messages=3, max_block_ms=300)
        try:
            for i in range(3):
                producer.send("nowhere", b"k", b"v")
            with pytest.raises(DeliveryError, match="local queue still full") as info:
                producer.send("nowhere", b"k", b"v")
            assert info.value.failed == 1
            assert producer.pending == 3
            with pytest.raises(DeliveryError) as info:
                producer.flush(0.5)
            assert (info.value.failed, info.value.pending) == (0, 3)
        finally:
            producer.close(timeout_s=0.1)


def test_confluent_failing_assign_hook_holds_the_partitions(broker: EmbeddedBroker,
                                                            unique_name: Callable[[str], str]) -> None:
    """After a failed hook nothing is read from a position the caller did not choose; the next
    assignment, with a working hook, reads again."""
    from gnnstream.stream.confluent import ConfluentConsumer

    topic, group = unique_name("hold"), unique_name("g")
    ensure_topics(broker.bootstrap, {topic: 2})
    produce("confluent", broker.bootstrap, topic, [(i, f"v{i}".encode()) for i in range(20)])
    calls: list[list[tuple[str, int]]] = []

    def on_assign(partitions: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        calls.append(sorted(partitions))
        if len(calls) == 1:
            raise RuntimeError("store unavailable")
        return {}

    with ConfluentConsumer(broker.bootstrap, topic, group, on_assign=on_assign) as consumer:
        deadline = time.monotonic() + 20
        with pytest.raises(StreamError, match="store unavailable"):
            while time.monotonic() < deadline:
                consumer.poll_batch(timeout_s=0.5)
        assert consumer.assignment() == {(topic, 0), (topic, 1)}
        assert [consumer.poll_batch(timeout_s=0.3) for _ in range(3)] == [[], [], []]
        # a second member joins: the rebalance assigns again, and the hook works this time
        with ConfluentConsumer(broker.bootstrap, topic, group) as other:
            records: list[Record] = []
            deadline = time.monotonic() + 30
            while len(records) < 20 and time.monotonic() < deadline:
                records.extend(consumer.poll_batch(timeout_s=0.2))
                records.extend(other.poll_batch(timeout_s=0.2))
            mine = consumer.assignment()
    assert len(calls) == 2 and len(mine) == 1  # one partition each after the rebalance
    assert sorted(r.value for r in records) == sorted(f"v{i}".encode() for i in range(20))
    assert {r.partition for r in records if (r.topic, r.partition) in mine} == {p for _, p in mine}


def test_confluent_close_is_bounded_when_the_broker_stalls(private_broker: EmbeddedBroker,
                                                           unique_name: Callable[[str], str],
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """librdkafka would wait minutes for a commit in flight to a stalled broker."""
    from gnnstream.stream.confluent import ConfluentConsumer

    topic = unique_name("stallclose")
    ensure_topics(private_broker.bootstrap, {topic: 1})
    produce("confluent", private_broker.bootstrap, topic, [(0, b"v")])
    consumer = ConfluentConsumer(private_broker.bootstrap, topic, unique_name("g"), close_timeout_s=1.0)
    consume(consumer, 1)
    private_broker.pause()
    try:
        assert consumer.commit() is True  # queued; its answer never comes
        with caplog.at_level(logging.WARNING, logger="gnnstream.stream.confluent"):
            assert _in_thread(consumer.close) is None  # returns: librdkafka's close goes on in the background
        assert any("did not leave its group within 1.0s" in r.getMessage() for r in caplog.records), caplog.text
        consumer.close()
        with pytest.raises(StreamError, match="closed"):
            consumer.lag()
    finally:
        private_broker.resume()
