"""``produce`` and ``tail`` with a wrong name: the file is checked before Kafka, a missing topic ends the tail.

The broker tests run ``gnnstream tail`` in the test's process with ``--idle``
bounding its wait: a tail that never stops fails at the suite's per-test
timeout instead of hanging it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kafka.admin import KafkaAdminClient

import gnnstream.workers.offline.replay as replay
from gnnstream.stream.clients import Record
from gnnstream.stream.exceptions import NoPartitionsError, StreamError
from gnnstream.stream.kafka import Producer, ensure_topics
from gnnstream.stream.updates import EmbeddingUpdate, encode_update
from gnnstream.workers.cli import main
from gnnstream.workers.offline.replay import tail_embeddings
from tests.workers.reference import call_gnnstream

ROOT = Path(__file__).resolve().parents[2]


def _topics(bootstrap: str) -> set[str]:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="test-topics")
    try:
        return set(admin.list_topics())
    finally:
        admin.close()


# ---------------------------------------------------------------------- 5. produce
def test_produce_checks_its_file_before_kafka(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    def no_kafka(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("produce reached Kafka before reading its file")

    monkeypatch.setattr(replay, "ensure_topics", no_kafka)
    monkeypatch.setattr(replay, "open_producer", no_kafka)
    missing = tmp_path / "typo.jsonl"
    capsys.readouterr()
    rc = main(["produce", "--bootstrap", "127.0.0.1:1", str(missing)])
    out, err = capsys.readouterr()
    assert (rc, out) == (2, "")
    assert err == f"gnnstream: error: [Errno 2] No such file or directory: {str(missing)!r}\n"


# ---------------------------------------------------------------------- 6. tail, on the broker
@pytest.mark.broker
@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_tail_of_a_missing_topic_stops_after_idle_with_one_line(broker: Any, unique_name: Any, client: str) -> None:
    topic = unique_name("typo")
    result = call_gnnstream("tail", "--bootstrap", broker.bootstrap, "--kafka-client", client, "--output-topic", topic,
                            "--idle", "1")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stdout == ""
    assert result.stderr.splitlines()[-1] == (f"gnnstream: error: topic {topic!r} does not exist at "
                                              f"{broker.bootstrap}; check its name (--output-topic, or --model-id "
                                              f"NAME:VERSION)")
    assert topic not in _topics(broker.bootstrap)  # the tail did not create it


@pytest.mark.broker
def test_tail_of_an_existing_topic_prints_its_updates(broker: Any, unique_name: Any) -> None:
    topic = unique_name("emb")
    ensure_topics(broker.bootstrap, {topic: 1})
    update = EmbeddingUpdate("n0", "m:1", 1, np.arange(3, dtype=np.float32), 1000.0, 2000.0, "full")
    with Producer(broker.bootstrap) as producer:
        producer.send(topic, b"n0", encode_update(update))
        producer.flush(30)
    result = call_gnnstream("tail", "--bootstrap", broker.bootstrap, "--output-topic", topic, "--from-beginning",
                            "--max", "1", "--idle", "20")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("n0 v1 full m:1 dim=3 [+0.0000, +1.0000, +2.0000, …]")


# ---------------------------------------------------------------------- 6. tail, without assignment (fake clock)
class _NeverAssigned:
    """A consumer whose group never assigns it anything; ``exists``: whether its topic is in the metadata."""

    def __init__(self, clock: list[float], exists: bool):
        self.clock, self.exists = clock, exists
        self.polls = 0
        self.closed = False

    def poll_batch(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        self.clock[0] += timeout_s
        self.polls += 1
        return []

    def assignment(self) -> set[Any]:
        return set()

    def partitions_of(self, topic: str, timeout_s: float = 10.0) -> set[int]:
        if not self.exists:
            raise NoPartitionsError(f"topic {topic!r} has no partitions after {timeout_s:g} s (does it exist?)")
        return {0}

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("exists, message", [
    (False, "topic 'emb' does not exist at b:9092; check its name"),
    (True, "no partition of topic 'emb' was assigned to the tail in 24 s; check that the broker at b:9092 is "
           "healthy"),
])
def test_tail_idle_stops_even_when_nothing_is_ever_assigned(monkeypatch: pytest.MonkeyPatch, exists: bool,
                                                            message: str) -> None:
    clock = [0.0]
    consumer = _NeverAssigned(clock, exists)
    monkeypatch.setattr(replay, "open_consumer", lambda *a, **kw: consumer)
    monkeypatch.setattr(replay.time, "monotonic", lambda: clock[0])
    with pytest.raises(StreamError) as info:
        tail_embeddings("b:9092", topic="emb", idle_s=3.0)
    assert str(info.value).startswith(message)
    assert consumer.closed
    # the join may take 20 s (40 polls of 0.5 s); then a missing topic stops it, else more than 3 idle seconds
    assert consumer.polls == (41 if not exists else 47)



def test_produce_refuses_a_gzipped_file_as_json_lines(capsys: pytest.CaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A gzipped file without --format snap would go out as raw bytes: refused before Kafka, naming the flag."""
    def no_kafka(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("produce reached Kafka before reading its file")

    monkeypatch.setattr(replay, "ensure_topics", no_kafka)
    monkeypatch.setattr(replay, "open_producer", no_kafka)
    data = str(ROOT / "data" / "soc-sign-bitcoinotc.csv.gz")
    capsys.readouterr()
    rc = main(["produce", "--bootstrap", "127.0.0.1:1", data])
    out, err = capsys.readouterr()
    assert (rc, out) == (2, "")
    assert err == (f"gnnstream: error: {data!r} is gzipped, not JSON lines: send a SNAP CSV with --format snap, "
                   f"or gunzip a JSONL file first\n")


def test_produce_sends_any_line_as_it_is(tmp_path: Path) -> None:
    """Lines the worker will dead-letter (not JSON, nested past the parser's depth) go out unchanged, without a
    key; a valid event is keyed by its source."""
    deep = b"[" * 100_000 + b"]" * 100_000
    path = tmp_path / "poison.jsonl"
    path.write_bytes(b'{"op":"edge_upsert","src":"a","dst":"b","ts":1}\n' + deep + b"\n{oops\n")
    assert list(replay.iter_file_messages(str(path))) == [
        (b"a", b'{"op":"edge_upsert","src":"a","dst":"b","ts":1}'), (None, deep), (None, b"{oops")]
