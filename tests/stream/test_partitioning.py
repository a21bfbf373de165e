"""Kafka's default partitioner: our murmur2 against Java's published values, kafka-python's, and where both
clients really put keyed messages on the broker."""

from __future__ import annotations

import os
import random

import pytest
from kafka.partitioner.default import murmur2 as kafka_python_murmur2

from gnnstream.stream.backends import KAFKA_CLIENTS, open_producer
from gnnstream.stream.kafka import ensure_topics
from gnnstream.stream.partitioning import murmur2, partition_for, partitions_for

# Utils.murmur2 in the Java client, as signed ints (its own unit test's values)
JAVA = {b"21": -973932308, b"foobar": -790332482, b"a-little-bit-long-string": -985981536,
        b"a-little-bit-longer-string": -1486304829, b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
        b"abc": 479470107}


def test_murmur2_matches_the_java_client() -> None:
    for key, signed in JAVA.items():
        assert murmur2(key) == signed % 2**32, key


def test_murmur2_matches_kafka_python_on_random_keys() -> None:
    rng = random.Random(5)
    for _ in range(2000):
        key = os.urandom(rng.randrange(0, 40))
        assert murmur2(key) == kafka_python_murmur2(key) % 2**32, key


def test_partition_for() -> None:
    assert partition_for(b"21", 6) == (JAVA[b"21"] & 0x7FFFFFFF) % 6
    assert partitions_for(["21", "abc"], 7).tolist() == [partition_for(b"21", 7), partition_for(b"abc", 7)]
    with pytest.raises(ValueError):
        partition_for(b"x", 0)


@pytest.mark.broker
@pytest.mark.parametrize("client", KAFKA_CLIENTS)
def test_both_clients_place_keyed_messages_where_partition_for_says(client: str, broker, unique_name) -> None:
    """The worker finds a node's owner by partition_for: each client must send the node's messages there."""
    from kafka import KafkaConsumer, TopicPartition
    topic = unique_name("parts")
    ensure_topics(broker.bootstrap, {topic: 5})
    keys = [f"node-{i}".encode() for i in range(200)]
    with open_producer(client, broker.bootstrap) as producer:
        for key in keys:
            producer.send(topic, key, b"v")
        producer.flush(30)
    consumer = KafkaConsumer(bootstrap_servers=broker.bootstrap, enable_auto_commit=False, group_id=None,
                             auto_offset_reset="earliest")
    tps = [TopicPartition(topic, p) for p in range(5)]
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)
    placed: dict[bytes, int] = {}
    try:
        for _ in range(100):
            for tp, msgs in consumer.poll(timeout_ms=300).items():
                placed.update({m.key: tp.partition for m in msgs})
            if len(placed) == len(keys):
                break
    finally:
        consumer.close()
    assert placed == {key: partition_for(key, 5) for key in keys}
