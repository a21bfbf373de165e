"""Poison records never wedge the worker (docs/operations.md, "Kafka errors: transient or permanent").

A stream of good events mixed with malformed records of every kind the
decoder knows, some of them larger than the producer's limit
(``--max-message-bytes``), runs through a worker that is SIGKILLed twice;
at the end every bad record is in the dead-letter topic as specified (cut
to fit where it had to be, with the truncation headers) and every
embedding equals an independent from-scratch computation
(tests/workers/reference.py). A group of three workers writes each bad
record once, and loses none when one of them is killed.

The embedded broker accepts records of at least 120 MB, so a record over
the *broker's* limit cannot be made here: tests/stream/test_deadletter.py
covers that path with each client's own error.
"""

from __future__ import annotations

import hashlib
import json
import random
import signal
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from gnnstream.stream.backends import KAFKA_CLIENTS, read_to_end
from tests.support import health, start_on_ports
from gnnstream.stream.broker import EmbeddedBroker
from gnnstream.stream.deadletter import DeadLetter, letter_partition
from gnnstream.stream.events import INVALID_EVENT_REASONS, EdgeUpsert, NodeUpsert, encode_event, event_key
from gnnstream.stream.kafka import ensure_topics
from gnnstream.stream.updates import decode_update
from tests.workers.reference import GraphFold, assert_embeddings_close, gnnstream_command, reference_embeddings

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

PARTITIONS = 4
IN_DIM = 8  # the model_dir fixture's
CLIENT_LIMIT = 200_000  # --max-message-bytes: the worker's producers refuse larger records
DEADLINE_S = 180.0


# ---------------------------------------------------------------------- the stream
def good_events(count: int, seed: int) -> list:
    rng = random.Random(seed)
    nodes = [f"n{i}" for i in range(120)]
    out: list = []
    for i in range(count):
        if i % 5 == 0:
            features = tuple(round(rng.uniform(-1, 1), 3) for _ in range(IN_DIM))
            out.append(NodeUpsert(id=rng.choice(nodes), ts=float(i), features=features))
        else:
            src, dst = rng.sample(nodes, 2)
            out.append(EdgeUpsert(src=src, dst=dst, ts=float(i), weight=round(rng.uniform(0.1, 2), 3)))
    return out


def bad_records(copies: int) -> list[tuple[str, bytes | None, bytes | None]]:
    """``(reason, key, value)`` of every kind of malformed record, ``copies`` of each, the big ones once."""
    def j(obj: Any) -> bytes:
        return json.dumps(obj).encode()

    kinds = [
        ("empty", lambda i: None),
        ("empty", lambda i: b""),
        ("not_utf8", lambda i: b'{"op":"edge_upsert","src":"\xff","dst":"b","ts":1}'),
        ("not_json", lambda i: b'{"op":"edge_upsert","src":"x%d' % i),
        ("not_object", lambda i: j([i])),
        ("duplicate_field", lambda i: b'{"op":"edge_upsert","src":"b%d","src":"z","dst":"c","ts":1}' % i),
        ("missing_field", lambda i: j({"op": "edge_upsert", "src": f"b{i}", "ts": 1})),
        ("unknown_op", lambda i: j({"op": "edge_merge", "src": f"b{i}", "dst": "c", "ts": 1})),
        ("unknown_field", lambda i: j({"op": "edge_upsert", "src": f"b{i}", "dst": "c", "ts": 1, "colour": 3})),
        ("bad_id", lambda i: j({"op": "node_delete", "id": True, "ts": 1})),
        ("empty_id", lambda i: j({"op": "edge_upsert", "src": "", "dst": "c", "ts": 1})),
        ("bad_type", lambda i: j({"op": "edge_upsert", "src": f"b{i}", "dst": "c", "ts": "yesterday"})),
        ("not_finite", lambda i: b'{"op":"edge_upsert","src":"b%d","dst":"c","ts":1,"weight":NaN}' % i),
        ("bad_ts", lambda i: j({"op": "edge_upsert", "src": f"b{i}", "dst": "c", "ts": -5})),
        ("bad_ts", lambda i: j({"op": "node_upsert", "id": f"b{i}", "ts": 1e300, "features": [0.5, 0.5]})),
        ("bad_features", lambda i: j({"op": "node_upsert", "id": f"b{i}", "ts": 1, "features": []})),
        ("wrong_feature_length", lambda i: j({"op": "node_upsert", "id": f"b{i}", "ts": 1, "features": [0.5] * 3})),
        ("oversize", lambda i: j({"op": "node_upsert", "id": f"b{i}", "ts": 1, "features": [0.25] * 700_000})),
    ]
    out = [(reason, f"bad{i}".encode(), make(i)) for i in range(copies) for reason, make in kinds[:-1]]
    out.append(kinds[-1][:1] + (b"huge-oversize", kinds[-1][1](0)))
    # the record that wedged a worker: within --max-event-bytes, over the producer's limit
    wide = j({"op": "node_upsert", "id": "wide", "ts": 1, "features": [0.123456] * 200_000})
    out += [("wrong_feature_length", f"wide{i}".encode(), wide) for i in range(3)]
    # unknown_type is a typed graph's (a model with a schema): an untyped worker refuses typed fields as unknown
    assert {reason for reason, _, _ in out} == INVALID_EVENT_REASONS - {"unknown_type"}
    return out


def mixed(good: list, bad: list, seed: int) -> list[tuple[str | None, bytes | None, bytes | None]]:
    """Good events in order with the bad records at random places: ``(reason or None, key, value)``."""
    rng = random.Random(seed)
    bad = list(bad)
    rng.shuffle(bad)
    slots = set(rng.sample(range(len(good) + len(bad)), len(bad)))
    goods, bads = iter(good), iter(bad)
    out: list[tuple[str | None, bytes | None, bytes | None]] = []
    for pos in range(len(good) + len(bad)):
        if pos in slots:
            out.append(next(bads))
        else:
            ev = next(goods)
            out.append((None, event_key(ev), encode_event(ev)))
    return out


def produce(bootstrap: str, topic: str, records: list) -> list[tuple[int, int]]:
    """Send ``(reason, key, value)`` records in order; the ``(partition, offset)`` of each."""
    from kafka import KafkaProducer
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5, max_request_size=64 << 20,
                             client_id="test-producer")
    try:
        futures = [producer.send(topic, key=k, value=v) for _, k, v in records]
        producer.flush(120)
        metas = [f.get(timeout=60) for f in futures]
    finally:
        producer.close(5)
    return [(m.partition, m.offset) for m in metas]


# ---------------------------------------------------------------------- workers
class Worker:
    """A ``gnnstream run`` process, its health port and its log."""

    def __init__(self, make_cmd: Callable[[int], list[Any]], log: Path):
        self.log = log
        self.proc, (self.port,) = start_on_ports(make_cmd, log)  # restarted on another port if it was taken

    def health(self) -> dict[str, Any]:
        if self.proc.poll() is not None:
            pytest.fail(f"worker exited with {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
        return health(self.port) or {}

    def wait(self, cond: Any, what: str, every_s: float = 0.05) -> dict[str, Any]:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            h = self.health()
            if h and cond(h):
                return h
            time.sleep(every_s)
        pytest.fail(f"timed out waiting for {what}:\n{self.log.read_text()[-4000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> dict[str, Any]:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=DEADLINE_S)
        assert self.proc.returncode == 0, self.log.read_text()[-4000:]
        return json.loads(out)


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for w in started:
        w.kill()


class Names:
    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:10]
        self.events, self.output, self.dlq, self.group = f"ev-{tag}", f"emb-{tag}", f"dlq-{tag}", f"g-{tag}"


def start(workers: list[Worker], bootstrap: str, n: Names, model: str, state: Path, client: str,
          name: str = "w") -> Worker:
    state.parent.mkdir(parents=True, exist_ok=True)
    cmd = lambda port: gnnstream_command("run", "--bootstrap", bootstrap, "--kafka-client", client, "--state", state,
                            "--model", model, "--events-topic", n.events, "--output-topic", n.output,
                            "--dlq-topic", n.dlq, "--group", n.group, "--worker-id", name,
                            "--partitions", PARTITIONS, "--metrics-port", port, "--batch-size", 50,
                            "--max-batch-size", 50, "--max-event-bytes", 4_000_000,
                            "--max-message-bytes", CLIENT_LIMIT)
    worker = Worker(cmd, state.parent / f"{name}.log")
    workers.append(worker)
    return worker


# ---------------------------------------------------------------------- checks
def check_dead_letters(bootstrap: str, client: str, n: Names, stream: list, placed: list) -> dict[tuple, int]:
    """Every bad record in the dead-letter topic as specified; ``{source: copies}``."""
    expected = {(n.events, p, o): (reason, k, v) for (reason, k, v), (p, o) in zip(stream, placed) if reason}
    deadline = time.monotonic() + 60  # a takeover writes the letters it held right after it: wait for them
    while True:
        records = read_to_end(client, bootstrap, n.dlq, timeout_s=60)
        found = {DeadLetter.from_record(r).source for r in records}
        if set(expected) <= found or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    copies: dict[tuple, int] = {}
    for record in records:
        letter = DeadLetter.from_record(record)
        assert letter.source in expected, f"a dead letter of {letter.source}, a good record"
        reason, key, value = expected[letter.source]
        assert (letter.reason, letter.key) == (reason, key), letter.source
        assert letter.detail
        size = len(record.key or b"") + len(record.value or b"") + sum(len(h) + len(v) for h, v in record.headers)
        assert size <= CLIENT_LIMIT
        if len(value or b"") + 2048 < CLIENT_LIMIT:  # fits whole: the original bytes
            assert letter.value == value and letter.original_size is None, letter.source
        else:  # cut to fit: a prefix of the original, with its size and digest
            assert record.header("gnnstream.truncated") == b"1", letter.source
            assert letter.original_size == len(value)
            assert letter.original_sha256 == hashlib.sha256(value).hexdigest()
            assert 0 < len(letter.value) < CLIENT_LIMIT and value.startswith(letter.value)
        copies[letter.source] = copies.get(letter.source, 0) + 1
    missing = sorted(set(expected) - set(copies))
    assert not missing, f"{len(missing)} bad records have no dead letter, e.g. {missing[:5]}"
    return copies


def check_embeddings(bootstrap: str, client: str, n: Names, good: list, model: str) -> None:
    """The newest published embedding of every node equals the from-scratch reference."""
    fold = GraphFold()
    for ev in good:
        fold.apply_event(ev)
    want = reference_embeddings(fold.nodes, fold.edges, fold.features, model)
    latest: dict[str, Any] = {}
    for record in read_to_end(client, bootstrap, n.output, timeout_s=60):
        u = decode_update(record.value)
        if u.id not in latest or u.version >= latest[u.id].version:
            latest[u.id] = u
    assert_embeddings_close({v: np.asarray(u.embedding) for v, u in latest.items()}, want)


# ---------------------------------------------------------------------- tests
@pytest.mark.parametrize("client", KAFKA_CLIENTS)
def test_poison_records_never_wedge_a_worker_killed_twice(client: str, broker: EmbeddedBroker, model_dir: str,
                                                          tmp_path: Path, workers: list[Worker]) -> None:
    n = Names()
    ensure_topics(broker.bootstrap, {n.events: PARTITIONS, n.output: PARTITIONS, n.dlq: 1})
    good = good_events(1500, seed=1)
    stream = mixed(good, bad_records(copies=3), seed=2)
    state = tmp_path / "state"
    placed: list[tuple[int, int]] = []
    slices = [stream[:500], stream[500:1000], stream[1000:]]
    applied = 0
    for run, part in enumerate(slices):
        placed += produce(broker.bootstrap, n.events, part)
        total_good = sum(1 for reason, _, _ in stream[:len(placed)] if reason is None)
        worker = start(workers, broker.bootstrap, n, model_dir, state, client)
        if run < 2:  # SIGKILLed once it applied some of its input
            worker.wait(lambda h: h.get("applied", 0) >= 50, "the first events applied", every_s=0.01)
            worker.kill()
            continue
        h = worker.wait(lambda h: h.get("position", 0) >= len(placed) and h.get("ok"),
                        "every record of the stream consumed")
        applied = h["applied"]
        summary = worker.stop()
        assert summary["status"] == "stopped"
        assert total_good == len(good)
    assert applied <= len(good)
    copies = check_dead_letters(broker.bootstrap, client, n, stream, placed)
    assert max(copies.values()) <= 3  # a copy per run at most: only a kill can repeat one
    check_embeddings(broker.bootstrap, client, n, good, model_dir)


@pytest.mark.parametrize("client", KAFKA_CLIENTS)
def test_a_group_writes_each_bad_record_once(client: str, broker: EmbeddedBroker, model_dir: str, tmp_path: Path,
                                             workers: list[Worker]) -> None:
    """Three workers of one group, started one after the other (each join moves partitions), 300 malformed
    records, one worker SIGKILLed while it reads the second half: every bad record reaches the dead-letter
    topic, once, except letters of the killed worker's partitions (written, not yet stored as done)."""
    n = Names()
    ensure_topics(broker.bootstrap, {n.events: PARTITIONS, n.output: PARTITIONS, n.dlq: 1})
    good = good_events(1200, seed=3)
    bad = [(r, k, v) for r, k, v in bad_records(copies=20) if v is None or len(v) < 10_000][:300]
    assert len(bad) == 300
    stream = mixed(good, bad, seed=4)
    placed = produce(broker.bootstrap, n.events, stream[:700])
    group = {"a": start(workers, broker.bootstrap, n, model_dir, tmp_path / "a" / "state", client, "a")}
    group["a"].wait(lambda h: h.get("applied", 0) >= 100, "the first worker under way")
    for name in ("b", "c"):
        group[name] = start(workers, broker.bootstrap, n, model_dir, tmp_path / name / "state", client, name)
    for w in group.values():
        w.wait(lambda h: h.get("position", 0) >= len(placed) and h.get("ok") and h.get("owned_partitions"),
               "every worker at the end of the first half, with partitions of its own")
    killed = set(group["b"].health()["owned_partitions"])
    placed += produce(broker.bootstrap, n.events, stream[700:])
    group.pop("b").kill()
    for w in group.values():
        w.wait(lambda h: h.get("position", 0) >= len(placed) and h.get("ok"), "the survivors at the end")
    deadline = time.monotonic() + DEADLINE_S
    while sum(len(w.health()["owned_partitions"]) for w in group.values()) < PARTITIONS:
        assert time.monotonic() < deadline, "the survivors never took the killed worker's partitions over"
        time.sleep(0.2)
    copies = check_dead_letters(broker.bootstrap, client, n, stream, placed)
    twice = {source for source, c in copies.items() if c > 1}
    assert {letter_partition(t, p, PARTITIONS) for t, p, _ in twice} <= killed, \
        f"{len(twice)} bad records written more than once outside a failover, e.g. {sorted(twice)[:5]}"
    for w in group.values():
        w.stop()
    check_embeddings(broker.bootstrap, client, n, good, model_dir)
