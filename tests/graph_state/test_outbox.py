"""The outbox of a graph store: records appended with their sequence numbers, read in order, confirmed."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gnnstream.graph_state.outbox import Outbox
from gnnstream.graph_state.store import GraphStore
from gnnstream.graph_state.transaction import Transaction


def _append(store: GraphStore, outbox: Outbox, *records: tuple[list[int], float]) -> None:
    tx = Transaction()
    for iids, at in records:
        outbox.append(tx, np.asarray(iids, dtype=np.int64), at)
    store.commit(tx)


def test_records_come_back_in_commit_order_and_go_once_confirmed(tmp_path: Path) -> None:
    with GraphStore(str(tmp_path / "s"), seed=0) as store:
        outbox = Outbox(store)
        _append(store, outbox, ([3, 1], 10.0), ([7], 11.0))
        _append(store, outbox, ([2], 12.0))
        got = [(at, iids.tolist()) for _, at, iids in outbox.records()]
        assert got == [(10.0, [3, 1]), (11.0, [7]), (12.0, [2])]
        keys = [key for key, _, _ in outbox.records()]
        assert [at for _, at, _ in outbox.records(after=keys[0])] == [11.0, 12.0]
        outbox.confirm(keys[:2])
        assert outbox.pending() == 1 and [at for _, at, _ in outbox.records()] == [12.0]


def test_the_sequence_goes_on_after_a_reopen_and_after_a_failed_write(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    with GraphStore(path, seed=0) as store:
        outbox = Outbox(store)
        _append(store, outbox, ([1], 1.0))
        lost = Transaction()
        outbox.append(lost, np.asarray([9]), 2.0)  # never committed: its number is not taken
        outbox.reload()
        _append(store, outbox, ([2], 3.0))
    with GraphStore(path, seed=0) as store:
        outbox = Outbox(store)
        _append(store, outbox, ([3], 4.0))
        keys = [key for key, _, _ in outbox.records()]
        assert [int.from_bytes(k, "big") for k in keys] == [0, 1, 2]
        assert [iids.tolist() for _, _, iids in outbox.records()] == [[1], [2], [3]]
