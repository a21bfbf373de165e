"""The packed output format: frame layout, round trips, splitting, the delivery's frames and the scorer."""

from __future__ import annotations

import dataclasses
import pickle
import struct

import numpy as np
import pytest

from gnnstream.fraud.scorer import FraudScorer
from gnnstream.model.head import ScoreHead
from gnnstream.stream.clients import Record
from gnnstream.stream.delivery import NodePartitions, UpdateColumns, encode_frames
from gnnstream.stream.exceptions import InvalidUpdate
from gnnstream.stream.partitioning import partition_for, partitions_for
from gnnstream.stream.updates import (PACKED_MAGIC, EmbeddingUpdate, decode_packed, decode_packed_columns,
                                      decode_update, encode_packed, encode_update, largest_update_bytes,
                                      packed_frame_overhead, packed_row_bytes)


def _rows(n: int, dim: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, dim)).astype(np.float32)


def test_hand_built_frame_pins_the_layout() -> None:
    rows = np.array([[1.5, -2.0], [0.0, 0.0]], dtype=np.float32)
    got = encode_packed(["ab", "é"], "m:1", [7, 2**64 - 1], [100.0, 200.5], [1.25, 3.0], ["full", "full"], rows,
                        [False, True])
    want = (bytes([0xE2, 1]) + struct.pack(">IIHB", 2, 2, 3, 1) + b"m:1" + bytes([4]) + b"full"
            + struct.pack(">HH", 2, 2) + struct.pack(">QQ", 7, 2**64 - 1) + struct.pack(">dd", 100.0, 200.5)
            + struct.pack(">dd", 1.25, 3.0) + bytes([0, 1]) + bytes([0, 0]) + b"ab" + "é".encode()
            + bytes(-(13 + 3 + 5 + 2 * 28 + 4) % 4) + struct.pack("<4f", 1.5, -2.0, 0.0, 0.0))
    assert got == [want]
    assert (13 + 3 + 5 + 2 * 28 + 4 + 3) % 4 == 0  # three pad bytes: the rows start at a multiple of 4
    assert decode_packed(want) == [EmbeddingUpdate("ab", "m:1", 7, (1.5, -2.0), 100.0, 1.25, "full"),
                                   EmbeddingUpdate("é", "m:1", 2**64 - 1, (0.0, 0.0), 200.5, 3.0, "full",
                                                   deleted=True)]


def test_round_trip_many_rows_with_tombstones_unicode_ids_and_big_versions() -> None:
    n, dim = 3000, 16
    rng = np.random.default_rng(3)
    ids = [f"ноде-{i}-✓" if i % 3 == 0 else f"n{i}" for i in range(n)]
    versions = [(i << 32) + 5 if i % 2 else 2**64 - 1 - i for i in range(n)]
    deleted = rng.random(n) < 0.1
    rows = _rows(n, dim)
    rows[deleted] = 0
    modes = ["full", "cold_start", "feature_only"]
    mode_of = [modes[i % 3] for i in range(n)]
    times = rng.uniform(0, 2e9, n)
    computed = rng.uniform(0, 2e9, n)
    (frame,) = encode_packed(ids, "otc-sage:12", versions, times, computed, mode_of, rows, deleted)
    c = decode_packed_columns(frame)
    assert c.model == "otc-sage:12" and c.ids == ids and c.modes == mode_of
    assert c.versions.tolist() == versions
    assert c.event_ts.tolist() == times.tolist() and c.computed_at.tolist() == computed.tolist()
    assert c.deleted.tolist() == deleted.tolist()
    np.testing.assert_array_equal(c.rows, rows)
    assert c.rows.base is not None and not c.rows.flags.writeable  # a view of the frame's bytes
    updates = decode_packed(frame)
    assert [(u.id, u.version, u.deleted, u.mode) for u in updates] == list(zip(ids, versions, deleted.tolist(),
                                                                              mode_of))
    assert updates[5] == EmbeddingUpdate(ids[5], "otc-sage:12", versions[5], rows[5], times[5], computed[5],
                                         mode_of[5], bool(deleted[5]))


def test_frames_split_at_the_byte_bound_and_keep_the_order() -> None:
    n, dim = 500, 8
    ids = [f"node-{i}" * (1 + i % 4) for i in range(n)]
    rows = _rows(n, dim, 1)
    limit = 4096
    frames = encode_packed(ids, "m:1", list(range(n)), [1.0] * n, 2.0, ["full"] * n, rows, max_bytes=limit)
    assert len(frames) > 1
    assert all(len(f) <= limit for f in frames)
    sizes = np.asarray([packed_row_bytes(len(i.encode()), dim) for i in ids])
    room = limit - packed_frame_overhead("m:1", ["full"])
    start = 0
    for f in frames:  # each frame is as full as the bound allows: the next row would not have fitted
        count = len(decode_packed_columns(f))
        assert sizes[start:start + count].sum() <= room
        if start + count < n:
            assert sizes[start:start + count + 1].sum() > room
        start += count
    got = [u for f in frames for u in decode_packed(f)]
    assert [u.id for u in got] == ids and [u.version for u in got] == list(range(n))
    np.testing.assert_array_equal(np.stack([u.embedding for u in got]), rows)
    with pytest.raises(ValueError, match="fit in 100 bytes"):
        encode_packed(ids, "m:1", list(range(n)), [1.0] * n, 2.0, ["full"] * n, rows, max_bytes=100)


def test_largest_update_bytes_bounds_a_one_row_frame() -> None:
    from gnnstream.stream.events import MAX_ID_BYTES
    (frame,) = encode_packed(["x" * MAX_ID_BYTES], "m:1", [2**64 - 1], [1.0], 2.0, ["y" * 32], _rows(1, 64))
    assert len(frame) + len(b"65535") <= largest_update_bytes(64, "m:1", "packed")
    assert largest_update_bytes(64, "m:1", "packed") < largest_update_bytes(64, "m:1", "binary") + 64


def test_other_formats_decode_as_before_and_tell_packed_apart() -> None:
    u = EmbeddingUpdate("a1", "m:1", 7, (0.25, -1.5), 1700000000.0, 1700000001.25, "full")
    for fmt in ("json", "binary"):
        assert decode_update(encode_update(u, fmt)) == u
        with pytest.raises(InvalidUpdate) as info:
            decode_packed(encode_update(u, fmt))
        assert info.value.reason == "bad_magic"
    (frame,) = encode_packed(["a1"], "m:1", [7], [1.0], 2.0, ["full"], np.ones((1, 2)))
    assert frame[0] == PACKED_MAGIC
    with pytest.raises(InvalidUpdate) as info:
        decode_update(frame)
    assert info.value.reason == "packed"
    bad = bytes([PACKED_MAGIC, 2]) + frame[2:]
    with pytest.raises(InvalidUpdate) as info:
        decode_packed(bad)
    assert info.value.reason == "bad_version"
    with pytest.raises(InvalidUpdate) as info:
        decode_packed(frame[:-1])
    assert info.value.reason == "truncated"


def test_encode_frames_puts_each_row_in_its_partition() -> None:
    n, dim, partitions = 400, 4, 5
    names = [f"u{i}" for i in range(n)]
    deleted = np.zeros(n, dtype=bool)
    deleted[::17] = True
    rows = _rows(n, dim, 2)
    rows[deleted] = 0
    half = n // 2
    columns = [UpdateColumns(names[:half], np.arange(half), np.full(half, 1.0), 10.0, ["full"] * half, rows[:half],
                             deleted[:half]),
               UpdateColumns(names[half:], np.arange(half, n), np.full(n - half, 2.0), 20.0, ["cold_start"] * (n - half),
                             rows[half:], deleted[half:])]
    frames = encode_frames(columns, "m:1", partitions_for(names, partitions), 2000)
    seen = []
    for p, key, value in frames:
        assert key == str(p).encode() and len(value) + len(key) <= 2000
        for u in decode_packed(value):
            assert partition_for(u.id.encode(), partitions) == p
            seen.append(u)
    assert sorted(u.id for u in seen) == sorted(names)
    by_id = {u.id: u for u in seen}
    for i, name in enumerate(names):
        u = by_id[name]
        assert (u.version, u.deleted, u.computed_at, u.mode) == (i, bool(deleted[i]), 10.0 if i < half else 20.0,
                                                                 "full" if i < half else "cold_start")
        np.testing.assert_array_equal(u.embedding, rows[i])
    order = [u.id for u in seen if partition_for(u.id.encode(), partitions) == 3]
    assert order == [x for x in names if partition_for(x.encode(), partitions) == 3]  # rows keep their order
    rows[[7, 250], 1] = [np.inf, np.nan]  # refused whole, naming the nodes (checked in partition order)
    with pytest.raises(ValueError, match="non-finite values for nodes") as info:
        encode_frames(columns, "m:1", partitions_for(names, partitions), 2000)
    assert sorted(str(info.value).split("[")[1].rstrip("])").replace("'", "").split(", ")) == ["u250", "u7"]


def test_scorer_scores_packed_rows_in_order_and_passes_tombstones_on() -> None:
    head = ScoreHead((0.5, -1.0, 0.25), 0.1, "m:1")
    scorer = FraudScorer("unused:9092", head, in_topic="emb")
    rows = _rows(4, 3, 4)
    rows[1] = 0
    (frame,) = encode_packed(["a", "b", "c", "d"], "m:1", [1, 2, 3, 4], [5.0, 6.0, 7.0, 8.0], 9.0, ["full"] * 4,
                             rows, [False, True, False, False])
    sent: list = []
    records = [Record("emb", 0, 10, b"0", frame, 0)]
    scorer._score_poll(records, lambda topic, key, value: sent.append((topic, key, value)))
    assert [(k, v is None) for _, k, v in sent] == [(b"a", False), (b"b", True), (b"c", False), (b"d", False)]
    import json
    scores = {json.loads(v)["id"]: json.loads(v)["score"] for _, _, v in sent if v is not None}
    want = head.score(rows[[0, 2, 3]])
    assert scores == pytest.approx({"a": want[0], "c": want[1], "d": want[2]}, abs=1e-6)
    assert (scorer.scored, scorer.deleted, scorer.invalid) == (3, 1, 0)
    scorer._score_poll([Record("emb", 0, 11, b"0", frame[:-2], 0)], lambda *a: sent.append(a))
    assert scorer.invalid == 1


def test_node_partitions_are_remembered_by_interned_id() -> None:
    n = 300
    names = [f"u{i}" for i in range(n)]
    cols = UpdateColumns(names, np.arange(n), np.zeros(n), 1.0, ["full"] * n, np.zeros((n, 2), dtype=np.float32),
                         np.zeros(n, dtype=bool), np.arange(n) * 7)
    expected = partitions_for(names, 5).tolist()
    lens = [len(x) for x in names]
    nodes = NodePartitions(5)
    assert [a.tolist() for a in nodes.of([cols])] == [expected, lens]
    # known now: looked up by interned id, the names are not read again
    assert [a.tolist() for a in nodes.of([dataclasses.replace(cols, names=["renamed"] * n)])] == [expected, lens]
    halves = [dataclasses.replace(cols, names=names[:100], iids=cols.iids[:100]),
              dataclasses.replace(cols, names=names[100:], iids=None)]  # without ids: by name
    parts, unknown = nodes.of(halves)
    assert parts.tolist() == expected and unknown is None
    assert [a.tolist() for a in NodePartitions(1).of([cols])] == [[0] * n, lens]
    assert [a.tolist() for a in NodePartitions(2).of([dataclasses.replace(cols, names=["é✓"] * n)])][1] == [5] * n
    # the remembered lengths make the same frames as lengths found from the names
    parts, lens = nodes.of([cols])
    assert encode_frames([cols], "m:1", parts, 1000, lens) == encode_frames([cols], "m:1", parts, 1000)
    with pytest.raises(ValueError, match="remembered id lengths"):
        encode_frames([dataclasses.replace(cols, names=["renamed"] * n)], "m:1", parts, 1000, lens)
    # the ids cross to the delivery process with the columns (the worker's mode codes do not)
    crossed = pickle.loads(pickle.dumps(dataclasses.replace(cols, mode_codes=np.zeros(n, dtype=np.int16)), protocol=5))
    assert crossed.iids.tolist() == cols.iids.tolist() and crossed.mode_codes is None
