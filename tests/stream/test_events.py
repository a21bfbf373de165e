"""Event schema: valid events, every rejection reason, and fuzzing."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gnnstream.stream.events import (
    INVALID_EVENT_REASONS,
    MAX_EVENT_BYTES,
    EdgeDelete,
    EdgeUpsert,
    InvalidEvent,
    NodeDelete,
    NodeUpsert,
    decode_event,
    decode_event_json,
    encode_event,
    event_key,
)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"op":"edge_upsert","src":"a1","dst":"b2","ts":1700000000,"weight":3.5}',
         EdgeUpsert("a1", "b2", 1700000000.0, 3.5)),
        ('{"op":"edge_upsert","src":"a1","dst":"b2","ts":1.5}', EdgeUpsert("a1", "b2", 1.5, 1.0)),
        ('{"op":"edge_delete","src":"a1","dst":"b2","ts":1700000100}', EdgeDelete("a1", "b2", 1700000100.0)),
        ('{"op":"node_upsert","id":"a1","ts":0,"features":[0.1,2,-3]}', NodeUpsert("a1", 0.0, (0.1, 2.0, -3.0))),
        ('{"op":"node_delete","id":"a1","ts":1700000200}', NodeDelete("a1", 1700000200.0)),
        ('{"op":"edge_upsert","src":12,"dst":-7,"ts":3}', EdgeUpsert("12", "-7", 3.0, 1.0)),
        (' {"ts":5,"id":"x","op":"node_delete"}\n', NodeDelete("x", 5.0)),
    ],
)
def test_valid_events_decode(line: str, expected: object) -> None:
    assert decode_event_json(line) == expected
    assert decode_event_json(line.encode()) == expected


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (None, "empty"),
        (b"", "empty"),
        (b"   \n", "empty"),
        (b"\xff\xfe{}", "not_utf8"),
        (b'{"op":"node_delete",', "not_json"),
        (b'{"op":"node_delete","id":"a","ts":1} trailing', "not_json"),
        (b"[" * 100_000, "not_json"),
        (b'["op","node_delete"]', "not_object"),
        (b'"node_delete"', "not_object"),
        (b'{"op":"node_delete","id":"a","id":"b","ts":1}', "duplicate_field"),
        (b'{"id":"a","ts":1}', "missing_field"),
        (b'{"op":"edge_upsert","src":"a","ts":1}', "missing_field"),
        (b'{"op":"edge_merge","src":"a","dst":"b","ts":1}', "unknown_op"),
        (b'{"op":7,"id":"a","ts":1}', "unknown_op"),
        (b'{"op":"node_delete","id":"a","ts":1,"extra":0}', "unknown_field"),
        (b'{"op":"edge_delete","src":"a","dst":"b","ts":1,"weight":2}', "unknown_field"),
        (b'{"op":"node_delete","id":"","ts":1}', "empty_id"),
        (b'{"op":"node_delete","id":true,"ts":1}', "bad_id"),
        (b'{"op":"node_delete","id":1.5,"ts":1}', "bad_id"),
        (b'{"op":"node_delete","id":null,"ts":1}', "bad_id"),
        ('{"op":"node_delete","id":"%s","ts":1}' % ("x" * 257), "bad_id"),
        (b'{"op":"node_delete","id":1' + b"0" * 300 + b',"ts":1}', "bad_id"),
        (b'{"op":"node_delete","id":"\\ud800","ts":1}', "bad_id"),
        (b'{"op":"node_delete","id":"a","ts":true}', "bad_type"),
        (b'{"op":"node_delete","id":"a","ts":"1"}', "bad_type"),
        (b'{"op":"edge_upsert","src":"a","dst":"b","ts":1,"weight":false}', "bad_type"),
        (b'{"op":"node_upsert","id":"a","ts":1,"features":{"0":1}}', "bad_type"),
        (b'{"op":"node_upsert","id":"a","ts":1,"features":[1,true]}', "bad_type"),
        (b'{"op":"node_delete","id":"a","ts":NaN}', "not_finite"),
        (b'{"op":"edge_upsert","src":"a","dst":"b","ts":1,"weight":-Infinity}', "not_finite"),
        (b'{"op":"node_delete","id":"a","ts":1e400}', "not_finite"),
        (b'{"op":"node_delete","id":"a","ts":1' + b"0" * 400 + b"}", "not_finite"),
        (b'{"op":"node_delete","id":"a","ts":-1}', "bad_ts"),
        (b'{"op":"node_upsert","id":"a","ts":1,"features":[]}', "bad_features"),
        (b'{"op":"node_delete","id":"a","ts":1,"pad":"' + b"x" * MAX_EVENT_BYTES + b'"}', "oversize"),
    ],
)
def test_invalid_events_have_stable_reasons(data: bytes | str | None, reason: str) -> None:
    with pytest.raises(InvalidEvent) as info:
        decode_event_json(data)
    assert info.value.reason == reason
    assert reason in INVALID_EVENT_REASONS
    assert len(info.value.detail) <= 300


def test_size_limit_is_configurable() -> None:
    line = b'{"op":"node_delete","id":"a","ts":1}'
    assert decode_event_json(line, max_bytes=len(line)) == NodeDelete("a", 1.0)
    with pytest.raises(InvalidEvent) as info:
        decode_event_json(line, max_bytes=len(line) - 1)
    assert info.value.reason == "oversize"
    with pytest.raises(InvalidEvent) as info:
        decode_event_json("é" * 20, max_bytes=30)  # 40 bytes in UTF-8
    assert info.value.reason == "oversize"


def test_decode_event_rejects_odd_python_values() -> None:
    with pytest.raises(InvalidEvent) as info:
        decode_event({"op": "node_delete", "id": "a", "ts": 1, 5: "x"})
    assert info.value.reason == "unknown_field"
    with pytest.raises(InvalidEvent) as info:
        decode_event({"op": "node_delete", "id": 10**5000, "ts": 1})
    assert info.value.reason == "bad_id"


def test_encode_round_trip_and_keys() -> None:
    events = [EdgeUpsert("a", "b", 1700000000.0, 2.5), EdgeDelete("a", "b", 1.25),
              NodeUpsert("n", 3.0, (0.5, -1.0)), NodeDelete("n", 4.0)]
    for event in events:
        assert decode_event_json(encode_event(event)) == event
    assert encode_event(events[0]) == b'{"op":"edge_upsert","src":"a","dst":"b","ts":1700000000,"weight":2.5}'
    assert [event_key(e) for e in events] == [b"a", b"a", b"n", b"n"]


def _check_decode(data: bytes | str) -> None:
    try:
        event = decode_event_json(data)
    except InvalidEvent as exc:
        assert exc.reason in INVALID_EVENT_REASONS
    else:
        assert decode_event_json(encode_event(event)) == event


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20,
)
ops = st.sampled_from(["edge_upsert", "edge_delete", "node_upsert", "node_delete", "nope"])
field_values = st.one_of(st.text(max_size=8), st.integers(), st.floats(), st.booleans(), st.none(),
                         st.lists(st.floats() | st.integers() | st.booleans(), max_size=4))
near_events = st.builds(
    lambda op, fields: {"op": op, **fields},
    ops,
    st.dictionaries(st.sampled_from(["src", "dst", "id", "ts", "weight", "features", "x"]), field_values),
)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(data: bytes) -> None:
    _check_decode(data)


@settings(max_examples=250, deadline=None)
@given(json_values)
def test_fuzz_random_json_values(value: object) -> None:
    _check_decode(json.dumps(value))


@settings(max_examples=400, deadline=None)
@given(near_events)
def test_fuzz_near_valid_events(obj: dict) -> None:
    _check_decode(json.dumps(obj))
    try:
        decode_event(obj)
    except InvalidEvent as exc:
        assert exc.reason in INVALID_EVENT_REASONS


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=100))
def test_fuzz_random_text(text: str) -> None:
    _check_decode(text)


_TYPED_PAY = ('{"op":"edge_upsert","src_type":"account","src":"a1","rel":"pays","dst_type":"merchant","dst":"m9",'
              '"ts":5,"features":[1.5,-2,0.25,1],"txn_id":"t7"}')


def test_typed_fields_are_taken_only_for_a_typed_graph():
    with pytest.raises(InvalidEvent) as info:
        decode_event_json(_TYPED_PAY)
    assert info.value.reason == "unknown_field"
    ev = decode_event_json(_TYPED_PAY, typed=True)
    assert ev == EdgeUpsert("a1", "m9", 5.0, 1.0, src_type="account", rel="pays", dst_type="merchant",
                            features=(1.5, -2.0, 0.25, 1.0), txn_id="t7")
    assert decode_event_json(encode_event(ev), typed=True) == ev
    node = decode_event_json('{"op":"node_upsert","type":"device","id":"d1","ts":3,"features":[1]}', typed=True)
    assert node == NodeUpsert("d1", 3.0, (1.0,), type="device")
    assert decode_event_json(encode_event(node), typed=True) == node
    # an omitted type is node, an omitted relation edge: an untyped event decodes the same either way
    line = '{"op":"edge_delete","src":"a","dst":"b","ts":1}'
    assert decode_event_json(line, typed=True) == decode_event_json(line) == EdgeDelete("a", "b", 1.0, "node", "edge",
                                                                                       "node")
    assert encode_event(decode_event_json(line, typed=True)) == b'{"op":"edge_delete","src":"a","dst":"b","ts":1}'
    with pytest.raises(InvalidEvent) as info:
        decode_event_json('{"op":"node_delete","type":"","id":"d1","ts":3}', typed=True)
    assert info.value.reason == "bad_type"


def test_check_schema_refuses_what_the_schema_does_not_take():
    from gnnstream.stream.events import check_schema

    node_types = {"account": 2, "merchant": 1}
    relations = {("account", "pays", "merchant"): 4}
    check_schema(decode_event_json(_TYPED_PAY, typed=True), node_types, relations)  # passes
    cases = [
        (_TYPED_PAY.replace('"pays"', '"owns"'), "unknown_type", "relation 'account__owns__merchant'"),
        (_TYPED_PAY.replace(',1],', '],'), "wrong_feature_length", "has 3 features, the schema gives 4"),
        (_TYPED_PAY.replace(',1],', ',1e300],'), "not_finite", "is beyond ±1e+15"),
        ('{"op":"node_upsert","type":"device","id":"d","ts":1,"features":[1]}', "unknown_type", "node type 'device'"),
        ('{"op":"node_upsert","type":"account","id":"a","ts":1,"features":[1]}', "wrong_feature_length",
         "the schema gives 'account' 2"),
        ('{"op":"edge_upsert","src":"a","dst":"b","ts":1}', "unknown_type", "relation 'node__edge__node'"),
    ]
    for line, reason, detail in cases:
        with pytest.raises(InvalidEvent) as info:
            check_schema(decode_event_json(line, typed=True), node_types, relations)
        assert info.value.reason == reason and detail in info.value.detail, (line, info.value)


@pytest.mark.parametrize("text, reason", [
    ('{"op":"node_delete","id":"a","ts":%s}' % ("1" * 5000), "not_finite"),
    ('{"op":"node_delete","id":%s,"ts":1}' % ("1" * 5000), "bad_id"),
    ('{"op":"node_upsert","id":"a","ts":1,"features":[%s]}' % ("-" + "9" * 5000), "not_finite"),
])
def test_integers_past_any_float_are_refused_by_what_they_stand_for(text: str, reason: str) -> None:
    with pytest.raises(InvalidEvent) as info:
        decode_event_json(text)
    assert info.value.reason == reason and ("longer than 256 digits" in str(info.value)) == (reason == "bad_id")
