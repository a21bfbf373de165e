"""The one rule for Kafka errors (stream.errors): each client's errors sorted into kinds, repeats limited."""

from __future__ import annotations

import logging

import kafka.errors as kp
import pytest
from confluent_kafka import KafkaError, KafkaException

from gnnstream.stream.errors import PERMANENT_KINDS, Limited, backoff_s, classify, retrying
from gnnstream.stream.exceptions import DeliveryError


def _rd(code: int) -> KafkaException:
    return KafkaException(KafkaError(code))


PERMANENT = [  # (kind, confluent-kafka's error, kafka-python's)
    ("record_too_large", _rd(KafkaError.MSG_SIZE_TOO_LARGE), kp.MessageSizeTooLargeError("m")),
    ("record_too_large", _rd(KafkaError.RECORD_LIST_TOO_LARGE), kp.RecordListTooLargeError("m")),
    ("unknown_topic", _rd(KafkaError.UNKNOWN_TOPIC_OR_PART), kp.UnknownTopicOrPartitionError("m")),
    ("unknown_topic", _rd(KafkaError._UNKNOWN_TOPIC), kp.InvalidTopicError("m")),
    ("not_authorised", _rd(KafkaError.TOPIC_AUTHORIZATION_FAILED), kp.TopicAuthorizationFailedError("m")),
    ("invalid_record", _rd(KafkaError.INVALID_RECORD), kp.CorruptRecordError("m")),
    ("serialisation", _rd(KafkaError._VALUE_SERIALIZATION), TypeError("not bytes")),
]
TRANSIENT = [
    ("broker_unavailable", _rd(KafkaError._TRANSPORT), kp.KafkaConnectionError("refused")),
    ("broker_unavailable", _rd(KafkaError._ALL_BROKERS_DOWN), kp.KafkaConnectionError("m")),
    ("timeout", _rd(KafkaError._MSG_TIMED_OUT), kp.KafkaTimeoutError("m")),
    ("timeout", _rd(KafkaError.REQUEST_TIMED_OUT), kp.RequestTimedOutError("m")),
    ("leader_change", _rd(KafkaError.NOT_LEADER_FOR_PARTITION), kp.NotLeaderForPartitionError("m")),
    ("leader_change", _rd(KafkaError.LEADER_NOT_AVAILABLE), kp.LeaderNotAvailableError("m")),
    ("queue_full", _rd(KafkaError._QUEUE_FULL), BufferError("full")),
]


@pytest.mark.parametrize("kind, confluent, kafka_python", PERMANENT)
def test_permanent_errors_of_both_clients(kind: str, confluent: BaseException, kafka_python: BaseException) -> None:
    assert kind in PERMANENT_KINDS
    for error in (confluent, kafka_python, DeliveryError("flush failed", failed=1, cause=confluent),
                  DeliveryError("flush failed", failed=1, cause=kafka_python)):
        assert classify(error) == (kind, True), error


@pytest.mark.parametrize("kind, confluent, kafka_python", TRANSIENT)
def test_transient_errors_of_both_clients(kind: str, confluent: BaseException, kafka_python: BaseException) -> None:
    for error in (confluent, kafka_python, DeliveryError("flush failed", cause=kafka_python)):
        assert classify(error) == (kind, False), error


def test_a_kind_named_by_another_process_wins_and_unknown_errors_are_retried() -> None:
    assert classify(DeliveryError("from the delivery process", kind="unknown_topic")) == ("unknown_topic", True)
    assert classify(DeliveryError("no answer", pending=3)) == ("timeout", False)
    assert classify(RuntimeError("something else")) == ("kafka", False)
    assert classify(_rd(KafkaError.UNKNOWN)) == ("kafka", False)


def test_backoff_doubles_to_a_cap() -> None:
    assert [backoff_s(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]


def test_repeats_are_logged_once_then_counted_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    limited = Limited(logging.getLogger("t.limited"), clock=lambda: now[0])
    with caplog.at_level(logging.DEBUG, logger="t.limited"):
        for second in range(0, 130):
            now[0] = float(second)
            limited.warning("k", "broker gone: %s", "x")
        limited.warning("other", "another kind")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["broker gone: x", "broker gone: x [repeated 59 times in the last 60 s]",
                        "broker gone: x [repeated 59 times in the last 60 s]", "another kind"]
    limited.forget("k")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="t.limited"):
        limited.warning("k", "back again")
    assert [r.getMessage() for r in caplog.records] == ["back again"]


def test_retrying_retries_transient_errors_and_not_permanent_ones() -> None:
    calls: list[int] = []
    pauses: list[float] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise DeliveryError("down", cause=kp.KafkaConnectionError("m"))
        return "sent"

    assert retrying(flaky, "test", sleep=pauses.append) == "sent"
    assert pauses == [0.5, 1.0]

    def refused() -> None:
        calls.append(1)
        raise DeliveryError("refused", cause=kp.TopicAuthorizationFailedError("m"))

    calls.clear()
    with pytest.raises(DeliveryError, match="refused"):
        retrying(refused, "test", sleep=pauses.append)
    assert len(calls) == 1
