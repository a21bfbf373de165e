"""The incremental engine against from-scratch and an independent PyG reference.

Property tests (GraphSAGE, GCN, GAT): random event streams with a hub above
the store's cached rank prefix, self loops, reciprocal edges, deletes and
feature-less nodes, applied in random batches with random restarts and skipped
recomputes, must end with stored embeddings equal to ``Engine.from_scratch``
and to :mod:`tests.workers.reference`; the outbox must tell consumers the same.
"""

from __future__ import annotations

import gc
import random
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from gnnstream.graph_state.store import GraphStore
from gnnstream.model import init_model_dir, load_model_dir
from gnnstream.stream.events import EdgeUpsert, NodeDelete, NodeUpsert
from tests.graph_state._events import random_batches
from tests.support import DIM, FANOUTS, HUB, LEAVES, MODELS, SEED, SETTINGS
from tests.support import event_group as _event_group, nonzero_features as _nonzero, to_event as _to_event
from tests.workers.reference import (
    ATOL,
    GraphFold,
    assert_embeddings_close,
    call_gnnstream,
    expected_modes,
    fast_tempdir,
    neighbourhoods,
    rank,
    reference_embeddings,
)
from gnnstream.workers.engine import Engine
from gnnstream.graph_state.outbox import decode_record
from gnnstream.graph_state.page_log import EmbeddingMeta, PageLog


@pytest.fixture
def tmp_path() -> Any:
    """RocksDB directories on tmpfs when available (overrides pytest's tmp_path here)."""
    with fast_tempdir() as d:
        yield Path(d)


@pytest.fixture(scope="module", autouse=True)
def _frozen_gc() -> Any:
    """GraphStore.close() runs gc.collect(); with torch, PyG and hypothesis loaded a full collection
    takes ~0.5 s. Freezing what exists before the tests keeps each close cheap."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


# ---------------------------------------------------------------------- streams
@st.composite
def streams(draw: Any) -> dict[str, Any]:
    """A random stream, its batching, and how the engine is driven."""
    rnd = draw(st.randoms(use_true_random=False))
    # A hub with more neighbours than the store's cached rank prefix (32) and the fanouts,
    # some of them reciprocal, interleaved with random events touching the hub, leaves and a pool.
    n_leaves = draw(st.integers(34, len(LEAVES)))
    hub_steps = []
    for leaf in LEAVES[:n_leaves]:
        r = rnd.random()
        if r < 0.45:
            hub_steps.append([("edge_upsert", HUB, leaf)])
        elif r < 0.9:
            hub_steps.append([("edge_upsert", leaf, HUB)])
        else:
            hub_steps.append([("edge_upsert", HUB, leaf), ("edge_upsert", leaf, HUB)])
        if rnd.random() < 0.3:
            hub_steps.append([("node_upsert", leaf, _nonzero(rnd))])
    random_steps = draw(st.lists(_event_group(), min_size=5, max_size=45))
    steps = hub_steps + random_steps
    # keep each group in place but interleave the hub prefix with the random steps
    rnd.shuffle(steps)
    flat = [s for group in steps for s in group]
    events = [_to_event(step, 1000 + i) for i, step in enumerate(flat)]
    batches, i = [], 0
    while i < len(events):
        size = rnd.choice([1, 2, 3, 5, 8, 13, 25, 60])
        batches.append(events[i:i + size])
        i += size
    return {
        "batches": batches,
        "hub_bound": draw(st.sampled_from([3, 3, 50_000])),
        "max_deferred_age": draw(st.sampled_from([0.0, 3600.0])),
        # per batch: recompute after it (else marks accumulate), restart (close/reopen) after it
        "recompute": [rnd.random() < 0.85 for _ in batches],
        "restart": _at_most(rnd, len(batches), 2),
    }


def _at_most(rnd: random.Random, n: int, count: int) -> list[bool]:
    picks = {rnd.randrange(n) for _ in range(rnd.randint(0, count))}
    return [i in picks for i in range(n)]


# ---------------------------------------------------------------------- helpers
class _Entry(NamedTuple):
    node: str
    version: int
    mode: str
    embedding: np.ndarray | None  # None: withdrawn


class _Publisher:
    """What the worker's publisher sends: outbox records read after each recompute, resolved then."""

    def __init__(self) -> None:
        self.entries: list = []
        self._read: set[bytes] = set()

    def collect(self, engine: Engine) -> list:
        for key, raw in engine.store.column("outbox").items():
            if key not in self._read:
                self._read.add(key)
                computed_at, iids = decode_record(raw)
                c = engine.outbox_columns(iids, computed_at)
                self.entries.extend(_Entry(node, version, mode, None if gone else row)
                                    for node, version, mode, gone, row
                                    in zip(c.names, c.versions.tolist(), c.modes, c.deleted.tolist(), c.rows))
        return self.entries


def _final_stored(engine: Engine) -> dict[str, np.ndarray]:
    """Final embeddings read back from RocksDB (caches dropped first)."""
    engine.tables.clear()
    store = engine.store
    iids = np.fromiter(store.node_iids(), dtype=np.int64)
    rows, present = engine.tables.get(engine.num_layers, iids)
    missing = [store.name(int(i)) for i in iids[~present]]
    assert not missing, f"nodes without a stored final embedding: {missing[:10]}"
    return {store.name(int(i)): rows[n] for n, i in enumerate(iids)}


def _metas(store: GraphStore) -> dict[str, EmbeddingMeta]:
    """Metadata of live embeddings (a deleted node keeps a "deleted" meta as its version floor)."""
    metas = {store.name(iid): m for iid, m, _ in PageLog(store).items()}
    return {v: m for v, m in metas.items() if m.mode != "deleted"}


def _stored_final(store: GraphStore, iid: int) -> tuple[EmbeddingMeta, np.ndarray | None]:
    """What the page log holds for one node, read by a fresh table."""
    found = [(m, row) for i, m, row in PageLog(store).items() if i == iid]
    assert len(found) == 1, f"{len(found)} current records for iid {iid}"
    return found[0]


def _from_scratch(engine: Engine) -> dict[str, np.ndarray]:
    targets, rows = engine.from_scratch()
    return {engine.store.name(int(i)): rows[n] for n, i in enumerate(targets)}


def _check_outbox_versions(entries: list, seen: dict[str, tuple[int, str]]) -> None:
    """Per node, versions strictly increase in outbox order (a re-created node is checked elsewhere)."""
    for e in entries:
        prev = seen.get(e.node)
        if prev is not None and prev[1] != "deleted":
            assert e.version > prev[0], f"node {e.node!r}: version {e.version} published after {prev[0]}"
        seen[e.node] = (e.version, e.mode)


def run_stream(model_dir: Path, batches: list[list], *, hub_bound: int = 50_000, max_deferred_age: float = 5.0,
               recompute: list[bool] | None = None, restart: list[bool] | None = None) -> dict[str, Any]:
    """Apply ``batches`` through store + engine, drain, and check every invariant; returns what it saw."""
    model = load_model_dir(model_dir)
    with fast_tempdir() as tmp:
        path = Path(tmp) / "state"
        store = GraphStore(path, seed=SEED)
        try:
            engine = Engine(store, model, hub_bound=hub_bound, max_deferred_age=max_deferred_age)
            fold = GraphFold()
            versions: dict[str, tuple[int, str]] = {}
            read = deferred = 0
            pub = _Publisher()
            for n, batch in enumerate(batches):
                store.apply(batch)
                for ev in batch:
                    fold.apply_event(ev)
                if recompute is None or recompute[n]:
                    deferred += engine.recompute(event_ts=max(ev.ts for ev in batch)).deferred
                    entries = pub.collect(engine)
                    _check_outbox_versions(entries[read:], versions)
                    read = len(entries)
                if restart is not None and restart[n]:
                    store.close()
                    store = GraphStore(path)
                    engine = Engine(store, model, hub_bound=hub_bound, max_deferred_age=max_deferred_age)
            engine.drain()
            assert engine.pending() == 0
            entries = pub.collect(engine)
            _check_outbox_versions(entries[read:], versions)

            # the store holds the folded graph
            assert set(store.nodes()) == fold.nodes
            assert {(s, d) for s, d, _, _ in store.edges()} == fold.edges

            stored = _final_stored(engine)
            scratch = _from_scratch(engine)
            ref = reference_embeddings(fold.nodes, fold.edges, fold.features, model_dir)
            assert_embeddings_close(scratch, ref, what="Engine.from_scratch vs PyG reference")
            assert_embeddings_close(stored, scratch, what="stored vs Engine.from_scratch")
            assert_embeddings_close(stored, ref, what="stored vs PyG reference")

            # metadata: one per existing node, with the policy's mode
            metas = _metas(store)
            assert set(metas) == fold.nodes, f"stale or missing embmeta: {sorted(set(metas) ^ fold.nodes)[:10]}"
            modes = expected_modes(fold, model_dir)
            wrong = {v: (m.mode, modes[v]) for v, m in metas.items() if m.mode != modes[v]}
            assert not wrong, f"(stored mode, expected mode): {wrong}"

            # what a consumer keeping the last update per node ends up with
            last: dict[str, Any] = {}
            for e in entries:
                last[e.node] = e
            for v, e in last.items():
                if v in fold.nodes:
                    assert e.mode == modes[v], f"node {v!r}: last published mode {e.mode}, expected {modes[v]}"
                    assert e.version == metas[v].version, f"node {v!r}: published v{e.version}, stored v{metas[v].version}"
                    assert np.abs(e.embedding - stored[v]).max() <= ATOL, f"node {v!r}: last published embedding is stale"
                else:
                    assert e.mode == "deleted", f"deleted node {v!r}: last update is {e.mode}, not deleted"
            never = sorted(fold.nodes - set(last))
            assert not never, f"existing nodes never published: {never[:10]}"

            # a backfill of the same graph stores the same embeddings
            engine.backfill()
            assert_embeddings_close(_final_stored(engine), stored, what="Engine.backfill vs stored after the stream")
            return {"fold": fold, "stored": stored, "metas": metas, "outbox": entries, "deferred": deferred}
        finally:
            store.close()


# ---------------------------------------------------------------------- property tests
@pytest.mark.parametrize("name", list(MODELS))
@SETTINGS
@given(stream=streams())
def test_incremental_equals_from_scratch_and_pyg(model_dirs: dict[str, Path], name: str, stream: dict) -> None:
    seen = run_stream(model_dirs[name], stream["batches"], hub_bound=stream["hub_bound"],
                      max_deferred_age=stream["max_deferred_age"], recompute=stream["recompute"],
                      restart=stream["restart"])
    event(f"hub_bound={stream['hub_bound']}: {'some' if seen['deferred'] else 'no'} propagation deferred")
    event(f"restarts: {sum(stream['restart'])}, recompute skipped after some batch: {False in stream['recompute']}")


def test_hub_deferral_is_exercised_and_converges(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A hub's feature change with hub_bound=3 is deferred (durably) and drain catches up exactly."""
    model = load_model_dir(model_dirs["sage"])
    rnd = random.Random(3)
    feats = lambda: tuple(rnd.uniform(-1, 1) for _ in range(DIM))  # noqa: E731
    events = [NodeUpsert(HUB, 1, feats())]
    events += [EdgeUpsert(leaf, HUB, 2) for leaf in LEAVES[:40]]
    events += [NodeUpsert(leaf, 3, feats()) for leaf in LEAVES[:40]]
    update = NodeUpsert(HUB, 4, feats())
    fold = GraphFold()
    for ev in events + [update]:
        fold.apply_event(ev)
    with GraphStore(tmp_path / "s", seed=SEED) as store:
        engine = Engine(store, model, hub_bound=3, max_deferred_age=3600.0)
        store.apply(events)
        engine.drain()
        store.apply([update])
        stats = engine.recompute()
        assert stats.deferred > 0, "hub propagation was not deferred with hub_bound=3"
        assert engine.pending() > 0, "a deferred propagation must stay durable until drained"
        engine.recompute()  # max_deferred_age not reached: still deferred
        assert engine.pending() > 0
        engine.drain()
        assert engine.pending() == 0
        stored = _final_stored(engine)
        assert_embeddings_close(stored, _from_scratch(engine), what="stored vs from_scratch after drain")
        assert_embeddings_close(stored, reference_embeddings(fold.nodes, fold.edges, fold.features,
                                                             model_dirs["sage"]))


# ---------------------------------------------------------------------- pruning
def _random_graph_events(n: int, m: int, seed: int) -> list:
    rnd = random.Random(seed)
    events = [NodeUpsert(f"v{i}", 1, tuple(rnd.uniform(-1, 1) for _ in range(DIM))) for i in range(n)]
    for j in range(m):
        a, b = rnd.randrange(n), rnd.randrange(n)
        events.append(EdgeUpsert(f"v{a}", f"v{b}", 2 + j))
    return events


@pytest.mark.parametrize("name", ["sage", "gcn", "gat"])
def test_one_edge_recomputes_a_small_neighbourhood(model_dirs: dict[str, Path], tmp_path: Path, name: str) -> None:
    n = 200
    events = _random_graph_events(n, 300, seed=5)
    fold = GraphFold()
    for ev in events:
        fold.apply_event(ev)
    nbrs = neighbourhoods(fold.nodes, fold.edges)
    low = sorted(v for v in fold.nodes if 1 <= len(nbrs[v]) <= 2)
    a = low[0]
    b = next(u for u in low[1:] if u not in nbrs[a] and not (nbrs[a] & nbrs[u]))
    model = load_model_dir(model_dirs[name])
    with GraphStore(tmp_path / "s", seed=SEED) as store:
        engine = Engine(store, model)
        for i in range(0, len(events), 100):
            store.apply(events[i:i + 100])
            engine.recompute()
        engine.drain()
        assert store.num_nodes() == n
        store.apply([EdgeUpsert(a, b, 10_000)])
        stats = engine.recompute()
        assert engine.pending() == 0
        assert len(stats.recomputed) == 2  # one count per layer
        assert 2 <= stats.recomputed[0] <= 12, stats
        assert sum(stats.recomputed) <= 40, f"one edge between low-degree nodes recomputed {stats.recomputed} of {n}"
        fold.apply_event(EdgeUpsert(a, b, 10_000))
        stored = _final_stored(engine)
        assert_embeddings_close(stored, _from_scratch(engine))
        assert_embeddings_close(stored, reference_embeddings(fold.nodes, fold.edges, fold.features, model_dirs[name]))


def test_unrelated_hub_edge_does_not_dirty_the_hub_sample(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A new neighbour of a hub that does not rank among its k smallest leaves S_k(hub) alone."""
    model = load_model_dir(model_dirs["sage"])
    events = [NodeUpsert(HUB, 1, (1.0, 0.0, 0.0, 0.0))] + [EdgeUpsert(leaf, HUB, 2) for leaf in LEAVES[:40]]
    with GraphStore(tmp_path / "s", seed=SEED) as store:
        engine = Engine(store, model)
        store.apply(events)
        engine.drain()
        before = store.sample(HUB, max(FANOUTS))
        worst = max(rank(SEED, HUB, u) for u in before)
        newcomer = next(f"x{i}" for i in range(10_000) if rank(SEED, HUB, f"x{i}") > worst)
        store.apply([EdgeUpsert(newcomer, HUB, 3)])
        stats = engine.recompute()
        assert store.sample(HUB, max(FANOUTS)) == before
        # layer 1 recomputes the newcomer only (its own sample and input changed), not the hub
        assert stats.recomputed[0] == 1, stats
        assert_embeddings_close(_final_stored(engine), _from_scratch(engine))


# ---------------------------------------------------------------------- cold start and modes
def test_feature_only_policy_modes_and_exactness(model_dirs: dict[str, Path]) -> None:
    model_dir = model_dirs["sage_feature_only"]
    f = (0.5, -0.25, 1.0, 0.0)
    batches = [
        [NodeUpsert("x", 1, f), NodeUpsert("y", 1, f), NodeUpsert("z", 1, f), NodeUpsert("w", 1, f)],
        [EdgeUpsert("x", "y", 2)],                       # x, y: degree 1 -> feature_only
        [EdgeUpsert("y", "z", 3), EdgeUpsert("w", "y", 3), EdgeUpsert("q", "y", 3)],  # y: degree 4 -> full
        [EdgeUpsert("q", "z", 4)],                       # q: no features, degree 2 -> cold_start
    ]
    seen = run_stream(model_dir, batches)
    metas = seen["metas"]
    assert metas["x"].mode == "feature_only"
    assert metas["w"].mode == "feature_only"
    assert metas["y"].mode == "full"
    assert metas["z"].mode == "full"
    assert metas["q"].mode == "cold_start"
    # x aggregates nothing: its embedding only depends on its own features, like the isolated-by-policy w
    assert np.abs(seen["stored"]["x"] - seen["stored"]["w"]).max() <= ATOL
    # a mode change alone is republished: x gains a second neighbour
    seen2 = run_stream(model_dir, batches + [[EdgeUpsert("x", "z", 5)]])
    assert seen2["metas"]["x"].mode == "full"
    published = [e.mode for e in seen2["outbox"] if e.node == "x"]
    assert published[0] == "feature_only" and published[-1] == "full", published


def test_plain_policy_reports_cold_start_for_nodes_without_features(model_dirs: dict[str, Path]) -> None:
    f = (1.0, 2.0, -1.0, 0.5)
    batches = [[NodeUpsert("a", 1, f), EdgeUpsert("a", "b", 1), EdgeUpsert("c", "a", 1)]]
    seen = run_stream(model_dirs["gcn"], batches)
    assert seen["metas"]["a"].mode == "full"
    assert seen["metas"]["b"].mode == "cold_start"
    assert seen["metas"]["c"].mode == "cold_start"
    seen = run_stream(model_dirs["gcn"], batches + [[NodeUpsert("b", 2, f)]])
    assert seen["metas"]["b"].mode == "full"
    b_modes = [e.mode for e in seen["outbox"] if e.node == "b"]
    assert b_modes[0] == "cold_start" and b_modes[-1] == "full"


# ---------------------------------------------------------------------- deletes and versions
def test_node_delete_withdraws_embedding_and_publishes_deleted(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    model = load_model_dir(model_dirs["gat"])
    f = (0.1, 0.2, 0.3, 0.4)
    with GraphStore(tmp_path / "s", seed=SEED) as store:
        engine = Engine(store, model)
        store.apply([NodeUpsert("a", 1, f), NodeUpsert("b", 1, f), EdgeUpsert("a", "b", 1), EdgeUpsert("b", "c", 1)])
        engine.recompute()
        b = store.iid("b")
        before = _stored_final(store, b)[0]
        pub = _Publisher()
        n_before = len(pub.collect(engine))
        store.apply([NodeDelete("b", 5)])
        stats = engine.recompute()
        assert stats.deleted == 1
        assert engine.pending() == 0
        floor, row = _stored_final(store, b)
        assert floor.mode == "deleted" and floor.version == before.version + 1  # the version floor stays
        assert row is None  # the row is withdrawn
        hidden = PageLog(store, family="layerpages", prefix=bytes((1,)), rows_name="layer1-rows")
        assert hidden.rows(np.asarray([b]), engine.tables.dims[1])[1].tolist() == [False]  # h^1 withdrawn too
        assert hidden.rows(np.asarray([store.iid("a")]), engine.tables.dims[1])[1].tolist() == [True]
        new = pub.collect(engine)[n_before:]
        gone = [e for e in new if e.node == "b"]
        assert len(gone) == 1 and gone[0].mode == "deleted" and gone[0].embedding is None
        assert gone[0].version > before.version
        # a and c lost their only neighbour: republished, and exact
        assert {e.node for e in new if e.mode != "deleted"} >= {"a", "c"}
        stored = _final_stored(engine)
        assert set(stored) == {"a", "c"}
        assert_embeddings_close(stored, _from_scratch(engine))
        assert_embeddings_close(stored, reference_embeddings({"a", "c"}, set(), {"a": f}, model_dirs["gat"]))


def test_versions_strictly_increase_across_recomputes(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    model = load_model_dir(model_dirs["sage"])
    rnd = random.Random(9)
    feats = lambda: tuple(rnd.uniform(-1, 1) for _ in range(DIM))  # noqa: E731
    with GraphStore(tmp_path / "s", seed=SEED) as store:
        engine = Engine(store, model)
        pub = _Publisher()
        last: dict[str, int] = {}
        for step in range(12):
            store.apply([NodeUpsert("a", step, feats()), EdgeUpsert("a", f"n{step % 4}", step)])
            engine.recompute()
            pub.collect(engine)
            metas = _metas(store)
            for v, m in metas.items():
                if v in last and v in {"a", f"n{step % 4}"}:
                    assert m.version > last[v], f"{v}: version {m.version} after {last[v]}"
                assert m.version >= last.get(v, 0)
                last[v] = m.version
        per_node: dict[str, list[int]] = defaultdict(list)
        for e in pub.entries:
            per_node[e.node].append(e.version)
        for v, vs in per_node.items():
            assert vs == sorted(set(vs)), f"{v}: published versions {vs}"
        assert per_node["a"][-1] == 12


def test_a_failed_recompute_write_leaves_the_caches_as_stored(model_dirs: dict[str, Path], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The page index moves before the WriteBatch is written: a failed write must not leave it pointing at
    pages that do not exist, nor versions that were never stored."""
    model = load_model_dir(model_dirs["sage"])
    with GraphStore(tmp_path / "s", seed=SEED) as store:
        engine = Engine(store, model)
        store.apply(_random_graph_events(40, 120, seed=5))
        engine.recompute()
        before = _metas(store)
        store.apply([EdgeUpsert("v1", "v2", 10), NodeUpsert("v3", 10, (0.5, -0.5, 0.25, 1.0))])
        real_commit = store.commit

        def failing(*args: Any, **kwargs: Any) -> int:
            raise OSError("disk full")

        monkeypatch.setattr(store, "commit", failing)
        with pytest.raises(OSError):
            engine.recompute()
        monkeypatch.setattr(store, "commit", real_commit)
        assert _metas(store) == before
        versions, _, _ = engine.meta.get(np.asarray([store.iid(v) for v in before]))
        assert versions.tolist() == [before[v].version for v in before]  # the cache reads the log again
        stats = engine.recompute()
        assert stats.changed[-1] > 0 and engine.pending() == 0
        after = _metas(store)
        assert all(after[v].version in (before[v].version, before[v].version + 1) for v in before)
        assert_embeddings_close(_final_stored(engine), _from_scratch(engine))


def test_the_page_log_compacts_during_a_stream_and_stays_exact(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    model = load_model_dir(model_dirs["gcn"])
    rnd = random.Random(4)
    with GraphStore(tmp_path / "s", seed=SEED) as store:
        engine = Engine(store, model)
        for log in engine.logs.values():  # the h^1 log compacts too
            log.gc_slack = 0
        store.apply(_random_graph_events(300, 900, seed=6))
        engine.recompute()
        deleted: set[str] = set()
        for step in range(25):
            events = [EdgeUpsert(f"v{rnd.randrange(300)}", f"v{rnd.randrange(300)}", 100 + step) for _ in range(20)]
            gone = f"v{rnd.randrange(300)}"  # withdrawn records (pages without rows) move too
            events.append(NodeDelete(gone, 100 + step))
            deleted = (deleted - {e.src for e in events[:-1]} - {e.dst for e in events[:-1]}) | {gone}
            store.apply(events)
            engine.recompute()
            for log in engine.logs.values():
                assert log.stored_slots() <= 2 * log.live() + 300
        slots = [log.stored_slots() for log in engine.logs.values()]
        assert all(n < 2 * log.live() + 300 for n, log in zip(slots, engine.logs.values()))
        engine.tables.clear()
        for log in engine.logs.values():
            log.clear()
        assert [log.stored_slots() for log in engine.logs.values()] == slots
        iids = np.fromiter(store.node_iids(), dtype=np.int64)
        want, _ = engine.compute_layer(0, iids, engine._full_inputs(iids))
        np.testing.assert_allclose(engine.logs[1].rows(iids, engine.tables.dims[1])[0], want, atol=1e-6)
        assert_embeddings_close(_final_stored(engine), _from_scratch(engine))
        assert _frames_named_twice(engine) == {}
        assert set(_metas(store)) == {store.name(i) for i in store.node_iids()}
        floors = {store.name(i): m for i, m, row in PageLog(store).items() if m.mode == "deleted" and row is None}
        assert deleted <= set(floors) and all(m.version > 1 for m in floors.values())


def test_recreated_node_versions_keep_increasing(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """docs/design.md: version is per node strictly increasing and consumers keep the highest.

    After node_delete (published as version n+1, mode deleted), a re-created node's
    first embedding must have a version above n+1, or consumers discard it.
    """
    model = load_model_dir(model_dirs["sage"])
    f = (0.3, 0.1, -0.2, 0.9)
    with GraphStore(tmp_path / "s", seed=SEED) as store:
        engine = Engine(store, model)
        pub = _Publisher()
        for batch in ([NodeUpsert("a", 1, f), EdgeUpsert("a", "b", 1)], [NodeUpsert("a", 2, tuple(x + 1 for x in f))],
                      [NodeDelete("a", 3)], [EdgeUpsert("a", "b", 4)]):
            store.apply(batch)
            engine.recompute()
            pub.collect(engine)
        versions = [(e.version, e.mode) for e in pub.entries if e.node == "a"]
        assert [m for _, m in versions] == ["full", "full", "deleted", "cold_start"], versions
        nums = [v for v, _ in versions]
        assert nums == sorted(set(nums)), f"versions of re-created node 'a' go back: {versions}"


def test_edges_only_stream(model_dirs: dict[str, Path]) -> None:
    """docs/design.md: a node with edges but no features gets a zero vector, also when no node has features yet."""
    batches = [[EdgeUpsert("a", "b", 1), EdgeUpsert("b", "c", 1), EdgeUpsert("c", "a", 2)],
               [NodeUpsert("a", 3, (1.0, 0.0, 0.5, -0.5))]]
    seen = run_stream(model_dirs["sage"], batches)
    assert seen["metas"]["b"].mode == "cold_start"


def test_mode_changes_when_features_equal_the_zero_default(model_dirs: dict[str, Path]) -> None:
    """A feature-less node (cold_start) that gets all-zero features is now ``full``, although its vector
    is unchanged: the mode change alone must be stored and republished."""
    batches = [[NodeUpsert("a", 1, (1.0, 1.0, 1.0, 1.0)), EdgeUpsert("b", "a", 1)],
               [NodeUpsert("b", 2, (0.0, 0.0, 0.0, 0.0))]]
    seen = run_stream(model_dirs["sage"], batches)
    assert seen["metas"]["b"].mode == "full"


def test_small_layers_run_on_one_torch_thread_and_restore_the_setting() -> None:
    from gnnstream.workers.engine.device import SMALL_LAYER as _SMALL_LAYER, threads_for as _threads_for

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with _threads_for(10):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with _threads_for(_SMALL_LAYER):
            assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), _threads_for(10):
            raise RuntimeError("restored on errors too")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------- row files
def _frames_named_twice(engine: Engine) -> dict:
    """Frames of a row file that more than one stored page points at (must be none)."""
    from collections import Counter

    from gnnstream.graph_state.codecs import decode_page

    named: Counter = Counter()
    for log in engine.logs.values():
        for _, raw in log._pages():
            rec, _, has_rows = decode_page(raw)
            if has_rows and "frame" in rec:
                named[(log.rows_name, int(rec["frame"]))] += 1
    return {frame: n for frame, n in named.items() if n > 1}


def test_a_recompute_that_fails_before_its_write_leaves_every_frame_to_its_page(
        model_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer-1 log has released frames when the final log's frame write fails (a full disk): those frames
    belong to stored pages until a write deletes them, so a retry and later batches must not reuse them."""
    from gnnstream.graph_state import row_file as tables

    model = load_model_dir(model_dirs["sage"])
    rnd = random.Random(5)
    names = [f"v{i}" for i in range(300)]

    def features() -> tuple[float, ...]:
        return tuple(rnd.uniform(-1, 1) for _ in range(DIM))

    with GraphStore(tmp_path / "s", seed=SEED) as store:
        engine = Engine(store, model)
        store.apply([NodeUpsert(n, 1, features()) for n in names]
                    + [EdgeUpsert(rnd.choice(names), rnd.choice(names), 2 + j) for j in range(900)])
        engine.recompute()
        store.apply([NodeUpsert(n, 10, features()) for n in names])  # supersedes every layer-1 page
        write = tables.RowFile.write

        def full_disk(self: Any, rows: np.ndarray) -> list[int]:
            if "final-rows" in self.path:
                raise OSError(28, "No space left on device")
            return write(self, rows)

        monkeypatch.setattr(tables.RowFile, "write", full_disk)
        with pytest.raises(OSError):
            engine.recompute()
        monkeypatch.setattr(tables.RowFile, "write", write)
        assert engine.pending()  # the marks wait for the retry
        engine.recompute()
        for t in range(3):  # later batches take frames from the free lists
            store.apply([NodeUpsert(n, 20 + t, features()) for n in names[::3]])
            engine.recompute()
        assert _frames_named_twice(engine) == {}
    with GraphStore(tmp_path / "s") as store:
        engine = Engine(store, model)
        iids = np.fromiter(store.node_iids(), dtype=np.int64)
        want, _ = engine.compute_layer(0, iids, engine._full_inputs(iids))
        got, present = engine.logs[1].rows(iids, engine.tables.dims[1])
        assert present.all()
        np.testing.assert_allclose(got, want, atol=1e-6)
        assert_embeddings_close(_final_stored(engine), _from_scratch(engine))


def test_rows_encoded_in_the_running_recompute_are_read_back_when_the_cache_cannot_hold_them(
        model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Past ``max_rows`` the layer tables read through the logs: layer 2 reads h^1 rows that layer 1 of the
    same recompute encoded but has not written yet."""
    model = load_model_dir(model_dirs["sage"])
    rnd = random.Random(9)
    names = [f"v{i}" for i in range(40)]
    with GraphStore(tmp_path / "s", seed=SEED) as store:
        engine = Engine(store, model)
        store.apply([NodeUpsert(n, 1, tuple(rnd.uniform(-1, 1) for _ in range(DIM))) for n in names]
                    + [EdgeUpsert(rnd.choice(names), rnd.choice(names), 2 + j) for j in range(120)])
        engine.recompute()
        engine.tables.max_rows = 10  # a store with more interned ids than the caches may hold
        engine.tables.clear()
        store.apply([EdgeUpsert("v1", "v2", 500), NodeUpsert("v5", 501, (0.9, 0.9, -0.9, 0.1))])
        stats = engine.recompute()
        assert stats.changed[0] > 0 and engine.pending() == 0
        assert_embeddings_close(_final_stored(engine), _from_scratch(engine))


def test_a_backfill_withdraws_what_nodes_deleted_before_their_recompute_left(
        model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A node deleted by a batch whose recompute never ran (a crash between the two) keeps its rows until
    a backfill, even one for a model with other widths: the backfill withdraws them and drops the row files
    nothing points into any more."""
    f = (0.3, 0.1, -0.2, 0.9)
    with GraphStore(tmp_path / "s", seed=SEED) as store:
        engine = Engine(store, load_model_dir(model_dirs["sage"]))
        store.apply([NodeUpsert(n, 1, f) for n in "abcd"] + [EdgeUpsert("a", "b", 2), EdgeUpsert("c", "d", 2)])
        engine.recompute()
        d = store.iid("d")
        store.apply([NodeDelete("d", 3)])  # not recomputed
    wider = tmp_path / "wider"
    init_model_dir(wider, in_dim=DIM, hidden=5, out_dim=7, layers=2, fanouts=FANOUTS, seed=SEED, arch="sage")
    with GraphStore(tmp_path / "s") as store:
        engine = Engine(store, load_model_dir(wider))
        assert engine.needs_backfill()
        engine.backfill(publish=True)
        meta, row = _stored_final(store, d)
        assert meta.mode == "deleted" and row is None
        assert engine.logs[1].held(np.asarray([d])).tolist() == [False]
        assert sorted(p.name for p in (tmp_path / "s").glob("*-rows-*.f32")) == ["final-rows-7.f32",
                                                                                   "layer1-rows-5.f32"]
        store.apply([NodeUpsert(n, 4 + i, f) for i, n in enumerate("abc")])
        engine.recompute()
        assert_embeddings_close(_final_stored(engine), _from_scratch(engine))
        assert "d" not in _final_stored(engine)


def test_rows_lost_to_an_operating_system_crash_are_recomputed_at_the_next_start(
        model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Frames of the final log and of the h^1 log that no longer hold their pages' rows (zeros, and the rows of
    another page): the engine marks their nodes at start, and the next recompute makes the store exact again."""
    from gnnstream.graph_state.codecs import PAGE_ROWS, decode_page

    model = load_model_dir(model_dirs["sage"])
    with GraphStore(tmp_path / "s", seed=SEED) as store:
        engine = Engine(store, model)
        engine.backfill()  # binds the store to the model (a start with another binding backfills instead)
        store.apply(_random_graph_events(300, 900, seed=3))
        engine.recompute()
        dims = engine.tables.dims
        frames = {}
        for layer, log in engine.logs.items():
            frames[layer] = [int(decode_page(raw)[0]["frame"]) for _, raw in log._pages()]
        seq, raw = next(engine.meta._pages())
        zeroed = {store.name(int(i)) for i in decode_page(raw)[0]["iid"] if engine.meta.page[i] == seq}
        assert zeroed
    for layer, name, fill in ((2, f"final-rows-{dims[2]}.f32", None), (1, f"layer1-rows-{dims[1]}.f32", 1)):
        path = tmp_path / "s" / name
        size = PAGE_ROWS * dims[layer] * 4
        data = bytearray(path.read_bytes())
        frame = frames[layer][0]
        other = frames[layer][fill] if fill is not None else None
        data[frame * size:(frame + 1) * size] = bytes(size) if other is None else data[other * size:(other + 1) * size]
        path.write_bytes(bytes(data))
    with GraphStore(tmp_path / "s") as store:
        engine = Engine(store, model)
        assert engine.pending() > 0
        before = _Publisher().collect(engine)
        engine.recompute()
        assert engine.pending() == 0
        assert_embeddings_close(_final_stored(engine), _from_scratch(engine))
        republished = _Publisher().collect(engine)[len(before):]
        assert zeroed <= {e.node for e in republished}  # the nodes of the zeroed final frame went out again
        iids = np.fromiter(store.node_iids(), dtype=np.int64)
        want, _ = engine.compute_layer(0, iids, engine._full_inputs(iids))
        np.testing.assert_allclose(engine.logs[1].rows(iids, dims[1])[0], want, atol=1e-6)
    with GraphStore(tmp_path / "s") as store:
        assert Engine(store, model).pending() == 0  # nothing is left to repair


@pytest.mark.parametrize("width", [4, 8, 128])
def test_a_row_counts_as_changed_when_any_entry_moves_past_the_tolerance(width):
    from types import SimpleNamespace

    rng = np.random.default_rng(width)
    held = rng.standard_normal((50, width)).astype(np.float32)
    pos = rng.permutation(50)[:12]
    rows = held[pos].copy()
    rows[1, width - 1] += 1e-3  # only the last entry moved
    rows[2, 0] -= 1e-3  # only the first
    rows[3] += 5e-7  # every entry, within the tolerance
    rows[4] += rng.standard_normal(width).astype(np.float32)  # the common case: everything moved
    rows[5, width // 2] = np.nan  # no number is not a move
    present = np.ones(12, dtype=bool)
    present[6] = False  # nothing held: counts as changed
    tables = SimpleNamespace(held=lambda layer, iids: (held, pos, present))
    moved = Engine._moved(SimpleNamespace(tables=tables), 1, np.arange(12), rows)
    assert moved.tolist() == [False, True, True, False, True, False, True] + [False] * 5


def test_sharded_final_layer_keeps_publishes_and_takes_over_by_partition(model_dirs: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    """One engine of a group: it keeps and publishes the final layer of its output partition only; a takeover
    computes and publishes another partition's nodes; a partition kept but not published is stored, not
    published, and taking it back recomputes nothing. Every version is at least its epoch << 32."""
    from gnnstream.stream.partitioning import partition_for
    model = load_model_dir(model_dirs["sage"])
    rnd = random.Random(3)
    names = [f"v{i}" for i in range(40)]
    part = {v: partition_for(v.encode(), 2) for v in names}
    assert set(part.values()) == {0, 1}
    events = [NodeUpsert(v, 1, tuple(rnd.uniform(-1, 1) for _ in range(DIM))) for v in names]
    events += [EdgeUpsert(rnd.choice(names), rnd.choice(names), 2 + i) for i in range(120)]
    with GraphStore(tmp_path / "s", seed=SEED) as store:
        engine = Engine(store, model)
        engine.own({0}, {0}, 2, epoch=3)
        pub = _Publisher()
        store.apply(events[:80])
        engine.recompute()
        store.apply(events[80:])
        stats = engine.recompute()
        assert 0 < stats.recomputed[-1] <= sum(p == 0 for p in part.values())
        sent = list(pub.collect(engine))
        assert sent and {part[e.node] for e in sent} == {0}
        want = _from_scratch(engine)
        metas = _metas(store)
        assert {v for v in metas} == {v for v in names if part[v] == 0}
        assert all(m.version > 3 << 32 for m in metas.values())
        for e in sent:
            if e.embedding is not None and e.version == metas[e.node].version:
                np.testing.assert_allclose(e.embedding, want[e.node], rtol=0, atol=ATOL)

        engine.own({0, 1}, {0, 1}, 2, epoch=5)
        taken = engine.take_over({1})
        ones = {v for v in names if part[v] == 1}
        assert taken.recomputed == [len(ones)] and taken.published == len(ones)
        fresh = [e for e in pub.collect(engine)[len(sent):]]
        assert {e.node for e in fresh} == ones and all(e.version == 5 << 32 for e in fresh)
        assert_embeddings_close({e.node: e.embedding for e in fresh}, {v: want[v] for v in ones}, what="taken over")

        engine.own({0, 1}, {1}, 2)  # partition 0 revoked: kept current, not published
        zero = sorted(v for v in names if part[v] == 0)[0]
        before = len(pub.entries)
        store.apply([NodeUpsert(zero, 500, tuple(rnd.uniform(-1, 1) for _ in range(DIM)))])
        engine.recompute()
        assert all(part[e.node] == 1 for e in pub.collect(engine)[before:])
        assert_embeddings_close(_final_stored(engine), _from_scratch(engine), what="stored after a revocation")

        engine.own({0, 1}, {0, 1}, 2, epoch=6)  # partition 0 back: nothing to compute, all republished
        before = len(pub.entries)
        again = engine.take_over({0}, computed={0})
        back = pub.collect(engine)[before:]
        assert again.recomputed == [0]
        assert {e.node for e in back} == {v for v in names if part[v] == 0}
        assert all(e.version >= 6 << 32 for e in back)
        assert_embeddings_close({e.node: e.embedding for e in back}, {v: r for v, r in _from_scratch(engine).items()
                                                                if part[v] == 0}, what="taken back")


@pytest.mark.parametrize("name", ["sage", "gcn", "gat"])
def test_a_backfill_on_a_device_equals_the_cpu_backfill(model_dirs: dict[str, Path], tmp_path: Path,
                                                        name: str) -> None:
    """backfill(device=...) runs the same layers with every tensor on the device: on the CPU it stores exactly
    what backfill() does; on a machine where torch sees a GPU, the GPU's rows equal them to 1e-5."""
    model = load_model_dir(model_dirs[name])
    events = [ev for batch in random_batches(7, 6, 40) for ev in batch]
    stored = {}
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    for device in [None, *devices]:
        with GraphStore(tmp_path / f"{name}-{device}", seed=SEED) as store:
            engine = Engine(store, model, chunk_nodes=16)  # several chunks a layer
            store.apply(events)
            engine.backfill() if device is None else engine.backfill(device=device)
            assert engine.device.type == "cpu" and next(engine.gnn.parameters()).device.type == "cpu"
            stored[device] = _final_stored(engine)
            assert_embeddings_close(stored[device], _from_scratch(engine))
    assert stored["cpu"].keys() == stored[None].keys() and len(stored[None]) > 20
    for node, row in stored[None].items():
        assert np.array_equal(stored["cpu"][node], row), node
        if "cuda" in stored:
            assert np.allclose(stored["cuda"][node], row, atol=1e-5), node


def test_a_device_torch_does_not_have_is_refused_before_anything_changes(model_dirs: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    from gnnstream.workers.engine import check_device
    with pytest.raises(ValueError, match="Expected device cpu or cuda"):
        check_device("meta")
    with pytest.raises(ValueError, match="Expected a torch device"):
        check_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA GPU here"):
            check_device("cuda")
        done = call_gnnstream("backfill", "--state", tmp_path / "none", "--model", model_dirs["sage"],
                              "--device", "cuda")
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode != 0 and len(lines) == 1 and "no CUDA GPU" in lines[0], done.stderr
        assert not (tmp_path / "none").exists()
    else:
        assert check_device("cuda").type == "cuda"
