"""Event time against the independent reference: the edge window, late events and the staged cold start.

Random streams with out-of-order times, late upserts, re-created edges, node
deletes and a hub above the fanouts go through the store and the engine in
random batches with restarts; the stored embeddings, modes and graph must
equal :func:`tests.workers.reference.fold_embeddings` of the same events
(the contract of docs/design.md, folded event by event), and a backfill must
store the same embeddings.
"""

from __future__ import annotations

import gc
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gnnstream.graph_state.exceptions import StoreConfigError
from gnnstream.graph_state.store import GraphStore
from gnnstream.model import init_model_dir, load_model_dir
from gnnstream.stream.events import EdgeDelete, EdgeUpsert, NodeDelete, NodeUpsert
from gnnstream.workers.engine import Engine
from gnnstream.graph_state.page_log import PageLog
from tests.workers.reference import GraphFold, assert_embeddings_close, expected_modes, fast_tempdir, fold_embeddings

SEED = 5
DIM = 4
FANOUTS = (3, 2)
TTL = 30
STAGED = {"policy": "staged", "feature_only_s": 5, "expand_s": 25, "min_neighbours": 3}
MODELS: dict[str, dict[str, Any]] = {
    "sage": dict(arch="sage"),
    "gcn": dict(arch="gcn"),
    "gat": dict(arch="gat", heads=2),
    "sage_staged": dict(arch="sage", cold_start=STAGED),
    "gcn_staged": dict(arch="gcn", cold_start=STAGED),
    "gat_staged": dict(arch="gat", heads=2, cold_start=STAGED),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, extra in MODELS.items():
        init_model_dir(root / name, **{**dict(in_dim=DIM, hidden=8, out_dim=6, layers=2, fanouts=FANOUTS, seed=SEED),
                                       **extra})
        out[name] = root / name
    return out


@pytest.fixture(scope="module", autouse=True)
def _frozen_gc() -> Any:
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def random_stream(seed: int, n: int = 260) -> list:
    """Events whose times drift upwards with jitter (so some arrive late), over a pool, a hub with more
    neighbours than the fanouts, re-created edges and node deletes."""
    rnd = random.Random(seed)
    pool = [f"n{i}" for i in range(14)] + ["7", "hub"]
    t = 0.0
    out: list = []
    for _ in range(n):
        t += rnd.uniform(0, 1.6)
        ts = round(t - rnd.choice([0, 0, 0, 0, 3, 12, 40]), 2)  # out of order; 40 is late for a 30 s window
        r = rnd.random()
        a, b = rnd.sample(pool, 2)
        if r < 0.25:
            a = "hub"
        if r < 0.62:
            out.append(EdgeUpsert(a, b, ts, weight=1.0))
        elif r < 0.72:
            out.append(EdgeDelete(a, b, ts))
        elif r < 0.94:
            out.append(NodeUpsert(a, ts, tuple(rnd.uniform(-1, 1) for _ in range(DIM))))
        elif a != "hub":
            out.append(NodeDelete(a, ts))
    return out


def _batches(events: list, rnd: random.Random) -> list[list]:
    out, i = [], 0
    while i < len(events):
        step = rnd.randint(1, 25)
        out.append(events[i:i + step])
        i += step
    return out


def _stored(engine: Engine) -> dict[str, np.ndarray]:
    engine.tables.clear()
    store = engine.store
    iids = np.fromiter(store.node_iids(), dtype=np.int64)
    rows, present = engine.tables.get(engine.num_layers, iids)
    assert present.all(), "nodes without a stored final embedding"
    return {store.name(int(i)): rows[n] for n, i in enumerate(iids)}


def _modes(store: GraphStore) -> dict[str, str]:
    return {store.name(i): m.mode for i, m, _ in PageLog(store).items() if m.mode != "deleted"}


def run_windowed(model_dir: Path, events: list, seed: int, *, ttl: int = TTL) -> dict[str, Any]:
    """Apply ``events`` in random batches with restarts and skipped recomputes; check the stored state against
    the reference after every few batches and at the end; return the totals the store reported."""
    rnd = random.Random(seed)
    model = load_model_dir(model_dir)
    fold = GraphFold(ttl)
    totals = {"expired": 0, "late": 0, "stage_changes": 0}
    with fast_tempdir() as tmp:
        path = Path(tmp) / "state"
        store = GraphStore(path, seed=SEED, edge_ttl=ttl)
        try:
            engine = Engine(store, model)
            for batch in _batches(events, rnd):
                result = store.apply(batch)
                totals["expired"] += result.expired_edges
                totals["late"] += result.late_events
                for ev in batch:
                    fold.apply_event(ev)
                assert store.stream_time == fold.T
                if rnd.random() < 0.7:
                    stats = engine.recompute()
                    totals["stage_changes"] += sum(stats.stage_changes.values())
                if rnd.random() < 0.1:
                    store.close()
                    store = GraphStore(path)
                    engine = Engine(store, model)
            engine.drain()
            assert engine.pending() == 0
            assert set(store.nodes()) == fold.nodes
            assert {(s, d) for s, d, _, _ in store.edges()} == fold.edges
            assert {(s, d): t for s, d, _, t in store.edges()} == fold.edge_time
            want = fold_embeddings(fold, model_dir)
            stored = _stored(engine)
            assert_embeddings_close(stored, want, what="stored vs reference")
            assert _modes(store) == expected_modes(fold, model_dir)
            targets, rows = engine.from_scratch()
            assert_embeddings_close({store.name(int(i)): rows[n] for n, i in enumerate(targets)}, want,
                                    what="from_scratch vs reference")
            engine.backfill()
            assert_embeddings_close(_stored(engine), want, what="backfill vs reference")
        finally:
            store.close()
    assert totals["late"] == fold.late
    return {"fold": fold, **totals}


@pytest.mark.parametrize("name", ["sage", "gcn", "gat"])
@pytest.mark.parametrize("seed", [1, 2])
def test_windowed_streams_match_the_reference(models: dict[str, Path], name: str, seed: int) -> None:
    seen = run_windowed(models[name], random_stream(seed), seed)
    assert seen["expired"] > 0 and seen["late"] > 0  # the stream exercises both


@pytest.mark.parametrize("name", ["sage_staged", "gcn_staged", "gat_staged"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_staged_streams_match_the_reference(models: dict[str, Path], name: str, seed: int) -> None:
    seen = run_windowed(models[name], random_stream(seed), seed)
    assert seen["stage_changes"] > 0  # timers fired with no event naming their nodes
    assert seen["expired"] > 0


@pytest.mark.parametrize("name", ["sage_staged", "gcn_staged", "gat_staged"])
@pytest.mark.parametrize("restart", [False, True])
def test_staged_stages_follow_age_and_degree(models: dict[str, Path], name: str, restart: bool) -> None:
    """Each stage by hand: feature-only while young, expanded while sparse, full after; the timers move a node
    on without an event naming it, and an expanded node samples two hops. With ``restart`` a new engine takes
    over each step: it works out what the expanded nodes read when it starts."""
    f = (0.5, -0.25, 1.0, 0.0)
    events = [NodeUpsert("hub", 0, f)] + [EdgeUpsert("hub", f"l{i}", 0) for i in range(6)] + \
        [NodeUpsert(f"l{i}", 0, f) for i in range(6)] + [NodeUpsert("new", 100, f), EdgeUpsert("new", "hub", 100)]
    fold = GraphFold(0)
    model_dir = models[name]
    with fast_tempdir() as tmp:
        store = GraphStore(Path(tmp) / "s", seed=SEED)
        try:
            engine = Engine(store, load_model_dir(model_dir))
            seen_modes = []
            # while "new" is expanded: its two-hop members change features, the hub's sample changes, both
            # with no event naming "new"
            two_hop = [[NodeUpsert(f"l{i}", 107, (float(i), 1.0, -1.0, 0.5))] for i in range(6)] + \
                [[EdgeUpsert("hub", f"m{i}", 108)] for i in range(8)] + [[EdgeDelete("hub", f"m{i}", 109)]
                                                                          for i in range(0, 8, 2)]
            for ev, t in [(events, None), ([NodeUpsert("clock", 106, f)], "expanded"),
                          *((ev, None) for ev in two_hop), ([NodeUpsert("clock", 130, f)], "full")]:
                store.apply(ev)
                for e in ev:
                    fold.apply_event(e)
                if restart:
                    store.close()
                    store = GraphStore(Path(tmp) / "s")
                    engine = Engine(store, load_model_dir(model_dir))
                stats = engine.recompute()
                if t is not None:
                    assert stats.stage_changes.get(t, 0) >= 1, stats.stage_changes
                seen_modes.append(_modes(store)["new"])
                assert_embeddings_close(_stored(engine), fold_embeddings(fold, model_dir))
            assert seen_modes == ["feature_only"] + ["expanded"] * (1 + len(two_hop)) + ["full"]
            assert engine.pending() == 0
        finally:
            store.close()


def test_no_window_keeps_every_edge_and_counts_nothing_late(models: dict[str, Path]) -> None:
    events = random_stream(3)
    fold = GraphFold()
    for ev in events:
        fold.apply_event(ev)
    seen = run_windowed(models["sage"], events, 3, ttl=0)
    assert seen["fold"].edges == fold.edges and seen["expired"] == 0 and seen["late"] == 0


def test_a_late_upsert_creates_its_endpoints_but_not_the_edge(tmp_path: Path) -> None:
    with GraphStore(tmp_path / "s", edge_ttl=10) as store:
        store.apply([EdgeUpsert("a", "b", 100)])
        r = store.apply([EdgeUpsert("c", "d", 85), EdgeUpsert("a", "b", 89)])
        assert r.late_events == 2 and r.expired_edges == 0
        assert store.exists("c") and store.exists("d") and store.edge("c", "d") is None
        assert store.edge("a", "b") == (1.0, 100.0)
        assert store.first_ts(np.asarray([store.iid("a"), store.iid("c")])).tolist() == [89.0, 85.0]
        r = store.apply([NodeUpsert("z", 110, (0.0,) * DIM)])  # T = 110: a->b (t 100) falls out
        assert r.expired_edges == 1 and store.edge("a", "b") is None and store.neighbors("a") == []
        assert store.stream_time == 110.0
        # a delete applies whatever its ts; a re-created edge starts its own time
        store.apply([EdgeUpsert("a", "b", 105), EdgeDelete("a", "b", 1), EdgeUpsert("a", "b", 104)])
        assert store.edge("a", "b") == (1.0, 104.0)


@pytest.mark.parametrize("together", [True, False])
def test_edges_expiring_together_unlink_each_pair_once(tmp_path: Path, together: bool) -> None:
    """Both directions of a pair falling out in one batch unlink it once; one direction falling out while the
    other stays keeps the pair linked; a refreshed edge and one written and expired in the same batch."""
    with GraphStore(tmp_path / "s", edge_ttl=10) as store:
        store.set_fanouts((1, 2))
        first = [EdgeUpsert("a", "b", 0), EdgeUpsert("b", "a", 1), EdgeUpsert("c", "d", 0), EdgeUpsert("d", "c", 5),
                 EdgeUpsert("e", "f", 0), EdgeUpsert("a", "c", 2)]
        second = [EdgeUpsert("e", "f", 8), EdgeUpsert("g", "h", 2), NodeUpsert("z", 13, (0.0,) * DIM)]
        r = store.apply(first + second) if together else (store.apply(first), store.apply(second))[1]
        assert r.expired_edges == 5  # T = 13: a->b, b->a, c->d, a->c and g->h (written in this batch) fall out
        assert sorted((s, d) for s, d, _, _ in store.edges()) == [("d", "c"), ("e", "f")]
        want = {"a": [], "b": [], "c": ["d"], "d": ["c"], "e": ["f"], "f": ["e"], "g": [], "h": [], "z": []}
        assert {v: store.neighbors(v) for v in want} == want
        assert {v: store.sample(v, 2) for v in want} == want
        assert {v: store.degree(v) for v in want} == {v: len(n) for v, n in want.items()}
        store.close()
        with GraphStore(tmp_path / "s") as again:  # degrees as stored, and nothing left due in the index
            assert {v: (again.neighbors(v), again.degree(v)) for v in want} == {v: (n, len(n)) for v, n in want.items()}
            assert again.apply([NodeUpsert("z", 13, (0.0,) * DIM)]).expired_edges == 0


def test_the_window_is_fixed_when_a_state_is_created(tmp_path: Path) -> None:
    GraphStore(tmp_path / "s", edge_ttl=60).close()
    with pytest.raises(StoreConfigError, match="created with --edge-ttl 60, not 30"):
        GraphStore(tmp_path / "s", edge_ttl=30)
    with GraphStore(tmp_path / "s") as store:
        assert store.edge_ttl == 60
    GraphStore(tmp_path / "plain").close()
    with pytest.raises(StoreConfigError, match="created with --edge-ttl 0, not 30"):
        GraphStore(tmp_path / "plain", edge_ttl=30)


def test_run_creates_its_state_with_the_window_it_is_given(tmp_path: Path) -> None:
    """``gnnstream run --edge-ttl`` on a new state: the state is created with that window (the worker then
    stops, Kafka being unreachable), and a run with another window is refused."""
    from tests.support import closed_port
    from tests.workers.reference import run_gnnstream
    init_model_dir(str(tmp_path / "model"), arch="sage", in_dim=DIM, hidden=4, out_dim=2, layers=1, fanouts=[2],
                   seed=0)
    state = tmp_path / "state"
    with closed_port() as port:
        common = ("run", "--bootstrap", f"127.0.0.1:{port}", "--broker-wait-s", "1", "--metrics-port", "0",
                  "--state", state, "--model", tmp_path / "model")
        res = run_gnnstream(*common, "--edge-ttl", "3600")
        assert res.returncode == 2 and "Kafka" in res.stderr, res.stderr
        with GraphStore(state) as store:
            assert store.edge_ttl == 3600
        res = run_gnnstream(*common, "--edge-ttl", "60")
        assert res.returncode == 2 and "created with --edge-ttl 3600, not 60" in res.stderr, res.stderr


def test_expiry_reads_only_the_edges_that_expire(tmp_path: Path) -> None:
    """The expiry index is ordered by time: advancing T reads the entries that fall out, and no more."""
    with GraphStore(tmp_path / "s", edge_ttl=10) as store:
        r = store.apply([EdgeUpsert(f"a{i}", f"b{i}", float(i)) for i in range(200)])
        assert r.expired_edges == 190  # T = 199 at the batch's end: t(e) <= 189 falls out
        seen: list[bytes] = []
        family = store.column("expiry")
        real = family.keys

        def counting(*args: Any, **kwargs: Any) -> Any:
            for key in real(*args, **kwargs):
                seen.append(key)
                yield key
        family.keys = counting  # type: ignore[method-assign]
        r = store.apply([NodeUpsert("x", 214.5, (0.0,) * DIM)])  # threshold 204.5: the other ten fall out
        assert r.expired_edges == 10 and not list(store.edges())
        seen.clear()
        store.apply([EdgeUpsert(f"c{i}", f"d{i}", 215.0 + i / 10) for i in range(50)])  # t 215.0 .. 219.9
        r = store.apply([NodeUpsert("x", 225.45, (0.0,) * DIM)])  # threshold 215.45: c0..c4 expire
        assert r.expired_edges == 5
        assert len(seen) <= 6  # the five expired and the first that stays


@pytest.mark.parametrize("name", ["sage", "gcn_staged", "gat_staged", "sage_staged"])
@pytest.mark.parametrize("seed", [4, 5])
def test_what_if_follows_the_window_and_the_stages(models: dict[str, Path], name: str, seed: int) -> None:
    """A what-if on a windowed state equals the reference of the base events plus the what-if's, whether its
    events move stream time (expiring edges and firing stages in the overlay only) or not; nothing is written."""
    from gnnstream.workers.query.state import QueryState
    model_dir = models[name]
    events = random_stream(seed, 200)
    rnd = random.Random(seed)
    base, extra = events[:160], events[160:]
    late = [e for e in base[100:] if isinstance(e, EdgeUpsert)][:3]  # old times again: late on arrival
    quiet = [EdgeUpsert(e.src, e.dst, e.ts - 2 * TTL) for e in late] + \
        [NodeUpsert(base[-1].src if isinstance(base[-1], EdgeUpsert) else "n1", 0.0, (0.1, 0.2, 0.3, 0.4))]
    with fast_tempdir() as tmp:
        with GraphStore(Path(tmp) / "s", seed=SEED, edge_ttl=TTL) as store:
            engine = Engine(store, load_model_dir(model_dir))
            for batch in _batches(base, rnd):
                store.apply(batch)
                engine.recompute()
            engine.drain()
            view = QueryState(store.path, model_dir, Path(tmp) / "q")
            try:
                view.refresh()
                for what_if in (extra, quiet):
                    fold = GraphFold(TTL)
                    for ev in base + what_if:
                        fold.apply_event(ev)
                    before = store.stream_time
                    ids = sorted(fold.nodes)
                    got = view.infer(what_if, ids)
                    assert store.stream_time == before
                    assert_embeddings_close(got["embeddings"], fold_embeddings(fold, model_dir), what="what-if")
                    modes = expected_modes(fold, model_dir)
                    assert got["modes"] == {v: modes[v] for v in ids}
                base_fold = GraphFold(TTL)
                for ev in base:
                    base_fold.apply_event(ev)
                assert_embeddings_close(_stored(engine), fold_embeddings(base_fold, model_dir),
                                        what="stored after the what-ifs")
            finally:
                view.close()


def _jsonl(path: Path, events: list) -> Path:
    from gnnstream.stream.events import encode_event
    path.write_bytes(b"".join(encode_event(ev) + b"\n" for ev in events))
    return path


def test_load_backfill_apply_in_runs_and_verify_from_the_command_line(models: dict[str, Path], tmp_path: Path) -> None:
    """``graph load --edge-ttl`` (bulk), ``backfill``, ``apply`` of two more files, ``verify``: the stored
    embeddings are the reference's at the final stream time; another window is refused in one line."""
    from tests.workers.reference import call_gnnstream
    import json
    model_dir = models["gcn_staged"]
    events = random_stream(7, 300)
    state = tmp_path / "state"
    parts = [_jsonl(tmp_path / f"part{i}.jsonl", events[a:b]) for i, (a, b) in enumerate([(0, 120), (120, 210),
                                                                                             (210, 300)])]
    deletes = [i for i, ev in enumerate(events[:120]) if isinstance(ev, NodeDelete)]
    done = call_gnnstream("graph", "load", "--state", state, "--model", model_dir, "--edge-ttl", TTL, parts[0])
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["edge_ttl"] == TTL and summary["bulk_events"] == (deletes[0] if deletes else 120)
    done = call_gnnstream("backfill", "--state", state, "--model", model_dir)
    assert done.returncode == 0, done.stderr
    expired = 0
    for part in parts[1:]:
        done = call_gnnstream("apply", "--state", state, part)
        assert done.returncode == 0, done.stderr
        expired += json.loads(done.stdout)["edges_expired"]
    assert expired > 0
    done = call_gnnstream("verify", "--state", state)
    assert done.returncode == 0, done.stdout + done.stderr
    done = call_gnnstream("embeddings", "--state", state, "--out", "-")
    got = {row["id"]: row["embedding"] for row in map(json.loads, done.stdout.splitlines())}
    fold = GraphFold(TTL)
    for ev in events:
        fold.apply_event(ev)
    assert_embeddings_close(got, fold_embeddings(fold, model_dir))
    refused = call_gnnstream("apply", "--state", state, "--edge-ttl", 10, parts[2])
    assert refused.returncode != 0
    line, = [ln for ln in refused.stderr.splitlines() if ln.strip()]
    assert "created with --edge-ttl 30, not 10" in line


def test_a_state_of_the_layout_without_event_time_is_refused_with_how_to_rebuild(tmp_path: Path) -> None:
    from gnnstream.graph_state.exceptions import StateLayoutError
    with GraphStore(tmp_path / "s") as store:
        store.column("meta")[b"layout"] = b"5"  # as a state written before event time records it
    with pytest.raises(StateLayoutError) as info:
        GraphStore(tmp_path / "s")
    message = str(info.value)
    assert "\n" not in message and "layout 5" in message and "gnnstream graph load --state NEW" in message


def test_model_init_writes_a_staged_policy(tmp_path: Path) -> None:
    """``model init --cold-start staged`` records the policy with its ages, as the engine reads it."""
    from tests.workers.reference import call_gnnstream
    res = call_gnnstream("model", "init", tmp_path / "m", "--in-dim", DIM, "--fanouts", "3", "--layers", "1",
                         "--cold-start", "staged", "--feature-only-s", "10", "--expand-s", "20",
                         "--min-neighbours", "3")
    assert res.returncode == 0, res.stderr
    policy = load_model_dir(str(tmp_path / "m")).config.cold_start
    assert policy == {"policy": "staged", "feature_only_s": 10.0, "expand_s": 20.0, "min_neighbours": 3}
