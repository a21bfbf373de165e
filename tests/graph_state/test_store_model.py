"""The RocksDB graph store against a networkx model of docs/design.md.

Property tests drive random event streams (hubs past the in-memory rank
prefix, which holds at least the largest fanout's entries of a list, self loops, reciprocal edges, deletes, cascading node deletes)
through random batchings, cache drops and reopens, and compare every public
read with :class:`GraphModel` after every batch.
"""

from __future__ import annotations

from hashlib import blake2b
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from gnnstream.graph_state.sampler import neighbor_rank, sample_neighbors
from gnnstream.graph_state.store import GraphStore
from gnnstream.stream.events import EdgeDelete, EdgeUpsert, NodeDelete, NodeUpsert
from tests.graph_state._model import DIM, GraphModel, assert_store_matches, random_batches, ranked, raw_contents
from tests.workers.reference import fast_tempdir

FANOUTS = (1, 3, 10)
CHECK_KS = (0, 1, 3, 10, 32, 40)  # 10: the whole in-memory prefix; 32 and 40: read straight from RocksDB
HUB = "hub"
LEAVES = [f"n{i}" for i in range(44)] + ["é", "日本", "a:b", "x y", "0"]
NAMES = [HUB, *LEAVES]

_ts = st.integers(0, 2**31)
_weight = st.floats(-1e6, 1e6, allow_nan=False)
_feats = st.tuples(*[st.floats(-1e3, 1e3, allow_nan=False, width=32)] * DIM)
_name = st.sampled_from(NAMES)
_endpoint = st.one_of(st.just(HUB), _name)  # about half of the edge events touch the hub


@st.composite
def scenarios(draw, hub_min: int = 0, max_events: int = 80):
    """Draw ``(seed, cache_nodes, events, batch sizes, actions between batches, fanout batch)``."""
    events: list = []
    upserted: list[tuple[str, str]] = []
    for _ in range(draw(st.integers(1, max_events))):
        op = draw(st.sampled_from(
            ["up", "up", "up", "loop", "pair", "del", "del_known", "del_known", "node", "node", "node_del"]
        ))
        ts = draw(_ts)
        if op == "up":
            s, d = draw(_endpoint), draw(_endpoint)
            events.append(EdgeUpsert(s, d, ts, draw(_weight)))
            upserted.append((s, d))
        elif op == "loop":
            n = draw(_name)
            events.append(EdgeUpsert(n, n, ts, draw(_weight)))
        elif op == "pair":
            s, d = draw(_endpoint), draw(_name)
            events += [EdgeUpsert(s, d, ts, draw(_weight)), EdgeUpsert(d, s, ts, draw(_weight))]
            upserted += [(s, d), (d, s)]
        elif op == "del":
            events.append(EdgeDelete(draw(_endpoint), draw(_endpoint), ts))
        elif op == "del_known" and upserted:
            s, d = draw(st.sampled_from(upserted))
            events.append(EdgeDelete(s, d, ts))
        elif op == "node":
            events.append(NodeUpsert(draw(_name), ts, draw(_feats)))
        elif op == "node_del":
            events.append(NodeDelete(draw(st.sampled_from(LEAVES + [HUB] + ["never-seen"])), ts))
    if hub_min:
        # a contiguous burst of distinct hub edges, so the hub's degree passes hub_min right after it
        leaves = draw(st.lists(st.sampled_from(LEAVES), min_size=hub_min, max_size=len(LEAVES), unique=True))
        burst = [EdgeUpsert(HUB, leaf, draw(_ts), 1.0) if draw(st.booleans()) else EdgeUpsert(leaf, HUB, draw(_ts), 2.0)
                 for leaf in leaves]
        at = draw(st.integers(0, len(events)))
        events[at:at] = burst
    sizes = []
    left = len(events)
    while left > 0:
        size = draw(st.integers(1, max(1, min(left, 40))))
        sizes.append(size)
        left -= size
    actions = [draw(st.sampled_from(["none"] * 3 + ["invalidate"] * 2 + ["reopen", "reopen_noseed"])) for _ in sizes]
    fanout_at = draw(st.integers(-1, len(sizes) - 1))  # set_fanouts before batch i (-1: at creation)
    seed = draw(st.sampled_from([0, 1, 2**40 + 3]))
    cache_nodes = draw(st.sampled_from([1, 5, 2_000_000]))
    return seed, cache_nodes, events, sizes, actions, fanout_at


pytestmark = pytest.mark.usefixtures("frozen_heap")


def _open(path, seed, cache_nodes, with_seed=True):
    return GraphStore(path, seed=seed if with_seed else None, cache_nodes=cache_nodes, lock_timeout=2)


def _run_scenario(scenario, require_hub_over: int = 0) -> None:
    with fast_tempdir() as d:
        _check_scenario(Path(d), scenario, require_hub_over)


def _check_scenario(path: Path, scenario, require_hub_over: int) -> None:
    seed, cache_nodes, events, sizes, actions, fanout_at = scenario
    store = _open(path, seed, cache_nodes)
    model = GraphModel(seed)
    if fanout_at < 0:
        store.set_fanouts(FANOUTS)
    names = set(NAMES) | {"never-seen"}
    max_hub = 0
    pos = 0
    try:
        for b, (size, action) in enumerate(zip(sizes, actions)):
            if b == fanout_at:
                store.set_fanouts(list(FANOUTS))
            batch = events[pos:pos + size]
            pos += size
            start_samples = {(v, k): model.sample(v, k) for v in names for k in FANOUTS}
            start_feats = {v: model.features.get(v) for v in names}
            start_deg = {v: len(model.nbrs(v)) for v in names}
            for ev in batch:
                model.apply(ev)
                max_hub = max(max_hub, len(model.nbrs(HUB)))
            result = store.apply(batch, {("graph-events", 0): pos})

            for k in store.fanouts:
                changed = {v for v in names if model.sample(v, k) != start_samples[(v, k)]}
                assert {store.name(x) for x in result.sample_changed[k]} == changed, f"sample_changed[{k}]"
                counts = {v for v in names if min(start_deg[v], k) != min(len(model.nbrs(v)), k)}
                assert {store.name(x) for x in result.count_changed[k]} == counts, f"count_changed[{k}]"
            feats_changed = {
                v for v in names
                if (start_feats[v] is None) != (model.features.get(v) is None)
                or (start_feats[v] is not None and not np.array_equal(start_feats[v], model.features[v]))
            }
            assert feats_changed <= {store.name(x) for x in result.features_changed}
            assert result.max_ts == max(float(ev.ts) for ev in batch)

            assert_store_matches(store, model, names, CHECK_KS)
            assert store.offsets() == {("graph-events", 0): pos}

            if action == "invalidate":
                store._invalidate_caches()
            elif action.startswith("reopen"):
                store.close()
                store = _open(path, seed, cache_nodes, with_seed=action == "reopen")
                assert store.seed == seed
        assert_store_matches(store, model, names, CHECK_KS)
    finally:
        store.close()
    note(f"max hub degree {max_hub}")
    if require_hub_over:
        assert max_hub > require_hub_over, "scenario generator did not build a big enough hub"


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.slow
@settings(max_examples=60, **_SETTINGS)
@given(scenario=scenarios())
def test_random_streams_match_model(scenario):
    _run_scenario(scenario)


@pytest.mark.slow
@settings(max_examples=35, **_SETTINGS)
@given(scenario=scenarios(hub_min=36, max_events=70))
def test_hub_past_cached_prefix_matches_model(scenario):
    """A hub with more than 32 neighbours: past the in-memory prefix (the largest fanout, 10, plus 8 held in
    reserve for removals) more than once."""
    _run_scenario(scenario, require_hub_over=32)


# ---------------------------------------------------------------------- oracle self-check
@given(v=st.text(min_size=1, max_size=5), us=st.sets(st.text(min_size=1, max_size=5), max_size=30),
       seed=st.integers(0, 2**63), k=st.integers(0, 35))
@settings(max_examples=200, deadline=None)
def test_sampler_oracle_matches_rank_formula(v, us, seed, k):
    assert sample_neighbors(seed, v, list(us) + list(us) + [v], k) == ranked(seed, v, us)[:k]
    for u in list(us)[:3]:
        assert neighbor_rank(seed, v, u) == int.from_bytes(
            blake2b(f"{seed}:{v}:{u}".encode(), digest_size=8).digest(), "big")


def test_rank_formula_known_value():
    # Pinned so a change of the formula (encoding, separator, byte order) shows up here.
    want = int.from_bytes(blake2b(b"0:a1:b2", digest_size=8).digest(), "big")
    assert neighbor_rank(0, "a1", "b2") == want
    assert neighbor_rank(1, "a1", "b2") != want


# ---------------------------------------------------------------------- semantics
@pytest.fixture
def store(tmp_path):
    s = GraphStore(tmp_path / "db", seed=0)
    s.set_fanouts(FANOUTS)
    yield s
    s.close()


def _feat(x: float) -> tuple[float, ...]:
    return (x,) * DIM


def test_delete_one_direction_keeps_neighbour_while_reverse_edge_remains(store):
    store.apply([EdgeUpsert("u", "v", 1, 1.0), EdgeUpsert("v", "u", 2, 2.0)])
    store.apply([EdgeDelete("u", "v", 3)])
    assert store.neighbors("v") == ["u"] and store.neighbors("u") == ["v"]
    assert store.degree("v") == 1
    assert store.edge("u", "v") is None and store.edge("v", "u") == (2.0, 2.0)
    assert store.sample("v", 1) == ["u"]
    assert store.sampled_by(1, store.iid("u")) == [store.iid("v")]
    store.apply([EdgeDelete("v", "u", 4)])
    assert store.neighbors("v") == [] and store.neighbors("u") == []
    assert store.exists("u") and store.exists("v"), "losing all edges must not remove a node"
    assert store.sampled_by(1, store.iid("u")) == []


def test_reciprocal_edges_count_once(store):
    r = store.apply([EdgeUpsert("a", "b", 1), EdgeUpsert("b", "a", 1)])
    assert store.degree("a") == store.degree("b") == 1
    assert r.sample_changed[1] == {store.iid("a"), store.iid("b")}
    store.apply([EdgeDelete("b", "a", 2)])
    r = store.apply([EdgeUpsert("b", "a", 3)])
    assert store.degree("a") == store.degree("b") == 1
    assert r.sample_changed[1] == set() and r.count_changed[1] == set(), "the reverse edge does not change N"


def test_self_loop_creates_node_but_no_neighbour(store):
    r = store.apply([EdgeUpsert("s", "s", 5, 0.5)])
    assert store.exists("s") and store.neighbors("s") == [] and store.degree("s") == 0
    assert list(store.edges()) == [("s", "s", 0.5, 5.0)]
    assert r.sample_changed[10] == set() and r.count_changed[10] == set()
    store.apply([EdgeUpsert("s", "t", 6), EdgeDelete("s", "s", 7)])
    assert store.neighbors("s") == ["t"] and list(store.edges()) == [("s", "t", 1.0, 6.0)]


def test_node_delete_cascades_and_edge_recreates_without_features(store):
    store.apply([NodeUpsert("a", 1, _feat(0.5)), EdgeUpsert("a", "b", 1), EdgeUpsert("c", "a", 1),
                 EdgeUpsert("a", "a", 1), NodeUpsert("b", 1, _feat(1.0))])
    a = store.iid("a")
    assert store.sampled_by(10, a) == sorted([store.iid("b"), store.iid("c")])
    r = store.apply([NodeDelete("a", 2)])
    assert not store.exists("a")
    assert store.features("a") is None
    assert list(store.edges()) == []
    assert store.neighbors("b") == [] and store.neighbors("c") == [] and store.neighbors("a") == []
    assert store.exists("b") and store.exists("c")
    assert store.sampled_by(10, a) == [] and store.sampled_by(10, store.iid("b")) == []
    assert r.sample_changed[1] == {a, store.iid("b"), store.iid("c")}
    assert a in r.deleted
    np.testing.assert_array_equal(store.features("b"), np.full(DIM, 1.0, np.float32))
    r = store.apply([EdgeUpsert("b", "a", 3)])
    assert store.exists("a") and store.features("a") is None and not store.has_features_iid(store.iid("a"))
    assert store.neighbors("a") == ["b"]
    assert store.iid("a") in r.created
    rows, has = store.feature_rows([store.iid("a"), store.iid("b")])
    assert rows.dtype == np.float32 and rows.shape == (2, DIM)
    assert has.tolist() == [False, True] and not rows[0].any()


def test_deleting_absent_things_is_a_noop_and_creates_nothing(store):
    store.apply([EdgeUpsert("a", "b", 1), NodeUpsert("c", 1, _feat(2.0))])
    before = raw_contents(store)
    r = store.apply([
        EdgeDelete("x", "y", 2),  # both endpoints unknown
        EdgeDelete("a", "x", 2),  # one endpoint unknown
        EdgeDelete("b", "a", 2),  # both known, edge absent (only a->b exists)
        EdgeDelete("a", "c", 2),
        EdgeDelete("c", "c", 2),
        NodeDelete("x", 2),
        NodeDelete("never", 2),
    ])
    after = raw_contents(store)  # the events move stream time on, and change nothing else
    assert dict(after.pop("meta"))[b"stream_time"] == b"2.0"
    assert dict(before.pop("meta"))[b"stream_time"] == b"1.0"
    assert after == before
    for name in ("x", "y", "never"):
        assert not store.exists(name) and store.iid(name) is None
    assert sorted(store.nodes()) == ["a", "b", "c"]
    assert all(r.sample_changed[k] == set() and r.count_changed[k] == set() for k in FANOUTS)
    # deleting an already-deleted node is a no-op too
    store.apply([NodeDelete("c", 3)])
    before = raw_contents(store)
    store.apply([NodeDelete("c", 3), EdgeDelete("c", "a", 3)])  # at the same stream time
    assert raw_contents(store) == before
    assert not store.exists("c")


def test_node_upsert_replaces_features_as_float32(store):
    store.apply([NodeUpsert("a", 1, (0.1, 0.2, 0.3, 1e-40))])
    store.apply([NodeUpsert("a", 2, (1.5, -2.5, 3.0, 4.0))])
    np.testing.assert_array_equal(store.features("a"), np.array([1.5, -2.5, 3.0, 4.0], np.float32))
    store._invalidate_caches()
    np.testing.assert_array_equal(store.features("a"), np.array([1.5, -2.5, 3.0, 4.0], np.float32))
    assert store.feature_dim == DIM


@pytest.mark.parametrize("per_batch", [1, 7, 1000])
def test_sample_changes_of_batches_hand_made(tmp_path, per_batch):
    """Each batch reports exactly the nodes whose S_k differs before and after it, changes that cancel out
    inside it included."""
    events = [EdgeUpsert("hub", f"n{i}", i) for i in range(40)]
    events += [EdgeDelete("hub", f"n{i}", 50 + i) for i in range(0, 40, 3)]
    events += [EdgeUpsert(f"n{i}", "hub", 100 + i) for i in range(0, 40, 6)]
    events += [NodeDelete("n5", 200), EdgeUpsert("n5", "hub", 201), NodeDelete("hub", 202),
               EdgeUpsert("hub", "n1", 203), EdgeUpsert("hub", "n2", 204), EdgeDelete("hub", "n2", 205)]
    names = {"hub", *(f"n{i}" for i in range(40))}
    store = GraphStore(tmp_path / "db", seed=3)
    store.set_fanouts(FANOUTS)
    model = GraphModel(3)
    try:
        for at in range(0, len(events), per_batch):
            batch = events[at:at + per_batch]
            before = {(v, k): model.sample(v, k) for v in names for k in FANOUTS}
            degree = {v: len(model.nbrs(v)) for v in names}
            model.apply_all(batch)
            result = store.apply(batch)
            for k in FANOUTS:
                want = {v for v in names if model.sample(v, k) != before[(v, k)]}
                assert {store.name(x) for x in result.sample_changed[k]} == want, (at, k)
                counts = {v for v in names if min(degree[v], k) != min(len(model.nbrs(v)), k)}
                assert {store.name(x) for x in result.count_changed[k]} == counts, (at, k)
        assert_store_matches(store, model, names, CHECK_KS)
    finally:
        store.close()


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
@pytest.mark.parametrize("per_batch", [1, 7, 1000])
def test_hub_refill_after_deleting_top_ranked(tmp_path, cold, per_batch):
    """Deleting the best-ranked neighbours of a 100-neighbour hub refills S_k from RocksDB."""
    store = GraphStore(tmp_path / "db", seed=11)
    store.set_fanouts(FANOUTS)
    model = GraphModel(11)
    leaves = [f"l{i}" for i in range(100)]
    names = {"hub", *leaves}
    try:
        events = [EdgeUpsert("hub", u, 1) if i % 2 else EdgeUpsert(u, "hub", 1) for i, u in enumerate(leaves)]
        store.apply(events)
        model.apply_all(events)
        doomed = ranked(11, "hub", leaves)[:70]  # eats through the 10-entry in-memory prefix 7 times
        dels = [EdgeDelete("hub", u, 2) if leaves.index(u) % 2 else NodeDelete(u, 2) for u in doomed]
        for i in range(0, len(dels), per_batch):
            if cold:
                store._invalidate_caches()
            store.apply(dels[i:i + per_batch])
            model.apply_all(dels[i:i + per_batch])
            assert store.sample("hub", 10) == model.sample("hub", 10)
        assert store.degree("hub") == 30
        assert_store_matches(store, model, names, CHECK_KS)
        # and back up again
        store.apply([EdgeUpsert("hub", u, 3) for u in doomed])
        model.apply_all([EdgeUpsert("hub", u, 3) for u in doomed])
        assert_store_matches(store, model, names, CHECK_KS)
    finally:
        store.close()


@pytest.mark.parametrize("k", [33, 50])
def test_set_fanouts_above_cached_prefix(tmp_path, k):
    """Raising the largest fanout past the in-memory prefix's width must not truncate S_k: the prefixes held
    at the old width are not reused for ``sample(v, k)`` or the sampled-by index of the new k."""
    store = GraphStore(tmp_path / "db", seed=0)
    model = GraphModel(0)
    try:
        events = [EdgeUpsert("hub", f"n{i}", 1) for i in range(100)]
        store.apply(events)  # holds hub's 8-entry prefix
        model.apply_all(events)
        store.set_fanouts([3, k])
        assert store.sample("hub", k) == model.sample("hub", k)
        rev = model.sampled_by(k)
        for u in (f"n{i}" for i in range(100)):
            assert sorted(store.name(x) for x in store.sampled_by(k, store.iid(u))) == sorted(rev.get(u, ()))
        more = [EdgeUpsert("hub", f"m{i}", 2) for i in range(20)]
        store.apply(more)
        model.apply_all(more)
        assert store.sample("hub", k) == model.sample("hub", k)
    finally:
        store.close()


def test_deterministic_stream_matches_model_with_reopens(tmp_path):
    """The crash test's event stream, applied in-process, matches the model batch by batch."""
    batches = random_batches(seed=5, n_batches=30, batch_size=50)
    path = tmp_path / "db"
    store = GraphStore(path, seed=0)
    store.set_fanouts(FANOUTS)
    model = GraphModel(0)
    names = {"hub", "never", *(f"v{i}" for i in range(60))}
    try:
        for i, batch in enumerate(batches):
            store.apply(batch, {("events", 0): (i + 1) * 50})
            model.apply_all(batch)
            if i % 7 == 3:
                store.close()
                store = GraphStore(path)
            if i % 5 == 0:
                assert_store_matches(store, model, names, FANOUTS)
        assert_store_matches(store, model, names, CHECK_KS)
        assert max(len(model.nbrs("hub")), 0) > 10
    finally:
        store.close()


def test_warm_ids_reads_the_name_map_up_to_the_cache_bound(tmp_path):
    names = [f"w{i}" for i in range(12)] + ["é", "a:b"]
    with GraphStore(tmp_path / "s", seed=0) as store:
        store.apply([EdgeUpsert(a, b, 1.0, 1.0) for a, b in zip(names, names[1:])])
        want = {name: store.iid(name) for name in names}
    with GraphStore(tmp_path / "s") as store:
        assert store.warm_ids() == len(names)
        assert {name: store._ids.iid_of[name] for name in names} == want  # read from the map, not looked up
        assert {store._ids.name_of[iid] for iid in want.values()} == set(names)
        assert store.warm_ids() == 0  # nothing left to read
    with GraphStore(tmp_path / "s", cache_nodes=5) as store:
        assert store.iid("é") == want["é"]
        assert store.warm_ids() == 4 and len(store._ids.iid_of) == 5
        assert all(store.iid(name) == iid for name, iid in want.items())  # the rest still come from RocksDB


def test_a_follower_keeps_names_ids_across_catch_ups(tmp_path) -> None:
    """A follower keeps the ids it looked up when it catches up (an id never changes once handed out) and
    reads what the writer changed since: deletes, re-creations and new nodes."""
    writer = GraphStore(tmp_path / "s", seed=0)
    follower = None
    try:
        writer.apply([EdgeUpsert("a", "b", 1), EdgeUpsert("b", "c", 2)])
        follower = GraphStore(tmp_path / "s", follow=tmp_path / "f")
        ids = {name: follower.iid(name) for name in "abc"}
        assert follower.iid("d") is None and sorted(follower.neighbors("b")) == ["a", "c"]
        writer.apply([NodeDelete("a", 3), EdgeUpsert("d", "b", 4), EdgeUpsert("a", "c", 5)])
        follower.catch_up()
        assert {name: follower.iid(name) for name in "abc"} == ids == {name: writer.iid(name) for name in "abc"}
        assert follower.iid("d") == writer.iid("d") not in ids.values()
        for name in "abcd":
            assert sorted(follower.neighbors(name)) == sorted(writer.neighbors(name)), name
        assert sorted(follower.neighbors("a")) == ["c"] and sorted(follower.neighbors("b")) == ["c", "d"]
    finally:
        if follower is not None:
            follower.close()
        writer.close()
