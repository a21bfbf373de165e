"""stream: Kafka I/O, the event schema, codecs, dead letters, embedded dev broker.

Modules:
    events: the graph-event schema and its strict decoder.
    updates: the embedding-update codec (JSON and binary) and tombstones.
    clients: :class:`Record` and the consumer/producer interfaces (no Kafka library).
    kafka: their kafka-python implementation: :class:`EventConsumer`,
        :class:`Producer`, and :func:`ensure_topics`.
    deadletter: dead-letter records, headers and writer.
    broker: :class:`EmbeddedBroker`, a Tansu broker for development and tests.
    exceptions: the errors of this package.

Names are imported lazily, so ``import stream.events`` does not load
kafka-python or numpy.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "gnnstream.stream.events": ["EdgeUpsert", "EdgeDelete", "NodeUpsert", "NodeDelete", "Event", "InvalidEvent",
                      "INVALID_EVENT_REASONS", "MAX_EVENT_BYTES", "decode_event", "decode_event_json",
                      "encode_event", "event_key"],
    "gnnstream.stream.updates": ["EmbeddingUpdate", "encode_update", "decode_update", "update_key", "tombstone",
                       "is_tombstone"],
    "gnnstream.stream.clients": ["Record", "ConsumerClient", "ProducerClient"],
    "gnnstream.stream.kafka": ["EventConsumer", "Producer", "ensure_topics"],
    "gnnstream.stream.deadletter": ["DeadLetter", "DeadLetterWriter", "dead_letter_headers"],
    "gnnstream.stream.broker": ["EmbeddedBroker", "run_broker_foreground"],
    "gnnstream.stream.exceptions": ["StreamError", "BrokerError", "BrokerBinaryNotFound", "BrokerPortInUse",
                          "TopicSetupError", "DeliveryError", "InvalidUpdate"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'stream' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
