"""The Kafka clients' own log lines while a broker cannot be reached: bounded, on time, distinct ones kept.

librdkafka (and kafka-python) report every failed reconnect; without a rate
limit an outage of any length floods stderr, and librdkafka's lines waited in
an idle producer's queue to come out all at once at its close.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

import pytest
from confluent_kafka import KafkaError

import gnnstream.stream.confluent as confluent
import gnnstream.stream.librdkafka_logs as librdkafka_logs
import gnnstream.stream.kafka as kafka_module
from tests.support import closed_port

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

DEADLINE_S = 60.0  # safety net of the waits on the real client, never what a test measures


def _refused(port: int, i: int = 0) -> str:
    """A librdkafka log text as its FAIL line has it (what varies between repeats included)."""
    suppressed = f", {i} identical error(s) suppressed" if i else ""
    return (f"[thrd:127.0.0.1:{port}/bootstrap]: 127.0.0.1:{port}/bootstrap: Connect to ipv4#127.0.0.1:{port} "
            f"failed: Connection refused (after {i % 5}ms in state CONNECT{suppressed})")


def _shown(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    """The messages above DEBUG of logger ``name`` and its children."""
    return [r.getMessage() for r in caplog.records
            if r.levelno > logging.DEBUG and (r.name == name or r.name.startswith(name + "."))]


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    """A fresh librdkafka rate limit on a clock the test moves."""
    fake = _Clock()
    monkeypatch.setattr(librdkafka_logs, "_repeats", librdkafka_logs._Repeats(librdkafka_logs.logger, clock=fake))
    return fake


def test_identical_librdkafka_messages_are_logged_once_then_summarised(clock: _Clock,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="gnnstream.stream.confluent")
    log, port = librdkafka_logs.librdkafka_log, 40001  # log texts only: nothing connects to it
    for i in range(1000):  # each refused reconnect: a log line and an error, with the same text
        log.log(logging.ERROR, "%s [%s] %s", "FAIL", "gnnstream-producer#producer-1", _refused(port, i))
        librdkafka_logs.librdkafka_error(KafkaError(KafkaError._TRANSPORT, _refused(port, i).split("]: ", 1)[1]))
        clock.now += 0.05
    shown = _shown(caplog, "gnnstream.stream.confluent")
    assert len(shown) == 1 and "Connection refused" in shown[0] and "thrd:" not in shown[0], shown
    repeats = [r for r in caplog.records if r.levelno == logging.DEBUG and "Connection refused" in r.getMessage()]
    assert len(repeats) == 1999  # every repeat still goes to DEBUG

    clock.now += 11  # 61 s after the first line: the next check logs how many were held back
    librdkafka_logs._repeats.expire()
    shown = _shown(caplog, "gnnstream.stream.confluent")
    assert len(shown) == 2 and shown[1].endswith("[repeated 999 times in the last 61 s]"), shown
    assert caplog.records[-1].levelno == logging.ERROR

    clock.now += 61  # a quiet minute: nothing to summarise, and the next failure is a first again
    librdkafka_logs._repeats.expire()
    log.log(logging.ERROR, "%s [%s] %s", "FAIL", "gnnstream-producer#producer-2", _refused(port))
    shown = _shown(caplog, "gnnstream.stream.confluent")
    assert len(shown) == 3 and "repeated" not in shown[2] and "producer-2" in shown[2], shown


def test_a_distinct_librdkafka_message_still_gets_through(clock: _Clock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gnnstream.stream.confluent")
    log, port, other = librdkafka_logs.librdkafka_log, 40001, 40002  # log texts only: nothing connects to them
    for i in range(200):
        log.log(logging.ERROR, "%s [%s] %s", "FAIL", "c#producer-1", _refused(port, i))
        clock.now += 0.1
    log.log(logging.ERROR, "%s [%s] %s", "FAIL", "c#producer-1",
            "[thrd:sasl_ssl://k:9093/1]: sasl_ssl://k:9093/1: SASL authentication error: Authentication failed "
            "during authentication due to invalid credentials with SASL mechanism PLAIN (after 312ms in state "
            "AUTH_REQ)")
    librdkafka_logs.librdkafka_error(KafkaError(KafkaError._UNKNOWN_TOPIC, "Subscribed topic not available: t: Broker: "
                                    "Unknown topic or partition"))
    log.log(logging.ERROR, "%s [%s] %s", "FAIL", "c#producer-1", _refused(other))  # another broker
    for i in range(200):
        log.log(logging.ERROR, "%s [%s] %s", "FAIL", "c#producer-1", _refused(port, i))
    fatal = KafkaError(KafkaError._FENCED, "Producer fenced by newer instance", fatal=True)
    librdkafka_logs.librdkafka_error(fatal)
    librdkafka_logs.librdkafka_error(fatal)  # fatal errors are never held back
    shown = _shown(caplog, "gnnstream.stream.confluent")
    assert len(shown) == 6, shown
    assert f"127.0.0.1:{port} failed" in shown[0]
    assert "SASL authentication error" in shown[1]
    assert "Unknown topic or partition" in shown[2]
    assert f"127.0.0.1:{other} failed" in shown[3]
    assert shown[4] == shown[5] and "fenced" in shown[4]


def test_an_idle_producer_logs_a_refused_broker_at_once_and_once(caplog: pytest.LogCaptureFixture) -> None:
    """The real client against a closed port, reconnecting every few milliseconds: its first failure is
    logged while the producer sits idle (not when it is closed), and its many repeats only at DEBUG."""
    caplog.set_level(logging.DEBUG, logger="gnnstream.stream.confluent")

    def repeats() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.levelno == logging.DEBUG and f":{port} failed" in r.getMessage()]

    with closed_port() as port:
        producer = confluent.ConfluentProducer(f"127.0.0.1:{port}", reconnect_backoff_ms=10,
                                               reconnect_backoff_max_ms=20)
        try:
            # the first failure shows while the producer sits idle; then wait for reconnects to repeat it
            deadline = time.monotonic() + DEADLINE_S
            while not any(f":{port} failed" in m for m in _shown(caplog, "gnnstream.stream")):
                assert time.monotonic() < deadline, "no refused connection was logged"
                time.sleep(0.05)
            seen_idle = _shown(caplog, "gnnstream.stream")
            while len(repeats()) < 5:
                assert time.monotonic() < deadline, f"only {len(repeats())} repeats of the refused connection"
                time.sleep(0.05)
        finally:
            producer.close(timeout_s=0.1)
    assert any(f":{port} failed: Connection refused" in m for m in seen_idle), seen_idle
    shown = [m for m in _shown(caplog, "gnnstream.stream.confluent") if str(port) in m]
    assert len(shown) == 1, shown  # five repeats and more, one line above DEBUG


def test_kafka_python_connection_failures_are_bounded(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="kafka")
    node = f"bootstrap-{uuid.uuid4().hex[:8]}"
    manager = logging.getLogger("kafka.net.manager")
    for i in range(300):
        manager.warning("Bootstrap connection to %s failed: %s (backoff %.2f secs)", node,
                        "KafkaConnectionError: 111 ECONNREFUSED", 0.05 * (i % 40))
        manager.warning("Bootstrap %s not ready; waiting %.2f secs", node, 0.05 * (i % 40))
    manager.error("Bootstrap failed: %s", f"KafkaTimeoutError: Unable to bootstrap from {node}")
    shown = [m for m in _shown(caplog, "kafka") if node in m]
    assert len(shown) == 3, shown
    assert "failed: KafkaConnectionError" in shown[0] and "not ready" in shown[1] and "Unable to" in shown[2]
    assert len([r for r in caplog.records if r.levelno == logging.DEBUG and node in r.getMessage()]) == 598

    later = time.monotonic() + 61  # a minute on: the next one says how many were held back
    monkeypatch.setattr(kafka_module._repeats, "clock", lambda: later)
    manager.warning("Bootstrap connection to %s failed: %s (backoff %.2f secs)", node,
                    "KafkaConnectionError: 111 ECONNREFUSED", 1.0)
    last = [m for m in _shown(caplog, "kafka") if node in m][-1]
    assert re.search(r"\(backoff 1\.00 secs\) \[repeated 299 times in the last 6\d s\]$", last), last
