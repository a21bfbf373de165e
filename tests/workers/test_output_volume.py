"""Output volume control: ``--min-change`` (docs/design.md, "Output volume control").

With ``min_change`` = m > 0 the publisher sends a node's update only when
``||new - last||_2 > m * ||last||_2``, ``last`` being the row it last sent for
the node in this process; deletes (tombstones), mode changes and a node's
first update in a process always go out. Skipped updates are confirmed with
their batch and counted in ``gnnstream_updates_suppressed_total``.

* unit level, with a scripted resolver and a recording producer: which
  updates go out, the boundary (inclusive), drift measured from the last
  *published* row, duplicates in one prepare, restarts, non-finite rows, and
  ``min_change`` 0 giving byte-identical output;
* the real engine over a Bitcoin OTC prefix with deletes, a publisher restart
  and an undelivered batch: the consumer's last value of every node is within
  m (relative L2) of the stored exact embedding, deleted nodes end on a
  tombstone, skipped = resolved - sent, and ``verify`` passes;
* the worker against the embedded broker: the same checks end to end, and the
  counter equals what was skipped.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pytest

from gnnstream.graph_state import keys
from gnnstream.graph_state.store import GraphStore
from gnnstream.graph_state.transaction import Transaction
from gnnstream.stream.events import EdgeDelete, NodeDelete
from gnnstream.stream.updates import VERSION_HEADER, decode_update
from gnnstream.stream.clients import ProducerClient
from gnnstream.stream.delivery import Delivery, UpdateColumns
from gnnstream.workers.settings import WorkerSettings, add_worker_arguments, settings_from_args
from gnnstream.graph_state.outbox import encode_record
from gnnstream.workers.runtime.publisher import OutboxReader, Outgoing
from gnnstream.workers.runtime.worker import Worker

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MODES = ["full", "cold_start", "feature_only", "deleted"]


# ---------------------------------------------------------------------- helpers
class RecordingProducer(ProducerClient):
    """A producer that keeps what it is sent (flush confirms everything)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, bytes | None, Any]] = []

    def send(self, topic: str, key: bytes | None, value: bytes | None, headers: Any = None,
             partition: int | None = None) -> None:
        self.sent.append((topic, key, value, headers))

    def flush(self, timeout_s: float = 30.0) -> int:
        return len(self.sent)

    def close(self, timeout_s: float = 1.0) -> None:
        pass


class Held:
    """What a consumer holds: per node the message of the highest version seen (delivery is at least once)."""

    def __init__(self) -> None:
        self.version: dict[str, int] = {}
        self.row: dict[str, np.ndarray | None] = {}  # None: withdrawn (tombstone)
        self.mode: dict[str, str] = {}

    def take(self, messages: Iterable[tuple[bytes, bytes | None, Any]]) -> None:
        for key, value, headers in messages:
            node = key.decode()
            if value is None:
                version, row, mode = int(dict(headers)[VERSION_HEADER]), None, "deleted"
            else:
                u = decode_update(value)
                assert u.id == node
                version, row, mode = u.version, np.asarray(u.embedding, dtype=np.float64), u.mode
            if version >= self.version.get(node, -1):
                self.version[node], self.row[node], self.mode[node] = version, row, mode


class Scripted:
    """A stored state to resolve outbox records against, set by the test: ``iid -> (version, mode, row)``."""

    def __init__(self, dim: int = 4):
        self.dim = dim
        self.state: dict[int, tuple[int, str, np.ndarray]] = {}
        self.resolved = 0

    def set(self, iid: int, mode: str, row: Any = None) -> None:
        version = self.state[iid][0] + 1 if iid in self.state else 1
        vec = np.zeros(self.dim, dtype=np.float32) if row is None else np.asarray(row, dtype=np.float32)
        self.state[iid] = (version, mode, vec)

    def __call__(self, iids: np.ndarray, computed_at: float) -> UpdateColumns:
        iids = np.asarray(iids, dtype=np.int64)
        versions = np.array([self.state[i][0] for i in iids.tolist()], dtype=np.int64)
        modes = [self.state[i][1] for i in iids.tolist()]
        rows = np.stack([self.state[i][2] for i in iids.tolist()]).astype(np.float32)
        deleted = np.array([m == "deleted" for m in modes])
        self.resolved += len(iids)
        return UpdateColumns([f"n{i}" for i in iids.tolist()], versions, np.full(len(iids), 100.0), computed_at,
                             modes, rows, deleted, iids, np.array([MODES.index(m) for m in modes], dtype=np.int16))


class OutboxWriter:
    """Writes outbox records into a store, as the engine does."""

    def __init__(self, store: GraphStore):
        self.store, self.seq = store, 0

    def add(self, *iids: int) -> None:
        tx = Transaction()
        tx.put_outbox(self.seq, encode_record(np.array(iids, dtype=np.int64), 1.0))
        self.store.commit(tx)
        self.seq += 1


class InProcess:
    """An outbox delivered in this process to ``producer`` (the worker has its publisher thread do it)."""

    def __init__(self, outbox: OutboxReader, delivery: Delivery):
        self.outbox, self.delivery = outbox, delivery

    def prepare(self, limit: int = 50_000) -> Outgoing:
        return self.outbox.prepare(limit)

    def deliver(self, out: Outgoing) -> None:
        self.delivery.deliver(out.columns, 30.0, out.headers)

    def confirm(self, out: Outgoing) -> None:
        self.outbox.confirm(out)


def publisher_of(store: GraphStore, producer: RecordingProducer, resolve: Any, fmt: str = "json",
                 model: str = "m:1", **kw: Any) -> InProcess:
    """An outbox delivering in this process to ``producer``."""
    return InProcess(OutboxReader(store, resolve, **kw), Delivery(producer, "emb", model, fmt))


def cycle(publisher: InProcess, held: Held | None = None) -> Outgoing:
    """One prepare, deliver and confirm, as the worker's loop and publisher thread do; ``held`` takes
    what the producer was sent."""
    out = publisher.prepare()
    producer = publisher.delivery.producer  # type: ignore[union-attr]
    before = len(producer.sent)
    publisher.deliver(out)
    publisher.confirm(out)
    assert len(producer.sent) - before == len(out)
    if held is not None:
        held.take((key, value, headers) for _, key, value, headers in producer.sent[before:])
    return out


def sent_nodes(out: Outgoing) -> list[str]:
    return sorted(name for cols in out.columns for name in cols.names)


def relative_gap(held: np.ndarray, exact: np.ndarray) -> float:
    """``||exact - held|| / ||held||`` (inf for a zero held row that differs)."""
    gap = float(np.linalg.norm(np.asarray(exact, np.float64) - held))
    scale = float(np.linalg.norm(held))
    return gap / scale if scale else (0.0 if gap == 0 else float("inf"))


# ---------------------------------------------------------------------- settings
def test_min_change_setting_flag_env_and_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GNNSTREAM_MIN_CHANGE", raising=False)
    assert WorkerSettings().min_change == 0.0  # off by default
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    assert settings_from_args(parser.parse_args([])).min_change == 0.0
    assert settings_from_args(parser.parse_args(["--min-change", "0.05"])).min_change == 0.05
    monkeypatch.setenv("GNNSTREAM_MIN_CHANGE", "0.2")
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    assert settings_from_args(parser.parse_args([])).min_change == 0.2
    assert settings_from_args(parser.parse_args(["--min-change", "0"])).min_change == 0.0  # the flag wins
    assert "--min-change" in parser.format_help()
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="min_change must be a finite number >= 0") as info:
            WorkerSettings(min_change=bad)
        assert "--min-change or GNNSTREAM_MIN_CHANGE" in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------------- the publisher, scripted
def test_threshold_decides_per_node_from_the_last_published_row(tmp_path: Path) -> None:
    with GraphStore(str(tmp_path / "s")) as store:
        state, outbox, producer, held = Scripted(), OutboxWriter(store), RecordingProducer(), Held()
        publisher = publisher_of(store, producer, state, min_change=0.25)
        base = [4.0, 0.0, 0.0, 0.0]
        for iid in range(6):
            state.set(iid, "full", base)
        outbox.add(0, 1, 2, 3, 4, 5)
        first = cycle(publisher, held)
        assert sent_nodes(first) == ["n0", "n1", "n2", "n3", "n4", "n5"]  # first update of each: always
        assert first.suppressed == 0

        state.set(0, "full", [4.0, 0.5, 0.0, 0.0])  # moved 0.125 of its norm: below
        state.set(1, "full", [4.0, 2.0, 0.0, 0.0])  # 0.5: above
        state.set(2, "deleted")  # withdrawn: always
        state.set(3, "feature_only", [4.0, 0.01, 0.0, 0.0])  # a tiny move, but the mode changed: always
        state.set(4, "full", [4.0, 1.0, 0.0, 0.0])  # exactly 0.25: not more than min_change, held back
        state.set(5, "full", [4.0, 0.0, 0.0, 0.0])  # a new version with the same row: held back
        outbox.add(0, 1, 2)
        outbox.add(3, 4, 5)
        second = cycle(publisher, held)
        assert second.keys == [keys.U64.pack(1), keys.U64.pack(2)]
        assert sent_nodes(second) == ["n1", "n2", "n3"]
        assert second.suppressed == 3
        assert held.row["n2"] is None and held.version["n2"] == 2  # the tombstone carries the version
        assert held.mode["n3"] == "feature_only"
        assert not list(store.column("outbox").keys())  # skipped updates are confirmed with their batch

        # drift: node 0 moves 0.25 of its norm from its last *version*, 0.375 from its last *published* row
        state.set(0, "full", [4.0, 1.5, 0.0, 0.0])
        state.set(2, "full", base)  # back after its delete: published whatever it was before
        state.set(1, "full", [4.0, 2.5, 0.0, 0.0])  # 0.5/||(4,2)|| = 0.11 from its published row: held back
        outbox.add(0, 1, 2)
        third = cycle(publisher, held)
        assert sent_nodes(third) == ["n0", "n2"] and third.suppressed == 1
        assert held.version == {"n0": 3, "n1": 2, "n2": 3, "n3": 2, "n4": 1, "n5": 1}

        # the consumer's value of every node is within min_change of the stored one (the invariant)
        for iid, (version, mode, row) in state.state.items():
            node = f"n{iid}"
            assert relative_gap(held.row[node], row) <= 0.25, node
            assert held.mode[node] == mode

        # a non-finite row is never held back as "unchanged": it reaches the encoder, which refuses it
        # as it does without min_change
        state.set(5, "full", [4.0, np.nan, 0.0, 0.0])
        outbox.add(5)
        with pytest.raises(ValueError, match="finite"):
            publisher.deliver(publisher.prepare())


def test_duplicates_in_one_prepare_and_restarts_publish_again(tmp_path: Path) -> None:
    with GraphStore(str(tmp_path / "s")) as store:
        state, outbox, producer = Scripted(), OutboxWriter(store), RecordingProducer()
        publisher = publisher_of(store, producer, state, min_change=0.5)
        state.set(7, "full", [1.0, 1.0, 0.0, 0.0])
        outbox.add(7)
        outbox.add(7)  # two records naming the node, taken together: it goes out once, nothing held back
        out = cycle(publisher)
        assert sent_nodes(out) == ["n7"] and out.suppressed == 0 and len(out.keys) == 2

        state.set(7, "full", [1.0, 1.1, 0.0, 0.0])
        outbox.add(7)
        assert cycle(publisher).suppressed == 1

        # a new process starts with nothing kept: the first update of each node goes out
        state.set(7, "full", [1.0, 1.21, 0.0, 0.0])
        outbox.add(7)
        fresh = publisher_of(store, producer, state, min_change=0.5)
        assert sent_nodes(cycle(fresh)) == ["n7"]


@pytest.mark.parametrize("fmt", ["json", "binary"])
def test_min_change_zero_publishes_every_update_byte_identical(tmp_path: Path, fmt: str) -> None:
    sent: dict[str, list] = {}
    for name, extra in (("default", {}), ("zero", {"min_change": 0.0})):
        with GraphStore(str(tmp_path / name)) as store:
            state, outbox, producer = Scripted(), OutboxWriter(store), RecordingProducer()
            publisher = publisher_of(store, producer, state, fmt, **extra)
            sent[name] = producer.sent
            rng = np.random.default_rng(3)
            for step in range(5):
                ids = sorted(set(rng.integers(0, 20, size=8).tolist()))
                for iid in ids:
                    mode = "deleted" if rng.random() < 0.1 else "full"
                    state.set(iid, mode, None if mode == "deleted" else 1 + 1e-4 * rng.random(4))
                outbox.add(*ids)
                out = cycle(publisher)
                assert len(out) == len(ids) and out.suppressed == 0  # every update goes out
    assert sent["default"] == sent["zero"] and len(sent["zero"]) > 5


def test_a_resolver_without_iids_works_only_without_min_change(tmp_path: Path) -> None:
    def resolve(iids: np.ndarray, computed_at: float) -> UpdateColumns:
        n = len(iids)
        return UpdateColumns([f"n{i}" for i in iids.tolist()], iids + 1, np.zeros(n), computed_at, ["full"] * n,
                             np.ones((n, 3), dtype=np.float32), np.zeros(n, dtype=bool))

    with GraphStore(str(tmp_path / "s")) as store:
        OutboxWriter(store).add(1, 2)
        assert len(publisher_of(store, RecordingProducer(), resolve).prepare()) == 2
        with pytest.raises(ValueError, match="iids and mode_codes"):
            publisher_of(store, RecordingProducer(), resolve, min_change=0.1).prepare()
    with pytest.raises(ValueError, match="min_change"):
        OutboxReader(None, resolve, min_change=-1.0)  # type: ignore[arg-type]


def test_suppressed_counter_counts_delivered_batches(tmp_path: Path) -> None:
    worker = Worker(WorkerSettings(state=str(tmp_path / "s"), metrics_port=0, min_change=0.1))
    text = worker.metrics.render().decode()
    assert "gnnstream_updates_suppressed_total 0.0" in text
    def taken(key: bytes, sent: int, suppressed: int = 0) -> Outgoing:
        return Outgoing([key], [], np.zeros(sent), suppressed=suppressed, count=sent)

    worker._delivered(taken(b"a", 1, suppressed=3), 0.01)
    worker._delivered(taken(b"b", 0, suppressed=4), 0.01)  # a batch of skipped updates only
    worker._delivered(taken(b"c", 1), 0.01)
    text = worker.metrics.render().decode()
    assert "gnnstream_updates_suppressed_total 7.0" in text
    assert "gnnstream_embeddings_published_total 2.0" in text
    assert worker.health.published == 2


# ---------------------------------------------------------------------- the real engine, without a broker
N_EVENTS = 1_500


@pytest.fixture(scope="module")
def otc_events() -> list:
    from gnnstream.fraud.datasets import BITCOIN_OTC
    from gnnstream.stream.snap import read_snap, snap_events
    evs = list(itertools.islice(snap_events(read_snap(BITCOIN_OTC)[:N_EVENTS]), N_EVENTS))
    rnd = random.Random(5)
    nodes = sorted({ev.src for ev in evs if hasattr(ev, "src")})
    edges = [ev for ev in evs if hasattr(ev, "src")]
    # deletes spread over the stream: nodes (some come back with later edges) and edges
    for pos in sorted(rnd.sample(range(200, len(evs)), 40), reverse=True):
        if rnd.random() < 0.5:
            evs.insert(pos, NodeDelete(rnd.choice(nodes), evs[pos].ts))
        else:
            e = rnd.choice(edges)
            evs.insert(pos, EdgeDelete(e.src, e.dst, evs[pos].ts))
    return evs


def exact_state(state: str) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """The stored final embeddings (``gnnstream embeddings``) and ``gnnstream verify``'s summary."""
    import io
    from gnnstream.workers.offline.jobs import export_embeddings, verify
    buf = io.StringIO()
    export_embeddings(state, buf)
    stored = {obj["id"]: obj for obj in map(json.loads, buf.getvalue().splitlines())}
    return stored, verify(state)


def assert_consumer_within(held: Held, stored: dict[str, dict[str, Any]], min_change: float) -> None:
    """Every stored node's last consumed value is within ``min_change`` of it; every other node ends withdrawn."""
    assert set(stored) <= set(held.row), f"never published: {sorted(set(stored) - set(held.row))[:10]}"
    for node, obj in stored.items():
        row = held.row[node]
        assert row is not None, f"node {node} is stored but the consumer holds a tombstone"
        assert held.version[node] <= obj["version"]
        assert held.mode[node] == obj["mode"], node
        gap = relative_gap(row, obj["embedding"])
        # float32 rows through JSON: a hair of slack over the threshold itself
        assert gap <= min_change + 1e-5, f"node {node}: held value {gap:.4f} (relative L2) from the stored one"
        if min_change == 0:
            assert held.version[node] == obj["version"]
    gone = set(held.row) - set(stored)
    assert all(held.row[node] is None for node in gone), "a deleted node's last message must be a tombstone"


@pytest.mark.parametrize("min_change", [0.0, 0.05])
def test_engine_stream_consumer_stays_within_min_change(otc_events: list, model_dir: str, tmp_path: Path,
                                                        min_change: float) -> None:
    from gnnstream.workers.state import open_engine, open_store
    state = str(tmp_path / "state")
    held, producer = Held(), RecordingProducer()
    resolved = sent = suppressed = deletes_sent = 0
    batches = [otc_events[i:i + 100] for i in range(0, len(otc_events), 100)]
    store = open_store(state, create=True, model_dir=model_dir)
    try:
        engine = open_engine(store, model_dir)
        engine.backfill(publish=True)

        def counting(iids: np.ndarray, computed_at: float) -> UpdateColumns:
            nonlocal resolved
            cols = engine.outbox_columns(iids, computed_at)
            resolved += len(cols)
            return cols

        publisher = publisher_of(store, producer, counting, model=engine.model_tag, min_change=min_change)
        for n, batch in enumerate(batches):
            store.apply(batch)
            engine.recompute(event_ts=max(ev.ts for ev in batch), publish=True)
            if n == len(batches) // 2:
                # a stop with a batch prepared and never delivered, then a new process: what it held is
                # read again from the outbox by a publisher that has kept nothing
                publisher.prepare()
                publisher = publisher_of(store, producer, counting, model=engine.model_tag, min_change=min_change)
                resolved = sent + suppressed  # what the lost batch resolved is resolved again
                continue
            out = cycle(publisher, held)
            sent += len(out)
            suppressed += out.suppressed
            deletes_sent += sum(int(cols.deleted.sum()) for cols in out.columns)
        engine.drain()
        out = cycle(publisher, held)
        sent, suppressed = sent + len(out), suppressed + out.suppressed
        assert not list(store.column("outbox").keys())
    finally:
        store.close()
    assert sent == len(producer.sent)
    assert resolved == sent + suppressed  # every resolved update was either sent or counted as skipped
    stored, summary = exact_state(state)
    assert summary["ok"] is True, summary  # the store stays exact
    assert_consumer_within(held, stored, min_change)
    assert deletes_sent > 0  # the workload withdrew nodes, and the tombstones went out
    print(f"min_change {min_change}: resolved {resolved}, sent {sent}, suppressed {suppressed}")
    if min_change == 0:
        assert suppressed == 0
    else:
        assert suppressed > resolved // 10, "the threshold left out almost nothing: the test tests nothing"


# ---------------------------------------------------------------------- the worker against the broker
@pytest.mark.broker
def test_worker_with_min_change_end_to_end(broker: Any, otc_events: list, model_dir: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch, unique_name: Any) -> None:
    """Two runs of the worker on one state: the Bitcoin OTC prefix, then (a restart: nothing kept) deletes of
    nodes no other event of that run names, so each must end on a tombstone."""
    from gnnstream.stream.events import encode_event, event_key
    from gnnstream.stream.kafka import ensure_topics
    from gnnstream.workers.engine import Engine
    from tests.support import produce, read_topic

    min_change = 0.05
    resolved = [0]
    original = Engine.outbox_columns

    def counting(self: Engine, iids: np.ndarray, computed_at: float) -> UpdateColumns:
        cols = original(self, iids, computed_at)
        resolved[0] += len(cols)
        return cols

    monkeypatch.setattr(Engine, "outbox_columns", counting)
    events_topic, output_topic, dlq_topic = unique_name("ev"), unique_name("emb"), unique_name("dlq")
    ensure_topics(broker.bootstrap, {events_topic: 4, output_topic: 4, dlq_topic: 1})
    state = str(tmp_path / "state")
    published = suppressed = 0.0

    def run(evs: list) -> None:
        nonlocal published, suppressed
        produce(broker.bootstrap, events_topic, [(event_key(ev), encode_event(ev)) for ev in evs])
        worker = Worker(WorkerSettings(bootstrap=broker.bootstrap, state=state, model=model_dir,
                                       events_topic=events_topic, output_topic=output_topic, dlq_topic=dlq_topic,
                                       group=unique_name("g"), partitions=4, batch_size=100, max_batch_size=100,
                                       metrics_port=0, min_change=min_change))
        summary = worker.run(max_idle_s=5.0)
        assert summary["applied"] == len(evs) and summary["pending_outbox"] == 0
        text = worker.metrics.render().decode()
        got = [float(re.search(rf"^{name} (\S+)$", text, flags=re.M).group(1))
               for name in ("gnnstream_embeddings_published_total", "gnnstream_updates_suppressed_total")]
        published += got[0]
        suppressed += got[1]

    run(otc_events)
    stored, _ = exact_state(state)
    gone = sorted(random.Random(1).sample(sorted(stored), 10))
    run([NodeDelete(node, 1.6e9) for node in gone])  # after every Bitcoin OTC event

    records = read_topic(broker.bootstrap, output_topic, 4)
    held = Held()
    held.take((r.key, r.value, r.headers) for r in records)
    print(f"resolved {resolved[0]}, published {published:.0f}, suppressed {suppressed:.0f}")  # reported only
    assert len(records) >= published  # at least once
    assert suppressed == resolved[0] - published  # the counter is what was skipped
    assert suppressed > 0  # the threshold left something out (small batches: many small moves)
    stored, verified = exact_state(state)
    assert verified["ok"] is True, verified  # the store stays exact
    assert not set(gone) & set(stored)
    assert all(held.row[node] is None for node in gone)  # deletes always go out
    assert_consumer_within(held, stored, min_change)
