"""Embedding-update codec: JSON and binary round trips, layout, tombstones."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gnnstream.stream.exceptions import InvalidUpdate
from gnnstream.stream.updates import (
    BINARY_MAGIC,
    VERSION_HEADER,
    EmbeddingUpdate,
    decode_binary_columns,
    decode_update,
    encode_update,
    encode_updates,
    is_tombstone,
    tombstone,
    update_key,
)


def make(embedding=(0.25, -1.5, 3.0), **kw) -> EmbeddingUpdate:
    fields = dict(id="a1", model="sage:3", version=7, embedding=embedding, event_ts=1700000000.0,
                  computed_at=1700000001.25, mode="full")
    fields.update(kw)
    return EmbeddingUpdate(**fields)


def test_json_is_exactly_the_documented_shape() -> None:
    data = encode_update(make())
    assert data == (b'{"id":"a1","model":"sage:3","version":7,"embedding":[0.25,-1.5,3.0],'
                    b'"event_ts":1700000000,"computed_at":1700000001.25,"mode":"full"}')
    assert list(json.loads(data)) == ["id", "model", "version", "embedding", "event_ts", "computed_at", "mode"]


def test_json_round_trip_from_float32_array_is_exact() -> None:
    values = np.array([0.1, -2.5, 1e-8, 3.4e38], dtype=np.float32)
    update = make(embedding=values, mode="cold_start", event_ts=12.5)
    data = encode_update(update)
    # float32 rows go out as the shortest decimal that reads back to the same float32
    assert b'"embedding":[0.1,-2.5,1e-8,3.4e+38]' in data
    back = decode_update(data)
    assert isinstance(back.embedding, tuple)
    assert np.array_equal(np.asarray(back.embedding, dtype=np.float32), values)
    assert (back.mode, back.event_ts, back.version) == ("cold_start", 12.5, 7)


@pytest.mark.parametrize("fmt", ["json", "binary"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_batch_encoding_equals_one_at_a_time(fmt: str, dtype: type) -> None:
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((5, 7)).astype(dtype)
    ids, versions = ["a", "b", "ß", "d", "e"], [1, 2, 3, 2**40, 0]
    times, modes = [1.0, 2.5, 1700000000.0, 3.0, 0.0], ["full", "cold_start", "full", "feature_only", "full"]
    batch = encode_updates(ids, "m:1", versions, times, 99.5, modes, rows, fmt)
    single = [encode_update(EmbeddingUpdate(i, "m:1", v, r, t, 99.5, m), fmt)
              for i, v, r, t, m in zip(ids, versions, rows, times, modes)]
    assert batch == single
    back = [decode_update(b) for b in batch]
    assert [u.id for u in back] == ids and [u.version for u in back] == versions
    assert [u.mode for u in back] == modes and [u.event_ts for u in back] == times
    expected = rows.astype(np.float32) if fmt == "binary" else rows
    assert np.array_equal(np.array([np.asarray(u.embedding, dtype=rows.dtype) for u in back]),
                          expected.astype(rows.dtype))


def test_batch_encoding_refuses_non_finite_rows_and_mismatched_lengths() -> None:
    rows = np.ones((2, 3), dtype=np.float32)
    rows[1, 2] = np.nan
    with pytest.raises(ValueError, match="non-finite values for nodes \\['b'\\]"):
        encode_updates(["a", "b"], "m:1", [1, 1], [0.0, 0.0], 1.0, ["full", "full"], rows)
    with pytest.raises(ValueError, match="Expected 2 versions"):
        encode_updates(["a", "b"], "m:1", [1], [0.0, 0.0], 1.0, ["full", "full"], np.ones((2, 3)))
    with pytest.raises(ValueError, match="fmt"):
        encode_updates(["a"], "m:1", [1], [0.0], 1.0, ["full"], np.ones((1, 3)), "xml")


def test_binary_round_trip_and_layout() -> None:
    update = make(embedding=np.array([1.0, -0.5], dtype=np.float32), id="n\u00e9", version=2**40)
    data = encode_update(update, fmt="binary")
    assert data[0] == BINARY_MAGIC == 0xE1
    assert struct.unpack(">Q", data[1:9]) == (2**40,)
    assert struct.unpack(">dd", data[9:25]) == (1700000000.0, 1700000001.25)
    assert struct.unpack(">IHHB", data[25:34]) == (2, 3, 6, 4)
    assert data[34:47] == "n\u00e9".encode() + b"sage:3" + b"full"
    assert data[47:] == struct.pack("<2f", 1.0, -0.5)
    assert len(data) == 34 + 3 + 6 + 4 + 4 * 2
    back = decode_update(data)
    assert back == update
    assert back.embedding.dtype == np.float32 and not back.embedding.flags.writeable


def test_binary_rounds_float64_to_float32() -> None:
    back = decode_update(encode_update(make(embedding=[0.1, 1 / 3]), fmt="binary"))
    assert np.allclose(back.embedding, [0.1, 1 / 3], atol=1e-7)
    assert back.embedding.tolist() == np.array([0.1, 1 / 3], dtype=np.float32).tolist()


def test_empty_embedding_round_trips() -> None:
    update = make(embedding=())
    assert decode_update(encode_update(update)) == update
    assert decode_update(encode_update(update, fmt="binary")) == update


def test_tombstone_helper() -> None:
    key, value, headers = tombstone("a1", version=8)
    assert (key, value, headers) == (b"a1", None, [(VERSION_HEADER, b"8")])
    assert tombstone("x") == (b"x", None, [])
    assert is_tombstone(value) and not is_tombstone(b"{}")
    assert update_key("n\u00e9") == "n\u00e9".encode()
    with pytest.raises(InvalidUpdate) as info:
        decode_update(None)  # type: ignore[arg-type]
    assert info.value.reason == "tombstone"


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "empty"),
        (b"\xe1\x00\x01", "truncated"),
        (encode_update(make(), fmt="binary")[:-1], "truncated"),
        (encode_update(make(), fmt="binary") + b"\x00", "truncated"),
        (b"not json", "not_json"),
        (b"[1,2]", "not_object"),
        (b'{"id":"a"}', "missing_field"),
        (encode_update(make()).replace(b"[0.25,", b"[true,"), "bad_type"),
        (encode_update(make()).replace(b'"version":7', b'"version":-1'), "bad_field"),
        (encode_update(make()).replace(b'"id":"a1"', b'"id":""'), "bad_field"),
    ],
)
def test_decode_errors(data: bytes, reason: str) -> None:
    with pytest.raises(InvalidUpdate) as info:
        decode_update(data)
    assert info.value.reason == reason


def test_binary_columns_equal_one_at_a_time_and_refuse_what_decode_update_refuses() -> None:
    rng = np.random.default_rng(3)
    updates = [make(id=f"n\u00e9{i}", model=f"m:{i % 2}", version=i, embedding=rng.normal(size=5).astype(np.float32),
                    event_ts=1000.0 + i, mode="full" if i % 3 else "cold_start") for i in range(20)]
    values = [encode_update(u, fmt="binary") for u in updates]
    ids, models, versions, times, rows = decode_binary_columns(values)
    one = [decode_update(v) for v in values]
    assert (ids, models, versions, times) == ([u.id for u in one], [u.model for u in one], [u.version for u in one],
                                              [u.event_ts for u in one])
    assert rows.dtype == np.float32 and rows.shape == (20, 5)
    np.testing.assert_array_equal(rows, np.stack([u.embedding for u in one]))
    for wrap in (bytearray, memoryview):
        wrapped = decode_binary_columns([wrap(v) for v in values])
        assert wrapped[:4] == (ids, models, versions, times)
        np.testing.assert_array_equal(wrapped[4], rows)
    assert decode_binary_columns([])[0] == []
    good = values[0]
    header = struct.Struct(">BQddIHHB")
    empty_id = header.pack(BINARY_MAGIC, 1, 0.0, 0.0, 5, 0, 3, 4) + b"m:1full" + bytes(20)
    bad_utf8 = header.pack(BINARY_MAGIC, 1, 0.0, 0.0, 5, 2, 3, 4) + b"\xff\xfe" + b"m:1full" + bytes(20)
    for bad, reason in ((good[:-1], "truncated"), (good[:10], "truncated"), (good + b"\x00", "truncated"),
                        (encode_update(make(embedding=[1.0]), fmt="binary"), "bad_field"),
                        (encode_update(make()), "bad_field"), (empty_id, "bad_field"), (bad_utf8, "not_utf8")):
        with pytest.raises(InvalidUpdate) as info:
            decode_binary_columns([values[1], bad])
        assert info.value.reason == reason, bad


def test_constructor_and_encoder_checks() -> None:
    with pytest.raises(ValueError, match="version"):
        make(version=True)
    with pytest.raises(ValueError, match="1-D"):
        make(embedding=np.zeros((2, 2)))
    with pytest.raises(ValueError, match="mode"):
        make(mode="")
    with pytest.raises(ValueError, match="finite"):
        encode_update(make(embedding=[float("nan")]))
    with pytest.raises(ValueError, match="finite"):
        encode_update(make(embedding=[float("inf")]), fmt="binary")
    with pytest.raises(ValueError, match="fmt"):
        encode_update(make(), fmt="xml")  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None)
@given(
    node_id=st.text(min_size=1, max_size=30),
    version=st.integers(0, 2**64 - 1),
    values=st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), max_size=16),
    event_ts=st.floats(0, 4e9),
)
def test_round_trip_property(node_id: str, version: int, values: list[float], event_ts: float) -> None:
    try:
        node_id.encode("utf-8")
    except UnicodeEncodeError:
        return
    update = make(id=node_id, version=version, embedding=values, event_ts=event_ts)
    assert decode_update(encode_update(update)) == update
    assert decode_update(encode_update(update, fmt="binary")) == update
