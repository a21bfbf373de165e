"""Kafka client backends by name: kafka-python or confluent-kafka (librdkafka).

Both implement :class:`gnnstream.stream.clients.ConsumerClient` and
:class:`gnnstream.stream.clients.ProducerClient` with the same semantics; the backend
module is imported only when it is asked for, so choosing ``kafka-python``
never loads librdkafka and the other way round::

    consumer = open_consumer("confluent", bootstrap, "graph-events", "gnnstream",
                             on_assign=stored_offsets)
    producer = open_producer("confluent", bootstrap)

Keyword arguments are passed to the backend's class
(:class:`gnnstream.stream.kafka.EventConsumer` / :class:`gnnstream.stream.kafka.Producer`, or
:class:`gnnstream.stream.confluent.ConfluentConsumer` /
:class:`gnnstream.stream.confluent.ConfluentProducer`). The named ones (``on_assign``,
``on_revoke``, ``session_timeout_ms``, ``heartbeat_interval_ms``,
``auto_offset_reset``, ``linger_ms``, ``batch_size``, ``max_block_ms``,
``max_message_bytes``) mean the same in both; other settings are the backend's own.
"""

from __future__ import annotations

import importlib
import time
from typing import Any, Sequence

from gnnstream.stream.clients import ConsumerClient, ProducerClient, Record

__all__ = ["KAFKA_CLIENTS", "DEFAULT_KAFKA_CLIENT", "open_consumer", "open_producer", "read_to_end"]

KAFKA_CLIENTS = ("kafka-python", "confluent")
"""The backend names, in the order ``--kafka-client`` lists them."""

DEFAULT_KAFKA_CLIENT = "confluent"
"""The client every command uses unless told otherwise: librdkafka does its network I/O on threads of its
own, outside the interpreter's lock (docs/benchmarks.md has the measurements)."""

_CLASSES = {
    "kafka-python": ("gnnstream.stream.kafka", "EventConsumer", "Producer"),
    "confluent": ("gnnstream.stream.confluent", "ConfluentConsumer", "ConfluentProducer"),
}


def _backend(client: str) -> tuple[Any, str, str]:
    try:
        module, consumer, producer = _CLASSES[client]
    except (KeyError, TypeError):
        raise ValueError(f"Expected a Kafka client among {', '.join(KAFKA_CLIENTS)} (got {client!r})") from None
    return importlib.import_module(module), consumer, producer


def open_consumer(client: str, bootstrap: str, topic: str | Sequence[str], group_id: str,
                  **kw: Any) -> ConsumerClient:
    """A consumer-group member of the named backend.

    Args:
        client: one of :data:`KAFKA_CLIENTS`.
        bootstrap: ``host:port[,host:port...]``.
        topic: a topic name or several.
        group_id: the consumer group.
        **kw: the backend consumer's other arguments.

    Raises:
        ValueError: an unknown backend name (or a setting it refuses).
    """
    module, consumer, _ = _backend(client)
    return getattr(module, consumer)(bootstrap, topic, group_id, **kw)


def open_producer(client: str, bootstrap: str, **kw: Any) -> ProducerClient:
    """A producer of the named backend.

    Args:
        client: one of :data:`KAFKA_CLIENTS`.
        bootstrap: ``host:port[,host:port...]``.
        **kw: the backend producer's other arguments.

    Raises:
        ValueError: an unknown backend name (or a setting it refuses).
    """
    module, _, producer = _backend(client)
    return getattr(module, producer)(bootstrap, **kw)



def read_to_end(client: str, bootstrap: str, topic: str, *, timeout_s: float = 30.0) -> list[Record]:
    """Every record of ``topic``, each partition's in order, up to where the partitions end by the time it
    gets there: every partition assigned at once, no group to join.

    Raises:
        NoPartitionsError: the topic does not exist.
        TimeoutError: the end was not reached within ``timeout_s``.
    """
    consumer = open_consumer(client, bootstrap, topic, f"gnnstream-reader-{topic}", assign_all=True)
    out: list[Record] = []
    deadline = time.monotonic() + timeout_s
    try:
        assigned = consumer.assignment()
        while True:
            out.extend(consumer.poll_batch(10_000, 0.3))
            lag = consumer.lag()  # only partitions a fetch has answered for: every one must be there
            if lag.keys() >= assigned and not any(lag.values()):
                return out
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read topic {topic!r} to its end within {timeout_s:g} s")
    finally:
        consumer.close()
