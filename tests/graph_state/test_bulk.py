"""A bulk load leaves the state exactly as ``GraphStore.apply`` of the same events in the same order: every
family compared record by record, on seeded random streams with deletes, self-loops and repeated upserts."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest

import gnnstream.graph_state.bulk as bulk_module
import gnnstream.graph_state.bulk_tables as bulk_tables
from gnnstream.graph_state import keys
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
        monkeypatch.setattr(bulk_tables, "_RANK_SLICE", 1 + seed)
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
    from tests.workers.reference import call_gnnstream
    files = {  # name: (events, nodes after the load, events in the bulk part)
        "empty": ([], 0, 0),
        "features": ([NodeUpsert("a", 1, (1.0, 2.0)), NodeUpsert("b", 2, (0.5, 0.5))], 2, 2),
        "a delete first": ([NodeDelete("a", 1), EdgeUpsert("a", "b", 2, 1.0)], 2, 0),
    }
    for name, (events, nodes, bulk) in files.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(b"".join(encode_event(ev) + b"\n" for ev in events))
        done = call_gnnstream("graph", "load", "--state", tmp_path / name, path, "--seed", 0)
        assert done.returncode == 0, done.stderr
        summary = json.loads(done.stdout)
        assert (summary["events"], summary["nodes"], summary["bulk_events"]) == (len(events), nodes, bulk), summary


def test_graph_load_takes_the_number_of_workers(tmp_path: Path) -> None:
    from gnnstream.stream.events import encode_event
    from tests.workers.reference import call_gnnstream, run_gnnstream  # --workers 2 forks: its own process
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"".join(encode_event(ev) + b"\n" for ev in _without_node_deletes(2, n=40)))
    states = {}
    for workers in ("1", "2"):
        done = run_gnnstream("graph", "load", "--state", tmp_path / workers, path, "--seed", 0, "--workers", workers)
        assert done.returncode == 0, done.stderr
        with GraphStore(tmp_path / workers) as store:
            states[workers] = {family: list(store.column(family).items()) for family in keys.COLUMN_FAMILIES}
    assert states["1"] == states["2"] and len(states["1"]["nbrs"]) > 50
    refused = call_gnnstream("graph", "load", "--state", tmp_path / "zero", path, "--workers", "0")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        "gnnstream graph load: error: argument --workers: expected an integer >= 1 (got '0')")


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


def _renamed(name: str) -> str:
    """Names of several lengths, some with multi-byte characters (their UTF-8 is what the keys hold)."""
    return name if not name[1:].isdigit() else name + "é" * (int(name[1:]) % 3) + "x" * (int(name[1:]) % 5)


def _load_with_workers(path: Path, events: list, columns: list, workers: int, ttl: int,
                       record_pids: Path | None = None) -> dict:
    """The state a bulk load of ``events`` (one at a time), then of the edge upserts ``columns`` (as columns)
    leaves, family by family."""
    with GraphStore(path, seed=7, edge_ttl=ttl) as store:
        if record_pids is not None:  # each table file's family and the process that wrote it
            write = store.write_table

            def recorded(family: str, file: str, items: object) -> int:
                (record_pids / f"{os.getpid()}-{os.path.basename(file)}").touch()
                return write(family, file, items)

            store.write_table = recorded
        load = BulkLoad(store, fanouts=(2, 3), workers=workers)
        for ev in events:
            load.add(ev)
        load.add_edges([ev.src for ev in columns], [ev.dst for ev in columns],
                       np.asarray([ev.weight for ev in columns]), np.asarray([ev.ts for ev in columns]))
        load.finish()
    with GraphStore(path) as store:
        return {family: list(store.column(family).items()) for family in keys.COLUMN_FAMILIES}


@pytest.mark.parametrize("ttl", [0, 400])
def test_bulk_loads_with_one_two_and_three_workers_leave_the_same_state(
        tmp_path: Path, ttl: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every column family, record for record, whatever the number of processes looking names up and writing
    the table files, and as applying the events leaves it; the small parts, chunks and rank slices make each
    worker's range span several of each."""
    monkeypatch.setattr(bulk_module, "_LOOKUPS_PER_WORKER", 5)
    monkeypatch.setattr(bulk_tables, "_CHUNK", 7)
    monkeypatch.setattr(bulk_tables, "_RANK_SLICE", 11)
    events = [dataclasses.replace(ev, **{field: _renamed(getattr(ev, field)) for field in ("id", "src", "dst")
                                         if hasattr(ev, field)})
              for ev in _without_node_deletes(4, n=60)]
    events, columns = events[:600], [ev for ev in events[600:] if ev.op == "edge_upsert"]
    columns += [EdgeUpsert(f"new{i % 7}", f"v{i}", 1001 + i, 0.5) for i in range(40)]  # names seen first here
    (tmp_path / "pids").mkdir()
    one = _load_with_workers(tmp_path / "one", events, columns, 1, ttl)
    two = _load_with_workers(tmp_path / "two", events, columns, 2, ttl, record_pids=tmp_path / "pids")
    three = _load_with_workers(tmp_path / "three", events, columns, 3, ttl)
    assert one == two
    assert one == three
    assert len(one["nbrs"]) > 100 and one["sampled"] and one["feats"] and (one["expiry"] if ttl else True)
    assert any(len(key) > 20 for key, _ in one["nbrs"])  # the multi-byte names are in it
    families = GRAPH_FAMILIES + ("born", "expiry")
    with GraphStore(tmp_path / "applied", seed=7, edge_ttl=ttl) as applied:
        applied.apply(events)
        applied.apply(columns)
        assert {f: list(applied.column(f).items()) for f in families} == {f: one[f] for f in families}
    writers: dict[str, set[int]] = {}
    for marker in (tmp_path / "pids").iterdir():
        pid, file = marker.name.split("-", 1)
        writers.setdefault(file.rsplit("-", 1)[0], set()).add(int(pid))
    assert {family: len(pids) for family, pids in writers.items()} == {
        **{family: 2 for family in ("ids", "names", "nodes", "born", "feats", "edges", "nbrs")},
        **({"expiry": 2} if ttl else {}), "sampled.sst": 1}, writers  # two processes; the snapshot after them


def test_neighbour_entries_that_share_a_rank_are_ordered_by_name() -> None:
    vs = np.asarray([0, 0, 0, 1, 1])
    us = np.asarray([3, 1, 2, 4, 0])
    name_order = np.asarray([4, 0, 3, 1, 2])  # names by bytes: 1, 3, 4, 2, 0
    tied = np.asarray([5, 5, 2, 7, 7], dtype=">u8")
    assert bulk_tables._index_order(vs, tied, us, name_order).tolist() == [2, 1, 0, 3, 4]
    rng = np.random.default_rng(0)
    vs = np.sort(rng.integers(0, 50, 1000))
    us = rng.permutation(1000)
    ranks = rng.integers(0, 1 << 63, 1000).astype(">u8") << 1  # no two alike: one sort
    assert bulk_tables._index_order(vs, ranks, us, np.arange(1000)).tolist() == np.lexsort((us, ranks, vs)).tolist()


def test_a_failing_bulk_load_worker_fails_the_load_and_leaves_the_state_empty(tmp_path: Path) -> None:
    parent = os.getpid()
    with GraphStore(tmp_path / "s", seed=0) as store:
        write = store.write_table

        def full_disk(family: str, path: str, items: object) -> int:
            if os.getpid() != parent:
                raise OSError(28, "No space left on device")
            return write(family, path, items)

        store.write_table = full_disk
        load = BulkLoad(store, workers=2)
        for ev in _without_node_deletes(0, n=30):
            load.add(ev)
        with pytest.raises(OSError, match="No space left on device") as failed:
            load.finish()
        assert "(in bulk load worker 1)" in failed.value.__notes__
        assert BulkLoad.takes(store) and store.num_nodes() == 0
        assert [p.name for p in Path(store.path).iterdir() if p.name.startswith(".bulk-")] == []
    for workers in (0, -1, 1.5, True):
        with GraphStore(tmp_path / f"w{workers}", seed=0) as store, \
                pytest.raises(ValueError, match="positive whole number of bulk load workers"):
            BulkLoad(store, workers=workers)
