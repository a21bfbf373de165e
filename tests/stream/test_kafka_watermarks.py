"""``EventConsumer.high_watermarks``: the end of each assigned partition as the last fetch reported it.

The worker compares these ends with its stored offsets to notice a topic reset, so they must be known
even when the consumer was told to read past the end (the embedded broker answers such a fetch with no
records and the true end).
"""

from __future__ import annotations

import time
from typing import Callable

import pytest

from gnnstream.stream.broker import EmbeddedBroker
from gnnstream.stream.kafka import EventConsumer, ensure_topics

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _produce(bootstrap: str, topic: str, partition: int, n: int) -> None:
    from kafka import KafkaProducer
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", client_id="test-producer")
    try:
        for i in range(n):
            producer.send(topic, key=b"k%d" % i, value=b"v%d" % i, partition=partition)
        producer.flush(60)
    finally:
        producer.close(5)


def _poll_until(consumer: EventConsumer, records: list, done: Callable[[], bool], what: str,
                timeout_s: float = 90.0) -> None:
    """Poll (appending to ``records``) until ``done()``; the deadline is only a safety net."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}; high watermarks {consumer.high_watermarks()}")
        records += consumer.poll_batch(100, 0.5)


@pytest.mark.broker
@pytest.mark.parametrize("start", ["stored", "past_end"])
def test_high_watermarks_of_assigned_partitions(broker: EmbeddedBroker, unique_name: Callable[[str], str],
                                                start: str) -> None:
    topic = unique_name("hw")
    ensure_topics(broker.bootstrap, {topic: 2})
    _produce(broker.bootstrap, topic, 0, 3)
    seek = {(topic, 0): 1} if start == "stored" else {(topic, 0): 100, (topic, 1): 50}
    consumer = EventConsumer(broker.bootstrap, topic, unique_name("g"), on_assign=lambda parts: seek)
    try:
        assert consumer.high_watermarks() == {}, "nothing is known before the first fetch"
        records: list = []
        _poll_until(consumer, records, lambda: len(consumer.high_watermarks()) == 2, "both ends")
        assert consumer.high_watermarks() == {(topic, 0): 3, (topic, 1): 0}
        if start == "stored":
            _poll_until(consumer, records, lambda: len(records) >= 2, "the records after the stored offset")
            assert [(r.partition, r.offset) for r in records] == [(0, 1), (0, 2)]
        else:
            assert records == [], "a position past the end delivers nothing"
        _produce(broker.bootstrap, topic, 1, 2)
        _poll_until(consumer, records, lambda: consumer.high_watermarks().get((topic, 1)) == 2,
                    "the new end of partition 1")
        if start == "past_end":
            assert records == [], "still past the end of both partitions"
        assert consumer.high_watermarks() == {(topic, 0): 3, (topic, 1): 2}
    finally:
        consumer.close()
