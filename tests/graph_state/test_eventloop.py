"""The compiled event loop (graph_state._eventloop) against the interpreted one it stands in for."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graph_state import keys
from graph_state.store import GraphStore, _eventloop, _Node, _Prefix
from stream.events import EdgeDelete, EdgeUpsert, NodeDelete, NodeUpsert
from tests.graph_state._events import DIM

FANOUTS = (2, 5)


def test_the_compiled_event_loop_is_built():
    # ``pip install -e .`` (make venv) compiles it; a missing module means the install found no C compiler
    assert _eventloop is not None, "graph_state._eventloop is not built: reinstall with gcc and the Python headers"
    assert GraphStore.compiled is True


def test_a_rank_function_that_does_not_return_8_bytes_fails_the_batch(tmp_path):
    store = GraphStore(tmp_path / "s")
    try:
        store.set_fanouts(FANOUTS)
        store.apply([NodeUpsert(name, 0, (0.0,) * DIM) for name in ("a", "b")])
        store._rank = lambda v, u: b"short"
        with pytest.raises(TypeError, match="8 bytes"):
            store.apply([EdgeUpsert("a", "b", 1, 1.0)])
        assert store.column("edges").get(keys.edge_key(store.iid("a"), store.iid("b"))) is None  # nothing written
    finally:
        store.close()


def _stream(rng: random.Random, n: int, n_nodes: int) -> list:
    """Events over few names, so edges repeat, reverse, loop, get deleted and a hub outgrows the cached prefix."""
    names = [f"v{i}" for i in range(n_nodes)] + ["h\u00fcb"]
    out = []
    for ts in range(n):
        a = "h\u00fcb" if rng.random() < 0.5 else rng.choice(names)
        b = rng.choice(names)
        r = rng.random()
        stamp = ts if rng.random() < 0.5 else float(ts) + 0.5  # int and float event times
        if r < 0.7:
            weight = rng.choice([1.0, 2.5, np.float32(3.0), 4])
            out.append(EdgeUpsert(a, b, stamp, weight) if rng.random() < 0.8 else EdgeUpsert(b, a, stamp, weight))
        elif r < 0.85:
            out.append(EdgeDelete(a, b, stamp))
        elif r < 0.97:
            out.append(NodeUpsert(b, stamp, tuple(rng.uniform(-1, 1) for _ in range(DIM))))
        else:
            out.append(NodeDelete(b, stamp))
    return out


def _contents(store: GraphStore) -> dict:
    return {cf: dict(store.column(cf).items()) for cf in keys.COLUMN_FAMILIES}


def _comparable(result) -> dict:
    fields = ("event_touches", "sample_changed", "count_changed", "features_changed", "degree_changed",
              "created", "deleted", "max_ts", "rows_written")
    return {name: getattr(result, name) for name in fields}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), n_nodes=st.integers(3, 80), max_batch=st.integers(1, 120))
def test_compiled_and_interpreted_loops_write_the_same(tmp_path_factory, seed, n_nodes, max_batch):
    rng = random.Random(seed)
    events = _stream(rng, 1_200, n_nodes)
    base = tmp_path_factory.mktemp("loops")
    stores = [GraphStore(base / "compiled", seed=seed % 1000), GraphStore(base / "interpreted", seed=seed % 1000)]
    stores[1].compiled = False
    try:
        for store in stores:
            store.set_fanouts(FANOUTS)
        pos, linked = 0, False
        while pos < len(events):
            size = rng.randint(1, max_batch)
            chunk = events[pos:pos + size]
            pos += size
            results = [store.apply(chunk) for store in stores]
            assert _comparable(results[0]) == _comparable(results[1])
            linked |= bool(results[0].degree_changed)
            assert {v: (p.keys, p.ids) for v, p in stores[0]._top.items()} == \
                   {v: (p.keys, p.ids) for v, p in stores[1]._top.items()}
            assert stores[0]._nodes == stores[1]._nodes
            if rng.random() < 0.1:  # both read back from RocksDB from here on
                for store in stores:
                    store._invalidate_caches()
        first, second = _contents(stores[0]), _contents(stores[1])
        assert first == second
        assert linked, "the stream changed some neighbour lists"  # (they may all be deleted again by its end)
    finally:
        for store in stores:
            store.close()


def test_the_compiled_loop_truncates_a_hub_prefix_as_the_interpreted_one(tmp_path):
    # a hub with more neighbours than the cached prefix holds: new neighbours past its end are reported far away
    stores = [GraphStore(tmp_path / "c"), GraphStore(tmp_path / "i")]
    stores[1].compiled = False
    try:
        for store in stores:
            store.set_fanouts(FANOUTS)
            store.apply([NodeUpsert(f"n{i}", 0, (0.0,) * DIM) for i in range(300)] + [NodeUpsert("hub", 0, (0.0,) * DIM)])
        for start in range(0, 300, 50):
            batch = [EdgeUpsert("hub", f"n{i}", 1, 1.0) for i in range(start, start + 50)]
            results = [store.apply(batch) for store in stores]
            assert results[0].event_touches == results[1].event_touches
        far = [pos for touches in results[0].event_touches for v, pos in touches if pos == 1 << 62]
        assert far, "some neighbours of the hub fall past its cached prefix"
        hub = stores[0].iid("hub")
        assert len(stores[0]._top[hub].keys) == stores[0].top_size < 300
        assert _contents(stores[0]) == _contents(stores[1])
    finally:
        for store in stores:
            store.close()


def _prefix(ids: list[int]) -> _Prefix:
    p = _Prefix()
    p.ids = list(ids)
    p.keys = [bytes(8)] * len(ids)
    return p


@pytest.mark.parametrize("width", [0, 1, 3, 6])
def test_the_compiled_prefix_comparison_matches_the_interpreted_one(width):
    rng = random.Random(width)
    nodes, tops, initial_top, initial_degree = {}, {}, {}, {}
    for v in range(400):
        before = rng.sample(range(1000), rng.randint(0, 8))
        kind = rng.random()
        if kind < 0.1:  # deleted in the batch
            nodes[v] = None
        elif kind < 0.2:  # record read, prefix dropped from the cache
            nodes[v] = _Node(len(before), 0, 0.0)
        else:
            after = list(before)
            if rng.random() < 0.5:  # a change past the first entries, or none at all
                after.insert(rng.randint(0, len(after)), rng.randrange(1000))
            if rng.random() < 0.3 and after:
                after.pop(rng.randrange(len(after)))
            nodes[v] = _Node(len(after) + rng.choice([0, 0, 5]), 0, 0.0)
            tops[v] = _prefix(after)
        initial_top[v], initial_degree[v] = before, len(before)
    batch = SimpleNamespace(initial_top=initial_top, initial_degree=initial_degree)
    out = {}
    for compiled in (True, False):
        owner = SimpleNamespace(_nodes=nodes, _top=tops, compiled=compiled)
        out[compiled] = GraphStore._prefix_changes(owner, batch, width)
    for got, want in zip(out[True], out[False]):
        assert got.dtype == want.dtype == np.int64
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    ids, before_m, after_m, moved = out[True]
    assert before_m.shape == after_m.shape == (len(ids), width)
    if width:
        assert 0 < len(ids) < 400  # some heads changed, some did not
        assert (before_m != after_m).any(axis=1).all()
    else:
        assert len(ids) == 0
    assert len(moved) and (moved[:, 1] != moved[:, 2]).all()


def _both_prefix_changes(nodes: dict, tops: dict, initial_top: dict, initial_degree: dict, width: int) -> list:
    """What the compiled and the interpreted comparison return (as lists), or the type of what they raise."""
    out = []
    for compiled in (True, False):
        owner = SimpleNamespace(_nodes=nodes, _top=tops, compiled=compiled)
        batch = SimpleNamespace(initial_top=dict(initial_top), initial_degree=initial_degree)
        try:
            out.append([part.tolist() for part in GraphStore._prefix_changes(owner, batch, width)])
        except Exception as exc:  # noqa: BLE001 - the two must fail alike
            out.append(type(exc))
    return out


def test_the_compiled_prefix_comparison_compares_ids_by_value_and_reads_absent_records_as_deleted():
    big = 10**12
    before, after = [int(str(big)), 5], [int(str(big)), 5]  # equal, not the same objects
    assert before[0] is not after[0]
    nodes = {1: _Node(2, 0, 0.0)}  # node 2 is not in the cache at all
    tops = {1: _prefix(after), 2: _prefix([7])}
    compiled, interpreted = _both_prefix_changes(nodes, tops, {1: before, 2: [7]}, {1: 2, 2: 1}, 4)
    assert compiled == interpreted == [[2], [[7, -1, -1, -1]], [[-1, -1, -1, -1]], [[2, 1, 0]]]


class _Touchy(int):
    """An id whose comparison does something."""

    def __eq__(self, other):
        self.action()
        return int(self) == int(other)

    __hash__ = int.__hash__


def test_the_compiled_prefix_comparison_fails_as_the_interpreted_one():
    node = {1: _Node(1, 0, 0.0)}
    cases = [
        (node, {1: None}, {1: [3]}, {1: 1}, 4),  # a cached prefix of None: AttributeError
        (node, {1: _prefix([2])}, {1: [3]}, {}, 4),  # no initial degree: KeyError
    ]
    for case in cases:
        compiled, interpreted = _both_prefix_changes(*case)
        assert isinstance(compiled, type) and compiled is interpreted
    owner = SimpleNamespace(_nodes=node, _top={1: _prefix([2])}, compiled=True)
    with pytest.raises(TypeError, match="list"):
        GraphStore._prefix_changes(owner, SimpleNamespace(initial_top={1: (3,)}, initial_degree={1: 1}), 4)
    with pytest.raises(ValueError, match="width"):
        GraphStore._prefix_changes(owner, SimpleNamespace(initial_top={1: [3]}, initial_degree={1: 1}), 2**62)
    with pytest.raises(MemoryError):
        GraphStore._prefix_changes(owner, SimpleNamespace(initial_top={1: [3]}, initial_degree={1: 1}), 2**59)


def test_the_compiled_prefix_comparison_survives_ids_whose_comparison_changes_the_lists():
    before = [_Touchy(3), 4, 5]
    after = [_Touchy(3), 4, 6]
    before[0].action = before.clear  # the lists shrink during the comparison
    after[0].action = lambda: None
    owner = SimpleNamespace(_nodes={1: _Node(3, 0, 0.0)}, _top={1: _prefix(after)}, compiled=True)
    ids, before_m, after_m, moved = GraphStore._prefix_changes(
        owner, SimpleNamespace(initial_top={1: before}, initial_degree={1: 3}), 4)
    assert ids.tolist() == [1] and before_m.tolist() == [[-1] * 4] and after_m.tolist() == [[3, 4, 6, -1]]
    grow = {1: [_Touchy(3)], 2: [8]}
    grow[1][0].action = lambda: grow.setdefault(99, [1])
    owner = SimpleNamespace(_nodes={1: _Node(1, 0, 0.0), 2: _Node(1, 0, 0.0)},
                            _top={1: _prefix([3]), 2: _prefix([8])}, compiled=True)
    with pytest.raises(RuntimeError, match="changed size"):
        GraphStore._prefix_changes(owner, SimpleNamespace(initial_top=grow, initial_degree={1: 1, 2: 1, 99: 1}), 4)
