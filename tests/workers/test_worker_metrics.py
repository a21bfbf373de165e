"""The worker's HTTP endpoint, health states and error bookkeeping, without Kafka.

* the endpoint binds 127.0.0.1 unless ``--metrics-host`` / ``GNNSTREAM_METRICS_HOST`` says otherwise
  (docker-compose.yml sets 0.0.0.0);
* a connection that sends nothing is closed by the server (no thread held for ever);
* ``/healthz`` is 503 with a ``reason`` until the worker consumes, 200 after;
* ``last_error`` clears once the failing operation works again;
* a stored offset past its partition's end stops the worker before anything of the poll is applied,
  or moves the partition per ``on_offset_reset``.
"""

from __future__ import annotations

import argparse
import json
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Mapping

import pytest
import yaml

from stream.clients import ConsumerClient, PartitionKey, Record
from stream.exceptions import DeliveryError
from workers.metrics import MetricsServer, WorkerMetrics
from workers.settings import WorkerSettings, add_worker_arguments, settings_from_args
from workers.worker import OffsetResetError, Worker

ROOT = Path(__file__).resolve().parents[2]


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


# ---------------------------------------------------------------------- the endpoint
def test_metrics_host_defaults_to_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GNNSTREAM_METRICS_HOST", raising=False)
    assert WorkerSettings().metrics_host == "127.0.0.1"
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    assert settings_from_args(parser.parse_args([])).metrics_host == "127.0.0.1"
    assert settings_from_args(parser.parse_args(["--metrics-host", "0.0.0.0"])).metrics_host == "0.0.0.0"
    monkeypatch.setenv("GNNSTREAM_METRICS_HOST", "::1")
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    assert settings_from_args(parser.parse_args([])).metrics_host == "::1"

    server = MetricsServer(WorkerMetrics(), 0, lambda: {"ok": True})
    try:
        assert server.httpd.server_address[0] == "127.0.0.1"
        assert _get(server.port, "/healthz")[0] == 200
    finally:
        server.close()
    # the container has to listen on every interface for Prometheus to reach it
    env = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["gnnstream"]["environment"]
    assert env["GNNSTREAM_METRICS_HOST"] == "0.0.0.0"


def test_idle_connection_is_closed_by_the_server() -> None:
    server = MetricsServer(WorkerMetrics(), 0, lambda: {"ok": True}, request_timeout_s=0.5)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as idle:
            # sends nothing: the server must hang up (recv returns b"" at EOF); the 60 s socket
            # timeout is only a safety net that turns a hang into a failure
            try:
                data = idle.recv(1024)
            except socket.timeout:
                pytest.fail("the metrics server kept an idle connection open for 60 s")
            assert data == b""
        # and it still serves requests afterwards
        status, body = _get(server.port, "/metrics")
        assert status == 200 and b"gnnstream_errors" in body
    finally:
        server.close()


def test_default_request_timeout_is_set() -> None:
    server = MetricsServer(WorkerMetrics(), 0, lambda: {"ok": True})
    try:
        assert server.httpd.RequestHandlerClass.timeout == 5.0
    finally:
        server.close()


def test_port_in_use_is_one_line() -> None:
    first = MetricsServer(WorkerMetrics(), 0, lambda: {"ok": True})
    try:
        with pytest.raises(OSError) as info:
            MetricsServer(WorkerMetrics(), first.port, lambda: {"ok": True})
        text = str(info.value)
        assert "\n" not in text and f"127.0.0.1:{first.port}" in text and "--metrics-port" in text
    finally:
        first.close()


def test_health_callback_failure_is_a_503_with_reason() -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("boom")

    server = MetricsServer(WorkerMetrics(), 0, broken)
    try:
        status, body = _get(server.port, "/healthz")
        assert status == 503
        assert "boom" in json.loads(body)["reason"]
    finally:
        server.close()


# ---------------------------------------------------------------------- health states
def test_health_is_503_with_reason_until_consuming(tmp_path: Path) -> None:
    worker = Worker(WorkerSettings(state=str(tmp_path / "s"), metrics_port=0))
    h = worker.health_info()
    assert h["ok"] is False and h["status"] == "starting" and h["reason"]
    worker._set_status("waiting_for_kafka", "waiting for Kafka at 127.0.0.1:1")
    server = MetricsServer(worker.metrics, 0, worker.health_info)
    try:
        status, body = _get(server.port, "/healthz")
        assert status == 503
        assert json.loads(body)["reason"] == "waiting for Kafka at 127.0.0.1:1"
        worker._set_status("consuming", None)
        worker.health.last_poll = time.time()
        status, body = _get(server.port, "/healthz")
        assert status == 200 and json.loads(body)["reason"] is None
        worker.stop()
        status, body = _get(server.port, "/healthz")
        assert status == 503 and json.loads(body)["reason"] == "stopping"
    finally:
        server.close()


def test_settings_reject_unknown_choices() -> None:
    with pytest.raises(ValueError, match="GNNSTREAM_ON_OFFSET_RESET"):
        WorkerSettings(on_offset_reset="sometimes")
    with pytest.raises(ValueError, match="drain_timeout_s"):
        WorkerSettings(drain_timeout_s=-1)


# ---------------------------------------------------------------------- errors clear
class _FlakyPublisher:
    """Fails ``failures`` times, then publishes nothing (an empty outbox)."""

    def __init__(self, failures: int):
        self.failures = failures
        self.calls = 0

    def publish(self) -> list:
        self.calls += 1
        if self.calls <= self.failures:
            raise DeliveryError("0 of 3 records failed and 3 got no answer within 30s", pending=3)
        return []


def test_last_error_clears_when_the_operation_works_again(tmp_path: Path) -> None:
    worker = Worker(WorkerSettings(state=str(tmp_path / "s"), metrics_port=0))
    worker._stop.set()  # _recoverable's one-second pause returns at once
    publisher = _FlakyPublisher(failures=1)
    worker._publish(publisher)  # type: ignore[arg-type]
    assert worker.health_info()["last_error"].startswith("publish: DeliveryError")
    worker._recoverable("poll", ConnectionError("broker gone"))
    assert worker.health_info()["last_error"].startswith("poll: ")
    worker._publish(publisher)  # type: ignore[arg-type]  # works now: its error is over, the poll error stays
    assert worker.health_info()["last_error"].startswith("poll: ")
    worker._cleared("poll")
    assert worker.health_info()["last_error"] is None
    text = worker.metrics.render().decode()
    assert 'gnnstream_errors_total{kind="publish"} 1.0' in text
    assert 'gnnstream_errors_total{kind="poll"} 1.0' in text


# ---------------------------------------------------------------------- offset reset, without a broker
class _FakeConsumer(ConsumerClient):
    """Returns fixed high watermarks; records what the worker seeks to."""

    def __init__(self, ends: Mapping[PartitionKey, int]):
        self.ends = dict(ends)
        self.seeks: list[dict[PartitionKey, int]] = []

    def seek_to(self, offsets: Mapping[PartitionKey, int]) -> None:
        self.seeks.append(dict(offsets))

    def poll_batch(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        return []

    def commit(self, offsets: Mapping[PartitionKey, int] | None = None) -> bool:
        return True

    def lag(self) -> dict[PartitionKey, int]:
        return {}

    def high_watermarks(self) -> dict[PartitionKey, int]:
        return dict(self.ends)

    def assignment(self) -> set[PartitionKey]:
        return set(self.ends)

    def close(self) -> None:
        pass


def _records(topic: str, partition: int, offsets: range) -> list[Record]:
    return [Record(topic, partition, o, b"k", b"{}", 0) for o in offsets]


@pytest.mark.parametrize("policy", ["fail", "earliest", "latest"])
def test_offset_past_end_is_caught_before_any_record_is_applied(tmp_path: Path, policy: str) -> None:
    """Partition 0 was reset: its end (4) is below the stored offset (10), and the consumer's position
    already went back to its start (what kafka-python does on OFFSET_OUT_OF_RANGE): records 0..3 arrive.
    Partition 1 is fine (stored 5, end 9)."""
    from graph_state.store import GraphStore
    worker = Worker(WorkerSettings(state=str(tmp_path / "s"), metrics_port=0, on_offset_reset=policy))
    with GraphStore(str(tmp_path / "s")) as store:
        store.apply([], {("ev", 0): 10, ("ev", 1): 5})
        worker.store = store
        assert worker._stored_offsets([("ev", 0), ("ev", 1)]) == {("ev", 0): 10, ("ev", 1): 5}
        consumer = _FakeConsumer({("ev", 0): 4, ("ev", 1): 9})
        records = _records("ev", 0, range(0, 4)) + _records("ev", 1, range(3, 9))  # 3 and 4 were applied
        if policy == "fail":
            with pytest.raises(OffsetResetError) as info:
                worker._check_offsets(consumer, records)
            message = str(info.value)
            assert "\n" not in message
            for part in ("'ev'", "partition 0", "stored offset 10", "end offset 4", "--on-offset-reset"):
                assert part in message, (part, message)
            assert info.value.partitions == {("ev", 0): (10, 4)}
            assert store.offsets() == {("ev", 0): 10, ("ev", 1): 5}, "nothing may move on a refusal"
            assert consumer.seeks == []
        else:
            kept = worker._check_offsets(consumer, records)
            want = 0 if policy == "earliest" else 4
            assert [(r.partition, r.offset) for r in kept] == [(1, o) for o in range(5, 9)]
            assert store.offsets() == {("ev", 0): want, ("ev", 1): 5}
            assert consumer.seeks == [{("ev", 0): want}]
            # the next poll of that partition is accepted from there on
            assert worker._check_offsets(consumer, _records("ev", 0, range(want, 4))) \
                == _records("ev", 0, range(want, 4))
        worker.store = None
    text = worker.metrics.render().decode()
    assert 'gnnstream_errors_total{kind="offset_reset"} 1.0' in text
