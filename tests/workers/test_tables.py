"""Value layouts of the engine's tables: final rows with their metadata, and outbox records."""

from __future__ import annotations

import numpy as np

from graph_state import keys
from graph_state.store import GraphStore
from workers.tables import EmbeddingMeta, MetaTable, decode_final, decode_outbox, encode_outbox


def test_meta_table_writes_what_embedding_meta_encodes(tmp_path) -> None:
    with GraphStore(tmp_path / "s") as store:
        table = MetaTable(store)
        iids = np.asarray([3, 0, 7, 12], dtype=np.int64)
        modes = ["full", "cold_start", "full", "feature_only"]
        table.set(iids, np.asarray([5, 1, 2, 9]), np.asarray([10.5, 0.0, 3.25, 7.0]),
                  np.asarray([table.code(m) for m in modes], dtype=np.int16))
        rows = np.arange(4 * 3, dtype=np.float32).reshape(4, 3) - 4.5
        store.write(table.encode(iids, rows))
        for i, iid in enumerate(iids.tolist()):
            raw = store.column("embmeta").get(keys.encode_iid(iid))
            want = EmbeddingMeta(int(table.version[iid]), float(table.event_ts[iid]), modes[i])
            assert raw == want.encode(rows[i])
            meta, row = decode_final(raw)
            assert meta == want
            np.testing.assert_array_equal(row, rows[i])
        # withdrawn: the metadata stays, the row goes
        table.set(iids[:1], np.asarray([6]), np.asarray([11.0]), np.asarray([table.code("deleted")], dtype=np.int16))
        store.write(table.encode(iids[:1], None))
        meta, row = decode_final(store.column("embmeta").get(keys.encode_iid(3)))
        assert meta == EmbeddingMeta(6, 11.0, "deleted") and row is None
        # a fresh table reads the stored values back
        again = MetaTable(store)
        version, event_ts, mode = again.get(np.asarray([3, 0, 99], dtype=np.int64))
        assert version.tolist() == [6, 1, 0]
        assert event_ts.tolist() == [11.0, 0.0, 0.0]
        assert [again.names[c] if c >= 0 else None for c in mode.tolist()] == ["deleted", "cold_start", None]


def test_outbox_record_round_trip() -> None:
    iids = np.asarray([2**40 + 1, 0, 17], dtype=np.int64)
    computed_at, back = decode_outbox(encode_outbox(iids, 1234.5))
    assert computed_at == 1234.5
    np.testing.assert_array_equal(back, iids)
    assert decode_outbox(encode_outbox(np.zeros(0, dtype=np.int64), 1.0))[1].tolist() == []
