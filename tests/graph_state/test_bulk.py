"""A bulk load leaves the state exactly as ``GraphStore.apply`` of the same events in the same order: every
family compared record by record, on seeded random streams with deletes, self-loops and repeated upserts."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

import gnnstream.graph_state.bulk as bulk_module
from gnnstream.graph_state.bulk import BulkLoad
from gnnstream.graph_state.exceptions import StoreConfigError
from gnnstream.graph_state.store import GraphStore
from gnnstream.stream.events import EdgeDelete, EdgeUpsert, NodeDelete, NodeUpsert
from tests.graph_state._events import random_batches

GRAPH_FAMILIES = ("ids", "names", "nodes", "feats", "edges", "nbrs")


def _records(store: GraphStore) -> dict[str, list[tuple[bytes, bytes]]]:
    return {family: list(store.column(family).items()) for family in GRAPH_FAMILIES}


def _next_iid(store: GraphStore) -> int:
    return json.loads(store.column("meta").get(b"next_iid"))


def _without_node_deletes(seed: int, n: int) -> list:
    return [ev for batch in random_batches(seed, 20, 50, n_nodes=n) for ev in batch if ev.op != "node_delete"]


@pytest.mark.parametrize("seed", range(6))
def test_bulk_load_equals_apply(tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    if seed % 2:  # neighbour lists ranked a few entries at a time: slices end between whole lists
        monkeypatch.setattr(bulk_module, "_RANK_SLICE", 1 + seed)
    events = _without_node_deletes(seed, n=[5, 30, 80][seed % 3])
    with GraphStore(tmp_path / "applied", seed=seed) as applied:
        for start in range(0, len(events), 64):
            applied.apply(events[start:start + 64])
        want = _records(applied)
        want_meta = _next_iid(applied), applied.feature_dim
    with GraphStore(tmp_path / "bulk", seed=seed) as store:
        load = BulkLoad(store)
        for ev in events:
            load.add(ev)
        counts = load.finish()
        assert _records(store) == want
        assert (_next_iid(store), store.feature_dim) == want_meta
        assert counts["events"] == len(events) and counts["edges"] == len(want["edges"])
    with GraphStore(tmp_path / "bulk") as store:  # reopened: the same, and the store goes on applying
        assert _records(store) == want
        more = [EdgeUpsert("new", "v1", 10_000, 1.0), NodeDelete("hub", 10_001)]
        store.apply(more)
    with GraphStore(tmp_path / "applied") as applied:
        applied.apply(more)
        want = _records(applied)
    with GraphStore(tmp_path / "bulk") as store:
        assert _records(store) == want


def test_columns_and_events_mix_and_the_last_event_of_a_pair_wins(tmp_path: Path) -> None:
    events = [
        EdgeDelete("x", "y", 1),  # names nodes no upsert has named yet: nothing to delete
        EdgeUpsert("x", "y", 2, 1.0),
        EdgeUpsert("y", "x", 3, 2.0),
        EdgeDelete("x", "y", 4),  # y -> x still links them
        NodeUpsert("x", 5, (1.0, 2.0)),
        EdgeUpsert("z", "z", 6, 3.0),  # a self-loop: an edge, no neighbour
        NodeUpsert("x", 7, (3.0, 4.0)),
    ]
    with GraphStore(tmp_path / "applied", seed=3) as applied:
        applied.apply(events)
        applied.apply([EdgeUpsert("a", "b", 8, 0.5), EdgeUpsert("b", "c", 8, 0.25), NodeUpsert("c", 9, (0.0, 1.0))])
        want = _records(applied)
    with GraphStore(tmp_path / "bulk", seed=3) as store:
        load = BulkLoad(store)
        for ev in events:
            load.add(ev)
        load.add_edges(["a", "b"], ["b", "c"], np.asarray([0.5, 0.25]), np.asarray([8, 8]))
        load.add_nodes(["c"], np.asarray([9]), np.asarray([[0.0, 1.0]]))
        load.finish()
        assert _records(store) == want
        assert store.neighbors("x") == ["y"] and store.degree("z") == 0
        assert store.features("x").tolist() == [3.0, 4.0]


def test_bulk_load_refuses_what_it_cannot_take(tmp_path: Path) -> None:
    with GraphStore(tmp_path / "s", seed=0) as store:
        load = BulkLoad(store)
        with pytest.raises(ValueError, match="node_delete"):
            load.add(NodeDelete("a", 1))
        with pytest.raises(ValueError, match="finite ts"):
            load.add(EdgeUpsert("a", "b", float("nan"), 1.0))
        load.add(EdgeUpsert("a", "b", 1, 1.0))
        load.finish()
        with pytest.raises(StoreConfigError, match="needs an empty state"):
            BulkLoad(store)
    with GraphStore(tmp_path / "t", seed=0) as store:
        store.set_fanouts([2])
        with pytest.raises(StoreConfigError, match="fanouts"):
            BulkLoad(store)


def test_a_bulk_load_cut_short_refuses_to_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with GraphStore(tmp_path / "s", seed=0) as store:
        load = BulkLoad(store)
        for ev in itertools.islice(_without_node_deletes(1, 20), 200):
            load.add(ev)

        def crash(*args: object, **kw: object) -> None:
            raise KeyboardInterrupt

        real = store._cf["nbrs"]
        monkeypatch.setattr(store, "_cf", {**store._cf, "nbrs": type("Crashing", (), {
            "ingest_external_file": crash, "close": real.close})()})
        with pytest.raises(KeyboardInterrupt):
            load.finish()
        monkeypatch.undo()
    with pytest.raises(StoreConfigError, match="bulk load .* was cut short; delete the directory"):
        GraphStore(tmp_path / "s")


@pytest.mark.parametrize("seed", range(3))
def test_bulk_load_writes_the_sampled_by_index_of_the_fanouts(tmp_path: Path, seed: int) -> None:
    events = _without_node_deletes(seed, n=40)
    fanouts = (2, 5)
    with GraphStore(tmp_path / "applied", seed=seed) as applied:
        applied.set_fanouts(fanouts)
        applied.apply(events)
        everyone = np.arange(json.loads(applied.column("meta").get(b"next_iid")), dtype=np.int64)
        want = {k: [sorted(applied.sampled_by(k, u)) for u in everyone.tolist()] for k in fanouts}
        want_rows = {k: applied.sample_matrix(k, everyone) for k in fanouts}
    with GraphStore(tmp_path / "bulk", seed=seed) as store:
        load = BulkLoad(store, fanouts=fanouts)
        for ev in events:
            load.add(ev)
        load.finish()
    with GraphStore(tmp_path / "bulk") as store:  # reopened: the index is read from the snapshot
        assert store.fanouts == fanouts
        for k in fanouts:
            assert [sorted(store.sampled_by(k, u)) for u in everyone.tolist()] == want[k], k
            assert np.array_equal(store.sample_matrix(k, everyone), want_rows[k]), k
        assert sum(map(len, want[2])) > 0


@pytest.mark.parametrize("events", [
    [],
    [NodeUpsert("a", 1, (1.0, 2.0)), NodeUpsert("b", 2, (0.5, 0.5))],
    [EdgeDelete("x", "y", 1)],
], ids=["nothing", "features only", "a delete of nothing"])
def test_a_bulk_load_without_edges_equals_apply(tmp_path: Path, events: list) -> None:
    with GraphStore(tmp_path / "applied", seed=0) as applied:
        applied.apply(events)
        want = _records(applied)
    with GraphStore(tmp_path / "bulk", seed=0) as store:
        load = BulkLoad(store, fanouts=(2,))
        for ev in events:
            load.add(ev)
        assert load.finish()["edges"] == 0
        assert _records(store) == want
    with pytest.raises(ValueError, match="non-empty string node id"):
        with GraphStore(tmp_path / "names", seed=0) as store:
            BulkLoad(store).add_edges(["a", ""], ["b", "c"], np.ones(2), np.ones(2))


def test_graph_load_into_a_new_state_takes_files_without_edges(tmp_path: Path) -> None:
    from gnnstream.stream.events import encode_event
    from tests.workers.reference import run_gnnstream
    files = {  # name: (events, nodes after the load, events in the bulk part)
        "empty": ([], 0, 0),
        "features": ([NodeUpsert("a", 1, (1.0, 2.0)), NodeUpsert("b", 2, (0.5, 0.5))], 2, 2),
        "a delete first": ([NodeDelete("a", 1), EdgeUpsert("a", "b", 2, 1.0)], 2, 0),
    }
    for name, (events, nodes, bulk) in files.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(b"".join(encode_event(ev) + b"\n" for ev in events))
        done = run_gnnstream("graph", "load", "--state", tmp_path / name, path, "--seed", 0)
        assert done.returncode == 0, done.stderr
        summary = json.loads(done.stdout)
        assert (summary["events"], summary["nodes"], summary["bulk_events"]) == (len(events), nodes, bulk), summary


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ttl", [0, 7, 40])
def test_a_windowed_bulk_load_equals_apply(tmp_path: Path, seed: int, ttl: int) -> None:
    """Out-of-order times, late upserts and re-created edges: the bulk load applies the window at its final
    stream time and leaves every family (the born and expiry indexes included) as applying in batches does."""
    rnd = np.random.default_rng(seed)
    events = _without_node_deletes(seed, n=30)
    t = np.cumsum(rnd.uniform(0, 0.3, len(events))) - rnd.choice([0, 0, 0, 2, 9, 50], len(events))
    events = [dataclasses.replace(ev, ts=float(round(ts, 2))) for ev, ts in zip(events, t)]
    families = GRAPH_FAMILIES + ("born", "expiry")
    with GraphStore(tmp_path / "applied", seed=seed, edge_ttl=ttl) as applied:
        late = expired = 0
        for start in range(0, len(events), 64):
            r = applied.apply(events[start:start + 64])
            late, expired = late + r.late_events, expired + r.expired_edges
        want = {f: list(applied.column(f).items()) for f in families}
        want_time = applied.stream_time
    if ttl == 7:
        assert late and expired  # the stream exercises both
    with GraphStore(tmp_path / "bulk", seed=seed, edge_ttl=ttl) as store:
        load = BulkLoad(store)
        for ev in events:
            load.add(ev)
        load.finish()
        assert {f: list(store.column(f).items()) for f in families} == want
        assert store.stream_time == want_time
