"""The worker's HTTP endpoint, health states and error bookkeeping, without Kafka.

* the endpoint binds 127.0.0.1 unless ``--metrics-host`` / ``GNNSTREAM_METRICS_HOST`` says otherwise
  (docker-compose.yml sets 0.0.0.0);
* a connection that sends nothing is closed by the server (no thread held for ever);
* ``/healthz`` is 503 with a ``reason`` until the worker consumes, 200 after;
* ``last_error`` clears once the failing operation works again; the publisher thread sends a failed
  batch again before any later one;
* the freshness histogram takes a batch at a time and renders like a Prometheus histogram;
* the batch target metric shows what each poll asked for: it grows under a backlog up to ``max_batch_size``
  and the latency bound, and shrinks after a late round and under light load;
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

import numpy as np
import pytest
import yaml

from gnnstream.stream.clients import ConsumerClient, PartitionKey, Record
from gnnstream.stream.exceptions import DeliveryError
from gnnstream.workers.runtime.metrics import MetricsServer, WorkerMetrics
from gnnstream.workers.settings import WorkerSettings, add_worker_arguments, settings_from_args
from gnnstream.workers.runtime.offsets import OffsetResetError, Offsets
from gnnstream.workers.runtime.publisher import Outgoing
from gnnstream.workers.runtime.worker import Worker

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
    worker.health.set_status("waiting_for_kafka", "waiting for Kafka at 127.0.0.1:1")
    server = MetricsServer(worker.metrics, 0, worker.health_info)
    try:
        status, body = _get(server.port, "/healthz")
        assert status == 503
        assert json.loads(body)["reason"] == "waiting for Kafka at 127.0.0.1:1"
        worker.health.set_status("consuming", None)
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
class _FlakyDelivery:
    """``deliver`` fails ``failures`` times, then succeeds (or always refuses the batch, as an encoder refuses
    non-finite rows); records the columns of every attempt."""

    def __init__(self, failures: int, refuse: bool = False):
        self.failures, self.refuse = failures, refuse
        self.attempts: list[Any] = []

    def deliver(self, columns: Any, flush_timeout_s: float = 30.0, headers: Any = None) -> None:
        self.attempts.append(columns)
        if self.refuse:
            raise ValueError("Expected finite embeddings and timestamps (got non-finite values for nodes ['n1'])")
        if len(self.attempts) <= self.failures:
            raise DeliveryError("0 of 3 records failed and 3 got no answer within 30s", pending=3)


def _outgoing(n: int, tag: bytes) -> Outgoing:
    return Outgoing([tag], [tag], np.full(n, time.time() - 100.0), count=n)  # type: ignore[list-item]


def _delivered(sender: Any, count: int) -> list:
    got: list = []
    for _ in range(200):  # a bound on polls, not on time: each waits at most 0.1 s
        got += sender.delivered()
        if len(got) >= count:
            return got
        sender.wait(0.1)
    raise AssertionError(f"{len(got)} of {count} batches delivered")


def test_publisher_thread_retries_in_order_and_clears_its_error(tmp_path: Path) -> None:
    worker = Worker(WorkerSettings(state=str(tmp_path / "s"), metrics_port=0))
    worker._stop.set()  # the one-second backoff pause returns at once
    worker.errors.recoverable("poll", ConnectionError("broker gone"))
    delivery = _FlakyDelivery(failures=2)
    sender = worker._new_publisher(None, delivery)  # type: ignore[arg-type]
    first, second = _outgoing(3, b"a"), _outgoing(5, b"b")
    sender.submit(first)
    sender.submit(second)
    try:
        assert _delivered(sender, 2) == [first, second]
    finally:
        sender.close(5.0)
    assert not sender.thread.is_alive()
    # the failing batch is sent again before the next one: versions of a node never go out of order
    assert delivery.attempts == [[b"a"], [b"a"], [b"a"], [b"b"]]
    assert sender.in_flight() == 0
    assert worker.health_info()["last_error"].startswith("poll: ")  # publish works again: its error is over
    worker.errors.cleared("poll")
    assert worker.health_info()["last_error"] is None
    assert worker.health.published == 8
    text = worker.metrics.render().decode()
    assert 'gnnstream_errors_total{kind="publish"} 2.0' in text
    assert "gnnstream_embeddings_published_total 8.0" in text
    assert "gnnstream_embedding_freshness_seconds_count 8.0" in text
    assert 'gnnstream_embedding_freshness_seconds_bucket{le="60.0"} 0.0' in text
    assert 'gnnstream_embedding_freshness_seconds_bucket{le="300.0"} 8.0' in text
    assert "gnnstream_publish_seconds_count 2.0" in text


def test_a_batch_that_cannot_be_encoded_stops_the_worker_instead_of_retrying(tmp_path: Path) -> None:
    worker = Worker(WorkerSettings(state=str(tmp_path / "s"), metrics_port=0))
    delivery = _FlakyDelivery(failures=0, refuse=True)
    sender = worker._new_publisher(None, delivery)  # type: ignore[arg-type]
    sender.submit(Outgoing([b"a"], [], np.zeros(1), count=1))
    try:
        sender.thread.join(10.0)  # the thread ends at the failure: no retry cures it
        assert not sender.thread.is_alive()
        with pytest.raises(ValueError, match="non-finite"):
            worker._publish(sender)
    finally:
        sender.close(1.0)
    assert len(delivery.attempts) == 1  # tried once, never again
    assert sender.in_flight() == 1 and worker.health.published == 0


def test_batch_histogram_renders_like_a_prometheus_histogram() -> None:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest
    from gnnstream.workers.runtime.metrics import BatchHistogram
    bounds = (0.005, 0.01, 1.0, 2.5, 86400.0 * 365 * 30)
    values = np.array([0.0, 0.005, 0.0051, 1.0, 3.0, 1e9, 2.5, 0.3, 0.3])
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    batch = BatchHistogram("x_seconds", "doc", bounds, registry=ours)
    batch.observe_many(values[:4])
    batch.observe_many(values[4:])
    batch.observe_many(np.zeros(0))
    plain = Histogram("x_seconds", "doc", buckets=bounds, registry=theirs)
    for v in values:
        plain.observe(v)

    def samples(registry: Any) -> list[str]:
        return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]

    assert samples(ours) == samples(theirs)
    assert 'x_seconds_bucket{le="1.0"} 6.0' in samples(ours)


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

    def commit(self, offsets: Mapping[PartitionKey, int] | None = None, wait: bool = False) -> bool:
        return True

    def committed(self, partitions, timeout_s: float = 10.0):
        return {key: None for key in partitions}

    def lag(self) -> dict[PartitionKey, int]:
        return {}

    def high_watermarks(self) -> dict[PartitionKey, int]:
        return dict(self.ends)

    def assignment(self) -> set[PartitionKey]:
        return set(self.ends)

    def partitions_of(self, topic: str, timeout_s: float = 10.0) -> set[int]:
        return {p for t, p in self.ends if t == topic}

    def close(self) -> None:
        pass


class _Backlog(_FakeConsumer):
    """Returns as many records as asked (at most ``available`` when set), produced at ``produced_s``; records
    each poll's ``max_records``."""

    def __init__(self, produced_s: float):
        super().__init__({})
        self.produced_s = produced_s
        self.available: int | None = None
        self.asked: list[int] = []

    def poll_batch(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        self.asked.append(max_records)
        n = max_records if self.available is None else min(self.available, max_records)
        return [Record("ev", 0, i, b"k", b"v", int(self.produced_s * 1000)) for i in range(n)]


def test_the_batch_target_metric_shows_what_each_poll_asked_for(tmp_path: Path) -> None:
    worker = Worker(WorkerSettings(state=str(tmp_path / "s"), metrics_port=0, batch_size=100, max_batch_size=700,
                                   max_latency_ms=1000))
    now = 1_000_000.0
    worker.batching.clock = lambda: now
    consumer = _Backlog(produced_s=now - 0.25)  # a backlog of records 0.25 s old
    gauge = []

    def poll() -> int:
        records = worker._poll(consumer)
        text = worker.metrics.render().decode()
        gauge.append(float(next(line.split()[1] for line in text.splitlines()
                                if line.startswith("gnnstream_batch_target "))))
        return len(records)

    for _ in range(5):
        poll()
    worker.batching.processed(700, 700 / 1000)  # 1 ms an event: 750 fit in the 0.75 s left, max_batch_size is 700
    poll()
    worker.batching.processed(700, 700 / 500)  # 2 ms an event: 375 fit
    poll()
    worker.batching.processed(375, 375 / 1000)  # 1 ms an event again: the target would be 700 ...
    # ... but a round was delivered 0.9 s after its oldest record, past 0.8 of the bound: the target is halved
    worker._delivered(Outgoing([b"a"], [], np.zeros(1), oldest_record_s=now - 0.9, count=1), 0.01)
    consumer.available = 0  # and the load is light from here on: each empty poll halves it again
    for _ in range(3):
        poll()
    assert consumer.asked == [100, 200, 400, 700, 700, 700, 375, 350, 175, 100]
    assert gauge == consumer.asked  # the metric is the target each poll used
    text = worker.metrics.render().decode()
    assert "gnnstream_batch_events_count 7.0" in text  # empty polls are not batches
    assert f"gnnstream_batch_events_sum {float(sum(consumer.asked[:7]))}" in text
    with pytest.raises(ValueError, match="GNNSTREAM_MAX_LATENCY_MS"):
        WorkerSettings(max_latency_ms=-1)


class _Trickle(_Backlog):
    """``first`` records at the first poll, then ``then`` more at each later one (produced at ``produced_s``)."""

    def __init__(self, produced_s: float, first: int, then: int):
        super().__init__(produced_s)
        self.first, self.then, self.timeouts = first, then, []
        self.offset = 0

    def poll_batch(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        self.asked.append(max_records)
        self.timeouts.append(timeout_s)
        n = min(self.first if self.offset == 0 else self.then, max_records)
        out = [Record("ev", 0, self.offset + i, b"k", b"v", int(self.produced_s * 1000)) for i in range(n)]
        self.offset += n
        return out


def test_a_light_poll_waits_for_more_records_up_to_the_target(tmp_path: Path) -> None:
    worker = Worker(WorkerSettings(state=str(tmp_path / "s"), metrics_port=0, batch_size=100, max_batch_size=700,
                                   max_latency_ms=1000, batch_wait_ms=200))
    now = 1_000_000.0
    worker.batching.clock = lambda: now  # the records were just produced: the whole share of the bound is left
    consumer = _Trickle(produced_s=now, first=10, then=30)
    records = worker._poll(consumer)
    assert [r.offset for r in records] == list(range(100))
    assert consumer.asked == [100, 90, 60, 30]  # what is missing to the target, each time
    assert consumer.timeouts == [0.2, 0.0, 0.0, 0.0]  # --batch-wait-ms for the first record; then no waiting in a poll
    assert "gnnstream_batch_events_sum 100.0" in worker.metrics.render().decode()
    unbound = Worker(WorkerSettings(state=str(tmp_path / "u"), metrics_port=0, batch_size=100, max_latency_ms=0))
    assert len(unbound._poll(_Trickle(produced_s=now, first=10, then=30))) == 10  # no bound: what is there


def _records(topic: str, partition: int, offsets: range) -> list[Record]:
    return [Record(topic, partition, o, b"k", b"{}", 0) for o in offsets]


@pytest.mark.parametrize("policy", ["fail", "earliest", "latest"])
def test_offset_past_end_is_caught_before_any_record_is_applied(tmp_path: Path, policy: str) -> None:
    """Partition 0 was reset: its end (4) is below the stored offset (10), and the consumer's position
    already went back to its start (what kafka-python does on OFFSET_OUT_OF_RANGE): records 0..3 arrive.
    Partition 1 is fine (stored 5, end 9)."""
    from gnnstream.graph_state.store import GraphStore
    worker = Worker(WorkerSettings(state=str(tmp_path / "s"), metrics_port=0, on_offset_reset=policy))
    with GraphStore(str(tmp_path / "s")) as store:
        store.apply([], {("ev", 0): 10, ("ev", 1): 5})
        offsets = Offsets(store, policy, worker.errors)
        assert offsets.stored([("ev", 0), ("ev", 1)]) == {("ev", 0): 10, ("ev", 1): 5}
        consumer = _FakeConsumer({("ev", 0): 4, ("ev", 1): 9})
        records = _records("ev", 0, range(0, 4)) + _records("ev", 1, range(3, 9))  # 3 and 4 were applied
        if policy == "fail":
            with pytest.raises(OffsetResetError) as info:
                offsets.check(consumer, records)
            message = str(info.value)
            assert "\n" not in message
            for part in ("'ev'", "partition 0", "stored offset 10", "end offset 4", "--on-offset-reset"):
                assert part in message, (part, message)
            assert info.value.partitions == {("ev", 0): (10, 4)}
            assert store.offsets() == {("ev", 0): 10, ("ev", 1): 5}, "nothing may move on a refusal"
            assert consumer.seeks == []
        else:
            kept = offsets.check(consumer, records)
            want = 0 if policy == "earliest" else 4
            assert [(r.partition, r.offset) for r in kept] == [(1, o) for o in range(5, 9)]
            assert store.offsets() == {("ev", 0): want, ("ev", 1): 5}
            assert consumer.seeks == [{("ev", 0): want}]
            # the next poll of that partition is accepted from there on
            assert offsets.check(consumer, _records("ev", 0, range(want, 4))) \
                == _records("ev", 0, range(want, 4))
    text = worker.metrics.render().decode()
    assert 'gnnstream_errors_total{kind="offset_reset"} 1.0' in text


# ---------------------------------------------------------------------- the outbox publisher, without a broker
def test_outbox_publisher_encodes_columns_and_deletes_only_confirmed_records(tmp_path: Path) -> None:
    from gnnstream.graph_state import keys
    from gnnstream.graph_state.store import GraphStore
    from gnnstream.stream.updates import EmbeddingUpdate, VERSION_HEADER, encode_update
    from gnnstream.stream.delivery import UpdateColumns, encode_columns
    from gnnstream.graph_state.outbox import encode_record
    from gnnstream.workers.runtime.publisher import OutboxReader

    def resolve(iids: np.ndarray, computed_at: float) -> UpdateColumns:
        n = len(iids)
        rows = np.arange(n * 3, dtype=np.float32).reshape(n, 3) / 7
        deleted = iids % 3 == 2
        rows[deleted] = 0
        return UpdateColumns([f"n{i}" for i in iids.tolist()], iids * 10, iids + 0.5, computed_at,
                             ["deleted" if d else "full" for d in deleted.tolist()], rows, deleted)

    with GraphStore(str(tmp_path / "s")) as store:
        from gnnstream.graph_state.transaction import Transaction
        tx = Transaction()
        tx.put_outbox(0, encode_record(np.array([1, 2, 3]), 100.0))
        tx.put_outbox(1, encode_record(np.array([4, 5]), 200.0))
        store.commit(tx)
        publisher = OutboxReader(store, resolve)
        first = publisher.prepare(limit=1)  # whole records: the first one alone reaches the limit
        assert first.keys == [keys.U64.pack(0)] and len(first) == 3
        rows = resolve(np.array([1, 2, 3]), 100.0).rows
        expected = {f"n{iid}".encode(): encode_update(EmbeddingUpdate(f"n{iid}", "m:1", iid * 10, rows[i], iid + 0.5,
                                                                      100.0, "full"))
                    for i, iid in ((0, 1), (2, 3))}
        got = {k: (v, h) for k, v, h in encode_columns(first.columns, "m:1", "json")}
        assert got[b"n2"] == (None, [(VERSION_HEADER, b"20")])  # a tombstone with the node's version
        assert {k: v for k, (v, _) in got.items() if v is not None} == expected
        np.testing.assert_array_equal(np.sort(first.event_ts), [1.5, 2.5, 3.5])
        second = publisher.prepare()  # what the first took is not taken twice
        assert second.keys == [keys.U64.pack(1)] and second.columns[0].names == ["n4", "n5"]
        assert not publisher.prepare().keys
        publisher.confirm(second)  # delivered out of order: only its record goes
        assert [k for k in store.column("outbox").keys()] == [keys.U64.pack(0)]


def test_outbox_publisher_sends_a_node_of_several_records_once(tmp_path: Path) -> None:
    """Records waiting together coalesce: each node goes out once, under the last record naming it, and the
    limit counts distinct nodes."""
    from gnnstream.graph_state import keys
    from gnnstream.graph_state.outbox import encode_record
    from gnnstream.graph_state.store import GraphStore
    from gnnstream.graph_state.transaction import Transaction
    from gnnstream.stream.delivery import UpdateColumns
    from gnnstream.workers.runtime.publisher import OutboxReader

    calls: list[tuple[list[int], float]] = []

    def resolve(iids: np.ndarray, computed_at: float) -> UpdateColumns:
        calls.append((iids.tolist(), computed_at))
        n = len(iids)
        return UpdateColumns([f"n{i}" for i in iids.tolist()], iids * 10, iids + 0.5, computed_at, ["full"] * n,
                             np.ones((n, 2), dtype=np.float32), np.zeros(n, dtype=bool))

    with GraphStore(str(tmp_path / "s")) as store:
        tx = Transaction()
        for seq, (iids, at) in enumerate([([1, 2, 3], 100.0), ([2, 4], 200.0), ([3, 2, 5], 300.0), ([6], 400.0),
                                          ([1, 7], 500.0)]):
            tx.put_outbox(seq, encode_record(np.array(iids), at))
        store.commit(tx)
        publisher = OutboxReader(store, resolve)
        first = publisher.prepare(limit=5)  # 3, then 4, then 5 distinct nodes: three records
        assert first.keys == [keys.U64.pack(i) for i in range(3)]
        assert calls == [([1], 100.0), ([4], 200.0), ([3, 2, 5], 300.0)]
        assert len(first) == 5 and sorted(first.event_ts.tolist()) == [1.5, 2.5, 3.5, 4.5, 5.5]
        calls.clear()
        second = publisher.prepare(limit=5)  # the rest; nothing it took before is left out
        assert second.keys == [keys.U64.pack(3), keys.U64.pack(4)]
        assert calls == [([6], 400.0), ([1, 7], 500.0)]
        assert not publisher.prepare().keys
