"""Value layouts of the engine's tables: final rows with their metadata, and outbox records."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from gnnstream.graph_state import keys
from gnnstream.graph_state.store import GraphStore
from gnnstream.graph_state.transaction import Transaction
from gnnstream.graph_state import row_file
from gnnstream.graph_state.codecs import PAGE_ROWS, decode_page, encode_pages
from gnnstream.graph_state.outbox import decode_record, encode_record
from gnnstream.graph_state.page_log import SUPERSEDED_SHARE, EmbeddingMeta, PageLog
from gnnstream.graph_state.row_cache import EmbeddingTables
from gnnstream.graph_state.row_file import RowFile, RowReaders


def _commit(store: GraphStore, records: list) -> int:
    """The page logs' records, committed as the engine commits them."""
    tx = Transaction()
    tx.add(records)
    return store.commit(tx)


def _set(table: PageLog, iids, versions, times, modes) -> None:
    table.set(np.asarray(iids, dtype=np.int64), np.asarray(versions), np.asarray(times, dtype=np.float64),
              np.asarray([table.code(m) for m in modes], dtype=np.int16))


def test_meta_table_pages_round_trip_through_a_fresh_table(tmp_path) -> None:
    with GraphStore(tmp_path / "s") as store:
        table = PageLog(store)
        iids = np.asarray([3, 0, 7, 12], dtype=np.int64)
        modes = ["full", "cold_start", "full", "feature_only"]
        _set(table, iids, [5, 1, 2, 9], [10.5, 0.0, 3.25, 7.0], modes)
        rows = np.arange(4 * 3, dtype=np.float32).reshape(4, 3) - 4.5
        puts = table.encode(iids, rows)
        assert [(cf, value is None) for cf, _, value in puts] == [("embpages", False)]  # one page for four rows
        _commit(store, puts)
        rec, page_modes, has_rows = decode_page(puts[0][2])
        assert has_rows and rec["iid"].tolist() == iids.tolist() and rec["version"].tolist() == [5, 1, 2, 9]
        assert [page_modes[m] for m in rec["mode"].tolist()] == modes
        assert (int(rec["width"]), int(rec["frame"])) == (3, 0)  # the rows sit in frame 0 of the row file
        stored = np.fromfile(tmp_path / "s" / "final-rows-3.f32", dtype="<f4")
        np.testing.assert_array_equal(stored[:12].reshape(4, 3), rows)
        # withdrawn: the metadata stays, the row goes; the first page still holds three current records
        _set(table, iids[:1], [6], [11.0], ["deleted"])
        puts = table.encode(iids[:1], None)
        assert [(cf, value is None) for cf, _, value in puts] == [("embpages", False)]
        _commit(store, puts)
        again = PageLog(store)
        version, event_ts, mode = again.get(np.asarray([3, 0, 99], dtype=np.int64))
        assert version.tolist() == [6, 1, 0]
        assert event_ts.tolist() == [11.0, 0.0, 0.0]
        assert [again.names[c] if c >= 0 else None for c in mode.tolist()] == ["deleted", "cold_start", None]
        got, present = again.rows(np.asarray([12, 3, 0, 99, 7], dtype=np.int64), 3)
        assert present.tolist() == [True, False, True, False, True]
        np.testing.assert_array_equal(got[[0, 2, 4]], rows[[3, 1, 2]])
        assert not got[[1, 3]].any()
        items = {iid: (meta, row) for iid, meta, row in again.items()}
        assert set(items) == {0, 3, 7, 12}
        assert items[3] == (EmbeddingMeta(6, 11.0, "deleted"), None)
        assert items[12][0] == EmbeddingMeta(9, 7.0, "feature_only")
        np.testing.assert_array_equal(items[12][1], rows[3])
        assert (again.live(), again.stored_slots()) == (4, 5)


def test_a_page_whose_records_are_all_superseded_is_deleted_in_the_same_batch(tmp_path) -> None:
    with GraphStore(tmp_path / "s") as store:
        table = PageLog(store)
        _set(table, [1, 2], [1, 1], [0.0, 0.0], ["full", "full"])
        _commit(store, table.encode(np.asarray([1, 2]), np.ones((2, 4), dtype=np.float32)))
        first = keys.encode_iid(0)
        assert store.column("embpages").get(first) is not None
        _set(table, [1, 2], [2, 2], [1.0, 1.0], ["full", "full"])
        puts = table.encode(np.asarray([2, 1]), np.full((2, 4), 2.0, dtype=np.float32))
        assert ("embpages", first, None) in puts
        _commit(store, puts)
        assert store.column("embpages").get(first) is None
        assert (table.live(), table.stored_slots()) == (2, 2)
        rows, present = PageLog(store).rows(np.asarray([1, 2]), 4)
        assert present.all() and (rows == 2.0).all()


@pytest.mark.parametrize("cache", ["none", "even iids"])
def test_the_log_stays_near_its_live_records_and_reloads_to_the_same_state(tmp_path, cache: str) -> None:
    """Records moved out of sparse pages take their rows from the row cache where it holds them, else from the
    pages."""

    def bound(table: PageLog) -> int:  # superseded slots within a share of the live ones plus the slack,
        live = table.live()  # and a batch's records (one batch may overshoot)
        return live + live // SUPERSEDED_SHARE + PAGE_ROWS + 400

    rng = np.random.default_rng(3)
    n, dim = 2_000, 8
    with GraphStore(tmp_path / "s") as store:
        table = PageLog(store, gc_slack=PAGE_ROWS)
        want_rows = np.zeros((n, dim), dtype=np.float32)
        want_version = np.zeros(n, dtype=np.int64)
        if cache == "even iids":
            def row_cache(iids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
                held = iids % 2 == 0
                return np.where(held[:, None], want_rows[iids], np.nan).astype(np.float32), held

            table.row_cache = row_cache
        for step in range(60):
            ids = np.sort(rng.choice(n, size=int(rng.integers(1, 400)), replace=False)).astype(np.int64)
            want_version[ids] += 1
            want_rows[ids] = rng.standard_normal((len(ids), dim)).astype(np.float32)
            _set(table, ids, want_version[ids], np.full(len(ids), float(step)), ["full"] * len(ids))
            _commit(store, table.encode(ids, want_rows[ids]) + table.compact())
            table.committed()
            assert table.stored_slots() <= bound(table)
        assert table.stored_slots() <= bound(table)
        pages = sum(1 for _ in store.column("embpages").keys())
        assert pages * PAGE_ROWS >= table.stored_slots()
        # frames of deleted pages are reused: little more frames are in use than pages are stored, and the
        # file holds at most a quarter more than those (it grows by a quarter at a time)
        used = table._file(dim)._next
        assert used <= pages + 10
        frames = (tmp_path / "s" / f"final-rows-{dim}.f32").stat().st_size / (PAGE_ROWS * dim * 4)
        assert frames <= max(used + used // 4, 16)
        written = np.flatnonzero(want_version)
        again = PageLog(store)
        version, _, _ = again.get(np.arange(n))
        np.testing.assert_array_equal(version, want_version)
        rows, present = again.rows(np.arange(n), dim)
        np.testing.assert_array_equal(present, want_version > 0)
        np.testing.assert_array_equal(rows[written], want_rows[written])
        assert again.stored_slots() == table.stored_slots() and again.live() == len(written)
        assert sorted(iid for iid, _, _ in again.items()) == written.tolist()


def test_outbox_record_round_trip() -> None:
    iids = np.asarray([2**40 + 1, 0, 17], dtype=np.int64)
    computed_at, back = decode_record(encode_record(iids, 1234.5))
    assert computed_at == 1234.5
    np.testing.assert_array_equal(back, iids)
    assert decode_record(encode_record(np.zeros(0, dtype=np.int64), 1.0))[1].tolist() == []


def test_compaction_moves_withdrawn_records_into_pages_without_rows(tmp_path) -> None:
    with GraphStore(tmp_path / "s") as store:
        table = PageLog(store, gc_slack=0)
        ids = np.arange(1000, dtype=np.int64)
        _set(table, ids, np.full(1000, 3), np.full(1000, 1.0), ["deleted"] * 1000)
        _commit(store, table.encode(ids, None))  # withdrawn: pages without rows
        want = np.zeros((1000, 2), dtype=np.float32)
        version = np.full(1000, 3)
        for back in (ids[ids % 10 != 0], ids[(ids % 10 != 0) & (ids % 100 >= 10)]):  # 90 %, then 90 % of those
            version[back] += 1
            want[back] = np.random.default_rng(len(back)).standard_normal((len(back), 2)).astype(np.float32)
            _set(table, back, version[back], np.full(len(back), 2.0), ["full"] * len(back))
            puts = table.encode(back, want[back])
            superseded = table.stored_slots() - table.live()
            moves = table.compact()  # as the engine does: after the last encode of a WriteBatch
            _commit(store, puts + moves)
        assert superseded > table.live() == 1000  # the second round left more superseded records than live ones
        kinds = {decode_page(value)[2] for _, _, value in moves if value is not None}
        assert kinds == {False, True}  # withdrawn records and rows both moved to new pages
        assert table.stored_slots() <= table.live() + table.live() // SUPERSEDED_SHARE + PAGE_ROWS
        again = PageLog(store)
        items = {iid: (meta, row) for iid, meta, row in again.items()}
        withdrawn = set(ids[ids % 10 == 0].tolist())
        assert {iid for iid, (_, row) in items.items() if row is None} == withdrawn
        assert all(items[i][0] == EmbeddingMeta(3, 1.0, "deleted") for i in withdrawn)
        back = ids[ids % 10 != 0]
        got, present = again.rows(back, 2)
        assert present.all()
        np.testing.assert_array_equal(got, want[back])
        np.testing.assert_array_equal(again.get(back)[0], version[back])


def _frame(store: GraphStore, seq: int) -> int:
    rec, _, has_rows = decode_page(store.column("embpages").get(keys.encode_iid(seq)))
    assert has_rows
    return int(rec["frame"])


def test_a_frame_is_reused_only_once_the_deletion_of_its_page_is_stored(tmp_path) -> None:
    """Rows are written before the WriteBatch that points a page at them: a batch that never lands (a crash
    between the two) must leave every stored page with the rows it was written with."""
    with GraphStore(tmp_path / "s") as store:
        table = PageLog(store)
        ids = np.asarray([1, 2], dtype=np.int64)
        _set(table, ids, [1, 1], [0.0, 0.0], ["full", "full"])
        _commit(store, table.encode(ids, np.ones((2, 4), dtype=np.float32)))
        table.committed()
        assert _frame(store, 0) == 0
        _set(table, ids, [2, 2], [1.0, 1.0], ["full", "full"])
        lost = table.encode(ids, np.full((2, 4), 2.0, dtype=np.float32))  # deletes page 0: never written
        assert ("embpages", keys.encode_iid(0), None) in lost
        _set(table, ids, [3, 3], [2.0, 2.0], ["full", "full"])
        table.encode(ids, np.full((2, 4), 3.0, dtype=np.float32))  # nor this one
        # what a restart finds: the stored page and its frame untouched
        again = PageLog(store)
        rows, present = again.rows(ids, 4)
        assert present.all() and (rows == 1.0).all()
        assert again.get(ids)[0].tolist() == [1, 1]
        # the reloaded table frees the frames nothing stored points at, and keeps frame 0 until page 0 goes
        _set(again, ids, [2, 2], [1.0, 1.0], ["full", "full"])
        puts = again.encode(ids, np.full((2, 4), 5.0, dtype=np.float32))
        _commit(store, puts)
        assert _frame(store, 1) == 1  # frame 0 still belonged to page 0 when this was written
        again.committed()
        _set(again, ids, [3, 3], [2.0, 2.0], ["full", "full"])
        _commit(store, again.encode(ids, np.full((2, 4), 6.0, dtype=np.float32)))
        assert _frame(store, 2) == 0  # page 0's deletion is stored: its frame is reused
        rows, _ = PageLog(store).rows(ids, 4)
        assert (rows == 6.0).all()


def test_logs_of_several_layers_share_a_family_without_seeing_each_other(tmp_path) -> None:
    def logs(store: GraphStore) -> list[PageLog]:
        return [PageLog(store), *(PageLog(store, family="layerpages", prefix=bytes((layer,)),
                                              rows_name=f"layer{layer}-rows") for layer in (1, 2))]

    with GraphStore(tmp_path / "s") as store:
        final, one, two = logs(store)
        _set(final, [1], [3], [2.0], ["full"])
        _commit(store, final.encode(np.asarray([1]), np.full((1, 4), 9.0, dtype=np.float32))
                    + one.put_rows(np.asarray([1, 2]), np.asarray([[1.0] * 4, [2.0] * 4], dtype=np.float32))
                    + two.put_rows(np.asarray([2, 3]), np.full((2, 2), 5.0, dtype=np.float32)))
        _commit(store, one.put_rows(np.asarray([2]), None))  # withdrawn from layer 1 only
        assert sorted(p.name for p in (tmp_path / "s").glob("*-rows-*.f32")) == [
            "final-rows-4.f32", "layer1-rows-4.f32", "layer2-rows-2.f32"]
        final, one, two = logs(store)
        rows, present = one.rows(np.asarray([1, 2, 3]), 4)
        assert present.tolist() == [True, False, False] and rows[0].tolist() == [1.0] * 4
        rows, present = two.rows(np.asarray([1, 2, 3]), 2)
        assert present.tolist() == [False, True, True] and (rows[1:] == 5.0).all()
        assert [(i, m.version, r.tolist()) for i, m, r in final.items()] == [(1, 3, [9.0] * 4)]
        assert (one.live(), two.live(), final.live()) == (2, 2, 1)


def test_frames_that_lost_their_rows_are_reported_by_the_check(tmp_path) -> None:
    """An operating-system crash can leave a frame with zeros or another page's rows while RocksDB kept the
    record pointing at it: the record's sum of the rows tells."""
    dim = 4
    with GraphStore(tmp_path / "s") as store:
        table = PageLog(store)
        ids = np.arange(3 * PAGE_ROWS, dtype=np.int64)
        rows = np.random.default_rng(2).standard_normal((len(ids), dim)).astype(np.float32)
        _set(table, ids, np.ones(len(ids)), np.zeros(len(ids)), ["full"] * len(ids))
        _commit(store, table.encode(ids, rows))
        table.committed()
        assert PageLog(store).damaged().tolist() == []
        path = tmp_path / "s" / f"final-rows-{dim}.f32"
        frame_bytes = PAGE_ROWS * dim * 4
        data = bytearray(path.read_bytes())
        first, second = _frame(store, 0), _frame(store, 1)
        data[first * frame_bytes:(first + 1) * frame_bytes] = bytes(frame_bytes)  # zeros
        data[second * frame_bytes:(second + 1) * frame_bytes] = rows[2 * PAGE_ROWS:].tobytes()  # another page's rows
        path.write_bytes(bytes(data))
        assert PageLog(store).damaged().tolist() == ids[:2 * PAGE_ROWS].tolist()
        path.unlink()
        assert PageLog(store).damaged().tolist() == ids.tolist()


def test_projections_are_kept_beside_the_cache_and_redone_only_for_rows_that_changed(tmp_path) -> None:
    with GraphStore(tmp_path / "s") as store:
        tables = EmbeddingTables(store, [3, 4], {1: PageLog(store, family="layerpages", prefix=b"\x01")})
        seen: list[list[float]] = []

        def project(rows: np.ndarray, iids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            seen.append(rows[:, 0].tolist())
            return rows[:, :2] * 2, rows[:, 2:] + 1

        def both(iids: list[int]) -> tuple[np.ndarray, np.ndarray]:
            table, pos, half = tables.projected(1, np.asarray(iids), project)
            return table[pos], table[half + pos]

        rows = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)
        tables.set(1, np.arange(6), rows)
        first, second = both([4, 1, 4])
        assert sorted(seen.pop()) == [4.0, 16.0]  # rows 1 and 4, each once
        np.testing.assert_array_equal(first, rows[[4, 1, 4], :2] * 2)
        np.testing.assert_array_equal(second, rows[[4, 1, 4], 2:] + 1)
        both([1, 4])
        assert seen == []  # nothing changed: nothing projected again
        tables.set(1, np.asarray([4]), np.full((1, 4), -1.0, dtype=np.float32))
        first, second = both([1, 4, 5])
        assert sorted(seen.pop()) == [-1.0, 20.0]  # the changed row and the new one
        assert first[1].tolist() == [-2.0, -2.0] and second[1].tolist() == [0.0, 0.0]
        tables.invalidate(1, [1])
        both([1])
        assert seen.pop() == [0.0]  # read again (the log holds nothing: zeros), projected again
        tables.clear()
        tables.set(1, np.asarray([2]), rows[2:3])
        both([2])
        assert seen.pop() == [8.0]


def test_cached_rows_set_from_rows_of_the_cache_itself_move_as_whole_rows(tmp_path) -> None:
    """Setting rows from a view of the cache (rows shifted by one) gives what numpy assignment gives."""
    with GraphStore(tmp_path / "s") as store:
        tables = EmbeddingTables(store, [3, 2], {1: PageLog(store, family="layerpages", prefix=b"\x01")})
        tables.set(1, np.arange(4), np.repeat(np.arange(4, dtype=np.float32)[:, None], 2, axis=1))
        held = tables.cached(1, np.arange(4))[0]
        view = tables.index(1, np.arange(4))[0][1:3]  # rows 1 and 2 of the cache, not a copy
        tables.set(1, np.asarray([2, 3]), view)
        expected = held.copy()
        expected[[2, 3]] = held[1:3]
        rows, present = tables.cached(1, np.arange(4))
        assert present.all() and rows.tolist() == expected.tolist() == [[0, 0], [1, 1], [1, 1], [2, 2]]


def test_a_frame_read_for_one_row_leaves_its_other_current_rows_cached(tmp_path) -> None:
    """Rows of the frame that are current and not held yet join the cache; a superseded record's row and a
    held (newer) row do not."""
    with GraphStore(tmp_path / "s") as store:
        log = PageLog(store, family="layerpages", prefix=b"\x01")
        _commit(store, log.put_rows(np.arange(6), np.repeat(np.arange(6, dtype=np.float32)[:, None], 2, axis=1)))
        _commit(store, log.put_rows(np.asarray([3]), np.full((1, 2), 30, dtype=np.float32)))
        tables = EmbeddingTables(store, [3, 2], {1: PageLog(store, family="layerpages", prefix=b"\x01",
                                                            frame_ids=True)})
        tables.set(1, np.asarray([4]), np.full((1, 2), 40, dtype=np.float32))
        assert tables.get(1, np.asarray([1]))[0].tolist() == [[1.0, 1.0]]
        rows, held = tables.cached(1, np.arange(6))
        assert held.tolist() == [True, True, True, False, True, True]
        assert rows[:, 0].tolist() == [0.0, 1.0, 2.0, 0.0, 40.0, 5.0]
        assert tables.get(1, np.asarray([3]))[0].tolist() == [[30.0, 30.0]]


def test_projections_of_rows_beyond_the_bound_are_computed_each_time(tmp_path) -> None:
    with GraphStore(tmp_path / "s") as store:
        tables = EmbeddingTables(store, [3, 2], {1: PageLog(store, family="layerpages", prefix=b"\x01")}, max_rows=4)
        calls = []

        def project(rows: np.ndarray, iids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            calls.append(len(rows))
            return rows, rows

        tables.set(1, np.asarray([1]), np.ones((1, 2), dtype=np.float32))
        table, pos, half = tables.projected(1, np.asarray([1, 9]), project)  # 9 is beyond the bound: the cache is dropped
        assert calls == [2] and half == 2 and table[pos].tolist() == [[0.0, 0.0], [0.0, 0.0]]  # read from the log: none stored


def test_frames_hold_what_was_written_whether_fresh_or_rewritten_through_the_mapping(tmp_path) -> None:
    file = RowFile(str(tmp_path / "rows-3.f32"), 3)
    file.start([])
    rng = np.random.default_rng(0)
    first = rng.standard_normal((2 * PAGE_ROWS + 5, 3)).astype(np.float32)
    assert file.write(first) == [0, 1, 2]  # fresh frames: written with pwrite
    for frame in (0, 2):
        file.release(frame)
    file.committed()
    second = rng.standard_normal((PAGE_ROWS + 7, 3)).astype(np.float32)
    assert file.write(second) == [0, 2]  # frame 0 again (now through the mapping), then frame 2
    third = rng.standard_normal((PAGE_ROWS, 3)).astype(np.float32)
    assert file.write(third) == [3]
    file.close()
    with RowReaders() as readers:
        np.testing.assert_array_equal(file.read(0, PAGE_ROWS, readers), second[:PAGE_ROWS])
        np.testing.assert_array_equal(file.read(1, PAGE_ROWS, readers), first[PAGE_ROWS:2 * PAGE_ROWS])
        np.testing.assert_array_equal(file.read(2, 7, readers), second[PAGE_ROWS:])
        np.testing.assert_array_equal(file.read(3, PAGE_ROWS, readers), third)


def test_fresh_frames_apart_in_the_file_are_written_each_at_its_own_place(tmp_path) -> None:
    file = RowFile(str(tmp_path / "rows-2.f32"), 2)
    file.start([1])  # frame 1 is taken by a stored page: 0 is free, new frames start at 2
    rows = np.arange((3 * PAGE_ROWS - 4) * 2, dtype=np.float32).reshape(-1, 2)
    assert file.write(rows) == [0, 2, 3]  # the free frame 0, then new frames 2 and 3
    file.close()
    with RowReaders() as readers:
        np.testing.assert_array_equal(file.read(0, PAGE_ROWS, readers), rows[:PAGE_ROWS])
        np.testing.assert_array_equal(file.read(2, PAGE_ROWS, readers), rows[PAGE_ROWS:2 * PAGE_ROWS])
        np.testing.assert_array_equal(file.read(3, PAGE_ROWS - 4, readers), rows[2 * PAGE_ROWS:])
        assert not file.read(1, PAGE_ROWS, readers).any()  # untouched


def test_a_failed_row_write_fails_the_encode(tmp_path, monkeypatch) -> None:
    with GraphStore(str(tmp_path / "db")) as store:
        table = PageLog(store)
        ids = np.arange(PAGE_ROWS + 1, dtype=np.int64)
        table.set(ids, np.ones(len(ids), dtype=np.int64), np.zeros(len(ids)),
                  np.full(len(ids), table.code("full"), dtype=np.int16))
        assert len(table.encode(ids[:1], np.ones((1, 4), dtype=np.float32))) == 1  # one page

        monkeypatch.setattr(row_file.os, "pwrite", lambda fd, data, offset: 0)  # a full disk
        with pytest.raises(OSError, match="short write to row file"):
            table.encode(ids, np.ones((len(ids), 4), dtype=np.float32))


def test_a_row_file_closed_while_a_failed_write_holds_its_mapping_keeps_the_error(tmp_path, monkeypatch) -> None:
    file = RowFile(str(tmp_path / "rows-2.f32"), 2)
    file.start([])
    rows = np.arange(2 * PAGE_ROWS, dtype=np.float32).reshape(-1, 2)
    assert file.write(rows) == [0]  # the file is mapped
    monkeypatch.setattr(row_file.os, "pwrite", lambda fd, data, offset: 0)  # a full disk
    with pytest.raises(OSError, match="short write to row file"):
        try:
            file.write(rows + 1)  # a fresh frame: its traceback holds the write's view of the mapping
        except OSError:
            file.close()  # as a failed recompute's clean-up does, while the error is being handled
            raise
    monkeypatch.undo()
    assert file.write(rows + 2) == [2]  # mapped again; the failed write's frame 1 stays taken
    file.close()
    with RowReaders() as readers:
        np.testing.assert_array_equal(file.read(0, PAGE_ROWS, readers), rows)
        np.testing.assert_array_equal(file.read(2, PAGE_ROWS, readers), rows + 2)


@pytest.mark.parametrize("framed", [True, False])
def test_encoded_pages_decode_to_their_records_full_pages_and_the_rest(framed: bool) -> None:
    n = 2 * PAGE_ROWS + 37
    rng = np.random.default_rng(3)
    iids = rng.permutation(10 * n)[:n].astype(np.int64)
    version = rng.integers(0, 2**40, n)
    event_ts = rng.random(n) * 1e9
    names = ["full", "cold_start", "deleted"]
    codes = rng.integers(0, 2, n).astype(np.int16)  # "deleted" unused: pages list only the modes they use
    frames, sums = ([7, 2, 11], [0, 2**64 - 1, 12345]) if framed else (None, None)
    pages, values = encode_pages(iids, version, event_ts, codes, names, 16 if framed else 0, frames, sums)
    assert [len(p) for p in pages] == [PAGE_ROWS, PAGE_ROWS, 37]
    for n_page, (ids, value) in enumerate(zip(pages, values)):
        at = slice(n_page * PAGE_ROWS, n_page * PAGE_ROWS + len(ids))
        rec, modes, has_rows = decode_page(value)
        assert has_rows == framed and modes == ["full", "cold_start"]
        assert rec["iid"].tolist() == ids.tolist() == iids[at].tolist()
        assert rec["version"].tolist() == version[at].tolist()
        assert rec["event_ts"].tolist() == event_ts[at].tolist()
        assert [modes[m] for m in rec["mode"].tolist()] == [names[c] for c in codes[at].tolist()]
        if framed:
            assert (int(rec["width"]), int(rec["frame"]), int(rec["sum"])) == (16, frames[n_page], sums[n_page])


def test_the_row_file_mapping_grows_geometrically(tmp_path, monkeypatch) -> None:
    file = RowFile(str(tmp_path / "rows-2.f32"), 2)
    file.start([])
    sizes = []
    rows = np.ones((PAGE_ROWS, 2), dtype=np.float32)
    for n in range(100):  # one new frame a write: the file is grown and mapped again by a quarter at a time
        assert file.write(rows * n) == [n]
        if not sizes or sizes[-1] != len(file._frames):
            sizes.append(len(file._frames))
    assert sizes == [16, 20, 25, 31, 38, 47, 58, 72, 90, 112]
    assert os.path.getsize(file.path) == 112 * PAGE_ROWS * 2 * 4
    # frames written before the file grew are rewritten through the new mapping, without pwrite
    for frame in (3, 50):
        file.release(frame)
    file.committed()
    monkeypatch.setattr(row_file.os, "pwrite", lambda fd, data, offset: 0)  # would fail the write
    assert file.write(np.full((2 * PAGE_ROWS, 2), -1.0, dtype=np.float32)) == [3, 50]
    monkeypatch.undo()
    file.close()
    with RowReaders() as readers:
        got = [float(file.read(n, 1, readers)[0, 0]) for n in (0, 3, 15, 16, 50, 63, 99)]
        assert got == [0.0, -1.0, 15.0, 16.0, -1.0, 63.0, 99.0]


def test_the_state_layer_needs_no_torch() -> None:
    code = ("import importlib, pkgutil, sys, gnnstream.graph_state as g\n"
            "names = [m.name for m in pkgutil.iter_modules(g.__path__)]\n"
            "for name in names: importlib.import_module('gnnstream.graph_state.' + name)\n"
            "print(len(names), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) > 10 and out[1] == "False"  # every module of the package imported, torch not among them
