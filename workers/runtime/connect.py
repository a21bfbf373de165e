"""Reaching Kafka at start (the topics created, waiting for the broker; the consumers opened), and the checks of
what the topics allow.

A broker that is not up yet is waited for, for ever unless ``broker_wait_s``
is set; each wait is paced by capped backoff and logged at the first failure,
then once a minute. While Kafka is away after that, opening a consumer is
retried like any transient error (:class:`gnnstream.workers.runtime.health.Errors`).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable

from gnnstream.stream.backends import open_consumer
from gnnstream.stream.clients import ConsumerClient, PartitionKey
from gnnstream.stream.deadletter import RECORD_OVERHEAD
from gnnstream.stream.delivery import WORKER_HEADER
from gnnstream.stream.exceptions import NoPartitionsError, StreamError, TopicSetupError
from gnnstream.stream.kafka import ensure_topics
from gnnstream.stream.updates import largest_update_bytes
from gnnstream.workers.runtime.health import Errors
from gnnstream.workers.settings import WorkerSettings

if TYPE_CHECKING:
    from gnnstream.workers.engine import Engine

__all__ = ["probe", "wait_for_kafka", "open_consumers", "partition_count", "check_fits", "check_partitions"]

logger = logging.getLogger(__name__)

_BACKOFF_FIRST_S = 0.5  # waits between attempts to reach Kafka at start: 0.5, 1, 2, 4, 5, 5 ... s
_BACKOFF_MAX_S = 5.0
_SETUP_TIMEOUT_S = 10.0  # one topic-setup attempt against a broker that accepts connections
_PROBE_TIMEOUT_S = 2.0
_WAIT_LOG_EVERY_S = 60.0  # while waiting for Kafka, a warning at the first failure and then this often


def probe(bootstrap: str, timeout_s: float = _PROBE_TIMEOUT_S) -> None:
    """Raise :class:`TopicSetupError` unless some bootstrap address accepts a TCP connection.

    Cheaper and quieter than a Kafka client, whose own bootstrap backs off
    for seconds and logs every refused connection.
    """
    errors = []
    for address in (a.strip() for a in bootstrap.split(",") if a.strip()):
        host, sep, port = address.rpartition(":")
        if not sep:
            host, port = address, "9092"
        try:
            with socket.create_connection((host.strip("[]") or "localhost", int(port)), timeout=timeout_s):
                return
        except (OSError, ValueError) as exc:
            errors.append(f"{address}: {getattr(exc, 'strerror', None) or exc}")
    raise TopicSetupError(f"cannot reach Kafka at {bootstrap} ({'; '.join(errors) or 'no address'}); "
                          "is the broker running and is --bootstrap right?")


def wait_for_kafka(s: WorkerSettings, topics: dict[str, int], errors: Errors, stop: threading.Event) -> bool:
    """Create ``topics`` (``{name: partitions}``), waiting for the broker with capped backoff; False if stopped
    meanwhile.

    Raises:
        TopicSetupError: not reachable within ``broker_wait_s`` (when not 0).
    """
    health = errors.health
    t0 = time.monotonic()
    delay = _BACKOFF_FIRST_S
    last_warning = None
    while not stop.is_set():
        health.kafka_attempts += 1
        try:
            probe(s.bootstrap)
            ensure_topics(s.bootstrap, topics, timeout_s=_SETUP_TIMEOUT_S)
        except TopicSetupError as exc:
            waited = time.monotonic() - t0
            errors.metrics.errors.labels("kafka_setup").inc()
            errors.set("kafka_setup", f"kafka_setup: {exc}")
            if s.broker_wait_s and waited >= s.broker_wait_s:
                raise TopicSetupError(f"gave up after {waited:.0f} s (--broker-wait-s {s.broker_wait_s:g}): "
                                      f"{exc}") from exc
            if last_warning is None or time.monotonic() - last_warning >= _WAIT_LOG_EVERY_S:
                last_warning = time.monotonic()
                logger.warning("waiting for Kafka (%.0f s so far, retrying every %g s at most): %s",
                               waited, _BACKOFF_MAX_S, exc)
            pause = delay if not s.broker_wait_s else max(0.0, min(delay, s.broker_wait_s - waited))
            stop.wait(pause)
            delay = min(2 * delay, _BACKOFF_MAX_S)
            continue
        if health.kafka_attempts > 1:
            logger.warning("Kafka at %s is reachable after %.0f s", s.bootstrap, time.monotonic() - t0)
        errors.cleared("kafka_setup")
        return True
    return False


def open_consumers(s: WorkerSettings, worker_id: str,
                   on_assign: Callable[[Iterable[PartitionKey]], dict[PartitionKey, int]], errors: Errors,
                   stop: threading.Event) -> tuple[ConsumerClient, ConsumerClient] | None:
    """``(events, dead letters)``: consumers of every partition of the events topic (starting at the offsets
    ``on_assign`` returns) and of the dead-letter topic, retrying while Kafka is unavailable; None if stopped
    meanwhile. Offsets are committed, for lag tools only, under the group ``<group>.<worker id>``."""
    while not stop.is_set():
        try:
            consumer = open_consumer(s.kafka_client, s.bootstrap, s.events_topic, f"{s.group}.{worker_id}",
                                     session_timeout_ms=s.session_timeout_ms, on_assign=on_assign, assign_all=True)
        except NoPartitionsError as exc:  # metadata late: retry
            errors.recoverable("consumer", exc)
            continue
        except StreamError:
            raise
        except Exception as exc:  # Kafka went away again: retry
            errors.recoverable("consumer", exc)
            continue
        try:  # what the group wrote to the dead-letter topic (docs/scaling.md)
            reader = open_consumer(s.kafka_client, s.bootstrap, s.dlq_topic, f"{s.group}.{worker_id}.dead-letters",
                                   assign_all=True)
        except Exception as exc:
            consumer.close()
            errors.recoverable("consumer", exc)
            continue
        errors.cleared("consumer")
        return consumer, reader
    return None


def partition_count(consumer: ConsumerClient, topic: str, errors: Errors, stop: threading.Event) -> int:
    """How many partitions ``topic`` has (retrying while Kafka does not say); 0 if stopped meanwhile."""
    while not stop.is_set():
        try:
            return len(consumer.partitions_of(topic))
        except Exception as exc:  # metadata late, Kafka away: retry
            errors.recoverable("consumer", exc)
    return 0


def check_fits(engine: Engine, s: WorkerSettings, worker_id: str, limit: int, what: str) -> None:
    """Refuse to start when an embedding update of the engine's model could exceed ``limit`` bytes (``what``
    sets the limit).

    Raises:
        StreamError: it could.
    """
    size = largest_update_bytes(engine.model.config.out_dim, engine.model_tag, s.output_format)
    headers = len(WORKER_HEADER) + len(worker_id.encode()) + 256  # worker, serving version, marker
    if size + headers + RECORD_OVERHEAD > limit:
        raise StreamError(f"an embedding update of model {engine.model_tag} ({engine.model.config.out_dim} "
                          f"values, --output-format {s.output_format}) may take {size + headers} bytes, more "
                          f"than the {limit} that {what} allows: raise it to at least "
                          f"{size + headers + RECORD_OVERHEAD}" + (" or use --output-format binary"
                                                                  if s.output_format == "json" else ""))


def check_partitions(consumer: ConsumerClient, topic: str) -> None:
    """Stop, with the reason, when the events ``topic`` gained partitions: a worker reads those it found when it
    started (a restart reads them all, new ones from their start).

    Raises:
        StreamError: it did.
    """
    try:
        found = consumer.partitions_of(topic, timeout_s=2.0)
    except StreamError:  # metadata late: the next check
        return
    reading = {p for t, p in consumer.assignment() if t == topic}
    if found - reading:
        raise StreamError(f"topic {topic!r} has {len(found)} partitions now, this worker reads {len(reading)}: "
                          f"restart it to read partitions {sorted(found - reading)} too")
