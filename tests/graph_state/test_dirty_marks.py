"""Dirty marks: one packed block per batch, OR-combined on read, durable across reopening."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gnnstream.graph_state.marks import DIRTY_COUNT, DIRTY_DEGREE, DIRTY_INPUT, DIRTY_SAMPLE
from gnnstream.graph_state.store import GraphStore
from gnnstream.graph_state.transaction import Transaction
from gnnstream.stream.events import EdgeUpsert, NodeUpsert


def _marks(store: GraphStore) -> dict[tuple[int, str], int]:
    tags, iids, flags = store.dirty_mark_arrays()
    assert len(tags) == store.dirty_count()
    return {(t, store.name(i)): f for t, i, f in zip(tags.tolist(), iids.tolist(), flags.tolist())}


def test_marks_of_two_batches_combine_and_survive_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "db"
    with GraphStore(path, seed=0) as store:
        store.set_fanouts([2])
        store.apply([NodeUpsert("a", 1.0, [1.0, 2.0])])
        assert _marks(store) == {(0, "a"): DIRTY_INPUT}
        store.apply([EdgeUpsert("a", "b", 2.0, 1.0)])
        want = {
            (0, "a"): DIRTY_INPUT | DIRTY_DEGREE,  # input from batch 1, degree from batch 2
            (0, "b"): DIRTY_INPUT | DIRTY_DEGREE,  # created with the edge
            (2, "a"): DIRTY_SAMPLE | DIRTY_COUNT,
            (2, "b"): DIRTY_SAMPLE | DIRTY_COUNT,
        }
        assert _marks(store) == want
        blocks = list(store.column("dirty").keys())
        assert len(blocks) == 2 and all(len(k) == 9 for k in blocks), "one packed block per batch"
    with GraphStore(path) as store:
        assert _marks(store) == want
        store.apply([EdgeUpsert("a", "c", 3.0, 1.0)])  # a new block after the reopen does not overwrite the old
        assert _marks(store)[(0, "b")] == DIRTY_INPUT | DIRTY_DEGREE
        assert _marks(store)[(0, "c")] == DIRTY_INPUT | DIRTY_DEGREE
        assert len(list(store.column("dirty").keys())) == 3


def test_blocks_combine_and_clearing(tmp_path: Path) -> None:
    path = tmp_path / "db"
    with GraphStore(path, seed=0) as store:
        store.set_fanouts([2])
        store.apply([EdgeUpsert("a", "b", 1.0, 1.0)])
        a = store.iid("a")
        # two blocks written through write(), one mark in both
        tx = Transaction()
        tx.add_marks(np.asarray([7]), np.asarray([a]), np.asarray([DIRTY_COUNT]))
        tx.add_marks(np.asarray([7, 0]), np.asarray([a, a]), np.asarray([DIRTY_SAMPLE, 16]))
        store.commit(tx)
        got = _marks(store)
        assert got[(7, "a")] == DIRTY_COUNT | DIRTY_SAMPLE
        assert got[(0, "a")] == DIRTY_INPUT | DIRTY_DEGREE | 16
    with GraphStore(path) as store:
        assert _marks(store) == got
        tx = Transaction()
        tx.clear_marks()
        store.commit(tx)
        assert store.dirty_count() == 0 and _marks(store) == {}
    with GraphStore(path) as store:
        assert store.dirty_count() == 0


def test_a_batch_that_changes_nothing_writes_no_block(tmp_path: Path) -> None:
    with GraphStore(tmp_path / "db", seed=0) as store:
        store.set_fanouts([2])
        store.apply([])
        assert store.dirty_count() == 0 and list(store.column("dirty").keys()) == []
