"""``gnnstream tail``: bad messages get an ``invalid`` line, and ``--idle`` counts only once assigned."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest

import gnnstream.workers.offline.replay as replay
from gnnstream.stream.clients import Record
from gnnstream.stream.kafka import Producer, ensure_topics
from gnnstream.stream.updates import EmbeddingUpdate, encode_update, tombstone
from gnnstream.workers.offline.replay import tail_embeddings


def _update(i: int) -> EmbeddingUpdate:
    return EmbeddingUpdate(f"n{i}", "m:1", i + 1, np.arange(3, dtype=np.float32) + i, 1000.0 + i, 2000.0, "full")


class _SlowJoinConsumer:
    """A consumer that joins its group only after ``join_polls`` empty polls, then returns ``batches``."""

    def __init__(self, clock: list[float], join_polls: int, batches: list[list[Record]]):
        self.clock, self.join_polls, self.batches = clock, join_polls, list(batches)
        self.polls = 0
        self.closed = False

    def poll_batch(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        self.clock[0] += timeout_s  # every poll waits its whole timeout (fake clock)
        self.polls += 1
        if self.polls <= self.join_polls or not self.batches:
            return []
        return self.batches.pop(0)

    def assignment(self) -> set[Any]:
        return {("emb", 0)} if self.polls > self.join_polls else set()

    def close(self) -> None:
        self.closed = True


def _record(offset: int, key: bytes | None, value: bytes | None) -> Record:
    return Record("emb", 0, offset, key, value, 0)


def test_tail_idle_counts_only_after_assignment_and_survives_bad_messages(monkeypatch) -> None:
    clock = [0.0]
    records = [_record(0, b"n0", encode_update(_update(0))),
               _record(1, b"x", b'{"hello":1}'),
               _record(2, b"n2", encode_update(_update(2), "binary")),
               _record(3, b"gone", None)]
    # joining takes 20 polls (10 s) with --idle 3: idle time must not count before the join
    consumer = _SlowJoinConsumer(clock, 20, [records])
    monkeypatch.setattr(replay, "open_consumer", lambda *a, **kw: consumer)
    monkeypatch.setattr(replay.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    count = tail_embeddings("unused:9092", from_beginning=True, idle_s=3.0, out=out)
    lines = out.getvalue().splitlines()
    assert count == 4 and len(lines) == 4 and consumer.closed
    assert lines[0].startswith("n0 v1 full m:1 dim=3 [+0.0000, +1.0000, +2.0000, …]")
    assert lines[1].startswith("x invalid emb/0@1 missing_field: ")
    assert lines[2].startswith("n2 v3 full m:1 dim=3 [+2.0000, +3.0000, +4.0000, …]")
    assert lines[3] == "gone deleted"
    # it stopped after the first idle stretch longer than 3 s once assigned: 21 polls, then 7 empty ones
    assert consumer.polls == 21 + 7


@pytest.mark.broker
def test_tail_prints_invalid_line_for_poison_message_on_broker(broker, unique_name) -> None:
    topic = unique_name("emb")
    ensure_topics(broker.bootstrap, {topic: 1})
    with Producer(broker.bootstrap) as producer:
        producer.send(topic, b"n0", encode_update(_update(0)))
        producer.send(topic, b"bad", b'{"hello":1}')
        producer.send(topic, b"n1", encode_update(_update(1)))
        key, value, headers = tombstone("gone", 3)
        producer.send(topic, key, value, headers)
        producer.flush(30)
    out = io.StringIO()
    count = tail_embeddings(broker.bootstrap, topic=topic, from_beginning=True, max_messages=4, idle_s=20.0,
                            out=out)
    lines = out.getvalue().splitlines()
    assert count == 4
    assert [line.split(" ")[:2] for line in lines] == [["n0", "v1"], ["bad", "invalid"], ["n1", "v2"],
                                                       ["gone", "deleted"]]
    assert lines[1].startswith(f"bad invalid {topic}/0@1 missing_field: ")
