"""Every worker metric of the recompute and of the consumer moves, by exactly what was built.

``Worker._recompute`` (where the worker sets the recompute's metrics) runs
an engine on a hand-made graph of a one-layer GraphSAGE model with fanout 3:

* hub ``h1`` with 10 leaves and hub ``h2`` with 5: their neighbourhoods
  exceed the fanout (``gnnstream_fanout_capped_total``); ``m`` with exactly
  3 leaves does not;
* every sample is known (a leaf samples its centre, a centre 3 of its
  leaves), so ``gnnstream_sampled_neighbours``, ``gnnstream_subgraph_edges``
  and ``gnnstream_dirty_nodes`` have exact values;
* with ``hub_bound`` 2, new features of ``h1`` (10 dependents) defer its
  propagation (``gnnstream_deferred_hubs``); the engine's clock is a fake
  one, so ``gnnstream_deferred_staleness_seconds`` is the exact time the
  deferral has waited, until a drain catches it up.

``gnnstream_consumer_lag`` comes from a real consumer of the embedded broker
(both clients) that has been handed part of a partition.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import pytest

from gnnstream.graph_state.store import GraphStore
from gnnstream.model import init_model_dir, load_model_dir
from gnnstream.stream.backends import KAFKA_CLIENTS, open_consumer, open_producer
from gnnstream.stream.broker import EmbeddedBroker
from gnnstream.stream.clients import Record
from gnnstream.stream.events import EdgeUpsert, Event, NodeUpsert
from gnnstream.stream.kafka import ensure_topics
from gnnstream.workers.engine import engine as engine_module
from gnnstream.workers.engine import Engine
from gnnstream.workers.settings import WorkerSettings
from gnnstream.workers.runtime.worker import Worker
from tests.workers.reference import fast_tempdir

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FANOUT = 3
HUB_BOUND = 2
LEAVES = {"h1": 10, "h2": 5, "m": FANOUT}  # centre -> its leaves (edges leaf -> centre)
CAPPED = [c for c, n in LEAVES.items() if n > FANOUT]  # h1, h2


TICK = 1e-6


class _Clock:
    """The engine's ``time`` module with a monotonic clock the test sets; like a real one, it has moved on
    (by :data:`TICK`) at each reading."""

    def __init__(self) -> None:
        self.now = 0.0
        self.perf_counter, self.time = time.perf_counter, time.time

    def monotonic(self) -> float:
        self.now += TICK
        return self.now - TICK


@pytest.fixture
def tmp_path() -> Any:
    with fast_tempdir() as d:
        yield Path(d)


def _value(worker: Worker, name: str, **labels: str) -> float | None:
    return worker.metrics.registry.get_sample_value(name, labels)


def _snapshot(worker: Worker) -> dict[str, float | None]:
    return {"capped": _value(worker, "gnnstream_fanout_capped_total"),
            "sampled_sum": _value(worker, "gnnstream_sampled_neighbours_sum"),
            "sampled_count": _value(worker, "gnnstream_sampled_neighbours_count"),
            "edges_sum": _value(worker, "gnnstream_subgraph_edges_sum"),
            "edges_count": _value(worker, "gnnstream_subgraph_edges_count"),
            "dirty": _value(worker, "gnnstream_dirty_nodes", layer="1"),
            "deferred": _value(worker, "gnnstream_deferred_hubs"),
            "staleness": _value(worker, "gnnstream_deferred_staleness_seconds"),
            "deferred_total": _value(worker, "gnnstream_deferred_hub_propagations_total")}


def test_recompute_metrics_move_by_what_the_graph_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(engine_module, "time", clock)
    init_model_dir(str(tmp_path / "model"), arch="sage", in_dim=2, hidden=4, out_dim=2, layers=1, fanouts=[FANOUT],
                   seed=0)
    worker = Worker(WorkerSettings(state=str(tmp_path / "state"), metrics_port=0))
    store = GraphStore(str(tmp_path / "state"), seed=0)
    try:
        engine = Engine(store, load_model_dir(str(tmp_path / "model")), hub_bound=HUB_BOUND,
                        max_deferred_age=3600.0)
        if engine.needs_backfill():
            engine.backfill()
        before = _snapshot(worker)
        assert before["capped"] == 0 and before["sampled_count"] == 0 and before["dirty"] is None

        def batch(events: list[Event], drain: bool = False) -> dict[str, float | None]:
            result = store.apply(events)
            worker._recompute(engine, result.max_ts if events else None, None, drain=drain)
            return _snapshot(worker)

        # 1: the whole graph, drained (nothing deferred). Every node is recomputed; a leaf samples its
        # centre, a centre min(3, leaves) leaves; the two hubs are capped, m (exactly 3) is not
        graph: list[Event] = []
        for centre, n in LEAVES.items():
            graph.append(NodeUpsert(centre, 1.0, (1.0, -1.0)))
            for i in range(n):
                leaf = f"{centre}-{i}"
                graph += [NodeUpsert(leaf, 1.0, (0.5, float(i))), EdgeUpsert(leaf, centre, 1.0)]
        nodes = len(LEAVES) + sum(LEAVES.values())
        sampled = sum(LEAVES.values()) + sum(min(n, FANOUT) for n in LEAVES.values())
        got = batch(graph, drain=True)
        assert got == {"capped": len(CAPPED), "sampled_sum": sampled, "sampled_count": 1,
                       "edges_sum": sampled + nodes, "edges_count": 1, "dirty": nodes, "deferred": 0,
                       "staleness": 0, "deferred_total": 0}

        # 2: new features of h1: its 10 dependents exceed hub_bound, so only h1 is recomputed (capped again)
        # and its propagation is deferred; the clock of the deferral starts when a recompute finds it
        got = batch([NodeUpsert("h1", 2.0, (3.0, 3.0))])
        assert got == {"capped": len(CAPPED) + 1, "sampled_sum": sampled + FANOUT, "sampled_count": 2,
                       "edges_sum": sampled + nodes + FANOUT + 1, "edges_count": 2, "dirty": 1, "deferred": 1,
                       "staleness": 0, "deferred_total": 1}

        # 3 and 4: a new isolated node, then its new features, 7.5 s apart: the deferral waits meanwhile
        clock.now = 1000.0
        got = batch([NodeUpsert("z", 3.0, (1.0, 1.0))])
        assert (got["dirty"], got["deferred"], got["deferred_total"], got["capped"]) == (1, 1, 1, len(CAPPED) + 1)
        assert got["staleness"] == pytest.approx(0.0, abs=100 * TICK)
        clock.now = 1007.5
        got = batch([NodeUpsert("z", 4.0, (2.0, 2.0))])
        assert (got["dirty"], got["deferred"], got["deferred_total"]) == (1, 1, 1)
        assert got["staleness"] == pytest.approx(7.5, abs=100 * TICK)
        assert (got["sampled_sum"], got["sampled_count"]) == (sampled + FANOUT, 4)  # z has no neighbour

        # 5: a drain catches h1 up: its 10 leaves, each sampling h1 alone, none capped
        clock.now = 1010.0
        got = batch([], drain=True)
        leaves = LEAVES["h1"]
        assert got == {"capped": len(CAPPED) + 1, "sampled_sum": sampled + FANOUT + leaves, "sampled_count": 5,
                       "edges_sum": sampled + nodes + FANOUT + 1 + 1 + 1 + 2 * leaves, "edges_count": 5,
                       "dirty": leaves, "deferred": 0, "staleness": 0, "deferred_total": 1}
        assert engine.pending() == 0
    finally:
        store.close()


@pytest.mark.broker
@pytest.mark.parametrize("kafka_client", KAFKA_CLIENTS)
def test_consumer_lag_is_what_the_partition_holds_past_the_position(
        kafka_client: str, broker: EmbeddedBroker, unique_name: Callable[[str], str], tmp_path: Path) -> None:
    """10 records, a consumer started at offset 4 and handed 2: the lag gauge of the partition is 4, then 0."""
    topic = unique_name("lag")
    ensure_topics(broker.bootstrap, {topic: 1})
    with open_producer(kafka_client, broker.bootstrap) as producer:
        for i in range(10):
            producer.send(topic, b"k", f"v{i}".encode())
        assert producer.flush(10) == 10
    worker = Worker(WorkerSettings(state=str(tmp_path / "s"), metrics_port=0))
    with open_consumer(kafka_client, broker.bootstrap, topic, unique_name("g"),
                       on_assign=lambda parts: {(topic, 0): 4}) as consumer:
        got: list[Record] = []
        deadline = time.monotonic() + 30  # a safety net only
        while len(got) < 2 and time.monotonic() < deadline:
            got += consumer.poll_batch(max_records=2 - len(got), timeout_s=0.5)
        assert [r.offset for r in got] == [4, 5]
        worker._report_lag(consumer)
        assert _value(worker, "gnnstream_consumer_lag", partition="0") == 4
        while len(got) < 6 and time.monotonic() < deadline:
            got += consumer.poll_batch(max_records=6 - len(got), timeout_s=0.5)
        assert [r.offset for r in got] == list(range(4, 10))
        worker._report_lag(consumer)
        assert _value(worker, "gnnstream_consumer_lag", partition="0") == 0


def test_event_time_metrics_move_with_the_window_and_the_stages(tmp_path: Path) -> None:
    """A window of 100 s and a staged policy (features only below 10 s of age, expanded below 20 s): stream
    time, expired edges, late upserts and stage changes are exported as the store and engine count them."""
    staged = {"policy": "staged", "feature_only_s": 10, "expand_s": 20, "min_neighbours": 5}
    init_model_dir(str(tmp_path / "model"), arch="sage", in_dim=2, hidden=4, out_dim=2, layers=1, fanouts=[2],
                   seed=0, cold_start=staged)
    worker = Worker(WorkerSettings(state=str(tmp_path / "state"), metrics_port=0))
    store = GraphStore(str(tmp_path / "state"), seed=0, edge_ttl=100)
    try:
        engine = Engine(store, load_model_dir(str(tmp_path / "model")))
        if engine.needs_backfill():
            engine.backfill()

        def batch(events: list[Event]) -> dict[str, float | None]:
            worker._applied(store.apply(events))
            worker._recompute(engine, None, None)
            return {"T": _value(worker, "gnnstream_stream_time_seconds"),
                    "expired": _value(worker, "gnnstream_edges_expired_total"),
                    "late": _value(worker, "gnnstream_late_events_total"),
                    "expanded": _value(worker, "gnnstream_stage_changes_total", stage="expanded"),
                    "full": _value(worker, "gnnstream_stage_changes_total", stage="full")}

        # a and b are born at 1000 with one edge; c and d at 1005
        got = batch([NodeUpsert("a", 1000.0, (1.0, 0.0)), EdgeUpsert("a", "b", 1000.0),
                     NodeUpsert("c", 1005.0, (0.0, 1.0)), EdgeUpsert("c", "d", 1005.0)])
        assert got == {"T": 1005.0, "expired": 0, "late": 0, "expanded": None, "full": None}
        # T = 1012: a and b (age 12) enter the expanded stage; c and d (age 7) do not yet
        got = batch([EdgeUpsert("e", "f", 1012.0)])
        assert got == {"T": 1012.0, "expired": 0, "late": 0, "expanded": 2, "full": None}
        # T = 1101: a->b (t = 1000 <= 1101 - 100) expires; a late upsert (ts 1001) neither adds nor refreshes;
        # it still creates x and y, born at 1001. A timer (first(v) + 10 or + 20) fires in (1012, 1101] for a, b,
        # c, d, e, f and x, y; each is counted once, by the stage it is in at 1101: full
        got = batch([EdgeUpsert("g", "h", 1101.0), EdgeUpsert("x", "y", 1001.0)])
        assert got == {"T": 1101.0, "expired": 1, "late": 1, "expanded": 2, "full": 8}
    finally:
        store.close()
